//! The credential broker's side of agent calls (DESIGN.md section 7): the tokens the factory's A2A
//! clients present, their verification at the agents, and the approval gate an agent asks at the
//! moment of a destructive call.
//!
//! - [`AgentTokens`] mints, per agent, a short-lived ES256 JWT with `sub = agent:loams-factory`,
//!   the run's organisation, `aud` = the agent's interface URL and every scope of that agent.
//! - [`on_behalf_token`] mints, with a key of its own, the token a panel read presents: the person as
//!   subject, and only the agent's read scope (collab.rs).
//! - [`AgentAuth`] verifies either at an agent: signature by the key of its kind, `iss`, `exp`,
//!   `aud` = that agent's URL, and a lifetime of at most [`MAX_AGENT_TOKEN_TTL_S`]; the agent runs a
//!   skill only for a token holding the scopes the skill requires.
//! - [`ApprovalBroker`] admits a destructive call only under a settled, approved, unexpired
//!   approval whose action hash is the hash of exactly this call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_lc_rs::constant_time;
use loams_a2a::{
    ApprovalGate, AuthError, CallerAuth, GateError, Principal, Risk, TokenError, TokenSource,
    every_scope,
};
use loams_factory::action_hash;
use loams_factory::approval::{Approval, ApprovalAction, ApprovalState};
use loams_platform::{Clock, Store, StoreError, limits};
use serde_json::Value;

use crate::ApiError;
use crate::auth::{Issuer, LEEWAY_S, Verifier};

/// The principal the factory's worker calls agents as.
pub const AGENT_SUBJECT: &str = "agent:loams-factory";
/// Longest lifetime of an agent token accepted (DESIGN.md section 7: at most 15 minutes).
pub const MAX_AGENT_TOKEN_TTL_S: u64 = 15 * 60;
/// Lifetime of the tokens minted here: long enough for one skill call (the agent's longest is 4 min).
const AGENT_TOKEN_TTL_S: u64 = 5 * 60;
/// Lifetime of a token minted for one panel read.
const ON_BEHALF_TTL_S: u64 = 60;
/// Longest lifetime of a panel-read token an agent accepts: a read is over in seconds, so a longer-lived one is
/// not one this API minted.
const MAX_ON_BEHALF_TTL_S: u64 = 2 * ON_BEHALF_TTL_S;
/// Prefix of a person's subject at an agent, so no person's name can pass for an agent principal.
const PERSON_PREFIX: &str = "user:";
/// Item kind of approval records (docs/contracts.md).
const APPROVAL_KIND: &str = "approval";

/// Mints the bearer tokens for agent calls: `sub` = [`AGENT_SUBJECT`], `org`, `aud` = the agent's URL, every scope
/// of that agent (the engine's policy and the approval gate decide what it may do), valid for five minutes. A token is reused for calls to the same agent until it has less than [`REUSE_MARGIN_S`] left:
/// an ECDSA signature per call was a measurable part of a run's CPU, and the cache holds nothing the issuer's
/// key beside it does not already grant.
pub struct AgentTokens {
    issuer: Issuer,
    org: String,
    minted: Mutex<HashMap<String, Minted>>,
}

struct Minted {
    token: String,
    exp: u64,
}

/// Least lifetime a reused token still has when sent: the agent checks it on arrival, and a call reaches the
/// agent well within this.
const REUSE_MARGIN_S: u64 = 60;
/// Most audiences whose tokens are kept; a deployment has a handful of agents.
const MAX_CACHED_TOKENS: usize = 64;

impl AgentTokens {
    pub fn new(issuer: Issuer, org: impl Into<String>) -> Self {
        Self {
            issuer,
            org: org.into(),
            minted: Mutex::default(),
        }
    }

    fn mint(&self, audience: &str, agent: &str, now: u64) -> Result<String, TokenError> {
        let scopes = every_scope(agent).join(" ");
        self.issuer
            .issue_for(
                audience,
                AGENT_SUBJECT,
                &self.org,
                &scopes,
                now,
                AGENT_TOKEN_TTL_S,
            )
            .map_err(|e| token_error(audience, e))
    }
}

fn token_error(audience: &str, e: ApiError) -> TokenError {
    TokenError {
        audience: audience.chars().take(limits::MAX_KEY).collect(),
        reason: e.to_string(),
    }
}

