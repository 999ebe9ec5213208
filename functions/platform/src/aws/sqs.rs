//! `Queue` on an SQS standard queue with a dead-letter queue (see [`super::provision_queue`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::ProvideErrorMetadata;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, Message, MessageAttributeValue,
    MessageSystemAttributeName,
};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use super::sqs_err;
use crate::limits::{
    self, MAX_DELAY_MS, MAX_MESSAGE, MAX_PAGE, MAX_RECEIVE, MAX_TOKEN, MAX_VISIBILITY_MS,
};
use crate::{Clock, Delivery, Queue, Result, StoreError};

/// The message attribute that marks a base64-encoded body. SQS bodies must be text made of the XML
/// characters; queue bodies are opaque bytes, so anything else travels base64-encoded with this attribute
/// set to `base64`. A Lambda handler decodes records with [`decode_body`].
pub const BODY_ENCODING_ATTRIBUTE: &str = "loams-encoding";
const BASE64: &str = "base64";

/// How long `dead_letters` hides the dead letters it reads while paging through them (it then makes them
/// visible again). SQS has no read-only peek: a receive with visibility 0 would return the same first
/// messages on every call.
const PEEK_VISIBILITY_S: i32 = 30;

/// How long before the end of a receive's visibility timeout its receipt counts as stale. The adapter's clock
/// and SQS's are different clocks; this margin covers their skew.
const SKEW_MARGIN_MS: i64 = 200;

/// How many receipts with a changed visibility deadline the adapter remembers at most. Entries leave when
/// acked or when their deadline passed, so only this many messages handled at once (or retried later) by one
/// process count; past it, a receipt keeps the deadline of its receive (see [`SqsQueue`]).
const MAX_REMEMBERED: usize = 10_000;

/// `Queue` on SQS.
///
/// Delays: SQS delays a message by at most 15 minutes, so `send` takes at most `limits::MAX_DELAY_MS`; the
/// worker puts longer waits (approvals, CI, re-checks) in the `Timers` store, whose scheduler enqueues them
/// when due. Delays, visibility timeouts and retry delays are whole seconds on SQS and are rounded up, so a
/// message never shows up earlier than asked.
///
/// Receipts: SQS deletes a message with any receipt handle it ever had (moto does; AWS documents that an old
/// handle "might" still work), but the port says an ack with a stale receipt must not delete a message that
/// someone else received since. So a receipt carries the end of its visibility timeout by this adapter's
/// clock, and `ack` / `retry_later` after that moment are no-ops: the message may belong to a newer receiver.
/// If it was not received again, it simply comes back (at most one redundant, idempotent run of its step).
/// The clock must therefore be the wall clock in production.
///
/// A successful `retry_later` moves the receipt's deadline to the end of the new visibility timeout, which the
/// adapter remembers per receipt (shared by clones): a worker that keeps extending a long step's message and
/// then acks it uses the same receipt throughout, and must not be told "stale" after the first window. The
/// newest deadline wins also when it is earlier (`retry_later(receipt, 0)` ends the receipt at once), because
/// from then on another receiver may hold the message. Past [`MAX_REMEMBERED`] receipts, a new one is not
/// remembered and keeps its receive's deadline: its later calls may be no-ops, which costs a redundant run.
///
/// Polling: `receive` short-polls by default (`wait_time_s` 0), which on AWS samples a subset of servers and
/// may return nothing while messages exist; a polling worker loops anyway. On Lambda, the event source
/// mapping receives and deletes; this adapter then only sends.
#[derive(Clone)]
pub struct SqsQueue {
    client: Client,
    queue_url: String,
    dead_letter_url: String,
    clock: Arc<dyn Clock>,
    wait_time_s: i32,
    /// Receipt -> the end of its visibility timeout (adapter clock, less the skew margin) set by the last
    /// successful `retry_later`.
    deadlines: Arc<Mutex<HashMap<String, i64>>>,
}

impl std::fmt::Debug for SqsQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsQueue")
            .field("queue_url", &self.queue_url)
            .field("dead_letter_url", &self.dead_letter_url)
            .finish_non_exhaustive()
    }
}

impl SqsQueue {
    pub fn new(client: Client, urls: super::QueueUrls, clock: Arc<dyn Clock>) -> Self {
        Self {
            client,
            queue_url: urls.queue_url,
            dead_letter_url: urls.dead_letter_url,
            clock,
            wait_time_s: 0,
            deadlines: Arc::default(),
        }
    }

    /// Long-polls receives for up to `seconds` (0..=20, SQS's range; larger is capped).
    pub fn with_wait_time(mut self, seconds: u8) -> Self {
        self.wait_time_s = i32::from(seconds.min(20));
        self
    }
}

