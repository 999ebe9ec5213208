use async_trait::async_trait;
use rusqlite::params;

use super::{Sqlite, db, exec, first_row, to_i64, to_u64};
use crate::limits::{self, MAX_BODY, MAX_LEASE_MS, MAX_PAGE};
use crate::{
    Claim, Cond, Durability, EventRow, Item, Page, Paged, Result, RunRow, Store, StoreError,
};

const RUN_COLUMNS: &str = "org, id, version, state, snapshot, updated_ms, created_ms";
const ITEM_COLUMNS: &str = "org, kind, id, version, idx, body, expires_ms";
/// Every this many item puts, one also removes expired items, as DynamoDB's TTL does: reads already skip them,
/// but a store that only hides them keeps what they hold (an agent's answers to a reader, challenges) forever.
pub(super) const SWEEP_EVERY: u64 = 256;
/// Most expired items one sweep removes, so a backlog never makes one put slow.
const SWEEP_BATCH: i64 = 512;

/// Removes up to `SWEEP_BATCH` items expired at `now` (through the `items_by_expiry` index).
fn remove_expired(conn: &rusqlite::Connection, now: i64) -> Result<()> {
    exec(
        conn,
        "DELETE FROM items WHERE rowid IN
           (SELECT rowid FROM items WHERE expires_ms IS NOT NULL AND expires_ms <= ?1 LIMIT ?2)",
        params![now, SWEEP_BATCH],
    )
    .map(drop)
}

/// A run row plus its created_ms, which the list cursor needs.
fn run_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(RunRow, i64, i64)> {
    Ok((
        RunRow {
            org: r.get(0)?,
            id: r.get(1)?,
            version: 0,
            state: r.get(3)?,
            snapshot: r.get(4)?,
            updated_ms: r.get(5)?,
        },
        r.get(2)?,
        r.get(6)?,
    ))
}

fn finish_run((mut row, version, _): (RunRow, i64, i64)) -> Result<RunRow> {
    row.version = to_u64("run version", version)?;
    Ok(row)
}

fn item_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(Item, i64)> {
    Ok((
        Item {
            org: r.get(0)?,
            kind: r.get(1)?,
            id: r.get(2)?,
            version: 0,
            index: r.get(4)?,
            body: r.get(5)?,
            expires_ms: r.get(6)?,
        },
        r.get(3)?,
    ))
}

fn finish_item((mut item, version): (Item, i64)) -> Result<Item> {
    item.version = to_u64("item version", version)?;
    Ok(item)
}

/// Run cursors are `<created_ms>:<id>` of the last row returned.
fn parse_run_cursor(cursor: &str) -> Result<(i64, String)> {
    let bad = || StoreError::Invalid("malformed cursor".into());
    let (ms, id) = cursor.split_once(':').ok_or_else(bad)?;
    Ok((ms.parse().map_err(|_| bad())?, id.to_owned()))
}

fn check_page(page: &Page) -> Result<i64> {
    if let Some(c) = &page.cursor {
        limits::token("cursor", c)?;
    }
    Ok(i64::from(limits::count(
        "page limit",
        page.limit,
        MAX_PAGE,
    )?))
}

/// The statement listing runs, newest first: `?1` org, `?2` the state, `?3` and `?4` the cursor's created_ms and
/// id, `?5` the page's limit + 1. As with items (`ItemFilter::condition`), one statement per case, so that a state
/// uses `runs_by_state` and a page after a cursor seeks to it (the row value `(created_ms, id) < (?3, ?4)` is one
/// bound of the index).
fn runs_listing(by_state: bool, after_cursor: bool) -> String {
    let state = if by_state { "state = ?2" } else { "?2 IS NULL" };
    let after = if after_cursor {
        "(created_ms, id) < (?3, ?4)"
    } else {
        "?3 IS NULL AND ?4 IS NULL"
    };
    format!(
        "SELECT {RUN_COLUMNS} FROM runs WHERE org = ?1 AND {state} AND {after}
         ORDER BY created_ms DESC, id DESC LIMIT ?5"
    )
}

