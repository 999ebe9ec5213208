//! Fault injection for client tests: make the next N requests to one app (optionally only those with a given
//! method and path prefix) answer an error status, answer late, or lose the connection, either before the request
//! reaches the app (nothing happened) or after the app applied it (the effect happened, the caller cannot tell).
//!
//! Rules are consumed in the order they were added: a request takes the first rule that matches and still has uses
//! left. Rules stay listed with their `fired` count until cleared (or, used up, dropped to make room past
//! [`MAX_RULES`]), so a test can check how often its client tried.
//! Faults live in memory only; they are not part of the persisted state.

use crate::Shared;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bounds of a rule, so a mistyped or hostile rule cannot hang an app for good: the longest delay (past every
/// client timeout worth testing) and the most requests one rule may hit.
pub const MAX_DELAY_MS: u64 = 60_000;
pub const MAX_TIMES: u32 = 1000;
/// Most rules armed at once; every request scans them, and memory must not grow with whatever a caller posts.
/// When full, used-up rules are dropped to make room (their `fired` counts go with them).
pub const MAX_RULES: usize = 256;
/// Longest `method`, `path_prefix` or `retry_after`, in bytes: far past any real one, small enough to keep 256
/// rules cheap.
pub const MAX_FIELD_BYTES: usize = 2048;

/// What a matching request gets.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Effect {
    /// An answer with this status and a JSON `{"message": ...}` body; `retry_after` becomes the `Retry-After`
    /// header verbatim (seconds or an HTTP date).
    Status {
        status: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after: Option<String>,
    },
    /// The answer is held back this long.
    Delay { ms: u64 },
    /// The connection is closed without an answer.
    Drop,
}

/// Whether the fault strikes before the app handles the request or after it has (and kept the effect).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    Before,
    After,
}

/// One rule, as `POST /_sandbox/faults` takes it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// `zulip`, `plane`, `forgejo`, `glitchtip` or `openpanel`.
    pub app: String,
    /// Only requests with this method (case-insensitive); any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Only requests whose path starts with this; any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// How many matching requests the rule applies to.
    pub times: u32,
    #[serde(default)]
    pub phase: Phase,
    pub effect: Effect,
}

impl Fault {
    pub fn new(app: &str, times: u32, effect: Effect) -> Self {
        Fault {
            app: app.into(),
            method: None,
            path_prefix: None,
            times,
            phase: Phase::Before,
            effect,
        }
    }

    pub fn status(app: &str, times: u32, status: u16) -> Self {
        Self::new(
            app,
            times,
            Effect::Status {
                status,
                retry_after: None,
            },
        )
    }

    pub fn rate_limited(app: &str, times: u32, retry_after: &str) -> Self {
        Self::new(
            app,
            times,
            Effect::Status {
                status: 429,
                retry_after: Some(retry_after.into()),
            },
        )
    }

    pub fn delay(app: &str, times: u32, delay: Duration) -> Self {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        Self::new(app, times, Effect::Delay { ms })
    }

    pub fn drop_connection(app: &str, times: u32) -> Self {
        Self::new(app, times, Effect::Drop)
    }

    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.into());
        self
    }

    pub fn path_prefix(mut self, prefix: &str) -> Self {
        self.path_prefix = Some(prefix.into());
        self
    }

    /// Strike after the app has applied the request.
    pub fn after_effect(mut self) -> Self {
        self.phase = Phase::After;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if !crate::APPS.contains(&self.app.as_str()) {
            return Err(format!(
                "unknown app `{}`; one of {}",
                self.app,
                crate::APPS.join(", ")
            ));
        }
        if !(1..=MAX_TIMES).contains(&self.times) {
            return Err(format!(
                "times must be between 1 and {MAX_TIMES}, got {}",
                self.times
            ));
        }
        let retry_after = match &self.effect {
            Effect::Status { retry_after, .. } => retry_after.as_deref(),
            _ => None,
        };
        for (name, value) in [
            ("method", self.method.as_deref()),
            ("path_prefix", self.path_prefix.as_deref()),
            ("retry_after", retry_after),
        ] {
            if let Some(v) = value
                && v.len() > MAX_FIELD_BYTES
            {
                return Err(format!(
                    "{name} must be at most {MAX_FIELD_BYTES} bytes, got {}",
                    v.len()
                ));
            }
        }
        if let Effect::Delay { ms } = self.effect
            && ms > MAX_DELAY_MS
        {
            return Err(format!("delay must be at most {MAX_DELAY_MS} ms, got {ms}"));
        }
        if let Effect::Status { status, .. } = self.effect
            && StatusCode::from_u16(status).is_err()
        {
            return Err(format!("invalid status {status}"));
        }
        Ok(())
    }

    fn matches(&self, app: &str, method: &str, path: &str) -> bool {
        self.app == app
            && self
                .method
                .as_deref()
                .is_none_or(|m| m.eq_ignore_ascii_case(method))
            && self
                .path_prefix
                .as_deref()
                .is_none_or(|p| path.starts_with(p))
    }
}

