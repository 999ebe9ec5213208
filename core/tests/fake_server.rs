//! Sync behaviour that the real server cannot be made to show on demand, against a small Connect server that
//! records what the client asks: a watch resumed after a restart starts from the stored cursor; a server that
//! cannot stream is polled instead; Loams Bot threads (whose service the real server does not serve yet).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use loams_core::{
    Client, ClientConfig, DeviceSigner, Error, RunListener, RunUpdate, SoftwareSigner, SyncMode,
    ThreadListener, ThreadUpdate, TokenProvider,
};
use loams_proto::bot::v1 as pb;
use loams_proto::connect::{CallContext, ConnectError, Router};
use loams_proto::factory::v1 as pf;
use tokio::sync::mpsc;

const RUN: &str = "r-0123456789abcdef";
const ORG: &str = "acme";

#[derive(Default)]
struct State {
    run: pf::Run,
    events: Vec<pf::TimelineEvent>,
    streaming: bool,
    /// `after_seq` of every WatchRun call.
    watch_after: Vec<u64>,
    /// `after_seq` of every GetTimeline call.
    timeline_after: Vec<u64>,
    messages: Vec<pb::BotMessage>,
    bot_watch_after: Vec<u64>,
}

type Shared = Arc<Mutex<State>>;

fn event(seq: u64) -> pf::TimelineEvent {
    pf::TimelineEvent {
        seq,
        at_ms: seq as i64,
        r#type: format!("e{seq}"),
        summary: format!("event {seq}"),
        ..Default::default()
    }
}

fn add_events(state: &Shared, seqs: std::ops::RangeInclusive<u64>, finish: bool) {
    let mut s = state.lock().unwrap();
    for seq in seqs {
        s.events.push(event(seq));
    }
    s.run.version = s.events.len() as u64;
    if finish {
        s.run.state = "succeeded".into();
    }
}

