//! Approval rules (DESIGN.md section 7) as pure functions.
//!
//! The records here are what the store keeps (item kinds `approval`, `device`, `challenge`); the API loads them and
//! asks [`check_decision`] whether a decision may be accepted. The bytes the signature is checked over are computed
//! here from the approval's own record with `loams_proto::canonical_decision_bytes` (the proto crate owns that
//! encoding so phone and server cannot drift), never taken from a caller.
//! Nothing here performs I/O or reads a clock: `now_ms` is always passed in.

use aws_lc_rs::constant_time;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1, ParsedPublicKey, UnparsedPublicKey};
use loams_proto::approvals::v1::Decision;
use serde::{Deserialize, Serialize};

/// How long an approval stays decidable after it is created (72 h).
pub const APPROVAL_TTL_MS: i64 = 72 * 60 * 60 * 1000;

/// Length of an uncompressed X9.63 P-256 point (`0x04 || X || Y`), the only device key form accepted.
pub const P256_POINT_LEN: usize = 65;

/// The privileged call an approval is about; its SHA-256 over the canonical form is `Approval::action_hash`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ApprovalAction {
    pub agent: String,
    pub skill: String,
    pub args: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_commit: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    Pending,
    Approved,
    Denied,
    Expired,
}

impl ApprovalState {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalState::Pending => "pending",
            ApprovalState::Approved => "approved",
            ApprovalState::Denied => "denied",
            ApprovalState::Expired => "expired",
        }
    }
}

/// The proof stored with a decision, so anyone can re-verify later who decided and with which key.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DecisionProof {
    pub device_id: String,
    /// DER-encoded ECDSA P-256 SHA-256 signature over the canonical decision bytes.
    pub signature: Vec<u8>,
    pub challenge: Vec<u8>,
    /// The time the phone signed (part of the signed bytes).
    pub decided_at_ms: i64,
    /// The user owning the device.
    pub decided_by: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Approval {
    pub id: String,
    pub org: String,
    pub run_id: String,
    pub action: ApprovalAction,
    /// Hex SHA-256 of the canonical action (agent, skill, args, target commit).
    pub action_hash: String,
    /// Server-rendered summary; never the agent's free text alone.
    pub summary: String,
    /// `read`, `write` or `destructive`.
    pub risk: String,
    pub requester: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_behalf_of: Option<String>,
    /// Destructive actions require the approver to type this exact phrase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation_phrase: Option<String>,
    pub state: ApprovalState,
    pub expires_at_ms: i64,
    pub created_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecisionProof>,
}

impl Approval {
    /// The state a reader should see at `now_ms`: a pending approval past its expiry reads as expired even before
    /// anything rewrites the stored record.
    pub fn effective_state(&self, now_ms: i64) -> ApprovalState {
        if self.state == ApprovalState::Pending && now_ms >= self.expires_at_ms {
            ApprovalState::Expired
        } else {
            self.state
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub org: String,
    pub user: String,
    /// Uncompressed X9.63 P-256 point, 65 bytes (what the Secure Enclave / StrongBox export).
    pub public_key: Vec<u8>,
    pub name: String,
    pub revoked: bool,
    /// When it was revoked; `None` while active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at_ms: Option<i64>,
    /// APNs / FCM token for waking the user; never sent back to clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_token: Option<String>,
    pub created_at_ms: i64,
}

/// A single-use server nonce the phone must sign over; binds a decision to one approval, or a kill to one run (and
/// optionally to one device). Kill challenges are stored under their own item kind, so neither stands in for the
/// other.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub value: Vec<u8>,
    /// The approval id, or the run id of a kill.
    #[serde(alias = "approval_id")]
    pub subject: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    pub expires_at_ms: i64,
    pub used: bool,
}

/// What the phone sent: the fields it signed (the action hash it signed is the approval's own) plus the signature
/// and the typed confirmation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DecisionRequest {
    pub approval_id: String,
    pub approve: bool,
    pub device_id: String,
    pub challenge: Vec<u8>,
    pub decided_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<String>,
    pub signature: Vec<u8>,
}

/// What a phone sent to kill a run: the fields it signed plus the signature. Kept verbatim with the kill switch as
/// its proof, so the signature can be verified again later from the record alone.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct KillRequest {
    pub run_id: String,
    /// As signed (the switch may show a default for an empty one).
    pub reason: String,
    pub device_id: String,
    pub challenge: Vec<u8>,
    pub killed_at_ms: i64,
    pub signature: Vec<u8>,
}

