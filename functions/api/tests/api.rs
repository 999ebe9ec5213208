//! The API over real HTTP: loams-proto's Connect client against the router, on the SQLite store in memory.

use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
use futures::StreamExt;
use loams_api::{ApiConfig, ApiError, ApiState, GlitchtipHook, Issuer, RunOpener, router};
use loams_factory::approval::{Approval, ApprovalAction, ApprovalState, Challenge};
use loams_factory::{Envelope, Input, Signal};
use loams_platform::race::RaceBeforeWrite;
use loams_platform::{Clock, Cond, Counting, Item, ManualClock, Page, Queue, Sqlite, Store};
use loams_proto::approvals::v1 as pa;
use loams_proto::connect::{Code, Codec, ConnectClient, ConnectError};
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
        // Issue 90 is in cooldown; issue 91's opener is down.
        match signal.fingerprint.as_str() {
            "glitchtip:90" => {
                return Err(ApiError::FailedPrecondition(
                    "fingerprint in cooldown until 99".into(),
                ));
            }
            "glitchtip:91" => return Err(ApiError::Unavailable("store busy".into())),
            _ => {}
        }
        let id = loams_factory::run_id(org, &signal.fingerprint, signal.generation);
        self.0
            .lock()
            .unwrap()
            .push((org.into(), env.into(), signal));
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
    start_with(
        ApiConfig {
            watch_poll_ms: 20,
            ..ApiConfig::default()
        },
        None,
    )
    .await
}

/// Wraps the test's store (to inject races).
type WrapStore = fn(Arc<Sqlite>) -> Arc<dyn Store>;

