//! A simulated phone: what the SwiftUI and Compose apps do for an approval, done from Rust over the same Connect
//! API. It registers a P-256 device key, lists pending approvals, fetches a challenge, signs the canonical
//! decision bytes defined in `loams-proto`, and decides.

use anyhow::{Context, anyhow};
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
use loams_proto::approvals::v1 as approvals;
use loams_proto::connect::ConnectClient;
use loams_proto::devices::v1 as devices;

const SERVICE_APPROVALS: &str = "/loams.approvals.v1.ApprovalService";
const SERVICE_DEVICES: &str = "/loams.devices.v1.DeviceService";

pub struct Phone {
    api: ConnectClient,
    key: EcdsaKeyPair,
    device_id: String,
}

impl Phone {
    /// Generates a device key and registers it for the user the bearer token names.
    pub async fn register(api_url: &str, token: &str, name: &str) -> anyhow::Result<Phone> {
        let api =
            ConnectClient::new(api_url).with_header("authorization", format!("Bearer {token}"))?;
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
            .map_err(|_| anyhow!("cannot generate a P-256 device key"))?;
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref())
            .map_err(|_| anyhow!("generated device key does not load"))?;
        let request = devices::RegisterDeviceRequest {
            device_id: String::new(),
            public_key: key.public_key().as_ref().to_vec(),
            name: name.to_string(),
            push_token: String::new(),
            idempotency_key: format!("register-{name}"),
        };
        let device: devices::Device = api
            .unary(&format!("{SERVICE_DEVICES}/RegisterDevice"), &request)
            .await
            .context("registering the device")?;
        Ok(Phone {
            api,
            key,
            device_id: device.device_id,
        })
    }

    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    pub async fn pending(&self) -> anyhow::Result<Vec<approvals::Approval>> {
        let request = approvals::ListApprovalsRequest {
            page_size: 50,
            page_token: String::new(),
            state: approvals::ApprovalState::Pending as i32,
        };
        let response: approvals::ListApprovalsResponse = self
            .api
            .unary(&format!("{SERVICE_APPROVALS}/ListApprovals"), &request)
            .await?;
        Ok(response.approvals)
    }

    /// Reads the approval as the server renders it, gets a fresh challenge, signs and decides.
    pub async fn decide(
        &self,
        approval_id: &str,
        approve: bool,
    ) -> anyhow::Result<approvals::Approval> {
        let shown: approvals::GetApprovalResponse = self
            .api
            .unary(
                &format!("{SERVICE_APPROVALS}/GetApproval"),
                &approvals::GetApprovalRequest {
                    approval_id: approval_id.to_string(),
                },
            )
            .await?;
        let approval = shown.approval.context("server returned no approval")?;
        let challenge: approvals::GetChallengeResponse = self
            .api
            .unary(
                &format!("{SERVICE_APPROVALS}/GetChallenge"),
                &approvals::GetChallengeRequest {
                    approval_id: approval_id.to_string(),
                    device_id: self.device_id.clone(),
                },
            )
            .await?;
        let decision = if approve {
            approvals::Decision::Approve
        } else {
            approvals::Decision::Deny
        };
        let decided_at_ms = now_ms();
        let bytes = loams_proto::canonical_decision_bytes(
            approval_id,
            &approval.action_hash,
            decision,
            &self.device_id,
            &challenge.challenge,
            decided_at_ms,
        );
        let signature = self
            .key
            .sign(&SystemRandom::new(), &bytes)
            .map_err(|_| anyhow!("signing the decision failed"))?;
        let request = approvals::DecideRequest {
            approval_id: approval_id.to_string(),
            decision: decision as i32,
            device_id: self.device_id.clone(),
            challenge: challenge.challenge,
            decided_at_ms,
            signature: signature.as_ref().to_vec(),
            // A person reads the phrase on screen and types it; the simulation types what it reads.
            typed_confirmation: approval.confirmation_phrase.clone(),
            idempotency_key: format!("decide-{approval_id}-{}", self.device_id),
        };
        let decided: approvals::DecideResponse = self
            .api
            .unary(&format!("{SERVICE_APPROVALS}/Decide"), &request)
            .await?;
        decided.approval.context("server returned no approval")
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
