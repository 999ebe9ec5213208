//! The AWS Lambda entry points (feature `aws`), thin shells over the same parts `loams dev` runs: the API's axum
//! router, each agent's A2A router, the worker's `handle_received` per SQS record (one or more steps of its run, as
//! many as fit in the invocation), and the scheduler's `fire_due`.
//!
//! One binary (`loams-lambda`) serves every function; `LOAMS_FUNCTION` picks which. Everything comes from the
//! environment, read once at start; a missing or bad variable stops the function at start, naming it:
//!
//! | variable | functions | meaning |
//! |---|---|---|
//! | `LOAMS_FUNCTION` | all | `api`, `worker`, `scheduler` or `agent:<zulip\|plane\|forgejo\|glitchtip\|analytics>` |
//! | `LOAMS_CONFIG` | all (optional) | the `loams dev` TOML configuration (`factory`, `policy`, `model`, `apps`, ...) |
//! | `LOAMS_ORG`, `LOAMS_ENV` | all | the tenant and the environment runs are opened in (override `LOAMS_CONFIG`) |
//! | `LOAMS_TABLE`, `LOAMS_QUEUE_URL`, `LOAMS_DEAD_LETTER_URL` | all | the DynamoDB table and the SQS queues |
//! | `LOAMS_AWS_ENDPOINT` | optional | a local emulator (moto) instead of AWS (nothing is created there either) |
//! | `LOAMS_ISSUER_KEY` | api, worker, agents | base64 PKCS#8 P-256 key of the token issuer (`loams token`'s key) |
//! | `LOAMS_CARD_KEY` | worker, agents | base64 PKCS#8 P-256 key the agents sign their cards with |
//! | `LOAMS_AGENT_URL_<NAME>` | worker | each agent's Function URL |
//! | `LOAMS_BASE_URL` | agents (optional) | the agent's own URL; unset: taken from the first request's `Host` |
//! | `LOAMS_WEBHOOK_TOKEN`, `LOAMS_GLITCHTIP_ORIGIN` | api | the GlitchTip webhook's URL token and GlitchTip's URL |

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, anyhow};
use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use loams_a2a::{A2aClient, CardSigner, Guards, Jwks};
use loams_api::{AgentAuth, AgentTokens, ApiState, ApprovalBroker, Issuer};
use loams_factory::Envelope;
use loams_model::Replay;
use loams_platform::aws::{
    BODY_ENCODING_ATTRIBUTE, BatchOutcome, batch_item_failures, decode_body,
};
use loams_worker::{
    A2aAgents, AgentCaller, AgentReply, Scheduler, Settlement, Worker, WorkerError,
};
use serde_json::Value;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::config::{AGENTS, AppSettings, Config, ConfigError, QueueKind, Secret, StoreKind};
use crate::stack::{
    Backend, DEV_AUDIENCE, DEV_ISSUER, WorkerOpener, agent, api_config, model, worker_deps,
};

/// Largest value accepted from one environment variable (Lambda allows 4 KiB for all of them together).
const MAX_VAR_BYTES: usize = 64 * 1024;
/// Scheduler passes per invocation (each fires up to the scheduler's batch of due timers).
const SCHEDULER_PASSES: usize = 20;

/// Which function this process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Function {
    Api,
    Agent(&'static str),
    Worker,
    Scheduler,
}

impl Function {
    pub fn parse(value: &str) -> Result<Function, ConfigError> {
        match value {
            "api" => Ok(Function::Api),
            "worker" => Ok(Function::Worker),
            "scheduler" => Ok(Function::Scheduler),
            other => other
                .strip_prefix("agent:")
                .and_then(|name| AGENTS.iter().find(|a| **a == name))
                .map(|name| Function::Agent(name))
                .ok_or_else(|| ConfigError::Invalid {
                    setting: "LOAMS_FUNCTION",
                    message: format!(
                        "{other:?} is not a function; expected api, worker, scheduler or agent:<{}>",
                        AGENTS.join("|")
                    ),
                }),
        }
    }
}

