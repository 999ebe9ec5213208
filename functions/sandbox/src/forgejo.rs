//! Fake Forgejo (`/api/v1`, `Authorization: token <t>`): one repository with branches, file commits, pull
//! requests, merges, diffs and CI commit statuses.

use crate::git::{self, Commit, Repo, Tree};
use crate::{RepoSeed, SandboxConfig, Shared, State as AppState, util};
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) const CI_CONTEXT: &str = "loams-ci";
const MAX_FILES_PER_COMMIT: usize = 100;
const MAX_PATH_CHARS: usize = 4096;
const MAX_TITLE_CHARS: usize = 255;
const MAX_PR_BODY_BYTES: usize = 64 * 1024;
const MAX_BRANCH_CHARS: usize = 255;
const DEFAULT_PAGE_LIMIT: usize = 30;
const MAX_PAGE_LIMIT: usize = 50;
/// Forgejo's label name column is 255 characters; its description is free text, capped here.
const MAX_LABEL_NAME_CHARS: usize = 255;
const MAX_LABEL_DESCRIPTION_CHARS: usize = 1024;
/// A repository has few labels; more than this is refused rather than grown without bound.
const MAX_LABELS: usize = 1000;
/// Labels named in one add request.
const MAX_LABELS_PER_REQUEST: usize = 100;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Pull {
    number: u64,
    title: String,
    body: String,
    head: String,
    base: String,
    open: bool,
    merged: bool,
    merge_commit_sha: Option<String>,
    /// The head commit once the PR is closed or merged (the branch may be gone by then).
    frozen_head: Option<String>,
    created_ms: i64,
    updated_ms: i64,
    closed_ms: Option<i64>,
    merged_ms: Option<i64>,
    /// Label ids, in the order they were added.
    #[serde(default)]
    labels: Vec<u64>,
    /// Login of the account that opened it; state saved before accounts were told apart has only the bot's.
    #[serde(default = "bot_login")]
    author: String,
}

const BOT_LOGIN: &str = "loams-bot";
const MAINTAINER_LOGIN: &str = "maintainer";

fn bot_login() -> String {
    BOT_LOGIN.into()
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Label {
    id: u64,
    name: String,
    /// Six hex digits without `#`, as the API answers it.
    color: String,
    description: String,
    exclusive: bool,
    is_archived: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct StatusRecord {
    id: u64,
    sha: String,
    context: String,
    created_ms: i64,
    /// The status reads `pending` until this time, then the outcome of the check.
    settle_ms: i64,
    outcome: String,
    description: String,
}

impl Pull {
    pub fn is_open(&self) -> bool {
        self.open
    }
}

impl StatusRecord {
    fn view(&self, now: i64) -> (&str, &str) {
        if now < self.settle_ms {
            ("pending", "CI is running")
        } else {
            (&self.outcome, &self.description)
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ForgejoState {
    pub repo: Repo,
    pub pulls: Vec<Pull>,
    pub statuses: Vec<StatusRecord>,
    pub merges: u64,
    #[serde(default)]
    pub labels: Vec<Label>,
}

impl ForgejoState {
    pub fn seed(seed: &RepoSeed, now: i64) -> Self {
        ForgejoState {
            repo: Repo::seed(
                &seed.owner,
                &seed.name,
                &seed.default_branch,
                &seed.files,
                now,
            ),
            pulls: Vec::new(),
            statuses: Vec::new(),
            merges: 0,
            labels: Vec::new(),
        }
    }

    fn pull_head(&self, p: &Pull) -> String {
        if p.open
            && let Some(sha) = self.repo.branches.get(&p.head)
        {
            return sha.clone();
        }
        p.frozen_head
            .clone()
            .or_else(|| self.repo.branches.get(&p.head).cloned())
            .unwrap_or_default()
    }
}

impl AppState {
    /// Records what a new commit did: CI for a non-default branch, production for the default branch.
    fn after_commit(&mut self, config: &SandboxConfig, branch: &str, sha: &str, now: i64) {
        if branch == self.forgejo.repo.default_branch {
            self.reconcile_production(config, now);
            return;
        }
        let Some(commit) = self.forgejo.repo.commits.get(sha) else {
            return;
        };
        let failures = config.ci.failures(&commit.tree);
        let (outcome, description) = if failures.is_empty() {
            ("success", "all checks passed".to_string())
        } else {
            ("failure", failures.join("; "))
        };
        let id = self.forgejo.statuses.len() as u64 + 1;
        self.forgejo.statuses.push(StatusRecord {
            id,
            sha: sha.into(),
            context: CI_CONTEXT.into(),
            created_ms: now,
            settle_ms: now.saturating_add(i64::try_from(config.ci.delay_ms).unwrap_or(i64::MAX)),
            outcome: outcome.into(),
            description,
        });
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    let base = "/api/v1/repos/{owner}/{repo}";
    Router::new()
        .route("/api/v1/user", get(current_user))
        .route(&format!("{base}/branches"), post(create_branch))
        .route(
            &format!("{base}/branches/{{*branch}}"),
            get(get_branch).delete(delete_branch),
        )
        .route(&format!("{base}/contents"), post(change_files))
        .route(&format!("{base}/contents/{{*filepath}}"), get(get_contents))
        .route(&format!("{base}/pulls"), get(list_pulls).post(create_pull))
        .route(
            &format!("{base}/pulls/{{index}}"),
            get(get_pull).patch(edit_pull),
        )
        .route(
            &format!("{base}/pulls/{{index}}/merge"),
            get(is_merged).post(merge_pull),
        )
        // Forgejo's `/pulls/{base}/{head}`; the path parameter shares the name `index` with the routes above
        // because the router allows one name per position, and `head` may hold slashes (`factory/<run>`).
        .route(
            &format!("{base}/pulls/{{index}}/{{*head}}"),
            get(get_pull_by_base_head),
        )
        .route(
            &format!("{base}/commits/{{reference}}/status"),
            get(combined_status),
        )
        .route(&format!("{base}/git/commits/{{sha}}"), get(get_commit))
        .route(
            &format!("{base}/labels"),
            get(list_labels).post(create_label),
        )
        .route(
            &format!("{base}/issues/{{index}}/labels"),
            get(issue_labels).post(add_issue_labels),
        )
}

fn api_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"message": message, "url": "/api/swagger"})),
    )
        .into_response()
}

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"errors": [], "message": "The target couldn't be found.", "url": "/api/swagger"})))
        .into_response()
}

