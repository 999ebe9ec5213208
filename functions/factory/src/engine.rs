//! `open` and `decide`: the pure decisions of the loop, and the guards that run before every step.

use std::borrow::Cow;

use serde_json::Value;

use crate::approval::APPROVAL_TTL_MS;
use crate::ci::parse_ci_log;
use crate::effect::{ApprovalRequest, Effect};
use crate::event::{Event, FinishStep, FollowUp, ObserveVerdict, Reason, WaitKind};
use crate::ids::{action_hash, run_id, run_id_after, sha256_hex, valid_run_id};
use crate::input::{Input, Outcome};
use crate::patch::{FileContent, check_scope, parse_patch, render_files};
use crate::policy::{Risk, Verdict, risk_of};
use crate::prompts::{approval_summary, tail};
use crate::review::{Finding, audit_verdict, lead_approves};
use crate::run::{Cursor, Run, RunState, gated_action};
use crate::{
    Ctx, MAX_FEEDBACK, MAX_FILE_BYTES, MAX_FILES, MAX_ID, MAX_MODEL_TEXT, MAX_RUN_BYTES,
    MAX_STEP_RETRIES, MAX_TITLE,
};
use crate::{LastRunStatus, Rejection, Signal};

/// The principal that requests the factory's approvals.
pub const REQUESTER: &str = "agent:loams-factory";

/// Longest error or reason text kept from outside.
const MAX_TEXT: usize = 2_000;

/// Shortest re-check interval, whatever `Config::recheck_ms` says: a zero would wake the run in a busy loop.
const MIN_RECHECK_MS: u64 = 1_000;

/// When the next timer of a wait until `due_ms` fires, seen at `now_ms`: the next re-check, or the deadline when
/// that comes first.
fn wake_ms(run: &Run, now_ms: i64, due_ms: i64) -> i64 {
    let every = i64::try_from(run.config.recheck_ms.max(MIN_RECHECK_MS)).unwrap_or(i64::MAX);
    now_ms.saturating_add(every).min(due_ms)
}