/// The API on an in-memory store; `store` wraps that store when given.
async fn start_with(config: ApiConfig, store: Option<WrapStore>) -> Env {
    let clock = Arc::new(ManualClock::new(wall_ms()));
    let db = Arc::new(Sqlite::memory(clock.clone()).unwrap());
    let issuer = Issuer::generate(ISS, AUD).unwrap();
    let opener = Arc::new(Opener(Mutex::new(Vec::new())));
    let state = ApiState {
        store: store.map_or_else(|| db.clone() as Arc<dyn Store>, |wrap| wrap(db.clone())),
        queue: db.clone(),
        verifier: issuer.verifier(),
        clock: clock.clone(),
        config: Arc::new(ApiConfig {
            glitchtip_hooks: vec![GlitchtipHook {
                org: "acme".into(),
                env: "prod".into(),
                token: HOOK_TOKEN.into(),
                origin: "https://gt.example".into(),
            }],
            ..config
        }),
        opener: opener.clone(),
        jwks: Some(Arc::new(issuer.jwks())),
        collab: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    Env {
        base,
        issuer,
        db,
        clock,
        opener,
    }
}

impl Env {
    /// A client whose token grants every scope.
    fn client(&self, user: &str, org: &str) -> ConnectClient {
        self.client_with(user, org, loams_api::scope::ALL)
    }

    fn client_with(&self, user: &str, org: &str, scope: &str) -> ConnectClient {
        let now = jsonwebtoken::get_current_timestamp();
        let token = self.issuer.issue(user, org, scope, now, 600).unwrap();
        ConnectClient::new(&self.base)
            .with_header("authorization", format!("Bearer {token}"))
            .unwrap()
    }

    /// Run `RUN` as the engine opens it, moved on to the review stage, with its opening event as event 1.
    async fn seed_run(&self, org: &str, state: &str) {
        self.seed_run_at(
            org,
            state,
            loams_factory::Stage::Review,
            loams_factory::Cursor::LeadReview,
        )
        .await;
    }

    /// Run `RUN` at another point of its loop (for example waiting for triage).
    async fn seed_run_at(
        &self,
        org: &str,
        state: &str,
        stage: loams_factory::Stage,
        cursor: loams_factory::Cursor,
    ) {
        let (snapshot, first) = run_snapshot(org, stage, cursor);
        let created = self
            .db
            .create_run(org, RUN, state, &snapshot, &first, 1)
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
        self.db
            .get_item(org, "approval", AP)
            .await
            .unwrap()
            .unwrap()
    }

    async fn challenges(&self, org: &str) -> Vec<Item> {
        self.db
            .list_items(org, "challenge", None, Page::first(100))
            .await
            .unwrap()
            .items
    }

    async fn approval_item(&self, org: &str) -> Item {
        self.db
            .get_item(org, "approval", AP)
            .await
            .unwrap()
            .unwrap()
    }

    async fn queued(&self) -> Vec<Envelope> {
        let msgs = self.db.receive(10, 60_000).await.unwrap();
        msgs.iter()
            .map(|d| serde_json::from_slice(&d.body).unwrap())
            .collect()
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

/// A real factory run (and its logged opening event) with the id `RUN`, at `stage` and `cursor`, with a PR.
fn run_snapshot(
    org: &str,
    stage: loams_factory::Stage,
    cursor: loams_factory::Cursor,
) -> (Vec<u8>, Vec<u8>) {
    let signal = Signal {
        source: "glitchtip".into(),
        fingerprint: "glitchtip:42".into(),
        title: "boom".into(),
        link: "https://gt.example/a/issues/42".into(),
        glitchtip_issue_id: Some("42".into()),
        severity: "error".into(),
        generation: 1,
        parent_run: None,
    };
    let (mut run, opened) =
        loams_factory::open(signal, &loams_factory::Ctx::new(org, "prod", 1)).unwrap();
    // The seeded rows use a fixed id so every test can name the run.
    run.id = RUN.into();
    run.stage = stage;
    run.cursor = cursor;
    run.links.pr_url = Some("https://forgejo.example/acme/shop/pulls/7".into());
    let mut logged = serde_json::to_value(&opened).unwrap();
    logged["at_ms"] = 1.into();
    logged["stage"] = "triage".into();
    logged["summary"] = opened.summary().into();
    (
        serde_json::to_vec(&run).unwrap(),
        serde_json::to_vec(&logged).unwrap(),
    )
}

fn key() -> EcdsaKeyPair {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
    EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref()).unwrap()
}

async fn register(
    c: &ConnectClient,
    id: &str,
    key: &EcdsaKeyPair,
) -> Result<pd::Device, ConnectError> {
    let req = pd::RegisterDeviceRequest {
        device_id: id.into(),
        public_key: key.public_key().as_ref().to_vec(),
        name: "phone".into(),
        push_token: String::new(),
        idempotency_key: format!("reg-{id}"),
    };
    c.unary("/loams.devices.v1.DeviceService/RegisterDevice", &req)
        .await
}

async fn get_challenge(
    c: &ConnectClient,
    device: &str,
) -> Result<pa::GetChallengeResponse, ConnectError> {
    let req = pa::GetChallengeRequest {
        approval_id: AP.into(),
        device_id: device.into(),
    };
    c.unary("/loams.approvals.v1.ApprovalService/GetChallenge", &req)
        .await
}

/// A decide request signed the way a phone signs it.
async fn signed_decide(
    c: &ConnectClient,
    key: &EcdsaKeyPair,
    device: &str,
    confirmation: &str,
    idem: &str,
) -> pa::DecideRequest {
    signed_decide_at(c, key, device, confirmation, idem, wall_ms()).await
}

/// A decide request signed as decided at `at`.
async fn signed_decide_at(
    c: &ConnectClient,
    key: &EcdsaKeyPair,
    device: &str,
    confirmation: &str,
    idem: &str,
    at: i64,
) -> pa::DecideRequest {
    let approval: pa::GetApprovalResponse = c
        .unary(
            "/loams.approvals.v1.ApprovalService/GetApproval",
            &pa::GetApprovalRequest {
                approval_id: AP.into(),
            },
        )
        .await
        .unwrap();
    let hash = approval.approval.unwrap().action_hash;
    let challenge = get_challenge(c, device).await.unwrap().challenge;
    let bytes = loams_proto::canonical_decision_bytes(
        AP,
        &hash,
        pa::Decision::Approve,
        device,
        &challenge,
        at,
    );
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

async fn decide(
    c: &ConnectClient,
    req: &pa::DecideRequest,
) -> Result<pa::DecideResponse, ConnectError> {
    c.unary("/loams.approvals.v1.ApprovalService/Decide", req)
        .await
}

const KILL_RUN: &str = "/loams.factory.v1.FactoryService/KillRun";

async fn get_kill_challenge(
    c: &ConnectClient,
    device: &str,
) -> Result<pf::GetKillChallengeResponse, ConnectError> {
    let req = pf::GetKillChallengeRequest {
        run_id: RUN.into(),
        device_id: device.into(),
    };
    c.unary("/loams.factory.v1.FactoryService/GetKillChallenge", &req)
        .await
}

/// A kill of `RUN` signed the way a phone signs it, over a fresh kill challenge.
async fn signed_kill(
    c: &ConnectClient,
    key: &EcdsaKeyPair,
    device: &str,
    reason: &str,
    idem: &str,
) -> pf::KillRunRequest {
    let challenge = get_kill_challenge(c, device).await.unwrap().challenge;
    let mut req = pf::KillRunRequest {
        run_id: RUN.into(),
        reason: reason.into(),
        idempotency_key: idem.into(),
        device_id: device.into(),
        challenge,
        killed_at_ms: wall_ms(),
        signature: Vec::new(),
    };
    sign_kill(key, &mut req);
    req
}

/// Signs `req` as it stands, with `key`.
fn sign_kill(key: &EcdsaKeyPair, req: &mut pf::KillRunRequest) {
    let bytes = loams_proto::canonical_kill_bytes(
        &req.run_id,
        &req.reason,
        &req.device_id,
        &req.challenge,
        req.killed_at_ms,
    );
    req.signature = key
        .sign(&SystemRandom::new(), &bytes)
        .unwrap()
        .as_ref()
        .to_vec();
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
    assert_eq!(
        code(
            anon.unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get)
                .await
        ),
        Code::Unauthenticated
    );
    let garbage = ConnectClient::new(&env.base)
        .with_header("authorization", "Bearer abc.def.ghi")
        .unwrap();
    assert_eq!(
        code(
            garbage
                .unary::<_, pa::ListApprovalsResponse>(
                    "/loams.approvals.v1.ApprovalService/ListApprovals",
                    &pa::ListApprovalsRequest::default()
                )
                .await
        ),
        Code::Unauthenticated
    );
    // A token from another issuer key.
    let stranger = Issuer::generate(ISS, AUD).unwrap();
    let token = stranger
        .issue(
            "alice",
            "acme",
            "",
            jsonwebtoken::get_current_timestamp(),
            600,
        )
        .unwrap();
    let forged = ConnectClient::new(&env.base)
        .with_header("authorization", format!("Bearer {token}"))
        .unwrap();
    assert_eq!(
        code(
            forged
                .unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get)
                .await
        ),
        Code::Unauthenticated
    );
    // The right token works.
    let ok: pf::GetRunResponse = env
        .client("alice", "acme")
        .unary("/loams.factory.v1.FactoryService/GetRun", &get)
        .await
        .unwrap();
    assert_eq!(ok.run.unwrap().id, RUN);
    // The JWKS is served for other verifiers.
    let jwks: serde_json::Value = reqwest::get(format!("{}/.well-known/jwks.json", env.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(jwks["keys"][0]["kty"], "EC");
    // A verifier elsewhere fetches that JWKS and accepts the issuer's tokens, for the configured iss/aud only.
    let fetched =
        loams_api::Verifier::fetch(&format!("{}/.well-known/jwks.json", env.base), ISS, AUD)
            .await
            .unwrap();
    let token = env
        .issuer
        .issue(
            "alice",
            "acme",
            "",
            jsonwebtoken::get_current_timestamp(),
            600,
        )
        .unwrap();
    assert_eq!(fetched.verify(&token).await.unwrap().org, "acme");
    let other_aud =
        loams_api::Verifier::fetch(&format!("{}/.well-known/jwks.json", env.base), ISS, "other")
            .await
            .unwrap();
    assert!(other_aud.verify(&token).await.is_err());
    assert!(
        loams_api::Verifier::fetch(&format!("{}/nope", env.base), ISS, AUD)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn runs_timeline_and_watch() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let list: pf::ListRunsResponse = c
        .unary(
            "/loams.factory.v1.FactoryService/ListRuns",
            &pf::ListRunsRequest::default(),
        )
        .await
        .unwrap();
    assert_eq!(list.runs.len(), 1);
    let run = &list.runs[0];
    assert_eq!(
        (run.state.as_str(), run.stage.as_str(), run.version),
        ("waiting", "review", 1)
    );
    assert_eq!(
        (run.stage_state.as_str(), run.env.as_str()),
        ("lead_review", "prod")
    );
    assert_eq!(run.signal.as_ref().unwrap().fingerprint, "glitchtip:42");
    assert_eq!(
        run.links.as_ref().unwrap().pr,
        "https://forgejo.example/acme/shop/pulls/7"
    );

    let tl: pf::GetTimelineResponse = c
        .unary(
            "/loams.factory.v1.FactoryService/GetTimeline",
            &pf::GetTimelineRequest {
                run_id: RUN.into(),
                after_seq: 0,
                page_size: 0,
            },
        )
        .await
        .unwrap();
    assert_eq!(tl.events.len(), 1);
    assert_eq!(
        (
            tl.events[0].seq,
            tl.events[0].r#type.as_str(),
            tl.events[0].stage.as_str()
        ),
        (1, "opened", "triage")
    );
    assert!(
        tl.events[0]
            .summary
            .starts_with("run opened from glitchtip"),
        "{}",
        tl.events[0].summary
    );
    assert!(!tl.has_more);

    // Watch: snapshot, the existing event, then one appended later; the stream ends when the run is finished.
    let db = env.db.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let ev = serde_json::to_vec(&serde_json::json!({"type": "run_killed", "reason": "stop"}))
            .unwrap();
        let (snapshot, _) = run_snapshot(
            "acme",
            loams_factory::Stage::Review,
            loams_factory::Cursor::LeadReview,
        );
        db.append("acme", RUN, 1, "killed", &snapshot, &[ev], 2)
            .await
            .unwrap();
    });
    let items = watch_to_end(&c, 0).await;
    use pf::watch_run_response::Item as W;
    assert!(matches!(&items[0].item, Some(W::Snapshot(r)) if r.id == RUN));
    assert_eq!(event_seqs(&items), vec![1, 2]);
    assert_eq!(items.len(), 3, "nothing but the snapshot and the events");
}

/// Watches `RUN` from `after_seq` until the server ends the stream (the run ended, or the watch's lifetime did),
/// each item unwrapped.
async fn watch_to_end(c: &ConnectClient, after_seq: u64) -> Vec<pf::WatchRunResponse> {
    let stream = c.server_stream::<_, pf::WatchRunResponse>(
        "/loams.factory.v1.FactoryService/WatchRun",
        &pf::WatchRunRequest {
            run_id: RUN.into(),
            after_seq,
        },
    );
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stream.collect::<Vec<_>>(),
    )
    .await
    .expect("the server ends every watch")
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// The seqs of the events among a watch's items, in the order they came.
fn event_seqs(items: &[pf::WatchRunResponse]) -> Vec<u64> {
    use pf::watch_run_response::Item as W;
    items
        .iter()
        .filter_map(|i| match &i.item {
            Some(W::Event(e)) => Some(e.seq),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_timeline_of_large_events_comes_in_pages_each_client_can_read() {
    // Events that carry the files a fix read or changed can be up to 400 KB; 200 of them in one page would be
    // far past a Connect client's 1 MiB message limit. The page ends early and says that more follow.
    // The store is counted, to see how many reads a page takes.
    static COUNTED: OnceLock<Arc<Counting<Sqlite>>> = OnceLock::new();
    let wrap: WrapStore = |inner| {
        COUNTED
            .get_or_init(|| Arc::new(Counting::new((*inner).clone())))
            .clone()
    };
    let env = start_with(ApiConfig::default(), Some(wrap)).await;
    let counted = COUNTED.get().unwrap();
    env.seed_run("acme", "waiting").await;
    // Quotes double in the JSON codec, which escapes the event's text.
    let big = |i: usize| {
        serde_json::to_vec(&serde_json::json!({
            "type": "files_read", "summary": format!("read file {i}"), "pad": "\"".repeat(190_000)
        }))
        .unwrap()
    };
    // Each event is a version: the run is at 1 after its opening event, then at 3 and 5.
    for round in 0..3u64 {
        let events = [big(2 * round as usize), big(2 * round as usize + 1)];
        let (snapshot, _) = run_snapshot(
            "acme",
            loams_factory::Stage::Review,
            loams_factory::Cursor::LeadReview,
        );
        env.db
            .append("acme", RUN, 1 + 2 * round, "waiting", &snapshot, &events, 0)
            .await
            .unwrap();
    }
    for codec in [Codec::Proto, Codec::Json] {
        let c = env.client("alice", "acme").with_codec(codec);
        let (mut seqs, mut after, mut pages) = (Vec::new(), 0, 0);
        loop {
            let tl: pf::GetTimelineResponse = c
                .unary(
                    "/loams.factory.v1.FactoryService/GetTimeline",
                    &pf::GetTimelineRequest {
                        run_id: RUN.into(),
                        after_seq: after,
                        page_size: 200,
                    },
                )
                .await
                .unwrap_or_else(|e| panic!("{codec:?} page {pages}: {e}"));
            pages += 1;
            assert!(!tl.events.is_empty(), "{codec:?}");
            seqs.extend(tl.events.iter().map(|e| e.seq));
            after = tl.events.last().unwrap().seq;
            if !tl.has_more {
                break;
            }
        }
        assert_eq!(
            seqs,
            (1..=7).collect::<Vec<u64>>(),
            "{codec:?}: every event once, in order"
        );
        assert!(pages >= 3, "{codec:?}: {pages} pages");
    }
    // Small events: a page spans store reads of at most 25 events and at most one more than it still takes, to say
    // whether more follow. (after_seq, page_size) -> (first seq shown, events shown, has_more, store reads, events
    // read).
    let small: Vec<Vec<u8>> = (0..60)
        .map(|i| {
            serde_json::to_vec(&serde_json::json!({"type": "note", "summary": format!("n{i}")}))
                .unwrap()
        })
        .collect();
    let (snapshot, _) = run_snapshot(
        "acme",
        loams_factory::Stage::Review,
        loams_factory::Cursor::LeadReview,
    );
    env.db
        .append("acme", RUN, 7, "waiting", &snapshot, &small, 0)
        .await
        .unwrap();
    let c = env.client("alice", "acme");
    let cases = [
        ((7, 200), (8, 60, false, 3, 60)),
        ((7, 50), (8, 50, true, 3, 51)),
        ((17, 50), (18, 50, false, 3, 50)),
        ((67, 50), (68, 0, false, 1, 0)),
        // One large event asked for: two events read (the one shown, and one to say more follow), not 25.
        ((1, 1), (2, 1, true, 1, 2)),
    ];
    for ((after_seq, page_size), (first, shown, more, reads, read)) in cases {
        let before = counted.counts();
        let tl: pf::GetTimelineResponse = c
            .unary(
                "/loams.factory.v1.FactoryService/GetTimeline",
                &pf::GetTimelineRequest {
                    run_id: RUN.into(),
                    after_seq,
                    page_size,
                },
            )
            .await
            .unwrap();
        let seqs: Vec<u64> = tl.events.iter().map(|e| e.seq).collect();
        let case = format!("after {after_seq}, page of {page_size}");
        assert_eq!(seqs, (first..first + shown).collect::<Vec<u64>>(), "{case}");
        assert_eq!(tl.has_more, more, "{case}");
        let spent = counted.counts().since(&before);
        assert_eq!((spent.events, spent.events_read), (reads, read), "{case}");
    }

    // A watch of the ended run gets every event once, in order, refilled 25 at a time, and then ends.
    let ended =
        serde_json::to_vec(&serde_json::json!({"type": "run_killed", "reason": "stop"})).unwrap();
    env.db
        .append("acme", RUN, 67, "killed", &snapshot, &[ended], 0)
        .await
        .unwrap();
    let before = counted.counts();
    let items = watch_to_end(&c, 0).await;
    assert_eq!(event_seqs(&items), (1..=68).collect::<Vec<u64>>());
    let spent = counted.counts().since(&before);
    assert_eq!((spent.events, spent.events_read), (3, 68), "25 + 25 + 18");
    // The run's state is read once, for the snapshot: a run seen ended stays ended.
    assert_eq!(spent.get_run, 1);
}

#[tokio::test]
async fn org_a_cannot_read_kill_or_approve_org_b_things() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let before = env.seed_approval("acme").await;
    let mallory = env.client("mallory", "umbrella");
    let run = pf::GetRunRequest { run_id: RUN.into() };
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &run)
                .await
        ),
        Code::NotFound
    );
    let tl = pf::GetTimelineRequest {
        run_id: RUN.into(),
        after_seq: 0,
        page_size: 0,
    };
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::GetTimelineResponse>(
                    "/loams.factory.v1.FactoryService/GetTimeline",
                    &tl
                )
                .await
        ),
        Code::NotFound
    );
    let list: pf::ListRunsResponse = mallory
        .unary(
            "/loams.factory.v1.FactoryService/ListRuns",
            &pf::ListRunsRequest::default(),
        )
        .await
        .unwrap();
    assert!(list.runs.is_empty());
    let kill = pf::KillRunRequest {
        run_id: RUN.into(),
        reason: "x".into(),
        idempotency_key: "k1".into(),
        ..Default::default()
    };
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &kill)
                .await
        ),
        Code::NotFound
    );
    assert!(
        env.db
            .get_item("acme", "kill", &format!("run:{RUN}"))
            .await
            .unwrap()
            .is_none()
    );
    let mut watch = Box::pin(mallory.server_stream::<_, pf::WatchRunResponse>(
        "/loams.factory.v1.FactoryService/WatchRun",
        &pf::WatchRunRequest {
            run_id: RUN.into(),
            after_seq: 0,
        },
    ));
    assert_eq!(
        watch.next().await.unwrap().unwrap_err().code,
        Code::NotFound
    );

    let get = pa::GetApprovalRequest {
        approval_id: AP.into(),
    };
    assert_eq!(
        code(
            mallory
                .unary::<_, pa::GetApprovalResponse>(
                    "/loams.approvals.v1.ApprovalService/GetApproval",
                    &get
                )
                .await
        ),
        Code::NotFound
    );
    let all: pa::ListApprovalsResponse = mallory
        .unary(
            "/loams.approvals.v1.ApprovalService/ListApprovals",
            &pa::ListApprovalsRequest::default(),
        )
        .await
        .unwrap();
    assert!(all.approvals.is_empty());
    // Mallory's own registered device still cannot decide acme's approval.
    let k = key();
    register(&mallory, "mallory-phone", &k).await.unwrap();
    assert_eq!(
        code(get_challenge(&mallory, "mallory-phone").await),
        Code::NotFound
    );
    // Nor kill acme's run with it: no kill challenge for it, and a kill signed anyway is not found.
    assert_eq!(
        code(get_kill_challenge(&mallory, "mallory-phone").await),
        Code::NotFound
    );
    let mut kill = pf::KillRunRequest {
        run_id: RUN.into(),
        reason: "x".into(),
        idempotency_key: "k2".into(),
        device_id: "mallory-phone".into(),
        challenge: vec![7; 32],
        killed_at_ms: wall_ms(),
        signature: Vec::new(),
    };
    sign_kill(&k, &mut kill);
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::KillRunResponse>(KILL_RUN, &kill)
                .await
        ),
        Code::NotFound
    );
    for org in ["acme", "umbrella"] {
        let issued = env
            .db
            .list_items(org, "kill_challenge", None, Page::first(10))
            .await
            .unwrap();
        assert!(issued.items.is_empty(), "{org}: {:?}", issued.items);
    }
    let challenge = vec![7u8; 32];
    let bytes = loams_proto::canonical_decision_bytes(
        AP,
        &[0; 32],
        pa::Decision::Approve,
        "mallory-phone",
        &challenge,
        1,
    );
    let req = pa::DecideRequest {
        approval_id: AP.into(),
        decision: pa::Decision::Approve as i32,
        device_id: "mallory-phone".into(),
        challenge,
        decided_at_ms: 1,
        signature: k
            .sign(&SystemRandom::new(), &bytes)
            .unwrap()
            .as_ref()
            .to_vec(),
        typed_confirmation: "merge 7".into(),
        idempotency_key: "d1".into(),
    };
    assert_eq!(code(decide(&mallory, &req).await), Code::NotFound);
    assert_eq!(env.approval_item("acme").await, before);
    assert!(env.queued().await.is_empty());
    // Acme's own user sees it.
    let own: pa::GetApprovalResponse = env
        .client("bob", "acme")
        .unary("/loams.approvals.v1.ApprovalService/GetApproval", &get)
        .await
        .unwrap();
    assert_eq!(
        own.approval.unwrap().state,
        pa::ApprovalState::Pending as i32
    );
}

