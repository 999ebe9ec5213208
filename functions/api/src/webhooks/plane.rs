//! Plane webhooks, notes/apps.md 4.4: `X-Plane-Signature` is the hex HMAC-SHA256 of the raw body, `X-Plane-Delivery`
//! a UUID. Two payload versions: v1 (what Plane CE sends: `{event, action, webhook_id, workspace_id, data,
//! activity}`) and v2 (the documented one: `{version: "v2", delivery_id, event_id, entity_id, entity_type,
//! event: "workitem.created", ...}`), told apart by the presence of `version`.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde::{Deserialize, Serialize};

use super::{AppEvent, delivery_id, delivery_key, header_str, record_reply, verify_hmac_hex};
use crate::{ApiError, ApiState};

/// Largest Plane delivery: a serialized work item with its description HTML.
pub const PLANE_MAX_BYTES: usize = 256 * 1024;
const MAX_WORD: usize = 64;
const MAX_ID: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlaneVersion {
    V1,
    V2,
}

/// One Plane event in a form common to both payload versions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaneEvent {
    pub version: PlaneVersion,
    /// The event as sent: `issue` (v1) or `workitem.created` (v2).
    pub event: String,
    /// What changed: `issue`, `issue_comment`, ... (v1) or `workitem`, `workitem.comment`, ... (v2).
    pub entity: String,
    /// `created`, `updated` or `deleted`.
    pub action: String,
    /// The id of what changed (v1 `data.id`, v2 `entity_id`).
    pub entity_id: Option<String>,
    pub workspace_id: Option<String>,
    pub webhook_id: Option<String>,
}

/// An authenticated Plane delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlaneDelivery {
    /// `X-Plane-Delivery`, else the v2 body's `delivery_id`, when it is a plausible id.
    pub delivery: Option<String>,
    pub event: PlaneEvent,
}

#[derive(Deserialize)]
struct RawPayload {
    version: Option<String>,
    event: String,
    action: Option<String>,
    entity_type: Option<String>,
    entity_id: Option<String>,
    delivery_id: Option<String>,
    webhook_id: Option<String>,
    workspace_id: Option<String>,
    #[serde(default)]
    data: serde_json::Value,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::InvalidArgument(msg.into())
}

/// An event, entity or action word: lowercase letters, digits, `_` and (for v2 events) `.`.
fn word(field: &str, value: &str) -> Result<String, ApiError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_WORD
        && value
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'.');
    if ok {
        Ok(value.to_owned())
    } else {
        Err(bad(format!("{field} is not a Plane event word")))
    }
}

/// An id (Plane uses UUIDs); a missing or null one stays `None`.
fn id(field: &str, value: Option<&str>) -> Result<Option<String>, ApiError> {
    match value {
        None => Ok(None),
        Some(v)
            if !v.is_empty()
                && v.len() <= MAX_ID
                && v.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-') =>
        {
            Ok(Some(v.to_owned()))
        }
        Some(_) => Err(bad(format!("{field} is not an id"))),
    }
}

fn event_of(raw: &RawPayload) -> Result<PlaneEvent, ApiError> {
    let event = word("event", &raw.event)?;
    match raw.version.as_deref() {
        None => {
            let action = word(
                "action",
                raw.action
                    .as_deref()
                    .ok_or_else(|| bad("v1 payload without action"))?,
            )?;
            // v1 sends the serialized object as `data` (only `{"id"}` on delete); ids are strings.
            let entity_id = raw
                .data
                .get("id")
                .map(|v| v.as_str().ok_or_else(|| bad("data.id is not a string")))
                .transpose()?;
            Ok(PlaneEvent {
                version: PlaneVersion::V1,
                entity: event.clone(),
                event,
                action,
                entity_id: id("data.id", entity_id)?,
                workspace_id: id("workspace_id", raw.workspace_id.as_deref())?,
                webhook_id: id("webhook_id", raw.webhook_id.as_deref())?,
            })
        }
        Some("v2") => {
            // `workitem.comment.created`: the action is the last segment, the entity what comes before.
            let (entity, action) = event
                .rsplit_once('.')
                .ok_or_else(|| bad("v2 event is not <entity>.<action>"))?;
            let entity = match raw.entity_type.as_deref() {
                Some(t) => word("entity_type", t)?,
                None => word("event", entity)?,
            };
            Ok(PlaneEvent {
                version: PlaneVersion::V2,
                action: word("event", action)?,
                entity,
                entity_id: id("entity_id", raw.entity_id.as_deref())?,
                workspace_id: id("workspace_id", raw.workspace_id.as_deref())?,
                webhook_id: id("webhook_id", raw.webhook_id.as_deref())?,
                event,
            })
        }
        Some(_) => Err(bad("unsupported Plane payload version")),
    }
}

/// Authenticates and parses one Plane delivery (either payload version): the signature first, then the body.
/// Errors: `Unauthenticated` (missing or wrong `X-Plane-Signature`), `InvalidArgument` (too large, not a Plane
/// payload).
pub fn parse_plane(
    headers: &HeaderMap,
    body: &[u8],
    secret: &[u8],
) -> Result<PlaneDelivery, ApiError> {
    if body.len() > PLANE_MAX_BYTES {
        return Err(super::too_large(PLANE_MAX_BYTES));
    }
    let signature = header_str(headers, "x-plane-signature")
        .ok_or_else(|| ApiError::Unauthenticated("missing X-Plane-Signature".into()))?;
    verify_hmac_hex(secret, body, signature, "X-Plane-Signature")?;
    let raw: RawPayload = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not a Plane webhook payload: {e}")))?;
    let event = event_of(&raw)?;
    let delivery = delivery_id(header_str(headers, "x-plane-delivery"))
        .or_else(|| delivery_id(raw.delivery_id.as_deref()));
    Ok(PlaneDelivery { delivery, event })
}

async fn plane(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Response> {
    let (hook, body) = super::hook_and_body(
        &state.config.plane_hooks,
        &id,
        "plane",
        &headers,
        body,
        PLANE_MAX_BYTES,
    )
    .await?;
    let parsed =
        parse_plane(&headers, &body, hook.secret.as_bytes()).map_err(super::error_reply)?;
    Ok(record_reply(
        &state,
        hook,
        delivery_key(parsed.delivery, &body),
        AppEvent::Plane(parsed.event),
    )
    .await)
}

pub(super) fn routes(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route("/webhooks/plane/{id}", post(plane))
        .with_state(state)
}
