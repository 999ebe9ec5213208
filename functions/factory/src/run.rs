//! The run record, its fold over events, and the effect it asks for next.

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::approval::{ApprovalAction, ApprovalState};
use crate::effect::{ApprovalRequest, Effect};
use crate::event::{Event, FinishStep, FollowUp, ObserveVerdict, Reason, WaitKind};
use crate::ids::{action_hash, step_id};
use crate::patch::FileContent;
use crate::policy::{Risk, risk_of};
use crate::{CiReport, Config, Rejection, Signal, prompts};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Open,
    Waiting,
    Succeeded,
    Failed,
    Killed,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Open => "open",
            RunState::Waiting => "waiting",
            RunState::Succeeded => "succeeded",
            RunState::Failed => "failed",
            RunState::Killed => "killed",
        }
    }

    /// The state a stored name (`as_str`) stands for; the store indexes runs by that name.
    pub fn parse(name: &str) -> Option<RunState> {
        [
            RunState::Open,
            RunState::Waiting,
            RunState::Succeeded,
            RunState::Failed,
            RunState::Killed,
        ]
        .into_iter()
        .find(|s| s.as_str() == name)
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Succeeded | RunState::Failed | RunState::Killed
        )
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Triage,
    Plan,
    Fix,
    Review,
    Approve,
    Deploy,
    Observe,
    Close,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Triage => "triage",
            Stage::Plan => "plan",
            Stage::Fix => "fix",
            Stage::Review => "review",
            Stage::Approve => "approve",
            Stage::Deploy => "deploy",
            Stage::Observe => "observe",
            Stage::Close => "close",
        }
    }
}

/// Where in its stage the run is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Cursor {
    OpenThread,
    AwaitTriage,
    CreateIssue,
    PostIssueLink,
    ReadFiles,
    ProposeFix,
    CommitPatch,
    OpenPr,
    CiStatus,
    AwaitCi,
    LeadReview,
    SecurityAudit,
    Merge,
    AwaitObserve,
    IssueEvents,
    Series,
    AwaitVerdict,
    /// Performing `Run::finish` in order; the run ends when it is empty.
    Finishing,
    Done,
}

