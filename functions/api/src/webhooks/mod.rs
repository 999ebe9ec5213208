//! Webhooks in (issue 6): Forgejo (`pull_request`, `push`), Plane (both payload versions), Zulip outgoing webhooks
//! and GlitchTip alerts. Formats, signature headers and quirks: shared/notes/apps.md section 4.
//!
//! Every delivery is read up to its app's size limit, authenticated (HMAC-SHA256 of the raw body for Forgejo and
//! Plane, the bot token in the body for Zulip, a secret URL token for GlitchTip), parsed into a typed event and
//! deduplicated. A Forgejo, Plane or Zulip event is recorded as an `app_event` item for later reactions; a GlitchTip
//! alert opens a run. A refused delivery (4xx) writes nothing.
//!
//! The `parse_*` functions are pure (no I/O, no clock) so the fuzz targets in `functions/api/fuzz` reach them.

mod forgejo;
mod glitchtip;
mod plane;
mod zulip;

use aws_lc_rs::{digest, hmac};
use axum::Json;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use loams_platform::{Cond, Item, StoreError};
use serde::{Deserialize, Serialize};

use crate::{ApiError, ApiState};

pub use forgejo::{
    FORGEJO_MAX_BYTES, ForgejoDelivery, ForgejoEvent, PullRequestEvent, PushCommit, PushEvent,
    parse_forgejo,
};
pub use glitchtip::{GlitchtipHook, MAX_WEBHOOK_BYTES, RunOpener, parse_glitchtip};
pub use plane::{PLANE_MAX_BYTES, PlaneDelivery, PlaneEvent, PlaneVersion, parse_plane};
pub use zulip::{ZULIP_MAX_BYTES, ZulipEvent, parse_zulip};

/// How long a delivery id is remembered as a `webhook` item (the apps resend within minutes).
const DEDUPE_MS: i64 = 10 * 60 * 1000;
/// Shortest secret or token accepted from config: a short HMAC key or token can be guessed.
pub const MIN_SECRET: usize = 16;
/// Longest delivery id taken from a header or body; the apps send UUIDs.
const MAX_DELIVERY: usize = 128;

/// One configured webhook of Forgejo, Plane or Zulip, served at `/webhooks/<app>/<id>`: its deliveries are
/// authenticated with `secret` (the hook's HMAC secret; for Zulip the outgoing-webhook bot's token) and recorded
/// in `org`. The id only routes (it is not a secret), so several hooks (repositories, workspaces, bots) can
/// feed one organisation.
#[derive(Clone, Debug)]
pub struct AppHook {
    pub id: String,
    pub org: String,
    pub secret: String,
}

/// What an `app_event` item holds: one authenticated, parsed delivery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppEventRecord {
    /// The hook it came through (`AppHook::id`).
    pub hook: String,
    /// The app's delivery id, or `sha256-<hex of the body>` when the app sends none.
    pub delivery: String,
    pub received_ms: i64,
    pub event: AppEvent,
}

/// A parsed event of one of the apps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "app", content = "data", rename_all = "snake_case")]
pub enum AppEvent {
    Forgejo(ForgejoEvent),
    Plane(PlaneEvent),
    Zulip(ZulipEvent),
}

impl AppEvent {
    fn app(&self) -> &'static str {
        match self {
            AppEvent::Forgejo(_) => "forgejo",
            AppEvent::Plane(_) => "plane",
            AppEvent::Zulip(_) => "zulip",
        }
    }
}

/// A header's value as text; a header sent twice is ambiguous and counts as absent.
fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok().map(str::trim).filter(|v| !v.is_empty())
}

/// Checks a hex HMAC-SHA256 of `body` under `secret`. `hmac::verify` compares in constant time.
fn verify_hmac_hex(
    secret: &[u8],
    body: &[u8],
    signature: &str,
    header: &str,
) -> Result<(), ApiError> {
    let tag = hex::decode(signature)
        .map_err(|_| ApiError::Unauthenticated(format!("{header} is not hex")))?;
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    hmac::verify(&key, body, &tag)
        .map_err(|_| ApiError::Unauthenticated(format!("{header} does not match the body")))
}

/// A delivery id as the app sent it, if it is a plausible one (UUID-like text); anything else is treated as absent
/// so the body hash identifies the delivery instead.
fn delivery_id(value: Option<&str>) -> Option<String> {
    value
        .filter(|v| {
            !v.is_empty()
                && v.len() <= MAX_DELIVERY
                && v.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.')
        })
        .map(str::to_owned)
}

