//! loams-worker: the shell around the pure engine. It drives runs from the queue (load the run, ask
//! `loams-factory` what to do, perform at most one external effect with the step's idempotency key, record the
//! outcome with a conditional append) and fires due timers.

mod agents;
mod error;
mod scheduler;
mod worker;

pub use agents::{AgentCaller, A2aAgents};
pub use error::WorkerError;
pub use scheduler::Scheduler;
pub use worker::{Opened, Worker, WorkerDeps};
