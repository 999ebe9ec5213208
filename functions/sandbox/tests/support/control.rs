//! Requests the sandbox tests make over HTTP, as a test in another process would.

use loams_sandbox::{Counts, SandboxHandle};

/// The sandbox's counters, read over the control endpoint. A shape mismatch fails the test rather than reading
/// as all zeros.
pub async fn counts(sb: &SandboxHandle) -> Counts {
    let resp = reqwest::get(format!("{}/_sandbox/state", sb.urls().plane))
        .await
        .unwrap_or_else(|e| panic!("control endpoint: {e}"));
    resp.json()
        .await
        .unwrap_or_else(|e| panic!("control endpoint answer: {e}"))
}

/// A Zulip message posted as the sandbox's user to topic `t` of channel `factory`; the caller sends it.
pub fn zulip_message(sb: &SandboxHandle, content: &str) -> reqwest::RequestBuilder {
    let t = sb.tokens();
    reqwest::Client::new()
        .post(format!("{}/api/v1/messages", sb.urls().zulip))
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .form(&[
            ("type", "stream"),
            ("to", "factory"),
            ("topic", "t"),
            ("content", content),
        ])
}
