//! The events of a run's append-only log. Folding them with [`crate::Run::apply`] rebuilds the run exactly, so every
//! event carries whatever the transition needed from outside (times, outputs, token counts, costs).

use serde::{Deserialize, Serialize};

use crate::effect::ApprovalRequest;
use crate::patch::FileContent;
use crate::review::Finding;
use crate::run::RunState;
use crate::{CiReport, Config, Signal};

/// Why a run stopped (snake_case on the wire).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Attempts exhausted: handed to a person (draft PR labelled `factory:needs-human`).
    FailSafe,
    /// The same CI failure twice in a row, or a patch identical to the previous attempt's.
    NoProgress,
    /// A check that passed in an earlier attempt fails now.
    Oscillation,
    /// Tokens or money of the run spent.
    Budget,
    /// A wait went past its timeout.
    Stalled,
    PolicyDenied,
    ApprovalDenied,
    TriageRejected,
    /// A step failed for good (not retryable, retries exhausted, or an output that does not match the contract).
    StepFailed,
    Killed,
    Regressed,
}

impl Reason {
    /// Reasons that hand the work to a person instead of undoing it.
    pub fn hands_off(self) -> bool {
        matches!(
            self,
            Reason::FailSafe | Reason::NoProgress | Reason::Oscillation | Reason::Budget
        )
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    /// Stall timeout of the wait for a triage decision.
    Triage,
    /// The next CI poll.
    Ci,
    /// Expiry of a pending approval.
    Approval,
    /// End of the observe window.
    Observe,
    /// Stall timeout of the wait for a person's verdict.
    Verdict,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ObserveVerdict {
    Resolved,
    Regressed,
    Inconclusive,
}

/// One step of a run's ending (close, compensation or hand-off), performed in order, each its own step.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishStep {
    ClosePr,
    DraftPr,
    Revert,
    Resolve,
    CompleteIssue,
    Comment,
    Post,
}

impl FinishStep {
    pub fn action(self) -> &'static str {
        match self {
            FinishStep::ClosePr => "close_pr",
            FinishStep::DraftPr => "draft_pr",
            FinishStep::Revert => "revert",
            FinishStep::Resolve => "resolve",
            FinishStep::CompleteIssue => "set_state",
            FinishStep::Comment => "comment",
            FinishStep::Post => "post",
        }
    }
}

/// A regressed run asks the worker to open a new run: `open(signal, ctx)` with this signal (generation + 1,
/// parent_run set).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FollowUp {
    pub generation: u32,
    pub parent_run: String,
    pub signal: Signal,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Opened {
        id: String,
        org: String,
        env: String,
        signal: Signal,
        owner: Option<String>,
        config: Config,
        at_ms: i64,
    },
    StepFailed {
        step: String,
        error: String,
        retryable: bool,
    },
    /// A wait until `due_ms`; its first timer fires at `wake_ms` (a re-check, see `Config::recheck_ms`), or at
    /// `due_ms` when absent (waits recorded before re-checks).
    WaitStarted {
        timer_id: String,
        kind: WaitKind,
        due_ms: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        wake_ms: Option<i64>,
    },
    /// A re-check timer fired before the wait's deadline with nothing new: the run waits on under timer
    /// `timer_id`, firing at `wake_ms`.
    WaitRechecked {
        timer_id: String,
        wake_ms: i64,
    },
    TimerScheduled {
        timer_id: String,
    },
    TimerFired {
        timer_id: String,
    },
    ThreadOpened {
        message_id: u64,
        url: String,
    },
    TriageDecided {
        accept: bool,
        automatic: bool,
        by: String,
    },
    IssueCreated {
        id: String,
        key: String,
        url: String,
    },
    IssueLinked {
        message_id: u64,
    },
    AttemptStarted {
        attempt: u32,
    },
    FilesRead {
        files: Vec<FileContent>,
    },
    ModelAnswered {
        step: String,
        purpose: String,
        input_tokens: u64,
        output_tokens: u64,
        cost_micros: u64,
    },
    PatchProposed {
        files: Vec<FileContent>,
        patch_hash: String,
    },
    Committed {
        sha: String,
    },
    PrOpened {
        number: u64,
        url: String,
        head_sha: String,
    },
    CiPending {
        poll: u32,
    },
    CiFinished {
        passed: bool,
        report: CiReport,
    },
    LeadReviewed {
        approved: bool,
        report: String,
    },
    SecurityAudited {
        approved: bool,
        findings: Vec<Finding>,
        report: String,
    },
    /// The attempt failed; `feedback` (CI log tail, review report, findings, parse error) goes to the next one.
    AttemptFailed {
        attempt: u32,
        reason: String,
        feedback: String,
    },
    GateOpened {
        request: ApprovalRequest,
    },
    /// The approval is stored; the run waits for it until it expires, its first timer firing at `wake_ms` (see
    /// `WaitStarted`).
    ApprovalRequested {
        approval_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        wake_ms: Option<i64>,
    },
    ApprovalSettled {
        approval_id: String,
        approved: bool,
        by: String,
    },
    Merged {
        merge_sha: String,
        at_ms: i64,
    },
    IssueEventsRead {
        count: u64,
        last_seen_ms: Option<i64>,
    },
    SeriesRead {
        total: u64,
    },
    VerdictReached {
        verdict: ObserveVerdict,
        by: Option<String>,
    },
    /// The run stops for `reason`; what follows (compensation, hand-off, revert) is derived from the run's links.
    /// A stop while already ending only turns the ending into `killed` when it is a kill.
    Abandoned {
        state: RunState,
        reason: Reason,
        detail: String,
    },
    FinishStepDone {
        step: String,
        action: FinishStep,
        url: Option<String>,
    },
    /// Closing the PR found it merged: the merge was performed but its outcome never recorded (a crash in between).
    /// The run now knows the deploy and compensates for it instead of closing the PR.
    MergeFound {
        merge_sha: String,
    },
    FinishStepSkipped {
        step: String,
        action: FinishStep,
        reason: String,
    },
    Ended {
        state: RunState,
        reason: Option<Reason>,
        verdict: Option<ObserveVerdict>,
        follow_up: Option<FollowUp>,
    },
}

