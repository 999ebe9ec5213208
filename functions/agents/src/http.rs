//! The HTTP plumbing shared by the five app clients: auth headers marked sensitive, timeouts, bounded bodies,
//! percent-encoded paths, retries and status-to-error mapping.
//!
//! Retries live here only, so every app gets the same rules. A call is repeated after a 5xx, a timeout or a lost
//! connection only when repeating it is harmless: the method is idempotent (GET, HEAD, PUT, DELETE, OPTIONS) or the
//! calling code made it so (`*_idempotent`: a dedupe key the app enforces, absolute values, a pinned sha). Any other
//! call that may have reached the app fails with [`AgentError::Uncertain`] instead of risking a second effect. A
//! connection that could not be opened, and a 429 (the app did not process the request), are retried for every
//! method.

use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Request, RequestBuilder, Url};
use serde::de::DeserializeOwned;

use crate::AgentError;

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest app answer we read; file contents and diffs for a patch are far smaller.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
const ERROR_EXCERPT_CHARS: usize = 300;

/// How an app client retries; set with each client's or agent's `with_retry`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per call, the first included; 1 turns retries off.
    pub max_attempts: u32,
    /// Backoff before the second attempt, doubled for each further one up to `max_backoff`; each wait is between
    /// half and all of that (jitter, so clients that failed together do not retry together).
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Longest `Retry-After` honoured; an app asking for more fails the call with [`AgentError::RateLimited`].
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
            // Plane's limit is 60 requests a minute: a full window is the longest wait worth making.
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The backoff before attempt `failed + 1`, jittered.
    fn backoff(&self, failed: u32) -> Duration {
        let doubled = self
            .initial_backoff
            .saturating_mul(2u32.saturating_pow(failed.saturating_sub(1)));
        let step = doubled.min(self.max_backoff);
        let half = step / 2;
        let jitter_nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let random = std::hash::RandomState::new().build_hasher().finish();
        half + Duration::from_nanos(random % jitter_nanos.saturating_add(1))
    }
}

/// Whether a call may be sent again after a failure that leaves its effect unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Repeat {
    /// Decided by the HTTP method.
    ByMethod,
    /// The calling code made a repeat harmless.
    Idempotent,
}

pub(crate) struct AppHttp {
    app: &'static str,
    client: reqwest::Client,
    base: Url,
    /// Values scrubbed from error excerpts (apps sometimes echo credentials back).
    secrets: Vec<String>,
    retry: RetryPolicy,
}

/// A complete answer whatever its status; callers decide which statuses they tolerate.
pub(crate) struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// `METHOD /path` of the call, for error messages (no query: it may carry caller data).
    call: String,
    attempts: u32,
}

