//! `Store` and `Timers` on one DynamoDB table.
//!
//! Keys (`<org>` never contains `#`, so every prefix below is unambiguous; `<ord t>` is a millisecond time as
//! 20 digits that sort like the signed number):
//!
//! | record | pk | sk | gsi1pk / gsi1sk |
//! |---|---|---|---|
//! | run row | `<org>#RUN#<id>` | `META` | `<org>#RUNSTATE#<state>` / `<ord created>#<id>` |
//! | run event | `<org>#RUN#<id>` | `EVT#<seq:020>` | – |
//! | run listing entry | `<org>#RUNS` | `<ord created>#<id>` | – |
//! | item | `<org>#ITEM#<kind>` | `<id>` | `<org>#IDX#<kind>#<index>` / `<id>` (only with an index) |
//! | idempotency record | `<org>#IDEM#<key>` | `IDEM` | – |
//! | timer | `<org>#TIMER#<id>` | `TIMER` | `TIMERS` / `<ord due>#<org>#<id>` |
//!
//! A run, its events and its version live in one partition, so an append is one `TransactWriteItems`: the
//! conditional version bump of the run row plus one conditional put per event. The listing entry exists
//! because "all runs of an org, newest first" needs one collection; it is written once, with the run.
//!
//! Binary attributes (snapshots, bodies, results, payloads) are stored tagged and, when that is smaller, deflated
//! (`blob.rs`): writes are billed by the item's size.
//!
//! The index is KEYS_ONLY: a listing through it queries keys, then reads the records themselves with a
//! strongly consistent `BatchGetItem` and re-checks them, because the index lags the table (a settled approval
//! or a cancelled timer may still be listed for a moment; the re-check drops it).
//!
//! Time: DynamoDB never decides what is expired here. Item expiry and timer due times are compared with the
//! adapter's `Clock` (items) or the caller's `now_ms` (timers, idempotency leases), because TTL deletion is
//! lazy (up to days on AWS, never on moto); `expires_at` (epoch seconds, rounded up) only lets DynamoDB
//! collect what is already invisible.
//!
//! Hot keys: `<org>#RUNS`, `<org>#ITEM#<kind>` and the global `TIMERS` index key each take all writes of their
//! kind. That is far below a partition's 1,000 writes per second at this product's rates; shard with a suffix
//! if it ever is not.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, KeysAndAttributes, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
    Update,
};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::{TTL_ATTRIBUTE, blob, build_err, sdk_err};
use crate::limits::{self, MAX_BODY, MAX_LEASE_MS, MAX_PAGE};
use crate::{
    Claim, Clock, Cond, EventRow, Item, Page, Paged, Result, RunRow, Store, StoreError, Timer,
    Timers,
};

type Attrs = HashMap<String, AttributeValue>;
/// Maps a listing row to the key of the record it stands for.
type Lookup<'a> = &'a (dyn Fn(&Attrs) -> Result<Attrs> + Send + Sync);
/// Decides whether a record belongs in the listing.
type Keep<'a> = &'a (dyn Fn(&Attrs) -> Result<bool> + Send + Sync);

const META: &str = "META";
const IDEM: &str = "IDEM";
const TIMER: &str = "TIMER";
const TIMERS: &str = "TIMERS";

const PK: &str = "pk";
const SK: &str = "sk";
const GPK: &str = "gsi1pk";
const GSK: &str = "gsi1sk";
const VERSION: &str = "version";
const STATE: &str = "state";
const SNAPSHOT: &str = "snapshot";
const UPDATED: &str = "updated_ms";
const BODY: &str = "body";
const INDEX: &str = "idx";
const EXPIRES: &str = "expires_ms";
const STATUS: &str = "status";
const LEASE: &str = "lease_until_ms";
const RESULT: &str = "result";
const DUE: &str = "due_ms";
const PAYLOAD: &str = "payload";
const ORG: &str = "org";
const ID: &str = "id";

const IN_PROGRESS: &str = "INPROGRESS";
const COMPLETED: &str = "COMPLETED";

/// Attempts of a transaction cancelled by a conflicting concurrent transaction or throttling (the SDK does
/// not retry `TransactionCanceledException`: only some of its causes are transient).
const TX_ATTEMPTS: u32 = 5;
/// Attempts to read back the keys a `BatchGetItem` left unprocessed (throttling).
const BATCH_ATTEMPTS: u32 = 8;
/// Attempts of a `Cond::Any` put racing with other writers of the same item.
const ANY_ATTEMPTS: u32 = 8;
/// `BatchGetItem` takes at most 100 keys.
const BATCH_GET_MAX: usize = 100;

