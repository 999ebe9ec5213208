//! Fault injection over the control endpoint, as a test in another process would arm it.

use loams_sandbox::{
    ArmedFault, Effect, Fault, MAX_DELAY_MS, MAX_FIELD_BYTES, MAX_RULES, MAX_TIMES, Sandbox,
    SandboxConfig, SandboxHandle,
};
use serde_json::json;
use std::time::{Duration, Instant};

#[path = "support/control.rs"]
mod control;
use control::{counts, zulip_message};

async fn start() -> SandboxHandle {
    Sandbox::start(SandboxConfig::default())
        .await
        .unwrap_or_else(|e| panic!("sandbox did not start: {e}"))
}

/// `POST /_sandbox/faults` with `rule` (a [`Fault`] or any JSON), to one app's control endpoint.
async fn post_rule(url: &str, rule: &impl serde::Serialize) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}/_sandbox/faults"))
        .json(rule)
        .send()
        .await
        .unwrap()
}

async fn arm(sb: &SandboxHandle, fault: &Fault) {
    let resp = post_rule(&sb.urls().forgejo, fault).await;
    assert_eq!(resp.status(), 204, "{:?}", resp.text().await);
}

async fn armed(sb: &SandboxHandle) -> Vec<ArmedFault> {
    reqwest::get(format!("{}/_sandbox/faults", sb.urls().zulip))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn plane_states(sb: &SandboxHandle) -> String {
    let c = sb.info();
    format!(
        "{}/api/v1/workspaces/{}/projects/{}/states/",
        c.urls.plane, c.plane_workspace, c.plane_project_id
    )
}

async fn zulip_post(sb: &SandboxHandle, content: &str) -> reqwest::Result<reqwest::Response> {
    zulip_message(sb, content).send().await
}

#[tokio::test]
async fn status_faults_match_method_and_path_and_are_counted() {
    let sb = start().await;
    let key = sb.tokens().plane_api_key.clone();
    let get_states = || {
        reqwest::Client::new()
            .get(plane_states(&sb))
            .header("x-api-key", &key)
            .send()
    };
    let rule = Fault::rate_limited("plane", 2, "7")
        .method("get")
        .path_prefix("/api/v1/workspaces/");
    arm(&sb, &rule).await;
    // Other methods, paths, apps and the control endpoints are untouched.
    assert_eq!(
        reqwest::Client::new()
            .post(plane_states(&sb))
            .header("x-api-key", &key)
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        405
    );
    assert_eq!(counts(&sb).await.plane.issues, 0);
    for _ in 0..2 {
        let resp = get_states().await.unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "7");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["message"], "sandbox: injected HTTP 429");
    }
    assert_eq!(get_states().await.unwrap().status(), 200);
    assert_eq!(
        armed(&sb).await,
        vec![ArmedFault {
            fault: rule,
            fired: 2
        }]
    );

    let clear = reqwest::Client::new()
        .delete(format!("{}/_sandbox/faults", sb.urls().glitchtip))
        .send()
        .await
        .unwrap();
    assert_eq!(clear.status(), 204);
    assert!(armed(&sb).await.is_empty());
    sb.shutdown().await;
}

#[tokio::test]
async fn bad_rules_are_refused() {
    let sb = start().await;
    let long_path = format!("/{}", "a".repeat(MAX_FIELD_BYTES));
    for body in [
        json!({"app": "jira", "times": 1, "effect": {"kind": "drop"}}),
        json!({"app": "plane", "times": 0, "effect": {"kind": "drop"}}),
        json!({"app": "plane", "times": 1, "effect": {"kind": "status", "status": 1000}}),
        json!({"app": "plane", "times": 1, "effect": {"kind": "explode"}}),
        // Rules that would hang the app or outlive any test.
        json!({"app": "plane", "times": 1, "effect": {"kind": "delay", "ms": MAX_DELAY_MS + 1}}),
        json!({"app": "plane", "times": 1, "effect": {"kind": "delay", "ms": u64::MAX}}),
        json!({"app": "plane", "times": MAX_TIMES + 1, "effect": {"kind": "drop"}}),
        json!({"app": "plane", "times": u32::MAX, "effect": {"kind": "drop"}}),
        // Strings past the cap, in each field that takes one.
        json!({"app": "plane", "times": 1, "method": "G".repeat(MAX_FIELD_BYTES + 1), "effect": {"kind": "drop"}}),
        json!({"app": "plane", "times": 1, "path_prefix": long_path, "effect": {"kind": "drop"}}),
        json!({"app": "plane", "times": 1, "effect": {"kind": "status", "status": 429, "retry_after": long_path}}),
    ] {
        let resp = post_rule(&sb.urls().plane, &body).await;
        assert_eq!(resp.status(), 400, "{body}");
    }
    assert!(sb.inject(Fault::status("nope", 1, 500)).is_err());
    assert!(
        sb.inject(Fault::delay("zulip", 1, Duration::from_secs(3600)))
            .is_err()
    );
    assert!(
        sb.inject(Fault::status("zulip", 1, 500).path_prefix(&long_path))
            .is_err()
    );
    assert!(sb.faults().is_empty());
    // The bounds themselves are allowed.
    sb.inject(Fault::delay(
        "zulip",
        MAX_TIMES,
        Duration::from_millis(MAX_DELAY_MS),
    ))
    .unwrap();
    assert_eq!(sb.faults().len(), 1);
    sb.inject(Fault::status("zulip", 1, 500).path_prefix(&long_path[1..]))
        .unwrap();
    sb.shutdown().await;
}

