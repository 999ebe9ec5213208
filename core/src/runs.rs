//! Runs and their timelines: list and read (cached), kill, and watch (snapshot from the cache, then the server's
//! changes from the stored cursor, over the WatchRun stream or by polling).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use loams_proto::connect::Code;
use loams_proto::factory::v1 as pf;
use pf::watch_run_response::Item as WatchItem;

use crate::cache::timeline_stream;
use crate::client::{Inner, TaskHandle, check_id, idempotency_key, now_ms};
use crate::error::{Error, Result};
use crate::follow::{Follower, Report, Step, follow};
use crate::types::{Run, TimelineEvent, is_terminal};

const SERVICE: &str = "/loams.factory.v1.FactoryService/";
/// Runs per ListRuns page, and pages read by one refresh (the newest 1,000 runs).
const LIST_PAGE: u32 = 100;
const LIST_PAGES: usize = 10;
/// Events per GetTimeline page (the server's maximum), and pages per poll before yielding to the listener.
const TIMELINE_PAGE: u32 = 200;
const TIMELINE_PAGES: usize = 50;
/// Events delivered in a watch's first snapshot.
const SNAPSHOT_EVENTS: u32 = 10_000;
/// The server keeps at most this much of a kill reason.
const MAX_REASON: usize = 500;

/// What a watch delivers: first one `Snapshot` (from the cache, possibly empty), then changes.
#[derive(Clone, Debug, PartialEq)]
pub enum RunUpdate {
    /// What the cache holds, delivered before `watch` returns. `run` is `None` for a run never synced.
    Snapshot {
        run: Option<Run>,
        events: Vec<TimelineEvent>,
    },
    /// The server's current view of the run (state, stage, links, budget).
    Run { run: Run },
    /// Events new to this installation, oldest first.
    Events { events: Vec<TimelineEvent> },
    /// A heartbeat: nothing changed, and the server confirmed that at `at_ms`.
    Confirmed { at_ms: i64 },
    /// The connection changed: `connected` false means offline (cached data stays readable); `detail` says why. A
    /// watch the server refuses ends with one last such notice carrying the reason, even if it was offline already.
    Connection { connected: bool, detail: String },
    /// The run has ended and its whole timeline is stored: the watch stops.
    Finished,
}

/// Receives a watch's updates, on a tokio worker thread (the UI hops to its main thread).
pub trait RunListener: Send + Sync {
    fn on_update(&self, update: RunUpdate);
}

/// The outcome of one poll step: the run as the server has it, and the events that were new to the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSync {
    pub run: Run,
    pub new_events: Vec<TimelineEvent>,
}

pub struct Runs {
    inner: Arc<Inner>,
}

impl Runs {
    pub(crate) fn new(inner: Arc<Inner>) -> Runs {
        Runs { inner }
    }

    /// The cached runs, newest first, with the time each was last confirmed.
    pub fn cached(&self, limit: u32) -> Result<Vec<Run>> {
        self.inner.cache.runs(limit)
    }

    pub fn cached_run(&self, run_id: &str) -> Result<Option<Run>> {
        self.inner.cache.run(run_id)
    }

