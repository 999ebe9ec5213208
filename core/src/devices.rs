//! This installation's device key on the server: register it (with the push token), revoke it.

use std::sync::Arc;

use loams_proto::devices::v1 as pd;

use crate::client::{Inner, idempotency_key, now_ms};
use crate::error::{Error, Result};
use crate::signer::check_public_key;
use crate::types::Device;

const SERVICE: &str = "/loams.devices.v1.DeviceService/";
const MAX_NAME: usize = 128;
const MAX_PUSH_TOKEN: usize = 4096;

pub struct Devices {
    inner: Arc<Inner>,
}

impl Devices {
    pub(crate) fn new(inner: Arc<Inner>) -> Devices {
        Devices { inner }
    }

    /// The registered device of this installation, as last confirmed (works offline).
    pub fn current(&self) -> Result<Option<Device>> {
        self.inner.cache.device()
    }

    /// Registers the signer's public key for the signed-in user. Registering the same key again returns the
    /// existing device: the idempotency key is derived from the public key, so a retry after a lost answer gets the
    /// same device instead of a second one.
    pub async fn register(&self, name: &str, push_token: Option<String>) -> Result<Device> {
        if name.len() > MAX_NAME || name.chars().any(char::is_control) {
            return Err(Error::InvalidInput(format!(
                "the device name must be at most {MAX_NAME} bytes of text"
            )));
        }
        let push_token = push_token.unwrap_or_default();
        if push_token.len() > MAX_PUSH_TOKEN {
            return Err(Error::InvalidInput(format!(
                "the push token is longer than {MAX_PUSH_TOKEN} bytes"
            )));
        }
        let public_key = self.inner.signer.public_key().await?;
        check_public_key(&public_key)?;
        if let Some(device) = self.inner.cache.device()?
            && device.public_key == public_key
            && device.revoked_at_ms == 0
        {
            return Ok(device);
        }
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &public_key);
        let req = pd::RegisterDeviceRequest {
            device_id: String::new(),
            public_key: public_key.clone(),
            name: name.to_owned(),
            push_token,
            idempotency_key: format!("register-{}", hex::encode(&digest.as_ref()[..16])),
        };
        let device: pd::Device = self
            .inner
            .unary(&format!("{SERVICE}RegisterDevice"), &req)
            .await?;
        if device.public_key != public_key || device.device_id.is_empty() {
            return Err(Error::Server(
                "the server registered a different key".into(),
            ));
        }
        let at = now_ms();
        self.inner.cache.put_device(&device, at)?;
        Ok(Device::from_proto(device, at))
    }

    /// Revokes this installation's device: its key can decide nothing more. The platform deletes the key after.
    pub async fn revoke(&self) -> Result<Device> {
        let current = self.inner.cache.device()?.ok_or(Error::NotRegistered)?;
        let req = pd::RevokeDeviceRequest {
            device_id: current.device_id.clone(),
            idempotency_key: idempotency_key("revoke")?,
        };
        let resp: pd::RevokeDeviceResponse = self
            .inner
            .unary(&format!("{SERVICE}RevokeDevice"), &req)
            .await?;
        let device = resp
            .device
            .ok_or_else(|| Error::Server("RevokeDevice returned no device".into()))?;
        let at = now_ms();
        self.inner.cache.put_device(&device, at)?;
        Ok(Device::from_proto(device, at))
    }
}
