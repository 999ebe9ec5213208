//! GlitchTip: count an issue's recent events, resolve an issue. API: glitchtip-openapi.json (Sentry-style
//! `/api/0`), `Authorization: Bearer <token>`, cursor pagination in the `Link` header.

use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{AgentSpec, Risk, SkillError, Skills};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{AppHttp, DEFAULT_TIMEOUT, RetryPolicy};
use crate::time::parse_rfc3339_ms;
use crate::{AGENT_VERSION, AgentError, args, found, skill};

const PAGE_SIZE: u32 = 100;
/// Pages read per `issue_events` call; past this the count is a lower bound (reported as `truncated`).
const MAX_PAGES: usize = 50;

#[derive(Clone)]
pub struct GlitchTipConfig {
    pub base_url: String,
    pub token: String,
    /// The organization slug (used for links; the issue endpoints are org-independent).
    pub org_slug: String,
    pub timeout: Duration,
}

impl std::fmt::Debug for GlitchTipConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlitchTipConfig")
            .field("base_url", &self.base_url)
            .field("org_slug", &self.org_slug)
            .finish_non_exhaustive()
    }
}

impl GlitchTipConfig {
    pub fn new(
        base_url: impl Into<String>,
        token: impl Into<String>,
        org_slug: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            token: token.into(),
            org_slug: org_slug.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

#[derive(Debug, Deserialize)]
struct EventRow {
    #[serde(rename = "dateCreated")]
    date_created: String,
}

#[derive(Debug, Deserialize)]
struct IssueRow {
    status: String,
}

/// The fields of GlitchTip's `IssueSchema` an error panel shows.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ErrorIssue {
    pub id: String,
    #[serde(rename = "shortId", default)]
    pub short_id: String,
    pub title: String,
    #[serde(default)]
    pub culprit: Option<String>,
    #[serde(default)]
    pub level: String,
    pub status: String,
    /// Sentry's wire shape: the event count as a decimal string.
    pub count: String,
    #[serde(rename = "firstSeen")]
    pub first_seen: String,
    #[serde(rename = "lastSeen")]
    pub last_seen: String,
}

/// Result of counting an issue's events since a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventCount {
    pub count: u64,
    /// Newest event time, whatever `since`; `None` if the issue has no events.
    pub last_seen_ms: Option<i64>,
    pub truncated: bool,
}

pub struct GlitchTipClient {
    http: AppHttp,
    org_slug: String,
}

impl GlitchTipClient {
    pub fn new(config: &GlitchTipConfig) -> Result<Self, AgentError> {
        let http = AppHttp::new(
            "glitchtip",
            &config.base_url,
            vec![("authorization", format!("Bearer {}", config.token))],
            config.timeout,
            vec![config.token.clone()],
        )?;
        Ok(Self {
            http,
            org_slug: config.org_slug.clone(),
        })
    }

