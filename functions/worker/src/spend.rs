//! The organisation's model spend per calendar month (UTC), kept in the store so that every worker process counts
//! against the same monthly limit (`Config::org_budget_micros`).

use loams_platform::{Cond, Item, Store, StoreError};
use serde::{Deserialize, Serialize};

use crate::WorkerError;

const KIND: &str = "spend";
/// Concurrent model answers of one organisation each bump the same record, and a lost race reads it again after a
/// short random pause; past this many lost races in a row the caller hears `Contended` and its message is retried.
const MAX_TRIES: u32 = 32;

#[derive(Serialize, Deserialize, Default)]
struct Spent {
    micros: u64,
}

/// What the organisation has spent on models in the month of `now_ms`.
pub(crate) async fn this_month(
    store: &dyn Store,
    org: &str,
    now_ms: i64,
) -> Result<u64, WorkerError> {
    Ok(read(store, org, &record_id(now_ms)).await?.0.micros)
}

/// Adds `micros` to the month of `now_ms`. Called once per model answer, before the answer is stored as final:
/// a crash in between makes the call be paid (and counted) again, so the count never falls behind what was paid.
pub(crate) async fn add(
    store: &dyn Store,
    org: &str,
    now_ms: i64,
    micros: u64,
) -> Result<(), WorkerError> {
    if micros == 0 {
        return Ok(());
    }
    let id = record_id(now_ms);
    for attempt in 0..MAX_TRIES {
        if attempt > 0 {
            pause(attempt).await;
        }
        let (spent, version) = read(store, org, &id).await?;
        let item = Item {
            org: org.into(),
            kind: KIND.into(),
            id: id.clone(),
            version: 0,
            index: None,
            body: serde_json::to_vec(&Spent {
                micros: spent.micros.saturating_add(micros),
            })
            .map_err(|e| WorkerError::Corrupt(e.to_string()))?,
            expires_ms: None,
        };
        let cond = version.map_or(Cond::Absent, Cond::Version);
        match store.put_item(&item, cond).await {
            Ok(_) => return Ok(()),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(WorkerError::Contended(MAX_TRIES))
}

/// Up to 2^min(attempt, 5) ms, at random, so that racing writers spread out instead of colliding again.
async fn pause(attempt: u32) {
    let mut byte = [0u8; 1];
    // Without randomness the pause is simply the longest one.
    let fraction = match aws_lc_rs::rand::fill(&mut byte) {
        Ok(()) => u64::from(byte[0]),
        Err(_) => 255,
    };
    let most_us = 1_000u64 << attempt.min(5);
    tokio::time::sleep(std::time::Duration::from_micros(most_us * fraction / 255)).await;
}

async fn read(store: &dyn Store, org: &str, id: &str) -> Result<(Spent, Option<u64>), WorkerError> {
    match store.get_item(org, KIND, id).await? {
        None => Ok((Spent::default(), None)),
        Some(item) => {
            let spent = serde_json::from_slice(&item.body)
                .map_err(|e| WorkerError::Corrupt(format!("{KIND} {id}: {e}")))?;
            Ok((spent, Some(item.version)))
        }
    }
}

/// `model:YYYY-MM` of the UTC month that `ms` (since the Unix epoch) falls in.
fn record_id(ms: i64) -> String {
    let (year, month) = year_month(ms.div_euclid(86_400_000));
    format!("model:{year:04}-{month:02}")
}

/// The civil (proleptic Gregorian) year and month of a day count since 1970-01-01, by the standard era
/// (400-year cycle) decomposition.
fn year_month(days: i64) -> (i64, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, u32::try_from(month).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use loams_platform::{ManualClock, Sqlite};

    #[test]
    fn months_are_utc_calendar_months() {
        // 1970-01-01, the last millisecond of 2024-02-29, the first of 2024-03-01, 2026-11-30, 1969-12-31.
        assert_eq!(record_id(0), "model:1970-01");
        assert_eq!(record_id(1_709_251_199_999), "model:2024-02");
        assert_eq!(record_id(1_709_251_200_000), "model:2024-03");
        assert_eq!(record_id(1_764_460_800_000), "model:2025-11");
        assert_eq!(record_id(1_796_083_200_000), "model:2026-12");
        assert_eq!(record_id(-1), "model:1969-12");
    }

    #[tokio::test]
    async fn concurrent_additions_all_count_and_a_new_month_starts_at_zero() {
        let now = 1_764_460_800_000;
        let db = Arc::new(Sqlite::memory(Arc::new(ManualClock::new(now))).unwrap());
        let adds = (0..20).map(|_| {
            let db = db.clone();
            tokio::spawn(async move { add(db.as_ref(), "acme", now, 250).await })
        });
        for done in futures::future::join_all(adds).await {
            done.unwrap().unwrap();
        }
        assert_eq!(this_month(db.as_ref(), "acme", now).await.unwrap(), 5_000);
        assert_eq!(this_month(db.as_ref(), "other", now).await.unwrap(), 0);
        let next_month = now + 31 * 86_400_000;
        assert_eq!(
            this_month(db.as_ref(), "acme", next_month).await.unwrap(),
            0
        );
    }
}
