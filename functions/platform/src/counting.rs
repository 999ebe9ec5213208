//! `Counting<T>`: a decorator over any `Store`, `Queue` or `Timers` that delegates every call unchanged and
//! counts it, so a benchmark (or an operator) can say how many store and queue operations the engine needs per
//! run without instrumenting each adapter.
//!
//! Counts are relaxed atomics: each counter is exact on its own, but a snapshot taken while calls are in flight
//! is not a consistent cut across counters. Take snapshots when the system is quiet, or accept that skew.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use async_trait::async_trait;

use crate::{
    Claim, Cond, Delivery, Durability, EventRow, Item, Page, Paged, Queue, Result, RunRow, Store,
    StoreError, Timer, Timers,
};

/// Declares the live counters and their plain snapshot from one field list, so the two cannot drift apart.
macro_rules! counters {
    ($($(#[$doc:meta])* $field:ident),* $(,)?) => {
        #[derive(Debug, Default)]
        struct Counters {
            $($field: AtomicU64,)*
        }

        /// A snapshot of the operation counters of a [`Counting`] adapter.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct OpCounts {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl Counters {
            fn snapshot(&self) -> OpCounts {
                OpCounts { $($field: self.$field.load(Relaxed),)* }
            }
        }

        impl OpCounts {
            /// The operations counted between `earlier` and `self` (field by field; never below zero).
            pub fn since(&self, earlier: &OpCounts) -> OpCounts {
                OpCounts { $($field: self.$field.saturating_sub(earlier.$field),)* }
            }

            /// Every field with its name, in declaration order (for tables and logs).
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field),)*]
            }
        }
    };
}

counters! {
    /// `Store::create_run` calls (a conditional write: create-if-absent).
    create_run,
    /// `Store::append` calls (conditional on the expected version).
    append,
    /// Events written by successful appends.
    appended_events,
    /// `Store::get_run` calls.
    get_run,
    /// `Store::list_runs` calls.
    list_runs,
    /// `Store::events` calls.
    events,
    /// Events those calls returned.
    events_read,
    /// `Store::get_item` calls.
    get_item,
    /// `Store::put_item` and `put_item_with` calls (conditional unless `Cond::Any`).
    put_item,
    /// Of those, calls with `Durability::Replayable` (whose commit may skip the sync to disk).
    replayable_puts,
    /// `Store::delete_item` calls.
    delete_item,
    /// `Store::list_items` and `Store::list_items_with_prefix` calls.
    list_items,
    /// `Store::claim` calls (a conditional write on the idempotency key).
    claim,
    /// `Store::finish` calls.
    finish,
    /// `Store::release` calls.
    release,
    /// Conditional writes (`append`, `put_item`) refused with `Conflict`.
    conflicts,
    /// `Queue::send` calls.
    send,
    /// `Queue::receive` calls, empty or not.
    receive,
    /// Messages delivered by `Queue::receive`.
    received,
    /// `Queue::ack` calls.
    ack,
    /// `Queue::retry_later` calls.
    retry_later,
    /// `Queue::dead_letters` calls.
    dead_letters,
    /// `Timers::schedule` calls.
    schedule,
    /// `Timers::cancel` calls.
    cancel,
    /// `Timers::due` calls.
    due,
}

impl OpCounts {
    /// Store calls that only read.
    pub fn store_reads(&self) -> u64 {
        self.get_run + self.list_runs + self.events + self.get_item + self.list_items
    }

    /// Store calls that write (each one transaction in the SQLite adapter).
    pub fn store_writes(&self) -> u64 {
        self.create_run
            + self.append
            + self.put_item
            + self.delete_item
            + self.claim
            + self.finish
            + self.release
    }

    /// Queue calls of any kind.
    pub fn queue_ops(&self) -> u64 {
        self.send + self.receive + self.ack + self.retry_later + self.dead_letters
    }

    /// Timer calls of any kind.
    pub fn timer_ops(&self) -> u64 {
        self.schedule + self.cancel + self.due
    }
}

/// Wraps an adapter and counts every call made through it. One `Counting` may serve as store, queue and timers
/// at once when `T` implements all three (as `Sqlite` does); the counts then cover all three ports.
#[derive(Debug, Default)]
pub struct Counting<T> {
    inner: T,
    counters: Counters,
}

impl<T> Counting<T> {
    pub fn new(inner: T) -> Self {
        Counting {
            inner,
            counters: Counters::default(),
        }
    }

    /// The wrapped adapter; calls made on it directly are not counted.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    pub fn counts(&self) -> OpCounts {
        self.counters.snapshot()
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }

    fn note_conflict<V>(&self, result: &Result<V>) {
        if matches!(result, Err(StoreError::Conflict)) {
            Self::bump(&self.counters.conflicts);
        }
    }
}