/// `s` without control characters (when `keep_newlines`, `\n` stays), cut to at most `max` bytes on a char
/// boundary: app payloads are untrusted text that is kept as data.
fn clean(s: &str, max: usize, keep_newlines: bool) -> String {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s
        .chars()
        .filter(|c| !c.is_control() || (keep_newlines && *c == '\n'))
    {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

fn too_large(max: usize) -> ApiError {
    ApiError::InvalidArgument(format!("body larger than {max} bytes"))
}

fn reply(status: StatusCode, body: serde_json::Value) -> Response {
    (status, Json(body)).into_response()
}

/// The HTTP answer to a refused or failed delivery. Refusals are 4xx with the reason; a failure of ours is a 503
/// (the apps retry) and its detail goes to the log only. `FailedPrecondition` is a misconfigured hook.
fn error_reply(e: ApiError) -> Response {
    match e {
        ApiError::Unauthenticated(m) => {
            reply(StatusCode::UNAUTHORIZED, serde_json::json!({"error": m}))
        }
        ApiError::InvalidArgument(m) => {
            reply(StatusCode::BAD_REQUEST, serde_json::json!({"error": m}))
        }
        ApiError::NotFound(_) => reply(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "not found"}),
        ),
        ApiError::FailedPrecondition(m) => {
            tracing::error!(error = %m, "webhook misconfigured; deliveries refused");
            reply(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"error": "webhook misconfigured"}),
            )
        }
        other => {
            tracing::warn!(error = %other, "webhook delivery failed");
            reply(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"error": "try again later"}),
            )
        }
    }
}

/// The body, read up to `max` bytes; a larger one (declared or sent) is a 413. A body holding serde_json's private
/// keys is a 400 before anything parses it (see `loams_platform::has_serde_private_key`).
async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    max: usize,
) -> Result<Vec<u8>, Response> {
    let too_large = || {
        reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            serde_json::json!({"error": format!("body larger than {max} bytes")}),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(too_large());
    }
    let body = axum::body::to_bytes(body, max)
        .await
        .map_err(|_| too_large())?;
    if loams_platform::has_serde_private_key(&body) {
        return Err(reply(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"error": "an object key starts with serde_json's private prefix"}),
        ));
    }
    Ok(body.to_vec())
}

/// The configured hook named by the path. A hook whose secret is too short is refused as misconfigured (logged)
/// rather than served: it would authenticate anyone who guesses it, and Forgejo signs with an empty secret as
/// "no signature".
fn find_hook<'a>(hooks: &'a [AppHook], id: &str, app: &str) -> Result<&'a AppHook, ApiError> {
    let hook = hooks
        .iter()
        .find(|h| h.id == id)
        .ok_or_else(|| ApiError::NotFound(format!("{app} hook")))?;
    if hook.secret.len() < MIN_SECRET {
        return Err(ApiError::FailedPrecondition(format!(
            "the secret of {app} hook {:?} is shorter than {MIN_SECRET} bytes",
            hook.id
        )));
    }
    Ok(hook)
}

/// The hook named by the path and its delivery's body, or the answer refusing the delivery.
async fn hook_and_body<'a>(
    hooks: &'a [AppHook],
    id: &str,
    app: &str,
    headers: &HeaderMap,
    body: axum::body::Body,
    max: usize,
) -> Result<(&'a AppHook, Vec<u8>), Response> {
    let hook = find_hook(hooks, id, app).map_err(error_reply)?;
    let body = read_body(headers, body, max).await?;
    Ok((hook, body))
}

/// Hex SHA-256 of a body: what identifies a delivery the app sends no id for (a resend carries the same bytes).
fn body_hash(body: &[u8]) -> String {
    hex::encode(digest::digest(&digest::SHA256, body).as_ref())
}

/// Whether the `webhook` marker `id` of `org` is live: a delivery seen within the last [`DEDUPE_MS`].
async fn seen(state: &ApiState, org: &str, id: &str) -> Result<bool, ApiError> {
    Ok(state.store.get_item(org, "webhook", id).await?.is_some())
}

