//! The core against the real server, in process: the sandbox apps, the agents, the worker and the API as
//! `loams demo` runs them. The core takes the simulated phone's place: it registers a device key, watches the run,
//! sees the merge approval arrive, approves it with a signature and sees the run go on to the end; then, with the
//! server stopped, everything cached stays readable and every write fails at once without touching the cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use loams::demo::Scenario;
use loams::stack::Stack;
use loams_core::{
    ApprovalListener, ApprovalUpdate, Client, ClientConfig, Decision, Error, RunListener,
    RunUpdate, SoftwareSigner, SyncMode, TokenProvider,
};
use loams_sandbox::SandboxHandle;
use tokio::sync::mpsc;

struct StaticToken(String);

#[async_trait]
impl TokenProvider for StaticToken {
    async fn access_token(&self) -> loams_core::Result<String> {
        Ok(self.0.clone())
    }
}

struct Forward<T>(mpsc::UnboundedSender<T>);

impl RunListener for Forward<RunUpdate> {
    fn on_update(&self, update: RunUpdate) {
        let _ = self.0.send(update);
    }
}

impl ApprovalListener for Forward<ApprovalUpdate> {
    fn on_update(&self, update: ApprovalUpdate) {
        let _ = self.0.send(update);
    }
}

/// The next update matching `want`, collecting every update seen on the way.
async fn until<T: Clone + std::fmt::Debug>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    seen: &mut Vec<T>,
    what: &str,
    want: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(u)) => {
                seen.push(u.clone());
                if want(&u) {
                    return u;
                }
            }
            Ok(None) => panic!("the watch ended before {what}: {seen:#?}"),
            Err(_) => panic!("no {what} within 90 s: {seen:#?}"),
        }
    }
}

/// The next pending approval of `skill` to arrive.
async fn added(
    rx: &mut mpsc::UnboundedReceiver<ApprovalUpdate>,
    seen: &mut Vec<ApprovalUpdate>,
    skill: &str,
) -> loams_core::Approval {
    let update = until(
        rx,
        seen,
        skill,
        |u| matches!(u, ApprovalUpdate::Added { approval } if approval.skill == skill),
    )
    .await;
    let ApprovalUpdate::Added { approval } = update else {
        unreachable!()
    };
    approval
}

fn has_event(u: &RunUpdate, kind: &str) -> bool {
    matches!(u, RunUpdate::Events { events } if events.iter().any(|e| e.kind == kind))
}

struct Server {
    stack: Stack,
    sandbox: SandboxHandle,
    org: String,
    run_id: String,
}

/// The demo's stack, with one run opened by the sandbox's GlitchTip alert.
async fn start(data_dir: std::path::PathBuf) -> Server {
    let scenario = Scenario::demo(data_dir);
    let (sandbox, stack) = loams::demo::start(&scenario).await.unwrap();
    let run_id = loams::demo::post_alert(&stack, &sandbox, &scenario.config)
        .await
        .unwrap();
    Server {
        stack,
        sandbox,
        org: scenario.config.org.clone(),
        run_id,
    }
}

