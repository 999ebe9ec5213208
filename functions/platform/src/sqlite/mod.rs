//! The embedded adapter: one SQLite database (a file, or `:memory:`) holding the store, the queue and the
//! timers. The async runtime never waits on disk.
//!
//! Every write goes to one writer thread that owns the writer connection, so writes from one process are
//! serialized without SQLite lock contention. The thread commits in groups (group commit): it takes every call
//! waiting for it (up to `MAX_GROUP`), runs each in its own savepoint inside one `BEGIN IMMEDIATE` transaction,
//! commits once, and only then answers the callers. Each call is still all-or-nothing (a failed call rolls back to
//! its savepoint, and a conditional write checks and writes within its savepoint), and no caller hears "done"
//! before its write is durable; a group shares one commit and one fsync instead of one each. If the commit fails,
//! every call of the group gets the error. A group made only of replayable writes (`Durability::Replayable`) commits
//! without the fsync: it is in the WAL file when its callers hear "done", and on disk by the next durable commit
//! or checkpoint.
//!
//! Plain reads of a file database go to a small pool of read-only connections on tokio's blocking pool: under
//! WAL they see the last committed state without waiting for the writer. An in-memory database is private to its
//! connection, so it has no readers and its reads are calls to the writer.
//!
//! A file database also has a checkpointer thread, which copies the WAL into the database file as commits come in,
//! so the writer seldom stops for that copy and its syncs (see `WRITER_CHECKPOINT_PAGES`).

mod queue;
mod store;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Duration;

use rusqlite::config::DbConfig;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior};
use tokio::sync::oneshot;

use crate::{Clock, Durability, Result, StoreError};

/// Receives after which a message is dead-lettered, unless `with_max_receives` says otherwise.
pub const DEFAULT_MAX_RECEIVES: u32 = 5;

/// How long a write waits for another process holding the database lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Read connections of a file database. Reads are short; two keep both cores busy while the writer commits.
const READERS: usize = 2;
/// Prepared statements kept per connection: more than the store and queue use (about 40, counting the list
/// queries built per filter and cursor, and the transaction-control statements), because parsing SQL again on
/// every call cost about a seventh of a run's CPU.
const STATEMENT_CACHE: usize = 64;

/// Most calls one writer transaction commits together. Bounds how long one group holds the write lock and how
/// much one failed commit takes down with it.
const MAX_GROUP: usize = 64;

/// WAL pages after which the writer checkpoints by itself (SQLite's default is 1,000). The checkpointer thread
/// copies the WAL into the database file as it grows, so the writer seldom has more than a few pages left to copy;
/// what it cannot hand off is the final step that lets the WAL start over, which waits for a sync of the database
/// file. At the default that wait came every second or so of busy writing and set the tail latency (a2a agent
/// benchmark, docs/benchmarks.md: p99 9 ms, about 5 ms with the checkpointer and this value). More pages would space
/// the waits further, but the WAL file grows to about this many pages (here 40 MB) and stays that large.
const WRITER_CHECKPOINT_PAGES: i64 = 10_000;
/// Least time between two checkpoints of the checkpointer thread: each syncs the WAL and the database file, so
/// this bounds the syncs it adds to the writer's.
const CHECKPOINT_PAUSE: Duration = Duration::from_millis(50);

/// Numbered schema migrations; migration N (1-based) brings `PRAGMA user_version` from N-1 to N. Only ever
/// append to this list: databases in the field have run the earlier entries.
const MIGRATIONS: &[&str] = &[
    include_str!("001_init.sql"),
    include_str!("002_item_expiry.sql"),
];

/// The SQLite adapter; implements `Store`, `Queue` and `Timers`. Cloning shares the connection.
#[derive(Clone)]
pub struct Sqlite {
    inner: Arc<Inner>,
    max_receives: u32,
}

/// When the writer syncs to disk; see `Sqlite::open_synchronous_normal`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Synchronous {
    Full,
    Normal,
}

