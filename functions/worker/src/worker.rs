//! The queue worker: one message moves one run through its next steps, one external effect per step, each recorded
//! before the next is made.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use loams_factory::{
    Ctx, Effect, Envelope, Event, Input, KillSwitches, LastRun, LastRunStatus, OrgSpend, Outcome,
    Policy, Prices, Run, RunState, Signal, run_kill_switch_id,
};
use loams_model::{ANSWER_TIMEOUT, ChatMessage, ChatModel, ChatRequest, ModelError};
use loams_platform::limits::MAX_RECEIVE;
use loams_platform::{Claim, Clock, Cond, Delivery, Item, Page, Queue, Store, StoreError, Timers};
use serde_json::json;
use tokio::time::Instant;
use tracing::{Instrument, error, info, info_span, warn};

use crate::WorkerError;
use crate::agents::{AgentCaller, AgentReply};
use crate::settings::{Boundary, Settings};
use crate::spend;

/// Delay before a message whose handling failed for a passing reason is seen again; doubled per receive, so a
/// store hiccup of a few seconds does not use up the queue's receives and dead-letter the run's only message.
const RETRY_DELAY_MS: u64 = 500;
/// Largest doubling of `RETRY_DELAY_MS` (500 ms * 2^4 = 8 s).
const MAX_BACKOFF_SHIFT: u32 = 4;
/// Conditional-append conflicts tolerated in a row before the message is retried later.
const MAX_CONFLICTS: u32 = 16;
// The engine keeps a run's files within MAX_RUN_BYTES and leaves RUN_HEADROOM_BYTES for what the run records after
// them, which it never refuses: together they must fit what the store keeps of a snapshot.
const _: () = assert!(
    loams_factory::MAX_RUN_BYTES + loams_factory::RUN_HEADROOM_BYTES
        <= loams_platform::limits::MAX_BODY
);
/// A model call's idempotency lease: another worker may take the call over only after this. It outlasts the call's
/// timeout, so a slow answer is never bought a second time by a worker that thinks the first one died.
const MODEL_LEASE_MS: u64 = ANSWER_TIMEOUT.as_millis() as u64 + 60_000;
/// Delay before a step whose model call is held by someone else is tried again. A third of the lease, so that a
/// holder that crashed is taken over after a few receives rather than after the queue gave up on the message.
const IN_PROGRESS_DELAY_MS: u64 = MODEL_LEASE_MS / 3;
/// When an agent says a step is still in progress: it usually finishes in milliseconds; after a crash its claim
/// lasts the agent's lease, and the retry timer keeps coming back until then.
const AGENT_IN_PROGRESS_DELAY_MS: u64 = 2_000;
/// Steps one queue message carries a run through before the rest goes back on the queue: a bound on how long one
/// run holds a worker slot while others wait.
const STEPS_PER_MESSAGE: usize = 16;
/// The longest one step may take: a model call's timeout with room for the records around it. A caller with a
/// deadline starts a further step only while this much time is left; the worker function's Lambda timeout
/// (infra/template.yaml) must leave room for one.
pub const MAX_STEP: Duration = Duration::from_secs(ANSWER_TIMEOUT.as_secs() + 30);
/// How often a step still waiting for a model answer looks at the run's and the organisation's kill switches: a kill
/// ends the wait within this, instead of when the answer comes (up to `ANSWER_TIMEOUT`).
const KILL_WATCH: Duration = Duration::from_secs(5);
/// Messages `run_once` takes from the queue and handles concurrently.
const BATCH: u32 = 8;
/// Steps `run` handles at once. Steps mostly wait on agents, the model and the store, so this is well above the
/// core count; it is bounded so a flood of messages cannot open unbounded agent calls and store transactions.
const MAX_IN_FLIGHT: usize = 32;
/// Pause before polling again after the queue was empty.
const IDLE_PAUSE: Duration = Duration::from_millis(10);
/// Pause before polling again after a receive failed.
const RECEIVE_FAILED_PAUSE: Duration = Duration::from_millis(200);

/// What becomes of a queue message once its handling ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Delete it: handled, hopeless, or its continuation moved to the timer store.
    Done,
    /// Let the queue deliver it again after `delay_ms`.
    Retry { delay_ms: u64 },
}

/// A run and the version of its last recorded event.
struct Current {
    run: Run,
    version: u64,
}

pub struct WorkerDeps {
    pub store: Arc<dyn Store>,
    pub queue: Arc<dyn Queue>,
    pub timers: Arc<dyn Timers>,
    pub clock: Arc<dyn Clock>,
    pub agents: Arc<dyn AgentCaller>,
    pub model: Arc<dyn ChatModel>,
    /// Environment runs are opened in.
    pub env: String,
    pub config: loams_factory::Config,
    pub policy: Policy,
    pub prices: Prices,
    /// The person runs act for; they cannot approve their own runs' actions.
    pub owner: Option<String>,
}

