//! Plane: create-if-absent work items keyed by external id, comments, state changes. API:
//! plane-openapi.v1.3.1.yaml, base `/api/v1/workspaces/{slug}`, `X-API-Key`.

use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{AgentSpec, AppLinks, Risk, SkillError, Skills};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::http::{AppHttp, DEFAULT_TIMEOUT, RetryPolicy, create_or_find};
use crate::{AGENT_VERSION, AgentError, args, found, require, skill, text_to_html};

/// The `external_source` of everything the factory creates.
pub const EXTERNAL_SOURCE: &str = "loams";
const MAX_ID: usize = 255;
const MAX_TITLE: usize = 255;
const MAX_TEXT: usize = 100_000;
const STATE_GROUPS: [&str; 5] = ["backlog", "unstarted", "started", "completed", "cancelled"];

#[derive(Clone)]
pub struct PlaneConfig {
    /// API host, e.g. `https://plane.example.com` (the client adds `/api/v1`).
    pub base_url: String,
    pub api_key: String,
    pub workspace_slug: String,
    pub project_id: String,
    /// Base of links shown to people; the API host when `None`.
    pub web_url: Option<String>,
    /// The project's identifier (`OPS` of `OPS-12`); read from the project once when `None`.
    pub project_identifier: Option<String>,
    pub timeout: Duration,
}

impl std::fmt::Debug for PlaneConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaneConfig")
            .field("base_url", &self.base_url)
            .field("workspace_slug", &self.workspace_slug)
            .field("project_id", &self.project_id)
            .finish_non_exhaustive()
    }
}

