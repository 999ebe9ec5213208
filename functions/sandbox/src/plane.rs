//! Fake Plane (`/api/v1/workspaces/{slug}`, `X-API-Key`): work items with external ids, states, comments.

use crate::{PlaneSeed, Shared, util};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

const MAX_NAME_CHARS: usize = 255;
const MAX_PER_PAGE: usize = 100;
const PRIORITIES: [&str; 5] = ["none", "low", "medium", "high", "urgent"];

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct PlaneStateRow {
    id: String,
    name: String,
    group: String,
    color: String,
    sequence: f64,
    default: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Issue {
    id: String,
    sequence_id: u64,
    name: String,
    description_html: String,
    priority: String,
    state: String,
    external_source: Option<String>,
    external_id: Option<String>,
    created_ms: i64,
    updated_ms: i64,
    completed_ms: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Comment {
    id: String,
    issue: String,
    comment_html: String,
    access: String,
    external_source: Option<String>,
    external_id: Option<String>,
    created_ms: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct PlaneState {
    states: Vec<PlaneStateRow>,
    pub issues: Vec<Issue>,
    pub comments: Vec<Comment>,
    workspace_id: String,
    user_id: String,
}

impl PlaneState {
    pub fn seed(seed: &PlaneSeed) -> Self {
        let groups = [
            ("Backlog", "backlog", "#60646C"),
            ("Todo", "unstarted", "#60646C"),
            ("In Progress", "started", "#F59E0B"),
            ("Done", "completed", "#46A758"),
            ("Cancelled", "cancelled", "#9AA4BC"),
        ];
        let states = groups
            .iter()
            .zip(1u32..)
            .map(|(&(name, group, color), i)| PlaneStateRow {
                id: util::uuid_from(&[&seed.project_id, "state", group]),
                name: name.into(),
                group: group.into(),
                color: color.into(),
                sequence: f64::from(i) * 15_000.0,
                default: group == "backlog",
            })
            .collect();
        PlaneState {
            states,
            issues: Vec::new(),
            comments: Vec::new(),
            workspace_id: util::uuid_from(&[&seed.workspace, "workspace"]),
            user_id: util::uuid_from(&[&seed.workspace, "bot"]),
        }
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    let base = "/api/v1/workspaces/{slug}/projects/{project_id}";
    Router::new()
        .route(&format!("{base}/"), get(get_project))
        .route(
            &format!("{base}/work-items/"),
            get(list_issues).post(create_issue),
        )
        .route(
            &format!("{base}/work-items/{{pk}}/"),
            get(get_issue).patch(patch_issue),
        )
        .route(
            &format!("{base}/work-items/{{issue_id}}/comments/"),
            get(list_comments).post(create_comment),
        )
        .route(
            &format!("{base}/work-items/{{issue_id}}/comments/{{pk}}/"),
            get(get_comment),
        )
        .route(&format!("{base}/states/"), get(list_states))
}

fn error(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

/// A body too large keeps its 413; any other unreadable body is DRF's 400 parse error.
fn rejected(e: &axum::extract::rejection::JsonRejection) -> Response {
    let status = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        e.status()
    } else {
        StatusCode::BAD_REQUEST
    };
    error(
        status,
        json!({"detail": format!("JSON parse error - {}", e.body_text())}),
    )
}

fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        json!({"error": "The requested resource does not exist."}),
    )
}

fn field_error(field: &str, msg: &str) -> Response {
    error(StatusCode::BAD_REQUEST, json!({ field: [msg] }))
}

/// Auth first (401 with DRF's `detail`), then the workspace and project must be the seeded ones (404).
fn check(
    shared: &Shared,
    headers: &HeaderMap,
    slug: &str,
    project_id: &str,
) -> Result<(), Response> {
    match headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        None => {
            return Err(error(
                StatusCode::UNAUTHORIZED,
                json!({"detail": "Authentication credentials were not provided."}),
            ));
        }
        Some(k) if k != shared.config.tokens.plane_api_key => {
            return Err(error(
                StatusCode::UNAUTHORIZED,
                json!({"detail": "Given API token is not valid"}),
            ));
        }
        Some(_) => {}
    }
    let p = &shared.config.plane;
    if slug != p.workspace || project_id != p.project_id {
        return Err(not_found());
    }
    Ok(())
}

fn issue_json(shared: &Shared, st: &PlaneState, i: &Issue) -> Value {
    let p = &shared.config.plane;
    json!({
        "id": i.id,
        "type_id": null,
        "created_at": util::iso_ms(i.created_ms),
        "updated_at": util::iso_ms(i.updated_ms),
        "deleted_at": null,
        "point": null,
        "name": i.name,
        "description_html": i.description_html,
        "description_binary": null,
        "priority": i.priority,
        "start_date": null,
        "target_date": null,
        "sequence_id": i.sequence_id,
        "sort_order": 65535.0,
        "completed_at": i.completed_ms.map(util::iso_ms),
        "archived_at": null,
        "is_draft": false,
        "external_source": i.external_source,
        "external_id": i.external_id,
        "created_by": st.user_id,
        "updated_by": st.user_id,
        "project": p.project_id,
        "workspace": st.workspace_id,
        "parent": null,
        "state": i.state,
        "estimate_point": null,
        "type": null,
        "assignees": [],
        "labels": [],
    })
}

fn paginated(results: Vec<Value>, total: usize, per_page: usize, page: usize) -> Value {
    let pages = total.div_ceil(per_page).max(1);
    json!({
        "grouped_by": null,
        "sub_grouped_by": null,
        "total_count": total,
        "next_cursor": format!("{per_page}:{}:0", page + 1),
        "prev_cursor": format!("{per_page}:{}:0", page.saturating_sub(1)),
        "next_page_results": (page + 1) * per_page < total,
        "prev_page_results": page > 0,
        "count": results.len(),
        "total_pages": pages,
        "total_results": total,
        "extra_stats": null,
        "results": results,
    })
}

/// Plane's cursor is `per_page:page:offset`.
fn page_params(q: &HashMap<String, String>) -> Result<(usize, usize), Response> {
    let per_page = match q.get("per_page") {
        None => MAX_PER_PAGE,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| field_error("per_page", "Invalid per_page"))?
            .clamp(1, MAX_PER_PAGE),
    };
    let page = match q.get("cursor") {
        None => 0,
        Some(c) => {
            let mut parts = c.split(':');
            let page = parts.nth(1).and_then(|p| p.parse::<usize>().ok());
            page.ok_or_else(|| field_error("cursor", "Invalid cursor format"))?
        }
    };
    Ok((per_page, page))
}

