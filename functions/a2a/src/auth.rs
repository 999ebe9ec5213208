//! The seams through which the host secures an agent: who may call it ([`CallerAuth`]), whether a
//! destructive call is covered by a settled approval ([`ApprovalGate`]), and where a client gets the
//! bearer token for an agent ([`TokenSource`]). The agent crate holds no keys and no approval
//! records; the host (loams-api's broker) does.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

/// Longest bearer token the server passes on to [`CallerAuth`]; a larger header is refused unread.
pub const MAX_BEARER_BYTES: usize = 8 * 1024;

/// The authenticated caller of an A2A call, taken from a verified token only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's subject (`agent:loams-factory`); a task is readable by this subject only.
    pub subject: String,
    /// The organisation the token is scoped to; it must be the agent's own.
    pub org: String,
    /// What the token grants, in the terms of the skills' security requirements on the card
    /// (`plane:read`, `plane:write`, `plane:destructive`): a skill runs only for a caller holding
    /// every scope it requires. The factory holds all of an agent's; a person reading a panel
    /// through Loams holds the read scope of that app only.
    pub scopes: Vec<String>,
}

impl Principal {
    /// The first scope a skill of `risk` on `agent` requires that this caller lacks, if any.
    pub fn missing_scope(&self, agent: &str, risk: crate::Risk) -> Option<String> {
        risk.scopes(agent)
            .into_iter()
            .find(|needed| !self.scopes.iter().any(|held| held == needed))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing bearer token")]
    Missing,
    /// Bad signature, issuer, audience, expiry or shape. Deliberately without detail: telling the
    /// caller which check failed helps only an attacker.
    #[error("invalid bearer token")]
    Invalid,
    /// The verifier could not decide (for example its key set could not be fetched); the caller
    /// may try again.
    #[error("caller authentication unavailable: {0}")]
    Unavailable(String),
}

/// Verifies the bearer token of an A2A call. `audience` is the agent's interface URL: a token minted
/// for another agent (or for the API) must not be accepted here.
#[async_trait]
pub trait CallerAuth: Send + Sync {
    async fn verify(&self, bearer: Option<&str>, audience: &str) -> Result<Principal, AuthError>;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// The approval does not cover this call; the call fails for good.
    #[error("{0}")]
    Refused(String),
    /// The approval records could not be read; nothing ran, the caller may try again.
    #[error("approval check unavailable: {0}")]
    Unavailable(String),
}

/// Decides, at the moment of a destructive call, whether the settled approval `approval_id` covers
/// exactly this call (DESIGN.md section 2.2: the gate is checked where the privilege is used).
#[async_trait]
pub trait ApprovalGate: Send + Sync {
    async fn admit(
        &self,
        org: &str,
        agent: &str,
        skill: &str,
        args: &Value,
        approval_id: &str,
    ) -> Result<(), GateError>;
}

/// What the host plugs into an agent's server.
#[derive(Clone)]
pub struct Guards {
    pub auth: Arc<dyn CallerAuth>,
    pub gate: Arc<dyn ApprovalGate>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no token for {audience}: {reason}")]
pub struct TokenError {
    pub audience: String,
    pub reason: String,
}

/// Gives a client the bearer token for the agent named `agent` (as its verified card names it) at
/// `audience` (its interface URL); the name lets the source grant that agent's scopes.
#[async_trait]
pub trait TokenSource: Send + Sync {
    async fn token(&self, audience: &str, agent: &str) -> Result<String, TokenError>;
}
