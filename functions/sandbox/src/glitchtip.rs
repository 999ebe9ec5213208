//! Fake GlitchTip (`/api/0`, bearer token): the seeded issue, its events, resolving it.
//!
//! Events are not stored one by one: production is "broken" over time spans, and while a span is open the issue
//! receives one event every `event_interval_ms`. Event k of a span is at `start + k * interval`, so counts and
//! pages are computed from the spans and no background task is needed.

use crate::{SandboxConfig, Shared, State, util};
use axum::extract::{Path, Query, State as AxState};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProducingMode {
    /// Events while the default branch fails the CI check.
    #[default]
    Auto,
    On,
    Off,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Span {
    start_ms: i64,
    end_ms: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct GlitchtipState {
    pub mode: ProducingMode,
    spans: Vec<Span>,
    interval_ms: i64,
    created_ms: i64,
    /// Stored status and when it was set; an event after a resolve reopens the issue (a regression).
    status: String,
    status_ms: i64,
}

impl GlitchtipState {
    pub fn seed(now: i64) -> Self {
        GlitchtipState {
            mode: ProducingMode::Auto,
            spans: Vec::new(),
            interval_ms: 1,
            created_ms: now,
            status: "unresolved".into(),
            status_ms: now,
        }
    }

    pub fn producing(&self) -> bool {
        self.spans.last().is_some_and(|s| s.end_ms.is_none())
    }

    /// Number of events of a span with timestamps in `[from, to)`, never later than `now`.
    fn span_count(&self, s: &Span, from: i64, to: i64, now: i64) -> u64 {
        let end = s.end_ms.unwrap_or(now + 1).min(now + 1).min(to);
        let lo = from.max(s.start_ms);
        if end <= lo {
            return 0;
        }
        let iv = self.interval_ms;
        // first k with start + k*iv >= lo, first k with start + k*iv >= end
        let first = (lo - s.start_ms + iv - 1).div_euclid(iv);
        let past = (end - s.start_ms + iv - 1).div_euclid(iv);
        u64::try_from(past - first).unwrap_or(0)
    }

    pub fn count_between(&self, from: i64, to: i64, now: i64) -> u64 {
        self.spans
            .iter()
            .map(|s| self.span_count(s, from, to, now))
            .sum()
    }

    pub fn event_count(&self, now: i64) -> u64 {
        self.count_between(i64::MIN / 2, i64::MAX / 2, now)
    }

    /// Timestamp of the event with chronological index `k`.
    fn event_time(&self, mut k: u64, now: i64) -> Option<i64> {
        for s in &self.spans {
            let n = self.span_count(s, i64::MIN / 2, i64::MAX / 2, now);
            if k < n {
                return Some(s.start_ms + i64::try_from(k).ok()? * self.interval_ms);
            }
            k -= n;
        }
        None
    }

    fn last_event(&self, now: i64) -> Option<i64> {
        self.event_count(now)
            .checked_sub(1)
            .and_then(|k| self.event_time(k, now))
    }

    fn status(&self, now: i64) -> &str {
        match self.last_event(now) {
            Some(t) if self.status == "resolved" && t > self.status_ms => "unresolved",
            _ => &self.status,
        }
    }
}

impl State {
    /// Opens or closes the current broken span to match the mode and the default branch.
    pub(crate) fn reconcile_production(&mut self, config: &SandboxConfig, now: i64) {
        let broken = match self.glitchtip.mode {
            ProducingMode::On => true,
            ProducingMode::Off => false,
            ProducingMode::Auto => self
                .forgejo
                .repo
                .default_tree()
                .is_some_and(|tree| !config.ci.failures(tree).is_empty()),
        };
        let g = &mut self.glitchtip;
        g.interval_ms = i64::try_from(config.glitchtip.event_interval_ms)
            .unwrap_or(i64::MAX)
            .max(1);
        match (broken, g.producing()) {
            (true, false) => g.spans.push(Span {
                start_ms: now,
                end_ms: None,
            }),
            (false, true) => {
                if let Some(s) = g.spans.last_mut() {
                    s.end_ms = Some(now);
                }
            }
            _ => {}
        }
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/api/0/issues/{issue_id}/", get(get_issue).put(put_issue))
        .route("/api/0/issues/{issue_id}/events/", get(list_events))
}

fn error(status: StatusCode, detail: &str) -> Response {
    (status, Json(json!({"detail": detail}))).into_response()
}

fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), Response> {
    let expected = format!("Bearer {}", shared.config.tokens.glitchtip_token);
    match headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        Some(v) if v == expected => Ok(()),
        _ => Err(error(StatusCode::UNAUTHORIZED, "Unauthorized")),
    }
}

fn check_issue(shared: &Shared, issue_id: &str) -> Result<(), Response> {
    // GlitchTip's path converter takes integers only; anything else is a 404 from the router, as here.
    match issue_id.parse::<u64>() {
        Ok(id) if id == shared.config.glitchtip.issue_id => Ok(()),
        _ => Err(error(StatusCode::NOT_FOUND, "Not Found")),
    }
}

fn short_id(config: &SandboxConfig) -> String {
    format!(
        "{}-{}",
        config.glitchtip.project_slug.to_uppercase(),
        config.glitchtip.issue_id
    )
}

fn issue_json(shared: &Shared, g: &GlitchtipState, now: i64) -> Value {
    let c = &shared.config.glitchtip;
    let first = g.event_time(0, now).unwrap_or(g.created_ms);
    let last = g.last_event(now).unwrap_or(g.created_ms);
    let title_type = c.title.split(':').next().unwrap_or(&c.title).to_string();
    json!({
        "id": c.issue_id.to_string(),
        "count": g.event_count(now).to_string(),
        "type": "error",
        "level": c.level,
        "status": g.status(now),
        "project": {"id": c.project_id.to_string(), "name": c.project_name, "slug": c.project_slug, "platform": "python"},
        "shortId": short_id(&shared.config),
        "numComments": 0,
        "stats": null,
        "share_id": null,
        "logger": null,
        "permalink": format!("{}/{}/issues/{}", shared.urls.glitchtip, c.org_slug, c.issue_id),
        "status_details": {},
        "subscription_details": null,
        "user_count": 0,
        "matching_event_id": null,
        "firstSeen": util::iso_ms(first),
        "lastSeen": util::iso_ms(last),
        "title": c.title,
        "metadata": {"type": title_type, "value": c.title, "filename": "src/checkout.py"},
        "culprit": c.culprit,
        "userReportCount": 0,
    })
}

async fn get_issue(
    AxState(shared): AxState<Arc<Shared>>,
    headers: HeaderMap,
    Path(issue_id): Path<String>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers).and_then(|()| check_issue(&shared, &issue_id)) {
        return r;
    }
    let st = shared.lock();
    Json(issue_json(&shared, &st.glitchtip, util::now_ms())).into_response()
}