/// A body too large keeps its 413; any other unreadable body is Forgejo's 422.
fn rejected(e: &JsonRejection) -> Response {
    let status = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        e.status()
    } else {
        StatusCode::UNPROCESSABLE_ENTITY
    };
    api_error(status, &e.body_text())
}

fn unprocessable(message: &str) -> Response {
    api_error(StatusCode::UNPROCESSABLE_ENTITY, message)
}

fn persist_or_500(shared: &Shared, st: &AppState) -> Result<(), Response> {
    shared
        .persist(st)
        .map_err(|e| api_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()))
}

/// Token auth first, then the repository must be the seeded one (names are case-insensitive, as in Forgejo).
/// Answers the caller's login.
fn check(
    shared: &Shared,
    headers: &HeaderMap,
    owner: &str,
    repo: &str,
) -> Result<&'static str, Response> {
    let login = authenticate(shared, headers)?;
    let r = &shared.config.repo;
    if !owner.eq_ignore_ascii_case(&r.owner) || !repo.eq_ignore_ascii_case(&r.name) {
        return Err(not_found());
    }
    Ok(login)
}

/// The login the request's token belongs to.
fn authenticate(shared: &Shared, headers: &HeaderMap) -> Result<&'static str, Response> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            (scheme.eq_ignore_ascii_case("token") || scheme.eq_ignore_ascii_case("bearer"))
                .then(|| rest.trim())
        });
    let tokens = &shared.config.tokens;
    match token {
        None => Err(api_error(StatusCode::UNAUTHORIZED, "token is required")),
        Some(t) if t == tokens.forgejo_token => Ok(BOT_LOGIN),
        Some(t) if t == tokens.forgejo_maintainer_token => Ok(MAINTAINER_LOGIN),
        Some(_) => Err(api_error(
            StatusCode::UNAUTHORIZED,
            "user does not exist [uid: 0, name: ]",
        )),
    }
}

/// `GET /user` (userGetCurrent): the account the token belongs to.
async fn current_user(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    match authenticate(&shared, &headers) {
        Ok(login) => Json(user_json(&shared, login)).into_response(),
        Err(r) => r,
    }
}

/// The `User` for `login`, one of [`BOT_LOGIN`] and [`MAINTAINER_LOGIN`].
fn user_json(shared: &Shared, login: &str) -> Value {
    let (id, full_name, email) = if login == BOT_LOGIN {
        (2, "Loams", shared.config.tokens.zulip_email.clone())
    } else {
        (3, "Maintainer", format!("{login}@forgejo.example"))
    };
    json!({
        "id": id,
        "login": login,
        "login_name": "",
        "full_name": full_name,
        "email": email,
        "avatar_url": format!("{}/avatars/{login}", shared.urls.forgejo),
        "html_url": format!("{}/{login}", shared.urls.forgejo),
        "is_admin": false,
        "restricted": false,
        "active": true,
        "visibility": "public",
    })
}

fn repo_json(shared: &Shared, repo: &Repo) -> Value {
    let full = format!("{}/{}", repo.owner, repo.name);
    json!({
        "id": 1,
        "name": repo.name,
        "full_name": full,
        "owner": {"id": 1, "login": repo.owner, "full_name": "", "email": "", "avatar_url": ""},
        "private": false,
        "fork": false,
        "empty": false,
        "default_branch": repo.default_branch,
        "html_url": format!("{}/{full}", shared.urls.forgejo),
        "clone_url": format!("{}/{full}.git", shared.urls.forgejo),
        "url": format!("{}/api/v1/repos/{full}", shared.urls.forgejo),
    })
}

fn repo_url(shared: &Shared) -> String {
    format!(
        "{}/{}/{}",
        shared.urls.forgejo, shared.config.repo.owner, shared.config.repo.name
    )
}

fn api_repo_url(shared: &Shared) -> String {
    format!(
        "{}/api/v1/repos/{}/{}",
        shared.urls.forgejo, shared.config.repo.owner, shared.config.repo.name
    )
}

fn payload_commit(shared: &Shared, c: &Commit, parent: Option<&Tree>) -> Value {
    let empty = Tree::new();
    let old = parent.unwrap_or(&empty);
    let added: Vec<&String> = c.tree.keys().filter(|p| !old.contains_key(*p)).collect();
    let removed: Vec<&String> = old.keys().filter(|p| !c.tree.contains_key(*p)).collect();
    let modified: Vec<&String> = c
        .tree
        .iter()
        .filter(|(p, v)| old.get(*p).is_some_and(|o| o != *v))
        .map(|(p, _)| p)
        .collect();
    let who = json!({"name": "Loams", "email": shared.config.tokens.zulip_email, "username": "loams-bot"});
    json!({
        "id": c.sha,
        "message": c.message,
        "url": format!("{}/commit/{}", repo_url(shared), c.sha),
        "author": who,
        "committer": who,
        "verification": null,
        "timestamp": util::iso_s(c.time_ms),
        "added": added,
        "removed": removed,
        "modified": modified,
    })
}

fn branch_json(shared: &Shared, repo: &Repo, name: &str, c: &Commit) -> Value {
    let parent = c
        .parent
        .as_ref()
        .and_then(|p| repo.commits.get(p))
        .map(|p| &p.tree);
    json!({
        "name": name,
        "commit": payload_commit(shared, c, parent),
        "protected": false,
        "required_approvals": 0,
        "enable_status_check": false,
        "status_check_contexts": [],
        "user_can_push": true,
        "user_can_merge": true,
        "effective_branch_protection_name": "",
    })
}

fn valid_branch_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_BRANCH_CHARS
        && !name.starts_with(['/', '-', '.'])
        && !name.ends_with(['/', '.'])
        && !name.contains("..")
        && !name.contains("//")
        && !name.contains("@{")
        && !name
            .chars()
            .any(|c| c.is_control() || " ~^:?*[\\".contains(c))
        && !name.ends_with(".lock")
}

