//! The cache numbers of docs/benchmarks.md (phones' core section) (issue 4 point 8), through the core's public API against an
//! in-process Connect server on 127.0.0.1 that serves 1,000 runs and one run with a 10,000-event timeline:
//!
//! - opening the cache (`Client::new`: SQLite open, migration check, account check) and listing 1,000 runs;
//! - applying a 10,000-event snapshot to an empty cache, by the poll path (`runs.sync`: GetRun + 50 GetTimeline
//!   pages) and by the stream path (`runs.watch`: one WatchRun stream), transport included;
//! - reading the 10,000 cached events back (what a watch delivers as its first snapshot).
//!
//! `cargo bench -p loams-ffi --bench cache`. With LOAMS_BENCH_KEEP=<dir>, the filled cache is left in
//! <dir>/phone.db (and its server URL in <dir>/server_url) for the memory measurement from Python.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use loams_core::{
    Client, ClientConfig, DeviceSigner, RunListener, RunUpdate, SyncMode, TokenProvider,
};
use loams_proto::connect::{CallContext, ConnectError, Router};
use loams_proto::factory::v1 as pf;
use tokio::sync::mpsc;

const ORG: &str = "acme";
const RUNS: usize = 1_000;
const EVENTS: u64 = 10_000;
const BIG_RUN: &str = "r-big";
/// GetTimeline's largest page on the real server.
const PAGE: u64 = 200;

fn run(i: usize) -> pf::Run {
    pf::Run {
        id: if i == 0 {
            BIG_RUN.into()
        } else {
            format!("r-{i:016x}")
        },
        org: ORG.into(),
        env: "production".into(),
        generation: 1,
        signal: Some(pf::Signal {
            source: "glitchtip".into(),
            fingerprint: format!("fp-{i}"),
            title: "ZeroDivisionError: division by zero in checkout.apply_discount".into(),
            link: format!("https://glitchtip.example/acme/issues/{i}"),
        }),
        state: "succeeded".into(),
        stage: "observe".into(),
        stage_state: "done".into(),
        verdict: "fixed".into(),
        started_at_ms: 1_790_000_000_000 + i as i64,
        updated_at_ms: 1_790_000_100_000 + i as i64,
        version: if i == 0 { EVENTS } else { 25 },
        ..Default::default()
    }
}

