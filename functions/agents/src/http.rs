//! The HTTP plumbing shared by the five app clients: auth headers marked sensitive, timeouts, bounded bodies,
//! percent-encoded paths, retries and status-to-error mapping.
//!
//! Retries live here only, so every app gets the same rules. A call is repeated after a 5xx, a timeout or a lost
//! connection only when repeating it is harmless: the method is idempotent (GET, HEAD, PUT, DELETE, OPTIONS) or the
//! calling code made it so (`*_idempotent`: a key the app enforces atomically, absolute values, a pinned sha; a key
//! the app only checks before saving is not enough, see [`create_or_find`]). Any other call that may have reached
//! the app (timeout, lost connection, or a 5xx, which a proxy in front of the app may answer while the app goes on)
//! fails with [`AgentError::Uncertain`] instead of risking a second effect. A
//! connection that could not be opened, and a 429 (the app did not process the request), are retried for every
//! method. All attempts and waits of a call fit in [`RetryPolicy::max_elapsed`].

use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Request, RequestBuilder, Url};
use serde::de::DeserializeOwned;

use crate::AgentError;

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest app answer we read; file contents and diffs for a patch are far smaller.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
const ERROR_EXCERPT_CHARS: usize = 300;
/// Least time left for a further attempt to be started (less if the per-attempt timeout is shorter); a healthy app
/// answers well within it.
const MIN_ATTEMPT: Duration = Duration::from_secs(1);

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
    /// Longest a call may take, every attempt and wait included: an attempt gets at most the time left, and a wait
    /// that would not leave time for another attempt ends the call. Keeps a call well inside the A2A skill
    /// timeout, past which the skill is cut off with its effects unknown.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
            // Plane's limit is 60 requests a minute: a full window is the longest wait worth making.
            max_retry_after: Duration::from_secs(60),
            // A third of the skill timeout (240 s), so a skill's lookup after a lost answer fits too.
            max_elapsed: Duration::from_secs(90),
        }
    }
}

