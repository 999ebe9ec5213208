//! Forgejo: files, branches, commits, pull requests, CI status, merge and revert. API: forgejo-swagger.v1.json
//! (Swagger 2.0, base `/api/v1`), `Authorization: token <PAT>`.
//!
//! Every write is safe to repeat: branches are created if absent, unchanged files are not recommitted, an open PR
//! for the branch is reused if this account opened it, an already-merged PR answers like a fresh merge.
//!
//! Commits are pinned: a work branch is written only where the caller says it stands (the base head for a first
//! commit, the caller's previous commit after that), so a branch prepared or pushed to by someone else is refused
//! instead of being merged along with the patch.

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use loams_a2a::{AgentSpec, AppLinks, Risk, SkillError, Skills};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use crate::http::{AppHttp, DEFAULT_TIMEOUT, RetryPolicy, create_or_find};
use crate::{AGENT_VERSION, AgentError, args, found, require, skill};

const MAX_FILES: usize = 100;
const MAX_PATH: usize = 1024;
const MAX_FILE_BYTES: usize = 1024 * 1024;
const MAX_BRANCH: usize = 200;
const MAX_TITLE: usize = 255;
const MAX_BODY: usize = 65_536;
const MAX_LABELS: usize = 10;
/// CI log handed to the model for the next attempt; longer logs are cut at the end.
const MAX_LOG_BYTES: usize = 64 * 1024;
/// Checks listed per commit by `ci_status`; a commit has a handful, the cap keeps a runaway CI from filling a task.
const MAX_CHECKS: usize = 100;
const DRAFT_PREFIX: &str = "WIP: ";
/// Colour of labels we have to create (Forgejo requires one).
const LABEL_COLOR: &str = "#e4e669";

#[derive(Clone)]
pub struct ForgejoConfig {
    /// Server URL, e.g. `https://code.example.com` (the client adds `/api/v1`).
    pub base_url: String,
    pub token: String,
    pub owner: String,
    pub repo: String,
    /// The protected branch fixes are merged into; never written to directly.
    pub base_branch: String,
    pub timeout: Duration,
}

impl std::fmt::Debug for ForgejoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForgejoConfig")
            .field("base_url", &self.base_url)
            .field("owner", &self.owner)
            .field("repo", &self.repo)
            .field("base_branch", &self.base_branch)
            .finish_non_exhaustive()
    }
}

impl ForgejoConfig {
    pub fn new(
        base_url: impl Into<String>,
        token: impl Into<String>,
        owner: impl Into<String>,
        repo: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            token: token.into(),
            owner: owner.into(),
            repo: repo.into(),
            base_branch: "main".into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// A file at a ref: its blob sha (needed to update or delete it) and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    pub sha: String,
    pub content: Vec<u8>,
}

/// A desired file state on a branch; `None` deletes the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChange {
    pub path: String,
    pub content: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BranchRef {
    #[serde(rename = "ref")]
    pub name: String,
    pub sha: String,
}

/// The fields of Forgejo's `PullRequest` we use.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PullRequest {
    pub number: u64,
    pub state: String,
    #[serde(default)]
    pub merged: bool,
    #[serde(default)]
    pub merge_commit_sha: Option<String>,
    #[serde(default)]
    pub html_url: String,
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub body: Option<String>,
    pub head: BranchRef,
    pub base: BranchRef,
    /// Who opened it (Forgejo's `User`); an answer without it counts as someone else's.
    #[serde(default)]
    pub user: Option<User>,
}

/// The fields of Forgejo's `User` we use.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct User {
    pub login: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CommitStatus {
    /// Forgejo's `CommitStatus` carries the state in `status`.
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub context: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub target_url: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CombinedStatus {
    #[serde(default)]
    pub state: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub statuses: Vec<CommitStatus>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize)]
struct Contents {
    #[serde(rename = "type")]
    kind: String,
    sha: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    encoding: Option<String>,
}

#[derive(Deserialize)]
struct Branch {
    commit: BranchCommit,
}

#[derive(Deserialize)]
struct BranchCommit {
    id: String,
}

#[derive(Deserialize)]
struct FilesResponse {
    commit: ShaOnly,
}

#[derive(Deserialize)]
struct ShaOnly {
    sha: String,
}

#[derive(Deserialize)]
struct Commit {
    #[serde(default, deserialize_with = "null_as_empty")]
    parents: Vec<ShaOnly>,
}

#[derive(Deserialize)]
struct Label {
    id: i64,
    name: String,
}

pub struct ForgejoClient {
    http: AppHttp,
    owner: String,
    repo: String,
    /// The token's account, read once: it does not change while the client lives.
    login: OnceCell<String>,
}

impl ForgejoClient {
    /// The repository's pull request and commit pages.
    fn links(&self) -> AppLinks {
        let repo = format!("/{}/{}", self.owner, self.repo);
        crate::app_links(
            self.http.base(),
            &[
                ("pull_request", format!("{repo}/pulls/{{number}}")),
                ("commit", format!("{repo}/commit/{{sha}}")),
            ],
        )
    }

    pub fn new(config: &ForgejoConfig) -> Result<Self, AgentError> {
        if config.owner.is_empty() || config.repo.is_empty() {
            return Err(AgentError::Config(
                "forgejo: owner and repo are required".into(),
            ));
        }
        let http = AppHttp::new(
            "forgejo",
            &config.base_url,
            vec![("authorization", format!("token {}", config.token))],
            config.timeout,
            vec![config.token.clone()],
        )?;
        Ok(Self {
            http,
            owner: config.owner.clone(),
            repo: config.repo.clone(),
            login: OnceCell::new(),
        })
    }