#[tokio::test]
async fn register_and_revoke_devices() {
    let env = start().await;
    let bob = env.client("bob", "acme");
    let k = key();
    let dev = register(&bob, "bob-phone", &k).await.unwrap();
    assert_eq!(
        (dev.device_id.as_str(), dev.user.as_str(), dev.revoked_at_ms),
        ("bob-phone", "bob", 0)
    );
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
    assert_eq!(
        code(
            bob.unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &again)
                .await
        ),
        Code::AlreadyExists
    );
    // Not a P-256 point.
    let bad = pd::RegisterDeviceRequest {
        device_id: "x".into(),
        public_key: vec![4; 65],
        idempotency_key: "b".into(),
        ..again.clone()
    };
    assert_eq!(
        code(
            bob.unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &bad)
                .await
        ),
        Code::InvalidArgument
    );
    // A server-assigned id.
    let auto = pd::RegisterDeviceRequest {
        device_id: String::new(),
        idempotency_key: "auto".into(),
        ..again.clone()
    };
    let auto: pd::Device = bob
        .unary("/loams.devices.v1.DeviceService/RegisterDevice", &auto)
        .await
        .unwrap();
    assert!(auto.device_id.starts_with("dev-"));

    // Only the owner revokes.
    let revoke = pd::RevokeDeviceRequest {
        device_id: "bob-phone".into(),
        idempotency_key: "r1".into(),
    };
    let carol = env.client("carol", "acme");
    assert_eq!(
        code(
            carol
                .unary::<_, pd::RevokeDeviceResponse>(
                    "/loams.devices.v1.DeviceService/RevokeDevice",
                    &revoke
                )
                .await
        ),
        Code::NotFound
    );
    let r: pd::RevokeDeviceResponse = bob
        .unary("/loams.devices.v1.DeviceService/RevokeDevice", &revoke)
        .await
        .unwrap();
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
        .unary(
            "/loams.approvals.v1.ApprovalService/ListApprovals",
            &pa::ListApprovalsRequest {
                state: pa::ApprovalState::Pending as i32,
                ..Default::default()
            },
        )
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
    assert_eq!(
        (proof.device_id.as_str(), proof.signature.as_slice()),
        ("bob-phone", req.signature.as_slice())
    );

    // The same call again (a retry) answers the same and enqueues nothing more.
    assert_eq!(decide(&bob, &req).await.unwrap(), resp);
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1);
    assert_eq!(
        (queued[0].org.as_str(), queued[0].run.as_str()),
        ("acme", RUN)
    );
    // A wake-up only: the worker takes the decision from the stored approval, never from a message.
    assert_eq!(queued[0].input, Some(Input::Continue));
    // Off the pending list.
    let pending: pa::ListApprovalsResponse = bob
        .unary(
            "/loams.approvals.v1.ApprovalService/ListApprovals",
            &pa::ListApprovalsRequest {
                state: pa::ApprovalState::Pending as i32,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(pending.approvals.is_empty());
    // The identical signed decision under a new idempotency key is recognised as the recorded one (it only
    // re-tells the run, which drops the duplicate); any other decision on the settled approval is refused.
    let replay = pa::DecideRequest {
        idempotency_key: "decide-2".into(),
        ..req.clone()
    };
    assert_eq!(
        decide(&bob, &replay).await.unwrap().approval.unwrap().state,
        pa::ApprovalState::Approved as i32
    );
    let mut other = pa::DecideRequest {
        idempotency_key: "decide-3".into(),
        ..req
    };
    other.decision = pa::Decision::Deny as i32;
    other.signature = k
        .sign(&SystemRandom::new(), b"deny")
        .unwrap()
        .as_ref()
        .to_vec();
    assert_eq!(code(decide(&bob, &other).await), Code::FailedPrecondition);
    assert_eq!(
        code(get_challenge(&bob, "bob-phone").await),
        Code::FailedPrecondition
    );
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

    // `challenges` are the challenge records as they were before the refused call.
    let assert_unchanged = |label: &'static str, challenges: Vec<Item>| {
        let env = &env;
        let before = before.clone();
        async move {
            assert_eq!(
                env.approval_item("acme").await,
                before,
                "{label}: approval changed"
            );
            assert_eq!(
                env.challenges("acme").await,
                challenges,
                "{label}: a challenge changed"
            );
            assert!(
                env.queued().await.is_empty(),
                "{label}: something was enqueued"
            );
        }
    };

    // Signed for a time the challenge did not exist yet, or far ahead of the server's clock.
    let ttl = ApiConfig::default().challenge_ttl_ms;
    for (label, at) in [
        ("before the challenge", wall_ms() - ttl - 120_000),
        ("in the future", wall_ms() + 120_000),
    ] {
        let req = signed_decide_at(&bob, &k, "bob-phone", "merge 7", label, at).await;
        let ch = env.challenges("acme").await;
        assert_eq!(
            code(decide(&bob, &req).await),
            Code::FailedPrecondition,
            "{label}"
        );
        assert_unchanged(label, ch).await;
    }

    // Bad signature: signed by another key.
    let mut req = signed_decide(&bob, &k, "bob-phone", "merge 7", "bad-sig").await;
    req.signature = key()
        .sign(&SystemRandom::new(), b"something else")
        .unwrap()
        .as_ref()
        .to_vec();
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("bad signature", ch).await;
    // Signed approve, sent as deny.
    let mut req = signed_decide(&bob, &k, "bob-phone", "", "flip").await;
    req.decision = pa::Decision::Deny as i32;
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("flipped decision", ch).await;

    // Wrong confirmation phrase.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 8", "confirm").await;
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::InvalidArgument);
    assert_unchanged("confirmation", ch).await;

    // Reused challenge: a challenge already consumed (as by a concurrent decision) cannot pass again.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "reuse").await;
    let item = env
        .challenges("acme")
        .await
        .into_iter()
        .find(|c| serde_json::from_slice::<Challenge>(&c.body).unwrap().value == req.challenge)
        .expect("the challenge of the request is stored");
    let mut ch: serde_json::Value = serde_json::from_slice(&item.body).unwrap();
    ch["used"] = true.into();
    env.db
        .put_item(
            &Item {
                body: serde_json::to_vec(&ch).unwrap(),
                ..item.clone()
            },
            Cond::Version(item.version),
        )
        .await
        .unwrap();
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::FailedPrecondition);
    assert_unchanged("reused challenge", ch).await;

    // Self-approval: alice, on whose behalf the agent acts, has a valid device of her own.
    let alice = env.client("alice", "acme");
    let ka = key();
    register(&alice, "alice-phone", &ka).await.unwrap();
    let req = signed_decide(&alice, &ka, "alice-phone", "merge 7", "self").await;
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&alice, &req).await), Code::PermissionDenied);
    assert_unchanged("self approval", ch).await;

    // Someone else's device.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "theft").await;
    let ch = env.challenges("acme").await;
    assert_eq!(
        code(decide(&env.client("carol", "acme"), &req).await),
        Code::PermissionDenied
    );
    assert_unchanged("foreign device", ch).await;

    // Revoked device: the challenge is taken before the revocation, the decision after it.
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "revoked").await;
    let rev = pd::RevokeDeviceRequest {
        device_id: "bob-phone".into(),
        idempotency_key: "rev".into(),
    };
    bob.unary::<_, pd::RevokeDeviceResponse>("/loams.devices.v1.DeviceService/RevokeDevice", &rev)
        .await
        .unwrap();
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::PermissionDenied);
    assert_unchanged("revoked device", ch).await;

    // Expired: a fresh device, a valid signature, but the approval's 72 h are over.
    let k2 = key();
    register(&bob, "bob-phone-2", &k2).await.unwrap();
    let req = signed_decide(&bob, &k2, "bob-phone-2", "merge 7", "late").await;
    env.clock.advance(73 * 60 * 60 * 1000);
    let ch = env.challenges("acme").await;
    assert_eq!(code(decide(&bob, &req).await), Code::FailedPrecondition);
    assert_unchanged("expired", ch).await;
    let shown: pa::GetApprovalResponse = bob
        .unary(
            "/loams.approvals.v1.ApprovalService/GetApproval",
            &pa::GetApprovalRequest {
                approval_id: AP.into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        shown.approval.unwrap().state,
        pa::ApprovalState::Expired as i32
    );
}

