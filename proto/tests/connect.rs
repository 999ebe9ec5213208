//! The Connect server and client against each other and against raw HTTP, on 127.0.0.1:0.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use loams_proto::connect::{self, CallContext, Code, Codec, ConnectClient, ConnectError};
use loams_proto::factory::v1::{
    Budget, GetRunRequest, GetRunResponse, KillRunRequest, KillRunResponse, Run, RunLinks,
    TimelineEvent, WatchRunRequest, WatchRunResponse, watch_run_response::Item,
};
use prost::Message;

const GET_RUN: &str = "/loams.factory.v1.FactoryService/GetRun";
const KILL_RUN: &str = "/loams.factory.v1.FactoryService/KillRun";
const WATCH_RUN: &str = "/loams.factory.v1.FactoryService/WatchRun";
const LIMIT: usize = 1024;

fn run(id: &str) -> Run {
    Run {
        id: id.to_owned(),
        org: "acme".into(),
        links: Some(RunLinks {
            deploy_ref: "deploy-7".into(),
            ..Default::default()
        }),
        budget: Some(Budget {
            limit_micros: 5_000_000,
            ..Default::default()
        }),
        started_at_ms: 1_700_000_000_000,
        version: 3,
        ..Default::default()
    }
}

fn event(seq: u64) -> WatchRunResponse {
    WatchRunResponse {
        item: Some(Item::Event(TimelineEvent {
            seq,
            r#type: "stage_started".into(),
            ..Default::default()
        })),
    }
}

/// `run_id` drives the behaviour: `err:<code>` fails with that code, `slow` never answers in time, `big` answers with
/// a large message.
async fn get_run(_ctx: CallContext, req: GetRunRequest) -> Result<GetRunResponse, ConnectError> {
    if let Some(code) = req.run_id.strip_prefix("err:") {
        let code =
            Code::from_wire(code).ok_or_else(|| ConnectError::invalid_argument("no such code"))?;
        return Err(ConnectError::new(code, format!("failed with {code}")));
    }
    match req.run_id.as_str() {
        "slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Err(ConnectError::internal("should have timed out"))
        }
        "big" => Ok(GetRunResponse {
            run: Some(Run {
                state: "x".repeat(4 * LIMIT),
                ..run("big")
            }),
        }),
        id => Ok(GetRunResponse { run: Some(run(id)) }),
    }
}

async fn watch_run(
    _ctx: CallContext,
    req: WatchRunRequest,
) -> Result<futures::stream::BoxStream<'static, Result<WatchRunResponse, ConnectError>>, ConnectError>
{
    let snapshot = WatchRunResponse {
        item: Some(Item::Snapshot(run(&req.run_id))),
    };
    let events = (req.after_seq + 1..=req.after_seq + 3).map(|seq| Ok(event(seq)));
    let head = futures::stream::iter(std::iter::once(Ok(snapshot)).chain(events));
    Ok(match req.run_id.as_str() {
        "missing" => return Err(ConnectError::not_found("no run missing")),
        "fail" => head
            .chain(futures::stream::once(async {
                Err(ConnectError::aborted("run was killed").with_metadata("x-run-state", "killed"))
            }))
            .boxed(),
        "slow" => head.chain(futures::stream::pending()).boxed(),
        _ => head.boxed(),
    })
}

async fn serve() -> String {
    let app = connect::Router::new()
        .max_message_bytes(LIMIT)
        .unary(GET_RUN, get_run)
        .unary(
            KILL_RUN,
            |ctx: CallContext, req: KillRunRequest| async move {
                // Echo what the API needs from the context: the authorization header.
                let auth = ctx.header("authorization").unwrap_or_default().to_owned();
                Ok(KillRunResponse {
                    run: Some(Run {
                        id: req.run_id,
                        state: auth,
                        ..Default::default()
                    }),
                })
            },
        )
        .server_stream(WATCH_RUN, watch_run)
        .into_axum_router()
        // A non-Connect route: its plain 503 must still become a Connect error on the client.
        .route(
            "/plain",
            axum::routing::post(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "try later") }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// One shared HTTP client: building one loads the TLS roots, which costs tens of milliseconds each time. No pooled
/// connections, because each test has its own runtime and a connection must not outlive the runtime it was made on.
fn http() -> &'static reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    })
}

fn client(base: &str) -> ConnectClient {
    ConnectClient::with_http_client(http().clone(), base)
}

fn raw_post(
    base: &str,
    path: &str,
    content_type: &str,
    body: impl Into<reqwest::Body>,
) -> reqwest::RequestBuilder {
    http()
        .post(format!("{base}{path}"))
        .header("content-type", content_type)
        .body(body)
}

async fn error_json(resp: reqwest::Response) -> serde_json::Value {
    assert_eq!(resp.headers()["content-type"], "application/json");
    resp.json().await.unwrap()
}

fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Splits a streaming body into (flags, payload) frames.
fn frames(mut body: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        out.push((body[0], body[5..5 + len].to_vec()));
        body = &body[5 + len..];
    }
    out
}

#[tokio::test]
async fn unary_round_trip_with_each_codec() {
    let base = serve().await;
    for codec in [Codec::Proto, Codec::Json] {
        let client = client(&base).with_codec(codec);
        let resp: GetRunResponse = client
            .unary(
                GET_RUN,
                &GetRunRequest {
                    run_id: "r-1".into(),
                },
            )
            .await
            .unwrap();
        assert_eq!(resp.run, Some(run("r-1")), "{codec:?}");
    }
}

#[tokio::test]
async fn handler_sees_request_headers() {
    let base = serve().await;
    let client = client(&base)
        .with_header("authorization", "Bearer t0k")
        .unwrap();
    let resp: KillRunResponse = client
        .unary(
            KILL_RUN,
            &KillRunRequest {
                run_id: "r-2".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let run = resp.run.unwrap();
    assert_eq!((run.id.as_str(), run.state.as_str()), ("r-2", "Bearer t0k"));
}

#[tokio::test]
async fn stream_round_trip_with_each_codec_resumes_after_cursor() {
    let base = serve().await;
    for codec in [Codec::Proto, Codec::Json] {
        let client = client(&base).with_codec(codec);
        let items: Vec<WatchRunResponse> = client
            .server_stream(
                WATCH_RUN,
                &WatchRunRequest {
                    run_id: "r-3".into(),
                    after_seq: 10,
                },
            )
            .try_collect()
            .await
            .unwrap();
        assert_eq!(items.len(), 4, "{codec:?}");
        assert_eq!(items[0].item, Some(Item::Snapshot(run("r-3"))));
        assert_eq!(items[1..].to_vec(), vec![event(11), event(12), event(13)]);
    }
}

#[tokio::test]
async fn every_code_maps_to_its_status_and_round_trips() {
    let base = serve().await;
    let expected = [
        (Code::Canceled, 499),
        (Code::Unknown, 500),
        (Code::InvalidArgument, 400),
        (Code::DeadlineExceeded, 504),
        (Code::NotFound, 404),
        (Code::AlreadyExists, 409),
        (Code::PermissionDenied, 403),
        (Code::ResourceExhausted, 429),
        (Code::FailedPrecondition, 400),
        (Code::Aborted, 409),
        (Code::OutOfRange, 400),
        (Code::Unimplemented, 501),
        (Code::Internal, 500),
        (Code::Unavailable, 503),
        (Code::DataLoss, 500),
        (Code::Unauthenticated, 401),
    ];
    assert_eq!(expected.len(), Code::ALL.len());
    let client = client(&base).with_codec(Codec::Json);
    for (code, status) in expected {
        let body = format!(r#"{{"runId":"err:{code}"}}"#);
        let resp = raw_post(&base, GET_RUN, "application/json", body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{code}");
        let json = error_json(resp).await;
        assert_eq!(
            json,
            serde_json::json!({"code": code.as_str(), "message": format!("failed with {code}")})
        );

        let err = client
            .unary::<_, GetRunResponse>(
                GET_RUN,
                &GetRunRequest {
                    run_id: format!("err:{code}"),
                },
            )
            .await
            .unwrap_err();
        assert_eq!(
            (err.code, err.message),
            (code, format!("failed with {code}"))
        );
    }
}

#[tokio::test]
async fn unknown_procedure_is_unimplemented_404() {
    let base = serve().await;
    let resp = raw_post(
        &base,
        "/loams.factory.v1.FactoryService/Nope",
        "application/json",
        "{}",
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(error_json(resp).await["code"], "unimplemented");

    let err = client(&base)
        .unary::<_, GetRunResponse>("/x.v1.S/M", &GetRunRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::Unimplemented);
}

#[tokio::test]
async fn only_post_is_routed() {
    let base = serve().await;
    let resp = http().get(format!("{base}{GET_RUN}")).send().await.unwrap();
    assert_eq!(resp.status(), 405);
}

#[tokio::test]
async fn unsupported_content_types_get_415() {
    let base = serve().await;
    let resp = raw_post(&base, GET_RUN, "text/plain", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);
    assert_eq!(
        resp.headers()["accept-post"],
        "application/proto, application/json"
    );
    // A unary content type on a streaming procedure, and the other way round.
    let resp = raw_post(&base, WATCH_RUN, "application/json", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);
    let resp = raw_post(
        &base,
        GET_RUN,
        "application/connect+json",
        envelope(0, b"{}"),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 415);
    // Parameters are ignored.
    let resp = raw_post(
        &base,
        GET_RUN,
        "application/json; charset=utf-8",
        r#"{"runId":"r"}"#,
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn malformed_bodies_are_invalid_argument() {
    let base = serve().await;
    for (content_type, body) in [
        ("application/json", b"{\"runId\":".to_vec()),
        ("application/json", b"{\"runId\": 5}".to_vec()),
        ("application/proto", vec![0x0a, 0x05, b'a']), // field 1, length 5, only one byte present
        ("application/proto", vec![0xff, 0xff, 0xff]),
    ] {
        let resp = raw_post(&base, GET_RUN, content_type, body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{content_type} {body:?}");
        assert_eq!(error_json(resp).await["code"], "invalid_argument");
    }
    // Streaming: a truncated envelope and a malformed message both end in an EndStream error, HTTP 200.
    for body in [vec![0, 0, 0, 0, 9, b'{'], envelope(0, b"not json")] {
        let resp = raw_post(&base, WATCH_RUN, "application/connect+json", body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let frames = frames(&resp.bytes().await.unwrap());
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].0, 0x02);
        let end: serde_json::Value = serde_json::from_slice(&frames[0].1).unwrap();
        assert_eq!(end["error"]["code"], "invalid_argument");
    }
}

#[tokio::test]
async fn protocol_headers_are_checked() {
    let base = serve().await;
    let resp = raw_post(&base, GET_RUN, "application/json", "{}")
        .header("connect-protocol-version", "2")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = raw_post(&base, GET_RUN, "application/json", "{}")
        .header("content-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 501);
    assert_eq!(error_json(resp).await["code"], "unimplemented");
    let resp = raw_post(&base, GET_RUN, "application/json", "{}")
        .header("connect-timeout-ms", "12345678901")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = raw_post(&base, GET_RUN, "application/json", "{}")
        .header("connect-protocol-version", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn oversized_requests_are_resource_exhausted() {
    let base = serve().await;
    let body = format!(r#"{{"runId":"{}"}}"#, "a".repeat(LIMIT));
    let resp = raw_post(&base, GET_RUN, "application/json", body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(error_json(resp).await["code"], "resource_exhausted");

    // Chunked (no content-length): the limit holds while reading.
    let chunks = futures::stream::iter(
        (0..LIMIT).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"  "))),
    );
    let resp = raw_post(
        &base,
        GET_RUN,
        "application/json",
        reqwest::Body::wrap_stream(chunks),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 429);

    // Streaming: an envelope declaring more than the limit.
    let mut body = vec![0];
    body.extend_from_slice(&((LIMIT + 1) as u32).to_be_bytes());
    let resp = raw_post(&base, WATCH_RUN, "application/connect+proto", body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let frames = frames(&resp.bytes().await.unwrap());
    let end: serde_json::Value = serde_json::from_slice(&frames[0].1).unwrap();
    assert_eq!(end["error"]["code"], "resource_exhausted");
}

#[tokio::test]
async fn client_limits_response_size() {
    let base = serve().await;
    let client = client(&base).with_max_response_bytes(LIMIT);
    let err = client
        .unary::<_, GetRunResponse>(
            GET_RUN,
            &GetRunRequest {
                run_id: "big".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::ResourceExhausted);
}

#[tokio::test]
async fn server_honours_connect_timeout_ms() {
    let base = serve().await;
    let resp = raw_post(&base, GET_RUN, "application/json", r#"{"runId":"slow"}"#)
        .header("connect-timeout-ms", "50")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 504);
    assert_eq!(error_json(resp).await["code"], "deadline_exceeded");

    let resp = raw_post(
        &base,
        WATCH_RUN,
        "application/connect+json",
        envelope(0, br#"{"runId":"slow"}"#),
    )
    .header("connect-timeout-ms", "50")
    .send()
    .await
    .unwrap();
    let frames = frames(&resp.bytes().await.unwrap());
    assert_eq!(frames.len(), 5, "snapshot, three events, EndStream");
    let end: serde_json::Value = serde_json::from_slice(&frames[4].1).unwrap();
    assert_eq!(end["error"]["code"], "deadline_exceeded");
}

#[tokio::test]
async fn client_timeout_is_deadline_exceeded() {
    let base = serve().await;
    let client = client(&base).with_timeout(Duration::from_millis(100));
    let err = client
        .unary::<_, GetRunResponse>(
            GET_RUN,
            &GetRunRequest {
                run_id: "slow".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::DeadlineExceeded);

    // Long enough for a fresh connection and the first frames on a loaded machine; the slow stream never ends.
    let items: Vec<_> = client
        .with_timeout(Duration::from_secs(2))
        .server_stream::<_, WatchRunResponse>(
            WATCH_RUN,
            &WatchRunRequest {
                run_id: "slow".into(),
                after_seq: 0,
            },
        )
        .collect()
        .await;
    assert_eq!(items.len(), 5);
    assert!(items[..4].iter().all(Result::is_ok));
    assert_eq!(items[4].as_ref().unwrap_err().code, Code::DeadlineExceeded);
}

#[tokio::test]
async fn mid_stream_error_arrives_in_end_stream() {
    let base = serve().await;
    for codec in [Codec::Proto, Codec::Json] {
        let client = client(&base).with_codec(codec);
        let items: Vec<_> = client
            .server_stream::<_, WatchRunResponse>(
                WATCH_RUN,
                &WatchRunRequest {
                    run_id: "fail".into(),
                    after_seq: 0,
                },
            )
            .collect()
            .await;
        assert_eq!(items.len(), 5, "{codec:?}");
        let err = items[4].as_ref().unwrap_err();
        assert_eq!(
            (err.code, err.message.as_str()),
            (Code::Aborted, "run was killed")
        );
        assert_eq!(err.metadata["x-run-state"], vec!["killed".to_owned()]);
    }

    let resp = raw_post(
        &base,
        WATCH_RUN,
        "application/connect+proto",
        envelope(
            0,
            &WatchRunRequest {
                run_id: "fail".into(),
                after_seq: 0,
            }
            .encode_to_vec(),
        ),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "errors after the headers can only travel in EndStream"
    );
    let frames = frames(&resp.bytes().await.unwrap());
    let (flags, payload) = frames.last().unwrap();
    assert_eq!(*flags, 0x02);
    let end: serde_json::Value = serde_json::from_slice(payload).unwrap();
    assert_eq!(
        end,
        serde_json::json!({"error": {"code": "aborted", "message": "run was killed"}, "metadata": {"x-run-state": ["killed"]}})
    );
}

#[tokio::test]
async fn error_before_first_message_is_a_stream_error() {
    let base = serve().await;
    let items: Vec<_> = client(&base)
        .server_stream::<_, WatchRunResponse>(
            WATCH_RUN,
            &WatchRunRequest {
                run_id: "missing".into(),
                after_seq: 0,
            },
        )
        .collect()
        .await;
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].as_ref().unwrap_err().code, Code::NotFound);
}

#[tokio::test]
async fn non_connect_error_bodies_map_from_http_status() {
    let base = serve().await;
    let err = client(&base)
        .unary::<_, GetRunResponse>("/plain", &GetRunRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::Unavailable);
    let err = client("http://127.0.0.1:1")
        .unary::<_, GetRunResponse>(GET_RUN, &GetRunRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code, Code::Unavailable);
}

#[tokio::test]
async fn json_wire_format_is_canonical_proto3_json() {
    let base = serve().await;
    let resp = raw_post(&base, GET_RUN, "application/json", r#"{"runId":"r-9"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let json: serde_json::Value = resp.json().await.unwrap();
    let run = &json["run"];
    assert_eq!(run["id"], "r-9");
    assert_eq!(
        run["links"]["deployRef"], "deploy-7",
        "camelCase field names"
    );
    assert_eq!(run["startedAtMs"], "1700000000000", "int64 as a string");
    assert_eq!(run["budget"]["limitMicros"], "5000000");
    assert!(run.get("started_at_ms").is_none());

    // Unknown fields from a newer client are skipped, not rejected.
    let resp = raw_post(
        &base,
        GET_RUN,
        "application/json",
        r#"{"runId":"r","addedLater":1}"#,
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn streaming_wire_layout() {
    let base = serve().await;
    let req = WatchRunRequest {
        run_id: "r-4".into(),
        after_seq: 0,
    };
    let resp = raw_post(
        &base,
        WATCH_RUN,
        "application/connect+proto",
        envelope(0, &req.encode_to_vec()),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/connect+proto");
    let body = resp.bytes().await.unwrap();
    let snapshot = WatchRunResponse {
        item: Some(Item::Snapshot(run("r-4"))),
    }
    .encode_to_vec();
    assert_eq!(body[0], 0, "message frames have flags 0");
    assert_eq!(
        u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize,
        snapshot.len()
    );
    assert_eq!(&body[5..5 + snapshot.len()], &snapshot[..]);
    assert_eq!(
        &body[body.len() - 7..],
        &[0x02, 0, 0, 0, 2, b'{', b'}'],
        "EndStream {{}} closes the stream"
    );

    let resp = raw_post(
        &base,
        WATCH_RUN,
        "application/connect+json",
        envelope(0, br#"{"runId":"r-4","afterSeq":"7"}"#),
    )
    .send()
    .await
    .unwrap();
    let frames = frames(&resp.bytes().await.unwrap());
    let first_event: serde_json::Value = serde_json::from_slice(&frames[1].1).unwrap();
    assert_eq!(
        first_event,
        serde_json::json!({"event": {"seq": "8", "type": "stage_started"}})
    );
}
