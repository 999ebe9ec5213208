//! CollabService (DESIGN.md section 4): the app registry, and the objects the native panels show (Issue,
//! PullRequest, CheckRun, Thread, ErrorIssue, MetricSeries).
//!
//! A panel never calls an app. Each read here goes through the app's own agent over A2A, as the caller: the token
//! it presents names the person (`user:<sub>`) and holds only that app's read scope (`plane:read`, ...,
//! [`crate::broker::on_behalf_token`]), so the agent, which checks the scope where the skill runs, would refuse
//! anything but a read even if this service asked. The caller's own token must grant the same scope.

use std::sync::Arc;

use async_trait::async_trait;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use loams_a2a::{A2aClient, CallError, Jwks, Risk, TokenError, TokenSource};
use loams_proto::collab::v1 as pc;
use loams_proto::connect::{CallContext, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::Issuer;
use crate::{ApiError, ApiState, Caller};

const SERVICE: &str = "/loams.collab.v1.CollabService/";
/// Longest id, channel or event name passed on to an agent (the agents' own limits are of this order).
const MAX_REF: usize = 256;
/// Zulip's topic limit.
const MAX_TOPIC_CHARS: usize = 60;

/// One app of the registry: `id` is the name of the agent that owns it (`zulip`, `plane`, `forgejo`, `glitchtip`,
/// `analytics`). Its web address and page links come from that agent's signed card ([`loams_a2a::APP_EXTENSION`]),
/// so they are configured once, where the app's credentials are.
pub struct RegisteredApp {
    pub id: String,
    /// The app's agent; `None` when the deployment has not configured the app.
    pub agent: Option<AgentLink>,
}

/// Where an app's agent is, and the keys its card must be signed with. Connected on first use, so a start does
/// not wait for every agent and an agent that is down fails only its own panels.
pub struct AgentLink {
    url: String,
    trusted: Jwks,
    client: tokio::sync::OnceCell<A2aClient>,
}

impl AgentLink {
    pub fn new(url: impl Into<String>, trusted: Jwks) -> Self {
        Self {
            url: url.into(),
            trusted,
            client: tokio::sync::OnceCell::new(),
        }
    }

    async fn client(&self) -> Result<&A2aClient, ApiError> {
        self.client
            .get_or_try_init(|| A2aClient::new(&self.url, &self.trusted))
            .await
            .map_err(|e| ApiError::Unavailable(format!("the app's agent cannot be reached: {e}")))
    }
}

/// The registry of one organisation's deployment, the environment its apps serve, and the key panel-read tokens
/// are signed with (a key of its own: neither the people's nor the worker's). A caller of another organisation
/// finds no app here, as a record of another organisation reads as a missing one.
#[derive(Default)]
pub struct Collab {
    org: String,
    environment: String,
    apps: Vec<RegisteredApp>,
    tokens: Option<Issuer>,
}

/// The kind of the app agent `id` owns.
fn kind_of(id: &str) -> pc::AppKind {
    match id {
        "zulip" => pc::AppKind::Zulip,
        "plane" => pc::AppKind::Plane,
        "forgejo" => pc::AppKind::Forgejo,
        "glitchtip" => pc::AppKind::Glitchtip,
        "analytics" => pc::AppKind::Openpanel,
        _ => pc::AppKind::Unspecified,
    }
}

impl Collab {
    pub fn new(
        org: impl Into<String>,
        environment: impl Into<String>,
        apps: Vec<RegisteredApp>,
        tokens: Issuer,
    ) -> Self {
        Self {
            org: org.into(),
            environment: environment.into(),
            apps,
            tokens: Some(tokens),
        }
    }

    /// The apps `caller` may see: the registry if the caller is of its organisation, else none.
    fn apps_of(&self, caller: &Caller) -> &[RegisteredApp] {
        if caller.org == self.org {
            &self.apps
        } else {
            &[]
        }
    }

    async fn list(&self, caller: &Caller) -> pc::ListAppsResponse {
        let apps = self.apps_of(caller).iter().map(|app| async move {
            let links = match &app.agent {
                Some(link) => match link.client().await {
                    Ok(client) => loams_a2a::app_links(client.card()),
                    Err(e) => {
                        // Listed all the same: the app is configured, its panels will say what is wrong.
                        tracing::warn!(app = %app.id, error = %e, "app registry: agent unreachable");
                        None
                    }
                },
                None => None,
            }
            .unwrap_or_default();
            pc::App {
                id: app.id.clone(),
                kind: kind_of(&app.id).into(),
                base_url: links.web_url,
                deep_link_templates: links.deep_link_templates.into_iter().collect(),
                configured: app.agent.is_some(),
                readable: read_scope(&app.id)
                    .iter()
                    .all(|s| caller.scopes.contains(s)),
                environment: self.environment.clone(),
            }
        });
        pc::ListAppsResponse {
            apps: futures::future::join_all(apps).await,
        }
    }

    /// Runs the read skill `skill` of app `app`'s agent as `caller`. `Ok(None)`: the app has no such object.
    async fn read(
        &self,
        caller: &Caller,
        app: &str,
        skill: &str,
        args: Value,
    ) -> Result<Option<Value>, ApiError> {
        for scope in read_scope(app) {
            caller.require(&scope)?;
        }
        let registered = self
            .apps_of(caller)
            .iter()
            .find(|a| a.id == app)
            .and_then(|a| a.agent.as_ref());
        let (Some(link), Some(issuer)) = (registered, &self.tokens) else {
            return Err(ApiError::FailedPrecondition(format!(
                "this deployment has no {app} configured"
            )));
        };
        let client = link.client().await?;
        let token = crate::broker::on_behalf_token(issuer, client.endpoint(), app, caller)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        let answer = client
            .clone()
            .with_tokens(Arc::new(OneToken(token)))
            .call(&panel_message_id()?, skill, args, None)
            .await
            .map_err(|e| refused(app, e))?;
        Ok(match answer.get("found") {
            Some(Value::Bool(false)) => None,
            _ => Some(answer),
        })
    }
}

/// The scopes a read of `app`'s panels needs: the agent's read scope, as its card names it.
fn read_scope(app: &str) -> Vec<String> {
    Risk::Read.scopes(app)
}

/// A fresh message id per read: reads are not deduplicated, every panel load asks again.
fn panel_message_id() -> Result<String, ApiError> {
    let mut bytes = [0u8; 12];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| ApiError::Internal("random message id".into()))?;
    Ok(format!("panel-{}", hex::encode(bytes)))
}

