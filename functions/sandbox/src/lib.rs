//! loams-sandbox: stateful fake Zulip, Plane, Forgejo, GlitchTip and OpenPanel servers for tests and demos.
//!
//! Each app listens on its own 127.0.0.1 port and answers the subset of its official API that the agents use,
//! with the official request and response shapes. All state sits behind one mutex (the apps are coupled: the
//! Forgejo default branch is "production", which drives GlitchTip events and OpenPanel counts) and can be
//! persisted to a JSON file after each change so the sandbox survives restarts of the system under test.

// Guards return the finished error `Response` (128 bytes); boxing it buys nothing for a fake server.
#![allow(clippy::result_large_err)]

mod ci;
mod control;
mod fault;
mod forgejo;
mod git;
mod glitchtip;
mod openpanel;
mod persist;
mod plane;
mod record;
mod util;
mod zulip;

pub use ci::{CiCheck, CiRule};
pub use control::{Counts, ForgejoCounts, GlitchtipCounts, PlaneCounts, ZulipCounts};
pub use fault::{
    ArmedFault, Effect, Fault, MAX_DELAY_MS, MAX_FIELD_BYTES, MAX_RULES, MAX_TIMES, Phase,
};
pub use glitchtip::ProducingMode;
pub use record::Exchange;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Largest request body any fake app accepts.
pub(crate) const MAX_BODY_BYTES: usize = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("invalid sandbox config: {0}")]
    Config(String),
    #[error("cannot bind {app} on 127.0.0.1:{port}: {source}")]
    Bind {
        app: &'static str,
        port: u16,
        source: std::io::Error,
    },
    #[error("state file {path}: {message}")]
    State { path: PathBuf, message: String },
}

