//! Stored records -> wire messages.
//!
//! A run's snapshot is the worker's `loams_factory::Run`, read as that type; a snapshot that does not parse is an
//! internal error, not a guess. Timeline events are stored as the factory's event JSON plus the worker's `at_ms`,
//! `stage` and `summary` fields, and only those (and the event's `type` tag) are read: the full event goes out
//! as `detail_json`.

use loams_factory::approval::{Approval, ApprovalState, Device};
use loams_platform::{EventRow, RunRow};
use loams_proto::approvals::v1 as pa;
use loams_proto::devices::v1 as pd;
use loams_proto::factory::v1 as pf;
use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Longest one-line event summary.
const MAX_SUMMARY: usize = 200;

/// The snake_case name a unit enum of the factory serializes as (cursor, verdict); empty if it is not a string.
fn name_of<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

/// The worker's run behind a stored row.
pub(crate) fn snapshot(row: &RunRow) -> Result<loams_factory::Run, ApiError> {
    serde_json::from_slice(&row.snapshot)
        .map_err(|e| ApiError::Internal(format!("run {} has a malformed snapshot: {e}", row.id)))
}

pub(crate) fn run(row: &RunRow) -> Result<pf::Run, ApiError> {
    let r = snapshot(row)?;
    let links = &r.links;
    let budget = &r.budget;
    Ok(pf::Run {
        id: row.id.clone(),
        org: row.org.clone(),
        env: r.env.clone(),
        generation: r.generation,
        parent_run: r.parent_run.clone().unwrap_or_default(),
        signal: Some(pf::Signal {
            source: r.signal.source.clone(),
            fingerprint: r.signal.fingerprint.clone(),
            title: r.signal.title.clone(),
            link: r.signal.link.clone(),
        }),
        // The row's state is what the store indexes and filters by, so it is the one shown.
        state: row.state.clone(),
        stage: r.stage.as_str().to_owned(),
        stage_state: name_of(&r.cursor),
        links: Some(pf::RunLinks {
            thread: links.thread_url.clone().unwrap_or_default(),
            issue: links.issue_url.clone().unwrap_or_default(),
            pr: links.pr_url.clone().unwrap_or_default(),
            deploy_ref: links.deploy_ref.clone().unwrap_or_default(),
        }),
        budget: Some(pf::Budget {
            limit_micros: i64::try_from(budget.limit_micros).unwrap_or(i64::MAX),
            spent_micros: i64::try_from(budget.micros).unwrap_or(i64::MAX),
            tokens_limit: budget.limit_tokens,
            tokens_spent: budget.tokens,
        }),
        verdict: r.verdict.as_ref().map(name_of).unwrap_or_default(),
        started_at_ms: r.started_at_ms,
        updated_at_ms: row.updated_ms,
        version: row.version,
    })
}

/// The fields of a stored event a timeline shows; everything else stays in `detail_json`.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Logged {
    #[serde(rename = "type")]
    kind: String,
    at_ms: i64,
    stage: String,
    summary: String,
}

