//! The native panels of a run (loams.collab.v1): the app registry and the objects the run touched, read through
//! the server, which reads them through the apps' agents as this person. A phone never calls an app.
//!
//! Panels are not cached: they show the app's state now, and without a connection a read fails at once with
//! [`Error::Offline`](crate::Error::Offline). Their text is written in the apps by other people: show it quoted, as plain text.

use std::sync::Arc;

use loams_proto::collab::v1 as pc;

use crate::client::{Inner, check_id, now_ms};
use crate::error::Result;

const SERVICE: &str = "/loams.collab.v1.CollabService/";

/// An app of the deployment's registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct App {
    /// `zulip`, `plane`, `forgejo`, `glitchtip` or `analytics`; the `<app>` of `loams://app/<env>/<app>/...`.
    pub id: String,
    /// The app's web address; empty unless configured, reachable and readable by this person.
    pub base_url: String,
    /// Object kind (`issue`, `pull_request`, `commit`, `error_issue`) to a web link with `{field}` placeholders.
    pub deep_link_templates: Vec<LinkTemplate>,
    pub configured: bool,
    /// Whether this person may read the app's panels.
    pub readable: bool,
    pub environment: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkTemplate {
    pub object: String,
    pub template: String,
}

/// The run's Plane work item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issue {
    pub id: String,
    pub key: String,
    pub title: String,
    pub state: String,
    pub state_group: String,
    pub url: String,
    pub read_at_ms: i64,
}

/// The run's Forgejo pull request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullRequest {
    pub number: u64,
    pub title: String,
    pub body: String,
    pub state: String,
    pub merged: bool,
    pub merge_commit_sha: String,
    pub head_branch: String,
    pub head_sha: String,
    pub base_branch: String,
    pub author: String,
    pub url: String,
    pub read_at_ms: i64,
}

/// The CI checks of the run's latest commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckRuns {
    pub sha: String,
    /// `pending`, `success`, `failure` or `error`.
    pub state: String,
    pub checks: Vec<CheckRun>,
    pub read_at_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckRun {
    pub name: String,
    pub state: String,
    pub description: String,
    pub url: String,
}

/// The run's Zulip thread, newest messages, oldest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatThread {
    pub channel: String,
    pub topic: String,
    pub messages: Vec<ChatMessage>,
    pub read_at_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub id: u64,
    pub sender_name: String,
    /// Raw Markdown as written.
    pub content: String,
}

/// The GlitchTip error issue that opened the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorIssue {
    pub id: String,
    pub short_id: String,
    pub title: String,
    pub culprit: String,
    pub level: String,
    pub status: String,
    pub event_count: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    pub url: String,
    pub read_at_ms: i64,
}

/// Daily counts of the analytics event the run watches.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricSeries {
    pub event: String,
    pub points: Vec<MetricPoint>,
    pub total: u64,
    pub read_at_ms: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MetricPoint {
    /// The day, as OpenPanel dates it (ISO 8601, with a time of day).
    pub date: String,
    pub count: f64,
}

pub struct Panels {
    inner: Arc<Inner>,
}

impl Panels {
    pub(crate) fn new(inner: Arc<Inner>) -> Panels {
        Panels { inner }
    }

    async fn call<
        Req: loams_proto::connect::ConnectMessage,
        Resp: loams_proto::connect::ConnectMessage,
    >(
        &self,
        method: &str,
        req: &Req,
    ) -> Result<Resp> {
        self.inner.unary(&format!("{SERVICE}{method}"), req).await
    }

    /// The deployment's apps, and which of them this person may read.
    pub async fn apps(&self) -> Result<Vec<App>> {
        let list: pc::ListAppsResponse = self.call("ListApps", &pc::ListAppsRequest {}).await?;
        Ok(list
            .apps
            .into_iter()
            .map(|a| App {
                id: a.id,
                base_url: a.base_url,
                deep_link_templates: a
                    .deep_link_templates
                    .into_iter()
                    .map(|(object, template)| LinkTemplate { object, template })
                    .collect(),
                configured: a.configured,
                readable: a.readable,
                environment: a.environment,
            })
            .collect())
    }

