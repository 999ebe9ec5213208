//! Engine benchmark: complete runs per second on the embedded SQLite store, with the sandbox apps and the replay
//! model, and the store, queue and timer operations one run needs.
//!
//! `cargo bench -p loams --bench engine` (release profile). Each batch starts a fresh sandbox and stack (the
//! stack's ports wrapped in `Counting`), opens N runs at once with distinct fingerprints straight through the
//! worker, approves every merge on a simulated phone through the Connect API, and stops the clock when all N
//! runs have ended. Method and results: docs/benchmarks.md.
//!
//! Environment:
//! - `LOAMS_BENCH_RUNS`: comma-separated batch sizes (default `1,100`; `1` when run as a test), each 1..=1000.
//! - `LOAMS_BENCH_DIR`: where the batches' SQLite files go (default: the system temp dir).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use loams::config::Config;
use loams::demo::{DEMO_CASSETTE, sandbox_counts};
use loams::phone::Phone;
use loams::stack::{Backend, Stack, sandbox_apps};
use loams_factory::{Run, Signal};
use loams_model::{ChatModel, ChatRequest, ChatResponse, ModelError};
use loams_platform::{Clock, Counting, OpCounts, Page, RunRow, Sqlite, Store, SystemClock, limits};
use loams_sandbox::{Sandbox, SandboxConfig};
use serde_json::Value;
use tokio::task::JoinSet;

/// The allocator the `loams` binary runs with, so the bench measures what it ships.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often the driver looks for pending approvals (on the uncounted store handle).
const POLL: Duration = Duration::from_millis(10);
/// How often it counts ended runs: the wall time is known to this much. Counting reads every ended run's
/// snapshot, which at 10 ms took a good share of the process's CPU away from the runs being measured.
const END_POLL: Duration = Duration::from_millis(100);
/// How long the stack is left idle before a batch, to measure the background polling rate.
const IDLE: Duration = Duration::from_secs(1);
/// A batch that has not finished by then is reported as a failure.
const DEADLINE: Duration = Duration::from_secs(600);
/// CI poll interval of the runs: a real timer, short enough not to dominate.
const CI_POLL_MS: u64 = 5;
/// Observe window of the runs. Not shorter: the analytics read starts at the merge rounded up to the next whole
/// second, and the agent refuses a start in the future, so a window under a second fails the run.
const OBSERVE_WINDOW_MS: u64 = 1_000;
const ENDED: [&str; 3] = ["succeeded", "failed", "killed"];

fn main() -> anyhow::Result<()> {
    let sizes = batch_sizes()?;
    let root = match std::env::var_os("LOAMS_BENCH_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    println!(
        "loams engine benchmark: {} cores, store under {}",
        cores(),
        root.display()
    );
    let mut results = Vec::new();
    for n in sizes {
        let result = runtime.block_on(batch(n, &root))?;
        result.print_detail();
        results.push(result);
    }
    print_table(&results);
    let (rss, hwm) = memory_kib()?;
    println!(
        "\nprocess memory at the end: VmRSS {:.1} MiB, VmHWM (peak) {:.1} MiB",
        mib(rss),
        mib(hwm)
    );
    Ok(())
}

