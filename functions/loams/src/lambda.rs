//! The AWS Lambda entry points (feature `aws`), thin shells over the same parts `loams dev` runs: the API's axum
//! router, each agent's A2A router, the worker's `handle_received` per SQS record (one or more steps of its run, as
//! many as fit in the invocation), and the scheduler's `fire_due`.
//!
//! One binary (`loams-lambda`) serves every function; `LOAMS_FUNCTION` picks which. Everything comes from the
//! environment, read once at start; a missing or bad variable stops the function at start, naming it. Each function
//! gets only the keys and credentials its own work needs, and refuses to start with one meant for another:
//!
//! | variable | functions | meaning |
//! |---|---|---|
//! | `LOAMS_FUNCTION` | all | `api`, `worker`, `scheduler` or `agent:<zulip\|plane\|forgejo\|glitchtip\|analytics>` |
//! | `LOAMS_CONFIG` | api, worker (optional) | the `loams dev` TOML configuration without `[apps]` (`factory`, `policy`, `model`, `webhooks`) |
//! | `LOAMS_ORG`, `LOAMS_ENV` | all | the tenant and the environment runs are opened in (override `LOAMS_CONFIG`) |
//! | `LOAMS_TABLE`, `LOAMS_QUEUE_URL`, `LOAMS_DEAD_LETTER_URL` | all | the DynamoDB table and the SQS queues |
//! | `LOAMS_AWS_ENDPOINT` | optional | a local emulator (moto) instead of AWS (nothing is created there either) |
//! | `LOAMS_BASE_BRANCH`, `LOAMS_ANALYTICS_PROJECT` | api, worker; forgejo, analytics agent | what runs start with |
//! | `LOAMS_ISSUER_PUBLIC_KEY` | api | base64 SPKI DER of the people's token issuer (`loams token`'s key); its private key is in no function |
//! | `LOAMS_AGENT_TOKEN_KEY` | worker | base64 PKCS#8 P-256 key the worker signs its agent tokens with |
//! | `LOAMS_AGENT_TOKEN_PUBLIC_KEY` | agents | base64 SPKI DER of that key: the agents accept tokens it signed, and no others |
//! | `LOAMS_PANEL_TOKEN_KEY` | api | base64 PKCS#8 P-256 key the API signs panel reads with (a person's, read scopes only) |
//! | `LOAMS_PANEL_TOKEN_PUBLIC_KEY` | agents | base64 SPKI DER of that key: the agents accept its tokens for reads only |
//! | `LOAMS_CARD_KEY` | agents | base64 PKCS#8 P-256 key the agents sign their cards with |
//! | `LOAMS_CARD_PUBLIC_KEY` | api, worker | base64 SPKI DER of that key: the API and the worker trust cards it signed |
//! | `LOAMS_APP_SECRET_ARN` | agents | the Secrets Manager secret with this agent's app settings (the JSON of `[apps.<name>]`), read at start |
//! | `LOAMS_AGENT_URL_<NAME>` | api, worker | each agent's Function URL |
//! | `LOAMS_BASE_URL` | agents (optional) | the agent's own URL; unset: taken from the first request's `Host` |
//! | `LOAMS_WEBHOOK_TOKEN`, `LOAMS_GLITCHTIP_ORIGIN` | api | the GlitchTip webhook's URL token and GlitchTip's URL |

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, anyhow};
use aws_lambda_events::event::sqs::{SqsBatchResponse, SqsEvent, SqsMessage};
use aws_lc_rs::encoding::AsDer;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED, ParsedPublicKey};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use jsonwebtoken::jwk::JwkSet;
use loams_a2a::{A2aClient, CardSigner, Guards, Jwk, Jwks};
use loams_api::{
    AgentAuth, AgentLink, AgentTokens, ApiState, ApprovalBroker, Collab, Issuer, RegisteredApp,
    Verifier,
};
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

use crate::config::{AGENTS, App, Config, ConfigError, QueueKind, Secret, StoreKind, is_http_url};
use crate::stack::{
    AGENT_TOKEN_ISSUER, Backend, DEV_AUDIENCE, DEV_ISSUER, PANEL_TOKEN_ISSUER, RunStart,
    WorkerOpener, agent, api_config, model, worker_deps,
};

/// Largest value accepted from one environment variable (Lambda allows 4 KiB for all of them together).
const MAX_VAR_BYTES: usize = 64 * 1024;
/// Scheduler passes per invocation (each fires up to the scheduler's batch of due timers).
const SCHEDULER_PASSES: usize = 20;
/// Length of a P-256 public key as SubjectPublicKeyInfo DER; its last 65 bytes are the uncompressed point.
const P256_SPKI_LEN: usize = 91;
const P256_POINT_LEN: usize = 65;

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

    /// Why this function must not be given `var`, if it must not: a private key, a credential (or where to read
    /// one) or the shared configuration belongs to the functions that use it, and a template that hands it to
    /// another function fails at that function's start instead of silently widening who holds what.
    fn must_not_hold(&self, var: &str) -> Option<&'static str> {
        let agent = matches!(self, Function::Agent(_));
        match var {
            "LOAMS_ISSUER_KEY" => Some(
                "no function holds the people's issuer key: tokens are minted offline (`loams token`) and the API \
                 checks them with LOAMS_ISSUER_PUBLIC_KEY",
            ),
            "LOAMS_AGENT_TOKEN_KEY" if *self != Function::Worker => {
                Some("only the worker signs agent tokens")
            }
            "LOAMS_PANEL_TOKEN_KEY" if *self != Function::Api => {
                Some("only the API signs panel-read tokens")
            }
            "LOAMS_CARD_KEY" if !agent => Some("only the agents sign their cards"),
            "LOAMS_APP_SECRET_ARN" if !agent => Some("only an agent reads its app's credentials"),
            "LOAMS_WEBHOOK_TOKEN" if *self != Function::Api => {
                Some("only the API receives the GlitchTip webhook")
            }
            "LOAMS_CONFIG" if !matches!(self, Function::Api | Function::Worker) => {
                Some("only the API and the worker open or move runs")
            }
            _ => None,
        }
    }
}

/// The variables some function must not be given (see [`Function::must_not_hold`]).
const GUARDED_VARS: [&str; 7] = [
    "LOAMS_ISSUER_KEY",
    "LOAMS_AGENT_TOKEN_KEY",
    "LOAMS_PANEL_TOKEN_KEY",
    "LOAMS_CARD_KEY",
    "LOAMS_APP_SECRET_ARN",
    "LOAMS_WEBHOOK_TOKEN",
    "LOAMS_CONFIG",
];