/// `Store` and `Timers` on a DynamoDB table made by [`super::provision_table`].
#[derive(Clone)]
pub struct DynamoStore {
    client: Client,
    table: String,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for DynamoStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl DynamoStore {
    /// `clock` decides item expiry (the port's rule: an item is invisible from its `expires_ms` on).
    pub fn new(client: Client, table: impl Into<String>, clock: Arc<dyn Clock>) -> Self {
        Self {
            client,
            table: table.into(),
            clock,
        }
    }

    async fn get(&self, pk: String, sk: &str) -> Result<Option<Attrs>> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(PK, s(pk))
            .key(SK, s(sk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| sdk_err("GetItem", e))?;
        Ok(out.item)
    }

    /// Runs a transaction, retrying transient cancellations: `Ok(true)` when it committed, `Ok(false)` when a
    /// condition failed.
    async fn transact(&self, items: Vec<TransactWriteItem>) -> Result<bool> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let sent = self
                .client
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .send()
                .await;
            let err = match sent {
                Ok(_) => return Ok(true),
                Err(e) => e,
            };
            let Some(TransactWriteItemsError::TransactionCanceledException(c)) =
                err.as_service_error()
            else {
                return Err(sdk_err("TransactWriteItems", err));
            };
            let codes: Vec<String> = c
                .cancellation_reasons()
                .iter()
                .map(|r| r.code().unwrap_or("None").to_owned())
                .collect();
            match cancelled(&codes) {
                Cancelled::ConditionFailed => return Ok(false),
                Cancelled::Transient if attempt < TX_ATTEMPTS => {
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Cancelled::Transient | Cancelled::Failed => {
                    return Err(StoreError::Backend(format!(
                        "dynamodb TransactWriteItems cancelled after {attempt} attempt(s): {codes:?}"
                    )));
                }
            }
        }
    }

    /// Strongly consistent reads of `keys`, in their order (`None` where the record is gone).
    async fn batch_get(&self, keys: Vec<Attrs>) -> Result<Vec<Option<Attrs>>> {
        let mut found: HashMap<(String, String), Attrs> = HashMap::new();
        for chunk in keys.chunks(BATCH_GET_MAX) {
            let mut pending = chunk.to_vec();
            let mut attempt = 0;
            while !pending.is_empty() {
                attempt += 1;
                if attempt > BATCH_ATTEMPTS {
                    return Err(StoreError::Backend(format!(
                        "dynamodb BatchGetItem left {} keys unprocessed after {BATCH_ATTEMPTS} attempts",
                        pending.len()
                    )));
                }
                if attempt > 1 {
                    tokio::time::sleep(backoff(attempt - 1)).await;
                }
                let req = KeysAndAttributes::builder()
                    .set_keys(Some(pending))
                    .consistent_read(true)
                    .build()
                    .map_err(build_err)?;
                let out = self
                    .client
                    .batch_get_item()
                    .request_items(&self.table, req)
                    .send()
                    .await
                    .map_err(|e| sdk_err("BatchGetItem", e))?;
                if let Some(rows) = out.responses.and_then(|mut r| r.remove(&self.table)) {
                    for row in rows {
                        let key = (get_s(&row, PK)?.to_owned(), get_s(&row, SK)?.to_owned());
                        found.insert(key, row);
                    }
                }
                pending = out
                    .unprocessed_keys
                    .and_then(|mut u| u.remove(&self.table))
                    .map(|k| k.keys)
                    .unwrap_or_default();
            }
        }
        keys.iter()
            .map(|k| {
                let key = (get_s(k, PK)?.to_owned(), get_s(k, SK)?.to_owned());
                Ok(found.remove(&key))
            })
            .collect()
    }

    /// A page of (org, kind)'s items from `q`, a query of the table itself (so its rows are the records),
    /// after the item `after`.
    async fn table_items_page(
        &self,
        org: &str,
        kind: &str,
        q: Listing,
        after: Option<String>,
        limit: usize,
    ) -> Result<Paged<Item>> {
        let start = after.map(|c| key(item_pk(org, kind), c));
        let keep = |rec: &Attrs| self.visible(rec);
        let rows = self.collect(&q, start, limit + 1, None, &keep).await?;
        page_of(rows, limit, ITEM_CURSOR, SK, |_, rec| {
            item_of(org, kind, rec)
        })
    }

