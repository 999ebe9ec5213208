//! The app webhooks (Forgejo, Plane, Zulip) over real HTTP on the SQLite store in memory, and the parsers fed
//! arbitrary bytes. The GlitchTip webhook's HTTP behaviour is covered in tests/api.rs.

use std::sync::Arc;

use async_trait::async_trait;
use aws_lc_rs::hmac;
use axum::http::{HeaderMap, HeaderValue};
use loams_api::webhooks::{
    AppEventRecord, ForgejoEvent, PlaneVersion, parse_forgejo, parse_glitchtip, parse_plane,
    parse_zulip,
};
use loams_api::{ApiConfig, ApiError, ApiState, AppHook, Issuer, RunOpener, router};
use loams_factory::Signal;
use loams_platform::{Clock, ManualClock, Page, Sqlite, Store};
use proptest::prelude::*;

const SECRET: &str = "forgejo-secret-0123456789";
const PLANE_SECRET: &str = "plane-secret-0123456789";
const ZULIP_TOKEN: &str = "zulip-bot-token-0123456789abcdef";
const RUN: &str = "r-0123456789abcdef";
const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
const MERGE_SHA: &str = "89abcdef0123456789abcdef0123456789abcdef";

/// The webhooks never open runs; GlitchTip's do, and are tested in tests/api.rs.
struct NoOpener;

#[async_trait]
impl RunOpener for NoOpener {
    async fn open(&self, _org: &str, _env: &str, _signal: Signal) -> Result<String, ApiError> {
        Err(ApiError::Internal("not used by these tests".into()))
    }
}

struct Env {
    base: String,
    db: Arc<Sqlite>,
    clock: Arc<ManualClock>,
    http: reqwest::Client,
}

fn hook(id: &str, org: &str, secret: &str) -> AppHook {
    AppHook {
        id: id.into(),
        org: org.into(),
        secret: secret.into(),
    }
}

async fn start() -> Env {
    let clock = Arc::new(ManualClock::new(loams_platform::SystemClock.now_ms()));
    let db = Arc::new(Sqlite::memory(clock.clone()).unwrap());
    let issuer = Issuer::generate("https://loams.test", "loams-api").unwrap();
    let state = ApiState {
        store: db.clone(),
        queue: db.clone(),
        verifier: issuer.verifier(),
        clock: clock.clone(),
        config: Arc::new(ApiConfig {
            forgejo_hooks: vec![
                hook("code", "acme", SECRET),
                hook("short", "acme", "too-short"),
            ],
            plane_hooks: vec![hook("tracker", "acme", PLANE_SECRET)],
            zulip_hooks: vec![hook("chat", "acme", ZULIP_TOKEN)],
            ..ApiConfig::default()
        }),
        opener: Arc::new(NoOpener),
        jwks: None,
        collab: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    Env {
        base,
        db,
        clock,
        http: reqwest::Client::new(),
    }
}

fn sign(secret: &str, body: &[u8]) -> String {
    hex::encode(hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()), body).as_ref())
}

impl Env {
    async fn post(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> (u16, serde_json::Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let res = req.body(body).send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(serde_json::Value::Null))
    }

    async fn forgejo(&self, event: &str, delivery: &str, body: &[u8]) -> (u16, serde_json::Value) {
        let sig = sign(SECRET, body);
        let headers = [
            ("x-forgejo-event", event),
            ("x-forgejo-delivery", delivery),
            ("x-forgejo-signature", &sig),
        ];
        self.post("/webhooks/forgejo/code", &headers, body.to_vec())
            .await
    }

    async fn items(&self, kind: &str) -> Vec<loams_platform::Item> {
        self.db
            .list_items("acme", kind, None, Page::first(100))
            .await
            .unwrap()
            .items
    }

    async fn events(&self) -> Vec<AppEventRecord> {
        self.items("app_event")
            .await
            .iter()
            .map(|i| serde_json::from_slice(&i.body).unwrap())
            .collect()
    }

    /// Asserts a refused delivery wrote nothing.
    async fn assert_nothing_written(&self) {
        assert!(self.items("app_event").await.is_empty());
        assert!(self.items("webhook").await.is_empty());
    }
}

