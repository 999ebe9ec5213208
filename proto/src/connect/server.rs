//! Connect server on axum: register unary and server-streaming handlers by procedure path, get an `axum::Router`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::routing::{MethodRouter, post};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;
use tracing::Instrument;

use super::envelope::{self, FLAG_END_STREAM};
use super::{Codec, ConnectError, ConnectMessage, EndStream, headers};

/// Default limit of one request message (a unary body or one streaming envelope): 1 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1 << 20;

/// What a handler knows about its call besides the request message.
#[derive(Clone, Debug)]
pub struct CallContext {
    procedure: Arc<str>,
    headers: HeaderMap,
    deadline: Option<Instant>,
    codec: Codec,
}

impl CallContext {
    /// The procedure path, e.g. `/loams.factory.v1.FactoryService/GetRun`.
    pub fn procedure(&self) -> &str {
        &self.procedure
    }

    /// All request headers (`authorization` and friends).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// A header as text; `None` if absent or not visible ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// When the client stops waiting (from `connect-timeout-ms`). The server enforces it too; handlers may use it
    /// to bound their own outgoing calls.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    pub fn codec(&self) -> Codec {
        self.codec
    }
}

type Route = Box<dyn FnOnce(Arc<Config>) -> MethodRouter + Send>;

#[derive(Debug)]
struct Config {
    max_message_bytes: usize,
}

/// Builder of a Connect service router.
///
/// ```
/// use futures::stream;
/// use loams_proto::connect::{self, CallContext, ConnectError};
/// use loams_proto::factory::v1::{GetRunRequest, GetRunResponse, WatchRunRequest, WatchRunResponse};
///
/// let app: axum::Router = connect::Router::new()
///     .unary("/loams.factory.v1.FactoryService/GetRun", |ctx: CallContext, req: GetRunRequest| async move {
///         let _token = ctx.header("authorization").ok_or_else(|| ConnectError::unauthenticated("no token"))?;
///         Err::<GetRunResponse, _>(ConnectError::not_found(format!("no run {}", req.run_id)))
///     })
///     .server_stream("/loams.factory.v1.FactoryService/WatchRun", |_ctx: CallContext, _req: WatchRunRequest| async move {
///         Ok(stream::iter(vec![Ok::<_, ConnectError>(WatchRunResponse::default())]))
///     })
///     .into_axum_router();
/// ```
///
/// Only POST is routed (others get 405). The returned router answers unknown paths with a Connect `unimplemented`
/// error (HTTP 404) through its fallback, so merge other axum routes into it rather than giving them a fallback too.
pub struct Router {
    routes: Vec<(String, Route)>,
    max_message_bytes: usize,
}

impl Default for Router {
    fn default() -> Self {
        Self::new()
    }
}

