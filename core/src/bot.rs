//! Loams Bot threads over `loams.bot.v1.BotService`: create a thread, send a message, and watch a thread (cached
//! messages first, then the Watch stream from the stored cursor; ListMessages polling where streaming is not
//! available). Note: the server in this repository does not serve BotService yet; this follows the proto.

use std::ops::ControlFlow;
use std::sync::Arc;

use loams_proto::bot::v1 as pb;
use loams_proto::connect::Code;

use crate::cache::messages_stream;
use crate::client::{Inner, TaskHandle, check_id, idempotency_key, now_ms};
use crate::error::{Error, Result};
use crate::follow::{Follower, Report, Step, follow};
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
    /// As `RunUpdate::Connection`.
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

    /// Delivers the cached messages before returning, then new ones as they arrive, until cancelled or until the
    /// server refuses the watch (a last `Connection` notice gives the reason).
    pub async fn watch(
        &self,
        thread_id: &str,
        listener: Arc<dyn ThreadListener>,
    ) -> Result<TaskHandle> {
        check_id("thread_id", thread_id)?;
        let messages = self.inner.cache.messages(thread_id, 0, SNAPSHOT_MESSAGES)?;
        listener.on_update(ThreadUpdate::Snapshot { messages });
        let follower = ThreadFollower {
            thread_id: thread_id.to_owned(),
            listener,
        };
        let inner = self.inner.clone();
        Ok(TaskHandle::spawn(|ending| follow(inner, follower, ending)))
    }
}

/// Follows one thread for a watch.
struct ThreadFollower {
    thread_id: String,
    listener: Arc<dyn ThreadListener>,
}

impl Follower for ThreadFollower {
    fn connection(&self, connected: bool, detail: String) {
        self.listener
            .on_update(ThreadUpdate::Connection { connected, detail });
    }

    /// One Watch connection from the cursor.
    async fn stream_once(&self, inner: &Inner, report: &mut Report<'_>) -> Result<Step> {
        let thread_id = self.thread_id.as_str();
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
                Err(e) if e.code == Code::Unimplemented => return Ok(Step::Unsupported),
                Err(e) => return Err(e.into()),
            };
            report(true, "live");
            if let Some(message) = item.message {
                // Messages that have already arrived behind this one are stored in the same transaction.
                let messages = stream.burst(message, |r| match r.message {
                    Some(message) => ControlFlow::Continue(message),
                    None => ControlFlow::Break(r),
                });
                let fresh = inner
                    .cache
                    .append_messages(thread_id, &messages, now_ms())?;
                if !fresh.is_empty() {
                    self.listener
                        .on_update(ThreadUpdate::Messages { messages: fresh });
                }
            }
        }
        Ok(Step::Again)
    }

    async fn poll_once(&self, inner: &Inner, report: &mut Report<'_>) -> Result<Step> {
        let fresh = poll_once(inner, &self.thread_id).await?;
        report(true, "polling");
        if !fresh.is_empty() {
            self.listener
                .on_update(ThreadUpdate::Messages { messages: fresh });
        }
        Ok(Step::Again)
    }
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
