//! Parsing of the two review reports (DESIGN.md section 5, review).

use serde::{Deserialize, Serialize};

/// The senior lead approves only when the whole report, trimmed, is exactly this (DESIGN.md: "approves only with the
/// exact string"); a report that says more is asking for something.
pub const LEAD_APPROVAL: &str = "All good";
/// The security auditor approves only when this is the last line of the report and no line anywhere else names a
/// CRITICAL or HIGH severity, however it is written.
pub const AUDIT_APPROVAL: &str = "No CRITICAL or HIGH findings.";
/// Most findings an audit records. A finding is at most 500 characters without control characters (2,000 bytes of
/// JSON at most: four-byte characters, or quotes escaped to two) and a location of at most `MAX_LOCATION` bytes
/// without them (twice that as JSON at most, all quotes or backslashes), so an audit's event stays near 300,000
/// bytes at worst, under the 400,000 a store keeps of an event.
const MAX_FINDINGS: usize = 100;
/// Longest location (`path:line`) a finding records.
const MAX_LOCATION: usize = 300;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "UPPERCASE")]
pub enum Severity {
    Critical,
    High,
    Medium,
    Low,
}

impl Severity {
    /// A severity word in any case (`HIGH`, `High`, `high`).
    fn parse(word: &str) -> Option<Severity> {
        match word.to_ascii_uppercase().as_str() {
            "CRITICAL" => Some(Severity::Critical),
            "HIGH" => Some(Severity::High),
            "MEDIUM" => Some(Severity::Medium),
            "LOW" => Some(Severity::Low),
            _ => None,
        }
    }

    pub fn blocks(self) -> bool {
        matches!(self, Severity::Critical | Severity::High)
    }
}

/// One report line that names a severity. `severity` is the gravest severity word on the line, wherever it stands
/// (`HIGH src/a.py:3 ...`, `1. **High**: ...`, `Severity: high`, `| HIGH | ... |`), so a finding cannot slip past the
/// gate by its formatting. `location` is the first `file:line` token of the line, if any.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    pub text: String,
}

pub fn lead_approves(report: &str) -> bool {
    report.trim() == LEAD_APPROVAL
}

fn is_location(token: &str) -> bool {
    match token.rsplit_once(':') {
        Some((file, line)) => {
            !file.is_empty()
                && !file.contains(char::is_control)
                && file.contains(['.', '/'])
                && !line.is_empty()
                && line.chars().all(|c| c.is_ascii_digit() || c == '-')
        }
        None => false,
    }
}

/// Words of a line: runs of ASCII letters and digits, so markdown (`**`, `|`, backticks, brackets), punctuation and
/// slashes around a severity never hide it.
fn words(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
}

fn finding(line: &str) -> Option<Finding> {
    let text = line.trim();
    let severity = words(text).filter_map(Severity::parse).min()?;
    let location = text
        .split(|c: char| {
            c.is_whitespace() || matches!(c, '`' | ',' | ';' | '(' | ')' | '|' | '*' | '[' | ']')
        })
        .map(|w| w.trim_end_matches('.'))
        .find(|w| w.len() <= MAX_LOCATION && is_location(w))
        .map(str::to_string);
    Some(Finding {
        severity,
        location,
        text: text.chars().filter(|c| !c.is_control()).take(500).collect(),
    })
}

