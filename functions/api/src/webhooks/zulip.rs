//! Zulip outgoing webhooks, notes/apps.md 4.1: no signature; the body carries the bot's `token`, compared in
//! constant time. No delivery id either, so a delivery is identified by the hash of its body (which includes the
//! message id). The answer `{"response_not_required": true}` tells Zulip to post nothing back.

use aws_lc_rs::constant_time;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use serde::{Deserialize, Serialize};

use super::{AppEvent, clean, delivery_key, record};
use crate::{ApiError, ApiState};

/// Largest Zulip delivery: a message is at most 10,000 characters, sent both raw and rendered.
pub const ZULIP_MAX_BYTES: usize = 128 * 1024;
const MAX_CONTENT: usize = 16 * 1024;
const MAX_NAME: usize = 255;

/// A message that mentioned (or was sent directly to) the outgoing-webhook bot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZulipEvent {
    /// `mention`, `direct_message` (`private_message` before feature level 201).
    pub trigger: String,
    pub message_id: u64,
    pub sender_email: String,
    pub sender_name: String,
    /// The channel and topic of a channel message; `None` for a direct message.
    pub channel: Option<String>,
    pub topic: Option<String>,
    /// The raw Markdown (`data`), cut to 16 KiB.
    pub content: String,
}

#[derive(Deserialize)]
struct RawToken {
    token: Option<String>,
}

#[derive(Deserialize)]
struct RawPayload {
    #[serde(default)]
    data: String,
    trigger: String,
    message: RawMessage,
}

#[derive(Deserialize)]
struct RawMessage {
    id: u64,
    #[serde(default)]
    sender_email: String,
    #[serde(default)]
    sender_full_name: String,
    #[serde(rename = "type")]
    kind: String,
    /// The channel name for a channel message, a list of users for a direct message.
    #[serde(default)]
    display_recipient: serde_json::Value,
    #[serde(default)]
    subject: String,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::InvalidArgument(msg.into())
}

/// Authenticates and parses one Zulip outgoing-webhook delivery. Errors: `Unauthenticated` (no `token`, or not the
/// bot's), `InvalidArgument` (too large, not JSON, not an outgoing-webhook payload).
pub fn parse_zulip(body: &[u8], token: &str) -> Result<ZulipEvent, ApiError> {
    if body.len() > ZULIP_MAX_BYTES {
        return Err(super::too_large(ZULIP_MAX_BYTES));
    }
    let sent: RawToken = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not a Zulip webhook payload: {e}")))?;
    let sent = sent
        .token
        .filter(|t| !t.is_empty())
        .ok_or_else(|| ApiError::Unauthenticated("missing token".into()))?;
    constant_time::verify_slices_are_equal(sent.as_bytes(), token.as_bytes())
        .map_err(|_| ApiError::Unauthenticated("token does not match the bot's".into()))?;
    let raw: RawPayload = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not a Zulip webhook payload: {e}")))?;
    let trigger = clean(&raw.trigger, 64, false);
    if trigger.is_empty() {
        return Err(bad("empty trigger"));
    }
    let (channel, topic) = match (raw.message.kind.as_str(), &raw.message.display_recipient) {
        ("stream" | "channel", serde_json::Value::String(channel)) => (
            Some(clean(channel, MAX_NAME, false)),
            Some(clean(&raw.message.subject, MAX_NAME * 2, false)),
        ),
        ("private" | "direct", _) => (None, None),
        _ => {
            return Err(bad(
                "message.type and message.display_recipient do not match",
            ));
        }
    };
    Ok(ZulipEvent {
        trigger,
        message_id: raw.message.id,
        sender_email: clean(&raw.message.sender_email, MAX_NAME, false),
        sender_name: clean(&raw.message.sender_full_name, MAX_NAME, false),
        channel,
        topic,
        content: clean(&raw.data, MAX_CONTENT, true),
    })
}

async fn zulip(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Response> {
    let (hook, body) = super::hook_and_body(
        &state.config.zulip_hooks,
        &id,
        "zulip",
        &headers,
        body,
        ZULIP_MAX_BYTES,
    )
    .await?;
    let event = parse_zulip(&body, &hook.secret).map_err(super::error_reply)?;
    // Zulip shows any other answer than a 200 in the channel; a duplicate is answered the same way.
    let fresh = record(
        &state,
        hook,
        delivery_key(None, &body),
        AppEvent::Zulip(event),
    )
    .await
    .map_err(super::error_reply)?;
    Ok(super::reply(
        StatusCode::OK,
        serde_json::json!({"response_not_required": true, "duplicate": !fresh}),
    ))
}

pub(super) fn routes(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route("/webhooks/zulip/{id}", post(zulip))
        .with_state(state)
}