#[derive(Deserialize)]
struct CreateBranchOption {
    new_branch_name: Option<String>,
    old_ref_name: Option<String>,
    old_branch_name: Option<String>,
}

async fn create_branch(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    body: Result<Json<CreateBranchOption>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let Some(name) = body.new_branch_name.filter(|n| !n.is_empty()) else {
        return unprocessable("[NewBranchName]: Required");
    };
    if !valid_branch_name(&name) {
        return unprocessable(&format!("[NewBranchName]: invalid branch name {name:?}"));
    }
    let mut st = shared.lock();
    let from = body
        .old_ref_name
        .or(body.old_branch_name)
        .unwrap_or_else(|| st.forgejo.repo.default_branch.clone());
    let from = from.strip_prefix("refs/heads/").unwrap_or(&from).to_owned();
    let Some(sha) = st.forgejo.repo.resolve(&from).map(|c| c.sha.clone()) else {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!("The old branch does not exist: {from}"),
        );
    };
    if st.forgejo.repo.branches.contains_key(&name) {
        return api_error(StatusCode::CONFLICT, "The branch already exists.");
    }
    st.forgejo.repo.branches.insert(name.clone(), sha.clone());
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    let repo = &st.forgejo.repo;
    match repo.commits.get(&sha) {
        Some(c) => (
            StatusCode::CREATED,
            Json(branch_json(&shared, repo, &name, c)),
        )
            .into_response(),
        None => not_found(),
    }
}

async fn get_branch(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, branch)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    let repo = &st.forgejo.repo;
    match repo.head(&branch) {
        Some(c) => Json(branch_json(&shared, repo, &branch, c)).into_response(),
        None => api_error(
            StatusCode::NOT_FOUND,
            &format!("branch does not exist [name: {branch}]"),
        ),
    }
}

async fn delete_branch(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, branch)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let mut st = shared.lock();
    if branch == st.forgejo.repo.default_branch {
        return api_error(StatusCode::FORBIDDEN, "can not delete default branch");
    }
    // An open PR keeps pointing at the last head of its branch.
    let head = st.forgejo.repo.branches.get(&branch).cloned();
    let Some(head) = head else {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!("branch does not exist [name: {branch}]"),
        );
    };
    for p in st.forgejo.pulls.iter_mut().filter(|p| p.head == branch) {
        p.frozen_head.get_or_insert(head.clone());
    }
    st.forgejo.repo.branches.remove(&branch);
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    StatusCode::NO_CONTENT.into_response()
}

fn contents_json(
    shared: &Shared,
    path: &str,
    content: &str,
    reference: &str,
    last_commit: &str,
) -> Value {
    let sha = git::blob_sha(content);
    let name = path.rsplit('/').next().unwrap_or(path);
    let url = format!("{}/contents/{path}?ref={reference}", api_repo_url(shared));
    let html = format!("{}/src/branch/{reference}/{path}", repo_url(shared));
    let git_url = format!("{}/git/blobs/{sha}", api_repo_url(shared));
    let download = format!("{}/raw/branch/{reference}/{path}", repo_url(shared));
    json!({
        "name": name,
        "path": path,
        "sha": sha,
        "last_commit_sha": last_commit,
        "type": "file",
        "size": content.len(),
        "encoding": "base64",
        "content": base64::engine::general_purpose::STANDARD.encode(content),
        "target": null,
        "url": url,
        "html_url": html,
        "git_url": git_url,
        "download_url": download,
        "submodule_git_url": null,
        "_links": {"self": url, "git": git_url, "html": html},
    })
}

async fn get_contents(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, filepath)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    let repo = &st.forgejo.repo;
    let reference = q
        .get("ref")
        .cloned()
        .unwrap_or_else(|| repo.default_branch.clone());
    let Some(commit) = repo.resolve(&reference) else {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!("object does not exist [id: {reference}, rel_path: ]"),
        );
    };
    let path = filepath.trim_matches('/');
    if let Some(content) = commit.tree.get(path) {
        return Json(contents_json(
            &shared,
            path,
            content,
            &reference,
            &commit.sha,
        ))
        .into_response();
    }
    // a directory: list its direct children, as Forgejo does
    let prefix = format!("{path}/");
    let mut entries: Vec<Value> = Vec::new();
    let mut dirs = std::collections::BTreeSet::new();
    for (p, content) in commit
        .tree
        .range(prefix.clone()..)
        .take_while(|(p, _)| p.starts_with(&prefix))
    {
        let rest = &p[prefix.len()..];
        match rest.split_once('/') {
            Some((dir, _)) => {
                dirs.insert(dir.to_owned());
            }
            None => {
                let mut v = contents_json(&shared, p, content, &reference, &commit.sha);
                if let Some(o) = v.as_object_mut() {
                    o.insert("content".into(), Value::Null);
                    o.insert("encoding".into(), Value::Null);
                }
                entries.push(v);
            }
        }
    }
    for dir in dirs {
        entries.push(
            json!({"name": dir, "path": format!("{prefix}{dir}"), "type": "dir", "size": 0,
                            "last_commit_sha": commit.sha, "content": null, "encoding": null}),
        );
    }
    if entries.is_empty() {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!(
                "object does not exist [id: {}, rel_path: {path}]",
                commit.sha
            ),
        );
    }
    Json(entries).into_response()
}

#[derive(Deserialize)]
struct ChangeFileOperation {
    operation: String,
    path: String,
    content: Option<String>,
    sha: Option<String>,
    from_path: Option<String>,
}

#[derive(Deserialize)]
struct ChangeFilesOptions {
    files: Vec<ChangeFileOperation>,
    branch: Option<String>,
    new_branch: Option<String>,
    message: Option<String>,
}

fn valid_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= MAX_PATH_CHARS
        && !p.starts_with('/')
        && p.split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != ".." && seg != ".git")
}