/// Which items of a kind a listing returns.
enum ItemFilter {
    All,
    Index(String),
    Prefix(String),
}

impl ItemFilter {
    /// The condition on `?3` (the filter's value) and `?4` (the cursor, the last id of the page before), one
    /// statement per case rather than `(?3 IS NULL OR idx = ?3)` and `(?4 IS NULL OR id > ?4)`: a statement is
    /// planned once for every binding, so those forms could seek no index, and every page would scan the kind
    /// (or the prefix) from its start.
    fn condition(&self, after_cursor: bool) -> &'static str {
        // Every id that starts with ?3 sorts in [?3, ?3 || X'F4908080') byte by byte, and only those: no UTF-8
        // text has bytes past F4 8F BF BF. After a cursor at or past ?3 (see `cursor`), `id > ?4` is the range's
        // start: one lower bound, which the primary key's index seeks to.
        match (self, after_cursor) {
            (ItemFilter::All, false) => "AND ?3 IS NULL AND ?4 IS NULL",
            (ItemFilter::All, true) => "AND ?3 IS NULL AND id > ?4",
            (ItemFilter::Index(_), false) => "AND idx = ?3 AND ?4 IS NULL",
            (ItemFilter::Index(_), true) => "AND idx = ?3 AND id > ?4",
            (ItemFilter::Prefix(_), false) => {
                "AND id >= ?3 AND id < ?3 || X'F4908080' AND ?4 IS NULL"
            }
            (ItemFilter::Prefix(_), true) => "AND id > ?4 AND id < ?3 || X'F4908080'",
        }
    }

    /// The listing statement: `?1` org, `?2` kind, `?3` the filter's value, `?4` the cursor, `?5` now, `?6` the
    /// page's limit + 1.
    fn listing(&self, after_cursor: bool) -> String {
        format!(
            "SELECT {ITEM_COLUMNS} FROM items
             WHERE org = ?1 AND kind = ?2 {}
               AND (expires_ms IS NULL OR expires_ms > ?5)
             ORDER BY id LIMIT ?6",
            self.condition(after_cursor)
        )
    }

    /// The page's cursor as the listing uses it. With a prefix, `id > cursor` is the range's only lower bound, so
    /// a cursor before the prefix (never one a prefix listing returned) must not widen it: it is dropped, and the
    /// listing starts at the prefix.
    fn cursor(&self, after: Option<String>) -> Option<String> {
        match self {
            ItemFilter::Prefix(prefix) => after.filter(|c| c >= prefix),
            ItemFilter::All | ItemFilter::Index(_) => after,
        }
    }

    fn value(&self) -> Option<&str> {
        match self {
            ItemFilter::All => None,
            ItemFilter::Index(v) | ItemFilter::Prefix(v) => Some(v),
        }
    }
}

impl Sqlite {
    async fn list_items_where(
        &self,
        org: &str,
        kind: &str,
        filter: ItemFilter,
        page: Page,
    ) -> Result<Paged<Item>> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        let limit = check_page(&page)?;
        // The cursor is the id of the last item returned; ids are unique within (org, kind).
        let (org, kind, after) = (org.to_owned(), kind.to_owned(), filter.cursor(page.cursor));
        self.with_reader(move |conn, inner| {
            let now = inner.clock.now_ms();
            let sql = filter.listing(after.is_some());
            let mut stmt = conn.prepare_cached(&sql).map_err(db)?;
            let rows = stmt
                .query_map(
                    params![org, kind, filter.value(), after, now, limit + 1],
                    item_row,
                )
                .map_err(db)?
                .collect::<rusqlite::Result<Vec<_>>>()
                .map_err(db)?;
            let more = rows.len() as i64 > limit;
            let items = rows
                .into_iter()
                .take(limit as usize)
                .map(finish_item)
                .collect::<Result<Vec<_>>>()?;
            let next = if more {
                items.last().map(|i| i.id.clone())
            } else {
                None
            };
            Ok(Paged { items, next })
        })
        .await
    }
}

