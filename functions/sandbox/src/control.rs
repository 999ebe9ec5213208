//! Test-only control endpoints under `/_sandbox/`, served by every app, without auth.

use crate::glitchtip::ProducingMode;
use crate::{Shared, State, util};
use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    pub messages: u64,
    pub issues: u64,
    pub comments: u64,
    pub branches: u64,
    pub prs: u64,
    pub merges: u64,
    pub commits: u64,
    pub statuses: u64,
    pub events: u64,
    /// Whether the seeded GlitchTip issue is receiving events right now.
    pub producing: bool,
}

pub(crate) fn counts(st: &State, now: i64) -> Counts {
    let n = |x: usize| x as u64;
    Counts {
        messages: n(st.zulip.messages.len()),
        issues: n(st.plane.issues.len()),
        comments: n(st.plane.comments.len()),
        branches: n(st.forgejo.repo.branches.len()),
        prs: n(st.forgejo.pulls.len()),
        merges: st.forgejo.merges,
        commits: n(st.forgejo.repo.commits.len()),
        statuses: n(st.forgejo.statuses.len()),
        events: st.glitchtip.event_count(now),
        producing: st.glitchtip.producing(),
    }
}

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/_sandbox/state", get(state))
        .route("/_sandbox/glitchtip/producing", post(producing))
}

async fn state(AxState(shared): AxState<Arc<Shared>>) -> Json<Counts> {
    Json(counts(&shared.lock(), util::now_ms()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProducingBody {
    mode: ProducingMode,
}

async fn producing(
    AxState(shared): AxState<Arc<Shared>>,
    body: Result<Json<ProducingBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(serde_json::json!({"error": e.body_text()})),
            )
                .into_response();
        }
    };
    let mut st = shared.lock();
    st.glitchtip.mode = body.mode;
    st.reconcile_production(&shared.config, util::now_ms());
    if let Err(e) = shared.persist(&st) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response();
    }
    Json(serde_json::json!({"mode": body.mode, "producing": st.glitchtip.producing()}))
        .into_response()
}