#[tokio::test]
async fn armed_rules_are_capped_and_used_up_ones_make_room() {
    let sb = start().await;
    // One rule that a request uses up, then live ones up to the cap.
    sb.inject(Fault::status("zulip", 1, 503)).unwrap();
    for _ in 1..MAX_RULES {
        sb.inject(Fault::status("zulip", 1, 500).path_prefix("/never"))
            .unwrap();
    }
    let over = json!({"app": "plane", "times": 1, "effect": {"kind": "drop"}});
    let post = || post_rule(&sb.urls().plane, &over);
    // Full with a rule still live: one more is refused, over HTTP and in process, and nothing is dropped.
    let resp = post().await;
    assert_eq!(resp.status(), 400);
    let text = resp.text().await.unwrap();
    assert!(text.contains("256 rules are armed"), "{text}");
    assert!(
        sb.inject(Fault::drop_connection("plane", 1))
            .unwrap_err()
            .to_string()
            .contains("none is used up")
    );
    assert_eq!(armed(&sb).await.len(), MAX_RULES);
    // Using up the first rule frees its place: the next rule takes it, the live ones stay in order.
    assert_eq!(zulip_post(&sb, "x").await.unwrap().status(), 503);
    assert_eq!(post().await.status(), 204);
    let rules = armed(&sb).await;
    assert_eq!(rules.len(), MAX_RULES);
    assert!(
        rules[..MAX_RULES - 1]
            .iter()
            .all(|r| r.fired == 0 && r.fault.path_prefix.is_some())
    );
    assert_eq!(rules[MAX_RULES - 1].fault.app, "plane");
    sb.shutdown().await;
}

#[tokio::test]
async fn drops_before_and_after_the_effect() {
    let sb = start().await;
    sb.inject(Fault::drop_connection("zulip", 1).method("POST"))
        .unwrap();
    let err = zulip_post(&sb, "lost before").await.unwrap_err();
    assert!(!err.is_status(), "{err:?}");
    assert_eq!(counts(&sb).await.zulip.messages, 0);

    sb.inject(
        Fault::drop_connection("zulip", 1)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    assert!(zulip_post(&sb, "lost after").await.is_err());
    assert_eq!(counts(&sb).await.zulip.messages, 1);

    // Exhausted rules leave requests alone.
    assert_eq!(zulip_post(&sb, "fine").await.unwrap().status(), 200);
    assert_eq!(counts(&sb).await.zulip.messages, 2);
    assert_eq!(
        sb.faults().iter().map(|f| f.fired).collect::<Vec<_>>(),
        [1, 1]
    );
    sb.shutdown().await;
}

#[tokio::test]
async fn delays_hold_the_answer_and_an_abandoned_request_before_the_effect_does_nothing() {
    let sb = start().await;
    sb.inject(Fault::delay("zulip", 1, Duration::from_millis(300)).after_effect())
        .unwrap();
    let t0 = Instant::now();
    assert_eq!(zulip_post(&sb, "slow").await.unwrap().status(), 200);
    assert!(t0.elapsed() >= Duration::from_millis(300));

    sb.inject(Fault::delay("zulip", 1, Duration::from_millis(600)))
        .unwrap();
    let gave_up = zulip_message(&sb, "x")
        .timeout(Duration::from_millis(100))
        .send()
        .await
        .unwrap_err();
    assert!(gave_up.is_timeout());
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(counts(&sb).await.zulip.messages, 1);
    assert!(matches!(
        sb.faults()[1].fault.effect,
        Effect::Delay { ms: 600 }
    ));
    sb.shutdown().await;
}

#[tokio::test]
async fn control_endpoints_answer_only_to_loopback_host_names() {
    let sb = start().await;
    let client = reqwest::Client::new();
    let drop_all = json!({"app": "plane", "times": 1, "effect": {"kind": "drop"}});
    // A page on a rebound name reaches 127.0.0.1 but still says its own name in Host.
    for host in ["evil.example", "evil.example:80", "127.0.0.1.evil.example"] {
        let add = client
            .post(format!("{}/_sandbox/faults", sb.urls().plane))
            .header("host", host)
            .json(&drop_all)
            .send()
            .await
            .unwrap();
        assert_eq!(add.status(), 403, "{host}");
        let state = client
            .get(format!("{}/_sandbox/state", sb.urls().zulip))
            .header("host", host)
            .send()
            .await
            .unwrap();
        assert_eq!(state.status(), 403, "{host}");
    }
    assert!(sb.faults().is_empty());
    // The names a local test uses still work.
    let port = sb.urls().plane.rsplit(':').next().unwrap().to_string();
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let add = client
            .post(format!("{}/_sandbox/faults", sb.urls().plane))
            .header("host", &host)
            .json(&drop_all)
            .send()
            .await
            .unwrap();
        assert_eq!(add.status(), 204, "{host}");
    }
    assert_eq!(sb.faults().len(), 2);
    sb.shutdown().await;
}