fn client(
    server: &Server,
    db: &std::path::Path,
    keys: &Arc<keyring_core::CredentialStore>,
    mode: SyncMode,
) -> Client {
    let token = server.stack.token("alice", &server.org).unwrap();
    let signer = SoftwareSigner::load_or_create(keys, "loams-test", &server.org).unwrap();
    let mut config = ClientConfig::new(server.stack.api_url.clone(), server.org.clone(), db);
    config.sync_mode = mode;
    config.poll_interval = Duration::from_millis(100);
    config.reconnect_delay = Duration::from_millis(100);
    config.request_timeout = Duration::from_secs(5);
    Client::new(config, Arc::new(StaticToken(token)), Arc::new(signer)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_watch_approve_and_then_work_offline() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path().join("server")).await;
    let db = dir.path().join("phone.db");
    let keys: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
    let phone = client(&server, &db, &keys, SyncMode::Stream);

    let device = phone.devices().register("alice-phone", None).await.unwrap();
    assert_eq!(device.public_key.len(), 65);
    assert_eq!(
        phone
            .devices()
            .register("alice-phone", None)
            .await
            .unwrap()
            .device_id,
        device.device_id
    );

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut seen = Vec::new();
    let watch = phone
        .runs()
        .watch(&server.run_id, Arc::new(Forward(tx)))
        .await
        .unwrap();
    let first = until(&mut rx, &mut seen, "the snapshot", |_| true).await;
    assert_eq!(
        first,
        RunUpdate::Snapshot {
            run: None,
            events: vec![]
        },
        "nothing cached yet"
    );

    let (atx, mut arx) = mpsc::unbounded_channel();
    let mut approvals_seen = Vec::new();
    let _approvals_watch = phone
        .approvals()
        .watch_pending(Arc::new(Forward(atx)))
        .await
        .unwrap();
    let snapshot = until(
        &mut arx,
        &mut approvals_seen,
        "the approvals snapshot",
        |_| true,
    )
    .await;
    assert_eq!(snapshot, ApprovalUpdate::Snapshot { approvals: vec![] });

    until(&mut rx, &mut seen, "the merge approval", |u| {
        has_event(u, "approval_requested")
    })
    .await;
    let added = until(
        &mut arx,
        &mut approvals_seen,
        "the approval to arrive",
        |u| matches!(u, ApprovalUpdate::Added { approval } if approval.run_id == server.run_id),
    )
    .await;
    let ApprovalUpdate::Added { approval } = added else {
        unreachable!()
    };
    assert!(
        !approval.summary.is_empty(),
        "the server renders the summary"
    );
    assert_eq!(approval.risk, loams_core::Risk::Destructive);
    let phrase = approval
        .confirmation_phrase
        .clone()
        .expect("a merge is destructive: a phrase must be typed");

    // A wrong phrase is refused before anything is signed or sent, and the approval stays pending.
    let err = phone
        .approvals()
        .decide(&approval.id, Decision::Approve, Some("yes".into()))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::ConfirmationMismatch {
            phrase: phrase.clone()
        }
    );
    assert_eq!(
        phone
            .approvals()
            .cached(&approval.id)
            .unwrap()
            .unwrap()
            .state,
        loams_core::ApprovalState::Pending
    );

    // A platform key that is not the registered one is caught before the decision is sent.
    let other_keys: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
    let impostor = client(&server, &db, &other_keys, SyncMode::Stream);
    let err = impostor
        .approvals()
        .decide(&approval.id, Decision::Approve, Some(phrase.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Signer(m) if m.contains("does not verify")),
        "{err}"
    );
    drop(impostor);

    let decided = phone
        .approvals()
        .decide(&approval.id, Decision::Approve, Some(phrase))
        .await
        .unwrap();
    assert_eq!(decided.state, loams_core::ApprovalState::Approved);
    assert_eq!(decided.decision, Some(Decision::Approve));
    assert_eq!(decided.decided_by, "alice");
    assert!(
        phone
            .approvals()
            .cached_pending(100)
            .unwrap()
            .iter()
            .all(|a| a.id != approval.id)
    );
    let removed = ApprovalUpdate::Removed {
        approval_id: approval.id.clone(),
    };
    until(
        &mut arx,
        &mut approvals_seen,
        "the approval to leave the list",
        |u| *u == removed,
    )
    .await;

    // The run goes on past the approval to the merge and its end.
    until(&mut rx, &mut seen, "the merge", |u| has_event(u, "merged")).await;
    until(&mut rx, &mut seen, "the end of the run", |u| {
        matches!(u, RunUpdate::Finished)
    })
    .await;
    assert!(watch.is_finished(), "finished as soon as it says so");

    // Events arrived once each and in order, and the cache holds the server's whole timeline.
    let delivered: Vec<u64> = seen
        .iter()
        .flat_map(|u| match u {
            RunUpdate::Events { events } => events.iter().map(|e| e.seq).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(
        delivered,
        (1..=delivered.len() as u64).collect::<Vec<_>>(),
        "{delivered:?}"
    );
    let run = phone.runs().cached_run(&server.run_id).unwrap().unwrap();
    assert_eq!(run.state, "succeeded", "{seen:#?}");
    assert_eq!(run.version, delivered.len() as u64);
    let cached = phone
        .runs()
        .cached_timeline(&server.run_id, 0, 10_000)
        .unwrap();
    assert_eq!(cached.len(), delivered.len());
    assert!(cached.iter().any(|e| e.kind == "approval_settled"));

    // A poll step (the fallback path) against the real server finds nothing new: the stream left nothing behind.
    let polled = phone.runs().sync(&server.run_id).await.unwrap();
    assert_eq!(
        (polled.run.state.as_str(), polled.new_events.len()),
        ("succeeded", 0)
    );

    // The server goes away.
    let api_url = server.stack.api_url.clone();
    server.stack.shutdown().await;
    server.sandbox.shutdown().await;
    assert!(
        reqwest::get(format!("{api_url}/")).await.is_err(),
        "the server is stopped"
    );

    let runs_before = phone.runs().cached(100).unwrap();
    let timeline_before = phone.runs().cached_timeline(&run.id, 0, 10_000).unwrap();
    let approval_before = phone.approvals().cached(&approval.id).unwrap();
    assert!(
        runs_before.iter().all(|r| r.confirmed_at_ms > 0),
        "cached rows say when they were confirmed"
    );

    let started = Instant::now();
    assert!(matches!(
        phone.runs().kill(&run.id, "stop").await,
        Err(Error::Offline(_))
    ));
    assert!(matches!(
        phone
            .approvals()
            .decide(&approval.id, Decision::Deny, None)
            .await,
        Err(Error::Offline(_))
    ));
    assert!(matches!(
        phone.approvals().refresh_pending().await,
        Err(Error::Offline(_))
    ));
    assert!(matches!(
        phone.runs().refresh().await,
        Err(Error::Offline(_))
    ));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "offline writes fail at once: {:?}",
        started.elapsed()
    );
    // The platform's network monitor can say so first: then nothing is even tried.
    phone.set_network_available(false);
    assert_eq!(
        phone.runs().kill(&run.id, "stop").await,
        Err(Error::Offline("no network connection".into()))
    );

    assert_eq!(
        phone.runs().cached(100).unwrap(),
        runs_before,
        "the cache is unchanged"
    );
    assert_eq!(
        phone.runs().cached_timeline(&run.id, 0, 10_000).unwrap(),
        timeline_before
    );
    assert_eq!(
        phone.approvals().cached(&approval.id).unwrap(),
        approval_before
    );
    assert_eq!(
        phone.devices().current().unwrap().unwrap().device_id,
        device.device_id
    );

    // A watch offline delivers the cached snapshot, then says it is offline.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _watch = phone
        .runs()
        .watch(&run.id, Arc::new(Forward(tx)))
        .await
        .unwrap();
    let mut seen = Vec::new();
    match until(&mut rx, &mut seen, "the offline snapshot", |_| true).await {
        RunUpdate::Snapshot {
            run: Some(r),
            events,
        } => {
            assert_eq!(Some(&r), runs_before.iter().find(|x| x.id == run.id));
            assert_eq!(events, timeline_before);
        }
        other => panic!("{other:?}"),
    }
    let offline = until(&mut rx, &mut seen, "the offline notice", |_| true).await;
    assert!(
        matches!(
            offline,
            RunUpdate::Connection {
                connected: false,
                ..
            }
        ),
        "{offline:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_signed_by_the_device_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path().join("server")).await;
    let keys: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
    let phone = client(
        &server,
        &dir.path().join("phone.db"),
        &keys,
        SyncMode::Stream,
    );

    // No device, no kill: the step-up needs a key the server knows.
    assert_eq!(
        phone.runs().kill(&server.run_id, "wrong fix").await,
        Err(Error::NotRegistered)
    );
    phone.devices().register("alice-phone", None).await.unwrap();
    let (atx, mut arx) = mpsc::unbounded_channel();
    let mut approvals_seen = Vec::new();
    let _approvals = phone
        .approvals()
        .watch_pending(Arc::new(Forward(atx)))
        .await
        .unwrap();
    // Killed while its merge waits for approval, so the pull request is open.
    added(&mut arx, &mut approvals_seen, "merge").await;
    let killed = phone
        .runs()
        .kill(&server.run_id, "wrong fix")
        .await
        .unwrap();
    assert_eq!(killed.id, server.run_id);
    // Compensation closes the pull request behind an approval of its own.
    let close = added(&mut arx, &mut approvals_seen, "close_pr").await;
    // Decided as listed, without reading it again. A copy whose action differs from the server's record is refused
    // by one side or the other, and nothing is decided: shown with another action (its hash kept), the phone does
    // not sign it; shown with another action and the hash of that action, the server refuses the signature.
    let phrase = close.confirmation_phrase.clone();
    let mut misshown = close.clone();
    misshown.args_json = r#"{"number":99}"#.into();
    let refused = phone
        .approvals()
        .decide_shown(&misshown, Decision::Approve, phrase.clone())
        .await;
    assert!(
        matches!(&refused, Err(Error::Server(m)) if m.contains("does not match its action hash")),
        "{refused:?}"
    );
    let target = (!misshown.target_commit.is_empty()).then_some(misshown.target_commit.as_str());
    let canonical = loams_proto::canonical_action(
        &misshown.agent,
        &misshown.skill,
        &serde_json::json!({"number": 99}),
        target,
    );
    misshown.action_hash =
        aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, canonical.as_bytes())
            .as_ref()
            .to_vec();
    let refused = phone
        .approvals()
        .decide_shown(&misshown, Decision::Approve, phrase.clone())
        .await;
    assert!(
        matches!(&refused, Err(Error::PermissionDenied(m)) if m.contains("signature does not verify")),
        "{refused:?}"
    );
    let decided = phone
        .approvals()
        .decide_shown(&close, Decision::Approve, close.confirmation_phrase.clone())
        .await
        .unwrap();
    assert_eq!(decided.state, loams_core::ApprovalState::Approved);

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut seen = Vec::new();
    let _watch = phone
        .runs()
        .watch(&server.run_id, Arc::new(Forward(tx)))
        .await
        .unwrap();
    until(
        &mut rx,
        &mut seen,
        "the run to end killed",
        |u| matches!(u, RunUpdate::Run { run } if run.state == "killed"),
    )
    .await;
    let timeline = phone
        .runs()
        .cached_timeline(&server.run_id, 0, 10_000)
        .unwrap();
    assert!(
        timeline
            .iter()
            .any(|e| e.kind == "abandoned" && e.summary == "stopped: killed"),
        "{timeline:#?}"
    );
    assert_eq!(server.sandbox.counts().forgejo.merges, 0);
}