fn batch_sizes() -> anyhow::Result<Vec<usize>> {
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`) one small batch checks that it works.
    let default = if std::env::args().any(|a| a == "--bench") {
        "1,100"
    } else {
        "1"
    };
    let spec = std::env::var("LOAMS_BENCH_RUNS").unwrap_or_else(|_| default.into());
    spec.split(',')
        .map(|s| {
            let n: usize = s
                .trim()
                .parse()
                .with_context(|| format!("LOAMS_BENCH_RUNS: {s:?} is not a number"))?;
            // The driver lists pending approvals and ended runs one page at a time.
            if n == 0 || n > limits::MAX_PAGE as usize {
                bail!("LOAMS_BENCH_RUNS: {n} is outside 1..={}", limits::MAX_PAGE);
            }
            Ok(n)
        })
        .collect()
}

struct BatchResult {
    runs: usize,
    wall: Duration,
    states: BTreeMap<String, usize>,
    /// Fix attempts a run took -> how many runs.
    attempts: BTreeMap<u32, usize>,
    /// Runs in the store, follow-ups included (a regressed run opens a successor).
    stored_runs: usize,
    events: u64,
    /// Open-to-end time of each run, from the run's own clock readings.
    latencies_ms: Vec<i64>,
    ops: OpCounts,
    idle: OpCounts,
    idle_secs: f64,
    approvals: usize,
    merges: u64,
    /// Why runs that did not succeed ended (reason and detail -> how many runs).
    unsuccessful: BTreeMap<String, usize>,
    /// CPU time of the whole process (engine, API, agents, sandbox apps, driver) during the batch.
    cpu: Duration,
    rss_kib: u64,
}

async fn batch(n: usize, root: &std::path::Path) -> anyhow::Result<BatchResult> {
    let dir = tempfile::Builder::new()
        .prefix("loams-bench-")
        .tempdir_in(root)
        .context("creating the data dir")?;

    let mut sandbox_config = SandboxConfig::default();
    sandbox_config.ci.delay_ms = 0;
    let issue_id = sandbox_config.glitchtip.issue_id.to_string();
    let sandbox = Sandbox::start(sandbox_config)
        .await
        .context("starting the sandbox")?;
    let info = sandbox.info();

    let mut config = Config {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: dir.path().to_path_buf(),
        ..Config::default()
    };
    config.policy.auto_triage = true;
    config.factory.observe_window_ms = OBSERVE_WINDOW_MS;
    config.factory.ci_poll_ms = CI_POLL_MS;
    let org = config.org.clone();

    let model = Arc::new(Story::from_demo()?);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let sqlite =
        Sqlite::open(dir.path().join("loams.db"), clock.clone()).context("opening the store")?;
    let counting = Arc::new(Counting::new(sqlite));
    // The driver's own polling goes to the inner handle (same connection, not counted), so the counts are the
    // engine's and the API's alone.
    let raw = counting.inner().clone();
    let backend = Backend {
        store: counting.clone(),
        queue: counting.clone(),
        timers: counting.clone(),
        clock: clock.clone(),
    };
    let stack = Stack::start(&config, &sandbox_apps(&info), model, backend).await?;
    let phone = Arc::new(
        Phone::register(&stack.api_url, &stack.token("alice", &org)?, "bench-phone").await?,
    );

    let idle_start = counting.counts();
    let idle_clock = Instant::now();
    tokio::time::sleep(IDLE).await;
    let idle = counting.counts().since(&idle_start);
    let idle_secs = idle_clock.elapsed().as_secs_f64();

    let before = counting.counts();
    let cpu_before = cpu_time()?;
    let started = Instant::now();
    let opens = (0..n).map(|i| {
        let worker = stack.worker.clone();
        let org = org.clone();
        let signal = Signal {
            source: "bench".into(),
            fingerprint: format!("bench:{n}:{i}"),
            title: format!("ZeroDivisionError: division by zero (bench {i})"),
            link: format!(
                "{}/{}/issues/{issue_id}",
                info.urls.glitchtip, info.glitchtip_org
            ),
            // The sandbox has one seeded issue; every run observes it.
            glitchtip_issue_id: Some(issue_id.clone()),
            severity: "error".into(),
            generation: 1,
            parent_run: None,
        };
        async move { worker.open(&org, signal).await }
    });
    for opened in futures::future::join_all(opens).await {
        let opened = opened.map_err(|e| anyhow!("opening a run: {e}"))?;
        if !opened.created {
            bail!("run {} already existed", opened.run_id);
        }
    }

    let mut decided = HashSet::new();
    let mut deciding = JoinSet::new();
    let mut counted = Instant::now();
    loop {
        if started.elapsed() > DEADLINE {
            bail!(
                "{n} runs did not end within {DEADLINE:?}; states: {:?}",
                states(&raw, &org).await?
            );
        }
        let pending = raw
            .list_items(
                &org,
                "approval",
                Some("pending"),
                Page::first(limits::MAX_PAGE),
            )
            .await?;
        for item in pending.items {
            if decided.insert(item.id.clone()) {
                let phone = phone.clone();
                deciding.spawn(async move { phone.decide(&item.id, true).await.map(|_| ()) });
            }
        }
        while let Some(done) = deciding.try_join_next() {
            done.context("a phone decision panicked")??;
        }
        if counted.elapsed() >= END_POLL {
            if ended(&raw, &org).await? >= n {
                break;
            }
            counted = Instant::now();
        }
        tokio::time::sleep(POLL).await;
    }
    let wall = started.elapsed();
    while let Some(done) = deciding.join_next().await {
        done.context("a phone decision panicked")??;
    }
    let ops = counting.counts().since(&before);
    let cpu = cpu_time()?.saturating_sub(cpu_before);

    let rows = all_runs(&raw, &org).await?;
    let mut result = BatchResult {
        runs: n,
        wall,
        states: BTreeMap::new(),
        attempts: BTreeMap::new(),
        stored_runs: rows.len(),
        events: 0,
        latencies_ms: Vec::new(),
        ops,
        idle,
        idle_secs,
        approvals: decided.len(),
        merges: 0,
        unsuccessful: BTreeMap::new(),
        cpu,
        rss_kib: memory_kib()?.0,
    };
    for row in &rows {
        let run: Run =
            serde_json::from_slice(&row.snapshot).with_context(|| format!("run {}", row.id))?;
        *result.states.entry(row.state.clone()).or_default() += 1;
        *result.attempts.entry(run.attempt).or_default() += 1;
        result.events += row.version;
        result.latencies_ms.push(row.updated_ms - run.started_at_ms);
        if row.state != "succeeded" {
            let why = match &run.ending {
                Some(e) => format!("{} {:?}: {}", row.state, e.reason, e.detail),
                None => format!("{} at stage {}", row.state, run.stage.as_str()),
            };
            *result.unsuccessful.entry(why).or_default() += 1;
        }
    }
    result.latencies_ms.sort_unstable();
    let counts = sandbox_counts(&info.urls.forgejo).await?;
    result.merges = counts
        .pointer("/forgejo/merges")
        .and_then(Value::as_u64)
        .unwrap_or_default();

    stack.shutdown().await;
    sandbox.shutdown().await;
    Ok(result)
}

/// The demo's story for every run, told to each run on its own: its first fix (the demo cassette's failing one),
/// then, once the prompt carries the failed attempt's feedback, the passing one; the reviews as recorded. A
/// cassette served in one order to every run would hand a run that moves faster than the others someone else's
/// attempt. Each patch also carries the run's fingerprint as a comment: the runs share one repository, and a fix
/// already merged by another run would otherwise leave nothing to change.
struct Story {
    completions: HashMap<&'static str, Vec<ChatResponse>>,
}

impl Story {
    fn from_demo() -> anyhow::Result<Self> {
        let demo: Value = serde_json::from_str(DEMO_CASSETTE).context("the demo cassette")?;
        let mut completions: HashMap<&'static str, Vec<ChatResponse>> = HashMap::new();
        for c in demo["completions"]
            .as_array()
            .ok_or_else(|| anyhow!("the demo cassette has no completions"))?
        {
            let purpose = match c["purpose"].as_str() {
                Some("fix") => "fix",
                Some("lead_review") => "lead_review",
                Some("security_audit") => "security_audit",
                other => bail!("the demo cassette has a completion for {other:?}"),
            };
            completions.entry(purpose).or_default().push(ChatResponse {
                text: c["text"].as_str().unwrap_or_default().to_string(),
                model: "bench-story".into(),
                input_tokens: c["input_tokens"].as_u64().unwrap_or_default(),
                output_tokens: c["output_tokens"].as_u64().unwrap_or_default(),
            });
        }
        if completions.get("fix").map(Vec::len) != Some(2) {
            bail!("the demo cassette must have a failing and a passing fix");
        }
        Ok(Self { completions })
    }
}

#[async_trait::async_trait]
impl ChatModel for Story {
    async fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError> {
        let prompt = req
            .messages
            .iter()
            .map(|m| m.content.as_str())
            .collect::<String>();
        let unknown = || {
            ModelError::Config(format!(
                "the bench story has no answer for {:?}",
                req.purpose
            ))
        };
        let answers = self
            .completions
            .get(req.purpose.as_str())
            .ok_or_else(unknown)?;
        if req.purpose != "fix" {
            return answers.first().cloned().ok_or_else(unknown);
        }
        let retry = prompt.contains(" failed. What went wrong");
        let mut answer = answers[usize::from(retry)].clone();
        let fingerprint = prompt
            .split("fingerprint ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .ok_or_else(|| ModelError::Config("the fix prompt names no fingerprint".into()))?;
        answer.text =
            answer
                .text
                .replacen("```python\n", &format!("```python\n# {fingerprint}\n"), 1);
        Ok(answer)
    }
}

async fn ended(store: &Sqlite, org: &str) -> anyhow::Result<usize> {
    let mut count = 0;
    for state in ENDED {
        count += runs_in(store, org, Some(state)).await?.len();
    }
    Ok(count)
}

async fn states(store: &Sqlite, org: &str) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut states = BTreeMap::new();
    for row in all_runs(store, org).await? {
        *states.entry(row.state).or_default() += 1;
    }
    Ok(states)
}

async fn all_runs(store: &Sqlite, org: &str) -> anyhow::Result<Vec<RunRow>> {
    runs_in(store, org, None).await
}

async fn runs_in(store: &Sqlite, org: &str, state: Option<&str>) -> anyhow::Result<Vec<RunRow>> {
    let mut rows = Vec::new();
    let mut page = Page::first(limits::MAX_PAGE);
    loop {
        let paged = store.list_runs(org, state, page.clone()).await?;
        rows.extend(paged.items);
        match paged.next {
            Some(next) => page.cursor = Some(next),
            None => return Ok(rows),
        }
    }
}

impl BatchResult {
    fn runs_per_sec(&self) -> f64 {
        self.runs as f64 / self.wall.as_secs_f64()
    }

    fn per_run(&self, total: u64) -> f64 {
        total as f64 / self.runs as f64
    }

    fn percentile(&self, p: f64) -> i64 {
        let i = ((self.latencies_ms.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_ms.get(i).copied().unwrap_or_default()
    }

    fn print_detail(&self) {
        println!(
            "\n== batch of {} runs: {:.2} s wall, {:.1} runs/s, {:.2} s CPU ({:.0}% of one core, {:.1} ms CPU per run)",
            self.runs,
            self.wall.as_secs_f64(),
            self.runs_per_sec(),
            self.cpu.as_secs_f64(),
            100.0 * self.cpu.as_secs_f64() / self.wall.as_secs_f64(),
            1000.0 * self.cpu.as_secs_f64() / self.runs as f64
        );
        println!(
            "   states {:?}; fix attempts -> runs {:?}; {} runs stored; {} approvals decided; {} merges",
            self.states, self.attempts, self.stored_runs, self.approvals, self.merges
        );
        println!(
            "   run latency ms: p50 {} p95 {} max {}; events per run {:.1}",
            self.percentile(0.5),
            self.percentile(0.95),
            self.percentile(1.0),
            self.per_run(self.events)
        );
        let per_run: Vec<String> = self
            .ops
            .fields()
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| format!("{k} {:.1}", self.per_run(v)))
            .collect();
        println!("   per run: {}", per_run.join(", "));
        for (why, count) in &self.unsuccessful {
            println!("   {count} run(s) {why}");
        }
        let idle: Vec<String> = self
            .idle
            .fields()
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| format!("{k} {:.0}/s", v as f64 / self.idle_secs))
            .collect();
        println!("   idle stack (before the batch): {}", idle.join(", "));
    }
}

fn print_table(results: &[BatchResult]) {
    println!();
    println!(
        "| runs | wall s | runs/s | CPU ms/run | succeeded | p50 ms | p95 ms | store reads/run | store writes/run | events/run | queue sends/run | msgs received/run | receive calls/run | timer ops/run | RSS MiB |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in results {
        let o = &r.ops;
        println!(
            "| {} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.runs,
            r.wall.as_secs_f64(),
            r.runs_per_sec(),
            1000.0 * r.cpu.as_secs_f64() / r.runs as f64,
            r.states.get("succeeded").copied().unwrap_or_default(),
            r.percentile(0.5),
            r.percentile(0.95),
            r.per_run(o.store_reads()),
            r.per_run(o.store_writes()),
            r.per_run(o.appended_events),
            r.per_run(o.send),
            r.per_run(o.received),
            r.per_run(o.receive),
            r.per_run(o.timer_ops()),
            mib(r.rss_kib),
        );
    }
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// User plus system CPU time of this process so far, from /proc/self/stat (fields 14 and 15, in clock ticks of
/// 1/100 s: USER_HZ is 100 on Linux whatever the kernel's internal tick).
fn cpu_time() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The command name (field 2) is in parentheses and may hold spaces; the numeric fields follow the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow!("malformed /proc/self/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state), so fields 14 and 15 are at indexes 11 and 12.
    let tick = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .ok_or_else(|| anyhow!("/proc/self/stat is short"))?
            .parse()
            .context("parsing /proc/self/stat")
    };
    Ok(Duration::from_millis((tick(11)? + tick(12)?) * 10))
}

/// (VmRSS, VmHWM) of this process in KiB.
fn memory_kib() -> anyhow::Result<(u64, u64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| anyhow!("/proc/self/status has no {name}"))?;
        line.trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("parsing {line:?}"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}