    /// The login of the account the token belongs to (`GET /user`, userGetCurrent).
    pub async fn login(&self) -> Result<&str, AgentError> {
        let login = self
            .login
            .get_or_try_init(|| async {
                let me: User = self
                    .http
                    .json(
                        self.http
                            .request(Method::GET, self.http.url(&["api", "v1", "user"])),
                    )
                    .await?;
                Ok::<_, AgentError>(me.login)
            })
            .await?;
        Ok(login.as_str())
    }

    /// Replaces the default [`RetryPolicy`] (e.g. short backoffs in tests, or none).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.http.set_retry(retry)?;
        Ok(self)
    }

    /// `/api/v1/repos/{owner}/{repo}/` + `rest`; entries containing `/` (file paths, branch names) become several
    /// segments, as Forgejo's wildcard routes expect.
    fn repo_url(&self, rest: &[&str]) -> reqwest::Url {
        let mut segments = vec!["api", "v1", "repos", &self.owner, &self.repo];
        for part in rest {
            segments.extend(part.split('/'));
        }
        self.http.url(&segments)
    }

    /// `GET /contents/{path}?ref=`; `None` if the file does not exist at that ref.
    pub async fn get_file(
        &self,
        path: &str,
        git_ref: &str,
    ) -> Result<Option<RepoFile>, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.repo_url(&["contents", path]))
            .query(&[("ref", git_ref)]);
        let reply = self.http.send(rb).await?;
        if reply.status == 404 {
            return Ok(None);
        }
        let reply = self.http.ok(reply)?;
        // A directory answers with an array.
        let value: Value = self.http.decode(&reply.body)?;
        if value.is_array() {
            return Err(AgentError::Refused(format!(
                "forgejo: `{path}` is a directory"
            )));
        }
        let c: Contents =
            serde_json::from_value(value).map_err(|e| self.http.bad(format!("contents: {e}")))?;
        if c.kind != "file" {
            return Err(AgentError::Refused(format!(
                "forgejo: `{path}` is a {}, not a file",
                c.kind
            )));
        }
        if c.encoding.as_deref().is_some_and(|e| e != "base64") {
            return Err(self
                .http
                .bad(format!("contents of `{path}`: unexpected encoding")));
        }
        let raw: String = c
            .content
            .unwrap_or_default()
            .chars()
            .filter(|ch| !ch.is_ascii_whitespace())
            .collect();
        let content = base64::engine::general_purpose::STANDARD
            .decode(raw)
            .map_err(|e| self.http.bad(format!("contents of `{path}`: {e}")))?;
        Ok(Some(RepoFile {
            sha: c.sha,
            content,
        }))
    }

    /// `POST /branches` from `from`; `false` if the branch already existed (409). The 409 makes a repeat
    /// harmless, so the call is retried like an idempotent one.
    pub async fn create_branch(&self, name: &str, from: &str) -> Result<bool, AgentError> {
        // `old_ref_name` is current; `old_branch_name` is the deprecated field older servers read.
        let body = json!({"new_branch_name": name, "old_ref_name": from, "old_branch_name": from});
        let reply = self
            .http
            .send_idempotent(
                self.http
                    .request(Method::POST, self.repo_url(&["branches"]))
                    .json(&body),
            )
            .await?;
        if reply.status == 409 {
            return Ok(false);
        }
        self.http.ok(reply)?;
        Ok(true)
    }

    /// `GET /branches/{branch}`: the head commit sha.
    pub async fn branch_head(&self, branch: &str) -> Result<String, AgentError> {
        let b: Branch = self
            .http
            .json(
                self.http
                    .request(Method::GET, self.repo_url(&["branches", branch])),
            )
            .await?;
        Ok(b.commit.id)
    }

    /// Like [`Self::branch_head`], `None` if the branch does not exist.
    pub async fn find_branch_head(&self, branch: &str) -> Result<Option<String>, AgentError> {
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::GET, self.repo_url(&["branches", branch])),
            )
            .await?;
        if reply.status == 404 {
            return Ok(None);
        }
        let reply = self.http.ok(reply)?;
        let b: Branch = self.http.decode(&reply.body)?;
        Ok(Some(b.commit.id))
    }

    /// `DELETE /branches/{branch}`; a branch already gone is fine.
    pub async fn delete_branch(&self, branch: &str) -> Result<(), AgentError> {
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::DELETE, self.repo_url(&["branches", branch])),
            )
            .await?;
        if reply.status == 404 {
            return Ok(());
        }
        self.http.ok(reply).map(drop)
    }

    /// The repoChangeFiles operations that bring the files at `at` (a branch or commit) to `changes`; files already
    /// in that state are left out.
    async fn pending_ops(
        &self,
        at: &str,
        changes: &[FileChange],
    ) -> Result<Vec<Value>, AgentError> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut ops = Vec::new();
        for change in changes {
            let current = self.get_file(&change.path, at).await?;
            match (&change.content, current) {
                (Some(want), None) => ops.push(json!({"operation": "create", "path": change.path, "content": b64.encode(want)})),
                (Some(want), Some(have)) if *want != have.content => ops.push(
                    json!({"operation": "update", "path": change.path, "content": b64.encode(want), "sha": have.sha}),
                ),
                (None, Some(have)) => ops.push(json!({"operation": "delete", "path": change.path, "sha": have.sha})),
                (Some(_), Some(_)) | (None, None) => {}
            }
        }
        Ok(ops)
    }

    /// Brings `branch`, which stands at commit `head`, to the given file states in one commit (`POST /contents`,
    /// repoChangeFiles). The files are read at `head`, not at the branch name, so a push in between cannot make a
    /// foreign commit look like ours; if nothing changes no commit is made and `head` is returned.
    pub async fn apply_changes(
        &self,
        branch: &str,
        head: &str,
        message: &str,
        changes: &[FileChange],
    ) -> Result<String, AgentError> {
        let ops = self.pending_ops(head, changes).await?;
        if ops.is_empty() {
            return Ok(head.to_string());
        }
        let body = json!({"branch": branch, "message": message, "files": ops});
        let rb = self
            .http
            .request(Method::POST, self.repo_url(&["contents"]))
            .json(&body);
        let r: FilesResponse = self.http.json(rb).await?;
        Ok(r.commit.sha)
    }

    /// The open PR from `head` into `base`, if any: `GET /pulls/{base}/{head}` answers the newest PR between the
    /// two branches whatever its state (404 when there is none), so one request finds it however many PRs the
    /// repository has.
    pub async fn open_pr_for(
        &self,
        base: &str,
        head: &str,
    ) -> Result<Option<PullRequest>, AgentError> {
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::GET, self.repo_url(&["pulls", base, head])),
            )
            .await?;
        if reply.status == 404 {
            return Ok(None);
        }
        let pr: PullRequest = self.http.decode(&self.http.ok(reply)?.body)?;
        Ok(
            Some(pr)
                .filter(|pr| pr.state == "open" && pr.head.name == head && pr.base.name == base),
        )
    }

    /// `POST /pulls`; `None` on 409 (an open PR for these branches exists). Forgejo checks for that PR and then
    /// creates one, not atomically, so the call is not repeated blindly (see `http::create_or_find`).
    pub async fn create_pr(
        &self,
        head: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<Option<PullRequest>, AgentError> {
        let req = json!({"head": head, "base": base, "title": title, "body": body});
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::POST, self.repo_url(&["pulls"]))
                    .json(&req),
            )
            .await?;
        if reply.status == 409 {
            return Ok(None);
        }
        let reply = self.http.ok(reply)?;
        Ok(Some(self.http.decode(&reply.body)?))
    }

    pub async fn get_pr(&self, number: u64) -> Result<PullRequest, AgentError> {
        let n = number.to_string();
        self.http
            .json(
                self.http
                    .request(Method::GET, self.repo_url(&["pulls", &n])),
            )
            .await
    }

    /// `PATCH /pulls/{n}` (the spec answers 201); the patches we send set absolute values, safe to repeat.
    pub async fn edit_pr(&self, number: u64, patch: &Value) -> Result<PullRequest, AgentError> {
        let n = number.to_string();
        self.http
            .json_idempotent(
                self.http
                    .request(Method::PATCH, self.repo_url(&["pulls", &n]))
                    .json(patch),
            )
            .await
    }

    /// `GET /labels`: the repository's labels.
    async fn labels(&self) -> Result<Vec<Label>, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.repo_url(&["labels"]))
            .query(&[("limit", "50")]);
        self.http.json(rb).await
    }

    /// Label ids for `names`, creating the missing labels.
    pub async fn ensure_labels(&self, names: &[String]) -> Result<Vec<i64>, AgentError> {
        let existing = self.labels().await?;
        let mut ids = Vec::new();
        for name in names {
            if let Some(l) = existing.iter().find(|l| &l.name == name) {
                ids.push(l.id);
                continue;
            }
            let rb = self
                .http
                .request(Method::POST, self.repo_url(&["labels"]))
                .json(&json!({"name": name, "color": LABEL_COLOR}));
            // Forgejo does not refuse a second label of the same name, so a lost answer is looked up, not resent.
            let created = create_or_find(
                || self.http.json::<Label>(rb),
                || async { Ok(self.labels().await?.into_iter().find(|l| &l.name == name)) },
            )
            .await?;
            ids.push(created.id);
        }
        Ok(ids)
    }

    /// `POST /issues/{n}/labels` (adds to the set; existing labels stay, so a repeat changes nothing).
    pub async fn add_labels(&self, number: u64, ids: &[i64]) -> Result<(), AgentError> {
        let n = number.to_string();
        let rb = self
            .http
            .request(Method::POST, self.repo_url(&["issues", &n, "labels"]))
            .json(&json!({"labels": ids}));
        self.http.ok(self.http.send_idempotent(rb).await?).map(drop)
    }

    /// `GET /commits/{sha}/status` (combined).
    pub async fn combined_status(&self, sha: &str) -> Result<CombinedStatus, AgentError> {
        self.http
            .json(
                self.http
                    .request(Method::GET, self.repo_url(&["commits", sha, "status"])),
            )
            .await
    }

    /// `POST /pulls/{n}/merge` with `Do: merge`, pinned to `head_sha`. Returns the raw reply so the caller can tell
    /// "not mergeable" (405) and conflicts (409) from success. Pinned, a repeat can only merge that same head once
    /// (a merged PR refuses), and the caller reads the PR afterwards, so the call is retried like an idempotent one.
    async fn merge_request(
        &self,
        number: u64,
        head_sha: &str,
    ) -> Result<crate::http::Reply, AgentError> {
        let n = number.to_string();
        let body = json!({"Do": "merge", "head_commit_id": head_sha});
        self.http
            .send_idempotent(
                self.http
                    .request(Method::POST, self.repo_url(&["pulls", &n, "merge"]))
                    .json(&body),
            )
            .await
    }

    /// `GET /git/commits/{sha}.diff`.
    pub async fn commit_diff(&self, sha: &str) -> Result<String, AgentError> {
        let file = format!("{sha}.diff");
        let reply = self
            .http
            .send(
                self.http
                    .request(Method::GET, self.repo_url(&["git", "commits", &file])),
            )
            .await?;
        let reply = self.http.ok(reply)?;
        String::from_utf8(reply.body).map_err(|_| self.http.bad("diff is not UTF-8"))
    }

    /// `GET /git/commits/{sha}`: the parents' shas, first parent first.
    pub async fn commit_parents(&self, sha: &str) -> Result<Vec<String>, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.repo_url(&["git", "commits", sha]))
            .query(&[("stat", "false")]);
        let c: Commit = self.http.json(rb).await?;
        Ok(c.parents.into_iter().map(|p| p.sha).collect())
    }
}

