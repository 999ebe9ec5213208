//! Approvals: the pending list (cached), the server-rendered approval, and a decision signed with the device key
//! over the canonical decision bytes of `loams-proto`.

use std::sync::Arc;

use loams_proto::approvals::v1 as pa;

use crate::client::{Inner, TaskHandle, check_id, idempotency_key, now_ms};
use crate::error::{Error, Result};
use crate::types::{Approval, ApprovalState, Decision, Device};

const SERVICE: &str = "/loams.approvals.v1.ApprovalService/";
const LIST_PAGE: u32 = 100;
const LIST_PAGES: usize = 10;
/// Cached approvals still shown as pending but no longer listed are re-read one by one, at most this many per
/// refresh (they were decided elsewhere or expired).
const RECHECK: usize = 50;
const MAX_CONFIRMATION: usize = 256;

/// What a pending-approvals watch delivers: the cached list first, then changes as the server confirms them.
// Plain owned records cross the FFI as they are; an update is delivered rarely, so its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum ApprovalUpdate {
    /// The cached pending approvals, delivered before `watch_pending` returns.
    Snapshot {
        approvals: Vec<Approval>,
    },
    /// A pending approval new to the list.
    Added {
        approval: Approval,
    },
    /// An approval that is no longer pending (decided here or elsewhere, expired, or gone).
    Removed {
        approval_id: String,
    },
    Connection {
        connected: bool,
        detail: String,
    },
}

pub trait ApprovalListener: Send + Sync {
    fn on_update(&self, update: ApprovalUpdate);
}

pub struct Approvals {
    inner: Arc<Inner>,
}

impl Approvals {
    pub(crate) fn new(inner: Arc<Inner>) -> Approvals {
        Approvals { inner }
    }

    /// Pending approvals as last confirmed (works offline; `confirmed_at_ms` says how fresh).
    pub fn cached_pending(&self, limit: u32) -> Result<Vec<Approval>> {
        self.inner
            .cache
            .approvals(Some(ApprovalState::Pending), limit)
    }

    pub fn cached(&self, approval_id: &str) -> Result<Option<Approval>> {
        self.inner.cache.approval(approval_id)
    }

    /// Reads the pending approvals from the server into the cache and returns them.
    pub async fn refresh_pending(&self) -> Result<Vec<Approval>> {
        let mut listed = Vec::new();
        let mut token = String::new();
        for _ in 0..LIST_PAGES {
            let req = pa::ListApprovalsRequest {
                page_size: LIST_PAGE,
                page_token: token,
                state: pa::ApprovalState::Pending as i32,
            };
            let resp: pa::ListApprovalsResponse = self
                .inner
                .unary(&format!("{SERVICE}ListApprovals"), &req)
                .await?;
            self.inner.cache.put_approvals(&resp.approvals, now_ms())?;
            listed.extend(resp.approvals.into_iter().map(|a| a.id));
            if resp.next_page_token.is_empty() {
                break;
            }
            token = resp.next_page_token;
        }
        let stale: Vec<String> = self
            .inner
            .cache
            .approvals(Some(ApprovalState::Pending), u32::MAX)?
            .into_iter()
            .map(|a| a.id)
            .filter(|id| !listed.contains(id))
            .take(RECHECK)
            .collect();
        for id in stale {
            match self.get(&id).await {
                Ok(_) => {}
                // Gone on the server (or never visible to this user): it must not linger as pending here.
                Err(Error::NotFound(_)) => self.inner.cache.delete_approval(&id)?,
                Err(e) => return Err(e),
            }
        }
        self.cached_pending(u32::try_from(listed.len()).unwrap_or(u32::MAX))
    }

    /// Delivers the cached pending approvals before returning, then what is added and removed, refreshing every
    /// `poll_interval` (the API has no approvals stream; a push from the server is the prompt to look sooner, by
    /// calling `refresh_pending`). Runs until cancelled.
    pub async fn watch_pending(&self, listener: Arc<dyn ApprovalListener>) -> Result<TaskHandle> {
        let cached = self.cached_pending(u32::MAX)?;
        let mut shown: Vec<String> = cached.iter().map(|a| a.id.clone()).collect();
        listener.on_update(ApprovalUpdate::Snapshot { approvals: cached });
        let this = Approvals {
            inner: self.inner.clone(),
        };
        // Never ends by itself: nothing to mark.
        Ok(TaskHandle::spawn(|_| async move {
            let mut connected: Option<bool> = None;
            loop {
                let result = if this.inner.network_available() {
                    this.refresh_pending().await
                } else {
                    Err(Error::Offline("no network connection".into()))
                };
                let ok = result.is_ok();
                match result {
                    Ok(pending) => {
                        if connected != Some(true) {
                            listener.on_update(ApprovalUpdate::Connection {
                                connected: true,
                                detail: "polling".into(),
                            });
                        }
                        for gone in shown
                            .iter()
                            .filter(|id| !pending.iter().any(|a| &&a.id == id))
                        {
                            listener.on_update(ApprovalUpdate::Removed {
                                approval_id: gone.clone(),
                            });
                        }
                        for new in pending.iter().filter(|a| !shown.contains(&a.id)) {
                            listener.on_update(ApprovalUpdate::Added {
                                approval: new.clone(),
                            });
                        }
                        shown = pending.into_iter().map(|a| a.id).collect();
                    }
                    Err(e) if connected != Some(false) => {
                        listener.on_update(ApprovalUpdate::Connection {
                            connected: false,
                            detail: e.to_string(),
                        });
                    }
                    Err(_) => {}
                }
                connected = Some(ok);
                let pause = if ok {
                    this.inner.config.poll_interval
                } else {
                    this.inner.config.reconnect_delay
                };
                tokio::time::sleep(pause).await;
            }
        }))
    }