fn valid_org(org: &str) -> bool {
    let b = org.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

fn check_signal(s: &Signal) -> Result<(), Rejection> {
    let bad = |what: &str| Err(Rejection::InvalidSignal(what.into()));
    let sized = |v: &str, max: usize| !v.trim().is_empty() && v.len() <= max;
    if !sized(&s.source, 64) {
        return bad("source must be 1..=64 bytes");
    }
    if !sized(&s.fingerprint, 200) {
        return bad("fingerprint must be 1..=200 bytes");
    }
    if !sized(&s.title, MAX_TITLE) {
        return bad("title must be 1..=500 bytes");
    }
    if s.link.len() > 2_000 || s.severity.len() > 32 {
        return bad("link or severity too long");
    }
    if s.glitchtip_issue_id.as_ref().is_some_and(|i| !sized(i, 64)) {
        return bad("glitchtip_issue_id must be 1..=64 bytes");
    }
    if s.generation == 0 || (s.generation > 1) != s.parent_run.is_some() {
        return bad("generation starts at 1 and a later generation names its parent_run");
    }
    if s.parent_run.as_ref().is_some_and(|p| p.len() > 64) {
        return bad("parent_run too long");
    }
    Ok(())
}

/// Opens a run for a signal: the first event of its log.
///
/// The id depends on the lineage (see [`run_id_after`]). A follow-up generation belongs to its parent's lineage: its
/// id follows the parent and no cooldown applies. A first generation looks at the fingerprint's last run:
/// - none: the fingerprint's first run ([`crate::run_id`]);
/// - still open ([`LastRunStatus::Open`]), or, with the state unknown, opened less than `cooldown_ms` ago: the alert
///   repeats what that run is already handling, so the answer is that run's id and the store's create-if-absent makes
///   opening a no-op (the returned record is what this signal would have opened; the stored one stays);
/// - ended less than `cooldown_ms` ago: refused with [`Rejection::Cooldown`], so a fresh fix is given time to show;
/// - otherwise: a new lineage whose id follows the last run.
///
/// Also refused above the generation cap or when a kill switch covers it.
pub fn open(signal: Signal, ctx: &Ctx) -> Result<(Run, Event), Rejection> {
    let id = opening_id(&signal, ctx)?;
    if ctx.kill.org {
        return Err(Rejection::Killed("organisation".into()));
    }
    if ctx.kill.runs.contains(&id) {
        return Err(Rejection::Killed(format!("run {id}")));
    }
    let event = Event::Opened {
        id,
        org: ctx.org.clone(),
        env: ctx.env.clone(),
        signal,
        owner: ctx.owner.clone(),
        config: ctx.config.clone(),
        at_ms: ctx.now_ms,
    };
    let run = Run::from_events(std::slice::from_ref(&event))?;
    Ok((run, event))
}

/// The id of the run [`open`] gives `signal`, or its refusal for any reason but a kill switch: the caller reads the
/// switch of that run with it.
pub fn opening_id(signal: &Signal, ctx: &Ctx) -> Result<String, Rejection> {
    if !valid_org(&ctx.org) {
        return Err(Rejection::InvalidSignal(format!(
            "invalid org {:?}",
            ctx.org
        )));
    }
    check_signal(signal)?;
    let cap = ctx.config.max_generations;
    if signal.generation > cap {
        return Err(Rejection::GenerationCap {
            generation: signal.generation,
            cap,
        });
    }
    lineage_id(signal, ctx)
}

/// The run id a signal opens, or the cooldown refusal; see [`open`].
fn lineage_id(signal: &Signal, ctx: &Ctx) -> Result<String, Rejection> {
    let (org, fingerprint) = (ctx.org.as_str(), signal.fingerprint.as_str());
    if signal.generation > 1 {
        return Ok(run_id_after(
            org,
            fingerprint,
            signal.generation,
            signal.parent_run.as_deref(),
        ));
    }
    let Some(last) = &ctx.last_run else {
        return Ok(run_id(org, fingerprint, 1));
    };
    if !valid_run_id(&last.run_id) {
        return Err(Rejection::InvalidInput(format!(
            "the fingerprint's last run {:?} is not a run id",
            last.run_id
        )));
    }
    let cooldown = i64::try_from(ctx.config.cooldown_ms).unwrap_or(i64::MAX);
    let same = match ctx.last_run_status {
        LastRunStatus::Open => true,
        LastRunStatus::Unknown => ctx.now_ms < last.at_ms.saturating_add(cooldown),
        LastRunStatus::Ended { at_ms } => {
            let until_ms = at_ms.saturating_add(cooldown);
            if ctx.now_ms < until_ms {
                return Err(Rejection::Cooldown { until_ms });
            }
            false
        }
    };
    Ok(if same {
        last.run_id.clone()
    } else {
        run_id_after(org, fingerprint, 1, Some(&last.run_id))
    })
}

fn check_input(run: &Run, input: &Input, ctx: &Ctx) -> Result<(), Rejection> {
    let long = |v: &str| v.len() > MAX_ID;
    if ctx.org != run.org {
        return Err(Rejection::InvalidInput(
            "the context is for another organisation".into(),
        ));
    }
    let too_long = match input {
        Input::Continue => false,
        Input::Completed { step, .. } => {
            if !step.starts_with(&format!("{}:", run.id)) {
                return Err(Rejection::InvalidInput(format!(
                    "step {step:?} is not a step of run {}",
                    run.id
                )));
            }
            long(step)
        }
        Input::TriageDecided { by, .. } | Input::VerdictGiven { by, .. } => long(by),
        Input::ApprovalSettled {
            approval_id, by, ..
        } => long(approval_id) || long(by),
        Input::TimerFired { timer_id } => long(timer_id),
        Input::Kill { by, reason } => long(by) || reason.len() > MAX_TEXT,
    };
    if too_long {
        return Err(Rejection::InvalidInput("a field is too long".into()));
    }
    if let Input::VerdictGiven {
        verdict: ObserveVerdict::Inconclusive,
        ..
    } = input
    {
        return Err(Rejection::InvalidInput(
            "a person's verdict is resolved or regressed".into(),
        ));
    }
    Ok(())
}

/// Decides what an input means for the run: the events to append (empty for a duplicate, stale or late input).
/// After the input's own events, the guards run against the state the run would act from next, and may add a stop
/// (kill switch, budget, policy deny), an approval gate, or the timer of a wait.
pub fn decide(run: &Run, input: &Input, ctx: &Ctx) -> Result<Vec<Event>, Rejection> {
    check_input(run, input, ctx)?;
    if run.state.is_terminal() {
        return Ok(Vec::new());
    }
    let events = match input {
        Input::Continue => Vec::new(),
        Input::Completed { step, outcome } => match run.next_effect() {
            Some(effect) if effect.step() == step => {
                let events = completed(run, &effect, outcome, ctx);
                return Ok(within_run_limit(run, Some(step), events, ctx));
            }
            _ => return Ok(Vec::new()),
        },
        Input::TriageDecided { accept, by } => {
            if run.cursor != Cursor::AwaitTriage || run.ending.is_some() {
                return Ok(Vec::new());
            }
            let mut ev = vec![Event::TriageDecided {
                accept: *accept,
                automatic: false,
                by: by.clone(),
            }];
            if !accept {
                ev.push(abandon(
                    RunState::Failed,
                    Reason::TriageRejected,
                    format!("rejected by {by}"),
                ));
            }
            ev
        }
        Input::ApprovalSettled {
            approval_id,
            approved,
            by,
        } => {
            let Some(gate) = &run.gate else {
                return Ok(Vec::new());
            };
            if &gate.request.id != approval_id && gate.approval_id.as_ref() != Some(approval_id) {
                return Ok(Vec::new());
            }
            let mut ev = vec![Event::ApprovalSettled {
                approval_id: gate
                    .approval_id
                    .clone()
                    .unwrap_or_else(|| approval_id.clone()),
                approved: *approved,
                by: by.clone(),
            }];
            if !approved {
                ev.push(gate_refused(
                    run,
                    Reason::ApprovalDenied,
                    format!("{} denied by {by}", gate.request.action.skill),
                ));
            }
            ev
        }
        Input::TimerFired { timer_id } => {
            let Some(wait) = run.wait.as_ref().filter(|w| &w.timer_id == timer_id) else {
                return Ok(Vec::new());
            };
            // A re-check before the deadline: whatever it was meant to notice (a kill switch, a decision the worker
            // read from the store) comes in through the guards and other inputs, so the run just waits on.
            if wait.is_recheck() && ctx.now_ms < wait.due_ms {
                let wake_ms = wake_ms(run, ctx.now_ms, wait.due_ms);
                return Ok(guard(
                    run,
                    vec![Event::WaitRechecked {
                        timer_id: wait.next_recheck_id(),
                        wake_ms,
                    }],
                    ctx,
                ));
            }
            let mut ev = vec![Event::TimerFired {
                timer_id: timer_id.clone(),
            }];
            match wait.kind {
                WaitKind::Triage => ev.push(abandon(
                    RunState::Failed,
                    Reason::Stalled,
                    "no triage decision in time".into(),
                )),
                WaitKind::Verdict => ev.push(abandon(
                    RunState::Failed,
                    Reason::Stalled,
                    "no verdict in time".into(),
                )),
                WaitKind::Approval => ev.push(gate_refused(
                    run,
                    Reason::Stalled,
                    "the approval expired".into(),
                )),
                WaitKind::Ci | WaitKind::Observe => {}
            }
            ev
        }
        Input::Kill { by, reason } => {
            if run
                .ending
                .as_ref()
                .is_some_and(|e| e.state == RunState::Killed)
            {
                return Ok(Vec::new());
            }
            vec![abandon(
                RunState::Killed,
                Reason::Killed,
                format!("killed by {by}: {reason}"),
            )]
        }
        Input::VerdictGiven { verdict, by } => {
            if run.cursor != Cursor::AwaitVerdict || run.ending.is_some() {
                return Ok(Vec::new());
            }
            vec![Event::VerdictReached {
                verdict: *verdict,
                by: Some(by.clone()),
            }]
        }
    };
    Ok(within_run_limit(run, None, events, ctx))
}

fn limit_text(limit: Option<u64>) -> String {
    limit.map_or_else(|| "none".into(), |l| l.to_string())
}

fn abandon(state: RunState, reason: Reason, detail: String) -> Event {
    Event::Abandoned {
        state,
        reason,
        detail: tail(&detail, MAX_TEXT),
    }
}

/// A gated call that will not happen: while finishing, skip that step; otherwise the run stops.
fn gate_refused(run: &Run, reason: Reason, detail: String) -> Event {
    match (run.cursor, run.finish.first(), &run.gate) {
        (Cursor::Finishing, Some(action), Some(gate)) => Event::FinishStepSkipped {
            step: gate.request.id.clone(),
            action: *action,
            reason: detail,
        },
        _ => abandon(RunState::Failed, reason, detail),
    }
}

/// A failed step: retried under a new step id while retryable, then given up (skipped while finishing).
fn failure(run: &Run, step: &str, error: &str, retryable: bool) -> Vec<Event> {
    let error = tail(error, MAX_TEXT);
    let mut ev = vec![Event::StepFailed {
        step: step.into(),
        error: error.clone(),
        retryable,
    }];
    if retryable && run.retries + 1 < MAX_STEP_RETRIES {
        return ev;
    }
    ev.push(match (run.cursor, run.finish.first()) {
        (Cursor::Finishing, Some(action)) if run.gate.is_none() && run.wait.is_none() => {
            Event::FinishStepSkipped {
                step: step.into(),
                action: *action,
                reason: error,
            }
        }
        _ => abandon(
            RunState::Failed,
            Reason::StepFailed,
            format!("step {step}: {error}"),
        ),
    });
    ev
}

fn completed(run: &Run, effect: &Effect, outcome: &Outcome, ctx: &Ctx) -> Vec<Event> {
    let step = effect.step();
    if let Outcome::Failed { error, retryable } = outcome {
        return failure(run, step, error, *retryable);
    }
    let result = match (effect, outcome) {
        (Effect::Wait { timer_id, .. }, _) => Ok(vec![Event::TimerScheduled {
            timer_id: timer_id.clone(),
        }]),
        (Effect::RequestApproval { .. }, Outcome::Agent(v)) => {
            let expires_ms = run
                .gate
                .as_ref()
                .map_or(ctx.now_ms, |g| g.request.expires_at_ms);
            let wake_ms = Some(wake_ms(run, ctx.now_ms, expires_ms));
            text(v, "approval_id").map(|approval_id| {
                vec![Event::ApprovalRequested {
                    approval_id,
                    wake_ms,
                }]
            })
        }
        (
            Effect::Model { purpose, .. },
            Outcome::Model {
                text,
                input_tokens,
                output_tokens,
            },
        ) => {
            let answered = model_answered(step, purpose, *input_tokens, *output_tokens, ctx);
            if text.len() > MAX_MODEL_TEXT {
                return paid_in_vain(run, step, answered, "the model answer is too long");
            }
            let mut ev = vec![answered];
            ev.extend(model_result(run, text));
            Ok(ev)
        }
        (
            Effect::Model { purpose, .. },
            Outcome::ModelUnusable {
                error,
                input_tokens,
                output_tokens,
            },
        ) => {
            let answered = model_answered(step, purpose, *input_tokens, *output_tokens, ctx);
            return paid_in_vain(run, step, answered, error);
        }
        (Effect::Call { agent, skill, .. }, Outcome::Agent(v)) => {
            call_result(run, v, ctx).map_err(|e| format!("bad output of {agent}.{skill}: {e}"))
        }
        _ => Err("the outcome does not match the effect".into()),
    };
    result.unwrap_or_else(|e| failure(run, step, &e, false))
}

fn model_answered(
    step: &str,
    purpose: &str,
    input_tokens: u64,
    output_tokens: u64,
    ctx: &Ctx,
) -> Event {
    Event::ModelAnswered {
        step: step.into(),
        purpose: purpose.into(),
        input_tokens,
        output_tokens,
        cost_micros: ctx.prices.cost_micros(input_tokens, output_tokens),
    }
}

/// A model answer that cannot be used: its tokens are paid all the same, so they are recorded before the step fails.
fn paid_in_vain(run: &Run, step: &str, answered: Event, error: &str) -> Vec<Event> {
    let mut paid = run.clone();
    paid.apply(&answered);
    let mut ev = vec![answered];
    ev.extend(failure(&paid, step, error, false));
    ev
}

/// A decision's `events` with the guards', unless they bring files that would make the run larger than `MAX_RUN_BYTES`:
/// then the events before the files are kept (a model call's tokens are spent whatever becomes of the answer) and the
/// step the files come with fails instead: the completed read or fix, or the call a gate was opened for (a retry of a
/// failed commit has its own step). A kill the guards obeyed after the files outranks that failure, as it would have
/// had the files fitted: the step's refusal is recorded, and the run ends killed, without the files, saying which
/// switch. Files come from a read, a patch, or a gate on committing a patch, whose request carries them once more; a
/// policy read at any decision may open that gate, so every decision that opens it is judged, not only the patch's. No
/// other decision is judged: that would let a run near the limit lose a later step it must take (a revert, a kill's
/// compensation). `completed` is the step a completed input names.
fn within_run_limit(
    run: &Run,
    completed: Option<&str>,
    events: Vec<Event>,
    ctx: &Ctx,
) -> Vec<Event> {
    let (events, next) = guarded(run, events, ctx);
    let Some(first) = events.iter().position(brings_files) else {
        return events;
    };
    let size = serde_json::to_vec(&*next).map_or(usize::MAX, |json| json.len());
    if size <= MAX_RUN_BYTES {
        return events;
    }
    let mut kept = events;
    let brought = kept.split_off(first);
    // The files came with the step that completed, unless the guards brought them in a gate: then with the call
    // they gated.
    let gated = matches!(brought[0], Event::GateOpened { .. });
    let mut before = run.clone();
    for event in &kept {
        before.apply(event);
    }
    // A gated call is the run's next step once the events before the gate are in (a failed commit's retry has its
    // own). Without a step (not expected) the run ends without naming one that never was.
    let step = completed
        .filter(|_| !gated)
        .map(str::to_owned)
        .or_else(|| before.next_effect().map(|e| e.step().to_owned()));
    let error = format!(
        "the files it brings would make the run {size} bytes, more than the {MAX_RUN_BYTES} a run keeps"
    );
    let killed = |e: &Event| {
        matches!(
            e,
            Event::Abandoned {
                state: RunState::Killed,
                ..
            }
        )
    };
    match (step, brought.into_iter().find(killed)) {
        (step, Some(kill)) => {
            kept.extend(step.map(|step| Event::StepFailed {
                step,
                error,
                retryable: false,
            }));
            kept.push(kill);
        }
        (Some(step), None) => kept.extend(failure(&before, &step, &error, false)),
        (None, None) => kept.push(abandon(RunState::Failed, Reason::StepFailed, error)),
    }
    guard(run, kept, ctx)
}

fn brings_files(event: &Event) -> bool {
    match event {
        Event::FilesRead { .. } | Event::PatchProposed { .. } => true,
        Event::GateOpened { request } => request.action.args.get("files").is_some(),
        _ => false,
    }
}

fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("missing field `{key}`"))
}