pub struct Worker {
    deps: WorkerDeps,
    settings: Settings,
    /// One lock per run being handled in this process. Two messages of one run (a duplicate continuation, a
    /// timer fired twice, a settlement racing the step that asked for it) are then handled one after the other:
    /// the second sees what the first recorded instead of performing the same step alongside it, which an
    /// agent would answer with "still in progress". Entries live only while a message of the run is handled.
    runs: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// What opening a signal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub run_id: String,
    /// False when the run already existed (the same signal and generation was opened before).
    pub created: bool,
}

impl Worker {
    /// Builds the worker; reads its environment settings (see the crate documentation) once, here.
    pub fn new(deps: WorkerDeps) -> Self {
        Worker {
            deps,
            settings: Settings::from_env(),
            runs: std::sync::Mutex::default(),
        }
    }

    /// Opens a run for `signal` (create-if-absent) and enqueues its first step.
    pub async fn open(&self, org: &str, signal: Signal) -> Result<Opened, WorkerError> {
        let d = &self.deps;
        let now = d.clock.now_ms();
        let mut ctx = self.ctx(org, None, now).await?;
        ctx.last_run = self.last_run(org, &signal.fingerprint).await?;
        if let Some(last) = &ctx.last_run {
            // The cooldown counts from the end of the fingerprint's last run, and a repeat of the alert while it
            // runs belongs to it: the engine needs to know which.
            ctx.last_run_status = match d.store.get_run(org, &last.run_id).await? {
                Some(row) if RunState::parse(&row.state).is_some_and(RunState::is_terminal) => {
                    LastRunStatus::Ended {
                        at_ms: row.updated_ms,
                    }
                }
                Some(_) => LastRunStatus::Open,
                None => LastRunStatus::Unknown,
            };
        }
        let refused = |e: loams_factory::Rejection| WorkerError::OpenRefused(e.to_string());
        let id = loams_factory::opening_id(&signal, &ctx).map_err(refused)?;
        ctx.kill.runs = self.run_switch(org, &id).await?;
        let (run, opened) = loams_factory::open(signal.clone(), &ctx).map_err(refused)?;
        let created = d
            .store
            .create_run(
                org,
                &run.id,
                run.state.as_str(),
                &to_json(&run)?,
                &logged(&opened, &run, now)?,
                now,
            )
            .await?;
        // Also when the run existed but its record is missing (a crash between the two writes): without it a later
        // alert would map onto the ended run and open nothing.
        if created
            || ctx
                .last_run
                .as_ref()
                .is_none_or(|last| last.run_id != run.id)
        {
            let last = LastRun {
                run_id: run.id.clone(),
                at_ms: now,
            };
            let item = Item {
                org: org.to_string(),
                kind: "fingerprint".into(),
                id: fingerprint_key(&signal.fingerprint),
                version: 0,
                index: None,
                body: to_json(&last)?,
                expires_ms: None,
            };
            d.store.put_item(&item, Cond::Any).await?;
        }
        // Enqueued even when the run existed: a crash between create and send must not strand the run, and a
        // duplicate continuation is harmless.
        self.enqueue(org, &run.id, None, 0).await?;
        Ok(Opened {
            run_id: run.id,
            created,
        })
    }

    /// Handles one queue message: records its input, then performs and records the run's next effects one after
    /// the other until the run has to wait (at most `STEPS_PER_MESSAGE`; a fresh message carries on after that).
    pub async fn handle(&self, envelope: &Envelope) -> Result<(), WorkerError> {
        self.handle_received(envelope, 1, None).await
    }

    /// [`Worker::handle`] for a message the queue has delivered `receive_count` times, by `deadline` if the caller
    /// has one (a Lambda invocation: a step after the first starts only while `MAX_STEP` still fits). A message
    /// that came back (its worker crashed or failed mid-way) moves its run by one step and hands the rest to a
    /// fresh message: the queue dead-letters a message by its receives, and those must count failures of one step,
    /// not every crash along a run that made progress in between.
    pub async fn handle_received(
        &self,
        envelope: &Envelope,
        receive_count: u32,
        deadline: Option<Instant>,
    ) -> Result<(), WorkerError> {
        let steps = if receive_count > 1 {
            1
        } else {
            STEPS_PER_MESSAGE
        };
        self.handle_steps(envelope, steps, deadline).await
    }