/// Milliseconds to SQS's whole seconds, rounded up.
fn seconds(ms: u64) -> i32 {
    // Every caller checked ms against a limit of at most 12 hours, so this fits.
    i32::try_from(ms.div_ceil(1000)).unwrap_or(i32::MAX)
}

/// Whether SQS accepts `text` as a message body unchanged: the XML characters
/// #x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF, and not empty.
fn sqs_text(body: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(body).ok()?;
    let ok = !text.is_empty() && text.chars().all(|c| {
        matches!(c, '\u{9}' | '\u{A}' | '\u{D}' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}')
            || c >= '\u{10000}'
    });
    ok.then_some(text)
}

/// The bytes of a message body as sent by [`SqsQueue`]: `encoding` is the value of the
/// [`BODY_ENCODING_ATTRIBUTE`] message attribute, if present.
pub fn decode_body(body: &str, encoding: Option<&str>) -> Result<Vec<u8>> {
    match encoding {
        None => Ok(body.as_bytes().to_vec()),
        Some(BASE64) => STANDARD.decode(body).map_err(|e| {
            StoreError::Backend(format!("a base64 message body does not decode: {e}"))
        }),
        Some(other) => Err(StoreError::Backend(format!(
            "unknown message body encoding {other:?}"
        ))),
    }
}

fn delivery(m: &Message, receipt: String) -> Result<Delivery> {
    let attr = |name: MessageSystemAttributeName| {
        m.attributes()
            .and_then(|a| a.get(&name))
            .map(String::as_str)
    };
    let receive_count = attr(MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| StoreError::Backend("sqs message without ApproximateReceiveCount".into()))?;
    let encoding = m
        .message_attributes()
        .and_then(|a| a.get(BODY_ENCODING_ATTRIBUTE))
        .and_then(|v| v.string_value());
    Ok(Delivery {
        id: m
            .message_id()
            .ok_or_else(|| StoreError::Backend("sqs message without id".into()))?
            .to_owned(),
        receipt,
        body: decode_body(m.body().unwrap_or_default(), encoding)?,
        receive_count,
    })
}

/// A receipt is `<valid until ms>.<SQS receipt handle>`.
fn open_receipt(receipt: &str) -> Option<(i64, &str)> {
    let (until, handle) = receipt.split_once('.')?;
    let until: i64 = until.parse().ok()?;
    (!handle.is_empty()).then_some((until, handle))
}

/// SQS's answers to a receipt that no longer names an in-flight message (deleted, or received again).
fn stale_receipt_error(code: Option<&str>) -> bool {
    matches!(
        code,
        Some("ReceiptHandleIsInvalid" | "InvalidParameterValue" | "MessageNotInflight")
            | Some("AWS.SimpleQueueService.MessageNotInflight")
    )
}

/// The end of a visibility timeout of `ms` that starts now, by the adapter's clock: measured before the SQS
/// call, which starts the timeout later, and less the skew margin, so the receipt expires first.
fn deadline_after(now_ms: i64, ms: u64) -> i64 {
    now_ms
        .saturating_add(i64::from(seconds(ms)) * 1000)
        .saturating_sub(SKEW_MARGIN_MS)
}

impl SqsQueue {
    fn deadlines(&self) -> std::sync::MutexGuard<'_, HashMap<String, i64>> {
        // A poisoned map only means another task panicked while holding it; its entries are still sound.
        self.deadlines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The SQS handle of a receipt that is still ours, or `None` for a stale or foreign one.
    fn live_handle<'a>(&self, receipt: &'a str) -> Result<Option<&'a str>> {
        limits::token("receipt", receipt)?;
        let Some((received_until, handle)) = open_receipt(receipt) else {
            return Ok(None);
        };
        let until = self
            .deadlines()
            .get(receipt)
            .copied()
            .unwrap_or(received_until);
        Ok((self.clock.now_ms() < until).then_some(handle))
    }

    /// A receive of up to `max` (1..=MAX_RECEIVE) messages from `url`, hidden for `visibility_s`, asking for
    /// what [`delivery`] reads: the receive count and the body's encoding.
    fn receive_from(
        &self,
        url: &str,
        max: usize,
        visibility_s: i32,
    ) -> aws_sdk_sqs::operation::receive_message::builders::ReceiveMessageFluentBuilder {
        self.client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(i32::try_from(max).unwrap_or(10))
            .visibility_timeout(visibility_s)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_attribute_names(BODY_ENCODING_ATTRIBUTE)
    }

    /// Records the deadline set by a successful visibility change, and drops the entries whose receipts are
    /// stale for good (both their receive's deadline and their remembered one passed), so that dropping them
    /// changes no answer.
    fn remember(&self, receipt: &str, until: i64) {
        let now = self.clock.now_ms();
        let mut deadlines = self.deadlines();
        if !deadlines.contains_key(receipt) {
            // Only as many entries as messages in hand, so a scan per new receipt is cheap.
            deadlines.retain(|r, until| {
                let received_until = open_receipt(r).map_or(i64::MIN, |(u, _)| u);
                now < received_until.max(*until)
            });
            if deadlines.len() >= MAX_REMEMBERED {
                return;
            }
        }
        deadlines.insert(receipt.to_owned(), until);
    }
}

