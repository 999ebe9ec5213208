//! A2A 1.0 client over either binding: verifies the agent's signed card once, then speaks JSON-RPC
//! or HTTP+JSON to the interface the card names. [`A2aClient::call`] is the skill call of the
//! factory (message id = step id); the other methods are the plain protocol operations, with SSE
//! streams for SendStreamingMessage and SubscribeToTask and [`A2aClient::follow`] to wait for a
//! task across dropped streams.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use a2a::{
    AgentCard, CancelTaskRequest, GetTaskRequest, JsonRpcId, JsonRpcRequest, JsonRpcResponse,
    ListTasksRequest, ListTasksResponse, Message, Part, PartContent, Role, SendMessageRequest,
    SendMessageResponse, StreamResponse, SubscribeToTaskRequest, TRANSPORT_PROTOCOL_HTTP_JSON,
    TRANSPORT_PROTOCOL_JSONRPC, Task, TaskState, error_code, methods,
};
use futures::StreamExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::auth::TokenSource;
use crate::card::{CARD_PATH, CardError, Jwks, verify_card};
use crate::server::{A2A_JSON, APPROVAL_ID_KEY};
use crate::tasks::settled;

/// Largest agent card accepted.
const MAX_CARD_BYTES: usize = 64 * 1024;
/// Most subscriptions [`A2aClient::follow`] opens for one task before giving up.
const MAX_RESUBSCRIBES: u32 = 20;

/// Which A2A protocol binding the client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Binding {
    #[default]
    JsonRpc,
    HttpJson,
}

impl Binding {
    /// The card's `protocolBinding` name.
    pub fn name(self) -> &'static str {
        match self {
            Binding::JsonRpc => TRANSPORT_PROTOCOL_JSONRPC,
            Binding::HttpJson => TRANSPORT_PROTOCOL_HTTP_JSON,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Whole-request timeout of each unary HTTP call (card fetch, send, get, list, cancel).
    pub timeout: Duration,
    /// Longest a stream may stay open; [`A2aClient::follow`] subscribes again after it.
    pub stream_timeout: Duration,
    /// Largest response (or single stream event) accepted.
    pub max_response_bytes: usize,
    /// The binding to use; the card must offer it.
    pub binding: Binding,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Duration::from_secs(60),
            stream_timeout: Duration::from_secs(10 * 60),
            max_response_bytes: 2 * 1024 * 1024,
            binding: Binding::JsonRpc,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The agent could not be reached or did not answer in time; the call may be repeated with the
    /// same message id.
    #[error("transport: {0}")]
    Transport(String),
    /// The agent answered with an HTTP error that carries no A2A error.
    #[error("HTTP status {0}")]
    Http(u16),
    /// The agent's card is missing, unsigned, badly signed or unusable.
    #[error("agent card: {0}")]
    Card(#[from] CardError),
    /// The agent rejected the request with an A2A error (JSON-RPC code; HTTP+JSON errors are mapped
    /// to the same codes through their ErrorInfo reason).
    #[error("A2A error {code}: {message}")]
    Protocol { code: i32, message: String },
    /// The response was not a valid A2A answer.
    #[error("invalid agent response: {0}")]
    InvalidResponse(String),
    /// The skill ran and failed.
    #[error("skill failed: {message}")]
    Skill { message: String, retryable: bool },
    /// Another delivery of the same message id is still running; ask again later.
    #[error("task {0} is still in progress")]
    InProgress(String),
    /// The task stopped to wait for the caller (`TASK_STATE_INPUT_REQUIRED` or
    /// `TASK_STATE_AUTH_REQUIRED`); `message` is the agent's request.
    #[error("task {task_id} needs {}: {message}", if *.needs_auth { "authorization" } else { "input" })]
    Interrupted {
        task_id: String,
        needs_auth: bool,
        message: String,
    },
    /// The agent's card does not offer this (a binding, streaming, the extended card).
    #[error("not offered by the agent: {0}")]
    Unsupported(String),
    /// No bearer token could be had for the agent; nothing was sent.
    #[error("credentials: {0}")]
    Token(String),
}

impl CallError {
    /// Whether repeating the call (with the same message id) may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            // Nothing reached the agent without a token, so asking again is safe; a token source
            // over the network fails transiently.
            CallError::Transport(_) | CallError::InProgress(_) | CallError::Token(_) => true,
            CallError::Http(status) => *status >= 500 || *status == 408 || *status == 429,
            CallError::Protocol { code, .. } => *code == error_code::INTERNAL_ERROR,
            CallError::Skill { retryable, .. } => *retryable,
            CallError::Card(_)
            | CallError::InvalidResponse(_)
            | CallError::Interrupted { .. }
            | CallError::Unsupported(_) => false,
        }
    }
}