#[tokio::test]
async fn kill_run_sets_the_switch_once_with_its_proof() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let k = key();
    register(&c, "alice-phone", &k).await.unwrap();
    // No reason given: the switch shows a default one, the proof keeps what was signed.
    let kill = signed_kill(&c, &k, "alice-phone", "", "kill-1").await;
    let resp: pf::KillRunResponse = c.unary(KILL_RUN, &kill).await.unwrap();
    assert_eq!(resp.run.unwrap().id, RUN);
    // The same request again (its challenge is used up by now) is answered from its idempotency record.
    let again: pf::KillRunResponse = c.unary(KILL_RUN, &kill).await.unwrap();
    assert_eq!(again.run.unwrap().id, RUN);
    let stored = env
        .db
        .get_item("acme", "kill", &format!("run:{RUN}"))
        .await
        .unwrap()
        .unwrap();
    let switch: loams_api::KillSwitch = serde_json::from_slice(&stored.body).unwrap();
    assert_eq!(
        (switch.reason.as_str(), switch.by.as_str()),
        ("killed by alice", "alice")
    );
    let proof = switch.proof.expect("the switch keeps the signed step-up");
    assert_eq!(
        (proof.device_id.as_str(), proof.reason.as_str()),
        ("alice-phone", "")
    );
    assert_eq!(
        (&proof.signature, &proof.challenge, proof.killed_at_ms),
        (&kill.signature, &kill.challenge, kill.killed_at_ms)
    );
    // Anyone can verify it again later from the switch and the device key alone.
    let bytes = loams_proto::canonical_kill_bytes(
        &proof.run_id,
        &proof.reason,
        &proof.device_id,
        &proof.challenge,
        proof.killed_at_ms,
    );
    loams_factory::approval::verify_signature(k.public_key().as_ref(), &bytes, &proof.signature)
        .unwrap();
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1, "a repeated kill must not enqueue twice");
    assert_eq!(
        queued[0].input,
        Some(Input::Kill {
            by: "alice".into(),
            reason: "killed by alice".into()
        })
    );
    // A write without an idempotency key is refused.
    let nokey = pf::KillRunRequest {
        idempotency_key: String::new(),
        ..kill.clone()
    };
    assert_eq!(
        code(c.unary::<_, pf::KillRunResponse>(KILL_RUN, &nokey).await),
        Code::InvalidArgument
    );
    // The worker sees the switch and the run ends.
    let ev =
        serde_json::to_vec(&serde_json::json!({"type": "run_killed", "reason": "stop"})).unwrap();
    let (snapshot, _) = run_snapshot(
        "acme",
        loams_factory::Stage::Review,
        loams_factory::Cursor::LeadReview,
    );
    env.db
        .append("acme", RUN, 1, "killed", &snapshot, &[ev], 2)
        .await
        .unwrap();
    // The very same signed request under a new key is the same kill (as after an attempt that stopped halfway):
    // it is answered, though the run has ended since; an ended run is not woken, and the switch stays as it was.
    let resent = pf::KillRunRequest {
        idempotency_key: "kill-2".into(),
        ..kill
    };
    c.unary::<_, pf::KillRunResponse>(KILL_RUN, &resent)
        .await
        .unwrap();
    assert!(env.queued().await.is_empty(), "an ended run is not woken");
    // Only its device's owner can send it: to anyone else the device is unknown.
    let bob = env.client("bob", "acme");
    assert_eq!(
        code(bob.unary::<_, pf::KillRunResponse>(KILL_RUN, &resent).await),
        Code::PermissionDenied
    );
    // Another kill finds the run ended: no challenge, no switch change.
    assert_eq!(
        code(get_kill_challenge(&c, "alice-phone").await),
        Code::FailedPrecondition
    );
    let mut second = pf::KillRunRequest {
        reason: "again".into(),
        idempotency_key: "kill-3".into(),
        ..resent.clone()
    };
    sign_kill(&k, &mut second);
    assert_eq!(
        code(c.unary::<_, pf::KillRunResponse>(KILL_RUN, &second).await),
        Code::FailedPrecondition
    );
    let after = env
        .db
        .get_item("acme", "kill", &format!("run:{RUN}"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(after.body, stored.body);
    assert!(env.queued().await.is_empty());
}

#[tokio::test]
async fn a_kill_that_stopped_after_setting_its_switch_is_finished_by_its_retry() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let k = key();
    register(&c, "alice-phone", &k).await.unwrap();
    let kill = signed_kill(&c, &k, "alice-phone", "wrong fix", "kill-1").await;
    // The earlier attempt set the switch with its proof and stopped there: the challenge is still unused and the
    // run was never woken.
    let proof = loams_factory::approval::KillRequest {
        run_id: kill.run_id.clone(),
        reason: kill.reason.clone(),
        device_id: kill.device_id.clone(),
        challenge: kill.challenge.clone(),
        killed_at_ms: kill.killed_at_ms,
        signature: kill.signature.clone(),
    };
    let switch = loams_api::KillSwitch {
        reason: "wrong fix".into(),
        by: "alice".into(),
        at_ms: env.clock.now_ms(),
        proof: Some(proof),
    };
    env.db
        .put_item(
            &Item {
                org: "acme".into(),
                kind: "kill".into(),
                id: format!("run:{RUN}"),
                version: 0,
                index: None,
                body: serde_json::to_vec(&switch).unwrap(),
                expires_ms: None,
            },
            Cond::Absent,
        )
        .await
        .unwrap();
    // Since then the device was revoked and the challenge ran out; neither undoes the kill it signed.
    c.unary::<_, pd::RevokeDeviceResponse>(
        "/loams.devices.v1.DeviceService/RevokeDevice",
        &pd::RevokeDeviceRequest {
            device_id: "alice-phone".into(),
            idempotency_key: "rev".into(),
        },
    )
    .await
    .unwrap();
    env.clock.advance(10 * 60 * 1000);
    // No new challenge is handed out for a run whose switch is set.
    assert_eq!(
        code(get_kill_challenge(&c, "alice-phone").await),
        Code::FailedPrecondition
    );

    c.unary::<_, pf::KillRunResponse>(KILL_RUN, &kill)
        .await
        .unwrap();
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1, "the run is woken");
    let challenge: Challenge = serde_json::from_slice(
        &env.db
            .list_items("acme", "kill_challenge", None, Page::first(10))
            .await
            .unwrap()
            .items[0]
            .body,
    )
    .unwrap();
    assert!(challenge.used, "the challenge is used up");
    // A copy of the request with one byte of the signature changed is not this request: refused.
    let mut forged = kill.clone();
    forged.idempotency_key = "kill-2".into();
    let last = forged.signature.len() - 1;
    forged.signature[last] ^= 1;
    assert_ne!(
        c.unary::<_, pf::KillRunResponse>(KILL_RUN, &forged)
            .await
            .map(|_| ()),
        Ok(())
    );
    assert!(env.queued().await.is_empty());
}

