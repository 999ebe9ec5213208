//! The conformance suites against DynamoDB and SQS on a local moto server.
//!
//! Needs `LOAMS_AWS_ENDPOINT` (what `tests/moto/start` prints); without it every test here fails, so a CI run
//! that forgot to start moto cannot pass by accident:
//!
//! ```sh
//! eval "$(tests/moto/start)"
//! cargo test -p loams-platform --features aws --test aws_conformance
//! tests/moto/stop
//! ```
//!
//! Each test makes its own uniquely named table or queues and deletes them afterwards, also when it fails.
#![cfg(feature = "aws")]

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use loams_platform::aws::{self, DynamoStore, QueueSpec, QueueUrls, SqsQueue};
use loams_platform::conformance::{queue_suite, store_suite, timers_suite};
use loams_platform::{
    Clock, Cond, Item, ManualClock, Page, Queue, Store, StoreError, SystemClock, TimeControl,
};

const START: i64 = 1_700_000_000_000;
/// The suites need at least 3; SQS dead-letters on the receive after this many.
const MAX_RECEIVES: u32 = 3;

fn endpoint() -> String {
    match std::env::var("LOAMS_AWS_ENDPOINT") {
        Ok(e) if !e.is_empty() => e,
        _ => panic!(
            "LOAMS_AWS_ENDPOINT is not set: these tests need a moto server. Run \
             `eval \"$(tests/moto/start)\"` first (and `tests/moto/stop` afterwards)."
        ),
    }
}