fn event(seq: u64) -> pf::TimelineEvent {
    pf::TimelineEvent {
        seq,
        at_ms: 1_790_000_000_000 + seq as i64,
        r#type: "tool_called".into(),
        stage: "fix".into(),
        summary: format!("step {seq}: forgejo.create_pull_request on acme/shop"),
        detail_json: format!(r#"{{"seq":{seq},"agent":"forgejo","skill":"create_pull_request"}}"#),
    }
}

async fn serve() -> String {
    let runs: Arc<Vec<pf::Run>> = Arc::new((0..RUNS).map(run).collect());
    let events: Arc<Vec<pf::TimelineEvent>> = Arc::new((1..=EVENTS).map(event).collect());
    let f = "/loams.factory.v1.FactoryService/";
    let r = Router::new();
    let all = runs.clone();
    let r = r.unary(
        &format!("{f}ListRuns"),
        move |_: CallContext, req: pf::ListRunsRequest| {
            let all = all.clone();
            async move {
                let from: usize = req.page_token.parse().unwrap_or(0);
                let to = (from + req.page_size as usize).min(all.len());
                Ok::<_, ConnectError>(pf::ListRunsResponse {
                    runs: all[from..to].to_vec(),
                    next_page_token: if to < all.len() {
                        to.to_string()
                    } else {
                        String::new()
                    },
                })
            }
        },
    );
    let big = runs[0].clone();
    let r = r.unary(
        &format!("{f}GetRun"),
        move |_: CallContext, _: pf::GetRunRequest| {
            let big = big.clone();
            async move { Ok::<_, ConnectError>(pf::GetRunResponse { run: Some(big) }) }
        },
    );
    let all = events.clone();
    let r = r.unary(
        &format!("{f}GetTimeline"),
        move |_: CallContext, req: pf::GetTimelineRequest| {
            let all = all.clone();
            async move {
                let from = req.after_seq as usize;
                let to = (from + (req.page_size as u64).min(PAGE) as usize).min(all.len());
                Ok::<_, ConnectError>(pf::GetTimelineResponse {
                    events: all[from..to].to_vec(),
                    has_more: to < all.len(),
                })
            }
        },
    );
    let big = runs[0].clone();
    let all = events.clone();
    let r = r.server_stream(
        &format!("{f}WatchRun"),
        move |_: CallContext, req: pf::WatchRunRequest| {
            let (big, all) = (big.clone(), all.clone());
            async move {
                let snapshot = pf::WatchRunResponse {
                    item: Some(pf::watch_run_response::Item::Snapshot(big)),
                };
                let items: Vec<_> = std::iter::once(snapshot)
                    .chain(
                        all[req.after_seq as usize..]
                            .iter()
                            .map(|e| pf::WatchRunResponse {
                                item: Some(pf::watch_run_response::Item::Event(e.clone())),
                            }),
                    )
                    .map(Ok)
                    .collect();
                Ok(futures::stream::iter(items))
            }
        },
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind 127.0.0.1:0");
    let url = format!("http://{}", listener.local_addr().expect("local address"));
    tokio::spawn(async move { axum::serve(listener, r.into_axum_router()).await });
    url
}

struct Token;

#[async_trait]
impl TokenProvider for Token {
    async fn access_token(&self) -> loams_core::Result<String> {
        Ok("bench".into())
    }
}

/// Never asked: nothing here decides or registers.
struct NoSigner;

#[async_trait]
impl DeviceSigner for NoSigner {
    async fn public_key(&self) -> loams_core::Result<Vec<u8>> {
        Err(loams_core::Error::Signer("no key in the benchmark".into()))
    }
    async fn sign(&self, _: Vec<u8>) -> loams_core::Result<Vec<u8>> {
        Err(loams_core::Error::Signer("no key in the benchmark".into()))
    }
}

fn client(url: &str, db: &Path, mode: SyncMode) -> Client {
    let mut config = ClientConfig::new(url, ORG, db);
    config.sync_mode = mode;
    Client::new(config, Arc::new(Token), Arc::new(NoSigner)).expect("the cache opens")
}

struct Counter(mpsc::UnboundedSender<RunUpdate>);

impl RunListener for Counter {
    fn on_update(&self, update: RunUpdate) {
        let _ = self.0.send(update);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn stats(mut xs: Vec<Duration>) -> String {
    xs.sort();
    format!(
        "median {:.2} ms, min {:.2} ms, max {:.2} ms (n={})",
        ms(xs[xs.len() / 2]),
        ms(xs[0]),
        ms(xs[xs.len() - 1]),
        xs.len()
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = serve().await;
    let dir = tempfile::tempdir().expect("a temporary directory");

    // 1. Fill a cache with 1,000 runs, then open it and list them, again and again.
    let db = dir.path().join("phone.db");
    let t = Instant::now();
    let refreshed = client(&url, &db, SyncMode::Stream)
        .runs()
        .refresh()
        .await
        .expect("refresh");
    assert_eq!(refreshed.len(), RUNS);
    println!(
        "refresh 1,000 runs (10 ListRuns pages, loopback): {:.2} ms",
        ms(t.elapsed())
    );
    let mut open_list = Vec::new();
    let mut open_only = Vec::new();
    let mut list_only = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        let c = client(&url, &db, SyncMode::Stream);
        let opened = t.elapsed();
        let runs = c.runs().cached(RUNS as u32).expect("list");
        let total = t.elapsed();
        assert_eq!(runs.len(), RUNS);
        open_only.push(opened);
        list_only.push(total - opened);
        open_list.push(total);
    }
    println!("open the cache + list 1,000 runs: {}", stats(open_list));
    println!("  of which open (Client::new): {}", stats(open_only));
    println!("  of which list 1,000 runs: {}", stats(list_only));

    // 2. A 10,000-event snapshot into an empty cache, by polling and by streaming.
    let mut poll = Vec::new();
    for i in 0..5 {
        let db = dir.path().join(format!("poll-{i}.db"));
        let c = client(&url, &db, SyncMode::Poll);
        let t = Instant::now();
        let synced = c.runs().sync(BIG_RUN).await.expect("sync");
        poll.push(t.elapsed());
        assert_eq!(synced.new_events.len() as u64, EVENTS);
    }
    println!(
        "apply a 10,000-event snapshot, poll path (GetRun + 50 GetTimeline pages): {}",
        stats(poll)
    );
    let mut stream = Vec::new();
    for i in 0..5 {
        let db = dir.path().join(format!("stream-{i}.db"));
        let c = client(&url, &db, SyncMode::Stream);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let t = Instant::now();
        let _watch = c
            .runs()
            .watch(BIG_RUN, Arc::new(Counter(tx)))
            .await
            .expect("watch");
        let mut got = 0u64;
        while let Some(u) = rx.recv().await {
            match u {
                RunUpdate::Events { events } => got += events.len() as u64,
                RunUpdate::Finished => break,
                _ => {}
            }
        }
        stream.push(t.elapsed());
        assert_eq!(got, EVENTS);
    }
    println!(
        "apply a 10,000-event snapshot, stream path (one WatchRun): {}",
        stats(stream)
    );

    // 3. Reading it back: what the next watch delivers as its snapshot.
    let db = dir.path().join("poll-0.db");
    let c = client(&url, &db, SyncMode::Poll);
    let mut read = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let events = c
            .runs()
            .cached_timeline(BIG_RUN, 0, EVENTS as u32)
            .expect("read");
        read.push(t.elapsed());
        assert_eq!(events.len() as u64, EVENTS);
    }
    println!("read 10,000 cached events: {}", stats(read));

    if let Ok(keep) = std::env::var("LOAMS_BENCH_KEEP") {
        // One cache with both: the 1,000 runs and the big run's timeline.
        let keep = Path::new(&keep);
        std::fs::create_dir_all(keep).expect("LOAMS_BENCH_KEEP is a writable directory");
        let db = keep.join("phone.db");
        let _ = std::fs::remove_file(&db);
        let c = client(&url, &db, SyncMode::Poll);
        c.runs().refresh().await.expect("refresh");
        c.runs().sync(BIG_RUN).await.expect("sync");
        std::fs::write(keep.join("server_url"), &url).expect("write server_url");
        println!("kept the filled cache in {}", db.display());
    }
}