fn text(v: &Value, key: &str) -> Result<String, String> {
    match field(v, key)?.as_str() {
        Some(s) if s.len() <= MAX_ID => Ok(s.to_string()),
        Some(_) => Err(format!("field `{key}` is too long")),
        None => Err(format!("field `{key}` is not a string")),
    }
}

fn number(v: &Value, key: &str) -> Result<u64, String> {
    field(v, key)?
        .as_u64()
        .ok_or_else(|| format!("field `{key}` is not a non-negative integer"))
}

fn attempt_failed(run: &Run, reason: &str, feedback: &str) -> Vec<Event> {
    // A reason may quote the model (a patch's bad path); the run keeps it for good.
    let reason = tail(reason, MAX_TEXT);
    let mut ev = vec![Event::AttemptFailed {
        attempt: run.attempt,
        reason: reason.clone(),
        feedback: tail(feedback, MAX_FEEDBACK),
    }];
    if run.attempt >= run.config.max_attempts {
        ev.push(abandon(
            RunState::Failed,
            Reason::FailSafe,
            format!("{} attempts failed; the last: {reason}", run.attempt),
        ));
    } else {
        ev.push(Event::AttemptStarted {
            attempt: run.attempt + 1,
        });
    }
    ev
}

/// The record of the attempt before the current one.
fn previous_attempt(run: &Run) -> Option<&crate::run::AttemptRecord> {
    run.attempts
        .len()
        .checked_sub(2)
        .and_then(|i| run.attempts.get(i))
}

