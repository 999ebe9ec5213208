//! CollabService (DESIGN.md section 4): the app registry, and the objects of a run its native panels show (Issue,
//! PullRequest, CheckRun, Thread, ErrorIssue, MetricSeries).
//!
//! A panel never calls an app. Each read names a run of the caller's organisation and goes through the app's own
//! agent over A2A, as the caller: the token it presents names the person (`user:<sub>`) and holds only that app's
//! read scope ([`crate::broker::on_behalf_token`], signed with a key of its own), so the agent, which checks the
//! scope where the skill runs, would refuse anything but a read even if this service asked. The caller's own token
//! must grant `runs:read` and the same app scope. The object read is the one the run made (or was opened for), taken
//! from the run's record: a person reads what the factory touched, not whatever the agent's credentials reach.

use std::sync::Arc;

use async_trait::async_trait;
use loams_a2a::{A2aClient, AppLinks, CallError, Jwks, Risk, TokenError, TokenSource};
use loams_proto::collab::v1 as pc;
use loams_proto::connect::{CallContext, Router};
use reqwest::Url;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::Issuer;
use crate::factory::run_row;
use crate::{ApiError, ApiState, Caller, convert, scope};

const SERVICE: &str = "/loams.collab.v1.CollabService/";
const DAY_MS: i64 = 86_400_000;
/// Longest look back of a metric series: a panel shows the run's neighbourhood, not the product's history.
const MAX_LOOKBACK_MS: i64 = 90 * DAY_MS;

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
    connected: tokio::sync::OnceCell<Connected>,
}

/// An agent whose card passed the checks, with the links of its card as shown (checked once, when connecting).
struct Connected {
    client: A2aClient,
    links: AppLinks,
    web: Option<Origin>,
}

impl AgentLink {
    pub fn new(url: impl Into<String>, trusted: Jwks) -> Self {
        Self {
            url: url.into(),
            trusted,
            connected: tokio::sync::OnceCell::new(),
        }
    }

    /// The agent of app `id`, once its card is verified, names that app, and sends calls where it was configured
    /// to be (a card that points elsewhere would take the panel tokens with it).
    async fn connect(&self, id: &str) -> Result<&Connected, ApiError> {
        self.connected
            .get_or_try_init(|| async {
                let client = A2aClient::new(&self.url, &self.trusted).await.map_err(|e| {
                    tracing::warn!(app = id, error = %e, "app registry: agent unreachable");
                    ApiError::Unavailable(format!("the {id} agent cannot be reached"))
                })?;
                if client.card().name != id || origin(client.endpoint()) != origin(&self.url) {
                    tracing::error!(app = id, card = %client.card().name, endpoint = client.endpoint(),
                        "app registry: the agent's card names another agent or address");
                    return Err(ApiError::Internal(format!("the {id} agent's card does not match its configuration")));
                }
                let links = loams_a2a::app_links(client.card())
                    .map(checked_links)
                    .unwrap_or_default();
                let web = origin(&links.web_url);
                Ok(Connected { client, links, web })
            })
            .await
    }
}

/// The registry of one organisation's deployment, the environment its apps serve, and the key panel-read tokens
/// are signed with (neither the people's nor the worker's). A caller of another organisation finds no app here, as
/// a record of another organisation reads as a missing one.
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

/// Scheme, host and port of a web address.
type Origin = (String, String, u16);

/// The origin of an absolute http(s) URL without credentials; `None` for anything else.
fn origin(url: &str) -> Option<Origin> {
    let url = Url::parse(url).ok()?;
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return None;
    }
    Some((
        url.scheme().to_string(),
        url.host_str()?.to_string(),
        url.port_or_known_default()?,
    ))
}

/// What of a card's links is shown: a plain http(s) web address, and only the templates under it.
fn checked_links(links: AppLinks) -> AppLinks {
    if origin(&links.web_url).is_none() {
        return AppLinks::default();
    }
    let under = format!("{}/", links.web_url.trim_end_matches('/'));
    AppLinks {
        deep_link_templates: links
            .deep_link_templates
            .into_iter()
            .filter(|(_, template)| template.starts_with(&under))
            .collect(),
        ..links
    }
}