/// The bearer token minted for one read.
struct OneToken(String);

#[async_trait]
impl TokenSource for OneToken {
    async fn token(&self, _audience: &str, _agent: &str) -> Result<String, TokenError> {
        Ok(self.0.clone())
    }
}

/// An agent's failure as the caller should see it: the app's own words where the read failed for good.
fn refused(app: &str, e: CallError) -> ApiError {
    match e {
        CallError::Skill {
            message,
            retryable: false,
        } => ApiError::FailedPrecondition(message),
        CallError::Skill { message, .. } => ApiError::Unavailable(message),
        CallError::Transport(_) | CallError::InProgress(_) | CallError::Http(_) => {
            ApiError::Unavailable(format!("the {app} agent did not answer: {e}"))
        }
        other => ApiError::Internal(format!("the {app} agent: {other}")),
    }
}

fn not_found(what: &str) -> ApiError {
    ApiError::NotFound(format!("{what} not found"))
}

/// A reference the caller passes on to an agent: present, bounded, one line.
fn reference(field: &str, value: &str) -> Result<(), ApiError> {
    if value.is_empty() || value.len() > MAX_REF || value.chars().any(char::is_control) {
        return Err(ApiError::InvalidArgument(format!(
            "{field} must be 1..={MAX_REF} bytes without control characters"
        )));
    }
    Ok(())
}

/// An agent's answer read as the panel message it was shaped for (proto3 JSON, unknown fields ignored).
fn decode<T: for<'de> Deserialize<'de>>(app: &str, answer: Value) -> Result<T, ApiError> {
    serde_json::from_value(answer)
        .map_err(|e| ApiError::Internal(format!("the {app} agent's answer does not decode: {e}")))
}

async fn get_issue(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetIssueRequest,
) -> Result<pc::Issue, ApiError> {
    reference("issue_id", &req.issue_id)?;
    let answer = s
        .collab
        .read(
            caller,
            "plane",
            "get_issue",
            json!({"issue_id": req.issue_id}),
        )
        .await?
        .ok_or_else(|| not_found("issue"))?;
    decode("plane", answer)
}

async fn get_pull_request(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetPullRequestRequest,
) -> Result<pc::PullRequest, ApiError> {
    if req.number == 0 {
        return Err(ApiError::InvalidArgument("number must be positive".into()));
    }
    let answer = s
        .collab
        .read(caller, "forgejo", "get_pr", json!({"number": req.number}))
        .await?
        .ok_or_else(|| not_found("pull request"))?;
    decode("forgejo", answer)
}

#[derive(Deserialize)]
struct CiAnswer {
    state: String,
    #[serde(default)]
    checks: Vec<Check>,
}

#[derive(Deserialize)]
struct Check {
    context: String,
    state: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    url: String,
}