impl Router {
    pub fn new() -> Self {
        Self {
            routes: Vec::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Limit of one request message: a unary body, or each envelope of a streaming request.
    pub fn max_message_bytes(mut self, limit: usize) -> Self {
        self.max_message_bytes = limit;
        self
    }

    /// Registers a unary procedure at `path` (`/<package>.<Service>/<Method>`).
    pub fn unary<Req, Resp, F, Fut>(mut self, path: &str, handler: F) -> Self
    where
        Req: ConnectMessage,
        Resp: ConnectMessage,
        F: Fn(CallContext, Req) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, ConnectError>> + Send + 'static,
    {
        let procedure: Arc<str> = Arc::from(path);
        let route: Route = Box::new(move |config: Arc<Config>| {
            post(move |request: Request| {
                let handler = handler.clone();
                let procedure = procedure.clone();
                let span = tracing::info_span!("connect.unary", procedure = %procedure);
                async move { serve_unary(config, procedure, request, handler).await }
                    .instrument(span)
            })
        });
        self.routes.push((path.to_owned(), route));
        self
    }

    /// Registers a server-streaming procedure. The handler's future resolves to the response stream; an `Err` item
    /// ends the stream with that error in the EndStream frame.
    pub fn server_stream<Req, Resp, F, Fut, S>(mut self, path: &str, handler: F) -> Self
    where
        Req: ConnectMessage,
        Resp: ConnectMessage,
        F: Fn(CallContext, Req) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<S, ConnectError>> + Send + 'static,
        S: Stream<Item = Result<Resp, ConnectError>> + Send + 'static,
    {
        let procedure: Arc<str> = Arc::from(path);
        let route: Route = Box::new(move |config: Arc<Config>| {
            post(move |request: Request| {
                let handler = handler.clone();
                let procedure = procedure.clone();
                let span = tracing::info_span!("connect.server_stream", procedure = %procedure);
                async move { serve_stream(config, procedure, request, handler).await }
                    .instrument(span)
            })
        });
        self.routes.push((path.to_owned(), route));
        self
    }

    pub fn into_axum_router(self) -> axum::Router {
        let config = Arc::new(Config {
            max_message_bytes: self.max_message_bytes,
        });
        let mut router = axum::Router::new();
        for (path, route) in self.routes {
            router = router.route(&path, route(config.clone()));
        }
        // The protocol answers an unknown procedure with 404 (which clients read as `unimplemented`), not 501.
        router.fallback(|request: Request| async move {
            let err =
                ConnectError::unimplemented(format!("no procedure at {}", request.uri().path()));
            error_response_with_status(&err, StatusCode::NOT_FOUND)
        })
    }
}

impl From<Router> for axum::Router {
    fn from(router: Router) -> Self {
        router.into_axum_router()
    }
}

/// The unary error response: status from the code, Connect error JSON body, metadata as headers.
fn error_response(err: &ConnectError) -> Response {
    error_response_with_status(err, err.code.http_status())
}

fn error_response_with_status(err: &ConnectError, status: StatusCode) -> Response {
    let mut response = Response::new(Body::from(err.to_json()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (key, values) in &err.metadata {
        let Ok(name) = HeaderName::try_from(key.as_str()) else {
            continue;
        };
        for value in values {
            if let Ok(value) = HeaderValue::try_from(value.as_str()) {
                headers.append(name.clone(), value);
            }
        }
    }
    response
}

fn unsupported_media_type(content_type: Option<&str>, accepted: [&'static str; 2]) -> Response {
    // 415 maps to `unknown` on clients that ignore the body; say the same in the body.
    let err = ConnectError::unknown(format!(
        "unsupported content type {:?}; use {} or {}",
        content_type.unwrap_or(""),
        accepted[0],
        accepted[1]
    ));
    let mut response = error_response_with_status(&err, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    response.headers_mut().insert(
        http::header::HeaderName::from_static("accept-post"),
        HeaderValue::from_str(&accepted.join(", "))
            .unwrap_or(HeaderValue::from_static("application/proto")),
    );
    response
}

/// Checks the protocol headers shared by unary and streaming calls and returns the deadline.
fn check_headers(h: &HeaderMap, encoding_header: &str) -> Result<Option<Instant>, ConnectError> {
    if let Some(version) = h.get(headers::PROTOCOL_VERSION) {
        // Absent is tolerated (browsers' simple requests); present must be "1".
        if version.as_bytes() != b"1" {
            return Err(ConnectError::invalid_argument(
                "connect-protocol-version must be 1",
            ));
        }
    }
    if let Some(encoding) = h.get(encoding_header)
        && !encoding.as_bytes().eq_ignore_ascii_case(b"identity")
    {
        return Err(ConnectError::unimplemented(format!(
            "{encoding_header} {:?} is not supported; send uncompressed messages",
            String::from_utf8_lossy(encoding.as_bytes())
        )));
    }
    parse_timeout(h).map(|t| t.map(|ms| Instant::now() + Duration::from_millis(ms)))
}

fn parse_timeout(h: &HeaderMap) -> Result<Option<u64>, ConnectError> {
    let Some(value) = h.get(headers::TIMEOUT_MS) else {
        return Ok(None);
    };
    let bytes = value.as_bytes();
    // The protocol allows at most 10 ASCII digits.
    if bytes.is_empty() || bytes.len() > 10 || !bytes.iter().all(u8::is_ascii_digit) {
        return Err(ConnectError::invalid_argument(
            "connect-timeout-ms must be 1 to 10 digits",
        ));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|_| ConnectError::invalid_argument("bad connect-timeout-ms"))?;
    text.parse::<u64>()
        .map(Some)
        .map_err(|_| ConnectError::invalid_argument("bad connect-timeout-ms"))
}

/// Reads the whole body, failing with `resource_exhausted` past `limit` bytes.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, ConnectError> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(
            ConnectError::resource_exhausted(format!("request exceeds the limit of {limit} bytes")),
        ),
        Err(e) => Err(ConnectError::canceled(format!("reading request body: {e}"))),
    }
}

fn declared_length_over(h: &HeaderMap, limit: usize) -> bool {
    h.get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > limit as u64)
}

/// Runs `fut` against the optional deadline.
async fn with_deadline<T>(
    deadline: Option<Instant>,
    fut: impl Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match deadline {
        None => fut.await,
        Some(at) => tokio::time::timeout_at(at, fut).await.unwrap_or_else(|_| {
            Err(ConnectError::deadline_exceeded(
                "the call's connect-timeout-ms elapsed",
            ))
        }),
    }
}

async fn serve_unary<Req, Resp, F, Fut>(
    config: Arc<Config>,
    procedure: Arc<str>,
    request: Request,
    handler: F,
) -> Response
where
    Req: ConnectMessage,
    Resp: ConnectMessage,
    F: FnOnce(CallContext, Req) -> Fut,
    Fut: Future<Output = Result<Resp, ConnectError>>,
{
    let (parts, body) = request.into_parts();
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let Some(codec) = content_type.and_then(Codec::from_unary_content_type) else {
        return unsupported_media_type(content_type, ["application/proto", "application/json"]);
    };
    let deadline = match check_headers(&parts.headers, headers::CONTENT_ENCODING) {
        Ok(d) => d,
        Err(e) => return error_response(&e),
    };
    let limit = config.max_message_bytes;
    let ctx = CallContext {
        procedure,
        headers: parts.headers,
        deadline,
        codec,
    };
    let result = with_deadline(deadline, async move {
        if declared_length_over(&ctx.headers, limit) {
            return Err(ConnectError::resource_exhausted(format!(
                "request exceeds the limit of {limit} bytes"
            )));
        }
        let bytes = read_body(body, limit).await?;
        let req: Req = codec.decode(&bytes)?;
        let resp = handler(ctx, req).await?;
        codec.encode(&resp)
    })
    .await;
    match result {
        Ok(bytes) => {
            let mut response = Response::new(Body::from(bytes));
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(codec.unary_content_type()),
            );
            response
        }
        Err(e) => {
            tracing::debug!(code = %e.code, message = %e.message, "connect error");
            error_response(&e)
        }
    }
}

async fn serve_stream<Req, Resp, F, Fut, S>(
    config: Arc<Config>,
    procedure: Arc<str>,
    request: Request,
    handler: F,
) -> Response
where
    Req: ConnectMessage,
    Resp: ConnectMessage,
    F: FnOnce(CallContext, Req) -> Fut,
    Fut: Future<Output = Result<S, ConnectError>>,
    S: Stream<Item = Result<Resp, ConnectError>> + Send + 'static,
{
    let (parts, body) = request.into_parts();
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let Some(codec) = content_type.and_then(Codec::from_stream_content_type) else {
        return unsupported_media_type(
            content_type,
            ["application/connect+proto", "application/connect+json"],
        );
    };
    let limit = config.max_message_bytes;
    // Past content negotiation every outcome, errors included, is an HTTP 200 stream ending in EndStream.
    let started = async {
        let deadline = check_headers(&parts.headers, headers::STREAM_CONTENT_ENCODING)?;
        let ctx = CallContext {
            procedure,
            headers: parts.headers,
            deadline,
            codec,
        };
        let stream = with_deadline(deadline, async {
            let req: Req = read_single_envelope(body, limit, codec).await?;
            handler(ctx, req).await
        })
        .await?;
        Ok::<_, ConnectError>((stream, deadline))
    }
    .await;

    let frames = match started {
        Ok((stream, deadline)) => response_frames(Box::pin(stream), deadline, codec).boxed(),
        Err(e) => futures::stream::once(async move { end_frame(Err(&e)) }).boxed(),
    };
    let mut response = Response::new(Body::from_stream(
        frames.map(Ok::<_, std::convert::Infallible>),
    ));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(codec.stream_content_type()),
    );
    response
}