/// Everything a function reads from its environment.
#[derive(Debug)]
pub struct Settings {
    pub function: Function,
    pub config: Config,
    agent_token_key: Option<Secret>,
    panel_token_key: Option<Secret>,
    card_key: Option<Secret>,
    issuer_public_key: Option<String>,
    agent_token_public_key: Option<String>,
    panel_token_public_key: Option<String>,
    card_public_key: Option<String>,
    app_secret_arn: Option<String>,
    /// What a run starts with (API and worker): the repository's base branch and the analytics project. The
    /// forgejo agent and the analytics agent get theirs to check their secret against.
    base_branch: Option<String>,
    analytics_project: Option<String>,
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
        for name in GUARDED_VARS {
            if let (Some(why), Some(_)) = (function.must_not_hold(name), get(name)?) {
                return Err(ConfigError::Invalid {
                    setting: name,
                    message: format!("must not be given to this function: {why}"),
                });
            }
        }
        let mut config = match get("LOAMS_CONFIG")? {
            Some(text) => Config::parse(&text).map_err(|message| ConfigError::Invalid {
                setting: "LOAMS_CONFIG",
                message,
            })?,
            None => Config::default(),
        };
        if config.apps.is_some() {
            return Err(ConfigError::Invalid {
                setting: "LOAMS_CONFIG",
                message: "must not hold [apps]: each agent reads its own app's settings from its secret \
                          (LOAMS_APP_SECRET_ARN); runs start with LOAMS_BASE_BRANCH and LOAMS_ANALYTICS_PROJECT"
                    .into(),
            });
        }
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
            agent_token_key: None,
            panel_token_key: None,
            card_key: None,
            issuer_public_key: None,
            agent_token_public_key: None,
            panel_token_public_key: None,
            card_public_key: None,
            app_secret_arn: None,
            base_branch: None,
            analytics_project: None,
            agent_urls: HashMap::new(),
            base_url: None,
            glitchtip_origin: None,
        };
        match function {
            Function::Api => {
                settings.issuer_public_key = Some(need("LOAMS_ISSUER_PUBLIC_KEY")?);
                settings.config.webhook_token = Some(Secret::new(need("LOAMS_WEBHOOK_TOKEN")?));
                settings.glitchtip_origin = Some(need("LOAMS_GLITCHTIP_ORIGIN")?);
                settings.panel_token_key = Some(Secret::new(need("LOAMS_PANEL_TOKEN_KEY")?));
            }
            Function::Worker => {
                settings.agent_token_key = Some(Secret::new(need("LOAMS_AGENT_TOKEN_KEY")?));
            }
            Function::Agent(_) => {
                settings.app_secret_arn = Some(need("LOAMS_APP_SECRET_ARN")?);
                settings.agent_token_public_key = Some(need("LOAMS_AGENT_TOKEN_PUBLIC_KEY")?);
                settings.panel_token_public_key = Some(need("LOAMS_PANEL_TOKEN_PUBLIC_KEY")?);
                if settings.panel_token_public_key == settings.agent_token_public_key {
                    return Err(ConfigError::Invalid {
                        setting: "LOAMS_PANEL_TOKEN_PUBLIC_KEY",
                        message: "is the same key as LOAMS_AGENT_TOKEN_PUBLIC_KEY: whoever signs panel reads could \
                                  then act as the worker"
                            .into(),
                    });
                }
                settings.card_key = Some(Secret::new(need("LOAMS_CARD_KEY")?));
                settings.base_url = get("LOAMS_BASE_URL")?;
            }
            Function::Scheduler => {}
        }
        // Both open runs (the API from webhooks), which start with these; the agent of each app checks it.
        let opens_runs = matches!(function, Function::Api | Function::Worker);
        // Both call the agents: the worker for the runs, the API for the panels people read.
        if opens_runs {
            settings.card_public_key = Some(need("LOAMS_CARD_PUBLIC_KEY")?);
            for (agent, name) in AGENTS.into_iter().zip(AGENT_URL_VARS) {
                settings.agent_urls.insert(agent, need(name)?);
            }
        }
        if opens_runs || function == Function::Agent("forgejo") {
            settings.base_branch = Some(need("LOAMS_BASE_BRANCH")?);
        }
        if opens_runs || function == Function::Agent("analytics") {
            settings.analytics_project = Some(need("LOAMS_ANALYTICS_PROJECT")?);
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

    /// What the runs this function opens start with (API and worker).
    fn run_start(&self) -> Option<RunStart<'_>> {
        Some(RunStart {
            base_branch: self.base_branch.as_deref()?,
            analytics_project: self.analytics_project.as_deref()?,
        })
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
        Some(u) if !is_http_url(u) => Err(ConfigError::Invalid {
            setting,
            message: format!("must be an http(s) URL, not {u:?}"),
        }),
        _ => Ok(()),
    }
}

/// The bytes of a base64 variable.
fn base64_var(setting: &'static str, value: Option<&str>) -> Result<Vec<u8>, ConfigError> {
    let value = value.ok_or(ConfigError::Invalid {
        setting,
        message: "is not set".into(),
    })?;
    STANDARD
        .decode(value.trim())
        .map_err(|e| ConfigError::Invalid {
            setting,
            message: format!("is not base64: {e}"),
        })
}

/// A base64 PKCS#8 private key from the environment.
fn key_bytes(setting: &'static str, key: Option<&Secret>) -> Result<Vec<u8>, ConfigError> {
    base64_var(setting, key.map(Secret::expose)).map_err(|e| match e {
        ConfigError::Invalid { setting, message } => ConfigError::Invalid {
            setting,
            message: format!("{message} (a PKCS#8 P-256 key, base64-encoded)"),
        },
        other => other,
    })
}

