//! Deterministic identifiers (docs/contracts.md, "Identifiers") and the approval action hash.

use aws_lc_rs::digest;

use crate::approval::ApprovalAction;

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let d = digest::digest(&digest::SHA256, bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The id of the first run a fingerprint ever gets: `r-` + the first 16 hex characters of
/// SHA-256(`org \n fingerprint \n generation`).
pub fn run_id(org: &str, fingerprint: &str, generation: u32) -> String {
    run_id_after(org, fingerprint, generation, None)
}

/// The id of a run that follows `after`: its parent for a follow-up generation, or the fingerprint's previous run
/// for a new lineage. `\n after` joins the hashed text, so each lineage and each generation of it gets its own id
/// while two workers opening the same lineage at once still derive the same one (create-if-absent keeps one).
pub fn run_id_after(org: &str, fingerprint: &str, generation: u32, after: Option<&str>) -> String {
    let mut text = format!("{org}\n{fingerprint}\n{generation}");
    if let Some(after) = after {
        text.push('\n');
        text.push_str(after);
    }
    let h = sha256_hex(text.as_bytes());
    format!("r-{}", &h[..16])
}

/// `r-` and 16 lowercase hex digits: the only shape of a run id.
pub(crate) fn valid_run_id(id: &str) -> bool {
    id.strip_prefix("r-").is_some_and(|h| {
        h.len() == 16
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// `<run>:<stage>:<attempt>:<action>`, the A2A messageId and idempotency key of one effect.
pub fn step_id(run: &str, stage: &str, attempt: u32, action: &str) -> String {
    format!("{run}:{stage}:{attempt}:{action}")
}

/// Hex SHA-256 over the canonical JSON of the action (`loams_proto::canonical_action`).
pub fn action_hash(action: &ApprovalAction) -> String {
    let text = loams_proto::canonical_action(
        &action.agent,
        &action.skill,
        &action.args,
        action.target_commit.as_deref(),
    );
    sha256_hex(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn run_id_is_derived_from_org_fingerprint_generation() {
        let a = run_id("acme", "fp-1", 1);
        assert_eq!(a.len(), 18);
        assert!(a.starts_with("r-"));
        assert_eq!(a, run_id("acme", "fp-1", 1));
        assert_ne!(a, run_id("acme", "fp-1", 2));
        assert_ne!(a, run_id("other", "fp-1", 1));
        assert_eq!(&a[2..], &sha256_hex(b"acme\nfp-1\n1")[..16]);
        let b = run_id_after("acme", "fp-1", 1, Some(&a));
        assert_eq!(
            &b[2..],
            &sha256_hex(format!("acme\nfp-1\n1\n{a}").as_bytes())[..16]
        );
        assert_ne!(b, a);
        assert_ne!(run_id_after("acme", "fp-1", 1, Some(&b)), b);
        assert!(valid_run_id(&a) && valid_run_id(&b));
        assert!(
            !valid_run_id("r-0123")
                && !valid_run_id("r-0123456789ABCDEF")
                && !valid_run_id("x-0123456789abcdef")
        );
    }

    #[test]
    fn step_id_shape() {
        assert_eq!(
            step_id("r-0123456789abcdef", "fix", 2, "open_pr"),
            "r-0123456789abcdef:fix:2:open_pr"
        );
    }

    #[test]
    fn action_hash_ignores_key_order_but_not_values() {
        let a = ApprovalAction {
            agent: "forgejo".into(),
            skill: "merge".into(),
            args: json!({"number": 7, "head_sha": "abc"}),
            target_commit: Some("abc".into()),
        };
        let mut b = a.clone();
        b.args = serde_json::from_str(r#"{"head_sha":"abc","number":7}"#).unwrap();
        assert_eq!(action_hash(&a), action_hash(&b));
        b.args = json!({"number": 8, "head_sha": "abc"});
        assert_ne!(action_hash(&a), action_hash(&b));
        let mut c = a.clone();
        c.target_commit = Some("def".into());
        assert_ne!(action_hash(&a), action_hash(&c));
    }
}
