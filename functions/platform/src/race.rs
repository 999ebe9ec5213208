//! A store for tests of lost races: the first conditional write (`Cond::Version`) of one item kind finds that a
//! rival wrote the same item just before it, as another process or request would, so it meets the conflict that
//! real concurrency only sometimes produces. Every other call goes straight through.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use crate::{Claim, Cond, EventRow, Item, Page, Paged, Result, RunRow, Store};

/// What the rival writes, given the item as stored and the write about to lose.
pub type Rival = fn(stored: Item, losing: &Item) -> Item;

pub struct RaceBeforeWrite {
    inner: Arc<dyn Store>,
    kind: String,
    rival: Rival,
    armed: AtomicBool,
}

impl RaceBeforeWrite {
    /// Arms one race on the first `Cond::Version` write of an item of `kind`.
    pub fn new(inner: Arc<dyn Store>, kind: &str, rival: Rival) -> Self {
        Self {
            inner,
            kind: kind.to_string(),
            rival,
            armed: AtomicBool::new(true),
        }
    }

    /// Whether the race has been run (a test checks that its scenario reached the conditional write).
    pub fn raced(&self) -> bool {
        !self.armed.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Store for RaceBeforeWrite {
    async fn create_run(
        &self,
        org: &str,
        id: &str,
        state: &str,
        snapshot: &[u8],
        first_event: &[u8],
        now_ms: i64,
    ) -> Result<bool> {
        self.inner
            .create_run(org, id, state, snapshot, first_event, now_ms)
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
        self.inner
            .append(org, id, expected_version, state, snapshot, events, now_ms)
            .await
    }

    async fn get_run(&self, org: &str, id: &str) -> Result<Option<RunRow>> {
        self.inner.get_run(org, id).await
    }

    async fn list_runs(&self, org: &str, state: Option<&str>, page: Page) -> Result<Paged<RunRow>> {
        self.inner.list_runs(org, state, page).await
    }

    async fn events(
        &self,
        org: &str,
        id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        self.inner.events(org, id, after_seq, limit).await
    }

    async fn get_item(&self, org: &str, kind: &str, id: &str) -> Result<Option<Item>> {
        self.inner.get_item(org, kind, id).await
    }

    async fn put_item(&self, item: &Item, cond: Cond) -> Result<u64> {
        if item.kind == self.kind
            && matches!(cond, Cond::Version(_))
            && self.armed.swap(false, Ordering::SeqCst)
            && let Some(stored) = self.inner.get_item(&item.org, &item.kind, &item.id).await?
        {
            self.inner
                .put_item(&(self.rival)(stored, item), Cond::Any)
                .await?;
        }
        self.inner.put_item(item, cond).await
    }

    async fn delete_item(&self, org: &str, kind: &str, id: &str) -> Result<()> {
        self.inner.delete_item(org, kind, id).await
    }

    async fn list_items(
        &self,
        org: &str,
        kind: &str,
        index: Option<&str>,
        page: Page,
    ) -> Result<Paged<Item>> {
        self.inner.list_items(org, kind, index, page).await
    }

    async fn list_items_with_prefix(
        &self,
        org: &str,
        kind: &str,
        prefix: &str,
        page: Page,
    ) -> Result<Paged<Item>> {
        self.inner
            .list_items_with_prefix(org, kind, prefix, page)
            .await
    }

    async fn claim(&self, org: &str, key: &str, now_ms: i64, lease_ms: u64) -> Result<Claim> {
        self.inner.claim(org, key, now_ms, lease_ms).await
    }

    async fn finish(&self, org: &str, key: &str, result: &[u8], now_ms: i64) -> Result<()> {
        self.inner.finish(org, key, result, now_ms).await
    }

    async fn release(&self, org: &str, key: &str) -> Result<()> {
        self.inner.release(org, key).await
    }
}
