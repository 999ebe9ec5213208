//! loams-worker: the shell around the pure engine. It drives runs from the queue (load the run, ask
//! `loams-factory` what to do, perform at most one external effect with the step's idempotency key, record the
//! outcome with a conditional append) and fires due timers.
//!
//! Environment settings, read once when a [`Worker`] is built (details in `settings.rs`):
//! `LOAMS_QUEUE_VISIBILITY_MS` (queue visibility timeout, default 30 s, extended while a step runs) and
//! `LOAMS_FAULT_ABORT_AT=<after_effect|after_record>:<n>` (tests only, off by default: abort the process at the
//! n-th crossing of that step boundary, to test crash recovery at exact points).

mod agents;
mod error;
mod scheduler;
mod settings;
mod spend;
mod worker;

pub use agents::{A2aAgents, AgentCaller, AgentReply};
pub use error::WorkerError;
pub use scheduler::Scheduler;
pub use worker::{MAX_STEP, Opened, Settlement, Worker, WorkerDeps};