/// The token a person's panel read presents to `agent` at `audience`, signed with the panel key `issuer`: the
/// person (as `user:<sub>`) in their organisation, holding only the agent's read scope, for one minute. The caller
/// checked that the person holds that scope; the agent checks it again where the skill runs.
pub fn on_behalf_token(
    issuer: &Issuer,
    audience: &str,
    agent: &str,
    person: &crate::Caller,
) -> Result<String, TokenError> {
    let scope = Risk::Read.scopes(agent).join(" ");
    issuer
        .issue_for(
            audience,
            &format!("{PERSON_PREFIX}{}", person.user),
            &person.org,
            &scope,
            jsonwebtoken::get_current_timestamp(),
            ON_BEHALF_TTL_S,
        )
        .map_err(|e| token_error(audience, e))
}

#[async_trait]
impl TokenSource for AgentTokens {
    async fn token(&self, audience: &str, agent: &str) -> Result<String, TokenError> {
        let now = jsonwebtoken::get_current_timestamp();
        // An audience is one agent's URL, so its cached token carries that agent's scopes.
        if let Some(minted) = lock(&self.minted).get(audience)
            && minted.exp >= now + REUSE_MARGIN_S
        {
            return Ok(minted.token.clone());
        }
        let token = self.mint(audience, agent, now)?;
        let mut minted = lock(&self.minted);
        if minted.len() >= MAX_CACHED_TOKENS {
            minted.clear();
        }
        minted.insert(
            audience.to_string(),
            Minted {
                token: token.clone(),
                exp: now + AGENT_TOKEN_TTL_S,
            },
        );
        Ok(token)
    }
}

/// Verifies agent tokens at an agent, with the agent's URL as audience, against two keys that never meet: the
/// worker's (the factory, `sub` = [`AGENT_SUBJECT`]) and, when panels are served, the API's panel key (a person,
/// `sub` = `user:<sub>`, read scopes only). Whoever holds one key cannot mint the other's tokens: the API cannot act
/// as the factory, the worker cannot read as a person. A worker's token that passed is remembered, with its
/// audience, until it expires: the worker reuses its tokens, and an ECDSA verification per call was as costly as the
/// signature (a panel token is used once, and not remembered).
/// Only the exact token string verified for the same audience is taken from memory, and its expiry is checked
/// again on every use.
pub struct AgentAuth {
    factory: Verifier,
    panels: Option<Verifier>,
    verified: Mutex<HashMap<(String, String), Verified>>,
}

struct Verified {
    principal: Principal,
    exp: u64,
}

/// Most verified tokens kept; past it the memory starts over (forged tokens never enter it).
const MAX_VERIFIED_TOKENS: usize = 256;

fn auth_error(e: ApiError) -> AuthError {
    match e {
        ApiError::Unavailable(why) | ApiError::Internal(why) => AuthError::Unavailable(why),
        _ => AuthError::Invalid,
    }
}

impl AgentAuth {
    /// `factory` carries the worker's key and issuer; its audience is replaced per agent.
    pub fn new(factory: Verifier) -> Self {
        Self {
            factory,
            panels: None,
            verified: Mutex::default(),
        }
    }

    /// Also accepts the panel reads the API makes for people, signed with the panel key of `panels`.
    pub fn with_panels(mut self, panels: Verifier) -> Self {
        self.panels = Some(panels);
        self
    }

    async fn check(&self, token: &str, audience: &str, now: u64) -> Result<Verified, AuthError> {
        let (claims, for_person) = match self
            .factory
            .for_audience(audience)
            .verify_claims(token)
            .await
        {
            Ok(claims) => (claims, false),
            // Not the worker's: a person's panel read, or nothing.
            Err(ApiError::Unauthenticated(_)) => match &self.panels {
                Some(panels) => {
                    let claims = panels.for_audience(audience).verify_claims(token).await;
                    (claims.map_err(auth_error)?, true)
                }
                None => return Err(AuthError::Invalid),
            },
            Err(e) => return Err(auth_error(e)),
        };
        // A long-lived token stolen once would open the agent for its whole life; refuse any that
        // was minted for longer than an agent token may live, or dated ahead to stretch that life.
        if claims.iat > claims.exp
            || claims.iat > now + LEEWAY_S
            || claims.exp - claims.iat > MAX_AGENT_TOKEN_TTL_S
        {
            return Err(AuthError::Invalid);
        }
        let scopes: Vec<String> = claims.scope.split_whitespace().map(str::to_owned).collect();
        // Each key mints for one kind of caller only; anything else under it is a token its holder should not
        // have made. A person reads, and nothing more, whatever scopes the token lists.
        let allowed = if for_person {
            claims.sub.starts_with(PERSON_PREFIX)
                && scopes.iter().all(|s| s.ends_with(":read"))
                && claims.exp - claims.iat <= MAX_ON_BEHALF_TTL_S
        } else {
            claims.sub == AGENT_SUBJECT
        };
        if !allowed {
            return Err(AuthError::Invalid);
        }
        Ok(Verified {
            principal: Principal {
                subject: claims.sub,
                org: claims.org,
                scopes,
            },
            // Remembered no longer than an agent token may live from now, whatever it claims.
            exp: claims.exp.min(now + MAX_AGENT_TOKEN_TTL_S),
        })
    }
}