/// The JWK coordinates (base64url x and y) and the uncompressed point of a P-256 public key given as base64
/// SubjectPublicKeyInfo DER (`openssl pkey -pubout -outform DER`).
fn public_key(
    setting: &'static str,
    value: Option<&str>,
) -> Result<(String, String, Vec<u8>), ConfigError> {
    let invalid = || ConfigError::Invalid {
        setting,
        message: "is not a P-256 public key (base64 SubjectPublicKeyInfo DER)".into(),
    };
    let der = base64_var(setting, value)?;
    // Parsing checks the curve and that the point lies on it; the canonical DER re-encoding then ends in the point.
    let key = ParsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, &der).map_err(|_| invalid())?;
    let spki = key.as_der().map_err(|_| invalid())?;
    let spki = spki.as_ref();
    if spki.len() != P256_SPKI_LEN {
        return Err(invalid());
    }
    let point = &spki[P256_SPKI_LEN - P256_POINT_LEN..];
    if point[0] != 0x04 {
        return Err(invalid());
    }
    Ok((
        URL_SAFE_NO_PAD.encode(&point[1..33]),
        URL_SAFE_NO_PAD.encode(&point[33..]),
        point.to_vec(),
    ))
}

/// A JWKS of one token-signing public key, with the key id `loams_api::Issuer` puts in the tokens it signs (the
/// first 8 bytes of the SHA-256 of the uncompressed point, in hex), so its tokens find their key.
fn token_jwks(setting: &'static str, value: Option<&str>) -> Result<JwkSet, ConfigError> {
    let (x, y, point) = public_key(setting, value)?;
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &point);
    let kid: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let jwks = serde_json::json!({ "keys": [{
        "kty": "EC", "crv": "P-256", "x": x, "y": y, "kid": kid, "use": "sig", "alg": "ES256"
    }]});
    serde_json::from_value(jwks).map_err(|e| ConfigError::Invalid {
        setting,
        message: format!("cannot make a JWKS of it: {e}"),
    })
}

/// The agents' card key as the worker trusts it, with the RFC 7638 thumbprint as key id (what `CardSigner` uses).
fn card_jwks(setting: &'static str, value: Option<&str>) -> Result<Jwks, ConfigError> {
    let (x, y, _) = public_key(setting, value)?;
    // RFC 7638: SHA-256 over the required members in lexicographic order, no whitespace.
    let thumb_input = format!(r#"{{"crv":"P-256","kty":"EC","x":"{x}","y":"{y}"}}"#);
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, thumb_input.as_bytes());
    Ok(Jwks {
        keys: vec![Jwk {
            kty: "EC".into(),
            crv: "P-256".into(),
            x,
            y,
            kid: URL_SAFE_NO_PAD.encode(digest.as_ref()),
            alg: Some("ES256".into()),
            use_: Some("sig".into()),
        }],
    })
}

/// The API's check of people's tokens: the issuer's public key only.
fn people_verifier(settings: &Settings) -> Result<(Verifier, JwkSet), ConfigError> {
    let jwks = token_jwks(
        "LOAMS_ISSUER_PUBLIC_KEY",
        settings.issuer_public_key.as_deref(),
    )?;
    Ok((
        Verifier::from_keys(jwks.clone(), DEV_ISSUER, DEV_AUDIENCE),
        jwks,
    ))
}

/// An agent's check of the tokens it is called with: the worker's (the agent-token public key) and the API's panel
/// reads (the panel-token public key), each key for its own kind of caller (the audience is set per call).
fn agent_auth(settings: &Settings) -> Result<AgentAuth, ConfigError> {
    let factory = token_jwks(
        "LOAMS_AGENT_TOKEN_PUBLIC_KEY",
        settings.agent_token_public_key.as_deref(),
    )?;
    let panels = token_jwks(
        "LOAMS_PANEL_TOKEN_PUBLIC_KEY",
        settings.panel_token_public_key.as_deref(),
    )?;
    Ok(AgentAuth::new(Verifier::from_keys(
        factory,
        AGENT_TOKEN_ISSUER,
        AGENT_TOKEN_ISSUER,
    ))
    .with_panels(Verifier::from_keys(
        panels,
        PANEL_TOKEN_ISSUER,
        PANEL_TOKEN_ISSUER,
    )))
}

/// The key the API signs panel reads with.
fn panel_tokens(settings: &Settings) -> anyhow::Result<Issuer> {
    let der = key_bytes("LOAMS_PANEL_TOKEN_KEY", settings.panel_token_key.as_ref())?;
    Issuer::from_pkcs8(&der, PANEL_TOKEN_ISSUER, PANEL_TOKEN_ISSUER)
        .map_err(|e| anyhow!("setting `LOAMS_PANEL_TOKEN_KEY`: {e}"))
}

/// The API's app registry: every agent, connected on its first panel read, and the panel-token key.
fn collab(settings: &Settings) -> anyhow::Result<Collab> {
    let trusted = card_jwks("LOAMS_CARD_PUBLIC_KEY", settings.card_public_key.as_deref())?;
    let panel_tokens = panel_tokens(settings)?;
    let apps = AGENTS
        .iter()
        .map(|name| RegisteredApp {
            id: name.to_string(),
            agent: settings
                .agent_urls
                .get(name)
                .map(|url| AgentLink::new(url, trusted.clone())),
        })
        .collect();
    let config = &settings.config;
    Ok(Collab::new(
        config.org.clone(),
        config.env.clone(),
        apps,
        panel_tokens,
    ))
}

/// The worker's agent tokens, signed with the agent-token key.
fn agent_tokens(settings: &Settings) -> anyhow::Result<AgentTokens> {
    let der = key_bytes("LOAMS_AGENT_TOKEN_KEY", settings.agent_token_key.as_ref())?;
    let issuer = Issuer::from_pkcs8(&der, AGENT_TOKEN_ISSUER, AGENT_TOKEN_ISSUER)
        .map_err(|e| anyhow!("setting `LOAMS_AGENT_TOKEN_KEY`: {e}"))?;
    Ok(AgentTokens::new(issuer, settings.config.org.clone()))
}

fn card_signer(settings: &Settings) -> anyhow::Result<CardSigner> {
    let der = key_bytes("LOAMS_CARD_KEY", settings.card_key.as_ref())?;
    CardSigner::from_pkcs8(&der).map_err(|e| anyhow!("setting `LOAMS_CARD_KEY`: {e}"))
}

