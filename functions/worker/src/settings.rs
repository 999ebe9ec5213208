//! Settings the worker reads once from the environment when it is built: the queue visibility timeout and the
//! fault-injection switch of the crash tests. Both are off the normal configuration path on purpose: the first is
//! an operational knob of the queue, the second must never be set outside a test.
//!
//! - `LOAMS_QUEUE_VISIBILITY_MS` (default 30000, 100..=600000): how long a received message stays hidden. While a
//!   step runs the worker extends it every third of that time, so a slow effect is never handed to a second
//!   worker, and a message of a crashed worker comes back after at most this long.
//! - `LOAMS_FAULT_ABORT_AT=<boundary>:<n>` (default off; read by debug builds only): aborts the process (`std::process::abort`, no unwinding,
//!   no cleanup, like a kill) at the `n`-th crossing of `boundary` since the worker was built, counted over all
//!   queue tasks of the process. `after_effect`: the effect was performed, its outcome is not recorded.
//!   `after_record`: the outcome is recorded, the continuation is not enqueued and the message not acked.

use std::sync::atomic::{AtomicU64, Ordering};

use tracing::{error, warn};

pub(crate) const VISIBILITY_ENV: &str = "LOAMS_QUEUE_VISIBILITY_MS";
pub(crate) const FAULT_ENV: &str = "LOAMS_FAULT_ABORT_AT";
const DEFAULT_VISIBILITY_MS: u64 = 30_000;
const MIN_VISIBILITY_MS: u64 = 100;
const MAX_VISIBILITY_MS: u64 = 600_000;
/// Longest environment value parsed; anything longer is a mistake.
const MAX_ENV_LEN: usize = 64;

/// A point in the handling of one message where a crash leaves a distinct state behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Boundary {
    /// The effect was performed; its outcome is not recorded yet.
    AfterEffect,
    /// The outcome is recorded; the continuation is not enqueued and the message is not acked.
    AfterRecord,
}

impl Boundary {
    fn parse(name: &str) -> Option<Boundary> {
        match name {
            "after_effect" => Some(Boundary::AfterEffect),
            "after_record" => Some(Boundary::AfterRecord),
            _ => None,
        }
    }
}

/// Abort at the `at`-th crossing of `boundary`.
#[derive(Debug)]
pub(crate) struct Fault {
    boundary: Boundary,
    at: u64,
    crossed: AtomicU64,
}

impl Fault {
    /// Parses `<boundary>:<n>` with n >= 1.
    pub(crate) fn parse(value: &str) -> Result<Fault, String> {
        if value.len() > MAX_ENV_LEN {
            return Err("value too long".into());
        }
        let (name, n) = value.split_once(':').ok_or("expected <boundary>:<n>")?;
        let boundary =
            Boundary::parse(name.trim()).ok_or("boundary is after_effect or after_record")?;
        let at = n
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or("n is a whole number >= 1")?;
        Ok(Fault {
            boundary,
            at,
            crossed: AtomicU64::new(0),
        })
    }

    /// Counts a crossing of `boundary` and aborts the process if it is the planned one.
    pub(crate) fn cross(&self, boundary: Boundary, step: &str) {
        if boundary != self.boundary {
            return;
        }
        if self.crossed.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            error!(
                ?boundary,
                n = self.at,
                step,
                "fault injection: aborting the process"
            );
            std::process::abort();
        }
    }
}

pub(crate) struct Settings {
    pub visibility_ms: u64,
    pub fault: Option<Fault>,
}

impl Settings {
    pub(crate) fn from_env() -> Settings {
        // Fault injection exists for the crash tests, which run debug builds; a release build never reads the
        // switch, so a stray variable in production cannot abort the service.
        let fault = if cfg!(debug_assertions) {
            std::env::var(FAULT_ENV).ok()
        } else {
            None
        };
        Settings::from_values(
            std::env::var(VISIBILITY_ENV).ok().as_deref(),
            fault.as_deref(),
        )
    }

    /// A bad value is reported and ignored rather than fatal: the worker then runs with the defaults (a crash
    /// test notices, since its process does not abort).
    pub(crate) fn from_values(visibility: Option<&str>, fault: Option<&str>) -> Settings {
        let visibility_ms = match visibility {
            None => DEFAULT_VISIBILITY_MS,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms)
                    if v.len() <= MAX_ENV_LEN
                        && (MIN_VISIBILITY_MS..=MAX_VISIBILITY_MS).contains(&ms) =>
                {
                    ms
                }
                _ => {
                    warn!(value = %v.chars().take(MAX_ENV_LEN).collect::<String>(),
                          "{VISIBILITY_ENV} must be {MIN_VISIBILITY_MS}..={MAX_VISIBILITY_MS}; using the default");
                    DEFAULT_VISIBILITY_MS
                }
            },
        };
        let fault = fault.and_then(|v| match Fault::parse(v) {
            Ok(fault) => {
                warn!(boundary = ?fault.boundary, n = fault.at, "fault injection is on: the process will abort");
                Some(fault)
            }
            Err(e) => {
                error!(error = %e, "{FAULT_ENV} ignored");
                None
            }
        });
        Settings {
            visibility_ms,
            fault,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_fault_switch() {
        let f = Fault::parse("after_record:3").unwrap();
        assert_eq!((f.boundary, f.at), (Boundary::AfterRecord, 3));
        assert_eq!(
            Fault::parse("after_effect:1").unwrap().boundary,
            Boundary::AfterEffect
        );
        for bad in [
            "after_effect",
            "after_effect:0",
            "before:1",
            "after_record:x",
            "",
        ] {
            assert!(Fault::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn counts_only_its_boundary_and_stops_before_the_planned_crossing() {
        let f = Fault::parse("after_record:2").unwrap();
        f.cross(Boundary::AfterEffect, "s1");
        f.cross(Boundary::AfterEffect, "s2");
        f.cross(Boundary::AfterRecord, "s3");
        assert_eq!(f.crossed.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn visibility_defaults_and_bounds() {
        assert_eq!(
            Settings::from_values(None, None).visibility_ms,
            DEFAULT_VISIBILITY_MS
        );
        assert_eq!(Settings::from_values(Some("500"), None).visibility_ms, 500);
        assert_eq!(
            Settings::from_values(Some("5"), None).visibility_ms,
            DEFAULT_VISIBILITY_MS
        );
        assert!(
            Settings::from_values(None, Some("nonsense"))
                .fault
                .is_none()
        );
    }
}