/// Writes the `webhook` marker `id` of `org`, remembered for [`DEDUPE_MS`] from `now`.
async fn mark(
    state: &ApiState,
    org: &str,
    id: String,
    body: Vec<u8>,
    now: i64,
) -> Result<(), ApiError> {
    let marker = Item {
        org: org.to_owned(),
        kind: "webhook".into(),
        id,
        version: 0,
        index: None,
        body,
        expires_ms: Some(now + DEDUPE_MS),
    };
    state.store.put_item(&marker, Cond::Any).await?;
    Ok(())
}

/// The dedupe key of a delivery: the app's delivery id, else the hash of the body (a resend carries the same bytes).
fn delivery_key(delivery: Option<String>, body: &[u8]) -> String {
    delivery.unwrap_or_else(|| format!("sha256-{}", body_hash(body)))
}

/// Records an authenticated event once: `Ok(true)` when recorded now, `Ok(false)` for a delivery already seen.
///
/// The `app_event` item is written only if absent, under an id made of the app, hook and delivery, so a resend racing
/// the first delivery (or arriving after the `webhook` marker expired) records nothing. The marker is written after
/// the event, so a crash in between leaves the event recorded and the resend answered as a duplicate.
async fn record(
    state: &ApiState,
    hook: &AppHook,
    delivery: String,
    event: AppEvent,
) -> Result<bool, ApiError> {
    let app = event.app();
    let id = format!("{app}:{}:{delivery}", hook.id);
    if seen(state, &hook.org, &id).await? {
        return Ok(false);
    }
    let now = state.now_ms();
    let record = AppEventRecord {
        hook: hook.id.clone(),
        delivery,
        received_ms: now,
        event,
    };
    let body = serde_json::to_vec(&record)
        .map_err(|e| ApiError::Internal(format!("encode app event: {e}")))?;
    let item = Item {
        org: hook.org.clone(),
        kind: "app_event".into(),
        id: id.clone(),
        version: 0,
        index: Some(app.into()),
        body,
        expires_ms: None,
    };
    let fresh = match state.store.put_item(&item, Cond::Absent).await {
        Ok(_) => true,
        Err(StoreError::Conflict) => false,
        Err(e) => return Err(e.into()),
    };
    mark(state, &hook.org, id, Vec::new(), now).await?;
    Ok(fresh)
}

/// The answer to an authenticated event: 202 when recorded, 200 for a duplicate (the app must not resend either).
async fn record_reply(
    state: &ApiState,
    hook: &AppHook,
    delivery: String,
    event: AppEvent,
) -> Response {
    match record(state, hook, delivery, event).await {
        Ok(true) => reply(StatusCode::ACCEPTED, serde_json::json!({"recorded": true})),
        Ok(false) => reply(StatusCode::OK, serde_json::json!({"duplicate": true})),
        Err(e) => error_reply(e),
    }
}

pub(crate) fn routes(state: ApiState) -> axum::Router {
    axum::Router::new()
        .merge(glitchtip::routes(state.clone()))
        .merge(forgejo::routes(state.clone()))
        .merge(plane::routes(state.clone()))
        .merge(zulip::routes(state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_cuts_on_char_boundaries_and_drops_controls() {
        assert_eq!(clean("a\u{0}b\nc", 10, false), "abc");
        assert_eq!(clean("a\u{0}b\nc", 10, true), "ab\nc");
        assert_eq!(clean("ééé", 5, false), "éé");
    }

    #[test]
    fn delivery_ids_are_uuid_like_or_absent() {
        assert_eq!(
            delivery_id(Some("3f2a-9c_1.x")).as_deref(),
            Some("3f2a-9c_1.x")
        );
        assert_eq!(delivery_id(Some("a b")), None);
        assert_eq!(delivery_id(Some("a:b")), None);
        assert_eq!(delivery_id(Some(&"a".repeat(MAX_DELIVERY + 1))), None);
        assert_eq!(delivery_id(None), None);
    }

    #[test]
    fn hmac_must_match_the_body_and_secret() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"secret-0123456789");
        let good = hex::encode(hmac::sign(&key, b"body").as_ref());
        assert!(verify_hmac_hex(b"secret-0123456789", b"body", &good, "X").is_ok());
        assert!(verify_hmac_hex(b"secret-0123456789", b"body!", &good, "X").is_err());
        assert!(verify_hmac_hex(b"other-secret-0123", b"body", &good, "X").is_err());
        assert!(verify_hmac_hex(b"secret-0123456789", b"body", "zz", "X").is_err());
        assert!(verify_hmac_hex(b"secret-0123456789", b"body", &good[..10], "X").is_err());
    }
}
