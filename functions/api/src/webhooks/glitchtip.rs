//! GlitchTip alert webhook (notes/apps.md 4.3): a Slack-compatible JSON body, no signature, so the URL carries a
//! secret token. Each alert opens (or finds) the run of its issue; a repeated delivery opens nothing.

use async_trait::async_trait;
use aws_lc_rs::constant_time;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use loams_factory::Signal;
use serde::Deserialize;

use super::reply;
use crate::{ApiError, ApiState};

/// Largest webhook body read; GlitchTip's alerts are a few KiB.
pub const MAX_WEBHOOK_BYTES: usize = 64 * 1024;
const MAX_ISSUE_ID: usize = 64;

/// One configured GlitchTip webhook: its secret URL token opens runs in `org` / `env`.
#[derive(Clone, Debug)]
pub struct GlitchtipHook {
    pub org: String,
    pub env: String,
    pub token: String,
    /// The GlitchTip instance's URL (`https://glitchtip.example`, a path is ignored). An alert's issue link must be
    /// on its origin: the link becomes the run's signal, shown to people and followed by agents.
    pub origin: String,
}

/// Opens the run of a signal; the binary wires it to the worker (which owns run creation and the cooldown).
#[async_trait]
pub trait RunOpener: Send + Sync {
    /// Opens or finds the run for `signal`; returns its id. Opening the same signal twice is a no-op.
    async fn open(&self, org: &str, env: &str, signal: Signal) -> Result<String, ApiError>;
}

#[derive(Deserialize)]
struct Alert {
    #[serde(default)]
    attachments: Vec<Attachment>,
}

#[derive(Deserialize)]
struct Attachment {
    #[serde(default)]
    title: String,
    #[serde(default)]
    title_link: String,
}

fn find_hook<'a>(hooks: &'a [GlitchtipHook], token: &str) -> Option<&'a GlitchtipHook> {
    // Compare against every hook, in constant time each, so timing reveals neither a token nor how many exist.
    let mut found = None;
    for hook in hooks {
        if constant_time::verify_slices_are_equal(hook.token.as_bytes(), token.as_bytes()).is_ok() {
            found = Some(hook);
        }
    }
    found
}

/// The signal of an alert body whose issue link is on the origin of `origin` (the configured GlitchTip URL).
/// Errors: `InvalidArgument` (too large, not an alert, a link that is not a GlitchTip issue on that origin),
/// `FailedPrecondition` (the configured origin is not an http(s) URL).
pub fn parse_glitchtip(body: &[u8], origin: &str) -> Result<Signal, ApiError> {
    let origin = match reqwest::Url::parse(origin) {
        Ok(url) if url.origin().is_tuple() => url,
        _ => {
            return Err(ApiError::FailedPrecondition(format!(
                "the GlitchTip hook's origin {origin:?} is not an http(s) URL"
            )));
        }
    };
    if body.len() > MAX_WEBHOOK_BYTES {
        return Err(super::too_large(MAX_WEBHOOK_BYTES));
    }
    let bad = |m: &str| ApiError::InvalidArgument(m.into());
    let alert: Alert = serde_json::from_slice(body)
        .map_err(|e| ApiError::InvalidArgument(format!("not a GlitchTip alert: {e}")))?;
    let first = alert
        .attachments
        .first()
        .ok_or_else(|| bad("the alert has no attachments"))?;
    let link = first.title_link.trim();
    // `<GLITCHTIP_URL>/<org_slug>/issues/<issue_id>`; issue ids are numbers. Uptime alerts link a monitor and open
    // nothing here.
    let mut segments = link.trim_end_matches('/').rsplit('/');
    let issue_id = segments.next().unwrap_or_default();
    let id_ok = segments.next() == Some("issues")
        && !issue_id.is_empty()
        && issue_id.len() <= MAX_ISSUE_ID
        && issue_id.bytes().all(|c| c.is_ascii_digit());
    if !id_ok
        || !(link.starts_with("https://") || link.starts_with("http://"))
        || link.len() > loams_factory::MAX_ID
    {
        return Err(bad(
            "attachments[0].title_link is not a GlitchTip issue URL",
        ));
    }
    // Scheme, host and port must all match; the configured origin is a tuple origin (checked above), so two
    // unparseable URLs never compare equal.
    match reqwest::Url::parse(link) {
        Ok(url) if url.origin() == origin.origin() => {}
        _ => {
            return Err(bad(
                "attachments[0].title_link is not on the configured GlitchTip origin",
            ));
        }
    }
    // The title is untrusted text: kept as data, cut to the engine's limit.
    let title = super::clean(&first.title, loams_factory::MAX_TITLE, false);
    Ok(Signal {
        source: "glitchtip".into(),
        fingerprint: format!("glitchtip:{issue_id}"),
        title,
        link: link.to_owned(),
        glitchtip_issue_id: Some(issue_id.to_owned()),
        severity: "error".into(),
        generation: 1,
        parent_run: None,
    })
}