impl Synchronous {
    /// Its value for `PRAGMA synchronous`. (Not worth a cached statement: SQLite applies this pragma while
    /// preparing it and marks it run-once, so a cached one is prepared again on every use anyway.)
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// A call for the writer thread, and what its write must survive.
struct Job {
    call: Call,
    durability: Durability,
}

/// Runs inside the group's transaction and returns whether it succeeded, and how to answer its caller once the
/// group's commit is known (`Some` error when the commit failed).
type Call = Box<dyn FnOnce(&mut Connection) -> (bool, Reply) + Send>;
type Reply = Box<dyn FnOnce(Option<StoreError>) + Send>;

struct Inner {
    /// Calls for the writer thread, which also serves reads when there are no readers. The thread ends when
    /// this (the last sender) is dropped.
    jobs: mpsc::Sender<Job>,
    /// Read-only connections (`query_only`); empty for an in-memory database.
    readers: Vec<Mutex<Connection>>,
    /// Where the next read starts looking for a free reader.
    next_reader: AtomicUsize,
    clock: Arc<dyn Clock>,
    /// Item puts so far; every `store::SWEEP_EVERY`th also removes expired items.
    puts: std::sync::atomic::AtomicU64,
}

impl Sqlite {
    /// Opens (creating if needed) the database file at `path` and brings its schema up to date. Blocking:
    /// meant for start-up.
    pub fn open(path: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<Self> {
        let path = path.as_ref();
        let conn = Connection::open(path).map_err(db)?;
        Self::init(conn, Some(path), clock, Synchronous::Full)
    }

    /// A private in-memory database (gone when the last clone is dropped).
    pub fn memory(clock: Arc<dyn Clock>) -> Result<Self> {
        let conn = Connection::open_in_memory().map_err(db)?;
        Self::init(conn, None, clock, Synchronous::Full)
    }

    /// Like `open`, but commits with `synchronous=NORMAL` instead of the default FULL: under WAL the writer then
    /// syncs only at checkpoints, not on every commit. A commit still survives the process crashing (it is in the
    /// WAL file the moment the call returns), but the last commits before a power loss or kernel crash may be
    /// lost, and with them an ack, an appended event or an idempotency result the exactly-once reasoning counts
    /// on. Opt in only where the host's storage makes that acceptable. Blocking: meant for start-up.
    pub fn open_synchronous_normal(path: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<Self> {
        let path = path.as_ref();
        let conn = Connection::open(path).map_err(db)?;
        Self::init(conn, Some(path), clock, Synchronous::Normal)
    }

    /// Sets after how many receives a message goes to the dead letters (0 counts as 1: a message is always
    /// delivered at least once). Applies to this handle and its later clones.
    pub fn with_max_receives(self, max_receives: u32) -> Self {
        Self {
            max_receives: max_receives.max(1),
            ..self
        }
    }

    fn init(
        mut conn: Connection,
        path: Option<&Path>,
        clock: Arc<dyn Clock>,
        sync: Synchronous,
    ) -> Result<Self> {
        // Listings compare ids as bytes, in Rust (a cursor against a prefix) and in SQL alike; only UTF-8 text
        // orders the same in both. A new database is UTF-8; a file made elsewhere could be UTF-16, and is refused
        // before anything is written to it.
        let encoding: String = conn
            .pragma_query_value(None, "encoding", |row| row.get(0))
            .map_err(db)?;
        if encoding != "UTF-8" {
            return Err(StoreError::Backend(format!(
                "the database is encoded {encoding}; Loams needs a UTF-8 database"
            )));
        }
        configure(&conn)?;
        // WAL lets readers (ours, and other processes such as a CLI inspecting the file) run beside the writer. An
        // in-memory database answers "memory" and keeps working without it.
        let journal = conn
            .pragma_update_and_check(None, "journal_mode", "wal", |row| row.get::<_, String>(0))
            .map_err(db)?;
        // FULL (the default): a committed event or ack survives power loss, which the exactly-once reasoning
        // relies on.
        conn.pragma_update(None, "synchronous", sync.pragma())
            .map_err(db)?;
        migrate(&mut conn)?;
        // Only a file in WAL mode has readers: without WAL a reader would block on (and block) the writer, and a
        // ":memory:" path or URI opened again would be a different, empty database.
        let wal = path.filter(|_| journal.eq_ignore_ascii_case("wal"));
        let readers = match wal {
            Some(path) => (0..READERS)
                .map(|_| open_reader(path))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let checkpointer = match wal {
            Some(path) => {
                conn.pragma_update(None, "wal_autocheckpoint", WRITER_CHECKPOINT_PAGES)
                    .map_err(db)?;
                Some(start_checkpointer(path)?)
            }
            None => None,
        };
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name("loams-sqlite-writer".into())
            .spawn(move || write_groups(conn, sync, queue, checkpointer))
            .map_err(|e| StoreError::Backend(format!("starting the database writer: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                jobs,
                readers,
                next_reader: AtomicUsize::new(0),
                clock,
                puts: std::sync::atomic::AtomicU64::new(0),
            }),
            max_receives: DEFAULT_MAX_RECEIVES,
        })
    }

    /// Runs `f` on the writer thread, inside a group transaction, and answers once that group is committed.
    /// Every write, and every read that a write depends on, goes through here. `f` runs in a savepoint of its
    /// own: when it returns an error, everything it wrote is rolled back, so it needs no transaction itself.
    async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, &Inner) -> Result<T> + Send + 'static,
    {
        self.write(Durability::Durable, f).await
    }

    /// `with_conn` for a call whose writes need only survive what `durability` says.
    async fn write<T, F>(&self, durability: Durability, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, &Inner) -> Result<T> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let inner = Arc::clone(&self.inner);
        let call: Call = Box::new(move |conn| {
            let result = f(conn, &inner);
            let ok = result.is_ok();
            let reply: Reply = Box::new(move |commit_failed| {
                // The caller may have given up waiting (its future was dropped); nothing to tell it then.
                let _ = answer.send(match commit_failed {
                    Some(e) => Err(e),
                    None => result,
                });
            });
            (ok, reply)
        });
        self.inner
            .jobs
            .send(Job { call, durability })
            .map_err(|_| StoreError::Backend("the database writer has stopped".into()))?;
        // Dropped unanswered when the call panicked or its group could not begin or keep its savepoint; the
        // writer goes on with the other calls.
        answered
            .await
            .map_err(|_| StoreError::Backend("a database call failed without an answer".into()))?
    }

