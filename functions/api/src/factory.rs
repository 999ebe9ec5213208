//! FactoryService: runs, timelines, the run kill switch and the live watch.
//!
//! Killing a run is a signed step-up, like an approval decision: the caller's own registered device signs the
//! canonical kill bytes over a single-use challenge from GetKillChallenge. The switch is written first, only if
//! absent, with the signed request as its proof: of two kills of one run only one sets it, and a request that finds
//! its own proof there is a retry of an attempt that stopped halfway, which it finishes (challenge used, and the run
//! woken unless it has ended).

use std::collections::VecDeque;
use std::time::Duration;

use futures::Stream;
use loams_factory::approval::{self, KillRequest, Refusal};
use loams_factory::{Cursor, Envelope, Input, ObserveVerdict, run_kill_switch_id};
use loams_platform::Claim;
use loams_platform::limits::ByteBudget;
use loams_platform::{Cond, Item, Page, RunRow, StoreError};
use loams_proto::connect::{CallContext, ConnectError, Router};
use loams_proto::factory::v1 as pf;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::approvals::{parse, to_body};
use crate::challenge::{self, callers_device};
use crate::{ApiError, ApiState, Caller, convert, idem, scope};

const SERVICE: &str = "/loams.factory.v1.FactoryService/";
pub(crate) const DEFAULT_PAGE: u32 = 50;
pub(crate) const MAX_PAGE: u32 = 200;
/// Most bytes of events one GetTimeline page carries: a page ends early, with `has_more`, rather than grow past
/// it. An event can be up to `limits::MAX_BODY` (the files a fix read or changed), so 200 of them would be far past
/// the Connect clients' 1 MiB message limit; this budget, or one event alone, stays under it even in the JSON
/// codec, which may double an event's text by escaping it.
const MAX_TIMELINE_BYTES: usize = 384 * 1024;
/// Events GetTimeline and WatchRun read from the store at a time: at most 10 MB, however large the events.
const TIMELINE_READ: u32 = 25;
/// Longest kill reason kept.
const MAX_REASON: usize = 500;
/// Run states after which nothing more happens, so a watch can end.
const TERMINAL: [&str; 3] = ["succeeded", "failed", "killed"];

/// The kill switch item (kind `kill`, id `run:<id>`), read by the worker before every step.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct KillSwitch {
    pub reason: String,
    pub by: String,
    pub at_ms: i64,
    /// The signed step-up that pulled it, verbatim (absent on switches stored before kills were signed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<KillRequest>,
}

pub(crate) fn page_size(requested: u32) -> u32 {
    if requested == 0 {
        DEFAULT_PAGE
    } else {
        requested.min(MAX_PAGE)
    }
}

pub(crate) fn page_token(token: &str) -> Result<Option<String>, ApiError> {
    if token.len() > loams_platform::limits::MAX_TOKEN {
        return Err(ApiError::InvalidArgument("page_token too long".into()));
    }
    Ok((!token.is_empty()).then(|| token.to_owned()))
}

pub(crate) fn id_arg(what: &str, value: &str) -> Result<(), ApiError> {
    if value.is_empty()
        || value.len() > loams_factory::MAX_ID
        || value.chars().any(char::is_control)
    {
        return Err(ApiError::InvalidArgument(format!(
            "{what} is required (1..={} bytes)",
            loams_factory::MAX_ID
        )));
    }
    Ok(())
}

/// Sends one input for `run` to the worker.
pub(crate) async fn enqueue(
    state: &ApiState,
    org: &str,
    run: &str,
    input: Input,
) -> Result<(), ApiError> {
    let envelope = Envelope {
        org: org.to_owned(),
        run: run.to_owned(),
        input: Some(input),
    };
    let body = serde_json::to_vec(&envelope)
        .map_err(|e| ApiError::Internal(format!("encoding envelope: {e}")))?;
    state.queue.send(&body, 0).await?;
    Ok(())
}

/// The stored run `id` of the caller's organisation.
pub(crate) async fn run_row(
    state: &ApiState,
    caller: &Caller,
    id: &str,
) -> Result<RunRow, ApiError> {
    id_arg("run_id", id)?;
    // Keys start with the caller's org, so another org's run is simply not there.
    state
        .store
        .get_run(&caller.org, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("run {id} not found")))
}

async fn load_run(state: &ApiState, caller: &Caller, id: &str) -> Result<pf::Run, ApiError> {
    convert::run(&run_row(state, caller, id).await?)
}