fn pull_request(action: &str, merged: bool, branch: &str) -> Vec<u8> {
    // Pretty-printed like Forgejo's payloads: the signature covers these exact bytes.
    serde_json::to_vec_pretty(&serde_json::json!({
        "action": action,
        "number": 7,
        "pull_request": {
            "id": 70, "number": 7, "title": "Fix checkout\u{0007} total", "state": "closed", "merged": merged,
            "merge_commit_sha": if merged { serde_json::json!(MERGE_SHA) } else { serde_json::Value::Null },
            "head": {"ref": branch, "sha": SHA, "label": branch},
            "base": {"ref": "main", "sha": MERGE_SHA, "label": "main"}
        },
        "repository": {"id": 1, "full_name": "acme/shop", "name": "shop"},
        "sender": {"id": 2, "login": "loams-bot"},
        "commit_id": "", "review": null
    }))
    .unwrap()
}

fn push_body() -> Vec<u8> {
    serde_json::to_vec_pretty(&serde_json::json!({
        "ref": "refs/heads/main",
        "before": "0000000000000000000000000000000000000000",
        "after": SHA,
        "compare_url": "https://forgejo.example/acme/shop/compare/0...1",
        "commits": [{"id": SHA, "message": "Fix checkout total\n\nLonger text.", "url": "https://x"}],
        "total_commits": 1,
        "repository": {"full_name": "acme/shop"},
        "pusher": {"login": "alice"},
        "sender": {"login": "alice"}
    }))
    .unwrap()
}

#[tokio::test]
async fn forgejo_merged_factory_pr_and_push_are_recorded_once() {
    let env = start().await;
    let merged = pull_request("closed", true, &format!("factory/{RUN}"));
    let (status, _) = env.forgejo("pull_request", "d-1", &merged).await;
    assert_eq!(status, 202);
    let (status, body) = env.forgejo("pull_request", "d-1", &merged).await;
    assert_eq!(
        (status, body["duplicate"].as_bool()),
        (200, Some(true)),
        "a resend is acknowledged, not recorded"
    );
    let (status, _) = env.forgejo("push", "d-2", &push_body()).await;
    assert_eq!(status, 202);

    let mut events = env.events().await;
    events.sort_by(|a, b| a.delivery.cmp(&b.delivery));
    assert_eq!(events.len(), 2);
    assert_eq!(env.items("webhook").await.len(), 2);
    let loams_api::webhooks::AppEvent::Forgejo(ForgejoEvent::PullRequest(pr)) = &events[0].event
    else {
        panic!("{:?}", events[0]);
    };
    assert_eq!(pr.merged_factory_run.as_deref(), Some(RUN));
    assert_eq!(
        (pr.number, pr.head_sha.as_str(), pr.merge_sha.as_deref()),
        (7, SHA, Some(MERGE_SHA))
    );
    assert_eq!(
        (pr.repo.as_str(), pr.base_ref.as_str(), pr.title.as_str()),
        ("acme/shop", "main", "Fix checkout total")
    );
    let loams_api::webhooks::AppEvent::Forgejo(ForgejoEvent::Push(push)) = &events[1].event else {
        panic!("{:?}", events[1]);
    };
    assert_eq!(
        (
            push.git_ref.as_str(),
            push.after.as_str(),
            push.total_commits
        ),
        ("refs/heads/main", SHA, 1)
    );
    assert_eq!(push.commits[0].title, "Fix checkout total");
    assert_eq!(events[1].hook, "code");
}

#[tokio::test]
async fn a_resend_after_the_dedupe_window_is_still_a_duplicate() {
    let env = start().await;
    let body = push_body();
    assert_eq!(env.forgejo("push", "d-9", &body).await.0, 202);
    // The `webhook` marker lives ten minutes; the recorded event still refuses a second copy of the delivery.
    env.clock.advance(11 * 60 * 1000);
    assert!(env.items("webhook").await.is_empty(), "the marker expired");
    assert_eq!(env.forgejo("push", "d-9", &body).await.0, 200);
    assert_eq!(env.events().await.len(), 1);
    // Another delivery of the same bytes is another event.
    assert_eq!(env.forgejo("push", "d-10", &body).await.0, 202);
    assert_eq!(env.events().await.len(), 2);
}

