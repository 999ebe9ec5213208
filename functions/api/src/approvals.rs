//! ApprovalService: list and read approvals, hand out single-use challenges, and accept signed decisions.
//!
//! A decision changes state only after `loams_factory::approval::check_decision` accepted it, and in this order:
//! the approval is settled (conditional on the version read, so of two concurrent decisions only one passes and
//! the other changes nothing), its challenge is marked used, and the run is told through the queue. A refusal, or a
//! decision that loses a race, writes nothing: the challenge stays usable for a corrected retry.
//!
//! Challenges are handed out and found by [`crate::challenge`].

use loams_factory::Input;
use loams_factory::approval::{self, Approval, ApprovalState, DecisionRequest, Refusal};
use loams_platform::{Cond, Item, Page, StoreError};
use loams_proto::approvals::v1 as pa;
use loams_proto::connect::{CallContext, Router};

use crate::challenge::{self, callers_device};
use crate::factory::{enqueue, id_arg, page_size, page_token};
use crate::{ApiError, ApiState, Caller, convert, idem, scope};

const SERVICE: &str = "/loams.approvals.v1.ApprovalService/";
const MAX_CONFIRMATION: usize = 256;

pub(crate) fn parse<T: serde::de::DeserializeOwned>(item: &Item) -> Result<T, ApiError> {
    serde_json::from_slice(&item.body).map_err(|e| {
        ApiError::Internal(format!(
            "stored {} {} is malformed: {e}",
            item.kind, item.id
        ))
    })
}

pub(crate) fn to_body<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(value).map_err(|e| ApiError::Internal(format!("encoding record: {e}")))
}

async fn load_approval(
    state: &ApiState,
    caller: &Caller,
    id: &str,
) -> Result<(Item, Approval), ApiError> {
    id_arg("approval_id", id)?;
    let item = state
        .store
        .get_item(&caller.org, "approval", id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("approval {id} not found")))?;
    let approval: Approval = parse(&item)?;
    Ok((item, approval))
}

async fn list(
    state: &ApiState,
    caller: &Caller,
    req: pa::ListApprovalsRequest,
) -> Result<pa::ListApprovalsResponse, ApiError> {
    let wanted = pa::ApprovalState::try_from(req.state)
        .map_err(|_| ApiError::InvalidArgument(format!("unknown approval state {}", req.state)))?;
    // Pending approvals have their own index; other states are filtered from the full list.
    let index = (wanted == pa::ApprovalState::Pending).then_some("pending");
    let page = Page {
        cursor: page_token(&req.page_token)?,
        limit: page_size(req.page_size),
    };
    let paged = state
        .store
        .list_items(&caller.org, "approval", index, page)
        .await?;
    let now = state.now_ms();
    let mut approvals = Vec::with_capacity(paged.items.len());
    for item in &paged.items {
        let a: Approval = parse(item)?;
        let shown = convert::approval(&a, now);
        // The index still lists a pending approval whose time ran out; it reads as expired, so it is left out.
        if wanted == pa::ApprovalState::Unspecified || shown.state == wanted as i32 {
            approvals.push(shown);
        }
    }
    Ok(pa::ListApprovalsResponse {
        approvals,
        next_page_token: paged.next.unwrap_or_default(),
    })
}

async fn challenge(
    state: &ApiState,
    caller: &Caller,
    req: pa::GetChallengeRequest,
) -> Result<pa::GetChallengeResponse, ApiError> {
    let (_, approval) = load_approval(state, caller, &req.approval_id).await?;
    let device = callers_device(state, caller, &req.device_id).await?;
    if device.revoked {
        return Err(Refusal::DeviceRevoked.into());
    }
    let now = state.now_ms();
    if approval.effective_state(now) != ApprovalState::Pending {
        return Err(ApiError::FailedPrecondition(format!(
            "approval is {}",
            approval.effective_state(now).as_str()
        )));
    }
    let issued =
        challenge::issue(state, caller, challenge::DECISION, &approval.id, &device).await?;
    Ok(pa::GetChallengeResponse {
        challenge: issued.value,
        expires_at_ms: issued.expires_at_ms,
    })
}

fn validate_decide(req: &pa::DecideRequest) -> Result<bool, ApiError> {
    let approve = match pa::Decision::try_from(req.decision) {
        Ok(pa::Decision::Approve) => true,
        Ok(pa::Decision::Deny) => false,
        _ => {
            return Err(ApiError::InvalidArgument(
                "decision must be APPROVE or DENY".into(),
            ));
        }
    };
    challenge::check_sizes(&req.challenge, &req.signature)?;
    if req.typed_confirmation.len() > MAX_CONFIRMATION {
        return Err(ApiError::InvalidArgument(format!(
            "typed_confirmation is longer than {MAX_CONFIRMATION} bytes"
        )));
    }
    Ok(approve)
}

