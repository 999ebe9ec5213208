//! The canonical bytes a phone signs with its device key and the server verifies: an approval decision, and the
//! step-up that kills a run. Defined once, here, so that the phones (through `core`) and the server cannot drift
//! apart.
//!
//! Decision encoding (all integers big-endian):
//!
//! ```text
//! "loams.approval.decision.v1" 0x00         domain separation: these bytes can never be mistaken for another message
//! u64 len || approval_id (UTF-8)
//! u64 len || action_hash
//! i32      decision (the proto enum number: 1 = APPROVE, 2 = DENY)
//! u64 len || device_id (UTF-8)
//! u64 len || challenge
//! i64      decided_at_ms
//! ```
//!
//! Kill encoding, the same way:
//!
//! ```text
//! "loams.factory.kill.v1" 0x00
//! u64 len || run_id (UTF-8)
//! u64 len || reason (UTF-8, as sent in KillRunRequest)
//! u64 len || device_id (UTF-8)
//! u64 len || challenge
//! i64      killed_at_ms
//! ```
//!
//! Each message has its own domain, so a signature for one is never valid for the other.
//! Every variable-length field carries its length, so no two different inputs give the same bytes (moving a byte
//! from one field to the next changes a length). Lengths are u64 so that the encoding has no failure case.

use crate::approvals::v1::Decision;

/// Domain-separation prefix of the canonical decision bytes (includes the terminating NUL).
pub const DECISION_DOMAIN: &[u8] = b"loams.approval.decision.v1\0";

/// The bytes a device signs (ECDSA P-256, SHA-256, DER signature) to approve or deny an approval.
pub fn canonical_decision_bytes(
    approval_id: &str,
    action_hash: &[u8],
    decision: Decision,
    device_id: &str,
    challenge: &[u8],
    decided_at_ms: i64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        DECISION_DOMAIN.len()
            + 4 * 8
            + 4
            + 8
            + approval_id.len()
            + action_hash.len()
            + device_id.len()
            + challenge.len(),
    );
    out.extend_from_slice(DECISION_DOMAIN);
    put_field(&mut out, approval_id.as_bytes());
    put_field(&mut out, action_hash);
    out.extend_from_slice(&(decision as i32).to_be_bytes());
    put_field(&mut out, device_id.as_bytes());
    put_field(&mut out, challenge);
    out.extend_from_slice(&decided_at_ms.to_be_bytes());
    out
}

/// Domain-separation prefix of the canonical kill bytes (includes the terminating NUL).
pub const KILL_DOMAIN: &[u8] = b"loams.factory.kill.v1\0";

/// The bytes a device signs (ECDSA P-256, SHA-256, DER signature) to kill a run: the step-up of `KillRun`.
pub fn canonical_kill_bytes(
    run_id: &str,
    reason: &str,
    device_id: &str,
    challenge: &[u8],
    killed_at_ms: i64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        KILL_DOMAIN.len()
            + 4 * 8
            + 8
            + run_id.len()
            + reason.len()
            + device_id.len()
            + challenge.len(),
    );
    out.extend_from_slice(KILL_DOMAIN);
    put_field(&mut out, run_id.as_bytes());
    put_field(&mut out, reason.as_bytes());
    put_field(&mut out, device_id.as_bytes());
    put_field(&mut out, challenge);
    out.extend_from_slice(&killed_at_ms.to_be_bytes());
    out
}

/// Whether a text a person signs reads as what is signed wherever it is shown (terminals, apps): no control
/// characters (terminal escapes), bidirectional marks, overrides or isolates, and no invisible or zero-width
/// characters. A kill reason must be plain text; the phone checks before asking the device to sign, the server
/// before accepting.
pub fn is_plain_text(text: &str) -> bool {
    !text
        .chars()
        .any(|c| c.is_control() || INVISIBLE.iter().any(|r| r.contains(&c)))
}

/// Every assigned format character (Unicode category Cf), line and paragraph separator (Zl, Zp) and
/// default-ignorable code point (fillers, variation selectors, invisible vowels): they show as nothing, or change how
/// the text around them shows. A test checks the table against those properties.
const INVISIBLE: [std::ops::RangeInclusive<char>; 25] = [
    '\u{00AD}'..='\u{00AD}',   // soft hyphen
    '\u{034F}'..='\u{034F}',   // combining grapheme joiner
    '\u{0600}'..='\u{0605}',   // Arabic number signs
    '\u{061C}'..='\u{061C}',   // Arabic letter mark
    '\u{06DD}'..='\u{06DD}',   // Arabic end of ayah
    '\u{070F}'..='\u{070F}',   // Syriac abbreviation mark
    '\u{0890}'..='\u{0891}',   // Arabic pound and piastre marks above
    '\u{08E2}'..='\u{08E2}',   // Arabic disputed end of ayah
    '\u{115F}'..='\u{1160}',   // Hangul fillers
    '\u{17B4}'..='\u{17B5}',   // Khmer inherent vowels
    '\u{180B}'..='\u{180F}',   // Mongolian variation selectors, vowel separator
    '\u{200B}'..='\u{200F}',   // zero-width characters, direction marks
    '\u{2028}'..='\u{202E}',   // line and paragraph separators, embeddings and overrides
    '\u{2060}'..='\u{206F}',   // word joiner, invisible operators, isolates
    '\u{3164}'..='\u{3164}',   // Hangul filler
    '\u{FE00}'..='\u{FE0F}',   // variation selectors
    '\u{FEFF}'..='\u{FEFF}',   // byte order mark
    '\u{FFA0}'..='\u{FFA0}',   // halfwidth Hangul filler
    '\u{FFF0}'..='\u{FFFB}',   // reserved, interlinear annotation
    '\u{110BD}'..='\u{110BD}', // Kaithi number sign
    '\u{110CD}'..='\u{110CD}', // Kaithi number sign above
    '\u{13430}'..='\u{1343F}', // Egyptian hieroglyph format controls
    '\u{1D173}'..='\u{1D17A}', // musical symbol format controls
    '\u{1BCA0}'..='\u{1BCA3}', // shorthand format controls
    '\u{E0000}'..='\u{E0FFF}', // tags, variation selectors supplement
];

fn put_field(out: &mut Vec<u8>, field: &[u8]) {
    // usize -> u64 is lossless on every platform Rust supports.
    out.extend_from_slice(&(field.len() as u64).to_be_bytes());
    out.extend_from_slice(field);
}
