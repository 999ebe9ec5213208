//! Parsing of the two review reports (DESIGN.md section 5, review).

use serde::{Deserialize, Serialize};

/// The senior lead approves only with a line that is exactly this.
pub const LEAD_APPROVAL: &str = "All good";
/// The security auditor approves only with a line that is exactly this, and only if no CRITICAL or HIGH finding is
/// listed in the same report.
pub const AUDIT_APPROVAL: &str = "No CRITICAL or HIGH findings.";

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "UPPERCASE")]
pub enum Severity {
    Critical,
    High,
    Medium,
    Low,
}

impl Severity {
    fn parse(word: &str) -> Option<Severity> {
        match word {
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

/// One finding line: `SEVERITY path:line description` (a leading list marker and a colon after the severity are
/// tolerated). `location` is the first `file:line` token of the line, if any.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    pub text: String,
}

fn exact_line(report: &str, wanted: &str) -> bool {
    report.lines().any(|l| l.trim() == wanted)
}

pub fn lead_approves(report: &str) -> bool {
    exact_line(report, LEAD_APPROVAL)
}

fn is_location(token: &str) -> bool {
    let token = token.trim_matches(|c: char| matches!(c, '`' | ',' | ';' | '(' | ')'));
    match token.rsplit_once(':') {
        Some((file, line)) => {
            !file.is_empty() && !line.is_empty() && line.chars().all(|c| c.is_ascii_digit() || c == '-')
        }
        None => false,
    }
}

pub(crate) fn findings(report: &str) -> Vec<Finding> {
    let mut out = Vec::new();
    for line in report.lines() {
        let l = line.trim().trim_start_matches(['-', '*', ' ', '#']).trim_start_matches("**");
        let mut words = l.split_whitespace();
        let Some(first) = words.next() else { continue };
        let word = first.trim_end_matches(':').trim_end_matches("**").trim_start_matches('[').trim_end_matches(']');
        let Some(severity) = Severity::parse(word) else { continue };
        let location = words
            .find(|w| is_location(w))
            .map(|w| w.trim_matches(|c: char| matches!(c, '`' | ',' | ';' | '(' | ')')).to_string());
        out.push(Finding { severity, location, text: l.chars().take(500).collect() });
    }
    out
}

/// The auditor's verdict and the findings it listed.
pub fn audit_verdict(report: &str) -> (bool, Vec<Finding>) {
    let found = findings(report);
    let approved = exact_line(report, AUDIT_APPROVAL) && !found.iter().any(|f| f.severity.blocks());
    (approved, found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lead_needs_the_exact_line() {
        assert!(lead_approves("Looks fine.\nAll good\n"));
        assert!(lead_approves("All good"));
        assert!(!lead_approves("All good, but rename x"));
        assert!(!lead_approves("all good"));
        assert!(!lead_approves("Required changes:\n- handle None"));
    }

    #[test]
    fn audit_grades_findings() {
        let ok = format!("LOW src/a.py:3 verbose log; exploit: none; remedy: trim\n{AUDIT_APPROVAL}\n");
        let (approved, f) = audit_verdict(&ok);
        assert!(approved);
        assert_eq!(f, vec![Finding {
            severity: Severity::Low,
            location: Some("src/a.py:3".into()),
            text: "LOW src/a.py:3 verbose log; exploit: none; remedy: trim".into()
        }]);

        let bad = format!("- **HIGH** `src/a.py:10` SQL injection\nMEDIUM: src/b.py:2-4 weak check\n{AUDIT_APPROVAL}");
        let (approved, f) = audit_verdict(&bad);
        assert!(!approved, "a HIGH finding blocks even with the approval line");
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].severity, Severity::High);
        assert_eq!(f[0].location.as_deref(), Some("src/a.py:10"));
        assert_eq!(f[1].location.as_deref(), Some("src/b.py:2-4"));

        assert!(!audit_verdict("Nothing to report.").0, "no approval string, no approval");
        assert!(!audit_verdict("CRITICAL x.py:1 rce").0);
    }
}