#[tokio::test]
async fn a_run_that_has_ended_cannot_be_killed() {
    let env = start().await;
    env.seed_run("acme", "succeeded").await;
    let c = env.client("alice", "acme");
    let k = key();
    register(&c, "alice-phone", &k).await.unwrap();
    assert_eq!(
        code(get_kill_challenge(&c, "alice-phone").await),
        Code::FailedPrecondition
    );
    let mut kill = pf::KillRunRequest {
        run_id: RUN.into(),
        reason: "late".into(),
        idempotency_key: "late".into(),
        device_id: "alice-phone".into(),
        challenge: vec![7; 32],
        killed_at_ms: wall_ms(),
        signature: Vec::new(),
    };
    sign_kill(&k, &mut kill);
    assert_eq!(
        code(c.unary::<_, pf::KillRunResponse>(KILL_RUN, &kill).await),
        Code::FailedPrecondition
    );
    // A reason that would show differently from what was signed is refused before anything else.
    for hidden in ["stop\u{1b}[2J", "stop \u{202E}dnuof", "st\u{200B}op"] {
        let refused = pf::KillRunRequest {
            reason: hidden.into(),
            ..kill.clone()
        };
        assert_eq!(
            code(c.unary::<_, pf::KillRunResponse>(KILL_RUN, &refused).await),
            Code::InvalidArgument,
            "{hidden:?}"
        );
    }
    assert!(
        env.db
            .get_item("acme", "kill", &format!("run:{RUN}"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(env.queued().await.is_empty());
}

#[tokio::test]
async fn a_kill_without_a_valid_step_up_is_refused_and_changes_nothing() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    env.seed_approval("acme").await;
    let alice = env.client("alice", "acme");
    let bob = env.client("bob", "acme");
    let (k, bobs_key) = (key(), key());
    register(&alice, "alice-phone", &k).await.unwrap();
    register(&bob, "bob-phone", &bobs_key).await.unwrap();
    let good = signed_kill(&alice, &k, "alice-phone", "stop", "kill").await;
    let refused = async |req: pf::KillRunRequest| {
        code(alice.unary::<_, pf::KillRunResponse>(KILL_RUN, &req).await)
    };
    let no_switch = async || {
        env.db
            .get_item("acme", "kill", &format!("run:{RUN}"))
            .await
            .unwrap()
            .is_none()
    };

    // Unsigned, as kills were before the step-up.
    let unsigned = pf::KillRunRequest {
        run_id: RUN.into(),
        reason: "stop".into(),
        idempotency_key: "unsigned".into(),
        ..Default::default()
    };
    assert_eq!(refused(unsigned).await, Code::InvalidArgument);
    // Signed by a key that is not the device's.
    let mut other_key = good.clone();
    sign_kill(&key(), &mut other_key);
    assert_eq!(refused(other_key).await, Code::PermissionDenied);
    // The reason changed after signing.
    let reworded = pf::KillRunRequest {
        reason: "something else".into(),
        ..good.clone()
    };
    assert_eq!(refused(reworded).await, Code::PermissionDenied);
    // Bob's device, a challenge issued to it and Bob's signature, sent by Alice: not her device.
    let borrowed = signed_kill(&bob, &bobs_key, "bob-phone", "stop", "borrowed").await;
    assert_eq!(refused(borrowed).await, Code::PermissionDenied);
    // The challenge of an approval is not a kill challenge.
    let mut approval_challenge = good.clone();
    approval_challenge.challenge = get_challenge(&alice, "alice-phone")
        .await
        .unwrap()
        .challenge;
    sign_kill(&k, &mut approval_challenge);
    assert_eq!(refused(approval_challenge).await, Code::InvalidArgument);
    // Signed a day from now: the device clock is wrong.
    let mut future = good.clone();
    future.killed_at_ms += 24 * 60 * 60 * 1000;
    sign_kill(&k, &mut future);
    assert_eq!(refused(future).await, Code::FailedPrecondition);
    // No kill challenge for someone else's device, or an unknown one.
    assert_eq!(
        code(get_kill_challenge(&alice, "bob-phone").await),
        Code::PermissionDenied
    );
    assert_eq!(
        code(get_kill_challenge(&alice, "nobody").await),
        Code::PermissionDenied
    );

    // Nothing changed: no switch, nothing queued.
    assert!(no_switch().await);
    assert!(env.queued().await.is_empty());
    // Once the device is revoked, its signed kill is refused too.
    alice
        .unary::<_, pd::RevokeDeviceResponse>(
            "/loams.devices.v1.DeviceService/RevokeDevice",
            &pd::RevokeDeviceRequest {
                device_id: "alice-phone".into(),
                idempotency_key: "rev".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(refused(good).await, Code::PermissionDenied);
    assert_eq!(
        code(get_kill_challenge(&alice, "alice-phone").await),
        Code::PermissionDenied
    );
    assert!(no_switch().await);
    // Bob's own step-up passes: the refusals used up nothing of his.
    let bobs = signed_kill(&bob, &bobs_key, "bob-phone", "stop", "bobs").await;
    bob.unary::<_, pf::KillRunResponse>(KILL_RUN, &bobs)
        .await
        .unwrap();
    assert!(!no_switch().await);
}

#[tokio::test]
async fn two_kills_over_one_challenge_pull_the_switch_once() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let k = key();
    register(&c, "alice-phone", &k).await.unwrap();
    // Two different kills signed over the same challenge, sent at once.
    let first = signed_kill(&c, &k, "alice-phone", "stop", "a").await;
    let mut second = pf::KillRunRequest {
        reason: "halt".into(),
        idempotency_key: "b".into(),
        ..first.clone()
    };
    sign_kill(&k, &mut second);
    let (a, b) = tokio::join!(
        c.unary::<_, pf::KillRunResponse>(KILL_RUN, &first),
        c.unary::<_, pf::KillRunResponse>(KILL_RUN, &second)
    );
    assert_eq!(
        usize::from(a.is_ok()) + usize::from(b.is_ok()),
        1,
        "one challenge, one kill: {a:?} {b:?}"
    );
    assert_eq!(env.queued().await.len(), 1);
}

#[tokio::test]
async fn one_signed_kill_sent_twice_at_once_succeeds_twice_and_kills_once() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let k = key();
    register(&c, "alice-phone", &k).await.unwrap();
    let first = signed_kill(&c, &k, "alice-phone", "stop", "a").await;
    let copy = pf::KillRunRequest {
        idempotency_key: "b".into(),
        ..first.clone()
    };
    let (a, b) = tokio::join!(
        c.unary::<_, pf::KillRunResponse>(KILL_RUN, &first),
        c.unary::<_, pf::KillRunResponse>(KILL_RUN, &copy)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    let switches = env
        .db
        .list_items("acme", "kill", None, Page::first(10))
        .await
        .unwrap();
    assert_eq!(switches.items.len(), 1);
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
    assert_eq!(
        env.webhook(HOOK_TOKEN, b"{\"attachments\":[]}".to_vec())
            .await
            .status(),
        400
    );
    assert!(env.opener.0.lock().unwrap().is_empty());

    let first = env.webhook(HOOK_TOKEN, alert(42)).await;
    assert_eq!(first.status(), 202);
    let body: serde_json::Value = first.json().await.unwrap();
    assert_eq!(
        body["run"],
        loams_factory::run_id("acme", "glitchtip:42", 1)
    );
    let dup = env.webhook(HOOK_TOKEN, alert(42)).await;
    assert_eq!(dup.status(), 200);
    {
        let opened = env.opener.0.lock().unwrap();
        assert_eq!(opened.len(), 1);
        let (org, envname, signal) = &opened[0];
        assert_eq!((org.as_str(), envname.as_str()), ("acme", "prod"));
        assert_eq!(
            (
                signal.fingerprint.as_str(),
                signal.glitchtip_issue_id.as_deref()
            ),
            ("glitchtip:42", Some("42"))
        );
    }
    assert_eq!(env.webhook(HOOK_TOKEN, alert(43)).await.status(), 202);
    assert_eq!(env.opener.0.lock().unwrap().len(), 2);

    // An issue link on any other origin than the configured GlitchTip's opens nothing.
    for link in [
        "https://evil.example/acme/issues/44",
        "http://gt.example/acme/issues/44",
        "https://gt.example:444/acme/issues/44",
    ] {
        let body = serde_json::json!({"attachments": [{"title": "x", "title_link": link}]});
        assert_eq!(
            env.webhook(HOOK_TOKEN, serde_json::to_vec(&body).unwrap())
                .await
                .status(),
            400,
            "{link}"
        );
    }
    assert_eq!(env.opener.0.lock().unwrap().len(), 2);

    // A refusal (cooldown) is an answer, not a failure: 2xx so GlitchTip does not resend, naming the reason.
    let refused = env.webhook(HOOK_TOKEN, alert(90)).await;
    assert_eq!(refused.status(), 200);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert!(
        body["refused"].as_str().unwrap().contains("cooldown"),
        "{body}"
    );
    // A failed open leaves no delivery marker: the resend is tried again rather than called a duplicate.
    for _ in 0..2 {
        assert_eq!(env.webhook(HOOK_TOKEN, alert(91)).await.status(), 503);
    }
    assert!(
        env.db
            .get_item(
                "acme",
                "webhook",
                &format!("glitchtip:{}", hex_sha256(&alert(91)))
            )
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(env.opener.0.lock().unwrap().len(), 2);
}

fn hex_sha256(bytes: &[u8]) -> String {
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
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
        &hex::decode(loams_factory::action_hash(
            &serde_json::from_slice::<Approval>(&env.approval_item("acme").await.body)
                .unwrap()
                .action,
        ))
        .unwrap(),
        pa::Decision::Approve,
        "bob-phone",
        &a.challenge,
        a.decided_at_ms,
    );
    let b = pa::DecideRequest {
        signature: k
            .sign(&SystemRandom::new(), &bytes)
            .unwrap()
            .as_ref()
            .to_vec(),
        idempotency_key: "race-b".into(),
        ..a.clone()
    };
    assert_ne!(a.signature, b.signature);
    let (ra, rb) = tokio::join!(decide(&bob, &a), decide(&bob, &b));
    assert_eq!(
        u8::from(ra.is_ok()) + u8::from(rb.is_ok()),
        1,
        "exactly one decision passes: {ra:?} {rb:?}"
    );
    assert_eq!(env.queued().await.len(), 1);
}

#[tokio::test]
async fn each_procedure_needs_its_scope_and_a_refusal_changes_nothing() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    let before = env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let k = key();
    register(&bob, "bob-phone", &k).await.unwrap();
    let signed = signed_decide(&bob, &k, "bob-phone", "merge 7", "scoped").await;
    let challenges = env.challenges("acme").await;

    let get = pf::GetRunRequest { run_id: RUN.into() };
    let kill = signed_kill(&bob, &k, "bob-phone", "x", "k").await;
    let reg = pd::RegisterDeviceRequest {
        device_id: "bob-tablet".into(),
        public_key: key().public_key().as_ref().to_vec(),
        name: "tablet".into(),
        push_token: String::new(),
        idempotency_key: "reg".into(),
    };
    let revoke = pd::RevokeDeviceRequest {
        device_id: "bob-phone".into(),
        idempotency_key: "rev".into(),
    };

    // A reader: reads pass, every write is refused.
    let reader = env.client_with("bob", "acme", "runs:read approvals:read");
    reader
        .unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get)
        .await
        .unwrap();
    reader
        .unary::<_, pa::ListApprovalsResponse>(
            "/loams.approvals.v1.ApprovalService/ListApprovals",
            &pa::ListApprovalsRequest::default(),
        )
        .await
        .unwrap();
    let denied = Code::PermissionDenied;
    assert_eq!(
        code(
            reader
                .unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &kill)
                .await
        ),
        denied
    );
    assert_eq!(code(get_kill_challenge(&reader, "bob-phone").await), denied);
    assert_eq!(
        code(
            reader
                .unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &reg)
                .await
        ),
        denied
    );
    assert_eq!(
        code(
            reader
                .unary::<_, pd::RevokeDeviceResponse>(
                    "/loams.devices.v1.DeviceService/RevokeDevice",
                    &revoke
                )
                .await
        ),
        denied
    );
    assert_eq!(code(get_challenge(&reader, "bob-phone").await), denied);
    assert_eq!(code(decide(&reader, &signed).await), denied);

    // No scopes at all: reads are refused too, the watch before its snapshot.
    let none = env.client_with("bob", "acme", "");
    assert_eq!(
        code(
            none.unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get)
                .await
        ),
        denied
    );
    let tl = pf::GetTimelineRequest {
        run_id: RUN.into(),
        after_seq: 0,
        page_size: 0,
    };
    assert_eq!(
        code(
            none.unary::<_, pf::GetTimelineResponse>(
                "/loams.factory.v1.FactoryService/GetTimeline",
                &tl
            )
            .await
        ),
        denied
    );
    let ap = pa::GetApprovalRequest {
        approval_id: AP.into(),
    };
    assert_eq!(
        code(
            none.unary::<_, pa::GetApprovalResponse>(
                "/loams.approvals.v1.ApprovalService/GetApproval",
                &ap
            )
            .await
        ),
        denied
    );
    let mut watch = Box::pin(none.server_stream::<_, pf::WatchRunResponse>(
        "/loams.factory.v1.FactoryService/WatchRun",
        &pf::WatchRunRequest {
            run_id: RUN.into(),
            after_seq: 0,
        },
    ));
    assert_eq!(watch.next().await.unwrap().unwrap_err().code, denied);
    // Scopes of other procedures do not stand in: a decider cannot kill, a killer cannot read.
    let decider = env.client_with("bob", "acme", "approvals:decide devices:write");
    assert_eq!(
        code(get_kill_challenge(&decider, "bob-phone").await),
        denied
    );
    assert_eq!(
        code(
            decider
                .unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &kill)
                .await
        ),
        denied
    );
    let killer = env.client_with("bob", "acme", "runs:kill");
    assert_eq!(
        code(
            killer
                .unary::<_, pf::GetRunResponse>("/loams.factory.v1.FactoryService/GetRun", &get)
                .await
        ),
        denied
    );

    // Nothing changed: no kill switch, no device added or revoked, the approval and its challenge as they were.
    assert!(
        env.db
            .get_item("acme", "kill", &format!("run:{RUN}"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        env.db
            .get_item("acme", "device", "bob-tablet")
            .await
            .unwrap()
            .is_none()
    );
    let phone: loams_factory::approval::Device = serde_json::from_slice(
        &env.db
            .get_item("acme", "device", "bob-phone")
            .await
            .unwrap()
            .unwrap()
            .body,
    )
    .unwrap();
    assert!(!phone.revoked);
    assert_eq!(env.approval_item("acme").await, before);
    assert_eq!(env.challenges("acme").await, challenges);
    assert!(env.queued().await.is_empty());

    // Each scope alone is enough for its procedure: the refused idempotency keys were not used up.
    killer
        .unary::<_, pf::KillRunResponse>("/loams.factory.v1.FactoryService/KillRun", &kill)
        .await
        .unwrap();
    decider
        .unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &reg)
        .await
        .unwrap();
    let done = decide(&env.client_with("bob", "acme", "approvals:decide"), &signed)
        .await
        .unwrap();
    assert_eq!(
        done.approval.unwrap().state,
        pa::ApprovalState::Approved as i32
    );
}