pub(crate) fn event(row: &EventRow) -> pf::TimelineEvent {
    // An event the worker wrote is always an object with these fields; anything else still shows, by its seq and
    // raw JSON, rather than breaking the whole timeline.
    let logged: Logged = serde_json::from_slice(&row.body).unwrap_or_default();
    // The worker logs each event with the engine's one-line summary; the type names an event without one.
    let summary = if logged.summary.is_empty() {
        logged.kind.replace('_', " ")
    } else {
        logged.summary
    };
    pf::TimelineEvent {
        seq: row.seq,
        at_ms: logged.at_ms,
        r#type: logged.kind,
        stage: logged.stage,
        summary: truncate(summary, MAX_SUMMARY),
        detail_json: String::from_utf8_lossy(&row.body).into_owned(),
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
            // The canonical text, the only one a phone accepts (it checks the text as well as its hash).
            args_json: loams_proto::canonical_json(&a.action.args),
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
        decided_by: a
            .decision
            .as_ref()
            .map(|d| d.decided_by.clone())
            .unwrap_or_default(),
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

    /// A run as the engine opens it (generation 2 of a regressed parent), then moved along by hand.
    fn opened_run() -> loams_factory::Run {
        let signal = loams_factory::Signal {
            source: "glitchtip".into(),
            fingerprint: "glitchtip:42".into(),
            title: "boom".into(),
            link: "https://gt/x/issues/42".into(),
            glitchtip_issue_id: Some("42".into()),
            severity: "error".into(),
            generation: 2,
            parent_run: Some("r-0".into()),
        };
        let (run, _) =
            loams_factory::open(signal, &loams_factory::Ctx::new("acme", "prod", 5)).unwrap();
        run
    }

    fn row(run: &loams_factory::Run) -> RunRow {
        RunRow {
            org: "acme".into(),
            id: run.id.clone(),
            version: 9,
            state: "waiting".into(),
            snapshot: serde_json::to_vec(run).unwrap(),
            updated_ms: 77,
        }
    }

    #[test]
    fn run_maps_the_factory_run() {
        let mut r = opened_run();
        let fresh = run(&row(&r)).unwrap();
        assert_eq!(
            (
                fresh.env.as_str(),
                fresh.generation,
                fresh.parent_run.as_str()
            ),
            ("prod", 2, "r-0")
        );
        assert_eq!(
            (
                fresh.stage.as_str(),
                fresh.stage_state.as_str(),
                fresh.verdict.as_str()
            ),
            ("triage", "open_thread", "")
        );
        assert_eq!(fresh.links.unwrap(), pf::RunLinks::default());
        assert_eq!(fresh.started_at_ms, 5);
        let signal = fresh.signal.unwrap();
        assert_eq!(
            (
                signal.source.as_str(),
                signal.fingerprint.as_str(),
                signal.title.as_str()
            ),
            ("glitchtip", "glitchtip:42", "boom")
        );

        r.stage = loams_factory::Stage::Observe;
        r.cursor = loams_factory::Cursor::AwaitVerdict;
        r.links.thread_url = Some("https://z/t".into());
        r.links.issue_url = Some("https://plane/i".into());
        r.links.pr_url = Some("https://forgejo/pr/7".into());
        r.links.deploy_ref = Some("abc123".into());
        r.budget = loams_factory::Budget {
            limit_tokens: 1000,
            limit_micros: 500,
            tokens: 10,
            micros: u64::MAX,
        };
        r.verdict = Some(loams_factory::ObserveVerdict::Regressed);
        let shown = run(&row(&r)).unwrap();
        assert_eq!(
            (shown.state.as_str(), shown.version, shown.updated_at_ms),
            ("waiting", 9, 77)
        );
        assert_eq!(
            (
                shown.stage.as_str(),
                shown.stage_state.as_str(),
                shown.verdict.as_str()
            ),
            ("observe", "await_verdict", "regressed")
        );
        assert_eq!(
            shown.links.unwrap(),
            pf::RunLinks {
                thread: "https://z/t".into(),
                issue: "https://plane/i".into(),
                pr: "https://forgejo/pr/7".into(),
                deploy_ref: "abc123".into(),
            }
        );
        // Spending past i64 saturates instead of wrapping negative.
        assert_eq!(
            shown.budget.unwrap(),
            pf::Budget {
                limit_micros: 500,
                spent_micros: i64::MAX,
                tokens_limit: 1000,
                tokens_spent: 10
            }
        );

        let bad = RunRow {
            snapshot: b"{".to_vec(),
            ..row(&r)
        };
        assert!(run(&bad).is_err());
        // JSON, but not a run: no guessing at other shapes.
        let other = RunRow {
            snapshot: br#"{"stage": "fix", "env": "prod"}"#.to_vec(),
            ..row(&r)
        };
        assert!(run(&other).is_err());
    }

    #[test]
    fn event_maps_type_stage_and_summary() {
        let logged = serde_json::json!({"type": "ended", "summary": "run killed (killed)", "at_ms": 3, "stage": "fix"});
        let e = event(&EventRow {
            seq: 4,
            body: serde_json::to_vec(&logged).unwrap(),
        });
        assert_eq!(
            (e.seq, e.at_ms, e.r#type.as_str(), e.stage.as_str()),
            (4, 3, "ended", "fix")
        );
        assert_eq!(e.summary, "run killed (killed)");
        let bare = event(&EventRow {
            seq: 5,
            body: br#"{"type":"timer_fired"}"#.to_vec(),
        });
        assert_eq!(bare.summary, "timer fired");
        // An event exactly as the worker logs it: the factory event plus at_ms, stage and summary.
        let (r, opened) = loams_factory::open(
            opened_run().signal,
            &loams_factory::Ctx::new("acme", "prod", 5),
        )
        .unwrap();
        let mut logged = serde_json::to_value(&opened).unwrap();
        logged["at_ms"] = 5.into();
        logged["stage"] = r.stage.as_str().into();
        logged["summary"] = opened.summary().into();
        let e = event(&EventRow {
            seq: 1,
            body: serde_json::to_vec(&logged).unwrap(),
        });
        assert_eq!(
            (e.at_ms, e.r#type.as_str(), e.stage.as_str()),
            (5, "opened", "triage")
        );
        assert_eq!(e.summary, opened.summary());
        let junk = event(&EventRow {
            seq: 6,
            body: b"[1]".to_vec(),
        });
        assert_eq!(
            (junk.seq, junk.r#type.as_str(), junk.detail_json.as_str()),
            (6, "", "[1]")
        );
        assert_eq!(truncate("é".repeat(200), 5).chars().count(), 3);
    }
}