    /// Pages through `q` from `start` and returns up to `want` (listing row, record) pairs whose record
    /// passes `keep`. With `lookup`, the record is read with `BatchGetItem` at the key `lookup` gives for
    /// the row (index and listing queries); without, the row is the record.
    async fn collect(
        &self,
        q: &Listing,
        mut start: Option<Attrs>,
        want: usize,
        lookup: Option<Lookup<'_>>,
        keep: Keep<'_>,
    ) -> Result<Vec<(Attrs, Attrs)>> {
        let mut out = Vec::new();
        while out.len() < want {
            // want <= MAX_PAGE + 1, far below i32::MAX.
            let limit = i32::try_from(want - out.len()).unwrap_or(i32::MAX);
            let resp = self
                .client
                .query()
                .table_name(&self.table)
                .set_index_name(q.index.map(str::to_owned))
                .key_condition_expression(&q.key_cond)
                .set_expression_attribute_names(Some(q.names.clone()))
                .set_expression_attribute_values(Some(q.values.clone()))
                .scan_index_forward(q.forward)
                .consistent_read(q.index.is_none())
                .limit(limit)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| sdk_err("Query", e))?;
            let rows = resp.items.unwrap_or_default();
            let records = match lookup {
                Some(f) => {
                    let keys = rows.iter().map(f).collect::<Result<Vec<_>>>()?;
                    self.batch_get(keys).await?
                }
                None => rows.iter().cloned().map(Some).collect(),
            };
            for (row, record) in rows.into_iter().zip(records) {
                if let Some(record) = record
                    && keep(&record)?
                    && out.len() < want
                {
                    out.push((row, record));
                }
            }
            match resp.last_evaluated_key {
                Some(k) if !k.is_empty() => start = Some(k),
                _ => break,
            }
        }
        Ok(out)
    }

    fn visible(&self, record: &Attrs) -> Result<bool> {
        Ok(opt_n::<i64>(record, EXPIRES)?.is_none_or(|e| e > self.clock.now_ms()))
    }

    /// `put_item` with `Cond::Any`. DynamoDB cannot express "version + 1, or 1 if absent or expired" in one
    /// write, so this reads the current version and writes conditionally on it; a concurrent writer in between
    /// makes it read again.
    async fn put_item_any(&self, item: &Item) -> Result<u64> {
        for _ in 0..ANY_ATTEMPTS {
            let now = self.clock.now_ms();
            let current = match self.get(item_pk(&item.org, &item.kind), &item.id).await? {
                Some(a) if self.visible(&a)? => Some(get_n(&a, VERSION)?),
                _ => None,
            };
            match self.put_item_once(item, current, now).await {
                Err(StoreError::Conflict) => continue,
                other => return other,
            }
        }
        Err(StoreError::Backend(format!(
            "put_item(Any) lost {ANY_ATTEMPTS} races with concurrent writers"
        )))
    }

    /// One conditional write of `item`: only if it is absent or expired (`expected` `None`), or unexpired at
    /// version `expected`; `Conflict` otherwise.
    async fn put_item_once(&self, item: &Item, expected: Option<u64>, now: i64) -> Result<u64> {
        // DynamoDB rejects names an expression does not use, hence `#pk` or `#v` by condition.
        let (version, condition, (name, attr), values) = match expected {
            None => (
                1,
                "attribute_not_exists(#pk) OR #exp <= :now",
                ("#pk", PK),
                vec![(":now", n(now))],
            ),
            Some(v) => (
                v.checked_add(1)
                    .ok_or_else(|| StoreError::Invalid("expected version overflows".into()))?,
                "#v = :v AND (attribute_not_exists(#exp) OR #exp > :now)",
                ("#v", VERSION),
                vec![(":now", n(now)), (":v", n(v))],
            ),
        };
        let mut rec: Attrs = HashMap::from([
            (PK.into(), s(item_pk(&item.org, &item.kind))),
            (SK.into(), s(&item.id)),
            (VERSION.into(), n(version)),
            (BODY.into(), b(&item.body)),
        ]);
        if let Some(idx) = &item.index {
            rec.insert(INDEX.into(), s(idx));
            rec.insert(GPK.into(), s(idx_pk(&item.org, &item.kind, idx)));
            rec.insert(GSK.into(), s(&item.id));
        }
        if let Some(exp) = item.expires_ms {
            rec.insert(EXPIRES.into(), n(exp));
            rec.insert(TTL_ATTRIBUTE.into(), n(ttl_seconds(exp)));
        }
        let mut req = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(rec))
            .condition_expression(condition)
            .expression_attribute_names("#exp", EXPIRES)
            .expression_attribute_names(name, attr);
        for (k, v) in values {
            req = req.expression_attribute_values(k, v);
        }
        match req.send().await {
            Ok(_) => Ok(version),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => {
                Err(StoreError::Conflict)
            }
            Err(e) => Err(sdk_err("PutItem", e)),
        }
    }
}

/// What a `TransactionCanceledException` means, from its per-item cancellation codes.
#[derive(Debug, PartialEq, Eq)]
enum Cancelled {
    /// A condition did not hold: the caller's answer (conflict, already exists, ...), never retried.
    ConditionFailed,
    /// Another transaction touched the same items, or throttling: worth another attempt.
    Transient,
    /// Anything else (validation, item collection too large): a backend error.
    Failed,
}

fn cancelled(codes: &[String]) -> Cancelled {
    // A failed condition decides even when another item was throttled: a retry would fail it again.
    if codes.iter().any(|c| c == "ConditionalCheckFailed") {
        return Cancelled::ConditionFailed;
    }
    let transient = |c: &String| {
        matches!(
            c.as_str(),
            "TransactionConflict"
                | "ThrottlingError"
                | "ProvisionedThroughputExceeded"
                | "RequestLimitExceeded"
        )
    };
    if codes.iter().any(transient) && codes.iter().all(|c| c == "None" || transient(c)) {
        Cancelled::Transient
    } else {
        Cancelled::Failed
    }
}

/// A query of the table or its index.
struct Listing {
    index: Option<&'static str>,
    key_cond: String,
    names: HashMap<String, String>,
    values: HashMap<String, AttributeValue>,
    forward: bool,
}

impl Listing {
    fn new(index: Option<&'static str>, key_cond: &str, forward: bool) -> Self {
        Self {
            index,
            key_cond: key_cond.into(),
            names: HashMap::new(),
            values: HashMap::new(),
            forward,
        }
    }

    fn name(mut self, k: &str, v: &str) -> Self {
        self.names.insert(k.into(), v.into());
        self
    }

    fn value(mut self, k: &str, v: AttributeValue) -> Self {
        self.values.insert(k.into(), v);
        self
    }
}