impl PlaneConfig {
    pub fn new(
        base_url: impl Into<String>,
        api_key: impl Into<String>,
        workspace_slug: impl Into<String>,
        project_id: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: api_key.into(),
            workspace_slug: workspace_slug.into(),
            project_id: project_id.into(),
            web_url: None,
            project_identifier: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// The fields of Plane's `Issue` we use.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WorkItem {
    pub id: String,
    pub name: String,
    pub sequence_id: Option<i64>,
    /// A state uuid (or an object when expanded).
    #[serde(default)]
    pub state: Value,
    #[serde(default)]
    pub external_id: Option<String>,
    #[serde(default)]
    pub external_source: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PlaneState {
    pub id: String,
    pub name: String,
    pub group: String,
    #[serde(default)]
    pub default: bool,
    #[serde(default)]
    pub sequence: Option<f64>,
}

#[derive(Deserialize)]
struct Paginated<T> {
    results: Vec<T>,
}

#[derive(Deserialize)]
struct Project {
    identifier: String,
}

#[derive(Deserialize)]
struct Conflict {
    id: String,
}

#[derive(Deserialize)]
struct Created {
    id: String,
}

/// The fields of Plane's `IssueComment` that tell whose comment it is.
#[derive(Deserialize)]
struct CommentRow {
    id: String,
    issue: String,
    #[serde(default)]
    comment_html: String,
    #[serde(default)]
    external_id: Option<String>,
    #[serde(default)]
    external_source: Option<String>,
}

impl CommentRow {
    fn is(&self, issue_id: &str, comment_html: &str, external_id: &str) -> bool {
        self.issue == issue_id
            && self.comment_html == comment_html
            && self.external_id.as_deref() == Some(external_id)
            && self.external_source.as_deref() == Some(EXTERNAL_SOURCE)
    }
}

/// What `create_work_item` found.
#[derive(Debug, Clone, PartialEq)]
pub enum CreateOutcome {
    Created(WorkItem),
    /// Plane's 409: a work item with this external id exists; its id.
    Exists(String),
}

pub struct PlaneClient {
    http: AppHttp,
    slug: String,
    project_id: String,
    web_url: String,
    identifier: OnceCell<String>,
}

impl PlaneClient {
    pub fn new(config: &PlaneConfig) -> Result<Self, AgentError> {
        if config.workspace_slug.is_empty() || config.project_id.is_empty() {
            return Err(AgentError::Config(
                "plane: workspace_slug and project_id are required".into(),
            ));
        }
        let http = AppHttp::new(
            "plane",
            &config.base_url,
            vec![("x-api-key", config.api_key.clone())],
            config.timeout,
            vec![config.api_key.clone()],
        )?;
        let web_url = config
            .web_url
            .clone()
            .unwrap_or_else(|| config.base_url.clone())
            .trim_end_matches('/')
            .to_string();
        Ok(Self {
            http,
            slug: config.workspace_slug.clone(),
            project_id: config.project_id.clone(),
            web_url,
            identifier: OnceCell::new_with(
                config.project_identifier.clone().filter(|i| !i.is_empty()),
            ),
        })
    }

    /// Replaces the default [`RetryPolicy`] (e.g. short backoffs in tests, or none).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.http.set_retry(retry)?;
        Ok(self)
    }

    /// `/api/v1/workspaces/{slug}/projects/{project_id}/<rest>` with Plane's trailing slash.
    fn project_url(&self, rest: &[&str]) -> reqwest::Url {
        let mut segments = vec![
            "api",
            "v1",
            "workspaces",
            &self.slug,
            "projects",
            &self.project_id,
        ];
        segments.extend_from_slice(rest);
        segments.push("");
        self.http.url(&segments)
    }

    /// `GET .../work-items/?external_id=&external_source=loams` (list_work_items_2).
    pub async fn find_by_external_id(
        &self,
        external_id: &str,
    ) -> Result<Option<WorkItem>, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.project_url(&["work-items"]))
            .query(&[
                ("external_id", external_id),
                ("external_source", EXTERNAL_SOURCE),
            ]);
        let page: Paginated<WorkItem> = self.http.json(rb).await?;
        // Check again: a server that ignored the filter must not make us adopt someone else's item.
        Ok(page.results.into_iter().find(|w| {
            w.external_id.as_deref() == Some(external_id)
                && w.external_source.as_deref() == Some(EXTERNAL_SOURCE)
        }))
    }

    /// `POST .../work-items/` (create_work_item_2) with our external id; a 409 names the existing item. Plane checks
    /// for the external id and then saves, not atomically, so the call is not repeated blindly after a lost answer:
    /// see [`PlaneAgent`]'s `create_issue`.
    pub async fn create_work_item(
        &self,
        name: &str,
        description_html: &str,
        external_id: &str,
    ) -> Result<CreateOutcome, AgentError> {
        let body = json!({
            "name": name,
            "description_html": description_html,
            "external_source": EXTERNAL_SOURCE,
            "external_id": external_id,
        });
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::POST, self.project_url(&["work-items"]))
                    .json(&body),
            )
            .await?;
        if reply.status == 409 {
            let c: Conflict = self.http.decode(&reply.body)?;
            return Ok(CreateOutcome::Exists(c.id));
        }
        let reply = self.http.ok(reply)?;
        Ok(CreateOutcome::Created(self.http.decode(&reply.body)?))
    }

    /// The work item a 409 named, provided it carries `external_id`: we adopt it as ours, so it must be.
    pub async fn adopt_work_item(
        &self,
        id: &str,
        external_id: &str,
    ) -> Result<WorkItem, AgentError> {
        let item = self.get_work_item(id).await?;
        if item.external_id.as_deref() != Some(external_id)
            || item.external_source.as_deref() != Some(EXTERNAL_SOURCE)
        {
            return Err(AgentError::Refused(format!(
                "plane: the work item {id} named as the holder of external id `{external_id}` does not carry it"
            )));
        }
        Ok(item)
    }

    /// `GET .../work-items/{id}/`.
    pub async fn get_work_item(&self, id: &str) -> Result<WorkItem, AgentError> {
        self.http
            .json(
                self.http
                    .request(Method::GET, self.project_url(&["work-items", id])),
            )
            .await
    }

    /// The project's identifier (the `PROJ` of `PROJ-12`), read once from `GET /projects/{id}/`.
    pub async fn project_identifier(&self) -> Result<&str, AgentError> {
        let id = self
            .identifier
            .get_or_try_init(|| async {
                let p: Project = self
                    .http
                    .json(self.http.request(Method::GET, self.project_url(&[])))
                    .await?;
                Ok::<_, AgentError>(p.identifier)
            })
            .await?;
        Ok(id.as_str())
    }

    /// Adds a comment (`POST .../work-items/{id}/comments/`, create_work_item_comment_2); returns its id. With an
    /// external id Plane refuses a second comment with it (409 naming the first), but checks and saves not
    /// atomically, so a lost answer is looked up instead of sending the comment again (see `http::create_or_find`),
    /// and a repeat returns the comment already made. Without one a lost answer is [`AgentError::Uncertain`].
    pub async fn add_comment(
        &self,
        issue_id: &str,
        comment_html: &str,
        external_id: Option<&str>,
    ) -> Result<String, AgentError> {
        match external_id {
            None => self.post_comment(issue_id, comment_html, None).await,
            Some(ext) => {
                create_or_find(
                    || self.post_comment(issue_id, comment_html, Some(ext)),
                    || self.find_comment(issue_id, comment_html, ext),
                )
                .await
            }
        }
    }

    async fn post_comment(
        &self,
        issue_id: &str,
        comment_html: &str,
        external_id: Option<&str>,
    ) -> Result<String, AgentError> {
        let mut body = json!({"comment_html": comment_html, "access": "INTERNAL"});
        if let Some(ext) = external_id {
            body["external_source"] = json!(EXTERNAL_SOURCE);
            body["external_id"] = json!(ext);
        }
        let rb = self
            .http
            .request(
                Method::POST,
                self.project_url(&["work-items", issue_id, "comments"]),
            )
            .json(&body);
        let reply = self.http.send(rb).await?;
        if reply.status == 409
            && let Some(ext) = external_id
        {
            let c: Conflict = self.http.decode(&reply.body)?;
            return self.adopt_comment(issue_id, comment_html, ext, &c.id).await;
        }
        let c: Created = self.http.decode(&self.http.ok(reply)?.body)?;
        Ok(c.id)
    }

    /// The comment a 409 named, provided it is this comment: Plane looks for the external id across the whole
    /// project, so the one it names may sit on another work item (or say something else), and returning it would
    /// report a comment as made that nobody made.
    async fn adopt_comment(
        &self,
        issue_id: &str,
        comment_html: &str,
        external_id: &str,
        id: &str,
    ) -> Result<String, AgentError> {
        // retrieve_work_item_comment_2 answers only for a comment on this work item.
        let reply = self
            .http
            .send(self.http.request(
                Method::GET,
                self.project_url(&["work-items", issue_id, "comments", id]),
            ))
            .await?;
        let on_this_item = reply.status != 404;
        let same = on_this_item && {
            let c: CommentRow = self.http.decode(&self.http.ok(reply)?.body)?;
            c.id == id && c.is(issue_id, comment_html, external_id)
        };
        if !same {
            let which = if on_this_item {
                "a different comment on this work item"
            } else {
                "a comment on another work item"
            };
            return Err(AgentError::Refused(format!(
                "plane: external id `{external_id}` is already used by {which} ({id}); the comment was not added"
            )));
        }
        Ok(id.to_string())
    }

    /// This comment among the work item's newest 100 (list_work_item_comments_2 has no external-id filter).
    async fn find_comment(
        &self,
        issue_id: &str,
        comment_html: &str,
        external_id: &str,
    ) -> Result<Option<String>, AgentError> {
        let rb = self
            .http
            .request(
                Method::GET,
                self.project_url(&["work-items", issue_id, "comments"]),
            )
            .query(&[("per_page", "100"), ("order_by", "-created_at")]);
        let page: Paginated<CommentRow> = self.http.json(rb).await?;
        Ok(page
            .results
            .into_iter()
            .find(|c| c.is(issue_id, comment_html, external_id))
            .map(|c| c.id))
    }

    /// `GET .../states/` (list_states).
    pub async fn list_states(&self) -> Result<Vec<PlaneState>, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.project_url(&["states"]))
            .query(&[("per_page", "100")]);
        let page: Paginated<PlaneState> = self.http.json(rb).await?;
        Ok(page.results)
    }

    /// `PATCH .../work-items/{id}/` with `{"state": uuid}` (update_work_item_2); setting an absolute value is
    /// safe to repeat.
    pub async fn set_state(&self, issue_id: &str, state_id: &str) -> Result<WorkItem, AgentError> {
        let rb = self
            .http
            .request(Method::PATCH, self.project_url(&["work-items", issue_id]))
            .json(&json!({"state": state_id}));
        self.http.json_idempotent(rb).await
    }

    /// A work item's web page, `{key}` standing for its key (`PROJ-12`).
    fn issue_page(&self) -> String {
        format!("{}/{}/browse/{{key}}/", self.web_url, self.slug)
    }

    /// The work items' web links, as [`PlaneClient::key_and_url`] makes them.
    fn links(&self) -> AppLinks {
        AppLinks {
            web_url: self.web_url.clone(),
            deep_link_templates: [("issue".to_string(), self.issue_page())].into(),
        }
    }

    /// `PROJ-12` and its web link (`/{slug}/browse/PROJ-12/`).
    pub async fn key_and_url(&self, item: &WorkItem) -> Result<(String, String), AgentError> {
        let ident = self.project_identifier().await?;
        let seq = item
            .sequence_id
            .ok_or_else(|| self.http.bad("work item without sequence_id"))?;
        let key = format!("{ident}-{seq}");
        let url = self.issue_page().replace("{key}", &key);
        Ok((key, url))
    }
}