#[derive(Deserialize)]
struct UpdateIssue {
    status: Option<String>,
}

async fn put_issue(
    AxState(shared): AxState<Arc<Shared>>,
    headers: HeaderMap,
    Path(issue_id): Path<String>,
    body: Result<Json<UpdateIssue>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers).and_then(|()| check_issue(&shared, &issue_id)) {
        return r;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error(e.status(), "Request body too large");
        }
        Err(e) => return error(StatusCode::UNPROCESSABLE_ENTITY, &e.body_text()),
    };
    let now = util::now_ms();
    let mut st = shared.lock();
    if let Some(status) = body.status {
        if !["unresolved", "resolved", "ignored"].contains(&status.as_str()) {
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "status: Input should be 'unresolved', 'resolved' or 'ignored'",
            );
        }
        st.glitchtip.status = status;
        st.glitchtip.status_ms = now;
        if let Err(e) = shared.persist(&st) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string());
        }
    }
    Json(issue_json(&shared, &st.glitchtip, now)).into_response()
}

const MAX_LIMIT: u64 = 100;

async fn list_events(
    AxState(shared): AxState<Arc<Shared>>,
    headers: HeaderMap,
    Path(issue_id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers).and_then(|()| check_issue(&shared, &issue_id)) {
        return r;
    }
    let Ok(limit) = q.get("limit").map_or(Ok(50), |l| l.parse::<u64>()) else {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "limit: Input should be a valid integer",
        );
    };
    let limit = limit.clamp(1, MAX_LIMIT);
    // Our cursors are "<offset>:0:0" (Sentry's value:offset:is_prev shape, with the offset first).
    let offset = match q
        .get("cursor")
        .map(|c| c.split(':').next().unwrap_or("").parse::<u64>())
    {
        None => 0,
        Some(Ok(o)) => o,
        Some(Err(_)) => return error(StatusCode::UNPROCESSABLE_ENTITY, "cursor: invalid cursor"),
    };
    let now = util::now_ms();
    let st = shared.lock();
    let g = &st.glitchtip;
    let c = &shared.config.glitchtip;
    let total = g.event_count(now);
    let mut events = Vec::new();
    // newest first, as GlitchTip lists them
    for i in offset..(offset + limit).min(total) {
        let k = total - 1 - i;
        let Some(t) = g.event_time(k, now) else { break };
        let event_id = util::sha256_hex(format!("{}:{k}", c.issue_id).as_bytes())[..32].to_string();
        events.push(json!({
            "id": event_id,
            "eventID": event_id,
            "projectID": c.project_id,
            "groupID": c.issue_id.to_string(),
            "dateCreated": util::iso_ms(t),
            "dateReceived": util::iso_ms(t),
            "type": "error",
            "message": c.title,
            "title": c.title,
            "culprit": c.culprit,
            "platform": "python",
            "metadata": {"value": c.title},
            "tags": [{"key": "environment", "value": "production"}, {"key": "level", "value": c.level}],
            "entries": [],
        }));
    }
    let base = format!(
        "{}/api/0/issues/{}/events/",
        shared.urls.glitchtip, c.issue_id
    );
    let prev = offset.saturating_sub(limit);
    let next = offset + limit;
    let link = format!(
        "<{base}?cursor={prev}:0:1>; rel=\"previous\"; results=\"{}\"; cursor=\"{prev}:0:1\", \
         <{base}?cursor={next}:0:0>; rel=\"next\"; results=\"{}\"; cursor=\"{next}:0:0\"",
        offset > 0,
        next < total
    );
    let mut resp = Json(events).into_response();
    if let Ok(v) = HeaderValue::from_str(&link) {
        resp.headers_mut().insert(header::LINK, v);
    }
    resp
}

