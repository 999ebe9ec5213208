//! Test vectors of the canonical bytes a device signs. The expected bytes were computed independently (Python `struct`),
//! so a change of the encoding shows up here and must be a new domain version, not a silent change.

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{self, EcdsaKeyPair, KeyPair, UnparsedPublicKey};
use loams_proto::approvals::v1::Decision;
use loams_proto::{
    DECISION_DOMAIN, KILL_DOMAIN, canonical_decision_bytes, canonical_kill_bytes, is_plain_text,
};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn vector_approve() {
    let action_hash: Vec<u8> = (0u8..32).collect();
    let bytes = canonical_decision_bytes(
        "ap-1",
        &action_hash,
        Decision::Approve,
        "dev-A",
        &[0xde, 0xad, 0xbe, 0xef],
        1_767_225_600_000,
    );
    let expected = hex(concat!(
        "6c6f616d732e617070726f76616c2e6465636973696f6e2e763100", // "loams.approval.decision.v1\0"
        "0000000000000004",
        "61702d31", // approval_id
        "0000000000000020",
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f", // action_hash
        "00000001",                                                         // decision APPROVE
        "0000000000000005",
        "6465762d41", // device_id
        "0000000000000004",
        "deadbeef",         // challenge
        "0000019b76daa800", // decided_at_ms
    ));
    assert_eq!(bytes, expected);
}

#[test]
fn vector_deny_with_empty_fields() {
    let bytes = canonical_decision_bytes("", &[], Decision::Deny, "", &[], -1);
    let expected = hex(concat!(
        "6c6f616d732e617070726f76616c2e6465636973696f6e2e763100",
        "0000000000000000",
        "0000000000000000",
        "00000002",
        "0000000000000000",
        "0000000000000000",
        "ffffffffffffffff",
    ));
    assert_eq!(bytes, expected);
    assert!(bytes.starts_with(DECISION_DOMAIN));
}

#[test]
fn moving_bytes_between_fields_changes_the_encoding() {
    let a = canonical_decision_bytes("ap-1", b"h", Decision::Approve, "dev", b"c", 1);
    let b = canonical_decision_bytes("ap-", b"1h", Decision::Approve, "dev", b"c", 1);
    let c = canonical_decision_bytes("ap-1", b"h", Decision::Approve, "de", b"vc", 1);
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_ne!(
        a,
        canonical_decision_bytes("ap-1", b"h", Decision::Deny, "dev", b"c", 1)
    );
}

#[test]
fn device_signature_over_the_bytes_verifies_with_the_x963_point() {
    let rng = SystemRandom::new();
    let pkcs8 =
        EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
    let key = EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref())
        .unwrap();
    let public = key.public_key().as_ref().to_vec();
    assert_eq!(public.len(), 65, "X9.63 uncompressed point");

    let msg = canonical_decision_bytes(
        "ap-1",
        &[7; 32],
        Decision::Approve,
        "dev-A",
        b"challenge",
        42,
    );
    let der = key.sign(&rng, &msg).unwrap();
    let verifier = UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, &public);
    assert!(verifier.verify(&msg, der.as_ref()).is_ok());

    let denied =
        canonical_decision_bytes("ap-1", &[7; 32], Decision::Deny, "dev-A", b"challenge", 42);
    assert!(
        verifier.verify(&denied, der.as_ref()).is_err(),
        "a signature for APPROVE must not pass as DENY"
    );
}

#[test]
fn vector_kill() {
    let bytes = canonical_kill_bytes(
        "run-7",
        "wrong fix",
        "dev-A",
        &[0xde, 0xad, 0xbe, 0xef],
        1_767_225_600_000,
    );
    let expected = hex(concat!(
        "6c6f616d732e666163746f72792e6b696c6c2e763100", // "loams.factory.kill.v1\0"
        "0000000000000005",
        "72756e2d37", // run_id
        "0000000000000009",
        "77726f6e6720666978", // reason
        "0000000000000005",
        "6465762d41", // device_id
        "0000000000000004",
        "deadbeef",         // challenge
        "0000019b76daa800", // killed_at_ms
    ));
    assert_eq!(bytes, expected);
    assert!(bytes.starts_with(KILL_DOMAIN));
}

#[test]
fn a_kill_differs_from_a_decision_over_the_same_fields() {
    // Same field values in the same order: only the domain keeps one message from passing as the other.
    let kill = canonical_kill_bytes("ap-1", "", "dev", b"c", 1);
    let decision = canonical_decision_bytes("ap-1", b"", Decision::Approve, "dev", b"c", 1);
    assert_ne!(kill, decision);
    assert_ne!(
        canonical_kill_bytes("run-", "1reason", "dev", b"c", 1),
        canonical_kill_bytes("run-1", "reason", "dev", b"c", 1)
    );
}

#[test]
fn plain_text_has_nothing_that_shows_differently() {
    for plain in [
        "",
        "wrong fix",
        "falscher Fix: Überlauf",
        "修正が間違っている",
        "stop 🙅",
    ] {
        assert!(is_plain_text(plain), "{plain:?}");
    }
    for hidden in [
        "stop\u{1b}[2J",
        "line\nbreak",
        "tab\t",
        "stop \u{202E}dnuof",
        "st\u{200B}op",
        "\u{2066}isolated\u{2069}",
        "word\u{2060}joiner",
        "\u{061C}arabic mark",
        "\u{FEFF}bom",
        "\u{7f}del",
        "line\u{2028}separator",
        "soft\u{00AD}hyphen",
        "tag\u{E0041}",
        "variation\u{FE0F}",
        "\u{3164}filler",
        "num\u{110CD}",
        "st\u{180B}op",
        "\u{17B4}vowel",
    ] {
        assert!(!is_plain_text(hidden), "{hidden:?}");
    }
}

#[test]
fn every_format_separator_and_default_ignorable_character_is_refused() {
    // The Unicode properties the rule stands for, from regex's own Unicode tables.
    let hidden =
        regex::Regex::new(r"^[\p{Cf}\p{Zl}\p{Zp}\p{Default_Ignorable_Code_Point}]$").unwrap();
    let missed: Vec<String> = (0..=0x10FFFF_u32)
        .filter_map(char::from_u32)
        .filter(|c| hidden.is_match(c.encode_utf8(&mut [0; 4])))
        .filter(|c| is_plain_text(&c.to_string()))
        .map(|c| format!("U+{:04X}", c as u32))
        .collect();
    assert!(missed.is_empty(), "let through: {missed:?}");
}
