//! The scheduler: turns due timers into queue messages. Firing is at-least-once (enqueue, then cancel); the
//! engine ignores a timer whose wait is already over, so a timer fired twice changes nothing.

use std::sync::Arc;

use loams_platform::{Clock, Queue, Timers};

use crate::WorkerError;

/// Largest number of timers fired in one pass; the next pass takes the rest.
const BATCH: u32 = 100;

pub struct Scheduler {
    timers: Arc<dyn Timers>,
    queue: Arc<dyn Queue>,
    clock: Arc<dyn Clock>,
}

impl Scheduler {
    pub fn new(timers: Arc<dyn Timers>, queue: Arc<dyn Queue>, clock: Arc<dyn Clock>) -> Self {
        Scheduler {
            timers,
            queue,
            clock,
        }
    }

    /// Fires every timer due now; returns how many fired. A timer's payload is the queue message to send.
    pub async fn fire_due(&self) -> Result<usize, WorkerError> {
        let due = self.timers.due(self.clock.now_ms(), BATCH).await?;
        for timer in &due {
            self.queue.send(&timer.payload, 0).await?;
            self.timers.cancel(&timer.org, &timer.id).await?;
        }
        Ok(due.len())
    }
}