    /// Moves the run by at most `steps` steps, each after the first only if it fits before `deadline`; if the run
    /// could go further, a fresh message carries on.
    pub async fn handle_steps(
        &self,
        envelope: &Envelope,
        steps: usize,
        deadline: Option<Instant>,
    ) -> Result<(), WorkerError> {
        let span = info_span!("run_step", loams.run_id = %envelope.run, org = %envelope.org);
        async {
            let (org, run_id) = (envelope.org.as_str(), envelope.run.as_str());
            let mut current = self.load(org, run_id).await?;
            let mut ctx = self
                .ctx(org, Some(run_id), self.deps.clock.now_ms())
                .await?;
            // Before the message's own input: the approval's deadline timer must not expire a decision that is
            // stored but whose message was lost.
            if let Some(settled) = self.stored_settlement(&current.run).await? {
                current = self
                    .record(org, run_id, &settled, current, &mut ctx)
                    .await?;
            }
            // An approval is settled only by its stored decision (read above), which the API writes after checking
            // the device signature: a queue message that says so is a nudge, not proof, so whoever can send to
            // the queue cannot release a gate.
            let mut input = match envelope.input.clone() {
                None | Some(Input::ApprovalSettled { .. }) => Input::Continue,
                Some(input) => input,
            };
            // One message carries the run through consecutive steps while they need no waiting, each effect
            // recorded before the next is made, so a crash anywhere resumes from the last record. Going back
            // through the queue between steps would cost a send, a receive and an ack per step and decide
            // nothing more.
            // Whether `ctx` is fresh enough for the next step's guards: read for this message a moment ago, after a
            // model answer, or after a kill stopped one.
            let mut world_read = true;
            for taken in 0..steps {
                if taken > 0
                    && deadline.is_some_and(|deadline| Instant::now() + MAX_STEP > deadline)
                {
                    break;
                }
                // The guards (kill switches, budget) see the latest world before every effect.
                if !world_read {
                    ctx = self
                        .ctx(org, Some(run_id), self.deps.clock.now_ms())
                        .await?;
                }
                world_read = false;
                current = self.record(org, run_id, &input, current, &mut ctx).await?;
                self.open_follow_up(org, &current.run).await?;
                let Some(effect) = current.run.next_effect() else {
                    return Ok(());
                };
                input = Input::Continue;
                let outcome = match self.perform(&current.run, &effect).await {
                    // Nothing came back, so no outcome is recorded: the guards, on the world read now, end the run
                    // in this message, however many steps it has left (or, the switch gone by then, decide nothing
                    // and the step is made again).
                    Err(WorkerError::Killed) => {
                        ctx = self
                            .ctx(org, Some(run_id), self.deps.clock.now_ms())
                            .await?;
                        current = self.record(org, run_id, &input, current, &mut ctx).await?;
                        self.open_follow_up(org, &current.run).await?;
                        world_read = true;
                        continue;
                    }
                    performed => performed?,
                };
                let step = effect.step().to_string();
                self.cross(Boundary::AfterEffect, &step);
                // Recorded against the world read before the effect rather than a second read per step: whatever
                // changed meanwhile (a kill switch, the org's spend) is seen by the guards of the next step before
                // its effect, in this message or the next. A model answer may take minutes, so after one the world
                // is read now, and that read serves the next step: a kill that came meanwhile ends the run at once.
                if matches!(effect, Effect::Model { .. }) {
                    ctx = self
                        .ctx(org, Some(run_id), self.deps.clock.now_ms())
                        .await?;
                    world_read = true;
                }
                let completed = Input::Completed {
                    step: step.clone(),
                    outcome,
                };
                current = self
                    .record(org, run_id, &completed, current, &mut ctx)
                    .await?;
                self.open_follow_up(org, &current.run).await?;
                self.cross(Boundary::AfterRecord, &step);
            }
            // This message's share is used up: the rest of the run goes behind the other runs' messages, in a
            // message of its own.
            if current.run.next_effect().is_some() {
                self.enqueue(org, run_id, None, 0).await?;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Takes one batch from the queue and handles it; returns how many messages it took.
    pub async fn run_once(&self) -> Result<usize, WorkerError> {
        let deliveries = self
            .deps
            .queue
            .receive(BATCH, self.settings.visibility_ms)
            .await?;
        let handled = deliveries.iter().map(|delivery| self.deliver(delivery));
        for result in futures::future::join_all(handled).await {
            result?;
        }
        Ok(deliveries.len())
    }

    /// Handles one delivery and settles it with the queue: acked when done (or hopeless), moved to a timer while
    /// someone else holds the step, made visible again later when it failed for a passing reason.
    async fn deliver(&self, delivery: &Delivery) -> Result<(), StoreError> {
        let d = &self.deps;
        let Ok(envelope) = serde_json::from_slice::<Envelope>(&delivery.body) else {
            // A body that does not parse never will: drop it loudly rather than retry it forever.
            warn!(message = %delivery.id, "dropping a queue message that is not an envelope");
            return d.queue.ack(&delivery.receipt).await;
        };
        let handled = self.handle_visible(&envelope, delivery).await;
        match self
            .settlement(&envelope, handled, delivery.receive_count)
            .await
        {
            Settlement::Done => d.queue.ack(&delivery.receipt).await,
            Settlement::Retry { delay_ms } => {
                d.queue.retry_later(&delivery.receipt, delay_ms).await
            }
        }
    }

    /// What the queue should do with a message whose handling (its `receive_count`-th) ended with `handled`. Used
    /// by this worker's own loop and by the Lambda entry point, which reports the retries as batch item failures.
    pub async fn settlement(
        &self,
        envelope: &Envelope,
        handled: Result<(), WorkerError>,
        receive_count: u32,
    ) -> Settlement {
        let d = &self.deps;
        match handled {
            Ok(()) => Settlement::Done,
            Err(WorkerError::InProgress { step, retry_ms }) => {
                // Waiting out someone else's lease must not use up the message's receives (it would be
                // dead-lettered), so the continuation moves to the timer store and the message is done.
                let due = d
                    .clock
                    .now_ms()
                    .saturating_add(i64::try_from(retry_ms).unwrap_or(i64::MAX));
                let again = Envelope {
                    org: envelope.org.clone(),
                    run: envelope.run.clone(),
                    input: None,
                };
                // One timer per retry: the scheduler cancels a fired timer by id, which must not drop a retry
                // scheduled again in between.
                let timer = format!("retry:{step}:{due}");
                let scheduled = match to_json(&again) {
                    Ok(body) => d
                        .timers
                        .schedule(&envelope.org, &timer, due, &body)
                        .await
                        .map_err(WorkerError::from),
                    Err(e) => Err(e),
                };
                match scheduled {
                    Ok(()) => Settlement::Done,
                    Err(e) => {
                        warn!(run = %envelope.run, error = %e, "could not schedule the retry; the message comes back");
                        Settlement::Retry {
                            delay_ms: RETRY_DELAY_MS,
                        }
                    }
                }
            }
            Err(e) if e.retryable() => {
                let delay_ms =
                    RETRY_DELAY_MS << receive_count.saturating_sub(1).min(MAX_BACKOFF_SHIFT);
                warn!(run = %envelope.run, error = %e, delay_ms, "step will be retried");
                Settlement::Retry { delay_ms }
            }
            Err(e) => {
                warn!(run = %envelope.run, error = %e, "dropping a message that cannot succeed");
                Settlement::Done
            }
        }
    }

    /// Handles the message while keeping it hidden from other workers: its visibility is extended every third of
    /// the timeout, so an effect slower than the timeout (a model call may take minutes) is not performed twice
    /// side by side, while the message of a crashed worker still comes back soon.
    async fn handle_visible(
        &self,
        envelope: &Envelope,
        delivery: &Delivery,
    ) -> Result<(), WorkerError> {
        let visibility = self.settings.visibility_ms;
        let key = format!("{}/{}", envelope.org, envelope.run);
        let work = async {
            let lock = self.run_lock(&key);
            let result = {
                let _held = lock.lock().await;
                self.handle_received(envelope, delivery.receive_count, None)
                    .await
            };
            drop(lock);
            self.forget_run_lock(&key);
            result
        };
        tokio::pin!(work);
        loop {
            tokio::select! {
                result = &mut work => return result,
                _ = tokio::time::sleep(Duration::from_millis(visibility / 3)) => {
                    if let Err(e) = self.deps.queue.retry_later(&delivery.receipt, visibility).await {
                        warn!(run = %envelope.run, error = %e, "extending the message visibility failed");
                    }
                }
            }
        }
    }

    fn run_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        // A poisoned map only means another task panicked while inserting; the map itself is still sound.
        let mut runs = self
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.entry(key.to_string()).or_default().clone()
    }

    /// Drops the run's lock once no task holds or waits for it, so the map does not grow with every run seen.
    fn forget_run_lock(&self, key: &str) {
        let mut runs = self
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if runs
            .get(key)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            runs.remove(key);
        }
    }

    fn cross(&self, boundary: Boundary, step: &str) {
        if let Some(fault) = &self.settings.fault {
            fault.cross(boundary, step);
        }
    }

    /// Works the queue until `stop` turns true, then finishes the steps it holds. Deliveries are handled as they
    /// arrive, up to `MAX_IN_FLIGHT` at once: a finished step frees its slot for the next message at once instead
    /// of waiting for the slowest step of its batch. One receive is outstanding at a time, and it is never
    /// dropped half-way (its messages would stay hidden until their visibility timeout).
    pub async fn run(&self, stop: tokio::sync::watch::Receiver<bool>) {
        enum Done {
            Received(Result<Vec<Delivery>, StoreError>),
            Handled,
        }
        let d = &self.deps;
        let visibility = self.settings.visibility_ms;
        let mut tasks: FuturesUnordered<Pin<Box<dyn Future<Output = Done> + Send + '_>>> =
            FuturesUnordered::new();
        let mut in_flight = 0usize;
        let mut receiving = false;
        // How long the next receive waits first: nothing after a busy receive, a pause after an empty or failed one.
        let mut pause = Duration::ZERO;
        loop {
            if !receiving && in_flight < MAX_IN_FLIGHT && !*stop.borrow() {
                let room = u32::try_from(MAX_IN_FLIGHT - in_flight)
                    .unwrap_or(MAX_RECEIVE)
                    .min(MAX_RECEIVE);
                let mut stop = stop.clone();
                tasks.push(Box::pin(async move {
                    if !pause.is_zero() {
                        tokio::select! {
                            _ = tokio::time::sleep(pause) => {}
                            // Stopping: receive nothing more. (If the sender is gone, this branch is disabled.)
                            Ok(()) = stop.changed() => return Done::Received(Ok(Vec::new())),
                        }
                    }
                    Done::Received(d.queue.receive(room, visibility).await)
                }));
                receiving = true;
            }
            // Empty only when stopping with nothing left in flight.
            let Some(done) = tasks.next().await else {
                return;
            };
            match done {
                Done::Handled => in_flight -= 1,
                Done::Received(Ok(deliveries)) => {
                    receiving = false;
                    pause = if deliveries.is_empty() {
                        IDLE_PAUSE
                    } else {
                        Duration::ZERO
                    };
                    in_flight += deliveries.len();
                    for delivery in deliveries {
                        tasks.push(Box::pin(async move {
                            // The message comes back after its visibility timeout; nothing else to do here.
                            if let Err(e) = self.deliver(&delivery).await {
                                warn!(message = %delivery.id, error = %e, "settling a queue message failed");
                            }
                            Done::Handled
                        }));
                    }
                }
                Done::Received(Err(e)) => {
                    receiving = false;
                    warn!(error = %e, "queue receive failed");
                    pause = RECEIVE_FAILED_PAUSE;
                }
            }
        }
    }

    /// The run as stored, with the version its next append must name.
    async fn load(&self, org: &str, run_id: &str) -> Result<Current, WorkerError> {
        let row = self
            .deps
            .store
            .get_run(org, run_id)
            .await?
            .ok_or_else(|| WorkerError::RunNotFound(run_id.into()))?;
        let run = serde_json::from_slice(&row.snapshot)
            .map_err(|e| WorkerError::Corrupt(format!("run {run_id}: {e}")))?;
        Ok(Current {
            run,
            version: row.version,
        })
    }

    /// Feeds `input` to the engine in `ctx` (the world as read for this step, at the clock's time now) and appends
    /// what it decides to `current` (the run as this worker last recorded or read it). After a concurrent append it
    /// reads the run and the world again, and leaves the fresh world in `ctx`. Returns the run as recorded.
    async fn record(
        &self,
        org: &str,
        run_id: &str,
        input: &Input,
        mut current: Current,
        ctx: &mut Ctx,
    ) -> Result<Current, WorkerError> {
        let d = &self.deps;
        for attempt in 0..MAX_CONFLICTS {
            let now = d.clock.now_ms();
            if attempt > 0 {
                current = self.load(org, run_id).await?;
                *ctx = self.ctx(org, Some(run_id), now).await?;
            }
            ctx.now_ms = now;
            let events = loams_factory::decide(&current.run, input, ctx)
                .map_err(|e| WorkerError::Corrupt(e.to_string()))?;
            if events.is_empty() {
                return Ok(current);
            }
            let mut bodies = Vec::with_capacity(events.len());
            for event in &events {
                current.run.apply(event);
                bodies.push(logged(event, &current.run, now)?);
            }
            let snapshot = to_json(&current.run)?;
            match d
                .store
                .append(
                    org,
                    run_id,
                    current.version,
                    current.run.state.as_str(),
                    &snapshot,
                    &bodies,
                    now,
                )
                .await
            {
                Ok(version) => return Ok(Current { version, ..current }),
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(WorkerError::Contended(MAX_CONFLICTS))
    }

    /// The decision stored for the approval the run waits on, as the input that tells the run: the only way an
    /// approval reaches a run. The API stores the signed decision and then wakes the run; reading the store on every
    /// message of a waiting run (its re-check timers wake it at least every `Config::recheck_ms`) also means a crash
    /// between those two writes delays the run by a re-check instead of stranding it until the approval expires.
    async fn stored_settlement(&self, run: &Run) -> Result<Option<Input>, WorkerError> {
        use loams_factory::approval::{Approval, ApprovalState};
        let d = &self.deps;
        let Some(gate) = run.gate.as_ref() else {
            return Ok(None);
        };
        let Some(approval_id) = gate.approval_id.clone() else {
            return Ok(None);
        };
        let Some(item) = d.store.get_item(&run.org, "approval", &approval_id).await? else {
            return Ok(None);
        };
        let approval: Approval = match serde_json::from_slice(&item.body) {
            Ok(approval) => approval,
            Err(e) => {
                // The run fails safe when the approval expires.
                warn!(approval = %approval_id, error = %e, "ignoring an unreadable approval record");
                return Ok(None);
            }
        };
        // Only a decision about this gate's action counts.
        if approval.run_id != run.id || approval.action_hash != gate.request.action_hash {
            warn!(approval = %approval_id, "the stored approval is not about the run's gated action");
            return Ok(None);
        }
        let approved = match approval.effective_state(d.clock.now_ms()) {
            ApprovalState::Approved => true,
            ApprovalState::Denied => false,
            ApprovalState::Pending | ApprovalState::Expired => return Ok(None),
        };
        let mut by = approval
            .decision
            .map_or_else(|| "unrecorded".to_string(), |proof| proof.decided_by);
        // The engine refuses a longer name, and a refused input would drop the whole message.
        by.truncate(by.floor_char_boundary(loams_factory::MAX_ID));
        Ok(Some(Input::ApprovalSettled {
            approval_id,
            approved,
            by,
        }))
    }

    /// What an ended run asks for outside itself: a regressed run opens its successor. Checked on every message
    /// of the run, not only the one that ended it, so a crash right after the end cannot lose the successor.
    async fn open_follow_up(&self, org: &str, run: &Run) -> Result<(), WorkerError> {
        let Some(follow_up) = run.follow_up.as_ref().filter(|_| run.state.is_terminal()) else {
            return Ok(());
        };
        // Create-if-absent: opening it again after a crash (or on a redelivered message) is a no-op.
        match self.open(org, follow_up.signal.clone()).await {
            Ok(_) => Ok(()),
            // The engine already checked the generation cap; a refusal here (kill switch) is logged rather than
            // retried forever.
            Err(WorkerError::OpenRefused(reason)) => {
                warn!(%reason, "follow-up run not opened");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Performs one effect, idempotently under its step id.
    async fn perform(&self, run: &Run, effect: &Effect) -> Result<Outcome, WorkerError> {
        let d = &self.deps;
        match effect {
            Effect::Call {
                step,
                agent,
                skill,
                args,
                approval_id,
            } => {
                let span = info_span!(
                    "invoke_agent",
                    gen_ai.agent.name = %agent,
                    gen_ai.tool.name = %skill,
                    step = %step
                );
                let reply = d
                    .agents
                    .call(agent, step, skill, args.clone(), approval_id.as_deref())
                    .instrument(span)
                    .await;
                match reply {
                    AgentReply::Done(output) => Ok(Outcome::Agent(output)),
                    AgentReply::Failed { error, retryable } => {
                        Ok(Outcome::Failed { error, retryable })
                    }
                    AgentReply::InProgress => Err(WorkerError::InProgress {
                        step: step.clone(),
                        retry_ms: AGENT_IN_PROGRESS_DELAY_MS,
                    }),
                }
            }
            Effect::Model {
                step,
                purpose,
                messages,
            } => self.complete(run, step, purpose, messages).await,
            Effect::RequestApproval { approval, .. } => {
                let record = approval.to_approval();
                let item = Item {
                    org: run.org.clone(),
                    kind: "approval".into(),
                    id: approval.id.clone(),
                    version: 0,
                    index: Some("pending".into()),
                    body: to_json(&record)?,
                    expires_ms: None,
                };
                match d.store.put_item(&item, Cond::Absent).await {
                    // Absent or already stored by an earlier try of this same step: either way it exists once.
                    Ok(_) | Err(StoreError::Conflict) => {
                        Ok(Outcome::Agent(json!({ "approval_id": approval.id })))
                    }
                    Err(e) => Err(e.into()),
                }
            }
            Effect::Wait {
                timer_id, due_ms, ..
            } => {
                let fire = Envelope {
                    org: run.org.clone(),
                    run: run.id.clone(),
                    input: Some(Input::TimerFired {
                        timer_id: timer_id.clone(),
                    }),
                };
                d.timers
                    .schedule(&run.org, timer_id, *due_ms, &to_json(&fire)?)
                    .await?;
                Ok(Outcome::Agent(json!({ "timer_id": timer_id })))
            }
        }
    }

    /// A model call, paid at most once: the step id is claimed before calling and the answer stored after. A kill
    /// of the run or its organisation stops the wait for the answer.
    async fn complete(
        &self,
        run: &Run,
        step: &str,
        purpose: &str,
        messages: &[loams_factory::ChatMessage],
    ) -> Result<Outcome, WorkerError> {
        let d = &self.deps;
        let org = run.org.as_str();
        let key = format!("model:{step}");
        match d
            .store
            .claim(org, &key, d.clock.now_ms(), MODEL_LEASE_MS)
            .await?
        {
            Claim::Done(stored) => {
                return serde_json::from_slice(&stored)
                    .map_err(|e| WorkerError::Corrupt(format!("{key}: {e}")));
            }
            Claim::InProgress => {
                return Err(WorkerError::InProgress {
                    step: step.into(),
                    retry_ms: IN_PROGRESS_DELAY_MS,
                });
            }
            Claim::New => {}
        }
        let request = ChatRequest {
            purpose: purpose.to_string(),
            messages: messages
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect(),
            max_tokens: None,
        };
        let span =
            info_span!("chat", gen_ai.operation.name = "chat", purpose = %purpose, step = %step);
        let call = d.model.complete(&request).instrument(span);
        let answer = tokio::select! {
            // An answer that is there is kept, kill or not: it is paid.
            biased;
            answer = call => answer,
            () = self.killed(org, &run.id) => {
                info!(%org, run = %run.id, %step, %purpose, "a kill switch stopped the wait for the model's answer");
                // The request is cancelled and the wait ends; a provider may stop generating then, or finish and
                // bill the answer all the same, which is then not counted. The claim is given up: the step is
                // made again only if the switch is gone by the time the guards look.
                d.store.release(org, &key).await?;
                return Err(WorkerError::Killed);
            }
        };
        let answered = match answer {
            Ok(answer) => Outcome::Model {
                text: answer.text,
                input_tokens: answer.input_tokens,
                output_tokens: answer.output_tokens,
            },
            // An answer with nothing to use still told its tokens: they are billed, so it is kept and counted.
            Err(
                e @ ModelError::Unusable {
                    input_tokens,
                    output_tokens,
                    ..
                },
            ) => Outcome::ModelUnusable {
                error: e.to_string(),
                input_tokens,
                output_tokens,
            },
            Err(e) => {
                // No answer told believable tokens, so none are counted, though a provider may bill one all the same
                // (cut off mid-way, too large to read, not a chat completion, without both usage counts, or with usage
                // past `MAX_TOKENS_TOLD`). The key is freed for the retry.
                d.store.release(org, &key).await?;
                return Ok(Outcome::Failed {
                    error: e.to_string(),
                    retryable: e.is_retryable(),
                });
            }
        };
        let (outcome, kept) = keepable(answered)?;
        d.store.finish(org, &key, &kept, d.clock.now_ms()).await?;
        // Counted after the answer is kept, so a failure here never makes the call be paid again. The price is an
        // undercount of this one answer when the count fails or the process dies right here.
        let paid = spend::Spent::of(&outcome, &d.prices);
        if let Err(e) = spend::add(d.store.as_ref(), org, d.clock.now_ms(), paid).await {
            let (micros, tokens) = (paid.micros, paid.tokens);
            error!(error = %e, %org, micros, tokens, "the organisation's model spend was not counted");
        }
        Ok(outcome)
    }

    /// Returns once the kill switch of `run` or of its organisation is on, reading the two every `KILL_WATCH`. A
    /// failed read is logged (the first of a call only) and the next one made; the guards read them all again
    /// after the call in any case.
    async fn killed(&self, org: &str, run: &str) {
        let store = self.deps.store.as_ref();
        let run_switch = run_kill_switch_id(run);
        let mut logged = false;
        loop {
            tokio::time::sleep(KILL_WATCH).await;
            let (org_switch, own_switch) = tokio::join!(
                store.get_item(org, "kill", "org"),
                store.get_item(org, "kill", &run_switch)
            );
            // Either switch found on is a kill, whatever became of the other read.
            if matches!(org_switch, Ok(Some(_))) || matches!(own_switch, Ok(Some(_))) {
                return;
            }
            if let (Err(e), _) | (_, Err(e)) = (org_switch, own_switch)
                && !logged
            {
                logged = true;
                warn!(error = %e, %org, %run, "cannot read the kill switches during a model call");
            }
        }
    }

    /// The world outside the run that the engine may look at, read fresh (kill switches are read strongly), for a
    /// decision about `run` (`None`: a run not yet opened, whose switch [`Worker::open`] reads once it knows the id).
    async fn ctx(&self, org: &str, run: Option<&str>, now_ms: i64) -> Result<Ctx, WorkerError> {
        let d = &self.deps;
        let mut ctx = Ctx::new(org, &d.env, now_ms);
        ctx.config = d.config.clone();
        ctx.policy = d.policy.clone();
        ctx.prices = d.prices;
        ctx.owner = d.owner.clone();
        ctx.kill = self.kill_switches(org, run).await?;
        // Without a monthly limit the spend decides nothing: it is not read.
        if d.config.org_budget_micros.is_some() || d.config.org_budget_tokens.is_some() {
            let spent = spend::this_month(d.store.as_ref(), org, now_ms).await?;
            ctx.org_spend = OrgSpend {
                spent_micros: spent.micros,
                spent_tokens: spent.tokens,
            };
        }
        Ok(ctx)
    }

    /// The kill switches that bear on a decision about `run`: the organisation's, the agents', and `run`'s own. Run
    /// switches are never listed in full: one is written per killed run and stays, so listing them would make every
    /// step of every run slower as the killed runs add up. Items come in the byte order of their ids and
    /// `agent:<name>` < `org` < `run:<id>`, so the listing stops at the first run switch; a scope added later must
    /// sort before `run:` too, or it is never read.
    async fn kill_switches(
        &self,
        org: &str,
        run: Option<&str>,
    ) -> Result<KillSwitches, WorkerError> {
        // The five agents' switches and the organisation's fit one page. In an organisation with killed runs, the
        // page also holds up to 8 run switches (each with its signed proof): when the listing ends there they answer
        // for the run's own; when run switches go on past the page they were read for nothing and a `get_item`
        // follows. A bounded price, where listing them all grew with every run ever killed.
        const PAGE: u32 = 8;
        let mut kill = KillSwitches::default();
        let mut page = Page::first(PAGE);
        loop {
            let listed = self.deps.store.list_items(org, "kill", None, page).await?;
            let runs_from = listed
                .items
                .iter()
                .position(|item| item.id.starts_with("run:"));
            for item in &listed.items[..runs_from.unwrap_or(listed.items.len())] {
                match item.id.split_once(':') {
                    None if item.id == "org" => kill.org = true,
                    Some(("agent", name)) => kill.agents.push(name.to_string()),
                    // A scope added by a later version, met during a rolling deploy: stopping the whole organisation
                    // for it would kill every run there for good (a kill is final), which is worse than leaving the
                    // switch to the workers that know its scope.
                    _ => warn!(id = %item.id, "ignoring a kill switch of unknown scope"),
                }
            }
            match (runs_from, listed.next) {
                (None, Some(cursor)) => {
                    page = Page {
                        cursor: Some(cursor),
                        limit: PAGE,
                    }
                }
                // The listing ended on this page, so every run switch there is was on it: the run's own too, if set.
                (_, None) => {
                    if let Some(run) = run {
                        let id = run_kill_switch_id(run);
                        kill.runs = own_switch(run, listed.items.iter().any(|item| item.id == id));
                    }
                    return Ok(kill);
                }
                // Run switches go on past this page: the run's own is read by its id.
                (Some(_), Some(_)) => {
                    if let Some(run) = run {
                        kill.runs = self.run_switch(org, run).await?;
                    }
                    return Ok(kill);
                }
            }
        }
    }

    /// [`KillSwitches::runs`] for a decision about `run`, its switch read by its id.
    async fn run_switch(&self, org: &str, run: &str) -> Result<Vec<String>, WorkerError> {
        let set = self
            .deps
            .store
            .get_item(org, "kill", &run_kill_switch_id(run))
            .await?
            .is_some();
        Ok(own_switch(run, set))
    }

    async fn last_run(&self, org: &str, fingerprint: &str) -> Result<Option<LastRun>, WorkerError> {
        let Some(item) = self
            .deps
            .store
            .get_item(org, "fingerprint", &fingerprint_key(fingerprint))
            .await?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&item.body)
            .map(Some)
            .map_err(|e| WorkerError::Corrupt(format!("fingerprint: {e}")))
    }

    async fn enqueue(
        &self,
        org: &str,
        run: &str,
        input: Option<Input>,
        delay_ms: u64,
    ) -> Result<(), WorkerError> {
        let envelope = Envelope {
            org: org.to_string(),
            run: run.to_string(),
            input,
        };
        self.deps.queue.send(&to_json(&envelope)?, delay_ms).await?;
        Ok(())
    }
}

/// [`KillSwitches::runs`] for a decision about `run`: `[run]` when its switch is `set`, else nothing.
fn own_switch(run: &str, set: bool) -> Vec<String> {
    if set {
        vec![run.to_string()]
    } else {
        Vec::new()
    }
}

/// Fingerprints are arbitrary text from outside; the item id is their hash so it has a bounded, safe shape.
fn fingerprint_key(fingerprint: &str) -> String {
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, fingerprint.as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The stored form of an event: the event itself plus when it was recorded, the stage it left the run in and a
/// one-line summary, so a timeline can say what happened when without replaying the run. Folding ignores them.
fn logged(event: &Event, run: &Run, now_ms: i64) -> Result<Vec<u8>, WorkerError> {
    let mut value = serde_json::to_value(event).map_err(|e| WorkerError::Corrupt(e.to_string()))?;
    if let Some(fields) = value.as_object_mut() {
        fields.entry("at_ms").or_insert(json!(now_ms));
        fields.insert("stage".into(), json!(run.stage.as_str()));
        fields.insert("summary".into(), json!(event.summary()));
    }
    to_json(&value)
}

/// A model answer as its idempotency result, and that result's bytes. An answer larger than a store keeps (a model
/// may send megabytes; an unusable one's reason is the client's) would be refused on every delivery and paid for
/// again each time the claim's lease ran out: it is kept as unusable instead, its tokens counted, its text dropped.
fn keepable(answer: Outcome) -> Result<(Outcome, Vec<u8>), WorkerError> {
    use loams_platform::limits::MAX_BODY;
    let json = to_json(&answer)?;
    match answer.model_tokens() {
        Some((input_tokens, output_tokens)) if json.len() > MAX_BODY => {
            let unusable = Outcome::ModelUnusable {
                error: format!(
                    "the model answer is {} bytes as JSON, more than the {MAX_BODY} a store keeps",
                    json.len()
                ),
                input_tokens,
                output_tokens,
            };
            let json = to_json(&unusable)?;
            Ok((unusable, json))
        }
        _ => Ok((answer, json)),
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, WorkerError> {
    serde_json::to_vec(value).map_err(|e| WorkerError::Corrupt(e.to_string()))
}
