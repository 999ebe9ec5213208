//! The one SQLite database of an installation: runs and their timelines, approvals, the device, bot threads and
//! messages, and the sync cursors. Numbered migrations (`migrations/NNN_*.sql`), each applied in its own
//! transaction and recorded in `PRAGMA user_version`.
//!
//! Rows are written only with what the server sent, stamped with the time it was received: the cache never holds
//! a local guess (nothing is queued), so whatever it shows was true at `confirmed_at_ms`.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use loams_proto::approvals::v1 as pa;
use loams_proto::bot::v1 as pb;
use loams_proto::devices::v1 as pd;
use loams_proto::factory::v1 as pf;
use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, params};

use crate::error::{Error, Result};
use crate::types::{Approval, ApprovalState, Device, Message, Run, Thread, TimelineEvent};

/// The migrations, in order; the index + 1 is the schema version they lead to.
const MIGRATIONS: &[&str] = &[include_str!("../migrations/001_init.sql")];

pub(crate) struct Cache {
    conn: Mutex<Connection>,
}

fn seq_to_sql(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::Server(format!("sequence number {v} out of range")))
}

fn sql_to_seq(v: i64) -> u64 {
    // Only ever written from a u64 through `seq_to_sql`.
    u64::try_from(v).unwrap_or(0)
}

fn decode<M: prost::Message + Default>(blob: &[u8]) -> rusqlite::Result<M> {
    M::decode(blob).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(e))
    })
}

pub(crate) fn timeline_stream(run_id: &str) -> String {
    format!("timeline:{run_id}")
}

pub(crate) fn messages_stream(thread_id: &str) -> String {
    format!("messages:{thread_id}")
}

impl Cache {
    /// Opens (creating and migrating as needed) the database at `path` for the account (`server_url`, `org`). A
    /// database of another account, or of a newer schema than this build knows, is refused rather than mixed.
    pub(crate) fn open(path: &Path, server_url: &str, org: &str) -> Result<Cache> {
        let conn = Connection::open(path)?;
        Self::init(conn, server_url, org)
    }

    #[cfg(test)]
    pub(crate) fn open_in_memory(server_url: &str, org: &str) -> Result<Cache> {
        Self::init(Connection::open_in_memory()?, server_url, org)
    }

