//! Setup shared by the test files that run the agents against a started sandbox: the sandbox itself, each app's
//! config pointed at it, and the call that must succeed.

use loams_a2a::Skills;
use loams_agents::*;
use loams_sandbox::{Sandbox, SandboxConfig, SandboxHandle, SandboxInfo};
use serde_json::Value;

/// A sandbox that records every exchange, for tests about what an agent sent.
pub async fn recording_sandbox() -> (SandboxHandle, SandboxInfo) {
    recording_sandbox_with(SandboxConfig::default()).await
}

/// A sandbox of `config` that records every request (the contract checks read them).
pub async fn recording_sandbox_with(config: SandboxConfig) -> (SandboxHandle, SandboxInfo) {
    let config = SandboxConfig {
        record_requests: true,
        ..config
    };
    let handle = Sandbox::start(config).await.unwrap();
    let info = handle.info();
    (handle, info)
}

pub async fn ok(agent: &dyn Skills, skill: &str, args: Value) -> Value {
    match agent.invoke(skill, args.clone()).await {
        Ok(v) => v,
        Err(e) => panic!("{skill}({args}) failed: {e:?}"),
    }
}

pub fn zulip_config(info: &SandboxInfo) -> ZulipConfig {
    ZulipConfig::new(
        &info.urls.zulip,
        &info.tokens.zulip_email,
        &info.tokens.zulip_api_key,
    )
}

/// With the project identifier given, so no test depends on it being looked up.
pub fn plane_config(info: &SandboxInfo) -> PlaneConfig {
    let mut cfg = PlaneConfig::new(
        &info.urls.plane,
        &info.tokens.plane_api_key,
        &info.plane_workspace,
        &info.plane_project_id,
    );
    cfg.project_identifier = Some("OPS".into());
    cfg
}

/// The agent's account, on the sandbox's base branch.
pub fn forgejo_config(info: &SandboxInfo) -> ForgejoConfig {
    let mut cfg = ForgejoConfig::new(
        &info.urls.forgejo,
        &info.tokens.forgejo_token,
        &info.forgejo_owner,
        &info.forgejo_repo,
    );
    cfg.base_branch = info.forgejo_base.clone();
    cfg
}

pub fn glitchtip_config(info: &SandboxInfo) -> GlitchTipConfig {
    GlitchTipConfig::new(
        &info.urls.glitchtip,
        &info.tokens.glitchtip_token,
        &info.glitchtip_org,
    )
}

pub fn analytics_config(info: &SandboxInfo) -> AnalyticsConfig {
    AnalyticsConfig::new(
        &info.urls.openpanel,
        &info.tokens.openpanel_client_id,
        &info.tokens.openpanel_client_secret,
        &info.openpanel_project_id,
    )
}
