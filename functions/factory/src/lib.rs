//! loams-factory: the loop of DESIGN.md section 5 as a sans-IO state machine.
//!
//! The worker owns all I/O. For one queue message it loads the [`Run`] (by folding its events with [`Run::apply`]),
//! feeds an [`Input`] to [`decide`], appends the returned [`Event`]s with a conditional write, performs
//! [`Run::next_effect`] with the effect's step id as idempotency key, and feeds the result back as
//! [`Input::Completed`]. Guards (kill switch, budget, policy, safety wall) run inside [`decide`] against the state the
//! run is about to act from, so a worker that performs an effect without a fresh [`Input::Continue`] still only ever
//! performs what the last recorded decision allowed.
//!
//! Nothing here reads a clock or performs I/O: time, kill switches, prices, policy and the fingerprint cooldown come
//! in through [`Ctx`].

pub mod approval;
mod ci;
mod effect;
mod engine;
mod event;
mod ids;
mod input;
mod patch;
mod policy;
mod prompts;
mod review;
mod run;

pub use ci::{CiReport, parse_ci_log};
pub use effect::{ApprovalRequest, ChatMessage, Effect};
pub use engine::{REQUESTER, decide, open, opening_id};
pub use event::{Event, FinishStep, FollowUp, ObserveVerdict, Reason, WaitKind};
pub use ids::{action_hash, run_id, run_id_after, step_id};
pub use input::{Envelope, Input, Outcome};
pub use patch::{FileContent, PatchError, check_scope, parse_patch, render_files};
pub use policy::{Policy, Risk, Rule, Verdict, risk_of};
pub use review::{AUDIT_APPROVAL, Finding, LEAD_APPROVAL, Severity, audit_verdict, lead_approves};
pub use run::{
    ApprovalRecord, AttemptRecord, Budget, Cursor, Ending, Gate, Links, Observation, PendingWait,
    Run, RunState, Stage, TriageRecord,
};

use serde::{Deserialize, Serialize};

/// Largest model answer the engine parses; a longer one is a recorded failure of the step.
pub const MAX_MODEL_TEXT: usize = 256 * 1024;
/// Largest single file the engine accepts from forgejo.read_files or from a model patch.
pub const MAX_FILE_BYTES: usize = 256 * 1024;
/// Most files in one read or one patch.
pub const MAX_FILES: usize = 32;
/// Largest run (its JSON, the snapshot the worker stores) that files read, a patch, or a gate on committing it may
/// make; a larger one fails its step. Files and patches are each within the limits above yet can together pass what a
/// store keeps of a snapshot, and an append the store refuses would strand the run. Later steps are never judged (a run
/// near the limit must still take its revert or its kill): they grow the run into `RUN_HEADROOM_BYTES`.
pub const MAX_RUN_BYTES: usize = 300_000;
/// Room over `MAX_RUN_BYTES` for what a run records after its last files: the last attempt's CI report (its failing
/// checks, listed and again in its signature) and feedback, all from tails of at most `MAX_FEEDBACK` bytes without
/// control characters (so at most twice that each as JSON, about 50,000 bytes together), approvals, a revert, its
/// ending. `MAX_RUN_BYTES` plus this must not pass what a store keeps of a snapshot.
pub const RUN_HEADROOM_BYTES: usize = 100_000;
/// The tail of a CI log or a review report kept as feedback for the next attempt.
pub const MAX_FEEDBACK: usize = 8 * 1024;
/// Longest id-like string accepted from outside (step ids, approval ids, user names, shas, urls).
pub const MAX_ID: usize = 512;
/// Longest signal title; the Zulip topic is cut further to 60 characters.
pub const MAX_TITLE: usize = 500;
/// Retries of one step after a retryable failure before the run gives up on it.
pub const MAX_STEP_RETRIES: u32 = 3;

/// A production signal that opens a run (a GlitchTip alert, a chat request, an operator command).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Signal {
    pub source: String,
    pub fingerprint: String,
    pub title: String,
    pub link: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glitchtip_issue_id: Option<String>,
    pub severity: String,
    /// 1 for a fresh signal; a regressed run's follow-up carries generation + 1.
    #[serde(default = "first_generation")]
    pub generation: u32,
    /// The run whose regression opened this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run: Option<String>,
}

fn first_generation() -> u32 {
    1
}

