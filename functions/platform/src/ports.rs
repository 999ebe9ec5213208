use async_trait::async_trait;

use crate::{
    Claim, Cond, Delivery, Durability, EventRow, Item, Page, Paged, Result, RunRow, Timer,
};

/// Durable state: runs with their event logs, keyed items, and idempotency records. Every key is scoped by org.
#[async_trait]
pub trait Store: Send + Sync {
    /// Creates the run at version 1 with `first_event` as event 1, unless it exists. Returns whether it was
    /// created; an existing run is left untouched (opening the same signal twice is a no-op).
    async fn create_run(
        &self,
        org: &str,
        id: &str,
        state: &str,
        snapshot: &[u8],
        first_event: &[u8],
        now_ms: i64,
    ) -> Result<bool>;

    /// Appends `events` as seq `expected_version + 1 ..` and stores the new snapshot, all or nothing, only if
    /// the run is at `expected_version` (else `Conflict`). `events` must not be empty: the version is the seq
    /// of the last event, so an append without events could not be told apart from no append. Returns the new
    /// version. A missing run is `NotFound`.
    #[allow(clippy::too_many_arguments)]
    async fn append(
        &self,
        org: &str,
        id: &str,
        expected_version: u64,
        state: &str,
        snapshot: &[u8],
        events: &[Vec<u8>],
        now_ms: i64,
    ) -> Result<u64>;

    async fn get_run(&self, org: &str, id: &str) -> Result<Option<RunRow>>;

    /// The org's runs, optionally only those in `state`, newest created first.
    async fn list_runs(&self, org: &str, state: Option<&str>, page: Page) -> Result<Paged<RunRow>>;

    /// Events with seq > `after_seq` in order, at most `limit` (capped at `limits::MAX_PAGE`). A missing run
    /// has no events.
    async fn events(
        &self,
        org: &str,
        id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<EventRow>>;

    async fn get_item(&self, org: &str, kind: &str, id: &str) -> Result<Option<Item>>;

    /// Writes the item if `cond` holds (else `Conflict`) and returns its new version.
    async fn put_item(&self, item: &Item, cond: Cond) -> Result<u64>;

    /// `put_item` that may return before the write would survive a power loss when `durability` allows it (an
    /// embedded store then skips the sync to disk). Adapters whose every write is durable keep this default.
    async fn put_item_with(&self, item: &Item, cond: Cond, durability: Durability) -> Result<u64> {
        let _ = durability;
        self.put_item(item, cond).await
    }

    /// Deletes the item; deleting a missing item is not an error.
    async fn delete_item(&self, org: &str, kind: &str, id: &str) -> Result<()>;

    /// Unexpired items of `kind` (only those whose index equals `index` if given), ordered by the bytes of their id.
    async fn list_items(
        &self,
        org: &str,
        kind: &str,
        index: Option<&str>,
        page: Page,
    ) -> Result<Paged<Item>>;

    /// Unexpired items of `kind` whose id starts with `prefix`, ordered by the bytes of their id. Ids that begin
    /// with their owner (`<owner>:<rest>`) list one owner's items this way, with no index to keep up on every
    /// write.
    async fn list_items_with_prefix(
        &self,
        org: &str,
        kind: &str,
        prefix: &str,
        page: Page,
    ) -> Result<Paged<Item>>;

    /// Claims idempotency key `key`: `New` (and a lease until `now_ms + lease_ms`) if the key is unknown or its
    /// holder's lease ran out, `InProgress` while a lease holds, `Done(result)` once finished.
    async fn claim(&self, org: &str, key: &str, now_ms: i64, lease_ms: u64) -> Result<Claim>;

    /// Records the effect's result; later claims get `Done(result)`. Finishing a key that is already done keeps
    /// the first result (the effect happened once; its first recorded outcome is the one others have seen).
    /// Finishing an unknown or expired-lease key still records it: the effect did happen.
    async fn finish(&self, org: &str, key: &str, result: &[u8], now_ms: i64) -> Result<()>;

    /// Drops an in-progress claim so the next claim is `New` at once (the effect failed and may be retried).
    /// A finished key stays finished; an unknown key is not an error.
    async fn release(&self, org: &str, key: &str) -> Result<()>;
}

/// An at-least-once work queue with visibility timeouts and a dead-letter store. Message bodies carry their org.
#[async_trait]
pub trait Queue: Send + Sync {
    /// Enqueues `body`, visible after `delay_ms` (at most `limits::MAX_DELAY_MS`, like SQS).
    async fn send(&self, body: &[u8], delay_ms: u64) -> Result<()>;

    /// Takes up to `max` (1..=`limits::MAX_RECEIVE`, larger is capped) visible messages and hides them for
    /// `visibility_ms`. A message already received the adapter's maximum number of times goes to the
    /// dead letters instead of being delivered.
    async fn receive(&self, max: u32, visibility_ms: u64) -> Result<Vec<Delivery>>;

    /// Deletes the message of this receipt. A stale receipt (the message was received again since) or an
    /// unknown one is a no-op, not an error: the message then belongs to its newer receiver, and deleting it
    /// under them would lose work they may not finish; processing is idempotent, so the cost is at most one
    /// redundant run of the same step.
    async fn ack(&self, receipt: &str) -> Result<()>;

    /// Makes the message of this receipt visible again after `delay_ms` (0 = now). Stale or unknown receipts
    /// are a no-op, for the same reason as `ack`.
    async fn retry_later(&self, receipt: &str, delay_ms: u64) -> Result<()>;

    /// The oldest dead letters (read only; their `receipt` is empty).
    async fn dead_letters(&self, limit: u32) -> Result<Vec<Delivery>>;
}

/// Durable timers (longer than a queue delay can be), drained by the scheduler.
#[async_trait]
pub trait Timers: Send + Sync {
    /// Creates or replaces the timer `(org, id)`.
    async fn schedule(&self, org: &str, id: &str, due_ms: i64, payload: &[u8]) -> Result<()>;

    /// Removes the timer; a missing timer is not an error.
    async fn cancel(&self, org: &str, id: &str) -> Result<()>;

    /// Timers with `due_ms <= now_ms`, earliest first (ties by org, then id), at most `limit` (capped at
    /// `limits::MAX_PAGE`). They stay until cancelled: the scheduler cancels each after enqueuing it.
    async fn due(&self, now_ms: i64, limit: u32) -> Result<Vec<Timer>>;
}