/// The paths a unified git diff touches (old and new names of renames), read from the file headers only so hunk
/// lines that happen to look like headers are ignored.
fn diff_paths(diff: &str) -> Result<BTreeSet<String>, AgentError> {
    let mut paths = BTreeSet::new();
    let mut in_header = false;
    for line in diff.lines() {
        if let Some(rest) = line.strip_prefix("diff --git ") {
            in_header = true;
            if rest.starts_with('"') {
                return Err(AgentError::Refused(
                    "forgejo: revert of quoted (unusual) file names is not supported".into(),
                ));
            }
            // `a/P b/P`: recoverable when both names are equal (binary files have no ---/+++ lines).
            if let Some(p) = rest.strip_prefix("a/") {
                let half = p.len().saturating_sub(2) / 2;
                if p.len() >= 3
                    && p.is_char_boundary(half)
                    && p[half..].starts_with(" b/")
                    && p[..half] == p[half + 3..]
                {
                    paths.insert(p[..half].to_string());
                }
            }
            continue;
        }
        if !in_header {
            continue;
        }
        if line.starts_with("@@") {
            in_header = false;
            continue;
        }
        let name = line
            .strip_prefix("--- a/")
            .or_else(|| line.strip_prefix("+++ b/"))
            .or_else(|| line.strip_prefix("rename from "))
            .or_else(|| line.strip_prefix("rename to "))
            .or_else(|| line.strip_prefix("copy to "));
        if let Some(name) = name {
            if name.starts_with('"') {
                return Err(AgentError::Refused(
                    "forgejo: revert of quoted (unusual) file names is not supported".into(),
                ));
            }
            paths.insert(name.to_string());
        }
    }
    Ok(paths)
}