/// Why a decision is refused. Each maps to one clear wire error in the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the signature does not verify with the device key")]
    BadSignature,
    #[error("the device is not registered for this organisation")]
    DeviceUnknown,
    #[error("the device has been revoked")]
    DeviceRevoked,
    #[error("the requester, or the user the agent acts for, cannot approve their own action")]
    SelfApproval,
    #[error("the approval or the challenge has expired")]
    Expired,
    #[error("the challenge has already been used")]
    ChallengeUsed,
    #[error("the challenge was not issued for this approval (or run) and device")]
    ChallengeMismatch,
    #[error("the typed confirmation does not match")]
    ConfirmationMismatch,
    #[error("the approval has already been decided")]
    AlreadyDecided,
    #[error("the action hash does not match the approval")]
    ActionHashMismatch,
}

fn same(a: &[u8], b: &[u8]) -> bool {
    constant_time::verify_slices_are_equal(a, b).is_ok()
}

/// The bytes a phone signs for `request` about `approval`: the approval's id and stored action hash (so a signature
/// is only ever good for the action the record says it allows), the decision, device, challenge and signing time.
pub fn decision_bytes(approval: &Approval, request: &DecisionRequest) -> Result<Vec<u8>, Refusal> {
    let hash = hex_decode(&approval.action_hash).ok_or(Refusal::ActionHashMismatch)?;
    let decision = if request.approve {
        Decision::Approve
    } else {
        Decision::Deny
    };
    Ok(loams_proto::canonical_decision_bytes(
        &approval.id,
        &hash,
        decision,
        &request.device_id,
        &request.challenge,
        request.decided_at_ms,
    ))
}

fn hex_decode(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
        })
        .collect()
}

/// Decides whether `request` may settle `approval`. The signature is verified over [`decision_bytes`], computed here.
/// Returns the first rule broken; on `Ok` the caller marks the challenge used and stores [`settle`]'s result.
pub fn check_decision(
    approval: &Approval,
    device: &Device,
    challenge: &Challenge,
    request: &DecisionRequest,
    now_ms: i64,
) -> Result<(), Refusal> {
    if approval.state != ApprovalState::Pending {
        return Err(if approval.state == ApprovalState::Expired {
            Refusal::Expired
        } else {
            Refusal::AlreadyDecided
        });
    }
    if now_ms >= approval.expires_at_ms {
        return Err(Refusal::Expired);
    }
    if device.org != approval.org || device.id != request.device_id {
        return Err(Refusal::DeviceUnknown);
    }
    if device.revoked {
        return Err(Refusal::DeviceRevoked);
    }
    // No one approves their own action, neither the requester nor the person the agent acts for.
    if device.user == approval.requester
        || approval.on_behalf_of.as_deref() == Some(device.user.as_str())
    {
        return Err(Refusal::SelfApproval);
    }
    if request.approval_id != approval.id {
        return Err(Refusal::ChallengeMismatch);
    }
    check_challenge(challenge, &approval.id, device, &request.challenge, now_ms)?;
    // The record must say what it will allow: a hash that does not match the shown action would let a person
    // approve one call while the broker releases another.
    if !same(
        crate::action_hash(&approval.action).as_bytes(),
        approval.action_hash.as_bytes(),
    ) {
        return Err(Refusal::ActionHashMismatch);
    }
    // A typed phrase guards approving a destructive action; refusing it must stay a single tap.
    if request.approve
        && let Some(phrase) = &approval.confirmation_phrase
        && request.confirmation.as_deref() != Some(phrase.as_str())
    {
        return Err(Refusal::ConfirmationMismatch);
    }
    verify_signature(
        &device.public_key,
        &decision_bytes(approval, request)?,
        &request.signature,
    )
}

/// The challenge presented is the unused, unexpired one issued for `subject` and `device`.
fn check_challenge(
    challenge: &Challenge,
    subject: &str,
    device: &Device,
    presented: &[u8],
    now_ms: i64,
) -> Result<(), Refusal> {
    if challenge.used {
        return Err(Refusal::ChallengeUsed);
    }
    let device_matches = challenge
        .device_id
        .as_deref()
        .is_none_or(|d| d == device.id);
    if challenge.subject != subject || !device_matches || !same(&challenge.value, presented) {
        return Err(Refusal::ChallengeMismatch);
    }
    if now_ms >= challenge.expires_at_ms {
        return Err(Refusal::Expired);
    }
    Ok(())
}

