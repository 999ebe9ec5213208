//! Loams Bot threads over `loams.bot.v1.BotService`: create a thread, send a message, and watch a thread (cached
//! messages first, then the Watch stream from the stored cursor; ListMessages polling where streaming is not
//! available). Note: the server in this repository does not serve BotService yet; this follows the proto.

use std::sync::Arc;

use loams_proto::bot::v1 as pb;
use loams_proto::connect::Code;

use crate::cache::messages_stream;
use crate::client::{Inner, SyncMode, TaskHandle, check_id, idempotency_key, now_ms};
use crate::error::{Error, Result};
use crate::types::{Message, Thread};

const SERVICE: &str = "/loams.bot.v1.BotService/";
const MAX_TITLE: usize = 200;
/// Longest message a person may send.
pub const MAX_MESSAGE: usize = 16 * 1024;
const SNAPSHOT_MESSAGES: u32 = 10_000;
const LIST_PAGE: u32 = 200;
const LIST_PAGES: usize = 50;

#[derive(Clone, Debug, PartialEq)]
pub enum ThreadUpdate {
    /// The cached messages, delivered before `watch` returns.
    Snapshot {
        messages: Vec<Message>,
    },
    /// Messages new to this installation, in order.
    Messages {
        messages: Vec<Message>,
    },
    Connection {
        connected: bool,
        detail: String,
    },
}

pub trait ThreadListener: Send + Sync {
    fn on_update(&self, update: ThreadUpdate);
}

pub struct Bot {
    inner: Arc<Inner>,
}

impl Bot {
    pub(crate) fn new(inner: Arc<Inner>) -> Bot {
        Bot { inner }
    }

    pub fn cached_threads(&self, limit: u32) -> Result<Vec<Thread>> {
        self.inner.cache.threads(limit)
    }