fn model_result(run: &Run, answer: &str) -> Vec<Event> {
    match run.cursor {
        Cursor::ProposeFix => match parse_patch(answer) {
            Err(e) => attempt_failed(
                run,
                &format!("no usable patch: {e}"),
                &format!("Your answer was not usable: {e}"),
            ),
            Ok(files) => {
                // A file outside the configured targets (or any CI file) never reaches forgejo.
                if let Err(e) = check_scope(&files, &run.config.target_files) {
                    let allowed = run.config.target_files.join(", ");
                    return attempt_failed(
                        run,
                        &format!("patch refused: {e}"),
                        &format!(
                            "Your patch was refused: {e}. Change only these files: {allowed}."
                        ),
                    );
                }
                let patch_hash = sha256_hex(render_files(&files).as_bytes());
                if previous_attempt(run).and_then(|a| a.patch_hash.as_ref()) == Some(&patch_hash) {
                    return vec![abandon(
                        RunState::Failed,
                        Reason::NoProgress,
                        format!(
                            "attempt {} proposes the same patch as attempt {}",
                            run.attempt,
                            run.attempt - 1
                        ),
                    )];
                }
                vec![Event::PatchProposed { files, patch_hash }]
            }
        },
        Cursor::LeadReview => {
            let approved = lead_approves(answer);
            let report = tail(answer, MAX_FEEDBACK);
            let mut ev = vec![Event::LeadReviewed {
                approved,
                report: report.clone(),
            }];
            if !approved {
                ev.extend(attempt_failed(
                    run,
                    "the lead review asks for changes",
                    &report,
                ));
            }
            ev
        }
        Cursor::SecurityAudit => {
            let (approved, findings) = audit_verdict(answer);
            let report = tail(answer, MAX_FEEDBACK);
            // The most severe last: the feedback keeps the tail of what it is given.
            let mut blocking: Vec<&Finding> =
                findings.iter().filter(|f| f.severity.blocks()).collect();
            blocking.sort_by_key(|f| std::cmp::Reverse(f.severity));
            let blocking: Vec<String> = blocking.iter().map(|f| f.text.clone()).collect();
            let mut ev = vec![Event::SecurityAudited {
                approved,
                findings,
                report: report.clone(),
            }];
            if !approved {
                let feedback = if blocking.is_empty() {
                    report
                } else {
                    blocking.join("\n")
                };
                ev.extend(attempt_failed(
                    run,
                    "the security audit does not approve",
                    &feedback,
                ));
            }
            ev
        }
        _ => Vec::new(),
    }
}