    fn init(mut conn: Connection, server_url: &str, org: &str) -> Result<Cache> {
        // WAL cannot be switched inside a transaction; readers then never wait for the sync writer.
        conn.pragma_update(None, "journal_mode", "wal")?;
        // NORMAL is durable enough for a cache in WAL mode: a crash cannot corrupt it, it can only lose the last
        // commits, and each commit stores rows together with their cursor, so a watch re-syncs what was lost from
        // the server. FULL would sync the disk on every commit of a stream.
        conn.pragma_update(None, "synchronous", "normal")?;
        conn.pragma_update(None, "foreign_keys", "on")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrate(&mut conn)?;
        bind_account(&conn, server_url, org)?;
        Ok(Cache {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> Result<MutexGuard<'_, Connection>> {
        self.conn
            .lock()
            .map_err(|_| Error::Cache("the database lock is poisoned".into()))
    }

    // --- runs ---

    /// Stores runs as the server sent them. A run already stored at a higher version keeps its content (a list or a
    /// snapshot taken before the stream's latest event must not roll it back); its confirmation time still moves.
    pub(crate) fn put_runs(&self, runs: &[pf::Run], now_ms: i64) -> Result<()> {
        let mut conn = self.conn()?;
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO runs (id, state, started_at_ms, version, proto, confirmed_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (id) DO UPDATE SET
                   state = CASE WHEN excluded.version >= runs.version THEN excluded.state ELSE runs.state END,
                   proto = CASE WHEN excluded.version >= runs.version THEN excluded.proto ELSE runs.proto END,
                   version = max(runs.version, excluded.version),
                   started_at_ms = excluded.started_at_ms,
                   confirmed_at_ms = max(runs.confirmed_at_ms, excluded.confirmed_at_ms)",
            )?;
            for run in runs {
                stmt.execute(params![
                    run.id,
                    run.state,
                    run.started_at_ms,
                    seq_to_sql(run.version)?,
                    run.encode_to_vec(),
                    now_ms
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    pub(crate) fn run(&self, id: &str) -> Result<Option<Run>> {
        let conn = self.conn()?;
        let row = conn
            .query_row(
                "SELECT proto, confirmed_at_ms FROM runs WHERE id = ?1",
                [id],
                |r| {
                    Ok((
                        decode::<pf::Run>(&r.get::<_, Vec<u8>>(0)?)?,
                        r.get::<_, i64>(1)?,
                    ))
                },
            )
            .optional()?;
        Ok(row.map(|(run, at)| Run::from_proto(run, at)))
    }

    /// The newest `limit` runs.
    pub(crate) fn runs(&self, limit: u32) -> Result<Vec<Run>> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare_cached(
            "SELECT proto, confirmed_at_ms FROM runs ORDER BY started_at_ms DESC, id LIMIT ?1",
        )?;
        let rows = stmt.query_map([limit], |r| {
            Ok(Run::from_proto(
                decode(&r.get::<_, Vec<u8>>(0)?)?,
                r.get(1)?,
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Records that the server confirmed the run as stored (a heartbeat of its watch) without new content.
    pub(crate) fn confirm_run(&self, id: &str, now_ms: i64) -> Result<()> {
        self.conn()?.execute(
            "UPDATE runs SET confirmed_at_ms = max(confirmed_at_ms, ?2) WHERE id = ?1",
            params![id, now_ms],
        )?;
        Ok(())
    }

    /// Stores timeline events and moves the run's cursor to the last of them, in one transaction, so a restart
    /// resumes exactly after what is stored. Returns the events that were new.
    pub(crate) fn append_events(
        &self,
        run_id: &str,
        events: &[pf::TimelineEvent],
        now_ms: i64,
    ) -> Result<Vec<TimelineEvent>> {
        let mut conn = self.conn()?;
        let tx = conn.transaction()?;
        let mut fresh = Vec::new();
        {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO timeline_events (run_id, seq, at_ms, kind, stage, summary, detail_json, confirmed_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (run_id, seq) DO UPDATE SET confirmed_at_ms = excluded.confirmed_at_ms",
            )?;
            let mut known =
                tx.prepare_cached("SELECT 1 FROM timeline_events WHERE run_id = ?1 AND seq = ?2")?;
            for e in events {
                let seq = seq_to_sql(e.seq)?;
                let existed = known.exists(params![run_id, seq])?;
                stmt.execute(params![
                    run_id,
                    seq,
                    e.at_ms,
                    e.r#type,
                    e.stage,
                    e.summary,
                    e.detail_json,
                    now_ms
                ])?;
                if !existed {
                    fresh.push(TimelineEvent::from_proto(run_id, e.clone(), now_ms));
                }
            }
            if let Some(last) = events.iter().map(|e| e.seq).max() {
                advance_cursor(&tx, &timeline_stream(run_id), last, now_ms)?;
            }
        }
        tx.commit()?;
        Ok(fresh)
    }

    /// The run's stored events after `after_seq`, oldest first, at most `limit`.
    pub(crate) fn events(
        &self,
        run_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<TimelineEvent>> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare_cached(
            "SELECT seq, at_ms, kind, stage, summary, detail_json, confirmed_at_ms FROM timeline_events
             WHERE run_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![run_id, seq_to_sql(after_seq)?, limit], |r| {
            Ok(TimelineEvent {
                run_id: run_id.to_owned(),
                seq: sql_to_seq(r.get(0)?),
                at_ms: r.get(1)?,
                kind: r.get(2)?,
                stage: r.get(3)?,
                summary: r.get(4)?,
                detail_json: r.get(5)?,
                confirmed_at_ms: r.get(6)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    // --- cursors ---

    /// The last seq stored for `stream` (0: nothing yet).
    pub(crate) fn cursor(&self, stream: &str) -> Result<u64> {
        let conn = self.conn()?;
        let v: Option<i64> = conn
            .query_row(
                "SELECT cursor FROM sync_cursors WHERE stream = ?1",
                [stream],
                |r| r.get(0),
            )
            .optional()?;
        Ok(v.map(sql_to_seq).unwrap_or(0))
    }

    // --- approvals ---

    pub(crate) fn put_approvals(&self, approvals: &[pa::Approval], now_ms: i64) -> Result<()> {
        let mut conn = self.conn()?;
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO approvals (id, run_id, state, created_at_ms, proto, confirmed_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (id) DO UPDATE SET state = excluded.state, proto = excluded.proto,
                   confirmed_at_ms = excluded.confirmed_at_ms",
            )?;
            for a in approvals {
                stmt.execute(params![
                    a.id,
                    a.run_id,
                    a.state,
                    a.created_at_ms,
                    a.encode_to_vec(),
                    now_ms
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    pub(crate) fn approval(&self, id: &str) -> Result<Option<Approval>> {
        let conn = self.conn()?;
        let row = conn
            .query_row(
                "SELECT proto, confirmed_at_ms FROM approvals WHERE id = ?1",
                [id],
                |r| {
                    Ok(Approval::from_proto(
                        decode(&r.get::<_, Vec<u8>>(0)?)?,
                        r.get(1)?,
                    ))
                },
            )
            .optional()?;
        Ok(row)
    }

    pub(crate) fn delete_approval(&self, id: &str) -> Result<()> {
        self.conn()?
            .execute("DELETE FROM approvals WHERE id = ?1", [id])?;
        Ok(())
    }

    /// Approvals as last confirmed in `state` (any state for `None`), newest first.
    pub(crate) fn approvals(
        &self,
        state: Option<ApprovalState>,
        limit: u32,
    ) -> Result<Vec<Approval>> {
        let conn = self.conn()?;
        let wanted = state.map(approval_state_number);
        let mut stmt = conn.prepare_cached(
            "SELECT proto, confirmed_at_ms FROM approvals WHERE ?1 IS NULL OR state = ?1
             ORDER BY created_at_ms DESC, id LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![wanted, limit], |r| {
            Ok(Approval::from_proto(
                decode(&r.get::<_, Vec<u8>>(0)?)?,
                r.get(1)?,
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    // --- device ---

    pub(crate) fn put_device(&self, device: &pd::Device, now_ms: i64) -> Result<()> {
        self.conn()?.execute(
            "INSERT INTO device (slot, device_id, proto, confirmed_at_ms) VALUES (1, ?1, ?2, ?3)
             ON CONFLICT (slot) DO UPDATE SET device_id = excluded.device_id, proto = excluded.proto,
               confirmed_at_ms = excluded.confirmed_at_ms",
            params![device.device_id, device.encode_to_vec(), now_ms],
        )?;
        Ok(())
    }

    pub(crate) fn device(&self) -> Result<Option<Device>> {
        let conn = self.conn()?;
        let row = conn
            .query_row(
                "SELECT proto, confirmed_at_ms FROM device WHERE slot = 1",
                [],
                |r| {
                    Ok(Device::from_proto(
                        decode(&r.get::<_, Vec<u8>>(0)?)?,
                        r.get(1)?,
                    ))
                },
            )
            .optional()?;
        Ok(row)
    }

    // --- bot ---

    pub(crate) fn put_thread(&self, thread: &pb::Thread, now_ms: i64) -> Result<()> {
        self.conn()?.execute(
            "INSERT INTO threads (id, updated_at_ms, proto, confirmed_at_ms) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (id) DO UPDATE SET updated_at_ms = excluded.updated_at_ms, proto = excluded.proto,
               confirmed_at_ms = excluded.confirmed_at_ms",
            params![thread.id, thread.updated_at_ms, thread.encode_to_vec(), now_ms],
        )?;
        Ok(())
    }

    pub(crate) fn threads(&self, limit: u32) -> Result<Vec<Thread>> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare_cached(
            "SELECT proto, confirmed_at_ms FROM threads ORDER BY updated_at_ms DESC, id LIMIT ?1",
        )?;
        let rows = stmt.query_map([limit], |r| {
            Ok(Thread::from_proto(
                decode(&r.get::<_, Vec<u8>>(0)?)?,
                r.get(1)?,
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Stores messages of one thread and moves its cursor to the highest seq, in one transaction. Returns the new
    /// ones.
    pub(crate) fn append_messages(
        &self,
        thread_id: &str,
        messages: &[pb::BotMessage],
        now_ms: i64,
    ) -> Result<Vec<Message>> {
        let mut conn = self.conn()?;
        let tx = conn.transaction()?;
        let mut fresh = Vec::new();
        {
            let mut known =
                tx.prepare_cached("SELECT 1 FROM messages WHERE thread_id = ?1 AND seq = ?2")?;
            let mut stmt = tx.prepare_cached(
                "INSERT INTO messages (thread_id, seq, id, role, author, content, created_at_ms, run_id, confirmed_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                 ON CONFLICT (thread_id, seq) DO UPDATE SET confirmed_at_ms = excluded.confirmed_at_ms",
            )?;
            for m in messages.iter().filter(|m| m.thread_id == thread_id) {
                let seq = seq_to_sql(m.seq)?;
                let existed = known.exists(params![thread_id, seq])?;
                stmt.execute(params![
                    thread_id,
                    seq,
                    m.id,
                    m.role,
                    m.author,
                    m.content,
                    m.created_at_ms,
                    m.run_id,
                    now_ms
                ])?;
                if !existed {
                    fresh.push(Message::from_proto(m.clone(), now_ms));
                }
            }
            if let Some(last) = messages
                .iter()
                .filter(|m| m.thread_id == thread_id)
                .map(|m| m.seq)
                .max()
            {
                advance_cursor(&tx, &messages_stream(thread_id), last, now_ms)?;
            }
        }
        tx.commit()?;
        Ok(fresh)
    }

    pub(crate) fn messages(
        &self,
        thread_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<Message>> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare_cached(
            "SELECT seq, id, role, author, content, created_at_ms, run_id, confirmed_at_ms FROM messages
             WHERE thread_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![thread_id, seq_to_sql(after_seq)?, limit], |r| {
            Ok(Message {
                thread_id: thread_id.to_owned(),
                seq: sql_to_seq(r.get(0)?),
                id: r.get(1)?,
                role: r.get(2)?,
                author: r.get(3)?,
                content: r.get(4)?,
                created_at_ms: r.get(5)?,
                run_id: r.get(6)?,
                confirmed_at_ms: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}

fn approval_state_number(s: ApprovalState) -> i32 {
    match s {
        ApprovalState::Unknown => pa::ApprovalState::Unspecified as i32,
        ApprovalState::Pending => pa::ApprovalState::Pending as i32,
        ApprovalState::Approved => pa::ApprovalState::Approved as i32,
        ApprovalState::Denied => pa::ApprovalState::Denied as i32,
        ApprovalState::Expired => pa::ApprovalState::Expired as i32,
    }
}

/// Cursors only move forward: a late page of older events must not send a resumed sync back.
fn advance_cursor(
    tx: &rusqlite::Transaction<'_>,
    stream: &str,
    seq: u64,
    now_ms: i64,
) -> Result<()> {
    tx.execute(
        "INSERT INTO sync_cursors (stream, cursor, updated_at_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (stream) DO UPDATE SET cursor = max(cursor, excluded.cursor), updated_at_ms = excluded.updated_at_ms",
        params![stream, seq_to_sql(seq)?, now_ms],
    )?;
    Ok(())
}

fn migrate(conn: &mut Connection) -> Result<()> {
    let current: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let known = MIGRATIONS.len() as i64;
    if current > known {
        return Err(Error::Cache(format!(
            "the database has schema version {current}, newer than this app knows ({known})"
        )));
    }
    for (i, script) in MIGRATIONS.iter().enumerate().skip(current as usize) {
        let tx = conn.transaction()?;
        tx.execute_batch(script)?;
        tx.pragma_update(None, "user_version", i as i64 + 1)?;
        tx.commit()?;
    }
    Ok(())
}

fn bind_account(conn: &Connection, server_url: &str, org: &str) -> Result<()> {
    for (key, value) in [("server_url", server_url), ("org", org)] {
        let stored: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()?;
        match stored {
            None => {
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2)",
                    params![key, value],
                )?;
            }
            Some(v) if v == value => {}
            Some(v) => {
                return Err(Error::Cache(format!(
                    "the database belongs to {key} {v:?}, not {value:?}; use one database per account"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: &str, version: u64, state: &str) -> pf::Run {
        pf::Run {
            id: id.into(),
            state: state.into(),
            version,
            started_at_ms: 10,
            ..Default::default()
        }
    }

    fn event(seq: u64) -> pf::TimelineEvent {
        pf::TimelineEvent {
            seq,
            at_ms: seq as i64,
            r#type: "t".into(),
            summary: format!("e{seq}"),
            ..Default::default()
        }
    }

    #[test]
    fn an_older_snapshot_does_not_roll_a_run_back_but_confirms_it() {
        let c = Cache::open_in_memory("http://s", "acme").unwrap();
        c.put_runs(&[run("r1", 5, "running")], 100).unwrap();
        c.put_runs(&[run("r1", 3, "waiting")], 200).unwrap();
        let got = c.run("r1").unwrap().unwrap();
        assert_eq!(
            (got.state.as_str(), got.version, got.confirmed_at_ms),
            ("running", 5, 200)
        );
        c.put_runs(&[run("r1", 6, "succeeded")], 300).unwrap();
        assert_eq!(c.run("r1").unwrap().unwrap().state, "succeeded");
    }

    #[test]
    fn events_move_the_cursor_forward_only_and_report_only_new_ones() {
        let c = Cache::open_in_memory("http://s", "acme").unwrap();
        let fresh = c.append_events("r1", &[event(1), event(2)], 1).unwrap();
        assert_eq!(fresh.len(), 2);
        assert_eq!(c.cursor(&timeline_stream("r1")).unwrap(), 2);
        let fresh = c.append_events("r1", &[event(2), event(3)], 2).unwrap();
        assert_eq!(fresh.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3]);
        c.append_events("r1", &[event(1)], 3).unwrap();
        assert_eq!(
            c.cursor(&timeline_stream("r1")).unwrap(),
            3,
            "a late old page does not move the cursor back"
        );
        assert_eq!(
            c.events("r1", 1, 10)
                .unwrap()
                .iter()
                .map(|e| e.seq)
                .collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(c.cursor(&timeline_stream("r2")).unwrap(), 0);
    }

    #[test]
    fn reopening_keeps_data_and_another_account_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("core.db");
        {
            let c = Cache::open(&path, "http://s", "acme").unwrap();
            c.append_events("r1", &[event(1)], 1).unwrap();
        }
        let c = Cache::open(&path, "http://s", "acme").unwrap();
        assert_eq!(c.cursor(&timeline_stream("r1")).unwrap(), 1);
        drop(c);
        assert!(matches!(
            Cache::open(&path, "http://s", "other"),
            Err(Error::Cache(_))
        ));
        assert!(matches!(
            Cache::open(&path, "http://elsewhere", "acme"),
            Err(Error::Cache(_))
        ));
    }

    #[test]
    fn a_database_from_a_newer_app_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("core.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.pragma_update(None, "user_version", 99).unwrap();
        }
        let err = Cache::open(&path, "http://s", "acme").err().unwrap();
        assert!(err.to_string().contains("newer"), "{err}");
    }

    #[test]
    fn approvals_filter_by_state() {
        let c = Cache::open_in_memory("http://s", "acme").unwrap();
        let a = |id: &str, state: pa::ApprovalState| pa::Approval {
            id: id.into(),
            state: state as i32,
            ..Default::default()
        };
        c.put_approvals(
            &[
                a("a1", pa::ApprovalState::Pending),
                a("a2", pa::ApprovalState::Approved),
            ],
            5,
        )
        .unwrap();
        let pending = c.approvals(Some(ApprovalState::Pending), 10).unwrap();
        assert_eq!(
            pending.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
            vec!["a1"]
        );
        assert_eq!(c.approvals(None, 10).unwrap().len(), 2);
        c.put_approvals(&[a("a1", pa::ApprovalState::Denied)], 6)
            .unwrap();
        assert!(
            c.approvals(Some(ApprovalState::Pending), 10)
                .unwrap()
                .is_empty()
        );
        assert_eq!(c.approval("a1").unwrap().unwrap().confirmed_at_ms, 6);
    }
}