    /// Runs the read-only `f` on a reader connection (the writer when there are none). A reader sees every
    /// commit that returned before `f` started, so a caller reads its own writes.
    async fn with_reader<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, &Inner) -> Result<T> + Send + 'static,
    {
        if self.inner.readers.is_empty() {
            return self.with_conn(move |conn, inner| f(conn, inner)).await;
        }
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let conn = inner.reader();
            f(&conn, &inner)
        })
        .await
        .map_err(|e| StoreError::Backend(format!("database task failed: {e}")))?
    }
}

impl Inner {
    /// A free reader if there is one, else waits for the next in turn. Only called with readers present.
    fn reader(&self) -> MutexGuard<'_, Connection> {
        let n = self.readers.len();
        let start = self.next_reader.fetch_add(1, Ordering::Relaxed) % n;
        for i in 0..n {
            if let Ok(conn) = self.readers[(start + i) % n].try_lock() {
                return conn;
            }
        }
        relock(self.readers[start].lock())
    }
}

/// The writer thread: runs the calls it is sent in groups of up to `MAX_GROUP`, one transaction and one commit
/// per group, until every sender is gone. A group commits with the connection's `sync` unless all its calls are
/// replayable, which commit with NORMAL. After each commit it wakes the checkpointer, if there is one.
fn write_groups(
    mut conn: Connection,
    sync: Synchronous,
    queue: mpsc::Receiver<Job>,
    checkpointer: Option<mpsc::SyncSender<()>>,
) {
    let mut current = sync;
    schedule_as_batch();
    while let Ok(first) = queue.recv() {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        // Set between transactions: the setting a commit uses is the connection's at that moment.
        let wanted = group_sync(sync, &group);
        if wanted != current {
            match conn.pragma_update(None, "synchronous", wanted.pragma()) {
                Ok(()) => current = wanted,
                // Left at NORMAL, a durable group would commit without its sync: its calls fail instead (dropped,
                // as when BEGIN fails). Left at FULL, a replayable group is merely synced.
                Err(e) if wanted == sync => {
                    tracing::warn!(error = %e, calls = group.len(), "database writer could not restore synchronous");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "database writer could not relax synchronous")
                }
            }
        }
        if let Err(e) = control(&conn, "BEGIN IMMEDIATE") {
            // Nothing ran: dropping the calls tells each caller it failed. The next group tries again.
            tracing::warn!(error = %e, calls = group.len(), "database writer could not begin a transaction");
            continue;
        }
        let mut replies = Vec::with_capacity(group.len());
        for job in group {
            // A panicking call is rolled back to its savepoint and its caller hears an error (its reply is
            // dropped); the rest of the group goes on.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                control(&conn, "SAVEPOINT call")?;
                let (ok, reply) = (job.call)(&mut conn);
                if !ok {
                    control(&conn, "ROLLBACK TO call")?;
                }
                control(&conn, "RELEASE call")?;
                Ok::<_, rusqlite::Error>((ok, reply))
            }));
            match run {
                Ok(Ok((_, reply))) => replies.push(reply),
                // The caller hears an error. If only the RELEASE failed, its write may still commit: as with any
                // I/O error the outcome is unknown to it, and its retry is checked again like any other call.
                Ok(Err(e)) => tracing::warn!(error = %e, "database savepoint failed"),
                Err(_) => {
                    tracing::warn!("a database call panicked; rolled back");
                    let _ = control(&conn, "ROLLBACK TO call")
                        .and_then(|()| control(&conn, "RELEASE call"));
                }
            }
            // SQLite rolls the whole transaction back by itself on some errors (a full disk, say). The calls
            // already run are then lost, and a later SAVEPOINT would open a transaction of its own outside the
            // group: stop here, and every call of the group hears an error (the rest by their dropped replies).
            if conn.is_autocommit() {
                break;
            }
        }
        let committed = if conn.is_autocommit() {
            Err(StoreError::Backend(
                "the database rolled the transaction back".into(),
            ))
        } else {
            control(&conn, "COMMIT").map_err(db)
        };
        match (&committed, &checkpointer) {
            // A failed COMMIT may leave the transaction open; end it so the next group starts clean.
            (Err(_), _) => {
                let _ = control(&conn, "ROLLBACK");
            }
            // A wake-up already pending covers this commit too.
            (Ok(()), Some(wake)) => {
                let _ = wake.try_send(());
            }
            (Ok(()), None) => {}
        }
        for reply in replies {
            reply(committed.as_ref().err().cloned());
        }
    }
}