#[tokio::test]
async fn a_decision_that_loses_its_write_changes_nothing_and_can_be_sent_again() {
    // Another instance rewrites the approval just before the decision's conditional write.
    let wrap: WrapStore =
        |inner| Arc::new(RaceBeforeWrite::new(inner, "approval", |stored, _| stored));
    let env = start_with(
        ApiConfig {
            watch_poll_ms: 20,
            ..ApiConfig::default()
        },
        Some(wrap),
    )
    .await;
    env.seed_run("acme", "waiting").await;
    let before = env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let k = key();
    register(&bob, "bob-phone", &k).await.unwrap();
    let req = signed_decide(&bob, &k, "bob-phone", "merge 7", "lost").await;
    let challenges = env.challenges("acme").await;
    assert_eq!(challenges.len(), 1);

    // The approval is still pending after the other write, so the caller is told to retry.
    assert_eq!(code(decide(&bob, &req).await), Code::Aborted);
    assert_eq!(
        env.approval_item("acme").await.body,
        before.body,
        "the approval must still be pending"
    );
    assert_eq!(
        env.challenges("acme").await,
        challenges,
        "the challenge must not be burnt"
    );
    assert!(env.queued().await.is_empty());

    // The very same request (same key, same challenge) then passes, and uses the challenge up.
    let done = decide(&bob, &req).await.unwrap();
    assert_eq!(
        done.approval.unwrap().state,
        pa::ApprovalState::Approved as i32
    );
    let used: Challenge = serde_json::from_slice(&env.challenges("acme").await[0].body).unwrap();
    assert!(used.used);
    assert_eq!(env.queued().await.len(), 1);
}

