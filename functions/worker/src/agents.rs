//! How the worker reaches the agents: one A2A client per agent, each verified against its signed card.

use std::collections::HashMap;

use async_trait::async_trait;
use loams_a2a::{A2aClient, CallError};
use serde_json::Value;

/// The result of one agent call as the engine sees it.
pub enum AgentReply {
    Done(Value),
    Failed {
        error: String,
        retryable: bool,
    },
    /// The agent is still performing this very step (same message id): nothing to record yet; ask again later
    /// with the same id rather than retry the step under a new one, which could repeat its effect.
    InProgress,
}

impl AgentReply {
    /// A call to an agent this deployment does not have: no retry can change that.
    pub fn unknown_agent(agent: &str) -> AgentReply {
        AgentReply::Failed {
            error: format!("no agent named {agent} is configured"),
            retryable: false,
        }
    }

    /// What an A2A call's result means for the step.
    pub fn from_call(result: Result<Value, CallError>) -> AgentReply {
        match result {
            Ok(output) => AgentReply::Done(output),
            Err(CallError::InProgress(_)) => AgentReply::InProgress,
            Err(e) => {
                let retryable = e.retryable();
                AgentReply::Failed {
                    error: e.to_string(),
                    retryable,
                }
            }
        }
    }
}

/// Calls an agent's skill with the step id as A2A `messageId`, so a repeated call is answered from the agent's
/// task store and performs nothing twice (a read may run again; its answer is the stored one). A gated call names
/// its settled approval, which the agent checks against the call before acting.
#[async_trait]
pub trait AgentCaller: Send + Sync {
    async fn call(
        &self,
        agent: &str,
        step: &str,
        skill: &str,
        args: Value,
        approval_id: Option<&str>,
    ) -> AgentReply;
}

/// The five agents over A2A JSON-RPC.
pub struct A2aAgents {
    clients: HashMap<String, A2aClient>,
}

impl A2aAgents {
    pub fn new(clients: HashMap<String, A2aClient>) -> Self {
        A2aAgents { clients }
    }
}

#[async_trait]
impl AgentCaller for A2aAgents {
    async fn call(
        &self,
        agent: &str,
        step: &str,
        skill: &str,
        args: Value,
        approval_id: Option<&str>,
    ) -> AgentReply {
        let Some(client) = self.clients.get(agent) else {
            return AgentReply::unknown_agent(agent);
        };
        AgentReply::from_call(client.call(step, skill, args, approval_id).await)
    }
}
