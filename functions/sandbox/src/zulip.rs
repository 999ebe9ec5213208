//! Fake Zulip (`/api/v1`, HTTP Basic email:api_key): send and read channel messages, `users/me`.

use crate::{Shared, ZulipSeed, util};
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

/// Zulip's own limits: `max_topic_length` 60 characters, `max_message_length` 10000 bytes.
const MAX_TOPIC_CHARS: usize = 60;
const MAX_CONTENT_BYTES: usize = 10_000;
/// Zulip caps `num_before + num_after` at 5000.
const MAX_WINDOW: u64 = 5000;
/// What Zulip answers as `anchor` for `anchor=newest`.
const NEWEST_ANCHOR: u64 = 10_000_000_000_000_000;
const BOT_USER_ID: u64 = 8;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Channel {
    id: u64,
    name: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Message {
    id: u64,
    stream_id: u64,
    topic: String,
    content: String,
    timestamp: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ZulipState {
    channels: Vec<Channel>,
    pub messages: Vec<Message>,
}

impl ZulipState {
    pub fn seed(seed: &ZulipSeed) -> Self {
        let channels = seed
            .channels
            .iter()
            .zip(1u64..)
            .map(|(name, id)| Channel {
                id,
                name: name.clone(),
            })
            .collect();
        ZulipState {
            channels,
            messages: Vec::new(),
        }
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/api/v1/messages", get(get_messages).post(send_message))
        .route("/api/v1/users/me", get(users_me))
        .route("/api/v1/get_stream_id", get(get_stream_id))
}

fn error(status: StatusCode, code: &str, msg: &str) -> Response {
    (
        status,
        Json(json!({"result": "error", "msg": msg, "code": code})),
    )
        .into_response()
}

fn bad_request(msg: &str) -> Response {
    error(StatusCode::BAD_REQUEST, "BAD_REQUEST", msg)
}

fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), Response> {
    let Some(encoded) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
    else {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "Not logged in: API authentication or user session required",
        ));
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default();
    let t = &shared.config.tokens;
    match decoded.split_once(':') {
        Some((email, key)) if email == t.zulip_email && key == t.zulip_api_key => Ok(()),
        Some((email, _)) if email == t.zulip_email => Err(error(
            StatusCode::UNAUTHORIZED,
            "INVALID_API_KEY",
            "Invalid API key",
        )),
        _ => Err(error(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "Account is not associated with this subdomain",
        )),
    }
}

/// Content as sent (`apply_markdown=false`) or rendered to HTML; the sandbox renders paragraphs only.
fn render(content: &str, markdown: bool) -> String {
    if !markdown {
        return content.to_owned();
    }
    let escaped = content
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    escaped
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .map(|p| format!("<p>{}</p>", p.trim().replace('\n', "<br>\n")))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn send_message(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    form: Result<Form<HashMap<String, String>>, axum::extract::rejection::FormRejection>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    let form = match form {
        Ok(Form(f)) => f,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error(e.status(), "BAD_REQUEST", "Request body too large");
        }
        Err(e) => return bad_request(&e.body_text()),
    };
    let field = |k: &str| form.get(k).map(String::as_str);
    let Some(kind) = field("type") else {
        return bad_request("Missing 'type' argument");
    };
    if kind == "direct" || kind == "private" {
        return bad_request("Direct messages are not available in this sandbox realm");
    }
    if kind != "stream" && kind != "channel" {
        return bad_request("Invalid 'type' argument");
    }
    let Some(to) = field("to") else {
        return bad_request("Missing 'to' argument");
    };
    // `to` is a channel name, a channel id, or either JSON-encoded
    let to = match serde_json::from_str::<Value>(to) {
        Ok(Value::String(s)) => s,
        Ok(Value::Number(n)) => n.to_string(),
        _ => to.to_owned(),
    };
    let Some(topic) = field("topic").or(field("subject")) else {
        return bad_request("Missing topic");
    };
    let topic = topic.trim();
    if topic.chars().count() > MAX_TOPIC_CHARS {
        return bad_request(&format!(
            "Topic too long (limit: {MAX_TOPIC_CHARS} characters)"
        ));
    }
    let Some(content) = field("content").filter(|c| !c.trim().is_empty()) else {
        return bad_request("Message must not be empty");
    };
    if content.len() > MAX_CONTENT_BYTES {
        return bad_request(&format!(
            "Message too long (limit: {MAX_CONTENT_BYTES} characters)"
        ));
    }
    let mut st = shared.lock();
    let found = st
        .zulip
        .channels
        .iter()
        .find(|c| c.name == to || c.id.to_string() == to)
        .map(|c| c.id);
    let Some(stream_id) = found else {
        return (
            StatusCode::BAD_REQUEST,
            Json(
                json!({"result": "error", "msg": format!("Channel '{to}' does not exist"),
                        "code": "STREAM_DOES_NOT_EXIST", "stream": to}),
            ),
        )
            .into_response();
    };
    let id = st.zulip.messages.last().map_or(1, |m| m.id + 1);
    st.zulip.messages.push(Message {
        id,
        stream_id,
        // Zulip stores an empty topic as the "general chat" topic; keep what was sent
        topic: topic.to_owned(),
        content: content.to_owned(),
        timestamp: util::now_ms() / 1000,
    });
    if let Err(e) = shared.persist(&st) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "BAD_REQUEST",
            &e.to_string(),
        );
    }
    Json(json!({"result": "success", "msg": "", "id": id})).into_response()
}

