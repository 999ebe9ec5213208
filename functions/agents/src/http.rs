//! The HTTP plumbing shared by the five app clients: auth headers marked sensitive, timeouts, bounded bodies,
//! percent-encoded paths and status-to-error mapping.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, RequestBuilder, Url};
use serde::de::DeserializeOwned;

use crate::AgentError;

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest app answer we read; file contents and diffs for a patch are far smaller.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
const ERROR_EXCERPT_CHARS: usize = 300;

pub(crate) struct AppHttp {
    app: &'static str,
    client: reqwest::Client,
    base: Url,
    /// Values scrubbed from error excerpts (apps sometimes echo credentials back).
    secrets: Vec<String>,
}

/// A complete answer whatever its status; callers decide which statuses they tolerate.
pub(crate) struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl AppHttp {
    pub fn new(
        app: &'static str,
        base_url: &str,
        auth: Vec<(&'static str, String)>,
        timeout: Duration,
        secrets: Vec<String>,
    ) -> Result<Self, AgentError> {
        let base = Url::parse(base_url.trim_end_matches('/')).map_err(|e| {
            AgentError::Config(format!("{app}: invalid base_url `{base_url}`: {e}"))
        })?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(AgentError::Config(format!(
                "{app}: base_url must be an http(s) URL, got `{base_url}`"
            )));
        }
        if timeout.is_zero() {
            return Err(AgentError::Config(format!(
                "{app}: timeout must be positive"
            )));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in auth {
            if value.is_empty() {
                return Err(AgentError::Config(format!(
                    "{app}: credential for `{name}` is empty"
                )));
            }
            let mut v = HeaderValue::from_str(&value).map_err(|_| {
                AgentError::Config(format!(
                    "{app}: credential for `{name}` is not a valid header value"
                ))
            })?;
            // Keeps credentials out of reqwest/hyper debug output.
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static(name), v);
        }
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| AgentError::Config(format!("{app}: cannot build HTTP client: {e}")))?;
        Ok(Self {
            app,
            client,
            base,
            secrets: secrets.into_iter().filter(|s| !s.is_empty()).collect(),
        })
    }

    pub fn base(&self) -> &Url {
        &self.base
    }

    /// The base URL plus `segments`, each percent-encoded as one path segment (so `a/b` in a segment stays data).
    /// An empty last segment yields the trailing slash Plane and GlitchTip require.
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    pub fn request(&self, method: Method, url: Url) -> RequestBuilder {
        self.client.request(method, url)
    }

    /// Sends and reads the whole body (bounded). Only transport problems are errors here.
    pub async fn send(&self, rb: RequestBuilder) -> Result<Reply, AgentError> {
        let mut resp = rb.send().await.map_err(|e| self.transport(e))?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_RESPONSE_BYTES as u64)
        {
            return Err(self.too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.transport(e))? {
            if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                return Err(self.too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    /// Sends, requires a 2xx, and decodes the JSON body.
    pub async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T, AgentError> {
        let reply = self.send(rb).await?;
        let reply = self.ok(reply)?;
        self.decode(&reply.body)
    }

    /// Turns a non-2xx reply into [`AgentError::Status`].
    pub fn ok(&self, reply: Reply) -> Result<Reply, AgentError> {
        if (200..300).contains(&reply.status) {
            Ok(reply)
        } else {
            Err(self.status_error(&reply))
        }
    }

    pub fn status_error(&self, reply: &Reply) -> AgentError {
        let text = String::from_utf8_lossy(&reply.body);
        let mut body: String = text.chars().take(ERROR_EXCERPT_CHARS).collect();
        for s in &self.secrets {
            body = body.replace(s.as_str(), "<redacted>");
        }
        AgentError::Status {
            app: self.app,
            status: reply.status,
            body,
        }
    }

    pub fn decode<T: DeserializeOwned>(&self, body: &[u8]) -> Result<T, AgentError> {
        serde_json::from_slice(body).map_err(|e| self.bad(format!("unexpected JSON: {e}")))
    }

    pub fn bad(&self, message: impl Into<String>) -> AgentError {
        AgentError::BadResponse {
            app: self.app,
            message: message.into(),
        }
    }

    fn transport(&self, e: reqwest::Error) -> AgentError {
        // without_url: query strings may carry caller data; the app name says enough.
        let kind = if e.is_timeout() {
            "timeout"
        } else if e.is_connect() {
            "connect"
        } else {
            "request"
        };
        AgentError::Transport {
            app: self.app,
            message: format!("{kind}: {}", e.without_url()),
        }
    }

    fn too_large(&self) -> AgentError {
        self.bad(format!("response larger than {MAX_RESPONSE_BYTES} bytes"))
    }
}