/// A name no other test (or earlier run against the same moto) uses.
fn unique(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "loams-test-{what}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Runs `body` and then `cleanup`, also when `body` panics (the panic is then re-raised).
async fn with_cleanup<B, C>(body: B, cleanup: C)
where
    B: Future<Output = ()> + Send + 'static,
    C: Future<Output = ()>,
{
    let outcome = tokio::spawn(body).await;
    cleanup.await;
    if let Err(e) = outcome
        && e.is_panic()
    {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// Runs `body` with a client and a fresh table named after `what`, then deletes the table, also when `body`
/// panics.
async fn with_table<B, Fut>(what: &str, body: B)
where
    B: FnOnce(aws_sdk_dynamodb::Client, String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let conf = aws::local_config(&endpoint()).await;
    let ddb = aws_sdk_dynamodb::Client::new(&conf);
    let name = unique(what);
    aws::provision_table(&ddb, &name)
        .await
        .expect("provision the table on moto");
    with_cleanup(body(ddb.clone(), name.clone()), async {
        aws::delete_table(&ddb, &name).await.expect("delete table");
    })
    .await;
}

/// Real time for SQS, whose visibility timeouts and delays run on the server's clock: `elapse` sleeps. It
/// sleeps a little longer than asked because moto compares times strictly, in milliseconds, on its own clock;
/// "at least `ms` later" then holds on both clocks.
struct RealTime;

impl Clock for RealTime {
    fn now_ms(&self) -> i64 {
        SystemClock.now_ms()
    }
}

#[async_trait::async_trait]
impl TimeControl for RealTime {
    async fn elapse(&self, ms: u64) {
        tokio::time::sleep(Duration::from_millis(ms + 50)).await;
    }
}

#[tokio::test]
async fn dynamodb_store_conformance() {
    with_table("store", |client, table| async move {
        // DynamoDB decides no expiry itself: the adapter compares with its clock, so a manual clock is an
        // honest stand-in for time here.
        let clock = Arc::new(ManualClock::new(START));
        let store = DynamoStore::new(client, table, clock.clone());
        store_suite(&store, &*clock).await;
    })
    .await;
}

#[tokio::test]
async fn dynamodb_timers_conformance() {
    with_table("timers", |client, table| async move {
        let store = DynamoStore::new(client, table, Arc::new(ManualClock::new(START)));
        timers_suite(&store).await;
    })
    .await;
}

#[tokio::test]
async fn sqs_queue_conformance() {
    let conf = aws::local_config(&endpoint()).await;
    let sqs = aws_sdk_sqs::Client::new(&conf);
    let made: Arc<Mutex<Vec<QueueUrls>>> = Arc::default();
    let (client, record) = (sqs.clone(), made.clone());
    with_cleanup(
        async move {
            queue_suite(
                move || {
                    let (client, record) = (client.clone(), record.clone());
                    async move {
                        let spec = QueueSpec {
                            max_receives: MAX_RECEIVES,
                            visibility_timeout_s: 30,
                        };
                        let urls = aws::provision_queue(&client, &unique("q"), spec)
                            .await
                            .expect("provision a queue on moto");
                        record.lock().expect("queue list").push(urls.clone());
                        let time = Arc::new(RealTime);
                        let queue = SqsQueue::new(client, urls, time.clone());
                        (
                            Arc::new(queue) as Arc<dyn Queue>,
                            time as Arc<dyn TimeControl>,
                        )
                    }
                },
                MAX_RECEIVES,
            )
            .await;
        },
        async {
            let urls = made.lock().expect("queue list").clone();
            for u in urls {
                aws::delete_queue(&sqs, &u).await.expect("delete queues");
            }
        },
    )
    .await;
}

/// Index listings re-read the records, so a page stays right when the index holds more than one page and
/// records leave it between pages.
#[tokio::test]
async fn dynamodb_pending_index_pages_past_settled_items() {
    with_table("pending", |client, table| async move {
        let clock = Arc::new(ManualClock::new(START));
        let store = DynamoStore::new(client, table, clock);
        for i in 0..25 {
            let it = Item {
                org: "acme".into(),
                kind: "approval".into(),
                id: format!("a{i:02}"),
                version: 0,
                index: Some("pending".into()),
                body: vec![u8::try_from(i).expect("small"); 3],
                expires_ms: None,
            };
            store.put_item(&it, Cond::Absent).await.expect("put");
        }
        let first = store
            .list_items("acme", "approval", Some("pending"), Page::first(10))
            .await
            .expect("first page");
        assert_eq!(first.items.len(), 10);
        // Settle two approvals on the next page: they must not show up any more.
        for id in ["a10", "a12"] {
            let settled = Item {
                org: "acme".into(),
                kind: "approval".into(),
                id: id.into(),
                version: 0,
                index: None,
                body: b"done".to_vec(),
                expires_ms: None,
            };
            store
                .put_item(&settled, Cond::Version(1))
                .await
                .expect("settle");
        }
        let mut seen: Vec<String> = first.items.into_iter().map(|i| i.id).collect();
        let mut cursor = first.next;
        while let Some(c) = cursor {
            let page = store
                .list_items(
                    "acme",
                    "approval",
                    Some("pending"),
                    Page {
                        cursor: Some(c),
                        limit: 10,
                    },
                )
                .await
                .expect("next page");
            assert!(page.items.len() <= 10);
            seen.extend(page.items.into_iter().map(|i| i.id));
            cursor = page.next;
        }
        let want: Vec<String> = (0..25)
            .filter(|i| *i != 10 && *i != 12)
            .map(|i| format!("a{i:02}"))
            .collect();
        assert_eq!(seen, want);
    })
    .await;
}

/// Text bodies go as they are, others base64-encoded with a marker attribute; both come back byte for byte.
#[tokio::test]
async fn sqs_binary_bodies_round_trip() {
    let conf = aws::local_config(&endpoint()).await;
    let sqs = aws_sdk_sqs::Client::new(&conf);
    let urls = aws::provision_queue(&sqs, &unique("bin"), QueueSpec::default())
        .await
        .expect("provision");
    let (client, u) = (sqs.clone(), urls.clone());
    with_cleanup(
        async move {
            let q = SqsQueue::new(client, u, Arc::new(SystemClock));
            let bodies: [&[u8]; 3] = [
                b"{\"org\":\"acme\"}",
                &[0, 1, 2, 255],
                "é\u{1F600}".as_bytes(),
            ];
            for body in bodies {
                q.send(body, 0).await.expect("send");
            }
            let mut got: Vec<Vec<u8>> = Vec::new();
            for _ in 0..5 {
                for d in q.receive(10, 30_000).await.expect("receive") {
                    q.ack(&d.receipt).await.expect("ack");
                    got.push(d.body);
                }
            }
            got.sort();
            let mut want: Vec<Vec<u8>> = bodies.iter().map(|b| b.to_vec()).collect();
            want.sort();
            assert_eq!(got, want);
        },
        async {
            aws::delete_queue(&sqs, &urls).await.expect("delete queues");
        },
    )
    .await;
}

/// A backend failure (here a table that does not exist) surfaces as `Backend`, never as an empty answer.
#[tokio::test]
async fn dynamodb_failures_surface_as_backend_errors() {
    let conf = aws::local_config(&endpoint()).await;
    let ddb = aws_sdk_dynamodb::Client::new(&conf);
    let store = DynamoStore::new(ddb, unique("missing"), Arc::new(ManualClock::new(START)));
    let got = store.get_run("acme", "r-1").await;
    assert!(
        matches!(&got, Err(StoreError::Backend(m)) if m.contains("ResourceNotFoundException")),
        "{got:?}"
    );
    let got = store
        .create_run("acme", "r-1", "open", b"s", b"e", START)
        .await;
    assert!(matches!(got, Err(StoreError::Backend(_))), "{got:?}");
    let got = store
        .list_items("acme", "approval", Some("pending"), Page::first(5))
        .await;
    assert!(matches!(got, Err(StoreError::Backend(_))), "{got:?}");
}
