//! The records the core hands to the apps: owned, plain data (what UniFFI records need), each carrying
//! `confirmed_at_ms`, the time the server last confirmed it, so a screen can show how fresh a cached value is.

use loams_proto::approvals::v1 as pa;
use loams_proto::bot::v1 as pb;
use loams_proto::devices::v1 as pd;
use loams_proto::factory::v1 as pf;

/// Run states after which nothing more happens.
const TERMINAL_STATES: [&str; 3] = ["succeeded", "failed", "killed"];

/// True for a run state that can change no more.
pub(crate) fn is_terminal(state: &str) -> bool {
    TERMINAL_STATES.contains(&state)
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Signal {
    pub source: String,
    pub fingerprint: String,
    pub title: String,
    pub link: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RunLinks {
    pub thread: String,
    pub issue: String,
    pub pr: String,
    pub deploy_ref: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Budget {
    pub limit_micros: i64,
    pub spent_micros: i64,
    pub tokens_limit: u64,
    pub tokens_spent: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub id: String,
    pub env: String,
    pub generation: u32,
    pub parent_run: String,
    pub signal: Signal,
    pub state: String,
    pub stage: String,
    pub stage_state: String,
    pub links: RunLinks,
    pub budget: Budget,
    pub verdict: String,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
    pub version: u64,
    pub confirmed_at_ms: i64,
}

impl Run {
    pub(crate) fn from_proto(r: pf::Run, confirmed_at_ms: i64) -> Run {
        let s = r.signal.unwrap_or_default();
        let l = r.links.unwrap_or_default();
        let b = r.budget.unwrap_or_default();
        Run {
            id: r.id,
            env: r.env,
            generation: r.generation,
            parent_run: r.parent_run,
            signal: Signal {
                source: s.source,
                fingerprint: s.fingerprint,
                title: s.title,
                link: s.link,
            },
            state: r.state,
            stage: r.stage,
            stage_state: r.stage_state,
            links: RunLinks {
                thread: l.thread,
                issue: l.issue,
                pr: l.pr,
                deploy_ref: l.deploy_ref,
            },
            budget: Budget {
                limit_micros: b.limit_micros,
                spent_micros: b.spent_micros,
                tokens_limit: b.tokens_limit,
                tokens_spent: b.tokens_spent,
            },
            verdict: r.verdict,
            started_at_ms: r.started_at_ms,
            updated_at_ms: r.updated_at_ms,
            version: r.version,
            confirmed_at_ms,
        }
    }

    /// True once the run can change no more.
    pub fn is_finished(&self) -> bool {
        is_terminal(&self.state)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineEvent {
    pub run_id: String,
    /// 1-based position in the run's event log; also the resume cursor.
    pub seq: u64,
    pub at_ms: i64,
    /// The event type as the factory names it (`approval_requested`, `merged`, ...).
    pub kind: String,
    pub stage: String,
    pub summary: String,
    pub detail_json: String,
    pub confirmed_at_ms: i64,
}

impl TimelineEvent {
    pub(crate) fn from_proto(
        run_id: &str,
        e: pf::TimelineEvent,
        confirmed_at_ms: i64,
    ) -> TimelineEvent {
        TimelineEvent {
            run_id: run_id.to_owned(),
            seq: e.seq,
            at_ms: e.at_ms,
            kind: e.r#type,
            stage: e.stage,
            summary: e.summary,
            detail_json: e.detail_json,
            confirmed_at_ms,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Deny,
}

impl Decision {
    pub(crate) fn to_proto(self) -> pa::Decision {
        match self {
            Decision::Approve => pa::Decision::Approve,
            Decision::Deny => pa::Decision::Deny,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Risk {
    Unknown,
    Read,
    Write,
    Destructive,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApprovalState {
    Unknown,
    Pending,
    Approved,
    Denied,
    Expired,
}

impl ApprovalState {
    pub(crate) fn from_proto(v: i32) -> ApprovalState {
        match pa::ApprovalState::try_from(v) {
            Ok(pa::ApprovalState::Pending) => ApprovalState::Pending,
            Ok(pa::ApprovalState::Approved) => ApprovalState::Approved,
            Ok(pa::ApprovalState::Denied) => ApprovalState::Denied,
            Ok(pa::ApprovalState::Expired) => ApprovalState::Expired,
            _ => ApprovalState::Unknown,
        }
    }
}

/// An approval request as the server renders it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Approval {
    pub id: String,
    pub run_id: String,
    pub agent: String,
    pub skill: String,
    pub args_json: String,
    pub target_commit: String,
    /// SHA-256 of the canonical call, computed by the server; it is what the signature covers.
    pub action_hash: Vec<u8>,
    /// Server-rendered description of what approving does (shown as is; never rendered on the phone).
    pub summary: String,
    pub risk: Risk,
    pub requester: String,
    pub on_behalf_of: String,
    /// The phrase a person must type to approve (destructive actions); `None` when a tap is enough.
    pub confirmation_phrase: Option<String>,
    pub state: ApprovalState,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
    pub decided_by: String,
    pub decision: Option<Decision>,
    pub confirmed_at_ms: i64,
}

impl Approval {
    pub(crate) fn from_proto(a: pa::Approval, confirmed_at_ms: i64) -> Approval {
        let action = a.action.unwrap_or_default();
        Approval {
            id: a.id,
            run_id: a.run_id,
            agent: action.agent,
            skill: action.skill,
            args_json: action.args_json,
            target_commit: action.target_commit,
            action_hash: a.action_hash,
            summary: a.summary,
            risk: match pa::Risk::try_from(a.risk) {
                Ok(pa::Risk::Read) => Risk::Read,
                Ok(pa::Risk::Write) => Risk::Write,
                Ok(pa::Risk::Destructive) => Risk::Destructive,
                _ => Risk::Unknown,
            },
            requester: a.requester,
            on_behalf_of: a.on_behalf_of,
            confirmation_phrase: (!a.confirmation_phrase.is_empty())
                .then_some(a.confirmation_phrase),
            state: ApprovalState::from_proto(a.state),
            expires_at_ms: a.expires_at_ms,
            created_at_ms: a.created_at_ms,
            decided_by: a.decided_by,
            decision: match pa::Decision::try_from(a.decision) {
                Ok(pa::Decision::Approve) => Some(Decision::Approve),
                Ok(pa::Decision::Deny) => Some(Decision::Deny),
                _ => None,
            },
            confirmed_at_ms,
        }
    }
}

/// This installation's registered device key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub device_id: String,
    pub user: String,
    pub name: String,
    /// Uncompressed P-256 point, 65 bytes.
    pub public_key: Vec<u8>,
    pub created_at_ms: i64,
    /// 0 while active.
    pub revoked_at_ms: i64,
    pub confirmed_at_ms: i64,
}

impl Device {
    pub(crate) fn from_proto(d: pd::Device, confirmed_at_ms: i64) -> Device {
        Device {
            device_id: d.device_id,
            user: d.user,
            name: d.name,
            public_key: d.public_key,
            created_at_ms: d.created_at_ms,
            revoked_at_ms: d.revoked_at_ms,
            confirmed_at_ms,
        }
    }
}

/// A Loams Bot conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thread {
    pub id: String,
    pub title: String,
    pub run_id: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub confirmed_at_ms: i64,
}

impl Thread {
    pub(crate) fn from_proto(t: pb::Thread, confirmed_at_ms: i64) -> Thread {
        Thread {
            id: t.id,
            title: t.title,
            run_id: t.run_id,
            created_at_ms: t.created_at_ms,
            updated_at_ms: t.updated_at_ms,
            confirmed_at_ms,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub thread_id: String,
    /// 1-based position in the thread; also the resume cursor.
    pub seq: u64,
    pub role: String,
    pub author: String,
    pub content: String,
    pub created_at_ms: i64,
    pub run_id: String,
    pub confirmed_at_ms: i64,
}

impl Message {
    pub(crate) fn from_proto(m: pb::BotMessage, confirmed_at_ms: i64) -> Message {
        Message {
            id: m.id,
            thread_id: m.thread_id,
            seq: m.seq,
            role: m.role,
            author: m.author,
            content: m.content,
            created_at_ms: m.created_at_ms,
            run_id: m.run_id,
            confirmed_at_ms,
        }
    }
}
