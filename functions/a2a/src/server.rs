//! The A2A 1.0 server: the signed card and a JSON-RPC endpoint (`SendMessage`, `GetTask`,
//! `CancelTask`) whose tasks live in the platform `Store`, deduplicated on the message id.
//!
//! Every JSON-RPC call needs a bearer token the host's [`CallerAuth`] accepts for this agent's URL
//! (the card stays public). A task is bound to the call that created it (skill and canonical args)
//! and to its caller: a reused message id with another call is refused, and only the creator may
//! read or cancel the task. A destructive skill runs only when the host's [`ApprovalGate`] admits
//! the approval named in the message metadata (`approval_id`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use a2a::{
    A2AError, Artifact, CancelTaskRequest, GetTaskRequest, JsonRpcId, JsonRpcResponse, Message,
    PartContent, Role, SendMessageRequest, SendMessageResponse, Task, TaskState, TaskStatus,
    error_code, methods,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use loams_platform::{Claim, Cond, Item, Store, StoreError, limits};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::auth::{
    ApprovalGate, AuthError, CallerAuth, GateError, Guards, MAX_BEARER_BYTES, Principal,
};
use crate::card::{CARD_PATH, CardSigner, build_card};
use crate::skills::{Risk, SkillError, Skills};

/// Largest JSON-RPC request body; a skill call is a few KiB, this leaves room for file contents.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// Longest message id (= task id). Store keys are at most `limits::MAX_KEY`; the agent name and the
/// kind prefix must still fit.
pub const MAX_MESSAGE_ID: usize = 256;
/// Item kind of stored tasks (docs/contracts.md).
pub const TASK_KIND: &str = "a2a_task";
/// How long a claimed message id stays "in progress" if the process dies mid-skill; after that a
/// repeat runs the skill again (skills are create-if-absent, so a second run is safe).
const CLAIM_LEASE_MS: u64 = 5 * 60 * 1000;
/// Longest skill run, safely inside the lease (store writes after the skill still need time).
const SKILL_TIMEOUT: Duration = Duration::from_secs(4 * 60);
const CARD_MAX_AGE: &str = "max-age=300";
/// Missing `A2A-Version` means 0.3 (A2A §3.6).
const IMPLICIT_VERSION: &str = "0.3";
/// Message metadata key naming the settled approval of a gated call.
pub const APPROVAL_ID_KEY: &str = "approval_id";

struct Agent {
    skills: Arc<dyn Skills>,
    store: Arc<dyn Store>,
    org: String,
    name: String,
    /// The card's skills and their risk: the risk decides whether a call needs an approval.
    risks: HashMap<String, Risk>,
    /// This agent's interface URL, the audience its callers' tokens must name.
    audience: String,
    auth: Arc<dyn CallerAuth>,
    gate: Arc<dyn ApprovalGate>,
    /// The signed card, rendered once; `Err` keeps the reason signing failed so the card endpoint
    /// reports it instead of serving an unsigned card.
    card: Result<CardDoc, String>,
}

struct CardDoc {
    json: Bytes,
    etag: HeaderValue,
    last_modified: HeaderValue,
}

/// The agent's HTTP surface: `GET /.well-known/agent-card.json` and JSON-RPC at `POST /`.
/// `base_url` is where this router is reachable (it becomes the card's JSON-RPC interface URL and
/// the audience callers' tokens must name); `guards` authenticate callers and gate destructive
/// skills.
pub fn router(
    skills: Arc<dyn Skills>,
    store: Arc<dyn Store>,
    org: String,
    signer: CardSigner,
    base_url: String,
    guards: Guards,
) -> Router {
    let spec = skills.card();
    let audience = base_url.trim_end_matches('/').to_string();
    let card = render_card(&signer, &spec, &audience);
    if let Err(e) = &card {
        tracing::error!(agent = %spec.name, error = %e, "agent card could not be signed");
    }
    let agent = Agent {
        risks: spec.skills.iter().map(|s| (s.id.clone(), s.risk)).collect(),
        name: spec.name,
        skills,
        store,
        org,
        audience,
        auth: guards.auth,
        gate: guards.gate,
        card,
    };
    Router::new()
        .route(CARD_PATH, get(serve_card))
        .route("/", post(serve_rpc))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(Arc::new(agent))
}

