//! loams-platform: the ports the factory's runtime talks to (`Store`, `Queue`, `Timers`, `Clock`) and their
//! embedded SQLite adapter.
//!
//! Bodies (run snapshots, events, items, queue messages, timer payloads, idempotency results) are opaque bytes:
//! this crate knows nothing about the factory's types, so every adapter stores exactly what it is given.
//! Every stored key starts with the org, so no call can read or write across tenants.
//!
//! `conformance` holds the behaviour every adapter must show; the SQLite adapter runs it in `tests/`, the
//! DynamoDB/SQS adapters are meant to run the same functions.

#[cfg(feature = "aws")]
pub mod aws;
pub mod backoff;
pub mod calendar;
pub mod clock;
pub mod conformance;
mod counting;
mod error;
mod json_guard;
pub mod limits;
mod ports;
pub mod race;
mod sqlite;
mod types;

pub use clock::{Clock, ManualClock, SystemClock, TimeControl};
pub use counting::{Counting, OpCounts};
pub use error::{Result, StoreError, with_causes};
pub use json_guard::has_serde_private_key;
pub use ports::{Queue, Store, Timers};
pub use sqlite::{DEFAULT_MAX_RECEIVES, Sqlite};
pub use types::{Claim, Cond, Delivery, Durability, EventRow, Item, Page, Paged, RunRow, Timer};
