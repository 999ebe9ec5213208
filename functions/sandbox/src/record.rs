//! Optional log of every request an app answered, with its answer, for contract tests: they replay the log
//! against the apps' official API descriptions to check what the clients sent and what the fakes returned.
//! Off unless `SandboxConfig::record_requests` is set; served at `GET /_sandbox/requests`.

use crate::{MAX_BODY_BYTES, Shared};
use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Oldest exchanges are dropped past this many, so a long-running recording sandbox stays bounded.
const MAX_EXCHANGES: usize = 1000;
/// Largest answer body kept; the fakes' answers are far smaller, a bigger one is answered with 500.
const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// One request to a fake app and the answer it got. Bodies are text (lossy UTF-8): every API here is JSON,
/// form-encoded or plain text.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Exchange {
    /// `zulip`, `plane`, `forgejo`, `glitchtip` or `openpanel`.
    pub app: String,
    pub method: String,
    /// The path as sent (still percent-encoded), without the query.
    pub path: String,
    /// The raw query string, empty when there was none.
    pub query: String,
    pub request_content_type: String,
    pub request_body: String,
    pub status: u16,
    pub response_content_type: String,
    pub response_body: String,
}

#[derive(Default)]
pub(crate) struct Log {
    exchanges: Mutex<VecDeque<Exchange>>,
}

impl Log {
    fn push(&self, e: Exchange) {
        let mut q = self
            .exchanges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.len() == MAX_EXCHANGES {
            q.pop_front();
        }
        q.push_back(e);
    }

    pub fn snapshot(&self) -> Vec<Exchange> {
        self.exchanges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }
}

fn content_type(h: &HeaderMap) -> String {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Middleware for one app's routes: buffers the request and the answer (both are size-limited) and logs them.
pub(crate) async fn record(
    State((shared, app)): State<(Arc<Shared>, &'static str)>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
        // The same answer the body-limit layer gives when recording is off.
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let mut exchange = Exchange {
        app: app.to_string(),
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or_default().to_string(),
        request_content_type: content_type(&parts.headers),
        request_body: text(&bytes),
        status: 0,
        response_content_type: String::new(),
        response_body: String::new(),
    };
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_RESPONSE_BYTES).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    exchange.status = parts.status.as_u16();
    exchange.response_content_type = content_type(&parts.headers);
    exchange.response_body = text(&bytes);
    shared.requests.push(exchange);
    Response::from_parts(parts, Body::from(bytes))
}