impl Cursor {
    /// Cursors that wait for something from outside, with a timer the engine starts on arrival.
    pub(crate) fn wait_kind(self) -> Option<WaitKind> {
        match self {
            Cursor::AwaitTriage => Some(WaitKind::Triage),
            Cursor::AwaitCi => Some(WaitKind::Ci),
            Cursor::AwaitObserve => Some(WaitKind::Observe),
            Cursor::AwaitVerdict => Some(WaitKind::Verdict),
            _ => None,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Links {
    pub thread_message_id: Option<u64>,
    pub thread_url: Option<String>,
    pub issue_id: Option<String>,
    pub issue_key: Option<String>,
    pub issue_url: Option<String>,
    pub commit_sha: Option<String>,
    pub pr_number: Option<u64>,
    pub pr_url: Option<String>,
    pub head_sha: Option<String>,
    /// The merge commit: with GitOps the merge is the deploy.
    pub deploy_ref: Option<String>,
    pub merged_at_ms: Option<i64>,
    /// The revert PR, or the draft PR of a hand-off.
    pub follow_pr_url: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TriageRecord {
    pub accept: bool,
    pub automatic: bool,
    pub by: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    pub attempt: u32,
    pub patch_hash: Option<String>,
    pub ci: Option<CiReport>,
    pub ci_passed: Option<bool>,
    pub failure: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ApprovalRecord {
    pub id: String,
    pub skill: String,
    pub action_hash: String,
    pub state: ApprovalState,
    pub by: Option<String>,
}

/// An approval the run waits for before a gated call.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Gate {
    pub request: ApprovalRequest,
    pub approval_id: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PendingWait {
    /// The timer the run waits for now: the wait's first timer, then the latest re-check's.
    pub timer_id: String,
    pub kind: WaitKind,
    /// The wait's deadline (approval expiry, stall timeout, end of the observe window, next CI poll).
    pub due_ms: i64,
    /// The worker confirmed the timer is stored; until then `next_effect` keeps asking for it.
    pub scheduled: bool,
    /// When the current timer fires: before `due_ms` it is a re-check. `None` for a wait recorded before
    /// re-checks existed, whose only timer is the deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_ms: Option<i64>,
    /// Re-checks so far; numbers the re-check timers.
    #[serde(default)]
    pub rechecks: u32,
}

impl PendingWait {
    fn new(timer_id: String, kind: WaitKind, due_ms: i64, wake_ms: Option<i64>) -> PendingWait {
        PendingWait {
            timer_id,
            kind,
            due_ms,
            scheduled: false,
            wake_ms,
            rechecks: 0,
        }
    }

    /// When the current timer fires.
    pub fn fires_at_ms(&self) -> i64 {
        self.wake_ms.unwrap_or(self.due_ms).min(self.due_ms)
    }

    /// Whether the current timer is a re-check rather than the deadline.
    pub fn is_recheck(&self) -> bool {
        self.fires_at_ms() < self.due_ms
    }

    /// The id of the next re-check timer: the wait's first timer id with a counter. Each re-check has its own id
    /// because the scheduler cancels a fired timer by id, which must not drop the re-check scheduled after it.
    pub(crate) fn next_recheck_id(&self) -> String {
        let first = match self.rechecks {
            0 => self.timer_id.as_str(),
            n => self
                .timer_id
                .strip_suffix(&format!(".recheck{n}"))
                .unwrap_or(&self.timer_id),
        };
        format!("{first}.recheck{}", self.rechecks + 1)
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    pub limit_tokens: u64,
    pub limit_micros: u64,
    pub tokens: u64,
    pub micros: u64,
}

impl Budget {
    pub fn exhausted(&self) -> bool {
        self.tokens >= self.limit_tokens || self.micros >= self.limit_micros
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    pub count: Option<u64>,
    pub last_seen_ms: Option<i64>,
    pub series_total: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    pub state: RunState,
    pub reason: Option<Reason>,
    pub detail: String,
    /// The state the ending was announced with. A kill arriving while the run is already ending turns `state` into
    /// killed, but the closing comment and post keep the text they started with: a step performed before the kill
    /// was recorded must be the very same effect when it is performed again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announced: Option<RunState>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Run {
    pub id: String,
    pub org: String,
    pub env: String,
    pub generation: u32,
    pub parent_run: Option<String>,
    pub signal: Signal,
    pub owner: Option<String>,
    pub config: Config,
    pub state: RunState,
    pub stage: Stage,
    pub cursor: Cursor,
    /// Current fix attempt (0 before the fix stage).
    pub attempt: u32,
    /// Failed tries of the current step; part of the step id so a retry is a new A2A message.
    pub retries: u32,
    pub ci_polls: u32,
    pub observe_round: u32,
    pub links: Links,
    pub triage: Option<TriageRecord>,
    /// The repository files read for the current attempt.
    pub files: Vec<FileContent>,
    /// The files the current attempt proposes.
    pub patch: Vec<FileContent>,
    /// What went wrong in the previous attempt (CI log tail, review report, audit findings).
    pub feedback: Option<String>,
    pub attempts: Vec<AttemptRecord>,
    pub approvals: Vec<ApprovalRecord>,
    pub gate: Option<Gate>,
    pub wait: Option<PendingWait>,
    pub budget: Budget,
    pub observation: Observation,
    pub verdict: Option<ObserveVerdict>,
    pub ending: Option<Ending>,
    pub finish: Vec<FinishStep>,
    pub follow_up: Option<FollowUp>,
    pub started_at_ms: i64,
    /// Number of events folded into this record.
    pub version: u64,
}

impl Run {
    fn opened(
        id: &str,
        org: &str,
        env: &str,
        signal: &Signal,
        owner: &Option<String>,
        config: &Config,
        at: i64,
    ) -> Run {
        Run {
            id: id.into(),
            org: org.into(),
            env: env.into(),
            generation: signal.generation,
            parent_run: signal.parent_run.clone(),
            signal: signal.clone(),
            owner: owner.clone(),
            config: config.clone(),
            state: RunState::Open,
            stage: Stage::Triage,
            cursor: Cursor::OpenThread,
            attempt: 0,
            retries: 0,
            ci_polls: 0,
            observe_round: 0,
            links: Links::default(),
            triage: None,
            files: Vec::new(),
            patch: Vec::new(),
            feedback: None,
            attempts: Vec::new(),
            approvals: Vec::new(),
            gate: None,
            wait: None,
            budget: Budget {
                limit_tokens: config.budget_tokens,
                limit_micros: config.budget_micros,
                tokens: 0,
                micros: 0,
            },
            observation: Observation::default(),
            verdict: None,
            ending: None,
            finish: Vec::new(),
            follow_up: None,
            started_at_ms: at,
            version: 0,
        }
    }

    /// Rebuilds a run from its event log (the first event must be `Opened`).
    pub fn from_events(events: &[Event]) -> Result<Run, Rejection> {
        let Some(Event::Opened {
            id,
            org,
            env,
            signal,
            owner,
            config,
            at_ms,
        }) = events.first()
        else {
            return Err(Rejection::InvalidInput(
                "an event log starts with `opened`".into(),
            ));
        };
        let mut run = Run::opened(id, org, env, signal, owner, config, *at_ms);
        run.version = 1;
        for e in &events[1..] {
            run.apply(e);
        }
        Ok(run)
    }

    /// Folds one event into the record. Applying `Opened` resets the record to the opened run.
    pub fn apply(&mut self, e: &Event) {
        let progress = !matches!(e, Event::StepFailed { .. });
        match e {
            Event::Opened {
                id,
                org,
                env,
                signal,
                owner,
                config,
                at_ms,
            } => {
                *self = Run::opened(id, org, env, signal, owner, config, *at_ms);
            }
            Event::StepFailed { .. } => self.retries += 1,
            Event::WaitStarted {
                timer_id,
                kind,
                due_ms,
                wake_ms,
            } => {
                self.wait = Some(PendingWait::new(timer_id.clone(), *kind, *due_ms, *wake_ms));
            }
            Event::WaitRechecked { timer_id, wake_ms } => {
                if let Some(w) = self.wait.as_mut() {
                    w.timer_id = timer_id.clone();
                    w.wake_ms = Some(*wake_ms);
                    w.rechecks += 1;
                    w.scheduled = false;
                }
            }
            Event::TimerScheduled { timer_id } => {
                if let Some(w) = self.wait.as_mut().filter(|w| &w.timer_id == timer_id) {
                    w.scheduled = true;
                }
            }
            Event::TimerFired { timer_id } => {
                if let Some(w) = self.wait.take_if(|w| &w.timer_id == timer_id) {
                    match w.kind {
                        WaitKind::Ci => {
                            self.ci_polls += 1;
                            self.cursor = Cursor::CiStatus;
                        }
                        WaitKind::Observe => {
                            self.cursor = if self.signal.glitchtip_issue_id.is_some() {
                                Cursor::IssueEvents
                            } else {
                                Cursor::Series
                            };
                        }
                        WaitKind::Approval => self.gate = None,
                        WaitKind::Triage | WaitKind::Verdict => {}
                    }
                }
            }
            Event::ThreadOpened { message_id, url } => {
                self.links.thread_message_id = Some(*message_id);
                self.links.thread_url = Some(url.clone());
                self.cursor = Cursor::AwaitTriage;
            }
            Event::TriageDecided {
                accept,
                automatic,
                by,
            } => {
                self.triage = Some(TriageRecord {
                    accept: *accept,
                    automatic: *automatic,
                    by: by.clone(),
                });
                self.wait = None;
                if *accept {
                    self.cursor = Cursor::CreateIssue;
                }
            }
            Event::IssueCreated { id, key, url } => {
                self.links.issue_id = Some(id.clone());
                self.links.issue_key = Some(key.clone());
                self.links.issue_url = Some(url.clone());
                self.cursor = Cursor::PostIssueLink;
            }
            Event::IssueLinked { .. } => {}
            Event::AttemptStarted { attempt } => {
                self.attempt = *attempt;
                self.files.clear();
                self.patch.clear();
                self.ci_polls = 0;
                self.attempts.push(AttemptRecord {
                    attempt: *attempt,
                    patch_hash: None,
                    ci: None,
                    ci_passed: None,
                    failure: None,
                });
                self.cursor = Cursor::ReadFiles;
            }
            Event::FilesRead { files } => {
                self.files = files.clone();
                self.cursor = Cursor::ProposeFix;
            }
            Event::ModelAnswered {
                input_tokens,
                output_tokens,
                cost_micros,
                ..
            } => {
                self.budget.tokens = self
                    .budget
                    .tokens
                    .saturating_add(input_tokens.saturating_add(*output_tokens));
                self.budget.micros = self.budget.micros.saturating_add(*cost_micros);
            }
            Event::PatchProposed { files, patch_hash } => {
                self.patch = files.clone();
                if let Some(a) = self.attempts.last_mut() {
                    a.patch_hash = Some(patch_hash.clone());
                }
                self.cursor = Cursor::CommitPatch;
            }
            Event::Committed { sha } => {
                self.links.commit_sha = Some(sha.clone());
                self.cursor = Cursor::OpenPr;
            }
            Event::PrOpened {
                number,
                url,
                head_sha,
            } => {
                self.links.pr_number = Some(*number);
                self.links.pr_url = Some(url.clone());
                self.links.head_sha = Some(head_sha.clone());
                self.ci_polls = 0;
                self.cursor = Cursor::CiStatus;
            }
            Event::CiPending { .. } => self.cursor = Cursor::AwaitCi,
            Event::CiFinished { passed, report } => {
                if let Some(a) = self.attempts.last_mut() {
                    a.ci = Some(report.clone());
                    a.ci_passed = Some(*passed);
                }
                if *passed {
                    self.cursor = Cursor::LeadReview;
                }
            }
            Event::LeadReviewed { approved, .. } => {
                if *approved {
                    self.cursor = Cursor::SecurityAudit;
                }
            }
            Event::SecurityAudited { approved, .. } => {
                if *approved {
                    self.cursor = Cursor::Merge;
                }
            }
            Event::AttemptFailed {
                reason, feedback, ..
            } => {
                if let Some(a) = self.attempts.last_mut() {
                    a.failure = Some(reason.clone());
                }
                self.feedback = Some(feedback.clone());
            }
            Event::GateOpened { request } => {
                self.gate = Some(Gate {
                    request: request.clone(),
                    approval_id: None,
                });
            }
            Event::ApprovalRequested {
                approval_id,
                wake_ms,
            } => {
                if let Some(g) = self.gate.as_mut() {
                    g.approval_id = Some(approval_id.clone());
                    self.approvals.push(ApprovalRecord {
                        id: approval_id.clone(),
                        skill: g.request.action.skill.clone(),
                        action_hash: g.request.action_hash.clone(),
                        state: ApprovalState::Pending,
                        by: None,
                    });
                    self.wait = Some(PendingWait::new(
                        format!("{}.wait", g.request.id),
                        WaitKind::Approval,
                        g.request.expires_at_ms,
                        *wake_ms,
                    ));
                }
            }
            Event::ApprovalSettled {
                approval_id,
                approved,
                by,
            } => {
                let state = if *approved {
                    ApprovalState::Approved
                } else {
                    ApprovalState::Denied
                };
                if let Some(g) = self.gate.take() {
                    let ids = [Some(&g.request.id), g.approval_id.as_ref()];
                    match self
                        .approvals
                        .iter_mut()
                        .find(|a| ids.contains(&Some(&a.id)))
                    {
                        Some(rec) => {
                            rec.state = state;
                            rec.by = Some(by.clone());
                        }
                        None => self.approvals.push(ApprovalRecord {
                            id: approval_id.clone(),
                            skill: g.request.action.skill.clone(),
                            action_hash: g.request.action_hash.clone(),
                            state,
                            by: Some(by.clone()),
                        }),
                    }
                }
                self.wait.take_if(|w| w.kind == WaitKind::Approval);
            }
            Event::Merged { merge_sha, at_ms } => {
                self.links.deploy_ref = Some(merge_sha.clone());
                self.links.merged_at_ms = Some(*at_ms);
                self.observe_round = 1;
                self.cursor = Cursor::AwaitObserve;
            }
            Event::IssueEventsRead {
                count,
                last_seen_ms,
            } => {
                self.observation.count = Some(*count);
                self.observation.last_seen_ms = *last_seen_ms;
                self.cursor = Cursor::Series;
            }
            Event::SeriesRead { total } => self.observation.series_total = Some(*total),
            Event::VerdictReached { verdict, .. } => {
                self.verdict = Some(*verdict);
                self.wait = None;
                match verdict {
                    ObserveVerdict::Resolved => {
                        let mut steps = Vec::new();
                        if self.signal.glitchtip_issue_id.is_some() {
                            steps.push(FinishStep::Resolve);
                        }
                        if self.links.issue_id.is_some() {
                            steps.push(FinishStep::CompleteIssue);
                        }
                        steps.push(FinishStep::Post);
                        self.start_finish(RunState::Succeeded, None, String::new(), steps);
                    }
                    ObserveVerdict::Regressed => {
                        let steps = self.tell(vec![FinishStep::Revert]);
                        self.start_finish(
                            RunState::Failed,
                            Some(Reason::Regressed),
                            String::new(),
                            steps,
                        );
                    }
                    ObserveVerdict::Inconclusive if self.observe_round < 2 => {
                        self.observe_round += 1;
                        self.cursor = Cursor::AwaitObserve;
                    }
                    ObserveVerdict::Inconclusive => self.cursor = Cursor::AwaitVerdict,
                }
            }
            Event::Abandoned {
                state,
                reason,
                detail,
            } => match self.ending.as_mut() {
                Some(ending) => {
                    if *state == RunState::Killed {
                        ending.state = RunState::Killed;
                    }
                }
                None => {
                    let first = self.compensation(reason.hands_off(), *reason == Reason::Killed);
                    let steps = self.tell(first.into_iter().collect());
                    self.start_finish(*state, Some(*reason), detail.clone(), steps);
                }
            },
            Event::MergeFound { merge_sha } => {
                self.links.deploy_ref = Some(merge_sha.clone());
                if self.finish.first() == Some(&FinishStep::ClosePr) {
                    self.finish.remove(0);
                }
                // The ending stays what it was; the compensation is now the one for a deployed change (a kill,
                // first or later, reverts it).
                if let Some(ending) = &self.ending
                    && let Some(step) = self.compensation(
                        ending.reason.is_some_and(Reason::hands_off),
                        ending.state == RunState::Killed,
                    )
                {
                    self.finish.insert(0, step);
                }
            }
            Event::FinishStepDone { url, action, .. } => {
                if matches!(action, FinishStep::Revert | FinishStep::DraftPr) {
                    self.links.follow_pr_url = url.clone();
                }
                if !self.finish.is_empty() {
                    self.finish.remove(0);
                }
            }
            Event::FinishStepSkipped { .. } => {
                if !self.finish.is_empty() {
                    self.finish.remove(0);
                }
                self.gate = None;
                self.wait = None;
            }
            Event::Ended {
                state,
                verdict,
                follow_up,
                ..
            } => {
                self.state = *state;
                if verdict.is_some() {
                    self.verdict = *verdict;
                }
                self.follow_up = follow_up.clone();
                self.cursor = Cursor::Done;
                self.gate = None;
                self.wait = None;
            }
        }
        if progress {
            self.retries = 0;
        }
        self.version += 1;
        self.refresh();
    }

    /// The step that undoes or hands off the run's work when it stops: once the change is deployed only a kill
    /// reverts it (other stops leave a deploy that passed review to people); before that, a hand-off opens a draft
    /// PR and any other stop closes the PR.
    fn compensation(&self, hands_off: bool, killed: bool) -> Option<FinishStep> {
        if self.links.deploy_ref.is_some() {
            killed.then_some(FinishStep::Revert)
        } else if hands_off {
            self.links
                .commit_sha
                .is_some()
                .then_some(FinishStep::DraftPr)
        } else {
            self.links
                .pr_number
                .is_some()
                .then_some(FinishStep::ClosePr)
        }
    }

    /// Appends the comment and post that tell people, where an issue and a thread exist.
    fn tell(&self, mut steps: Vec<FinishStep>) -> Vec<FinishStep> {
        if self.links.issue_id.is_some() {
            steps.push(FinishStep::Comment);
        }
        if self.links.thread_message_id.is_some() {
            steps.push(FinishStep::Post);
        }
        steps
    }

    fn start_finish(
        &mut self,
        state: RunState,
        reason: Option<Reason>,
        detail: String,
        steps: Vec<FinishStep>,
    ) {
        self.ending = Some(Ending {
            state,
            reason,
            detail,
            announced: Some(state),
        });
        self.finish = steps;
        self.cursor = Cursor::Finishing;
        self.gate = None;
        self.wait = None;
    }

    fn refresh(&mut self) {
        if self.state.is_terminal() {
            return;
        }
        self.stage = match self.cursor {
            Cursor::OpenThread | Cursor::AwaitTriage => Stage::Triage,
            Cursor::CreateIssue | Cursor::PostIssueLink => Stage::Plan,
            Cursor::ReadFiles
            | Cursor::ProposeFix
            | Cursor::CommitPatch
            | Cursor::OpenPr
            | Cursor::CiStatus
            | Cursor::AwaitCi => Stage::Fix,
            Cursor::LeadReview | Cursor::SecurityAudit => Stage::Review,
            Cursor::Merge => match self.planned() {
                Some(call) if self.approval_for(&call).is_some() => Stage::Deploy,
                _ => Stage::Approve,
            },
            Cursor::AwaitObserve | Cursor::IssueEvents | Cursor::Series | Cursor::AwaitVerdict => {
                Stage::Observe
            }
            Cursor::Finishing | Cursor::Done => Stage::Close,
        };
        let waiting = self.wait.is_some()
            || self.gate.is_some()
            || matches!(self.cursor, Cursor::AwaitTriage | Cursor::AwaitVerdict);
        self.state = if waiting {
            RunState::Waiting
        } else {
            RunState::Open
        };
    }

    /// The `<attempt>` part of step ids: the fix attempt, or the observe round while observing.
    fn slot(&self) -> u32 {
        match self.stage {
            Stage::Triage | Stage::Plan => 0,
            Stage::Observe => self.observe_round,
            _ => self.attempt,
        }
    }

    /// The step id of `action` at the run's current position.
    pub fn step(&self, action: &str) -> String {
        let action = if self.retries > 0 {
            format!("{action}~{}", self.retries + 1)
        } else {
            action.to_string()
        };
        step_id(&self.id, self.stage.as_str(), self.slot(), &action)
    }

    /// The current attempt's patch: its short hash and the paths it changes (`patch 0123456789ab: a.py, b.py`).
    pub fn change_binding(&self) -> String {
        let hash = self
            .attempts
            .last()
            .and_then(|a| a.patch_hash.as_deref())
            .unwrap_or("none");
        let paths: Vec<&str> = self.patch.iter().map(|f| f.path.as_str()).collect();
        format!(
            "patch {}: {}",
            hash.get(..12).unwrap_or(hash),
            paths.join(", ")
        )
    }

    /// What an attempt commits: the patched files, and every other target file as it is on the base. So the
    /// branch head differs from the base by exactly this attempt's patch, whatever earlier attempts committed:
    /// the reviews and the merge approval, which see and bind this patch only, cover the whole change that merges.
    pub fn commit_files(&self) -> Vec<FileContent> {
        let mut files = self.patch.clone();
        for base in &self.files {
            if base.content.is_some() && !self.patch.iter().any(|f| f.path == base.path) {
                files.push(base.clone());
            }
        }
        files
    }

    pub fn branch(&self) -> String {
        format!("factory/{}", self.id)
    }

    /// The Zulip topic of the run's thread: the signal title, cut to Zulip's 60 characters.
    pub fn topic(&self) -> String {
        self.signal.title.chars().take(60).collect()
    }

    /// The settled, approved approval whose action hash matches this call.
    pub(crate) fn approval_for(&self, call: &Effect) -> Option<&ApprovalRecord> {
        // Hashing the action serialises its arguments (a whole patch for a commit), and most calls of most runs
        // have no approval to match: look for one first.
        let mut approved = self
            .approvals
            .iter()
            .filter(|a| a.state == ApprovalState::Approved)
            .peekable();
        approved.peek()?;
        let hash = action_hash(&gated_action(self, call)?);
        approved.find(|a| a.action_hash == hash)
    }

    /// What the worker must do next, or `None` while the run waits or has ended. A destructive call is returned only
    /// once an approval with the matching action hash is settled (the safety wall), whatever the policy says.
    pub fn next_effect(&self) -> Option<Effect> {
        if self.state.is_terminal() {
            return None;
        }
        if let Some(w) = &self.wait {
            return (!w.scheduled).then(|| Effect::Wait {
                step: w.timer_id.clone(),
                timer_id: w.timer_id.clone(),
                due_ms: w.fires_at_ms(),
            });
        }
        if let Some(g) = &self.gate {
            return g.approval_id.is_none().then(|| Effect::RequestApproval {
                step: g.request.id.clone(),
                approval: Box::new(g.request.clone()),
            });
        }
        let mut effect = self.planned()?;
        if let Effect::Call { agent, skill, .. } = &effect {
            let granted = self.approval_for(&effect).map(|a| a.id.clone());
            if risk_of(agent, skill) == Risk::Destructive && granted.is_none() {
                return None;
            }
            if let Effect::Call { approval_id, .. } = &mut effect {
                *approval_id = granted;
            }
        }
        Some(effect)
    }

    fn call(
        &self,
        action: &str,
        agent: &str,
        skill: &str,
        args: serde_json::Value,
    ) -> Option<Effect> {
        Some(Effect::Call {
            step: self.step(action),
            agent: agent.into(),
            skill: skill.into(),
            args,
            approval_id: None,
        })
    }

    /// The effect of the cursor, before gates and walls.
    pub(crate) fn planned(&self) -> Option<Effect> {
        let c = &self.config;
        let l = &self.links;
        match self.cursor {
            Cursor::OpenThread => self.call(
                "open_thread",
                "zulip",
                "open_thread",
                json!({"channel": c.channel, "topic": self.topic(), "content": prompts::triage_evidence(self)}),
            ),
            Cursor::CreateIssue => self.call(
                "create_issue",
                "plane",
                "create_issue",
                json!({
                    "external_id": format!("factory:{}", self.id),
                    "title": self.topic(),
                    "description": prompts::issue_description(self),
                }),
            ),
            Cursor::PostIssueLink => self.call(
                "post_issue",
                "zulip",
                "post",
                json!({"channel": c.channel, "topic": self.topic(), "content": prompts::issue_link(self)}),
            ),
            // Always the base: every attempt is a whole change against it (see `commit_files`), never a layer on
            // top of an earlier attempt that the reviews of this one would not see.
            Cursor::ReadFiles => self.call(
                "read_files",
                "forgejo",
                "read_files",
                json!({"paths": c.target_files, "ref": c.base_branch}),
            ),
            Cursor::ProposeFix => Some(Effect::Model {
                step: self.step("propose"),
                purpose: "fix".into(),
                messages: prompts::fix_messages(self),
            }),
            Cursor::CommitPatch => self.call(
                "commit_patch",
                "forgejo",
                "commit_patch",
                // Pins the branch: the agent refuses to commit unless it stands at the factory's previous commit
                // (none yet: at the base head), so commits pushed by someone else never ride along into the merge.
                json!({
                    "branch": self.branch(),
                    "base": c.base_branch,
                    "expected_head": l.commit_sha,
                    "files": self.commit_files(),
                    "message": format!("factory: fix attempt {} for {}", self.attempt, self.id),
                }),
            ),
            Cursor::OpenPr => self.call(
                "open_pr",
                "forgejo",
                "open_pr",
                json!({
                    "branch": self.branch(),
                    "base": c.base_branch,
                    "title": format!("factory: {}", self.topic()),
                    "body": prompts::pr_body(self),
                }),
            ),
            Cursor::CiStatus => {
                self.call(&format!("ci_status.{}", self.ci_polls), "forgejo", "ci_status", json!({"sha": l.commit_sha}))
            }
            Cursor::LeadReview => Some(Effect::Model {
                step: self.step("lead_review"),
                purpose: "lead_review".into(),
                messages: prompts::lead_messages(self),
            }),
            Cursor::SecurityAudit => Some(Effect::Model {
                step: self.step("security_audit"),
                purpose: "security_audit".into(),
                messages: prompts::audit_messages(self),
            }),
            Cursor::Merge => {
                self.call("merge", "forgejo", "merge", json!({"number": l.pr_number, "head_sha": l.head_sha}))
            }
            Cursor::IssueEvents => self.call(
                "issue_events",
                "glitchtip",
                "issue_events",
                json!({"issue_id": self.signal.glitchtip_issue_id, "since_ms": l.merged_at_ms}),
            ),
            // Analytics exports take whole seconds: a start rounded down would count errors from before the merge
            // (and make a fixed run look inconclusive), so the series starts at the next whole second.
            Cursor::Series => self.call(
                "series",
                "analytics",
                "series",
                json!({
                    "project_id": c.analytics_project_id,
                    "event": c.analytics_event,
                    "since_ms": l.merged_at_ms.map(|t| t.saturating_add(999).div_euclid(1000).saturating_mul(1000)),
                }),
            ),
            Cursor::Finishing => self.finish_effect(*self.finish.first()?),
            Cursor::AwaitTriage | Cursor::AwaitCi | Cursor::AwaitObserve | Cursor::AwaitVerdict | Cursor::Done => None,
        }
    }

    fn finish_effect(&self, step: FinishStep) -> Option<Effect> {
        let c = &self.config;
        let l = &self.links;
        let action = step.action();
        match step {
            FinishStep::ClosePr => {
                self.call(action, "forgejo", "close_pr", json!({"number": l.pr_number, "branch": self.branch()}))
            }
            FinishStep::DraftPr => self.call(
                action,
                "forgejo",
                "open_pr",
                json!({
                    "branch": self.branch(),
                    "base": c.base_branch,
                    "title": format!("factory (needs a person): {}", self.topic()),
                    "body": prompts::pr_body(self),
                    "draft": true,
                    "labels": ["factory:needs-human"],
                }),
            ),
            FinishStep::Revert => self.call(
                action,
                "forgejo",
                "revert",
                json!({
                    "merge_sha": l.deploy_ref,
                    "branch": format!("{}-revert", self.branch()),
                    "base": c.base_branch,
                    "title": format!("Revert factory fix for {}", self.topic()),
                }),
            ),
            FinishStep::Resolve => {
                self.call(action, "glitchtip", "resolve", json!({"issue_id": self.signal.glitchtip_issue_id}))
            }
            FinishStep::CompleteIssue => {
                self.call(action, "plane", "set_state", json!({"issue_id": l.issue_id, "state": "completed"}))
            }
            FinishStep::Comment => self.call(
                action,
                "plane",
                "comment",
                // Plane refuses a second comment with the same external id, so a comment whose answer was lost
                // (or whose agent crashed after making it) is not made twice by a later try. It leaves out the
                // retry count that the step id carries: every try of this comment is the same comment.
                json!({
                    "issue_id": l.issue_id,
                    "body": prompts::finish_text(self),
                    "external_id": step_id(&self.id, self.stage.as_str(), self.slot(), action),
                }),
            ),
            FinishStep::Post => self.call(
                action,
                "zulip",
                "post",
                json!({"channel": c.channel, "topic": self.topic(), "content": prompts::finish_text(self)}),
            ),
        }
    }
}

/// The action an approval for this call is about. The target commit is bound where the call has one; a merge also
/// binds what the commit changes (the patch's paths and hash, see [`Run::change_binding`]): the person approves the
/// change shown to them, and the action hash the agent-side gate checks covers it. Only `target_commit` carries it,
/// so the call's own args stay exactly what the skill takes.
pub(crate) fn gated_action(run: &Run, call: &Effect) -> Option<ApprovalAction> {
    let Effect::Call {
        agent, skill, args, ..
    } = call
    else {
        return None;
    };
    let commit = |key: &str| args.get(key).and_then(|v| v.as_str()).map(str::to_string);
    let target_commit = match skill.as_str() {
        "merge" => commit("head_sha").map(|sha| {
            let committed = run.links.commit_sha.as_deref().unwrap_or("none");
            format!("{sha}; commit {committed}; {}", run.change_binding())
        }),
        "revert" => commit("merge_sha"),
        _ => None,
    }
    // An empty commit is no commit: the wire (and so the phone that checks the hash) cannot tell "" from none.
    .filter(|t| !t.is_empty());
    Some(ApprovalAction {
        agent: agent.clone(),
        skill: skill.clone(),
        args: args.clone(),
        target_commit,
    })
}

#[cfg(test)]
mod tests {
    use super::{RunState, gated_action};
    use crate::{Ctx, Effect, Signal, open};

    #[test]
    fn an_empty_commit_is_no_commit_in_the_action() {
        let signal = Signal {
            source: "glitchtip".into(),
            fingerprint: "fp".into(),
            title: "t".into(),
            link: "https://gt.example/acme/issues/1".into(),
            glitchtip_issue_id: None,
            severity: "error".into(),
            generation: 1,
            parent_run: None,
        };
        let (run, _) = open(signal, &Ctx::new("acme", "production", 1_000)).unwrap();
        let call = |skill: &str, args: serde_json::Value| Effect::Call {
            step: "s".into(),
            agent: "forgejo".into(),
            skill: skill.into(),
            args,
            approval_id: None,
        };
        let revert = |merge_sha: &str| call("revert", serde_json::json!({"merge_sha": merge_sha}));
        // The wire sends no commit as "", which a phone reads back as none: both sides must hash it the same.
        let empty = gated_action(&run, &revert("")).unwrap();
        assert_eq!(empty.target_commit, None);
        assert_eq!(
            gated_action(&run, &revert("abc"))
                .unwrap()
                .target_commit
                .as_deref(),
            Some("abc")
        );
        // A merge keeps its binding of the commit and the change even when the head is empty: only an empty target
        // commit as a whole is dropped.
        let merge =
            gated_action(&run, &call("merge", serde_json::json!({"head_sha": ""}))).unwrap();
        let target = merge.target_commit.expect("a merge binds its change");
        assert!(
            target.starts_with("; commit none; patch none: "),
            "{target}"
        );
    }

    #[test]
    fn state_names_round_trip() {
        for s in [
            RunState::Open,
            RunState::Waiting,
            RunState::Succeeded,
            RunState::Failed,
            RunState::Killed,
        ] {
            assert_eq!(RunState::parse(s.as_str()), Some(s));
        }
        assert_eq!(RunState::parse("paused"), None);
    }
}
