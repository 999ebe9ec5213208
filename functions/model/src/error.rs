use std::time::Duration;

/// Everything that can go wrong asking a model. Messages never contain the API key.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Connect, TLS, timeout or a broken body: the request may not have reached the model; retry.
    #[error("transport error: {0}")]
    Transport(String),
    /// A non-success HTTP status; `body` is a short excerpt of the answer.
    #[error("model endpoint answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// HTTP 429; `retry_after` is the server's Retry-After (seconds form) when it sent one.
    #[error("rate limited by the model endpoint (retry after {retry_after:?})")]
    RateLimited { retry_after: Option<Duration> },
    /// A 2xx answer that is not a usable chat completion and tells no believable tokens (bad JSON, too large, no
    /// usage with both counts, or usage past `MAX_TOKENS_TOLD`).
    #[error("bad response from the model endpoint: {0}")]
    BadResponse(String),
    /// A chat completion that tells believable tokens (within `MAX_TOKENS_TOLD`) but holds no answer (no choice, no
    /// content): the tokens are billed all the same.
    #[error("unusable answer from the model endpoint: {why}")]
    Unusable {
        why: String,
        input_tokens: u64,
        output_tokens: u64,
    },
    /// The replay cassette has no more completions recorded for this purpose.
    #[error("cassette exhausted: no more completions recorded for purpose `{purpose}`")]
    CassetteExhausted { purpose: String },
    /// Bad configuration or an unreadable cassette; retrying will not help.
    #[error("model configuration error: {0}")]
    Config(String),
}

impl ModelError {
    /// Whether the same request may succeed later: transport failures, 429 and 5xx.
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelError::Transport(_) | ModelError::RateLimited { .. } => true,
            ModelError::Status { status, .. } => *status >= 500,
            ModelError::BadResponse(_)
            | ModelError::Unusable { .. }
            | ModelError::CassetteExhausted { .. }
            | ModelError::Config(_) => false,
        }
    }
}