fn read_files(v: &Value) -> Result<Vec<FileContent>, String> {
    let items = field(v, "files")?
        .as_array()
        .ok_or("field `files` is not an array")?;
    if items.len() > MAX_FILES {
        return Err(format!("more than {MAX_FILES} files"));
    }
    items
        .iter()
        .map(|f| {
            let path = text(f, "path")?;
            let content = match f.get("content") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s.len() <= MAX_FILE_BYTES => Some(s.clone()),
                Some(Value::String(_)) => return Err(format!("file {path} is too large")),
                Some(_) => return Err(format!("content of {path} is not a string")),
            };
            Ok(FileContent { path, content })
        })
        .collect()
}

fn call_result(run: &Run, v: &Value, ctx: &Ctx) -> Result<Vec<Event>, String> {
    Ok(match run.cursor {
        Cursor::OpenThread => {
            let mut ev = vec![Event::ThreadOpened {
                message_id: number(v, "message_id")?,
                url: text(v, "url")?,
            }];
            if ctx.policy.auto_triage {
                ev.push(Event::TriageDecided {
                    accept: true,
                    automatic: true,
                    by: format!("policy v{}", ctx.policy.version),
                });
            }
            ev
        }
        Cursor::CreateIssue => {
            vec![Event::IssueCreated {
                id: text(v, "id")?,
                key: text(v, "key")?,
                url: text(v, "url")?,
            }]
        }
        Cursor::PostIssueLink => {
            vec![
                Event::IssueLinked {
                    message_id: number(v, "message_id")?,
                },
                Event::AttemptStarted { attempt: 1 },
            ]
        }
        Cursor::ReadFiles => vec![Event::FilesRead {
            files: read_files(v)?,
        }],
        Cursor::CommitPatch => vec![Event::Committed {
            sha: text(v, "sha")?,
        }],
        Cursor::OpenPr => {
            let (number, url, head_sha) =
                (number(v, "number")?, text(v, "url")?, text(v, "head_sha")?);
            let opened = Event::PrOpened {
                number,
                url,
                head_sha: head_sha.clone(),
            };
            let committed = run.links.commit_sha.as_deref().unwrap_or_default();
            // The agent answers only about a PR into the base it was asked for; an answer naming another base is
            // refused like a foreign head.
            let base = v.get("base").map(|_| text(v, "base")).transpose()?;
            if let Some(base) = base.filter(|b| *b != run.config.base_branch) {
                return Err(format!(
                    "the PR targets `{base}`, not `{}`",
                    run.config.base_branch
                ));
            }
            if head_sha.eq_ignore_ascii_case(committed) {
                vec![opened]
            } else {
                // CI, review and the approval are about the factory's commit; a different head means someone pushed
                // to the branch. The PR is recorded (so the ending closes it and deletes the branch) and the run
                // stops: another attempt would only build on, and read, that branch.
                let reason = format!(
                    "tampering suspected: the PR head {head_sha} is not the factory's commit {committed}"
                );
                vec![
                    opened,
                    Event::AttemptFailed {
                        attempt: run.attempt,
                        reason: reason.clone(),
                        feedback: String::new(),
                    },
                    abandon(
                        RunState::Failed,
                        Reason::StepFailed,
                        format!("attempt {}: {reason}", run.attempt),
                    ),
                ]
            }
        }
        Cursor::CiStatus => ci_result(run, v)?,
        Cursor::Merge => vec![Event::Merged {
            merge_sha: text(v, "merge_sha")?,
            at_ms: ctx.now_ms,
        }],
        Cursor::IssueEvents => {
            let last_seen_ms = match v.get("last_seen_ms") {
                None | Some(Value::Null) => None,
                Some(t) => Some(t.as_i64().ok_or("field `last_seen_ms` is not an integer")?),
            };
            vec![Event::IssueEventsRead {
                count: number(v, "count")?,
                last_seen_ms,
            }]
        }
        Cursor::Series => {
            let total = number(v, "total")?;
            let verdict = observe_verdict(
                run.observation.count,
                total,
                run.config.regression_threshold,
            );
            vec![
                Event::SeriesRead { total },
                Event::VerdictReached { verdict, by: None },
            ]
        }
        Cursor::Finishing => {
            let action = *run.finish.first().ok_or("nothing to finish")?;
            if action == FinishStep::ClosePr {
                match (
                    field(v, "closed")?.as_bool(),
                    v.get("merged").and_then(Value::as_bool),
                ) {
                    (Some(true), _) => {}
                    // The merge happened but its outcome was lost: compensate for the deploy, not for an open PR.
                    (Some(false), Some(true)) => {
                        return Ok(vec![Event::MergeFound {
                            merge_sha: text(v, "merge_sha")?,
                        }]);
                    }
                    _ => return Err("field `closed` is not true and the PR is not merged".into()),
                }
            }
            let url = match action {
                FinishStep::DraftPr | FinishStep::Revert => Some(text(v, "url")?),
                _ => None,
            };
            let step = run.step(action.action());
            vec![Event::FinishStepDone { step, action, url }]
        }
        other => return Err(format!("no call expected at {other:?}")),
    })
}