/// Applies the operations to `tree` or says why not (status + message).
fn apply_ops(tree: &mut Tree, files: &[ChangeFileOperation]) -> Result<(), (StatusCode, String)> {
    let unprocessable = |m: String| Err((StatusCode::UNPROCESSABLE_ENTITY, m));
    for f in files {
        if !valid_path(&f.path) {
            return unprocessable(format!(
                "path contains a malformed path component [path: {}]",
                f.path
            ));
        }
        let decode = |c: &Option<String>| -> Result<String, (StatusCode, String)> {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(c.as_deref().unwrap_or("").trim())
                .map_err(|e| {
                    (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        format!("invalid base64 content: {e}"),
                    )
                })?;
            String::from_utf8(raw).map_err(|_| {
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "the sandbox stores UTF-8 text files only".to_string(),
                )
            })
        };
        let check_sha = |path: &str, tree: &Tree| -> Result<(), (StatusCode, String)> {
            let Some(current) = tree.get(path) else {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("repository file does not exist [path: {path}]"),
                ));
            };
            let expected = git::blob_sha(current);
            match f.sha.as_deref() {
                None => Err((StatusCode::UNPROCESSABLE_ENTITY, "[Sha]: Required".into())),
                Some(given) if given != expected => Err((
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("sha does not match [given: {given}, expected: {expected}]"),
                )),
                Some(_) => Ok(()),
            }
        };
        match f.operation.as_str() {
            "create" => {
                if tree.contains_key(&f.path) {
                    return unprocessable(format!(
                        "repository file already exists [path: {}]",
                        f.path
                    ));
                }
                let content = decode(&f.content)?;
                tree.insert(f.path.clone(), content);
            }
            "update" => {
                let from = f
                    .from_path
                    .clone()
                    .filter(|p| !p.is_empty())
                    .unwrap_or_else(|| f.path.clone());
                if !valid_path(&from) {
                    return unprocessable(format!(
                        "path contains a malformed path component [path: {from}]"
                    ));
                }
                check_sha(&from, tree)?;
                let content = decode(&f.content)?;
                if from != f.path {
                    if tree.contains_key(&f.path) {
                        return unprocessable(format!(
                            "repository file already exists [path: {}]",
                            f.path
                        ));
                    }
                    tree.remove(&from);
                }
                tree.insert(f.path.clone(), content);
            }
            "delete" => {
                check_sha(&f.path, tree)?;
                tree.remove(&f.path);
            }
            other => return unprocessable(format!("[Operation]: unknown operation {other:?}")),
        }
    }
    Ok(())
}

async fn change_files(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    body: Result<Json<ChangeFilesOptions>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    if body.files.is_empty() || body.files.len() > MAX_FILES_PER_COMMIT {
        return unprocessable(&format!(
            "[Files]: between 1 and {MAX_FILES_PER_COMMIT} files"
        ));
    }
    let now = util::now_ms();
    let mut st = shared.lock();
    let from = body
        .branch
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| st.forgejo.repo.default_branch.clone());
    let Some(parent) = st.forgejo.repo.head(&from).cloned() else {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!("branch does not exist [name: {from}]"),
        );
    };
    let target = match body.new_branch.filter(|b| !b.is_empty()) {
        Some(nb) if st.forgejo.repo.branches.contains_key(&nb) => {
            return unprocessable(&format!("branch already exists [name: {nb}]"));
        }
        Some(nb) if !valid_branch_name(&nb) => {
            return unprocessable(&format!("invalid branch name {nb:?}"));
        }
        Some(nb) => nb,
        None => from.clone(),
    };
    let mut tree = parent.tree.clone();
    if let Err((status, message)) = apply_ops(&mut tree, &body.files) {
        return api_error(status, &message);
    }
    let message = body
        .message
        .filter(|m| !m.trim().is_empty())
        .unwrap_or_else(|| {
            let paths: Vec<&str> = body.files.iter().map(|f| f.path.as_str()).collect();
            format!("Update {}", paths.join(", "))
        });
    let sha = st
        .forgejo
        .repo
        .add_commit([Some(&parent.sha), None], tree, &message, now);
    st.forgejo.repo.branches.insert(target.clone(), sha.clone());
    st.after_commit(&shared.config, &target, &sha, now);
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    let Some(commit) = st.forgejo.repo.commits.get(&sha) else {
        return not_found();
    };
    let files: Vec<Value> = body
        .files
        .iter()
        .map(|f| match commit.tree.get(&f.path) {
            Some(content) => contents_json(&shared, &f.path, content, &target, &sha),
            None => Value::Null,
        })
        .collect();
    let who = json!({"name": "Loams", "email": shared.config.tokens.zulip_email, "date": util::iso_s(now)});
    let api = api_repo_url(&shared);
    let out = json!({
        "commit": {
            "sha": sha,
            "url": format!("{api}/git/commits/{sha}"),
            "html_url": format!("{}/commit/{sha}", repo_url(&shared)),
            "message": commit.message,
            "author": who,
            "committer": who,
            "parents": [{"sha": parent.sha, "url": format!("{api}/git/commits/{}", parent.sha), "created": util::iso_s(parent.time_ms)}],
            "tree": {"sha": git::tree_sha(&commit.tree), "url": format!("{api}/git/trees/{sha}"), "created": util::iso_s(now)},
            "created": util::iso_s(now),
        },
        "files": files,
        "verification": {"verified": false, "reason": "gpg.error.not_signed_commit", "signature": "", "signer": null, "payload": ""},
    });
    (StatusCode::CREATED, Json(out)).into_response()
}

fn branch_info(shared: &Shared, st: &ForgejoState, branch: &str, sha: &str) -> Value {
    json!({"label": branch, "ref": branch, "sha": sha, "repo_id": 1, "repo": repo_json(shared, &st.repo)})
}

