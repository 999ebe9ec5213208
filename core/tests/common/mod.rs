//! Helpers shared by the core's test binaries.

use std::time::{Duration, Instant};

/// Waits up to five seconds for `done`: work finished on another thread (a stream reaching the server) can come a
/// moment after what the test saw, on a busy machine. The caller asserts the outcome.
pub async fn wait_until(mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