fn check_sha(field: &str, sha: &str) -> Result<(), AgentError> {
    if (4..=64).contains(&sha.len()) && sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(AgentError::InvalidArgs(format!(
            "`{field}` is not a commit sha"
        )))
    }
}

fn check_path(path: &str) -> Result<(), AgentError> {
    require("path", path, MAX_PATH)?;
    if path.starts_with('/')
        || path
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(AgentError::InvalidArgs(format!(
            "`{path}` is not a clean relative path"
        )));
    }
    Ok(())
}

fn check_branch(field: &str, name: &str) -> Result<(), AgentError> {
    require(field, name, MAX_BRANCH)?;
    // git check-ref-format, the parts that matter for a URL path and for safety.
    let bad = name.starts_with('/')
        || name.ends_with('/')
        || name.ends_with(".lock")
        || name.contains("..")
        || name.contains("//")
        || name.contains("@{")
        || name
            .bytes()
            .any(|b| b.is_ascii_control() || b" ~^:?*[\\".contains(&b));
    if bad {
        Err(AgentError::InvalidArgs(format!(
            "`{field}` is not a valid branch name"
        )))
    } else {
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    paths: Vec<String>,
    #[serde(default, rename = "ref")]
    git_ref: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileArg {
    path: String,
    content: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommitArgs {
    branch: String,
    base: String,
    /// Where the branch must stand: the caller's previous commit; absent (or null) for the first commit.
    #[serde(default)]
    expected_head: Option<String>,
    files: Vec<FileArg>,
    message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrArgs {
    branch: String,
    base: String,
    title: String,
    #[serde(default)]
    body: String,
    #[serde(default)]
    draft: bool,
    #[serde(default)]
    labels: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CiArgs {
    sha: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MergeArgs {
    number: u64,
    head_sha: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrArgsByNumber {
    number: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloseArgs {
    number: u64,
    branch: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RevertArgs {
    merge_sha: String,
    branch: String,
    base: String,
    title: String,
}

/// The code agent: reads files, commits patches on factory branches, opens/merges/closes PRs, reads CI, reverts.
pub struct ForgejoAgent {
    client: ForgejoClient,
    base_branch: String,
}

impl ForgejoAgent {
    pub fn new(config: &ForgejoConfig) -> Result<Self, AgentError> {
        check_branch("base_branch", &config.base_branch)
            .map_err(|e| AgentError::Config(e.to_string()))?;
        Ok(Self {
            client: ForgejoClient::new(config)?,
            base_branch: config.base_branch.clone(),
        })
    }

    /// Replaces the default [`RetryPolicy`] of the agent's app client.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.client = self.client.with_retry(retry)?;
        Ok(self)
    }

    /// Writes only ever go to a work branch, never to the protected base.
    fn check_work_branch(&self, branch: &str, base: &str) -> Result<(), AgentError> {
        check_branch("branch", branch)?;
        check_branch("base", base)?;
        if branch == base || branch == self.base_branch {
            return Err(AgentError::Refused(format!(
                "forgejo: refusing to write to the base branch `{branch}`"
            )));
        }
        Ok(())
    }

    /// Commits `changes` on `branch`, which must stand at `expected_head` (the caller's previous commit) or, when
    /// that is absent, not exist or stand at the head of `base`. Anything else is refused with nothing committed:
    /// a branch name is predictable, so a branch prepared by someone else (or pushed to since the caller's last
    /// commit) would otherwise carry their commits into the merge. A retry whose earlier answer was lost finds its
    /// own commit on the branch and gets it back.
    async fn commit(
        &self,
        branch: &str,
        base: &str,
        expected_head: Option<&str>,
        message: &str,
        changes: &[FileChange],
    ) -> Result<String, AgentError> {
        let parent = match expected_head {
            Some(sha) => sha.to_ascii_lowercase(),
            None => self.client.branch_head(base).await?.to_ascii_lowercase(),
        };
        let head = match self.client.find_branch_head(branch).await? {
            Some(head) => head,
            None if expected_head.is_some() => {
                return Err(AgentError::Refused(format!(
                    "forgejo: branch `{branch}` no longer exists; it was expected at {parent}"
                )));
            }
            // Created at the sha read above rather than at `base` by name: a base moving meanwhile changes nothing.
            None if self.client.create_branch(branch, &parent).await? => parent.clone(),
            // 409: created concurrently; whoever did must have put it where we expect.
            None => self.client.branch_head(branch).await?,
        };
        if !head.eq_ignore_ascii_case(&parent) {
            if self.is_own_commit(&head, &parent, changes).await? {
                return Ok(head);
            }
            let expected = if expected_head.is_some() {
                "the previous commit"
            } else {
                "the head of the base branch"
            };
            return Err(AgentError::Refused(format!(
                "forgejo: branch `{branch}` is at {head}, not at {parent} ({expected}); refusing to commit on top of \
                 commits this caller did not make"
            )));
        }
        let sha = match self
            .client
            .apply_changes(branch, &parent, message, changes)
            .await
        {
            Ok(sha) => sha,
            // The answer was lost, so the commit may have been made: it was if the branch now holds exactly it.
            Err(e @ AgentError::Uncertain { .. }) => {
                return match self.client.find_branch_head(branch).await? {
                    Some(head)
                        if !head.eq_ignore_ascii_case(&parent)
                            && self.is_own_commit(&head, &parent, changes).await? =>
                    {
                        Ok(head)
                    }
                    _ => Err(e),
                };
            }
            Err(e) => return Err(e),
        };
        // A push between the check above and the commit ends up under our commit.
        if !sha.eq_ignore_ascii_case(&parent) {
            let parents = self.client.commit_parents(&sha).await?;
            if !matches!(parents.as_slice(), [p] if p.eq_ignore_ascii_case(&parent)) {
                return Err(AgentError::Refused(format!(
                    "forgejo: branch `{branch}` moved while committing: {sha} is not on top of {parent}"
                )));
            }
        }
        Ok(sha)
    }

    /// Whether `head` is exactly the commit `changes` make on top of `parent`: its only parent is `parent`, it
    /// touches no other file, and every changed file is in the wanted state.
    async fn is_own_commit(
        &self,
        head: &str,
        parent: &str,
        changes: &[FileChange],
    ) -> Result<bool, AgentError> {
        let parents = self.client.commit_parents(head).await?;
        if !matches!(parents.as_slice(), [p] if p.eq_ignore_ascii_case(parent)) {
            return Ok(false);
        }
        let ours: BTreeSet<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        let touched = diff_paths(&self.client.commit_diff(head).await?)?;
        if touched.iter().any(|p| !ours.contains(p.as_str())) {
            return Ok(false);
        }
        Ok(self.client.pending_ops(head, changes).await?.is_empty())
    }

    async fn open_pr(&self, a: &PrArgs) -> Result<Value, AgentError> {
        self.check_work_branch(&a.branch, &a.base)?;
        require("title", &a.title, MAX_TITLE)?;
        if a.body.len() > MAX_BODY || a.labels.len() > MAX_LABELS {
            return Err(AgentError::InvalidArgs(format!(
                "body over {MAX_BODY} bytes or more than {MAX_LABELS} labels"
            )));
        }
        for l in &a.labels {
            require("labels[]", l, 100)?;
        }
        let title = if a.draft && !a.title.starts_with(DRAFT_PREFIX) {
            format!("{DRAFT_PREFIX}{}", a.title)
        } else {
            a.title.clone()
        };
        let find = || self.client.open_pr_for(&a.base, &a.branch);
        let pr = match find().await? {
            Some(pr) => pr,
            None => {
                create_or_find(
                    || async {
                        match self
                            .client
                            .create_pr(&a.branch, &a.base, &title, &a.body)
                            .await?
                        {
                            Some(pr) => Ok(pr),
                            // 409: created concurrently (or by an earlier attempt whose answer was lost).
                            None => find().await?.ok_or_else(|| {
                                AgentError::Refused(
                                    "forgejo: PR exists (409) but cannot be found".into(),
                                )
                            }),
                        }
                    },
                    find,
                )
                .await?
            }
        };
        // An open PR for the branch is adopted only if this account opened it: one a person opened (or pointed at
        // our branch) is theirs, and editing, labelling or later merging it would act on their behalf.
        let me = self.client.login().await?;
        let author = pr.user.as_ref().map_or("", |u| u.login.as_str());
        if author != me {
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} for `{}` was opened by `{author}`, not by this agent's account `{me}`; not adopting \
                 it",
                pr.number, a.branch
            )));
        }
        // Open-or-update: bring title and body to what was asked.
        let pr = if pr.title != title || pr.body.as_deref().unwrap_or("") != a.body {
            self.client
                .edit_pr(pr.number, &json!({"title": title, "body": a.body}))
                .await?
        } else {
            pr
        };
        // The PR was looked up by base, but it can be retargeted at any time; the caller binds CI, review and merge to
        // this answer, so it must be about the base that was asked for.
        if pr.base.name != a.base || pr.head.name != a.branch {
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} is `{}` into `{}`, not `{}` into `{}`",
                pr.number, pr.head.name, pr.base.name, a.branch, a.base
            )));
        }
        if !a.labels.is_empty() {
            let ids = self.client.ensure_labels(&a.labels).await?;
            self.client.add_labels(pr.number, &ids).await?;
        }
        Ok(
            json!({"number": pr.number, "url": pr.html_url, "head_sha": pr.head.sha, "base": pr.base.name}),
        )
    }

    async fn merge(&self, a: MergeArgs) -> Result<Value, AgentError> {
        check_sha("head_sha", &a.head_sha)?;
        let pr = self.client.get_pr(a.number).await?;
        // A PR can be retargeted after it was opened and approved; merging it would then change another branch.
        // Checked before the already-merged answer too: a PR merged elsewhere is not this merge done.
        if pr.base.name != self.base_branch {
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} is into `{}`, not the configured base `{}`; not merging it",
                a.number, pr.base.name, self.base_branch
            )));
        }
        if let Some(sha) = merged_sha(&pr) {
            return Ok(json!({"merge_sha": sha}));
        }
        if pr.state != "open" {
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} is closed without merge",
                a.number
            )));
        }
        if pr.head.sha != a.head_sha {
            // The approval covered a specific commit; anything else needs a new approval.
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} head is {}, not the approved {}",
                a.number, pr.head.sha, a.head_sha
            )));
        }
        let reply = self.client.merge_request(a.number, &a.head_sha).await?;
        let pr = self.client.get_pr(a.number).await?;
        match merged_sha(&pr) {
            Some(sha) => Ok(json!({"merge_sha": sha})),
            None if (200..300).contains(&reply.status) => Err(self.client.http.bad(format!(
                "PR #{} reported merged but has no merge commit",
                a.number
            ))),
            None => Err(self.client.http.status_error(&reply)),
        }
    }

    async fn close(&self, a: CloseArgs) -> Result<Value, AgentError> {
        check_branch("branch", &a.branch)?;
        let pr = self.client.get_pr(a.number).await?;
        if pr.head.name != a.branch {
            return Err(AgentError::Refused(format!(
                "forgejo: PR #{} is from `{}`, not `{}`",
                a.number, pr.head.name, a.branch
            )));
        }
        if a.branch == self.base_branch || a.branch == pr.base.name {
            return Err(AgentError::Refused(format!(
                "forgejo: refusing to delete the base branch `{}`",
                a.branch
            )));
        }
        // A merged PR cannot be closed, and its branch stays for the record. Saying so (with the merge commit) lets
        // a caller that never learned of the merge (its answer was lost) undo the merge instead.
        if pr.merged {
            let sha = merged_sha(&pr).ok_or_else(|| {
                self.client.http.bad(format!(
                    "PR #{} is merged but has no merge commit",
                    a.number
                ))
            })?;
            return Ok(json!({"closed": false, "merged": true, "merge_sha": sha}));
        }
        if pr.state != "closed" {
            self.client
                .edit_pr(a.number, &json!({"state": "closed"}))
                .await?;
        }
        self.client.delete_branch(&a.branch).await?;
        Ok(json!({"closed": true}))
    }

    async fn revert(&self, a: RevertArgs) -> Result<Value, AgentError> {
        check_sha("merge_sha", &a.merge_sha)?;
        self.check_work_branch(&a.branch, &a.base)?;
        let paths = diff_paths(&self.client.commit_diff(&a.merge_sha).await?)?;
        if paths.is_empty() || paths.len() > MAX_FILES {
            return Err(AgentError::Refused(format!(
                "forgejo: commit {} changes {} files",
                a.merge_sha,
                paths.len()
            )));
        }
        let parent = self
            .client
            .commit_parents(&a.merge_sha)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| {
                AgentError::Refused(format!(
                    "forgejo: {} has no parent to revert to",
                    a.merge_sha
                ))
            })?;
        // The reverse change: every touched file back to its content before the merge (absent then = delete).
        let mut changes = Vec::new();
        for path in paths {
            let before = self.client.get_file(&path, &parent).await?;
            changes.push(FileChange {
                path,
                content: before.map(|f| f.content),
            });
        }
        let message = format!(
            "Revert {}\n\nThis reverts commit {}.",
            a.merge_sha, a.merge_sha
        );
        // The revert branch is as predictable as the work branch: it too must be new (or our own earlier revert).
        self.commit(&a.branch, &a.base, None, &message, &changes)
            .await?;
        let body = format!("This reverts commit {}.", a.merge_sha);
        let pr = PrArgs {
            branch: a.branch,
            base: a.base,
            title: a.title,
            body,
            draft: false,
            labels: Vec::new(),
        };
        self.open_pr(&pr).await
    }

    async fn run(&self, skill: &str, value: Value) -> Result<Value, AgentError> {
        match skill {
            "read_files" => {
                let a: ReadArgs = args(skill, value)?;
                if a.paths.is_empty() || a.paths.len() > MAX_FILES {
                    return Err(AgentError::InvalidArgs(format!(
                        "`paths` must hold 1 to {MAX_FILES} paths"
                    )));
                }
                let git_ref = a
                    .git_ref
                    .filter(|r| !r.is_empty())
                    .unwrap_or_else(|| self.base_branch.clone());
                require("ref", &git_ref, MAX_BRANCH)?;
                let mut files = Vec::new();
                for path in a.paths {
                    check_path(&path)?;
                    let file = self.client.get_file(&path, &git_ref).await?;
                    files.push(match file.map(|f| String::from_utf8(f.content)) {
                        None => json!({"path": path, "content": null}),
                        Some(Ok(text)) => json!({"path": path, "content": text}),
                        Some(Err(_)) => json!({"path": path, "content": null, "binary": true}),
                    });
                }
                Ok(json!({"files": files}))
            }
            "commit_patch" => {
                let a: CommitArgs = args(skill, value)?;
                self.check_work_branch(&a.branch, &a.base)?;
                if let Some(sha) = &a.expected_head {
                    check_sha("expected_head", sha)?;
                }
                require("message", &a.message, MAX_BODY)?;
                if a.files.is_empty() || a.files.len() > MAX_FILES {
                    return Err(AgentError::InvalidArgs(format!(
                        "`files` must hold 1 to {MAX_FILES} files"
                    )));
                }
                let mut changes = Vec::new();
                for f in a.files {
                    check_path(&f.path)?;
                    if f.content.as_ref().is_some_and(|c| c.len() > MAX_FILE_BYTES) {
                        return Err(AgentError::InvalidArgs(format!(
                            "`{}` is larger than {MAX_FILE_BYTES} bytes",
                            f.path
                        )));
                    }
                    changes.push(FileChange {
                        path: f.path,
                        content: f.content.map(String::into_bytes),
                    });
                }
                let sha = self
                    .commit(
                        &a.branch,
                        &a.base,
                        a.expected_head.as_deref(),
                        &a.message,
                        &changes,
                    )
                    .await?;
                Ok(json!({"sha": sha}))
            }
            "open_pr" => self.open_pr(&args(skill, value)?).await,
            "get_pr" => {
                let a: PrArgsByNumber = args(skill, value)?;
                found(self.client.get_pr(a.number).await.map(|pr| pr_panel(&pr)))
            }
            "ci_status" => {
                let a: CiArgs = args(skill, value)?;
                check_sha("sha", &a.sha)?;
                let status = self.client.combined_status(&a.sha).await?;
                let checks: Vec<Value> = status
                    .statuses
                    .iter()
                    .take(MAX_CHECKS)
                    .map(|s| json!({"context": s.context, "state": s.status, "description": s.description, "url": s.target_url}))
                    .collect();
                Ok(json!({"state": ci_state(&status), "log": ci_log(&status), "checks": checks}))
            }
            "merge" => self.merge(args(skill, value)?).await,
            "close_pr" => self.close(args(skill, value)?).await,
            "revert" => self.revert(args(skill, value)?).await,
            other => Err(AgentError::UnknownSkill(other.into())),
        }
    }
}