#[async_trait]
impl<T: Store> Store for Counting<T> {
    async fn create_run(
        &self,
        org: &str,
        id: &str,
        state: &str,
        snapshot: &[u8],
        first_event: &[u8],
        now_ms: i64,
    ) -> Result<bool> {
        Self::bump(&self.counters.create_run);
        self.inner
            .create_run(org, id, state, snapshot, first_event, now_ms)
            .await
    }

    async fn append(
        &self,
        org: &str,
        id: &str,
        expected_version: u64,
        state: &str,
        snapshot: &[u8],
        events: &[Vec<u8>],
        now_ms: i64,
    ) -> Result<u64> {
        Self::bump(&self.counters.append);
        let result = self
            .inner
            .append(org, id, expected_version, state, snapshot, events, now_ms)
            .await;
        self.note_conflict(&result);
        if result.is_ok() {
            self.counters
                .appended_events
                .fetch_add(events.len() as u64, Relaxed);
        }
        result
    }

    async fn get_run(&self, org: &str, id: &str) -> Result<Option<RunRow>> {
        Self::bump(&self.counters.get_run);
        self.inner.get_run(org, id).await
    }

    async fn list_runs(&self, org: &str, state: Option<&str>, page: Page) -> Result<Paged<RunRow>> {
        Self::bump(&self.counters.list_runs);
        self.inner.list_runs(org, state, page).await
    }

    async fn events(
        &self,
        org: &str,
        id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        Self::bump(&self.counters.events);
        let rows = self.inner.events(org, id, after_seq, limit).await?;
        self.counters
            .events_read
            .fetch_add(rows.len() as u64, Relaxed);
        Ok(rows)
    }

    async fn get_item(&self, org: &str, kind: &str, id: &str) -> Result<Option<Item>> {
        Self::bump(&self.counters.get_item);
        self.inner.get_item(org, kind, id).await
    }

    async fn put_item(&self, item: &Item, cond: Cond) -> Result<u64> {
        self.put_item_with(item, cond, Durability::Durable).await
    }

    async fn put_item_with(&self, item: &Item, cond: Cond, durability: Durability) -> Result<u64> {
        Self::bump(&self.counters.put_item);
        if durability == Durability::Replayable {
            Self::bump(&self.counters.replayable_puts);
        }
        let result = self.inner.put_item_with(item, cond, durability).await;
        self.note_conflict(&result);
        result
    }

    async fn delete_item(&self, org: &str, kind: &str, id: &str) -> Result<()> {
        Self::bump(&self.counters.delete_item);
        self.inner.delete_item(org, kind, id).await
    }

    async fn list_items(
        &self,
        org: &str,
        kind: &str,
        index: Option<&str>,
        page: Page,
    ) -> Result<Paged<Item>> {
        Self::bump(&self.counters.list_items);
        self.inner.list_items(org, kind, index, page).await
    }

    async fn list_items_with_prefix(
        &self,
        org: &str,
        kind: &str,
        prefix: &str,
        page: Page,
    ) -> Result<Paged<Item>> {
        Self::bump(&self.counters.list_items);
        self.inner
            .list_items_with_prefix(org, kind, prefix, page)
            .await
    }

    async fn claim(&self, org: &str, key: &str, now_ms: i64, lease_ms: u64) -> Result<Claim> {
        Self::bump(&self.counters.claim);
        self.inner.claim(org, key, now_ms, lease_ms).await
    }

    async fn finish(&self, org: &str, key: &str, result: &[u8], now_ms: i64) -> Result<()> {
        Self::bump(&self.counters.finish);
        self.inner.finish(org, key, result, now_ms).await
    }

    async fn release(&self, org: &str, key: &str) -> Result<()> {
        Self::bump(&self.counters.release);
        self.inner.release(org, key).await
    }
}

#[async_trait]
impl<T: Queue> Queue for Counting<T> {
    async fn send(&self, body: &[u8], delay_ms: u64) -> Result<()> {
        Self::bump(&self.counters.send);
        self.inner.send(body, delay_ms).await
    }

    async fn receive(&self, max: u32, visibility_ms: u64) -> Result<Vec<Delivery>> {
        Self::bump(&self.counters.receive);
        let result = self.inner.receive(max, visibility_ms).await;
        if let Ok(deliveries) = &result {
            self.counters
                .received
                .fetch_add(deliveries.len() as u64, Relaxed);
        }
        result
    }

    async fn ack(&self, receipt: &str) -> Result<()> {
        Self::bump(&self.counters.ack);
        self.inner.ack(receipt).await
    }

    async fn retry_later(&self, receipt: &str, delay_ms: u64) -> Result<()> {
        Self::bump(&self.counters.retry_later);
        self.inner.retry_later(receipt, delay_ms).await
    }

    async fn dead_letters(&self, limit: u32) -> Result<Vec<Delivery>> {
        Self::bump(&self.counters.dead_letters);
        self.inner.dead_letters(limit).await
    }
}

