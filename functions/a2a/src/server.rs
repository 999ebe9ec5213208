//! The A2A 1.0 server: the signed card, the JSON-RPC binding at the base URL and the HTTP+JSON
//! binding under it (also tenant-prefixed), with SSE streams for SendStreamingMessage and
//! SubscribeToTask. The operations themselves live in [`crate::tasks`] and keep every task in the
//! platform `Store`.
//!
//! Every call needs a bearer token the host's [`CallerAuth`] accepts for this agent's URL (the card
//! stays public). A task is bound to the call that created it (skill and canonical args) and to
//! its caller: a reused message id with another call is refused, and only the creator may read,
//! list, follow or cancel the task. A destructive skill runs only when the host's
//! [`ApprovalGate`](crate::ApprovalGate) admits the approval named in the message metadata
//! (`approval_id`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use a2a::{
    A2AError, AgentExtension, CancelTaskRequest, DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest, GetTaskRequest, JsonRpcId, JsonRpcResponse,
    ListTaskPushNotificationConfigsRequest, ListTasksRequest, SendMessageRequest,
    SendMessageResponse, StreamResponse, SubscribeToTaskRequest, TaskPushNotificationConfig,
    TaskState, error_code, error_reason, methods,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::auth::{AuthError, Guards, MAX_BEARER_BYTES, Principal};
use crate::card::{CARD_PATH, CardSigner, build_card};
use crate::push::{self, PushOptions};
use crate::skills::{Risk, Skills};
use crate::tasks::{self, Agent, Begun, EventTx};
use loams_platform::Store;

/// Largest request body; a skill call is a few KiB, this leaves room for file contents.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// Longest message id (= task id). Store keys are at most `limits::MAX_KEY` (512 bytes); the agent name and
/// the caller's hash (`task_item_id`) must still fit.
pub const MAX_MESSAGE_ID: usize = 256;
/// Item kind of stored tasks (docs/contracts.md).
pub const TASK_KIND: &str = "a2a_task";
/// Message metadata key naming the settled approval of a gated call.
pub const APPROVAL_ID_KEY: &str = "approval_id";
/// The extension on the extended card that tells an authenticated caller its limits.
pub const CALLER_LIMITS_EXTENSION: &str = "https://loams.dev/a2a/extensions/caller-limits/v1";
/// Content type of HTTP+JSON bodies (A2A 1.0.1 §11).
pub const A2A_JSON: &str = "application/a2a+json";

const CARD_MAX_AGE: &str = "max-age=300";
/// Missing `A2A-Version` means 0.3 (A2A §3.6).
const IMPLICIT_VERSION: &str = "0.3";
/// Events buffered per stream before the producer waits for the client.
const STREAM_BUFFER: usize = 16;
/// Longest query string of an HTTP+JSON request.
const MAX_QUERY_BYTES: usize = 4096;

/// Tuning of the server. The defaults suit production; tests shorten them.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// How long a claimed message id stays "in progress" if the process dies mid-skill; after that a
    /// repeat runs the skill again (the skills look up what a lost call may have made before making it
    /// again, where the app allows; a chat message can still be posted twice) and the task may be
    /// canceled. A skill is cut off at four fifths of it, so store writes after the
    /// skill still fit in the lease.
    pub claim_lease: Duration,
    /// How often a subscription re-reads its task from the store.
    pub poll_interval: Duration,
    /// Longest a single subscription stream stays open; the client subscribes again after it.
    pub max_follow: Duration,
    /// Delivery of push notifications.
    pub push: PushOptions,
    /// Conformance mode for the official A2A TCK, off by default: messages whose id starts with
    /// `tck-` or `test-resubscribe-` play the TCK's scripted scenarios (complete, artifacts,
    /// message reply, input-required, reject, streams, a task that stays WORKING for 4 s) instead
    /// of calling a skill, and may continue their task by `taskId`. Skill calls are unchanged.
    /// Never enable it in production: it lets any authenticated caller create tasks that run no
    /// skill. See docs/conformance.md.
    pub conformance: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            claim_lease: Duration::from_secs(5 * 60),
            poll_interval: Duration::from_millis(250),
            max_follow: Duration::from_secs(6 * 60),
            push: PushOptions::default(),
            conformance: false,
        }
    }
}

impl ServerOptions {
    pub(crate) fn skill_timeout(&self) -> Duration {
        self.claim_lease * 4 / 5
    }
}

pub(crate) struct CardDoc {
    json: Bytes,
    etag: HeaderValue,
    last_modified: HeaderValue,
}

/// The agent's HTTP surface with default [`ServerOptions`]; see [`router_with`].
pub fn router(
    skills: Arc<dyn Skills>,
    store: Arc<dyn Store>,
    org: String,
    signer: CardSigner,
    base_url: String,
    guards: Guards,
) -> Router {
    router_with(
        skills,
        store,
        org,
        signer,
        base_url,
        guards,
        ServerOptions::default(),
    )
}