#[test]
fn only_a_merge_of_a_factory_branch_names_a_run() {
    let parse = |body: &[u8]| {
        let mut headers = HeaderMap::new();
        headers.insert("x-gitea-event", HeaderValue::from_static("pull_request"));
        headers.insert(
            "x-gitea-signature",
            HeaderValue::from_str(&sign(SECRET, body)).unwrap(),
        );
        match parse_forgejo(&headers, body, SECRET.as_bytes())
            .unwrap()
            .event
        {
            Some(ForgejoEvent::PullRequest(pr)) => pr,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        parse(&pull_request("closed", true, &format!("factory/{RUN}")))
            .merged_factory_run
            .as_deref(),
        Some(RUN)
    );
    assert_eq!(
        parse(&pull_request("closed", false, &format!("factory/{RUN}"))).merged_factory_run,
        None
    );
    assert_eq!(
        parse(&pull_request("opened", false, &format!("factory/{RUN}"))).merged_factory_run,
        None
    );
    assert_eq!(
        parse(&pull_request("closed", true, "feature/x")).merged_factory_run,
        None
    );
}

#[tokio::test]
async fn forgejo_refuses_unsigned_forged_and_malformed_deliveries() {
    let env = start().await;
    let body = push_body();
    let path = "/webhooks/forgejo/code";
    let event = ("x-forgejo-event", "push");
    // Missing signature (also: Forgejo's empty signature when the hook has no secret).
    assert_eq!(env.post(path, &[event], body.clone()).await.0, 401);
    assert_eq!(
        env.post(path, &[event, ("x-forgejo-signature", "")], body.clone())
            .await
            .0,
        401
    );
    // Signed with another secret, not hex, or over other bytes.
    let wrong = sign("another-secret-0123456789", &body);
    let (status, reply) = env
        .post(
            path,
            &[event, ("x-forgejo-signature", &wrong)],
            body.clone(),
        )
        .await;
    assert_eq!(status, 401);
    assert!(
        reply["error"].as_str().unwrap().contains("does not match"),
        "{reply}"
    );
    assert_eq!(
        env.post(
            path,
            &[event, ("x-forgejo-signature", "not-hex")],
            body.clone()
        )
        .await
        .0,
        401
    );
    let tampered = sign(SECRET, &body);
    let mut other = body.clone();
    other.push(b' ');
    assert_eq!(
        env.post(path, &[event, ("x-forgejo-signature", &tampered)], other)
            .await
            .0,
        401
    );
    // GitHub-style headers are not what Forgejo's secret signs here.
    let hub = format!("sha256={tampered}");
    assert_eq!(
        env.post(path, &[event, ("x-hub-signature-256", &hub)], body.clone())
            .await
            .0,
        401
    );
    // Correctly signed but not a payload of the event.
    assert_eq!(env.forgejo("push", "d-3", b"{\"ref\": ").await.0, 400);
    assert_eq!(env.forgejo("pull_request", "d-4", &body).await.0, 400);
    let mut bad_sha = push_body();
    bad_sha = String::from_utf8(bad_sha)
        .unwrap()
        .replace(SHA, "not-a-sha")
        .into_bytes();
    assert_eq!(env.forgejo("push", "d-5", &bad_sha).await.0, 400);
    // Oversized: refused before it is read.
    let big = vec![b' '; loams_api::webhooks::FORGEJO_MAX_BYTES + 1];
    assert_eq!(env.forgejo("push", "d-6", &big).await.0, 413);
    // Unknown hook, and a hook whose secret is too short to be served.
    let sig = sign(SECRET, &body);
    assert_eq!(
        env.post(
            "/webhooks/forgejo/nope",
            &[event, ("x-forgejo-signature", &sig)],
            body.clone()
        )
        .await
        .0,
        404
    );
    let short = sign("too-short", &body);
    assert_eq!(
        env.post(
            "/webhooks/forgejo/short",
            &[event, ("x-forgejo-signature", &short)],
            body.clone()
        )
        .await
        .0,
        503
    );
    // Signed events this API does not handle are acknowledged and not recorded.
    let (status, reply) = env.forgejo("issues", "d-7", b"{}").await;
    assert_eq!((status, reply["ignored"].as_str()), (200, Some("issues")));
    env.assert_nothing_written().await;
}

fn plane_v1() -> Vec<u8> {
    // Python's json.dumps separators, as Plane CE sends them.
    br#"{"event": "issue", "action": "updated", "webhook_id": "6a1f0c2e-0000-4000-8000-000000000001", "workspace_id": "6a1f0c2e-0000-4000-8000-000000000002", "data": {"id": "6a1f0c2e-0000-4000-8000-000000000003", "name": "Checkout total is wrong", "state": "started"}, "activity": {"field": "state", "new_value": "started", "old_value": "todo", "actor": {"id": "u1"}}}"#.to_vec()
}

fn plane_v2() -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "version": "v2", "delivery_id": "dlv-42", "event_id": "ev-1",
        "entity_id": "6a1f0c2e-0000-4000-8000-000000000004", "entity_type": "workitem.comment",
        "event": "workitem.comment.created", "webhook_id": "6a1f0c2e-0000-4000-8000-000000000001",
        "workspace_id": "6a1f0c2e-0000-4000-8000-000000000002", "data": {"comment_html": "<p>hi</p>"},
        "previous_attributes": {}
    }))
    .unwrap()
}