#[async_trait]
impl Queue for SqsQueue {
    async fn send(&self, body: &[u8], delay_ms: u64) -> Result<()> {
        limits::body("message", body, MAX_MESSAGE)?;
        limits::duration("delay", delay_ms, MAX_DELAY_MS)?;
        let mut req = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .delay_seconds(seconds(delay_ms));
        req = match sqs_text(body) {
            Some(text) => req.message_body(text),
            None => req.message_body(STANDARD.encode(body)).message_attributes(
                BODY_ENCODING_ATTRIBUTE,
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(BASE64)
                    .build()
                    .map_err(|e| StoreError::Backend(format!("building an SQS attribute: {e}")))?,
            ),
        };
        req.send().await.map_err(|e| sqs_err("SendMessage", e))?;
        Ok(())
    }

    async fn receive(&self, max: u32, visibility_ms: u64) -> Result<Vec<Delivery>> {
        let max = limits::count("receive max", max, MAX_RECEIVE)? as usize;
        limits::duration("visibility", visibility_ms, MAX_VISIBILITY_MS)?;
        let valid_until = deadline_after(self.clock.now_ms(), visibility_ms);
        let out = self
            .receive_from(&self.queue_url, max, seconds(visibility_ms))
            .wait_time_seconds(self.wait_time_s)
            .send()
            .await
            .map_err(|e| sqs_err("ReceiveMessage", e))?;
        out.messages()
            .iter()
            .map(|m| {
                let handle = m
                    .receipt_handle()
                    .ok_or_else(|| StoreError::Backend("sqs message without receipt".into()))?;
                let receipt = format!("{valid_until}.{handle}");
                if receipt.len() > MAX_TOKEN {
                    return Err(StoreError::Backend(format!(
                        "sqs receipt handle of {} bytes does not fit a {MAX_TOKEN}-byte receipt",
                        handle.len()
                    )));
                }
                delivery(m, receipt)
            })
            .collect()
    }