/// The verdict of an observe window from GlitchTip's error events since the merge (`None` for a signal without a
/// GlitchTip issue) and the analytics error total since the merge. Either source above the threshold is a
/// regression; resolved needs both silent; a quiet GlitchTip with analytics still counting errors (or a count at or
/// below the threshold) is inconclusive and extends the window.
fn observe_verdict(errors: Option<u64>, analytics_total: u64, threshold: u64) -> ObserveVerdict {
    if errors.is_some_and(|n| n > threshold) || analytics_total > threshold {
        ObserveVerdict::Regressed
    } else if errors.unwrap_or(0) == 0 && analytics_total == 0 {
        ObserveVerdict::Resolved
    } else {
        ObserveVerdict::Inconclusive
    }
}

fn ci_result(run: &Run, v: &Value) -> Result<Vec<Event>, String> {
    let log = match v.get("log") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => tail(s, MAX_FEEDBACK),
        Some(_) => return Err("field `log` is not a string".into()),
    };
    let state = text(v, "state")?;
    let report = parse_ci_log(&log);
    Ok(match state.as_str() {
        "pending" if run.ci_polls + 1 >= run.config.ci_max_polls => vec![abandon(
            RunState::Failed,
            Reason::Stalled,
            format!("CI still pending after {} polls", run.ci_polls + 1),
        )],
        "pending" => vec![Event::CiPending { poll: run.ci_polls }],
        "success" => vec![Event::CiFinished {
            passed: true,
            report,
        }],
        "failure" | "error" => {
            let mut ev = vec![Event::CiFinished {
                passed: false,
                report: report.clone(),
            }];
            let earlier = &run.attempts[..run.attempts.len().saturating_sub(1)];
            let oscillating = report.failing.iter().find_map(|check| {
                earlier
                    .iter()
                    .find(|a| a.ci.as_ref().is_some_and(|c| c.passing.contains(check)))
                    .map(|a| (check.clone(), a.attempt))
            });
            let same_failure = previous_attempt(run).is_some_and(|a| {
                a.ci_passed == Some(false)
                    && a.ci
                        .as_ref()
                        .is_some_and(|c| c.signature == report.signature)
            });
            if same_failure {
                ev.push(abandon(
                    RunState::Failed,
                    Reason::NoProgress,
                    format!(
                        "CI failed the same way in attempts {} and {} ({})",
                        run.attempt - 1,
                        run.attempt,
                        report.signature
                    ),
                ));
            } else if let Some((check, passed_in)) = oscillating {
                ev.push(abandon(
                    RunState::Failed,
                    Reason::Oscillation,
                    format!(
                        "check `{check}` passed in attempt {passed_in} and fails in attempt {}",
                        run.attempt
                    ),
                ));
            } else {
                ev.extend(attempt_failed(run, &format!("CI {state}"), &log));
            }
            ev
        }
        other => return Err(format!("unknown CI state {other:?}")),
    })
}

