//! Connect client on reqwest.

use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::time::Instant;

use super::envelope::{self, Decoder};
use super::error::WireError;
use super::server::DEFAULT_MAX_MESSAGE_BYTES;
use super::{Code, Codec, ConnectError, ConnectMessage, EndStream, headers};

/// Limit of a non-200 error body; Connect error JSON is small, anything larger is not one.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// A Connect client for one base URL. Cheap to clone (reqwest's client is reference-counted).
#[derive(Clone, Debug)]
pub struct ConnectClient {
    http: reqwest::Client,
    base_url: String,
    headers: HeaderMap,
    codec: Codec,
    timeout: Option<Duration>,
    max_response_bytes: usize,
}

impl ConnectClient {
    /// A client for `base_url` (e.g. `http://127.0.0.1:8080`; a path prefix is kept) with the proto codec, no timeout
    /// and a 1 MiB limit per response message.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self::with_http_client(reqwest::Client::new(), base_url)
    }

    /// Shares an existing reqwest client (connection pool, TLS settings).
    pub fn with_http_client(http: reqwest::Client, base_url: impl Into<String>) -> Self {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        Self {
            http,
            base_url,
            headers: HeaderMap::new(),
            codec: Codec::Proto,
            timeout: None,
            max_response_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Adds a header sent with every call (e.g. `authorization`). Fails with `invalid_argument` on an invalid name or
    /// value.
    pub fn with_header<K, V>(mut self, name: K, value: V) -> Result<Self, ConnectError>
    where
        HeaderName: TryFrom<K>,
        HeaderValue: TryFrom<V>,
    {
        let name = HeaderName::try_from(name)
            .map_err(|_| ConnectError::invalid_argument("invalid header name"))?;
        let value = HeaderValue::try_from(value)
            .map_err(|_| ConnectError::invalid_argument("invalid header value"))?;
        self.headers.append(name, value);
        Ok(self)
    }

    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// Deadline of each call (a whole stream included, counted from the `server_stream` call): sent as
    /// `connect-timeout-ms` and enforced locally.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Limit of one response message (a unary body or one streaming envelope).
    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        self.max_response_bytes = limit;
        self
    }

    fn request(
        &self,
        path: &str,
        content_type: &'static str,
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let mut builder = self
            .http
            .post(format!("{}{}", self.base_url, path))
            .headers(self.headers.clone())
            .header(CONTENT_TYPE, content_type)
            .header(headers::PROTOCOL_VERSION, "1")
            .body(body);
        if let Some(timeout) = self.timeout {
            builder = builder.header(headers::TIMEOUT_MS, timeout_header(timeout));
        }
        builder
    }

    /// Calls a unary procedure (`/<package>.<Service>/<Method>`).
    pub async fn unary<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        req: &Req,
    ) -> Result<Resp, ConnectError> {
        let body = self.codec.encode(req)?;
        let call = async {
            let response = self
                .request(path, self.codec.unary_content_type(), body)
                .send()
                .await
                .map_err(transport_error)?;
            if response.status() != StatusCode::OK {
                return Err(error_from_response(response).await);
            }
            check_content_type(response.headers(), self.codec.unary_content_type())?;
            let bytes = read_limited(response, self.max_response_bytes).await?;
            decode_response(self.codec, &bytes)
        };
        match self.timeout {
            None => call.await,
            Some(t) => tokio::time::timeout(t, call)
                .await
                .unwrap_or_else(|_| Err(deadline_exceeded())),
        }
    }

    /// Calls a server-streaming procedure. The request is sent when the stream is first polled; the stream yields
    /// each response message, then ends, or yields one error (from the EndStream frame, the transport, or the
    /// deadline) and ends.
    pub fn server_stream<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        req: &Req,
    ) -> impl Stream<Item = Result<Resp, ConnectError>> + Send + 'static {
        let codec = self.codec;
        let max = self.max_response_bytes;
        let deadline = self.timeout.map(|t| Instant::now() + t);
        let request = self
            .codec
            .encode(req)
            .and_then(|payload| envelope::encode(0, &payload))
            .map(|framed| self.request(path, codec.stream_content_type(), framed.to_vec()));

        let state = StreamState::Start(Box::new(request));
        futures::stream::unfold(state, move |state| async move {
            let step = next_stream_item::<Resp>(state, codec, max);
            let (item, next) = match deadline {
                None => step.await,
                Some(at) => tokio::time::timeout_at(at, step)
                    .await
                    .unwrap_or_else(|_| (Some(Err(deadline_exceeded())), StreamState::Done)),
            };
            item.map(|item| (item, next))
        })
    }
}

enum StreamState {
    Start(Box<Result<reqwest::RequestBuilder, ConnectError>>),
    Reading {
        body: BoxStream<'static, reqwest::Result<Bytes>>,
        decoder: Decoder,
    },
    Done,
}

