//! The conformance suites and the SQLite-specific guarantees (concurrency, durability, migrations).

use std::sync::Arc;

use loams_platform::conformance::{queue_suite, store_suite, timers_suite};
use loams_platform::{
    Claim, Clock, Cond, DEFAULT_MAX_RECEIVES, Item, ManualClock, Page, Queue, Sqlite, Store,
    StoreError, TimeControl, Timers,
};
use tempfile::TempDir;

const START: i64 = 1_700_000_000_000;

fn open_file(dir: &TempDir, clock: Arc<ManualClock>) -> Sqlite {
    Sqlite::open(dir.path().join("loams.db"), clock).expect("open sqlite file in a temp dir")
}

#[tokio::test]
async fn sqlite_store_conformance() {
    let dir = TempDir::new().expect("temp dir");
    let clock = Arc::new(ManualClock::new(START));
    let db = open_file(&dir, clock.clone());
    store_suite(&db, &*clock).await;
}

#[tokio::test]
async fn sqlite_memory_store_conformance() {
    let clock = Arc::new(ManualClock::new(START));
    let db = Sqlite::memory(clock.clone()).expect("in-memory sqlite");
    store_suite(&db, &*clock).await;
}

#[tokio::test]
async fn sqlite_queue_conformance() {
    let dirs = std::sync::Mutex::new(Vec::new());
    queue_suite(
        || {
            let dir = TempDir::new().expect("temp dir");
            let clock = Arc::new(ManualClock::new(START));
            let db = open_file(&dir, clock.clone());
            dirs.lock().expect("dirs").push(dir);
            async move {
                (
                    Arc::new(db) as Arc<dyn Queue>,
                    clock as Arc<dyn TimeControl>,
                )
            }
        },
        DEFAULT_MAX_RECEIVES,
    )
    .await;
}

#[tokio::test]
async fn sqlite_queue_conformance_with_custom_max_receives() {
    queue_suite(
        || {
            let clock = Arc::new(ManualClock::new(START));
            let db = Sqlite::memory(clock.clone())
                .expect("in-memory sqlite")
                .with_max_receives(3);
            async move {
                (
                    Arc::new(db) as Arc<dyn Queue>,
                    clock as Arc<dyn TimeControl>,
                )
            }
        },
        3,
    )
    .await;
}

#[tokio::test]
async fn sqlite_timers_conformance() {
    let dir = TempDir::new().expect("temp dir");
    let db = open_file(&dir, Arc::new(ManualClock::new(START)));
    timers_suite(&db).await;
}

/// Two tasks on one handle append at the same expected version: exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_on_one_handle_have_one_winner() {
    let dir = TempDir::new().expect("temp dir");
    let db = Arc::new(open_file(&dir, Arc::new(ManualClock::new(START))));
    concurrent_appends(db.clone(), db.clone(), &db).await;
}

/// The same on two connections to one file: the guarantee must hold across processes, where the mutex does
/// not serialize and SQLite's write lock (plus busy_timeout) has to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_on_two_connections_have_one_winner() {
    let dir = TempDir::new().expect("temp dir");
    let a = Arc::new(open_file(&dir, Arc::new(ManualClock::new(START))));
    let b = Arc::new(open_file(&dir, Arc::new(ManualClock::new(START))));
    concurrent_appends(a.clone(), b, &a).await;
}

async fn concurrent_appends(a: Arc<Sqlite>, b: Arc<Sqlite>, check: &Sqlite) {
    for round in 0..20 {
        let id = format!("r-{round}");
        assert!(
            check
                .create_run("acme", &id, "open", b"s", b"e1", START)
                .await
                .expect("create")
        );
        let go = Arc::new(tokio::sync::Barrier::new(2));
        let task = |db: Arc<Sqlite>, tag: &'static str| {
            let (go, id) = (go.clone(), id.clone());
            tokio::spawn(async move {
                go.wait().await;
                db.append(
                    "acme",
                    &id,
                    1,
                    tag,
                    tag.as_bytes(),
                    &[tag.as_bytes().to_vec()],
                    START,
                )
                .await
            })
        };
        let (ra, rb) = (task(a.clone(), "a"), task(b.clone(), "b"));
        let (ra, rb) = (ra.await.expect("task a"), rb.await.expect("task b"));
        let winner = match (&ra, &rb) {
            (Ok(2), Err(StoreError::Conflict)) => "a",
            (Err(StoreError::Conflict), Ok(2)) => "b",
            other => panic!("round {round}: expected exactly one winner, got {other:?}"),
        };
        let run = check
            .get_run("acme", &id)
            .await
            .expect("get")
            .expect("run exists");
        assert_eq!(
            (run.version, run.state.as_str()),
            (2, winner),
            "round {round}"
        );
        let events = check.events("acme", &id, 0, 10).await.expect("events");
        assert_eq!(events.len(), 2, "round {round}: the loser wrote events");
        assert_eq!(
            events[1].body,
            winner.as_bytes(),
            "round {round}: event from the loser"
        );
    }
}

/// Concurrent receivers never get the same message twice within its visibility window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_receivers_split_messages() {
    let dir = TempDir::new().expect("temp dir");
    let clock = Arc::new(ManualClock::new(START));
    let a = Arc::new(open_file(&dir, clock.clone()));
    let b = Arc::new(open_file(&dir, clock.clone()));
    for i in 0..40 {
        a.send(format!("m{i}").as_bytes(), 0).await.expect("send");
    }
    let drain = |q: Arc<Sqlite>| {
        tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = q.receive(3, 60_000).await.expect("receive");
                if batch.is_empty() {
                    return got;
                }
                got.extend(batch.into_iter().map(|d| d.body));
            }
        })
    };
    let (x, y) = (drain(a), drain(b));
    let mut all = x.await.expect("drain a");
    all.extend(y.await.expect("drain b"));
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(
        (n, all.len()),
        (40, 40),
        "each message delivered exactly once"
    );
}