/// Applies the input's events to a scratch copy, then checks the guards until the run has something safe to do.
fn guard(run: &Run, events: Vec<Event>, ctx: &Ctx) -> Vec<Event> {
    guarded(run, events, ctx).0
}

/// `events` followed by the guards' events, and the run after all of them.
fn guarded<'a>(run: &'a Run, mut events: Vec<Event>, ctx: &Ctx) -> (Vec<Event>, Cow<'a, Run>) {
    // Copied only once there is an event to fold in: the common input (a continue before a step the guards let
    // through) decides nothing, and a run carries its files and attempts, so a copy per decision is not free.
    let mut next = Cow::Borrowed(run);
    for e in &events {
        next.to_mut().apply(e);
    }
    // Each guard event moves the run on (an ending, a gate, a timer, a skipped step); a run has at most a handful of
    // finishing steps, so the bound is never reached in practice.
    for _ in 0..16 {
        let Some(e) = guard_once(&next, ctx) else {
            break;
        };
        next.to_mut().apply(&e);
        events.push(e);
    }
    (events, next)
}

fn guard_once(run: &Run, ctx: &Ctx) -> Option<Event> {
    if run.state.is_terminal() {
        return None;
    }
    if run.cursor == Cursor::Finishing && run.finish.is_empty() {
        return Some(ended(run));
    }
    if run.ending.is_none() {
        if ctx.kill.org {
            return Some(abandon(
                RunState::Killed,
                Reason::Killed,
                "kill switch: organisation".into(),
            ));
        }
        if ctx.kill.runs.contains(&run.id) {
            return Some(abandon(
                RunState::Killed,
                Reason::Killed,
                "kill switch: run".into(),
            ));
        }
    }
    if run.wait.is_some() || run.gate.is_some() {
        return None;
    }
    if let Some(kind) = run.cursor.wait_kind() {
        let (action, delay) = match kind {
            WaitKind::Triage => ("await_decision".to_string(), run.config.stall_ms),
            WaitKind::Ci => (format!("await_ci.{}", run.ci_polls), run.config.ci_poll_ms),
            WaitKind::Observe => ("await_window".to_string(), run.config.observe_window_ms),
            WaitKind::Verdict | WaitKind::Approval => {
                ("await_verdict".to_string(), run.config.stall_ms)
            }
        };
        let due_ms = ctx
            .now_ms
            .saturating_add(i64::try_from(delay).unwrap_or(i64::MAX));
        let wake_ms = Some(wake_ms(run, ctx.now_ms, due_ms));
        return Some(Event::WaitStarted {
            timer_id: run.step(&action),
            kind,
            due_ms,
            wake_ms,
        });
    }
    let planned = run.planned()?;
    let skip = |reason: String| match (run.finish.first(), run.ending.is_some()) {
        (Some(action), true) => Some(Event::FinishStepSkipped {
            step: planned.step().into(),
            action: *action,
            reason,
        }),
        _ => None,
    };
    match &planned {
        Effect::Model { .. } if run.budget.exhausted() => Some(abandon(
            RunState::Failed,
            Reason::Budget,
            format!(
                "spent {} of {} tokens and {} of {} micro-dollars",
                run.budget.tokens,
                run.budget.limit_tokens,
                run.budget.micros,
                run.budget.limit_micros
            ),
        )),
        Effect::Model { .. } if ctx.org_spend.exhausted(&ctx.config) => Some(abandon(
            RunState::Failed,
            Reason::Budget,
            format!(
                "the organisation's model budget for this month is spent: {} micro-dollars (limit {}), {} tokens \
                 (limit {})",
                ctx.org_spend.spent_micros,
                limit_text(ctx.config.org_budget_micros),
                ctx.org_spend.spent_tokens,
                limit_text(ctx.config.org_budget_tokens)
            ),
        )),
        Effect::Call { agent, skill, .. } => {
            if ctx.kill.org || ctx.kill.agents.contains(agent) {
                let why = format!("kill switch: agent {agent}");
                return skip(why.clone())
                    .or_else(|| Some(abandon(RunState::Killed, Reason::Killed, why)));
            }
            let risk = risk_of(agent, skill);
            let verdict = ctx.policy.decide(agent, skill, risk, &run.env);
            if verdict == Verdict::Deny {
                let why = format!(
                    "policy v{} denies {agent}.{skill} in {}",
                    ctx.policy.version, run.env
                );
                return skip(why.clone())
                    .or_else(|| Some(abandon(RunState::Failed, Reason::PolicyDenied, why)));
            }
            // The safety wall: destructive calls are gated whatever the policy says.
            let gated = verdict == Verdict::Approve || risk == Risk::Destructive;
            if gated && run.approval_for(&planned).is_none() {
                return approval_request(run, &planned, risk, ctx)
                    .map(|request| Event::GateOpened { request });
            }
            None
        }
        _ => None,
    }
}

