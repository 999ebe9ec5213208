//! The API over real HTTP: loams-proto's Connect client against the router, on the SQLite store in memory.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
use futures::StreamExt;
use loams_api::{ApiConfig, ApiError, ApiState, GlitchtipHook, Issuer, RunOpener, router};
use loams_factory::approval::{Approval, ApprovalAction, ApprovalState};
use loams_factory::{Envelope, Input, Signal};
use loams_platform::{Clock, Cond, Item, ManualClock, Queue, Sqlite, Store};
use loams_proto::approvals::v1 as pa;
use loams_proto::connect::{Code, ConnectClient, ConnectError};
use loams_proto::devices::v1 as pd;
use loams_proto::factory::v1 as pf;

const ISS: &str = "https://loams.test";
const AUD: &str = "loams-api";
const HOOK_TOKEN: &str = "hook-token-0123456789abcdef";
const RUN: &str = "r-0123456789abcdef";
const AP: &str = "ap-1";

struct Opener(Mutex<Vec<(String, String, Signal)>>);

#[async_trait]
impl RunOpener for Opener {
    async fn open(&self, org: &str, env: &str, signal: Signal) -> Result<String, ApiError> {
        let id = loams_factory::run_id(org, &signal.fingerprint, signal.generation);
        self.0.lock().unwrap().push((org.into(), env.into(), signal));
        Ok(id)
    }
}

struct Env {
    base: String,
    issuer: Issuer,
    db: Arc<Sqlite>,
    clock: Arc<ManualClock>,
    opener: Arc<Opener>,
}

fn wall_ms() -> i64 {
    loams_platform::SystemClock.now_ms()
}