impl Event {
    /// One line saying what happened, for timelines (phones, `loams demo`). Untrusted text (titles, reports, logs)
    /// stays out of it: those are in the event's fields, shown quoted where a person asks for them.
    pub fn summary(&self) -> String {
        match self {
            Event::Opened { signal, .. } => format!(
                "run opened from {} (generation {})",
                signal.source, signal.generation
            ),
            Event::StepFailed {
                step, retryable, ..
            } => {
                format!(
                    "step {} failed{}",
                    step.rsplit(':').next().unwrap_or(step),
                    if *retryable { ", will retry" } else { "" }
                )
            }
            Event::WaitStarted { kind, .. } => format!("waiting ({})", wait_name(*kind)),
            Event::WaitRechecked { .. } => "still waiting".into(),
            Event::TimerScheduled { .. } => "timer set".into(),
            Event::TimerFired { .. } => "timer fired".into(),
            Event::ThreadOpened { message_id, .. } => {
                format!("triage thread opened (message {message_id})")
            }
            Event::TriageDecided {
                accept,
                automatic,
                by,
            } => format!(
                "triage {} {}",
                if *accept { "accepted" } else { "rejected" },
                if *automatic {
                    "automatically by policy".to_string()
                } else {
                    format!("by {by}")
                }
            ),
            Event::IssueCreated { key, .. } => format!("issue {key} created"),
            Event::IssueLinked { .. } => "issue linked in the thread".into(),
            Event::AttemptStarted { attempt } => format!("fix attempt {attempt}"),
            Event::FilesRead { files } => format!("read {} file(s)", files.len()),
            Event::ModelAnswered {
                purpose,
                input_tokens,
                output_tokens,
                ..
            } => {
                format!(
                    "model answered for {purpose} ({} tokens)",
                    input_tokens.saturating_add(*output_tokens)
                )
            }
            Event::PatchProposed { files, .. } => {
                format!("patch proposed for {} file(s)", files.len())
            }
            Event::Committed { sha } => format!("committed {}", short_sha(sha)),
            Event::PrOpened { number, .. } => format!("pull request #{number} opened"),
            Event::CiPending { poll } => format!("CI pending (poll {poll})"),
            Event::CiFinished { passed, report } => {
                if *passed {
                    "CI passed".into()
                } else {
                    format!(
                        "CI failed ({} failing check(s))",
                        report.failing.len().max(1)
                    )
                }
            }
            Event::LeadReviewed { approved, .. } => {
                if *approved {
                    "lead review: All good".into()
                } else {
                    "lead review asks for changes".into()
                }
            }
            Event::SecurityAudited {
                approved, findings, ..
            } => {
                format!(
                    "security audit {} ({} finding(s))",
                    if *approved { "passed" } else { "blocks" },
                    findings.len()
                )
            }
            Event::AttemptFailed {
                attempt, reason, ..
            } => format!("attempt {attempt} failed: {reason}"),
            Event::GateOpened { request } => format!(
                "approval needed for {}.{}",
                request.action.agent, request.action.skill
            ),
            Event::ApprovalRequested { .. } => "approval requested".into(),
            Event::ApprovalSettled { approved, by, .. } => {
                format!("{} by {by}", if *approved { "approved" } else { "denied" })
            }
            Event::Merged { merge_sha, .. } => {
                format!("merged and deployed {}", short_sha(merge_sha))
            }
            Event::IssueEventsRead { count, .. } => {
                format!("{count} error event(s) since the merge")
            }
            Event::SeriesRead { total } => format!("analytics: {total} event(s)"),
            Event::VerdictReached { verdict, .. } => format!("verdict: {}", verdict_name(*verdict)),
            Event::Abandoned { reason, .. } => format!("stopped: {}", reason_name(*reason)),
            Event::FinishStepDone { action, .. } => format!("{} done", action.action()),
            Event::MergeFound { merge_sha } => {
                format!(
                    "the PR was already merged and deployed {}",
                    short_sha(merge_sha)
                )
            }
            Event::FinishStepSkipped { action, .. } => format!("{} skipped", action.action()),
            Event::Ended { state, reason, .. } => match reason {
                Some(reason) => format!("run {} ({})", state.as_str(), reason_name(*reason)),
                None => format!("run {}", state.as_str()),
            },
        }
    }
}

fn short_sha(sha: &str) -> &str {
    sha.get(..10).unwrap_or(sha)
}

/// The snake_case wire name of a unit enum value.
fn wire_name<T: Serialize>(value: T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn wait_name(kind: WaitKind) -> String {
    wire_name(kind)
}

fn verdict_name(verdict: ObserveVerdict) -> String {
    wire_name(verdict)
}

fn reason_name(reason: Reason) -> String {
    wire_name(reason)
}

#[cfg(test)]
mod tests {
    use super::Event;

    #[test]
    fn a_summary_of_tokens_no_model_could_use_does_not_overflow() {
        // The counts come from the model endpoint; the run's record must still read.
        let answered = Event::ModelAnswered {
            step: "r-1:fix:1:propose".into(),
            purpose: "fix".into(),
            input_tokens: u64::MAX,
            output_tokens: 1,
            cost_micros: 0,
        };
        assert_eq!(
            answered.summary(),
            format!("model answered for fix ({} tokens)", u64::MAX)
        );
    }
}