fn pull_json(shared: &Shared, st: &ForgejoState, p: &Pull) -> Value {
    let head_sha = st.pull_head(p);
    let base_sha = st.repo.branches.get(&p.base).cloned().unwrap_or_default();
    let head_tree = st.repo.commits.get(&head_sha).map(|c| &c.tree);
    let base_tree = st.repo.commits.get(&base_sha).map(|c| &c.tree);
    let changed = match (head_tree, base_tree) {
        (Some(h), Some(b)) => h
            .keys()
            .chain(b.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|k| h.get(*k) != b.get(*k))
            .count(),
        _ => 0,
    };
    let mergeable = p.open
        && !p.merged
        && st.repo.branches.contains_key(&p.head)
        && st.repo.branches.contains_key(&p.base);
    let html = format!("{}/pulls/{}", repo_url(shared), p.number);
    json!({
        "id": p.number,
        "number": p.number,
        "url": html,
        "html_url": html,
        "diff_url": format!("{html}.diff"),
        "patch_url": format!("{html}.patch"),
        "user": user_json(shared, &p.author),
        "title": p.title,
        "body": p.body,
        "labels": pull_labels_json(shared, st, p),
        "milestone": null,
        "assignee": null,
        "assignees": [],
        "requested_reviewers": [],
        "requested_reviewers_teams": [],
        "state": if p.open { "open" } else { "closed" },
        "draft": is_wip(&p.title),
        "is_locked": false,
        "comments": 0,
        "review_comments": 0,
        "additions": 0,
        "deletions": 0,
        "changed_files": changed,
        "mergeable": mergeable,
        "merged": p.merged,
        "merged_at": p.merged_ms.map(util::iso_s),
        "merged_by": if p.merged { user_json(shared, BOT_LOGIN) } else { Value::Null },
        "merge_commit_sha": p.merge_commit_sha,
        "merge_base": base_sha,
        "base": branch_info(shared, st, &p.base, &base_sha),
        "head": branch_info(shared, st, &p.head, &head_sha),
        "allow_maintainer_edit": false,
        "due_date": null,
        "created_at": util::iso_s(p.created_ms),
        "updated_at": util::iso_s(p.updated_ms),
        "closed_at": p.closed_ms.map(util::iso_s),
        "pin_order": 0,
        "flow": 0,
    })
}

/// Forgejo treats these title prefixes as "work in progress" (a draft), which cannot be merged.
fn is_wip(title: &str) -> bool {
    let t = title.to_ascii_uppercase();
    t.starts_with("WIP:") || t.starts_with("[WIP]")
}

#[derive(Deserialize)]
struct CreatePullRequestOption {
    head: Option<String>,
    base: Option<String>,
    title: Option<String>,
    body: Option<String>,
}

async fn create_pull(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    body: Result<Json<CreatePullRequestOption>, JsonRejection>,
) -> Response {
    let author = match check(&shared, &headers, &owner, &repo) {
        Ok(login) => login,
        Err(r) => return r,
    };
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let Some(title) = body.title.filter(|t| !t.trim().is_empty()) else {
        return unprocessable("[Title]: Required");
    };
    if title.chars().count() > MAX_TITLE_CHARS {
        return unprocessable("[Title]: MaxSize");
    }
    let text = body.body.unwrap_or_default();
    if text.len() > MAX_PR_BODY_BYTES {
        return unprocessable("[Body]: too long");
    }
    let (Some(head), Some(base)) = (body.head, body.base) else {
        return unprocessable("[Head] and [Base] are required");
    };
    // `owner:branch` names the head repository; there is only one here
    let head = match head.split_once(':') {
        Some((o, b)) if o.eq_ignore_ascii_case(&shared.config.repo.owner) => b.to_owned(),
        Some(_) => return not_found(),
        None => head,
    };
    let now = util::now_ms();
    let mut st = shared.lock();
    let (Some(h), Some(b)) = (st.forgejo.repo.head(&head), st.forgejo.repo.head(&base)) else {
        return not_found();
    };
    if head == base || h.tree == b.tree {
        return unprocessable(
            "Invalid PullRequest: There are no changes between the head and the base",
        );
    }
    if let Some(p) = st
        .forgejo
        .pulls
        .iter()
        .find(|p| p.open && p.head == head && p.base == base)
    {
        return api_error(
            StatusCode::CONFLICT,
            &format!(
                "pull request already exists for these targets [id: {}, issue_id: {}, head_repo_id: 1, base_repo_id: 1, head_branch: {head}, base_branch: {base}]",
                p.number, p.number
            ),
        );
    }
    let pull = Pull {
        number: st.forgejo.pulls.len() as u64 + 1,
        title,
        body: text,
        head,
        base,
        open: true,
        merged: false,
        merge_commit_sha: None,
        frozen_head: None,
        created_ms: now,
        updated_ms: now,
        closed_ms: None,
        merged_ms: None,
        labels: Vec::new(),
        author: author.into(),
    };
    let out = pull_json(&shared, &st.forgejo, &pull);
    st.forgejo.pulls.push(pull);
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    (StatusCode::CREATED, Json(out)).into_response()
}

async fn list_pulls(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let state = q.get("state").map_or("open", String::as_str);
    if !["open", "closed", "all"].contains(&state) {
        return unprocessable("[State]: must be open, closed or all");
    }
    let page = q
        .get("page")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let limit = q
        .get("limit")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(DEFAULT_PAGE_LIMIT)
        .clamp(1, MAX_PAGE_LIMIT);
    let st = shared.lock();
    let matching: Vec<&Pull> = st
        .forgejo
        .pulls
        .iter()
        .rev()
        .filter(|p| state == "all" || p.open == (state == "open"))
        .collect();
    let total = matching.len();
    let out: Vec<Value> = matching
        .into_iter()
        .skip((page - 1) * limit)
        .take(limit)
        .map(|p| pull_json(&shared, &st.forgejo, p))
        .collect();
    let mut resp = Json(out).into_response();
    resp.headers_mut().insert("x-total-count", total.into());
    resp
}

fn find_pull(st: &ForgejoState, index: &str) -> Option<usize> {
    let n: u64 = index.parse().ok()?;
    st.pulls.iter().position(|p| p.number == n)
}

async fn get_pull(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    match find_pull(&st.forgejo, &index) {
        Some(i) => Json(pull_json(&shared, &st.forgejo, &st.forgejo.pulls[i])).into_response(),
        None => not_found(),
    }
}

