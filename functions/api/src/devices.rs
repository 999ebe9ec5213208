//! DeviceService: register a phone's P-256 key (and push token), revoke it.

use loams_factory::approval::{Device, valid_device_key};
use loams_platform::{Cond, Item, Page, StoreError};
use loams_proto::connect::{CallContext, Router};
use loams_proto::devices::v1 as pd;

use crate::approvals::{parse, to_body};
use crate::{ApiError, ApiState, Caller, convert, idem, scope};

const SERVICE: &str = "/loams.devices.v1.DeviceService/";
const MAX_DEVICE_ID: usize = 64;
const MAX_NAME: usize = 128;
const MAX_PUSH_TOKEN: usize = 4096;
/// Unrevoked devices one user may have; each is a key that can approve, and a push target.
pub const MAX_ACTIVE_DEVICES: usize = 10;

/// How many unrevoked devices `user` has, counting no further than `MAX_ACTIVE_DEVICES`.
async fn active_devices(state: &ApiState, caller: &Caller) -> Result<usize, ApiError> {
    let mut count = 0;
    let mut cursor = None;
    loop {
        let page = Page {
            cursor,
            limit: MAX_ACTIVE_DEVICES as u32 + 1,
        };
        let paged = state
            .store
            .list_items(&caller.org, "device", Some(&caller.user), page)
            .await?;
        for item in &paged.items {
            let device: Device = parse(item)?;
            // Revocation takes a device out of the index; one revoked before that rule may still be listed.
            if !device.revoked && device.user == caller.user {
                count += 1;
            }
        }
        match paged.next {
            Some(next) if count < MAX_ACTIVE_DEVICES => cursor = Some(next),
            _ => return Ok(count),
        }
    }
}

fn device_id(requested: &str) -> Result<String, ApiError> {
    if requested.is_empty() {
        return crate::random_id("dev");
    }
    let ok = requested.len() <= MAX_DEVICE_ID
        && requested
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.');
    if !ok {
        return Err(ApiError::InvalidArgument(format!(
            "device_id must be 1..={MAX_DEVICE_ID} of [A-Za-z0-9._-]"
        )));
    }
    Ok(requested.to_owned())
}

async fn register(
    state: &ApiState,
    caller: &Caller,
    req: pd::RegisterDeviceRequest,
) -> Result<pd::Device, ApiError> {
    if !valid_device_key(&req.public_key) {
        return Err(ApiError::InvalidArgument(
            "public_key must be an uncompressed P-256 point (65 bytes, 0x04 || X || Y) on the curve".into(),
        ));
    }
    if req.name.len() > MAX_NAME || req.name.chars().any(char::is_control) {
        return Err(ApiError::InvalidArgument(format!(
            "name must be at most {MAX_NAME} bytes of text"
        )));
    }
    if req.push_token.len() > MAX_PUSH_TOKEN {
        return Err(ApiError::InvalidArgument(format!(
            "push_token is longer than {MAX_PUSH_TOKEN} bytes"
        )));
    }
    let id = device_id(&req.device_id)?;
    idem::once(
        state,
        caller,
        "RegisterDevice",
        &req.idempotency_key,
        || async {
            // Checked before the write, so two registrations at the same instant can pass one over the limit; the
            // limit bounds a user's keys, it is not an exact quota.
            if active_devices(state, caller).await? >= MAX_ACTIVE_DEVICES {
                return Err(ApiError::FailedPrecondition(format!(
                    "at most {MAX_ACTIVE_DEVICES} active devices per user; revoke one first"
                )));
            }
            let device = Device {
                id: id.clone(),
                org: caller.org.clone(),
                user: caller.user.clone(),
                public_key: req.public_key.clone(),
                name: req.name.clone(),
                revoked: false,
                revoked_at_ms: None,
                push_token: (!req.push_token.is_empty()).then(|| req.push_token.clone()),
                created_at_ms: state.now_ms(),
            };
            let item = Item {
                org: caller.org.clone(),
                kind: "device".into(),
                id: id.clone(),
                version: 0,
                // Indexed by user while active, so a user's devices can be counted and listed (push fan-out) without a
                // scan.
                index: Some(caller.user.clone()),
                body: to_body(&device)?,
                expires_ms: None,
            };
            // A device id is never reused: re-registering would swap the key under existing decisions' proofs.
            match state.store.put_item(&item, Cond::Absent).await {
                Ok(_) => Ok(convert::device(&device)),
                Err(StoreError::Conflict) => Err(ApiError::AlreadyExists(format!(
                    "device {id} already exists"
                ))),
                Err(e) => Err(e.into()),
            }
        },
    )
    .await
}

async fn revoke(
    state: &ApiState,
    caller: &Caller,
    req: pd::RevokeDeviceRequest,
) -> Result<pd::RevokeDeviceResponse, ApiError> {
    crate::factory::id_arg("device_id", &req.device_id)?;
    idem::once(
        state,
        caller,
        "RevokeDevice",
        &req.idempotency_key,
        || async {
            let not_found = || ApiError::NotFound(format!("device {} not found", req.device_id));
            let item = state
                .store
                .get_item(&caller.org, "device", &req.device_id)
                .await?
                .ok_or_else(not_found)?;
            let mut device: Device = parse(&item)?;
            // Only the owner revokes (there are no admin roles yet); someone else's device reads as absent.
            if device.user != caller.user {
                return Err(not_found());
            }
            if !device.revoked {
                device.revoked = true;
                device.revoked_at_ms = Some(state.now_ms());
                let updated = Item {
                    body: to_body(&device)?,
                    index: None,
                    ..item.clone()
                };
                state
                    .store
                    .put_item(&updated, Cond::Version(item.version))
                    .await?;
            }
            Ok(pd::RevokeDeviceResponse {
                device: Some(convert::device(&device)),
            })
        },
    )
    .await
}

pub(crate) fn routes(state: ApiState, router: Router) -> Router {
    let s = state.clone();
    let router = router.unary(
        &format!("{SERVICE}RegisterDevice"),
        move |ctx: CallContext, req: pd::RegisterDeviceRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::DEVICES_WRITE).await?;
                Ok(register(&s, &caller, req).await?)
            }
        },
    );
    let s = state;
    router.unary(
        &format!("{SERVICE}RevokeDevice"),
        move |ctx: CallContext, req: pd::RevokeDeviceRequest| {
            let s = s.clone();
            async move {
                let caller = s.caller(&ctx, scope::DEVICES_WRITE).await?;
                Ok(revoke(&s, &caller, req).await?)
            }
        },
    )
}