/// The state to move to for a group: the group's default state, else its first by sequence.
fn pick_state<'a>(states: &'a [PlaneState], group: &str) -> Option<&'a PlaneState> {
    let mut in_group: Vec<&PlaneState> = states.iter().filter(|s| s.group == group).collect();
    in_group.sort_by(|a, b| {
        b.default.cmp(&a.default).then(
            a.sequence
                .unwrap_or(f64::MAX)
                .total_cmp(&b.sequence.unwrap_or(f64::MAX)),
        )
    });
    in_group.first().copied()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateArgs {
    external_id: String,
    title: String,
    #[serde(default)]
    description: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommentArgs {
    issue_id: String,
    body: String,
    /// Makes the comment create-once: a repeat with the same id returns the first comment.
    #[serde(default)]
    external_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IssueArgs {
    issue_id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StateArgs {
    issue_id: String,
    state: String,
}

/// The issues agent: one work item per run, its comments and its state.
pub struct PlaneAgent {
    client: PlaneClient,
}

impl PlaneAgent {
    pub fn new(config: &PlaneConfig) -> Result<Self, AgentError> {
        Ok(Self {
            client: PlaneClient::new(config)?,
        })
    }

    /// Replaces the default [`RetryPolicy`] of the agent's app client.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.client = self.client.with_retry(retry)?;
        Ok(self)
    }

    async fn create_issue(&self, a: CreateArgs) -> Result<Value, AgentError> {
        require("external_id", &a.external_id, MAX_ID)?;
        require("title", &a.title, MAX_TITLE)?;
        if a.description.len() > MAX_TEXT {
            return Err(AgentError::InvalidArgs(format!(
                "`description` is longer than {MAX_TEXT} bytes"
            )));
        }
        // Look first so a retry never creates a second item; the 409 path covers a race with another worker, and
        // a lost answer is looked up, never sent again within the call.
        let ext = a.external_id.as_str();
        let description = text_to_html(&a.description);
        let (item, created) = match self.client.find_by_external_id(ext).await? {
            Some(item) => (item, false),
            None => {
                create_or_find(
                    || async {
                        match self
                            .client
                            .create_work_item(&a.title, &description, ext)
                            .await?
                        {
                            CreateOutcome::Created(item) => Ok((item, true)),
                            CreateOutcome::Exists(id) => {
                                Ok((self.client.adopt_work_item(&id, ext).await?, false))
                            }
                        }
                    },
                    // Found after our lost create: almost surely made by it.
                    || async {
                        Ok(self
                            .client
                            .find_by_external_id(ext)
                            .await?
                            .map(|i| (i, true)))
                    },
                )
                .await?
            }
        };
        let (key, url) = self.client.key_and_url(&item).await?;
        Ok(json!({"id": item.id, "key": key, "url": url, "created": created}))
    }

    /// A work item as its panel shows it: key, title, its state's name and group, and link.
    async fn issue(&self, issue_id: &str) -> Result<Value, AgentError> {
        let item = self.client.get_work_item(issue_id).await?;
        // The state comes as a uuid (or, expanded, an object with one); its name and group are the project's.
        let state_id = match &item.state {
            Value::String(id) => id.clone(),
            other => other["id"].as_str().unwrap_or_default().to_string(),
        };
        let states = self.client.list_states().await?;
        let state = states.iter().find(|s| s.id == state_id);
        let (key, url) = self.client.key_and_url(&item).await?;
        Ok(json!({
            "id": item.id,
            "key": key,
            "title": item.name,
            "state": state.map(|s| s.name.as_str()).unwrap_or_default(),
            "state_group": state.map(|s| s.group.as_str()).unwrap_or_default(),
            "external_id": item.external_id.unwrap_or_default(),
            "url": url,
        }))
    }

    async fn run(&self, skill: &str, value: Value) -> Result<Value, AgentError> {
        match skill {
            "create_issue" => self.create_issue(args(skill, value)?).await,
            "get_issue" => {
                let a: IssueArgs = args(skill, value)?;
                require("issue_id", &a.issue_id, MAX_ID)?;
                found(self.issue(&a.issue_id).await)
            }
            "comment" => {
                let a: CommentArgs = args(skill, value)?;
                require("issue_id", &a.issue_id, MAX_ID)?;
                require("body", &a.body, MAX_TEXT)?;
                if let Some(ext) = &a.external_id {
                    require("external_id", ext, MAX_ID)?;
                }
                let id = self
                    .client
                    .add_comment(
                        &a.issue_id,
                        &text_to_html(&a.body),
                        a.external_id.as_deref(),
                    )
                    .await?;
                Ok(json!({"id": id}))
            }
            "set_state" => {
                let a: StateArgs = args(skill, value)?;
                require("issue_id", &a.issue_id, MAX_ID)?;
                if !STATE_GROUPS.contains(&a.state.as_str()) {
                    return Err(AgentError::InvalidArgs(format!(
                        "`state` must be one of {}",
                        STATE_GROUPS.join(", ")
                    )));
                }
                let states = self.client.list_states().await?;
                let target = pick_state(&states, &a.state).ok_or_else(|| {
                    AgentError::Refused(format!(
                        "plane: the project has no state in group `{}`",
                        a.state
                    ))
                })?;
                self.client.set_state(&a.issue_id, &target.id).await?;
                Ok(json!({"state": a.state, "state_id": target.id, "state_name": target.name}))
            }
            other => Err(AgentError::UnknownSkill(other.into())),
        }
    }
}

#[async_trait]
impl Skills for PlaneAgent {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "plane".into(),
            description: "Issues agent for Plane: creates the run's work item once (keyed by external id), reads it, \
                          comments on it and moves it between state groups."
                .into(),
            version: AGENT_VERSION.into(),
            app: Some(self.client.links()),
            skills: vec![
                skill(
                    "create_issue",
                    "Create issue",
                    "Create a work item for an external id unless one exists; returns its id, key and link.",
                    Risk::Write,
                    &[r#"{"external_id":"factory:r-0123456789abcdef","title":"checkout 500s","description":"TypeError in checkout"}"#],
                ),
                skill(
                    "get_issue",
                    "Get issue",
                    "Read a work item for its panel: key, title, state name and group, external id and link; \
                     {\"found\": false} if there is none.",
                    Risk::Read,
                    &[r#"{"issue_id":"5f0c..."}"#],
                ),
                skill(
                    "comment",
                    "Comment",
                    "Add a comment to a work item; with an external id, at most once per id.",
                    Risk::Write,
                    &[r#"{"issue_id":"5f0c...","body":"Fix proposed in PR #12","external_id":"factory:r-0123456789abcdef:pr"}"#],
                ),
                skill(
                    "set_state",
                    "Set state",
                    "Move a work item to the default state of a group: started, completed or cancelled.",
                    Risk::Write,
                    &[r#"{"issue_id":"5f0c...","state":"completed"}"#],
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

    fn st(id: &str, group: &str, default: bool, sequence: f64) -> PlaneState {
        PlaneState {
            id: id.into(),
            name: id.into(),
            group: group.into(),
            default,
            sequence: Some(sequence),
        }
    }

    #[test]
    fn picks_default_then_lowest_sequence() {
        let states = vec![
            st("a", "started", false, 5.0),
            st("b", "started", false, 1.0),
            st("c", "completed", false, 9.0),
        ];
        assert_eq!(
            pick_state(&states, "started").map(|s| s.id.as_str()),
            Some("b")
        );
        let mut with_default = states.clone();
        with_default.push(st("d", "started", true, 50.0));
        assert_eq!(
            pick_state(&with_default, "started").map(|s| s.id.as_str()),
            Some("d")
        );
        assert!(pick_state(&states, "cancelled").is_none());
    }
}