/// Decides whether `request` may kill its run: the step-up of DESIGN.md section 7 applied to a kill. The device is
/// the caller's own (the API looks it up by owner), unrevoked, and signed `loams_proto::canonical_kill_bytes` over the
/// unused, unexpired challenge issued for this run and this device. Unlike a decision, anyone with the right may stop
/// a run, the requester included.
pub fn check_kill(
    device: &Device,
    challenge: &Challenge,
    request: &KillRequest,
    now_ms: i64,
) -> Result<(), Refusal> {
    if device.id != request.device_id {
        return Err(Refusal::DeviceUnknown);
    }
    if device.revoked {
        return Err(Refusal::DeviceRevoked);
    }
    check_challenge(
        challenge,
        &request.run_id,
        device,
        &request.challenge,
        now_ms,
    )?;
    let bytes = loams_proto::canonical_kill_bytes(
        &request.run_id,
        &request.reason,
        &request.device_id,
        &request.challenge,
        request.killed_at_ms,
    );
    verify_signature(&device.public_key, &bytes, &request.signature)
}

/// ECDSA P-256 SHA-256 with a DER signature over `message`, against a 65-byte uncompressed point.
pub fn verify_signature(
    public_key: &[u8],
    message: &[u8],
    signature: &[u8],
) -> Result<(), Refusal> {
    if public_key.len() != P256_POINT_LEN || public_key.first() != Some(&0x04) {
        return Err(Refusal::BadSignature);
    }
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, public_key)
        .verify(message, signature)
        .map_err(|_| Refusal::BadSignature)
}

/// Checks that `public_key` is an uncompressed P-256 point on the curve, for device registration.
pub fn valid_device_key(public_key: &[u8]) -> bool {
    // aws-lc also parses SPKI DER; the length and prefix check pins the one form phones are told to send.
    public_key.len() == P256_POINT_LEN
        && public_key.first() == Some(&0x04)
        && ParsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, public_key).is_ok()
}

