//! Time as a port, so that queue visibility, item expiry and timers are deterministic in tests.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> i64;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        // A wall clock set before 1970 is a broken host; clamping to 0 keeps the store working (everything
        // looks due/visible) instead of failing every call.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn new(start_ms: i64) -> Self {
        Self(AtomicI64::new(start_ms))
    }

    pub fn advance(&self, ms: u64) {
        let ms = i64::try_from(ms).unwrap_or(i64::MAX);
        // fetch_update cannot fail with a closure that always returns Some.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(ms))
            });
    }

    pub fn set(&self, now_ms: i64) {
        self.0.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Lets the conformance suite move time forward: a `ManualClock` jumps, an adapter backed by a real service
/// (SQS visibility runs on the service's clock) can implement it by sleeping. The suite only moves time in
/// whole seconds so that second-granular services can follow.
#[async_trait::async_trait]
pub trait TimeControl: Clock {
    async fn elapse(&self, ms: u64);
}

#[async_trait::async_trait]
impl TimeControl for ManualClock {
    async fn elapse(&self, ms: u64) {
        self.advance(ms);
    }
}