async fn start() -> Env {
    let clock = Arc::new(ManualClock::new(wall_ms()));
    let db = Arc::new(Sqlite::memory(clock.clone()).unwrap());
    let issuer = Issuer::generate(ISS, AUD).unwrap();
    let opener = Arc::new(Opener(Mutex::new(Vec::new())));
    let state = ApiState {
        store: db.clone(),
        queue: db.clone(),
        verifier: issuer.verifier(),
        clock: clock.clone(),
        config: Arc::new(ApiConfig {
            glitchtip_hooks: vec![GlitchtipHook { org: "acme".into(), env: "prod".into(), token: HOOK_TOKEN.into() }],
            watch_poll_ms: 20,
            ..ApiConfig::default()
        }),
        opener: opener.clone(),
        jwks: Some(Arc::new(issuer.jwks())),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    Env { base, issuer, db, clock, opener }
}

impl Env {
    fn client(&self, user: &str, org: &str) -> ConnectClient {
        let now = jsonwebtoken::get_current_timestamp();
        let token = self.issuer.issue(user, org, "", now, 600).unwrap();
        ConnectClient::new(&self.base).with_header("authorization", format!("Bearer {token}")).unwrap()
    }

    async fn seed_run(&self, org: &str, state: &str) {
        let snapshot = serde_json::json!({
            "id": RUN, "org": org, "env": "prod", "generation": 1,
            "signal": {"source": "glitchtip", "fingerprint": "glitchtip:42", "title": "boom", "link": "https://gt/a/issues/42"},
            "stage": "review"
        });
        let first = serde_json::json!({"type": "opened", "at_ms": 1});
        let created = self
            .db
            .create_run(org, RUN, state, &serde_json::to_vec(&snapshot).unwrap(), &serde_json::to_vec(&first).unwrap(), 1)
            .await
            .unwrap();
        assert!(created);
    }

    /// A pending destructive approval requested by the bot on behalf of alice.
    async fn seed_approval(&self, org: &str) -> Item {
        let action = ApprovalAction {
            agent: "forgejo".into(),
            skill: "merge".into(),
            args: serde_json::json!({"number": 7, "head_sha": "abc"}),
            target_commit: Some("abc".into()),
        };
        let now = self.clock.now_ms();
        let approval = Approval {
            id: AP.into(),
            org: org.into(),
            run_id: RUN.into(),
            action_hash: loams_factory::action_hash(&action),
            action,
            summary: "Merge PR #7".into(),
            risk: "destructive".into(),
            requester: "agent:loams-bot".into(),
            on_behalf_of: Some("alice".into()),
            confirmation_phrase: Some("merge 7".into()),
            state: ApprovalState::Pending,
            expires_at_ms: now + loams_factory::approval::APPROVAL_TTL_MS,
            created_at_ms: now,
            decision: None,
        };
        let item = Item {
            org: org.into(),
            kind: "approval".into(),
            id: AP.into(),
            version: 0,
            index: Some("pending".into()),
            body: serde_json::to_vec(&approval).unwrap(),
            expires_ms: None,
        };
        self.db.put_item(&item, Cond::Absent).await.unwrap();
        self.db.get_item(org, "approval", AP).await.unwrap().unwrap()
    }

    async fn approval_item(&self, org: &str) -> Item {
        self.db.get_item(org, "approval", AP).await.unwrap().unwrap()
    }

    async fn queued(&self) -> Vec<Envelope> {
        let msgs = self.db.receive(10, 60_000).await.unwrap();
        msgs.iter().map(|d| serde_json::from_slice(&d.body).unwrap()).collect()
    }

    async fn webhook(&self, token: &str, body: Vec<u8>) -> reqwest::Response {
        reqwest::Client::new()
            .post(format!("{}/webhooks/glitchtip/{token}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
    }
}

fn key() -> EcdsaKeyPair {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
    EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref()).unwrap()
}

async fn register(c: &ConnectClient, id: &str, key: &EcdsaKeyPair) -> Result<pd::Device, ConnectError> {
    let req = pd::RegisterDeviceRequest {
        device_id: id.into(),
        public_key: key.public_key().as_ref().to_vec(),
        name: "phone".into(),
        push_token: String::new(),
        idempotency_key: format!("reg-{id}"),
    };
    c.unary("/loams.devices.v1.DeviceService/RegisterDevice", &req).await
}

async fn get_challenge(c: &ConnectClient, device: &str) -> Result<pa::GetChallengeResponse, ConnectError> {
    let req = pa::GetChallengeRequest { approval_id: AP.into(), device_id: device.into() };
    c.unary("/loams.approvals.v1.ApprovalService/GetChallenge", &req).await
}

/// A decide request signed the way a phone signs it.
async fn signed_decide(c: &ConnectClient, key: &EcdsaKeyPair, device: &str, confirmation: &str, idem: &str) -> pa::DecideRequest {
    let approval: pa::GetApprovalResponse =
        c.unary("/loams.approvals.v1.ApprovalService/GetApproval", &pa::GetApprovalRequest { approval_id: AP.into() }).await.unwrap();
    let hash = approval.approval.unwrap().action_hash;
    let challenge = get_challenge(c, device).await.unwrap().challenge;
    let at = wall_ms();
    let bytes = loams_proto::canonical_decision_bytes(AP, &hash, pa::Decision::Approve, device, &challenge, at);
    let sig = key.sign(&SystemRandom::new(), &bytes).unwrap();
    pa::DecideRequest {
        approval_id: AP.into(),
        decision: pa::Decision::Approve as i32,
        device_id: device.into(),
        challenge,
        decided_at_ms: at,
        signature: sig.as_ref().to_vec(),
        typed_confirmation: confirmation.into(),
        idempotency_key: idem.into(),
    }
}

async fn decide(c: &ConnectClient, req: &pa::DecideRequest) -> Result<pa::DecideResponse, ConnectError> {
    c.unary("/loams.approvals.v1.ApprovalService/Decide", req).await
}

fn code<T: std::fmt::Debug>(r: Result<T, ConnectError>) -> Code {
    r.expect_err("the call must fail").code
}

#[tokio::test]
async fn calls_without_a_valid_token_are_unauthenticated() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let anon = ConnectClient::new(&env.base);
    let get = pf::GetRunRequest { run_id: RUN.into() };
    assert_eq!(code(anon.unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get).await), Code::Unauthenticated);
    let garbage = ConnectClient::new(&env.base).with_header("authorization", "Bearer abc.def.ghi").unwrap();
    assert_eq!(
        code(garbage.unary::<_, pa::ListApprovalsResponse>("/loams.approvals.v1.ApprovalService/ListApprovals", &pa::ListApprovalsRequest::default()).await),
        Code::Unauthenticated
    );
    // A token from another issuer key.
    let stranger = Issuer::generate(ISS, AUD).unwrap();
    let token = stranger.issue("alice", "acme", "", jsonwebtoken::get_current_timestamp(), 600).unwrap();
    let forged = ConnectClient::new(&env.base).with_header("authorization", format!("Bearer {token}")).unwrap();
    assert_eq!(code(forged.unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get).await), Code::Unauthenticated);
    // The right token works.
    let ok: pf::GetRunResponse = env.client("alice", "acme").unary("/loams.factory.v1.FactoryService/GetRun", &get).await.unwrap();
    assert_eq!(ok.run.unwrap().id, RUN);
    // The JWKS is served for other verifiers.
    let jwks: serde_json::Value = reqwest::get(format!("{}/.well-known/jwks.json", env.base)).await.unwrap().json().await.unwrap();
    assert_eq!(jwks["keys"][0]["kty"], "EC");
    // A verifier elsewhere fetches that JWKS and accepts the issuer's tokens, for the configured iss/aud only.
    let fetched = loams_api::Verifier::fetch(&format!("{}/.well-known/jwks.json", env.base), ISS, AUD).await.unwrap();
    let token = env.issuer.issue("alice", "acme", "", jsonwebtoken::get_current_timestamp(), 600).unwrap();
    assert_eq!(fetched.verify(&token).await.unwrap().org, "acme");
    let other_aud = loams_api::Verifier::fetch(&format!("{}/.well-known/jwks.json", env.base), ISS, "other").await.unwrap();
    assert!(other_aud.verify(&token).await.is_err());
    assert!(loams_api::Verifier::fetch(&format!("{}/nope", env.base), ISS, AUD).await.is_err());
}