async fn list_runs(
    state: &ApiState,
    caller: &Caller,
    req: pf::ListRunsRequest,
) -> Result<pf::ListRunsResponse, ApiError> {
    let filter = (!req.state.is_empty()).then_some(req.state.as_str());
    if let Some(s) = filter {
        loams_platform::limits::name("state", s)?;
    }
    let page = Page {
        cursor: page_token(&req.page_token)?,
        limit: page_size(req.page_size),
    };
    let paged = state.store.list_runs(&caller.org, filter, page).await?;
    let runs = paged
        .items
        .iter()
        .map(convert::run)
        .collect::<Result<_, _>>()?;
    Ok(pf::ListRunsResponse {
        runs,
        next_page_token: paged.next.unwrap_or_default(),
    })
}

async fn timeline(
    state: &ApiState,
    caller: &Caller,
    req: pf::GetTimelineRequest,
) -> Result<pf::GetTimelineResponse, ApiError> {
    load_run(state, caller, &req.run_id).await?;
    let limit = page_size(req.page_size);
    let mut events = Vec::new();
    let mut after = req.after_seq;
    let mut budget = ByteBudget::new(MAX_TIMELINE_BYTES);
    // Read a few events at a time, and at most one more than the page still takes (to know whether more follow),
    // so a page that ends early on its byte budget has not read 200 large events.
    let has_more = 'page: loop {
        let want = TIMELINE_READ.min(limit - events.len() as u32 + 1);
        let rows = state
            .store
            .events(&caller.org, &req.run_id, after, want)
            .await?;
        let exhausted = rows.len() < want as usize;
        for row in rows {
            if events.len() == limit as usize || !budget.take(row.body.len()) {
                break 'page true;
            }
            after = row.seq;
            events.push(convert::event(&row));
        }
        if exhausted {
            break false;
        }
    };
    Ok(pf::GetTimelineResponse { events, has_more })
}

async fn kill_challenge(
    state: &ApiState,
    caller: &Caller,
    req: pf::GetKillChallengeRequest,
) -> Result<pf::GetKillChallengeResponse, ApiError> {
    let run = load_run(state, caller, &req.run_id).await?;
    still_running(&run)?;
    if switch(state, caller, &req.run_id).await?.is_some() {
        return Err(switch_set());
    }
    let device = callers_device(state, caller, &req.device_id).await?;
    if device.revoked {
        return Err(Refusal::DeviceRevoked.into());
    }
    let issued = challenge::issue(state, caller, challenge::KILL, &req.run_id, &device).await?;
    Ok(pf::GetKillChallengeResponse {
        challenge: issued.value,
        expires_at_ms: issued.expires_at_ms,
    })
}