/// Why one attempt got no complete answer.
enum Failure {
    Transport {
        /// The connection could not be opened, so nothing was sent.
        unsent: bool,
        timeout: bool,
        message: String,
    },
    /// The answer came but is over [`MAX_RESPONSE_BYTES`]; a repeat would be as big.
    TooLarge,
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
            retry: RetryPolicy::default(),
        })
    }

    pub fn set_retry(&mut self, retry: RetryPolicy) -> Result<(), AgentError> {
        if retry.max_attempts == 0 {
            return Err(AgentError::Config(format!(
                "{}: retry.max_attempts must be at least 1",
                self.app
            )));
        }
        self.retry = retry;
        Ok(())
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

    /// Sends (with retries, see the module docs) and reads the whole body (bounded). Transport problems, 429s
    /// past the retries and unknown outcomes are errors here; any other status is the caller's to judge.
    pub async fn send(&self, rb: RequestBuilder) -> Result<Reply, AgentError> {
        self.exchange(rb, Repeat::ByMethod).await
    }

    /// Like [`Self::send`] for a call the caller made safe to repeat whatever its method (a POST the app dedupes
    /// by a key, a PATCH to absolute values).
    pub async fn send_idempotent(&self, rb: RequestBuilder) -> Result<Reply, AgentError> {
        self.exchange(rb, Repeat::Idempotent).await
    }

    /// Sends, requires a 2xx, and decodes the JSON body.
    pub async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T, AgentError> {
        let reply = self.send(rb).await?;
        self.decode(&self.ok(reply)?.body)
    }

    /// [`Self::json`] for a call made safe to repeat, as in [`Self::send_idempotent`].
    pub async fn json_idempotent<T: DeserializeOwned>(
        &self,
        rb: RequestBuilder,
    ) -> Result<T, AgentError> {
        let reply = self.send_idempotent(rb).await?;
        self.decode(&self.ok(reply)?.body)
    }

    async fn exchange(&self, rb: RequestBuilder, repeat: Repeat) -> Result<Reply, AgentError> {
        let request = rb
            .build()
            .map_err(|e| self.bad(format!("cannot build request: {}", e.without_url())))?;
        let call = format!("{} {}", request.method(), request.url().path());
        let repeatable = repeat == Repeat::Idempotent
            || matches!(
                *request.method(),
                Method::GET | Method::HEAD | Method::PUT | Method::DELETE | Method::OPTIONS
            );
        let mut attempt = 1;
        loop {
            // Bodies here are JSON or forms (bytes), which always clone.
            let this = request
                .try_clone()
                .ok_or_else(|| self.bad(format!("{call}: request body cannot be resent")))?;
            let outcome = self.once(this).await;
            let last = attempt >= self.retry.max_attempts;
            let wait = match outcome {
                Ok((status, headers, body)) => {
                    let reply = Reply {
                        status,
                        headers,
                        body,
                        call: call.clone(),
                        attempts: attempt,
                    };
                    if status == 429 {
                        let asked = retry_after(&reply.headers, SystemTime::now());
                        if last || asked.is_some_and(|d| d > self.retry.max_retry_after) {
                            return Err(AgentError::RateLimited {
                                app: self.app,
                                call,
                                attempts: attempt,
                                retry_after: asked,
                            });
                        }
                        asked.unwrap_or_else(|| self.retry.backoff(attempt))
                    } else if status >= 500 && repeatable && !last {
                        self.retry.backoff(attempt)
                    } else {
                        return Ok(reply);
                    }
                }
                Err(Failure::TooLarge) => {
                    return Err(self.bad(format!(
                        "{call}: response larger than {MAX_RESPONSE_BYTES} bytes"
                    )));
                }
                Err(Failure::Transport {
                    unsent: false,
                    timeout,
                    message,
                }) if !repeatable => {
                    let what = if timeout { "timed out" } else { "broke off" };
                    return Err(AgentError::Uncertain {
                        app: self.app,
                        call,
                        message: format!("{what} after the request was sent: {message}"),
                    });
                }
                Err(Failure::Transport {
                    timeout, message, ..
                }) if last => {
                    let kind = if timeout {
                        "timeout"
                    } else {
                        "connection failed"
                    };
                    return Err(AgentError::Transport {
                        app: self.app,
                        call,
                        message: format!("{kind} after {attempt} attempt(s): {message}"),
                    });
                }
                Err(Failure::Transport { .. }) => self.retry.backoff(attempt),
            };
            tracing::warn!(app = self.app, call = %call, attempt, wait_ms = wait.as_millis() as u64, "retrying app call");
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// One attempt: the status, headers and whole (bounded) body.
    async fn once(&self, request: Request) -> Result<(u16, HeaderMap, Vec<u8>), Failure> {
        let mut resp = self.client.execute(request).await.map_err(failure)?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_RESPONSE_BYTES as u64)
        {
            return Err(Failure::TooLarge);
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(failure)? {
            if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                return Err(Failure::TooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        Ok((status, headers, body))
    }

    /// Turns a non-2xx reply into [`AgentError::Status`].
    pub fn ok(&self, reply: Reply) -> Result<Reply, AgentError> {
        if (200..300).contains(&reply.status) {
            Ok(reply)
        } else {
            Err(self.status_error(&reply))
        }
    }

    /// The app's error for `reply`: its status, the call, how often it was tried and the app's own message.
    pub fn status_error(&self, reply: &Reply) -> AgentError {
        let mut message = app_message(&reply.body);
        for s in &self.secrets {
            message = message.replace(s.as_str(), "<redacted>");
        }
        AgentError::Status {
            app: self.app,
            call: reply.call.clone(),
            status: reply.status,
            attempts: reply.attempts,
            message,
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
}

fn failure(e: reqwest::Error) -> Failure {
    Failure::Transport {
        unsent: e.is_connect(),
        timeout: e.is_timeout(),
        // without_url: query strings may carry caller data; the call names the endpoint.
        message: error_chain(&e.without_url()),
    }
}

/// The error and its causes ("error sending request: connection closed before message completed").
fn error_chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `Retry-After` as a wait from `now`: delay-seconds or an HTTP date (a past date means now).
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get("retry-after")?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at_ms = crate::time::parse_http_date_ms(value)?;
    let now_ms = now.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_millis() as i64;
    Some(Duration::from_millis(
        u64::try_from(at_ms - now_ms).unwrap_or(0),
    ))
}

/// The app's own error text: the usual message field of a JSON error body (Zulip `msg`, Forgejo and OpenPanel
/// `message`, GlitchTip and DRF `detail`, Plane `error`), else the start of the body.
fn app_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let field = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            ["msg", "message", "detail", "error"]
                .iter()
                .find_map(|k| v.get(k)?.as_str().map(str::to_string))
        });
    let message = field.unwrap_or_else(|| text.trim().to_string());
    message.chars().take(ERROR_EXCERPT_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            ..RetryPolicy::default()
        };
        for (failed, step) in [(1, 100), (2, 200), (3, 350), (9, 350), (u32::MAX, 350)] {
            let step = Duration::from_millis(step);
            let waits: Vec<Duration> = (0..50).map(|_| p.backoff(failed)).collect();
            assert!(
                waits.iter().all(|w| *w >= step / 2 && *w <= step),
                "{failed}: {waits:?}"
            );
            assert!(waits.iter().any(|w| *w != waits[0]), "jittered: {waits:?}");
        }
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_770);
        let wait = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("retry-after", HeaderValue::from_str(v).unwrap());
            retry_after(&h, now)
        };
        assert_eq!(wait("30"), Some(Duration::from_secs(30)));
        assert_eq!(wait(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            wait("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::from_secs(7))
        );
        // A date already past means now.
        assert_eq!(wait("Sun, 06 Nov 1994 08:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(wait("-1"), None);
        assert_eq!(wait("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn app_messages_come_from_the_usual_fields() {
        assert_eq!(
            app_message(br#"{"result":"error","msg":"Stream 'x' does not exist","code":"BAD"}"#),
            "Stream 'x' does not exist"
        );
        assert_eq!(
            app_message(br#"{"message":"The branch already exists.","url":"u"}"#),
            "The branch already exists."
        );
        assert_eq!(app_message(br#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(
            app_message(br#"{"error":"Issue with the same external id","id":"1"}"#),
            "Issue with the same external id"
        );
        assert_eq!(
            app_message(b"  <h1>Bad Gateway</h1>\n"),
            "<h1>Bad Gateway</h1>"
        );
        assert_eq!(app_message(&[b'x'; 1000]).len(), ERROR_EXCERPT_CHARS);
        // A non-string field is not a message; the body is shown instead.
        assert_eq!(
            app_message(br#"{"detail":[{"loc":"q"}]}"#),
            r#"{"detail":[{"loc":"q"}]}"#
        );
    }
}