/// The newest PR from `head` into `base`, whatever its state, as Forgejo answers `repoGetPullRequestByBaseHead`.
async fn get_pull_by_base_head(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, base, head)): Path<(String, String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    match st
        .forgejo
        .pulls
        .iter()
        .rev()
        .find(|p| p.base == base && p.head == head)
    {
        Some(pull) => Json(pull_json(&shared, &st.forgejo, pull)).into_response(),
        None => not_found(),
    }
}

#[derive(Deserialize)]
struct EditPullRequestOption {
    title: Option<String>,
    body: Option<String>,
    state: Option<String>,
    /// A new base branch (retargets the PR).
    base: Option<String>,
}

async fn edit_pull(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
    body: Result<Json<EditPullRequestOption>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let now = util::now_ms();
    let mut st = shared.lock();
    let Some(i) = find_pull(&st.forgejo, &index) else {
        return not_found();
    };
    if let Some(t) = &body.title
        && (t.trim().is_empty() || t.chars().count() > MAX_TITLE_CHARS)
    {
        return unprocessable("[Title]: Required, at most 255 characters");
    }
    if body
        .body
        .as_ref()
        .is_some_and(|b| b.len() > MAX_PR_BODY_BYTES)
    {
        return unprocessable("[Body]: too long");
    }
    let head_now = st.forgejo.pull_head(&st.forgejo.pulls[i]);
    let p = st.forgejo.pulls[i].clone();
    // Forgejo retargets only open PRs, onto an existing branch other than the head, with no open PR there yet.
    if let Some(base) = body.base.as_ref().filter(|b| **b != p.base) {
        if !p.open {
            return unprocessable("cannot change the base of a closed pull request");
        }
        if *base == p.head || !st.forgejo.repo.branches.contains_key(base) {
            return not_found();
        }
        if st
            .forgejo
            .pulls
            .iter()
            .any(|o| o.open && o.head == p.head && o.base == *base)
        {
            return api_error(
                StatusCode::CONFLICT,
                "pull request already exists for these targets",
            );
        }
    }
    match body.state.as_deref() {
        None => {}
        Some("closed") if p.open => {
            let pull = &mut st.forgejo.pulls[i];
            pull.open = false;
            pull.closed_ms = Some(now);
            pull.frozen_head = Some(head_now);
        }
        Some("open") if !p.open => {
            if p.merged {
                return api_error(StatusCode::CONFLICT, "cannot reopen a merged pull request");
            }
            if !st.forgejo.repo.branches.contains_key(&p.head) {
                return api_error(
                    StatusCode::CONFLICT,
                    "cannot reopen: the head branch no longer exists",
                );
            }
            if st
                .forgejo
                .pulls
                .iter()
                .any(|o| o.open && o.head == p.head && o.base == p.base)
            {
                return api_error(
                    StatusCode::CONFLICT,
                    "pull request already exists for these targets",
                );
            }
            let pull = &mut st.forgejo.pulls[i];
            pull.open = true;
            pull.closed_ms = None;
            pull.frozen_head = None;
        }
        Some("open" | "closed") => {}
        Some(other) => return unprocessable(&format!("[State]: unknown state {other:?}")),
    }
    let pull = &mut st.forgejo.pulls[i];
    if let Some(t) = body.title {
        pull.title = t;
    }
    if let Some(b) = body.body {
        pull.body = b;
    }
    if let Some(base) = body.base {
        pull.base = base;
    }
    pull.updated_ms = now;
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    // the spec gives 201 for a successful edit
    (
        StatusCode::CREATED,
        Json(pull_json(&shared, &st.forgejo, &st.forgejo.pulls[i])),
    )
        .into_response()
}

async fn is_merged(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    match find_pull(&st.forgejo, &index) {
        Some(i) if st.forgejo.pulls[i].merged => StatusCode::NO_CONTENT.into_response(),
        _ => not_found(),
    }
}

const MERGE_STYLES: [&str; 6] = [
    "merge",
    "rebase",
    "rebase-merge",
    "squash",
    "fast-forward-only",
    "manually-merged",
];

#[derive(Deserialize)]
struct MergePullRequestOption {
    #[serde(rename = "Do")]
    action: Option<String>,
    #[serde(rename = "MergeTitleField")]
    title: Option<String>,
    #[serde(rename = "MergeMessageField")]
    message: Option<String>,
    head_commit_id: Option<String>,
    delete_branch_after_merge: Option<bool>,
}

/// Every merge style lands the head tree on the base as one new commit (no conflicts exist in the sandbox).
async fn merge_pull(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
    body: Result<Json<MergePullRequestOption>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    match body.action.as_deref() {
        Some(a) if MERGE_STYLES.contains(&a) => {}
        _ => {
            return unprocessable(
                "[Do]: Required, one of merge, rebase, rebase-merge, squash, fast-forward-only, manually-merged",
            );
        }
    }
    let now = util::now_ms();
    let mut st = shared.lock();
    let Some(i) = find_pull(&st.forgejo, &index) else {
        return not_found();
    };
    let p = st.forgejo.pulls[i].clone();
    if p.merged {
        return api_error(StatusCode::METHOD_NOT_ALLOWED, "The PR is already merged");
    }
    if !p.open {
        return not_found();
    }
    if is_wip(&p.title) {
        return api_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "The PR is a work in progress and cannot be merged",
        );
    }
    let (Some(head), Some(base)) = (
        st.forgejo.repo.head(&p.head).cloned(),
        st.forgejo.repo.head(&p.base).cloned(),
    ) else {
        return api_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "Please try again later: the pull request is not mergeable",
        );
    };
    if let Some(expected) = body.head_commit_id.filter(|h| !h.is_empty())
        && expected != head.sha
    {
        return api_error(
            StatusCode::CONFLICT,
            "head commit of the pull request has changed",
        );
    }
    let message = match (
        body.title.filter(|t| !t.is_empty()),
        body.message.filter(|m| !m.is_empty()),
    ) {
        (Some(t), Some(m)) => format!("{t}\n\n{m}"),
        (Some(t), None) => t,
        (None, m) => {
            let t = format!(
                "Merge pull request '{}' (#{}) from {} into {}",
                p.title, p.number, p.head, p.base
            );
            m.map_or(t.clone(), |m| format!("{t}\n\n{m}"))
        }
    };
    // `merge` and `rebase-merge` make a merge commit (base first, head second); the other styles a linear one
    let second = matches!(body.action.as_deref(), Some("merge" | "rebase-merge"))
        .then_some(head.sha.as_str());
    let sha =
        st.forgejo
            .repo
            .add_commit([Some(&base.sha), second], head.tree.clone(), &message, now);
    st.forgejo.repo.branches.insert(p.base.clone(), sha.clone());
    if body.delete_branch_after_merge == Some(true) {
        st.forgejo.repo.branches.remove(&p.head);
    }
    let pull = &mut st.forgejo.pulls[i];
    pull.open = false;
    pull.merged = true;
    pull.merge_commit_sha = Some(sha.clone());
    pull.frozen_head = Some(head.sha);
    pull.merged_ms = Some(now);
    pull.closed_ms = Some(now);
    pull.updated_ms = now;
    st.forgejo.merges += 1;
    st.after_commit(&shared.config, &p.base, &sha, now);
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    StatusCode::OK.into_response()
}

