//! A trivial agent for interoperability tests: serves the skills `echo` (returns its `text`
//! argument) and `sleep` (waits `ms` milliseconds, at most ten seconds) on 127.0.0.1 with an
//! in-memory store, and prints its URL as `A2A_URL=http://127.0.0.1:PORT` on the first line of
//! stdout and the public keys its card is signed with as `A2A_JWKS=<json>` on the second. Callers authenticate with `Authorization: Bearer <token>`, the token being the
//! `ECHO_AGENT_TOKEN` environment variable (default `interop`). `ECHO_AGENT_ALLOW_PRIVATE_PUSH=1`
//! lets push notifications go to private and loopback webhooks (a local test receiver). Runs
//! until killed.
//!
//! `cargo run -p loams-a2a --example echo_agent`

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{
    AgentSpec, ApprovalGate, AuthError, CallerAuth, CardSigner, GateError, Guards, Principal,
    PushOptions, Risk, ServerOptions, SkillError, SkillSpec, Skills,
};
use loams_platform::{Sqlite, SystemClock};
use serde_json::{Value, json};

const ORG: &str = "interop";
const MAX_SLEEP_MS: u64 = 10_000;

struct Echo;

fn skill(id: &str, description: &str) -> SkillSpec {
    SkillSpec {
        id: id.into(),
        name: id.into(),
        description: description.into(),
        risk: Risk::Read,
        tags: vec!["interop".into()],
        examples: vec![],
    }
}

#[async_trait]
impl Skills for Echo {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "echo".into(),
            description: "echoes text, for interoperability tests".into(),
            version: "1.0.0".into(),
            skills: vec![
                skill("echo", "returns {\"echo\": text}"),
                skill(
                    "sleep",
                    "waits ms milliseconds, then returns {\"slept\": ms}",
                ),
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

/// Accepts exactly the configured token, as the caller `interop-client`.
struct FixedToken(String);

#[async_trait]
impl CallerAuth for FixedToken {
    async fn verify(&self, bearer: Option<&str>, _audience: &str) -> Result<Principal, AuthError> {
        match bearer {
            None => Err(AuthError::Missing),
            Some(t) if t == self.0 => Ok(Principal {
                subject: "interop-client".into(),
                org: ORG.into(),
            }),
            Some(_) => Err(AuthError::Invalid),
        }
    }
}

/// No skill of this agent is destructive, so nothing ever asks; refuse to be safe.
struct NoApprovals;

#[async_trait]
impl ApprovalGate for NoApprovals {
    async fn admit(&self, _: &str, _: &str, _: &str, _: &Value, _: &str) -> Result<(), GateError> {
        Err(GateError::Refused("this agent grants no approvals".into()))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let token = std::env::var("ECHO_AGENT_TOKEN").unwrap_or_else(|_| "interop".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let store = Arc::new(Sqlite::memory(Arc::new(SystemClock))?);
    let guards = Guards {
        auth: Arc::new(FixedToken(token)),
        gate: Arc::new(NoApprovals),
    };
    let signer = CardSigner::generate()?;
    let jwks = serde_json::to_string(&signer.jwks()?)?;
    let options = ServerOptions {
        push: PushOptions {
            allow_private_targets: std::env::var("ECHO_AGENT_ALLOW_PRIVATE_PUSH").as_deref()
                == Ok("1"),
            ..PushOptions::default()
        },
        ..ServerOptions::default()
    };
    let app = loams_a2a::router_with(
        Arc::new(Echo),
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
    out.flush()?;
    axum::serve(listener, app).await?;
    Ok(())
}
