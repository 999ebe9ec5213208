//! Zulip: post to a channel topic (a "thread"), read a topic. API: zulip.yaml, base `{realm}/api/v1`,
//! HTTP Basic `email:api_key`, form-encoded requests, `{"result": "success"|"error", "msg"}` answers.

use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use loams_a2a::{AgentSpec, Risk, SkillError, Skills};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{AppHttp, DEFAULT_TIMEOUT, RetryPolicy, create_or_find};
use crate::{AGENT_VERSION, AgentError, args, require, skill};

/// Zulip's own limits (server defaults `max_topic_length`, `max_message_length`, channel names).
const MAX_TOPIC_CHARS: usize = 60;
const MAX_CHANNEL_BYTES: usize = 240;
const MAX_CONTENT_BYTES: usize = 10_000;
/// How many of a topic's newest messages `read` returns.
const READ_LIMIT: u32 = 100;
/// After a send whose answer was lost: how many of the topic's newest messages are searched for it, and how far
/// the server's clock may be behind ours.
const LOOKUP_LIMIT: u32 = 50;
const CLOCK_SKEW_SECS: i64 = 120;

#[derive(Clone)]
pub struct ZulipConfig {
    /// The realm URL, e.g. `https://chat.example.com`; also the base of thread links.
    pub base_url: String,
    pub email: String,
    pub api_key: String,
    pub timeout: Duration,
}

impl std::fmt::Debug for ZulipConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZulipConfig")
            .field("base_url", &self.base_url)
            .field("email", &self.email)
            .finish_non_exhaustive()
    }
}

impl ZulipConfig {
    pub fn new(
        base_url: impl Into<String>,
        email: impl Into<String>,
        api_key: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            email: email.into(),
            api_key: api_key.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// One message of a topic, as `read` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ZulipMessage {
    pub id: u64,
    pub sender_email: String,
    #[serde(default)]
    pub sender_full_name: String,
    pub content: String,
    /// Seconds since the epoch, server time.
    #[serde(default)]
    pub timestamp: i64,
}

#[derive(Deserialize)]
struct Envelope {
    result: String,
    #[serde(default)]
    msg: String,
}

#[derive(Deserialize)]
struct SendReply {
    id: u64,
}

#[derive(Deserialize)]
struct StreamIdReply {
    stream_id: u64,
}

#[derive(Deserialize)]
struct MessagesReply {
    messages: Vec<ZulipMessage>,
}

pub struct ZulipClient {
    http: AppHttp,
    email: String,
}

impl ZulipClient {
    pub fn new(config: &ZulipConfig) -> Result<Self, AgentError> {
        if config.email.is_empty() {
            return Err(AgentError::Config("zulip: email is empty".into()));
        }
        let basic = base64::engine::general_purpose::STANDARD
            .encode(format!("{}:{}", config.email, config.api_key));
        let http = AppHttp::new(
            "zulip",
            &config.base_url,
            vec![("authorization", format!("Basic {basic}"))],
            config.timeout,
            vec![config.api_key.clone(), basic],
        )?;
        Ok(Self {
            http,
            email: config.email.clone(),
        })
    }

    /// Replaces the default [`RetryPolicy`] (e.g. short backoffs in tests, or none).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.http.set_retry(retry)?;
        Ok(self)
    }

    /// `POST /messages` (send-message) to a channel topic; returns the message id. Zulip has no dedupe key, so
    /// the send is never repeated; when its answer is lost (including a 5xx) the topic is searched for it (ours,
    /// same content, sent since), and if it is not there, or the search fails, the [`AgentError::Uncertain`]
    /// stands.
    pub async fn send(&self, channel: &str, topic: &str, content: &str) -> Result<u64, AgentError> {
        let started = crate::time::now_ms() / 1000;
        create_or_find(
            || self.post_message(channel, topic, content),
            || async {
                let newest = self.read(channel, topic, LOOKUP_LIMIT).await?;
                Ok(newest
                    .iter()
                    .rev()
                    .find(|m| {
                        m.sender_email.eq_ignore_ascii_case(&self.email)
                            && m.content.trim() == content.trim()
                            && m.timestamp >= started - CLOCK_SKEW_SECS
                    })
                    .map(|m| m.id))
            },
        )
        .await
    }

