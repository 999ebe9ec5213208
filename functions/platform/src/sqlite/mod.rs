//! The embedded adapter: one SQLite database (a file, or `:memory:`) holding the store, the queue and the
//! timers. Calls run on tokio's blocking pool with the one connection behind a mutex, so the async runtime never
//! waits on disk and writes from one process are serialized without SQLite lock contention.

mod queue;
mod store;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, TransactionBehavior};

use crate::{Clock, Result, StoreError};

/// Receives after which a message is dead-lettered, unless `with_max_receives` says otherwise.
pub const DEFAULT_MAX_RECEIVES: u32 = 5;

/// How long a write waits for another process holding the database lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Numbered schema migrations; migration N (1-based) brings `PRAGMA user_version` from N-1 to N. Only ever
/// append to this list: databases in the field have run the earlier entries.
const MIGRATIONS: &[&str] = &[include_str!("001_init.sql")];

/// The SQLite adapter; implements `Store`, `Queue` and `Timers`. Cloning shares the connection.
#[derive(Clone)]
pub struct Sqlite {
    inner: Arc<Inner>,
    max_receives: u32,
}

struct Inner {
    conn: Mutex<Connection>,
    clock: Arc<dyn Clock>,
}

impl Sqlite {
    /// Opens (creating if needed) the database file at `path` and brings its schema up to date. Blocking:
    /// meant for start-up.
    pub fn open(path: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<Self> {
        let conn = Connection::open(path).map_err(db)?;
        Self::init(conn, clock)
    }

    /// A private in-memory database (gone when the last clone is dropped).
    pub fn memory(clock: Arc<dyn Clock>) -> Result<Self> {
        let conn = Connection::open_in_memory().map_err(db)?;
        Self::init(conn, clock)
    }

    /// Sets after how many receives a message goes to the dead letters (0 counts as 1: a message is always
    /// delivered at least once). Applies to this handle and its later clones.
    pub fn with_max_receives(self, max_receives: u32) -> Self {
        Self {
            max_receives: max_receives.max(1),
            ..self
        }
    }

    fn init(mut conn: Connection, clock: Arc<dyn Clock>) -> Result<Self> {
        conn.busy_timeout(BUSY_TIMEOUT).map_err(db)?;
        // WAL lets readers in other processes (a CLI inspecting the file) run beside the writer. An in-memory
        // database answers "memory" and keeps working without it.
        conn.pragma_update_and_check(None, "journal_mode", "wal", |row| row.get::<_, String>(0))
            .map_err(db)?;
        // FULL: a committed event or ack survives power loss, which the exactly-once reasoning relies on.
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(db)?;
        migrate(&mut conn)?;
        Ok(Self {
            inner: Arc::new(Inner {
                conn: Mutex::new(conn),
                clock,
            }),
            max_receives: DEFAULT_MAX_RECEIVES,
        })
    }

    /// Runs `f` with the connection on the blocking pool.
    async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, &Inner) -> Result<T> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            // A panic while holding the lock can only have happened inside a rusqlite call or our closure; an
            // open transaction is rolled back when it is dropped during unwinding, so the connection is
            // consistent and the poison flag carries no information worth failing every later call for.
            let mut conn = inner
                .conn
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut conn, &inner)
        })
        .await
        .map_err(|e| StoreError::Backend(format!("database task failed: {e}")))?
    }
}

/// Applies the migrations the database has not seen. Each runs in its own write transaction that re-reads the
/// version first, so two processes opening the same new file at once do not both apply migration 1.
fn migrate(conn: &mut Connection) -> Result<()> {
    loop {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db)?;
        let current: i64 = tx
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(db)?;
        let current = usize::try_from(current).map_err(|_| {
            StoreError::Backend(format!("database has a negative schema version {current}"))
        })?;
        if current > MIGRATIONS.len() {
            return Err(StoreError::Backend(format!(
                "database schema version {current} is newer than this binary knows ({})",
                MIGRATIONS.len()
            )));
        }
        let Some(sql) = MIGRATIONS.get(current) else {
            return Ok(());
        };
        tx.execute_batch(sql).map_err(db)?;
        let next = i64::try_from(current + 1)
            .map_err(|_| StoreError::Backend("schema version overflow".into()))?;
        tx.pragma_update(None, "user_version", next).map_err(db)?;
        tx.commit().map_err(db)?;
    }
}

fn db(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// SQLite integers are i64; the ports speak u64 for versions and counts.
fn to_i64(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("{what} {v} is out of range")))
}

fn to_u64(what: &str, v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::Backend(format!("stored {what} {v} is negative")))
}
