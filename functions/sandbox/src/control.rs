//! Test-only control endpoints under `/_sandbox/`, served by every app, without auth. The apps listen on loopback
//! only, but a web page the developer opens could still reach them through DNS rebinding (its own host name
//! pointed at 127.0.0.1); such a request carries that foreign name in `Host`, so only loopback names are served.

use crate::fault::{ArmedFault, Fault};
use crate::glitchtip::ProducingMode;
use crate::{Shared, State, util};
use axum::extract::{Request, State as AxState};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What `/_sandbox/state` answers: effect counters grouped by app, so tests can check that nothing happened twice.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    pub zulip: ZulipCounts,
    pub plane: PlaneCounts,
    pub forgejo: ForgejoCounts,
    pub glitchtip: GlitchtipCounts,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ZulipCounts {
    pub messages: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PlaneCounts {
    pub issues: u64,
    pub comments: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ForgejoCounts {
    pub branches: u64,
    /// Pull requests ever opened, whatever their state now.
    pub prs: u64,
    pub open_prs: u64,
    pub merges: u64,
    pub commits: u64,
    pub statuses: u64,
    pub labels: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GlitchtipCounts {
    pub events: u64,
    /// Whether the seeded issue is receiving events right now.
    pub producing: bool,
}

pub(crate) fn counts(st: &State, now: i64) -> Counts {
    let n = |x: usize| x as u64;
    let f = &st.forgejo;
    Counts {
        zulip: ZulipCounts {
            messages: n(st.zulip.messages.len()),
        },
        plane: PlaneCounts {
            issues: n(st.plane.issues.len()),
            comments: n(st.plane.comments.len()),
        },
        forgejo: ForgejoCounts {
            branches: n(f.repo.branches.len()),
            prs: n(f.pulls.len()),
            open_prs: n(f.pulls.iter().filter(|p| p.is_open()).count()),
            merges: f.merges,
            commits: n(f.repo.commits.len()),
            statuses: n(f.statuses.len()),
            labels: n(f.labels.len()),
        },
        glitchtip: GlitchtipCounts {
            events: st.glitchtip.event_count(now),
            producing: st.glitchtip.producing(),
        },
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/_sandbox/state", get(state))
        .route("/_sandbox/glitchtip/producing", post(producing))
        .route("/_sandbox/requests", get(requests))
        .route(
            "/_sandbox/faults",
            get(list_faults).post(add_fault).delete(clear_faults),
        )
        .route_layer(axum::middleware::from_fn(loopback_host_only))
}

/// Refuses a control request whose `Host` is not a loopback name (see the module docs).
async fn loopback_host_only(req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if is_loopback_host(host) {
        next.run(req).await
    } else {
        (
            StatusCode::FORBIDDEN,
            Json(serde_json::json!({
                "error": "the sandbox control endpoints answer only to Host 127.0.0.1 or localhost"
            })),
        )
            .into_response()
    }
}

/// `127.0.0.1`, `localhost` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    name.eq_ignore_ascii_case("localhost") || name == "127.0.0.1" || name == "[::1]"
}

async fn list_faults(AxState(shared): AxState<Arc<Shared>>) -> Json<Vec<ArmedFault>> {
    Json(shared.faults.snapshot())
}

async fn add_fault(
    AxState(shared): AxState<Arc<Shared>>,
    body: Result<Json<Fault>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let added = match body {
        Ok(Json(fault)) => shared.faults.add(fault),
        Err(e) => Err(e.body_text()),
    };
    match added {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => bad_request(e),
    }
}

async fn clear_faults(AxState(shared): AxState<Arc<Shared>>) -> StatusCode {
    shared.faults.clear();
    StatusCode::NO_CONTENT
}

fn bad_request(message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({"error": message})),
    )
        .into_response()
}

async fn requests(AxState(shared): AxState<Arc<Shared>>) -> Response {
    if !shared.config.record_requests {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "request recording is off (config record_requests)"})),
        )
            .into_response();
    }
    Json(shared.requests.snapshot()).into_response()
}

async fn state(AxState(shared): AxState<Arc<Shared>>) -> Json<Counts> {
    Json(counts(&shared.lock(), util::now_ms()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProducingBody {
    mode: ProducingMode,
}

async fn producing(
    AxState(shared): AxState<Arc<Shared>>,
    body: Result<Json<ProducingBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return bad_request(e.body_text()),
    };
    let mut st = shared.lock();
    st.glitchtip.mode = body.mode;
    st.reconcile_production(&shared.config, util::now_ms());
    if let Err(e) = shared.persist(&st) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response();
    }
    Json(serde_json::json!({"mode": body.mode, "producing": st.glitchtip.producing()}))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::is_loopback_host;

    #[test]
    fn only_loopback_hosts_pass() {
        for ok in [
            "127.0.0.1",
            "127.0.0.1:8080",
            "localhost",
            "LocalHost:1",
            "[::1]",
            "[::1]:9",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example",
            "evil.example:80",
            "127.0.0.1.evil.example",
            "localhost.evil.example:80",
            "127.0.0.2",
            "[::2]:80",
            "127.0.0.1:80:80",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }
}