/// Everything a function reads from its environment.
#[derive(Debug)]
pub struct Settings {
    pub function: Function,
    pub config: Config,
    issuer_key: Option<Secret>,
    card_key: Option<Secret>,
    agent_urls: HashMap<&'static str, String>,
    base_url: Option<String>,
    glitchtip_origin: Option<String>,
}

impl Settings {
    /// Reads the settings through `var` (the process environment in `main`, a map in tests).
    pub fn read(var: impl Fn(&str) -> Option<String>) -> Result<Settings, ConfigError> {
        let get = |name: &'static str| -> Result<Option<String>, ConfigError> {
            match var(name) {
                Some(v) if v.len() > MAX_VAR_BYTES => Err(ConfigError::Invalid {
                    setting: name,
                    message: format!("is longer than {MAX_VAR_BYTES} bytes"),
                }),
                Some(v) if v.trim().is_empty() => Ok(None),
                other => Ok(other),
            }
        };
        let need = |name: &'static str| -> Result<String, ConfigError> {
            get(name)?.ok_or(ConfigError::Invalid {
                setting: name,
                message: "is not set".into(),
            })
        };
        let function = Function::parse(&need("LOAMS_FUNCTION")?)?;
        let mut config = match get("LOAMS_CONFIG")? {
            Some(text) => Config::parse(&text).map_err(|message| ConfigError::Invalid {
                setting: "LOAMS_CONFIG",
                message,
            })?,
            None => Config::default(),
        };
        config.org = need("LOAMS_ORG")?;
        config.env = need("LOAMS_ENV")?;
        // The only writable place on Lambda; nothing durable is kept there.
        config.data_dir = std::env::temp_dir().join("loams");
        let b = &mut config.backend;
        b.store = StoreKind::Dynamodb;
        b.queue = QueueKind::Sqs;
        b.table = need("LOAMS_TABLE")?;
        b.queue_url = Some(need("LOAMS_QUEUE_URL")?);
        b.dead_letter_url = Some(need("LOAMS_DEAD_LETTER_URL")?);
        b.aws_endpoint = get("LOAMS_AWS_ENDPOINT")?;

        let mut settings = Settings {
            function: function.clone(),
            config,
            issuer_key: None,
            card_key: None,
            agent_urls: HashMap::new(),
            base_url: None,
            glitchtip_origin: None,
        };
        match function {
            Function::Api => {
                settings.issuer_key = Some(Secret::new(need("LOAMS_ISSUER_KEY")?));
                settings.config.webhook_token = Some(Secret::new(need("LOAMS_WEBHOOK_TOKEN")?));
                settings.glitchtip_origin = Some(need("LOAMS_GLITCHTIP_ORIGIN")?);
            }
            Function::Worker => {
                settings.issuer_key = Some(Secret::new(need("LOAMS_ISSUER_KEY")?));
                settings.card_key = Some(Secret::new(need("LOAMS_CARD_KEY")?));
                for (agent, name) in AGENTS.into_iter().zip(AGENT_URL_VARS) {
                    settings.agent_urls.insert(agent, need(name)?);
                }
            }
            Function::Agent(_) => {
                settings.issuer_key = Some(Secret::new(need("LOAMS_ISSUER_KEY")?));
                settings.card_key = Some(Secret::new(need("LOAMS_CARD_KEY")?));
                settings.base_url = get("LOAMS_BASE_URL")?;
            }
            Function::Scheduler => {}
        }
        // The API too: a run it opens takes its base branch and analytics project from them.
        if matches!(
            function,
            Function::Api | Function::Worker | Function::Agent(_)
        ) && settings.config.apps.is_none()
        {
            return Err(ConfigError::Invalid {
                setting: "LOAMS_CONFIG",
                message: "must hold the [apps] settings for the API, the worker and the agents"
                    .into(),
            });
        }
        settings.config.validate()?;
        check_url("LOAMS_BASE_URL", settings.base_url.as_deref())?;
        check_url(
            "LOAMS_GLITCHTIP_ORIGIN",
            settings.glitchtip_origin.as_deref(),
        )?;
        for (agent, var) in AGENTS.into_iter().zip(AGENT_URL_VARS) {
            check_url(var, settings.agent_urls.get(agent).map(String::as_str))?;
        }
        Ok(settings)
    }

    /// The process environment.
    pub fn from_env() -> Result<Settings, ConfigError> {
        Settings::read(|name| std::env::var(name).ok())
    }
}