    async fn post_message(
        &self,
        channel: &str,
        topic: &str,
        content: &str,
    ) -> Result<u64, AgentError> {
        // `stream` rather than `channel`: accepted by every server version (`channel` needs feature level 248).
        let form = [
            ("type", "stream"),
            ("to", channel),
            ("topic", topic),
            ("content", content),
        ];
        let rb = self
            .http
            .request(Method::POST, self.http.url(&["api", "v1", "messages"]))
            .form(&form);
        let reply: SendReply = self.call(rb).await?;
        Ok(reply.id)
    }

    /// `GET /get_stream_id`.
    pub async fn stream_id(&self, channel: &str) -> Result<u64, AgentError> {
        let rb = self
            .http
            .request(Method::GET, self.http.url(&["api", "v1", "get_stream_id"]))
            .query(&[("stream", channel)]);
        let reply: StreamIdReply = self.call(rb).await?;
        Ok(reply.stream_id)
    }

    /// `GET /messages`: the newest `limit` messages of a topic, oldest first, raw Markdown.
    pub async fn read(
        &self,
        channel: &str,
        topic: &str,
        limit: u32,
    ) -> Result<Vec<ZulipMessage>, AgentError> {
        let narrow = json!([{"operator": "channel", "operand": channel}, {"operator": "topic", "operand": topic}]).to_string();
        let limit = limit.to_string();
        let query = [
            ("anchor", "newest"),
            ("num_before", limit.as_str()),
            ("num_after", "0"),
            ("narrow", narrow.as_str()),
            ("apply_markdown", "false"),
        ];
        let rb = self
            .http
            .request(Method::GET, self.http.url(&["api", "v1", "messages"]))
            .query(&query);
        let reply: MessagesReply = self.call(rb).await?;
        Ok(reply.messages)
    }

    /// A web link to the topic, near `message_id`, in Zulip's `#narrow` hash encoding.
    pub fn thread_url(
        &self,
        stream_id: u64,
        channel: &str,
        topic: &str,
        message_id: u64,
    ) -> String {
        let base = self.http.base().as_str().trim_end_matches('/');
        format!(
            "{base}/#narrow/channel/{stream_id}-{}/topic/{}/near/{message_id}",
            hash_encode(&channel.replace(' ', "-")),
            hash_encode(topic)
        )
    }

    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        rb: reqwest::RequestBuilder,
    ) -> Result<T, AgentError> {
        let reply = self.http.send(rb).await?;
        if !(200..300).contains(&reply.status) {
            return Err(self.http.status_error(&reply));
        }
        let env: Envelope = self.http.decode(&reply.body)?;
        if env.result != "success" {
            return Err(self
                .http
                .bad(format!("result `{}`: {}", env.result, env.msg)));
        }
        self.http.decode(&reply.body)
    }
}

/// Zulip's `encodeHashComponent`: encodeURIComponent, then `.` for `%` (and `.` itself escaped first).
fn hash_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'!' | b'~' | b'*' | b'\'' => {
                out.push(b as char)
            }
            b'(' => out.push_str(".28"),
            b')' => out.push_str(".29"),
            _ => out.push_str(&format!(".{b:02X}")),
        }
    }
    out
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PostArgs {
    channel: String,
    topic: String,
    content: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    channel: String,
    topic: String,
}

fn check_place(channel: &str, topic: &str) -> Result<(), AgentError> {
    require("channel", channel, MAX_CHANNEL_BYTES)?;
    require("topic", topic, MAX_TOPIC_CHARS * 4)?;
    if topic.chars().count() > MAX_TOPIC_CHARS {
        // Zulip would truncate it, and later reads of the full name would miss the thread.
        return Err(AgentError::InvalidArgs(format!(
            "`topic` is longer than {MAX_TOPIC_CHARS} characters"
        )));
    }
    Ok(())
}

