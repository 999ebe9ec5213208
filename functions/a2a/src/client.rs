//! A2A client for skill calls: verifies the agent's signed card once, then sends each call as a
//! JSON-RPC `SendMessage` whose message id is the caller's step id.

use std::sync::Arc;
use std::time::Duration;

use a2a::{
    AgentCard, JsonRpcId, JsonRpcRequest, JsonRpcResponse, Message, Part, PartContent, Role,
    SendMessageRequest, SendMessageResponse, TRANSPORT_PROTOCOL_JSONRPC, Task, TaskState, methods,
};
use serde_json::{Value, json};

use crate::auth::TokenSource;
use crate::card::{CARD_PATH, CardError, Jwks, verify_card};
use crate::server::APPROVAL_ID_KEY;

/// Largest agent card accepted.
const MAX_CARD_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Whole-request timeout of each HTTP call (card fetch or skill call).
    pub timeout: Duration,
    /// Largest JSON-RPC response accepted.
    pub max_response_bytes: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Duration::from_secs(60),
            max_response_bytes: 2 * 1024 * 1024,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The agent could not be reached or did not answer in time; the call may be repeated with the
    /// same message id.
    #[error("transport: {0}")]
    Transport(String),
    /// The agent answered with an HTTP error instead of JSON-RPC.
    #[error("HTTP status {0}")]
    Http(u16),
    /// The agent's card is missing, unsigned, badly signed or unusable.
    #[error("agent card: {0}")]
    Card(#[from] CardError),
    /// The agent rejected the request (JSON-RPC error).
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
            CallError::Protocol { code, .. } => *code == a2a::error_code::INTERNAL_ERROR,
            CallError::Skill { retryable, .. } => *retryable,
            CallError::Card(_) | CallError::InvalidResponse(_) => false,
        }
    }
}

fn transport(e: reqwest::Error) -> CallError {
    CallError::Transport(e.to_string())
}

#[derive(Clone)]
pub struct A2aClient {
    http: reqwest::Client,
    card: AgentCard,
    endpoint: String,
    max_response_bytes: usize,
    tokens: Option<Arc<dyn TokenSource>>,
}

impl std::fmt::Debug for A2aClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("A2aClient")
            .field("endpoint", &self.endpoint)
            .field("authenticated", &self.tokens.is_some())
            .finish_non_exhaustive()
    }
}

impl A2aClient {
    /// Fetches the card from `base_url`, refuses it unless a key in `trusted` signed it, and picks
    /// its JSON-RPC 1.0 interface.
    pub async fn new(base_url: &str, trusted: &Jwks) -> Result<Self, CallError> {
        Self::with_options(base_url, trusted, ClientOptions::default()).await
    }

    pub async fn with_options(
        base_url: &str,
        trusted: &Jwks,
        options: ClientOptions,
    ) -> Result<Self, CallError> {
        let http = reqwest::Client::builder()
            .timeout(options.timeout)
            // The endpoint comes from a verified card; redirects would lead past that check.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(transport)?;
        let url = format!("{}{CARD_PATH}", base_url.trim_end_matches('/'));
        let resp = http.get(&url).send().await.map_err(transport)?;
        if !resp.status().is_success() {
            return Err(CallError::Http(resp.status().as_u16()));
        }
        let bytes = read_limited(resp, MAX_CARD_BYTES).await?;
        let card: AgentCard = serde_json::from_slice(&bytes)
            .map_err(|e| CallError::Card(CardError::Malformed(e.to_string())))?;
        verify_card(&card, trusted)?;
        let endpoint = card
            .supported_interfaces
            .iter()
            .find(|i| {
                i.protocol_binding == TRANSPORT_PROTOCOL_JSONRPC
                    && i.protocol_version == a2a::VERSION
            })
            .map(|i| i.url.clone())
            .ok_or_else(|| {
                CallError::Card(CardError::Malformed("no JSON-RPC 1.0 interface".into()))
            })?;
        Ok(A2aClient {
            http,
            card,
            endpoint,
            max_response_bytes: options.max_response_bytes,
            tokens: None,
        })
    }

    /// Sends `Authorization: Bearer <token>` on every call, the token asked of `tokens` for this
    /// agent's JSON-RPC interface URL (the audience the agent checks).
    pub fn with_tokens(mut self, tokens: Arc<dyn TokenSource>) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// The JSON-RPC interface URL taken from the verified card.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The verified card.
    pub fn card(&self) -> &AgentCard {
        &self.card
    }

    /// Runs `skill` with `args` under `message_id` (the step id): repeats with the same id return
    /// the first outcome instead of running the skill again. A gated call names its settled approval in the
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
        let params = SendMessageRequest {
            message,
            configuration: None,
            metadata: None,
            tenant: None,
        };
        let params =
            serde_json::to_value(&params).map_err(|e| CallError::InvalidResponse(e.to_string()))?;
        let request = JsonRpcRequest::new(
            JsonRpcId::String(message_id.to_string()),
            methods::SEND_MESSAGE,
            Some(params),
        );
        let mut req = self
            .http
            .post(&self.endpoint)
            .header(a2a::SVC_PARAM_VERSION, a2a::VERSION)
            .json(&request);
        if let Some(tokens) = &self.tokens {
            let token = tokens
                .token(&self.endpoint)
                .await
                .map_err(|e| CallError::Token(e.to_string()))?;
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.map_err(transport)?;
        if !resp.status().is_success() {
            return Err(CallError::Http(resp.status().as_u16()));
        }
        let bytes = read_limited(resp, self.max_response_bytes).await?;
        let rpc: JsonRpcResponse = serde_json::from_slice(&bytes)
            .map_err(|e| CallError::InvalidResponse(e.to_string()))?;
        if let Some(err) = rpc.error {
            return Err(CallError::Protocol {
                code: err.code,
                message: err.message,
            });
        }
        // A success for some other request would be someone else's outcome.
        if rpc.id != JsonRpcId::String(message_id.to_string()) {
            return Err(CallError::InvalidResponse(
                "response id does not match the request".into(),
            ));
        }
        let result = rpc
            .result
            .ok_or_else(|| CallError::InvalidResponse("neither result nor error".into()))?;
        match serde_json::from_value(result)
            .map_err(|e| CallError::InvalidResponse(e.to_string()))?
        {
            SendMessageResponse::Task(task) => task_outcome(task),
            SendMessageResponse::Message(_) => Err(CallError::InvalidResponse(
                "expected a task, got a message".into(),
            )),
        }
    }
}

/// The skill's output from a finished task, per the Skills contract.
fn task_outcome(task: Task) -> Result<Value, CallError> {
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
        TaskState::Failed | TaskState::Rejected | TaskState::Canceled => {
            let parts = task.status.message.map(|m| m.parts).unwrap_or_default();
            let message = parts
                .iter()
                .find_map(|p| p.as_text())
                .unwrap_or("the skill failed")
                .to_string();
            let retryable = parts.iter().find_map(|p| match &p.content {
                PartContent::Data(v) => v.get("retryable").and_then(Value::as_bool),
                _ => None,
            });
            Err(CallError::Skill {
                message,
                retryable: retryable.unwrap_or(false),
            })
        }
        TaskState::Submitted | TaskState::Working => Err(CallError::InProgress(task.id)),
        other => Err(CallError::InvalidResponse(format!(
            "unexpected task state {other:?}"
        ))),
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