/// A pull request as its panel shows it.
fn pr_panel(pr: &PullRequest) -> Value {
    json!({
        "number": pr.number,
        "title": pr.title,
        "body": pr.body.clone().unwrap_or_default(),
        "state": pr.state,
        "merged": pr.merged,
        "merge_commit_sha": merged_sha(pr).unwrap_or_default(),
        "head_branch": pr.head.name,
        "head_sha": pr.head.sha,
        "base_branch": pr.base.name,
        "author": pr.user.as_ref().map(|u| u.login.as_str()).unwrap_or_default(),
        "url": pr.html_url,
    })
}

fn merged_sha(pr: &PullRequest) -> Option<String> {
    if pr.merged {
        pr.merge_commit_sha.clone().filter(|s| !s.is_empty())
    } else {
        None
    }
}

/// The contract's four states. No status yet means pending; Forgejo's `warning` does not block a merge, so it
/// counts as success.
fn ci_state(status: &CombinedStatus) -> &'static str {
    if status.statuses.is_empty() {
        return "pending";
    }
    match status.state.as_str() {
        "success" | "warning" => "success",
        "failure" => "failure",
        "error" => "error",
        _ => "pending",
    }
}

/// One line per check, failing ones first, from the statuses' descriptions (the CI's summary of the failure).
fn ci_log(status: &CombinedStatus) -> String {
    let mut statuses: Vec<&CommitStatus> = status.statuses.iter().collect();
    statuses.sort_by_key(|s| !matches!(s.status.as_str(), "failure" | "error"));
    let mut log = String::new();
    for s in statuses {
        let line = if s.target_url.is_empty() {
            format!("[{}] {}: {}\n", s.status, s.context, s.description)
        } else {
            format!(
                "[{}] {}: {} ({})\n",
                s.status, s.context, s.description, s.target_url
            )
        };
        if log.len() + line.len() > MAX_LOG_BYTES {
            break;
        }
        log.push_str(&line);
    }
    log
}