#[async_trait]
impl Store for Sqlite {
    async fn create_run(
        &self,
        org: &str,
        id: &str,
        state: &str,
        snapshot: &[u8],
        first_event: &[u8],
        now_ms: i64,
    ) -> Result<bool> {
        limits::run_write(org, id, state, snapshot, &[first_event])?;
        let (org, id, state, snapshot, event) = (
            org.to_owned(),
            id.to_owned(),
            state.to_owned(),
            snapshot.to_vec(),
            first_event.to_vec(),
        );
        self.with_conn(move |conn, _| {
            let inserted = exec(
                conn,
                "INSERT INTO runs (org, id, version, state, snapshot, created_ms, updated_ms)
                 VALUES (?1, ?2, 1, ?3, ?4, ?5, ?5) ON CONFLICT (org, id) DO NOTHING",
                params![org, id, state, snapshot, now_ms],
            )?;
            if inserted == 0 {
                return Ok(false);
            }
            exec(
                conn,
                "INSERT INTO events (org, run, seq, body) VALUES (?1, ?2, 1, ?3)",
                params![org, id, event],
            )?;
            Ok(true)
        })
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
        limits::run_write(org, id, state, snapshot, events)?;
        let expected = to_i64("expected version", expected_version)?;
        // events.len() <= 99, so the sum only overflows for an expected version near i64::MAX.
        let new_version = expected
            .checked_add(events.len() as i64)
            .ok_or_else(|| StoreError::Invalid("version overflow".into()))?;
        let (org, id, state, snapshot, events) = (
            org.to_owned(),
            id.to_owned(),
            state.to_owned(),
            snapshot.to_vec(),
            events.to_vec(),
        );
        self.with_conn(move |conn, _| {
            let current: Option<i64> = first_row(
                conn,
                "SELECT version FROM runs WHERE org = ?1 AND id = ?2",
                params![org, id],
                |r| r.get(0),
            )?;
            match current {
                None => return Err(StoreError::NotFound),
                Some(v) if v != expected => return Err(StoreError::Conflict),
                Some(_) => {}
            }
            {
                let mut insert = conn
                    .prepare_cached(
                        "INSERT INTO events (org, run, seq, body) VALUES (?1, ?2, ?3, ?4)",
                    )
                    .map_err(db)?;
                for (seq, body) in (expected + 1..).zip(&events) {
                    insert.execute(params![org, id, seq, body]).map_err(db)?;
                }
            }
            exec(
                conn,
                "UPDATE runs SET version = ?3, state = ?4, snapshot = ?5, updated_ms = ?6
                 WHERE org = ?1 AND id = ?2",
                params![org, id, new_version, state, snapshot, now_ms],
            )?;
            to_u64("run version", new_version)
        })
        .await
    }

    async fn get_run(&self, org: &str, id: &str) -> Result<Option<RunRow>> {
        limits::org(org)?;
        limits::key("run id", id)?;
        let (org, id) = (org.to_owned(), id.to_owned());
        self.with_reader(move |conn, _| {
            first_row(
                conn,
                &format!("SELECT {RUN_COLUMNS} FROM runs WHERE org = ?1 AND id = ?2"),
                params![org, id],
                run_row,
            )?
            .map(finish_run)
            .transpose()
        })
        .await
    }

    async fn list_runs(&self, org: &str, state: Option<&str>, page: Page) -> Result<Paged<RunRow>> {
        limits::org(org)?;
        if let Some(s) = state {
            limits::name("state", s)?;
        }
        let limit = check_page(&page)?;
        // Newest first; the cursor is the (created_ms, id) of the last row, and ids break ties so paging neither
        // skips nor repeats runs created in the same millisecond.
        let (after_ms, after_id) = match &page.cursor {
            Some(c) => {
                let (ms, id) = parse_run_cursor(c)?;
                (Some(ms), Some(id))
            }
            None => (None, None),
        };
        let (org, state) = (org.to_owned(), state.map(str::to_owned));
        self.with_reader(move |conn, _| {
            let sql = runs_listing(state.is_some(), after_ms.is_some());
            let mut stmt = conn.prepare_cached(&sql).map_err(db)?;
            let rows = stmt
                .query_map(params![org, state, after_ms, after_id, limit + 1], run_row)
                .map_err(db)?
                .collect::<rusqlite::Result<Vec<_>>>()
                .map_err(db)?;
            let more = rows.len() as i64 > limit;
            let mut items = Vec::with_capacity(rows.len());
            let mut next = None;
            for row in rows.into_iter().take(limit as usize) {
                let created = row.2;
                let row = finish_run(row)?;
                next = Some(format!("{created}:{}", row.id));
                items.push(row);
            }
            Ok(Paged {
                items,
                next: if more { next } else { None },
            })
        })
        .await
    }