/// Wakes the run an approval gates. The message carries no decision: the worker reads the stored, signed one, so a
/// message on the queue can never stand in for it.
async fn wake_run(state: &ApiState, caller: &Caller, a: &Approval) -> Result<(), ApiError> {
    enqueue(state, &caller.org, &a.run_id, Input::Continue).await
}

/// Why a decision's conditional write lost: the approval was settled (or ran out) meanwhile, or something else
/// changed it and the same decision may simply be sent again.
async fn lost_race(state: &ApiState, caller: &Caller, approval_id: &str) -> ApiError {
    match load_approval(state, caller, approval_id).await {
        Ok((_, current)) => match current.effective_state(state.now_ms()) {
            ApprovalState::Pending => ApiError::Aborted(
                "the approval changed meanwhile; nothing was decided, retry".into(),
            ),
            ApprovalState::Expired => Refusal::Expired.into(),
            ApprovalState::Approved | ApprovalState::Denied => Refusal::AlreadyDecided.into(),
        },
        Err(e) => e,
    }
}

async fn decide(
    state: &ApiState,
    caller: &Caller,
    req: pa::DecideRequest,
) -> Result<pa::DecideResponse, ApiError> {
    let approve = validate_decide(&req)?;
    id_arg("approval_id", &req.approval_id)?;
    idem::once(state, caller, "Decide", &req.idempotency_key, || async {
        let now = state.now_ms();
        let (approval_item, approval) = load_approval(state, caller, &req.approval_id).await?;
        let device = callers_device(state, caller, &req.device_id).await?;

        // A decision already recorded from this very request (same device, challenge and signature) means an
        // earlier attempt stopped after settling: wake the run again (it reads the decision once) and answer.
        if let Some(proof) = &approval.decision
            && proof.device_id == device.id
            && proof.challenge == req.challenge
            && proof.signature == req.signature
        {
            wake_run(state, caller, &approval).await?;
            return Ok(pa::DecideResponse { approval: Some(convert::approval(&approval, now)) });
        }

        // Settled or timed out: say so before looking for the challenge, whose record may be gone by then.
        match approval.effective_state(now) {
            ApprovalState::Pending => {}
            ApprovalState::Expired => return Err(Refusal::Expired.into()),
            ApprovalState::Approved | ApprovalState::Denied => return Err(Refusal::AlreadyDecided.into()),
        }
        let (challenge_item, challenge) =
            challenge::load(state, caller, challenge::DECISION, &approval.id, &device.id).await?;

        let request = DecisionRequest {
            approval_id: req.approval_id.clone(),
            approve,
            device_id: req.device_id.clone(),
            challenge: req.challenge.clone(),
            decided_at_ms: req.decided_at_ms,
            confirmation: (!req.typed_confirmation.is_empty()).then(|| req.typed_confirmation.clone()),
            signature: req.signature.clone(),
        };
        approval::check_decision(&approval, &device, &challenge, &request, now)?;

        challenge::check_signed_at(state, &challenge, req.decided_at_ms, "decided_at_ms")?;

        // The approval is written first: its conditional write is what lets exactly one decision through, and a
        // decision that loses it has changed nothing yet.
        let settled = approval::settle(&approval, &device, &request);
        // Leaving the `pending` index takes it off every phone's to-do list.
        let item = Item { body: to_body(&settled)?, index: None, ..approval_item.clone() };
        match state.store.put_item(&item, Cond::Version(approval_item.version)).await {
            Ok(_) => {}
            Err(StoreError::Conflict) => return Err(lost_race(state, caller, &approval.id).await),
            Err(e) => return Err(e.into()),
        }
        challenge::use_up(state, &challenge_item, &challenge).await;
        tracing::info!(approval = %settled.id, run = %settled.run_id, approved = approve, by = %device.user, "approval settled");
        wake_run(state, caller, &settled).await?;
        Ok(pa::DecideResponse { approval: Some(convert::approval(&settled, now)) })
    })
    .await
}

pub(crate) fn routes(state: ApiState, router: Router) -> Router {
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}ListApprovals"),
        move |ctx: CallContext, req: pa::ListApprovalsRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::APPROVALS_READ).await?;
                Ok(list(&s, &caller, req).await?)
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GetApproval"),
        move |ctx: CallContext, req: pa::GetApprovalRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::APPROVALS_READ).await?;
                let (_, a) = load_approval(&s, &caller, &req.approval_id).await?;
                Ok(pa::GetApprovalResponse {
                    approval: Some(convert::approval(&a, s.now_ms())),
                })
            }
        },
    );
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}GetChallenge"),
        move |ctx: CallContext, req: pa::GetChallengeRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::APPROVALS_DECIDE).await?;
                Ok(challenge(&s, &caller, req).await?)
            }
        },
    );
    let s = state;
    router.unary(
        &format!("{SERVICE}Decide"),
        move |ctx: CallContext, req: pa::DecideRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::APPROVALS_DECIDE).await?;
                Ok(decide(&s, &caller, req).await?)
            }
        },
    )
}
