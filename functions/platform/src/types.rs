/// A run's current row: the latest snapshot and the version (= the seq of its last event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRow {
    pub org: String,
    pub id: String,
    pub version: u64,
    pub state: String,
    pub snapshot: Vec<u8>,
    pub updated_ms: i64,
}

/// One event of a run's log; seq starts at 1 and has no gaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    pub seq: u64,
    pub body: Vec<u8>,
}

/// A keyed record of some `kind` (approval, device, kill, ...), with an optional secondary index value.
///
/// `version` is assigned by the store (1 on first write, +1 on each put); the value passed to `put_item` is
/// ignored, the condition says what the caller expects. An item whose `expires_ms` is at or before the store
/// clock's now is invisible: reads skip it and a put treats it as absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub org: String,
    pub kind: String,
    pub id: String,
    pub version: u64,
    pub index: Option<String>,
    pub body: Vec<u8>,
    pub expires_ms: Option<i64>,
}

/// The condition of `put_item`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    /// Only if no (unexpired) item exists.
    Absent,
    /// Only if the item exists at exactly this version.
    Version(u64),
    /// Unconditionally.
    Any,
}

/// What a write must survive by the time its call returns (see `Store::put_item_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// A power loss: the write is on stable storage before the call returns. Every write is this by default.
    Durable,
    /// The process crashing, but not necessarily a power loss until a later durable write or checkpoint: for a
    /// record its writer could make again with no effect anywhere, such as the outcome of a read. It is atomic and
    /// visible to every later read at once, like any other write.
    Replayable,
}

/// The answer of an idempotency `claim`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller now holds the lease and must perform the effect, then `finish` (or `release`).
    New,
    /// Someone else holds an unexpired lease.
    InProgress,
    /// The effect already happened; here is its recorded result.
    Done(Vec<u8>),
}

/// A received queue message. `receipt` identifies this receive (not the message): it is what `ack` and
/// `retry_later` take, and it goes stale when the message is received again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub id: String,
    pub receipt: String,
    pub body: Vec<u8>,
    pub receive_count: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timer {
    pub org: String,
    pub id: String,
    pub due_ms: i64,
    pub payload: Vec<u8>,
}

/// A page request. `cursor` is the `next` of the previous page (opaque), `limit` is capped at
/// `limits::MAX_PAGE` and must not be 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub cursor: Option<String>,
    pub limit: u32,
}

impl Page {
    pub fn first(limit: u32) -> Self {
        Self {
            cursor: None,
            limit,
        }
    }
}

/// One page of results; `next` is `None` on the last page, and only there: then no unexpired item is left after
/// `items` (the worker's kill-switch read relies on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paged<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}