#[tokio::test]
async fn plane_records_both_payload_versions_once() {
    let env = start().await;
    let path = "/webhooks/plane/tracker";
    let v1 = plane_v1();
    let sig1 = sign(PLANE_SECRET, &v1);
    let headers = [
        ("x-plane-event", "issue"),
        ("x-plane-delivery", "11111111-2222-4333-8444-555555555555"),
        ("x-plane-signature", sig1.as_str()),
    ];
    assert_eq!(env.post(path, &headers, v1.clone()).await.0, 202);
    assert_eq!(
        env.post(path, &headers, v1.clone()).await.0,
        200,
        "same delivery id"
    );
    // v2 without the header: the body's delivery_id identifies it.
    let v2 = plane_v2();
    let sig2 = sign(PLANE_SECRET, &v2);
    assert_eq!(
        env.post(path, &[("x-plane-signature", &sig2)], v2.clone())
            .await
            .0,
        202
    );
    assert_eq!(
        env.post(path, &[("x-plane-signature", &sig2)], v2.clone())
            .await
            .0,
        200
    );

    let mut events = env.events().await;
    events.sort_by(|a, b| a.delivery.cmp(&b.delivery));
    assert_eq!(
        events
            .iter()
            .map(|e| e.delivery.as_str())
            .collect::<Vec<_>>(),
        ["11111111-2222-4333-8444-555555555555", "dlv-42"]
    );
    let loams_api::webhooks::AppEvent::Plane(p1) = &events[0].event else {
        panic!("{:?}", events[0])
    };
    assert_eq!(
        (p1.version, p1.entity.as_str(), p1.action.as_str()),
        (PlaneVersion::V1, "issue", "updated")
    );
    assert_eq!(
        p1.entity_id.as_deref(),
        Some("6a1f0c2e-0000-4000-8000-000000000003")
    );
    let loams_api::webhooks::AppEvent::Plane(p2) = &events[1].event else {
        panic!("{:?}", events[1])
    };
    assert_eq!(
        (p2.version, p2.entity.as_str(), p2.action.as_str()),
        (PlaneVersion::V2, "workitem.comment", "created")
    );
    assert_eq!(p2.event, "workitem.comment.created");
    assert_eq!(
        p2.entity_id.as_deref(),
        Some("6a1f0c2e-0000-4000-8000-000000000004")
    );
}