/// Everything written survives closing and reopening the file.
#[tokio::test]
async fn file_database_survives_reopen() {
    let dir = TempDir::new().expect("temp dir");
    let clock = Arc::new(ManualClock::new(START));
    {
        let db = open_file(&dir, clock.clone());
        db.create_run("acme", "r-1", "open", b"s1", b"e1", START)
            .await
            .expect("create");
        db.append(
            "acme",
            "r-1",
            1,
            "fixing",
            b"s2",
            &[b"e2".to_vec()],
            START + 1,
        )
        .await
        .expect("append");
        let it = Item {
            org: "acme".into(),
            kind: "approval".into(),
            id: "a1".into(),
            version: 0,
            index: Some("pending".into()),
            body: b"ask".to_vec(),
            expires_ms: None,
        };
        db.put_item(&it, Cond::Absent).await.expect("put");
        db.claim("acme", "k1", START, 1000).await.expect("claim");
        db.finish("acme", "k1", b"done", START)
            .await
            .expect("finish");
        db.send(b"msg", 0).await.expect("send");
        db.schedule("acme", "t1", START + 5000, b"tick")
            .await
            .expect("schedule");
    }
    let db = open_file(&dir, clock.clone());
    let run = db
        .get_run("acme", "r-1")
        .await
        .expect("get")
        .expect("run after reopen");
    assert_eq!(
        (run.version, run.state.as_str(), run.snapshot.as_slice()),
        (2, "fixing", &b"s2"[..])
    );
    assert_eq!(
        db.events("acme", "r-1", 0, 10).await.expect("events").len(),
        2
    );
    let items = db
        .list_items("acme", "approval", Some("pending"), Page::first(10))
        .await
        .expect("list");
    assert_eq!(items.items.len(), 1);
    assert_eq!(
        db.claim("acme", "k1", START, 1000).await.expect("claim"),
        Claim::Done(b"done".to_vec())
    );
    let msgs = db.receive(10, 1000).await.expect("receive");
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0].body, b"msg");
    let due = db.due(START + 5000, 10).await.expect("due");
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].payload, b"tick");
    // An in-flight message keeps its receipt across a restart, so the receiver can still ack it.
    drop(db);
    let db = open_file(&dir, clock.clone());
    db.ack(&msgs[0].receipt).await.expect("ack after reopen");
    clock.advance(2000);
    assert!(
        db.receive(10, 1000).await.expect("receive").is_empty(),
        "acked message came back"
    );
}

/// A database written by a newer binary is refused rather than misread.
#[tokio::test]
async fn newer_schema_is_refused() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("loams.db");
    drop(Sqlite::open(&path, Arc::new(ManualClock::new(START))).expect("first open"));
    {
        let conn = rusqlite::Connection::open(&path).expect("raw open");
        conn.pragma_update(None, "user_version", 99)
            .expect("bump version");
    }
    match Sqlite::open(&path, Arc::new(ManualClock::new(START))) {
        Err(StoreError::Backend(msg)) => assert!(msg.contains("newer"), "{msg}"),
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("opened a database with a newer schema"),
    }
}

#[tokio::test]
async fn reopening_does_not_rerun_migrations() {
    let dir = TempDir::new().expect("temp dir");
    for _ in 0..3 {
        let db = open_file(&dir, Arc::new(ManualClock::new(START)));
        db.send(b"m", 0).await.expect("send");
    }
    let db = open_file(&dir, Arc::new(ManualClock::new(START)));
    assert_eq!(db.receive(10, 1000).await.expect("receive").len(), 3);
}

#[test]
fn system_clock_is_wall_time() {
    let now = loams_platform::SystemClock.now_ms();
    // 2023-11-14 .. 2100: catches a seconds/ms mix-up and an epoch of 0.
    assert!(
        (1_700_000_000_000..4_102_444_800_000).contains(&now),
        "{now}"
    );
}

#[test]
fn manual_clock_moves_only_when_told() {
    let clock = ManualClock::new(5);
    assert_eq!(clock.now_ms(), 5);
    clock.advance(10);
    assert_eq!(clock.now_ms(), 15);
    clock.set(-3);
    assert_eq!(clock.now_ms(), -3);
    clock.set(i64::MAX - 1);
    clock.advance(u64::MAX);
    assert_eq!(clock.now_ms(), i64::MAX, "advance saturates");
}

/// With a zero visibility timeout a delivered message is visible again at once; dead-lettering in the same
/// batch must not make the receive pick it up a second time.
#[tokio::test]
async fn zero_visibility_batch_with_a_dead_letter_has_no_duplicates() {
    let clock = Arc::new(ManualClock::new(START));
    let db = Sqlite::memory(clock.clone())
        .expect("memory")
        .with_max_receives(1);
    db.send(b"poison", 0).await.expect("send");
    assert_eq!(db.receive(1, 0).await.expect("first receive").len(), 1);
    db.send(b"a", 0).await.expect("send a");
    db.send(b"b", 0).await.expect("send b");
    let got = db.receive(10, 0).await.expect("receive");
    let mut bodies: Vec<&[u8]> = got.iter().map(|d| d.body.as_slice()).collect();
    bodies.sort_unstable();
    assert_eq!(bodies, [&b"a"[..], &b"b"[..]], "{got:?}");
    assert_eq!(db.dead_letters(10).await.expect("dead letters").len(), 1);
}