#[derive(Deserialize)]
struct NarrowTerm {
    operator: String,
    operand: Value,
    #[serde(default)]
    negated: bool,
}

enum Filter {
    Channel(u64),
    /// lower-cased: Zulip matches topics case-insensitively
    Topic(String),
}

impl Filter {
    fn matches(&self, m: &Message) -> bool {
        match self {
            Filter::Channel(id) => m.stream_id == *id,
            Filter::Topic(t) => m.topic.to_lowercase() == *t,
        }
    }
}

fn parse_u64(q: &HashMap<String, String>, k: &str) -> Result<u64, Response> {
    match q.get(k) {
        None => Err(bad_request(&format!("Missing '{k}' argument"))),
        Some(v) => v.parse().map_err(|_| bad_request(&format!("Invalid {k}"))),
    }
}

async fn get_messages(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    let (num_before, num_after) = match (parse_u64(&q, "num_before"), parse_u64(&q, "num_after")) {
        (Ok(b), Ok(a)) => (b, a),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    if num_before + num_after > MAX_WINDOW {
        return bad_request(&format!(
            "Too many messages requested (maximum {MAX_WINDOW})."
        ));
    }
    let narrow: Vec<NarrowTerm> = match q.get("narrow").map(|n| serde_json::from_str(n)) {
        None => Vec::new(),
        Some(Ok(n)) => n,
        Some(Err(_)) => return bad_request("Invalid narrow"),
    };
    let apply_markdown = q.get("apply_markdown").is_none_or(|v| v != "false");
    let include_anchor = q.get("include_anchor").is_none_or(|v| v != "false");
    let st = shared.lock();
    let mut filters: Vec<(bool, Filter)> = Vec::new();
    for term in &narrow {
        let operand = match &term.operand {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return bad_request("Invalid narrow operand"),
        };
        match term.operator.as_str() {
            "channel" | "stream" => {
                let Some(ch) = st
                    .zulip
                    .channels
                    .iter()
                    .find(|c| c.name == operand || c.id.to_string() == operand)
                else {
                    return bad_request("Invalid narrow operator: unknown channel");
                };
                filters.push((term.negated, Filter::Channel(ch.id)));
            }
            "topic" | "subject" => {
                filters.push((term.negated, Filter::Topic(operand.to_lowercase())));
            }
            other => {
                return bad_request(&format!(
                    "Invalid narrow operator: unknown operator {other}"
                ));
            }
        }
    }
    let matching: Vec<&Message> = st
        .zulip
        .messages
        .iter()
        .filter(|m| filters.iter().all(|(neg, f)| f.matches(m) != *neg))
        .collect();

    let anchor = match q.get("anchor").map(String::as_str) {
        None | Some("newest") | Some("first_unread") => NEWEST_ANCHOR,
        Some("oldest") => 0,
        Some(n) => match n.parse::<u64>() {
            Ok(n) => n,
            Err(_) => return bad_request("Invalid anchor"),
        },
    };
    let before: Vec<&&Message> = matching.iter().filter(|m| m.id < anchor).collect();
    let at = matching.iter().find(|m| m.id == anchor);
    let after: Vec<&&Message> = matching.iter().filter(|m| m.id > anchor).collect();
    let take_before = before
        .len()
        .saturating_sub(usize::try_from(num_before).unwrap_or(usize::MAX));
    let after_n = usize::try_from(num_after).unwrap_or(usize::MAX);
    let mut window: Vec<&Message> = before[take_before..].iter().map(|m| **m).collect();
    if include_anchor {
        window.extend(at.copied());
    }
    window.extend(after.iter().take(after_n).map(|m| **m));
    let found_oldest = take_before == 0;
    let found_newest = after.len() <= after_n;

    let me = &shared.config;
    let messages: Vec<Value> = window
        .iter()
        .map(|m| {
            let channel = st
                .zulip
                .channels
                .iter()
                .find(|c| c.id == m.stream_id)
                .map_or("", |c| c.name.as_str());
            json!({
                "id": m.id,
                "sender_id": BOT_USER_ID,
                "sender_email": me.tokens.zulip_email,
                "sender_full_name": me.zulip.bot_full_name,
                "sender_realm_str": "zulip",
                "avatar_url": null,
                "client": "ZulipPython",
                "content": render(&m.content, apply_markdown),
                "content_type": if apply_markdown { "text/html" } else { "text/x-markdown" },
                "subject": m.topic,
                "topic_links": [],
                "stream_id": m.stream_id,
                "display_recipient": channel,
                "recipient_id": 100 + m.stream_id,
                "timestamp": m.timestamp,
                "type": "stream",
                "is_me_message": false,
                "reactions": [],
                "submessages": [],
                "flags": ["read"],
            })
        })
        .collect();
    Json(json!({
        "result": "success",
        "msg": "",
        "anchor": anchor,
        "found_anchor": at.is_some(),
        "found_oldest": found_oldest,
        "found_newest": found_newest,
        "history_limited": false,
        "messages": messages,
    }))
    .into_response()
}

async fn users_me(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    let c = &shared.config;
    let max_message_id = shared
        .lock()
        .zulip
        .messages
        .last()
        .map_or(-1, |m| i64::try_from(m.id).unwrap_or(-1));
    Json(json!({
        "result": "success",
        "msg": "",
        "avatar_url": "",
        "avatar_version": 1,
        "email": c.tokens.zulip_email,
        "delivery_email": c.tokens.zulip_email,
        "full_name": c.zulip.bot_full_name,
        "is_admin": false,
        "is_owner": false,
        "role": 400,
        "is_guest": false,
        "is_bot": true,
        "is_active": true,
        "timezone": "",
        "date_joined": "2026-01-01T00:00:00+00:00",
        "max_message_id": max_message_id,
        "user_id": BOT_USER_ID,
        "profile_data": {},
    }))
    .into_response()
}

#[derive(Deserialize)]
struct StreamQuery {
    stream: String,
}

/// `GET /get_stream_id?stream=NAME` (get-stream-id): `{result, msg, stream_id}`, or 400 for an unknown channel.
async fn get_stream_id(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    query: Result<Query<StreamQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    let Ok(Query(query)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_REQUEST",
            "Missing 'stream' argument",
        );
    };
    let st = shared.lock();
    match st.zulip.channels.iter().find(|c| c.name == query.stream) {
        Some(channel) => {
            Json(json!({"result": "success", "msg": "", "stream_id": channel.id})).into_response()
        }
        // zulip.yaml's get-stream-id example: a plain BAD_REQUEST, unlike send-message's STREAM_DOES_NOT_EXIST
        None => bad_request(&format!("Invalid channel name '{}'", query.stream)),
    }
}