#[tokio::test]
async fn plane_refuses_unsigned_forged_and_malformed_deliveries() {
    let env = start().await;
    let path = "/webhooks/plane/tracker";
    let v1 = plane_v1();
    assert_eq!(
        env.post(path, &[], v1.clone()).await.0,
        401,
        "missing header"
    );
    let wrong = sign(SECRET, &v1);
    assert_eq!(
        env.post(path, &[("x-plane-signature", &wrong)], v1.clone())
            .await
            .0,
        401,
        "wrong secret"
    );
    let mut tampered = v1.clone();
    tampered[10] ^= 1;
    let good = sign(PLANE_SECRET, &v1);
    assert_eq!(
        env.post(path, &[("x-plane-signature", &good)], tampered)
            .await
            .0,
        401,
        "bad signature"
    );
    for body in [
        b"{\"event\": ".to_vec(),
        br#"{"version": "v3", "event": "workitem.created"}"#.to_vec(),
        br#"{"version": "v2", "event": "workitem"}"#.to_vec(),
        br#"{"event": "issue", "data": {}}"#.to_vec(),
        br#"{"event": "issue", "action": "updated", "data": {"id": 5}}"#.to_vec(),
        br#"{"event": "Issue; drop", "action": "updated"}"#.to_vec(),
    ] {
        let sig = sign(PLANE_SECRET, &body);
        let (status, reply) = env
            .post(path, &[("x-plane-signature", &sig)], body.clone())
            .await;
        assert_eq!(status, 400, "{} -> {reply}", String::from_utf8_lossy(&body));
    }
    let big = vec![b' '; loams_api::webhooks::PLANE_MAX_BYTES + 1];
    let sig = sign(PLANE_SECRET, &big);
    assert_eq!(
        env.post(path, &[("x-plane-signature", &sig)], big).await.0,
        413
    );
    env.assert_nothing_written().await;
}