fn backoff(attempt: u32) -> Duration {
    // Jitter from the clock's sub-second digits keeps concurrent retriers from colliding in lock step.
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::from(d.subsec_nanos()) % 25)
        .unwrap_or(0);
    Duration::from_millis((25u64 << attempt.min(6)) + jitter)
}

// --- keys -------------------------------------------------------------------------------------------------

/// A signed millisecond time as 20 digits whose string order is the numeric order.
fn ord(t: i64) -> String {
    // Flipping the sign bit maps i64's order onto u64's.
    format!("{:020}", (t as u64) ^ (1 << 63))
}

fn run_pk(org: &str, id: &str) -> String {
    format!("{org}#RUN#{id}")
}
fn runs_pk(org: &str) -> String {
    format!("{org}#RUNS")
}
fn run_state_pk(org: &str, state: &str) -> String {
    format!("{org}#RUNSTATE#{state}")
}
fn evt_sk(seq: u64) -> String {
    format!("EVT#{seq:020}")
}
fn item_pk(org: &str, kind: &str) -> String {
    format!("{org}#ITEM#{kind}")
}
fn idx_pk(org: &str, kind: &str, index: &str) -> String {
    format!("{org}#IDX#{kind}#{index}")
}
fn idem_pk(org: &str, key: &str) -> String {
    format!("{org}#IDEM#{key}")
}
fn timer_pk(org: &str, id: &str) -> String {
    format!("{org}#TIMER#{id}")
}

fn key(pk: String, sk: impl Into<String>) -> Attrs {
    HashMap::from([(PK.into(), s(pk)), (SK.into(), s(sk))])
}

/// Epoch seconds for the TTL attribute, rounded up so DynamoDB never collects an item before it expired.
fn ttl_seconds(ms: i64) -> i64 {
    ms.div_euclid(1000) + i64::from(ms.rem_euclid(1000) != 0)
}

/// The id in a run sort key `<ord created>#<id>`.
fn run_id_of(sort_key: &str) -> Option<&str> {
    let (t, id) = sort_key.split_at_checked(20)?;
    let id = id.strip_prefix('#')?;
    (t.bytes().all(|c| c.is_ascii_digit()) && limits::key("run id", id).is_ok()).then_some(id)
}

// --- cursors ----------------------------------------------------------------------------------------------

const RUN_CURSOR: char = 'R';
const ITEM_CURSOR: char = 'I';

/// Cursors are the sort key of the last record returned, tagged by listing, base64url-encoded.
fn cursor(tag: char, sort_key: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{tag}{sort_key}"))
}

fn open_cursor(tag: char, page: &Page) -> Result<Option<String>> {
    let Some(c) = &page.cursor else {
        return Ok(None);
    };
    limits::token("cursor", c)?;
    let bad = || StoreError::Invalid("malformed cursor".into());
    let raw = URL_SAFE_NO_PAD.decode(c).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let sort_key = text.strip_prefix(tag).ok_or_else(bad)?;
    let ok = match tag {
        RUN_CURSOR => run_id_of(sort_key).is_some(),
        _ => limits::key("cursor", sort_key).is_ok(),
    };
    if ok {
        Ok(Some(sort_key.to_owned()))
    } else {
        Err(bad())
    }
}

/// Turns `limit + 1` collected rows into a page: the extra row only says that there is more.
fn page_of<T>(
    mut rows: Vec<(Attrs, Attrs)>,
    limit: usize,
    tag: char,
    sort_attr: &str,
    f: impl Fn(&Attrs, &Attrs) -> Result<T>,
) -> Result<Paged<T>> {
    let more = rows.len() > limit;
    rows.truncate(limit);
    let next = match rows.last() {
        Some((row, _)) if more => Some(cursor(tag, get_s(row, sort_attr)?)),
        _ => None,
    };
    let items = rows
        .iter()
        .map(|(row, rec)| f(row, rec))
        .collect::<Result<_>>()?;
    Ok(Paged { items, next })
}

// --- attribute values -------------------------------------------------------------------------------------

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}
fn n(v: impl std::fmt::Display) -> AttributeValue {
    AttributeValue::N(v.to_string())
}
fn b(v: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(blob::pack(v)))
}

fn corrupt(what: &str, name: &str) -> StoreError {
    StoreError::Backend(format!(
        "stored record has a missing or malformed {what} `{name}`"
    ))
}

fn get_s<'a>(a: &'a Attrs, name: &str) -> Result<&'a str> {
    match a.get(name) {
        Some(AttributeValue::S(v)) => Ok(v),
        _ => Err(corrupt("string", name)),
    }
}

fn opt_s(a: &Attrs, name: &str) -> Result<Option<String>> {
    match a.get(name) {
        None => Ok(None),
        Some(AttributeValue::S(v)) => Ok(Some(v.clone())),
        Some(_) => Err(corrupt("string", name)),
    }
}

fn opt_n<T: std::str::FromStr>(a: &Attrs, name: &str) -> Result<Option<T>> {
    match a.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(v)) => v.parse().map(Some).map_err(|_| corrupt("number", name)),
        Some(_) => Err(corrupt("number", name)),
    }
}

fn get_n<T: std::str::FromStr>(a: &Attrs, name: &str) -> Result<T> {
    opt_n(a, name)?.ok_or_else(|| corrupt("number", name))
}