    async fn ack(&self, receipt: &str) -> Result<()> {
        let Some(handle) = self.live_handle(receipt)? else {
            return Ok(());
        };
        let deleted = match self
            .client
            .delete_message()
            .queue_url(&self.queue_url)
            .receipt_handle(handle)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if stale_receipt_error(e.code()) => Ok(()),
            Err(e) => Err(sqs_err("DeleteMessage", e)),
        };
        if deleted.is_ok() {
            // The message is gone (or someone else's): its receipt has nothing left to extend.
            self.deadlines().remove(receipt);
        }
        deleted
    }

    async fn retry_later(&self, receipt: &str, delay_ms: u64) -> Result<()> {
        limits::duration("retry delay", delay_ms, MAX_VISIBILITY_MS)?;
        let Some(handle) = self.live_handle(receipt)? else {
            return Ok(());
        };
        let until = deadline_after(self.clock.now_ms(), delay_ms);
        match self
            .client
            .change_message_visibility()
            .queue_url(&self.queue_url)
            .receipt_handle(handle)
            .visibility_timeout(seconds(delay_ms))
            .send()
            .await
        {
            Ok(_) => {
                self.remember(receipt, until);
                Ok(())
            }
            Err(e) if stale_receipt_error(e.code()) => Ok(()),
            Err(e) => Err(sqs_err("ChangeMessageVisibility", e)),
        }
    }

    /// Reads up to `limit` dead letters, oldest sent first. SQS has no peek, so this receives them (hidden for
    /// 30 s while paging) and then makes them visible again; each read adds to their receive count, and a
    /// concurrent reader may see fewer. The dead-letter queue has no redrive of its own, so reads never move
    /// or lose a dead letter.
    async fn dead_letters(&self, limit: u32) -> Result<Vec<Delivery>> {
        let limit = limits::count("dead letter limit", limit, MAX_PAGE)? as usize;
        let mut seen: HashMap<String, (i64, Delivery)> = HashMap::new();
        let mut handles = Vec::new();
        while seen.len() < limit {
            let want = (limit - seen.len()).min(MAX_RECEIVE as usize);
            let out = self
                .receive_from(&self.dead_letter_url, want, PEEK_VISIBILITY_S)
                .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
                .send()
                .await
                .map_err(|e| sqs_err("ReceiveMessage", e))?;
            if out.messages().is_empty() {
                break;
            }
            for m in out.messages() {
                let handle = m.receipt_handle().unwrap_or_default().to_owned();
                let sent = m
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp))
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(i64::MAX);
                let d = delivery(m, String::new())?;
                handles.push(handle);
                seen.insert(d.id.clone(), (sent, d));
            }
        }
        // Give them back at once rather than after the peek timeout.
        for chunk in handles.chunks(MAX_RECEIVE as usize) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(format!("m{i}"))
                        .receipt_handle(h)
                        .visibility_timeout(0)
                        .build()
                        .map_err(|e| StoreError::Backend(format!("building an SQS batch: {e}")))
                })
                .collect::<Result<Vec<_>>>()?;
            self.client
                .change_message_visibility_batch()
                .queue_url(&self.dead_letter_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| sqs_err("ChangeMessageVisibilityBatch", e))?;
        }
        let mut dead: Vec<(i64, Delivery)> = seen.into_values().collect();
        dead.sort_by(|a, b| (a.0, &a.1.id).cmp(&(b.0, &b.1.id)));
        Ok(dead.into_iter().map(|(_, d)| d).take(limit).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_bodies_travel_as_is_and_bytes_as_base64() {
        assert_eq!(sqs_text(br#"{"org":"acme"}"#), Some(r#"{"org":"acme"}"#));
        assert_eq!(sqs_text("é😀\t\n".as_bytes()), Some("é😀\t\n"));
        assert_eq!(sqs_text(b""), None);
        assert_eq!(sqs_text(&[1, 2, 3]), None);
        assert_eq!(sqs_text(&[0xff, 0xfe]), None);
        let bytes = [0u8, 1, 255];
        let sent = STANDARD.encode(bytes);
        assert_eq!(decode_body(&sent, Some(BASE64)), Ok(bytes.to_vec()));
        assert_eq!(decode_body("plain", None), Ok(b"plain".to_vec()));
        assert!(decode_body("plain", Some("gzip")).is_err());
        assert!(decode_body("not base64!", Some(BASE64)).is_err());
    }

    #[test]
    fn receipts_carry_their_deadline() {
        assert_eq!(open_receipt("1234.AQEB+/x.y="), Some((1234, "AQEB+/x.y=")));
        assert_eq!(open_receipt("no-such-receipt"), None);
        assert_eq!(open_receipt("12."), None);
        assert_eq!(open_receipt("x.handle"), None);
    }

    /// An adapter whose client is never called: these checks only touch the receipt bookkeeping.
    fn offline(clock: Arc<crate::ManualClock>) -> SqsQueue {
        let conf = aws_sdk_sqs::Config::builder()
            .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
            .region(aws_sdk_sqs::config::Region::new("us-east-1"))
            .build();
        let urls = crate::aws::QueueUrls {
            queue_url: "q".into(),
            dead_letter_url: "dlq".into(),
        };
        SqsQueue::new(Client::from_conf(conf), urls, clock)
    }

    #[test]
    fn remembered_deadlines_replace_the_received_one_and_expire() {
        let clock = Arc::new(crate::ManualClock::new(1_000_000));
        let q = offline(clock.clone());
        let extended = format!("{}.h1", deadline_after(1_000_000, 1000));
        q.remember(&extended, deadline_after(1_000_000, 3000));
        clock.advance(2000);
        assert_eq!(
            q.live_handle(&extended),
            Ok(Some("h1")),
            "extension honoured"
        );
        let unextended = format!("{}.h2", deadline_after(1_000_000, 1000));
        assert_eq!(
            q.live_handle(&unextended),
            Ok(None),
            "received deadline passed"
        );

        // Shortening wins too: after retry_later(0) another receiver may hold the message.
        let released = format!("{}.h3", deadline_after(1_002_000, 30_000));
        q.remember(&released, deadline_after(1_002_000, 0));
        assert_eq!(q.live_handle(&released), Ok(None));

        // Past the extension, a new entry prunes the expired one but keeps the still-meaningful release.
        clock.advance(2000);
        assert_eq!(q.live_handle(&extended), Ok(None));
        let other = format!("{}.h4", deadline_after(1_004_000, 1000));
        q.remember(&other, deadline_after(1_004_000, 5000));
        let kept: Vec<String> = {
            let mut k: Vec<String> = q.deadlines().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(kept, vec![other.clone(), released.clone()]);
        assert_eq!(
            q.live_handle(&released),
            Ok(None),
            "pruning revived nothing"
        );
        // Clones share what they remember.
        assert_eq!(q.clone().live_handle(&other), Ok(Some("h4")));
    }

    #[test]
    fn durations_round_up_to_seconds() {
        assert_eq!(seconds(0), 0);
        assert_eq!(seconds(1), 1);
        assert_eq!(seconds(1000), 1);
        assert_eq!(seconds(1001), 2);
        assert_eq!(seconds(MAX_DELAY_MS), 900);
    }
}