#[tokio::test]
async fn runs_timeline_and_watch() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let list: pf::ListRunsResponse = c.unary("/loams.factory.v1.FactoryService/ListRuns", &pf::ListRunsRequest::default()).await.unwrap();
    assert_eq!(list.runs.len(), 1);
    let run = &list.runs[0];
    assert_eq!((run.state.as_str(), run.stage.as_str(), run.version), ("waiting", "review", 1));
    assert_eq!(run.signal.as_ref().unwrap().fingerprint, "glitchtip:42");

    let tl: pf::GetTimelineResponse = c
        .unary("/loams.factory.v1.FactoryService/GetTimeline", &pf::GetTimelineRequest { run_id: RUN.into(), after_seq: 0, page_size: 0 })
        .await
        .unwrap();
    assert_eq!(tl.events.len(), 1);
    assert_eq!((tl.events[0].seq, tl.events[0].r#type.as_str()), (1, "opened"));
    assert!(!tl.has_more);

    // Watch: snapshot, the existing event, then one appended later; the stream ends when the run is finished.
    let stream = c.server_stream::<_, pf::WatchRunResponse>(
        "/loams.factory.v1.FactoryService/WatchRun",
        &pf::WatchRunRequest { run_id: RUN.into(), after_seq: 0 },
    );
    let db = env.db.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let ev = serde_json::to_vec(&serde_json::json!({"type": "run_killed", "reason": "stop"})).unwrap();
        db.append("acme", RUN, 1, "killed", b"{\"stage\":\"review\"}", &[ev], 2).await.unwrap();
    });
    let items: Vec<_> = tokio::time::timeout(std::time::Duration::from_secs(10), stream.collect::<Vec<_>>()).await.unwrap();
    let items: Vec<_> = items.into_iter().map(Result::unwrap).collect();
    use pf::watch_run_response::Item as W;
    assert!(matches!(&items[0].item, Some(W::Snapshot(r)) if r.id == RUN));
    let seqs: Vec<u64> = items[1..].iter().map(|i| match &i.item { Some(W::Event(e)) => e.seq, _ => 0 }).collect();
    assert_eq!(seqs, vec![1, 2]);
}