fn get_b(a: &Attrs, name: &str) -> Result<Vec<u8>> {
    match a.get(name) {
        Some(AttributeValue::B(v)) => {
            blob::unpack(v.as_ref()).ok_or_else(|| corrupt("binary", name))
        }
        _ => Err(corrupt("binary", name)),
    }
}

fn run_row(org: &str, id: &str, a: &Attrs) -> Result<RunRow> {
    Ok(RunRow {
        org: org.into(),
        id: id.into(),
        version: get_n(a, VERSION)?,
        state: get_s(a, STATE)?.into(),
        snapshot: get_b(a, SNAPSHOT)?,
        updated_ms: get_n(a, UPDATED)?,
    })
}

fn item_of(org: &str, kind: &str, a: &Attrs) -> Result<Item> {
    Ok(Item {
        org: org.into(),
        kind: kind.into(),
        id: get_s(a, SK)?.into(),
        version: get_n(a, VERSION)?,
        index: opt_s(a, INDEX)?,
        body: get_b(a, BODY)?,
        expires_ms: opt_n(a, EXPIRES)?,
    })
}

fn put(table: &str, item: Attrs, condition: &str) -> Result<TransactWriteItem> {
    let put = Put::builder()
        .table_name(table)
        .set_item(Some(item))
        .condition_expression(condition)
        .expression_attribute_names("#pk", PK)
        .build()
        .map_err(build_err)?;
    Ok(TransactWriteItem::builder().put(put).build())
}

fn check_page(page: &Page) -> Result<usize> {
    Ok(limits::count("page limit", page.limit, MAX_PAGE)? as usize)
}

// --- Store ------------------------------------------------------------------------------------------------

