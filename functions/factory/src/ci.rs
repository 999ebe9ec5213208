//! Reading a CI log for the walls: which checks passed, which failed, and a signature of the failure.
//!
//! Recognised lines (one check per line): `PASS <check>` / `FAIL <check>` (also `ok`/`FAILED`/`ERROR`), and the
//! commit-status form `<check>: <state>[ ...]` with state `success`, `failure` or `error`, which is what the forgejo
//! agent renders from Forgejo's combined status.

use serde::{Deserialize, Serialize};

use crate::ids::sha256_hex;

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct CiReport {
    pub passing: Vec<String>,
    pub failing: Vec<String>,
    /// Equal for two failures that failed the same way: the sorted failing checks, or when none could be read, a
    /// hash of the log with digits removed (timestamps and durations differ between otherwise equal runs).
    pub signature: String,
}

fn check_of(line: &str) -> Option<(bool, String)> {
    let line = line.trim();
    let (first, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let rest = rest.trim();
    match first {
        "PASS" | "ok" | "PASSED" if !rest.is_empty() => return Some((true, rest.to_string())),
        "FAIL" | "FAILED" | "ERROR" if !rest.is_empty() => return Some((false, rest.to_string())),
        _ => {}
    }
    let (name, state) = line.split_once(": ")?;
    let state = state.split_whitespace().next()?;
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    match state {
        "success" => Some((true, name.to_string())),
        "failure" | "error" => Some((false, name.to_string())),
        _ => None,
    }
}

pub fn parse_ci_log(log: &str) -> CiReport {
    let mut report = CiReport::default();
    for line in log.lines() {
        if let Some((passed, mut name)) = check_of(line) {
            // At most 200 bytes, cut on a character boundary (`truncate` panics inside a character).
            name.truncate(name.floor_char_boundary(200));
            let list = if passed {
                &mut report.passing
            } else {
                &mut report.failing
            };
            if !list.contains(&name) {
                list.push(name);
            }
        }
    }
    report.passing.retain(|p| !report.failing.contains(p));
    report.passing.sort();
    report.failing.sort();
    report.signature = if report.failing.is_empty() {
        let normalized: String = log
            .split_whitespace()
            .map(|w| {
                w.chars()
                    .filter(|c| !c.is_ascii_digit())
                    .collect::<String>()
            })
            .collect::<Vec<_>>()
            .join(" ");
        format!("log:{}", &sha256_hex(normalized.as_bytes())[..16])
    } else {
        format!("checks:{}", report.failing.join(","))
    };
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_forms() {
        let r = parse_ci_log(
            "PASS test_a\nFAIL test_b\nlint: success\nunit: failure - 2 failed\nnoise line\n",
        );
        assert_eq!(r.passing, vec!["lint", "test_a"]);
        assert_eq!(r.failing, vec!["test_b", "unit"]);
        assert_eq!(r.signature, "checks:test_b,unit");
    }

    #[test]
    fn signature_ignores_digits_when_no_checks() {
        let a = parse_ci_log("build failed after 12.3s at 10:01");
        let b = parse_ci_log("build failed after 9.1s at 11:47");
        let c = parse_ci_log("link error");
        assert_eq!(a.signature, b.signature);
        assert_ne!(a.signature, c.signature);
        assert!(a.failing.is_empty());
    }

    #[test]
    fn long_check_names_are_cut_on_a_character_boundary() {
        // 199 bytes, then a two-byte character across the 200th: a byte cut there would split it.
        let name = format!("{}é-and-more", "a".repeat(199));
        let r = parse_ci_log(&format!("FAIL {name}\n"));
        assert_eq!(r.failing, vec!["a".repeat(199)]);
    }
}