/// The one enveloped request message of a server-streaming call.
async fn read_single_envelope<Req: ConnectMessage>(
    body: Body,
    limit: usize,
    codec: Codec,
) -> Result<Req, ConnectError> {
    let bytes = read_body(body, limit.saturating_add(5)).await?;
    let mut decoder = envelope::Decoder::new(limit);
    decoder.push(&bytes);
    let frame = decoder.next_frame()?.ok_or_else(|| {
        ConnectError::invalid_argument("request is not one complete Connect envelope")
    })?;
    if !decoder.is_empty() {
        return Err(ConnectError::invalid_argument(
            "a server-streaming request carries exactly one message",
        ));
    }
    if frame.is_compressed() {
        return Err(ConnectError::invalid_argument(
            "compressed envelope without a negotiated encoding",
        ));
    }
    if frame.is_end_stream() {
        return Err(ConnectError::invalid_argument(
            "unexpected EndStream flag in a request",
        ));
    }
    codec.decode(&frame.payload)
}

fn end_frame(result: Result<(), &ConnectError>) -> Bytes {
    if let Err(e) = result {
        tracing::debug!(code = %e.code, message = %e.message, "connect stream error");
    }
    // An EndStream payload is a few hundred bytes; it cannot reach 4 GiB.
    envelope::encode(FLAG_END_STREAM, &EndStream::encode(result)).unwrap_or_default()
}