#[async_trait]
impl Store for DynamoStore {
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
        let listed = format!("{}#{id}", ord(now_ms));
        let meta = HashMap::from([
            (PK.into(), s(run_pk(org, id))),
            (SK.into(), s(META)),
            (VERSION.into(), n(1)),
            (STATE.into(), s(state)),
            (SNAPSHOT.into(), b(snapshot)),
            (UPDATED.into(), n(now_ms)),
            (GPK.into(), s(run_state_pk(org, state))),
            (GSK.into(), s(&listed)),
        ]);
        let event = HashMap::from([
            (PK.into(), s(run_pk(org, id))),
            (SK.into(), s(evt_sk(1))),
            (BODY.into(), b(first_event)),
        ]);
        let entry = HashMap::from([(PK.into(), s(runs_pk(org))), (SK.into(), s(listed))]);
        let absent = "attribute_not_exists(#pk)";
        let tx = vec![
            put(&self.table, meta, absent)?,
            put(&self.table, event, absent)?,
            put(&self.table, entry, absent)?,
        ];
        // A failed condition can only be the run row or its first event: the run exists, and stays as is.
        self.transact(tx).await
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
        // At most 99 events, so this only overflows for an expected version near u64::MAX.
        let new_version = expected_version
            .checked_add(events.len() as u64)
            .ok_or_else(|| StoreError::Invalid("expected version overflows".into()))?;
        let pk = run_pk(org, id);
        let bump = Update::builder()
            .table_name(&self.table)
            .key(PK, s(&pk))
            .key(SK, s(META))
            .update_expression("SET #v = :new, #st = :st, #snap = :snap, #upd = :now, #gpk = :gpk")
            .condition_expression("attribute_exists(#pk) AND #v = :expected")
            .expression_attribute_names("#pk", PK)
            .expression_attribute_names("#v", VERSION)
            .expression_attribute_names("#st", STATE)
            .expression_attribute_names("#snap", SNAPSHOT)
            .expression_attribute_names("#upd", UPDATED)
            .expression_attribute_names("#gpk", GPK)
            .expression_attribute_values(":new", n(new_version))
            .expression_attribute_values(":expected", n(expected_version))
            .expression_attribute_values(":st", s(state))
            .expression_attribute_values(":snap", b(snapshot))
            .expression_attribute_values(":now", n(now_ms))
            .expression_attribute_values(":gpk", s(run_state_pk(org, state)))
            .build()
            .map_err(build_err)?;
        let mut tx = vec![TransactWriteItem::builder().update(bump).build()];
        for (i, e) in events.iter().enumerate() {
            let event = HashMap::from([
                (PK.into(), s(&pk)),
                (SK.into(), s(evt_sk(expected_version + 1 + i as u64))),
                (BODY.into(), b(e)),
            ]);
            tx.push(put(&self.table, event, "attribute_not_exists(#pk)")?);
        }
        if self.transact(tx).await? {
            return Ok(new_version);
        }
        // The version check failed: tell a missing run from a stale version.
        match self.get(pk, META).await? {
            None => Err(StoreError::NotFound),
            Some(_) => Err(StoreError::Conflict),
        }
    }

    async fn get_run(&self, org: &str, id: &str) -> Result<Option<RunRow>> {
        limits::org(org)?;
        limits::key("run id", id)?;
        self.get(run_pk(org, id), META)
            .await?
            .map(|a| run_row(org, id, &a))
            .transpose()
    }

    async fn list_runs(&self, org: &str, state: Option<&str>, page: Page) -> Result<Paged<RunRow>> {
        limits::org(org)?;
        if let Some(st) = state {
            limits::name("state", st)?;
        }
        let limit = check_page(&page)?;
        let after = open_cursor(RUN_CURSOR, &page)?;
        let id_of = |row: &Attrs, attr: &str| -> Result<String> {
            let sort_key = get_s(row, attr)?;
            run_id_of(sort_key)
                .map(str::to_owned)
                .ok_or_else(|| corrupt("run sort key", attr))
        };
        match state {
            None => {
                let q = Listing::new(None, "#pk = :pk", false)
                    .name("#pk", PK)
                    .value(":pk", s(runs_pk(org)));
                let start = after.map(|c| key(runs_pk(org), c));
                let lookup = |row: &Attrs| Ok(key(run_pk(org, &id_of(row, SK)?), META));
                let rows = self
                    .collect(&q, start, limit + 1, Some(&lookup), &|_| Ok(true))
                    .await?;
                page_of(rows, limit, RUN_CURSOR, SK, |row, rec| {
                    run_row(org, &id_of(row, SK)?, rec)
                })
            }
            Some(st) => {
                let gpk = run_state_pk(org, st);
                let q = Listing::new(Some(super::GSI1), "#g = :g", false)
                    .name("#g", GPK)
                    .value(":g", s(&gpk));
                let start = match after {
                    Some(c) => {
                        let id = run_id_of(&c).unwrap_or_default().to_owned();
                        let mut k = key(run_pk(org, &id), META);
                        k.insert(GPK.into(), s(&gpk));
                        k.insert(GSK.into(), s(c));
                        Some(k)
                    }
                    None => None,
                };
                let lookup = |row: &Attrs| Ok(key(get_s(row, PK)?.to_owned(), META));
                // The index lags: keep only runs that really are in this state now.
                let keep = |rec: &Attrs| Ok(get_s(rec, STATE)? == st);
                let rows = self
                    .collect(&q, start, limit + 1, Some(&lookup), &keep)
                    .await?;
                page_of(rows, limit, RUN_CURSOR, GSK, |row, rec| {
                    run_row(org, &id_of(row, GSK)?, rec)
                })
            }
        }
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
        let limit = limits::count("event limit", limit, MAX_PAGE)? as usize;
        let Some(first) = after_seq.checked_add(1) else {
            return Ok(Vec::new());
        };
        let q = Listing::new(None, "#pk = :pk AND #sk BETWEEN :lo AND :hi", true)
            .name("#pk", PK)
            .name("#sk", SK)
            .value(":pk", s(run_pk(org, id)))
            .value(":lo", s(evt_sk(first)))
            .value(":hi", s(evt_sk(u64::MAX)));
        let rows = self.collect(&q, None, limit, None, &|_| Ok(true)).await?;
        rows.iter()
            .map(|(row, _)| {
                let sk = get_s(row, SK)?;
                let seq = sk
                    .strip_prefix("EVT#")
                    .and_then(|d| d.parse().ok())
                    .ok_or_else(|| corrupt("event sort key", SK))?;
                Ok(EventRow {
                    seq,
                    body: get_b(row, BODY)?,
                })
            })
            .collect()
    }

    async fn get_item(&self, org: &str, kind: &str, id: &str) -> Result<Option<Item>> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        limits::key("item id", id)?;
        match self.get(item_pk(org, kind), id).await? {
            Some(a) if self.visible(&a)? => Ok(Some(item_of(org, kind, &a)?)),
            _ => Ok(None),
        }
    }

    async fn put_item(&self, item: &Item, cond: Cond) -> Result<u64> {
        limits::item(item)?;
        let expected = match cond {
            Cond::Absent => None,
            Cond::Version(v) => Some(v),
            Cond::Any => return self.put_item_any(item).await,
        };
        self.put_item_once(item, expected, self.clock.now_ms())
            .await
    }

    async fn delete_item(&self, org: &str, kind: &str, id: &str) -> Result<()> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        limits::key("item id", id)?;
        self.client
            .delete_item()
            .table_name(&self.table)
            .set_key(Some(key(item_pk(org, kind), id)))
            .send()
            .await
            .map_err(|e| sdk_err("DeleteItem", e))?;
        Ok(())
    }

    async fn list_items(
        &self,
        org: &str,
        kind: &str,
        index: Option<&str>,
        page: Page,
    ) -> Result<Paged<Item>> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        if let Some(idx) = index {
            limits::key("index", idx)?;
        }
        let limit = check_page(&page)?;
        let after = open_cursor(ITEM_CURSOR, &page)?;
        let pk = item_pk(org, kind);
        match index {
            None => {
                let q = Listing::new(None, "#pk = :pk", true)
                    .name("#pk", PK)
                    .value(":pk", s(&pk));
                self.table_items_page(org, kind, q, after, limit).await
            }
            Some(idx) => {
                let gpk = idx_pk(org, kind, idx);
                let q = Listing::new(Some(super::GSI1), "#g = :g", true)
                    .name("#g", GPK)
                    .value(":g", s(&gpk));
                let start = after.map(|c| {
                    let mut k = key(pk.clone(), c.clone());
                    k.insert(GPK.into(), s(&gpk));
                    k.insert(GSK.into(), s(c));
                    k
                });
                let lookup = |row: &Attrs| Ok(key(pk.clone(), get_s(row, SK)?));
                // The index lags: keep only unexpired items that still carry this index value.
                let keep = |rec: &Attrs| {
                    Ok(self.visible(rec)? && opt_s(rec, INDEX)?.as_deref() == Some(idx))
                };
                let rows = self
                    .collect(&q, start, limit + 1, Some(&lookup), &keep)
                    .await?;
                page_of(rows, limit, ITEM_CURSOR, GSK, |_, rec| {
                    item_of(org, kind, rec)
                })
            }
        }
    }

    async fn list_items_with_prefix(
        &self,
        org: &str,
        kind: &str,
        prefix: &str,
        page: Page,
    ) -> Result<Paged<Item>> {
        limits::org(org)?;
        limits::name("kind", kind)?;
        limits::key("prefix", prefix)?;
        let limit = check_page(&page)?;
        let after = open_cursor(ITEM_CURSOR, &page)?;
        let q = Listing::new(None, "#pk = :pk AND begins_with(#sk, :prefix)", true)
            .name("#pk", PK)
            .name("#sk", SK)
            .value(":pk", s(item_pk(org, kind)))
            .value(":prefix", s(prefix));
        self.table_items_page(org, kind, q, after, limit).await
    }

    async fn claim(&self, org: &str, key_: &str, now_ms: i64, lease_ms: u64) -> Result<Claim> {
        limits::org(org)?;
        limits::key("idempotency key", key_)?;
        let lease = limits::duration("lease", lease_ms, MAX_LEASE_MS)?;
        let lease_until = now_ms.saturating_add(lease);
        // Powertools-style claim: take the key if nobody has it, or if its holder's lease ran out. The TTL
        // only collects abandoned claims, which are as good as absent once their lease ended.
        let rec = HashMap::from([
            (PK.into(), s(idem_pk(org, key_))),
            (SK.into(), s(IDEM)),
            (STATUS.into(), s(IN_PROGRESS)),
            (LEASE.into(), n(lease_until)),
            (UPDATED.into(), n(now_ms)),
            (TTL_ATTRIBUTE.into(), n(ttl_seconds(lease_until))),
        ]);
        let sent = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(rec))
            .condition_expression(
                "attribute_not_exists(#pk) OR (#status = :inprogress AND #lease <= :now)",
            )
            .expression_attribute_names("#pk", PK)
            .expression_attribute_names("#status", STATUS)
            .expression_attribute_names("#lease", LEASE)
            .expression_attribute_values(":inprogress", s(IN_PROGRESS))
            .expression_attribute_values(":now", n(now_ms))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let old = match sent {
            Ok(_) => return Ok(Claim::New),
            Err(e) => match e.as_service_error() {
                Some(PutItemError::ConditionalCheckFailedException(c)) => c.item.clone(),
                _ => return Err(sdk_err("PutItem", e)),
            },
        };
        // Without the old image (an emulator may omit it), read the record that blocked us.
        let old = match old {
            Some(a) => Some(a),
            None => self.get(idem_pk(org, key_), IDEM).await?,
        };
        match old {
            Some(a) if get_s(&a, STATUS)? == COMPLETED => Ok(Claim::Done(get_b(&a, RESULT)?)),
            // In progress under a live lease, or deleted by a release just now: either way someone else
            // was first, and the caller retries later.
            _ => Ok(Claim::InProgress),
        }
    }

    async fn finish(&self, org: &str, key_: &str, result: &[u8], now_ms: i64) -> Result<()> {
        limits::org(org)?;
        limits::key("idempotency key", key_)?;
        limits::body("idempotency result", result, MAX_BODY)?;
        let sent = self
            .client
            .update_item()
            .table_name(&self.table)
            .set_key(Some(key(idem_pk(org, key_), IDEM)))
            .update_expression(
                "SET #status = :completed, #result = :r, #upd = :now REMOVE #lease, #ttl",
            )
            // The first recorded result wins: others may already have seen it.
            .condition_expression("attribute_not_exists(#pk) OR #status <> :completed")
            .expression_attribute_names("#pk", PK)
            .expression_attribute_names("#status", STATUS)
            .expression_attribute_names("#result", RESULT)
            .expression_attribute_names("#upd", UPDATED)
            .expression_attribute_names("#lease", LEASE)
            .expression_attribute_names("#ttl", TTL_ATTRIBUTE)
            .expression_attribute_values(":completed", s(COMPLETED))
            .expression_attribute_values(":r", b(result))
            .expression_attribute_values(":now", n(now_ms))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(()),
            Err(e) => Err(sdk_err("UpdateItem", e)),
        }
    }

    async fn release(&self, org: &str, key_: &str) -> Result<()> {
        limits::org(org)?;
        limits::key("idempotency key", key_)?;
        let sent = self
            .client
            .delete_item()
            .table_name(&self.table)
            .set_key(Some(key(idem_pk(org, key_), IDEM)))
            // A finished key stays finished; an unknown key fails the condition and is not an error.
            .condition_expression("#status = :inprogress")
            .expression_attribute_names("#status", STATUS)
            .expression_attribute_values(":inprogress", s(IN_PROGRESS))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(()),
            Err(e) => Err(sdk_err("DeleteItem", e)),
        }
    }
}

