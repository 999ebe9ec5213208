//! Serves one agent on 127.0.0.1 for the A2A TCK and the benchmark (docs/conformance.md,
//! docs/benchmarks.md, A2A section): one of the five real agents (`zulip`, `plane`, `forgejo`,
//! `glitchtip`, `analytics`, their apps pointed at an unreachable address, so only the protocol
//! is exercised) or `echo` (the skill `echo`: `{"text": t}` -> `{"echo": t}`, and `sleep`: waits
//! `ms` milliseconds, at most ten seconds, then answers `{"slept": ms}`).
//!
//! ```text
//! serve_agent --agent NAME [--port N] [--store FILE.db [--sync normal]] [--conformance] [--sandbox]
//!             [--allow-private-push]
//! ```
//!
//! - `--sandbox`: starts the sandbox apps (loams-sandbox) in this process and points the agent at
//!   them, so its skills really run; prints `A2A_SANDBOX=<json>` (the seeded channel, repo,
//!   issue ids) as the third line of stdout.
//! - `--store FILE.db`: tasks in that SQLite file (WAL, synchronous=FULL as `loams dev` opens
//!   it); default in memory. `--sync normal` opens it with synchronous=NORMAL instead
//!   (`Sqlite::open_synchronous_normal`: commits survive a process crash, not a power loss).
//! - `--conformance`: the server's conformance mode (ServerOptions::conformance) and, because the
//!   TCK sends no credentials, every caller is accepted as the subject `tck`. Without it callers
//!   need `Authorization: Bearer <SERVE_AGENT_TOKEN>` (default `bench`) and are the subject
//!   `client`.
//! - `--allow-private-push`: push notifications may go to private and loopback webhooks (a local
//!   test receiver); `--conformance` implies it.
//!
//! Prints `A2A_URL=http://127.0.0.1:PORT` on the first line of stdout and the card's signing
//! keys as `A2A_JWKS=<json>` on the second; runs until killed.
//!
//! `cargo run --release -p loams-a2a --example serve_agent -- --agent zulip --conformance`

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{
    AgentSpec, ApprovalGate, AuthError, CallerAuth, CardSigner, GateError, Guards, Principal,
    PushOptions, Risk, ServerOptions, SkillError, SkillSpec, Skills,
};
use loams_agents::*;
use loams_platform::{Sqlite, SystemClock};
use loams_sandbox::{Sandbox, SandboxConfig, SandboxInfo};
use serde_json::{Value, json};

/// The allocator the `loams` binary serves the agents with (functions/loams/src/main.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ORG: &str = "local";
/// Where the real agents' apps are said to be: nothing listens there.
const NO_APP: &str = "http://127.0.0.1:9";
const USAGE: &str = "usage: serve_agent --agent echo|zulip|plane|forgejo|glitchtip|analytics [--port N] [--store FILE.db [--sync normal|full]] [--conformance] [--sandbox] [--allow-private-push]";
/// Longest wait of the echo agent's `sleep` skill.
const MAX_SLEEP_MS: u64 = 10_000;

struct Echo;

#[async_trait]
impl Skills for Echo {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "echo".into(),
            description: "echoes text".into(),
            version: "1.0.0".into(),
            app: None,
            skills: vec![
                SkillSpec {
                    id: "echo".into(),
                    name: "Echo".into(),
                    description: "returns {\"echo\": text}".into(),
                    risk: Risk::Read,
                    tags: vec!["echo".into()],
                    examples: vec!["{\"text\": \"hello\"}".into()],
                },
                SkillSpec {
                    id: "sleep".into(),
                    name: "Sleep".into(),
                    description: "waits ms milliseconds, then returns {\"slept\": ms}".into(),
                    risk: Risk::Read,
                    tags: vec!["echo".into()],
                    examples: vec!["{\"ms\": 100}".into()],
                },
            ],
        }
    }

    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError> {
        match skill {
            "echo" => Ok(json!({"echo": args.get("text").cloned().unwrap_or(Value::Null)})),
            "sleep" => {
                // ProtoJSON peers send every number as a double (google.protobuf.Value).
                let ms = args.get("ms").and_then(Value::as_f64).unwrap_or(0.0);
                if !(0.0..=MAX_SLEEP_MS as f64).contains(&ms) {
                    return Err(SkillError::permanent(format!(
                        "ms must be 0..={MAX_SLEEP_MS}"
                    )));
                }
                let ms = ms as u64;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(json!({"slept": ms}))
            }
            other => Err(SkillError::permanent(format!("no skill {other}"))),
        }
    }
}

/// Accepts the configured token, or (conformance) anyone, with every scope of the agent served.
struct LocalAuth {
    token: Option<String>,
    scopes: Vec<String>,
}

#[async_trait]
impl CallerAuth for LocalAuth {
    async fn verify(&self, bearer: Option<&str>, _audience: &str) -> Result<Principal, AuthError> {
        let subject = match (&self.token, bearer) {
            (None, _) => "tck",
            (Some(_), None) => return Err(AuthError::Missing),
            (Some(t), Some(b)) if t == b => "client",
            (Some(_), Some(_)) => return Err(AuthError::Invalid),
        };
        Ok(Principal {
            subject: subject.into(),
            org: ORG.into(),
            scopes: self.scopes.clone(),
        })
    }
}

/// Destructive skills stay refused: nothing here grants approvals.
struct NoApprovals;