    /// The approval as the server renders it now (summary, risk, confirmation phrase), cached.
    pub async fn get(&self, approval_id: &str) -> Result<Approval> {
        check_id("approval_id", approval_id)?;
        let approval = self.fetch(approval_id).await?;
        Ok(Approval::from_proto(approval, now_ms()))
    }

    async fn fetch(&self, approval_id: &str) -> Result<pa::Approval> {
        let req = pa::GetApprovalRequest {
            approval_id: approval_id.to_owned(),
        };
        let resp: pa::GetApprovalResponse = self
            .inner
            .unary(&format!("{SERVICE}GetApproval"), &req)
            .await?;
        let approval = resp
            .approval
            .ok_or_else(|| Error::Server("GetApproval returned no approval".into()))?;
        if approval.id != approval_id {
            return Err(Error::Server(format!(
                "asked for approval {approval_id}, got {}",
                approval.id
            )));
        }
        self.inner
            .cache
            .put_approvals(std::slice::from_ref(&approval), now_ms())?;
        Ok(approval)
    }

    /// Decides an approval with this device's key, reading it from the server first and then deciding it as
    /// [`Approvals::decide_shown`] does. Nothing is queued: offline, it fails at once and the cache is unchanged.
    pub async fn decide(
        &self,
        approval_id: &str,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> Result<Approval> {
        check_id("approval_id", approval_id)?;
        // What needs no server is refused before any request: an oversized phrase, a phone without a device key.
        check_confirmation(&typed_confirmation)?;
        let device = self.inner.signing_device()?;
        let approval = Approval::from_proto(self.fetch(approval_id).await?, now_ms());
        self.decide_as(device, &approval, decision, typed_confirmation)
            .await
    }

    /// Decides `shown`, a copy of the approval as the person saw it (from the server, a watch or the cache), without
    /// reading it again:
    /// - the phone signs the copy's action hash only after checking that the copy's action (agent, skill, arguments,
    ///   target commit) hashes to it, so the signature covers exactly those fields as shown; the summary and the
    ///   risk are the server's rendering, shown as sent and not signed;
    /// - the server verifies the signature over its own record's hash, so a copy of another action is refused, and
    ///   it checks state, expiry, the single-use challenge and the typed phrase again.
    ///
    /// The local checks of state, expiry and phrase only spare a challenge and say sooner what is wrong.
    pub async fn decide_shown(
        &self,
        shown: &Approval,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> Result<Approval> {
        check_id("approval_id", &shown.id)?;
        check_confirmation(&typed_confirmation)?;
        let device = self.inner.signing_device()?;
        self.decide_as(device, shown, decision, typed_confirmation)
            .await
    }

    /// The decision itself, by `device`, once the caller has checked the phrase's size.
    async fn decide_as(
        &self,
        device: Device,
        shown: &Approval,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> Result<Approval> {
        let typed = typed_confirmation.unwrap_or_default();
        if shown.state != ApprovalState::Pending || shown.expires_at_ms <= now_ms() {
            return Err(Error::Rejected(format!(
                "the approval is no longer pending ({:?}, expires at {} ms)",
                shown.state, shown.expires_at_ms
            )));
        }
        check_action_hash(shown)?;
        // The server checks this too; checking first spares a challenge and tells the person what to type.
        if decision == Decision::Approve
            && let Some(phrase) = &shown.confirmation_phrase
            && typed != *phrase
        {
            return Err(Error::ConfirmationMismatch {
                phrase: phrase.clone(),
            });
        }

        let approval_id = shown.id.as_str();
        let req = pa::GetChallengeRequest {
            approval_id: approval_id.to_owned(),
            device_id: device.device_id.clone(),
        };
        let challenge: pa::GetChallengeResponse = self
            .inner
            .unary(&format!("{SERVICE}GetChallenge"), &req)
            .await?;
        let decided_at_ms = now_ms();
        let bytes = loams_proto::canonical_decision_bytes(
            approval_id,
            &shown.action_hash,
            decision.to_proto(),
            &device.device_id,
            &challenge.challenge,
            decided_at_ms,
        );
        let signature = self
            .inner
            .sign_step(&device, &challenge.challenge, bytes)
            .await?;

        let req = pa::DecideRequest {
            approval_id: approval_id.to_owned(),
            decision: decision.to_proto() as i32,
            device_id: device.device_id,
            challenge: challenge.challenge,
            decided_at_ms,
            signature,
            typed_confirmation: typed,
            idempotency_key: idempotency_key("decide")?,
        };
        let resp: pa::DecideResponse = self.inner.unary(&format!("{SERVICE}Decide"), &req).await?;
        let decided = resp
            .approval
            .ok_or_else(|| Error::Server("Decide returned no approval".into()))?;
        if decided.id != shown.id {
            return Err(Error::Server(format!(
                "decided approval {}, got {}",
                shown.id, decided.id
            )));
        }
        let at = now_ms();
        self.inner
            .cache
            .put_approvals(std::slice::from_ref(&decided), at)?;
        Ok(Approval::from_proto(decided, at))
    }
}

fn check_confirmation(typed: &Option<String>) -> Result<()> {
    if typed.as_ref().is_some_and(|t| t.len() > MAX_CONFIRMATION) {
        return Err(Error::InvalidInput(format!(
            "the confirmation is longer than {MAX_CONFIRMATION} bytes"
        )));
    }
    Ok(())
}

/// The action hash is SHA-256 over the canonical action (`loams_proto::canonical_action`): a copy whose action does
/// not hash to it (rewritten in the cache, or sent so by a server) shows one thing and would sign another, so it is
/// not signed. The server sends the arguments as `loams_proto::canonical_json` text, and no target commit as an
/// empty string.
fn check_action_hash(shown: &Approval) -> Result<()> {
    let args: serde_json::Value = serde_json::from_str(&shown.args_json)
        .map_err(|_| Error::Server("the approval's arguments are not JSON".into()))?;
    // Only the canonical text: any other (a duplicate key, spare digits, escapes) could read one way and hash another.
    if loams_proto::canonical_json(&args) != shown.args_json {
        return Err(Error::Server(
            "the approval's arguments are not in canonical form: they were not signed".into(),
        ));
    }
    let target_commit = (!shown.target_commit.is_empty()).then_some(shown.target_commit.as_str());
    let canonical = loams_proto::canonical_action(&shown.agent, &shown.skill, &args, target_commit);
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, canonical.as_bytes());
    if digest.as_ref() != shown.action_hash.as_slice() {
        return Err(Error::Server(
            "the approval's action does not match its action hash: it was not signed".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(args: &serde_json::Value, target_commit: Option<&str>) -> Approval {
        let canonical = loams_proto::canonical_action("forgejo", "merge", args, target_commit);
        Approval {
            id: "ap-1".into(),
            run_id: "r-1".into(),
            agent: "forgejo".into(),
            skill: "merge".into(),
            // As the server sends it.
            args_json: loams_proto::canonical_json(args),
            target_commit: target_commit.unwrap_or_default().into(),
            action_hash: aws_lc_rs::digest::digest(
                &aws_lc_rs::digest::SHA256,
                canonical.as_bytes(),
            )
            .as_ref()
            .to_vec(),
            summary: String::new(),
            risk: crate::types::Risk::Destructive,
            requester: String::new(),
            on_behalf_of: String::new(),
            confirmation_phrase: None,
            state: ApprovalState::Pending,
            expires_at_ms: i64::MAX,
            created_at_ms: 0,
            decided_by: String::new(),
            decision: None,
            confirmed_at_ms: 0,
        }
    }

    #[test]
    fn the_shown_action_must_hash_to_the_shown_hash() {
        let args = serde_json::json!({"number": 7, "head_sha": "abc", "note": "caf\u{e9}"});
        assert_eq!(check_action_hash(&shown(&args, Some("abc"))), Ok(()));
        assert_eq!(check_action_hash(&shown(&args, None)), Ok(()));
        let mut other = shown(&args, Some("abc"));
        other.args_json = r#"{"head_sha":"abc","note":"café","number":8}"#.into();
        assert!(
            matches!(&check_action_hash(&other), Err(Error::Server(m)) if m.contains("does not match its action hash"))
        );
        other = shown(&args, Some("abc"));
        other.target_commit = "def".into();
        assert!(matches!(check_action_hash(&other), Err(Error::Server(_))));
        other = shown(&args, Some("abc"));
        other.args_json = "not json".into();
        assert!(matches!(check_action_hash(&other), Err(Error::Server(_))));
        // The same value in another text: a duplicate key (the last one wins when parsed), spare digits, escapes.
        for text in [
            r#"{"head_sha":"abc","note":"café","number":1,"number":7}"#,
            r#"{"head_sha":"abc","note":"café","number":7.0}"#,
            r#"{"head_sha":"abc","note":"caf\u00e9","number":7}"#,
            r#"{ "head_sha":"abc","note":"café","number":7}"#,
        ] {
            other = shown(&args, Some("abc"));
            other.args_json = text.into();
            assert!(
                matches!(check_action_hash(&other), Err(Error::Server(_))),
                "{text}"
            );
        }
    }
}