/// The non-empty lines of a report, trimmed.
fn lines(report: &str) -> Vec<&str> {
    report
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

/// The auditor's verdict and the findings it listed. The approval line itself names CRITICAL and HIGH, so it is the
/// one line not read as a finding, and only in last position.
pub fn audit_verdict(report: &str) -> (bool, Vec<Finding>) {
    let all = lines(report);
    let approval_last = all.last() == Some(&AUDIT_APPROVAL);
    let body = if approval_last {
        &all[..all.len() - 1]
    } else {
        &all[..]
    };
    let found: Vec<Finding> = body.iter().filter_map(|l| finding(l)).collect();
    let approved = approval_last && !found.iter().any(|f| f.severity.blocks());
    (approved, most_severe(found))
}

/// At most `MAX_FINDINGS` of `found`, the most severe, in the report's order: a report the model filled with findings
/// would otherwise make an event larger than a store keeps.
fn most_severe(found: Vec<Finding>) -> Vec<Finding> {
    if found.len() <= MAX_FINDINGS {
        return found;
    }
    // A stable sort: among equally severe findings the earlier ones are kept.
    let mut ranked: Vec<(usize, Finding)> = found.into_iter().enumerate().collect();
    ranked.sort_by_key(|(_, f)| f.severity);
    ranked.truncate(MAX_FINDINGS);
    ranked.sort_unstable_by_key(|(at, _)| *at);
    ranked.into_iter().map(|(_, f)| f).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lead_needs_exactly_the_approval_and_nothing_else() {
        assert!(lead_approves("All good"));
        assert!(lead_approves("  All good\n\n"));
        assert!(
            !lead_approves("Looks fine.\nAll good\n"),
            "anything beside the approval is a remark"
        );
        assert!(!lead_approves("All good\nbut rename x"));
        assert!(!lead_approves("All good, but rename x"));
        assert!(!lead_approves("all good"));
        assert!(!lead_approves("All good."));
        assert!(!lead_approves(""));
        assert!(!lead_approves("Required changes:\n- handle None"));
    }

    #[test]
    fn audit_approves_with_only_minor_findings_and_the_last_line() {
        let ok =
            format!("LOW src/a.py:3 verbose log; exploit: none; remedy: trim\n{AUDIT_APPROVAL}\n");
        let (approved, f) = audit_verdict(&ok);
        assert!(approved);
        assert_eq!(
            f,
            vec![Finding {
                severity: Severity::Low,
                location: Some("src/a.py:3".into()),
                text: "LOW src/a.py:3 verbose log; exploit: none; remedy: trim".into()
            }]
        );
        assert!(audit_verdict(AUDIT_APPROVAL).0);
        assert!(
            audit_verdict(&format!(
                "Scope: arithmetic only.\nMEDIUM: src/b.py:2-4 weak check\n\n{AUDIT_APPROVAL}"
            ))
            .0
        );
    }

    #[test]
    fn any_blocking_finding_blocks_however_written() {
        let shapes = [
            "HIGH src/a.py:10 SQL injection",
            "- **HIGH** `src/a.py:10` SQL injection",
            "1. HIGH src/a.py:10 SQL injection",
            "1. [HIGH] SQL injection in src/a.py:10",
            "Severity: HIGH - SQL injection (src/a.py:10)",
            "severity: high; SQL injection at src/a.py:10",
            "| src/a.py:10 | HIGH | SQL injection |",
            "**High**: SQL injection",
            "### Critical",
            "CRITICAL: remote code execution",
            "critical rce in src/a.py:1",
            "MEDIUM/HIGH src/a.py:10 depends on the deployment",
        ];
        for shape in shapes {
            let report = format!("{shape}\n{AUDIT_APPROVAL}");
            let (approved, f) = audit_verdict(&report);
            assert!(!approved, "{shape:?} must block");
            assert!(
                f[0].severity.blocks(),
                "{shape:?} read as {:?}",
                f[0].severity
            );
        }
        let (_, f) = audit_verdict(&format!(
            "- **HIGH** `src/a.py:10` SQL injection\nMEDIUM: src/b.py:2-4 weak\n{AUDIT_APPROVAL}"
        ));
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].location.as_deref(), Some("src/a.py:10"));
        assert_eq!(f[1].severity, Severity::Medium);
        assert_eq!(f[1].location.as_deref(), Some("src/b.py:2-4"));
    }

    #[test]
    fn an_audit_keeps_its_most_severe_findings_when_it_lists_too_many() {
        let mut report = "LOW src/a.py:1 style\n".repeat(150);
        report.push_str(&format!("HIGH src/b.py:2 injection\n{AUDIT_APPROVAL}\n"));
        let (approved, findings) = audit_verdict(&report);
        assert!(!approved, "the finding past the cap still blocks");
        assert_eq!(findings.len(), MAX_FINDINGS);
        assert_eq!(
            findings.last().unwrap().severity,
            Severity::High,
            "in the report's order"
        );
        assert!(
            findings[..MAX_FINDINGS - 1]
                .iter()
                .all(|f| f.severity == Severity::Low)
        );
        let long = format!("LOW src/{}.py:1 x\u{1b}[0m", "d".repeat(400));
        let (_, findings) = audit_verdict(&long);
        assert_eq!(findings[0].location, None);
        assert!(!findings[0].text.contains('\u{1b}'));
        let hidden = "LOW src/\u{1}\u{1}.py:1 x";
        assert_eq!(audit_verdict(hidden).1[0].location, None);
    }

    #[test]
    fn the_largest_audit_event_stays_well_within_what_a_store_keeps() {
        // Each finding as costly as JSON allows: 500 four-byte characters of text (the severity word after them), a
        // location at the cap made of quotes (two bytes each as JSON), and a report tail of quotes.
        let line = format!("{} /{}:1 CRITICAL\n", "😀".repeat(500), "\"".repeat(297));
        let answer = line.repeat(MAX_FINDINGS + 20);
        let (approved, findings) = audit_verdict(&answer);
        assert!(!approved);
        let event = crate::Event::SecurityAudited {
            approved,
            findings,
            report: "\"".repeat(crate::MAX_FEEDBACK),
        };
        let size = serde_json::to_vec(&event).unwrap().len();
        assert!(size < 300_000, "{size} bytes");
    }

    #[test]
    fn audit_approval_must_be_the_exact_last_line() {
        assert!(
            !audit_verdict("Nothing to report.").0,
            "no approval string, no approval"
        );
        assert!(
            !audit_verdict(&format!("{AUDIT_APPROVAL}\nLOW src/a.py:1 nit")).0,
            "not the last line"
        );
        assert!(!audit_verdict(&format!("{AUDIT_APPROVAL}\nHIGH src/a.py:1 rce")).0);
        assert!(!audit_verdict("No critical or high findings.").0);
        assert!(!audit_verdict(&format!("LOW a.py:1 x\n> {AUDIT_APPROVAL}")).0);
        // The approval string repeated earlier is itself read as naming CRITICAL and HIGH.
        assert!(!audit_verdict(&format!("{AUDIT_APPROVAL}\n{AUDIT_APPROVAL}")).0);
    }
}