/// A transport error with its causes: reqwest's own message alone ("error decoding response body") hides what went
/// wrong. Without the URL: call errors reach run timelines, and a URL's query may carry caller data.
fn transport(e: reqwest::Error) -> CallError {
    CallError::Transport(loams_platform::with_causes(&e.without_url()))
}

fn invalid(e: impl std::fmt::Display) -> CallError {
    CallError::InvalidResponse(e.to_string())
}

#[derive(Clone)]
pub struct A2aClient {
    /// Builds every request, and sends it unless `local` serves it.
    http: reqwest::Client,
    /// The agent's own router when it runs in this process: requests go straight into it, without a loopback
    /// connection, and come back as the same responses.
    local: Option<axum::Router>,
    card: AgentCard,
    trusted: Jwks,
    endpoint: String,
    tenant: Option<String>,
    binding: Binding,
    options: ClientOptions,
    tokens: Option<Arc<dyn TokenSource>>,
    next_id: Arc<AtomicI64>,
}

impl std::fmt::Debug for A2aClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("A2aClient")
            .field("endpoint", &self.endpoint)
            .field("binding", &self.binding)
            .field("authenticated", &self.tokens.is_some())
            .finish_non_exhaustive()
    }
}

/// One operation in the terms of both bindings.
struct Op {
    method: &'static str,
    params: Value,
    http: reqwest::Method,
    /// Path below the interface URL (and tenant), already escaped.
    path: String,
    query: Vec<(&'static str, String)>,
    /// Whether the HTTP+JSON request carries `params` as its body.
    body: bool,
}

/// Escapes a path segment (RFC 3986 unreserved characters stay).
fn escape(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl A2aClient {
    /// Fetches the card from `base_url`, refuses it unless a key in `trusted` signed it, and picks
    /// its JSON-RPC 1.0 interface.
    pub async fn new(base_url: &str, trusted: &Jwks) -> Result<Self, CallError> {
        Self::with_options(base_url, trusted, ClientOptions::default()).await
    }

    /// As [`A2aClient::new`], with the binding and limits of `options`.
    pub async fn with_options(
        base_url: &str,
        trusted: &Jwks,
        options: ClientOptions,
    ) -> Result<Self, CallError> {
        Self::connect(base_url, trusted, options, None).await
    }

    /// A client of an agent served by `router` in this process at `base_url`: the same protocol, card check, tokens
    /// and time limits as over HTTP, with every request handed to the router instead of sent through a loopback
    /// connection.
    pub async fn in_process(
        base_url: &str,
        trusted: &Jwks,
        options: ClientOptions,
        router: axum::Router,
    ) -> Result<Self, CallError> {
        Self::connect(base_url, trusted, options, Some(router)).await
    }

    async fn connect(
        base_url: &str,
        trusted: &Jwks,
        options: ClientOptions,
        local: Option<axum::Router>,
    ) -> Result<Self, CallError> {
        let http = reqwest::Client::builder()
            .timeout(options.timeout)
            // The endpoint comes from a verified card; redirects would lead past that check.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(transport)?;
        let url = format!("{}{CARD_PATH}", base_url.trim_end_matches('/'));
        let resp = execute(local.as_ref(), http.get(&url), options.timeout).await?;
        if !resp.status().is_success() {
            return Err(CallError::Http(resp.status().as_u16()));
        }
        let bytes = read_limited(resp, MAX_CARD_BYTES).await?;
        let card: AgentCard = serde_json::from_slice(&bytes)
            .map_err(|e| CallError::Card(CardError::Malformed(e.to_string())))?;
        verify_card(&card, trusted)?;
        let binding = options.binding;
        let interface = card
            .supported_interfaces
            .iter()
            .find(|i| i.protocol_binding == binding.name() && i.protocol_version == a2a::VERSION)
            .ok_or_else(|| {
                CallError::Card(CardError::Malformed(format!(
                    "no {} 1.0 interface",
                    binding.name()
                )))
            })?;
        Ok(A2aClient {
            endpoint: interface.url.trim_end_matches('/').to_string(),
            tenant: interface.tenant.clone().filter(|t| !t.is_empty()),
            http,
            local,
            card,
            trusted: trusted.clone(),
            binding,
            options,
            tokens: None,
            next_id: Arc::new(AtomicI64::new(1)),
        })
    }

    /// Sends `Authorization: Bearer <token>` on every call, the token asked of `tokens` for this
    /// agent's interface URL (the audience the agent checks).
    pub fn with_tokens(mut self, tokens: Arc<dyn TokenSource>) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// The interface URL taken from the verified card.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn binding(&self) -> Binding {
        self.binding
    }

    /// The verified card.
    pub fn card(&self) -> &AgentCard {
        &self.card
    }

    /// Runs `skill` with `args` under `message_id` (the step id): repeats with the same id return
    /// the first outcome instead of running the skill again (a read skill may run again; the
    /// answer is still the first outcome). A gated call names its settled approval in the
    /// message metadata (`approval_id`), for the agent to check against the call.
    pub async fn call(
        &self,
        message_id: &str,
        skill: &str,
        args: Value,
        approval_id: Option<&str>,
    ) -> Result<Value, CallError> {
        let message = Message {
            message_id: message_id.to_string(),
            context_id: None,
            task_id: None,
            role: Role::User,
            parts: vec![Part::data(json!({"skill": skill, "args": args}))],
            metadata: approval_id.map(|id| [(APPROVAL_ID_KEY.to_string(), json!(id))].into()),
            extensions: None,
            reference_task_ids: None,
        };
        let request = SendMessageRequest {
            message,
            configuration: None,
            metadata: None,
            tenant: None,
        };
        match self.send(request).await? {
            SendMessageResponse::Task(task) => task_outcome(task),
            SendMessageResponse::Message(_) => Err(CallError::InvalidResponse(
                "expected a task, got a message".into(),
            )),
        }
    }

    /// SendMessage: blocks until the task settles unless the request's configuration asks for
    /// `returnImmediately`.
    pub async fn send(
        &self,
        mut request: SendMessageRequest,
    ) -> Result<SendMessageResponse, CallError> {
        request.tenant = request.tenant.or_else(|| self.tenant.clone());
        // The message id names the request, so a response to another request cannot pass for it.
        let id = JsonRpcId::String(request.message.message_id.clone());
        let op = Op {
            method: methods::SEND_MESSAGE,
            params: serde_json::to_value(&request).map_err(invalid)?,
            http: reqwest::Method::POST,
            path: "/message:send".into(),
            query: Vec::new(),
            body: true,
        };
        let value = self.unary(id, op).await?;
        serde_json::from_value(value).map_err(invalid)
    }

    /// SendStreamingMessage: the task (or message), then its updates until it settles.
    pub async fn send_streaming(
        &self,
        mut request: SendMessageRequest,
    ) -> Result<EventStream, CallError> {
        self.require_streaming()?;
        request.tenant = request.tenant.or_else(|| self.tenant.clone());
        let op = Op {
            method: methods::SEND_STREAMING_MESSAGE,
            params: serde_json::to_value(&request).map_err(invalid)?,
            http: reqwest::Method::POST,
            path: "/message:stream".into(),
            query: Vec::new(),
            body: true,
        };
        self.stream(op).await
    }

    /// GetTask, with at most `history_length` history messages if given.
    pub async fn get_task(&self, id: &str, history_length: Option<i32>) -> Result<Task, CallError> {
        let request = GetTaskRequest {
            id: id.to_string(),
            history_length,
            tenant: self.tenant.clone(),
        };
        let op = Op {
            method: methods::GET_TASK,
            params: serde_json::to_value(&request).map_err(invalid)?,
            http: reqwest::Method::GET,
            path: format!("/tasks/{}", escape(id)),
            query: history_length
                .map(|n| vec![("historyLength", n.to_string())])
                .unwrap_or_default(),
            body: false,
        };
        let value = self.unary(self.fresh_id(), op).await?;
        serde_json::from_value(value).map_err(invalid)
    }

    /// ListTasks: one page of the caller's tasks.
    pub async fn list_tasks(
        &self,
        mut request: ListTasksRequest,
    ) -> Result<ListTasksResponse, CallError> {
        request.tenant = request.tenant.or_else(|| self.tenant.clone());
        let mut query = Vec::new();
        if let Some(c) = &request.context_id {
            query.push(("contextId", c.clone()));
        }
        if let Some(s) = &request.status {
            let name = serde_json::to_value(s).map_err(invalid)?;
            query.push(("status", name.as_str().unwrap_or_default().to_string()));
        }
        if let Some(n) = request.page_size {
            query.push(("pageSize", n.to_string()));
        }
        if let Some(t) = &request.page_token {
            query.push(("pageToken", t.clone()));
        }
        if let Some(n) = request.history_length {
            query.push(("historyLength", n.to_string()));
        }
        if let Some(t) = request.status_timestamp_after {
            query.push((
                "statusTimestampAfter",
                t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ));
        }
        if let Some(b) = request.include_artifacts {
            query.push(("includeArtifacts", b.to_string()));
        }
        let op = Op {
            method: methods::LIST_TASKS,
            params: serde_json::to_value(&request).map_err(invalid)?,
            http: reqwest::Method::GET,
            path: "/tasks".into(),
            query,
            body: false,
        };
        let value = self.unary(self.fresh_id(), op).await?;
        serde_json::from_value(value).map_err(invalid)
    }

    /// CancelTask: the canceled task, or `Protocol { code: -32002 }` when it cannot be canceled.
    pub async fn cancel_task(&self, id: &str) -> Result<Task, CallError> {
        let request = CancelTaskRequest {
            id: id.to_string(),
            metadata: None,
            tenant: self.tenant.clone(),
        };
        let op = Op {
            method: methods::CANCEL_TASK,
            params: serde_json::to_value(&request).map_err(invalid)?,
            http: reqwest::Method::POST,
            path: format!("/tasks/{}:cancel", escape(id)),
            query: Vec::new(),
            body: false,
        };
        let value = self.unary(self.fresh_id(), op).await?;
        serde_json::from_value(value).map_err(invalid)
    }

    /// SubscribeToTask: the task as it is now, then its updates until it settles.
    pub async fn subscribe(&self, id: &str) -> Result<EventStream, CallError> {
        self.require_streaming()?;
        let request = SubscribeToTaskRequest {
            id: id.to_string(),
            tenant: self.tenant.clone(),
        };
        let op = Op {
            method: methods::SUBSCRIBE_TO_TASK,
            params: serde_json::to_value(&request).map_err(invalid)?,
            // The proto maps SubscribeToTask to GET (the spec prose says POST; servers take both).
            http: reqwest::Method::GET,
            path: format!("/tasks/{}:subscribe", escape(id)),
            query: Vec::new(),
            body: false,
        };
        self.stream(op).await
    }

    /// Waits until task `id` settles (terminal, input-required or auth-required) and returns it,
    /// subscribing again whenever a stream drops (after a timeout, a restart of the agent, a
    /// network cut). A task that settled meanwhile is read with GetTask.
    pub async fn follow(&self, id: &str) -> Result<Task, CallError> {
        let mut last_error = None;
        for _ in 0..MAX_RESUBSCRIBES {
            let mut stream = match self.subscribe(id).await {
                Ok(stream) => stream,
                // Subscribing to a terminal task is refused: it is done, read it.
                Err(CallError::Protocol { code, .. })
                    if code == error_code::UNSUPPORTED_OPERATION =>
                {
                    return self.get_task(id, None).await;
                }
                Err(e) if e.retryable() => {
                    last_error = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut task: Option<Task> = None;
            loop {
                match stream.next().await {
                    Some(Ok(event)) => {
                        apply(&mut task, event);
                        if let Some(done) = task.take_if(|t| settled(&t.status.state)) {
                            return Ok(done);
                        }
                    }
                    Some(Err(e)) if e.retryable() => {
                        last_error = Some(e);
                        break;
                    }
                    Some(Err(e)) => return Err(e),
                    // Closed before the task settled: subscribe again.
                    None => break,
                }
            }
        }
        Err(last_error.unwrap_or_else(|| {
            CallError::Transport(format!(
                "task {id} did not settle within {MAX_RESUBSCRIBES} subscriptions"
            ))
        }))
    }

    /// GetExtendedAgentCard: the card as this caller sees it, verified like the public one.
    pub async fn extended_card(&self) -> Result<AgentCard, CallError> {
        if self.card.capabilities.extended_agent_card != Some(true) {
            return Err(CallError::Unsupported("the extended agent card".into()));
        }
        let op = Op {
            method: methods::GET_EXTENDED_AGENT_CARD,
            params: json!({}),
            http: reqwest::Method::GET,
            path: "/extendedAgentCard".into(),
            query: Vec::new(),
            body: false,
        };
        let value = self.unary(self.fresh_id(), op).await?;
        let card: AgentCard = serde_json::from_value(value).map_err(invalid)?;
        verify_card(&card, &self.trusted)?;
        Ok(card)
    }

    fn require_streaming(&self) -> Result<(), CallError> {
        if self.card.capabilities.streaming == Some(true) {
            Ok(())
        } else {
            Err(CallError::Unsupported("streaming".into()))
        }
    }

    fn fresh_id(&self) -> JsonRpcId {
        JsonRpcId::Number(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The HTTP request of `op` on this client's binding, with version and credentials.
    async fn build(&self, id: &JsonRpcId, op: Op) -> Result<reqwest::RequestBuilder, CallError> {
        let req = match self.binding {
            Binding::JsonRpc => {
                let request = JsonRpcRequest::new(id.clone(), op.method, Some(op.params));
                self.http.post(&self.endpoint).json(&request)
            }
            Binding::HttpJson => {
                let tenant = self
                    .tenant
                    .as_deref()
                    .map(|t| format!("/{}", escape(t)))
                    .unwrap_or_default();
                let url = format!("{}{tenant}{}", self.endpoint, op.path);
                let mut req = self.http.request(op.http, url).query(&op.query);
                if op.body {
                    req = req
                        .header(reqwest::header::CONTENT_TYPE, A2A_JSON)
                        .body(op.params.to_string());
                }
                req
            }
        };
        let mut req = req.header(a2a::SVC_PARAM_VERSION, a2a::VERSION);
        if let Some(tokens) = &self.tokens {
            let token = tokens
                .token(&self.endpoint, &self.card.name)
                .await
                .map_err(|e| CallError::Token(e.to_string()))?;
            req = req.bearer_auth(token);
        }
        Ok(req)
    }

    async fn unary(&self, id: JsonRpcId, op: Op) -> Result<Value, CallError> {
        let req = self.build(&id, op).await?;
        let resp = execute(self.local.as_ref(), req, self.options.timeout).await?;
        let status = resp.status();
        match self.binding {
            Binding::JsonRpc => {
                if !status.is_success() {
                    return Err(CallError::Http(status.as_u16()));
                }
                let bytes = read_limited(resp, self.options.max_response_bytes).await?;
                let rpc: JsonRpcResponse = serde_json::from_slice(&bytes).map_err(invalid)?;
                rpc_result(rpc, &id)
            }
            Binding::HttpJson => {
                let bytes = read_limited(resp, self.options.max_response_bytes).await?;
                if !status.is_success() {
                    return Err(rest_error(status.as_u16(), &bytes));
                }
                serde_json::from_slice(&bytes).map_err(invalid)
            }
        }
    }

    async fn stream(&self, op: Op) -> Result<EventStream, CallError> {
        let id = self.fresh_id();
        let req = self
            .build(&id, op)
            .await?
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .timeout(self.options.stream_timeout);
        let resp = execute(self.local.as_ref(), req, self.options.stream_timeout).await?;
        let status = resp.status();
        let is_sse = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            // Errors before the stream starts come as an ordinary response.
            let bytes = read_limited(resp, self.options.max_response_bytes).await?;
            return Err(match self.binding {
                Binding::JsonRpc if status.is_success() => {
                    let rpc: JsonRpcResponse = serde_json::from_slice(&bytes).map_err(invalid)?;
                    match rpc_result(rpc, &id) {
                        Err(e) => e,
                        Ok(_) => invalid("expected an event stream"),
                    }
                }
                Binding::JsonRpc => CallError::Http(status.as_u16()),
                Binding::HttpJson if status.is_success() => invalid("expected an event stream"),
                Binding::HttpJson => rest_error(status.as_u16(), &bytes),
            });
        }
        Ok(EventStream {
            resp,
            buf: Vec::new(),
            binding: self.binding,
            id,
            max_event_bytes: self.options.max_response_bytes,
            done: false,
        })
    }
}

/// Sends `req`, or hands it to the in-process agent's `local` router. In process, `timeout` bounds the whole
/// exchange, body included, as the client's timeouts do over HTTP.
async fn execute(
    local: Option<&axum::Router>,
    req: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<reqwest::Response, CallError> {
    let Some(router) = local else {
        return req.send().await.map_err(transport);
    };
    // A year stands in for longer timeouts: tokio's timers overflow near the largest instant.
    let deadline = tokio::time::Instant::now() + timeout.min(Duration::from_secs(365 * 24 * 3600));
    let late = move || format!("no answer within {timeout:?}");
    let req: axum::http::Request<reqwest::Body> = req
        .build()
        .map_err(transport)?
        .try_into()
        .map_err(transport)?;
    // The handler runs in a task of its own, as it would on a connection of its own: a panic in it fails this call
    // only, and it is stopped when the call times out or is dropped, as a closed connection stops it.
    let mut handler = AbortOnDrop(tokio::spawn(
        router.clone().oneshot(req.map(axum::body::Body::new)),
    ));
    let resp = match tokio::time::timeout_at(deadline, &mut handler.0).await {
        Err(_) => return Err(CallError::Transport(late())),
        Ok(Err(failed)) => {
            // A panic's message may hold internal detail, and call errors reach run timelines: it stays in the log.
            tracing::error!(error = %failed, "an in-process agent's handler failed");
            return Err(CallError::Transport("the agent failed".into()));
        }
        Ok(Ok(Ok(resp))) => resp,
    };
    let (parts, body) = resp.into_parts();
    let body = futures::stream::unfold(Some(body.into_data_stream()), move |body| async move {
        let mut body = body?;
        // The clock first: a body that always has a chunk ready would otherwise never time out.
        if tokio::time::Instant::now() >= deadline {
            return Some((Err(BoxError::from(late())), None));
        }
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => Some((Ok(chunk), Some(body))),
            Ok(Some(Err(e))) => Some((Err(BoxError::from(e)), None)),
            Ok(None) => None,
            Err(_) => Some((Err(BoxError::from(late())), None)),
        }
    });
    Ok(axum::http::Response::from_parts(parts, reqwest::Body::wrap_stream(body)).into())
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Aborts the task when dropped: a call given up on stops its in-process handler.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The outcome of a JSON-RPC response to request `id`.
fn rpc_result(rpc: JsonRpcResponse, id: &JsonRpcId) -> Result<Value, CallError> {
    if let Some(err) = rpc.error {
        return Err(CallError::Protocol {
            code: err.code,
            message: err.message,
        });
    }
    // A success for some other request would be someone else's outcome.
    if &rpc.id != id {
        return Err(invalid("response id does not match the request"));
    }
    rpc.result
        .ok_or_else(|| invalid("neither result nor error"))
}

/// The error of an HTTP+JSON error response: the A2A error its ErrorInfo names, else the status.
fn rest_error(status: u16, body: &[u8]) -> CallError {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return CallError::Http(status);
    };
    rest_error_value(&value).unwrap_or(CallError::Http(status))
}

fn rest_error_value(value: &Value) -> Option<CallError> {
    let error = value.get("error")?;
    let message = error.get("message").and_then(Value::as_str).unwrap_or("");
    let code = error
        .get("details")?
        .as_array()?
        .iter()
        .filter(|d| d.get("@type").and_then(Value::as_str) == Some(a2a::ERROR_INFO_TYPE))
        .find_map(|d| a2a::reason_to_error_code(d.get("reason")?.as_str()?))?;
    Some(CallError::Protocol {
        code,
        message: message.to_string(),
    })
}

/// Folds a stream event into the task it describes.
fn apply(task: &mut Option<Task>, event: StreamResponse) {
    match event {
        StreamResponse::Task(t) => *task = Some(t),
        StreamResponse::StatusUpdate(u) => {
            if let Some(t) = task {
                t.status = u.status;
            }
        }
        StreamResponse::ArtifactUpdate(u) => {
            if let Some(t) = task {
                let artifacts = t.artifacts.get_or_insert_with(Vec::new);
                match artifacts
                    .iter_mut()
                    .find(|a| a.artifact_id == u.artifact.artifact_id)
                {
                    Some(a) if u.append == Some(true) => a.parts.extend(u.artifact.parts),
                    Some(a) => *a = u.artifact,
                    None => artifacts.push(u.artifact),
                }
            }
        }
        StreamResponse::Message(_) => {}
    }
}

/// The events of an SSE response (SendStreamingMessage, SubscribeToTask), in order.
pub struct EventStream {
    resp: reqwest::Response,
    buf: Vec<u8>,
    binding: Binding,
    id: JsonRpcId,
    max_event_bytes: usize,
    done: bool,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("binding", &self.binding)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    /// The next event; `None` once the server closed the stream. An error event ends the stream.
    pub async fn next(&mut self) -> Option<Result<StreamResponse, CallError>> {
        if self.done {
            return None;
        }
        loop {
            if let Some(data) = self.take_event() {
                let Some(data) = data else { continue };
                let event = self.decode(&data);
                if event.is_err() {
                    self.done = true;
                }
                return Some(event);
            }
            if self.buf.len() > self.max_event_bytes {
                self.done = true;
                return Some(Err(invalid(format!(
                    "stream event larger than {} bytes",
                    self.max_event_bytes
                ))));
            }
            match self.resp.chunk().await {
                Ok(Some(chunk)) => self.buf.extend_from_slice(&chunk),
                Ok(None) => {
                    self.done = true;
                    return None;
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(transport(e)));
                }
            }
        }
    }

    /// Removes one complete event (up to a blank line, LF or CRLF) from the buffer: `Some(None)`
    /// for an event without data (a keep-alive comment), `None` if no event is complete yet.
    fn take_event(&mut self) -> Option<Option<String>> {
        let text = &self.buf;
        let (end, sep) = [&b"\r\n\r\n"[..], b"\n\n", b"\r\r"]
            .iter()
            .filter_map(|sep| {
                text.windows(sep.len())
                    .position(|w| w == *sep)
                    .map(|p| (p, sep.len()))
            })
            .min()?;
        let block = String::from_utf8_lossy(&text[..end]).into_owned();
        self.buf.drain(..end + sep);
        let data: Vec<&str> = block
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        Some((!data.is_empty()).then(|| data.join("\n")))
    }

    fn decode(&self, data: &str) -> Result<StreamResponse, CallError> {
        let value: Value = serde_json::from_str(data).map_err(invalid)?;
        let value = match self.binding {
            Binding::JsonRpc => {
                let rpc: JsonRpcResponse = serde_json::from_value(value).map_err(invalid)?;
                rpc_result(rpc, &self.id)?
            }
            Binding::HttpJson => {
                if let Some(e) = rest_error_value(&value) {
                    return Err(e);
                }
                value
            }
        };
        serde_json::from_value(value).map_err(invalid)
    }
}

/// The skill's output from a finished task, per the Skills contract.
fn task_outcome(task: Task) -> Result<Value, CallError> {
    let status_text = |task: &Task, default: &str| {
        task.status
            .message
            .as_ref()
            .and_then(|m| m.parts.iter().find_map(|p| p.as_text()))
            .unwrap_or(default)
            .to_string()
    };
    match task.status.state {
        TaskState::Completed => {
            let artifact = task.artifacts.into_iter().flatten().next();
            let data = artifact
                .into_iter()
                .flat_map(|a| a.parts)
                .find_map(|p| match p.content {
                    PartContent::Data(v) => Some(v),
                    _ => None,
                });
            data.ok_or_else(|| {
                CallError::InvalidResponse("completed task without a data artifact".into())
            })
        }
        TaskState::Failed | TaskState::Rejected | TaskState::Canceled => Err(CallError::Skill {
            message: status_text(&task, "the skill failed"),
            retryable: crate::tasks::retryable(&task.status),
        }),
        TaskState::InputRequired | TaskState::AuthRequired => Err(CallError::Interrupted {
            message: status_text(&task, ""),
            needs_auth: task.status.state == TaskState::AuthRequired,
            task_id: task.id,
        }),
        TaskState::Submitted | TaskState::Working => Err(CallError::InProgress(task.id)),
        TaskState::Unspecified => Err(CallError::InvalidResponse("task state unspecified".into())),
    }
}

/// Reads a body, failing as soon as it grows past `max` so a hostile agent cannot exhaust memory.
async fn read_limited(mut resp: reqwest::Response, max: usize) -> Result<Vec<u8>, CallError> {
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Err(CallError::InvalidResponse(format!(
            "response larger than {max} bytes"
        )));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(transport)? {
        if body.len() + chunk.len() > max {
            return Err(CallError::InvalidResponse(format!(
                "response larger than {max} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A router answering anything with `chunks` SSE comments, each ready at once.
    fn always_ready(chunks: usize) -> axum::Router {
        axum::Router::new().fallback(move || async move {
            axum::body::Body::from_stream(futures::stream::iter(
                (0..chunks).map(|_| Ok::<_, std::convert::Infallible>(": k\n\n")),
            ))
        })
    }

    #[tokio::test]
    async fn an_in_process_body_that_is_always_ready_still_ends_at_the_deadline() {
        let get = reqwest::Client::new().get("http://agent.test/");
        let resp = execute(
            Some(&always_ready(10_000_000)),
            get,
            Duration::from_millis(100),
        )
        .await
        .unwrap();
        let err = read_limited(resp, usize::MAX).await.unwrap_err();
        assert!(
            matches!(&err, CallError::Transport(why) if why.contains("no answer within")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_in_process_call_without_a_time_limit_is_served() {
        let get = reqwest::Client::new().get("http://agent.test/");
        let resp = execute(Some(&always_ready(3)), get, Duration::MAX)
            .await
            .unwrap();
        assert_eq!(read_limited(resp, 100).await.unwrap(), b": k\n\n".repeat(3));
    }

    #[tokio::test]
    async fn transport_errors_name_their_cause_but_not_the_url() {
        // Nothing listens on a freshly closed port.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let url = format!("http://{dead}/tasks?pageToken=SECRET");
        let err = reqwest::Client::new().get(url).send().await.unwrap_err();
        let CallError::Transport(why) = transport(err) else {
            panic!("expected a transport error")
        };
        assert!(!why.contains("SECRET"), "{why}");
        assert!(
            why.contains("error sending request: "),
            "with its cause: {why}"
        );
    }

    #[test]
    fn path_segments_are_escaped() {
        assert_eq!(escape("r-1:fix:2/x y"), "r-1%3Afix%3A2%2Fx%20y");
    }

    #[test]
    fn rest_errors_map_to_a2a_codes_by_reason() {
        let body = json!({"error": {"code": 404, "status": "NOT_FOUND", "message": "no task",
            "details": [{"@type": a2a::ERROR_INFO_TYPE, "reason": "TASK_NOT_FOUND", "domain": "a2a-protocol.org"}]}});
        match rest_error(404, body.to_string().as_bytes()) {
            CallError::Protocol { code, message } => {
                assert_eq!(
                    (code, message.as_str()),
                    (error_code::TASK_NOT_FOUND, "no task")
                );
            }
            other => panic!("{other}"),
        }
        assert!(matches!(rest_error(401, b"{}"), CallError::Http(401)));
        assert!(matches!(rest_error(502, b"<html>"), CallError::Http(502)));
    }

    #[test]
    fn stream_updates_fold_into_the_task() {
        let base: Task = serde_json::from_value(json!({"id": "t", "contextId": "c",
            "status": {"state": "TASK_STATE_WORKING"}}))
        .unwrap();
        let mut task = Some(base);
        let artifact = json!({"artifactUpdate": {"taskId": "t", "contextId": "c",
            "artifact": {"artifactId": "a", "parts": [{"text": "x"}]}}});
        apply(&mut task, serde_json::from_value(artifact.clone()).unwrap());
        let mut appended = artifact;
        appended["artifactUpdate"]["append"] = json!(true);
        apply(&mut task, serde_json::from_value(appended).unwrap());
        let done = json!({"statusUpdate": {"taskId": "t", "contextId": "c",
            "status": {"state": "TASK_STATE_COMPLETED"}}});
        apply(&mut task, serde_json::from_value(done).unwrap());
        let task = task.unwrap();
        assert_eq!(task.status.state, TaskState::Completed);
        assert_eq!(task.artifacts.unwrap()[0].parts.len(), 2);
    }
}
