//! Forgejo (and Gitea) webhooks, notes/apps.md 4.2: `X-Forgejo-Signature` (or `X-Gitea-Signature`) is the hex
//! HMAC-SHA256 of the raw body, `X-Forgejo-Event` names the event, `X-Forgejo-Delivery` is a UUID. Only the JSON
//! content type is accepted: with the form type the signature covers the decoded payload, not the body.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde::{Deserialize, Serialize};

use super::{
    AppEvent, clean, delivery_id, delivery_key, header_str, record_reply, verify_hmac_hex,
};
use crate::{ApiError, ApiState};

/// Largest Forgejo delivery: push payloads list commits and PR payloads carry whole repository objects.
pub const FORGEJO_MAX_BYTES: usize = 1024 * 1024;
/// Most commits of a push kept in the recorded event (the count is kept whole).
const MAX_COMMITS: usize = 20;
const MAX_TEXT: usize = 500;
const MAX_NAME: usize = 255;

/// An authenticated Forgejo delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForgejoDelivery {
    /// `X-Forgejo-Delivery` (or `X-Gitea-Delivery`), when it is a plausible id.
    pub delivery: Option<String>,
    /// `X-Forgejo-Event` as sent.
    pub event_name: String,
    /// The parsed event; `None` for an event this API does not handle (answered 200, nothing recorded).
    pub event: Option<ForgejoEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ForgejoEvent {
    PullRequest(PullRequestEvent),
    Push(PushEvent),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequestEvent {
    /// `opened`, `closed`, `synchronized`, ...; a merge arrives as `closed` with `merged`.
    pub action: String,
    pub number: u64,
    pub title: String,
    pub merged: bool,
    pub head_ref: String,
    pub head_sha: String,
    pub base_ref: String,
    pub merge_sha: Option<String>,
    /// `owner/name`.
    pub repo: String,
    pub sender: String,
    /// The factory run whose branch `factory/<run id>` this event merged; set only for `closed` with `merged`.
    pub merged_factory_run: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushEvent {
    /// `refs/heads/<branch>` or `refs/tags/<tag>`.
    pub git_ref: String,
    pub before: String,
    pub after: String,
    pub repo: String,
    pub pusher: String,
    /// The first commits of the push (at most 20).
    pub commits: Vec<PushCommit>,
    /// How many commits the payload listed.
    pub total_commits: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCommit {
    pub id: String,
    /// The first line of the message, cut to 500 bytes.
    pub title: String,
}

#[derive(Deserialize)]
struct RawUser {
    #[serde(default)]
    login: String,
}

#[derive(Deserialize)]
struct RawRepo {
    full_name: String,
}

#[derive(Deserialize)]
struct RawBranch {
    #[serde(rename = "ref")]
    git_ref: String,
    sha: String,
}

#[derive(Deserialize)]
struct RawPull {
    #[serde(default)]
    title: String,
    #[serde(default)]
    merged: bool,
    #[serde(default)]
    merge_commit_sha: Option<String>,
    head: RawBranch,
    base: RawBaseBranch,
}

#[derive(Deserialize)]
struct RawBaseBranch {
    #[serde(rename = "ref")]
    git_ref: String,
}

#[derive(Deserialize)]
struct RawPullRequestPayload {
    action: String,
    number: u64,
    pull_request: RawPull,
    repository: RawRepo,
    sender: Option<RawUser>,
}

#[derive(Deserialize)]
struct RawCommit {
    id: String,
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
struct RawPushPayload {
    #[serde(rename = "ref")]
    git_ref: String,
    before: String,
    after: String,
    #[serde(default)]
    commits: Vec<RawCommit>,
    repository: RawRepo,
    pusher: Option<RawUser>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::InvalidArgument(msg.into())
}

/// A commit id: 40 (SHA-1) or 64 (SHA-256) hex digits.
fn sha(field: &str, value: &str) -> Result<String, ApiError> {
    if (value.len() == 40 || value.len() == 64) && value.bytes().all(|c| c.is_ascii_hexdigit()) {
        Ok(value.to_ascii_lowercase())
    } else {
        Err(bad(format!("{field} is not a commit id")))
    }
}

/// A ref, repository or user name: non-empty, bounded, no control characters.
fn name(field: &str, value: &str) -> Result<String, ApiError> {
    if value.is_empty() || value.len() > MAX_NAME || value.chars().any(char::is_control) {
        Err(bad(format!("{field} must be 1..={MAX_NAME} bytes of text")))
    } else {
        Ok(value.to_owned())
    }
}

/// The run id of a factory branch: `factory/r-` + 16 lowercase hex digits (loams-factory's run id).
fn factory_run(branch: &str) -> Option<String> {
    let run = branch.strip_prefix("factory/")?;
    let hex = run.strip_prefix("r-")?;
    (hex.len() == 16
        && hex
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)))
    .then(|| run.to_owned())
}

fn pull_request(body: &[u8]) -> Result<PullRequestEvent, ApiError> {
    let raw: RawPullRequestPayload = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not a Forgejo pull_request payload: {e}")))?;
    let action = name("action", &raw.action)?;
    let head_ref = name("pull_request.head.ref", &raw.pull_request.head.git_ref)?;
    let merged = raw.pull_request.merged;
    // Forgejo sends an empty or null merge commit for unmerged PRs.
    let merge_sha = match raw.pull_request.merge_commit_sha.as_deref() {
        None | Some("") => None,
        Some(s) => Some(sha("pull_request.merge_commit_sha", s)?),
    };
    let merged_factory_run = if action == "closed" && merged {
        factory_run(&head_ref)
    } else {
        None
    };
    Ok(PullRequestEvent {
        number: raw.number,
        title: clean(&raw.pull_request.title, MAX_TEXT, false),
        merged,
        head_sha: sha("pull_request.head.sha", &raw.pull_request.head.sha)?,
        base_ref: name("pull_request.base.ref", &raw.pull_request.base.git_ref)?,
        merge_sha,
        repo: name("repository.full_name", &raw.repository.full_name)?,
        sender: login(raw.sender),
        merged_factory_run,
        head_ref,
        action,
    })
}

/// The login of a payload's user, as data; empty when the payload names none.
fn login(user: Option<RawUser>) -> String {
    user.map_or_else(String::new, |u| clean(&u.login, MAX_NAME, false))
}

fn push(body: &[u8]) -> Result<PushEvent, ApiError> {
    let raw: RawPushPayload = serde_json::from_slice(body)
        .map_err(|e| bad(format!("not a Forgejo push payload: {e}")))?;
    let total_commits = raw.commits.len();
    let commits = raw
        .commits
        .iter()
        .take(MAX_COMMITS)
        .map(|c| {
            Ok(PushCommit {
                id: sha("commits[].id", &c.id)?,
                title: clean(
                    c.message.lines().next().unwrap_or_default(),
                    MAX_TEXT,
                    false,
                ),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(PushEvent {
        git_ref: name("ref", &raw.git_ref)?,
        // A new branch has `before` all zeros and a deleted one `after` all zeros; both are still commit ids.
        before: sha("before", &raw.before)?,
        after: sha("after", &raw.after)?,
        repo: name("repository.full_name", &raw.repository.full_name)?,
        pusher: login(raw.pusher),
        commits,
        total_commits,
    })
}

/// Authenticates and parses one Forgejo delivery: the signature first (nothing of an unsigned body is read), then
/// the event. Errors: `Unauthenticated` (missing or wrong signature), `InvalidArgument` (too large, no event
/// header, a body that is not the event's payload).
pub fn parse_forgejo(
    headers: &HeaderMap,
    body: &[u8],
    secret: &[u8],
) -> Result<ForgejoDelivery, ApiError> {
    if body.len() > FORGEJO_MAX_BYTES {
        return Err(super::too_large(FORGEJO_MAX_BYTES));
    }
    let (signature, header) = match header_str(headers, "x-forgejo-signature") {
        Some(s) => (s, "X-Forgejo-Signature"),
        None => match header_str(headers, "x-gitea-signature") {
            Some(s) => (s, "X-Gitea-Signature"),
            None => {
                return Err(ApiError::Unauthenticated(
                    "missing X-Forgejo-Signature".into(),
                ));
            }
        },
    };
    verify_hmac_hex(secret, body, signature, header)?;
    let event_name = header_str(headers, "x-forgejo-event")
        .or_else(|| header_str(headers, "x-gitea-event"))
        .ok_or_else(|| bad("missing X-Forgejo-Event"))?;
    let event_name = name("X-Forgejo-Event", event_name)?;
    let delivery = delivery_id(
        header_str(headers, "x-forgejo-delivery")
            .or_else(|| header_str(headers, "x-gitea-delivery")),
    );
    let event = match event_name.as_str() {
        "pull_request" => Some(ForgejoEvent::PullRequest(pull_request(body)?)),
        "push" => Some(ForgejoEvent::Push(push(body)?)),
        _ => None,
    };
    Ok(ForgejoDelivery {
        delivery,
        event_name,
        event,
    })
}

async fn forgejo(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Response> {
    let (hook, body) = super::hook_and_body(
        &state.config.forgejo_hooks,
        &id,
        "forgejo",
        &headers,
        body,
        FORGEJO_MAX_BYTES,
    )
    .await?;
    let parsed =
        parse_forgejo(&headers, &body, hook.secret.as_bytes()).map_err(super::error_reply)?;
    let Some(event) = parsed.event else {
        return Ok(super::reply(
            axum::http::StatusCode::OK,
            serde_json::json!({"ignored": parsed.event_name}),
        ));
    };
    Ok(record_reply(
        &state,
        hook,
        delivery_key(parsed.delivery, &body),
        AppEvent::Forgejo(event),
    )
    .await)
}

pub(super) fn routes(state: ApiState) -> axum::Router {
    axum::Router::new()
        .route("/webhooks/forgejo/{id}", post(forgejo))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factory_branches_name_a_run() {
        assert_eq!(
            factory_run("factory/r-0123456789abcdef").as_deref(),
            Some("r-0123456789abcdef")
        );
        assert_eq!(factory_run("factory/r-0123456789ABCDEF"), None);
        assert_eq!(factory_run("factory/r-0123456789abcde"), None);
        assert_eq!(factory_run("feature/r-0123456789abcdef"), None);
        assert_eq!(factory_run("factory/r-0123456789abcdef/x"), None);
    }
}