pub(crate) fn alert_payload(config: &SandboxConfig, glitchtip_url: &str) -> Value {
    let c = &config.glitchtip;
    let link = format!("{glitchtip_url}/{}/issues/{}", c.org_slug, c.issue_id);
    json!({
        "alias": "GlitchTip",
        "text": "GlitchTip Alert",
        "attachments": [{
            "title": c.title,
            "title_link": link,
            "text": c.culprit,
            "image_url": null,
            "color": "#e52b50",
            "fields": [
                {"title": "Project", "value": c.project_name, "short": true},
                {"title": "Environment", "value": "production", "short": true},
            ],
            "mrkdown_in": ["text"],
        }],
        "sections": [{
            "activityTitle": c.title,
            "activitySubtitle": format!("[View Issue {}]({link})", short_id(config)),
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_events_lazily() {
        let mut g = GlitchtipState::seed(0);
        g.interval_ms = 10;
        g.spans = vec![
            Span {
                start_ms: 100,
                end_ms: Some(130),
            },
            Span {
                start_ms: 200,
                end_ms: None,
            },
        ];
        // first span: 100, 110, 120; open span at now=225: 200, 210, 220
        assert_eq!(g.event_count(225), 6);
        assert_eq!(g.event_time(3, 225), Some(200));
        assert_eq!(g.last_event(225), Some(220));
        // 110, 120 and 200, 210
        assert_eq!(g.count_between(105, 215, 225), 4);
        assert_eq!(g.event_count(99), 0);
        g.status = "resolved".into();
        g.status_ms = 215;
        assert_eq!(g.status(219), "resolved");
        assert_eq!(g.status(220), "unresolved");
    }
}