async fn list_issues(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let (per_page, page) = match page_params(&q) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let st = shared.lock();
    let matching: Vec<&Issue> = st
        .plane
        .issues
        .iter()
        .filter(|i| {
            q.get("external_id")
                .is_none_or(|e| i.external_id.as_deref() == Some(e.as_str()))
        })
        .filter(|i| {
            q.get("external_source")
                .is_none_or(|e| i.external_source.as_deref() == Some(e.as_str()))
        })
        .collect();
    let total = matching.len();
    // newest first, Plane's default `-created_at` order
    let results = matching
        .iter()
        .rev()
        .skip(page * per_page)
        .take(per_page)
        .map(|i| issue_json(&shared, &st.plane, i))
        .collect();
    Json(paginated(results, total, per_page, page)).into_response()
}

#[derive(Deserialize)]
struct IssueBody {
    name: Option<String>,
    description_html: Option<String>,
    priority: Option<String>,
    state: Option<String>,
    external_source: Option<String>,
    external_id: Option<String>,
}

fn validate(st: &PlaneState, body: &IssueBody) -> Result<(), Response> {
    if let Some(name) = &body.name {
        if name.trim().is_empty() {
            return Err(field_error("name", "This field may not be blank."));
        }
        if name.chars().count() > MAX_NAME_CHARS {
            return Err(field_error(
                "name",
                "Ensure this field has no more than 255 characters.",
            ));
        }
    }
    if let Some(p) = &body.priority
        && !PRIORITIES.contains(&p.as_str())
    {
        return Err(field_error(
            "priority",
            &format!("\"{p}\" is not a valid choice."),
        ));
    }
    if let Some(s) = &body.state
        && !st.states.iter().any(|x| &x.id == s)
    {
        return Err(field_error(
            "state",
            &format!("Invalid pk \"{s}\" - object does not exist."),
        ));
    }
    Ok(())
}