#[async_trait]
impl ApprovalGate for NoApprovals {
    async fn admit(&self, _: &str, _: &str, _: &str, _: &Value, _: &str) -> Result<(), GateError> {
        Err(GateError::Refused("this host grants no approvals".into()))
    }
}

fn agent(name: &str) -> Result<Arc<dyn Skills>, Box<dyn std::error::Error>> {
    Ok(match name {
        "echo" => Arc::new(Echo),
        "zulip" => Arc::new(ZulipAgent::new(&ZulipConfig::new(
            NO_APP,
            "bot@local",
            "k",
        ))?),
        "plane" => Arc::new(PlaneAgent::new(&PlaneConfig::new(
            NO_APP, "k", "ws", "proj",
        ))?),
        "forgejo" => Arc::new(ForgejoAgent::new(&ForgejoConfig::new(
            NO_APP, "t", "o", "r",
        ))?),
        "glitchtip" => Arc::new(GlitchTipAgent::new(&GlitchTipConfig::new(
            NO_APP, "t", "o",
        ))?),
        "analytics" => Arc::new(AnalyticsAgent::new(&AnalyticsConfig::new(
            NO_APP, "id", "s", "p",
        ))?),
        _ => return Err(USAGE.into()),
    })
}

/// The agent `name` configured against the sandbox apps, as `loams dev` configures it.
fn sandbox_agent(
    name: &str,
    i: &SandboxInfo,
) -> Result<Arc<dyn Skills>, Box<dyn std::error::Error>> {
    let t = &i.tokens;
    Ok(match name {
        "zulip" => Arc::new(ZulipAgent::new(&ZulipConfig::new(
            &i.urls.zulip,
            &t.zulip_email,
            &t.zulip_api_key,
        ))?),
        "plane" => {
            let mut cfg = PlaneConfig::new(
                &i.urls.plane,
                &t.plane_api_key,
                &i.plane_workspace,
                &i.plane_project_id,
            );
            cfg.project_identifier = Some("OPS".into());
            Arc::new(PlaneAgent::new(&cfg)?)
        }
        "forgejo" => {
            let mut cfg = ForgejoConfig::new(
                &i.urls.forgejo,
                &t.forgejo_token,
                &i.forgejo_owner,
                &i.forgejo_repo,
            );
            cfg.base_branch = i.forgejo_base.clone();
            Arc::new(ForgejoAgent::new(&cfg)?)
        }
        "glitchtip" => Arc::new(GlitchTipAgent::new(&GlitchTipConfig::new(
            &i.urls.glitchtip,
            &t.glitchtip_token,
            &i.glitchtip_org,
        ))?),
        "analytics" => Arc::new(AnalyticsAgent::new(&AnalyticsConfig::new(
            &i.urls.openpanel,
            &t.openpanel_client_id,
            &t.openpanel_client_secret,
            &i.openpanel_project_id,
        ))?),
        _ => return Err(USAGE.into()),
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut name = None;
    let mut port = 0u16;
    let mut store_path = None;
    let mut conformance = false;
    let mut sandbox = false;
    let mut sync_normal = false;
    let mut allow_private_push = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--agent" => name = args.next(),
            "--port" => port = args.next().ok_or(USAGE)?.parse()?,
            "--store" => store_path = args.next(),
            "--conformance" => conformance = true,
            "--sandbox" => sandbox = true,
            "--allow-private-push" => allow_private_push = true,
            "--sync" => match args.next().as_deref() {
                Some("normal") => sync_normal = true,
                Some("full") => sync_normal = false,
                _ => return Err(USAGE.into()),
            },
            _ => return Err(USAGE.into()),
        }
    }
    let name = name.ok_or(USAGE)?;
    // Kept alive for as long as the agent serves.
    let mut apps = None;
    let skills = if sandbox {
        let handle = Sandbox::start(SandboxConfig::default()).await?;
        let skills = sandbox_agent(&name, &handle.info())?;
        apps = Some(handle);
        skills
    } else {
        agent(&name)?
    };
    let clock = Arc::new(SystemClock);
    let store = Arc::new(match store_path {
        Some(path) if sync_normal => Sqlite::open_synchronous_normal(path, clock)?,
        Some(path) => Sqlite::open(path, clock)?,
        None => Sqlite::memory(clock)?,
    });
    let token = std::env::var("SERVE_AGENT_TOKEN").unwrap_or_else(|_| "bench".into());
    let guards = Guards {
        auth: Arc::new(LocalAuth {
            token: (!conformance).then_some(token),
            scopes: loams_a2a::every_scope(&skills.card().name),
        }),
        gate: Arc::new(NoApprovals),
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    // The TCK's webhook receiver listens on localhost: conformance runs must reach it.
    let options = ServerOptions {
        conformance,
        push: PushOptions {
            allow_private_targets: conformance || allow_private_push,
            ..PushOptions::default()
        },
        ..ServerOptions::default()
    };
    let signer = CardSigner::generate()?;
    let jwks = serde_json::to_string(&signer.jwks()?)?;
    let app = loams_a2a::router_with(
        skills,
        store,
        ORG.into(),
        signer,
        url.clone(),
        guards,
        options,
    );
    let mut out = std::io::stdout();
    writeln!(out, "A2A_URL={url}")?;
    writeln!(out, "A2A_JWKS={jwks}")?;
    if let Some(apps) = &apps {
        writeln!(out, "A2A_SANDBOX={}", serde_json::to_string(&apps.info())?)?;
    }
    out.flush()?;
    axum::serve(listener, app).await?;
    Ok(())
}
