//! The core's records and enums, declared to UniFFI as remote types: each declaration repeats the core's
//! definition field for field (the compiler checks they match), so the values cross the FFI without copies into
//! look-alike types.

use loams_core::{
    AllowedApp, App, Approval, ApprovalState, ApprovalUpdate, Budget, ChatMessage, ChatThread,
    CheckRun, CheckRuns, Decision, Device, ErrorIssue, Issue, LinkTemplate, Message, MetricPoint,
    MetricSeries, PullRequest, Risk, Route, Run, RunLinks, RunSync, RunUpdate, Signal, SyncMode,
    Thread, ThreadUpdate, TimelineEvent,
};

#[uniffi::remote(Enum)]
pub enum SyncMode {
    Stream,
    Poll,
}

#[uniffi::remote(Record)]
pub struct Signal {
    pub source: String,
    pub fingerprint: String,
    pub title: String,
    pub link: String,
}

#[uniffi::remote(Record)]
pub struct RunLinks {
    pub thread: String,
    pub issue: String,
    pub pr: String,
    pub deploy_ref: String,
}

#[uniffi::remote(Record)]
pub struct Budget {
    pub limit_micros: i64,
    pub spent_micros: i64,
    pub tokens_limit: u64,
    pub tokens_spent: u64,
}

#[uniffi::remote(Record)]
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

#[uniffi::remote(Record)]
pub struct TimelineEvent {
    pub run_id: String,
    pub seq: u64,
    pub at_ms: i64,
    pub kind: String,
    pub stage: String,
    pub summary: String,
    pub detail_json: String,
    pub confirmed_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct RunSync {
    pub run: Run,
    pub new_events: Vec<TimelineEvent>,
}

#[uniffi::remote(Enum)]
pub enum RunUpdate {
    Snapshot {
        run: Option<Run>,
        events: Vec<TimelineEvent>,
    },
    Run {
        run: Run,
    },
    Events {
        events: Vec<TimelineEvent>,
    },
    Confirmed {
        at_ms: i64,
    },
    Connection {
        connected: bool,
        detail: String,
    },
    Finished,
}

#[uniffi::remote(Enum)]
pub enum Decision {
    Approve,
    Deny,
}

#[uniffi::remote(Enum)]
pub enum Risk {
    Unknown,
    Read,
    Write,
    Destructive,
}

#[uniffi::remote(Enum)]
pub enum ApprovalState {
    Unknown,
    Pending,
    Approved,
    Denied,
    Expired,
}

#[uniffi::remote(Record)]
pub struct Approval {
    pub id: String,
    pub run_id: String,
    pub agent: String,
    pub skill: String,
    pub args_json: String,
    pub target_commit: String,
    pub action_hash: Vec<u8>,
    pub summary: String,
    pub risk: Risk,
    pub requester: String,
    pub on_behalf_of: String,
    pub confirmation_phrase: Option<String>,
    pub state: ApprovalState,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
    pub decided_by: String,
    pub decision: Option<Decision>,
    pub confirmed_at_ms: i64,
}

#[uniffi::remote(Enum)]
pub enum ApprovalUpdate {
    Snapshot { approvals: Vec<Approval> },
    Added { approval: Approval },
    Removed { approval_id: String },
    Connection { connected: bool, detail: String },
}

#[uniffi::remote(Record)]
pub struct Device {
    pub device_id: String,
    pub user: String,
    pub name: String,
    pub public_key: Vec<u8>,
    pub created_at_ms: i64,
    pub revoked_at_ms: i64,
    pub confirmed_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct Thread {
    pub id: String,
    pub title: String,
    pub run_id: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub confirmed_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct Message {
    pub id: String,
    pub thread_id: String,
    pub seq: u64,
    pub role: String,
    pub author: String,
    pub content: String,
    pub created_at_ms: i64,
    pub run_id: String,
    pub confirmed_at_ms: i64,
}

#[uniffi::remote(Enum)]
pub enum ThreadUpdate {
    Snapshot { messages: Vec<Message> },
    Messages { messages: Vec<Message> },
    Connection { connected: bool, detail: String },
}

#[uniffi::remote(Record)]
pub struct AllowedApp {
    pub env: String,
    pub app: String,
}

#[uniffi::remote(Enum)]
pub enum Route {
    Run {
        run_id: String,
    },
    Approval {
        approval_id: String,
    },
    BotThread {
        thread_id: String,
    },
    App {
        env: String,
        app: String,
        path: String,
    },
}

#[uniffi::remote(Record)]
pub struct LinkTemplate {
    pub object: String,
    pub template: String,
}

#[uniffi::remote(Record)]
pub struct App {
    pub id: String,
    pub base_url: String,
    pub deep_link_templates: Vec<LinkTemplate>,
    pub configured: bool,
    pub readable: bool,
    pub environment: String,
}

#[uniffi::remote(Record)]
pub struct Issue {
    pub id: String,
    pub key: String,
    pub title: String,
    pub state: String,
    pub state_group: String,
    pub url: String,
    pub read_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct PullRequest {
    pub number: u64,
    pub title: String,
    pub body: String,
    pub state: String,
    pub merged: bool,
    pub merge_commit_sha: String,
    pub head_branch: String,
    pub head_sha: String,
    pub base_branch: String,
    pub author: String,
    pub url: String,
    pub read_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct CheckRun {
    pub name: String,
    pub state: String,
    pub description: String,
    pub url: String,
}

#[uniffi::remote(Record)]
pub struct CheckRuns {
    pub sha: String,
    pub state: String,
    pub checks: Vec<CheckRun>,
    pub read_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct ChatMessage {
    pub id: u64,
    pub sender_name: String,
    pub content: String,
}

#[uniffi::remote(Record)]
pub struct ChatThread {
    pub channel: String,
    pub topic: String,
    pub messages: Vec<ChatMessage>,
    pub read_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct ErrorIssue {
    pub id: String,
    pub short_id: String,
    pub title: String,
    pub culprit: String,
    pub level: String,
    pub status: String,
    pub event_count: u64,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    pub url: String,
    pub read_at_ms: i64,
}

#[uniffi::remote(Record)]
pub struct MetricPoint {
    pub date: String,
    pub count: f64,
}

#[uniffi::remote(Record)]
pub struct MetricSeries {
    pub event: String,
    pub points: Vec<MetricPoint>,
    pub total: u64,
    pub read_at_ms: i64,
}
