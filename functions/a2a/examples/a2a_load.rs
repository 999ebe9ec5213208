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
//! A request counts as an error unless the answer is HTTP 200 with a task in state COMPLETED.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const USAGE: &str = "usage: a2a_load --url URL [--connections N] [--seconds S] [--warmup S] [--token T] [--label L]";

struct Options {
    url: String,
    connections: usize,
    seconds: u64,
    warmup: u64,
    token: Option<String>,
    label: String,
}

fn options() -> Result<Options, Box<dyn std::error::Error>> {
    let mut o = Options {
        url: String::new(),
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
            "--url" => o.url = value()?,
            "--connections" => o.connections = value()?.parse()?,
            "--seconds" => o.seconds = value()?.parse()?,
            "--warmup" => o.warmup = value()?.parse()?,
            "--token" => o.token = Some(value()?),
            "--label" => o.label = value()?,
            _ => return Err(USAGE.into()),
        }
    }
    if o.url.is_empty() || o.connections == 0 {
        return Err(USAGE.into());
    }
    Ok(o)
}

fn completed(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .is_ok_and(|v| v["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED")
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
            // One client per worker: one connection each, as a load tool's `-c` means.
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()
                .map_err(|e| e.to_string())?;
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            let mut n: u64 = 0;
            while run.load(Ordering::Relaxed) {
                n += 1;
                let body = json!({"jsonrpc": "2.0", "id": n, "method": "SendMessage", "params": {
                    "message": {"messageId": format!("bench-{worker}-{n}-{}", std::process::id()),
                        "role": "ROLE_USER",
                        "parts": [{"data": {"skill": "echo", "args": {"text": "hello"}}}]}}});
                let mut req = client
                    .post(&o.url)
                    .header("A2A-Version", "1.0")
                    .header("content-type", "application/json")
                    .body(body.to_string());
                if let Some(t) = &o.token {
                    req = req.bearer_auth(t);
                }
                let start = Instant::now();
                let ok = match req.send().await {
                    Ok(resp) if resp.status().is_success() => {
                        resp.bytes().await.is_ok_and(|b| completed(&b))
                    }
                    _ => false,
                };
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
