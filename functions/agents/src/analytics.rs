//! OpenPanel (analytics): a daily event-count series. No official OpenAPI file exists; the shapes are OpenPanel's
//! zod schemas (notes/apps.md §3.5): `GET /export/charts` with JSON-encoded `series` in the query, headers
//! `openpanel-client-id` / `openpanel-client-secret` (a `read` or `root` client).

use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{AgentSpec, Risk, SkillError, Skills};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{AppHttp, DEFAULT_TIMEOUT, RetryPolicy};
use crate::time::{ceil_to_second, format_utc_seconds, now_ms};
use crate::{AGENT_VERSION, AgentError, args, require, skill};

const MAX_EVENT_NAME: usize = 200;
const MAX_PROJECT_ID: usize = 128;

#[derive(Clone)]
pub struct AnalyticsConfig {
    pub base_url: String,
    pub client_id: String,
    pub client_secret: String,
    /// Used when a call does not name a project.
    pub project_id: String,
    pub timeout: Duration,
}

impl std::fmt::Debug for AnalyticsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnalyticsConfig")
            .field("base_url", &self.base_url)
            .field("client_id", &self.client_id)
            .field("project_id", &self.project_id)
            .finish_non_exhaustive()
    }
}

impl AnalyticsConfig {
    pub fn new(
        base_url: impl Into<String>,
        client_id: impl Into<String>,
        client_secret: impl Into<String>,
        project_id: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            client_id: client_id.into(),
            client_secret: client_secret.into(),
            project_id: project_id.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// One bucket of a series.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Point {
    pub date: String,
    pub count: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub points: Vec<Point>,
    pub total: f64,
}

#[derive(Deserialize)]
struct FinalChart {
    series: Vec<ChartSeries>,
}

#[derive(Deserialize)]
struct ChartSeries {
    data: Vec<Point>,
    metrics: Metrics,
}

#[derive(Deserialize)]
struct Metrics {
    sum: f64,
}

pub struct OpenPanelClient {
    http: AppHttp,
}

impl OpenPanelClient {
    pub fn new(config: &AnalyticsConfig) -> Result<Self, AgentError> {
        let http = AppHttp::new(
            "openpanel",
            &config.base_url,
            vec![
                ("openpanel-client-id", config.client_id.clone()),
                ("openpanel-client-secret", config.client_secret.clone()),
            ],
            config.timeout,
            vec![config.client_secret.clone()],
        )?;
        Ok(Self { http })
    }

    /// Replaces the default [`RetryPolicy`] (e.g. short backoffs in tests, or none).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.http.set_retry(retry)?;
        Ok(self)
    }

    /// `GET /export/charts`: daily counts of `event` in `[from_ms, to_ms]` (UTC, custom range). The API takes
    /// whole seconds, so the end is rounded up: rounded down, events of the last partial second (all of a run's,
    /// when the run is that short) would not be counted.
    pub async fn daily_counts(
        &self,
        project_id: &str,
        event: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Series, AgentError> {
        let series = json!([{"id": "A", "name": event}]).to_string();
        let query = [
            ("projectId", project_id.to_string()),
            ("series", series),
            ("interval", "day".into()),
            ("range", "custom".into()),
            ("startDate", format_utc_seconds(from_ms)),
            ("endDate", format_utc_seconds(ceil_to_second(to_ms))),
        ];
        let rb = self
            .http
            .request(Method::GET, self.http.url(&["export", "charts"]))
            .query(&query);
        let chart: FinalChart = self.http.json(rb).await?;
        Ok(match chart.series.into_iter().next() {
            Some(s) => Series {
                points: s.data,
                total: s.metrics.sum,
            },
            None => Series {
                points: Vec::new(),
                total: 0.0,
            },
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeriesArgs {
    #[serde(default)]
    project_id: Option<String>,
    event: String,
    since_ms: i64,
}

/// The analytics agent: reads product metrics that show whether users are hurt.
pub struct AnalyticsAgent {
    client: OpenPanelClient,
    default_project: String,
}

impl AnalyticsAgent {
    pub fn new(config: &AnalyticsConfig) -> Result<Self, AgentError> {
        Ok(Self {
            client: OpenPanelClient::new(config)?,
            default_project: config.project_id.clone(),
        })
    }

    /// Replaces the default [`RetryPolicy`] of the agent's app client.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.client = self.client.with_retry(retry)?;
        Ok(self)
    }

    async fn run(&self, skill: &str, value: Value) -> Result<Value, AgentError> {
        match skill {
            "series" => {
                let a: SeriesArgs = args(skill, value)?;
                let project = a
                    .project_id
                    .filter(|p| !p.is_empty())
                    .unwrap_or_else(|| self.default_project.clone());
                require("project_id", &project, MAX_PROJECT_ID)?;
                require("event", &a.event, MAX_EVENT_NAME)?;
                let now = now_ms();
                // A start in the future is a fair question with an empty answer: the factory starts the series at
                // the next whole second after a merge, which a short observe window can reach before that second.
                if a.since_ms > now {
                    return Ok(json!({"points": [], "total": 0}));
                }
                let s = self
                    .client
                    .daily_counts(&project, &a.event, a.since_ms, now)
                    .await?;
                let points: Vec<Value> = s
                    .points
                    .iter()
                    .map(|p| json!({"date": p.date, "count": p.count}))
                    .collect();
                // Counts of events are whole numbers; OpenPanel sends them as JSON numbers that may carry a
                // fraction, so the skill's contract (`total` a non-negative integer) is kept here.
                let total = if s.total.is_finite() && s.total > 0.0 {
                    s.total.round() as u64
                } else {
                    0
                };
                Ok(json!({"points": points, "total": total}))
            }
            other => Err(AgentError::UnknownSkill(other.into())),
        }
    }
}

#[async_trait]
impl Skills for AnalyticsAgent {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "analytics".into(),
            description: "Analytics agent for OpenPanel: daily counts of a product event, to measure user impact \
                          before and after a fix."
                .into(),
            version: AGENT_VERSION.into(),
            // The agent knows OpenPanel's API address only, not where its dashboards are: it names no web address.
            app: None,
            skills: vec![skill(
                "series",
                "Event series",
                "Daily counts of an event since a time (epoch ms), with the total; a time in the future counts nothing.",
                Risk::Read,
                &[r#"{"project_id":"shop","event":"checkout_failed","since_ms":1764500000000}"#],
            )],
        }
    }

    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError> {
        Ok(self.run(skill, args).await?)
    }
}