async fn create_issue(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id)): Path<(String, String)>,
    body: Result<Json<IssueBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let Some(name) = body.name.clone() else {
        return field_error("name", "This field is required.");
    };
    let mut st = shared.lock();
    if let Err(r) = validate(&st.plane, &body) {
        return r;
    }
    if let (Some(src), Some(ext)) = (&body.external_source, &body.external_id)
        && let Some(existing) = st.plane.issues.iter().find(|i| {
            i.external_source.as_ref() == Some(src) && i.external_id.as_ref() == Some(ext)
        })
    {
        return error(
            StatusCode::CONFLICT,
            json!({"error": "Issue with the same external id and external source already exists", "id": existing.id}),
        );
    }
    let now = util::now_ms();
    let sequence_id = st.plane.issues.len() as u64 + 1;
    let default_state = st
        .plane
        .states
        .iter()
        .find(|s| s.default)
        .map(|s| s.id.clone())
        .unwrap_or_default();
    let issue = Issue {
        id: util::uuid_from(&[
            &shared.config.plane.project_id,
            "issue",
            &sequence_id.to_string(),
        ]),
        sequence_id,
        name,
        description_html: body.description_html.unwrap_or_else(|| "<p></p>".into()),
        priority: body.priority.unwrap_or_else(|| "none".into()),
        state: body.state.unwrap_or(default_state),
        external_source: body.external_source,
        external_id: body.external_id,
        created_ms: now,
        updated_ms: now,
        completed_ms: None,
    };
    let out = issue_json(&shared, &st.plane, &issue);
    st.plane.issues.push(issue);
    if let Err(e) = shared.persist(&st) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": e.to_string()}),
        );
    }
    (StatusCode::CREATED, Json(out)).into_response()
}

async fn get_issue(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id, pk)): Path<(String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let st = shared.lock();
    match st.plane.issues.iter().find(|i| i.id == pk) {
        Some(i) => Json(issue_json(&shared, &st.plane, i)).into_response(),
        None => not_found(),
    }
}

async fn patch_issue(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id, pk)): Path<(String, String, String)>,
    body: Result<Json<IssueBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let mut st = shared.lock();
    let Some(idx) = st.plane.issues.iter().position(|i| i.id == pk) else {
        return not_found();
    };
    if let Err(r) = validate(&st.plane, &body) {
        return r;
    }
    if let (Some(src), Some(ext)) = (&body.external_source, &body.external_id)
        && let Some(other) = st.plane.issues.iter().find(|i| {
            i.id != pk
                && i.external_source.as_ref() == Some(src)
                && i.external_id.as_ref() == Some(ext)
        })
    {
        return error(
            StatusCode::CONFLICT,
            json!({"error": "Issue with the same external id and external source already exists", "id": other.id}),
        );
    }
    let now = util::now_ms();
    let completed_state = body.state.as_ref().map(|s| {
        st.plane
            .states
            .iter()
            .any(|x| &x.id == s && x.group == "completed")
    });
    let issue = &mut st.plane.issues[idx];
    if let Some(v) = body.name {
        issue.name = v;
    }
    if let Some(v) = body.description_html {
        issue.description_html = v;
    }
    if let Some(v) = body.priority {
        issue.priority = v;
    }
    if let Some(v) = body.state {
        issue.state = v;
        issue.completed_ms = if completed_state == Some(true) {
            Some(now)
        } else {
            None
        };
    }
    if let Some(v) = body.external_source {
        issue.external_source = Some(v);
    }
    if let Some(v) = body.external_id {
        issue.external_id = Some(v);
    }
    issue.updated_ms = now;
    let issue = issue.clone();
    if let Err(e) = shared.persist(&st) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": e.to_string()}),
        );
    }
    Json(issue_json(&shared, &st.plane, &issue)).into_response()
}