const AGENT_URL_VARS: [&str; 5] = [
    "LOAMS_AGENT_URL_ZULIP",
    "LOAMS_AGENT_URL_PLANE",
    "LOAMS_AGENT_URL_FORGEJO",
    "LOAMS_AGENT_URL_GLITCHTIP",
    "LOAMS_AGENT_URL_ANALYTICS",
];

fn check_url(setting: &'static str, url: Option<&str>) -> Result<(), ConfigError> {
    match url {
        Some(u) if !(u.starts_with("https://") || u.starts_with("http://")) => {
            Err(ConfigError::Invalid {
                setting,
                message: format!("must be an http(s) URL, not {u:?}"),
            })
        }
        _ => Ok(()),
    }
}

/// A base64 PKCS#8 key from the environment.
fn key_bytes(setting: &'static str, key: Option<&Secret>) -> Result<Vec<u8>, ConfigError> {
    let key = key.ok_or(ConfigError::Invalid {
        setting,
        message: "is not set".into(),
    })?;
    STANDARD
        .decode(key.expose().trim())
        .map_err(|e| ConfigError::Invalid {
            setting,
            message: format!("is not base64 (a PKCS#8 P-256 key, base64-encoded): {e}"),
        })
}

fn issuer(settings: &Settings) -> anyhow::Result<Issuer> {
    let der = key_bytes("LOAMS_ISSUER_KEY", settings.issuer_key.as_ref())?;
    Issuer::from_pkcs8(&der, DEV_ISSUER, DEV_AUDIENCE)
        .map_err(|e| anyhow!("setting `LOAMS_ISSUER_KEY`: {e}"))
}

fn card_signer(settings: &Settings) -> anyhow::Result<CardSigner> {
    let der = key_bytes("LOAMS_CARD_KEY", settings.card_key.as_ref())?;
    CardSigner::from_pkcs8(&der).map_err(|e| anyhow!("setting `LOAMS_CARD_KEY`: {e}"))
}

fn apps(settings: &Settings) -> anyhow::Result<&AppSettings> {
    settings
        .config
        .apps
        .as_ref()
        .ok_or_else(|| anyhow!("setting `LOAMS_CONFIG`: [apps] is missing"))
}

/// Runs the function the settings name until the Lambda runtime stops it.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let backend = Backend::open(&settings.config, false).await?;
    let result = match settings.function {
        Function::Api => {
            let router = api_router(&settings, backend)?;
            lambda_http::run_with_streaming_response(router).await
        }
        Function::Agent(name) => {
            let service = agent_service(&settings, name, backend)?;
            lambda_http::run_with_streaming_response(service).await
        }
        Function::Worker => {
            let worker = Arc::new(Worker::new(worker_deps(
                &settings.config,
                Some(apps(&settings)?),
                &backend,
                Arc::new(lazy_agents(&settings)?),
                model(&settings.config)?,
            )));
            lambda_runtime::run(lambda_runtime::service_fn(
                move |event: lambda_runtime::LambdaEvent<SqsEvent>| {
                    let worker = worker.clone();
                    let deadline = invocation_deadline(event.context.deadline);
                    async move {
                        Ok::<_, std::convert::Infallible>(
                            handle_sqs(&worker, event.payload, deadline).await,
                        )
                    }
                },
            ))
            .await
        }
        Function::Scheduler => {
            let scheduler = Arc::new(Scheduler::new(backend.timers, backend.queue, backend.clock));
            lambda_runtime::run(lambda_runtime::service_fn(
                move |_: lambda_runtime::LambdaEvent<Value>| {
                    let scheduler = scheduler.clone();
                    async move { fire_due(&scheduler).await.map_err(|e| e.to_string()) }
                },
            ))
            .await
        }
    };
    result.map_err(|e| anyhow!("lambda runtime: {e}"))
}

