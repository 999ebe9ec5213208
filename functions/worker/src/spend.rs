//! The organisation's model spend per calendar month (UTC), money and tokens, kept in the store so that every
//! worker process counts against the same monthly limits (`Config::org_budget_micros`, `org_budget_tokens`).
//!
//! A month is counted in `SHARDS` records (`model:YYYY-MM:<n>`, indexed by `model:YYYY-MM`) and each answer is
//! added to one of them at random: with one record, a hundred runs answering at once lost most of their
//! conditional writes to each other (20 conflicts per run in the engine benchmark). Reading sums them in one query.

use loams_factory::{Outcome, Prices};
use loams_platform::backoff::{jittered, random_u64};
use loams_platform::calendar::{DAY_MS, civil_from_days};
use loams_platform::{Cond, Item, Page, Store, StoreError};
use serde::{Deserialize, Serialize};

use crate::WorkerError;

const KIND: &str = "spend";
/// Concurrent model answers of one organisation may pick the same shard; a lost race picks one again after a
/// short random pause; past this many lost races in a row the caller hears `Contended`.
const MAX_TRIES: u32 = 32;
const SHARDS: u8 = 8;

/// One month's spend of one organisation.
#[derive(Serialize, Deserialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spent {
    pub micros: u64,
    pub tokens: u64,
}

impl Spent {
    /// What a model call's outcome cost: an answer's tokens at `prices`, usable or not; nothing for a failed call.
    pub(crate) fn of(outcome: &Outcome, prices: &Prices) -> Spent {
        outcome
            .model_tokens()
            .map_or_else(Spent::default, |(input, output)| Spent {
                micros: prices.cost_micros(input, output),
                tokens: input.saturating_add(output),
            })
    }
}

/// What the organisation has spent on models in the month of `now_ms`.
pub(crate) async fn this_month(
    store: &dyn Store,
    org: &str,
    now_ms: i64,
) -> Result<Spent, WorkerError> {
    let page = Page::first(u32::from(SHARDS) + 1);
    let shards = store
        .list_items(org, KIND, Some(&month(now_ms)), page)
        .await?;
    let mut total = Spent::default();
    for item in &shards.items {
        let spent: Spent = decode(item)?;
        total.micros = total.micros.saturating_add(spent.micros);
        total.tokens = total.tokens.saturating_add(spent.tokens);
    }
    Ok(total)
}

/// Adds one paid answer to the month of `now_ms`.
pub(crate) async fn add(
    store: &dyn Store,
    org: &str,
    now_ms: i64,
    paid: Spent,
) -> Result<(), WorkerError> {
    if paid == Spent::default() {
        return Ok(());
    }
    let month = month(now_ms);
    for attempt in 0..MAX_TRIES {
        if attempt > 0 {
            pause(attempt).await;
        }
        let id = format!("{month}:{}", random_u64() % u64::from(SHARDS));
        let (spent, version) = match store.get_item(org, KIND, &id).await? {
            None => (Spent::default(), None),
            Some(item) => (decode(&item)?, Some(item.version)),
        };
        let total = Spent {
            micros: spent.micros.saturating_add(paid.micros),
            tokens: spent.tokens.saturating_add(paid.tokens),
        };
        let item = Item {
            org: org.into(),
            kind: KIND.into(),
            id,
            version: 0,
            index: Some(month.clone()),
            body: serde_json::to_vec(&total).map_err(|e| WorkerError::Corrupt(e.to_string()))?,
            expires_ms: None,
        };
        match store
            .put_item(&item, version.map_or(Cond::Absent, Cond::Version))
            .await
        {
            Ok(_) => return Ok(()),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(WorkerError::Contended(MAX_TRIES))
}

/// About 2^min(attempt, 5) ms, jittered, so that racing writers spread out instead of colliding again.
async fn pause(attempt: u32) {
    let step = std::time::Duration::from_millis(1 << attempt.min(5));
    tokio::time::sleep(jittered(step)).await;
}

fn decode(item: &Item) -> Result<Spent, WorkerError> {
    serde_json::from_slice(&item.body)
        .map_err(|e| WorkerError::Corrupt(format!("{KIND} {}: {e}", item.id)))
}

/// `model:YYYY-MM` of the UTC month that `ms` (since the Unix epoch) falls in.
fn month(ms: i64) -> String {
    let (year, month, _) = civil_from_days(ms.div_euclid(DAY_MS));
    format!("model:{year:04}-{month:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use loams_platform::{ManualClock, Sqlite};

    #[test]
    fn records_are_per_utc_calendar_month() {
        // The first millisecond of 1970, the last of 2024-02-29 and the first of 2024-03-01, the last millisecond
        // of 2026-11-30 and the first of 2026-12-01, and the last of 1969.
        assert_eq!(month(0), "model:1970-01");
        assert_eq!(month(1_709_251_199_999), "model:2024-02");
        assert_eq!(month(1_709_251_200_000), "model:2024-03");
        assert_eq!(month(1_796_083_199_999), "model:2026-11");
        assert_eq!(month(1_796_083_200_000), "model:2026-12");
        assert_eq!(month(-1), "model:1969-12");
    }

    #[tokio::test]
    async fn concurrent_additions_all_count_and_a_new_month_starts_at_zero() {
        let now = 1_796_083_199_000;
        let db = Arc::new(Sqlite::memory(Arc::new(ManualClock::new(now))).unwrap());
        let paid = Spent {
            micros: 250,
            tokens: 1_000,
        };
        let adds = (0..20).map(|_| {
            let db = db.clone();
            tokio::spawn(async move { add(db.as_ref(), "acme", now, paid).await })
        });
        for done in futures::future::join_all(adds).await {
            done.unwrap().unwrap();
        }
        let expected = Spent {
            micros: 5_000,
            tokens: 20_000,
        };
        assert_eq!(
            this_month(db.as_ref(), "acme", now).await.unwrap(),
            expected
        );
        assert_eq!(
            this_month(db.as_ref(), "other", now).await.unwrap(),
            Spent::default()
        );
        assert_eq!(
            this_month(db.as_ref(), "acme", now + 1_000).await.unwrap(),
            Spent::default(),
            "December starts at zero"
        );
    }
}
