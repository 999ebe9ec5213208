//! What the worker must do next: at most one effect per step.

use serde::{Deserialize, Serialize};

use crate::approval::{Approval, ApprovalAction, ApprovalState};
use crate::policy::Risk;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// An approval the run asks a person for. `id` is the id of the RequestApproval step: the worker stores the
/// approval under it (create-if-absent), so a retried request never creates a second approval, and a settlement
/// that overtakes the recorded request still matches.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ApprovalRequest {
    pub id: String,
    pub org: String,
    pub run_id: String,
    pub action: ApprovalAction,
    /// Hex SHA-256 of the canonical action, see [`crate::action_hash`].
    pub action_hash: String,
    /// Rendered by the engine from structured fields; untrusted text appears only quoted.
    pub summary: String,
    pub risk: Risk,
    pub requester: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_behalf_of: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation_phrase: Option<String>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
}

impl ApprovalRequest {
    /// The pending approval record the worker stores for this request.
    pub fn to_approval(&self) -> Approval {
        Approval {
            id: self.id.clone(),
            org: self.org.clone(),
            run_id: self.run_id.clone(),
            action: self.action.clone(),
            action_hash: self.action_hash.clone(),
            summary: self.summary.clone(),
            risk: self.risk.as_str().to_string(),
            requester: self.requester.clone(),
            on_behalf_of: self.on_behalf_of.clone(),
            confirmation_phrase: self.confirmation_phrase.clone(),
            state: ApprovalState::Pending,
            expires_at_ms: self.expires_at_ms,
            created_at_ms: self.created_at_ms,
            decision: None,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Effect {
    /// An A2A call; answer with `Outcome::Agent(output)` or `Outcome::Failed`. For a gated call `approval_id` names
    /// the settled approval the credential broker must check against the call.
    Call {
        step: String,
        agent: String,
        skill: String,
        args: serde_json::Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approval_id: Option<String>,
    },
    /// A model completion with purpose `fix`, `lead_review` or `security_audit`; answer with `Outcome::Model`, with
    /// `Outcome::ModelUnusable` for an answer that told believable tokens but holds nothing to use or is too large to
    /// keep as the call's result, or with `Outcome::Failed` when no answer told believable tokens (none are counted,
    /// though a provider may bill one cut off mid-way, too large to read, not a chat completion, without both usage
    /// counts, or with usage past the model client's `MAX_TOKENS_TOLD`).
    Model {
        step: String,
        purpose: String,
        messages: Vec<ChatMessage>,
    },
    /// Store the approval (pending) and answer with `Outcome::Agent({"approval_id": ...})`.
    RequestApproval {
        step: String,
        approval: Box<ApprovalRequest>,
    },
    /// Schedule the timer (upsert on `timer_id`) and answer with any `Outcome::Agent`; when it fires, send
    /// `Input::TimerFired`.
    Wait {
        step: String,
        timer_id: String,
        due_ms: i64,
    },
}

impl Effect {
    pub fn step(&self) -> &str {
        match self {
            Effect::Call { step, .. }
            | Effect::Model { step, .. }
            | Effect::RequestApproval { step, .. }
            | Effect::Wait { step, .. } => step,
        }
    }
}