/// The approval after an accepted decision, with its proof. Call only after [`check_decision`] returned `Ok`.
pub fn settle(approval: &Approval, device: &Device, request: &DecisionRequest) -> Approval {
    let mut settled = approval.clone();
    settled.state = if request.approve {
        ApprovalState::Approved
    } else {
        ApprovalState::Denied
    };
    settled.decision = Some(DecisionProof {
        device_id: device.id.clone(),
        signature: request.signature.clone(),
        challenge: request.challenge.clone(),
        decided_at_ms: request.decided_at_ms,
        decided_by: device.user.clone(),
    });
    settled
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_lc_rs::rand::SystemRandom;
    use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};

    const NOW: i64 = 1_000_000;

    struct Fixture {
        approval: Approval,
        device: Device,
        challenge: Challenge,
        request: DecisionRequest,
        key: EcdsaKeyPair,
    }

    /// What a phone signs, computed the way the phones do (the proto crate's encoding over the shown approval).
    fn bytes(a: &Approval, r: &DecisionRequest) -> Vec<u8> {
        let hash: Vec<u8> = (0..a.action_hash.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&a.action_hash[i..i + 2], 16).unwrap())
            .collect();
        let d = if r.approve {
            Decision::Approve
        } else {
            Decision::Deny
        };
        loams_proto::canonical_decision_bytes(
            &a.id,
            &hash,
            d,
            &r.device_id,
            &r.challenge,
            r.decided_at_ms,
        )
    }

    fn key() -> EcdsaKeyPair {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref()).unwrap()
    }

    fn sign(key: &EcdsaKeyPair, a: &Approval, r: &mut DecisionRequest) {
        let sig = key.sign(&SystemRandom::new(), &bytes(a, r)).unwrap();
        r.signature = sig.as_ref().to_vec();
    }

    fn fixture() -> Fixture {
        let key = key();
        let action = ApprovalAction {
            agent: "forgejo".into(),
            skill: "merge".into(),
            args: serde_json::json!({"number": 7, "head_sha": "abc"}),
            target_commit: Some("abc".into()),
        };
        let approval = Approval {
            id: "ap-1".into(),
            org: "acme".into(),
            run_id: "r-0123456789abcdef".into(),
            action_hash: crate::action_hash(&action),
            action,
            summary: "Merge PR #7".into(),
            risk: "destructive".into(),
            requester: "agent:loams-bot".into(),
            on_behalf_of: Some("alice".into()),
            confirmation_phrase: Some("merge 7".into()),
            state: ApprovalState::Pending,
            expires_at_ms: NOW + APPROVAL_TTL_MS,
            created_at_ms: NOW - 10,
            decision: None,
        };
        let device = Device {
            id: "dev-1".into(),
            org: "acme".into(),
            user: "bob".into(),
            public_key: key.public_key().as_ref().to_vec(),
            name: "Bob's phone".into(),
            revoked: false,
            revoked_at_ms: None,
            push_token: None,
            created_at_ms: NOW - 100,
        };
        let challenge = Challenge {
            value: b"nonce-1".to_vec(),
            subject: "ap-1".into(),
            device_id: Some("dev-1".into()),
            expires_at_ms: NOW + 60_000,
            used: false,
        };
        let mut request = DecisionRequest {
            approval_id: "ap-1".into(),
            approve: true,
            device_id: "dev-1".into(),
            challenge: b"nonce-1".to_vec(),
            decided_at_ms: NOW,
            confirmation: Some("merge 7".into()),
            signature: vec![],
        };
        sign(&key, &approval, &mut request);
        Fixture {
            approval,
            device,
            challenge,
            request,
            key,
        }
    }

    fn check(f: &Fixture) -> Result<(), Refusal> {
        check_decision(&f.approval, &f.device, &f.challenge, &f.request, NOW)
    }

    #[test]
    fn valid_decision_is_accepted_and_settles_with_proof() {
        let f = fixture();
        assert_eq!(f.device.public_key.len(), P256_POINT_LEN);
        assert!(valid_device_key(&f.device.public_key));
        assert_eq!(check(&f), Ok(()));
        let settled = settle(&f.approval, &f.device, &f.request);
        assert_eq!(settled.state, ApprovalState::Approved);
        let proof = settled.decision.unwrap();
        assert_eq!(proof.decided_by, "bob");
        assert_eq!(proof.signature, f.request.signature);
    }

    #[test]
    fn deny_needs_no_confirmation() {
        let mut f = fixture();
        f.request.approve = false;
        f.request.confirmation = None;
        sign(&f.key, &f.approval, &mut f.request);
        assert_eq!(check(&f), Ok(()));
        assert_eq!(
            settle(&f.approval, &f.device, &f.request).state,
            ApprovalState::Denied
        );
    }

    #[test]
    fn bad_signature() {
        let mut f = fixture();
        // Signed bytes differ from the verified bytes: the phone signed "deny" but the request says approve.
        let mut other = f.request.clone();
        other.approve = false;
        sign(&f.key, &f.approval, &mut other);
        f.request.signature = other.signature;
        assert_eq!(check(&f), Err(Refusal::BadSignature));
        f.request.signature = vec![1, 2, 3];
        assert_eq!(check(&f), Err(Refusal::BadSignature));
        // A signature by another key.
        let mut g = fixture();
        sign(&key(), &g.approval, &mut g.request);
        assert_eq!(check(&g), Err(Refusal::BadSignature));
        // Signed for another action (the phone was shown a different hash) or another approval: the bytes are
        // computed from this record, so neither signature covers it.
        let mut h = fixture();
        let mut shown = h.approval.clone();
        shown.action_hash = "aa".repeat(32);
        sign(&h.key, &shown, &mut h.request);
        assert_eq!(check(&h), Err(Refusal::BadSignature));
        shown = h.approval.clone();
        shown.id = "ap-2".into();
        sign(&h.key, &shown, &mut h.request);
        assert_eq!(check(&h), Err(Refusal::BadSignature));
    }

    #[test]
    fn malformed_device_key_is_bad_signature() {
        let mut f = fixture();
        f.device.public_key.truncate(64);
        assert_eq!(check(&f), Err(Refusal::BadSignature));
        assert!(!valid_device_key(&f.device.public_key));
        assert!(!valid_device_key(&[0x04; 1]));
        // Right shape, not on the curve.
        let mut off_curve = vec![0x04];
        off_curve.extend([7u8; 64]);
        assert!(!valid_device_key(&off_curve));
    }

    #[test]
    fn device_unknown() {
        let mut f = fixture();
        f.device.org = "other".into();
        assert_eq!(check(&f), Err(Refusal::DeviceUnknown));
        let mut f = fixture();
        f.request.device_id = "dev-2".into();
        assert_eq!(check(&f), Err(Refusal::DeviceUnknown));
    }

    #[test]
    fn device_revoked() {
        let mut f = fixture();
        f.device.revoked = true;
        assert_eq!(check(&f), Err(Refusal::DeviceRevoked));
    }

    #[test]
    fn self_approval() {
        let mut f = fixture();
        f.device.user = "alice".into();
        assert_eq!(check(&f), Err(Refusal::SelfApproval));
        let mut f = fixture();
        f.device.user = "agent:loams-bot".into();
        assert_eq!(check(&f), Err(Refusal::SelfApproval));
    }

    #[test]
    fn expired() {
        let f = fixture();
        let late = f.approval.expires_at_ms;
        let mut c = f.challenge.clone();
        c.expires_at_ms = late + 1;
        assert_eq!(
            check_decision(&f.approval, &f.device, &c, &f.request, late),
            Err(Refusal::Expired)
        );
        assert_eq!(f.approval.effective_state(late), ApprovalState::Expired);
        assert_eq!(f.approval.effective_state(late - 1), ApprovalState::Pending);
        let mut f = fixture();
        f.approval.state = ApprovalState::Expired;
        assert_eq!(check(&f), Err(Refusal::Expired));
        // The challenge expires on its own, earlier.
        let mut f = fixture();
        f.challenge.expires_at_ms = NOW;
        assert_eq!(check(&f), Err(Refusal::Expired));
    }

    #[test]
    fn challenge_used() {
        let mut f = fixture();
        f.challenge.used = true;
        assert_eq!(check(&f), Err(Refusal::ChallengeUsed));
    }

    #[test]
    fn challenge_mismatch() {
        let mut f = fixture();
        f.request.challenge = b"nonce-2".to_vec();
        sign(&f.key, &f.approval, &mut f.request);
        assert_eq!(check(&f), Err(Refusal::ChallengeMismatch));
        let mut f = fixture();
        f.challenge.subject = "ap-2".into();
        assert_eq!(check(&f), Err(Refusal::ChallengeMismatch));
        let mut f = fixture();
        f.challenge.device_id = Some("dev-9".into());
        assert_eq!(check(&f), Err(Refusal::ChallengeMismatch));
        let mut f = fixture();
        f.challenge.device_id = None;
        assert_eq!(check(&f), Ok(()));
    }

    #[test]
    fn confirmation_mismatch() {
        let mut f = fixture();
        f.request.confirmation = Some("merge 8".into());
        assert_eq!(check(&f), Err(Refusal::ConfirmationMismatch));
        f.request.confirmation = None;
        assert_eq!(check(&f), Err(Refusal::ConfirmationMismatch));
        let mut f = fixture();
        f.approval.confirmation_phrase = None;
        f.request.confirmation = None;
        assert_eq!(check(&f), Ok(()));
    }

    #[test]
    fn already_decided() {
        for state in [ApprovalState::Approved, ApprovalState::Denied] {
            let mut f = fixture();
            f.approval.state = state;
            assert_eq!(check(&f), Err(Refusal::AlreadyDecided));
        }
    }

    #[test]
    fn action_hash_mismatch() {
        // The shown action was changed after hashing (say, a different PR number).
        let mut f = fixture();
        f.approval.action.args = serde_json::json!({"number": 8, "head_sha": "abc"});
        assert_eq!(check(&f), Err(Refusal::ActionHashMismatch));
        let mut f = fixture();
        f.approval.action_hash = "bb".repeat(32);
        assert_eq!(check(&f), Err(Refusal::ActionHashMismatch));
    }

    #[test]
    fn records_round_trip_as_json() {
        let f = fixture();
        let back: Approval =
            serde_json::from_slice(&serde_json::to_vec(&f.approval).unwrap()).unwrap();
        assert_eq!(back, f.approval);
        let json = serde_json::to_value(&f.approval).unwrap();
        assert_eq!(json["state"], "pending");
        let dev: Device = serde_json::from_slice(&serde_json::to_vec(&f.device).unwrap()).unwrap();
        assert_eq!(dev, f.device);
    }

    /// A kill of the fixture's run, signed by its device over a challenge issued for that run.
    fn signed_kill(f: &Fixture) -> (Challenge, KillRequest) {
        let challenge = Challenge {
            subject: f.approval.run_id.clone(),
            ..f.challenge.clone()
        };
        let mut request = KillRequest {
            run_id: f.approval.run_id.clone(),
            reason: "wrong fix".into(),
            device_id: f.device.id.clone(),
            challenge: challenge.value.clone(),
            killed_at_ms: NOW - 5,
            signature: Vec::new(),
        };
        sign_kill(&f.key, &mut request);
        (challenge, request)
    }

    fn sign_kill(key: &EcdsaKeyPair, r: &mut KillRequest) {
        let bytes = loams_proto::canonical_kill_bytes(
            &r.run_id,
            &r.reason,
            &r.device_id,
            &r.challenge,
            r.killed_at_ms,
        );
        r.signature = key
            .sign(&SystemRandom::new(), &bytes)
            .unwrap()
            .as_ref()
            .to_vec();
    }

    #[test]
    fn a_signed_kill_is_accepted_and_every_broken_rule_refused() {
        let f = fixture();
        let (challenge, request) = signed_kill(&f);
        assert_eq!(check_kill(&f.device, &challenge, &request, NOW), Ok(()));
        // The requester or the user the agent acts for may stop a run: only deciding is barred to them.
        let mut alice = f.device.clone();
        alice.user = "alice".into();
        assert_eq!(check_kill(&alice, &challenge, &request, NOW), Ok(()));

        let refused = |device: &Device, challenge: &Challenge, request: &KillRequest| {
            check_kill(device, challenge, request, NOW).unwrap_err()
        };
        let mut revoked = f.device.clone();
        revoked.revoked = true;
        assert_eq!(
            refused(&revoked, &challenge, &request),
            Refusal::DeviceRevoked
        );
        let mut other = request.clone();
        other.device_id = "dev-2".into();
        assert_eq!(
            refused(&f.device, &challenge, &other),
            Refusal::DeviceUnknown
        );
        let used = Challenge {
            used: true,
            ..challenge.clone()
        };
        assert_eq!(refused(&f.device, &used, &request), Refusal::ChallengeUsed);
        let expired = Challenge {
            expires_at_ms: NOW,
            ..challenge.clone()
        };
        assert_eq!(refused(&f.device, &expired, &request), Refusal::Expired);
        // A challenge issued for another run, or for an approval, does not kill this one.
        let elsewhere = Challenge {
            subject: "r-other".into(),
            ..challenge.clone()
        };
        assert_eq!(
            refused(&f.device, &elsewhere, &request),
            Refusal::ChallengeMismatch
        );
        assert_eq!(
            refused(&f.device, &f.challenge, &request),
            Refusal::ChallengeMismatch
        );
        let mut replayed = request.clone();
        replayed.challenge = b"nonce-2".to_vec();
        sign_kill(&f.key, &mut replayed);
        assert_eq!(
            refused(&f.device, &challenge, &replayed),
            Refusal::ChallengeMismatch
        );

        // The signature covers every field: a changed reason, time or run breaks it.
        let mut reworded = request.clone();
        reworded.reason = "no reason".into();
        assert_eq!(
            refused(&f.device, &challenge, &reworded),
            Refusal::BadSignature
        );
        let mut redated = request.clone();
        redated.killed_at_ms += 1;
        assert_eq!(
            refused(&f.device, &challenge, &redated),
            Refusal::BadSignature
        );
        let mut by_another_key = request.clone();
        sign_kill(&key(), &mut by_another_key);
        assert_eq!(
            refused(&f.device, &challenge, &by_another_key),
            Refusal::BadSignature
        );
        // An approval signature over the same challenge is not a kill signature.
        let mut decision = f.request.clone();
        decision.challenge = request.challenge.clone();
        sign(&f.key, &f.approval, &mut decision);
        let mut passed_off = request.clone();
        passed_off.signature = decision.signature;
        assert_eq!(
            refused(&f.device, &challenge, &passed_off),
            Refusal::BadSignature
        );
    }

    #[test]
    fn a_challenge_stored_before_subjects_still_reads() {
        let old = br#"{"value":[1,2],"approval_id":"ap-1","device_id":"dev-1","expires_at_ms":5,"used":false}"#;
        let read: Challenge = serde_json::from_slice(old).unwrap();
        assert_eq!(read.subject, "ap-1");
    }
}