#[async_trait]
impl Skills for ForgejoAgent {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "forgejo".into(),
            description: "Code agent for Forgejo: reads files, commits patches on work branches, opens, reads and \
                          updates pull requests, reads CI status, merges, closes and reverts."
                .into(),
            version: AGENT_VERSION.into(),
            app: Some(self.client.links()),
            skills: vec![
                skill("read_files", "Read files", "Read files at a ref (missing files come back with null content).", Risk::Read,
                    &[r#"{"paths":["src/checkout.js"],"ref":"main"}"#]),
                skill("commit_patch", "Commit patch", "Commit whole-file contents to a work branch (null content deletes). The branch must stand at expected_head (the previous commit); without it, it must not exist (it is created from base) or stand at the base head. Anything else is refused.", Risk::Write,
                    &[r#"{"branch":"factory/r-0123456789abcdef","base":"main","files":[{"path":"src/checkout.js","content":"..."}],"message":"Fix TypeError in checkout"}"#,
                      r#"{"branch":"factory/r-0123456789abcdef","base":"main","expected_head":"3f786850e387550fdab836ed7e6dc881de23001b","files":[{"path":"src/checkout.js","content":"..."}],"message":"Fix attempt 2"}"#]),
                skill("open_pr", "Open pull request", "Open a pull request for a branch, or update and return the open one; draft adds the WIP: prefix.", Risk::Write,
                    &[r#"{"branch":"factory/r-0123456789abcdef","base":"main","title":"Fix checkout","body":"...","draft":false,"labels":["factory"]}"#]),
                skill("get_pr", "Get pull request", "Read a pull request for its panel: title, body, state, merged and merge commit, head and base, author and link; {\"found\": false} if there is none.", Risk::Read,
                    &[r#"{"number":12}"#]),
                skill("ci_status", "CI status", "Combined CI state of a commit (pending, success, failure, error) with the checks' log and each check (context, state, description, link).", Risk::Read,
                    &[r#"{"sha":"3f786850e387550fdab836ed7e6dc881de23001b"}"#]),
                skill("merge", "Merge", "Merge a pull request at the approved head commit; an already merged PR answers the same.", Risk::Destructive,
                    &[r#"{"number":12,"head_sha":"3f786850e387550fdab836ed7e6dc881de23001b"}"#]),
                skill("close_pr", "Close pull request", "Close a pull request without merging and delete its branch; an already merged PR is left as is and answered with its merge commit.", Risk::Destructive,
                    &[r#"{"number":12,"branch":"factory/r-0123456789abcdef"}"#]),
                skill("revert", "Revert", "Revert a merged commit on a new branch and open a pull request for it.", Risk::Destructive,
                    &[r#"{"merge_sha":"3f786850e387550fdab836ed7e6dc881de23001b","branch":"factory/r-0123456789abcdef-revert","base":"main","title":"Revert fix"}"#]),
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
    fn diff_paths_reads_headers_only() {
        let diff = "diff --git a/src/app.js b/src/app.js\nindex 1..2 100644\n--- a/src/app.js\n+++ b/src/app.js\n@@ -1 +1 @@\n--- a/not/a/file\n+x\n\
diff --git a/new.txt b/new.txt\nnew file mode 100644\n--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+hi\n\
diff --git a/old name.md b/new name.md\nsimilarity index 90%\nrename from old name.md\nrename to new name.md\n\
diff --git a/img.png b/img.png\nBinary files a/img.png and b/img.png differ\n";
        let got: Vec<String> = diff_paths(diff).unwrap().into_iter().collect();
        assert_eq!(
            got,
            [
                "img.png",
                "new name.md",
                "new.txt",
                "old name.md",
                "src/app.js"
            ]
        );
        assert!(diff_paths("diff --git \"a/\\303\" \"b/\\303\"\n").is_err());
    }

    #[test]
    fn ci_state_and_log() {
        let st = |status: &str, ctx: &str, desc: &str| CommitStatus {
            status: status.into(),
            context: ctx.into(),
            description: desc.into(),
            target_url: String::new(),
        };
        let empty = CombinedStatus {
            state: String::new(),
            statuses: vec![],
        };
        assert_eq!(ci_state(&empty), "pending");
        let failing = CombinedStatus {
            state: "failure".into(),
            statuses: vec![
                st("success", "lint", "ok"),
                st("failure", "test", "1 failed: checkout"),
            ],
        };
        assert_eq!(ci_state(&failing), "failure");
        assert_eq!(
            ci_log(&failing),
            "[failure] test: 1 failed: checkout\n[success] lint: ok\n"
        );
        let warn = CombinedStatus {
            state: "warning".into(),
            statuses: vec![st("warning", "x", "")],
        };
        assert_eq!(ci_state(&warn), "success");
    }

    #[test]
    fn names_are_checked() {
        assert!(check_path("src/a.rs").is_ok());
        for bad in ["/etc/passwd", "a/../b", "a//b", "./a", ""] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        assert!(check_branch("b", "factory/r-0123").is_ok());
        for bad in ["a..b", "a b?", "x.lock", "/x", "x/", "a~1"] {
            assert!(check_branch("b", bad).is_err(), "{bad}");
        }
        assert!(check_sha("s", "abc123").is_ok() && check_sha("s", "xyz").is_err());
    }
}
