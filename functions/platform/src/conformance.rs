//! The behaviour every adapter of `Store`, `Queue` and `Timers` must show. Each suite runs named checks in
//! sequence and panics with the check's name and what went wrong; adapters call them from their tests.
//!
//! Preconditions: `store_suite` and `timers_suite` need an empty backend (they use fixed org names);
//! `queue_suite` calls `make` for a fresh, empty queue per check. Time only moves through the
//! given `TimeControl`, in whole seconds.

use std::future::Future;
use std::sync::Arc;

use crate::limits::{MAX_BODY, MAX_DELAY_MS, MAX_MESSAGE, MAX_RECEIVE};
use crate::{Claim, Cond, Item, Page, Queue, Store, StoreError, TimeControl, Timers};

type Checked = Result<(), String>;

/// Turns a port error into a check failure that says which call failed.
trait Ctx<T> {
    fn ctx(self, call: &str) -> Result<T, String>;
}

impl<T> Ctx<T> for Result<T, StoreError> {
    fn ctx(self, call: &str) -> Result<T, String> {
        self.map_err(|e| format!("{call} failed: {e}"))
    }
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// Asserts that a call failed with the expected error variant.
fn expect_err<T: std::fmt::Debug>(
    call: &str,
    got: Result<T, StoreError>,
    want: fn(&StoreError) -> bool,
) -> Checked {
    match got {
        Err(e) if want(&e) => Ok(()),
        other => Err(format!("{call}: unexpected answer {other:?}")),
    }
}

fn is_conflict(e: &StoreError) -> bool {
    matches!(e, StoreError::Conflict)
}
fn is_not_found(e: &StoreError) -> bool {
    matches!(e, StoreError::NotFound)
}
fn is_invalid(e: &StoreError) -> bool {
    matches!(e, StoreError::Invalid(_))
}

fn outcome(suite: &str, name: &str, r: Checked) {
    if let Err(msg) = r {
        panic!("{suite} conformance check `{name}` failed: {msg}");
    }
}

fn item(
    org: &str,
    kind: &str,
    id: &str,
    index: Option<&str>,
    body: &[u8],
    expires_ms: Option<i64>,
) -> Item {
    Item {
        org: org.into(),
        kind: kind.into(),
        id: id.into(),
        version: 0,
        index: index.map(Into::into),
        body: body.to_vec(),
        expires_ms,
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Store

pub async fn store_suite(store: &dyn Store, time: &dyn TimeControl) {
    outcome(
        "store",
        "create_run_is_create_if_absent",
        create_run_once(store, time).await,
    );
    outcome(
        "store",
        "append_commits_events_and_version",
        append_commits(store, time).await,
    );
    outcome(
        "store",
        "append_at_stale_version_conflicts_and_writes_nothing",
        append_conflict(store, time).await,
    );
    outcome(
        "store",
        "append_rejects_missing_run_and_bad_batches",
        append_rejects(store, time).await,
    );
    outcome(
        "store",
        "events_page_by_seq",
        events_paging(store, time).await,
    );
    outcome(
        "store",
        "list_runs_pages_newest_first_and_filters_state",
        list_runs(store, time).await,
    );
    outcome("store", "put_item_conditions", item_conditions(store).await);
    outcome(
        "store",
        "expired_items_are_invisible",
        item_expiry(store, time).await,
    );
    outcome(
        "store",
        "list_items_by_kind_and_index_with_paging",
        item_listing(store).await,
    );
    outcome(
        "store",
        "list_items_by_id_prefix_with_paging",
        item_prefix_listing(store, time).await,
    );
    outcome(
        "store",
        "list_items_in_byte_order_of_the_ids",
        item_byte_order(store).await,
    );
    outcome(
        "store",
        "idempotency_claim_lifecycle",
        idempotency(store, time).await,
    );
    outcome(
        "store",
        "orgs_are_isolated",
        store_isolation(store, time).await,
    );
    outcome(
        "store",
        "inputs_are_validated",
        store_validation(store, time).await,
    );
}

async fn create_run_once(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-create", t.now_ms());
    let created = s
        .create_run(org, "r-1", "open", b"snap-1", b"ev-1", now)
        .await
        .ctx("create_run")?;
    ensure!(created, "first create_run returned false");
    let again = s
        .create_run(org, "r-1", "other", b"snap-x", b"ev-x", now + 5)
        .await
        .ctx("create_run again")?;
    ensure!(!again, "second create_run of the same id returned true");
    let row = s
        .get_run(org, "r-1")
        .await
        .ctx("get_run")?
        .ok_or("created run not found")?;
    ensure!(row.org == org && row.id == "r-1", "wrong keys {row:?}");
    ensure!(
        row.version == 1,
        "version {} after create, want 1",
        row.version
    );
    ensure!(
        row.state == "open" && row.snapshot == b"snap-1",
        "second create changed the run: {row:?}"
    );
    ensure!(
        row.updated_ms == now,
        "updated_ms {} want {now}",
        row.updated_ms
    );
    let events = s.events(org, "r-1", 0, 100).await.ctx("events")?;
    ensure!(
        events.len() == 1 && events[0].seq == 1 && events[0].body == b"ev-1",
        "events after create: {events:?}"
    );
    ensure!(
        s.get_run(org, "r-missing")
            .await
            .ctx("get_run missing")?
            .is_none(),
        "missing run found"
    );
    Ok(())
}

async fn append_commits(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-append", t.now_ms());
    s.create_run(org, "r-1", "open", b"s1", b"e1", now)
        .await
        .ctx("create_run")?;
    let v = s
        .append(
            org,
            "r-1",
            1,
            "fixing",
            b"s3",
            &[b"e2".to_vec(), b"e3".to_vec()],
            now + 10,
        )
        .await
        .ctx("append")?;
    ensure!(
        v == 3,
        "append of 2 events at version 1 returned {v}, want 3"
    );
    let v = s
        .append(org, "r-1", 3, "done", b"s4", &[b"e4".to_vec()], now + 20)
        .await
        .ctx("second append")?;
    ensure!(v == 4, "append returned {v}, want 4");
    let row = s
        .get_run(org, "r-1")
        .await
        .ctx("get_run")?
        .ok_or("run vanished")?;
    ensure!(
        row.version == 4 && row.state == "done" && row.snapshot == b"s4",
        "run after appends: {row:?}"
    );
    ensure!(
        row.updated_ms == now + 20,
        "updated_ms {} want {}",
        row.updated_ms,
        now + 20
    );
    let events = s.events(org, "r-1", 0, 100).await.ctx("events")?;
    let got: Vec<(u64, &[u8])> = events.iter().map(|e| (e.seq, e.body.as_slice())).collect();
    let want: Vec<(u64, &[u8])> = vec![(1, b"e1"), (2, b"e2"), (3, b"e3"), (4, b"e4")];
    ensure!(got == want, "events {got:?}, want {want:?}");
    Ok(())
}

async fn append_conflict(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-conflict", t.now_ms());
    s.create_run(org, "r-1", "open", b"s1", b"e1", now)
        .await
        .ctx("create_run")?;
    s.append(org, "r-1", 1, "fixing", b"s2", &[b"e2".to_vec()], now)
        .await
        .ctx("append")?;
    for stale in [0, 1, 3] {
        let r = s
            .append(
                org,
                "r-1",
                stale,
                "bad",
                b"bad",
                &[b"bad".to_vec(), b"bad".to_vec()],
                now,
            )
            .await;
        expect_err(
            &format!("append at version {stale} when the run is at 2"),
            r,
            is_conflict,
        )?;
    }
    let row = s
        .get_run(org, "r-1")
        .await
        .ctx("get_run")?
        .ok_or("run vanished")?;
    ensure!(
        row.version == 2 && row.state == "fixing" && row.snapshot == b"s2",
        "a conflicting append wrote: {row:?}"
    );
    let events = s.events(org, "r-1", 0, 100).await.ctx("events")?;
    ensure!(
        events.len() == 2,
        "a conflicting append wrote events: {events:?}"
    );
    Ok(())
}

async fn append_rejects(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-reject", t.now_ms());
    let r = s
        .append(org, "r-none", 1, "open", b"s", &[b"e".to_vec()], now)
        .await;
    expect_err("append to a missing run", r, is_not_found)?;
    ensure!(
        s.get_run(org, "r-none").await.ctx("get_run")?.is_none(),
        "append created a missing run"
    );
    s.create_run(org, "r-1", "open", b"s1", b"e1", now)
        .await
        .ctx("create_run")?;
    expect_err(
        "append without events",
        s.append(org, "r-1", 1, "open", b"s", &[], now).await,
        is_invalid,
    )?;
    let big = vec![0u8; MAX_BODY + 1];
    let r = s
        .append(
            org,
            "r-1",
            1,
            "open",
            b"s",
            &[b"ok".to_vec(), big.clone()],
            now,
        )
        .await;
    expect_err("append with an oversized event", r, is_invalid)?;
    let r = s
        .append(org, "r-1", 1, "open", &big, &[b"ok".to_vec()], now)
        .await;
    expect_err("append with an oversized snapshot", r, is_invalid)?;
    let row = s
        .get_run(org, "r-1")
        .await
        .ctx("get_run")?
        .ok_or("run vanished")?;
    ensure!(
        row.version == 1 && row.snapshot == b"s1",
        "a rejected append wrote: {row:?}"
    );
    let events = s.events(org, "r-1", 0, 100).await.ctx("events")?;
    ensure!(
        events.len() == 1,
        "a rejected append wrote events: {events:?}"
    );
    let max = vec![7u8; MAX_BODY];
    let v = s
        .append(org, "r-1", 1, "open", &max, std::slice::from_ref(&max), now)
        .await
        .ctx("append at the size limit")?;
    ensure!(v == 2, "append at the size limit returned {v}");
    Ok(())
}

async fn events_paging(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-events", t.now_ms());
    s.create_run(org, "r-1", "open", b"s", b"e1", now)
        .await
        .ctx("create_run")?;
    let more: Vec<Vec<u8>> = (2..=7).map(|i| format!("e{i}").into_bytes()).collect();
    s.append(org, "r-1", 1, "open", b"s", &more, now)
        .await
        .ctx("append")?;
    let page = s.events(org, "r-1", 2, 3).await.ctx("events after 2")?;
    let seqs: Vec<u64> = page.iter().map(|e| e.seq).collect();
    ensure!(
        seqs == [3, 4, 5],
        "events(after 2, limit 3) gave seqs {seqs:?}"
    );
    ensure!(page[0].body == b"e3", "event 3 body {:?}", page[0].body);
    let tail = s.events(org, "r-1", 5, 100).await.ctx("events after 5")?;
    ensure!(
        tail.iter().map(|e| e.seq).eq([6, 7]),
        "events after 5: {tail:?}"
    );
    ensure!(
        s.events(org, "r-1", 7, 100)
            .await
            .ctx("events after last")?
            .is_empty(),
        "events after the last seq"
    );
    ensure!(
        s.events(org, "r-none", 0, 100)
            .await
            .ctx("events of missing run")?
            .is_empty(),
        "missing run has events"
    );
    expect_err(
        "events with limit 0",
        s.events(org, "r-1", 0, 0).await,
        is_invalid,
    )?;
    Ok(())
}

async fn list_runs(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-list-runs", t.now_ms());
    // Creation times: r-a oldest ... r-e newest, with r-c and r-d created in the same millisecond.
    let runs = [
        ("r-a", "open", 1),
        ("r-b", "done", 2),
        ("r-c", "open", 3),
        ("r-d", "open", 3),
        ("r-e", "done", 4),
    ];
    for (id, state, at) in runs {
        s.create_run(org, id, state, b"s", b"e", now + at)
            .await
            .ctx("create_run")?;
    }
    s.create_run("conf-list-other", "r-z", "open", b"s", b"e", now)
        .await
        .ctx("create_run other org")?;
    let mut seen = Vec::new();
    let mut page = Page::first(2);
    let mut pages = 0;
    loop {
        let got = s
            .list_runs(org, None, page.clone())
            .await
            .ctx("list_runs")?;
        pages += 1;
        ensure!(
            got.items.len() <= 2,
            "page of limit 2 had {} runs",
            got.items.len()
        );
        ensure!(pages <= 3, "5 runs in pages of 2 took more than 3 pages");
        seen.extend(got.items.iter().map(|r| r.id.clone()));
        match got.next {
            Some(next) => {
                page = Page {
                    cursor: Some(next),
                    limit: 2,
                }
            }
            None => break,
        }
    }
    let want = ["r-e", "r-d", "r-c", "r-b", "r-a"];
    // Runs created in the same millisecond may come in either order; all else is newest first.
    let tie_ok = seen == want || seen == ["r-e", "r-c", "r-d", "r-b", "r-a"];
    ensure!(
        tie_ok,
        "list_runs paged to {seen:?}, want newest first {want:?}"
    );
    let open = s
        .list_runs(org, Some("open"), Page::first(100))
        .await
        .ctx("list_runs open")?;
    let mut ids: Vec<&str> = open.items.iter().map(|r| r.id.as_str()).collect();
    ensure!(open.next.is_none(), "a complete page returned a cursor");
    ids.sort_unstable();
    ensure!(ids == ["r-a", "r-c", "r-d"], "open runs {ids:?}");
    let none = s
        .list_runs(org, Some("killed"), Page::first(10))
        .await
        .ctx("list_runs killed")?;
    ensure!(
        none.items.is_empty() && none.next.is_none(),
        "no killed runs expected: {none:?}"
    );
    let bad = Page {
        cursor: Some("not a cursor".into()),
        limit: 2,
    };
    expect_err(
        "list_runs with a garbage cursor",
        s.list_runs(org, None, bad).await,
        is_invalid,
    )?;
    expect_err(
        "list_runs with limit 0",
        s.list_runs(org, None, Page::first(0)).await,
        is_invalid,
    )?;
    Ok(())
}

async fn item_conditions(s: &dyn Store) -> Checked {
    let org = "conf-items";
    let mut it = item(org, "approval", "a1", Some("pending"), b"v1", None);
    ensure!(
        s.put_item(&it, Cond::Absent).await.ctx("put Absent")? == 1,
        "first put is not version 1"
    );
    it.body = b"v-lost".to_vec();
    expect_err(
        "put Absent over an existing item",
        s.put_item(&it, Cond::Absent).await,
        is_conflict,
    )?;
    expect_err(
        "put Version(2) at version 1",
        s.put_item(&it, Cond::Version(2)).await,
        is_conflict,
    )?;
    it.body = b"v2".to_vec();
    it.index = None;
    ensure!(
        s.put_item(&it, Cond::Version(1))
            .await
            .ctx("put Version(1)")?
            == 2,
        "put Version(1) is not version 2"
    );
    expect_err(
        "put Version(1) again",
        s.put_item(&it, Cond::Version(1)).await,
        is_conflict,
    )?;
    it.body = b"v3".to_vec();
    ensure!(
        s.put_item(&it, Cond::Any).await.ctx("put Any")? == 3,
        "put Any is not version 3"
    );
    let got = s
        .get_item(org, "approval", "a1")
        .await
        .ctx("get_item")?
        .ok_or("item missing")?;
    ensure!(
        got.version == 3 && got.body == b"v3" && got.index.is_none(),
        "item after puts: {got:?}"
    );
    ensure!(
        got.org == org && got.kind == "approval" && got.id == "a1",
        "item keys: {got:?}"
    );
    let other = s
        .get_item(org, "device", "a1")
        .await
        .ctx("get_item other kind")?;
    ensure!(other.is_none(), "same id under another kind is visible");
    let fresh = item(org, "approval", "a2", None, b"x", None);
    expect_err(
        "put Version(1) on a missing item",
        s.put_item(&fresh, Cond::Version(1)).await,
        is_conflict,
    )?;
    ensure!(
        s.put_item(&fresh, Cond::Any)
            .await
            .ctx("put Any on missing")?
            == 1,
        "put Any on missing is not 1"
    );
    s.delete_item(org, "approval", "a1")
        .await
        .ctx("delete_item")?;
    ensure!(
        s.get_item(org, "approval", "a1")
            .await
            .ctx("get deleted")?
            .is_none(),
        "deleted item still there"
    );
    s.delete_item(org, "approval", "a1")
        .await
        .ctx("delete_item twice")?;
    ensure!(
        s.put_item(&it, Cond::Absent)
            .await
            .ctx("put Absent after delete")?
            == 1,
        "recreated item not at 1"
    );
    Ok(())
}

async fn item_expiry(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-expiry", t.now_ms());
    let short = item(
        org,
        "challenge",
        "c1",
        Some("open"),
        b"nonce",
        Some(now + 2000),
    );
    s.put_item(&short, Cond::Absent).await.ctx("put expiring")?;
    s.put_item(
        &item(org, "challenge", "c2", Some("open"), b"keep", None),
        Cond::Absent,
    )
    .await
    .ctx("put lasting")?;
    let got = s
        .get_item(org, "challenge", "c1")
        .await
        .ctx("get before expiry")?
        .ok_or("unexpired item missing")?;
    ensure!(
        got.expires_ms == Some(now + 2000),
        "expires_ms not kept: {got:?}"
    );
    t.elapse(2000).await;
    ensure!(
        s.get_item(org, "challenge", "c1")
            .await
            .ctx("get expired")?
            .is_none(),
        "item visible at its expiry"
    );
    let listed = s
        .list_items(org, "challenge", None, Page::first(10))
        .await
        .ctx("list")?;
    ensure!(
        listed.items.iter().map(|i| i.id.as_str()).eq(["c2"]),
        "list shows expired items: {listed:?}"
    );
    let by_index = s
        .list_items(org, "challenge", Some("open"), Page::first(10))
        .await
        .ctx("list by index")?;
    ensure!(
        by_index.items.len() == 1,
        "index list shows expired items: {by_index:?}"
    );
    expect_err(
        "put Version(1) on an expired item",
        s.put_item(&short, Cond::Version(1)).await,
        is_conflict,
    )?;
    let v = s
        .put_item(
            &item(org, "challenge", "c1", None, b"new", None),
            Cond::Absent,
        )
        .await
        .ctx("put over expired")?;
    ensure!(
        v == 1,
        "put Absent over an expired item gave version {v}, want 1"
    );
    Ok(())
}

/// The order the worker's kill-switch read relies on (`agent:<name>` < `org` < `run:<id>`): bytes, not a collation
/// that folds case or sorts punctuation apart.
async fn item_byte_order(s: &dyn Store) -> Checked {
    let org = "conf-byte-order";
    for id in [
        "run:r-1",
        "org",
        "agent:zulip",
        "Zulip",
        "agent:plane",
        "agent-x",
    ] {
        s.put_item(&item(org, "kill", id, None, b"x", None), Cond::Absent)
            .await
            .ctx("put")?;
    }
    let listed = s
        .list_items(org, "kill", None, Page::first(10))
        .await
        .ctx("list_items")?;
    let ids: Vec<&str> = listed.items.iter().map(|i| i.id.as_str()).collect();
    ensure!(
        ids == [
            "Zulip",
            "agent-x",
            "agent:plane",
            "agent:zulip",
            "org",
            "run:r-1"
        ],
        "listed {ids:?}"
    );
    Ok(())
}

/// The ids of a listing read `limit` items a page until it has no next page (ten pages at the most), each page
/// checked to hold at most `limit`.
async fn ids_of_every_page<F, Fut>(limit: u32, mut list: F) -> Result<Vec<String>, String>
where
    F: FnMut(Page) -> Fut,
    Fut: Future<Output = Result<crate::Paged<Item>, StoreError>>,
{
    let mut seen = Vec::new();
    let mut page = Page::first(limit);
    for _ in 0..10 {
        let got = list(page).await.ctx("listing a page")?;
        ensure!(
            got.items.len() <= limit as usize,
            "page of limit {limit} had {}",
            got.items.len()
        );
        seen.extend(got.items.into_iter().map(|i| i.id));
        match got.next {
            Some(next) => {
                page = Page {
                    cursor: Some(next),
                    limit,
                }
            }
            None => break,
        }
    }
    Ok(seen)
}

async fn item_listing(s: &dyn Store) -> Checked {
    let org = "conf-list-items";
    // Written out of id order: the listing's order must come from the ids, not from the writes.
    for i in [3, 0, 6, 1, 5, 2, 4] {
        let index = if i % 2 == 0 {
            Some("pending")
        } else {
            Some("settled")
        };
        s.put_item(
            &item(org, "approval", &format!("a{i}"), index, b"x", None),
            Cond::Absent,
        )
        .await
        .ctx("put")?;
    }
    s.put_item(
        &item(org, "device", "d1", Some("pending"), b"x", None),
        Cond::Absent,
    )
    .await
    .ctx("put device")?;
    s.put_item(
        &item(
            "conf-list-other",
            "approval",
            "a9",
            Some("pending"),
            b"x",
            None,
        ),
        Cond::Absent,
    )
    .await
    .ctx("put other org")?;
    let seen = ids_of_every_page(3, |page| s.list_items(org, "approval", None, page)).await?;
    ensure!(
        seen == ["a0", "a1", "a2", "a3", "a4", "a5", "a6"],
        "paged approvals {seen:?}"
    );
    let pending = s
        .list_items(org, "approval", Some("pending"), Page::first(100))
        .await
        .ctx("list pending")?;
    let ids: Vec<&str> = pending.items.iter().map(|i| i.id.as_str()).collect();
    ensure!(ids == ["a0", "a2", "a4", "a6"], "pending approvals {ids:?}");
    ensure!(
        pending
            .items
            .iter()
            .all(|i| i.index.as_deref() == Some("pending")),
        "index not returned"
    );
    // Moving an item out of the index (approval settled) removes it from the index listing.
    let settled = item(org, "approval", "a0", None, b"done", None);
    s.put_item(&settled, Cond::Version(1))
        .await
        .ctx("settle a0")?;
    let pending = s
        .list_items(org, "approval", Some("pending"), Page::first(100))
        .await
        .ctx("list pending")?;
    ensure!(
        pending.items.len() == 3,
        "settled item still indexed: {pending:?}"
    );
    let two = s
        .list_items(org, "approval", Some("pending"), Page::first(2))
        .await
        .ctx("list pending by 2")?;
    let next = two.next.ok_or("first of two pages has no cursor")?;
    let rest = s
        .list_items(
            org,
            "approval",
            Some("pending"),
            Page {
                cursor: Some(next),
                limit: 2,
            },
        )
        .await;
    let rest = rest.ctx("second page")?;
    ensure!(
        rest.items.len() == 1 && rest.next.is_none(),
        "second index page {rest:?}"
    );
    Ok(())
}

/// Ids that begin with their owner list one owner's items (the A2A task store keys tasks by caller this way).
async fn item_prefix_listing(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-prefix", t.now_ms());
    // Written out of order; the prefix itself, its first and last possible next characters (a space: keys hold no
    // control characters), and ids that share all but its last byte or differ only in case.
    let inside = ["a:", "a: ", "a:1", "a:2", "a:3", "a:\u{e9}", "a:\u{10ffff}"];
    for id in [
        "a:3",
        "a: ",
        "b:1",
        "a:\u{10ffff}",
        "a",
        "a:1",
        "A:1",
        "a;",
        "a:\u{e9}",
        "a:",
        "a:2",
        "a9",
    ] {
        s.put_item(&item(org, "task", id, None, b"x", None), Cond::Absent)
            .await
            .ctx("put")?;
    }
    let expiring = item(org, "task", "a:0", None, b"x", Some(now + 1000));
    s.put_item(&expiring, Cond::Absent)
        .await
        .ctx("put expiring")?;
    s.put_item(&item(org, "other", "a:1", None, b"x", None), Cond::Absent)
        .await
        .ctx("put other kind")?;
    s.put_item(
        &item("conf-prefix-other", "task", "a:1", None, b"x", None),
        Cond::Absent,
    )
    .await
    .ctx("put other org")?;
    t.elapse(1000).await;
    let seen =
        ids_of_every_page(2, |page| s.list_items_with_prefix(org, "task", "a:", page)).await?;
    ensure!(seen == inside, "listed {seen:?}");
    let none = s
        .list_items_with_prefix(org, "task", "c:", Page::first(10))
        .await
        .ctx("list an unused prefix")?;
    ensure!(none.items.is_empty() && none.next.is_none(), "{none:?}");
    expect_err(
        "list with an empty prefix",
        s.list_items_with_prefix(org, "task", "", Page::first(10))
            .await,
        is_invalid,
    )
}

async fn idempotency(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (org, now) = ("conf-idem", t.now_ms());
    let key = "r-1:fix:1:open_pr";
    ensure!(
        s.claim(org, key, now, 1000).await.ctx("claim")? == Claim::New,
        "first claim is not New"
    );
    let c = s
        .claim(org, key, now + 999, 1000)
        .await
        .ctx("claim during lease")?;
    ensure!(c == Claim::InProgress, "claim during the lease gave {c:?}");
    let c = s
        .claim(org, key, now + 1000, 1000)
        .await
        .ctx("claim after lease")?;
    ensure!(c == Claim::New, "claim after the lease ran out gave {c:?}");
    let c = s
        .claim(org, key, now + 1500, 1000)
        .await
        .ctx("claim during the new lease")?;
    ensure!(
        c == Claim::InProgress,
        "the takeover did not renew the lease: {c:?}"
    );
    s.finish(org, key, b"pr-42", now + 1600)
        .await
        .ctx("finish")?;
    let c = s
        .claim(org, key, now + 1700, 1000)
        .await
        .ctx("claim after finish")?;
    ensure!(
        c == Claim::Done(b"pr-42".to_vec()),
        "claim after finish gave {c:?}"
    );
    let c = s
        .claim(org, key, now + 10_000_000, 1000)
        .await
        .ctx("claim long after")?;
    ensure!(
        c == Claim::Done(b"pr-42".to_vec()),
        "a finished key expired: {c:?}"
    );
    s.finish(org, key, b"other", now + 1800)
        .await
        .ctx("finish again")?;
    s.release(org, key).await.ctx("release finished")?;
    let c = s
        .claim(org, key, now + 1900, 1000)
        .await
        .ctx("claim after refinish")?;
    ensure!(
        c == Claim::Done(b"pr-42".to_vec()),
        "finish/release changed a finished key: {c:?}"
    );

    let k2 = "r-1:fix:1:comment";
    ensure!(
        s.claim(org, k2, now, 60_000).await.ctx("claim k2")? == Claim::New,
        "claim k2 not New"
    );
    s.release(org, k2).await.ctx("release")?;
    let c = s
        .claim(org, k2, now + 1, 60_000)
        .await
        .ctx("claim after release")?;
    ensure!(c == Claim::New, "claim after release gave {c:?}");
    s.release(org, "never-claimed")
        .await
        .ctx("release unknown key")?;
    s.finish(org, "unclaimed", b"r", now)
        .await
        .ctx("finish unclaimed")?;
    let c = s
        .claim(org, "unclaimed", now, 1000)
        .await
        .ctx("claim unclaimed")?;
    ensure!(
        c == Claim::Done(b"r".to_vec()),
        "finish without a claim not recorded: {c:?}"
    );
    Ok(())
}

async fn store_isolation(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let (a, b, now) = ("conf-iso-a", "conf-iso-b", t.now_ms());
    s.create_run(a, "r-1", "open", b"secret", b"ev", now)
        .await
        .ctx("create_run in A")?;
    ensure!(
        s.get_run(b, "r-1").await.ctx("get_run from B")?.is_none(),
        "org B reads org A's run"
    );
    ensure!(
        s.events(b, "r-1", 0, 10)
            .await
            .ctx("events from B")?
            .is_empty(),
        "org B reads org A's events"
    );
    let listed = s
        .list_runs(b, None, Page::first(10))
        .await
        .ctx("list_runs B")?;
    ensure!(listed.items.is_empty(), "org B lists org A's runs");
    expect_err(
        "append to A's run as B",
        s.append(b, "r-1", 1, "x", b"x", &[b"x".to_vec()], now)
            .await,
        is_not_found,
    )?;
    // The same run id in B is a different run.
    ensure!(
        s.create_run(b, "r-1", "open", b"b", b"b", now)
            .await
            .ctx("create in B")?,
        "B's run blocked by A's"
    );
    let a_run = s
        .get_run(a, "r-1")
        .await
        .ctx("get_run A")?
        .ok_or("A's run vanished")?;
    ensure!(a_run.snapshot == b"secret", "B's create changed A's run");

    s.put_item(
        &item(a, "kill", "org", Some("on"), b"a", None),
        Cond::Absent,
    )
    .await
    .ctx("put in A")?;
    ensure!(
        s.get_item(b, "kill", "org")
            .await
            .ctx("get_item B")?
            .is_none(),
        "org B reads org A's item"
    );
    let listed = s
        .list_items(b, "kill", None, Page::first(10))
        .await
        .ctx("list_items B")?;
    ensure!(listed.items.is_empty(), "org B lists org A's items");
    let v = s
        .put_item(&item(b, "kill", "org", None, b"b", None), Cond::Absent)
        .await
        .ctx("put in B")?;
    ensure!(v == 1, "B's put saw A's item (version {v})");
    s.delete_item(b, "kill", "org").await.ctx("delete in B")?;
    ensure!(
        s.get_item(a, "kill", "org")
            .await
            .ctx("get_item A")?
            .is_some(),
        "B's delete removed A's item"
    );

    s.claim(a, "k", now, 1000).await.ctx("claim A")?;
    s.finish(a, "k", b"a-result", now).await.ctx("finish A")?;
    let c = s.claim(b, "k", now, 1000).await.ctx("claim B")?;
    ensure!(
        c == Claim::New,
        "org B sees org A's idempotency record: {c:?}"
    );
    s.release(b, "k").await.ctx("release B")?;
    let c = s.claim(a, "k", now, 1000).await.ctx("claim A again")?;
    ensure!(
        c == Claim::Done(b"a-result".to_vec()),
        "B's release touched A's record: {c:?}"
    );
    Ok(())
}

async fn store_validation(s: &dyn Store, t: &dyn TimeControl) -> Checked {
    let now = t.now_ms();
    let long_org = "a".repeat(64);
    for org in [
        "",
        "Bad",
        "-lead",
        "has_underscore",
        "has space",
        long_org.as_str(),
        "a/b",
    ] {
        let r = s.create_run(org, "r-1", "open", b"s", b"e", now).await;
        expect_err(&format!("create_run in org {org:?}"), r, is_invalid)?;
        expect_err(
            &format!("get_item in org {org:?}"),
            s.get_item(org, "kill", "x").await,
            is_invalid,
        )?;
        expect_err(
            &format!("claim in org {org:?}"),
            s.claim(org, "k", now, 10).await,
            is_invalid,
        )?;
    }
    let max_org = "a".repeat(63);
    s.create_run(&max_org, "r-1", "open", b"s", b"e", now)
        .await
        .ctx("create_run with a 63-char org")?;
    s.create_run("0-conf-digits", "r-1", "open", b"s", b"e", now)
        .await
        .ctx("create_run with a digit org")?;

    let big = vec![0u8; MAX_BODY + 1];
    let org = "conf-valid";
    expect_err(
        "oversized snapshot",
        s.create_run(org, "r-1", "open", &big, b"e", now).await,
        is_invalid,
    )?;
    expect_err(
        "oversized first event",
        s.create_run(org, "r-1", "open", b"s", &big, now).await,
        is_invalid,
    )?;
    ensure!(
        s.get_run(org, "r-1").await.ctx("get_run")?.is_none(),
        "a rejected create_run wrote"
    );
    expect_err(
        "empty run id",
        s.create_run(org, "", "open", b"s", b"e", now).await,
        is_invalid,
    )?;
    expect_err(
        "empty state",
        s.create_run(org, "r-2", "", b"s", b"e", now).await,
        is_invalid,
    )?;
    let r = s
        .put_item(&item(org, "approval", "a", None, &big, None), Cond::Any)
        .await;
    expect_err("oversized item body", r, is_invalid)?;
    ensure!(
        s.get_item(org, "approval", "a")
            .await
            .ctx("get_item")?
            .is_none(),
        "a rejected put wrote"
    );
    let r = s
        .put_item(&item(org, "Bad Kind", "a", None, b"x", None), Cond::Any)
        .await;
    expect_err("malformed kind", r, is_invalid)?;
    let r = s
        .put_item(
            &item(org, "approval", &"x".repeat(10_000), None, b"x", None),
            Cond::Any,
        )
        .await;
    expect_err("oversized item id", r, is_invalid)?;
    expect_err(
        "oversized result",
        s.finish(org, "k", &big, now).await,
        is_invalid,
    )?;
    let long_cursor = Page {
        cursor: Some("c".repeat(100_000)),
        limit: 10,
    };
    expect_err(
        "oversized cursor",
        s.list_items(org, "approval", None, long_cursor).await,
        is_invalid,
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Queue

/// Runs the queue checks; `make` returns a fresh empty queue and the time it runs on, and `max_receives` is
/// the receive count after which the adapter dead-letters a message.
pub async fn queue_suite<F, Fut>(make: F, max_receives: u32)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn Queue>, Arc<dyn TimeControl>)>,
{
    // The visibility and retry checks receive one message three times and must not see it dead-lettered.
    assert!(
        max_receives >= 3,
        "queue_suite needs an adapter with max_receives >= 3, got {max_receives}"
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "send_receive_ack",
        send_receive_ack(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "unacked_message_reappears_after_visibility",
        visibility(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "delayed_send_is_invisible_until_due",
        delay(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "stale_receipt_ack_is_a_noop",
        stale_ack(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "retry_later_changes_visibility",
        retry_later(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "extended_receipt_stays_valid_past_its_first_window",
        extended_ack(&*q, &*t).await,
    );
    let (q, t) = make().await;
    outcome(
        "queue",
        "dead_letter_after_max_receives",
        dead_letter(&*q, &*t, max_receives).await,
    );
    let (q, _) = make().await;
    outcome(
        "queue",
        "receive_batches_are_bounded_and_distinct",
        batches(&*q).await,
    );
    let (q, _) = make().await;
    outcome(
        "queue",
        "queue_inputs_are_validated",
        queue_validation(&*q).await,
    );
}

const VIS: u64 = 30_000;

async fn send_receive_ack(q: &dyn Queue, _t: &dyn TimeControl) -> Checked {
    q.send(b"hello", 0).await.ctx("send")?;
    let got = q.receive(10, VIS).await.ctx("receive")?;
    ensure!(got.len() == 1, "received {} messages, want 1", got.len());
    let d = &got[0];
    ensure!(d.body == b"hello" && d.receive_count == 1, "delivery {d:?}");
    ensure!(
        !d.receipt.is_empty() && !d.id.is_empty(),
        "delivery without id or receipt: {d:?}"
    );
    ensure!(
        q.receive(10, VIS)
            .await
            .ctx("receive in flight")?
            .is_empty(),
        "in-flight message received again"
    );
    q.ack(&d.receipt).await.ctx("ack")?;
    q.ack(&d.receipt).await.ctx("ack twice")?;
    ensure!(
        q.receive(10, VIS)
            .await
            .ctx("receive after ack")?
            .is_empty(),
        "acked message received"
    );
    Ok(())
}

async fn visibility(q: &dyn Queue, t: &dyn TimeControl) -> Checked {
    q.send(b"m", 0).await.ctx("send")?;
    let first = q.receive(1, 2000).await.ctx("receive")?;
    let first = first.first().ok_or("nothing received")?;
    t.elapse(1000).await;
    ensure!(
        q.receive(1, 2000).await.ctx("receive early")?.is_empty(),
        "message visible before its timeout"
    );
    t.elapse(1000).await;
    let again = q.receive(1, VIS).await.ctx("receive after timeout")?;
    let again = again
        .first()
        .ok_or("message did not reappear after its visibility timeout")?;
    ensure!(
        again.id == first.id && again.body == b"m",
        "a different message reappeared: {again:?}"
    );
    ensure!(
        again.receive_count == 2,
        "receive_count {} on the second receive",
        again.receive_count
    );
    ensure!(
        again.receipt != first.receipt,
        "the second receive reused the receipt"
    );
    Ok(())
}

async fn delay(q: &dyn Queue, t: &dyn TimeControl) -> Checked {
    q.send(b"later", 3000).await.ctx("send delayed")?;
    q.send(b"now", 0).await.ctx("send")?;
    let got = q.receive(10, VIS).await.ctx("receive")?;
    ensure!(
        got.len() == 1 && got[0].body == b"now",
        "receive before the delay: {got:?}"
    );
    t.elapse(3000).await;
    let got = q.receive(10, VIS).await.ctx("receive after delay")?;
    ensure!(
        got.len() == 1 && got[0].body == b"later",
        "receive after the delay: {got:?}"
    );
    Ok(())
}

async fn stale_ack(q: &dyn Queue, t: &dyn TimeControl) -> Checked {
    q.send(b"m", 0).await.ctx("send")?;
    let old = q
        .receive(1, 1000)
        .await
        .ctx("receive")?
        .pop()
        .ok_or("nothing received")?;
    t.elapse(1000).await;
    let new = q
        .receive(1, 1000)
        .await
        .ctx("receive again")?
        .pop()
        .ok_or("message did not reappear")?;
    q.ack(&old.receipt)
        .await
        .ctx("ack with the stale receipt")?;
    q.retry_later(&old.receipt, 0)
        .await
        .ctx("retry_later with the stale receipt")?;
    ensure!(
        q.receive(1, 1000).await.ctx("receive")?.is_empty(),
        "a stale retry_later changed visibility"
    );
    t.elapse(1000).await;
    let third = q
        .receive(1, VIS)
        .await
        .ctx("receive third")?
        .pop()
        .ok_or("a stale ack deleted the message")?;
    ensure!(third.id == new.id, "wrong message {third:?}");
    q.ack(&third.receipt).await.ctx("ack current")?;
    t.elapse(VIS).await;
    ensure!(
        q.receive(1, VIS).await.ctx("receive after ack")?.is_empty(),
        "current ack did not delete"
    );
    q.ack("no-such-receipt")
        .await
        .ctx("ack an unknown receipt")?;
    Ok(())
}

async fn retry_later(q: &dyn Queue, t: &dyn TimeControl) -> Checked {
    q.send(b"m", 0).await.ctx("send")?;
    let d = q
        .receive(1, VIS)
        .await
        .ctx("receive")?
        .pop()
        .ok_or("nothing received")?;
    q.retry_later(&d.receipt, 2000)
        .await
        .ctx("retry_later 2s")?;
    t.elapse(1000).await;
    ensure!(
        q.receive(1, VIS).await.ctx("receive early")?.is_empty(),
        "visible before the retry delay"
    );
    t.elapse(1000).await;
    let d = q
        .receive(1, VIS)
        .await
        .ctx("receive after retry delay")?
        .pop()
        .ok_or("not visible after the delay")?;
    ensure!(
        d.receive_count == 2,
        "receive_count {} after one retry",
        d.receive_count
    );
    q.retry_later(&d.receipt, 0).await.ctx("retry_later 0")?;
    let d = q
        .receive(1, VIS)
        .await
        .ctx("receive after retry 0")?
        .pop()
        .ok_or("retry_later(0) did not release")?;
    ensure!(
        d.receive_count == 3,
        "receive_count {} after two retries",
        d.receive_count
    );
    Ok(())
}

/// What a worker does with a step longer than its visibility timeout: extend the message's visibility with
/// `retry_later` before each window lapses, then ack with the same receipt. Neither call may turn into a no-op
/// after the first window, since the message was not received again.
async fn extended_ack(q: &dyn Queue, t: &dyn TimeControl) -> Checked {
    q.send(b"long step", 0).await.ctx("send")?;
    let d = q
        .receive(1, 1000)
        .await
        .ctx("receive")?
        .pop()
        .ok_or("nothing received")?;
    q.retry_later(&d.receipt, 2000).await.ctx("extend")?;
    t.elapse(1000).await;
    // Past the receive's window: this extension only counts if the first one made the receipt last.
    q.retry_later(&d.receipt, 3000).await.ctx("extend again")?;
    t.elapse(2000).await;
    // Past the first extension, within the second.
    ensure!(
        q.receive(1, VIS)
            .await
            .ctx("receive while extended")?
            .is_empty(),
        "the message reappeared while its visibility was being extended"
    );
    q.ack(&d.receipt).await.ctx("ack after the extensions")?;
    // Past the second extension: an ack that did nothing would let the message reappear now.
    t.elapse(1000).await;
    ensure!(
        q.receive(1, VIS).await.ctx("receive after ack")?.is_empty(),
        "an ack after extending the visibility did not delete the message"
    );
    Ok(())
}

async fn dead_letter(q: &dyn Queue, t: &dyn TimeControl, max_receives: u32) -> Checked {
    q.send(b"poison", 0).await.ctx("send poison")?;
    let mut id = None;
    for n in 1..=max_receives {
        let d = q.receive(1, 1000).await.ctx("receive poison")?.pop();
        let d = d.ok_or(format!("receive {n} of {max_receives} got nothing"))?;
        ensure!(
            d.receive_count == n,
            "receive {n} reported receive_count {}",
            d.receive_count
        );
        id = Some(d.id);
        t.elapse(1000).await;
    }
    ensure!(
        q.dead_letters(10)
            .await
            .ctx("dead_letters early")?
            .is_empty(),
        "dead-lettered too early"
    );
    q.send(b"fine", 0).await.ctx("send fine")?;
    let got = q.receive(10, VIS).await.ctx("receive past max")?;
    ensure!(
        got.len() == 1 && got[0].body == b"fine",
        "past max_receives, receive gave {got:?}"
    );
    let dead = q.dead_letters(10).await.ctx("dead_letters")?;
    ensure!(dead.len() == 1, "{} dead letters, want 1", dead.len());
    ensure!(
        Some(&dead[0].id) == id.as_ref() && dead[0].body == b"poison",
        "dead letter {:?}",
        dead[0]
    );
    ensure!(
        dead[0].receive_count >= max_receives,
        "dead letter receive_count {}",
        dead[0].receive_count
    );
    t.elapse(VIS).await;
    let got = q.receive(10, VIS).await.ctx("receive later")?;
    ensure!(
        got.iter().all(|d| d.body != b"poison"),
        "a dead letter was delivered again"
    );
    Ok(())
}

async fn batches(q: &dyn Queue) -> Checked {
    let total = MAX_RECEIVE as usize + 5;
    for i in 0..total {
        q.send(format!("m{i}").as_bytes(), 0).await.ctx("send")?;
    }
    let first = q.receive(3, VIS).await.ctx("receive 3")?;
    ensure!(first.len() == 3, "receive(3) gave {}", first.len());
    let second = q.receive(1000, VIS).await.ctx("receive 1000")?;
    ensure!(
        second.len() == MAX_RECEIVE as usize,
        "receive(1000) gave {}, want the cap {MAX_RECEIVE}",
        second.len()
    );
    let third = q.receive(10, VIS).await.ctx("receive rest")?;
    let mut bodies: Vec<Vec<u8>> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .map(|d| d.body.clone())
        .collect();
    bodies.sort();
    bodies.dedup();
    ensure!(
        bodies.len() == total,
        "{} distinct messages of {total} delivered",
        bodies.len()
    );
    expect_err("receive(0)", q.receive(0, VIS).await, is_invalid)?;
    Ok(())
}

async fn queue_validation(q: &dyn Queue) -> Checked {
    expect_err(
        "oversized message",
        q.send(&vec![0u8; MAX_MESSAGE + 1], 0).await,
        is_invalid,
    )?;
    expect_err(
        "delay past the maximum",
        q.send(b"m", MAX_DELAY_MS + 1).await,
        is_invalid,
    )?;
    q.send(&vec![1u8; MAX_MESSAGE], MAX_DELAY_MS)
        .await
        .ctx("send at the limits")?;
    expect_err("empty receipt", q.ack("").await, is_invalid)?;
    expect_err(
        "oversized receipt",
        q.ack(&"r".repeat(100_000)).await,
        is_invalid,
    )?;
    expect_err("dead_letters(0)", q.dead_letters(0).await, is_invalid)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Timers

pub async fn timers_suite(timers: &dyn Timers) {
    outcome(
        "timers",
        "due_returns_due_timers_in_order",
        due_in_order(timers).await,
    );
    outcome(
        "timers",
        "schedule_upserts_and_cancel_removes",
        upsert_cancel(timers).await,
    );
    outcome(
        "timers",
        "timers_are_scoped_by_org",
        timer_isolation(timers).await,
    );
    outcome(
        "timers",
        "timer_inputs_are_validated",
        timer_validation(timers).await,
    );
}

async fn due_ids(t: &dyn Timers, now: i64) -> Result<Vec<(String, String)>, String> {
    Ok(t.due(now, 1000)
        .await
        .ctx("due")?
        .into_iter()
        .map(|t| (t.org, t.id))
        .collect())
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(o, i)| ((*o).to_owned(), (*i).to_owned()))
        .collect()
}

async fn due_in_order(t: &dyn Timers) -> Checked {
    let org = "conf-timers";
    t.schedule(org, "c", 300, b"pc").await.ctx("schedule c")?;
    t.schedule(org, "a", 100, b"pa").await.ctx("schedule a")?;
    t.schedule(org, "b", 200, b"pb").await.ctx("schedule b")?;
    ensure!(
        due_ids(t, 99).await?.is_empty(),
        "timers due before their time"
    );
    ensure!(
        due_ids(t, 100).await? == pairs(&[(org, "a")]),
        "due at 100 (inclusive)"
    );
    let all = t.due(1000, 1000).await.ctx("due all")?;
    let got: Vec<(&str, i64, &[u8])> = all
        .iter()
        .map(|t| (t.id.as_str(), t.due_ms, t.payload.as_slice()))
        .collect();
    let want: Vec<(&str, i64, &[u8])> =
        vec![("a", 100, b"pa"), ("b", 200, b"pb"), ("c", 300, b"pc")];
    ensure!(got == want, "due(1000) gave {got:?}");
    let two = t.due(1000, 2).await.ctx("due limit 2")?;
    ensure!(
        two.iter().map(|t| t.id.as_str()).eq(["a", "b"]),
        "due with limit 2: {two:?}"
    );
    ensure!(due_ids(t, 1000).await?.len() == 3, "due() removed timers");
    for id in ["a", "b", "c"] {
        t.cancel(org, id).await.ctx("cancel")?;
    }
    ensure!(
        due_ids(t, i64::MAX).await?.is_empty(),
        "cancelled timers still due"
    );
    Ok(())
}

async fn upsert_cancel(t: &dyn Timers) -> Checked {
    let org = "conf-timers-upsert";
    t.schedule(org, "w", 100, b"one").await.ctx("schedule")?;
    t.schedule(org, "w", 500, b"two").await.ctx("reschedule")?;
    ensure!(
        due_ids(t, 499).await?.is_empty(),
        "reschedule kept the old due time"
    );
    let all = t.due(500, 10).await.ctx("due")?;
    ensure!(
        all.len() == 1 && all[0].payload == b"two" && all[0].due_ms == 500,
        "after upsert: {all:?}"
    );
    t.cancel(org, "w").await.ctx("cancel")?;
    t.cancel(org, "w").await.ctx("cancel twice")?;
    ensure!(
        due_ids(t, i64::MAX).await?.is_empty(),
        "cancelled timer still due"
    );
    Ok(())
}

async fn timer_isolation(t: &dyn Timers) -> Checked {
    let (a, b) = ("conf-timers-a", "conf-timers-b");
    t.schedule(a, "same", 10, b"a").await.ctx("schedule A")?;
    t.schedule(b, "same", 20, b"b").await.ctx("schedule B")?;
    ensure!(
        due_ids(t, 100).await? == pairs(&[(a, "same"), (b, "same")]),
        "same id in two orgs"
    );
    t.cancel(b, "same").await.ctx("cancel B")?;
    let left = t.due(100, 10).await.ctx("due")?;
    ensure!(
        left.len() == 1 && left[0].org == a && left[0].payload == b"a",
        "B's cancel touched A: {left:?}"
    );
    t.cancel(a, "same").await.ctx("cancel A")?;
    Ok(())
}

async fn timer_validation(t: &dyn Timers) -> Checked {
    expect_err(
        "schedule in a bad org",
        t.schedule("Bad Org", "x", 1, b"").await,
        is_invalid,
    )?;
    expect_err(
        "empty timer id",
        t.schedule("conf-timers", "", 1, b"").await,
        is_invalid,
    )?;
    expect_err(
        "oversized payload",
        t.schedule("conf-timers", "x", 1, &vec![0u8; MAX_BODY + 1])
            .await,
        is_invalid,
    )?;
    expect_err("due(limit 0)", t.due(0, 0).await, is_invalid)?;
    ensure!(
        due_ids(t, i64::MAX).await?.is_empty(),
        "a rejected schedule wrote a timer"
    );
    Ok(())
}