async fn kill(
    state: &ApiState,
    caller: &Caller,
    req: pf::KillRunRequest,
) -> Result<pf::KillRunResponse, ApiError> {
    let run = load_run(state, caller, &req.run_id).await?;
    if req.reason.len() > MAX_REASON || !loams_proto::is_plain_text(&req.reason) {
        return Err(ApiError::InvalidArgument(format!(
            "reason must be at most {MAX_REASON} bytes without control, bidirectional or invisible characters"
        )));
    }
    challenge::check_sizes(&req.challenge, &req.signature)?;
    let reason = if req.reason.trim().is_empty() {
        format!("killed by {}", caller.user)
    } else {
        req.reason.clone()
    };
    idem::once(state, caller, "KillRun", &req.idempotency_key, || async {
        let device = callers_device(state, caller, &req.device_id).await?;
        let request = KillRequest {
            run_id: req.run_id.clone(),
            reason: req.reason.clone(),
            device_id: req.device_id.clone(),
            challenge: req.challenge.clone(),
            killed_at_ms: req.killed_at_ms,
            signature: req.signature.clone(),
        };
        let carries_this = async || -> Result<bool, ApiError> {
            let set = switch(state, caller, &req.run_id).await?;
            Ok(set.is_some_and(|s| s.proof.as_ref() == Some(&request)))
        };
        // The challenge is read before the switch: it is used up only after its switch is set, so if it reads as
        // used here, the switch read next already shows who set it.
        let loaded = challenge::load(state, caller, challenge::KILL, &req.run_id, &device.id).await;
        // A switch that carries this very request, checked when it was set, means an earlier attempt (or a copy
        // sent at the same time) set it: the kill is finished below, whatever happened since (the run ended, the
        // challenge expired, the device was revoked).
        let presented = if carries_this().await? {
            // Still to be used up if it is still there and still the one this request presented.
            loaded.ok().filter(|(_, c)| c.value == request.challenge)
        } else {
            still_running(&run)?;
            let (item, challenge) = loaded?;
            approval::check_kill(&device, &challenge, &request, state.now_ms())?;
            challenge::check_signed_at(state, &challenge, req.killed_at_ms, "killed_at_ms")?;
            let set = KillSwitch {
                reason: reason.clone(),
                by: caller.user.clone(),
                at_ms: state.now_ms(),
                proof: Some(request.clone()),
            };
            let switch_item = Item {
                org: caller.org.clone(),
                kind: "kill".into(),
                id: run_kill_switch_id(&req.run_id),
                version: 0,
                index: None,
                body: to_body(&set)?,
                expires_ms: None,
            };
            // The switch is what stops the run (the worker reads it before every step); the input below only
            // wakes a waiting run so it notices now instead of at its next timer.
            match state.store.put_item(&switch_item, Cond::Absent).await {
                Ok(_) => {
                    tracing::info!(run = %req.run_id, by = %device.user, device = %device.id, "kill switch set")
                }
                Err(StoreError::Conflict) if carries_this().await? => {}
                Err(StoreError::Conflict) => return Err(switch_set()),
                Err(e) => return Err(e.into()),
            }
            Some((item, challenge))
        };
        if let Some((item, challenge)) = &presented {
            challenge::use_up(state, item, challenge).await;
        }
        // A run that has ended needs no waking: repeating a finished kill then changes nothing at all.
        if ended(&run.state) {
            return Ok(pf::KillRunResponse { run: Some(run) });
        }
        enqueue(
            state,
            &caller.org,
            &req.run_id,
            Input::Kill {
                reason: reason.clone(),
                by: caller.user.clone(),
            },
        )
        .await?;
        Ok(pf::KillRunResponse {
            run: Some(load_run(state, caller, &req.run_id).await?),
        })
    })
    .await
}

/// The run's kill switch, if one is set.
async fn switch(
    state: &ApiState,
    caller: &Caller,
    run_id: &str,
) -> Result<Option<KillSwitch>, ApiError> {
    let item = state
        .store
        .get_item(&caller.org, "kill", &run_kill_switch_id(run_id))
        .await?;
    item.as_ref().map(parse).transpose()
}

fn switch_set() -> ApiError {
    ApiError::FailedPrecondition("the run's kill switch is already set".into())
}

/// Whether a run in `state` has ended: nothing more happens to it.
fn ended(state: &str) -> bool {
    TERMINAL.contains(&state)
}

/// A run that has ended has nothing left to stop: neither a kill challenge nor a kill switch is written for it.
fn still_running(run: &pf::Run) -> Result<(), ApiError> {
    if ended(&run.state) {
        return Err(ApiError::FailedPrecondition(format!(
            "run {} has already ended ({})",
            run.id, run.state
        )));
    }
    Ok(())
}

/// A decision only a person can give, and the cursor at which a run waits for it.
#[derive(Clone, Copy)]
enum Wanted {
    Triage,
    Verdict,
}

impl Wanted {
    fn cursor(self) -> Cursor {
        match self {
            Wanted::Triage => Cursor::AwaitTriage,
            Wanted::Verdict => Cursor::AwaitVerdict,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Wanted::Triage => "triage",
            Wanted::Verdict => "verdict",
        }
    }
}

