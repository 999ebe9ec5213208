use std::collections::HashSet;

use async_trait::async_trait;
use rusqlite::params;

use super::{Sqlite, db, exec};
use crate::limits::{
    self, MAX_BODY, MAX_DELAY_MS, MAX_MESSAGE, MAX_PAGE, MAX_RECEIVE, MAX_VISIBILITY_MS,
};
use crate::{Delivery, Queue, Result, StoreError, Timer, Timers};

fn count_u32(v: i64) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| StoreError::Backend(format!("stored receive count {v} out of range")))
}

#[async_trait]
impl Queue for Sqlite {
    async fn send(&self, body: &[u8], delay_ms: u64) -> Result<()> {
        limits::body("message", body, MAX_MESSAGE)?;
        let delay = limits::duration("delay", delay_ms, MAX_DELAY_MS)?;
        let body = body.to_vec();
        self.with_conn(move |conn, inner| {
            let now = inner.clock.now_ms();
            exec(
                conn,
                "INSERT INTO queue (body, visible_at_ms, sent_ms) VALUES (?1, ?2, ?3)",
                params![body, now.saturating_add(delay), now],
            )?;
            Ok(())
        })
        .await
    }

    async fn receive(&self, max: u32, visibility_ms: u64) -> Result<Vec<Delivery>> {
        let max = limits::count("receive max", max, MAX_RECEIVE)? as usize;
        let visibility = limits::duration("visibility", visibility_ms, MAX_VISIBILITY_MS)?;
        let max_receives = i64::from(self.max_receives);
        self.with_conn(move |conn, inner| {
            let now = inner.clock.now_ms();
            let mut out = Vec::new();
            // Messages delivered by this call; with a zero visibility timeout they are visible again at once and
            // must not be picked up (or dead-lettered) a second time within the same batch.
            let mut taken = HashSet::new();
            // Dead-lettering a candidate frees a slot, so keep taking candidates until the batch is full or
            // nothing visible is left. Each round removes or takes at least one message, so this ends.
            loop {
                let want = i64::try_from(max - out.len() + taken.len()).unwrap_or(i64::MAX);
                let candidates: Vec<(i64, Vec<u8>, i64)> = {
                    let mut stmt = conn
                        .prepare_cached(
                            "SELECT id, body, receive_count FROM queue WHERE visible_at_ms <= ?1
                             ORDER BY visible_at_ms, id LIMIT ?2",
                        )
                        .map_err(db)?;
                    stmt.query_map(params![now, want], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                        .map_err(db)?
                        .collect::<rusqlite::Result<Vec<_>>>()
                        .map_err(db)?
                        .into_iter()
                        .filter(|(id, _, _)| !taken.contains(id))
                        .collect()
                };
                if candidates.is_empty() {
                    break;
                }
                for (id, body, count) in candidates {
                    if out.len() >= max {
                        break;
                    }
                    if count >= max_receives {
                        exec(
                            conn,
                            "INSERT INTO dead_letters (id, body, receive_count, dead_ms) VALUES (?1, ?2, ?3, ?4)",
                            params![id, body, count, now],
                        )?;
                        exec(conn, "DELETE FROM queue WHERE id = ?1", params![id])?;
                        tracing::warn!(message = id, receives = count, "queue message dead-lettered");
                        continue;
                    }
                    let count = count + 1;
                    // The receipt names this receive: it goes stale when the count moves on.
                    let receipt = format!("{id}.{count}");
                    exec(
                        conn,
                        "UPDATE queue SET visible_at_ms = ?2, receive_count = ?3, receipt = ?4 WHERE id = ?1",
                        params![id, now.saturating_add(visibility), count, receipt],
                    )?;
                    taken.insert(id);
                    out.push(Delivery { id: id.to_string(), receipt, body, receive_count: count_u32(count)? });
                }
                if out.len() >= max {
                    break;
                }
            }
            Ok(out)
        })
        .await
    }

    async fn ack(&self, receipt: &str) -> Result<()> {
        limits::token("receipt", receipt)?;
        let receipt = receipt.to_owned();
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "DELETE FROM queue WHERE receipt = ?1",
                params![receipt],
            )?;
            Ok(())
        })
        .await
    }

    async fn retry_later(&self, receipt: &str, delay_ms: u64) -> Result<()> {
        limits::token("receipt", receipt)?;
        let delay = limits::duration("retry delay", delay_ms, MAX_VISIBILITY_MS)?;
        let receipt = receipt.to_owned();
        self.with_conn(move |conn, inner| {
            let now = inner.clock.now_ms();
            exec(
                conn,
                "UPDATE queue SET visible_at_ms = ?2 WHERE receipt = ?1",
                params![receipt, now.saturating_add(delay)],
            )?;
            Ok(())
        })
        .await
    }

    async fn dead_letters(&self, limit: u32) -> Result<Vec<Delivery>> {
        let limit = i64::from(limits::count("dead letter limit", limit, MAX_PAGE)?);
        self.with_reader(move |conn, _| {
            let mut stmt = conn
                .prepare_cached("SELECT id, body, receive_count FROM dead_letters ORDER BY dead_ms, id LIMIT ?1")
                .map_err(db)?;
            let rows = stmt
                .query_map(params![limit], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?, r.get::<_, i64>(2)?)))
                .map_err(db)?;
            let mut out = Vec::new();
            for row in rows {
                let (id, body, count) = row.map_err(db)?;
                out.push(Delivery { id: id.to_string(), receipt: String::new(), body, receive_count: count_u32(count)? });
            }
            Ok(out)
        })
        .await
    }
}

#[async_trait]
impl Timers for Sqlite {
    async fn schedule(&self, org: &str, id: &str, due_ms: i64, payload: &[u8]) -> Result<()> {
        limits::org(org)?;
        limits::key("timer id", id)?;
        limits::body("timer payload", payload, MAX_BODY)?;
        let (org, id, payload) = (org.to_owned(), id.to_owned(), payload.to_vec());
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "INSERT INTO timers (org, id, due_ms, payload) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (org, id) DO UPDATE SET due_ms = excluded.due_ms, payload = excluded.payload",
                params![org, id, due_ms, payload],
            )?;
            Ok(())
        })
        .await
    }

    async fn cancel(&self, org: &str, id: &str) -> Result<()> {
        limits::org(org)?;
        limits::key("timer id", id)?;
        let (org, id) = (org.to_owned(), id.to_owned());
        self.with_conn(move |conn, _| {
            exec(
                conn,
                "DELETE FROM timers WHERE org = ?1 AND id = ?2",
                params![org, id],
            )?;
            Ok(())
        })
        .await
    }

    async fn due(&self, now_ms: i64, limit: u32) -> Result<Vec<Timer>> {
        let limit = i64::from(limits::count("timer limit", limit, MAX_PAGE)?);
        self.with_reader(move |conn, _| {
            let mut stmt = conn
                .prepare_cached(
                    "SELECT org, id, due_ms, payload FROM timers WHERE due_ms <= ?1
                     ORDER BY due_ms, org, id LIMIT ?2",
                )
                .map_err(db)?;
            stmt.query_map(params![now_ms, limit], |r| {
                Ok(Timer {
                    org: r.get(0)?,
                    id: r.get(1)?,
                    due_ms: r.get(2)?,
                    payload: r.get(3)?,
                })
            })
            .map_err(db)?
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(db)
        })
        .await
    }
}