/// Asks Linux to schedule the calling thread as batch work (`SCHED_BATCH`): woken, it waits for the running thread's
/// turn to end instead of preempting it. For the writer, the callers it would have interrupted go on to queue more
/// calls, so it commits larger groups with fewer thread switches (on one core: 6–10% more A2A requests a second,
/// docs/benchmarks.md); the checkpointer's copying gives way to serving requests the same way. Its share of the CPU
/// is unchanged. Best effort: if the policy cannot be set, the thread runs as before.
fn schedule_as_batch() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 names the calling thread, and `param` outlives the call; SCHED_BATCH takes priority 0.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "could not schedule a database thread as batch");
        }
    }
}

/// How a group commits: as the connection was opened (`sync`), except that a group of replayable calls alone
/// skips the sync of FULL. Under WAL, a later FULL commit syncs the whole log, the replayable commits before it
/// included.
fn group_sync(sync: Synchronous, group: &[Job]) -> Synchronous {
    if group
        .iter()
        .all(|job| job.durability == Durability::Replayable)
    {
        Synchronous::Normal
    } else {
        sync
    }
}

/// Starts the checkpointer thread of the WAL database at `path` and returns how to wake it. Woken after commits, it
/// copies the WAL's new pages into the database file (a passive checkpoint: it never blocks the writer or the
/// readers), at most once per `CHECKPOINT_PAUSE`, so the writer does not stop for that copy and its sync. It ends
/// when the writer thread does.
fn start_checkpointer(path: &Path) -> Result<mpsc::SyncSender<()>> {
    let conn = Connection::open(path).map_err(db)?;
    configure(&conn)?;
    let (wake, woken) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("loams-sqlite-checkpoint".into())
        .spawn(move || {
            schedule_as_batch();
            while woken.recv().is_ok() {
                if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::warn!(error = %e, "database checkpoint failed; the writer's own checkpoints go on");
                }
                std::thread::sleep(CHECKPOINT_PAUSE);
            }
        })
        .map_err(|e| StoreError::Backend(format!("starting the database checkpointer: {e}")))?;
    Ok(wake)
}