#[tokio::test]
async fn a_user_has_a_bounded_number_of_devices_and_challenges() {
    let env = start().await;
    env.seed_run("acme", "waiting").await;
    env.seed_approval("acme").await;
    let bob = env.client("bob", "acme");
    let keys: Vec<_> = (0..=loams_api::MAX_ACTIVE_DEVICES).map(|_| key()).collect();
    for (i, k) in keys.iter().enumerate().take(loams_api::MAX_ACTIVE_DEVICES) {
        register(&bob, &format!("bob-{i}"), k).await.unwrap();
    }
    let extra = format!("bob-{}", loams_api::MAX_ACTIVE_DEVICES);
    assert_eq!(
        code(register(&bob, &extra, &keys[loams_api::MAX_ACTIVE_DEVICES]).await),
        Code::FailedPrecondition
    );
    assert!(
        env.db
            .get_item("acme", "device", &extra)
            .await
            .unwrap()
            .is_none()
    );
    // Another user is not affected; a revoked device frees a place.
    register(&env.client("carol", "acme"), "carol-0", &key())
        .await
        .unwrap();
    let rev = pd::RevokeDeviceRequest {
        device_id: "bob-0".into(),
        idempotency_key: "rev-0".into(),
    };
    bob.unary::<_, pd::RevokeDeviceResponse>("/loams.devices.v1.DeviceService/RevokeDevice", &rev)
        .await
        .unwrap();
    let again = pd::RegisterDeviceRequest {
        device_id: extra.clone(),
        public_key: keys[loams_api::MAX_ACTIVE_DEVICES]
            .public_key()
            .as_ref()
            .to_vec(),
        name: "phone".into(),
        push_token: String::new(),
        idempotency_key: "after-revoke".into(),
    };
    bob.unary::<_, pd::Device>("/loams.devices.v1.DeviceService/RegisterDevice", &again)
        .await
        .unwrap();

    // One challenge per approval and device: asking again, even all at once, returns the same one.
    let first = get_challenge(&bob, "bob-1").await.unwrap();
    let (a, b, c) = tokio::join!(
        get_challenge(&bob, "bob-1"),
        get_challenge(&bob, "bob-1"),
        get_challenge(&bob, "bob-1")
    );
    for again in [a, b, c] {
        assert_eq!(again.unwrap(), first);
    }
    assert_eq!(env.challenges("acme").await.len(), 1);
    get_challenge(&bob, "bob-2").await.unwrap();
    assert_eq!(env.challenges("acme").await.len(), 2);
    // With less than half its life left it is replaced, not joined by a second one.
    env.clock
        .advance(u64::try_from(ApiConfig::default().challenge_ttl_ms / 2 + 1).unwrap());
    let fresh = get_challenge(&bob, "bob-1").await.unwrap();
    assert_ne!(fresh.challenge, first.challenge);
    assert!(fresh.expires_at_ms > first.expires_at_ms);
    assert_eq!(env.challenges("acme").await.len(), 2);
}