fn zulip(token: &str, message_id: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "bot_email": "loams-bot@zulip.example", "bot_full_name": "Loams",
        "data": "@**Loams** why did checkout fail?", "trigger": "mention", "token": token,
        "message": {
            "id": message_id, "sender_email": "alice@acme.example", "sender_full_name": "Alice",
            "type": "stream", "display_recipient": "factory", "subject": "r-0123456789abcdef",
            "stream_id": 3, "content": "<p>why did checkout fail?</p>", "timestamp": 1_700_000_000
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn zulip_records_a_mention_once_and_refuses_bad_tokens() {
    let env = start().await;
    let path = "/webhooks/zulip/chat";
    assert_eq!(
        env.post(path, &[], zulip("wrong-token-0123456789abcdef0123", 9))
            .await
            .0,
        401
    );
    assert_eq!(env.post(path, &[], zulip("", 9)).await.0, 401);
    assert_eq!(
        env.post(path, &[], br#"{"data": "hi"}"#.to_vec()).await.0,
        401,
        "no token"
    );
    assert_eq!(env.post(path, &[], b"{\"token\": ".to_vec()).await.0, 400);
    let no_message =
        serde_json::to_vec(&serde_json::json!({"token": ZULIP_TOKEN, "trigger": "mention"}))
            .unwrap();
    assert_eq!(env.post(path, &[], no_message).await.0, 400);
    let mut big = zulip(ZULIP_TOKEN, 9);
    big.extend(std::iter::repeat_n(
        b' ',
        loams_api::webhooks::ZULIP_MAX_BYTES,
    ));
    assert_eq!(env.post(path, &[], big).await.0, 413);
    // serde_json's private key would have the payload's `Value` fields parsed again, unbounded: refused unparsed.
    let private =
        br#"{"token": "t", "message": {"$serde_json::private::RawValue": "{}"}}"#.to_vec();
    assert_eq!(env.post(path, &[], private).await.0, 400);
    env.assert_nothing_written().await;

    let (status, reply) = env.post(path, &[], zulip(ZULIP_TOKEN, 9)).await;
    assert_eq!(
        (
            status,
            reply["response_not_required"].as_bool(),
            reply["duplicate"].as_bool()
        ),
        (200, Some(true), Some(false))
    );
    let (status, reply) = env.post(path, &[], zulip(ZULIP_TOKEN, 9)).await;
    assert_eq!((status, reply["duplicate"].as_bool()), (200, Some(true)));
    let events = env.events().await;
    assert_eq!(events.len(), 1);
    assert!(
        events[0].delivery.starts_with("sha256-"),
        "{}",
        events[0].delivery
    );
    let loams_api::webhooks::AppEvent::Zulip(z) = &events[0].event else {
        panic!("{:?}", events[0])
    };
    assert_eq!(
        (z.message_id, z.channel.as_deref(), z.topic.as_deref()),
        (9, Some("factory"), Some(RUN))
    );
    assert_eq!(
        (z.trigger.as_str(), z.sender_email.as_str()),
        ("mention", "alice@acme.example")
    );
}

#[test]
fn zulip_direct_messages_have_no_channel() {
    let body = serde_json::json!({
        "token": ZULIP_TOKEN, "trigger": "direct_message", "data": "hello",
        "message": {"id": 4, "type": "private", "display_recipient": [{"email": "a@x"}], "subject": ""}
    });
    let event = parse_zulip(&serde_json::to_vec(&body).unwrap(), ZULIP_TOKEN).unwrap();
    assert_eq!(
        (event.channel, event.topic, event.content.as_str()),
        (None, None, "hello")
    );
}

/// Headers with a valid signature over `body`, so the fuzzed bytes reach the JSON parsers.
fn signed(
    event_header: &str,
    event: &str,
    sig_header: &str,
    secret: &str,
    body: &[u8],
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(event) {
        headers.insert(
            axum::http::HeaderName::from_bytes(event_header.as_bytes()).unwrap(),
            v,
        );
    }
    headers.insert(
        axum::http::HeaderName::from_bytes(sig_header.as_bytes()).unwrap(),
        HeaderValue::from_str(&sign(secret, body)).unwrap(),
    );
    headers
}

fn json_like() -> impl Strategy<Value = Vec<u8>> {
    // Arbitrary bytes rarely get past the first JSON byte; near-payloads with random values reach the field checks.
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        "[a-z0-9/._-]{0,50}".prop_map(serde_json::Value::from),
        Just(serde_json::Value::from(SHA)),
    ];
    let keys = prop::sample::select(vec![
        "action",
        "number",
        "pull_request",
        "head",
        "base",
        "ref",
        "sha",
        "merged",
        "merge_commit_sha",
        "repository",
        "full_name",
        "before",
        "after",
        "commits",
        "id",
        "message",
        "event",
        "version",
        "data",
        "entity_id",
        "token",
        "trigger",
        "type",
        "display_recipient",
        "subject",
        "attachments",
        "title_link",
        "delivery_id",
    ]);
    let value = leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map(keys.clone(), inner, 0..6).prop_map(|m| {
                serde_json::Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    });
    value.prop_map(|v| serde_json::to_vec(&v).unwrap())
}

fn any_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..512), json_like()]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_parser_panics_on_arbitrary_bytes(body in any_body(), event in prop::sample::select(vec!["pull_request", "push", "issues"])) {
        // Unsigned: refused as unauthenticated, whatever the bytes.
        let unsigned = parse_forgejo(&HeaderMap::new(), &body, SECRET.as_bytes());
        prop_assert!(matches!(unsigned, Err(ApiError::Unauthenticated(_))));
        let _ = parse_forgejo(&signed("x-forgejo-event", event, "x-forgejo-signature", SECRET, &body), &body, SECRET.as_bytes());
        let _ = parse_plane(&signed("x-plane-event", event, "x-plane-signature", PLANE_SECRET, &body), &body, PLANE_SECRET.as_bytes());
        let _ = parse_zulip(&body, ZULIP_TOKEN);
        let _ = parse_glitchtip(&body, "https://gt.example");
    }

    #[test]
    fn a_zulip_body_with_the_token_parses_or_is_refused_cleanly(mut value in json_like()) {
        // Splice the right token into arbitrary objects so the later checks run too.
        if value.first() == Some(&b'{') && value.len() > 2 {
            let token = format!("\"token\":\"{ZULIP_TOKEN}\",");
            value.splice(1..1, token.into_bytes());
        }
        match parse_zulip(&value, ZULIP_TOKEN) {
            Ok(e) => prop_assert!(e.content.len() <= 16 * 1024),
            Err(e) => prop_assert!(matches!(e, ApiError::InvalidArgument(_) | ApiError::Unauthenticated(_)), "{e}"),
        }
    }
}
