//! Wires the whole backend into one process: embedded store, the five agents (each its own A2A server), the
//! worker and scheduler, and the HTTP API. `loams dev` keeps it up; `loams demo` drives one run through it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use async_trait::async_trait;
use loams_a2a::{A2aClient, CardSigner, ClientOptions, Guards, Skills};
use loams_agents::{
    AnalyticsAgent, AnalyticsConfig, ForgejoAgent, ForgejoConfig, GlitchTipAgent, GlitchTipConfig,
    PlaneAgent, PlaneConfig, ZulipAgent, ZulipConfig,
};
use loams_api::{
    AgentAuth, AgentLink, AgentTokens, ApiConfig, ApiError, ApiState, ApprovalBroker, Collab,
    GlitchtipHook, Issuer, RegisteredApp, RunOpener,
};
use loams_factory::Signal;
use loams_model::{ChatModel, ModelConfig, OpenAiCompatible, Replay};
use loams_platform::{Clock, Queue, Sqlite, Store, SystemClock, Timers};
use loams_sandbox::{Sandbox, SandboxConfig, SandboxInfo};
use loams_worker::{A2aAgents, AgentCaller, Scheduler, Worker, WorkerDeps, WorkerError};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{
    AGENTS, AnalyticsSettings, App, AppSettings, Config, ForgejoSettings, GlitchtipSettings,
    MIN_WEBHOOK_TOKEN, PlaneSettings, Secret, WebhookSettings, ZulipSettings,
};

/// Timeout of every app call an agent makes.
const APP_TIMEOUT: Duration = Duration::from_secs(15);
/// How often the scheduler looks for due timers.
const SCHEDULER_TICK: Duration = Duration::from_millis(20);
/// Queue workers running side by side in this process.
const WORKERS: usize = 2;
/// Issuer and audience of the tokens `loams dev` issues and accepts.
pub const DEV_ISSUER: &str = "loams-dev";
pub const DEV_AUDIENCE: &str = "loams-api";
/// Issuer of the tokens the worker presents to the agents. They are signed with a key of their own, never the
/// people's issuer key: an agent then trusts only the worker, and whoever can mint agent tokens cannot mint a
/// person's token (or the reverse).
pub const AGENT_TOKEN_ISSUER: &str = "loams-agent-tokens";
/// Issuer of the tokens the API presents to the agents when a person reads a panel. A key of its own again: the
/// API cannot act as the worker, and the agents accept its tokens for reads only.
pub const PANEL_TOKEN_ISSUER: &str = "loams-panel-tokens";

/// The state the stack runs on: the ports, and the clock they share.
#[derive(Clone)]
pub struct Backend {
    pub store: Arc<dyn Store>,
    pub queue: Arc<dyn Queue>,
    pub timers: Arc<dyn Timers>,
    pub clock: Arc<dyn Clock>,
}

impl Backend {
    /// The embedded default: one SQLite file in the data directory serving all three ports.
    pub fn sqlite(data_dir: &Path) -> anyhow::Result<Backend> {
        create_private_dir(data_dir)?;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let db = data_dir.join("loams.db");
        let sqlite = Arc::new(
            Sqlite::open(&db, clock.clone())
                .with_context(|| format!("opening the store {}", db.display()))?,
        );
        Ok(Backend {
            store: sqlite.clone(),
            queue: sqlite.clone(),
            timers: sqlite,
            clock,
        })
    }
}