    /// The cached timeline after `after_seq`, oldest first.
    pub fn cached_timeline(
        &self,
        run_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<TimelineEvent>> {
        self.inner.cache.events(run_id, after_seq, limit)
    }

    /// Reads the newest runs from the server into the cache and returns them.
    pub async fn refresh(&self) -> Result<Vec<Run>> {
        let mut token = String::new();
        let mut count = 0usize;
        for _ in 0..LIST_PAGES {
            let req = pf::ListRunsRequest {
                page_size: LIST_PAGE,
                page_token: token,
                state: String::new(),
            };
            let resp: pf::ListRunsResponse = self
                .inner
                .unary(&format!("{SERVICE}ListRuns"), &req)
                .await?;
            self.inner.cache.put_runs(&resp.runs, now_ms())?;
            count += resp.runs.len();
            if resp.next_page_token.is_empty() {
                break;
            }
            token = resp.next_page_token;
        }
        self.inner
            .cache
            .runs(u32::try_from(count).unwrap_or(u32::MAX))
    }

    /// One sync step without a stream: the run, then its timeline from the stored cursor. Returns the run and the
    /// events new to the cache.
    pub async fn sync(&self, run_id: &str) -> Result<RunSync> {
        check_id("run_id", run_id)?;
        let (run, new_events, _) = poll_once(&self.inner, run_id).await?;
        Ok(RunSync { run, new_events })
    }

    /// Stops the run at its next step, as a signed step-up: gets a single-use kill challenge for this run and this
    /// device, signs the canonical kill bytes of `loams-proto` with the device key, and sends the kill. Needs a
    /// registered device and the token's `runs:kill` scope. Fails at once when offline; the cache changes only with
    /// the server's answer.
    pub async fn kill(&self, run_id: &str, reason: &str) -> Result<Run> {
        check_id("run_id", run_id)?;
        // Checked before anything is signed (a signature may cost the person a biometric prompt).
        if reason.len() > MAX_REASON || !loams_proto::is_plain_text(reason) {
            return Err(Error::InvalidInput(format!(
                "the reason must be at most {MAX_REASON} bytes without control, bidirectional or invisible characters"
            )));
        }
        let device = self.inner.signing_device()?;
        let challenge: pf::GetKillChallengeResponse = self
            .inner
            .unary(
                &format!("{SERVICE}GetKillChallenge"),
                &pf::GetKillChallengeRequest {
                    run_id: run_id.to_owned(),
                    device_id: device.device_id.clone(),
                },
            )
            .await?;
        let killed_at_ms = now_ms();
        let bytes = loams_proto::canonical_kill_bytes(
            run_id,
            reason,
            &device.device_id,
            &challenge.challenge,
            killed_at_ms,
        );
        let signature = self
            .inner
            .sign_step(&device, &challenge.challenge, bytes)
            .await?;
        let req = pf::KillRunRequest {
            run_id: run_id.to_owned(),
            reason: reason.to_owned(),
            idempotency_key: idempotency_key("kill")?,
            device_id: device.device_id,
            challenge: challenge.challenge,
            killed_at_ms,
            signature,
        };
        let resp: pf::KillRunResponse =
            self.inner.unary(&format!("{SERVICE}KillRun"), &req).await?;
        let run = resp
            .run
            .ok_or_else(|| Error::Server("KillRun returned no run".into()))?;
        let at = now_ms();
        self.inner.cache.put_runs(std::slice::from_ref(&run), at)?;
        Ok(Run::from_proto(run, at))
    }

    /// Delivers the cached snapshot to `listener` before returning, then follows the run from the stored cursor
    /// until it has finished, the server refuses the watch (a last `Connection` notice gives the reason), or the
    /// handle is cancelled or dropped. Connection losses are reported and retried; nothing is lost or repeated
    /// across them, nor across a restart of the app.
    pub async fn watch(&self, run_id: &str, listener: Arc<dyn RunListener>) -> Result<TaskHandle> {
        check_id("run_id", run_id)?;
        let run = self.inner.cache.run(run_id)?;
        let events = self.inner.cache.events(run_id, 0, SNAPSHOT_EVENTS)?;
        listener.on_update(RunUpdate::Snapshot { run, events });
        let follower = RunFollower {
            run_id: run_id.to_owned(),
            listener,
        };
        let inner = self.inner.clone();
        Ok(TaskHandle::spawn(|ending| follow(inner, follower, ending)))
    }
}

/// Follows one run for a watch.
struct RunFollower {
    run_id: String,
    listener: Arc<dyn RunListener>,
}

impl Follower for RunFollower {
    fn connection(&self, connected: bool, detail: String) {
        self.listener
            .on_update(RunUpdate::Connection { connected, detail });
    }

