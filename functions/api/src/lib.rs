//! loams-api: the HTTP surface of the factory. Connect services (FactoryService, ApprovalService, DeviceService,
//! CollabService) on
//! loams-proto's Connect server, bearer-token auth (ES256 JWT, JWKS), the apps' webhooks (Forgejo, Plane, Zulip,
//! GlitchTip) and the dev issuer's JWKS.
//!
//! Every Connect call needs `Authorization: Bearer <jwt>` and sees only the organisation its token names: a record of
//! another organisation answers exactly as a missing one does. Every write takes an idempotency key; a repeat with
//! the same key returns the first response and changes nothing.

mod approvals;
pub mod auth;
pub mod broker;
mod challenge;
mod collab;
mod convert;
mod devices;
mod error;
mod factory;
mod idem;
pub mod webhooks;

use std::sync::Arc;

use axum::routing::get;
use loams_platform::{Clock, Queue, Store};

pub use auth::{Caller, Claims, Issuer, Verifier, scope};
pub use broker::{AGENT_SUBJECT, AgentAuth, AgentTokens, ApprovalBroker};
pub use collab::{AgentLink, Collab, RegisteredApp};
pub use devices::MAX_ACTIVE_DEVICES;
pub use error::ApiError;
pub use factory::KillSwitch;
pub use webhooks::{AppHook, GlitchtipHook, MAX_WEBHOOK_BYTES, RunOpener};

/// Settings read once at start.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// GlitchTip alert webhooks: each secret URL token opens runs in one organisation.
    pub glitchtip_hooks: Vec<GlitchtipHook>,
    /// Forgejo webhooks (`/webhooks/forgejo/<id>`), each with its HMAC secret.
    pub forgejo_hooks: Vec<AppHook>,
    /// Plane webhooks (`/webhooks/plane/<id>`), each with its HMAC secret.
    pub plane_hooks: Vec<AppHook>,
    /// Zulip outgoing webhooks (`/webhooks/zulip/<id>`); the secret is the bot's token.
    pub zulip_hooks: Vec<AppHook>,
    /// How long a decision challenge stays usable.
    pub challenge_ttl_ms: i64,
    /// How often WatchRun looks for new events.
    pub watch_poll_ms: u64,
    /// WatchRun sends a heartbeat after this long without anything else, so clients and proxies see a live stream.
    pub watch_heartbeat_ms: u64,
    /// A WatchRun stream ends after this long; the client resumes with the last seq it saw as `after_seq`.
    pub watch_max_ms: u64,
    /// Idempotency lease of a write in progress.
    pub write_lease_ms: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            glitchtip_hooks: Vec::new(),
            forgejo_hooks: Vec::new(),
            plane_hooks: Vec::new(),
            zulip_hooks: Vec::new(),
            challenge_ttl_ms: 5 * 60 * 1000,
            watch_poll_ms: 500,
            watch_heartbeat_ms: 15_000,
            watch_max_ms: 15 * 60 * 1000,
            write_lease_ms: 30_000,
        }
    }
}

/// Everything the handlers share.
#[derive(Clone)]
pub struct ApiState {
    pub store: Arc<dyn Store>,
    pub queue: Arc<dyn Queue>,
    pub verifier: Verifier,
    pub clock: Arc<dyn Clock>,
    pub config: Arc<ApiConfig>,
    /// Opens runs for webhook signals (wired to the worker by the binary).
    pub opener: Arc<dyn RunOpener>,
    /// Served at `/.well-known/jwks.json` when set (the `loams dev` issuer's keys).
    pub jwks: Option<Arc<jsonwebtoken::jwk::JwkSet>>,
    /// The app registry and the agents panel reads go through (empty: no app configured).
    pub collab: Arc<Collab>,
}

impl ApiState {
    /// The verified caller, if their token grants `scope`; checked before anything is read or written.
    async fn caller(
        &self,
        ctx: &loams_proto::connect::CallContext,
        scope: &str,
    ) -> Result<Caller, ApiError> {
        let caller = self
            .verifier
            .verify_header(ctx.header("authorization"))
            .await?;
        caller.require(scope)?;
        Ok(caller)
    }

    fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }
}

/// A fresh id `<prefix>-<24 hex digits>` (96 random bits): device ids, panel-read message ids.
pub(crate) fn random_id(prefix: &str) -> Result<String, ApiError> {
    use aws_lc_rs::rand::{SecureRandom, SystemRandom};
    let mut bytes = [0u8; 12];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ApiError::Internal(format!("random {prefix} id")))?;
    Ok(format!("{prefix}-{}", hex::encode(bytes)))
}

/// The whole HTTP surface: the Connect services, the webhooks and (when configured) the JWKS.
pub fn router(state: ApiState) -> axum::Router {
    let connect = factory::routes(state.clone(), loams_proto::connect::Router::new());
    let connect = approvals::routes(state.clone(), connect);
    let connect = devices::routes(state.clone(), connect);
    let connect = collab::routes(state.clone(), connect);
    let mut extra = axum::Router::new().merge(webhooks::routes(state.clone()));
    if let Some(jwks) = state.jwks.clone() {
        extra = extra.route(
            "/.well-known/jwks.json",
            get(move || async move { axum::Json((*jwks).clone()) }),
        );
    }
    // The Connect router carries the fallback (unknown procedure => `unimplemented`), so it is merged last.
    extra.merge(connect.into_axum_router())
}