fn render_card(
    signer: &CardSigner,
    spec: &crate::skills::AgentSpec,
    base_url: &str,
) -> Result<CardDoc, String> {
    let signed = signer
        .sign(&build_card(spec, base_url))
        .map_err(|e| e.to_string())?;
    let json = serde_json::to_vec(&signed).map_err(|e| e.to_string())?;
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &json);
    let hex: String = digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let etag = HeaderValue::from_str(&format!("\"{hex}\"")).map_err(|e| e.to_string())?;
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

async fn serve_card(State(agent): State<Arc<Agent>>, headers: HeaderMap) -> Response {
    let doc = match &agent.card {
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

/// A JSON-RPC failure before or during dispatch, answered with the request's id.
struct RpcFailure(A2AError);

impl From<A2AError> for RpcFailure {
    fn from(e: A2AError) -> Self {
        RpcFailure(e)
    }
}

fn store_failure(e: StoreError) -> RpcFailure {
    tracing::error!(error = %e, "a2a task store");
    // The message is generic on purpose: backend details are not the caller's business.
    RpcFailure(A2AError::internal("task store unavailable"))
}

fn rpc_response(resp: JsonRpcResponse) -> Response {
    rpc_response_with(StatusCode::OK, resp)
}

fn rpc_response_with(status: StatusCode, resp: JsonRpcResponse) -> Response {
    match serde_json::to_vec(&resp) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// A refused or undecidable authentication, answered before anything runs. A2A 1.0 has no
/// JSON-RPC code for it, so the body carries `-32600` (invalid request: the request lacks valid
/// credentials) and the HTTP status says what happened: 401 with a Bearer challenge (RFC 6750),
/// or 503 when the verifier could not decide (the client may retry).
fn auth_failure(id: JsonRpcId, e: &AuthError) -> Response {
    let (status, message) = match e {
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
    };
    let err = if status == StatusCode::UNAUTHORIZED {
        A2AError::invalid_request(message)
    } else {
        A2AError::internal(message)
    };
    let mut resp = rpc_response_with(status, JsonRpcResponse::error(id, err.to_jsonrpc_error()));
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
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

async fn serve_rpc(
    State(agent): State<Arc<Agent>>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let err = A2AError::parse_error(format!("invalid JSON: {e}"));
            return rpc_response(JsonRpcResponse::error(
                JsonRpcId::Null,
                err.to_jsonrpc_error(),
            ));
        }
    };
    let (id, method, params) = match parse_envelope(value) {
        Ok(parts) => parts,
        Err((id, err)) => return rpc_response(JsonRpcResponse::error(id, err.to_jsonrpc_error())),
    };
    let caller = match authenticate(&agent, &headers).await {
        Ok(caller) => caller,
        Err(e) => return auth_failure(id, &e),
    };
    let outcome = match check_version(&headers, &uri) {
        Ok(()) => dispatch(&agent, &caller, &method, params).await,
        Err(e) => Err(RpcFailure(e)),
    };
    rpc_response(match outcome {
        Ok(result) => JsonRpcResponse::success(id, result),
        Err(RpcFailure(e)) => JsonRpcResponse::error(id, e.to_jsonrpc_error()),
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

fn check_version(headers: &HeaderMap, uri: &Uri) -> Result<(), A2AError> {
    let from_header = headers
        .get(a2a::SVC_PARAM_VERSION)
        .map(|v| v.to_str().unwrap_or("").trim().to_string());
    let from_query = || {
        uri.query()?.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == a2a::SVC_PARAM_VERSION).then(|| v.trim().to_string())
        })
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

async fn dispatch(
    agent: &Agent,
    caller: &Principal,
    method: &str,
    params: Value,
) -> Result<Value, RpcFailure> {
    let result = match method {
        methods::SEND_MESSAGE => {
            let req: SendMessageRequest = parse_params(params)?;
            let history =
                history_length(req.configuration.as_ref().and_then(|c| c.history_length))?;
            let task = send_message(agent, caller, req.message).await?;
            to_value(&SendMessageResponse::Task(trim_history(task, history)))?
        }
        methods::GET_TASK => {
            let req: GetTaskRequest = parse_params(params)?;
            let history = history_length(req.history_length)?;
            let task = own_task(agent, caller, &req.id).await?;
            to_value(&trim_history(task, history))?
        }
        methods::CANCEL_TASK => {
            let req: CancelTaskRequest = parse_params(params)?;
            let task = own_task(agent, caller, &req.id).await?;
            // A skill runs to completion inside one request: once it started, its effect on the app
            // cannot be withdrawn, so no task of ours is cancelable.
            let why = if task.status.state.is_terminal() {
                "is in a terminal state"
            } else {
                "is running a skill that cannot be interrupted"
            };
            return Err(A2AError::new(
                error_code::TASK_NOT_CANCELABLE,
                format!("task {} {why}", req.id),
            )
            .into());
        }
        methods::SEND_STREAMING_MESSAGE | methods::SUBSCRIBE_TO_TASK => {
            return Err(A2AError::unsupported_operation(
                "streaming is not supported by this agent",
            )
            .into());
        }
        methods::CREATE_PUSH_CONFIG
        | methods::GET_PUSH_CONFIG
        | methods::LIST_PUSH_CONFIGS
        | methods::DELETE_PUSH_CONFIG => {
            return Err(A2AError::push_notification_not_supported().into());
        }
        methods::LIST_TASKS | methods::GET_EXTENDED_AGENT_CARD => {
            return Err(A2AError::unsupported_operation(format!(
                "{method} is not supported by this agent"
            ))
            .into());
        }
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(A2AError::method_not_found(&shown).into());
        }
    };
    Ok(result)
}

fn parse_params<T: serde::de::DeserializeOwned>(params: Value) -> Result<T, RpcFailure> {
    serde_json::from_value(params)
        .map_err(|e| A2AError::invalid_params(format!("invalid params: {e}")).into())
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<Value, RpcFailure> {
    serde_json::to_value(v)
        .map_err(|e| A2AError::internal(format!("serialising the result: {e}")).into())
}

/// `None` = the whole history; negative lengths are a caller error.
fn history_length(n: Option<i32>) -> Result<Option<usize>, RpcFailure> {
    match n {
        None => Ok(None),
        Some(n) => usize::try_from(n)
            .map(Some)
            .map_err(|_| A2AError::invalid_params("historyLength must not be negative").into()),
    }
}

fn trim_history(mut task: Task, keep: Option<usize>) -> Task {
    if let Some(keep) = keep {
        task.history = task.history.and_then(|mut h| {
            let drop = h.len().saturating_sub(keep);
            h.drain(..drop);
            (!h.is_empty()).then_some(h)
        });
    }
    task
}

fn check_id(what: &str, id: &str) -> Result<(), RpcFailure> {
    if id.is_empty() || id.len() > MAX_MESSAGE_ID || id.chars().any(char::is_control) {
        return Err(A2AError::invalid_params(format!(
            "{what} must be 1..={MAX_MESSAGE_ID} bytes without control characters"
        ))
        .into());
    }
    Ok(())
}

/// The skill call carried by a message: exactly one data part `{"skill": "...", "args": {...}}`.
fn skill_call(message: &Message) -> Result<(String, Value), RpcFailure> {
    let bad = |why: &str| RpcFailure(A2AError::invalid_params(why.to_string()));
    let [part] = message.parts.as_slice() else {
        return Err(bad("the message must have exactly one part"));
    };
    let PartContent::Data(Value::Object(call)) = &part.content else {
        return Err(bad(
            "the message part must be a data part {\"skill\", \"args\"}",
        ));
    };
    let Some(Value::String(skill)) = call.get("skill") else {
        return Err(bad("the data part needs a string \"skill\""));
    };
    let Some(args @ Value::Object(_)) = call.get("args") else {
        return Err(bad("the data part needs an object \"args\""));
    };
    Ok((skill.clone(), args.clone()))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn status(state: TaskState, message: Option<Message>, at_ms: i64) -> TaskStatus {
    TaskStatus {
        state,
        message,
        timestamp: chrono::DateTime::from_timestamp_millis(at_ms),
    }
}

/// The task id is the message id itself: the message id is already the caller's unique,
/// deterministic key for this call, and GetTask can then find the stored item without an index.
fn item_id(agent: &Agent, task_id: &str) -> String {
    format!("{}:{task_id}", agent.name)
}

fn claim_key(agent: &Agent, task_id: &str) -> String {
    format!("{TASK_KIND}:{}", item_id(agent, task_id))
}

/// A stored task with what it is bound to. Kept beside the task (not in its metadata) so callers
/// never see the binding and cannot shape it.
#[derive(Serialize, Deserialize)]
struct StoredTask {
    task: Task,
    /// [`call_hash`] of the call that created the task.
    call: String,
    /// Subject of the caller that created the task.
    caller: String,
}

impl StoredTask {
    fn bound_to(&self, call: &str, caller: &Principal) -> bool {
        self.call == call && self.caller == caller.subject
    }
}

/// Hex SHA-256 over the RFC 8785 canonical form of `{"skill", "args"}`: the same call hashes the
/// same whatever its key order or whitespace.
fn call_hash(skill: &str, args: &Value) -> Result<String, RpcFailure> {
    let canonical = serde_json_canonicalizer::to_vec(&json!({"skill": skill, "args": args}))
        .map_err(|e| A2AError::invalid_params(format!("args cannot be canonicalised: {e}")))?;
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &canonical);
    Ok(digest.as_ref().iter().map(|b| format!("{b:02x}")).collect())
}

/// The task `task_id` if `caller` created it. Someone else's task answers exactly as a missing
/// one does, so task ids reveal nothing to other callers.
async fn own_task(agent: &Agent, caller: &Principal, task_id: &str) -> Result<Task, RpcFailure> {
    match load_task(agent, task_id).await? {
        Some(stored) if stored.caller == caller.subject => Ok(stored.task),
        _ => Err(A2AError::task_not_found(task_id).into()),
    }
}

async fn load_task(agent: &Agent, task_id: &str) -> Result<Option<StoredTask>, RpcFailure> {
    check_id("task id", task_id)?;
    let Some(item) = agent
        .store
        .get_item(&agent.org, TASK_KIND, &item_id(agent, task_id))
        .await
        .map_err(store_failure)?
    else {
        return Ok(None);
    };
    decode_task(&item.body).map(Some)
}

fn decode_task(bytes: &[u8]) -> Result<StoredTask, RpcFailure> {
    serde_json::from_slice(bytes).map_err(|e| {
        tracing::error!(error = %e, "stored a2a task does not decode");
        RpcFailure(A2AError::internal("stored task is unreadable"))
    })
}

/// The refusal of a reused message id: the stored task belongs to another call or caller and is not
/// shown.
fn reused(task_id: &str) -> RpcFailure {
    RpcFailure(A2AError::invalid_params(format!(
        "messageId {task_id} was already used for a different call"
    )))
}

/// The approval named in the message metadata, if any.
fn approval_id(message: &Message) -> Result<Option<String>, RpcFailure> {
    match message
        .metadata
        .as_ref()
        .and_then(|m| m.get(APPROVAL_ID_KEY))
    {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) => {
            check_id(APPROVAL_ID_KEY, id)?;
            Ok(Some(id.clone()))
        }
        Some(_) => Err(A2AError::invalid_params(format!(
            "metadata {APPROVAL_ID_KEY} must be a string"
        ))
        .into()),
    }
}

/// Whether a call may run: a destructive skill needs an approval the host admits for exactly this
/// call. `Ok(Err(_))` is a refusal (the task fails for good); `Err(_)` means nothing could be decided.
async fn gate(
    agent: &Agent,
    skill: &str,
    args: &Value,
    approval_id: Option<&str>,
) -> Result<Result<(), SkillError>, GateError> {
    if agent.risks.get(skill) != Some(&Risk::Destructive) {
        return Ok(Ok(()));
    }
    let refused = |why: String| {
        Ok(Err(SkillError::permanent(format!(
            "{}.{skill} refused: {why}",
            agent.name
        ))))
    };
    let Some(approval_id) = approval_id else {
        return refused(format!(
            "a destructive skill needs a settled approval (message metadata {APPROVAL_ID_KEY})"
        ));
    };
    match agent
        .gate
        .admit(&agent.org, &agent.name, skill, args, approval_id)
        .await
    {
        Ok(()) => Ok(Ok(())),
        Err(GateError::Refused(why)) => refused(format!("approval {approval_id}: {why}")),
        Err(e) => Err(e),
    }
}

async fn put_task(agent: &Agent, task: &Task, body: Vec<u8>) -> Result<(), StoreError> {
    let item = Item {
        org: agent.org.clone(),
        kind: TASK_KIND.to_string(),
        id: item_id(agent, &task.id),
        version: 0,
        index: None,
        body,
        expires_ms: None,
    };
    agent.store.put_item(&item, Cond::Any).await.map(|_| ())
}

/// SendMessage, exactly once per message id: claim the id, check the approval gate, run the skill,
/// store the finished task, finish the claim. A repeat of the same call by the same caller gets the
/// stored task (a WORKING one during the run); the id reused for another call or by another caller
/// is refused.
///
/// An approval binds agent, skill and args, not the message id: another message id carrying the
/// same approved call is admitted and repeats the identical action, which the app treats as a
/// no-op (merge of a merged PR answers the same merge sha, closing a closed PR stays closed). A
/// replay with the same message id is the dedupe case and runs nothing.
async fn send_message(
    agent: &Agent,
    caller: &Principal,
    message: Message,
) -> Result<Task, RpcFailure> {
    check_id("messageId", &message.message_id)?;
    if let Some(ctx) = &message.context_id {
        check_id("contextId", ctx)?;
    }
    if message.role != Role::User {
        return Err(A2AError::invalid_params("the message role must be ROLE_USER").into());
    }
    let (skill, args) = skill_call(&message)?;
    if !agent.risks.contains_key(&skill) {
        let shown: String = skill.chars().take(64).collect();
        return Err(A2AError::invalid_params(format!("unknown skill {shown:?}")).into());
    }
    let approval_id = approval_id(&message)?;
    let call = call_hash(&skill, &args)?;

    let task_id = message.message_id.clone();
    let context_id = message
        .context_id
        .clone()
        .unwrap_or_else(|| task_id.clone());
    let key = claim_key(agent, &task_id);
    let started = now_ms();
    let mut record = StoredTask {
        task: Task {
            id: task_id.clone(),
            context_id: context_id.clone(),
            status: status(TaskState::Working, None, started),
            artifacts: None,
            history: Some(vec![Message {
                task_id: Some(task_id.clone()),
                context_id: Some(context_id.clone()),
                ..message
            }]),
            metadata: None,
        },
        call,
        caller: caller.subject.clone(),
    };

    match agent
        .store
        .claim(&agent.org, &key, started, CLAIM_LEASE_MS)
        .await
        .map_err(store_failure)?
    {
        Claim::Done(bytes) => {
            let stored = decode_task(&bytes)?;
            return if stored.bound_to(&record.call, caller) {
                Ok(stored.task)
            } else {
                Err(reused(&task_id))
            };
        }
        Claim::InProgress => {
            // The running call stores its WORKING task right after claiming; until then there is
            // nothing to compare with, and echoing the caller's own message reveals nothing.
            return match load_task(agent, &task_id).await? {
                Some(stored) if !stored.bound_to(&record.call, caller) => Err(reused(&task_id)),
                _ => Ok(record.task),
            };
        }
        Claim::New => {}
    }
    // Make the running task visible to GetTask; a failure here is not worth aborting the call for.
    let working = storable(&mut record)?;
    if let Err(e) = put_task(agent, &record.task, working).await {
        tracing::warn!(error = %e, "storing the working a2a task");
    }

    let admitted = match gate(agent, &skill, &args, approval_id.as_deref()).await {
        Ok(admitted) => admitted,
        Err(e) => {
            // Nothing ran: give the message id back so the same call can be decided again.
            tracing::error!(error = %e, "a2a approval gate");
            if let Err(release) = agent.store.release(&agent.org, &key).await {
                tracing::warn!(error = %release, "releasing the a2a claim");
            }
            return Err(A2AError::internal("the approval check is unavailable").into());
        }
    };
    // A skill must end before its claim's lease does, or a repeat would run it a second time
    // alongside. Cut off, its effect is unknown: report it retryable (skills are create-if-absent).
    let outcome = match admitted {
        Err(refusal) => Err(refusal),
        Ok(()) => {
            match tokio::time::timeout(SKILL_TIMEOUT, agent.skills.invoke(&skill, args)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(SkillError::retryable(format!(
                    "the skill did not finish within {} s",
                    SKILL_TIMEOUT.as_secs()
                ))),
            }
        }
    };
    let finished = now_ms();
    let retryable_failure = matches!(&outcome, Err(e) if e.retryable);
    let task = &mut record.task;
    match outcome {
        Ok(output) => {
            task.status = status(TaskState::Completed, None, finished);
            task.artifacts = Some(vec![Artifact {
                artifact_id: format!("{task_id}:output"),
                name: Some("output".into()),
                description: None,
                parts: vec![a2a::Part::data(output)],
                metadata: None,
                extensions: None,
            }]);
        }
        Err(e) => {
            task.status = failed_status(&task_id, &context_id, &e.message, e.retryable, finished)
        }
    }
    let mut body = storable(&mut record)?;
    if body.len() > limits::MAX_BODY {
        // Too big to store means too big to dedupe; report it as a permanent failure of the call.
        let why = format!("skill output exceeds {} bytes", limits::MAX_BODY);
        record.task.artifacts = None;
        record.task.status = failed_status(&task_id, &context_id, &why, false, finished);
        body = storable(&mut record)?;
    }

    if let Err(e) = put_task(agent, &record.task, body.clone()).await {
        // The effect may have happened but is not recorded: let the next repeat run the skill again
        // (skills are create-if-absent) rather than wait out the lease.
        if let Err(release) = agent.store.release(&agent.org, &key).await {
            tracing::warn!(error = %release, "releasing the a2a claim");
        }
        return Err(store_failure(e));
    }
    if retryable_failure {
        // Nothing happened on the app's side, so the same message id may try again at once.
        agent
            .store
            .release(&agent.org, &key)
            .await
            .map_err(store_failure)?;
    } else {
        agent
            .store
            .finish(&agent.org, &key, &body, finished)
            .await
            .map_err(store_failure)?;
    }
    Ok(record.task)
}

/// The record's stored bytes. The history holds the request, which may be large (file contents
/// for a commit); when the record would not fit in a store item the history is dropped, since the
/// caller has the request anyway. Still too large is left to the caller to handle.
fn storable(record: &mut StoredTask) -> Result<Vec<u8>, RpcFailure> {
    let encode = |r: &StoredTask| {
        serde_json::to_vec(r).map_err(|e| RpcFailure(A2AError::internal(e.to_string())))
    };
    let body = encode(record)?;
    if body.len() <= limits::MAX_BODY || record.task.history.is_none() {
        return Ok(body);
    }
    record.task.history = None;
    encode(record)
}

fn failed_status(
    task_id: &str,
    context_id: &str,
    error: &str,
    retryable: bool,
    at_ms: i64,
) -> TaskStatus {
    let message = Message {
        message_id: format!("{task_id}:status"),
        context_id: Some(context_id.to_string()),
        task_id: Some(task_id.to_string()),
        role: Role::Agent,
        parts: vec![
            a2a::Part::text(error),
            a2a::Part::data(json!({"retryable": retryable})),
        ],
        metadata: None,
        extensions: None,
        reference_task_ids: None,
    };
    status(TaskState::Failed, Some(message), at_ms)
}