/// The agent's app settings, from its own secret. Read once, at cold start: a missing or unreadable secret, or one
/// that is not this app's settings, stops the function with a message naming the secret.
async fn app_from_secret(
    settings: &Settings,
    sdk: &aws_config::SdkConfig,
    name: &str,
) -> anyhow::Result<App> {
    let arn = settings
        .app_secret_arn
        .as_deref()
        .ok_or_else(|| anyhow!("setting `LOAMS_APP_SECRET_ARN`: is not set"))?;
    let read = aws_sdk_secretsmanager::Client::new(sdk)
        .get_secret_value()
        .secret_id(arn)
        .send()
        .await
        .map_err(|e| {
            anyhow!(
                "setting `LOAMS_APP_SECRET_ARN`: cannot read the secret {arn}: {}",
                secret_read_error(&e)
            )
        })?;
    let app = app_from_secret_string(name, arn, read.secret_string())?;
    agrees_with_runs(settings, arn, &app)?;
    Ok(app)
}

/// Two settings say one thing: the base branch and the analytics project runs start with (the worker's
/// LOAMS_BASE_BRANCH and LOAMS_ANALYTICS_PROJECT) and those the app's agent works on (its secret's `base` and
/// `project_id`; the forgejo agent merges only into its base). The worker cannot read the secret, so the agent
/// compares them at start: a difference stops it, naming both settings, instead of failing every run later.
fn agrees_with_runs(settings: &Settings, arn: &str, app: &App) -> Result<(), ConfigError> {
    let (setting, field, runs, agent) = match app {
        App::Forgejo(f) => ("LOAMS_BASE_BRANCH", "base", &settings.base_branch, &f.base),
        App::Analytics(a) => (
            "LOAMS_ANALYTICS_PROJECT",
            "project_id",
            &settings.analytics_project,
            &a.project_id,
        ),
        _ => return Ok(()),
    };
    if runs.as_deref() == Some(agent.as_str()) {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        setting,
        message: format!(
            "is {runs:?}, but the secret {arn} says `{field}` = {agent:?}: runs would start with one and the agent \
             work on the other"
        ),
    })
}

/// Why a secret could not be read, without the raw response the SDK's own error context would show: for an
/// answer that failed to parse, that response is the secret itself.
fn secret_read_error<E, R>(error: &aws_sdk_secretsmanager::error::SdkError<E, R>) -> String
where
    E: aws_sdk_secretsmanager::error::ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    use aws_sdk_secretsmanager::error::{DisplayErrorContext, SdkError};
    match error {
        SdkError::ServiceError(e) => format!(
            "{}: {}",
            e.err().code().unwrap_or("error"),
            e.err().message().unwrap_or("no message")
        ),
        SdkError::ResponseError(_) => "its answer could not be read".into(),
        // Failures before any answer (no connection, a timeout): no response to leak.
        other => DisplayErrorContext(other).to_string(),
    }
}

/// App `name`'s settings from the text of the secret `arn`.
fn app_from_secret_string(name: &str, arn: &str, text: Option<&str>) -> Result<App, ConfigError> {
    let text = text.ok_or_else(|| ConfigError::Invalid {
        setting: "LOAMS_APP_SECRET_ARN",
        message: format!("the secret {arn} has no text value (expected the JSON of [apps.{name}])"),
    })?;
    App::from_json(name, text).map_err(|why| ConfigError::Invalid {
        setting: "LOAMS_APP_SECRET_ARN",
        message: format!("the secret {arn} is not the {name} app's settings: {why}"),
    })
}