    pub async fn issue(&self, run: &str) -> Result<Issue> {
        check_id("run_id", run)?;
        let i: pc::Issue = self
            .call("GetIssue", &pc::GetIssueRequest { run_id: run.into() })
            .await?;
        Ok(Issue {
            id: i.id,
            key: i.key,
            title: i.title,
            state: i.state,
            state_group: i.state_group,
            url: i.url,
            read_at_ms: now_ms(),
        })
    }

    pub async fn pull_request(&self, run: &str) -> Result<PullRequest> {
        check_id("run_id", run)?;
        let req = pc::GetPullRequestRequest { run_id: run.into() };
        let p: pc::PullRequest = self.call("GetPullRequest", &req).await?;
        Ok(PullRequest {
            number: p.number,
            title: p.title,
            body: p.body,
            state: p.state,
            merged: p.merged,
            merge_commit_sha: p.merge_commit_sha,
            head_branch: p.head_branch,
            head_sha: p.head_sha,
            base_branch: p.base_branch,
            author: p.author,
            url: p.url,
            read_at_ms: now_ms(),
        })
    }

    pub async fn check_runs(&self, run: &str) -> Result<CheckRuns> {
        check_id("run_id", run)?;
        let req = pc::ListCheckRunsRequest { run_id: run.into() };
        let c: pc::ListCheckRunsResponse = self.call("ListCheckRuns", &req).await?;
        Ok(CheckRuns {
            sha: c.sha,
            state: c.state,
            checks: c
                .check_runs
                .into_iter()
                .map(|r| CheckRun {
                    name: r.name,
                    state: r.state,
                    description: r.description,
                    url: r.url,
                })
                .collect(),
            read_at_ms: now_ms(),
        })
    }

    pub async fn thread(&self, run: &str) -> Result<ChatThread> {
        check_id("run_id", run)?;
        let t: pc::Thread = self
            .call("GetThread", &pc::GetThreadRequest { run_id: run.into() })
            .await?;
        Ok(ChatThread {
            channel: t.channel,
            topic: t.topic,
            messages: t
                .messages
                .into_iter()
                .map(|m| ChatMessage {
                    id: m.id,
                    sender_name: m.sender_name,
                    content: m.content,
                })
                .collect(),
            read_at_ms: now_ms(),
        })
    }

    pub async fn error_issue(&self, run: &str) -> Result<ErrorIssue> {
        check_id("run_id", run)?;
        let req = pc::GetErrorIssueRequest { run_id: run.into() };
        let e: pc::ErrorIssue = self.call("GetErrorIssue", &req).await?;
        Ok(ErrorIssue {
            id: e.id,
            short_id: e.short_id,
            title: e.title,
            culprit: e.culprit,
            level: e.level,
            status: e.status,
            event_count: e.event_count,
            first_seen_ms: e.first_seen_ms,
            last_seen_ms: e.last_seen_ms,
            url: e.url,
            read_at_ms: now_ms(),
        })
    }

    /// The run's metric from `since_ms` (at most 90 days back; 0: from a day before the run started).
    pub async fn metric_series(&self, run: &str, since_ms: i64) -> Result<MetricSeries> {
        check_id("run_id", run)?;
        let req = pc::GetMetricSeriesRequest {
            run_id: run.into(),
            since_ms,
        };
        let m: pc::MetricSeries = self.call("GetMetricSeries", &req).await?;
        Ok(MetricSeries {
            event: m.event,
            points: m
                .points
                .into_iter()
                .map(|p| MetricPoint {
                    date: p.date,
                    count: p.count,
                })
                .collect(),
            total: m.total,
            read_at_ms: now_ms(),
        })
    }
}
