//! loams-model: the chat-model port used by the worker (reviews), the bot and the agents.
//!
//! Two implementations of [`ChatModel`]:
//! - [`OpenAiCompatible`]: any OpenAI-compatible `POST {base}/chat/completions` endpoint (default DeepSeek);
//! - [`Replay`]: a cassette of recorded completions, served in order per purpose (offline runs and tests).

mod error;
mod openai;
mod replay;

pub use error::ModelError;
pub use openai::{
    ANSWER_TIMEOUT, DEFAULT_BASE_URL, DEFAULT_MODEL, MAX_RESPONSE_BYTES, MAX_TOKENS_TOLD,
    ModelConfig, OpenAiCompatible,
};
pub use replay::{MAX_CASSETTE_BYTES, Replay};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// A chat model: one request in, one completion out.
#[async_trait]
pub trait ChatModel: Send + Sync {
    async fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError>;
}

/// What the caller wants completed. `purpose` (`fix`, `lead_review`, `security_audit`, `chat`, ...) is not sent to
/// the provider: it selects the cassette track on replay and labels metering and traces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub purpose: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
}

/// One message of the conversation, OpenAI shape (`role` is `system`, `user` or `assistant`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: "assistant".into(),
            content: content.into(),
        }
    }
}

/// The completion: its text, the model that produced it and the tokens to meter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatResponse {
    pub text: String,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}