/// A rule and how many requests it has hit so far.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ArmedFault {
    #[serde(flatten)]
    pub fault: Fault,
    pub fired: u32,
}

#[derive(Default)]
pub(crate) struct Faults {
    rules: Mutex<Vec<ArmedFault>>,
}

impl Faults {
    fn rules(&self) -> std::sync::MutexGuard<'_, Vec<ArmedFault>> {
        self.rules
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn add(&self, fault: Fault) -> Result<(), String> {
        fault.validate()?;
        let mut rules = self.rules();
        if rules.len() >= MAX_RULES {
            rules.retain(|r| r.fired < r.fault.times);
        }
        if rules.len() >= MAX_RULES {
            return Err(format!(
                "{MAX_RULES} rules are armed and none is used up; clear them first"
            ));
        }
        rules.push(ArmedFault { fault, fired: 0 });
        Ok(())
    }

    pub fn snapshot(&self) -> Vec<ArmedFault> {
        self.rules().clone()
    }

    pub fn clear(&self) {
        self.rules().clear();
    }

    /// Consumes one use of the first live rule matching the request.
    fn take(&self, app: &str, method: &str, path: &str) -> Option<(Phase, Effect)> {
        let mut rules = self.rules();
        let rule = rules
            .iter_mut()
            .find(|r| r.fired < r.fault.times && r.fault.matches(app, method, path))?;
        rule.fired += 1;
        Some((rule.fault.phase, rule.fault.effect.clone()))
    }
}

/// An answer whose body fails at once: hyper then closes the connection without sending anything for it.
fn dropped() -> Response {
    let failing = tokio_stream::once(Err::<axum::body::Bytes, _>(std::io::Error::other(
        "sandbox: injected connection drop",
    )));
    Response::new(Body::from_stream(failing))
}

fn status_answer(status: u16, retry_after: Option<&str>) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let message = format!("sandbox: injected HTTP {status}");
    let mut resp = (code, axum::Json(serde_json::json!({"message": message}))).into_response();
    if let Some(v) = retry_after.and_then(|v| HeaderValue::from_str(v).ok()) {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

/// Middleware for one app's routes (outside the request recorder, so a request the app never saw is not logged).
pub(crate) async fn inject(
    State((shared, app)): State<(Arc<Shared>, &'static str)>,
    req: Request,
    next: Next,
) -> Response {
    let Some((phase, effect)) = shared
        .faults
        .take(app, req.method().as_str(), req.uri().path())
    else {
        return next.run(req).await;
    };
    match effect {
        Effect::Delay { ms } => {
            let delay = Duration::from_millis(ms);
            // Delayed before, the app handles the request only afterwards, so a client that gave up meanwhile (its
            // disconnect cancels this future) leaves no effect behind; delayed after, the effect stays.
            match phase {
                Phase::Before => {
                    tokio::time::sleep(delay).await;
                    next.run(req).await
                }
                Phase::After => {
                    let resp = next.run(req).await;
                    tokio::time::sleep(delay).await;
                    resp
                }
            }
        }
        Effect::Status {
            status,
            retry_after,
        } => {
            apply_if_after(phase, req, next).await;
            status_answer(status, retry_after.as_deref())
        }
        Effect::Drop => {
            apply_if_after(phase, req, next).await;
            dropped()
        }
    }
}

/// For a fault that strikes after the app: lets the app apply the request and throws its answer away.
async fn apply_if_after(phase: Phase, req: Request, next: Next) {
    if phase == Phase::After {
        drop(next.run(req).await);
    }
}