/// Sends a person's triage decision or verdict to a run that waits for it. Runs inside the caller's idempotency
/// claim, so a repeat with the same key gets the first answer even after the run has moved on.
async fn decide_run(
    state: &ApiState,
    caller: &Caller,
    run_id: &str,
    wanted: Wanted,
    input: Input,
) -> Result<pf::Run, ApiError> {
    let row = run_row(state, caller, run_id).await?;
    let run = convert::snapshot(&row)?;
    // The engine ignores a decision the run does not wait for; refusing it here tells the person instead.
    if run.state.is_terminal() || run.ending.is_some() || run.cursor != wanted.cursor() {
        return Err(ApiError::FailedPrecondition(format!(
            "run {run_id} is not waiting for a {} decision (it is at {}, {})",
            wanted.what(),
            run.stage.as_str(),
            row.state
        )));
    }
    // The worker applies the input later, so until then the snapshot still shows the wait. One marker per run and
    // decision lets only the first person's call through; a second, possibly opposite, one is told so instead of
    // being silently dropped by the engine.
    let marker = format!("api:decided:{}:{run_id}", wanted.what());
    match state
        .store
        .claim(
            &caller.org,
            &marker,
            state.now_ms(),
            state.config.write_lease_ms,
        )
        .await?
    {
        Claim::New => {}
        Claim::Done(_) => {
            return Err(ApiError::FailedPrecondition(format!(
                "the {} of run {run_id} was already decided",
                wanted.what()
            )));
        }
        Claim::InProgress => {
            return Err(ApiError::Aborted(format!(
                "another {} decision for run {run_id} is in progress",
                wanted.what()
            )));
        }
    }
    if let Err(e) = enqueue(state, &caller.org, run_id, input).await {
        // Nothing was sent, so the decision is still open.
        if let Err(re) = state.store.release(&caller.org, &marker).await {
            tracing::warn!(error = %re, key = %marker, "releasing a decision marker failed");
        }
        return Err(e);
    }
    if let Err(e) = state
        .store
        .finish(&caller.org, &marker, b"", state.now_ms())
        .await
    {
        // The input is queued; the lease runs out and a later call is then refused by the run's own state.
        tracing::warn!(error = %e, key = %marker, "recording a decision marker failed");
    }
    convert::run(&row)
}

async fn decide_triage(
    state: &ApiState,
    caller: &Caller,
    req: pf::DecideTriageRequest,
) -> Result<pf::DecideTriageResponse, ApiError> {
    idem::once(
        state,
        caller,
        "DecideTriage",
        &req.idempotency_key,
        || async {
            let input = Input::TriageDecided {
                accept: req.accept,
                by: caller.user.clone(),
            };
            let run = decide_run(state, caller, &req.run_id, Wanted::Triage, input).await?;
            Ok(pf::DecideTriageResponse { run: Some(run) })
        },
    )
    .await
}

async fn give_verdict(
    state: &ApiState,
    caller: &Caller,
    req: pf::GiveVerdictRequest,
) -> Result<pf::GiveVerdictResponse, ApiError> {
    let verdict = match pf::Verdict::try_from(req.verdict) {
        Ok(pf::Verdict::Resolved) => ObserveVerdict::Resolved,
        Ok(pf::Verdict::Regressed) => ObserveVerdict::Regressed,
        _ => {
            return Err(ApiError::InvalidArgument(
                "verdict must be VERDICT_RESOLVED or VERDICT_REGRESSED".into(),
            ));
        }
    };
    idem::once(
        state,
        caller,
        "GiveVerdict",
        &req.idempotency_key,
        || async {
            let input = Input::VerdictGiven {
                verdict,
                by: caller.user.clone(),
            };
            let run = decide_run(state, caller, &req.run_id, Wanted::Verdict, input).await?;
            Ok(pf::GiveVerdictResponse { run: Some(run) })
        },
    )
    .await
}

enum Watch {
    Snapshot(Box<pf::Run>),
    Events {
        after: u64,
        pending: VecDeque<pf::TimelineEvent>,
        /// The run was seen in a final state: it stays there, so its state need not be read again.
        run_ended: bool,
        /// The last read reached the end of the log.
        caught_up: bool,
        last_sent: Instant,
    },
    Done,
}