/// The API's router, as `loams dev` serves it. Opening a run from a webhook writes the run and enqueues its
/// first message; no effect is performed here (the worker function does that), so the worker this API opens
/// runs through has no agents and a model that answers nothing.
fn api_router(settings: &Settings, backend: Backend) -> anyhow::Result<axum::Router> {
    let config = &settings.config;
    let issuer = issuer(settings)?;
    let no_model =
        Replay::from_json_str(r#"{"completions": []}"#).context("the API's empty model")?;
    // The API opens runs: the factory settings (cooldown, ...) and the app settings a run starts with (base
    // branch, analytics project) come from the same LOAMS_CONFIG as the worker function's.
    let worker = Worker::new(worker_deps(
        config,
        config.apps.as_ref(),
        &backend,
        Arc::new(A2aAgents::new(HashMap::new())),
        Arc::new(no_model),
    ));
    let Backend {
        store,
        queue,
        clock,
        ..
    } = backend;
    let state = ApiState {
        store,
        queue,
        verifier: issuer.verifier(),
        clock,
        config: Arc::new(api_config(
            config,
            config
                .webhook_token
                .as_ref()
                .map(|t| t.expose().to_string())
                .unwrap_or_default(),
            settings.glitchtip_origin.clone().unwrap_or_default(),
        )),
        opener: Arc::new(WorkerOpener(Arc::new(worker))),
        jwks: Some(Arc::new(issuer.jwks())),
    };
    Ok(loams_api::router(state))
}

/// One agent's A2A router. Its card names its own URL, which a Function URL only learns after deployment (the
/// function cannot reference its own URL in the template), so unless `LOAMS_BASE_URL` sets it the router is built
/// on the first request, from the `Host` Lambda routed it by (a Function URL is reachable only by its own host).
fn agent_service(
    settings: &Settings,
    name: &'static str,
    backend: Backend,
) -> anyhow::Result<
    impl tower::Service<
        lambda_http::Request,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future = impl Send,
    >,
> {
    let skills = agent(apps(settings)?, name).context("setting `LOAMS_FUNCTION`")?;
    let issuer = issuer(settings)?;
    // Loaded once here so a bad key fails at start; the router takes a signer of its own when it is built.
    let card_key = card_signer(settings)?
        .to_pkcs8()
        .map_err(|e| anyhow!("setting `LOAMS_CARD_KEY`: {e}"))?;
    let guards = Guards {
        auth: Arc::new(AgentAuth::new(issuer.verifier())),
        gate: Arc::new(ApprovalBroker::new(
            backend.store.clone(),
            backend.clock.clone(),
        )),
    };
    let org = settings.config.org.clone();
    let fixed_url = settings.base_url.clone();
    let router: OnceLock<axum::Router> = OnceLock::new();
    Ok(tower::service_fn(move |req: lambda_http::Request| {
        let ready = match router.get() {
            Some(router) => Ok(router.clone()),
            None => {
                let url = fixed_url.clone().unwrap_or_else(|| {
                    let host = req
                        .headers()
                        .get(http::header::HOST)
                        .and_then(|h| h.to_str().ok())
                        .unwrap_or("localhost");
                    format!("https://{host}")
                });
                CardSigner::from_pkcs8(&card_key).map(|signer| {
                    let built = loams_a2a::router(
                        skills.clone(),
                        backend.store.clone(),
                        org.clone(),
                        signer,
                        url,
                        guards.clone(),
                    );
                    router.get_or_init(|| built).clone()
                })
            }
        };
        async move {
            use tower::ServiceExt;
            match ready {
                Ok(router) => router.oneshot(req).await,
                Err(e) => Ok(axum::response::IntoResponse::into_response((
                    http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("agent card key: {e}"),
                ))),
            }
        }
    }))
}

/// The worker's agent clients, each connected (its signed card fetched and verified) on its first call, so a
/// cold start does not fetch five cards for a step that calls one agent.
fn lazy_agents(settings: &Settings) -> anyhow::Result<LazyAgents> {
    let trusted = card_signer(settings)?
        .jwks()
        .map_err(|e| anyhow!("setting `LOAMS_CARD_KEY`: {e}"))?;
    let tokens = Arc::new(AgentTokens::new(
        issuer(settings)?,
        settings.config.org.clone(),
    ));
    let clients = settings
        .agent_urls
        .iter()
        .map(|(name, url)| (name.to_string(), (url.clone(), OnceCell::new())))
        .collect();
    Ok(LazyAgents {
        clients,
        trusted,
        tokens,
    })
}

struct LazyAgents {
    clients: HashMap<String, (String, OnceCell<A2aClient>)>,
    trusted: Jwks,
    tokens: Arc<AgentTokens>,
}

#[async_trait::async_trait]
impl AgentCaller for LazyAgents {
    async fn call(
        &self,
        agent: &str,
        step: &str,
        skill: &str,
        args: Value,
        approval_id: Option<&str>,
    ) -> AgentReply {
        let Some((url, cell)) = self.clients.get(agent) else {
            return AgentReply::Failed {
                error: format!("no agent named {agent} is configured"),
                retryable: false,
            };
        };
        let connected = cell
            .get_or_try_init(|| async {
                A2aClient::new(url, &self.trusted)
                    .await
                    .map(|c| c.with_tokens(self.tokens.clone()))
            })
            .await;
        match connected {
            Ok(client) => AgentReply::from_call(client.call(step, skill, args, approval_id).await),
            Err(e) => AgentReply::Failed {
                error: format!("connecting to agent {agent}: {e}"),
                retryable: true,
            },
        }
    }
}

/// Handles one SQS batch by `deadline` (the invocation's): each record moves its run by one or more steps (see
/// `Worker::handle_received`), the records side by side (the worker tolerates
/// concurrent steps, of one run too: its appends are conditional). The answer names the records SQS must deliver
/// again (`ReportBatchItemFailures`); on a FIFO queue also every later record of a failed record's group.
///
/// Per record, as the polling worker settles a delivery: done or hopeless (a body that is no envelope, an error
/// that cannot succeed) is a success, so SQS deletes it; a passing failure is reported, so SQS delivers it again
/// after its visibility timeout (not after the worker's own backoff: a batch response cannot say when) and
/// dead-letters it after the queue's `maxReceiveCount`; a step held by another
/// worker moves to a timer, so waiting for its lease does not use up receives.
pub async fn handle_sqs(worker: &Worker, event: SqsEvent, deadline: Instant) -> SqsBatchResponse {
    let fifo = event
        .records
        .first()
        .and_then(|r| r.event_source_arn.as_deref())
        .is_some_and(|arn| arn.ends_with(".fifo"));
    let steps = event.records.iter().map(|record| async move {
        BatchOutcome {
            id: record.message_id.clone().unwrap_or_default(),
            group: record.attributes.get("MessageGroupId").cloned(),
            succeeded: handle_record(worker, record, deadline).await,
        }
    });
    let outcomes = futures::future::join_all(steps).await;
    let mut response = SqsBatchResponse::default();
    for id in batch_item_failures(&outcomes, fifo) {
        response.add_failure(id);
    }
    response
}

/// The invocation's deadline (milliseconds since the epoch, as the runtime API gives it) on the monotonic clock.
fn invocation_deadline(deadline_ms: u64) -> Instant {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms))
}