/// The running backend.
pub struct Stack {
    pub api_url: String,
    pub worker: Arc<Worker>,
    pub store: Arc<dyn Store>,
    pub issuer: Issuer,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Stack {
    pub async fn start(
        config: &Config,
        apps: &AppSettings,
        model: Arc<dyn ChatModel>,
        backend: Backend,
    ) -> anyhow::Result<Stack> {
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();

        let issuer = dev_issuer(&config.data_dir)?;
        // The agents accept only tokens of the agent-token key minted for their own URL, and run a destructive
        // skill only under a settled approval from the store that matches the call; the worker's clients carry
        // such tokens. The key is made fresh at each start: agent tokens live minutes and both ends are in this
        // process.
        let agent_tokens = Issuer::generate(AGENT_TOKEN_ISSUER, AGENT_TOKEN_ISSUER)
            .map_err(|e| anyhow!("agent token key: {e}"))?;
        let panel_tokens = Issuer::generate(PANEL_TOKEN_ISSUER, PANEL_TOKEN_ISSUER)
            .map_err(|e| anyhow!("panel token key: {e}"))?;
        let guards = Guards {
            auth: Arc::new(
                AgentAuth::new(agent_tokens.verifier()).with_panels(panel_tokens.verifier()),
            ),
            gate: Arc::new(ApprovalBroker::new(
                backend.store.clone(),
                backend.clock.clone(),
            )),
        };
        let tokens = Arc::new(AgentTokens::new(agent_tokens, config.org.clone()));
        let mut served = HashMap::new();
        for (name, skills) in agents(apps)? {
            let (agent, task) = serve_agent(
                name,
                skills,
                backend.store.clone(),
                &config.org,
                guards.clone(),
                stop_rx.clone(),
            )
            .await?;
            tasks.push(task);
            served.insert(name.to_string(), agent);
        }
        let registry = AGENTS
            .iter()
            .map(|name| RegisteredApp {
                id: name.to_string(),
                agent: served
                    .get(*name)
                    .map(|agent| AgentLink::new(&agent.url, agent.jwks.clone())),
            })
            .collect();
        let collab = Collab::new(
            config.org.clone(),
            config.env.clone(),
            registry,
            panel_tokens,
        );
        let mut directory = HashMap::new();
        for (name, agent) in served {
            // The agents run in this process: the worker hands its calls to their routers instead of sending them
            // through loopback connections (their ports stay open for other clients).
            let client = A2aClient::in_process(
                &agent.url,
                &agent.jwks,
                ClientOptions::default(),
                agent.router,
            )
            .await
            .with_context(|| format!("connecting to agent {name}"))?;
            directory.insert(name, client.with_tokens(tokens.clone()));
        }

        let worker = Arc::new(Worker::new(worker_deps(
            config,
            Some(RunStart::of(apps)),
            &backend,
            Arc::new(A2aAgents::new(directory)),
            model,
        )));
        for _ in 0..WORKERS {
            let worker = worker.clone();
            let stop = stop_rx.clone();
            tasks.push(tokio::spawn(async move { worker.run(stop).await }));
        }
        let scheduler = Scheduler::new(
            backend.timers.clone(),
            backend.queue.clone(),
            backend.clock.clone(),
        );
        let mut scheduler_stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            while !*scheduler_stop.borrow() {
                if let Err(e) = scheduler.fire_due().await {
                    tracing::warn!(error = %e, "scheduler pass failed");
                }
                tokio::select! {
                    _ = tokio::time::sleep(SCHEDULER_TICK) => {}
                    _ = scheduler_stop.changed() => {}
                }
            }
        }));

        let state = ApiState {
            store: backend.store.clone(),
            queue: backend.queue,
            verifier: issuer.verifier(),
            clock: backend.clock,
            config: Arc::new(api_config(
                config,
                webhook_token(config)?,
                apps.glitchtip.url.clone(),
            )),
            opener: Arc::new(WorkerOpener(worker.clone())),
            jwks: Some(Arc::new(issuer.jwks())),
            collab: Arc::new(collab),
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("setting `listen`: cannot bind {}", config.listen))?;
        let api_url = format!("http://{}", listener.local_addr()?);
        tasks.push(serve(listener, loams_api::router(state), stop_rx.clone()));

        Ok(Stack {
            api_url,
            worker,
            store: backend.store,
            issuer,
            stop,
            tasks,
        })
    }

    /// A bearer token of the dev issuer for `user` in `org`, valid for an hour.
    pub fn token(&self, user: &str, org: &str) -> anyhow::Result<String> {
        dev_token(&self.issuer, user, org)
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// The API's webhooks, from the configuration; shared by `loams dev` and the API function. `glitchtip_token` is the
/// alert webhook's path secret, `glitchtip_origin` the GlitchTip whose issue links an alert may carry.
pub(crate) fn api_config(
    config: &Config,
    glitchtip_token: String,
    glitchtip_origin: String,
) -> ApiConfig {
    ApiConfig {
        glitchtip_hooks: vec![GlitchtipHook {
            org: config.org.clone(),
            env: config.env.clone(),
            token: glitchtip_token,
            origin: glitchtip_origin,
        }],
        forgejo_hooks: WebhookSettings::for_api(&config.webhooks.forgejo, &config.org),
        plane_hooks: WebhookSettings::for_api(&config.webhooks.plane, &config.org),
        zulip_hooks: WebhookSettings::for_api(&config.webhooks.zulip, &config.org),
        ..ApiConfig::default()
    }
}

/// What a run starts with: the repository's base branch and the analytics project it observes.
#[derive(Clone, Copy)]
pub(crate) struct RunStart<'a> {
    pub base_branch: &'a str,
    pub analytics_project: &'a str,
}