/// Snapshot first, then every event after `after_seq` as it is appended, with a heartbeat after each quiet
/// `watch_heartbeat_ms`; ends once a finished run's log is drained, or after `watch_max_ms` (the client resumes).
fn watch(
    state: ApiState,
    caller: Caller,
    req: pf::WatchRunRequest,
    run: pf::Run,
) -> impl Stream<Item = Result<pf::WatchRunResponse, ConnectError>> + Send + 'static {
    use pf::watch_run_response::Item as W;
    let poll = Duration::from_millis(state.config.watch_poll_ms.max(10));
    let heartbeat = Duration::from_millis(state.config.watch_heartbeat_ms.max(10));
    // A bounded lifetime keeps one client from holding a connection (and a Lambda invocation) open forever.
    let deadline = Instant::now() + Duration::from_millis(state.config.watch_max_ms);
    futures::stream::unfold(Watch::Snapshot(Box::new(run)), move |mut step| {
        let (state, caller, req) = (state.clone(), caller.clone(), req.clone());
        async move {
            loop {
                match step {
                    Watch::Done => return None,
                    Watch::Snapshot(run) => {
                        let next = Watch::Events {
                            after: req.after_seq,
                            pending: VecDeque::new(),
                            run_ended: ended(&run.state),
                            caught_up: false,
                            last_sent: Instant::now(),
                        };
                        let snapshot = pf::WatchRunResponse {
                            item: Some(W::Snapshot(*run)),
                        };
                        return Some((Ok(snapshot), next));
                    }
                    Watch::Events {
                        after,
                        mut pending,
                        mut run_ended,
                        caught_up,
                        last_sent,
                    } => {
                        if let Some(ev) = pending.pop_front() {
                            let after = ev.seq;
                            return Some((
                                Ok(pf::WatchRunResponse {
                                    item: Some(W::Event(ev)),
                                }),
                                Watch::Events {
                                    after,
                                    pending,
                                    run_ended,
                                    caught_up,
                                    last_sent: Instant::now(),
                                },
                            ));
                        }
                        let now = Instant::now();
                        // Checked only once the fetched events are sent, so the stream ends on a known seq.
                        if (run_ended && caught_up) || now >= deadline {
                            return None;
                        }
                        if now.duration_since(last_sent) >= heartbeat {
                            let beat = pf::Heartbeat {
                                at_ms: state.now_ms(),
                            };
                            return Some((
                                Ok(pf::WatchRunResponse {
                                    item: Some(W::Heartbeat(beat)),
                                }),
                                Watch::Events {
                                    after,
                                    pending,
                                    run_ended,
                                    caught_up,
                                    last_sent: now,
                                },
                            ));
                        }
                        // Read the state before the events: a run seen terminal here has all its events below.
                        if !run_ended {
                            run_ended = match state.store.get_run(&caller.org, &req.run_id).await {
                                Ok(Some(run)) => ended(&run.state),
                                Ok(None) => {
                                    return Some((
                                        Err(ApiError::NotFound("run gone".into()).into()),
                                        Watch::Done,
                                    ));
                                }
                                Err(e) => {
                                    return Some((Err(ApiError::from(e).into()), Watch::Done));
                                }
                            };
                        }
                        let rows = match state
                            .store
                            .events(&caller.org, &req.run_id, after, TIMELINE_READ)
                            .await
                        {
                            Ok(rows) => rows,
                            Err(e) => return Some((Err(ApiError::from(e).into()), Watch::Done)),
                        };
                        let caught_up = rows.len() < TIMELINE_READ as usize;
                        // Each row is let go once converted, so a refill is not held twice.
                        let pending: VecDeque<_> =
                            rows.into_iter().map(|row| convert::event(&row)).collect();
                        if pending.is_empty() && !run_ended {
                            // Wake for the next poll, or earlier for a heartbeat or the end of the lifetime.
                            let wake = (last_sent + heartbeat).min(deadline);
                            tokio::time::sleep(
                                poll.min(wake.saturating_duration_since(Instant::now())),
                            )
                            .await;
                        }
                        step = Watch::Events {
                            after,
                            pending,
                            run_ended,
                            caught_up,
                            last_sent,
                        };
                    }
                }
            }
        }
    })
}

pub(crate) fn routes(state: ApiState, router: Router) -> Router {
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}ListRuns"),
        move |ctx: CallContext, req: pf::ListRunsRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_READ).await?;
                Ok(list_runs(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GetRun"),
        move |ctx: CallContext, req: pf::GetRunRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_READ).await?;
                Ok(pf::GetRunResponse {
                    run: Some(load_run(&s, &caller, &req.run_id).await?),
                })
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GetTimeline"),
        move |ctx: CallContext, req: pf::GetTimelineRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_READ).await?;
                Ok(timeline(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GetKillChallenge"),
        move |ctx: CallContext, req: pf::GetKillChallengeRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_KILL).await?;
                Ok(kill_challenge(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}KillRun"),
        move |ctx: CallContext, req: pf::KillRunRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_KILL).await?;
                Ok(kill(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}DecideTriage"),
        move |ctx: CallContext, req: pf::DecideTriageRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_DECIDE).await?;
                Ok(decide_triage(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GiveVerdict"),
        move |ctx: CallContext, req: pf::GiveVerdictRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_DECIDE).await?;
                Ok(give_verdict(&s, &caller, req).await?)
            }
        },
    );
    let s = state;
    router.server_stream(
        &format!("{SERVICE}WatchRun"),
        move |ctx: CallContext, req: pf::WatchRunRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::RUNS_READ).await?;
                // Fail before the stream starts for a run that is not there, so the client sees a plain error;
                // the run read is the stream's snapshot.
                let run = load_run(&s, &caller, &req.run_id).await?;
                Ok(watch(s, caller, req, run))
            }
        },
    )
}