// --- Timers -----------------------------------------------------------------------------------------------

#[async_trait]
impl Timers for DynamoStore {
    async fn schedule(&self, org: &str, id: &str, due_ms: i64, payload: &[u8]) -> Result<()> {
        limits::org(org)?;
        limits::key("timer id", id)?;
        limits::body("timer payload", payload, MAX_BODY)?;
        let rec = HashMap::from([
            (PK.into(), s(timer_pk(org, id))),
            (SK.into(), s(TIMER)),
            (GPK.into(), s(TIMERS)),
            (GSK.into(), s(format!("{}#{org}#{id}", ord(due_ms)))),
            (ORG.into(), s(org)),
            (ID.into(), s(id)),
            (DUE.into(), n(due_ms)),
            (PAYLOAD.into(), b(payload)),
        ]);
        self.client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(rec))
            .send()
            .await
            .map_err(|e| sdk_err("PutItem", e))?;
        Ok(())
    }

    async fn cancel(&self, org: &str, id: &str) -> Result<()> {
        limits::org(org)?;
        limits::key("timer id", id)?;
        self.client
            .delete_item()
            .table_name(&self.table)
            .set_key(Some(key(timer_pk(org, id), TIMER)))
            .send()
            .await
            .map_err(|e| sdk_err("DeleteItem", e))?;
        Ok(())
    }

    async fn due(&self, now_ms: i64, limit: u32) -> Result<Vec<Timer>> {
        let limit = limits::count("timer limit", limit, MAX_PAGE)? as usize;
        // Index sort keys are `<ord due>#<org>#<id>`; `$` sorts right after `#`, so `< <ord now>$` takes every
        // timer due at or before now, ordered by due time, then org, then id.
        let q = Listing::new(Some(super::GSI1), "#g = :g AND #s < :ub", true)
            .name("#g", GPK)
            .name("#s", GSK)
            .value(":g", s(TIMERS))
            .value(":ub", s(format!("{}$", ord(now_ms))));
        let lookup = |row: &Attrs| Ok(key(get_s(row, PK)?.to_owned(), TIMER));
        // The index lags: a rescheduled timer must be due by its current time.
        let keep = |rec: &Attrs| Ok(get_n::<i64>(rec, DUE)? <= now_ms);
        let rows = self.collect(&q, None, limit, Some(&lookup), &keep).await?;
        let mut timers = rows
            .iter()
            .map(|(_, rec)| {
                Ok(Timer {
                    org: get_s(rec, ORG)?.into(),
                    id: get_s(rec, ID)?.into(),
                    due_ms: get_n(rec, DUE)?,
                    payload: get_b(rec, PAYLOAD)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        timers.sort_by(|a, b| (a.due_ms, &a.org, &a.id).cmp(&(b.due_ms, &b.org, &b.id)));
        Ok(timers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ord_sorts_like_the_signed_number() {
        let times = [i64::MIN, -1_000, -1, 0, 1, 999, 1_700_000_000_000, i64::MAX];
        let keys: Vec<String> = times.iter().map(|t| ord(*t)).collect();
        assert!(keys.iter().all(|k| k.len() == 20));
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(2_000), 2);
        assert_eq!(ttl_seconds(2_001), 3);
        assert_eq!(ttl_seconds(-1), 0);
    }

    #[test]
    fn run_cursors_round_trip_and_reject_garbage() {
        let sort_key = format!("{}#r-0123", ord(42));
        let page = Page {
            cursor: Some(cursor(RUN_CURSOR, &sort_key)),
            limit: 1,
        };
        assert_eq!(open_cursor(RUN_CURSOR, &page), Ok(Some(sort_key.clone())));
        // An item cursor is not a run cursor, nor is text that is not base64 or lacks the time.
        for bad in [
            cursor(ITEM_CURSOR, &sort_key),
            "not a cursor".into(),
            cursor(RUN_CURSOR, "r-0123"),
        ] {
            let page = Page {
                cursor: Some(bad),
                limit: 1,
            };
            assert!(matches!(
                open_cursor(RUN_CURSOR, &page),
                Err(StoreError::Invalid(_))
            ));
        }
    }

    #[test]
    fn transaction_cancellations_are_classified() {
        let c =
            |codes: &[&str]| cancelled(&codes.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>());
        assert_eq!(
            c(&["ConditionalCheckFailed", "None"]),
            Cancelled::ConditionFailed
        );
        assert_eq!(
            c(&["ThrottlingError", "ConditionalCheckFailed"]),
            Cancelled::ConditionFailed
        );
        assert_eq!(c(&["None", "TransactionConflict"]), Cancelled::Transient);
        assert_eq!(
            c(&["ProvisionedThroughputExceeded", "ThrottlingError"]),
            Cancelled::Transient
        );
        assert_eq!(
            c(&["ValidationError", "ThrottlingError"]),
            Cancelled::Failed
        );
        assert_eq!(c(&["ItemCollectionSizeLimitExceeded"]), Cancelled::Failed);
        assert_eq!(c(&[]), Cancelled::Failed);
    }

    #[test]
    fn run_ids_come_out_of_sort_keys() {
        assert_eq!(run_id_of(&format!("{}#r-1#x", ord(5))), Some("r-1#x"));
        assert_eq!(run_id_of("00000000000000000005r-1"), None);
        assert_eq!(run_id_of(&format!("{}#", ord(5))), None);
    }
}