    /// Replaces the default [`RetryPolicy`] (e.g. short backoffs in tests, or none).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.http.set_retry(retry)?;
        Ok(self)
    }

    /// `GET /api/0/issues/{id}/events/`, following `Link: rel="next"` cursors while the pages (newest first, as in
    /// Sentry) still reach back to `since_ms`.
    pub async fn count_events(
        &self,
        issue_id: u64,
        since_ms: i64,
    ) -> Result<EventCount, AgentError> {
        let id = issue_id.to_string();
        let url = self.http.url(&["api", "0", "issues", &id, "events", ""]);
        let mut out = EventCount {
            count: 0,
            last_seen_ms: None,
            truncated: false,
        };
        let mut cursor: Option<String> = None;
        for page in 0..MAX_PAGES {
            let limit = PAGE_SIZE.to_string();
            let mut query = vec![("limit", limit)];
            if let Some(c) = &cursor {
                query.push(("cursor", c.clone()));
            }
            let reply = self
                .http
                .send(self.http.request(Method::GET, url.clone()).query(&query))
                .await?;
            let reply = self.http.ok(reply)?;
            let events: Vec<EventRow> = self.http.decode(&reply.body)?;
            let mut oldest = i64::MAX;
            for e in &events {
                let t = parse_rfc3339_ms(&e.date_created).ok_or_else(|| {
                    self.http
                        .bad(format!("bad dateCreated `{}`", e.date_created))
                })?;
                out.last_seen_ms = Some(out.last_seen_ms.map_or(t, |l| l.max(t)));
                oldest = oldest.min(t);
                if t >= since_ms {
                    out.count += 1;
                }
            }
            let next = reply
                .headers
                .get_all("link")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .find_map(next_cursor);
            match next {
                Some(c) if !events.is_empty() && oldest >= since_ms => {
                    if page + 1 == MAX_PAGES {
                        out.truncated = true;
                    }
                    cursor = Some(c);
                }
                _ => break,
            }
        }
        Ok(out)
    }

    /// `PUT /api/0/issues/{id}/` with `{"status": "resolved"}`; returns the issue's status afterwards.
    pub async fn resolve(&self, issue_id: u64) -> Result<String, AgentError> {
        let id = issue_id.to_string();
        let url = self.http.url(&["api", "0", "issues", &id, ""]);
        let issue: IssueRow = self
            .http
            .json(
                self.http
                    .request(Method::PUT, url)
                    .json(&json!({"status": "resolved"})),
            )
            .await?;
        Ok(issue.status)
    }

    /// `GET /api/0/issues/{id}/` (the issue as its list and detail pages show it).
    pub async fn get_issue(&self, issue_id: u64) -> Result<ErrorIssue, AgentError> {
        let id = issue_id.to_string();
        let url = self.http.url(&["api", "0", "issues", &id, ""]);
        self.http.json(self.http.request(Method::GET, url)).await
    }

    /// The path of an issue's page in the GlitchTip web UI, `{id}` standing for the issue id.
    fn issue_page(&self) -> String {
        format!("/{}/issues/{{id}}", self.org_slug)
    }

    /// The issue's page in the GlitchTip web UI.
    pub fn issue_url(&self, issue_id: u64) -> String {
        let web = self.http.base().as_str().trim_end_matches('/');
        format!(
            "{web}{}",
            self.issue_page().replace("{id}", &issue_id.to_string())
        )
    }
}

/// The cursor of a `rel="next"` link that has `results="true"` (Sentry's link format), if any.
fn next_cursor(header: &str) -> Option<String> {
    for link in header.split(", <").map(|l| l.trim_start_matches('<')) {
        let params: Vec<&str> = link.split(';').skip(1).map(str::trim).collect();
        let param = |name: &str| {
            params
                .iter()
                .find_map(|p| p.strip_prefix(name)?.strip_prefix('='))
                .map(|v| v.trim_matches('"'))
        };
        if param("rel") == Some("next") && param("results") == Some("true") {
            return param("cursor").map(str::to_string);
        }
    }
    None
}