#[async_trait]
impl<T: Timers> Timers for Counting<T> {
    async fn schedule(&self, org: &str, id: &str, due_ms: i64, payload: &[u8]) -> Result<()> {
        Self::bump(&self.counters.schedule);
        self.inner.schedule(org, id, due_ms, payload).await
    }

    async fn cancel(&self, org: &str, id: &str) -> Result<()> {
        Self::bump(&self.counters.cancel);
        self.inner.cancel(org, id).await
    }

    async fn due(&self, now_ms: i64, limit: u32) -> Result<Vec<Timer>> {
        Self::bump(&self.counters.due);
        self.inner.due(now_ms, limit).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::conformance::{store_suite, timers_suite};
    use crate::{ManualClock, Sqlite};

    const START: i64 = 1_700_000_000_000;

    fn counting() -> (Counting<Sqlite>, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(START));
        let db = Sqlite::memory(clock.clone()).expect("in-memory sqlite");
        (Counting::new(db), clock)
    }

    fn item(body: &[u8]) -> Item {
        Item {
            org: "acme".into(),
            kind: "approval".into(),
            id: "a-1".into(),
            version: 0,
            index: None,
            body: body.to_vec(),
            expires_ms: None,
        }
    }

    #[tokio::test]
    async fn counts_each_operation_and_its_payload() {
        let (db, _clock) = counting();
        assert!(
            db.create_run("acme", "r-1", "open", b"{}", b"e1", START)
                .await
                .unwrap()
        );
        let events = vec![b"e2".to_vec(), b"e3".to_vec()];
        assert_eq!(
            db.append("acme", "r-1", 1, "open", b"{}", &events, START)
                .await
                .unwrap(),
            3
        );
        // A stale expected version is refused, counted as a call and a conflict, and adds no events.
        assert!(matches!(
            db.append("acme", "r-1", 1, "open", b"{}", &events, START)
                .await,
            Err(StoreError::Conflict)
        ));
        assert_eq!(
            db.get_run("acme", "r-1").await.unwrap().map(|r| r.version),
            Some(3)
        );
        assert_eq!(db.events("acme", "r-1", 0, 10).await.unwrap().len(), 3);
        assert_eq!(db.put_item(&item(b"x"), Cond::Absent).await.unwrap(), 1);
        assert!(matches!(
            db.put_item(&item(b"y"), Cond::Absent).await,
            Err(StoreError::Conflict)
        ));
        assert_eq!(
            db.claim("acme", "k", START, 1_000).await.unwrap(),
            Claim::New
        );
        db.finish("acme", "k", b"done", START).await.unwrap();

        db.send(b"m1", 0).await.unwrap();
        db.send(b"m2", 0).await.unwrap();
        let got = db.receive(10, 1_000).await.unwrap();
        assert_eq!(got.len(), 2);
        for d in &got {
            db.ack(&d.receipt).await.unwrap();
        }
        assert!(db.receive(10, 1_000).await.unwrap().is_empty());

        db.schedule("acme", "t", START, b"p").await.unwrap();
        assert_eq!(db.due(START, 10).await.unwrap().len(), 1);
        db.cancel("acme", "t").await.unwrap();

        let c = db.counts();
        assert_eq!(
            (c.create_run, c.append, c.appended_events, c.conflicts),
            (1, 2, 2, 2)
        );
        assert_eq!(
            (c.get_run, c.events, c.events_read, c.put_item, c.claim),
            (1, 1, 3, 2, 1)
        );
        assert_eq!(c.finish, 1);
        assert_eq!((c.send, c.receive, c.received, c.ack), (2, 2, 2, 2));
        assert_eq!((c.schedule, c.due, c.cancel), (1, 1, 1));
        assert_eq!(c.store_reads(), 2);
        assert_eq!(c.store_writes(), 7);
        assert_eq!(c.queue_ops(), 6);
        assert_eq!(c.timer_ops(), 3);

        // Calls on the inner adapter bypass the counters; `since` isolates a window.
        let before = db.counts();
        db.inner().get_run("acme", "r-1").await.unwrap();
        db.get_item("acme", "approval", "a-1").await.unwrap();
        let window = db.counts().since(&before);
        assert_eq!(
            window,
            OpCounts {
                get_item: 1,
                ..OpCounts::default()
            }
        );
        assert_eq!(window.fields().iter().map(|(_, n)| n).sum::<u64>(), 1);
    }

    /// The decorator must not change behaviour: the adapter conformance suites pass through it.
    #[tokio::test]
    async fn delegates_faithfully() {
        let (db, clock) = counting();
        store_suite(&db, &*clock).await;
        timers_suite(&db).await;
        let c = db.counts();
        assert!(c.store_writes() > 0 && c.store_reads() > 0 && c.timer_ops() > 0);
    }
}