const STATUS_SEVERITY: [&str; 4] = ["success", "pending", "failure", "error"];

async fn combined_status(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, reference)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let now = util::now_ms();
    let st = shared.lock();
    let Some(commit) = st.forgejo.repo.resolve(&reference) else {
        return api_error(
            StatusCode::NOT_FOUND,
            &format!("object does not exist [id: {reference}, rel_path: ]"),
        );
    };
    let api = api_repo_url(&shared);
    // newest status per context, as Forgejo combines them
    let mut latest: Vec<&StatusRecord> = Vec::new();
    for s in st
        .forgejo
        .statuses
        .iter()
        .rev()
        .filter(|s| s.sha == commit.sha)
    {
        if !latest.iter().any(|l| l.context == s.context) {
            latest.push(s);
        }
    }
    let statuses: Vec<Value> = latest
        .iter()
        .map(|s| {
            let (state, description) = s.view(now);
            json!({
                "id": s.id,
                "status": state,
                "target_url": format!("{}/actions/runs/{}", repo_url(&shared), s.id),
                "description": description,
                "url": format!("{api}/statuses/{}", s.sha),
                "context": s.context,
                "creator": user_json(&shared, BOT_LOGIN),
                "created_at": util::iso_s(s.created_ms),
                "updated_at": util::iso_s(s.created_ms.max(s.settle_ms.min(now))),
            })
        })
        .collect();
    // the most severe state wins; no status at all reads as pending (nothing has reported yet)
    let state = latest
        .iter()
        .map(|s| s.view(now).0)
        .max_by_key(|st| STATUS_SEVERITY.iter().position(|x| x == st).unwrap_or(0))
        .unwrap_or("pending");
    Json(json!({
        "state": state,
        "sha": commit.sha,
        "total_count": statuses.len(),
        "statuses": statuses,
        "repository": repo_json(&shared, &st.forgejo.repo),
        "commit_url": format!("{api}/git/commits/{}", commit.sha),
        "url": format!("{api}/commits/{}/status", commit.sha),
    }))
    .into_response()
}

/// `GET /git/commits/{sha}` (repoGetSingleCommit, a Commit object) and its `{sha}.diff` form (the raw diff
/// against the first parent). `sha` may also be a branch name or an unambiguous prefix.
async fn get_commit(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, sha)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let (reference, as_diff) = match sha.strip_suffix(".diff") {
        Some(s) => (s, true),
        None => (sha.as_str(), false),
    };
    if !valid_branch_name(reference) {
        return unprocessable(&format!("no valid ref or sha: {reference}"));
    }
    let st = shared.lock();
    let repo = &st.forgejo.repo;
    let Some(commit) = repo.resolve(reference) else {
        return not_found();
    };
    let parent_tree = repo.parent_tree(commit);
    if as_diff {
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Body::from(git::diff(&parent_tree, &commit.tree)))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    // each part is on unless its query flag says false, as in Forgejo
    let on = |k: &str| q.get(k).is_none_or(|v| v != "false" && v != "0");
    let api = api_repo_url(&shared);
    let date = util::iso_s(commit.time_ms);
    let who = json!({"name": "Loams", "email": shared.config.tokens.zulip_email, "date": date});
    let stats = git::diff_stat(&parent_tree, &commit.tree);
    let parents: Vec<Value> = commit
        .parent
        .iter()
        .chain(commit.merge_parent.iter())
        .map(|p| json!({"url": format!("{api}/git/commits/{p}"), "sha": p}))
        .collect();
    let tree_sha = git::tree_sha(&commit.tree);
    let (additions, deletions) = stats
        .iter()
        .fold((0, 0), |(a, d), f| (a + f.additions, d + f.deletions));
    Json(json!({
        "url": format!("{api}/git/commits/{}", commit.sha),
        "sha": commit.sha,
        "created": date,
        "html_url": format!("{}/commit/{}", repo_url(&shared), commit.sha),
        "commit": {
            "url": format!("{api}/git/commits/{}", commit.sha),
            "author": who,
            "committer": who,
            "message": commit.message,
            "tree": {"url": format!("{api}/git/trees/{tree_sha}"), "sha": tree_sha, "created": date},
            "verification": if on("verification") {
                json!({"verified": false, "reason": "gpg.error.not_signed_commit", "signature": "", "signer": null, "payload": ""})
            } else {
                Value::Null
            },
        },
        "author": user_json(&shared, BOT_LOGIN),
        "committer": user_json(&shared, BOT_LOGIN),
        "parents": parents,
        "files": if on("files") {
            json!(stats.iter().map(|f| json!({"filename": f.path, "status": f.status})).collect::<Vec<_>>())
        } else {
            Value::Null
        },
        "stats": if on("stat") {
            json!({"total": additions + deletions, "additions": additions, "deletions": deletions})
        } else {
            Value::Null
        },
    }))
    .into_response()
}