impl<'a> RunStart<'a> {
    /// `loams dev`'s: the apps' own settings, so the forgejo agent merges into the base runs start from.
    pub fn of(apps: &'a AppSettings) -> RunStart<'a> {
        RunStart {
            base_branch: &apps.forgejo.base,
            analytics_project: &apps.analytics.project_id,
        }
    }
}

/// What a worker needs, from the configuration and the backend; shared by `loams dev` and the Lambda functions.
pub(crate) fn worker_deps(
    config: &Config,
    run_start: Option<RunStart<'_>>,
    backend: &Backend,
    agents: Arc<dyn AgentCaller>,
    model: Arc<dyn ChatModel>,
) -> WorkerDeps {
    let mut factory = loams_factory::Config::default();
    let f = &config.factory;
    factory.max_attempts = f.max_attempts;
    factory.max_generations = f.max_generations;
    factory.observe_window_ms = f.observe_window_ms;
    factory.ci_poll_ms = f.ci_poll_ms;
    factory.budget_micros = f.budget_micros;
    factory.budget_tokens = f.budget_tokens;
    factory.org_budget_micros = f.org_budget_micros;
    factory.org_budget_tokens = f.org_budget_tokens;
    factory.cooldown_ms = f.cooldown_ms;
    factory.target_files = f.target_files.clone();
    factory.channel = f.channel.clone();
    // Without them these keep their defaults; a process that opens runs must have them (runs start with them).
    if let Some(start) = run_start {
        factory.base_branch = start.base_branch.to_string();
        factory.analytics_project_id = start.analytics_project.to_string();
    }
    WorkerDeps {
        store: backend.store.clone(),
        queue: backend.queue.clone(),
        timers: backend.timers.clone(),
        clock: backend.clock.clone(),
        agents,
        model,
        env: config.env.clone(),
        config: factory,
        policy: config.policy.clone(),
        prices: loams_factory::Prices::default(),
        owner: Some(config.owner.clone()),
    }
}

/// The dev issuer's key lives in the data directory, so tokens survive a restart of `loams dev`.
pub fn dev_issuer(data_dir: &Path) -> anyhow::Result<Issuer> {
    let path = data_dir.join("issuer.pk8");
    let pkcs8 = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            create_private_dir(data_dir)?;
            let key = Issuer::generate_pkcs8().map_err(|e| anyhow!("dev issuer: {e}"))?;
            write_private(&path, &key)?;
            key
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    Issuer::from_pkcs8(&pkcs8, DEV_ISSUER, DEV_AUDIENCE)
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The GlitchTip webhook's URL token: the configured one, or one made at first start and kept in the data
/// directory, so the URL given to GlitchTip stays valid across restarts.
pub fn webhook_token(config: &Config) -> anyhow::Result<String> {
    if let Some(token) = &config.webhook_token {
        return Ok(token.expose().to_string());
    }
    let path = config.data_dir.join("webhook.token");
    match std::fs::read_to_string(&path) {
        Ok(token) if token.trim().len() >= MIN_WEBHOOK_TOKEN => Ok(token.trim().to_string()),
        Ok(_) => bail!(
            "{}: the webhook token is shorter than {MIN_WEBHOOK_TOKEN} characters",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut bytes = [0u8; 24];
            aws_lc_rs::rand::fill(&mut bytes)
                .map_err(|_| anyhow!("no randomness for the webhook token"))?;
            let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            create_private_dir(&config.data_dir)?;
            write_private(&path, token.as_bytes())?;
            Ok(token)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Creates the data directory readable by its owner only (it holds the store and keys).
pub(crate) fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("setting `data_dir`: cannot create {}", dir.display()))
}

/// Writes a secret readable by its owner only, whole or not at all. The temporary file is created fresh (never
/// an existing file or a symlink someone planted), then renamed over the target.
fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A bearer token of `issuer` for `user` in `org`, valid for an hour.
pub fn dev_token(issuer: &Issuer, user: &str, org: &str) -> anyhow::Result<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    issuer
        .issue(user, org, loams_api::scope::ALL, now, 3600)
        .map_err(|e| anyhow!("issuing a token: {e}"))
}

/// The webhook opens runs through the worker, which owns run creation and the cooldown.
pub(crate) struct WorkerOpener(pub(crate) Arc<Worker>);

#[async_trait]
impl RunOpener for WorkerOpener {
    async fn open(&self, org: &str, _env: &str, signal: Signal) -> Result<String, ApiError> {
        match self.0.open(org, signal).await {
            Ok(opened) => Ok(opened.run_id),
            Err(WorkerError::OpenRefused(reason)) => Err(ApiError::FailedPrecondition(reason)),
            Err(e) => Err(ApiError::Unavailable(e.to_string())),
        }
    }
}

pub(crate) fn agents(apps: &AppSettings) -> anyhow::Result<Vec<(&'static str, Arc<dyn Skills>)>> {
    AGENTS
        .into_iter()
        .map(|name| {
            let app = apps
                .app(name)
                .ok_or_else(|| anyhow!("no agent named {name}"))?;
            Ok((name, agent(&app)?))
        })
        .collect()
}

/// One agent's skills over its app (each holds its own HTTP client, so a process serving one agent builds one).
pub(crate) fn agent(app: &App) -> anyhow::Result<Arc<dyn Skills>> {
    Ok(match app {
        App::Zulip(zulip) => Arc::new(ZulipAgent::new(&ZulipConfig {
            base_url: zulip.url.clone(),
            email: zulip.email.clone(),
            api_key: zulip.api_key.expose().to_string(),
            timeout: APP_TIMEOUT,
        })?),
        App::Plane(plane) => Arc::new(PlaneAgent::new(&PlaneConfig {
            base_url: plane.url.clone(),
            api_key: plane.api_key.expose().to_string(),
            workspace_slug: plane.workspace.clone(),
            project_id: plane.project_id.clone(),
            web_url: None,
            // Read from the project on first use.
            project_identifier: None,
            timeout: APP_TIMEOUT,
        })?),
        App::Forgejo(forgejo) => Arc::new(ForgejoAgent::new(&ForgejoConfig {
            base_url: forgejo.url.clone(),
            token: forgejo.token.expose().to_string(),
            owner: forgejo.owner.clone(),
            repo: forgejo.repo.clone(),
            base_branch: forgejo.base.clone(),
            timeout: APP_TIMEOUT,
        })?),
        App::Glitchtip(glitchtip) => Arc::new(GlitchTipAgent::new(&GlitchTipConfig {
            base_url: glitchtip.url.clone(),
            token: glitchtip.token.expose().to_string(),
            org_slug: glitchtip.org.clone(),
            timeout: APP_TIMEOUT,
        })?),
        App::Analytics(analytics) => Arc::new(AnalyticsAgent::new(&AnalyticsConfig {
            base_url: analytics.url.clone(),
            client_id: analytics.client_id.clone(),
            client_secret: analytics.client_secret.expose().to_string(),
            project_id: analytics.project_id.clone(),
            timeout: APP_TIMEOUT,
        })?),
    })
}

/// An agent this process serves.
struct ServedAgent {
    url: String,
    /// The public keys its card is signed with.
    jwks: loams_a2a::Jwks,
    /// Its routes, for calls from within this process.
    router: axum::Router,
}

/// Serves one agent on its own 127.0.0.1 port (its card lives at the root of its origin).
async fn serve_agent(
    name: &str,
    skills: Arc<dyn Skills>,
    store: Arc<dyn Store>,
    org: &str,
    guards: Guards,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<(ServedAgent, JoinHandle<()>)> {
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .with_context(|| format!("binding agent {name}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let signer = CardSigner::generate().map_err(|e| anyhow!("agent {name} card key: {e}"))?;
    let jwks = signer
        .jwks()
        .map_err(|e| anyhow!("agent {name} card key: {e}"))?;
    let router = loams_a2a::router(skills, store, org.to_string(), signer, url.clone(), guards);
    let task = serve(listener, router.clone(), stop);
    Ok((ServedAgent { url, jwks, router }, task))
}

fn serve(
    listener: TcpListener,
    router: axum::Router,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let shutdown = async move {
            while !*stop.borrow() {
                if stop.changed().await.is_err() {
                    break;
                }
            }
        };
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "server stopped");
        }
    })
}

/// The model the config asks for: a replayed cassette, or an OpenAI-compatible endpoint.
pub fn model(config: &Config) -> anyhow::Result<Arc<dyn ChatModel>> {
    if let Some(path) = &config.model.cassette {
        let replay = Replay::from_file(path)
            .with_context(|| format!("setting `model.cassette`: {}", path.display()))?;
        return Ok(Arc::new(replay));
    }
    let client = OpenAiCompatible::new(ModelConfig {
        base_url: config.model.base_url.clone(),
        model: config.model.model.clone(),
        api_key: config.model_api_key()?,
        timeout: loams_model::ANSWER_TIMEOUT,
    })
    .context("setting `model`")?;
    Ok(Arc::new(client))
}

/// App settings pointing at a running sandbox.
pub fn sandbox_apps(info: &SandboxInfo) -> AppSettings {
    let t = &info.tokens;
    AppSettings {
        zulip: ZulipSettings {
            url: info.urls.zulip.clone(),
            email: t.zulip_email.clone(),
            api_key: Secret::new(t.zulip_api_key.clone()),
        },
        plane: PlaneSettings {
            url: info.urls.plane.clone(),
            api_key: Secret::new(t.plane_api_key.clone()),
            workspace: info.plane_workspace.clone(),
            project_id: info.plane_project_id.clone(),
        },
        forgejo: ForgejoSettings {
            url: info.urls.forgejo.clone(),
            token: Secret::new(t.forgejo_token.clone()),
            owner: info.forgejo_owner.clone(),
            repo: info.forgejo_repo.clone(),
            base: info.forgejo_base.clone(),
        },
        glitchtip: GlitchtipSettings {
            url: info.urls.glitchtip.clone(),
            token: Secret::new(t.glitchtip_token.clone()),
            org: info.glitchtip_org.clone(),
        },
        analytics: AnalyticsSettings {
            url: info.urls.openpanel.clone(),
            client_id: t.openpanel_client_id.clone(),
            client_secret: Secret::new(t.openpanel_client_secret.clone()),
            project_id: info.openpanel_project_id.clone(),
        },
    }
}

/// `loams dev`: the stack on the configured apps (or an in-process sandbox), up until Ctrl-C.
pub async fn dev(config: Config, sandbox_state: Option<PathBuf>) -> anyhow::Result<()> {
    let model = model(&config)?;
    let (apps, sandbox) = match &config.apps {
        Some(apps) => (apps.clone(), None),
        None => {
            let sandbox = Sandbox::start(SandboxConfig {
                state_file: sandbox_state,
                ..SandboxConfig::default()
            })
            .await
            .context("starting the sandbox apps")?;
            (sandbox_apps(&sandbox.info()), Some(sandbox))
        }
    };
    let stack = Stack::start(&config, &apps, model, Backend::from_config(&config).await?).await?;
    println!("loams dev: API on {}", stack.api_url);
    println!("  JWKS:     {}/.well-known/jwks.json", stack.api_url);
    println!(
        "  webhook:  {}/webhooks/glitchtip/{}",
        stack.api_url,
        webhook_token(&config)?
    );
    println!("  token:    {}", stack.token("dev", &config.org)?);
    if let Some(sandbox) = &sandbox {
        println!(
            "  sandbox:  {}",
            serde_json::to_string(&sandbox.info().urls)?
        );
    }
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    stack.shutdown().await;
    if let Some(sandbox) = sandbox {
        sandbox.shutdown().await;
    }
    Ok(())
}

/// `loams sandbox`: the fake apps alone, in their own process, so they outlive a killed `loams`.
pub async fn sandbox_only(
    state: Option<PathBuf>,
    urls_file: Option<PathBuf>,
) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(SandboxConfig {
        state_file: state,
        ..SandboxConfig::default()
    })
    .await
    .context("starting the sandbox apps")?;
    let info = serde_json::to_string_pretty(&sandbox.info())?;
    match urls_file {
        Some(path) => {
            // Written whole then renamed, so a reader never sees half a file.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, &info)?;
            std::fs::rename(&tmp, &path)?;
        }
        None => println!("{info}"),
    }
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    sandbox.shutdown().await;
    Ok(())
}