#[async_trait]
impl CallerAuth for AgentAuth {
    async fn verify(&self, bearer: Option<&str>, audience: &str) -> Result<Principal, AuthError> {
        let token = bearer.ok_or(AuthError::Missing)?;
        let key = (audience.to_string(), token.to_string());
        let now = jsonwebtoken::get_current_timestamp();
        if let Some(known) = lock(&self.verified).get(&key)
            && known.exp > now
        {
            return Ok(known.principal.clone());
        }
        let verified = self.check(token, audience, now).await?;
        let principal = verified.principal.clone();
        // A panel token serves one read: remembering it would only push the worker's tokens out.
        if principal.subject.starts_with(PERSON_PREFIX) {
            return Ok(principal);
        }
        let mut memory = lock(&self.verified);
        memory.retain(|_, v| v.exp > now);
        if memory.len() >= MAX_VERIFIED_TOKENS {
            memory.clear();
        }
        memory.insert(key, verified);
        Ok(principal)
    }
}

/// The caches above hold plain data that no panic can leave half-written, so a poisoned lock is still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Checks destructive calls against the factory's approval records in the store.
pub struct ApprovalBroker {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
}

impl ApprovalBroker {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        Self { store, clock }
    }
}

#[async_trait]
impl ApprovalGate for ApprovalBroker {
    async fn admit(
        &self,
        org: &str,
        agent: &str,
        skill: &str,
        args: &Value,
        approval_id: &str,
    ) -> Result<(), GateError> {
        let refuse = |why: &str| Err(GateError::Refused(why.to_string()));
        if limits::key("approval id", approval_id).is_err() {
            return refuse("the approval id is malformed");
        }
        let item = match self.store.get_item(org, APPROVAL_KIND, approval_id).await {
            Ok(Some(item)) => item,
            Ok(None) => return refuse("no such approval"),
            Err(StoreError::Invalid(_)) => return refuse("the approval id is malformed"),
            Err(e) => return Err(GateError::Unavailable(e.to_string())),
        };
        let approval: Approval = match serde_json::from_slice(&item.body) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, approval_id, "stored approval does not decode");
                return refuse("the approval record is unreadable");
            }
        };
        let now = self.clock.now_ms();
        match approval.effective_state(now) {
            ApprovalState::Approved => {}
            ApprovalState::Pending => return refuse("the approval is still pending"),
            ApprovalState::Denied => return refuse("the approval was denied"),
            ApprovalState::Expired => return refuse("the approval has expired"),
        }
        // An approval releases its call within its lifetime only, even once approved.
        if now >= approval.expires_at_ms {
            return refuse("the approval has expired");
        }
        if approval.org != org {
            return refuse("the approval belongs to another organisation");
        }
        if approval.action.agent != agent || approval.action.skill != skill {
            return refuse(&format!(
                "the approval is for {}.{}, not {agent}.{skill}",
                approval.action.agent, approval.action.skill
            ));
        }
        // The hash the person signed over must be the hash of exactly this call: agent, skill and args
        // come from the call, so an approval for other arguments releases nothing. The target commit
        // is the record's own: the engine binds run context into it (the patch behind a merge) that
        // the call does not carry, and the hash covers it as signed.
        let called = ApprovalAction {
            agent: agent.to_string(),
            skill: skill.to_string(),
            args: args.clone(),
            target_commit: approval.action.target_commit.clone(),
        };
        let hash = action_hash(&called);
        if constant_time::verify_slices_are_equal(hash.as_bytes(), approval.action_hash.as_bytes())
            .is_err()
        {
            return refuse("the call does not match the approved action (action hash differs)");
        }
        Ok(())
    }
}
