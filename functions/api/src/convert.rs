//! Stored records -> wire messages.
//!
//! Runs and events are read as JSON values rather than as `loams_factory` types: the API shows whatever the worker
//! stored, and an older or newer snapshot (a field added, renamed or missing) still renders instead of failing the
//! whole list. Only the fields of DESIGN.md section 5's run record are mapped.

use loams_factory::approval::{Approval, ApprovalState, Device};
use loams_platform::{EventRow, RunRow};
use loams_proto::approvals::v1 as pa;
use loams_proto::devices::v1 as pd;
use loams_proto::factory::v1 as pf;
use serde_json::Value;

use crate::ApiError;

/// Longest one-line event summary.
const MAX_SUMMARY: usize = 200;

/// The first of `keys` present in `v` as text: strings as they are, numbers and booleans printed, an object by its
/// `url` (links such as the issue or PR are stored as objects), anything else empty.
fn text(v: &Value, keys: &[&str]) -> String {
    for k in keys {
        match v.get(*k) {
            Some(Value::String(s)) => return s.clone(),
            Some(Value::Number(n)) => return n.to_string(),
            Some(Value::Bool(b)) => return b.to_string(),
            Some(Value::Object(o)) => {
                if let Some(Value::String(s)) = o.get("url") {
                    return s.clone();
                }
                // Tagged enums (`{"type": "open"}`) render by their tag.
                if let Some(Value::String(s)) = o.get("type") {
                    return s.clone();
                }
            }
            _ => {}
        }
    }
    String::new()
}

fn int(v: &Value, keys: &[&str]) -> i64 {
    keys.iter().find_map(|k| v.get(*k).and_then(Value::as_i64)).unwrap_or(0)
}

fn uint(v: &Value, keys: &[&str]) -> u64 {
    keys.iter().find_map(|k| v.get(*k).and_then(Value::as_u64)).unwrap_or(0)
}

fn stage_name(v: &Value) -> String {
    match v.get("stage") {
        Some(Value::String(s)) => s.clone(),
        // A stage stored as a tagged object (`{"stage": {"fix": {...}}}` or `{"type": "fix"}`).
        Some(Value::Object(o)) => o
            .get("type")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| o.keys().next().cloned())
            .unwrap_or_default(),
        _ => String::new(),
    }
}

pub(crate) fn run(row: &RunRow) -> Result<pf::Run, ApiError> {
    let v: Value = serde_json::from_slice(&row.snapshot)
        .map_err(|e| ApiError::Internal(format!("run {} has a malformed snapshot: {e}", row.id)))?;
    let signal = v.get("signal").map(|s| pf::Signal {
        source: text(s, &["source"]),
        fingerprint: text(s, &["fingerprint"]),
        title: text(s, &["title"]),
        link: text(s, &["link"]),
    });
    let links = v.get("links").map(|l| pf::RunLinks {
        thread: text(l, &["thread", "thread_url"]),
        issue: text(l, &["issue", "issue_url"]),
        pr: text(l, &["pr", "pr_url"]),
        deploy_ref: text(l, &["deploy_ref", "merge_sha"]),
    });
    let budget = v.get("budget").map(|b| pf::Budget {
        limit_micros: int(b, &["limit_micros", "limit"]),
        spent_micros: int(b, &["spent_micros", "micros"]),
        tokens_limit: uint(b, &["tokens_limit", "limit_tokens"]),
        tokens_spent: uint(b, &["tokens_spent", "tokens"]),
    });
    let generation = uint(&v, &["generation"]);
    Ok(pf::Run {
        id: row.id.clone(),
        org: row.org.clone(),
        env: text(&v, &["env"]),
        generation: u32::try_from(generation).unwrap_or(u32::MAX),
        parent_run: text(&v, &["parent_run"]),
        signal,
        // The row's state is what the store indexes and filters by, so it is the one shown.
        state: row.state.clone(),
        stage: stage_name(&v),
        stage_state: text(&v, &["stage_state"]),
        links,
        budget,
        verdict: text(&v, &["verdict", "ending"]),
        started_at_ms: int(&v, &["started_at_ms", "started_at", "opened_at_ms"]),
        updated_at_ms: row.updated_ms,
        version: row.version,
    })
}

