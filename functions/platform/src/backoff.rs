//! Jittered waits before a retry: the store's conditional writes, the app clients and the spend counter all back
//! off, and concurrent retriers that wait exactly as long collide again in lock step.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// A wait between half of `step` and all of it, at random.
pub fn jittered(step: Duration) -> Duration {
    let half = step / 2;
    let spread = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(random_u64() % spread.saturating_add(1))
}

/// A random number from the standard library's per-hasher random keys: enough to spread retries, not for secrets.
pub fn random_u64() -> u64 {
    std::hash::RandomState::new().build_hasher().finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_stay_between_half_and_the_whole_step_and_vary() {
        let step = Duration::from_millis(80);
        let waits: Vec<Duration> = (0..100).map(|_| jittered(step)).collect();
        assert!(
            waits.iter().all(|w| *w >= step / 2 && *w <= step),
            "{waits:?}"
        );
        assert!(waits.iter().any(|w| *w != waits[0]), "{waits:?}");
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }
}