    async fn events(
        &self,
        org: &str,
        id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        limits::org(org)?;
        limits::key("run id", id)?;
        let limit = i64::from(limits::count("event limit", limit, MAX_PAGE)?);
        let after = to_i64("after_seq", after_seq)?;
        let (org, id) = (org.to_owned(), id.to_owned());
        self.with_reader(move |conn, _| {
            let mut stmt = conn
                .prepare_cached("SELECT seq, body FROM events WHERE org = ?1 AND run = ?2 AND seq > ?3 ORDER BY seq LIMIT ?4")
                .map_err(db)?;
            let rows = stmt
                .query_map(params![org, id, after, limit], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))
                .map_err(db)?;
            let mut out = Vec::new();
            for row in rows {
                let (seq, body) = row.map_err(db)?;
                out.push(EventRow { seq: to_u64("event seq", seq)?, body });
            }
            Ok(out)
        })
        .await
    }

    async fn get_item(&self, org: &str, kind: &str, id: &str) -> Result<Option<Item>> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        limits::key("item id", id)?;
        let (org, kind, id) = (org.to_owned(), kind.to_owned(), id.to_owned());
        self.with_reader(move |conn, inner| {
            let now = inner.clock.now_ms();
            first_row(
                conn,
                &format!(
                    "SELECT {ITEM_COLUMNS} FROM items WHERE org = ?1 AND kind = ?2 AND id = ?3
                     AND (expires_ms IS NULL OR expires_ms > ?4)"
                ),
                params![org, kind, id, now],
                item_row,
            )?
            .map(finish_item)
            .transpose()
        })
        .await
    }

    async fn put_item(&self, item: &Item, cond: Cond) -> Result<u64> {
        self.put_item_with(item, cond, Durability::Durable).await
    }

    async fn put_item_with(&self, item: &Item, cond: Cond, durability: Durability) -> Result<u64> {
        let sweep = self
            .inner
            .puts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % SWEEP_EVERY
            == SWEEP_EVERY - 1;
        limits::item(item)?;
        let expected = match cond {
            Cond::Version(v) => Some(to_i64("expected version", v)?),
            Cond::Absent | Cond::Any => None,
        };
        let item = item.clone();
        self.write(durability, move |conn, inner| {
            let now = inner.clock.now_ms();
            // An expired row counts as absent: it is invisible to reads, so it must not block a fresh put either.
            let current: Option<i64> = first_row(
                conn,
                "SELECT version FROM items WHERE org = ?1 AND kind = ?2 AND id = ?3
                 AND (expires_ms IS NULL OR expires_ms > ?4)",
                params![item.org, item.kind, item.id, now],
                |r| r.get(0),
            )?;
            let holds = match cond {
                Cond::Absent => current.is_none(),
                Cond::Version(_) => current.is_some() && current == expected,
                Cond::Any => true,
            };
            if !holds {
                return Err(StoreError::Conflict);
            }
            let version = current.map_or(Ok(1), |v| {
                v.checked_add(1).ok_or_else(|| StoreError::Backend("item version overflow".into()))
            })?;
            exec(
                conn,
                "INSERT INTO items (org, kind, id, version, idx, body, expires_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                 ON CONFLICT (org, kind, id) DO UPDATE SET
                   version = excluded.version, idx = excluded.idx, body = excluded.body,
                   expires_ms = excluded.expires_ms",
                params![item.org, item.kind, item.id, version, item.index, item.body, item.expires_ms],
            )?;
            if sweep {
                remove_expired(conn, now)?;
            }
            to_u64("item version", version)
        })
        .await
    }

    async fn delete_item(&self, org: &str, kind: &str, id: &str) -> Result<()> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        limits::key("item id", id)?;
        let (org, kind, id) = (org.to_owned(), kind.to_owned(), id.to_owned());
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "DELETE FROM items WHERE org = ?1 AND kind = ?2 AND id = ?3",
                params![org, kind, id],
            )?;
            Ok(())
        })
        .await
    }

    async fn list_items(
        &self,
        org: &str,
        kind: &str,
        index: Option<&str>,
        page: Page,
    ) -> Result<Paged<Item>> {
        if let Some(idx) = index {
            limits::key("index", idx)?;
        }
        let filter = match index {
            Some(idx) => ItemFilter::Index(idx.to_owned()),
            None => ItemFilter::All,
        };
        self.list_items_where(org, kind, filter, page).await
    }

    async fn list_items_with_prefix(
        &self,
        org: &str,
        kind: &str,
        prefix: &str,
        page: Page,
    ) -> Result<Paged<Item>> {
        limits::key("prefix", prefix)?;
        self.list_items_where(org, kind, ItemFilter::Prefix(prefix.to_owned()), page)
            .await
    }

    async fn claim(&self, org: &str, key: &str, now_ms: i64, lease_ms: u64) -> Result<Claim> {
        limits::org(org)?;
        limits::key("idempotency key", key)?;
        let lease = limits::duration("lease", lease_ms, MAX_LEASE_MS)?;
        let lease_until = now_ms.saturating_add(lease);
        let (org, key) = (org.to_owned(), key.to_owned());
        self.with_conn(move |conn, _| {
            let current: Option<(String, Option<Vec<u8>>, i64)> = first_row(
                conn,
                "SELECT status, result, lease_until_ms FROM idempotency WHERE org = ?1 AND key = ?2",
                params![org, key],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )?;
            match current {
                Some((status, result, _)) if status == "done" => return Ok(Claim::Done(result.unwrap_or_default())),
                Some((_, _, until)) if until > now_ms => return Ok(Claim::InProgress),
                // Unknown, or the previous holder's lease ran out (it crashed or stalled): take over.
                _ => {}
            }
            exec(
                conn,
                "INSERT INTO idempotency (org, key, status, result, lease_until_ms, updated_ms)
                 VALUES (?1, ?2, 'in_progress', NULL, ?3, ?4)
                 ON CONFLICT (org, key) DO UPDATE SET
                   status = 'in_progress', result = NULL, lease_until_ms = excluded.lease_until_ms,
                   updated_ms = excluded.updated_ms",
                params![org, key, lease_until, now_ms],
            )?;
            Ok(Claim::New)
        })
        .await
    }

    async fn finish(&self, org: &str, key: &str, result: &[u8], now_ms: i64) -> Result<()> {
        limits::org(org)?;
        limits::key("idempotency key", key)?;
        limits::body("idempotency result", result, MAX_BODY)?;
        let (org, key, result) = (org.to_owned(), key.to_owned(), result.to_vec());
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "INSERT INTO idempotency (org, key, status, result, lease_until_ms, updated_ms)
                 VALUES (?1, ?2, 'done', ?3, 0, ?4)
                 ON CONFLICT (org, key) DO UPDATE SET
                   status = 'done', result = excluded.result, updated_ms = excluded.updated_ms
                 WHERE idempotency.status <> 'done'",
                params![org, key, result, now_ms],
            )?;
            Ok(())
        })
        .await
    }

    async fn release(&self, org: &str, key: &str) -> Result<()> {
        limits::org(org)?;
        limits::key("idempotency key", key)?;
        let (org, key) = (org.to_owned(), key.to_owned());
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "DELETE FROM idempotency WHERE org = ?1 AND key = ?2 AND status = 'in_progress'",
                params![org, key],
            )?;
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each listing seeks its index to the page's start instead of scanning from the start of the kind, the index
    /// value, the prefix or the org's runs: the plan names the index and the bounds it seeks.
    #[test]
    fn every_listing_seeks_to_its_page() {
        let mut conn = rusqlite::Connection::open_in_memory().expect("open");
        super::super::migrate(&mut conn).expect("migrate");
        let plan = |sql: &str, params: &[&dyn rusqlite::ToSql]| -> String {
            let mut stmt = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("prepare");
            stmt.query_map(params, |r| r.get::<_, String>(3))
                .expect("plan")
                .collect::<rusqlite::Result<Vec<_>>>()
                .expect("plan rows")
                .join("; ")
        };
        let filters = [
            ItemFilter::All,
            ItemFilter::Index("i".into()),
            ItemFilter::Prefix("p:".into()),
        ];
        for filter in &filters {
            for after_cursor in [false, true] {
                let sql = filter.listing(after_cursor);
                let cursor = after_cursor.then_some("p:1");
                let got = plan(&sql, params!["o", "k", filter.value(), cursor, 0, 10]);
                let seeks = match (filter, after_cursor) {
                    (ItemFilter::All, false) => "sqlite_autoindex_items_1 (org=? AND kind=?)",
                    (ItemFilter::All, true) => {
                        "sqlite_autoindex_items_1 (org=? AND kind=? AND id>?)"
                    }
                    (ItemFilter::Index(_), false) => "items_by_idx (org=? AND kind=? AND idx=?)",
                    (ItemFilter::Index(_), true) => {
                        "items_by_idx (org=? AND kind=? AND idx=? AND id>?)"
                    }
                    (ItemFilter::Prefix(_), _) => {
                        "sqlite_autoindex_items_1 (org=? AND kind=? AND id>? AND id<?)"
                    }
                };
                assert!(got.ends_with(seeks), "{sql}: {got}");
            }
        }
        for by_state in [false, true] {
            for after_cursor in [false, true] {
                let sql = runs_listing(by_state, after_cursor);
                let (ms, id) = (after_cursor.then_some(5), after_cursor.then_some("r"));
                let state = by_state.then_some("s");
                let got = plan(&sql, params!["o", state, ms, id, 10]);
                let seeks = match (by_state, after_cursor) {
                    (false, false) => "runs_by_created (org=?)",
                    (false, true) => "runs_by_created (org=? AND (created_ms,id)<(?,?))",
                    (true, false) => "runs_by_state (org=? AND state=?)",
                    (true, true) => "runs_by_state (org=? AND state=? AND (created_ms,id)<(?,?))",
                };
                assert!(got.ends_with(seeks), "{sql}: {got}");
            }
        }
    }

    /// A prefix listing never leaves its prefix, whatever the cursor: one before the prefix starts at the prefix,
    /// one past it finds nothing.
    #[tokio::test]
    async fn a_prefix_listing_keeps_to_its_prefix_whatever_the_cursor() {
        let db = Sqlite::memory(std::sync::Arc::new(crate::ManualClock::new(0))).expect("open");
        for id in ["A:1", "a", "a9", "a:1", "a:2", "b"] {
            let item = Item {
                org: "o".into(),
                kind: "k".into(),
                id: id.into(),
                version: 0,
                index: None,
                body: b"x".to_vec(),
                expires_ms: None,
            };
            db.put_item(&item, Cond::Absent).await.expect("put");
        }
        for (cursor, want) in [("0", &["a:1", "a:2"][..]), ("a:1", &["a:2"]), ("a;", &[])] {
            let page = Page {
                cursor: Some(cursor.into()),
                limit: 10,
            };
            let got = db
                .list_items_with_prefix("o", "k", "a:", page)
                .await
                .expect("list");
            let ids: Vec<&str> = got.items.iter().map(|i| i.id.as_str()).collect();
            assert_eq!(ids, want, "after {cursor:?}");
        }
    }
}