    async fn stream_once(&self, inner: &Inner, report: &mut Report<'_>) -> Result<Step> {
        let (run_id, listener) = (self.run_id.as_str(), &*self.listener);
        let after_seq = inner.cache.cursor(&timeline_stream(run_id))?;
        let req = pf::WatchRunRequest {
            run_id: run_id.to_owned(),
            after_seq,
        };
        let mut stream = inner
            .server_stream::<_, pf::WatchRunResponse>(&format!("{SERVICE}WatchRun"), &req)
            .await?;
        let mut finished_at_start = false;
        let mut last_run_read = Instant::now();
        while let Some(item) = stream.recv().await {
            let item = match item {
                Ok(item) => item,
                Err(e) if e.code == Code::Unimplemented => return Ok(Step::Unsupported),
                Err(e) => return Err(e.into()),
            };
            report(true, "live");
            match item.item {
                Some(WatchItem::Snapshot(run)) => {
                    finished_at_start = is_terminal(&run.state);
                    let run = store_run(inner, run)?;
                    last_run_read = Instant::now();
                    listener.on_update(RunUpdate::Run { run });
                }
                Some(WatchItem::Event(event)) => {
                    // The events that have already arrived behind this one are stored in the same transaction: a
                    // long timeline replayed from the cursor arrives as one burst.
                    let events = stream.burst(event, |r| match r.item {
                        Some(WatchItem::Event(event)) => ControlFlow::Continue(event),
                        item => ControlFlow::Break(pf::WatchRunResponse { item }),
                    });
                    let fresh = inner.cache.append_events(run_id, &events, now_ms())?;
                    if !fresh.is_empty() {
                        listener.on_update(RunUpdate::Events { events: fresh });
                    }
                    // The stream carries events, not the run's new state; re-read it now and then so the stage and
                    // state on screen follow the timeline.
                    if last_run_read.elapsed() >= inner.config.poll_interval {
                        last_run_read = Instant::now();
                        if let Ok(run) = get_run(inner, run_id).await {
                            listener.on_update(RunUpdate::Run { run });
                        }
                    }
                }
                Some(WatchItem::Heartbeat(_)) => {
                    let at_ms = now_ms();
                    inner.cache.confirm_run(run_id, at_ms)?;
                    listener.on_update(RunUpdate::Confirmed { at_ms });
                }
                None => {}
            }
        }
        // The server ends a stream early only for a finished run whose events are all sent; a run that was finished
        // when this stream began is therefore complete. Otherwise (the stream's lifetime cap) the next stream's
        // snapshot tells.
        Ok(if finished_at_start {
            Step::Finished
        } else {
            Step::Again
        })
    }

    async fn poll_once(&self, inner: &Inner, report: &mut Report<'_>) -> Result<Step> {
        let (run, events, finished) = poll_once(inner, &self.run_id).await?;
        report(true, "polling");
        self.listener.on_update(RunUpdate::Run { run });
        if !events.is_empty() {
            self.listener.on_update(RunUpdate::Events { events });
        }
        Ok(if finished {
            Step::Finished
        } else {
            Step::Again
        })
    }

    fn finished(&self) {
        self.listener.on_update(RunUpdate::Finished);
    }
}

fn store_run(inner: &Inner, run: pf::Run) -> Result<Run> {
    let id = run.id.clone();
    inner.cache.put_runs(&[run], now_ms())?;
    inner
        .cache
        .run(&id)?
        .ok_or_else(|| Error::Cache(format!("run {id} vanished from the cache")))
}

async fn get_run(inner: &Inner, run_id: &str) -> Result<Run> {
    let req = pf::GetRunRequest {
        run_id: run_id.to_owned(),
    };
    let resp: pf::GetRunResponse = inner.unary(&format!("{SERVICE}GetRun"), &req).await?;
    let run = resp
        .run
        .ok_or_else(|| Error::Server("GetRun returned no run".into()))?;
    if run.id != run_id {
        return Err(Error::Server(format!(
            "asked for run {run_id}, got {}",
            run.id
        )));
    }
    store_run(inner, run)
}

/// The run, then its timeline from the cursor: returns the run, the new events, and whether the run has
/// finished with its whole timeline stored.
async fn poll_once(inner: &Inner, run_id: &str) -> Result<(Run, Vec<TimelineEvent>, bool)> {
    // The run first: a run seen finished here has all its events in the pages read after.
    let run = get_run(inner, run_id).await?;
    let mut fresh = Vec::new();
    let mut complete = false;
    for _ in 0..TIMELINE_PAGES {
        let after_seq = inner.cache.cursor(&timeline_stream(run_id))?;
        let req = pf::GetTimelineRequest {
            run_id: run_id.to_owned(),
            after_seq,
            page_size: TIMELINE_PAGE,
        };
        let resp: pf::GetTimelineResponse =
            inner.unary(&format!("{SERVICE}GetTimeline"), &req).await?;
        if resp.events.iter().any(|e| e.seq <= after_seq) {
            return Err(Error::Server(
                "GetTimeline returned events before the cursor".into(),
            ));
        }
        fresh.extend(inner.cache.append_events(run_id, &resp.events, now_ms())?);
        if !resp.has_more || resp.events.is_empty() {
            complete = true;
            break;
        }
    }
    let finished = run.is_finished() && complete;
    Ok((run, fresh, finished))
}