/// GlitchTip issue ids are integers; accept them as JSON numbers or digit strings (Sentry sends strings).
fn issue_id(v: &Value) -> Result<u64, AgentError> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s)
            if !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()) =>
        {
            s.parse().ok()
        }
        _ => None,
    }
    .ok_or_else(|| AgentError::InvalidArgs("`issue_id` must be a positive integer".into()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsArgs {
    issue_id: Value,
    since_ms: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IssueArgs {
    issue_id: Value,
}

/// The errors agent: watches an error issue after a fix and resolves it.
pub struct GlitchTipAgent {
    client: GlitchTipClient,
}

impl GlitchTipAgent {
    pub fn new(config: &GlitchTipConfig) -> Result<Self, AgentError> {
        Ok(Self {
            client: GlitchTipClient::new(config)?,
        })
    }

    /// Replaces the default [`RetryPolicy`] of the agent's app client.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.client = self.client.with_retry(retry)?;
        Ok(self)
    }

    async fn error_issue(&self, id: u64) -> Result<Value, AgentError> {
        let issue = self.client.get_issue(id).await?;
        let bad = |what: &str, value: &str| AgentError::BadResponse {
            app: "glitchtip",
            message: format!("issue {what} `{value}` does not parse"),
        };
        let count: u64 = issue
            .count
            .parse()
            .map_err(|_| bad("count", &issue.count))?;
        let first_seen_ms = parse_rfc3339_ms(&issue.first_seen)
            .ok_or_else(|| bad("firstSeen", &issue.first_seen))?;
        let last_seen_ms =
            parse_rfc3339_ms(&issue.last_seen).ok_or_else(|| bad("lastSeen", &issue.last_seen))?;
        Ok(json!({
            "id": issue.id,
            "short_id": issue.short_id,
            "title": issue.title,
            "culprit": issue.culprit.unwrap_or_default(),
            "level": issue.level,
            "status": issue.status,
            "event_count": count,
            "first_seen_ms": first_seen_ms,
            "last_seen_ms": last_seen_ms,
            "url": self.client.issue_url(id),
        }))
    }

    async fn run(&self, skill: &str, value: Value) -> Result<Value, AgentError> {
        match skill {
            "issue_events" => {
                let a: EventsArgs = args(skill, value)?;
                let id = issue_id(&a.issue_id)?;
                let c = self.client.count_events(id, a.since_ms).await?;
                Ok(
                    json!({"count": c.count, "last_seen_ms": c.last_seen_ms, "truncated": c.truncated}),
                )
            }
            "get_issue" => {
                let a: IssueArgs = args(skill, value)?;
                let id = issue_id(&a.issue_id)?;
                found(self.error_issue(id).await)
            }
            "resolve" => {
                let a: IssueArgs = args(skill, value)?;
                let id = issue_id(&a.issue_id)?;
                let status = self.client.resolve(id).await?;
                Ok(json!({"status": status, "url": self.client.issue_url(id)}))
            }
            other => Err(AgentError::UnknownSkill(other.into())),
        }
    }
}

#[async_trait]
impl Skills for GlitchTipAgent {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "glitchtip".into(),
            description: "Errors agent for GlitchTip: reads an error issue, counts its events since a time (to see \
                          whether a fix worked) and resolves it."
                .into(),
            version: AGENT_VERSION.into(),
            app: Some(crate::app_links(
                self.client.http.base(),
                &[("error_issue", self.client.issue_page())],
            )),
            skills: vec![
                skill(
                    "issue_events",
                    "Issue events",
                    "Count the events of an error issue since a time (epoch ms) and report when it was last seen.",
                    Risk::Read,
                    &[r#"{"issue_id":"42","since_ms":1764500000000}"#],
                ),
                skill(
                    "get_issue",
                    "Get issue",
                    "Read an error issue for its panel: title, culprit, level, status, event count, first and last \
                     seen (epoch ms) and link; {\"found\": false} if there is none.",
                    Risk::Read,
                    &[r#"{"issue_id":"42"}"#],
                ),
                skill(
                    "resolve",
                    "Resolve issue",
                    "Mark an error issue resolved.",
                    Risk::Write,
                    &[r#"{"issue_id":"42"}"#],
                ),
            ],
        }
    }

    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError> {
        Ok(self.run(skill, args).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_header_next_cursor() {
        let h = r#"<http://x/api/0/issues/1/events/?cursor=0:0:1>; rel="previous"; results="false"; cursor="0:0:1", <http://x/api/0/issues/1/events/?cursor=100:0:0>; rel="next"; results="true"; cursor="100:0:0""#;
        assert_eq!(next_cursor(h).as_deref(), Some("100:0:0"));
        let done = h.replace(r#"results="true""#, r#"results="false""#);
        assert_eq!(next_cursor(&done), None);
        assert_eq!(next_cursor(""), None);
    }

    #[test]
    fn issue_ids() {
        assert_eq!(issue_id(&json!(42)).ok(), Some(42));
        assert_eq!(issue_id(&json!("42")).ok(), Some(42));
        for bad in [json!(-1), json!("4a"), json!(""), json!(null), json!(1.5)] {
            assert!(issue_id(&bad).is_err(), "{bad}");
        }
    }
}