enum StreamState<S> {
    Open(Pin<Box<S>>),
    Done,
}

/// Messages as flags-0 envelopes, then exactly one EndStream frame: `{}` after the last message, or the error of an
/// `Err` item, an encoding failure, or the deadline.
fn response_frames<Resp, S>(
    stream: Pin<Box<S>>,
    deadline: Option<Instant>,
    codec: Codec,
) -> impl Stream<Item = Bytes> + Send
where
    Resp: ConnectMessage,
    S: Stream<Item = Result<Resp, ConnectError>> + Send + 'static,
{
    futures::stream::unfold(StreamState::Open(stream), move |state| async move {
        let StreamState::Open(mut stream) = state else {
            return None;
        };
        let next = match deadline {
            None => stream.next().await,
            Some(at) => match tokio::time::timeout_at(at, stream.next()).await {
                Ok(next) => next,
                Err(_) => Some(Err(ConnectError::deadline_exceeded(
                    "the call's connect-timeout-ms elapsed",
                ))),
            },
        };
        let frame = match next {
            Some(Ok(message)) => match codec
                .encode(&message)
                .and_then(|bytes| envelope::encode(0, &bytes))
            {
                Ok(frame) => return Some((frame, StreamState::Open(stream))),
                Err(e) => end_frame(Err(&e)),
            },
            Some(Err(e)) => end_frame(Err(&e)),
            None => end_frame(Ok(())),
        };
        Some((frame, StreamState::Done))
    })
}
