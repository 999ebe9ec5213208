use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{AUTHORIZATION, HeaderValue, RETRY_AFTER};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;
use tracing::Instrument;

use crate::{ChatMessage, ChatModel, ChatRequest, ChatResponse, ModelError};

pub const DEFAULT_BASE_URL: &str = "https://api.deepseek.com";
/// The contract's default. DeepSeek has announced this name as a legacy alias of its V4 model, so deployments
/// should set the model explicitly; the default only keeps the zero-config path working while the alias lives.
pub const DEFAULT_MODEL: &str = "deepseek-chat";
/// Upper bound on a completion body we accept: room for the longest answer a provider bills (a reasoning model's
/// thoughts and answer, hundreds of thousands of tokens), so that one too long to use is still counted; more means a
/// broken or hostile peer. Parsing a body this size costs memory in proportion: serde's error for a mistyped value
/// quotes it whole, at up to six bytes a byte, for as long as the error lives (see `parse_error`).
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// Most of serde's message a bad answer's reason keeps (never a quoted string of the answer: see `parse_error`).
const MAX_PARSE_ERROR: usize = 160;
/// Longest model name kept from an answer (it names the trace's model); a longer one, or one with a character no
/// model's name has (see `is_model_name`), is not kept, and the configured one is used instead.
const MAX_MODEL_NAME: usize = 256;
/// Most tokens an answer may say it used on either side: the largest context window of a model on offer (Llama 4
/// Scout, 10M), five times the largest the common hosted models take (2M). A count beyond it is a broken or hostile
/// peer, not a model a client of this kind talks to.
pub const MAX_TOKENS_TOLD: u64 = 10_000_000;
/// How long an answer may take, body included: ten minutes, as the official OpenAI SDKs wait. Answers take minutes
/// when the model writes the complete new content of a long file (thousands of tokens at tens a second) or reasons
/// first; a shorter limit fails such a call after the provider has done, and billed, the work, and every retry of
/// the step pays for it again. The worker's lease on a call and the steps it starts are sized from this, so no
/// client may wait longer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(600);
/// How much of an error body is kept in [`ModelError::Status`].
const ERROR_EXCERPT_CHARS: usize = 512;
/// Shortest key (without its padding) an error body is shown with, redacted: a shorter one is withheld with it.
const MIN_REDACTED_KEY: usize = 8;
/// How much of an error body is read: far past the excerpt (a key the read cuts is trimmed away, see `excerpt`).
const ERROR_BODY_BYTES: usize = 64 * 1024;
/// How long an error body may take to arrive.
const ERROR_BODY_TIME: Duration = Duration::from_secs(10);

/// Where and how to reach an OpenAI-compatible endpoint.
#[derive(Clone)]
pub struct ModelConfig {
    /// Without the `/chat/completions` suffix, e.g. `https://api.deepseek.com`.
    pub base_url: String,
    pub model: String,
    /// Sent as `Authorization: Bearer`; empty means no header (local servers). Never logged.
    pub api_key: String,
    /// Whole-request timeout, body included: positive and at most [`ANSWER_TIMEOUT`], the default.
    pub timeout: Duration,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            base_url: DEFAULT_BASE_URL.into(),
            model: DEFAULT_MODEL.into(),
            api_key: String::new(),
            timeout: ANSWER_TIMEOUT,
        }
    }
}

// Hand-written so the key cannot reach a log through `{:?}`.
impl fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field(
                "api_key",
                &if self.api_key.is_empty() {
                    "<none>"
                } else {
                    "<redacted>"
                },
            )
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Client for `POST {base_url}/chat/completions` (non-streaming).
pub struct OpenAiCompatible {
    /// Built on the first request, not in `new`: a TLS client reads and parses the whole CA bundle (about a
    /// millisecond), and most of the worker's invocations never ask the model, so a cold start should not pay it.
    http: OnceCell<reqwest::Client>,
    timeout: Duration,
    endpoint: reqwest::Url,
    model: String,
    api_key: String,
}

impl fmt::Debug for OpenAiCompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiCompatible")
            .field("endpoint", &self.endpoint.as_str())
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: &'a [ChatMessage],
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    stream: bool,
}

// Only the fields we use, typed so serde skips the rest without building it (DeepSeek adds `reasoning_content`,
// cache-hit usage, ...): what is skipped costs memory bounded by the body's size, not a tree of it. Everything but
// usage may be missing or null, so an answer that tells its tokens is counted; but a value of another type where a
// field is read (content in parts, a choice that is not an object, a `model` that is not a string) fails the whole
// parse, and such a billed answer is not counted.
#[derive(Deserialize)]
struct WireResponse {
    model: Option<String>,
    choices: Option<FirstChoice>,
    usage: Option<WireUsage>,
}