async fn list_states(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id)): Path<(String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let st = shared.lock();
    let results: Vec<Value> = st
        .plane
        .states
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "created_at": "2026-01-01T00:00:00.000000Z",
                "updated_at": "2026-01-01T00:00:00.000000Z",
                "deleted_at": null,
                "name": s.name,
                "description": "",
                "color": s.color,
                "slug": s.name.to_lowercase().replace(' ', "-"),
                "sequence": s.sequence,
                "group": s.group,
                "is_triage": false,
                "default": s.default,
                "external_source": null,
                "external_id": null,
                "created_by": st.plane.user_id,
                "updated_by": st.plane.user_id,
                "project": shared.config.plane.project_id,
                "workspace": st.plane.workspace_id,
            })
        })
        .collect();
    let total = results.len();
    Json(paginated(results, total, MAX_PER_PAGE, 0)).into_response()
}

#[derive(Deserialize)]
struct CommentBody {
    comment_html: Option<String>,
    access: Option<String>,
    external_source: Option<String>,
    external_id: Option<String>,
}

const MAX_COMMENT_BYTES: usize = 256 * 1024;

async fn create_comment(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id, issue_id)): Path<(String, String, String)>,
    body: Result<Json<CommentBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return rejected(&e),
    };
    let mut st = shared.lock();
    if !st.plane.issues.iter().any(|i| i.id == issue_id) {
        return not_found();
    }
    let html = body.comment_html.unwrap_or_default();
    if html.trim().is_empty() {
        return field_error("comment_html", "This field may not be blank.");
    }
    if html.len() > MAX_COMMENT_BYTES {
        return field_error("comment_html", "Comment is too long.");
    }
    let access = body.access.unwrap_or_else(|| "INTERNAL".into());
    if access != "INTERNAL" && access != "EXTERNAL" {
        return field_error("access", &format!("\"{access}\" is not a valid choice."));
    }
    // Plane looks for the external id in the whole project, not just this work item, so its 409 can name a
    // comment on another item.
    if let (Some(src), Some(ext)) = (&body.external_source, &body.external_id)
        && let Some(existing) = st.plane.comments.iter().find(|c| {
            c.external_source.as_ref() == Some(src) && c.external_id.as_ref() == Some(ext)
        })
    {
        return error(
            StatusCode::CONFLICT,
            json!({"error": "Issue Comment with the same external id and external source already exists",
                   "id": existing.id}),
        );
    }
    let now = util::now_ms();
    let n = st.plane.comments.len() + 1;
    let comment = Comment {
        id: util::uuid_from(&[&shared.config.plane.project_id, "comment", &n.to_string()]),
        issue: issue_id,
        comment_html: html,
        access,
        external_source: body.external_source,
        external_id: body.external_id,
        created_ms: now,
    };
    let out = comment_json(&shared, &st.plane, &comment);
    st.plane.comments.push(comment);
    if let Err(e) = shared.persist(&st) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": e.to_string()}),
        );
    }
    (StatusCode::CREATED, Json(out)).into_response()
}

