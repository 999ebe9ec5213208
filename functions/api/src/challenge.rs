//! Single-use challenges for signed steps (an approval decision, a run kill): issuing one to a device, finding it
//! again, and the window a signing time must fall in.
//!
//! A device holds at most one challenge per subject (its item id is derived from both): asking again returns the
//! same one while at least half its lifetime is left, else replaces it. Each kind of step keeps its challenges under
//! its own item kind, so a challenge for one can never be presented for the other.

use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use loams_factory::approval::{Challenge, Device, Refusal};
use loams_platform::{Cond, Item, StoreError};

use crate::approvals::{parse, to_body};
use crate::{ApiError, ApiState, Caller};

/// Item kind of the challenges of approval decisions.
pub(crate) const DECISION: &str = "challenge";
/// Item kind of the challenges of run kills.
pub(crate) const KILL: &str = "kill_challenge";

/// Bytes of randomness in a challenge.
const CHALLENGE_BYTES: usize = 32;
/// A DER P-256 signature is at most 72 bytes; anything much larger is not one.
const MAX_SIGNATURE: usize = 128;
/// Challenge items outlive their expiry by this much, so a late step is told "expired" rather than "unknown".
const CHALLENGE_KEEP_MS: i64 = 24 * 60 * 60 * 1000;
/// Clock difference tolerated between a phone's signing time and the server (phone clocks drift).
const MAX_CLOCK_SKEW_MS: i64 = 60 * 1000;

/// A challenge as handed to a device.
pub(crate) struct Issued {
    pub value: Vec<u8>,
    pub expires_at_ms: i64,
}

/// The id of the one challenge item of `device` for `subject`: a hash, so any subject and device ids fit.
fn challenge_id(subject: &str, device_id: &str) -> String {
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    // Length-prefixed, so no two (subject, device) pairs give the same bytes.
    ctx.update(&(subject.len() as u64).to_be_bytes());
    ctx.update(subject.as_bytes());
    ctx.update(device_id.as_bytes());
    hex::encode(ctx.finish().as_ref())
}

/// The caller's own device (revoked or not: each step says how it treats that); anyone else's reads as unknown.
pub(crate) async fn callers_device(
    state: &ApiState,
    caller: &Caller,
    id: &str,
) -> Result<Device, ApiError> {
    crate::factory::id_arg("device_id", id)?;
    let unknown = || ApiError::from(Refusal::DeviceUnknown);
    let item = state
        .store
        .get_item(&caller.org, "device", id)
        .await?
        .ok_or_else(unknown)?;
    let device: Device = parse(&item)?;
    if device.user != caller.user {
        return Err(unknown());
    }
    Ok(device)
}

/// The signature and challenge fields of a signed request have the sizes a real one has.
pub(crate) fn check_sizes(challenge: &[u8], signature: &[u8]) -> Result<(), ApiError> {
    if challenge.len() != CHALLENGE_BYTES {
        return Err(ApiError::InvalidArgument(format!(
            "challenge must be {CHALLENGE_BYTES} bytes"
        )));
    }
    if signature.is_empty() || signature.len() > MAX_SIGNATURE {
        return Err(ApiError::InvalidArgument(format!(
            "signature must be 1..={MAX_SIGNATURE} bytes"
        )));
    }
    Ok(())
}