async fn list_check_runs(
    s: &ApiState,
    caller: &Caller,
    req: pc::ListCheckRunsRequest,
) -> Result<pc::ListCheckRunsResponse, ApiError> {
    if req.sha.is_empty() || req.sha.len() > 64 || !req.sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::InvalidArgument(
            "sha must be a hex commit id of at most 64 digits".into(),
        ));
    }
    let answer = s
        .collab
        .read(caller, "forgejo", "ci_status", json!({"sha": req.sha}))
        .await?
        .ok_or_else(|| not_found("commit"))?;
    let ci: CiAnswer = decode("forgejo", answer)?;
    Ok(pc::ListCheckRunsResponse {
        sha: req.sha,
        state: ci.state,
        check_runs: ci
            .checks
            .into_iter()
            .map(|c| pc::CheckRun {
                name: c.context,
                state: c.state,
                description: c.description,
                url: c.url,
            })
            .collect(),
    })
}

#[derive(Deserialize)]
struct ThreadAnswer {
    messages: Vec<ThreadMessage>,
}

#[derive(Deserialize)]
struct ThreadMessage {
    id: u64,
    #[serde(default)]
    sender: String,
    #[serde(default)]
    sender_name: String,
    #[serde(default)]
    content: String,
}

async fn get_thread(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetThreadRequest,
) -> Result<pc::Thread, ApiError> {
    reference("channel", &req.channel)?;
    reference("topic", &req.topic)?;
    if req.topic.chars().count() > MAX_TOPIC_CHARS {
        return Err(ApiError::InvalidArgument(format!(
            "topic must be at most {MAX_TOPIC_CHARS} characters"
        )));
    }
    let answer = s
        .collab
        .read(
            caller,
            "zulip",
            "read",
            json!({"channel": req.channel, "topic": req.topic}),
        )
        .await?
        .ok_or_else(|| not_found("thread"))?;
    let thread: ThreadAnswer = decode("zulip", answer)?;
    Ok(pc::Thread {
        channel: req.channel,
        topic: req.topic,
        messages: thread
            .messages
            .into_iter()
            .map(|m| pc::ThreadMessage {
                id: m.id,
                sender_name: m.sender_name,
                sender_email: m.sender,
                content: m.content,
            })
            .collect(),
    })
}

async fn get_error_issue(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetErrorIssueRequest,
) -> Result<pc::ErrorIssue, ApiError> {
    if req.issue_id.is_empty()
        || req.issue_id.len() > 20
        || !req.issue_id.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(ApiError::InvalidArgument(
            "issue_id must be GlitchTip's decimal issue id".into(),
        ));
    }
    let answer = s
        .collab
        .read(
            caller,
            "glitchtip",
            "get_issue",
            json!({"issue_id": req.issue_id}),
        )
        .await?
        .ok_or_else(|| not_found("error issue"))?;
    decode("glitchtip", answer)
}

async fn get_metric_series(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetMetricSeriesRequest,
) -> Result<pc::MetricSeries, ApiError> {
    reference("event", &req.event)?;
    if req.since_ms < 0 {
        return Err(ApiError::InvalidArgument(
            "since_ms must not be negative".into(),
        ));
    }
    let answer = s
        .collab
        .read(
            caller,
            "analytics",
            "series",
            json!({"event": req.event, "since_ms": req.since_ms}),
        )
        .await?
        .ok_or_else(|| not_found("metric"))?;
    let series: pc::MetricSeries = decode("analytics", answer)?;
    Ok(pc::MetricSeries {
        event: req.event,
        ..series
    })
}

/// Registers one panel read: any valid token, then the procedure checks the app's read scope itself.
macro_rules! panel {
    ($router:expr, $state:expr, $name:literal, $handler:ident, $req:ty) => {{
        let s = $state.clone();
        $router.unary(
            &format!("{SERVICE}{}", $name),
            move |ctx: CallContext, req: $req| {
                let s = s.clone();
                async move {
                    let caller = s
                        .verifier
                        .verify_header(ctx.header("authorization"))
                        .await?;
                    Ok($handler(&s, &caller, req).await?)
                }
            },
        )
    }};
}

pub(crate) fn routes(state: ApiState, router: Router) -> Router {
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}ListApps"),
        move |ctx: CallContext, _req: pc::ListAppsRequest| {
            let s = s.clone();
            async move {
                // The registry holds no secrets; it says per app whether this caller may read its panels.
                let caller = s
                    .verifier
                    .verify_header(ctx.header("authorization"))
                    .await?;
                Ok(s.collab.list(&caller).await)
            }
        },
    );
    let router = panel!(router, state, "GetIssue", get_issue, pc::GetIssueRequest);
    let router = panel!(
        router,
        state,
        "GetPullRequest",
        get_pull_request,
        pc::GetPullRequestRequest
    );
    let router = panel!(
        router,
        state,
        "ListCheckRuns",
        list_check_runs,
        pc::ListCheckRunsRequest
    );
    let router = panel!(router, state, "GetThread", get_thread, pc::GetThreadRequest);
    let router = panel!(
        router,
        state,
        "GetErrorIssue",
        get_error_issue,
        pc::GetErrorIssueRequest
    );
    panel!(
        router,
        state,
        "GetMetricSeries",
        get_metric_series,
        pc::GetMetricSeriesRequest
    )
}