#[tokio::test]
async fn org_a_cannot_read_kill_or_approve_org_b_things() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let before = env.seed_approval("acme").await;
    let mallory = env.client("mallory", "umbrella");
    let run = pf::GetRunRequest { run_id: RUN.into() };
    assert_eq!(code(mallory.unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &run).await), Code::NotFound);
    let tl = pf::GetTimelineRequest { run_id: RUN.into(), after_seq: 0, page_size: 0 };
    assert_eq!(code(mallory.unary::<_, pf::GetTimelineResponse>("/loams.factory.v1.FactoryService/GetTimeline", &tl).await), Code::NotFound);
    let list: pf::ListRunsResponse = mallory.unary("/loams.factory.v1.FactoryService/ListRuns", &pf::ListRunsRequest::default()).await.unwrap();
    assert!(list.runs.is_empty());
    let kill = pf::KillRunRequest { run_id: RUN.into(), reason: "x".into(), idempotency_key: "k1".into() };
    assert_eq!(code(mallory.unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &kill).await), Code::NotFound);
    assert!(env.db.get_item("acme", "kill", &format!("run:{RUN}")).await.unwrap().is_none());
    let mut watch = Box::pin(mallory.server_stream::<_, pf::WatchRunResponse>(
        "/loams.factory.v1.FactoryService/WatchRun",
        &pf::WatchRunRequest { run_id: RUN.into(), after_seq: 0 },
    ));
    assert_eq!(watch.next().await.unwrap().unwrap_err().code, Code::NotFound);

    let get = pa::GetApprovalRequest { approval_id: AP.into() };
    assert_eq!(code(mallory.unary::<_, pa::GetApprovalResponse>("/loams.approvals.v1.ApprovalService/GetApproval", &get).await), Code::NotFound);
    let all: pa::ListApprovalsResponse =
        mallory.unary("/loams.approvals.v1.ApprovalService/ListApprovals", &pa::ListApprovalsRequest::default()).await.unwrap();
    assert!(all.approvals.is_empty());
    // Mallory's own registered device still cannot decide acme's approval.
    let k = key();
    register(&mallory, "mallory-phone", &k).await.unwrap();
    assert_eq!(code(get_challenge(&mallory, "mallory-phone").await), Code::NotFound);
    let challenge = vec![7u8; 32];
    let bytes = loams_proto::canonical_decision_bytes(AP, &[0; 32], pa::Decision::Approve, "mallory-phone", &challenge, 1);
    let req = pa::DecideRequest {
        approval_id: AP.into(),
        decision: pa::Decision::Approve as i32,
        device_id: "mallory-phone".into(),
        challenge,
        decided_at_ms: 1,
        signature: k.sign(&SystemRandom::new(), &bytes).unwrap().as_ref().to_vec(),
        typed_confirmation: "merge 7".into(),
        idempotency_key: "d1".into(),
    };
    assert_eq!(code(decide(&mallory, &req).await), Code::NotFound);
    assert_eq!(env.approval_item("acme").await, before);
    assert!(env.queued().await.is_empty());
    // Acme's own user sees it.
    let own: pa::GetApprovalResponse = env.client("bob", "acme").unary("/loams.approvals.v1.ApprovalService/GetApproval", &get).await.unwrap();
    assert_eq!(own.approval.unwrap().state, pa::ApprovalState::Pending as i32);
}