/// Runs the function the settings name until the Lambda runtime stops it.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    // One SDK configuration for all this function reads of AWS: the store, the queue, an agent's secret.
    let sdk = crate::backend::sdk_config(settings.config.backend.aws_endpoint.as_deref()).await;
    let backend = Backend::open_on(&settings.config, &sdk).await?;
    let result = match settings.function {
        Function::Api => {
            let router = api_router(&settings, backend)?;
            lambda_http::run_with_streaming_response(router).await
        }
        Function::Agent(name) => {
            // The apps' HTTP client parses the CA bundle (about a millisecond of CPU): done while the secret is read.
            let warm_up = tokio::task::spawn_blocking(loams_agents::warm_up_http_client);
            let app = app_from_secret(&settings, &sdk, name).await?;
            // A panic in it would come back when the client is built again, below.
            let _ = warm_up.await;
            let service = agent_service(&settings, &app, backend)?;
            lambda_http::run_with_streaming_response(service).await
        }
        Function::Worker => {
            let worker = Arc::new(Worker::new(worker_deps(
                &settings.config,
                settings.run_start(),
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
    let (verifier, jwks) = people_verifier(settings)?;
    let no_model =
        Replay::from_json_str(r#"{"completions": []}"#).context("the API's empty model")?;
    // The API opens runs: the factory settings (cooldown, ...) come from the same LOAMS_CONFIG as the worker
    // function's, the base branch and analytics project a run starts with from the same variables.
    let worker = Worker::new(worker_deps(
        config,
        settings.run_start(),
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
        verifier,
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
        jwks: Some(Arc::new(jwks)),
        collab: Arc::new(collab(settings)?),
    };
    Ok(loams_api::router(state))
}

/// One agent's A2A router. Its card names its own URL, which a Function URL only learns after deployment (the
/// function cannot reference its own URL in the template), so unless `LOAMS_BASE_URL` sets it the router is built
/// on the first request, from the `Host` Lambda routed it by (a Function URL is reachable only by its own host).
fn agent_service(
    settings: &Settings,
    app: &App,
    backend: Backend,
) -> anyhow::Result<
    impl tower::Service<
        lambda_http::Request,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future = impl Send,
    >,
> {
    let skills = agent(app).context("setting `LOAMS_APP_SECRET_ARN`")?;
    // Loaded once here so a bad key fails at start; the router takes a signer of its own when it is built.
    let card_key = card_signer(settings)?
        .to_pkcs8()
        .map_err(|e| anyhow!("setting `LOAMS_CARD_KEY`: {e}"))?;
    let guards = Guards {
        auth: Arc::new(agent_auth(settings)?),
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
    let trusted = card_jwks("LOAMS_CARD_PUBLIC_KEY", settings.card_public_key.as_deref())?;
    let tokens = Arc::new(agent_tokens(settings)?);
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
            return AgentReply::unknown_agent(agent);
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
        pairs.push(("LOAMS_AGENT_TOKEN_KEY", "a2V5"));
        pairs.push(("LOAMS_CARD_PUBLIC_KEY", "a2V5"));
        assert!(error(&pairs).contains("LOAMS_AGENT_URL_ZULIP"));
        for var in AGENT_URL_VARS {
            pairs.push((var, "https://agent.lambda-url.eu-west-1.on.aws/"));
        }
        assert!(
            error(&pairs).contains("LOAMS_BASE_BRANCH"),
            "runs start with the base branch"
        );
        pairs.push(("LOAMS_BASE_BRANCH", "main"));
        assert!(error(&pairs).contains("LOAMS_ANALYTICS_PROJECT"));
        pairs.push(("LOAMS_ANALYTICS_PROJECT", "shop"));
        let worker = Settings::read(vars(&pairs)).unwrap();
        // The keys are only decoded when the function starts: not base64 of a PKCS#8 key, not a public key.
        let err = agent_tokens(&worker).err().unwrap().to_string();
        assert!(err.contains("LOAMS_AGENT_TOKEN_KEY"), "{err}");
        let err = card_jwks("LOAMS_CARD_PUBLIC_KEY", worker.card_public_key.as_deref())
            .unwrap_err()
            .to_string();
        assert!(err.contains("LOAMS_CARD_PUBLIC_KEY"), "{err}");

        let mut api: Vec<_> = BASE.into();
        api.push(("LOAMS_FUNCTION", "api"));
        api.push(("LOAMS_BASE_BRANCH", "main"));
        api.push(("LOAMS_ANALYTICS_PROJECT", "shop"));
        assert!(error(&api).contains("LOAMS_ISSUER_PUBLIC_KEY"));
        api.push(("LOAMS_ISSUER_PUBLIC_KEY", "a2V5"));
        assert!(error(&api).contains("LOAMS_WEBHOOK_TOKEN"));
        api.push(("LOAMS_WEBHOOK_TOKEN", "0123456789abcdef0123456789abcdef"));
        assert!(error(&api).contains("LOAMS_GLITCHTIP_ORIGIN"));
        api.push(("LOAMS_GLITCHTIP_ORIGIN", "glitchtip.example.com"));
        assert!(error(&api).contains("LOAMS_PANEL_TOKEN_KEY"));
        api.push(("LOAMS_PANEL_TOKEN_KEY", "a2V5"));
        assert!(
            error(&api).contains("LOAMS_CARD_PUBLIC_KEY"),
            "the API reads panels through the agents"
        );
        api.extend(AGENT_LINKS);
        assert!(error(&api).contains("LOAMS_GLITCHTIP_ORIGIN"), "not a URL");
        api.retain(|(k, _)| *k != "LOAMS_GLITCHTIP_ORIGIN");
        api.push(("LOAMS_GLITCHTIP_ORIGIN", "https://glitchtip.example.com"));
        let read = Settings::read(vars(&api)).unwrap();
        let err = people_verifier(&read).err().unwrap().to_string();
        assert!(err.contains("LOAMS_ISSUER_PUBLIC_KEY"), "{err}");
        let err = collab(&read).err().unwrap().to_string();
        assert!(err.contains("LOAMS_CARD_PUBLIC_KEY"), "{err}");
        api.push(("LOAMS_CONFIG", "[factory]\nmax_attempts = 0\n"));
        assert!(error(&api).contains("factory.max_attempts"));
    }

    /// Base64 PKCS#8 of a new P-256 key, and base64 SubjectPublicKeyInfo DER of its public key.
    fn key_pair() -> (Vec<u8>, String, String) {
        let pkcs8 = Issuer::generate_pkcs8().unwrap();
        let public = spki(&pkcs8);
        (pkcs8.clone(), STANDARD.encode(&pkcs8), public)
    }

    fn spki(pkcs8: &[u8]) -> String {
        use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8).unwrap();
        STANDARD.encode(pair.public_key().as_der().unwrap().as_ref())
    }

    /// A complete, valid environment of each kind of function.
    fn environment(function: &'static str) -> Vec<(&'static str, &'static str)> {
        let mut pairs: Vec<_> = BASE.into();
        pairs.push(("LOAMS_FUNCTION", function));
        let own: &[(&str, &str)] = match function {
            "api" => &[
                ("LOAMS_ISSUER_PUBLIC_KEY", "a2V5"),
                ("LOAMS_WEBHOOK_TOKEN", "0123456789abcdef0123456789abcdef"),
                ("LOAMS_GLITCHTIP_ORIGIN", "https://glitchtip.example.com"),
                ("LOAMS_PANEL_TOKEN_KEY", "a2V5"),
                ("LOAMS_BASE_BRANCH", "main"),
                ("LOAMS_ANALYTICS_PROJECT", "shop"),
            ],
            "worker" => &[
                ("LOAMS_AGENT_TOKEN_KEY", "a2V5"),
                ("LOAMS_BASE_BRANCH", "main"),
                ("LOAMS_ANALYTICS_PROJECT", "shop"),
            ],
            "scheduler" => &[],
            _ => &[
                ("LOAMS_APP_SECRET_ARN", SECRET_ARN),
                ("LOAMS_AGENT_TOKEN_PUBLIC_KEY", "a2V5"),
                ("LOAMS_PANEL_TOKEN_PUBLIC_KEY", "cGFuZWw="),
                ("LOAMS_CARD_KEY", "a2V5"),
            ],
        };
        pairs.extend_from_slice(own);
        // The API and the worker call the agents.
        if function == "api" || function == "worker" {
            pairs.extend_from_slice(&AGENT_LINKS);
        }
        if function == "agent:forgejo" {
            pairs.push(("LOAMS_BASE_BRANCH", "main"));
        }
        pairs
    }

    const AGENT_LINKS: [(&str, &str); 6] = [
        ("LOAMS_CARD_PUBLIC_KEY", "a2V5"),
        (
            "LOAMS_AGENT_URL_ZULIP",
            "https://z.lambda-url.eu-west-1.on.aws/",
        ),
        (
            "LOAMS_AGENT_URL_PLANE",
            "https://p.lambda-url.eu-west-1.on.aws/",
        ),
        (
            "LOAMS_AGENT_URL_FORGEJO",
            "https://f.lambda-url.eu-west-1.on.aws/",
        ),
        (
            "LOAMS_AGENT_URL_GLITCHTIP",
            "https://g.lambda-url.eu-west-1.on.aws/",
        ),
        (
            "LOAMS_AGENT_URL_ANALYTICS",
            "https://a.lambda-url.eu-west-1.on.aws/",
        ),
    ];

    const SECRET_ARN: &str =
        "arn:aws:secretsmanager:eu-west-1:1:secret:loams-acme-production/forgejo-AbCdEf";
    const FORGEJO_SECRET: &str = r#"{"url": "https://git.example.com", "token": "forgejo-secret-1", "owner": "acme", "repo": "shop", "base": "main"}"#;

    /// The read itself, against Secrets Manager on the moto server `tests/run` starts: the forgejo agent gets its
    /// settings from its own secret, and a secret that does not exist stops it with the setting and the ARN named.
    #[tokio::test]
    async fn an_agent_reads_its_apps_secret_from_secrets_manager() {
        let endpoint = std::env::var("LOAMS_AWS_ENDPOINT").expect(
            "LOAMS_AWS_ENDPOINT is not set: this test needs a moto server; run `eval \"$(tests/moto/start)\"` first",
        );
        let sdk = crate::backend::sdk_config(Some(&endpoint)).await;
        // A name of its own, so repeated runs against one moto server do not meet an existing secret.
        let name = format!(
            "loams-test/forgejo-{}",
            loams_platform::backoff::random_u64()
        );
        let created = aws_sdk_secretsmanager::Client::new(&sdk)
            .create_secret()
            .name(&name)
            .secret_string(FORGEJO_SECRET)
            .send()
            .await
            .expect("creating the secret on moto");
        let arn = created.arn().expect("moto answers the ARN").to_string();

        let with_arn = |arn: &str| {
            let mut pairs: Vec<(&str, &str)> = environment("agent:forgejo");
            pairs.retain(|(k, _)| *k != "LOAMS_APP_SECRET_ARN");
            pairs.push(("LOAMS_APP_SECRET_ARN", arn));
            Settings::read(vars(&pairs)).unwrap()
        };
        let App::Forgejo(read) = app_from_secret(&with_arn(&arn), &sdk, "forgejo")
            .await
            .unwrap()
        else {
            panic!("not the forgejo settings");
        };
        assert_eq!(read.token.expose(), "forgejo-secret-1");
        assert_eq!(read.base, "main");

        let missing = format!("{arn}-gone");
        let err = app_from_secret(&with_arn(&missing), &sdk, "forgejo")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("LOAMS_APP_SECRET_ARN") && err.contains(&missing),
            "{err}"
        );
    }

    #[test]
    fn each_function_refuses_the_keys_and_credentials_of_others() {
        // What each kind may hold, and nothing else of the guarded variables.
        let allowed: [(&str, &[&str]); 4] = [
            (
                "api",
                &[
                    "LOAMS_WEBHOOK_TOKEN",
                    "LOAMS_PANEL_TOKEN_KEY",
                    "LOAMS_CONFIG",
                ],
            ),
            ("worker", &["LOAMS_AGENT_TOKEN_KEY", "LOAMS_CONFIG"]),
            ("scheduler", &[]),
            ("agent:forgejo", &["LOAMS_CARD_KEY", "LOAMS_APP_SECRET_ARN"]),
        ];
        for (function, own) in allowed {
            let pairs = environment(function);
            Settings::read(vars(&pairs)).unwrap_or_else(|e| panic!("{function}: {e}"));
            for var in GUARDED_VARS.into_iter().filter(|v| !own.contains(v)) {
                let mut with = pairs.clone();
                with.retain(|(k, _)| *k != var);
                with.push((var, "[factory]\nmax_attempts = 3\n"));
                let err = error(&with);
                assert!(
                    err.contains(var) && err.contains("must not be given"),
                    "{function} took {var}: {err}"
                );
            }
        }
        // The shared configuration carries no app credentials, for the functions that take it either; the
        // refusal does not repeat them.
        let apps = r#"apps = { zulip = { url = "https://z", email = "b@z", api_key = "zulip-secret-1" }, plane = { url = "https://p", api_key = "k", workspace = "w", project_id = "p" }, forgejo = { url = "https://f", token = "t", owner = "o", repo = "r", base = "main" }, glitchtip = { url = "https://g", token = "t", org = "o" }, analytics = { url = "https://a", client_id = "c", client_secret = "s", project_id = "p" } }"#;
        for function in ["api", "worker"] {
            let mut pairs = environment(function);
            pairs.push(("LOAMS_CONFIG", apps));
            let err = error(&pairs);
            assert!(
                err.contains("LOAMS_CONFIG") && err.contains("[apps]"),
                "{function}: {err}"
            );
            assert!(!err.contains("zulip-secret-1"), "{err}");
        }
    }

    #[test]
    fn an_agent_starts_only_with_its_own_apps_secret() {
        let mut pairs = environment("agent:forgejo");
        pairs.retain(|(k, _)| *k != "LOAMS_APP_SECRET_ARN");
        assert!(error(&pairs).contains("LOAMS_APP_SECRET_ARN"));
        // One key pair for the worker's tokens and the API's panel reads would let the API act as the worker.
        let mut one_key = environment("agent:forgejo");
        one_key.retain(|(k, _)| *k != "LOAMS_PANEL_TOKEN_PUBLIC_KEY");
        one_key.push(("LOAMS_PANEL_TOKEN_PUBLIC_KEY", "a2V5"));
        assert!(error(&one_key).contains("LOAMS_PANEL_TOKEN_PUBLIC_KEY"));

        let App::Forgejo(read) =
            app_from_secret_string("forgejo", SECRET_ARN, Some(FORGEJO_SECRET)).unwrap()
        else {
            panic!("not the forgejo settings");
        };
        assert_eq!(read.token.expose(), "forgejo-secret-1");
        // The forgejo agent needs the base branch runs start with, and its secret must name the same.
        let mut with_base = environment("agent:forgejo");
        let without: Vec<_> = with_base
            .iter()
            .copied()
            .filter(|(k, _)| *k != "LOAMS_BASE_BRANCH")
            .collect();
        assert!(error(&without).contains("LOAMS_BASE_BRANCH"));
        let agent = Settings::read(vars(&with_base)).unwrap();
        agrees_with_runs(&agent, SECRET_ARN, &App::Forgejo(read.clone())).unwrap();
        with_base.retain(|(k, _)| *k != "LOAMS_BASE_BRANCH");
        with_base.push(("LOAMS_BASE_BRANCH", "develop"));
        let agent = Settings::read(vars(&with_base)).unwrap();
        let err = agrees_with_runs(&agent, SECRET_ARN, &App::Forgejo(read.clone()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("LOAMS_BASE_BRANCH") && err.contains("`base` = \"main\""),
            "{err}"
        );
        // A binary secret, or another app's: refused, naming the variable and the secret, quoting no value.
        for (name, text) in [("forgejo", None), ("zulip", Some(FORGEJO_SECRET))] {
            let err = app_from_secret_string(name, SECRET_ARN, text)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("LOAMS_APP_SECRET_ARN") && err.contains(SECRET_ARN),
                "{err}"
            );
            assert!(!err.contains("forgejo-secret-1"), "{err}");
        }
    }

    #[test]
    fn a_secret_that_cannot_be_read_is_explained_without_its_answer() {
        use aws_sdk_secretsmanager::error::{ErrorMetadata, SdkError};
        use aws_sdk_secretsmanager::operation::get_secret_value::GetSecretValueError;
        use aws_sdk_secretsmanager::types::error::ResourceNotFoundException;
        let missing = ResourceNotFoundException::builder()
            .message("Secrets Manager can't find the specified secret.")
            .meta(
                ErrorMetadata::builder()
                    .code("ResourceNotFoundException")
                    .message("Secrets Manager can't find the specified secret.")
                    .build(),
            )
            .build();
        let raw = r#"{"__type": "ResourceNotFoundException", "aws_request_id": "r-1"}"#.to_string();
        let error =
            SdkError::service_error(GetSecretValueError::ResourceNotFoundException(missing), raw);
        assert_eq!(
            secret_read_error(&error),
            "ResourceNotFoundException: Secrets Manager can't find the specified secret."
        );
        // An answer that did not parse is the secret itself: none of it is shown.
        let answer = r#"{"SecretString": "{\"token\": \"forgejo-secret-1\"}"#.to_string();
        let error: SdkError<GetSecretValueError, String> =
            SdkError::response_error("unexpected end of input", answer);
        assert!(!secret_read_error(&error).contains("forgejo-secret-1"));
    }

    #[tokio::test]
    async fn agents_accept_tokens_of_the_agent_key_only() {
        use loams_a2a::{CallerAuth, TokenSource};
        let (people_pkcs8, _, people_public) = key_pair();
        let (_, agent_key, agent_public) = key_pair();
        let (_, panel_key, panel_public) = key_pair();
        let mut worker = environment("worker");
        worker.retain(|(k, _)| *k != "LOAMS_AGENT_TOKEN_KEY");
        worker.push(("LOAMS_AGENT_TOKEN_KEY", &agent_key));
        let worker = Settings::read(vars(&worker)).unwrap();
        let mut agent = environment("agent:forgejo");
        agent.retain(|(k, _)| !k.ends_with("_TOKEN_PUBLIC_KEY"));
        agent.push(("LOAMS_AGENT_TOKEN_PUBLIC_KEY", &agent_public));
        agent.push(("LOAMS_PANEL_TOKEN_PUBLIC_KEY", &panel_public));
        let agent = Settings::read(vars(&agent)).unwrap();
        let auth = agent_auth(&agent).unwrap();
        let url = "https://f.lambda-url.eu-west-1.on.aws/";

        let token = agent_tokens(&worker)
            .unwrap()
            .token(url, "forgejo")
            .await
            .unwrap();
        let principal = auth.verify(Some(&token), url).await.unwrap();
        assert_eq!(
            (principal.subject.as_str(), principal.org.as_str()),
            (loams_api::AGENT_SUBJECT, "acme")
        );
        // The API's panel reads, with its own key: a person, reading.
        let card = CardSigner::generate().unwrap();
        let card_public = spki(&card.to_pkcs8().unwrap());
        let mut api = environment("api");
        api.retain(|(k, _)| !matches!(*k, "LOAMS_PANEL_TOKEN_KEY" | "LOAMS_CARD_PUBLIC_KEY"));
        api.push(("LOAMS_PANEL_TOKEN_KEY", &panel_key));
        api.push(("LOAMS_CARD_PUBLIC_KEY", &card_public));
        let api_settings = Settings::read(vars(&api)).unwrap();
        collab(&api_settings).expect("the API's registry starts with its keys");
        let alice = loams_api::Caller {
            user: "alice".into(),
            org: "acme".into(),
            scopes: vec!["forgejo:read".into()],
        };
        let panels = panel_tokens(&api_settings).unwrap();
        let read = loams_api::broker::on_behalf_token(&panels, url, "forgejo", &alice).unwrap();
        let reader = auth.verify(Some(&read), url).await.unwrap();
        assert_eq!(
            (reader.subject.as_str(), reader.scopes.as_slice()),
            ("user:alice", ["forgejo:read".to_string()].as_slice())
        );
        // The people's issuer key signs nothing an agent accepts: not an agent token (even one naming the agent
        // token issuer), not a person's token for the agent's URL.
        let people = Issuer::from_pkcs8(&people_pkcs8, DEV_ISSUER, DEV_AUDIENCE).unwrap();
        let forged =
            Issuer::from_pkcs8(&people_pkcs8, AGENT_TOKEN_ISSUER, AGENT_TOKEN_ISSUER).unwrap();
        let now = jsonwebtoken::get_current_timestamp();
        for token in [
            AgentTokens::new(forged, "acme")
                .token(url, "forgejo")
                .await
                .unwrap(),
            AgentTokens::new(people.clone(), "acme")
                .token(url, "forgejo")
                .await
                .unwrap(),
            people
                .issue_for(url, "alice", "acme", loams_api::scope::ALL, now, 300)
                .unwrap(),
        ] {
            assert_eq!(
                auth.verify(Some(&token), url).await,
                Err(loams_a2a::AuthError::Invalid)
            );
        }

        // The API checks people's tokens with the public key alone, and serves the JWKS the issuer would.
        let mut api = environment("api");
        api.retain(|(k, _)| *k != "LOAMS_ISSUER_PUBLIC_KEY");
        api.push(("LOAMS_ISSUER_PUBLIC_KEY", &people_public));
        let (verifier, jwks) = people_verifier(&Settings::read(vars(&api)).unwrap()).unwrap();
        assert_eq!(jwks, people.jwks());
        let person = crate::stack::dev_token(&people, "alice", "acme").unwrap();
        assert_eq!(verifier.verify(&person).await.unwrap().user, "alice");
        assert!(
            verifier.verify(&token).await.is_err(),
            "an agent token is no person's"
        );
    }

    #[test]
    fn public_keys_are_checked_and_match_their_private_keys() {
        let card = CardSigner::generate().unwrap();
        let card_public = spki(&card.to_pkcs8().unwrap());
        assert_eq!(
            card_jwks("LOAMS_CARD_PUBLIC_KEY", Some(&card_public)).unwrap(),
            card.jwks().unwrap()
        );
        let p384 = {
            use aws_lc_rs::signature::{ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
            let rng = aws_lc_rs::rand::SystemRandom::new();
            let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, &rng).unwrap();
            let pair =
                EcdsaKeyPair::from_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, doc.as_ref()).unwrap();
            STANDARD.encode(pair.public_key().as_der().unwrap().as_ref())
        };
        let (_, private, _) = key_pair();
        for bad in ["not base64!", "a2V5", &p384, &private] {
            let err = token_jwks("LOAMS_AGENT_TOKEN_PUBLIC_KEY", Some(bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains("LOAMS_AGENT_TOKEN_PUBLIC_KEY"), "{err}");
        }
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

    /// Lambda runs on DynamoDB and SQS: the embedded store is refused by name (and so stays out of the binary).
    #[tokio::test]
    async fn a_function_opens_no_backend_but_dynamodb_and_sqs() {
        let sdk = aws_config::SdkConfig::builder().build();
        let mut config = Config::default();
        let refused = Backend::open_on(&config, &sdk).await.err().unwrap();
        assert!(
            refused.to_string().starts_with("setting `backend`"),
            "{refused}"
        );
        config.backend.store = StoreKind::Dynamodb;
        let refused = Backend::open_on(&config, &sdk).await.err().unwrap();
        assert!(
            refused.to_string().starts_with("setting `backend`"),
            "{refused}"
        );
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
        let version = async || {
            let stored = backend.store.get_run("acme", &run).await.unwrap();
            stored.unwrap().version
        };
        let before = version().await;

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
        let response = handle_sqs(&worker, event, far()).await;
        // A run that is not (yet) there may appear: delivered again. Bodies that never parse are dropped.
        assert_eq!(failures(&response), ["m-unknown-run"]);
        let after = version().await;
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
            "LOAMS_CONFIG" => "[factory]\nmax_attempts = 3\n".into(),
            "LOAMS_BASE_BRANCH" => "main".into(),
            "LOAMS_ANALYTICS_PROJECT" => "shop".into(),
            "LOAMS_APP_SECRET_ARN" => {
                "arn:aws:secretsmanager:eu-west-1:1:secret:loams-acme-production/app-AbCdEf".into()
            }
            // Each key its own stand-in: a function refuses two of its keys being one.
            name if name.ends_with("_KEY") => STANDARD.encode(name),
            "LOAMS_WEBHOOK_TOKEN" => "0123456789abcdef0123456789abcdef".into(),
            _ => "https://example.lambda-url.eu-west-1.on.aws/".into(),
        }
    }

    /// The template's resources, each as the text of its block (its first line `Name:`).
    fn resources() -> Vec<String> {
        let resources = TEMPLATE.split_once("\nResources:\n").unwrap().1;
        // A resource starts at a line indented by exactly two spaces.
        let mut blocks: Vec<String> = Vec::new();
        for line in resources.lines() {
            let top = line.starts_with("  ") && !line[2..].starts_with([' ', '#']);
            match blocks.last_mut() {
                Some(block) if !top => block.push_str(&format!("\n{line}")),
                _ => blocks.push(line.trim().to_string()),
            }
        }
        blocks
    }

    /// The number a resource sets `property` to.
    fn seconds(resource: &str, property: &str) -> u64 {
        let block = resources()
            .into_iter()
            .find(|b| b.starts_with(&format!("{resource}:")))
            .unwrap_or_else(|| panic!("no resource {resource}"));
        let line = block
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix(&format!("{property}: "))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("{resource} sets no {property}"));
        line.parse()
            .unwrap_or_else(|e| panic!("{resource}.{property} = {line}: {e}"))
    }

    /// A model answer may take minutes: the worker's invocation must hold a whole step (else the answer is paid
    /// and lost, then bought again), within Lambda's 900 s; its queue must not deliver a batch again while the
    /// invocation that holds it may still run, nor page about a message that waits on one.
    #[test]
    fn the_worker_function_outlasts_its_longest_step_and_its_queue_outlasts_the_worker() {
        let timeout = seconds("WorkerFunction", "Timeout");
        assert!(
            (loams_worker::MAX_STEP.as_secs()..=900).contains(&timeout),
            "worker Timeout {timeout} s, a step up to {:?}",
            loams_worker::MAX_STEP
        );
        let visibility = seconds("WorkQueue", "VisibilityTimeout");
        assert!(
            visibility >= timeout,
            "visibility {visibility} s < worker Timeout {timeout} s"
        );
        // A message stays in the queue, its age growing, while its batch's invocation runs.
        let alarm = seconds("WorkQueueAgeAlarm", "Threshold");
        assert!(
            alarm > timeout,
            "age alarm at {alarm} s pages on a worker invocation of {timeout} s"
        );
    }

    #[test]
    fn every_function_of_the_template_starts_with_its_variables() {
        let globals = TEMPLATE.split_once("\nResources:\n").unwrap().0;
        let common = variables(globals.split_once("\nGlobals:\n").unwrap().1);
        assert!(common.iter().any(|(k, _)| k == "LOAMS_TABLE"), "{common:?}");
        let mut seen = Vec::new();
        let blocks = resources();
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
            // An agent may read its own app's secret, which refuses everyone else; no other function reads any.
            let grants: Vec<&str> = block
                .lines()
                .filter_map(|l| l.trim().strip_prefix("Resource: !Ref "))
                .filter(|r| r.ends_with("Secret"))
                .collect();
            match settings.function {
                Function::Agent(agent) => {
                    let secret = format!("{}{}Secret", agent[..1].to_uppercase(), &agent[1..]);
                    assert_eq!(grants, [secret.as_str()], "{name}");
                    assert!(
                        own.contains(&("LOAMS_APP_SECRET_ARN".into(), format!("!Ref {secret}"))),
                        "{name}: {own:?}"
                    );
                    let policy = blocks
                        .iter()
                        .find(|b| b.starts_with(&format!("{secret}Policy:")))
                        .unwrap_or_else(|| panic!("no policy on {secret}"));
                    assert!(
                        policy.contains(&format!("!Ref {secret}"))
                            && policy.contains(&format!("!GetAtt {name}Role.Arn")),
                        "{policy}"
                    );
                }
                _ => assert!(!block.contains("secretsmanager:"), "{name} reads a secret"),
            }
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