/// The first of a completion's choices (the one asked for), the others skipped unread.
struct FirstChoice(Option<WireChoice>);

impl<'de> Deserialize<'de> for FirstChoice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct First;
        impl<'de> serde::de::Visitor<'de> for First {
            type Value = FirstChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<FirstChoice, A::Error> {
                let first = seq.next_element::<Option<WireChoice>>()?.flatten();
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }
        deserializer.deserialize_seq(First)
    }
}

#[derive(Deserialize)]
struct WireChoice {
    message: Option<WireMessage>,
}

#[derive(Deserialize)]
struct WireMessage {
    content: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl OpenAiCompatible {
    pub fn new(config: ModelConfig) -> Result<Self, ModelError> {
        let base = config.base_url.trim_end_matches('/');
        let endpoint = reqwest::Url::parse(&format!("{base}/chat/completions")).map_err(|e| {
            ModelError::Config(format!("invalid base_url `{}`: {e}", config.base_url))
        })?;
        if !matches!(endpoint.scheme(), "http" | "https") {
            return Err(ModelError::Config(format!(
                "base_url must be http(s), got `{}`",
                config.base_url
            )));
        }
        if config.model.trim().is_empty() {
            return Err(ModelError::Config("model name is empty".into()));
        }
        // Longer, a call could outlive the worker's lease on it and be bought a second time.
        if config.timeout.is_zero() || config.timeout > ANSWER_TIMEOUT {
            return Err(ModelError::Config(format!(
                "timeout must be positive and at most {ANSWER_TIMEOUT:?}, got {:?}",
                config.timeout
            )));
        }
        if !config.api_key.is_empty() && !is_bearer_token(&config.api_key) {
            // Do not echo the key: say only what is wrong with it.
            return Err(ModelError::Config(
                "api_key must be a bearer token: ASCII letters, digits and - . _ ~ + / (then = for padding), no spaces"
                    .into(),
            ));
        }
        Ok(Self {
            http: OnceCell::new(),
            timeout: config.timeout,
            endpoint,
            model: config.model,
            api_key: config.api_key,
        })
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    async fn http(&self) -> Result<&reqwest::Client, ModelError> {
        self.http
            .get_or_try_init(|| async {
                reqwest::Client::builder()
                    .timeout(self.timeout)
                    .connect_timeout(self.timeout.min(Duration::from_secs(10)))
                    .build()
                    .map_err(|e| ModelError::Config(format!("cannot build HTTP client: {e}")))
            })
            .await
    }

    async fn send(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError> {
        let body = WireRequest {
            model: &self.model,
            messages: &req.messages,
            max_tokens: req.max_tokens,
            stream: false,
        };
        let mut builder = self.http().await?.post(self.endpoint.clone()).json(&body);
        if !self.api_key.is_empty() {
            let mut value = HeaderValue::from_str(&format!("Bearer {}", self.api_key))
                .map_err(|_| ModelError::Config("api_key is not a valid header value".into()))?;
            // Keeps the value out of reqwest/hyper debug output.
            value.set_sensitive(true);
            builder = builder.header(AUTHORIZATION, value);
        }
        let mut resp = builder
            .send()
            .await
            .map_err(|e| ModelError::Transport(e.without_url().to_string()))?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        if status.as_u16() == 429 {
            return Err(ModelError::RateLimited { retry_after });
        }
        if !status.is_success() {
            // The status already says what happened: a peer that trickles its error body does not hold the call
            // for the whole answer timeout.
            let read =
                tokio::time::timeout(ERROR_BODY_TIME, read_start(&mut resp, ERROR_BODY_BYTES));
            let body = match read.await {
                Ok(Ok(b)) => self.excerpt(&b, b.len() == ERROR_BODY_BYTES),
                _ => String::from("<unreadable body>"),
            };
            return Err(ModelError::Status {
                status: status.as_u16(),
                body,
            });
        }
        let bytes = read_limited(&mut resp, MAX_RESPONSE_BYTES).await?;
        let parsed: WireResponse =
            serde_json::from_slice(&bytes).map_err(|e| ModelError::BadResponse(parse_error(&e)))?;
        let usage = parsed
            .usage
            .ok_or_else(|| ModelError::BadResponse("no usage".into()))?;
        // A count past any model on offer is not believed: counted, it would spend the organisation's month at once.
        if usage.prompt_tokens.max(usage.completion_tokens) > MAX_TOKENS_TOLD {
            return Err(ModelError::BadResponse(format!(
                "usage of {} input and {} output tokens is past any model on offer ({MAX_TOKENS_TOLD})",
                usage.prompt_tokens, usage.completion_tokens
            )));
        }
        let text = match parsed.choices.and_then(|first| first.0) {
            Some(choice) => (choice.message.and_then(|m| m.content)).ok_or("choice has no content"),
            None => Err("no choices"),
        };
        match text {
            Ok(text) => Ok(ChatResponse {
                text,
                model: (parsed.model)
                    .filter(|m| is_model_name(m))
                    .unwrap_or_else(|| self.model.clone()),
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
            }),
            Err(why) => Err(ModelError::Unusable {
                why: why.into(),
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
            }),
        }
    }

    /// A short, key-free excerpt of an error body (some providers echo the presented key back); `cut` says the read
    /// stopped before the body's end.
    fn excerpt(&self, body: &[u8], cut: bool) -> String {
        let text = String::from_utf8_lossy(body);
        if self.api_key.is_empty() {
            return text.chars().take(ERROR_EXCERPT_CHARS).collect();
        }
        // Echoed with or without its padding, the key is found by what precedes it.
        let key = self.api_key.trim_end_matches('=');
        if key.len() < MIN_REDACTED_KEY {
            // Such a key matches ordinary text (`1` in `401`), and where the marks land would spell it out.
            return "<body withheld: the key is too short to redact>".into();
        }
        // The whole body read (at most ERROR_BODY_BYTES) is redacted before the excerpt is taken: cut first, a key
        // straddling the end keeps its first characters; redacting a window only, each shorter `<redacted>` pulls
        // later text (a key cut at the window's edge too) into the excerpt.
        let mut text = text.into_owned();
        if cut {
            // The read may have stopped inside an echoed key, after the last whole one: that key's start, which no
            // redaction recognises, goes. (Keys are ASCII, so the lossy conversion kept it as it came.)
            let after_last_key = text
                .match_indices(key)
                .last()
                .map_or(0, |(i, _)| i + key.len());
            // Whatever follows it within a key's length of the end goes, a key's start or not: the body was cut
            // anyway, and nothing of a key cut there is left.
            let keep = (text.len().saturating_sub(key.len() - 1)).max(after_last_key);
            text.truncate(text.floor_char_boundary(keep));
        }
        let redacted = text.replace(key, "<redacted>");
        redacted.chars().take(ERROR_EXCERPT_CHARS).collect()
    }
}

/// Whether `key` is made of the characters a bearer token has (RFC 6750 `b64token`), as every provider's keys are.
/// Nothing else is sent: a server that trims, splits or unquotes a header value would echo a part of any other key
/// that the redaction of error answers does not recognise, and an ASCII key survives a cut body's lossy decoding.
fn is_bearer_token(key: &str) -> bool {
    let token = key.trim_end_matches('=');
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// The first `limit` bytes of the body (all of it if shorter); the rest is not read.
async fn read_start(resp: &mut reqwest::Response, limit: usize) -> Result<Vec<u8>, ModelError> {
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| ModelError::Transport(e.without_url().to_string()))?
        else {
            break;
        };
        out.extend_from_slice(&chunk[..chunk.len().min(limit - out.len())]);
    }
    Ok(out)
}

/// Reads the body, refusing more than `limit` bytes so a hostile peer cannot exhaust memory.
async fn read_limited(resp: &mut reqwest::Response, limit: usize) -> Result<Vec<u8>, ModelError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(ModelError::BadResponse(format!(
            "response larger than {limit} bytes"
        )));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ModelError::Transport(e.without_url().to_string()))?
    {
        if out.len() + chunk.len() > limit {
            return Err(ModelError::BadResponse(format!(
                "response larger than {limit} bytes"
            )));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

#[async_trait]
impl ChatModel for OpenAiCompatible {
    async fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError> {
        // GenAI semantic-convention span; usage is recorded once known.
        let span = tracing::info_span!(
            "chat",
            otel.name = %format!("chat {}", self.model),
            otel.kind = "client",
            gen_ai.operation.name = "chat",
            gen_ai.request.model = %self.model,
            loams.purpose = %req.purpose,
            server.address = self.endpoint.host_str().unwrap_or_default(),
            gen_ai.response.model = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let result = self.send(req).instrument(span.clone()).await;
        match &result {
            Ok(r) => {
                span.record("gen_ai.response.model", r.model.as_str());
                span.record("gen_ai.usage.input_tokens", r.input_tokens);
                span.record("gen_ai.usage.output_tokens", r.output_tokens);
            }
            Err(e) => {
                span.record("error.type", error_type(e));
                if let ModelError::Unusable {
                    input_tokens,
                    output_tokens,
                    ..
                } = e
                {
                    // Billed all the same: traces count what the provider charges.
                    span.record("gen_ai.usage.input_tokens", input_tokens);
                    span.record("gen_ai.usage.output_tokens", output_tokens);
                }
            }
        }
        result
    }
}

/// Whether an answer's `model` reads as a model's name (`deepseek-chat`, `meta-llama/Llama-4-Scout`,
/// `llama3.1:8b-instruct-q4_K_M`, `ft:gpt-4o-mini:my-org:custom_suffix:id`): not empty, short, and of the characters
/// such names use. Anything else (control characters, bidirectional overrides, line
/// separators) could disguise what a trace shows.
fn is_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODEL_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:/@+-".contains(c))
}

/// Why an answer is not a chat completion: at most `MAX_PARSE_ERROR` bytes of serde's message, up to any `"`, and where
/// it stopped. What follows a `"` is a string of the answer (a mistyped value, quoted whole: up to six times the body
/// while the error lives), which may hold anything, the presented key included; it is neither kept nor copied.
fn parse_error(e: &serde_json::Error) -> String {
    /// Keeps the first `limit` bytes written to it, then refuses the rest.
    struct Start {
        kept: String,
        limit: usize,
    }
    impl fmt::Write for Start {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let room = self.limit.saturating_sub(self.kept.len());
            self.kept.push_str(&s[..s.floor_char_boundary(room)]);
            if s.len() > room {
                Err(fmt::Error)
            } else {
                Ok(())
            }
        }
    }
    // `Display` ends the message with its position, given whole below.
    let position = format!(" at line {} column {}", e.line(), e.column());
    let mut start = Start {
        kept: String::new(),
        limit: MAX_PARSE_ERROR + position.len(),
    };
    let _ = fmt::write(&mut start, format_args!("{e}"));
    // A message cut short lost its position too: it is cut to the limit instead.
    let message = match start.kept.strip_suffix(&position) {
        Some(message) => message,
        None => &start.kept[..start.kept.floor_char_boundary(MAX_PARSE_ERROR)],
    };
    let message = message.split('"').next().unwrap_or_default().trim_end();
    format!(
        "not a chat completion: {message} (line {}, column {})",
        e.line(),
        e.column()
    )
}

fn error_type(e: &ModelError) -> &'static str {
    match e {
        ModelError::Transport(_) => "transport",
        ModelError::Status { .. } => "http_status",
        ModelError::RateLimited { .. } => "rate_limited",
        ModelError::BadResponse(_) => "bad_response",
        ModelError::Unusable { .. } => "unusable",
        ModelError::CassetteExhausted { .. } => "cassette_exhausted",
        ModelError::Config(_) => "config",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message a bad answer keeps of an error serde reports as `message`.
    fn kept(message: String) -> String {
        let reason = parse_error(&<serde_json::Error as serde::de::Error>::custom(message));
        let kept = reason.strip_prefix("not a chat completion: ").unwrap();
        kept.split(" (line ").next().unwrap().to_string()
    }

    #[test]
    fn a_parse_error_keeps_at_most_its_limit_and_no_part_of_its_position() {
        // Built directly (serde prints numbers short, so a real answer's message rarely gets this long). Just over the
        // limit, the position is half kept before the cut; far over it, none is; either way the limit holds.
        let just_over = format!("{} at line 1 column 2", "x".repeat(MAX_PARSE_ERROR + 5));
        let e = <serde_json::Error as serde::de::Error>::custom(just_over.clone());
        assert_eq!(
            (e.line(), e.column()),
            (1, 2),
            "the error lost its position"
        );
        let far_over = format!("invalid type: `{}`, expected u64", "1".repeat(200));
        for message in [just_over, far_over] {
            let kept = kept(message);
            assert_eq!(kept.len(), MAX_PARSE_ERROR, "{kept}");
            assert!(!kept.contains(" at line"), "{kept}");
        }
    }

    #[tokio::test]
    async fn the_http_client_is_built_on_the_first_request_and_kept() {
        let model = OpenAiCompatible::new(ModelConfig {
            base_url: "http://127.0.0.1:9".into(),
            ..ModelConfig::default()
        })
        .unwrap();
        assert!(model.http.get().is_none(), "built by new");
        let first: *const reqwest::Client = model.http().await.unwrap();
        assert!(
            std::ptr::eq(first, model.http().await.unwrap()),
            "built again"
        );
    }

    #[test]
    fn a_key_cut_by_the_end_of_the_excerpt_leaves_none_of_it() {
        let key = "sk-0123456789abcdef";
        let model = OpenAiCompatible::new(ModelConfig {
            api_key: key.into(),
            ..ModelConfig::default()
        })
        .unwrap();
        let body = format!("{}{key} and more", "x".repeat(ERROR_EXCERPT_CHARS - 5));
        let excerpt = model.excerpt(body.as_bytes(), false);
        assert_eq!(excerpt.chars().count(), ERROR_EXCERPT_CHARS);
        assert!(!excerpt.contains(&key[..5]), "{excerpt}");

        // A full key first, then one that reaches past the excerpt's end once the first is redacted.
        let body = format!("{key}{}{key}", "y".repeat(ERROR_EXCERPT_CHARS - 14));
        let excerpt = model.excerpt(body.as_bytes(), false);
        assert!(!excerpt.contains("sk-"), "{excerpt}");
    }

    #[test]
    fn a_long_key_cut_by_the_read_leaves_none_of_it() {
        // A bearer token of a few KB, echoed until the read stops in the middle of one: redacted, the whole keys
        // shrink so far that the cut one's start would come into the excerpt. The second must not lose its end to
        // the trim.
        for key in [
            format!("eyJ{}", "k".repeat(1_997)),
            // Ends as it starts, and the read stops right after a whole one.
            format!("eyJ{}eyJ", "k".repeat(2_042)),
        ] {
            let model = OpenAiCompatible::new(ModelConfig {
                api_key: key.clone(),
                ..ModelConfig::default()
            })
            .unwrap();
            let body = key.repeat(40);
            let read = &body.as_bytes()[..ERROR_BODY_BYTES];
            let excerpt = model.excerpt(read, true);
            assert!(excerpt.starts_with("<redacted><redacted>"), "{excerpt}");
            assert!(!excerpt.contains("eyJ"), "{excerpt}");
            // Where the read stops inside a key, without the trim its start is in the excerpt: the test reaches
            // the case.
            if !ERROR_BODY_BYTES.is_multiple_of(key.len()) {
                assert!(model.excerpt(read, false).contains("eyJ"));
            }
        }
    }

    #[test]
    fn a_cut_key_goes_whole_and_the_text_before_it_stays() {
        // Whole keys shrink the text to fit the excerpt; then one character, then a key cut one short of whole.
        let key = format!("eyJ{}", "k".repeat(2_045));
        let model = OpenAiCompatible::new(ModelConfig {
            api_key: key.clone(),
            ..ModelConfig::default()
        })
        .unwrap();
        let body = format!("{}x{}", key.repeat(31), &key[..key.len() - 1]);
        assert_eq!(body.len(), ERROR_BODY_BYTES);
        let expected = format!("{}x", "<redacted>".repeat(31));
        assert_eq!(model.excerpt(body.as_bytes(), true), expected);
    }

    #[test]
    fn a_key_is_redacted_without_its_padding_and_a_short_one_withholds_the_body() {
        let model = |key: &str| {
            OpenAiCompatible::new(ModelConfig {
                api_key: key.into(),
                ..ModelConfig::default()
            })
            .unwrap()
        };
        let padded = model("sk-AbCdEfGh==");
        let excerpt = padded.excerpt(b"invalid key sk-AbCdEfGh, was sk-AbCdEfGh==", false);
        assert_eq!(excerpt, "invalid key <redacted>, was <redacted>==");
        // Eight characters are redacted; seven are too few, padding not counted.
        let eight = model("sk-12345");
        let excerpt = eight.excerpt(b"{\"code\":401,\"error\":\"bad key sk-12345\"}", false);
        assert_eq!(excerpt, "{\"code\":401,\"error\":\"bad key <redacted>\"}");
        for key in ["sk-1234", "sk-1234="] {
            let body = format!("{{\"code\":401,\"error\":\"bad key {key}\"}}");
            let excerpt = model(key).excerpt(body.as_bytes(), false);
            assert!(
                !excerpt.contains("1234") && !excerpt.contains("401"),
                "{key}: {excerpt}"
            );
        }
    }
}