/// The agent's HTTP surface: `GET /.well-known/agent-card.json`, JSON-RPC at `POST /` and the
/// HTTP+JSON routes (`/message:send`, `/message:stream`, `/tasks`, `/tasks/{id}`,
/// `/tasks/{id}:cancel`, `/tasks/{id}:subscribe`, `/extendedAgentCard`, each also under
/// `/tasks/{id}/pushNotificationConfigs[/{configId}]`, each also under `/{tenant}/` where the
/// tenant is the org), all with or without a trailing slash. `base_url` is
/// where this router is reachable (the card's interface URL of both bindings and the audience
/// callers' tokens must name); `guards` authenticate callers and gate destructive skills.
pub fn router_with(
    skills: Arc<dyn Skills>,
    store: Arc<dyn Store>,
    org: String,
    signer: CardSigner,
    base_url: String,
    guards: Guards,
    options: ServerOptions,
) -> Router {
    let spec = skills.card();
    let audience = base_url.trim_end_matches('/').to_string();
    let card = build_card(&spec, &audience);
    let card_doc = render_card(&signer, &card);
    if let Err(e) = &card_doc {
        tracing::error!(agent = %spec.name, error = %e, "agent card could not be signed");
    }
    let agent = Agent {
        push_client: OnceLock::new(),
        risks: spec.skills.iter().map(|s| (s.id.clone(), s.risk)).collect(),
        name: spec.name,
        skills,
        store,
        org,
        audience,
        auth: guards.auth,
        gate: guards.gate,
        card,
        signer,
        card_doc,
        options,
    };
    Router::new()
        .fallback(serve)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(Arc::new(agent))
}

fn render_card(signer: &CardSigner, card: &a2a::AgentCard) -> Result<CardDoc, String> {
    let signed = signer.sign(card).map_err(|e| e.to_string())?;
    let json = serde_json::to_vec(&signed).map_err(|e| e.to_string())?;
    let hex = crate::tasks::sha256_hex(&json);
    let etag = HeaderValue::from_str(&format!("\"{}\"", &hex[..32])).map_err(|e| e.to_string())?;
    let now = chrono::Utc::now()
        .format("%a, %d %b %Y %H:%M:%S GMT")
        .to_string();
    let last_modified = HeaderValue::from_str(&now).map_err(|e| e.to_string())?;
    Ok(CardDoc {
        json: Bytes::from(json),
        etag,
        last_modified,
    })
}

fn serve_card(agent: &Agent, headers: &HeaderMap) -> Response {
    let doc = match &agent.card_doc {
        Ok(doc) => doc,
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    let cache = [
        (
            header::CACHE_CONTROL,
            HeaderValue::from_static(CARD_MAX_AGE),
        ),
        (header::ETAG, doc.etag.clone()),
        (header::LAST_MODIFIED, doc.last_modified.clone()),
    ];
    let etag = doc.etag.as_bytes();
    let not_modified = headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|tag| {
            let tag = tag.trim_ascii();
            tag == etag || tag == b"*"
        });
    if not_modified {
        return (StatusCode::NOT_MODIFIED, cache).into_response();
    }
    let content_type = [(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    (StatusCode::OK, cache, content_type, doc.json.clone()).into_response()
}

/// The caller of this request, or why there is none. The token is taken from
/// `Authorization: Bearer <jwt>` only; a token of another organisation is as good as none.
async fn authenticate(agent: &Agent, headers: &HeaderMap) -> Result<Principal, AuthError> {
    let bearer = match headers.get(header::AUTHORIZATION) {
        None => None,
        Some(value) => {
            let value = value.to_str().map_err(|_| AuthError::Invalid)?;
            let (scheme, token) = value.split_once(' ').ok_or(AuthError::Invalid)?;
            let token = token.trim();
            if !scheme.eq_ignore_ascii_case("bearer")
                || token.is_empty()
                || token.len() > MAX_BEARER_BYTES
            {
                return Err(AuthError::Invalid);
            }
            Some(token)
        }
    };
    let principal = agent.auth.verify(bearer, &agent.audience).await?;
    if principal.org != agent.org || principal.subject.is_empty() {
        return Err(AuthError::Invalid);
    }
    Ok(principal)
}

/// The HTTP status of a refused or undecidable authentication: 401 with a Bearer challenge
/// (RFC 6750), or 503 when the verifier could not decide (the client may retry).
fn auth_status(e: &AuthError) -> (StatusCode, String) {
    match e {
        AuthError::Missing | AuthError::Invalid => (
            StatusCode::UNAUTHORIZED,
            format!("authentication required: {e}"),
        ),
        AuthError::Unavailable(why) => {
            tracing::error!(error = %why, "a2a caller authentication unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "caller authentication is unavailable".to_string(),
            )
        }
    }
}

fn with_challenge(mut resp: Response, status: StatusCode) -> Response {
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

fn check_version(headers: &HeaderMap, query: Option<&str>) -> Result<(), A2AError> {
    let from_header = headers
        .get(a2a::SVC_PARAM_VERSION)
        .map(|v| v.to_str().unwrap_or("").trim().to_string());
    let from_query = || {
        query_pairs(query?)
            .find_map(|(k, v)| (k == a2a::SVC_PARAM_VERSION).then(|| v.trim().to_string()))
    };
    let version = from_header.or_else(from_query).filter(|v| !v.is_empty());
    let version = version.as_deref().unwrap_or(IMPLICIT_VERSION);
    if version == a2a::VERSION {
        Ok(())
    } else {
        let shown: String = version.chars().take(16).collect();
        Err(A2AError::new(
            error_code::VERSION_NOT_SUPPORTED,
            format!("A2A version '{shown}' is not supported"),
        ))
    }
}

/// Bodies are JSON: `application/json` (JSON-RPC, and what many HTTP+JSON clients send) or
/// `application/a2a+json`. A request without a Content-Type is read as JSON.
fn check_content_type(headers: &HeaderMap) -> Result<(), A2AError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = value
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if essence == "application/json" || essence == A2A_JSON {
        Ok(())
    } else {
        Err(A2AError::new(
            error_code::CONTENT_TYPE_NOT_SUPPORTED,
            "the request body must be application/json or application/a2a+json",
        ))
    }
}

/// This agent serves one tenant, its org: a request naming another is refused.
fn check_tenant(agent: &Agent, tenant: Option<&str>) -> Result<(), A2AError> {
    match tenant {
        None | Some("") => Ok(()),
        Some(t) if t == agent.org => Ok(()),
        Some(_) => Err(A2AError::invalid_params("unknown tenant")),
    }
}

/// `key=value` pairs of a query string, percent-decoded; undecodable pairs are skipped.
fn query_pairs(query: &str) -> impl Iterator<Item = (String, String)> + '_ {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Some((percent_decode(k, true)?, percent_decode(v, true)?))
        })
}