fn approval_request(run: &Run, call: &Effect, risk: Risk, ctx: &Ctx) -> Option<ApprovalRequest> {
    let action = gated_action(run, call)?;
    let skill = action.skill.clone();
    let confirmation_phrase =
        (risk == Risk::Destructive).then(|| match (skill.as_str(), run.links.pr_number) {
            ("merge", Some(n)) => format!("merge #{n}"),
            ("close_pr", Some(n)) => format!("close #{n}"),
            ("revert", _) => {
                format!(
                    "revert {}",
                    run.links
                        .deploy_ref
                        .as_deref()
                        .unwrap_or("")
                        .chars()
                        .take(7)
                        .collect::<String>()
                )
            }
            _ => skill.clone(),
        });
    Some(ApprovalRequest {
        id: run.step(&format!("approval.{skill}")),
        org: run.org.clone(),
        run_id: run.id.clone(),
        action_hash: action_hash(&action),
        summary: approval_summary(run, &skill, run.stage),
        action,
        risk,
        requester: REQUESTER.into(),
        on_behalf_of: run.owner.clone(),
        confirmation_phrase,
        created_at_ms: ctx.now_ms,
        expires_at_ms: ctx.now_ms.saturating_add(APPROVAL_TTL_MS),
    })
}

fn ended(run: &Run) -> Event {
    let (state, reason) = run
        .ending
        .as_ref()
        .map_or((RunState::Failed, None), |e| (e.state, e.reason));
    let follow_up = (state == RunState::Failed
        && reason == Some(Reason::Regressed)
        && run.generation < run.config.max_generations)
        .then(|| {
            let generation = run.generation + 1;
            FollowUp {
                generation,
                parent_run: run.id.clone(),
                signal: Signal {
                    generation,
                    parent_run: Some(run.id.clone()),
                    ..run.signal.clone()
                },
            }
        });
    Event::Ended {
        state,
        reason,
        verdict: run.verdict,
        follow_up,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_reads_both_series() {
        use ObserveVerdict::*;
        let t = 5;
        assert_eq!(observe_verdict(Some(0), 0, t), Resolved);
        assert_eq!(
            observe_verdict(None, 0, t),
            Resolved,
            "no GlitchTip issue: analytics alone decide"
        );
        assert_eq!(observe_verdict(Some(6), 0, t), Regressed);
        assert_eq!(
            observe_verdict(Some(0), 6, t),
            Regressed,
            "analytics above the threshold regress on their own"
        );
        assert_eq!(observe_verdict(None, 6, t), Regressed);
        assert_eq!(
            observe_verdict(Some(0), 3, t),
            Inconclusive,
            "GlitchTip quiet but analytics still count errors"
        );
        assert_eq!(observe_verdict(Some(5), 0, t), Inconclusive);
        assert_eq!(observe_verdict(Some(2), 5, t), Inconclusive);
        assert_eq!(observe_verdict(None, 1, t), Inconclusive);
    }
}