pub(crate) fn event(row: &EventRow) -> pf::TimelineEvent {
    let detail_json = String::from_utf8_lossy(&row.body).into_owned();
    let v: Value = serde_json::from_slice(&row.body).unwrap_or(Value::Null);
    let kind = text(&v, &["type"]);
    // The worker logs each event with the engine's one-line summary; the type names an event without one.
    let summary = match text(&v, &["summary"]) {
        s if s.is_empty() => kind.replace('_', " "),
        s => s,
    };
    pf::TimelineEvent {
        seq: row.seq,
        at_ms: int(&v, &["at_ms", "at", "now_ms"]),
        r#type: kind,
        stage: stage_name(&v),
        summary: truncate(summary, MAX_SUMMARY),
        detail_json,
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

pub(crate) fn approval_state(s: ApprovalState) -> pa::ApprovalState {
    match s {
        ApprovalState::Pending => pa::ApprovalState::Pending,
        ApprovalState::Approved => pa::ApprovalState::Approved,
        ApprovalState::Denied => pa::ApprovalState::Denied,
        ApprovalState::Expired => pa::ApprovalState::Expired,
    }
}

fn risk(r: &str) -> pa::Risk {
    match r {
        "read" => pa::Risk::Read,
        "write" => pa::Risk::Write,
        "destructive" => pa::Risk::Destructive,
        _ => pa::Risk::Unspecified,
    }
}

pub(crate) fn approval(a: &Approval, now_ms: i64) -> pa::Approval {
    let state = a.effective_state(now_ms);
    let decision = match state {
        ApprovalState::Approved => pa::Decision::Approve,
        ApprovalState::Denied => pa::Decision::Deny,
        _ => pa::Decision::Unspecified,
    };
    pa::Approval {
        id: a.id.clone(),
        run_id: a.run_id.clone(),
        action: Some(pa::Action {
            agent: a.action.agent.clone(),
            skill: a.action.skill.clone(),
            args_json: a.action.args.to_string(),
            target_commit: a.action.target_commit.clone().unwrap_or_default(),
        }),
        // A malformed stored hash shows as empty; deciding then fails its action-hash check.
        action_hash: hex::decode(&a.action_hash).unwrap_or_default(),
        summary: a.summary.clone(),
        risk: risk(&a.risk) as i32,
        requester: a.requester.clone(),
        on_behalf_of: a.on_behalf_of.clone().unwrap_or_default(),
        confirmation_phrase: a.confirmation_phrase.clone().unwrap_or_default(),
        state: approval_state(state) as i32,
        expires_at_ms: a.expires_at_ms,
        created_at_ms: a.created_at_ms,
        decided_by: a.decision.as_ref().map(|d| d.decided_by.clone()).unwrap_or_default(),
        decision: decision as i32,
    }
}

pub(crate) fn device(d: &Device) -> pd::Device {
    pd::Device {
        device_id: d.id.clone(),
        user: d.user.clone(),
        name: d.name.clone(),
        public_key: d.public_key.clone(),
        created_at_ms: d.created_at_ms,
        revoked_at_ms: d.revoked_at_ms.unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_snapshot_maps_known_fields_and_tolerates_shapes() {
        let snapshot = serde_json::json!({
            "id": "r-1", "org": "acme", "env": "prod", "generation": 2, "parent_run": "r-0",
            "signal": {"source": "glitchtip", "fingerprint": "gt:42", "title": "boom", "link": "https://gt/x/issues/42"},
            "stage": "fix",
            "links": {"thread": "https://z/t", "issue": {"id": "i", "url": "https://plane/i"}, "pr": null},
            "budget": {"limit_micros": 100, "spent_micros": 7},
            "started_at_ms": 5
        });
        let row = RunRow {
            org: "acme".into(),
            id: "r-1".into(),
            version: 9,
            state: "waiting".into(),
            snapshot: serde_json::to_vec(&snapshot).unwrap(),
            updated_ms: 77,
        };
        let r = run(&row).unwrap();
        assert_eq!((r.env.as_str(), r.generation, r.parent_run.as_str()), ("prod", 2, "r-0"));
        assert_eq!(r.signal.unwrap().fingerprint, "gt:42");
        let links = r.links.unwrap();
        assert_eq!((links.thread.as_str(), links.issue.as_str(), links.pr.as_str()), ("https://z/t", "https://plane/i", ""));
        assert_eq!(r.budget.unwrap().spent_micros, 7);
        assert_eq!((r.state.as_str(), r.stage.as_str(), r.version, r.updated_at_ms, r.started_at_ms), ("waiting", "fix", 9, 77, 5));
        let bad = RunRow { snapshot: b"{".to_vec(), ..row };
        assert!(run(&bad).is_err());
    }

    #[test]
    fn event_maps_type_stage_and_summary() {
        let logged = serde_json::json!({"type": "ended", "summary": "run killed (killed)", "at_ms": 3, "stage": "fix"});
        let e = event(&EventRow { seq: 4, body: serde_json::to_vec(&logged).unwrap() });
        assert_eq!((e.seq, e.at_ms, e.r#type.as_str(), e.stage.as_str()), (4, 3, "ended", "fix"));
        assert_eq!(e.summary, "run killed (killed)");
        let bare = event(&EventRow { seq: 5, body: br#"{"type":"timer_fired"}"#.to_vec() });
        assert_eq!(bare.summary, "timer fired");
        assert_eq!(truncate("é".repeat(200), 5).chars().count(), 3);
    }
}