#[tokio::test]
async fn watch_sends_heartbeats_ends_after_its_lifetime_and_resumes() {
    let config = ApiConfig {
        watch_poll_ms: 20,
        watch_heartbeat_ms: 100,
        watch_max_ms: 600,
        ..ApiConfig::default()
    };
    let env = start_with(config, None).await;
    env.seed_run("acme", "waiting").await;
    let c = env.client("alice", "acme");
    let started = std::time::Instant::now();
    // The run never finishes, so only the lifetime ends this stream.
    let items = watch_to_end(&c, 0).await;
    assert!(started.elapsed() >= std::time::Duration::from_millis(600));
    use pf::watch_run_response::Item as W;
    assert!(matches!(&items[0].item, Some(W::Snapshot(_))));
    assert!(matches!(&items[1].item, Some(W::Event(e)) if e.seq == 1));
    let beats: Vec<i64> = items[2..]
        .iter()
        .map(|i| match &i.item {
            Some(W::Heartbeat(h)) => h.at_ms,
            other => panic!("{other:?}"),
        })
        .collect();
    // A heartbeat per quiet 100 ms of a 600 ms life: at least one, never more than six.
    assert!((1..=6).contains(&beats.len()), "{beats:?}");
    assert!(
        beats.iter().all(|&at| at == env.clock.now_ms()),
        "heartbeats carry the server time"
    );

    // The client resumes from the last seq it saw and gets only what came after.
    let ev = serde_json::to_vec(
        &serde_json::json!({"type": "run_killed", "at_ms": 9, "stage": "review"}),
    )
    .unwrap();
    let (snapshot, _) = run_snapshot(
        "acme",
        loams_factory::Stage::Review,
        loams_factory::Cursor::LeadReview,
    );
    env.db
        .append("acme", RUN, 1, "killed", &snapshot, &[ev], 2)
        .await
        .unwrap();
    let items = watch_to_end(&c, 1).await;
    assert!(matches!(&items[0].item, Some(W::Snapshot(r)) if r.state == "killed"));
    assert_eq!(items.len(), 2);
    assert!(matches!(&items[1].item, Some(W::Event(e)) if e.seq == 2 && e.r#type == "run_killed"));
}

const DECIDE_TRIAGE: &str = "/loams.factory.v1.FactoryService/DecideTriage";
const GIVE_VERDICT: &str = "/loams.factory.v1.FactoryService/GiveVerdict";

fn triage(accept: bool, key: &str) -> pf::DecideTriageRequest {
    pf::DecideTriageRequest {
        run_id: RUN.into(),
        accept,
        idempotency_key: key.into(),
    }
}

fn verdict(v: pf::Verdict, key: &str) -> pf::GiveVerdictRequest {
    pf::GiveVerdictRequest {
        run_id: RUN.into(),
        verdict: v as i32,
        idempotency_key: key.into(),
    }
}

#[tokio::test]
async fn a_person_decides_triage_and_gives_the_verdict_once() {
    use loams_factory::{Cursor, ObserveVerdict, Stage};
    let env = start().await;
    env.seed_run_at("acme", "waiting", Stage::Triage, Cursor::AwaitTriage)
        .await;
    env.seed_run_at("beta", "waiting", Stage::Observe, Cursor::AwaitVerdict)
        .await;
    let alice = env.client("alice", "acme");

    let resp: pf::DecideTriageResponse = alice
        .unary(DECIDE_TRIAGE, &triage(true, "t1"))
        .await
        .unwrap();
    let run = resp.run.unwrap();
    assert_eq!(
        (run.id.as_str(), run.stage_state.as_str()),
        (RUN, "await_triage")
    );
    let queued = env.queued().await;
    assert_eq!(
        queued,
        vec![Envelope {
            org: "acme".into(),
            run: RUN.into(),
            input: Some(Input::TriageDecided {
                accept: true,
                by: "alice".into()
            }),
        }]
    );
    // The same key again: the first answer, nothing sent again.
    let again: pf::DecideTriageResponse = alice
        .unary(DECIDE_TRIAGE, &triage(true, "t1"))
        .await
        .unwrap();
    assert_eq!(again.run.unwrap().id, RUN);
    // Until the worker applies it the run still shows the wait, but a second (opposite) decision is refused.
    let bob = env.client("bob", "acme");
    assert_eq!(
        code(
            bob.unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &triage(false, "t2"))
                .await
        ),
        Code::FailedPrecondition
    );
    // This run waits for triage, not for a verdict.
    let regressed = verdict(pf::Verdict::Regressed, "v1");
    assert_eq!(
        code(
            bob.unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &regressed)
                .await
        ),
        Code::FailedPrecondition
    );
    assert!(env.queued().await.is_empty());

    // Another organisation's run waits for its verdict.
    let carol = env.client("carol", "beta");
    let unspecified = verdict(pf::Verdict::Unspecified, "v0");
    assert_eq!(
        code(
            carol
                .unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &unspecified)
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            carol
                .unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &triage(true, "t1"))
                .await
        ),
        Code::FailedPrecondition
    );
    let resp: pf::GiveVerdictResponse = carol.unary(GIVE_VERDICT, &regressed).await.unwrap();
    assert_eq!(resp.run.unwrap().org, "beta");
    let again: pf::GiveVerdictResponse = carol.unary(GIVE_VERDICT, &regressed).await.unwrap();
    assert_eq!(again.run.unwrap().id, RUN);
    assert_eq!(
        env.queued().await,
        vec![Envelope {
            org: "beta".into(),
            run: RUN.into(),
            input: Some(Input::VerdictGiven {
                verdict: ObserveVerdict::Regressed,
                by: "carol".into()
            }),
        }]
    );
    let resolved = verdict(pf::Verdict::Resolved, "v2");
    assert_eq!(
        code(
            carol
                .unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &resolved)
                .await
        ),
        Code::FailedPrecondition
    );
    assert!(env.queued().await.is_empty());
}

#[tokio::test]
async fn refused_triage_and_verdict_calls_send_nothing() {
    use loams_factory::{Cursor, Stage};
    let env = start().await;
    env.seed_run_at("acme", "waiting", Stage::Triage, Cursor::AwaitTriage)
        .await;
    env.seed_run("beta", "open").await;
    let accept = triage(true, "t1");
    let resolved = verdict(pf::Verdict::Resolved, "v1");

    // Another organisation's run is not there.
    let mallory = env.client("mallory", "umbrella");
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &accept)
                .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            mallory
                .unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &resolved)
                .await
        ),
        Code::NotFound
    );
    // Reading and killing runs does not let one decide them.
    let reader = env.client_with("alice", "acme", "runs:read runs:kill approvals:decide");
    assert_eq!(
        code(
            reader
                .unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &accept)
                .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        code(
            reader
                .unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &resolved)
                .await
        ),
        Code::PermissionDenied
    );
    // A write needs its idempotency key.
    let alice = env.client_with("alice", "acme", loams_api::scope::RUNS_DECIDE);
    assert_eq!(
        code(
            alice
                .unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &triage(true, ""))
                .await
        ),
        Code::InvalidArgument
    );
    // A run in review waits for neither.
    let dave = env.client("dave", "beta");
    assert_eq!(
        code(
            dave.unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &accept)
                .await
        ),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(
            dave.unary::<_, pf::GiveVerdictResponse>(GIVE_VERDICT, &resolved)
                .await
        ),
        Code::FailedPrecondition
    );
    assert!(env.queued().await.is_empty());

    // The refusals used up neither the keys nor the decision: the scope alone is enough for the call.
    alice
        .unary::<_, pf::DecideTriageResponse>(DECIDE_TRIAGE, &triage(false, "t1"))
        .await
        .unwrap();
    let queued = env.queued().await;
    assert_eq!(queued.len(), 1);
    assert_eq!(
        queued[0].input,
        Some(Input::TriageDecided {
            accept: false,
            by: "alice".into()
        })
    );
}
