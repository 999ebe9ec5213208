//! What an agent offers: its card description and the skills it runs.

use async_trait::async_trait;
use serde_json::Value;

/// How much harm a skill can do; published on the card as the tag `risk:<level>` so callers and
/// policy can gate on it without trusting the skill's free-text description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Risk {
    /// Changes nothing at the app: a blocking call of it without a push config is not claimed before it runs, so a
    /// repeat of its message id may run it again (it answers the stored outcome).
    Read,
    /// Changes something at the app: runs once per message id.
    Write,
    /// Changes something that cannot be undone: runs once per message id, and only with an admitted approval.
    Destructive,
}

impl Risk {
    /// The card tag for this level, e.g. `risk:write`.
    pub fn tag(self) -> &'static str {
        match self {
            Risk::Read => "risk:read",
            Risk::Write => "risk:write",
            Risk::Destructive => "risk:destructive",
        }
    }

    /// The scopes a caller's token needs for a skill of this level on `agent`, as the skill's
    /// security requirement lists them: `plane:read`; `plane:write`; `plane:write` plus
    /// `plane:destructive` (a destructive skill writes, and needs a settled approval besides).
    pub fn scopes(self, agent: &str) -> Vec<String> {
        match self {
            Risk::Read => vec![format!("{agent}:read")],
            Risk::Write => vec![format!("{agent}:write")],
            Risk::Destructive => vec![format!("{agent}:write"), format!("{agent}:destructive")],
        }
    }
}

/// Every scope of `agent`'s skills, once each: what a caller trusted with all of them (the factory) holds.
pub fn every_scope(agent: &str) -> Vec<String> {
    ["read", "write", "destructive"]
        .iter()
        .map(|level| format!("{agent}:{level}"))
        .collect()
}

/// The principal an agent acts as (its subject in tokens it is issued, the key of its kill
/// switch, docs/contracts.md): `agent:<name>`. Each agent has its own; the card names it.
pub fn agent_principal(agent: &str) -> String {
    format!("agent:{agent}")
}

/// One skill as advertised on the card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillSpec {
    pub id: String,
    pub name: String,
    pub description: String,
    pub risk: Risk,
    /// Extra tags; the risk tag is added by the card builder.
    pub tags: Vec<String>,
    pub examples: Vec<String>,
}

/// The agent as advertised on the card. `name` is also the agent's key in the task store
/// (`a2a_task` items are `<name>:<caller>:<messageId>`, see [`crate::task_item_id`]), so it should be the short
/// agent name (`zulip`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSpec {
    pub name: String,
    pub description: String,
    pub version: String,
    pub skills: Vec<SkillSpec>,
    /// The app the agent works on, published on the card ([`crate::APP_EXTENSION`]) for clients that link into it.
    pub app: Option<AppLinks>,
}

/// How to link into an agent's app: nothing secret, the same addresses the agent's own answers carry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AppLinks {
    /// The app's web address.
    pub web_url: String,
    /// Web links to the app's pages by object kind (`issue`, `pull_request`, ...), with `{field}` placeholders.
    pub deep_link_templates: std::collections::BTreeMap<String, String>,
}

/// A skill that did not produce an output. `retryable` tells the caller whether the same call may
/// succeed later (a timeout, a 5xx of the app) or will fail again (bad arguments, a 4xx).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SkillError {
    pub message: String,
    pub retryable: bool,
}

impl SkillError {
    pub fn retryable(message: impl Into<String>) -> Self {
        SkillError {
            message: message.into(),
            retryable: true,
        }
    }

    pub fn permanent(message: impl Into<String>) -> Self {
        SkillError {
            message: message.into(),
            retryable: false,
        }
    }
}

/// An agent's skills: `skill` + JSON `args` -> JSON output (see docs/contracts.md "Skills").
#[async_trait]
pub trait Skills: Send + Sync + 'static {
    fn card(&self) -> AgentSpec;
    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError>;
}