#[tokio::test]
async fn register_and_revoke_devices() {
    let env = start().await;
    let bob = env.client("bob", "acme");
    let k = key();
    let dev = register(&bob, "bob-phone", &k).await.unwrap();
    assert_eq!((dev.device_id.as_str(), dev.user.as_str(), dev.revoked_at_ms), ("bob-phone", "bob", 0));
    assert_eq!(dev.public_key, k.public_key().as_ref());
    // The same idempotency key replays the answer; a new key for the same id is a conflict.
    assert_eq!(register(&bob, "bob-phone", &k).await.unwrap(), dev);
    let again = pd::RegisterDeviceRequest {
        device_id: "bob-phone".into(),
        public_key: k.public_key().as_ref().to_vec(),
        name: "x".into(),
        push_token: String::new(),
        idempotency_key: "other".into(),
    };
    assert_eq!(code(bob.unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &again).await), Code::AlreadyExists);
    // Not a P-256 point.
    let bad = pd::RegisterDeviceRequest { device_id: "x".into(), public_key: vec![4; 65], idempotency_key: "b".into(), ..again.clone() };
    assert_eq!(code(bob.unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &bad).await), Code::InvalidArgument);
    // A server-assigned id.
    let auto = pd::RegisterDeviceRequest { device_id: String::new(), idempotency_key: "auto".into(), ..again.clone() };
    let auto: pd::Device = bob.unary("/loams.devices.v1.DeviceService/RegisterDevice", &auto).await.unwrap();
    assert!(auto.device_id.starts_with("dev-"));

    // Only the owner revokes.
    let revoke = pd::RevokeDeviceRequest { device_id: "bob-phone".into(), idempotency_key: "r1".into() };
    let carol = env.client("carol", "acme");
    assert_eq!(code(carol.unary::<_, pd::RevokeDeviceResponse>("/loams.devices.v1.DeviceService/RevokeDevice", &revoke).await), Code::NotFound);
    let r: pd::RevokeDeviceResponse = bob.unary("/loams.devices.v1.DeviceService/RevokeDevice", &revoke).await.unwrap();
    assert!(r.device.unwrap().revoked_at_ms > 0);
}

#[tokio::test]
async fn signed_decision_settles_the_approval_and_tells_the_run() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let k = key();
    register(&bob, "bob-phone", &k).await.unwrap();
    let pending: pa::ListApprovalsResponse = bob
        .unary("/loams.approvals.v1.ApprovalService/ListApprovals", &pa::ListApprovalsRequest { state: pa::ApprovalState::Pending as i32, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(pending.approvals.len(), 1);

    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "decide-1").await;
    let resp = decide(&bob, &req).await.unwrap();
    let shown = resp.approval.clone().unwrap();
    assert_eq!(shown.state, pa::ApprovalState::Approved as i32);
    assert_eq!(shown.decision, pa::Decision::Approve as i32);
    assert_eq!(shown.decided_by, "bob");

    let stored: Approval = serde_json::from_slice(&env.approval_item("acme").await.body).unwrap();
    assert_eq!(stored.state, ApprovalState::Approved);
    let proof = stored.decision.unwrap();
    assert_eq!((proof.device_id.as_str(), proof.signature.as_slice()), ("bob-phone", req.signature.as_slice()));

    // The same call again (a retry) answers the same and enqueues nothing more.
    assert_eq!(decide(&bob, &req).await.unwrap(), resp);
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1);
    assert_eq!((queued[0].org.as_str(), queued[0].run.as_str()), ("acme", RUN));
    assert_eq!(
        queued[0].input,
        Some(Input::ApprovalSettled { approval_id: AP.into(), approved: true, by: "bob".into() })
    );
    // Off the pending list.
    let pending: pa::ListApprovalsResponse = bob
        .unary("/loams.approvals.v1.ApprovalService/ListApprovals", &pa::ListApprovalsRequest { state: pa::ApprovalState::Pending as i32, ..Default::default() })
        .await
        .unwrap();
    assert!(pending.approvals.is_empty());
    // The identical signed decision under a new idempotency key is recognised as the recorded one (it only
    // re-tells the run, which drops the duplicate); any other decision on the settled approval is refused.
    let replay = pa::DecideRequest { idempotency_key: "decide-2".into(), ..req.clone() };
    assert_eq!(decide(&bob, &replay).await.unwrap().approval.unwrap().state, pa::ApprovalState::Approved as i32);
    let mut other = pa::DecideRequest { idempotency_key: "decide-3".into(), ..req };
    other.decision = pa::Decision::Deny as i32;
    other.signature = k.sign(&SystemRandom::new(), b"deny").unwrap().as_ref().to_vec();
    assert_eq!(code(decide(&bob, &other).await), Code::FailedPrecondition);
    assert_eq!(code(get_challenge(&bob, "bob-phone").await), Code::FailedPrecondition);
    let stored: Approval = serde_json::from_slice(&env.approval_item("acme").await.body).unwrap();
    assert_eq!(stored.state, ApprovalState::Approved);
}