async fn glitchtip(
    State(state): State<ApiState>,
    Path(token): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Response> {
    // An unknown token gets the same answer as an unknown path: the URL is the secret.
    let hook = find_hook(&state.config.glitchtip_hooks, &token)
        .ok_or_else(|| super::error_reply(ApiError::NotFound("glitchtip hook".into())))?;
    let body = super::read_body(&headers, body, MAX_WEBHOOK_BYTES).await?;
    let signal = parse_glitchtip(&body, &hook.origin).map_err(super::error_reply)?;
    let answer = match deliver(&state, state.opener.as_ref(), hook, &body, signal).await {
        Ok(Some(run)) => reply(StatusCode::ACCEPTED, serde_json::json!({"run": run})),
        Ok(None) => reply(StatusCode::OK, serde_json::json!({"duplicate": true})),
        // Received and understood, and nothing to do (cooldown, kill switch): a 2xx so GlitchTip does not resend.
        Err(ApiError::FailedPrecondition(reason)) => {
            reply(StatusCode::OK, serde_json::json!({"refused": reason}))
        }
        Err(e) => {
            tracing::warn!(error = %e, org = %hook.org, "glitchtip webhook failed");
            reply(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"error": "try again later"}),
            )
        }
    };
    Ok(answer)
}

/// Opens the run of a delivery; `None` for a delivery seen within the last minutes. Opening is idempotent by run
/// id, so the marker only tells a resend (GlitchTip retries within minutes) from a new alert; it is written after the
/// open succeeded, so a crash in between never turns the alert into a "duplicate" that opened nothing, and it
/// lives no longer than a resend window, so a later alert of the same issue reaches the cooldown logic.
async fn deliver(
    state: &ApiState,
    opener: &dyn RunOpener,
    hook: &GlitchtipHook,
    body: &[u8],
    signal: Signal,
) -> Result<Option<String>, ApiError> {
    // GlitchTip sends no delivery id; a redelivery carries the same bytes, so the body's hash identifies it.
    let id = format!("glitchtip:{}", super::body_hash(body));
    if super::seen(state, &hook.org, &id).await? {
        return Ok(None);
    }
    let run = opener.open(&hook.org, &hook.env, signal).await?;
    super::mark(
        state,
        &hook.org,
        id,
        run.as_bytes().to_vec(),
        state.now_ms(),
    )
    .await?;
    Ok(Some(run))
}

pub(super) fn routes(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route("/webhooks/glitchtip/{token}", post(glitchtip))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_from_slack_style_alert() {
        let body = serde_json::json!({
            "alias": "GlitchTip", "text": "GlitchTip Alert",
            "attachments": [{"title": "ZeroDivisionError: checkout", "title_link": "https://gt.example/acme/issues/4217",
                             "text": "checkout.total", "fields": []}]
        });
        let s = parse_glitchtip(
            &serde_json::to_vec(&body).unwrap(),
            "https://gt.example/ignored/path",
        )
        .unwrap();
        assert_eq!(s.fingerprint, "glitchtip:4217");
        assert_eq!(s.glitchtip_issue_id.as_deref(), Some("4217"));
        assert_eq!(s.title, "ZeroDivisionError: checkout");
        assert_eq!(s.link, "https://gt.example/acme/issues/4217");
    }

    #[test]
    fn rejects_bodies_that_are_not_alerts() {
        let gt = "https://gt";
        let link = |l: &str| {
            format!(r#"{{"attachments": [{{"title": "x", "title_link": "{l}"}}]}}"#).into_bytes()
        };
        assert!(parse_glitchtip(b"{", gt).is_err());
        assert!(parse_glitchtip(br#"{"attachments": []}"#, gt).is_err());
        assert!(parse_glitchtip(&link("https://gt/acme/issues/"), gt).is_err());
        assert!(parse_glitchtip(&link("javascript:alert(1)/5"), gt).is_err());
        assert!(parse_glitchtip(&link("https://gt/a/issues/1;rm"), gt).is_err());
        assert!(parse_glitchtip(&link("https://gt/a/monitors/12"), gt).is_err());
        assert!(parse_glitchtip(&link("https://gt/a/issues/12/"), gt).is_ok());
    }

    #[test]
    fn the_issue_link_must_be_on_the_configured_origin() {
        let gt = "https://gt.example";
        let link = |l: &str| {
            format!(r#"{{"attachments": [{{"title": "x", "title_link": "{l}"}}]}}"#).into_bytes()
        };
        assert!(parse_glitchtip(&link("https://gt.example/a/issues/1"), gt).is_ok());
        assert!(
            parse_glitchtip(&link("https://GT.example:443/a/issues/1"), gt).is_ok(),
            "same origin, other spelling"
        );
        for other in [
            "https://evil.example/a/issues/1",
            "http://gt.example/a/issues/1",
            "https://gt.example:8443/a/issues/1",
            "https://gt.example.evil.example/a/issues/1",
            "https://gt.example@evil.example/a/issues/1",
            "https://sub.gt.example/a/issues/1",
        ] {
            assert!(
                parse_glitchtip(&link(other), gt).is_err(),
                "{other} must be refused"
            );
        }
        let local = "http://127.0.0.1:4000";
        assert!(parse_glitchtip(&link("http://127.0.0.1:4000/a/issues/1"), local).is_ok());
        assert!(parse_glitchtip(&link("http://127.0.0.1:4001/a/issues/1"), local).is_err());
    }

    #[test]
    fn hook_lookup_needs_the_exact_token() {
        let hooks = vec![
            GlitchtipHook {
                org: "a".into(),
                env: "prod".into(),
                token: "token-aaaaaaaaaaaa".into(),
                origin: "https://gt".into(),
            },
            GlitchtipHook {
                org: "b".into(),
                env: "prod".into(),
                token: "token-bbbbbbbbbbbb".into(),
                origin: "https://gt".into(),
            },
        ];
        assert_eq!(
            find_hook(&hooks, "token-bbbbbbbbbbbb").map(|h| h.org.as_str()),
            Some("b")
        );
        assert!(find_hook(&hooks, "token-bbbbbbbbbbb").is_none());
        assert!(find_hook(&hooks, "").is_none());
    }
}