fn label_json(shared: &Shared, l: &Label) -> Value {
    json!({
        "id": l.id,
        "name": l.name,
        "exclusive": l.exclusive,
        "is_archived": l.is_archived,
        "color": l.color,
        "description": l.description,
        "url": format!("{}/labels/{}", api_repo_url(shared), l.id),
    })
}

/// Forgejo's label order: by name (ids break ties between equal names, which Forgejo allows).
fn sorted_labels<'a>(labels: impl Iterator<Item = &'a Label>) -> Vec<&'a Label> {
    let mut v: Vec<&Label> = labels.collect();
    v.sort_by(|a, b| a.name.cmp(&b.name).then(a.id.cmp(&b.id)));
    v
}

async fn list_labels(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let page = q
        .get("page")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let limit = q
        .get("limit")
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(DEFAULT_PAGE_LIMIT)
        .clamp(1, MAX_PAGE_LIMIT);
    let st = shared.lock();
    let all = sorted_labels(st.forgejo.labels.iter());
    let total = all.len();
    let out: Vec<Value> = all
        .into_iter()
        .skip((page - 1).saturating_mul(limit))
        .take(limit)
        .map(|l| label_json(&shared, l))
        .collect();
    let mut resp = Json(out).into_response();
    resp.headers_mut().insert("x-total-count", total.into());
    resp
}

#[derive(Deserialize)]
struct CreateLabelOption {
    name: Option<String>,
    color: Option<String>,
    description: Option<String>,
    exclusive: Option<bool>,
    is_archived: Option<bool>,
}

/// `#rgb`, `#rrggbb`, with or without `#`, to Forgejo's stored six lower-case digits.
fn normalize_color(color: &str) -> Option<String> {
    let hex = color.trim().trim_start_matches('#');
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match hex.len() {
        6 => Some(hex.to_ascii_lowercase()),
        3 => Some(
            hex.chars()
                .flat_map(|c| [c, c])
                .collect::<String>()
                .to_ascii_lowercase(),
        ),
        _ => None,
    }
}

/// `POST /labels` (issueCreateLabel). Forgejo does not require label names to be unique, and neither does this.
async fn create_label(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo)): Path<(String, String)>,
    body: Result<Json<CreateLabelOption>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let Some(name) = body.name.filter(|n| !n.trim().is_empty()) else {
        return unprocessable("[Name]: Required");
    };
    if name.chars().count() > MAX_LABEL_NAME_CHARS {
        return unprocessable("[Name]: MaxSize");
    }
    let Some(raw_color) = body.color.filter(|c| !c.trim().is_empty()) else {
        return unprocessable("[Color]: Required");
    };
    let Some(color) = normalize_color(&raw_color) else {
        return unprocessable(&format!("bad color code: {raw_color}"));
    };
    let description = body.description.unwrap_or_default();
    if description.chars().count() > MAX_LABEL_DESCRIPTION_CHARS {
        return unprocessable("[Description]: MaxSize");
    }
    let mut st = shared.lock();
    if st.forgejo.labels.len() >= MAX_LABELS {
        return unprocessable(&format!("the sandbox keeps at most {MAX_LABELS} labels"));
    }
    let label = Label {
        id: st.forgejo.labels.iter().map(|l| l.id).max().unwrap_or(0) + 1,
        name,
        color,
        description,
        exclusive: body.exclusive.unwrap_or(false),
        is_archived: body.is_archived.unwrap_or(false),
    };
    let out = label_json(&shared, &label);
    st.forgejo.labels.push(label);
    if let Err(r) = persist_or_500(&shared, &st) {
        return r;
    }
    (StatusCode::CREATED, Json(out)).into_response()
}

fn pull_labels_json(shared: &Shared, st: &ForgejoState, p: &Pull) -> Value {
    let on_pull = st.labels.iter().filter(|l| p.labels.contains(&l.id));
    json!(
        sorted_labels(on_pull)
            .into_iter()
            .map(|l| label_json(shared, l))
            .collect::<Vec<_>>()
    )
}

/// `GET /issues/{index}/labels` (issueGetLabels); pull requests share the issue index space.
async fn issue_labels(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let st = shared.lock();
    match find_pull(&st.forgejo, &index) {
        Some(i) => {
            Json(pull_labels_json(&shared, &st.forgejo, &st.forgejo.pulls[i])).into_response()
        }
        None => not_found(),
    }
}

#[derive(Deserialize)]
struct IssueLabelsOption {
    #[serde(default)]
    labels: Vec<Value>,
}

/// `POST /issues/{index}/labels` (issueAddLabel): adds labels named by id or by name and answers the full list.
/// As in Forgejo, ids and names that match no label of the repository are skipped, not an error.
async fn add_issue_labels(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((owner, repo, index)): Path<(String, String, String)>,
    body: Result<Json<IssueLabelsOption>, JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &owner, &repo) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    if body.labels.len() > MAX_LABELS_PER_REQUEST {
        return unprocessable(&format!(
            "[Labels]: at most {MAX_LABELS_PER_REQUEST} labels per request"
        ));
    }
    let mut st = shared.lock();
    let Some(i) = find_pull(&st.forgejo, &index) else {
        return not_found();
    };
    let mut ids = Vec::new();
    for item in &body.labels {
        let found: Vec<u64> = match item {
            Value::Number(n) => n
                .as_u64()
                .filter(|id| st.forgejo.labels.iter().any(|l| l.id == *id))
                .into_iter()
                .collect(),
            Value::String(name) => st
                .forgejo
                .labels
                .iter()
                .filter(|l| &l.name == name)
                .map(|l| l.id)
                .collect(),
            _ => {
                return unprocessable("[Labels]: items must be label ids or label names");
            }
        };
        ids.extend(found);
    }
    let now = util::now_ms();
    let pull = &mut st.forgejo.pulls[i];
    let before = pull.labels.len();
    for id in ids {
        if !pull.labels.contains(&id) {
            pull.labels.push(id);
        }
    }
    if pull.labels.len() != before {
        pull.updated_ms = now;
        if let Err(r) = persist_or_500(&shared, &st) {
            return r;
        }
    }
    Json(pull_labels_json(&shared, &st.forgejo, &st.forgejo.pulls[i])).into_response()
}