/// RFC 3986 percent-decoding (and `+` as space in queries); `None` for bad escapes or non-UTF-8.
fn percent_decode(s: &str, plus_is_space: bool) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// One A2A operation, whichever binding carried it.
enum Call {
    Send(SendMessageRequest),
    Stream(SendMessageRequest),
    Get(GetTaskRequest),
    List(ListTasksRequest),
    Cancel(CancelTaskRequest),
    Subscribe(SubscribeToTaskRequest),
    ExtendedCard,
    CreatePush(TaskPushNotificationConfig),
    GetPush(GetTaskPushNotificationConfigRequest),
    ListPush(ListTaskPushNotificationConfigsRequest),
    DeletePush(DeleteTaskPushNotificationConfigRequest),
}

enum Reply {
    /// The result, serialised as JSON.
    Value(String),
    Events(mpsc::Receiver<Result<StreamResponse, A2AError>>),
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, A2AError> {
    serde_json::to_string(v).map_err(|e| A2AError::internal(format!("serialising the result: {e}")))
}

async fn execute(agent: &Arc<Agent>, caller: &Principal, call: Call) -> Result<Reply, A2AError> {
    let value = match call {
        Call::Send(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            let config = req.configuration.as_ref();
            let history = tasks::history_length(config.and_then(|c| c.history_length))?;
            let immediately = config.and_then(|c| c.return_immediately) == Some(true);
            let push = config.and_then(|c| c.task_push_notification_config.clone());
            let task = match tasks::begin(agent, caller, req.message, push, !immediately).await? {
                Begun::Stored(task) | Begun::Elsewhere(task) => task,
                Begun::Started(task, _) if immediately => task,
                Begun::Started(_, run) => tasks::finish(run).await?,
                Begun::Reply(message) => {
                    return Ok(Reply::Value(to_json(&SendMessageResponse::Message(
                        message,
                    ))?));
                }
            };
            to_json(&SendMessageResponse::Task(tasks::trim_history(
                task, history,
            )))?
        }
        Call::Stream(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            let config = req.configuration.as_ref();
            let history = tasks::history_length(config.and_then(|c| c.history_length))?;
            let push = config.and_then(|c| c.task_push_notification_config.clone());
            let begun = tasks::begin(agent, caller, req.message, push, false).await?;
            let (tx, rx) = mpsc::channel(STREAM_BUFFER);
            match begun {
                Begun::Stored(task) | Begun::Elsewhere(task) => {
                    spawn_follow(agent, caller, tasks::trim_history(task, history), tx)
                }
                Begun::Reply(message) => {
                    // Capacity is STREAM_BUFFER and the channel is fresh, so this cannot wait.
                    let _ = tx.try_send(Ok(StreamResponse::Message(message)));
                }
                Begun::Started(task, run) => {
                    tokio::spawn(tasks::stream_run(
                        tasks::trim_history(task, history),
                        run,
                        tx,
                    ));
                }
            }
            return Ok(Reply::Events(rx));
        }
        Call::Get(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            to_json(&tasks::get_task(agent, caller, &req.id, req.history_length).await?)?
        }
        Call::List(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            to_json(&tasks::list_tasks(agent, caller, &req).await?)?
        }
        Call::Cancel(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            to_json(&tasks::cancel_task(agent, caller, &req.id).await?)?
        }
        Call::Subscribe(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            let task = tasks::subscribable(agent, caller, &req.id).await?;
            let (tx, rx) = mpsc::channel(STREAM_BUFFER);
            spawn_follow(agent, caller, task, tx);
            return Ok(Reply::Events(rx));
        }
        Call::ExtendedCard => extended_card(agent, caller)?,
        Call::CreatePush(config) => {
            check_tenant(agent, config.tenant.as_deref())?;
            to_json(&push::create(agent, caller, config).await?)?
        }
        Call::GetPush(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            to_json(&push::get(agent, caller, &req).await?)?
        }
        Call::ListPush(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            to_json(&push::list(agent, caller, &req).await?)?
        }
        Call::DeletePush(req) => {
            check_tenant(agent, req.tenant.as_deref())?;
            push::delete(agent, caller, &req).await?;
            to_json(&json!({}))?
        }
    };
    Ok(Reply::Value(value))
}

fn spawn_follow(agent: &Arc<Agent>, caller: &Principal, first: a2a::Task, tx: EventTx) {
    tokio::spawn(tasks::follow(agent.clone(), caller.clone(), first, tx));
}

/// The card as this caller sees it: the public card plus the caller-limits extension, signed.
fn extended_card(agent: &Agent, caller: &Principal) -> Result<String, A2AError> {
    let mut card = agent.card.clone();
    let gated: Vec<Value> = agent
        .card
        .skills
        .iter()
        .filter(|s| agent.risks.get(&s.id) == Some(&Risk::Destructive))
        .map(|s| json!(s.id))
        .collect();
    let params: HashMap<String, Value> = [
        ("subject", json!(caller.subject)),
        ("org", json!(caller.org)),
        ("maxRequestBytes", json!(MAX_REQUEST_BYTES)),
        ("maxMessageIdBytes", json!(MAX_MESSAGE_ID)),
        (
            "skillTimeoutSeconds",
            json!(agent.options.skill_timeout().as_secs()),
        ),
        ("approvalRequiredSkills", Value::Array(gated)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // First, before the public card's extensions: callers look for it there.
    card.capabilities
        .extensions
        .get_or_insert_with(Vec::new)
        .insert(
            0,
            AgentExtension {
                uri: CALLER_LIMITS_EXTENSION.into(),
                description: Some("the limits that apply to the authenticated caller".into()),
                // `required` is a plain proto3 bool: false is its default and must be absent, or the
                // canonical form (and so the signature) differs from what ProtoJSON peers compute.
                required: None,
                params: Some(params),
            },
        );
    let signed = agent
        .signer
        .sign(&card)
        .map_err(|e| A2AError::internal(format!("signing the extended card: {e}")))?;
    to_json(&signed)
}

/// Every request: the card, JSON-RPC at the root, or an HTTP+JSON route.
async fn serve(
    State(agent): State<Arc<Agent>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().trim_end_matches('/');
    if path == CARD_PATH {
        return if method == Method::GET || method == Method::HEAD {
            serve_card(&agent, &headers)
        } else {
            StatusCode::METHOD_NOT_ALLOWED.into_response()
        };
    }
    if path.is_empty() {
        return if method == Method::POST {
            serve_jsonrpc(&agent, &headers, uri.query(), &body).await
        } else {
            StatusCode::METHOD_NOT_ALLOWED.into_response()
        };
    }
    serve_rest(&agent, &method, path, uri.query(), &headers, &body).await
}

// ---------------------------------------------------------------------------------------------
// JSON-RPC binding (A2A §9)
// ---------------------------------------------------------------------------------------------

fn rpc_response(status: StatusCode, resp: &JsonRpcResponse) -> Response {
    rpc_json(status, serde_json::to_string(resp))
}

/// A success response around the serialised `result`: [`JsonRpcResponse`] holds a `Value`, which would parse the
/// result again only to write it out.
fn rpc_success(id: &JsonRpcId, result: &str) -> Response {
    let body = serde_json::to_string(id)
        .map(|id| format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#));
    rpc_json(StatusCode::OK, body)
}

fn rpc_json(status: StatusCode, body: serde_json::Result<String>) -> Response {
    match body {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn rpc_error(id: JsonRpcId, e: &A2AError) -> Response {
    rpc_response(
        StatusCode::OK,
        &JsonRpcResponse::error(id, jsonrpc_error(e)),
    )
}

async fn serve_jsonrpc(
    agent: &Arc<Agent>,
    headers: &HeaderMap,
    query: Option<&str>,
    body: &[u8],
) -> Response {
    if let Err(e) = check_content_type(headers) {
        return rpc_error(JsonRpcId::Null, &e);
    }
    let value: Value = match parse_json(body) {
        Ok(v) => v,
        Err(e) => {
            return rpc_error(
                JsonRpcId::Null,
                &A2AError::parse_error(format!("invalid JSON: {e}")),
            );
        }
    };
    let (id, method, params) = match parse_envelope(value) {
        Ok(parts) => parts,
        Err((id, err)) => return rpc_error(id, &err),
    };
    let caller = match authenticate(agent, headers).await {
        Ok(caller) => caller,
        Err(e) => {
            // A2A 1.0 has no JSON-RPC code for it, so the body carries `-32600` (the request lacks
            // valid credentials) or `-32603`, and the HTTP status says what happened.
            let (status, message) = auth_status(&e);
            let err = if status == StatusCode::UNAUTHORIZED {
                A2AError::invalid_request(message)
            } else {
                A2AError::internal(message)
            };
            let resp = rpc_response(status, &JsonRpcResponse::error(id, jsonrpc_error(&err)));
            return with_challenge(resp, status);
        }
    };
    let outcome = match check_version(headers, query).and_then(|()| rpc_call(&method, params)) {
        Ok(call) => execute(agent, &caller, call).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(Reply::Value(result)) => rpc_success(&id, &result),
        Ok(Reply::Events(rx)) => sse(rx, move |item| {
            let resp = match item {
                Ok(event) => match serde_json::to_value(&event) {
                    Ok(v) => JsonRpcResponse::success(id.clone(), v),
                    Err(e) => JsonRpcResponse::error(
                        id.clone(),
                        jsonrpc_error(&A2AError::internal(e.to_string())),
                    ),
                },
                Err(e) => JsonRpcResponse::error(id.clone(), jsonrpc_error(&e)),
            };
            serde_json::to_string(&resp).unwrap_or_default()
        }),
        Err(e) => rpc_error(id, &e),
    }
}

/// Fields whose values are free JSON (`google.protobuf.Struct` / `Value`): their keys are data,
/// not proto field names, and are left as they are.
const FREE_JSON_FIELDS: [&str; 3] = ["data", "metadata", "params"];

/// ProtoJSON parsers accept a field by its proto name as well as its JSON name
/// (`task_id` = `taskId`); serde knows only the JSON name, so proto names are renamed first, in
/// place: an object is rebuilt only when one of its keys needs it, so most requests are read as
/// they came. A key given both ways keeps the JSON-name value.
fn proto_names_to_json(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if !FREE_JSON_FIELDS.contains(&key.as_str()) {
                    proto_names_to_json(v);
                }
            }
            if !map.keys().any(|key| key.contains('_')) {
                return;
            }
            let (snake, json): (Vec<_>, Vec<_>) = std::mem::take(map)
                .into_iter()
                .partition(|(key, _)| key.contains('_'));
            map.extend(json);
            for (key, v) in snake {
                map.entry(snake_to_camel(&key)).or_insert(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(proto_names_to_json),
        _ => {}
    }
}

fn snake_to_camel(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// A request body as JSON. serde_json's private keys are refused before the parse, which they could make
/// overflow the stack (see `loams_platform::has_serde_private_key`).
fn parse_json(body: &[u8]) -> Result<Value, String> {
    if loams_platform::has_serde_private_key(body) {
        return Err("an object key starts with serde_json's private prefix".into());
    }
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

fn parse_params<T: serde::de::DeserializeOwned>(mut params: Value) -> Result<T, A2AError> {
    proto_names_to_json(&mut params);
    serde_json::from_value(params)
        .map_err(|e| A2AError::invalid_params(format!("invalid params: {e}")))
}

fn rpc_call(method: &str, params: Value) -> Result<Call, A2AError> {
    Ok(match method {
        methods::SEND_MESSAGE => Call::Send(parse_params(params)?),
        methods::SEND_STREAMING_MESSAGE => Call::Stream(parse_params(params)?),
        methods::GET_TASK => Call::Get(parse_params(params)?),
        methods::LIST_TASKS => Call::List(parse_params(params)?),
        methods::CANCEL_TASK => Call::Cancel(parse_params(params)?),
        methods::SUBSCRIBE_TO_TASK => Call::Subscribe(parse_params(params)?),
        methods::GET_EXTENDED_AGENT_CARD => Call::ExtendedCard,
        methods::CREATE_PUSH_CONFIG => Call::CreatePush(parse_params(params)?),
        methods::GET_PUSH_CONFIG => Call::GetPush(parse_params(params)?),
        methods::LIST_PUSH_CONFIGS => Call::ListPush(parse_params(params)?),
        methods::DELETE_PUSH_CONFIG => Call::DeletePush(parse_params(params)?),
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(A2AError::method_not_found(&shown));
        }
    })
}

/// Splits a JSON-RPC 2.0 request into id, method and params, or says why it is not one.
fn parse_envelope(value: Value) -> Result<(JsonRpcId, String, Value), (JsonRpcId, A2AError)> {
    let Value::Object(mut obj) = value else {
        return Err((
            JsonRpcId::Null,
            A2AError::invalid_request("request must be a JSON object"),
        ));
    };
    let id = match obj.remove("id") {
        Some(Value::String(s)) => JsonRpcId::String(s),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(i) => JsonRpcId::Number(i),
            None => {
                return Err((
                    JsonRpcId::Null,
                    A2AError::invalid_request("id must be an integer or string"),
                ));
            }
        },
        Some(Value::Null) => JsonRpcId::Null,
        // Notifications (no id) get no answer in JSON-RPC; every A2A method has a result, so a
        // request without id is malformed here.
        None => return Err((JsonRpcId::Null, A2AError::invalid_request("missing id"))),
        Some(_) => {
            return Err((
                JsonRpcId::Null,
                A2AError::invalid_request("id must be an integer or string"),
            ));
        }
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((id, A2AError::invalid_request("jsonrpc must be \"2.0\"")));
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        _ => return Err((id, A2AError::invalid_request("method must be a string"))),
    };
    let params = match obj.remove("params") {
        None => Value::Object(Default::default()),
        Some(p @ Value::Object(_)) => p,
        Some(_) => return Err((id, A2AError::invalid_params("params must be an object"))),
    };
    Ok((id, method, params))
}

/// An SSE response: one `data:` line per event, rendered by `render`; the stream ends when the
/// producer does. Keep-alive comments stop proxies from cutting a quiet subscription.
fn sse<F>(rx: mpsc::Receiver<Result<StreamResponse, A2AError>>, render: F) -> Response
where
    F: Fn(Result<StreamResponse, A2AError>) -> String + Send + 'static,
{
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .map(move |item| Ok::<_, Infallible>(Event::default().data(render(item))));
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// HTTP+JSON binding (A2A §11)
// ---------------------------------------------------------------------------------------------

/// The HTTP status of an error (A2A §5.4; the JSON-RPC standard codes as AIP-193 maps them).
fn http_status(code: i32) -> StatusCode {
    match code {
        error_code::TASK_NOT_FOUND => StatusCode::NOT_FOUND,
        error_code::TASK_NOT_CANCELABLE => StatusCode::CONFLICT,
        error_code::CONTENT_TYPE_NOT_SUPPORTED => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        error_code::INVALID_AGENT_RESPONSE => StatusCode::BAD_GATEWAY,
        error_code::PUSH_NOTIFICATION_NOT_SUPPORTED
        | error_code::UNSUPPORTED_OPERATION
        | error_code::EXTENDED_CARD_NOT_CONFIGURED
        | error_code::EXTENSION_SUPPORT_REQUIRED
        | error_code::VERSION_NOT_SUPPORTED
        | error_code::PARSE_ERROR
        | error_code::INVALID_REQUEST
        | error_code::INVALID_PARAMS => StatusCode::BAD_REQUEST,
        error_code::METHOD_NOT_FOUND => StatusCode::NOT_FOUND,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The gRPC status name of an error (google.rpc.Status `status`, A2A §5.4).
fn grpc_status(code: i32) -> &'static str {
    match code {
        error_code::TASK_NOT_FOUND => "NOT_FOUND",
        error_code::TASK_NOT_CANCELABLE
        | error_code::EXTENDED_CARD_NOT_CONFIGURED
        | error_code::EXTENSION_SUPPORT_REQUIRED => "FAILED_PRECONDITION",
        error_code::PUSH_NOTIFICATION_NOT_SUPPORTED
        | error_code::UNSUPPORTED_OPERATION
        | error_code::VERSION_NOT_SUPPORTED
        | error_code::METHOD_NOT_FOUND => "UNIMPLEMENTED",
        error_code::CONTENT_TYPE_NOT_SUPPORTED
        | error_code::PARSE_ERROR
        | error_code::INVALID_REQUEST
        | error_code::INVALID_PARAMS => "INVALID_ARGUMENT",
        _ => "INTERNAL",
    }
}

/// Whether `code` is one of the A2A errors of §3.3.2 (-32001..=-32009), which carry an ErrorInfo
/// with their reason; the JSON-RPC standard codes have no A2A reason.
fn is_a2a_error(code: i32) -> bool {
    (error_code::VERSION_NOT_SUPPORTED..=error_code::TASK_NOT_FOUND).contains(&code)
}

/// The JSON-RPC error object: A2A errors with their ErrorInfo, standard ones without `data`.
fn jsonrpc_error(e: &A2AError) -> a2a::JsonRpcError {
    let mut err = e.to_jsonrpc_error();
    if !is_a2a_error(e.code) {
        err.data = None;
    }
    err
}

/// The google.rpc.Status error object (the body of an error response and of a failed stream event).
fn status_body(http: StatusCode, status: &str, message: &str, reason: Option<&str>) -> Value {
    let details: Vec<Value> = reason
        .map(|r| {
            json!({
                "@type": a2a::ERROR_INFO_TYPE,
                "reason": r,
                "domain": a2a::PROTOCOL_DOMAIN,
                "metadata": {},
            })
        })
        .into_iter()
        .collect();
    json!({"error": {"code": http.as_u16(), "status": status, "message": message, "details": details}})
}

fn a2a_json(status: StatusCode, media: &'static str, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, media)], body).into_response()
}

/// The media type of HTTP+JSON responses: `application/a2a+json` (A2A 1.0.1 §11) for a client
/// that names it in `Accept` or `Content-Type`, else `application/json`, which v1.0.0 required
/// and which clients of either version read.
fn response_media(headers: &HeaderMap) -> &'static str {
    let names_a2a = |name: header::HeaderName| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .unwrap_or("")
                .to_ascii_lowercase()
                .contains(A2A_JSON)
        })
    };
    if names_a2a(header::ACCEPT) || names_a2a(header::CONTENT_TYPE) {
        A2A_JSON
    } else {
        "application/json"
    }
}

fn rest_error_body(e: &A2AError) -> (StatusCode, Value) {
    let http = http_status(e.code);
    let body = status_body(
        http,
        grpc_status(e.code),
        &e.message,
        Some(error_reason(e.code)),
    );
    (http, body)
}

fn rest_error(e: &A2AError, media: &'static str) -> Response {
    let (http, body) = rest_error_body(e);
    a2a_json(http, media, body.to_string())
}

/// First path segments of the HTTP+JSON routes; anything else in front of them is a tenant.
const ROUTE_HEADS: [&str; 4] = [
    "message:send",
    "message:stream",
    "tasks",
    "extendedAgentCard",
];

async fn serve_rest(
    agent: &Arc<Agent>,
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let media = response_media(headers);
    let not_found = || {
        a2a_json(
            StatusCode::NOT_FOUND,
            media,
            status_body(StatusCode::NOT_FOUND, "NOT_FOUND", "no such route", None).to_string(),
        )
    };
    let Some(segments) = path
        .trim_start_matches('/')
        .split('/')
        .map(|s| percent_decode(s, false))
        .collect::<Option<Vec<String>>>()
    else {
        return not_found();
    };
    let (tenant, route) = match segments.split_first() {
        Some((head, rest)) if !ROUTE_HEADS.contains(&head.as_str()) && !rest.is_empty() => {
            (Some(head.clone()), rest)
        }
        _ => (None, segments.as_slice()),
    };
    if query.is_some_and(|q| q.len() > MAX_QUERY_BYTES) {
        return rest_error(&A2AError::invalid_request("query string too long"), media);
    }
    let route: Vec<&str> = route.iter().map(String::as_str).collect();
    let call = match rest_route(method, &route, query, body) {
        Some(Ok(call)) => call,
        Some(Err(e)) => return rest_error(&e, media),
        None => return not_found(),
    };
    if method == Method::POST
        && let Err(e) = check_content_type(headers)
    {
        return rest_error(&e, media);
    }
    let caller = match authenticate(agent, headers).await {
        Ok(caller) => caller,
        Err(e) => {
            let (status, message) = auth_status(&e);
            let name = if status == StatusCode::UNAUTHORIZED {
                "UNAUTHENTICATED"
            } else {
                "UNAVAILABLE"
            };
            let body = status_body(status, name, &message, None).to_string();
            let resp = a2a_json(status, media, body);
            return with_challenge(resp, status);
        }
    };
    let checked =
        check_version(headers, query).and_then(|()| check_tenant(agent, tenant.as_deref()));
    let outcome = match checked {
        Ok(()) => execute(agent, &caller, call).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(Reply::Value(v)) => a2a_json(StatusCode::OK, media, v),
        Ok(Reply::Events(rx)) => sse(rx, |item| match item {
            Ok(event) => serde_json::to_string(&event).unwrap_or_default(),
            Err(e) => rest_error_body(&e).1.to_string(),
        }),
        Err(e) => rest_error(&e, media),
    }
}

/// The operation a REST route names, `None` for no route, `Some(Err)` for a bad request to one.
fn rest_route(
    method: &Method,
    route: &[&str],
    query: Option<&str>,
    body: &[u8],
) -> Option<Result<Call, A2AError>> {
    let json_body = || -> Result<SendMessageRequest, A2AError> {
        let value = parse_json(body)
            .map_err(|e| A2AError::invalid_params(format!("invalid request body: {e}")))?;
        parse_params(value)
    };
    let params: Vec<(String, String)> = query.map(|q| query_pairs(q).collect()).unwrap_or_default();
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    Some(match (method.clone(), route) {
        (Method::POST, ["message:send"]) => json_body().map(Call::Send),
        (Method::POST, ["message:stream"]) => json_body().map(Call::Stream),
        (Method::GET, ["tasks"]) => list_request(&param).map(Call::List),
        (Method::GET, ["extendedAgentCard"]) => Ok(Call::ExtendedCard),
        (Method::GET | Method::POST, ["tasks", action]) if action.ends_with(":subscribe") => {
            Ok(Call::Subscribe(SubscribeToTaskRequest {
                id: action.trim_end_matches(":subscribe").to_string(),
                tenant: None,
            }))
        }
        (Method::POST, ["tasks", action]) if action.ends_with(":cancel") => {
            Ok(Call::Cancel(CancelTaskRequest {
                id: action.trim_end_matches(":cancel").to_string(),
                metadata: None,
                tenant: None,
            }))
        }
        (Method::GET, ["tasks", id]) => int_param(&param, "historyLength").map(|history_length| {
            Call::Get(GetTaskRequest {
                id: (*id).to_string(),
                history_length,
                tenant: None,
            })
        }),
        (Method::POST, ["tasks", task, "pushNotificationConfigs"]) => parse_json(body)
            .map_err(|e| A2AError::invalid_params(format!("invalid request body: {e}")))
            .and_then(parse_params::<TaskPushNotificationConfig>)
            .map(|mut config| {
                config.task_id = (*task).to_string();
                Call::CreatePush(config)
            }),
        (Method::GET, ["tasks", task, "pushNotificationConfigs"]) => int_param(&param, "pageSize")
            .map(|page_size| {
                Call::ListPush(ListTaskPushNotificationConfigsRequest {
                    task_id: (*task).to_string(),
                    page_size,
                    page_token: param("pageToken").map(str::to_string),
                    tenant: None,
                })
            }),
        (Method::GET, ["tasks", task, "pushNotificationConfigs", id]) => {
            Ok(Call::GetPush(GetTaskPushNotificationConfigRequest {
                task_id: (*task).to_string(),
                id: (*id).to_string(),
                tenant: None,
            }))
        }
        (Method::DELETE, ["tasks", task, "pushNotificationConfigs", id]) => {
            Ok(Call::DeletePush(DeleteTaskPushNotificationConfigRequest {
                task_id: (*task).to_string(),
                id: (*id).to_string(),
                tenant: None,
            }))
        }
        _ => return None,
    })
}

fn int_param<'a>(
    param: &impl Fn(&str) -> Option<&'a str>,
    name: &str,
) -> Result<Option<i32>, A2AError> {
    param(name)
        .map(|v| {
            v.parse::<i32>()
                .map_err(|_| A2AError::invalid_params(format!("{name} must be an integer")))
        })
        .transpose()
}

fn list_request<'a>(
    param: &impl Fn(&str) -> Option<&'a str>,
) -> Result<ListTasksRequest, A2AError> {
    let status = param("status")
        .map(|s| {
            serde_json::from_value::<TaskState>(json!(s))
                .map_err(|_| A2AError::invalid_params(format!("unknown status {s:?}")))
        })
        .transpose()?;
    let after = param("statusTimestampAfter")
        .map(|t| {
            chrono::DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&chrono::Utc))
                .map_err(|_| A2AError::invalid_params("statusTimestampAfter must be RFC 3339"))
        })
        .transpose()?;
    let include_artifacts = param("includeArtifacts")
        .map(|b| match b {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(A2AError::invalid_params(
                "includeArtifacts must be true or false",
            )),
        })
        .transpose()?;
    Ok(ListTasksRequest {
        context_id: param("contextId").map(str::to_string),
        status,
        page_size: int_param(param, "pageSize")?,
        page_token: param("pageToken").map(str::to_string),
        history_length: int_param(param, "historyLength")?,
        status_timestamp_after: after,
        include_artifacts,
        tenant: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_field_names_are_read_as_json_names_outside_free_json() {
        let free = json!({"messageId": "m", "parts": [{"data": {"issue_id": 7}}], "metadata": {"approval_id": "a"}});
        let mut same = free.clone();
        proto_names_to_json(&mut same);
        assert_eq!(same, free, "keys of free JSON are data");
        let mut nested = json!({"message": {"parts": [{"media_type": "x"}]}});
        proto_names_to_json(&mut nested);
        assert_eq!(nested, json!({"message": {"parts": [{"mediaType": "x"}]}}));
        let mut got = json!({
            "task_id": "t",
            "history_length": 1,
            "message": {"message_id": "m", "parts": [{"data": {"issue_id": 7}}],
                        "metadata": {"approval_id": "a"}},
            "context_id": "snake",
            "contextId": "camel",
        });
        proto_names_to_json(&mut got);
        assert_eq!(got["taskId"], "t");
        assert_eq!(got["historyLength"], 1);
        assert_eq!(got["message"]["messageId"], "m");
        assert_eq!(got["message"]["parts"][0]["data"]["issue_id"], 7);
        assert_eq!(got["message"]["metadata"]["approval_id"], "a");
        assert_eq!(got["contextId"], "camel");
        assert!(got.get("task_id").is_none());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%3Ab+c", true).as_deref(), Some("a:b c"));
        assert_eq!(percent_decode("a%3Ab+c", false).as_deref(), Some("a:b+c"));
        assert_eq!(percent_decode("%zz", false), None);
        assert_eq!(percent_decode("%4", false), None);
    }

    #[test]
    fn every_a2a_error_has_its_http_and_grpc_status() {
        // A2A §5.4.
        let table = [
            (error_code::TASK_NOT_FOUND, 404, "NOT_FOUND"),
            (error_code::TASK_NOT_CANCELABLE, 409, "FAILED_PRECONDITION"),
            (
                error_code::PUSH_NOTIFICATION_NOT_SUPPORTED,
                400,
                "UNIMPLEMENTED",
            ),
            (error_code::UNSUPPORTED_OPERATION, 400, "UNIMPLEMENTED"),
            (
                error_code::CONTENT_TYPE_NOT_SUPPORTED,
                415,
                "INVALID_ARGUMENT",
            ),
            (error_code::INVALID_AGENT_RESPONSE, 502, "INTERNAL"),
            (
                error_code::EXTENDED_CARD_NOT_CONFIGURED,
                400,
                "FAILED_PRECONDITION",
            ),
            (
                error_code::EXTENSION_SUPPORT_REQUIRED,
                400,
                "FAILED_PRECONDITION",
            ),
            (error_code::VERSION_NOT_SUPPORTED, 400, "UNIMPLEMENTED"),
            (error_code::INVALID_PARAMS, 400, "INVALID_ARGUMENT"),
            (error_code::INTERNAL_ERROR, 500, "INTERNAL"),
        ];
        for (code, http, status) in table {
            let (got_http, body) = rest_error_body(&A2AError::new(code, "x"));
            assert_eq!(got_http.as_u16(), http, "{code}");
            assert_eq!(body["error"]["status"], status, "{code}");
            assert_eq!(body["error"]["code"], http, "{code}");
            assert_eq!(
                body["error"]["details"][0]["reason"],
                error_reason(code),
                "{code}"
            );
        }
    }
}