/// Runs a transaction-control statement through the statement cache: the writer runs two or three per call and
/// two per group, and parsing them each time showed in the profile.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(drop)
}

/// A panic while holding a connection's lock can only have happened inside a rusqlite call or our closure; an open
/// transaction is rolled back when it is dropped during unwinding, so the connection is consistent and the poison
/// flag carries no information worth failing every later call for.
fn relock<'a>(
    lock: std::sync::LockResult<MutexGuard<'a, Connection>>,
) -> MutexGuard<'a, Connection> {
    lock.unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What every connection, writer or reader, is opened with.
fn configure(conn: &Connection) -> Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // Query planner stability: a cached statement keeps its plan whatever is bound to it. Without it SQLite
    // re-plans a statement whenever a parameter it looked at while planning changes value: the bound LIMIT of
    // the listings, whose page size differs between callers, had `list_items` re-parsed on most calls (12% of the
    // engine's CPU). Every statement here is written to use its index whatever the values.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
        .map_err(db)?;
    Ok(())
}

/// A read connection to the (already migrated, WAL) file at `path`. `query_only` makes any write through it an
/// error, so a write routed here by mistake fails loudly instead of bypassing the writer's serialization.
fn open_reader(path: &Path) -> Result<Mutex<Connection>> {
    let conn = Connection::open(path).map_err(db)?;
    configure(&conn)?;
    conn.pragma_update(None, "query_only", true).map_err(db)?;
    Ok(Mutex::new(conn))
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

/// Runs one statement through the connection's statement cache; returns how many rows it changed.
fn exec(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<usize> {
    conn.prepare_cached(sql)
        .map_err(db)?
        .execute(params)
        .map_err(db)
}

/// The first row of a query run through the connection's statement cache, if there is one.
fn first_row<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    row: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Option<T>> {
    conn.prepare_cached(sql)
        .map_err(db)?
        .query_row(params, row)
        .optional()
        .map_err(db)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ManualClock, Store};

    fn file_db(dir: &tempfile::TempDir) -> Sqlite {
        Sqlite::open(
            dir.path().join("loams.db"),
            Arc::new(ManualClock::new(1_000)),
        )
        .expect("open a temp file")
    }

    /// The writer connection held by a call that returns only when released, as during a slow commit.
    struct HeldWriter {
        release: std::sync::mpsc::Sender<()>,
        holder: tokio::task::JoinHandle<Result<()>>,
    }

    impl HeldWriter {
        /// Returns once the call holds the writer.
        async fn take(db: &Sqlite) -> HeldWriter {
            let (held_tx, held_rx) = std::sync::mpsc::channel();
            let (release, release_rx) = std::sync::mpsc::channel::<()>();
            let writer = db.clone();
            let holder = tokio::spawn(async move {
                writer
                    .with_conn(move |_, _| {
                        held_tx
                            .send(())
                            .map_err(|e| StoreError::Backend(e.to_string()))?;
                        // Returns when the test sends or drops its end.
                        let _ = release_rx.recv();
                        Ok(())
                    })
                    .await
            });
            tokio::task::spawn_blocking(move || held_rx.recv())
                .await
                .expect("join")
                .expect("writer taken");
            HeldWriter { release, holder }
        }

        /// Lets the call return; its result.
        async fn release(self) -> Result<()> {
            drop(self.release);
            self.holder.await.expect("holder task")
        }
    }

    /// A small item of org "o", kind "k".
    fn item(id: &str, expires_ms: Option<i64>) -> crate::Item {
        crate::Item {
            org: "o".into(),
            kind: "k".into(),
            id: id.into(),
            version: 0,
            index: None,
            body: b"{}".to_vec(),
            expires_ms,
        }
    }

    #[test]
    fn a_database_in_another_text_encoding_is_refused() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let path = dir.path().join("utf16.db");
        let made = Connection::open(&path).expect("create");
        made.pragma_update(None, "encoding", "UTF-16le")
            .expect("encoding");
        made.execute_batch("CREATE TABLE t (x)")
            .expect("fix the encoding");
        drop(made);
        let refused = Sqlite::open(&path, Arc::new(ManualClock::new(0)));
        assert!(
            matches!(&refused, Err(StoreError::Backend(m)) if m.contains("UTF-16le")),
            "{:?}",
            refused.err()
        );
        // Refused before anything was written: no WAL was started in it.
        assert!(!dir.path().join("utf16.db-wal").exists());
        let journal: String = Connection::open(&path)
            .expect("reopen")
            .pragma_query_value(None, "journal_mode", |row| row.get(0))
            .expect("journal mode");
        assert_eq!(journal, "delete");
        // A database Loams makes itself is UTF-8, and opens.
        file_db(&dir);
    }

    #[tokio::test]
    async fn the_checkpointer_copies_commits_into_the_database_file() {
        // The writer checkpoints only past WRITER_CHECKPOINT_PAGES; one small commit reaches the database file
        // itself (not only the WAL) through the checkpointer thread.
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        db.put_item(&item("i", None), crate::Cond::Absent)
            .await
            .expect("put");
        // `immutable=1` reads the database file alone, as if there were no WAL; until the checkpoint it has no
        // items table at all, and a read racing the checkpoint's copy may fail: both count as not there yet.
        let uri = format!("file:{}?immutable=1", dir.path().join("loams.db").display());
        let in_file = || -> i64 {
            let flags =
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_URI;
            rusqlite::Connection::open_with_flags(&uri, flags)
                .and_then(|conn| conn.query_row("SELECT count(*) FROM items", [], |r| r.get(0)))
                .unwrap_or(0)
        };
        let mut seen = 0;
        for _ in 0..250 {
            seen = in_file();
            if seen == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(seen, 1, "the commit is in the database file within 5 s");
    }

    #[tokio::test]
    async fn expired_items_are_removed_not_only_hidden() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let clock = Arc::new(ManualClock::new(1_000));
        let db = Sqlite::open(dir.path().join("loams.db"), clock.clone()).expect("open");
        db.put_item(&item("gone", Some(1_500)), crate::Cond::Any)
            .await
            .expect("put");
        db.put_item(&item("kept", Some(10_000)), crate::Cond::Any)
            .await
            .expect("put");
        clock.set(2_000);
        let stored = |id: &'static str| {
            let path = dir.path().join("loams.db");
            move || -> i64 {
                let conn = rusqlite::Connection::open(&path).expect("open raw");
                conn.query_row("SELECT count(*) FROM items WHERE id = ?1", [id], |r| {
                    r.get(0)
                })
                .expect("count")
            }
        };
        // Hidden at once, still on disk until a sweep.
        assert!(db.get_item("o", "k", "gone").await.expect("get").is_none());
        assert_eq!(stored("gone")(), 1);
        for n in 0..store::SWEEP_EVERY {
            db.put_item(&item(&format!("filler-{n}"), None), crate::Cond::Any)
                .await
                .expect("put");
        }
        assert_eq!(stored("gone")(), 0, "the sweep removed the expired item");
        assert_eq!(stored("kept")(), 1, "an item not yet expired stays");
    }

    #[tokio::test]
    async fn reads_of_a_file_do_not_wait_for_the_writer() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        assert_eq!(db.inner.readers.len(), READERS);
        assert!(
            db.create_run("o", "r", "running", b"{}", b"e", 1)
                .await
                .expect("create")
        );
        // With the writer held (as during a slow commit), a read still answers, and sees the committed run.
        let held = HeldWriter::take(&db).await;
        let read = tokio::time::timeout(Duration::from_secs(5), db.get_run("o", "r")).await;
        held.release().await.expect("holder call");
        let row = read
            .expect("the read waited for the writer")
            .expect("get_run")
            .expect("the run");
        assert_eq!(row.version, 1);
    }

    #[tokio::test]
    async fn a_transaction_sqlite_ended_by_itself_fails_the_whole_group_and_commits_nothing_after()
    {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        // Hold the writer (a group of its own) so that the two calls below queue up and run in the next group.
        let held = HeldWriter::take(&db).await;
        // As SQLite does by itself on some errors (a full disk): the group's transaction ends under a call.
        let ending = db.clone();
        let ends = tokio::spawn(async move {
            ending
                .with_conn(|conn, _| conn.execute_batch("ROLLBACK").map_err(super::db))
                .await
        });
        let later = db.clone();
        let writes = tokio::spawn(async move {
            later
                .create_run("o", "after", "running", b"{}", b"e", 1)
                .await
        });
        // Both calls are queued behind the held writer before it is let go.
        tokio::time::sleep(Duration::from_millis(200)).await;
        held.release().await.expect("the holder's own group");
        assert!(ends.await.expect("task").is_err());
        assert!(writes.await.expect("task").is_err());
        assert!(
            db.get_run("o", "after").await.expect("get_run").is_none(),
            "a call after the rollback must not commit on its own"
        );
        // The writer goes on with the next group.
        assert!(
            db.create_run("o", "next", "running", b"{}", b"e", 1)
                .await
                .expect("create")
        );
    }

    #[tokio::test]
    async fn readers_refuse_writes() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        let reader = db.inner.reader();
        let err = reader
            .execute("DELETE FROM runs", [])
            .expect_err("a reader wrote");
        assert!(err.to_string().contains("readonly"), "{err}");
    }

    #[tokio::test]
    async fn memory_keeps_one_connection() {
        let db = Sqlite::memory(Arc::new(ManualClock::new(1_000))).expect("memory");
        assert!(db.inner.readers.is_empty());
        assert!(
            db.create_run("o", "r", "running", b"{}", b"e", 1)
                .await
                .expect("create")
        );
        assert!(db.get_run("o", "r").await.expect("get_run").is_some());
    }

    /// The `synchronous` setting a call of this durability commits under (each awaited call is a group alone).
    async fn synchronous_for(db: &Sqlite, durability: Durability) -> i64 {
        db.write(durability, |conn, _| {
            conn.pragma_query_value(None, "synchronous", |r| r.get(0))
                .map_err(db_err)
        })
        .await
        .expect("pragma")
    }

    async fn synchronous(db: &Sqlite) -> i64 {
        synchronous_for(db, Durability::Durable).await
    }

    fn db_err(e: rusqlite::Error) -> StoreError {
        db(e)
    }

    #[tokio::test]
    async fn synchronous_is_full_unless_relaxed() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        assert_eq!(synchronous(&file_db(&dir)).await, 2, "FULL");
        let clock = Arc::new(ManualClock::new(1_000));
        let db = Sqlite::open_synchronous_normal(dir.path().join("loams.db"), clock)
            .expect("open relaxed");
        assert_eq!(synchronous(&db).await, 1, "NORMAL");
    }

    #[tokio::test]
    async fn a_group_of_replayable_writes_alone_commits_without_the_sync() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        assert_eq!(
            synchronous_for(&db, Durability::Replayable).await,
            1,
            "NORMAL"
        );
        assert_eq!(
            synchronous_for(&db, Durability::Durable).await,
            2,
            "FULL again"
        );
        // A replayable put is still conditional and visible at once.
        let item = item("i", None);
        let put = |cond| db.put_item_with(&item, cond, Durability::Replayable);
        assert_eq!(put(crate::Cond::Absent).await.expect("put"), 1);
        assert!(matches!(
            put(crate::Cond::Absent).await,
            Err(StoreError::Conflict)
        ));
        let read = db
            .get_item("o", "k", "i")
            .await
            .expect("get")
            .expect("stored");
        assert_eq!((read.version, read.body), (1, item.body.clone()));
        // A connection opened NORMAL stays NORMAL for durable calls too.
        let relaxed = Sqlite::open_synchronous_normal(
            dir.path().join("relaxed.db"),
            Arc::new(ManualClock::new(1_000)),
        )
        .expect("open relaxed");
        assert_eq!(synchronous_for(&relaxed, Durability::Replayable).await, 1);
        assert_eq!(synchronous_for(&relaxed, Durability::Durable).await, 1);
    }

    /// The scheduling policy of each of this process's threads whose name starts with `name` (Linux numbers:
    /// 0 normal, 3 batch), from /proc.
    #[cfg(target_os = "linux")]
    fn policies_of(name: &str) -> Vec<String> {
        let tasks = std::fs::read_dir("/proc/self/task").expect("threads");
        tasks
            .filter_map(|task| {
                let path = task.ok()?.path();
                let comm = std::fs::read_to_string(path.join("comm")).ok()?;
                if !comm.starts_with(name) {
                    return None;
                }
                let sched = std::fs::read_to_string(path.join("sched")).ok()?;
                let policy = sched.lines().find(|l| l.starts_with("policy"))?;
                Some(policy.rsplit(':').next()?.trim().to_string())
            })
            .collect()
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_writer_and_the_checkpointer_run_as_batch_work() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let _db = file_db(&dir);
        // Each thread sets its policy as it starts; other tests' threads may be starting too, so wait a little.
        for name in ["loams-sqlite-wr", "loams-sqlite-ch"] {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                let policies = policies_of(name);
                if !policies.is_empty() && policies.iter().all(|p| p == "3") {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "{name}: {policies:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    #[test]
    fn one_durable_call_makes_its_group_sync() {
        let job = |durability| Job {
            call: Box::new(|_| (true, Box::new(|_| {}) as Reply)),
            durability,
        };
        let (full, replayable, durable) = (
            Synchronous::Full,
            Durability::Replayable,
            Durability::Durable,
        );
        assert_eq!(
            group_sync(full, &[job(replayable), job(replayable)]),
            Synchronous::Normal
        );
        assert_eq!(
            group_sync(full, &[job(replayable), job(durable)]),
            Synchronous::Full
        );
        assert_eq!(group_sync(full, &[job(durable)]), Synchronous::Full);
    }

    #[tokio::test]
    async fn concurrent_writes_commit_in_groups_and_each_stays_conditional() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let db = file_db(&dir);
        assert!(
            db.create_run("o", "r", "running", b"{}", b"e", 1)
                .await
                .expect("create")
        );
        // 20 appends race for version 1: exactly one wins, even when they share a group transaction, and the
        // losers' savepoints leave nothing behind.
        let appends = (0..20).map(|i| {
            let db = db.clone();
            tokio::spawn(async move {
                db.append(
                    "o",
                    "r",
                    1,
                    "running",
                    b"{}",
                    &[format!("{i}").into_bytes()],
                    2,
                )
                .await
            })
        });
        let mut won = 0;
        for append in futures_join(appends).await {
            match append {
                Ok(v) => {
                    assert_eq!(v, 2);
                    won += 1;
                }
                Err(StoreError::Conflict) => {}
                Err(e) => panic!("unexpected {e}"),
            }
        }
        assert_eq!(won, 1);
        assert_eq!(db.events("o", "r", 0, 100).await.expect("events").len(), 2);
    }

    async fn futures_join<T>(handles: impl Iterator<Item = tokio::task::JoinHandle<T>>) -> Vec<T> {
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.expect("task"));
        }
        out
    }
}