/// Each refusal: the expected error, and the approval and the queue exactly as before.
#[tokio::test]
async fn refused_decisions_change_nothing() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let before = env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let k = key();
    register(&bob, "bob-phone", &k).await.unwrap();

    let assert_unchanged = |label: &'static str| {
        let env = &env;
        let before = before.clone();
        async move {
            assert_eq!(env.approval_item("acme").await, before, "{label}: approval changed");
            assert!(env.queued().await.is_empty(), "{label}: something was enqueued");
        }
    };

    // Bad signature: signed by another key.
    let mut req = signed_decide(&bob, &k, "bob-phone", "merge 7", "bad-sig").await;
    req.signature = key().sign(&SystemRandom::new(), b"something else").unwrap().as_ref().to_vec();
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("bad signature").await;
    // Signed approve, sent as deny.
    let mut req = signed_decide(&bob, &k, "bob-phone", "", "flip").await;
    req.decision = pa::Decision::Deny as i32;
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("flipped decision").await;

    // Wrong confirmation phrase.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 8", "confirm").await;
    assert_eq!(code(decide(&bob, &req).await), Code::InvalidArgument);
    assert_unchanged("confirmation").await;

    // Reused challenge: a challenge already consumed (as by a concurrent decision) cannot pass again.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "reuse").await;
    let cid = hex::encode(&req.challenge);
    let item = env.db.get_item("acme", "challenge", &cid).await.unwrap().unwrap();
    let mut ch: serde_json::Value = serde_json::from_slice(&item.body).unwrap();
    ch["used"] = true.into();
    env.db.put_item(&Item { body: serde_json::to_vec(&ch).unwrap(), ..item.clone() }, Cond::Version(item.version)).await.unwrap();
    assert_eq!(code(decide(&bob, &req).await), Code::FailedPrecondition);
    assert_unchanged("reused challenge").await;

    // Self-approval: alice, on whose behalf the agent acts, has a valid device of her own.
    let alice = env.client("alice", "acme");
    let ka = key();
    register(&alice, "alice-phone", &ka).await.unwrap();
    let req = signed_decide(&alice, &ka, "alice-phone", "merge 7", "self").await;
    assert_eq!(code(decide(&alice, &req).await), Code::PermissionDenied);
    assert_unchanged("self approval").await;

    // Someone else's device.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "theft").await;
    assert_eq!(code(decide(&env.client("carol", "acme"), &req).await), Code::PermissionDenied);
    assert_unchanged("foreign device").await;

    // Revoked device: the challenge is taken before the revocation, the decision after it.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "revoked").await;
    let rev = pd::RevokeDeviceRequest { device_id: "bob-phone".into(), idempotency_key: "rev".into() };
    bob.unary::<_, pd::RevokeDeviceResponse>("/loams.devices.v1.DeviceService/RevokeDevice", &rev).await.unwrap();
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("revoked device").await;

    // Expired: a fresh device, a valid signature, but the approval's 72 h are over.
    let k2 = key();
    register(&bob, "bob-phone-2", &k2).await.unwrap();
    let req = signed_decide(&bob, &k2, "bob-phone-2", "merge 7", "late").await;
    env.clock.advance(73 * 60 * 60 * 1000);
    assert_eq!(code(decide(&bob, &req).await), Code::FailedPrecondition);
    assert_unchanged("expired").await;
    let shown: pa::GetApprovalResponse =
        bob.unary("/loams.approvals.v1.ApprovalService/GetApproval", &pa::GetApprovalRequest { approval_id: AP.into() }).await.unwrap();
    assert_eq!(shown.approval.unwrap().state, pa::ApprovalState::Expired as i32);
}