/// One step of the response stream: the next item (None = finished) and the state after it.
async fn next_stream_item<Resp: ConnectMessage>(
    state: StreamState,
    codec: Codec,
    max: usize,
) -> (Option<Result<Resp, ConnectError>>, StreamState) {
    let (mut body, mut decoder) = match state {
        StreamState::Done => return (None, StreamState::Done),
        StreamState::Start(request) => match open_stream(*request, codec).await {
            Ok(body) => (body, Decoder::new(max)),
            Err(e) => return (Some(Err(e)), StreamState::Done),
        },
        StreamState::Reading { body, decoder } => (body, decoder),
    };
    loop {
        match decoder.next_frame() {
            Err(e) => return (Some(Err(e)), StreamState::Done),
            Ok(Some(frame)) if frame.is_end_stream() => {
                return match EndStream::decode(&frame.payload) {
                    Ok(()) => (None, StreamState::Done),
                    Err(e) => (Some(Err(e)), StreamState::Done),
                };
            }
            Ok(Some(frame)) if frame.is_compressed() => {
                let e = ConnectError::internal(
                    "server sent a compressed message that was not negotiated",
                );
                return (Some(Err(e)), StreamState::Done);
            }
            Ok(Some(frame)) => {
                let item = decode_response(codec, &frame.payload);
                let next = if item.is_ok() {
                    StreamState::Reading { body, decoder }
                } else {
                    StreamState::Done
                };
                return (Some(item), next);
            }
            Ok(None) => {}
        }
        match body.next().await {
            Some(Ok(chunk)) => decoder.push(&chunk),
            Some(Err(e)) => return (Some(Err(transport_error(e))), StreamState::Done),
            None => {
                // A stream cut before EndStream (connection lost, proxy timeout) is worth retrying with a cursor.
                let e = ConnectError::unavailable("stream ended without an EndStream frame");
                return (Some(Err(e)), StreamState::Done);
            }
        }
    }
}

async fn open_stream(
    request: Result<reqwest::RequestBuilder, ConnectError>,
    codec: Codec,
) -> Result<BoxStream<'static, reqwest::Result<Bytes>>, ConnectError> {
    let response = request?.send().await.map_err(transport_error)?;
    if response.status() != StatusCode::OK {
        return Err(error_from_response(response).await);
    }
    check_content_type(response.headers(), codec.stream_content_type())?;
    Ok(response.bytes_stream().boxed())
}

fn timeout_header(timeout: Duration) -> String {
    // At most 10 digits on the wire; anything longer than ~115 days is "no practical deadline" anyway.
    timeout.as_millis().clamp(1, 9_999_999_999).to_string()
}

fn deadline_exceeded() -> ConnectError {
    ConnectError::deadline_exceeded("the call's timeout elapsed")
}

fn transport_error(e: reqwest::Error) -> ConnectError {
    if e.is_timeout() {
        deadline_exceeded()
    } else {
        ConnectError::unavailable(format!("transport: {e}"))
    }
}

/// A response message that does not decode means the server broke the contract, not the caller: `internal`.
fn decode_response<Resp: ConnectMessage>(codec: Codec, bytes: &[u8]) -> Result<Resp, ConnectError> {
    codec
        .decode(bytes)
        .map_err(|e| ConnectError::internal(format!("bad response message: {}", e.message)))
}

fn check_content_type(h: &HeaderMap, expected: &str) -> Result<(), ConnectError> {
    let got = h
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = got.split(';').next().unwrap_or_default().trim();
    if media.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        Err(ConnectError::internal(format!(
            "unexpected response content type {got:?}, wanted {expected}"
        )))
    }
}

/// Reads a body of at most `limit` bytes; more is `resource_exhausted`.
async fn read_limited(response: reqwest::Response, limit: usize) -> Result<Vec<u8>, ConnectError> {
    let too_big =
        || ConnectError::resource_exhausted(format!("response exceeds the limit of {limit} bytes"));
    let declared = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_big());
    }
    let mut body = response.bytes_stream();
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(transport_error)?;
        if out.len() + chunk.len() > limit {
            return Err(too_big());
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// The error of a non-200 response: the Connect error JSON if the body is one, else a code inferred from the status.
async fn error_from_response(response: reqwest::Response) -> ConnectError {
    let status = response.status();
    let is_json = check_content_type(response.headers(), "application/json").is_ok();
    let fallback = || ConnectError::new(Code::from_http_status(status), format!("HTTP {status}"));
    if !is_json {
        return fallback();
    }
    match read_limited(response, MAX_ERROR_BODY_BYTES).await {
        Ok(bytes) => match serde_json::from_slice::<WireError>(&bytes) {
            Ok(wire) => ConnectError::from_wire(wire),
            Err(_) => fallback(),
        },
        Err(_) => fallback(),
    }
}