/// The chat agent: opens and follows the incident thread.
pub struct ZulipAgent {
    client: ZulipClient,
}

impl ZulipAgent {
    pub fn new(config: &ZulipConfig) -> Result<Self, AgentError> {
        Ok(Self {
            client: ZulipClient::new(config)?,
        })
    }

    /// Replaces the default [`RetryPolicy`] of the agent's app client.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, AgentError> {
        self.client = self.client.with_retry(retry)?;
        Ok(self)
    }

    async fn run(&self, skill: &str, value: Value) -> Result<Value, AgentError> {
        match skill {
            "open_thread" | "post" => {
                let a: PostArgs = args(skill, value)?;
                check_place(&a.channel, &a.topic)?;
                require("content", &a.content, MAX_CONTENT_BYTES)?;
                if skill == "post" {
                    let id = self.client.send(&a.channel, &a.topic, &a.content).await?;
                    return Ok(json!({"message_id": id}));
                }
                // Resolve the channel first: an unknown channel fails before anything is posted.
                let stream_id = self.client.stream_id(&a.channel).await?;
                let id = self.client.send(&a.channel, &a.topic, &a.content).await?;
                Ok(
                    json!({"message_id": id, "url": self.client.thread_url(stream_id, &a.channel, &a.topic, id)}),
                )
            }
            "read" => {
                let a: ReadArgs = args(skill, value)?;
                check_place(&a.channel, &a.topic)?;
                let messages = self.client.read(&a.channel, &a.topic, READ_LIMIT).await?;
                let messages: Vec<Value> = messages
                    .into_iter()
                    .map(|m| json!({"id": m.id, "sender": m.sender_email, "sender_name": m.sender_full_name, "content": m.content}))
                    .collect();
                Ok(json!({"messages": messages}))
            }
            other => Err(AgentError::UnknownSkill(other.into())),
        }
    }
}

#[async_trait]
impl Skills for ZulipAgent {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "zulip".into(),
            description: "Chat agent for Zulip: opens the incident thread in a channel topic, posts updates to it \
                          and reads the discussion back."
                .into(),
            version: AGENT_VERSION.into(),
            // Zulip encodes its links its own way (`hash_encode`), which a link template cannot say: none.
            app: Some(crate::app_links(self.client.http.base(), &[])),
            skills: vec![
                skill(
                    "open_thread",
                    "Open thread",
                    "Start a thread: post the first message to a channel topic; returns the message id and a link.",
                    Risk::Write,
                    &[r#"{"channel":"incidents","topic":"checkout 500s","content":"Investigating **TypeError** in checkout"}"#],
                ),
                skill(
                    "post",
                    "Post",
                    "Post a Markdown message to an existing channel topic.",
                    Risk::Write,
                    &[r#"{"channel":"incidents","topic":"checkout 500s","content":"PR #12 opened"}"#],
                ),
                skill(
                    "read",
                    "Read thread",
                    "Read the newest messages of a channel topic (raw Markdown, oldest first).",
                    Risk::Read,
                    &[r#"{"channel":"incidents","topic":"checkout 500s"}"#],
                ),
            ],
        }
    }

    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError> {
        Ok(self.run(skill, args).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_encoding_matches_zulip() {
        assert_eq!(hash_encode("checkout 500s"), "checkout.20500s");
        assert_eq!(hash_encode("a.b(c)/é"), "a.2Eb.28c.29.2F.C3.A9");
    }

    #[test]
    fn topic_limits() {
        assert!(check_place("incidents", &"x".repeat(60)).is_ok());
        assert!(check_place("incidents", &"x".repeat(61)).is_err());
        assert!(check_place("", "t").is_err());
        assert!(check_place("c", " ").is_err());
    }
}
