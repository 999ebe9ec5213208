//! What arrives from outside the run.

use serde::{Deserialize, Serialize};

use crate::event::ObserveVerdict;

/// The result of performing an effect.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A skill's output object (or, for RequestApproval and Wait, the worker's acknowledgement).
    Agent(serde_json::Value),
    Model {
        text: String,
        input_tokens: u64,
        output_tokens: u64,
    },
    /// A model answer paid for, its tokens believable, that holds nothing to use (a completion without a choice or
    /// content) or cannot be kept as it came (larger than a store keeps): its tokens count, its text is gone, and the
    /// step fails with `error`.
    ModelUnusable {
        error: String,
        input_tokens: u64,
        output_tokens: u64,
    },
    Failed {
        error: String,
        retryable: bool,
    },
}

impl Outcome {
    /// The input and output tokens a model answer was billed for, usable or not.
    pub fn model_tokens(&self) -> Option<(u64, u64)> {
        match *self {
            Outcome::Model {
                input_tokens,
                output_tokens,
                ..
            }
            | Outcome::ModelUnusable {
                input_tokens,
                output_tokens,
                ..
            } => Some((input_tokens, output_tokens)),
            Outcome::Agent(_) | Outcome::Failed { .. } => None,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Input {
    /// Re-check the guards before performing `next_effect()` (the worker sends it for an envelope without input).
    Continue,
    Completed {
        step: String,
        outcome: Outcome,
    },
    TriageDecided {
        accept: bool,
        by: String,
    },
    ApprovalSettled {
        approval_id: String,
        approved: bool,
        by: String,
    },
    TimerFired {
        timer_id: String,
    },
    Kill {
        by: String,
        reason: String,
    },
    /// A person's verdict after two inconclusive observation windows (`resolved` or `regressed`).
    VerdictGiven {
        verdict: ObserveVerdict,
        by: String,
    },
}

/// The queue message body: `input: None` means "continue: perform `next_effect()`".
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Envelope {
    pub org: String,
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Input>,
}