pub type Result<T, E = SandboxError> = std::result::Result<T, E>;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Ports {
    pub zulip: u16,
    pub plane: u16,
    pub forgejo: u16,
    pub glitchtip: u16,
    pub openpanel: u16,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Tokens {
    pub zulip_email: String,
    pub zulip_api_key: String,
    pub plane_api_key: String,
    pub forgejo_token: String,
    /// A second Forgejo account (`maintainer`), for tests about pull requests the agent did not open.
    pub forgejo_maintainer_token: String,
    pub glitchtip_token: String,
    pub openpanel_client_id: String,
    pub openpanel_client_secret: String,
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens {
            zulip_email: "loams-bot@zulip.example".into(),
            zulip_api_key: "sandbox-zulip-key".into(),
            plane_api_key: "plane_api_sandbox".into(),
            forgejo_token: "sandbox-forgejo-token".into(),
            forgejo_maintainer_token: "sandbox-forgejo-maintainer-token".into(),
            glitchtip_token: "sandbox-glitchtip-token".into(),
            openpanel_client_id: "0b5a7c1e-4f2d-4c8b-9a6e-1d3f5b7c9e21".into(),
            openpanel_client_secret: "sec_sandbox".into(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ZulipSeed {
    /// Channels that exist; posting to any other is refused as the real server does.
    pub channels: Vec<String>,
    pub bot_full_name: String,
}

impl Default for ZulipSeed {
    fn default() -> Self {
        ZulipSeed {
            channels: vec!["factory".into()],
            bot_full_name: "Loams".into(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct PlaneSeed {
    pub workspace: String,
    pub project_id: String,
    /// Project identifier used in work item keys (`OPS-12`).
    pub project_identifier: String,
    pub project_name: String,
}

impl Default for PlaneSeed {
    fn default() -> Self {
        PlaneSeed {
            workspace: "acme".into(),
            project_id: "5f0c8d2e-3b1a-4c6d-9e8f-7a6b5c4d3e2f".into(),
            project_identifier: "OPS".into(),
            project_name: "Operations".into(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RepoSeed {
    pub owner: String,
    pub name: String,
    pub default_branch: String,
    pub files: BTreeMap<String, String>,
}

impl Default for RepoSeed {
    fn default() -> Self {
        let checkout = "\"\"\"Checkout pricing.\"\"\"\n\n\ndef apply_discount(price, percent):\n    \
                        \"\"\"Return the price after a percentage discount.\"\"\"\n    \
                        return price - price * percent / 0\n";
        RepoSeed {
            owner: "acme".into(),
            name: "shop".into(),
            default_branch: "main".into(),
            files: [
                (
                    "README.md".to_string(),
                    "# shop\n\nThe checkout service.\n".to_string(),
                ),
                ("src/checkout.py".to_string(), checkout.to_string()),
            ]
            .into(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct GlitchtipSeed {
    pub org_slug: String,
    pub project_id: u64,
    pub project_slug: String,
    pub project_name: String,
    pub issue_id: u64,
    pub title: String,
    pub culprit: String,
    pub level: String,
    /// While production is broken the seeded issue gets one event per interval.
    pub event_interval_ms: u64,
}

impl Default for GlitchtipSeed {
    fn default() -> Self {
        GlitchtipSeed {
            org_slug: "acme".into(),
            project_id: 1,
            project_slug: "shop".into(),
            project_name: "shop".into(),
            issue_id: 42,
            title: "ZeroDivisionError: division by zero".into(),
            culprit: "checkout.apply_discount".into(),
            level: "error".into(),
            event_interval_ms: 100,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct OpenpanelSeed {
    pub project_id: String,
    /// The analytics event that mirrors the seeded GlitchTip error; other event names count zero.
    pub event: String,
}

impl Default for OpenpanelSeed {
    fn default() -> Self {
        OpenpanelSeed {
            project_id: "shop".into(),
            event: "checkout_error".into(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    pub ports: Ports,
    /// Where to keep the state across restarts; loaded at start when present, rewritten after each change.
    pub state_file: Option<PathBuf>,
    pub tokens: Tokens,
    pub zulip: ZulipSeed,
    pub plane: PlaneSeed,
    pub repo: RepoSeed,
    pub ci: CiCheck,
    pub glitchtip: GlitchtipSeed,
    pub openpanel: OpenpanelSeed,
    /// Keep a log of every app request and answer (the newest 1000), served at `GET /_sandbox/requests`, for
    /// contract tests. Off by default: it buffers every body.
    pub record_requests: bool,
}

impl SandboxConfig {
    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(SandboxError::Config(m.into()));
        if self.glitchtip.event_interval_ms == 0 {
            return bad("glitchtip.event_interval_ms must be at least 1");
        }
        if self.zulip.channels.is_empty() {
            return bad("zulip.channels must name at least one channel");
        }
        let r = &self.repo;
        if r.owner.is_empty() || r.name.is_empty() || r.default_branch.is_empty() {
            return bad("repo.owner, repo.name and repo.default_branch must not be empty");
        }
        let t = &self.tokens;
        let secrets = [
            &t.zulip_email,
            &t.zulip_api_key,
            &t.plane_api_key,
            &t.forgejo_token,
            &t.forgejo_maintainer_token,
            &t.glitchtip_token,
            &t.openpanel_client_id,
            &t.openpanel_client_secret,
        ];
        if secrets.iter().any(|s| s.is_empty()) {
            return bad("tokens must not be empty");
        }
        // The token names the account; one token for both would make every request the bot's.
        if t.forgejo_token == t.forgejo_maintainer_token {
            return bad("tokens.forgejo_token and tokens.forgejo_maintainer_token must differ");
        }
        Ok(())
    }
}

/// Base URLs of the five fake apps (no trailing slash).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Urls {
    pub zulip: String,
    pub plane: String,
    pub forgejo: String,
    pub glitchtip: String,
    pub openpanel: String,
}

/// Everything a client needs to talk to the sandbox, e.g. printed by `loams sandbox` for another process.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SandboxInfo {
    pub urls: Urls,
    pub tokens: Tokens,
    pub plane_workspace: String,
    pub plane_project_id: String,
    pub forgejo_owner: String,
    pub forgejo_repo: String,
    pub forgejo_base: String,
    pub glitchtip_org: String,
    pub glitchtip_issue_id: u64,
    pub openpanel_project_id: String,
    pub zulip_channel: String,
}

/// All apps' state; one lock because production (Forgejo) drives GlitchTip and OpenPanel.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct State {
    pub zulip: zulip::ZulipState,
    pub plane: plane::PlaneState,
    pub forgejo: forgejo::ForgejoState,
    pub glitchtip: glitchtip::GlitchtipState,
}

pub(crate) struct Shared {
    pub config: SandboxConfig,
    pub urls: Urls,
    state: Mutex<State>,
    pub requests: record::Log,
    pub faults: fault::Faults,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A handler that panicked mid-change leaves plain data behind; keep serving rather than wedge every app.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes the state file, if configured. Called by every handler that changed state, under the lock.
    pub fn persist(&self, state: &State) -> Result<()> {
        match &self.config.state_file {
            Some(path) => persist::save(path, state),
            None => Ok(()),
        }
    }
}

pub struct Sandbox;

pub struct SandboxHandle {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
}

const APPS: [&str; 5] = ["zulip", "plane", "forgejo", "glitchtip", "openpanel"];

impl Sandbox {
    pub async fn start(config: SandboxConfig) -> Result<SandboxHandle> {
        config.validate()?;
        let p = &config.ports;
        let mut listeners = Vec::new();
        for (app, port) in
            APPS.into_iter()
                .zip([p.zulip, p.plane, p.forgejo, p.glitchtip, p.openpanel])
        {
            let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
                .await
                .map_err(|source| SandboxError::Bind { app, port, source })?;
            let addr =
                listener
                    .local_addr()
                    .map_err(|source| SandboxError::Bind { app, port, source })?;
            listeners.push((listener, format!("http://{addr}")));
        }
        let url = |i: usize| listeners[i].1.clone();
        let urls = Urls {
            zulip: url(0),
            plane: url(1),
            forgejo: url(2),
            glitchtip: url(3),
            openpanel: url(4),
        };

        let now = util::now_ms();
        let state = match config
            .state_file
            .as_deref()
            .map(persist::load)
            .transpose()?
            .flatten()
        {
            Some(state) => state,
            None => State::seed(&config, now),
        };
        let shared = Arc::new(Shared {
            config,
            urls,
            state: Mutex::new(state),
            requests: record::Log::default(),
            faults: fault::Faults::default(),
        });
        {
            let mut st = shared.lock();
            st.reconcile_production(&shared.config, now);
            shared.persist(&st)?;
        }

        let routers: [Router<Arc<Shared>>; 5] = [
            zulip::router(),
            plane::router(),
            forgejo::router(),
            glitchtip::router(),
            openpanel::router(),
        ];
        let (stop, _) = watch::channel(false);
        let mut servers = Vec::new();
        for (((listener, _), mut router), name) in listeners.into_iter().zip(routers).zip(APPS) {
            if shared.config.record_requests {
                // Only the app's own routes (and its 404 fallback): the control endpoints are not its API.
                router = router.layer(axum::middleware::from_fn_with_state(
                    (shared.clone(), name),
                    record::record,
                ));
            }
            // Outside the recorder: a request failed before the app saw it is not one the app answered.
            router = router.layer(axum::middleware::from_fn_with_state(
                (shared.clone(), name),
                fault::inject,
            ));
            let app = router
                .merge(control::router())
                .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
                .with_state(shared.clone());
            let mut rx = stop.subscribe();
            servers.push(tokio::spawn(async move {
                let shutdown = async move {
                    let _ = rx.wait_for(|stopped| *stopped).await;
                };
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown)
                    .await
                {
                    tracing::error!(error = %e, "sandbox server stopped");
                }
            }));
        }
        Ok(SandboxHandle {
            shared,
            stop,
            servers,
        })
    }
}

impl State {
    fn seed(config: &SandboxConfig, now: i64) -> State {
        State {
            zulip: zulip::ZulipState::seed(&config.zulip),
            plane: plane::PlaneState::seed(&config.plane),
            forgejo: forgejo::ForgejoState::seed(&config.repo, now),
            glitchtip: glitchtip::GlitchtipState::seed(now),
        }
    }
}

impl SandboxHandle {
    pub fn urls(&self) -> &Urls {
        &self.shared.urls
    }

    pub fn tokens(&self) -> &Tokens {
        &self.shared.config.tokens
    }

    pub fn info(&self) -> SandboxInfo {
        let c = &self.shared.config;
        SandboxInfo {
            urls: self.shared.urls.clone(),
            tokens: c.tokens.clone(),
            plane_workspace: c.plane.workspace.clone(),
            plane_project_id: c.plane.project_id.clone(),
            forgejo_owner: c.repo.owner.clone(),
            forgejo_repo: c.repo.name.clone(),
            forgejo_base: c.repo.default_branch.clone(),
            glitchtip_org: c.glitchtip.org_slug.clone(),
            glitchtip_issue_id: c.glitchtip.issue_id,
            openpanel_project_id: c.openpanel.project_id.clone(),
            zulip_channel: c.zulip.channels.first().cloned().unwrap_or_default(),
        }
    }

    pub fn counts(&self) -> Counts {
        control::counts(&self.shared.lock(), util::now_ms())
    }

    /// The recorded exchanges, oldest first; empty unless `record_requests` is set.
    pub fn requests(&self) -> Vec<Exchange> {
        self.shared.requests.snapshot()
    }

    /// Arms a fault rule (see [`Fault`]); rules apply in the order they were added. An error for a rule out of
    /// bounds, or when [`MAX_RULES`] rules are armed and none is used up.
    pub fn inject(&self, fault: Fault) -> Result<()> {
        self.shared.faults.add(fault).map_err(SandboxError::Config)
    }

    /// The fault rules armed since the last [`Self::clear_faults`], each with how many requests it hit.
    pub fn faults(&self) -> Vec<ArmedFault> {
        self.shared.faults.snapshot()
    }

    pub fn clear_faults(&self) {
        self.shared.faults.clear();
    }

    /// Forces GlitchTip production events on or off, or back to following the default branch.
    pub fn set_producing(&self, mode: ProducingMode) -> Result<()> {
        let mut st = self.shared.lock();
        st.glitchtip.mode = mode;
        st.reconcile_production(&self.shared.config, util::now_ms());
        self.shared.persist(&st)
    }

    /// The Slack-compatible alert GlitchTip's webhook recipient would post for the seeded issue (apps.md 4.3).
    pub fn alert_payload(&self) -> serde_json::Value {
        glitchtip::alert_payload(&self.shared.config, &self.shared.urls.glitchtip)
    }

    /// Stops all five servers and waits for them to finish in-flight requests.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for server in self.servers {
            let _ = server.await;
        }
    }
}