/// `link` if it is an http(s) address on the app's own web origin, else empty: links in app data are written by
/// whoever can write there, and a panel must not become a way to send people elsewhere.
fn own_link(link: String, web: &Option<Origin>) -> String {
    match Url::parse(&link) {
        // Passed on as parsed: a client whose parser reads the raw text differently sees the same address.
        Ok(url) if web.is_some() && origin(url.as_str()) == *web => url.into(),
        _ => String::new(),
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
            let readable = may_read(caller, &app.id);
            // Where an app lives is shown only to those who may read it.
            let links = match (&app.agent, readable) {
                (Some(link), true) => link.connect(&app.id).await.ok().map(|c| c.links.clone()),
                _ => None,
            }
            .unwrap_or_default();
            pc::App {
                id: app.id.clone(),
                kind: kind_of(&app.id).into(),
                base_url: links.web_url,
                deep_link_templates: links.deep_link_templates.into_iter().collect(),
                configured: app.agent.is_some(),
                readable,
                environment: self.environment.clone(),
            }
        });
        pc::ListAppsResponse {
            apps: futures::future::join_all(apps).await,
        }
    }

    /// Runs the read skill `skill` of app `app`'s agent as `caller` and reads its answer as `T`, with the app's web
    /// origin (for [`own_link`]). `what` names the object when the app has none.
    async fn read<T: for<'de> Deserialize<'de>>(
        &self,
        caller: &Caller,
        app: &str,
        skill: &str,
        args: Value,
        what: &str,
    ) -> Result<(T, Option<Origin>), ApiError> {
        if !may_read(caller, app) {
            return Err(ApiError::PermissionDenied(format!(
                "reading {app} panels needs the scope {app}:read"
            )));
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
        let Connected { client, web, .. } = link.connect(app).await?;
        let token = crate::broker::on_behalf_token(issuer, client.endpoint(), app, caller)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        let answer = client
            .clone()
            .with_tokens(Arc::new(OneToken(token)))
            .call(&panel_message_id()?, skill, args, None)
            .await
            .map_err(|e| refused(app, e))?;
        if answer.get("found") == Some(&Value::Bool(false)) {
            return Err(ApiError::NotFound(format!(
                "the run's {what} is not in {app} (any more)"
            )));
        }
        let decoded = serde_json::from_value(answer).map_err(|e| {
            tracing::error!(app, skill, error = %e, "panel read: the agent's answer does not decode");
            ApiError::Internal(format!("the {app} agent's answer does not decode"))
        })?;
        Ok((decoded, web.clone()))
    }
}

/// Whether `caller` holds the agent's read scope of `app`, as its card names it.
fn may_read(caller: &Caller, app: &str) -> bool {
    Risk::Read
        .scopes(app)
        .iter()
        .all(|s| caller.scopes.contains(s))
}

/// A fresh message id per read: reads are not deduplicated, every panel load asks again.
fn panel_message_id() -> Result<String, ApiError> {
    crate::random_id("panel")
}

/// The bearer token minted for one read.
struct OneToken(String);

#[async_trait]
impl TokenSource for OneToken {
    async fn token(&self, _audience: &str, _agent: &str) -> Result<String, TokenError> {
        Ok(self.0.clone())
    }
}

/// An agent's failure as the caller sees it: what to do, not the app's paths and words (those go to the log).
fn refused(app: &str, e: CallError) -> ApiError {
    tracing::warn!(app, error = %e, "panel read failed");
    match e {
        CallError::Skill {
            retryable: false, ..
        } => ApiError::FailedPrecondition(format!("{app} could not answer this read")),
        CallError::Skill { .. }
        | CallError::Transport(_)
        | CallError::InProgress(_)
        | CallError::Http(_) => ApiError::Unavailable(format!("{app} is not answering; try again")),
        _ => ApiError::Internal(format!("the {app} agent answered outside the protocol")),
    }
}

/// The run `run_id` of the caller's organisation, as the worker keeps it.
async fn run_of(
    s: &ApiState,
    caller: &Caller,
    run_id: &str,
) -> Result<loams_factory::Run, ApiError> {
    caller.require(scope::RUNS_READ)?;
    convert::snapshot(&run_row(s, caller, run_id).await?)
}

/// The run's reference to an object it made, or NotFound while it has not made it.
fn made<T>(reference: Option<T>, run_id: &str, what: &str) -> Result<T, ApiError> {
    reference.ok_or_else(|| ApiError::NotFound(format!("run {run_id} has no {what} (yet)")))
}

async fn get_issue(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetIssueRequest,
) -> Result<pc::Issue, ApiError> {
    let run = run_of(s, caller, &req.run_id).await?;
    let issue_id = made(run.links.issue_id, &req.run_id, "issue")?;
    let (issue, web): (pc::Issue, _) = s
        .collab
        .read(
            caller,
            "plane",
            "get_issue",
            json!({"issue_id": issue_id}),
            "issue",
        )
        .await?;
    Ok(pc::Issue {
        url: own_link(issue.url, &web),
        ..issue
    })
}