impl RetryPolicy {
    /// The backoff before attempt `failed + 1`, jittered.
    fn backoff(&self, failed: u32) -> Duration {
        let doubled = self
            .initial_backoff
            .saturating_mul(2u32.saturating_pow(failed.saturating_sub(1)));
        loams_platform::backoff::jittered(doubled.min(self.max_backoff))
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
    /// The process-wide client (see [`shared_client`]).
    client: reqwest::Client,
    /// This app's credentials, added to each request; marked sensitive.
    auth: HeaderMap,
    base: Url,
    /// Values scrubbed from error texts (apps sometimes echo credentials back), longest first so a secret that
    /// contains another is replaced whole.
    secrets: Vec<String>,
    /// Per attempt; an attempt near the call's deadline gets less.
    timeout: Duration,
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

/// Longest wait for a connection to open; an attempt with less time left is cut off sooner by its own timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One client for every app client in the process. Building a client loads and parses the system's root
/// certificates, which each of the five apps would otherwise do again at start-up; one client also pools
/// connections across them. Per-app settings travel with each request instead: the credentials (see
/// [`AppHttp::request`]) and the per-attempt timeout (set in the retry loop).
fn shared_client() -> Result<reqwest::Client, String> {
    static CLIENT: LazyLock<Result<reqwest::Client, String>> = LazyLock::new(|| {
        reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .map_err(|e| e.to_string())
    });
    CLIENT.clone()
}

/// Builds the client every app client shares, ahead of the first of them: for a process with a moment to spare at
/// start (an agent function while its app's secret is on its way), so the root certificates are parsed then.
pub fn warm_up_http_client() {
    // A failure is reported where the client is needed: by the first app client built.
    let _ = shared_client();
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
        let client = shared_client()
            .map_err(|e| AgentError::Config(format!("{app}: cannot build HTTP client: {e}")))?;
        let mut secrets: Vec<String> = secrets.into_iter().filter(|s| !s.is_empty()).collect();
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Ok(Self {
            app,
            client,
            auth: headers,
            base,
            secrets,
            timeout,
            retry: RetryPolicy::default(),
        })
    }

    pub fn set_retry(&mut self, retry: RetryPolicy) -> Result<(), AgentError> {
        if retry.max_attempts == 0 || retry.max_elapsed.is_zero() {
            return Err(AgentError::Config(format!(
                "{}: retry.max_attempts and retry.max_elapsed must be positive",
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
        self.client.request(method, url).headers(self.auth.clone())
    }

    /// Sends (with retries, see the module docs) and reads the whole body (bounded). Transport problems, 429s
    /// past the retries and unknown outcomes are errors here; any other status is the caller's to judge.
    pub async fn send(&self, rb: RequestBuilder) -> Result<Reply, AgentError> {
        self.exchange(rb, Repeat::ByMethod).await
    }

    /// Like [`Self::send`] for a call the caller made safe to repeat whatever its method (a POST the app dedupes
    /// atomically by a key, a PATCH to absolute values).
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
        let deadline = Instant::now() + self.retry.max_elapsed;
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
            let mut this = request
                .try_clone()
                .ok_or_else(|| self.bad(format!("{call}: request body cannot be resent")))?;
            let left = deadline.saturating_duration_since(Instant::now());
            *this.timeout_mut() = Some(self.timeout.min(left));
            let outcome = self.once(this).await;
            let left = deadline.saturating_duration_since(Instant::now());
            // Another attempt only if one is left and the wait before it still leaves the attempt enough time to be
            // answered: an attempt with a sliver of time would time out at once, and a lost answer to it is one
            // more request of unknown effect.
            let may_wait = |wait: Duration| {
                attempt < self.retry.max_attempts && wait.saturating_add(self.min_attempt()) <= left
            };
            let backoff = self.retry.backoff(attempt);
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
                        let wait = asked.unwrap_or(backoff);
                        if !may_wait(wait) || asked.is_some_and(|d| d > self.retry.max_retry_after)
                        {
                            return Err(AgentError::RateLimited {
                                app: self.app,
                                call,
                                attempts: attempt,
                                retry_after: asked,
                            });
                        }
                        wait
                    } else if status >= 500 && !repeatable {
                        // A 5xx is no proof that nothing happened: a gateway answers 502/504 while the app may
                        // still commit the request.
                        return Err(AgentError::Uncertain {
                            app: self.app,
                            call,
                            message: format!(
                                "answered HTTP {status}: {}",
                                self.scrub(&app_message(&reply.body))
                            ),
                        });
                    } else if status >= 500 && may_wait(backoff) {
                        backoff
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
                        message: self
                            .scrub(&format!("{what} after the request was sent: {message}")),
                    });
                }
                Err(Failure::Transport {
                    timeout, message, ..
                }) => {
                    if !may_wait(backoff) {
                        let kind = if timeout {
                            "timeout"
                        } else {
                            "connection failed"
                        };
                        let spent = if attempt < self.retry.max_attempts {
                            format!(
                                " (the call's time limit of {} s is spent)",
                                self.retry.max_elapsed.as_secs_f64()
                            )
                        } else {
                            String::new()
                        };
                        return Err(AgentError::Transport {
                            app: self.app,
                            call,
                            message: self.scrub(&format!(
                                "{kind} after {attempt} attempt(s){spent}: {message}"
                            )),
                        });
                    }
                    backoff
                }
            };
            tracing::warn!(
                app = self.app,
                call = %call,
                attempt,
                wait_ms = wait.as_millis() as u64,
                "retrying app call"
            );
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// The least time an attempt after the first must have: the per-attempt timeout, at most 1 s.
    fn min_attempt(&self) -> Duration {
        self.timeout.min(MIN_ATTEMPT)
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
        AgentError::Status {
            app: self.app,
            call: reply.call.clone(),
            status: reply.status,
            attempts: reply.attempts,
            message: self.scrub(&app_message(&reply.body)),
        }
    }

    pub fn decode<T: DeserializeOwned>(&self, body: &[u8]) -> Result<T, AgentError> {
        serde_json::from_slice(body).map_err(|e| self.bad(format!("unexpected JSON: {e}")))
    }

    /// A bad answer; `message` may quote the app (a JSON error names the value it choked on), so it is scrubbed.
    pub fn bad(&self, message: impl Into<String>) -> AgentError {
        AgentError::BadResponse {
            app: self.app,
            message: self.scrub(&message.into()),
        }
    }

    /// `text` without the client's secrets, cut to [`ERROR_EXCERPT_CHARS`]. Replaced before the cut: cut first, a
    /// secret straddling the cut would no longer match and its first part would be shown.
    fn scrub(&self, text: &str) -> String {
        let mut clean = text.to_string();
        for s in &self.secrets {
            clean = clean.replace(s.as_str(), "<redacted>");
        }
        clean.chars().take(ERROR_EXCERPT_CHARS).collect()
    }
}

/// A create that must not be made twice: the app has no dedupe key, or checks one before saving but not atomically
/// (a repeat could pass the check while the first request is still on its way to the save, and make a second
/// object). So `create` is sent as a non-idempotent call, which the retry layer repeats only when nothing was
/// processed (the connection was refused, or a 429). When its answer is lost (timeout, dropped connection, 5xx) the
/// object is looked up with `find`, and `create` is never sent again within the call: if the lookup does not find
/// it, the app may still be working on the first request, and the call fails with [`AgentError::Uncertain`] (not
/// retryable; the caller looks again later before repeating it). A lookup that fails leaves the outcome unknown
/// too (see [`AgentError::unresolved`]).
// Plain closures returning futures rather than async closures: the futures of async closures cannot yet be shown
// to be `Send`, which the agents' `invoke` needs.
pub(crate) async fn create_or_find<T, Made, Found>(
    create: impl FnOnce() -> Made,
    find: impl FnOnce() -> Found,
) -> Result<T, AgentError>
where
    Made: Future<Output = Result<T, AgentError>>,
    Found: Future<Output = Result<Option<T>, AgentError>>,
{
    let (app, call, message) = match create().await {
        Err(AgentError::Uncertain { app, call, message }) => (app, call, message),
        other => return other,
    };
    match find().await {
        Ok(Some(found)) => Ok(found),
        Ok(None) => Err(AgentError::Uncertain {
            app,
            call,
            message: format!("{message}; not found right after, the app may still be making it"),
        }),
        Err(e) => Err(AgentError::Uncertain { app, call, message }.unresolved(&e)),
    }
}

fn failure(e: reqwest::Error) -> Failure {
    Failure::Transport {
        unsent: e.is_connect(),
        timeout: e.is_timeout(),
        // without_url: query strings may carry caller data; the call names the endpoint.
        message: loams_platform::with_causes(&e.without_url()),
    }
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
/// `message`, GlitchTip and DRF `detail`, Plane `error`), else the body; cut by [`AppHttp::scrub`].
fn app_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let field = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            ["msg", "message", "detail", "error"]
                .iter()
                .find_map(|k| v.get(k)?.as_str().map(str::to_string))
        });
    field.unwrap_or_else(|| text.trim().to_string())
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

    /// A client whose secret is `token`, as an app that echoes credentials would meet it.
    fn leaky(token: &str) -> AppHttp {
        AppHttp::new(
            "forgejo",
            "http://127.0.0.1:1",
            vec![("authorization", format!("token {token}"))],
            DEFAULT_TIMEOUT,
            vec![token.to_string(), "short".into()],
        )
        .unwrap()
    }

    fn reply(status: u16, body: String) -> Reply {
        Reply {
            status,
            headers: HeaderMap::new(),
            body: body.into_bytes(),
            call: "POST /api/v1/x".into(),
            attempts: 1,
        }
    }

    #[test]
    fn secrets_echoed_by_an_app_never_reach_an_error() {
        let token = "t0k3n-ABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789";
        let http = leaky(token);
        let prefix = &token[..10];
        let message = |body: String| match http.status_error(&reply(401, body)) {
            AgentError::Status { message, .. } => message,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            message(format!(r#"{{"message":"bad token {token}"}}"#)),
            "bad token <redacted>"
        );
        assert_eq!(
            message(format!("<h1>401</h1> header was: token {token} (short)")),
            "<h1>401</h1> header was: token <redacted> (<redacted>)"
        );
        // Straddling the excerpt's cut at every offset: not even the token's first characters remain.
        for before in ERROR_EXCERPT_CHARS - token.len()..=ERROR_EXCERPT_CHARS {
            let expected: String = format!("{}<redacted> and more", "x".repeat(before))
                .chars()
                .take(ERROR_EXCERPT_CHARS)
                .collect();
            assert_eq!(
                message(format!("{}{token} and more", "x".repeat(before))),
                expected
            );
        }
        // A body we cannot decode (serde quotes the value it choked on) and a Zulip-style `msg` past the cut go
        // through the same scrubbing.
        let quoted: Result<u64, _> = http.decode(format!(r#""{token}""#).as_bytes());
        let bad = http.bad(format!("result `error`: {}{token}", "y".repeat(290)));
        for e in [quoted.unwrap_err(), bad] {
            assert!(!e.to_string().contains(prefix), "{e}");
        }
        // The cut still holds whatever the secrets.
        let long = http.status_error(&reply(500, "z".repeat(1000))).to_string();
        assert!(long.ends_with(&"z".repeat(ERROR_EXCERPT_CHARS)));
        assert!(!long.contains(&"z".repeat(ERROR_EXCERPT_CHARS + 1)));
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
        // A non-string field is not a message; the body is shown instead.
        assert_eq!(
            app_message(br#"{"detail":[{"loc":"q"}]}"#),
            r#"{"detail":[{"loc":"q"}]}"#
        );
    }
}