#[tokio::test]
async fn kill_run_sets_the_switch_once() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let kill = pf::KillRunRequest { run_id: RUN.into(), reason: "wrong fix".into(), idempotency_key: "kill-1".into() };
    let resp: pf::KillRunResponse = c.unary("/loams.factory.v1.FactoryService/KillRun", &kill).await.unwrap();
    assert_eq!(resp.run.unwrap().id, RUN);
    let again: pf::KillRunResponse = c.unary("/loams.factory.v1.FactoryService/KillRun", &kill).await.unwrap();
    assert_eq!(again.run.unwrap().id, RUN);
    let switch = env.db.get_item("acme", "kill", &format!("run:{RUN}")).await.unwrap().unwrap();
    let switch: loams_api::KillSwitch = serde_json::from_slice(&switch.body).unwrap();
    assert_eq!((switch.reason.as_str(), switch.by.as_str()), ("wrong fix", "alice"));
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1, "a repeated kill must not enqueue twice");
    assert_eq!(queued[0].input, Some(Input::Kill { by: "alice".into(), reason: "wrong fix".into() }));
    // A write without an idempotency key is refused.
    let nokey = pf::KillRunRequest { idempotency_key: String::new(), ..kill };
    assert_eq!(code(c.unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &nokey).await), Code::InvalidArgument);
}

fn alert(issue: u32) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "alias": "GlitchTip", "text": "GlitchTip Alert",
        "attachments": [{"title": "ZeroDivisionError", "title_link": format!("https://gt.example/acme/issues/{issue}"),
                         "text": "checkout", "color": "#e52b50", "fields": [], "mrkdown_in": ["text"]}]
    }))
    .unwrap()
}

#[tokio::test]
async fn glitchtip_webhook_opens_a_run_once() {
    let env = start().await;
    let wrong = env.webhook("hook-token-0123456789abcdeX", alert(42)).await;
    assert_eq!(wrong.status(), 404);
    assert!(env.opener.0.lock().unwrap().is_empty());

    let mut big = alert(42);
    big.extend(std::iter::repeat_n(b' ', loams_api::MAX_WEBHOOK_BYTES));
    assert_eq!(env.webhook(HOOK_TOKEN, big).await.status(), 413);
    assert_eq!(env.webhook(HOOK_TOKEN, b"{\"attachments\":[]}".to_vec()).await.status(), 400);
    assert!(env.opener.0.lock().unwrap().is_empty());

    let first = env.webhook(HOOK_TOKEN, alert(42)).await;
    assert_eq!(first.status(), 202);
    let body: serde_json::Value = first.json().await.unwrap();
    assert_eq!(body["run"], loams_factory::run_id("acme", "glitchtip:42", 1));
    let dup = env.webhook(HOOK_TOKEN, alert(42)).await;
    assert_eq!(dup.status(), 200);
    {
        let opened = env.opener.0.lock().unwrap();
        assert_eq!(opened.len(), 1);
        let (org, envname, signal) = &opened[0];
        assert_eq!((org.as_str(), envname.as_str()), ("acme", "prod"));
        assert_eq!((signal.fingerprint.as_str(), signal.glitchtip_issue_id.as_deref()), ("glitchtip:42", Some("42")));
    }
    assert_eq!(env.webhook(HOOK_TOKEN, alert(43)).await.status(), 202);
    assert_eq!(env.opener.0.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn concurrent_decisions_over_one_challenge_settle_once() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let k = key();
    register(&bob, "bob-phone", &k).await.unwrap();
    let a = signed_decide(&bob, &k, "bob-phone", "merge 7", "race-a").await;
    // A second signature over the same bytes (ECDSA signatures differ each time): a distinct request, same challenge.
    let bytes = loams_proto::canonical_decision_bytes(
        AP,
        &hex::decode(loams_factory::action_hash(&serde_json::from_slice::<Approval>(&env.approval_item("acme").await.body).unwrap().action)).unwrap(),
        pa::Decision::Approve,
        "bob-phone",
        &a.challenge,
        a.decided_at_ms,
    );
    let b = pa::DecideRequest {
        signature: k.sign(&SystemRandom::new(), &bytes).unwrap().as_ref().to_vec(),
        idempotency_key: "race-b".into(),
        ..a.clone()
    };
    assert_ne!(a.signature, b.signature);
    let (ra, rb) = tokio::join!(decide(&bob, &a), decide(&bob, &b));
    assert_eq!(u8::from(ra.is_ok()) + u8::from(rb.is_ok()), 1, "exactly one decision passes: {ra:?} {rb:?}");
    assert_eq!(env.queued().await.len(), 1);
}