fn comment_json(shared: &Shared, st: &PlaneState, c: &Comment) -> Value {
    json!({
    "id": c.id,
    "is_member": true,
    "created_at": util::iso_ms(c.created_ms),
    "updated_at": util::iso_ms(c.created_ms),
    "deleted_at": null,
    "comment_html": c.comment_html,
    "attachments": [],
    "access": c.access,
    "external_source": c.external_source,
    "external_id": c.external_id,
    "edited_at": null,
    "created_by": st.user_id,
    "updated_by": st.user_id,
    "project": shared.config.plane.project_id,
    "workspace": st.workspace_id,
    "issue": c.issue,
    "actor": st.user_id,
    "parent": null,
    })
}

/// `GET .../work-items/{issue_id}/comments/` (list_work_item_comments_2): the item's comments, newest first.
async fn list_comments(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id, issue_id)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let (per_page, page) = match page_params(&q) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let st = shared.lock();
    if !st.plane.issues.iter().any(|i| i.id == issue_id) {
        return not_found();
    }
    let matching: Vec<&Comment> = st
        .plane
        .comments
        .iter()
        .filter(|c| c.issue == issue_id)
        .collect();
    let results = matching
        .iter()
        .rev()
        .skip(page * per_page)
        .take(per_page)
        .map(|c| comment_json(&shared, &st.plane, c))
        .collect();
    Json(paginated(results, matching.len(), per_page, page)).into_response()
}

/// `GET .../work-items/{issue_id}/comments/{pk}/` (retrieve_work_item_comment_2): 404 unless the comment is on
/// that work item, as Plane filters by both.
async fn get_comment(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id, issue_id, pk)): Path<(String, String, String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let st = shared.lock();
    match st
        .plane
        .comments
        .iter()
        .find(|c| c.id == pk && c.issue == issue_id)
    {
        Some(c) => Json(comment_json(&shared, &st.plane, c)).into_response(),
        None => not_found(),
    }
}

/// `GET /workspaces/{slug}/projects/{pk}/` (retrieve_project): the seeded project, with the identifier that
/// prefixes work item keys.
async fn get_project(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((slug, project_id)): Path<(String, String)>,
) -> Response {
    if let Err(r) = check(&shared, &headers, &slug, &project_id) {
        return r;
    }
    let p = &shared.config.plane;
    let st = shared.lock();
    let created = "2026-01-01T00:00:00.000000Z";
    let default_state = st
        .plane
        .states
        .iter()
        .find(|s| s.default)
        .map(|s| s.id.clone());
    let cover = format!("{}/static/project-cover.jpg", shared.urls.plane);
    // two literals: one would pass serde_json's macro recursion limit
    let mut out = json!({
        "id": p.project_id,
        "total_members": 1,
        "total_cycles": 0,
        "total_modules": 0,
        "is_member": true,
        "sort_order": 65535.0,
        "member_role": 20,
        "is_deployed": false,
        // The description types this as a non-null string, so the seeded project has a cover image.
        "cover_image_url": cover,
        "created_at": created,
        "updated_at": created,
        "deleted_at": null,
        "name": p.project_name,
        "description": "",
        "description_text": null,
        "description_html": null,
        "network": 2,
        "identifier": p.project_identifier,
        "emoji": null,
        "icon_prop": null,
        "module_view": true,
        "cycle_view": true,
        "issue_views_view": true,
        "page_view": true,
        "intake_view": false,
        "is_time_tracking_enabled": false,
        "is_issue_type_enabled": false,
        "guest_view_all_features": false,
        "cover_image": cover,
        "archive_in": 0,
        "close_in": 0,
        "logo_props": {},
        "archived_at": null,
        "timezone": "UTC",
    });
    let rest = json!({
        "external_source": null,
        "external_id": null,
        "created_by": st.plane.user_id,
        "updated_by": st.plane.user_id,
        "workspace": st.plane.workspace_id,
        "default_assignee": null,
        "project_lead": null,
        "cover_image_asset": null,
        "estimate": null,
        "default_state": default_state,
    });
    if let (Some(o), Value::Object(r)) = (out.as_object_mut(), rest) {
        o.extend(r);
    }
    Json(out).into_response()
}