/// Per-organisation settings of the loop, captured into the run when it opens so a run's limits never shift under it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(default)]
pub struct Config {
    pub max_attempts: u32,
    pub max_generations: u32,
    pub observe_window_ms: u64,
    pub ci_poll_ms: u64,
    /// CI polls per attempt before the wait counts as stalled.
    pub ci_max_polls: u32,
    /// How long a wait for a person (triage decision, verdict) may last before the run stalls.
    pub stall_ms: u64,
    /// Longest time a waiting run goes without a step. A long wait (an approval, a person's decision) wakes the
    /// run at least this often until its deadline, so a decision or a kill switch that was stored but whose queue
    /// message was lost (a crash between the two writes) still reaches the run.
    pub recheck_ms: u64,
    pub budget_tokens: u64,
    pub budget_micros: u64,
    /// The organisation's model spend allowed per calendar month (UTC) over all its runs, in micro-dollars and in
    /// tokens; `None`: no limit beyond each run's own budget.
    pub org_budget_micros: Option<u64>,
    pub org_budget_tokens: Option<u64>,
    pub cooldown_ms: u64,
    /// Files of the repository the fix stage shows the model.
    pub target_files: Vec<String>,
    /// Zulip channel of the triage threads.
    pub channel: String,
    /// Branch fixes are based on and merged into.
    pub base_branch: String,
    pub analytics_project_id: String,
    pub analytics_event: String,
    /// Errors after the merge above which the fix counts as regressed, applied to the GlitchTip issue's events and to
    /// the analytics error total alike; resolved needs both at 0.
    pub regression_threshold: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_attempts: 3,
            max_generations: 2,
            observe_window_ms: 60_000,
            ci_poll_ms: 2_000,
            ci_max_polls: 30,
            stall_ms: 24 * 60 * 60 * 1000,
            recheck_ms: 60_000,
            budget_tokens: 400_000,
            budget_micros: 2_000_000,
            org_budget_micros: None,
            org_budget_tokens: None,
            cooldown_ms: 600_000,
            target_files: vec!["src/checkout.py".into()],
            channel: "factory".into(),
            base_branch: "main".into(),
            analytics_project_id: "default".into(),
            analytics_event: "checkout_error".into(),
            regression_threshold: 5,
        }
    }
}

/// Model prices in micro-dollars per million tokens.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prices {
    pub input_micros_per_mtok: u64,
    pub output_micros_per_mtok: u64,
}

impl Default for Prices {
    fn default() -> Self {
        // deepseek-chat list prices (USD 0.27 / 1.10 per million tokens).
        Prices {
            input_micros_per_mtok: 270_000,
            output_micros_per_mtok: 1_100_000,
        }
    }
}

impl Prices {
    pub fn cost_micros(&self, input_tokens: u64, output_tokens: u64) -> u64 {
        let c = (u128::from(input_tokens) * u128::from(self.input_micros_per_mtok)
            + u128::from(output_tokens) * u128::from(self.output_micros_per_mtok))
            / 1_000_000;
        u64::try_from(c).unwrap_or(u64::MAX)
    }
}

/// The organisation's model spend this month, read by the worker before a decision when the configuration sets a
/// monthly limit (`Config::org_budget_micros`, `org_budget_tokens`, which the limits are read from).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(default)]
pub struct OrgSpend {
    pub spent_micros: u64,
    pub spent_tokens: u64,
}

impl OrgSpend {
    /// Whether either of `config`'s monthly limits is reached.
    pub fn exhausted(&self, config: &Config) -> bool {
        config
            .org_budget_micros
            .is_some_and(|limit| self.spent_micros >= limit)
            || config
                .org_budget_tokens
                .is_some_and(|limit| self.spent_tokens >= limit)
    }
}

/// The kill switches that bear on a decision, read strongly by the worker before it asks for one. They are items of
/// kind `kill` with the ids `org`, `agent:<name>` and [`run_kill_switch_id`].
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(default)]
pub struct KillSwitches {
    pub org: bool,
    pub agents: Vec<String>,
    /// The runs among those the decision concerns (the run it moves, or the one it opens) whose switch is set.
    pub runs: Vec<String>,
}

/// The id of a run's kill switch item (kind `kill`).
pub fn run_kill_switch_id(run_id: &str) -> String {
    format!("run:{run_id}")
}

/// The last run opened for a signal's fingerprint (item kind `fingerprint`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LastRun {
    pub run_id: String,
    /// When it was opened.
    pub at_ms: i64,
}

/// What the worker knows of [`Ctx::last_run`]'s state when it opens a signal.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum LastRunStatus {
    /// Not looked up: the cooldown then counts from the last run's opening.
    #[default]
    Unknown,
    /// Still running: a repeat of the alert belongs to it.
    Open,
    /// Ended at `at_ms`: the cooldown counts from there.
    Ended { at_ms: i64 },
}

/// Everything outside the run that a decision may depend on, supplied by the worker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Ctx {
    pub now_ms: i64,
    pub org: String,
    pub env: String,
    pub config: Config,
    pub policy: Policy,
    pub prices: Prices,
    pub kill: KillSwitches,
    #[serde(default)]
    pub org_spend: OrgSpend,
    /// Used by [`open`] for the lineage and the cooldown per fingerprint.
    pub last_run: Option<LastRun>,
    #[serde(default)]
    pub last_run_status: LastRunStatus,
    /// The person the run acts for (approvals are requested on their behalf; they cannot approve them).
    pub owner: Option<String>,
}

impl Ctx {
    pub fn new(org: &str, env: &str, now_ms: i64) -> Ctx {
        Ctx {
            now_ms,
            org: org.into(),
            env: env.into(),
            config: Config::default(),
            policy: Policy::default(),
            prices: Prices::default(),
            kill: KillSwitches::default(),
            org_spend: OrgSpend::default(),
            last_run: None,
            last_run_status: LastRunStatus::Unknown,
            owner: None,
        }
    }
}

/// Why [`open`] or [`decide`] refused; each maps to one clear error at the worker or the API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("fingerprint in cooldown until {until_ms}")]
    Cooldown { until_ms: i64 },
    #[error("generation {generation} is above the cap of {cap}")]
    GenerationCap { generation: u32, cap: u32 },
    #[error("the kill switch is on ({0})")]
    Killed(String),
    #[error("invalid signal: {0}")]
    InvalidSignal(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