/// Hands `device` a challenge of `kind` for `subject`: the current one while it is unused and has at least half its
/// life left, else a fresh one that replaces it.
pub(crate) async fn issue(
    state: &ApiState,
    caller: &Caller,
    kind: &str,
    subject: &str,
    device: &Device,
) -> Result<Issued, ApiError> {
    let id = challenge_id(subject, &device.id);
    let existing = state.store.get_item(&caller.org, kind, &id).await?;
    let now = state.now_ms();
    let ttl = state.config.challenge_ttl_ms;
    let reusable = |item: &Item| -> Result<Option<Issued>, ApiError> {
        let c: Challenge = parse(item)?;
        Ok(
            (!c.used && c.expires_at_ms - now >= ttl / 2).then_some(Issued {
                value: c.value,
                expires_at_ms: c.expires_at_ms,
            }),
        )
    };
    if let Some(item) = &existing
        && let Some(reused) = reusable(item)?
    {
        return Ok(reused);
    }

    let mut value = [0u8; CHALLENGE_BYTES];
    SystemRandom::new()
        .fill(&mut value)
        .map_err(|_| ApiError::Internal("random challenge".into()))?;
    let expires_at_ms = now + ttl;
    let record = Challenge {
        value: value.to_vec(),
        subject: subject.to_owned(),
        device_id: Some(device.id.clone()),
        expires_at_ms,
        used: false,
    };
    let item = Item {
        org: caller.org.clone(),
        kind: kind.to_owned(),
        id: id.clone(),
        version: 0,
        index: None,
        body: to_body(&record)?,
        expires_ms: Some(expires_at_ms + CHALLENGE_KEEP_MS),
    };
    // Replacing the old one (expired, or soon to be) keeps the count at one.
    let cond = existing
        .as_ref()
        .map_or(Cond::Absent, |old| Cond::Version(old.version));
    match state.store.put_item(&item, cond).await {
        Ok(_) => Ok(Issued {
            value: value.to_vec(),
            expires_at_ms,
        }),
        // A concurrent request of the same device wrote one first: that one is fresh, so it is the answer.
        Err(StoreError::Conflict) => {
            let raced = state.store.get_item(&caller.org, kind, &id).await?;
            match raced.as_ref().map(reusable).transpose()?.flatten() {
                Some(theirs) => Ok(theirs),
                None => Err(ApiError::Aborted(
                    "a concurrent request replaced the challenge; retry".into(),
                )),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// The stored challenge of `device` for `subject`, with its item (for the conditional write that uses it up).
/// None issued reads as a mismatch: the presented one was not issued for this subject and device.
pub(crate) async fn load(
    state: &ApiState,
    caller: &Caller,
    kind: &str,
    subject: &str,
    device_id: &str,
) -> Result<(Item, Challenge), ApiError> {
    let item = state
        .store
        .get_item(&caller.org, kind, &challenge_id(subject, device_id))
        .await?
        .ok_or(ApiError::from(Refusal::ChallengeMismatch))?;
    let challenge = parse(&item)?;
    Ok((item, challenge))
}

/// Marks `challenge` used, at the version read, once the step it was presented for is recorded. That record
/// already refuses a second step, so a failure here only leaves a challenge that can no longer be used: it is
/// logged, and the step stands.
pub(crate) async fn use_up(state: &ApiState, item: &Item, challenge: &Challenge) {
    if challenge.used {
        return;
    }
    let used = to_body(&Challenge {
        used: true,
        ..challenge.clone()
    });
    let written = match used {
        Ok(body) => state
            .store
            .put_item(
                &Item {
                    body,
                    ..item.clone()
                },
                Cond::Version(item.version),
            )
            .await
            .map(drop)
            .map_err(ApiError::from),
        Err(e) => Err(e),
    };
    if let Err(e) = written {
        tracing::warn!(error = %e, kind = %item.kind, subject = %challenge.subject, "marking a challenge used failed");
    }
}

/// The signed time must fall in the challenge's life: a signature cannot predate its challenge, and one dated well
/// past the server's clock is from a device whose clock is wrong.
pub(crate) fn check_signed_at(
    state: &ApiState,
    challenge: &Challenge,
    signed_at_ms: i64,
    field: &str,
) -> Result<(), ApiError> {
    let issued_at_ms = challenge.expires_at_ms - state.config.challenge_ttl_ms;
    if signed_at_ms < issued_at_ms - MAX_CLOCK_SKEW_MS
        || signed_at_ms > challenge.expires_at_ms.min(state.now_ms()) + MAX_CLOCK_SKEW_MS
    {
        return Err(ApiError::FailedPrecondition(format!(
            "{field} is outside the challenge's validity window (check the device clock)"
        )));
    }
    Ok(())
}