async fn get_pull_request(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetPullRequestRequest,
) -> Result<pc::PullRequest, ApiError> {
    let run = run_of(s, caller, &req.run_id).await?;
    let number = made(run.links.pr_number, &req.run_id, "pull request")?;
    let (pr, web): (pc::PullRequest, _) = s
        .collab
        .read(
            caller,
            "forgejo",
            "get_pr",
            json!({"number": number}),
            "pull request",
        )
        .await?;
    Ok(pc::PullRequest {
        url: own_link(pr.url, &web),
        ..pr
    })
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
    let run = run_of(s, caller, &req.run_id).await?;
    let sha = made(run.links.commit_sha, &req.run_id, "commit")?;
    let (ci, web): (CiAnswer, _) = s
        .collab
        .read(
            caller,
            "forgejo",
            "ci_status",
            json!({"sha": sha}),
            "commit",
        )
        .await?;
    Ok(pc::ListCheckRunsResponse {
        sha,
        state: ci.state,
        check_runs: ci
            .checks
            .into_iter()
            .map(|c| pc::CheckRun {
                name: c.context,
                state: c.state,
                description: c.description,
                url: own_link(c.url, &web),
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
    sender_name: String,
    #[serde(default)]
    content: String,
}

async fn get_thread(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetThreadRequest,
) -> Result<pc::Thread, ApiError> {
    let run = run_of(s, caller, &req.run_id).await?;
    made(run.links.thread_message_id, &req.run_id, "thread")?;
    let (channel, topic) = (run.config.channel.clone(), run.topic());
    let (thread, _): (ThreadAnswer, _) = s
        .collab
        .read(
            caller,
            "zulip",
            "read",
            json!({"channel": channel, "topic": topic}),
            "thread",
        )
        .await?;
    Ok(pc::Thread {
        channel,
        topic,
        // Senders' addresses stay in Zulip, which decides who may see them.
        messages: thread
            .messages
            .into_iter()
            .map(|m| pc::ThreadMessage {
                id: m.id,
                sender_name: m.sender_name,
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
    let run = run_of(s, caller, &req.run_id).await?;
    let issue_id = made(
        run.signal.glitchtip_issue_id,
        &req.run_id,
        "GlitchTip issue",
    )?;
    let (error, web): (pc::ErrorIssue, _) = s
        .collab
        .read(
            caller,
            "glitchtip",
            "get_issue",
            json!({"issue_id": issue_id}),
            "error issue",
        )
        .await?;
    Ok(pc::ErrorIssue {
        url: own_link(error.url, &web),
        ..error
    })
}

async fn get_metric_series(
    s: &ApiState,
    caller: &Caller,
    req: pc::GetMetricSeriesRequest,
) -> Result<pc::MetricSeries, ApiError> {
    let run = run_of(s, caller, &req.run_id).await?;
    let now = s.now_ms();
    let since_ms = match req.since_ms {
        0 => (run.started_at_ms - DAY_MS).max(now - MAX_LOOKBACK_MS),
        since if (now - MAX_LOOKBACK_MS..=now).contains(&since) => since,
        _ => {
            return Err(ApiError::InvalidArgument(format!(
                "since_ms must be within the last {} days (or 0)",
                MAX_LOOKBACK_MS / DAY_MS
            )));
        }
    };
    let event = run.config.analytics_event.clone();
    let args = json!({"project_id": run.config.analytics_project_id, "event": event, "since_ms": since_ms});
    let (series, _): (pc::MetricSeries, _) = s
        .collab
        .read(caller, "analytics", "series", args, "metric")
        .await?;
    Ok(pc::MetricSeries { event, ..series })
}

/// Registers one panel read: any valid token, then the procedure checks the scopes it needs itself.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_plain_http_addresses_only() {
        assert_eq!(
            origin("https://git.example/o/r/pulls/1"),
            Some(("https".into(), "git.example".into(), 443))
        );
        assert_eq!(
            origin("http://127.0.0.1:3000/x"),
            Some(("http".into(), "127.0.0.1".into(), 3000))
        );
        for bad in [
            "javascript:alert(1)",
            "https://user:pw@git.example/",
            "ftp://git.example/",
            "/relative",
            "",
        ] {
            assert_eq!(origin(bad), None, "{bad}");
        }
    }

    #[test]
    fn app_links_keep_only_their_own_pages() {
        let web = origin("https://git.example");
        assert_eq!(
            own_link("https://git.example/o/r/pulls/1".into(), &web),
            "https://git.example/o/r/pulls/1"
        );
        for elsewhere in [
            "https://git.example.evil/x",
            "http://git.example/x",
            "javascript:x",
            "https://a@git.example/",
        ] {
            assert_eq!(own_link(elsewhere.into(), &web), "", "{elsewhere}");
        }
        assert_eq!(own_link("https://git.example/x".into(), &None), "");
        // What is passed on is the address as parsed, which every parser reads alike.
        assert_eq!(
            own_link("https://git.example\\@evil.com/".into(), &web),
            "https://git.example/@evil.com/"
        );

        let card = AppLinks {
            web_url: "https://git.example".into(),
            deep_link_templates: [
                (
                    "pull_request".to_string(),
                    "https://git.example/o/r/pulls/{number}".to_string(),
                ),
                (
                    "phish".to_string(),
                    "https://git.example.evil/{number}".to_string(),
                ),
                ("script".to_string(), "javascript:{number}".to_string()),
            ]
            .into(),
        };
        let shown = checked_links(card);
        assert_eq!(
            shown.deep_link_templates.keys().collect::<Vec<_>>(),
            ["pull_request"]
        );
        let bad_home = AppLinks {
            web_url: "javascript:x".into(),
            ..shown
        };
        assert_eq!(checked_links(bad_home), AppLinks::default());
    }
}