    pub fn cached_messages(
        &self,
        thread_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<Message>> {
        self.inner.cache.messages(thread_id, after_seq, limit)
    }

    pub async fn create_thread(&self, title: &str) -> Result<Thread> {
        if title.len() > MAX_TITLE || title.chars().any(char::is_control) {
            return Err(Error::InvalidInput(format!(
                "the title must be at most {MAX_TITLE} bytes of text"
            )));
        }
        let req = pb::CreateThreadRequest {
            title: title.to_owned(),
            idempotency_key: idempotency_key("thread")?,
        };
        let resp: pb::CreateThreadResponse = self
            .inner
            .unary(&format!("{SERVICE}CreateThread"), &req)
            .await?;
        let thread = resp
            .thread
            .ok_or_else(|| Error::Server("CreateThread returned no thread".into()))?;
        check_id("thread id", &thread.id)
            .map_err(|_| Error::Server("the server sent an unusable thread id".into()))?;
        let at = now_ms();
        self.inner.cache.put_thread(&thread, at)?;
        Ok(Thread::from_proto(thread, at))
    }

    /// Sends a message; it is cached only once the server has it (the answer arrives through `watch`). Offline,
    /// it fails at once and nothing is kept for later.
    pub async fn send(&self, thread_id: &str, content: &str) -> Result<Message> {
        check_id("thread_id", thread_id)?;
        if content.trim().is_empty() || content.len() > MAX_MESSAGE {
            return Err(Error::InvalidInput(format!(
                "a message is 1..={MAX_MESSAGE} bytes of text"
            )));
        }
        let req = pb::SendRequest {
            thread_id: thread_id.to_owned(),
            content: content.to_owned(),
            idempotency_key: idempotency_key("send")?,
        };
        let resp: pb::SendResponse = self.inner.unary(&format!("{SERVICE}Send"), &req).await?;
        let message = resp
            .message
            .ok_or_else(|| Error::Server("Send returned no message".into()))?;
        let at = now_ms();
        self.inner
            .cache
            .append_messages(thread_id, std::slice::from_ref(&message), at)?;
        Ok(Message::from_proto(message, at))
    }

    /// Delivers the cached messages before returning, then new ones as they arrive, until cancelled.
    pub async fn watch(
        &self,
        thread_id: &str,
        listener: Arc<dyn ThreadListener>,
    ) -> Result<TaskHandle> {
        check_id("thread_id", thread_id)?;
        let messages = self.inner.cache.messages(thread_id, 0, SNAPSHOT_MESSAGES)?;
        listener.on_update(ThreadUpdate::Snapshot { messages });
        let inner = self.inner.clone();
        let thread_id = thread_id.to_owned();
        Ok(TaskHandle::new(tokio::spawn(follow(
            inner, thread_id, listener,
        ))))
    }
}

async fn follow(inner: Arc<Inner>, thread_id: String, listener: Arc<dyn ThreadListener>) {
    let mut mode = inner.config.sync_mode;
    let mut connected: Option<bool> = None;
    let mut report = |ok: bool, detail: String| {
        if connected != Some(ok) {
            connected = Some(ok);
            listener.on_update(ThreadUpdate::Connection {
                connected: ok,
                detail,
            });
        }
    };
    loop {
        if !inner.network_available() {
            report(false, "no network connection".into());
            tokio::time::sleep(inner.config.reconnect_delay).await;
            continue;
        }
        let result = match mode {
            SyncMode::Stream => stream_once(&inner, &thread_id, &*listener, &mut report).await,
            SyncMode::Poll => poll_once(&inner, &thread_id).await.map(|fresh| {
                report(true, "polling".into());
                if !fresh.is_empty() {
                    listener.on_update(ThreadUpdate::Messages { messages: fresh });
                }
                false
            }),
        };
        match result {
            Ok(true) => {
                mode = SyncMode::Poll;
                report(true, "streaming unavailable; polling".into());
            }
            Ok(false) if mode == SyncMode::Poll => {
                tokio::time::sleep(inner.config.poll_interval).await
            }
            Ok(false) => tokio::time::sleep(inner.config.reconnect_delay).await,
            Err(
                e @ (Error::NotFound(_) | Error::PermissionDenied(_) | Error::Unauthenticated(_)),
            ) => {
                report(false, e.to_string());
                return;
            }
            Err(e) => {
                report(false, e.to_string());
                tokio::time::sleep(inner.config.reconnect_delay).await;
            }
        }
    }
}

/// One Watch connection from the cursor. `Ok(true)`: the server cannot stream.
async fn stream_once(
    inner: &Inner,
    thread_id: &str,
    listener: &dyn ThreadListener,
    report: &mut impl FnMut(bool, String),
) -> Result<bool> {
    let after_seq = inner.cache.cursor(&messages_stream(thread_id))?;
    let req = pb::WatchRequest {
        thread_id: thread_id.to_owned(),
        after_seq,
    };
    let mut stream = inner
        .server_stream::<_, pb::WatchResponse>(&format!("{SERVICE}Watch"), &req)
        .await?;
    while let Some(item) = stream.recv().await {
        let item = match item {
            Ok(item) => item,
            Err(e) if e.code == Code::Unimplemented => return Ok(true),
            Err(e) => return Err(e.into()),
        };
        report(true, "live".into());
        if let Some(message) = item.message {
            let fresh = inner
                .cache
                .append_messages(thread_id, &[message], now_ms())?;
            if !fresh.is_empty() {
                listener.on_update(ThreadUpdate::Messages { messages: fresh });
            }
        }
    }
    Ok(false)
}

/// ListMessages has page tokens, not a seq cursor, so polling reads the thread from its start; the cache keeps
/// only what is new.
async fn poll_once(inner: &Inner, thread_id: &str) -> Result<Vec<Message>> {
    let mut token = String::new();
    let mut fresh = Vec::new();
    for _ in 0..LIST_PAGES {
        let req = pb::ListMessagesRequest {
            thread_id: thread_id.to_owned(),
            page_size: LIST_PAGE,
            page_token: token,
        };
        let resp: pb::ListMessagesResponse =
            inner.unary(&format!("{SERVICE}ListMessages"), &req).await?;
        fresh.extend(
            inner
                .cache
                .append_messages(thread_id, &resp.messages, now_ms())?,
        );
        if resp.next_page_token.is_empty() {
            break;
        }
        token = resp.next_page_token;
    }
    Ok(fresh)
}