fn router(state: Shared) -> axum::Router {
    let f = "/loams.factory.v1.FactoryService/";
    let b = "/loams.bot.v1.BotService/";
    let s = state.clone();
    let r = Router::new().unary(
        &format!("{f}GetRun"),
        move |_: CallContext, _: pf::GetRunRequest| {
            let s = s.clone();
            async move {
                Ok::<_, ConnectError>(pf::GetRunResponse {
                    run: Some(s.lock().unwrap().run.clone()),
                })
            }
        },
    );
    let s = state.clone();
    let r = r.unary(
        &format!("{f}GetTimeline"),
        move |_: CallContext, req: pf::GetTimelineRequest| {
            let s = s.clone();
            async move {
                let mut st = s.lock().unwrap();
                st.timeline_after.push(req.after_seq);
                // Two per page, so paging is exercised.
                let after: Vec<_> = st
                    .events
                    .iter()
                    .filter(|e| e.seq > req.after_seq)
                    .cloned()
                    .collect();
                let has_more = after.len() > 2;
                Ok::<_, ConnectError>(pf::GetTimelineResponse {
                    events: after.into_iter().take(2).collect(),
                    has_more,
                })
            }
        },
    );
    let s = state.clone();
    let r = r.server_stream(
        &format!("{f}WatchRun"),
        move |_: CallContext, req: pf::WatchRunRequest| {
            let s = s.clone();
            async move {
                let streaming = {
                    let mut st = s.lock().unwrap();
                    st.watch_after.push(req.after_seq);
                    st.streaming
                };
                if !streaming {
                    // What a proxy that cannot stream (or a server without the procedure) answers.
                    return Err(ConnectError::unimplemented("no streaming here"));
                }
                if req.run_id != RUN {
                    return Err(ConnectError::not_found(format!("no run {}", req.run_id)));
                }
                let snapshot = s.lock().unwrap().run.clone();
                let first = futures::stream::iter([Ok(pf::WatchRunResponse {
                    item: Some(pf::watch_run_response::Item::Snapshot(snapshot)),
                })]);
                // Then every event after the cursor as it appears; the stream ends once a finished run is drained.
                let rest = futures::stream::unfold(
                    (s.clone(), req.after_seq),
                    |(s, mut after)| async move {
                        loop {
                            let (next, finished) = {
                                let st = s.lock().unwrap();
                                (
                                    st.events.iter().find(|e| e.seq > after).cloned(),
                                    st.run.state == "succeeded",
                                )
                            };
                            match next {
                                Some(e) => {
                                    after = e.seq;
                                    let item = pf::WatchRunResponse {
                                        item: Some(pf::watch_run_response::Item::Event(e)),
                                    };
                                    return Some((Ok(item), (s, after)));
                                }
                                None if finished => return None,
                                None => tokio::time::sleep(Duration::from_millis(10)).await,
                            }
                        }
                    },
                );
                Ok(futures::StreamExt::chain(first, rest))
            }
        },
    );
    let r = r.unary(
        &format!("{b}CreateThread"),
        move |_: CallContext, req: pb::CreateThreadRequest| async move {
            Ok::<_, ConnectError>(pb::CreateThreadResponse {
                thread: Some(pb::Thread {
                    id: "t-1".into(),
                    title: req.title,
                    created_at_ms: 1,
                    updated_at_ms: 1,
                    ..Default::default()
                }),
            })
        },
    );
    let s = state.clone();
    let r = r.unary(
        &format!("{b}Send"),
        move |_: CallContext, req: pb::SendRequest| {
            let s = s.clone();
            async move {
                let mut st = s.lock().unwrap();
                let mut add = |role: &str, content: String| {
                    let seq = st.messages.len() as u64 + 1;
                    let m = pb::BotMessage {
                        id: format!("m-{seq}"),
                        thread_id: req.thread_id.clone(),
                        seq,
                        role: role.into(),
                        author: role.into(),
                        content,
                        ..Default::default()
                    };
                    st.messages.push(m.clone());
                    m
                };
                let mine = add("user", req.content.clone());
                add("assistant", format!("echo: {}", req.content));
                Ok::<_, ConnectError>(pb::SendResponse {
                    message: Some(mine),
                })
            }
        },
    );
    let s = state.clone();
    let r = r.unary(
        &format!("{b}ListMessages"),
        move |_: CallContext, _: pb::ListMessagesRequest| {
            let s = s.clone();
            async move {
                Ok::<_, ConnectError>(pb::ListMessagesResponse {
                    messages: s.lock().unwrap().messages.clone(),
                    next_page_token: String::new(),
                })
            }
        },
    );
    let s = state;
    let r = r.server_stream(
        &format!("{b}Watch"),
        move |_: CallContext, req: pb::WatchRequest| {
            let s = s.clone();
            async move {
                s.lock().unwrap().bot_watch_after.push(req.after_seq);
                Ok(futures::stream::unfold(
                    (s, req.after_seq),
                    |(s, mut after)| async move {
                        loop {
                            let next = s
                                .lock()
                                .unwrap()
                                .messages
                                .iter()
                                .find(|m| m.seq > after)
                                .cloned();
                            if let Some(m) = next {
                                after = m.seq;
                                return Some((
                                    Ok(pb::WatchResponse { message: Some(m) }),
                                    (s, after),
                                ));
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    },
                ))
            }
        },
    );
    r.into_axum_router()
}

async fn serve(state: Shared) -> String {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    url
}

fn shared(streaming: bool) -> Shared {
    Arc::new(Mutex::new(State {
        run: pf::Run {
            id: RUN.into(),
            org: ORG.into(),
            state: "running".into(),
            ..Default::default()
        },
        streaming,
        ..Default::default()
    }))
}

struct Token;

#[async_trait]
impl TokenProvider for Token {
    async fn access_token(&self) -> loams_core::Result<String> {
        Ok("t".into())
    }
}

fn client(url: &str, db: &std::path::Path, mode: SyncMode) -> Client {
    let keys: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
    let signer: Arc<dyn DeviceSigner> =
        Arc::new(SoftwareSigner::load_or_create(&keys, "loams", ORG).unwrap());
    let mut config = ClientConfig::new(url, ORG, db);
    config.sync_mode = mode;
    config.poll_interval = Duration::from_millis(20);
    config.reconnect_delay = Duration::from_millis(20);
    Client::new(config, Arc::new(Token), signer).unwrap()
}

struct Forward<T>(mpsc::UnboundedSender<T>);

impl RunListener for Forward<RunUpdate> {
    fn on_update(&self, u: RunUpdate) {
        let _ = self.0.send(u);
    }
}

/// Forwards run updates; after one that can end a watch it holds the watch's thread a while, as a slow screen could,
/// so the test sees what the handle says between that delivery and the end of the task.
struct Lingering(mpsc::UnboundedSender<RunUpdate>);

impl RunListener for Lingering {
    fn on_update(&self, u: RunUpdate) {
        let ends = matches!(
            u,
            RunUpdate::Finished
                | RunUpdate::Connection {
                    connected: false,
                    ..
                }
        );
        let _ = self.0.send(u);
        if ends {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

impl ThreadListener for Forward<ThreadUpdate> {
    fn on_update(&self, u: ThreadUpdate) {
        let _ = self.0.send(u);
    }
}

async fn next<T: std::fmt::Debug>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    want: impl Fn(&T) -> bool,
) -> T {
    loop {
        let u = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("an update in time")
            .expect("open");
        if want(&u) {
            return u;
        }
    }
}

/// Waits up to five seconds for `done`: work finished on another thread (a stream reaching the server) can come a
/// moment after what the test saw, on a busy machine. The caller asserts the outcome.
async fn wait_until(mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !done() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn seqs(u: &RunUpdate) -> Vec<u64> {
    match u {
        RunUpdate::Events { events } => events.iter().map(|e| e.seq).collect(),
        RunUpdate::Snapshot { events, .. } => events.iter().map(|e| e.seq).collect(),
        _ => vec![],
    }
}

#[tokio::test]
async fn a_watch_resumes_from_the_stored_cursor_after_a_restart() {
    let state = shared(true);
    add_events(&state, 1..=3, false);
    let url = serve(state.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("core.db");

    {
        let c = client(&url, &db, SyncMode::Stream);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let _h = c.runs().watch(RUN, Arc::new(Forward(tx))).await.unwrap();
        next(&mut rx, |u| seqs(u).contains(&3)).await;
    } // the app is closed: handle and client dropped

    add_events(&state, 4..=5, false);
    let c = client(&url, &db, SyncMode::Stream);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _h = c.runs().watch(RUN, Arc::new(Forward(tx))).await.unwrap();
    let snapshot = next(&mut rx, |_| true).await;
    assert_eq!(
        seqs(&snapshot),
        vec![1, 2, 3],
        "the snapshot comes from the cache"
    );
    let mut got = Vec::new();
    while !got.contains(&5) {
        got.extend(seqs(
            &next(&mut rx, |u| matches!(u, RunUpdate::Events { .. })).await,
        ));
    }
    assert_eq!(got, vec![4, 5], "only what is new, once");
    assert_eq!(
        *state.lock().unwrap().watch_after.last().unwrap(),
        3,
        "resumed from the cursor, not from scratch"
    );

    add_events(&state, 6..=6, true);
    next(&mut rx, |u| matches!(u, RunUpdate::Finished)).await;
    assert_eq!(
        c.runs().cached_run(RUN).unwrap().unwrap().state,
        "succeeded"
    );
    assert_eq!(c.runs().cached_timeline(RUN, 0, 100).unwrap().len(), 6);
}

// Two runtime threads, so the watch's task runs beside the test: on one thread it would end before the test looked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_cannot_stream_is_polled_from_the_cursor() {
    let state = shared(false);
    add_events(&state, 1..=5, false);
    let url = serve(state.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let c = client(&url, &dir.path().join("core.db"), SyncMode::Stream);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let watch = c.runs().watch(RUN, Arc::new(Lingering(tx))).await.unwrap();
    let notice = next(&mut rx, |u| matches!(u, RunUpdate::Connection { .. })).await;
    assert_eq!(
        notice,
        RunUpdate::Connection {
            connected: true,
            detail: "streaming unavailable; polling".into()
        }
    );
    let mut got = Vec::new();
    while !got.contains(&5) {
        got.extend(seqs(
            &next(&mut rx, |u| matches!(u, RunUpdate::Events { .. })).await,
        ));
    }
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    add_events(&state, 6..=7, true);
    next(&mut rx, |u| matches!(u, RunUpdate::Finished)).await;
    assert!(watch.is_finished(), "finished as soon as it says so");
    assert_eq!(c.runs().cached_timeline(RUN, 0, 100).unwrap().len(), 7);
    let after = state.lock().unwrap().timeline_after.clone();
    assert_eq!(after.first(), Some(&0));
    assert!(
        after.contains(&2) && after.contains(&5),
        "pages follow the cursor: {after:?}"
    );
    assert!(
        !after.iter().skip_while(|a| **a < 5).any(|a| *a < 5),
        "never back: {after:?}"
    );
    assert_eq!(
        state.lock().unwrap().watch_after.len(),
        1,
        "the stream is not retried once it is known missing"
    );
}

// Two runtime threads, as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_the_server_refuses_ends_with_the_reason() {
    let state = shared(true);
    let url = serve(state.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let c = client(&url, &dir.path().join("core.db"), SyncMode::Stream);
    // Offline first, so the watch has already said it is disconnected when the refusal comes.
    c.set_network_available(false);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let watch = c
        .runs()
        .watch("r-missing", Arc::new(Lingering(tx)))
        .await
        .unwrap();
    let offline = next(&mut rx, |u| matches!(u, RunUpdate::Connection { .. })).await;
    assert_eq!(
        offline,
        RunUpdate::Connection {
            connected: false,
            detail: "no network connection".into()
        }
    );
    assert!(!watch.is_finished());
    c.set_network_available(true);
    let notice = next(&mut rx, |u| matches!(u, RunUpdate::Connection { .. })).await;
    let RunUpdate::Connection { connected, detail } = notice else {
        unreachable!()
    };
    assert!(!connected);
    assert!(detail.contains("no run r-missing"), "{detail}");
    // Retrying cannot help: the watch has ended, and says so by the time the reason arrives.
    assert!(watch.is_finished());
    assert_eq!(state.lock().unwrap().watch_after.len(), 1, "not retried");
}

#[tokio::test]
async fn bot_threads_send_and_watch_with_a_resumable_cursor() {
    let state = shared(true);
    let url = serve(state.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("core.db");
    {
        let c = client(&url, &db, SyncMode::Stream);
        let thread = c.bot().create_thread("deploys").await.unwrap();
        assert_eq!(c.bot().cached_threads(10).unwrap(), vec![thread.clone()]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let _h = c
            .bot()
            .watch(&thread.id, Arc::new(Forward(tx)))
            .await
            .unwrap();
        assert_eq!(
            next(&mut rx, |_| true).await,
            ThreadUpdate::Snapshot { messages: vec![] }
        );
        let sent = c.bot().send(&thread.id, "status?").await.unwrap();
        assert_eq!((sent.seq, sent.role.as_str()), (1, "user"));
        let answer = next(&mut rx, |u| matches!(u, ThreadUpdate::Messages { messages } if messages.iter().any(|m| m.seq == 2))).await;
        let ThreadUpdate::Messages { messages } = answer else {
            unreachable!()
        };
        assert_eq!(messages.last().unwrap().content, "echo: status?");
        assert!(matches!(
            c.bot().send(&thread.id, "  ").await,
            Err(Error::InvalidInput(_))
        ));
        c.set_network_available(false);
        assert!(matches!(
            c.bot().send(&thread.id, "hi").await,
            Err(Error::Offline(_))
        ));
        assert_eq!(
            c.bot().cached_messages(&thread.id, 0, 10).unwrap().len(),
            2,
            "nothing kept for later"
        );
    }
    let c = client(&url, &db, SyncMode::Stream);
    let watches_before = state.lock().unwrap().bot_watch_after.len();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _h = c.bot().watch("t-1", Arc::new(Forward(tx))).await.unwrap();
    let ThreadUpdate::Snapshot { messages } = next(&mut rx, |_| true).await else {
        panic!("snapshot first")
    };
    assert_eq!(messages.len(), 2);
    // The snapshot comes from the cache; the stream may reach the server a moment later.
    wait_until(|| state.lock().unwrap().bot_watch_after.len() > watches_before).await;
    assert_eq!(
        *state.lock().unwrap().bot_watch_after.last().unwrap(),
        2,
        "resumed from the cursor"
    );
}
