//! Closed-loop load generator for the A2A benchmark (docs/benchmarks.md, A2A section): `--connections`
//! workers each keep one HTTP/1.1 keep-alive connection busy with blocking JSON-RPC
//! `SendMessage` calls of the skill `echo` (data part `{"skill": "echo", "args": {"text": ...}}`),
//! every call with a fresh message id (our agent answers a repeated id from its store without
//! running anything, which would flatter it). After `--warmup` seconds it measures for
//! `--seconds` and prints one JSON line: requests, errors, throughput, p50/p90/p99/max latency.
//!
//! ```text
//! a2a_load --url http://127.0.0.1:PORT [--connections 16] [--seconds 10] [--warmup 2] [--token T] [--label L]
//! ```
//!
//! A request counts as an error unless the answer is HTTP 2xx with a task in state COMPLETED. The
//! client is hyper's HTTP/1.1 connection itself (plain `http://` only), so that the tool spends as
//! little of its core per request as it can and the agent under test, not the tool, sets the pace.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;

const USAGE: &str = "usage: a2a_load --url http://HOST:PORT[/PATH] [--connections N] [--seconds S] [--warmup S] [--token T] [--label L]";

struct Options {
    url: hyper::Uri,
    connections: usize,
    seconds: u64,
    warmup: u64,
    token: Option<String>,
    label: String,
}

fn options() -> Result<Options, Box<dyn std::error::Error>> {
    let mut url = String::new();
    let mut o = Options {
        url: hyper::Uri::default(),
        connections: 16,
        seconds: 10,
        warmup: 2,
        token: None,
        label: String::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(USAGE);
        match arg.as_str() {
            "--url" => url = value()?,
            "--connections" => o.connections = value()?.parse()?,
            "--seconds" => o.seconds = value()?.parse()?,
            "--warmup" => o.warmup = value()?.parse()?,
            "--token" => o.token = Some(value()?),
            "--label" => o.label = value()?,
            _ => return Err(USAGE.into()),
        }
    }
    o.url = url.parse()?;
    let has_port = o.url.authority().and_then(|a| a.port_u16()).is_some();
    if o.url.scheme_str() != Some("http") || !has_port || o.connections == 0 {
        return Err(USAGE.into());
    }
    Ok(o)
}

/// The part of a SendMessage answer the tool checks; the rest is skipped unread.
#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(borrow)]
    result: Option<AnswerResult<'a>>,
}
#[derive(Deserialize)]
struct AnswerResult<'a> {
    #[serde(borrow)]
    task: Option<AnswerTask<'a>>,
}
#[derive(Deserialize)]
struct AnswerTask<'a> {
    #[serde(borrow)]
    status: AnswerStatus<'a>,
}
#[derive(Deserialize)]
struct AnswerStatus<'a> {
    state: &'a str,
}

fn completed(body: &[u8]) -> bool {
    serde_json::from_slice::<Answer>(body).is_ok_and(|a| {
        a.result
            .and_then(|r| r.task)
            .is_some_and(|t| t.status.state == "TASK_STATE_COMPLETED")
    })
}

/// A fresh keep-alive connection to the agent.
async fn connect(url: &hyper::Uri) -> Result<SendRequest<Full<Bytes>>, String> {
    let authority = url.authority().ok_or(USAGE)?.as_str();
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    Ok(sender)
}

/// A worker's connection, opened again when the agent closed it.
struct Connection {
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Connection {
    /// A connection ready to send on: the open one, or a new one if the agent closed it.
    async fn ready(&mut self, url: &hyper::Uri) -> Result<&mut SendRequest<Full<Bytes>>, String> {
        if let Some(sender) = &mut self.sender
            && sender.ready().await.is_err()
        {
            self.sender = None;
        }
        if self.sender.is_none() {
            self.sender = Some(connect(url).await?);
        }
        Ok(self.sender.as_mut().expect("connected above"))
    }
}

/// Sends one call; whether it was answered with a COMPLETED task. A connection that cannot be opened, or fails
/// during the call, is an error of this call, and the next call opens a new one.
async fn call(conn: &mut Connection, o: &Options, body: String) -> bool {
    let authority = o.url.authority().map_or("", |a| a.as_str());
    let path = o.url.path_and_query().map_or("/", |p| p.as_str());
    let mut req = hyper::Request::post(path)
        .header("host", authority)
        .header("a2a-version", "1.0")
        .header("content-type", "application/json");
    if let Some(t) = &o.token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let Ok(req) = req.body(Full::new(Bytes::from(body))) else {
        return false;
    };
    let Ok(sender) = conn.ready(&o.url).await else {
        return false;
    };
    let Ok(resp) = sender.send_request(req).await else {
        conn.sender = None;
        return false;
    };
    let success = resp.status().is_success();
    // Read every answer whole, a refusal too, so the connection stays usable for the next call.
    match resp.into_body().collect().await {
        Ok(body) => success && completed(&body.to_bytes()),
        Err(_) => {
            conn.sender = None;
            false
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = Arc::new(options()?);
    let run = Arc::new(AtomicBool::new(true));
    let measuring = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..o.connections {
        let (o, run, measuring, errors) =
            (o.clone(), run.clone(), measuring.clone(), errors.clone());
        workers.push(tokio::spawn(async move {
            // One connection per worker, as a load tool's `-c` means; a broken one is replaced.
            let mut conn = Connection {
                sender: Some(connect(&o.url).await?),
            };
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            let mut n: u64 = 0;
            while run.load(Ordering::Relaxed) {
                n += 1;
                let body = json!({"jsonrpc": "2.0", "id": n, "method": "SendMessage", "params": {
                    "message": {"messageId": format!("bench-{worker}-{n}-{}", std::process::id()),
                        "role": "ROLE_USER",
                        "parts": [{"data": {"skill": "echo", "args": {"text": "hello"}}}]}}});
                let start = Instant::now();
                let ok = call(&mut conn, &o, body.to_string()).await;
                let micros = u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX);
                if measuring.load(Ordering::Relaxed) {
                    if ok {
                        latencies.push(micros);
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok::<_, String>(latencies)
        }));
    }
    tokio::time::sleep(Duration::from_secs(o.warmup)).await;
    measuring.store(true, Ordering::Relaxed);
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(o.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    run.store(false, Ordering::Relaxed);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await??);
    }
    all.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.is_empty() {
            return 0.0;
        }
        let i = ((all.len() as f64 * p).ceil() as usize).clamp(1, all.len()) - 1;
        f64::from(all[i]) / 1000.0
    };
    let report = json!({
        "label": o.label,
        "connections": o.connections,
        "seconds": elapsed,
        "requests": all.len(),
        "errors": errors.load(Ordering::Relaxed),
        "rps": all.len() as f64 / elapsed,
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": all.last().map_or(0.0, |m| f64::from(*m) / 1000.0),
    });
    println!("{report}");
    Ok(())
}