async fn handle_record(worker: &Worker, record: &SqsMessage, deadline: Instant) -> bool {
    let id = record.message_id.as_deref().unwrap_or("?");
    let encoding = record
        .message_attributes
        .get(BODY_ENCODING_ATTRIBUTE)
        .and_then(|a| a.string_value.as_deref());
    let body = match decode_body(record.body.as_deref().unwrap_or_default(), encoding) {
        Ok(body) => body,
        Err(e) => {
            tracing::warn!(message = id, error = %e, "dropping a queue message whose body does not decode");
            return true;
        }
    };
    let Ok(envelope) = serde_json::from_slice::<Envelope>(&body) else {
        tracing::warn!(
            message = id,
            "dropping a queue message that is not an envelope"
        );
        return true;
    };
    // SQS counts deliveries; a message that came back moves its run by one step (see `Worker::handle_received`).
    let receive_count = record
        .attributes
        .get("ApproximateReceiveCount")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    // Steps after the first start only while one more fits in the invocation's remaining time.
    let handled = worker
        .handle_received(&envelope, receive_count, Some(deadline))
        .await;
    // A retry is reported as a batch item failure: SQS makes the message visible again after its timeout.
    worker.settlement(&envelope, handled, receive_count).await == Settlement::Done
}

/// One scheduler invocation: fires what is due, pass after pass until one finds nothing (timers that fell due
/// meanwhile go too), at most `SCHEDULER_PASSES`; the next invocation takes what is left.
async fn fire_due(scheduler: &Scheduler) -> Result<Value, WorkerError> {
    let mut fired = 0;
    for _ in 0..SCHEDULER_PASSES {
        let n = scheduler.fire_due().await?;
        fired += n;
        if n == 0 {
            break;
        }
    }
    Ok(serde_json::json!({ "fired": fired }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use loams_factory::Signal;
    use serde_json::json;

    /// A deadline no test reaches.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const BASE: [(&str, &str); 5] = [
        ("LOAMS_ORG", "acme"),
        ("LOAMS_ENV", "production"),
        ("LOAMS_TABLE", "loams-prod"),
        (
            "LOAMS_QUEUE_URL",
            "https://sqs.eu-west-1.amazonaws.com/1/work",
        ),
        (
            "LOAMS_DEAD_LETTER_URL",
            "https://sqs.eu-west-1.amazonaws.com/1/work-dlq",
        ),
    ];

    fn error(pairs: &[(&str, &str)]) -> String {
        Settings::read(vars(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn a_missing_or_bad_variable_is_named() {
        assert!(error(&[]).contains("LOAMS_FUNCTION"));
        let mut pairs = vec![("LOAMS_FUNCTION", "agent:jira")];
        assert!(error(&pairs).contains("LOAMS_FUNCTION"));
        pairs[0].1 = "scheduler";
        assert!(error(&pairs).contains("LOAMS_ORG"));
        pairs.extend(BASE);
        let scheduler = Settings::read(vars(&pairs)).unwrap();
        assert_eq!(scheduler.function, Function::Scheduler);
        assert_eq!(scheduler.config.backend.table, "loams-prod");

        pairs.retain(|(k, _)| *k != "LOAMS_TABLE");
        assert!(error(&pairs).contains("LOAMS_TABLE"));
        pairs.push(("LOAMS_TABLE", "x"));
        assert!(
            error(&pairs).contains("backend.table"),
            "a bad table name is refused at start"
        );
        pairs.retain(|(k, _)| *k != "LOAMS_TABLE");
        pairs.push(("LOAMS_TABLE", "loams-prod"));

        pairs[0].1 = "worker";
        pairs.push(("LOAMS_ISSUER_KEY", "a2V5"));
        pairs.push(("LOAMS_CARD_KEY", "a2V5"));
        assert!(error(&pairs).contains("LOAMS_AGENT_URL_ZULIP"));
        for var in AGENT_URL_VARS {
            pairs.push((var, "https://agent.lambda-url.eu-west-1.on.aws/"));
        }
        assert!(
            error(&pairs).contains("LOAMS_CONFIG"),
            "the worker needs [apps]"
        );
        pairs[0].1 = "api";
        assert!(error(&pairs).contains("LOAMS_WEBHOOK_TOKEN"));
        // The API opens runs, which start with the app settings.
        pairs.push(("LOAMS_WEBHOOK_TOKEN", "0123456789abcdef0123456789abcdef"));
        pairs.push(("LOAMS_GLITCHTIP_ORIGIN", "https://glitchtip.example.com"));
        assert!(
            error(&pairs).contains("LOAMS_CONFIG"),
            "the API needs [apps]"
        );
        pairs.truncate(pairs.len() - 2);
        pairs.push(("LOAMS_CONFIG", super::template_tests::APPS));
        pairs.push(("LOAMS_WEBHOOK_TOKEN", "0123456789abcdef0123456789abcdef"));
        pairs.push(("LOAMS_GLITCHTIP_ORIGIN", "glitchtip.example.com"));
        assert!(error(&pairs).contains("LOAMS_GLITCHTIP_ORIGIN"));
        pairs.pop();
        pairs.push(("LOAMS_GLITCHTIP_ORIGIN", "https://glitchtip.example.com"));
        let api = Settings::read(vars(&pairs)).unwrap();
        // The key is only decoded when the function starts: not base64 of a PKCS#8 key.
        let err = issuer(&api).err().unwrap().to_string();
        assert!(err.contains("LOAMS_ISSUER_KEY"), "{err}");
        let bad = format!(
            "{}\n[factory]\nmax_attempts = 0\n",
            super::template_tests::APPS
        );
        pairs.push(("LOAMS_CONFIG", &bad));
        assert!(error(&pairs).contains("factory.max_attempts"));
    }

    /// Answers every agent call with an empty object.
    struct Agents;

    #[async_trait::async_trait]
    impl AgentCaller for Agents {
        async fn call(&self, _: &str, _: &str, _: &str, _: Value, _: Option<&str>) -> AgentReply {
            AgentReply::Done(json!({}))
        }
    }

    fn record(id: &str, body: &str, group: Option<&str>, encoding: Option<&str>) -> Value {
        let mut attributes = json!({
            "ApproximateReceiveCount": "1",
            "SentTimestamp": "1764547200000",
            "SenderId": "AIDAEXAMPLE",
            "ApproximateFirstReceiveTimestamp": "1764547200001"
        });
        if let Some(group) = group {
            attributes["MessageGroupId"] = json!(group);
        }
        let message_attributes = match encoding {
            Some(e) => {
                json!({ BODY_ENCODING_ATTRIBUTE: { "stringValue": e, "dataType": "String" } })
            }
            None => json!({}),
        };
        json!({
            "messageId": id,
            "receiptHandle": format!("receipt-{id}"),
            "body": body,
            "attributes": attributes,
            "messageAttributes": message_attributes,
            "md5OfBody": "",
            "eventSource": "aws:sqs",
            "eventSourceARN": if group.is_some() { "arn:aws:sqs:eu-west-1:1:work.fifo" } else { "arn:aws:sqs:eu-west-1:1:work" },
            "awsRegion": "eu-west-1"
        })
    }

    fn failures(response: &SqsBatchResponse) -> Vec<String> {
        let value = serde_json::to_value(response).unwrap();
        value["batchItemFailures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["itemIdentifier"].as_str().unwrap().to_string())
            .collect()
    }

    /// An SQS event as Lambda delivers it, through the handler, against the SQLite backend.
    #[tokio::test]
    async fn sqs_batch_reports_exactly_the_records_to_deliver_again() {
        let dir = tempfile::tempdir().unwrap();
        let backend = Backend::sqlite(dir.path()).unwrap();
        let model = Arc::new(Replay::from_json_str(crate::demo::DEMO_CASSETTE).unwrap());
        let worker = Worker::new(worker_deps(
            &Config::default(),
            None,
            &backend,
            Arc::new(Agents),
            model,
        ));
        let signal = Signal {
            source: "glitchtip".into(),
            fingerprint: "fp-lambda".into(),
            title: "ZeroDivisionError: division by zero".into(),
            link: "https://glitchtip/issues/1".into(),
            glitchtip_issue_id: Some("1".into()),
            severity: "error".into(),
            generation: 1,
            parent_run: None,
        };
        let run = worker.open("acme", signal).await.unwrap().run_id;
        let before = backend
            .store
            .get_run("acme", &run)
            .await
            .unwrap()
            .unwrap()
            .version;

        let step = json!({ "org": "acme", "run": run, "input": null }).to_string();
        let unknown =
            json!({ "org": "acme", "run": "r-0000000000000000", "input": null }).to_string();
        let event: SqsEvent = serde_json::from_value(json!({ "Records": [
            record("m-step", &STANDARD.encode(&step), None, Some("base64")),
            record("m-unknown-run", &unknown, None, None),
            record("m-not-an-envelope", "{\"hello\": 1}", None, None),
            record("m-bad-encoding", "@@@", None, Some("base64")),
        ]}))
        .unwrap();
        let event = lambda_runtime::LambdaEvent::new(event, lambda_runtime::Context::default());
        let response = handle_sqs(&worker, event.payload, far()).await;
        // A run that is not (yet) there may appear: delivered again. Bodies that never parse are dropped.
        assert_eq!(failures(&response), ["m-unknown-run"]);
        let after = backend
            .store
            .get_run("acme", &run)
            .await
            .unwrap()
            .unwrap()
            .version;
        assert!(
            after > before,
            "the base64 record moved the run: version {before} -> {after}"
        );

        // FIFO: a failed record fails the rest of its group, not other groups.
        let fifo: SqsEvent = serde_json::from_value(json!({ "Records": [
            record("f1", &unknown, Some("g1"), None),
            record("f2", "not json", Some("g2"), None),
            record("f3", "not json", Some("g1"), None),
        ]}))
        .unwrap();
        assert_eq!(
            failures(&handle_sqs(&worker, fifo, far()).await),
            ["f1", "f3"]
        );
    }
}

/// The SAM template gives every function the variables its role requires (and names only roles that exist).
#[cfg(test)]
mod template_tests {
    use super::*;

    const TEMPLATE: &str = include_str!("../../../infra/template.yaml");
    pub(super) const APPS: &str = r#"apps = { zulip = { url = "https://z", email = "b@z", api_key = "k" }, plane = { url = "https://p", api_key = "k", workspace = "w", project_id = "p" }, forgejo = { url = "https://f", token = "t", owner = "o", repo = "r", base = "main" }, glitchtip = { url = "https://g", token = "t", org = "o" }, analytics = { url = "https://a", client_id = "c", client_secret = "s", project_id = "p" } }"#;

    /// The `LOAMS_*: value` lines of a part of the template.
    fn variables(block: &str) -> Vec<(String, String)> {
        block
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("LOAMS_"))
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect()
    }

    /// A stand-in for a value CloudFormation fills in (`!Ref`, `!GetAtt`): what the parameter or resource holds.
    fn stand_in(name: &str, value: &str) -> String {
        if !value.starts_with('!') {
            return value.to_string();
        }
        match name {
            "LOAMS_ORG" => "acme".into(),
            "LOAMS_ENV" => "production".into(),
            "LOAMS_TABLE" => "loams-acme-production".into(),
            "LOAMS_CONFIG" => APPS.into(),
            "LOAMS_ISSUER_KEY" | "LOAMS_CARD_KEY" => "a2V5".into(),
            "LOAMS_WEBHOOK_TOKEN" => "0123456789abcdef0123456789abcdef".into(),
            _ => "https://example.lambda-url.eu-west-1.on.aws/".into(),
        }
    }

    #[test]
    fn every_function_of_the_template_starts_with_its_variables() {
        let (globals, resources) = TEMPLATE.split_once("\nResources:\n").unwrap();
        let common = variables(globals.split_once("\nGlobals:\n").unwrap().1);
        assert!(common.iter().any(|(k, _)| k == "LOAMS_TABLE"), "{common:?}");
        let mut seen = Vec::new();
        // A resource starts at a line indented by exactly two spaces.
        let mut blocks: Vec<String> = Vec::new();
        for line in resources.lines() {
            let top = line.starts_with("  ") && !line[2..].starts_with([' ', '#']);
            match blocks.last_mut() {
                Some(block) if !top => block.push_str(&format!("\n{line}")),
                _ => blocks.push(line.trim().to_string()),
            }
        }
        for block in blocks
            .iter()
            .filter(|b| b.contains("Type: AWS::Serverless::Function"))
        {
            let name = block.lines().next().unwrap().trim_end_matches(':');
            let own = variables(block);
            let pairs: Vec<(String, String)> = common
                .iter()
                .chain(own.iter())
                .map(|(k, v)| (k.clone(), stand_in(k, v)))
                .collect();
            let settings =
                Settings::read(|var| pairs.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone()))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            seen.push(settings.function);
        }
        let agents = AGENTS.iter().map(|a| Function::Agent(a));
        for function in [Function::Api, Function::Worker, Function::Scheduler]
            .into_iter()
            .chain(agents)
        {
            assert!(
                seen.contains(&function),
                "no function {function:?} in the template: {seen:?}"
            );
        }
    }
}
