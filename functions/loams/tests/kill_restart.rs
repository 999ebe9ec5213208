//! Crash safety with real process crashes at exact step boundaries. The sandbox apps and the model run outside the
//! crashing process (the apps as their own process, the model as an OpenAI-compatible server in this test), like a
//! real deployment's. `loams dev` is started again and again on the same data directory with the worker's fault
//! switch `LOAMS_FAULT_ABORT_AT`, so each start aborts itself right after an effect was performed but not recorded
//! (`after_effect`) or right after it was recorded but before the run was continued (`after_record`). A start
//! first redoes what the previous one was cut at, and a message that carried the run through an abort is received
//! again by the next start; a plan below moves the run one step per start, cutting each step it reaches at one of
//! the two boundaries, while no queue message is received more than three times (the queue dead-letters at
//! five). Cutting each step at both boundaries in one run is not possible (it would take two starts per step on
//! the same message), so the run is crashed twice over, with two plans. Each time the run must complete, the apps
//! must show exactly what an uninterrupted run leaves (no duplicate issue, PR, comment, message or merge), and each
//! model answer must have been paid for once.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loams::demo::{DEMO_CASSETTE, Scenario, play, sandbox_counts};
use loams::phone::Phone;
use loams_proto::connect::ConnectClient;
use loams_proto::factory::v1 as factory;
use loams_sandbox::SandboxInfo;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_loams");
/// The fault of each start, cycled. Each plan moves the run one step per start and receives no message more than
/// three times; the second cuts, roughly, at the other boundary the steps the first cut at one.
const PLANS: [&[&str]; 2] = [
    &[
        "after_effect:1",
        "after_effect:2",
        "after_effect:2",
        "after_record:1",
        "after_record:2",
    ],
    &[
        "after_record:1",
        "after_record:2",
        "after_effect:2",
        "after_effect:2",
        "after_effect:1",
    ],
];
/// Short, so the message of an aborted start comes back soon; the worker extends it while a step runs. Not shorter:
/// at 300 ms a message handed over late within a start came back while it was being handled, and that extra receive
/// dead-lettered a message the plan had already received four times.
const VISIBILITY_MS: &str = "1000";
const WEBHOOK_TOKEN: &str = "kill-restart-webhook-token-0123456789";
const MODEL_KEY_ENV: &str = "KILL_RESTART_MODEL_KEY";
/// SIGABRT: what `std::process::abort` ends the process with.
const SIGABRT: i32 = 6;

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_file(path: &Path) -> String {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A free port below Linux's ephemeral range (32768 and up by default): `loams dev` is restarted on it many times,
/// and binds its agents on port 0 first, so a port from that range could be handed to one of them meanwhile.
fn free_port() -> u16 {
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    // Each port of the range once, from a point that differs between runs.
    (0..COUNT)
        .map(|i| (FIRST + (seed % COUNT + i) % COUNT) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port in 20000..32000")
}

fn config(dir: &Path, port: u16, info: &SandboxInfo, model_url: &str) -> String {
    let t = &info.tokens;
    format!(
        r#"listen = "127.0.0.1:{port}"
data_dir = "{data}"
org = "acme"
webhook_token = "{webhook}"

[model]
base_url = "{model}"
model = "replay"
api_key_env = "{model_key_env}"

[policy]
auto_triage = true

[factory]
observe_window_ms = 1500
ci_poll_ms = 100

[apps.zulip]
url = "{zulip}"
email = "{zulip_email}"
api_key = "{zulip_key}"

[apps.plane]
url = "{plane}"
api_key = "{plane_key}"
workspace = "{workspace}"
project_id = "{project}"

[apps.forgejo]
url = "{forgejo}"
token = "{forgejo_token}"
owner = "{owner}"
repo = "{repo}"
base = "{base}"

[apps.glitchtip]
url = "{glitchtip}"
token = "{glitchtip_token}"
org = "{glitchtip_org}"

[apps.analytics]
url = "{openpanel}"
client_id = "{op_id}"
client_secret = "{op_secret}"
project_id = "{op_project}"
"#,
        data = dir.join("data").display(),
        webhook = WEBHOOK_TOKEN,
        model = model_url,
        model_key_env = MODEL_KEY_ENV,
        zulip = info.urls.zulip,
        zulip_email = t.zulip_email,
        zulip_key = t.zulip_api_key,
        plane = info.urls.plane,
        plane_key = t.plane_api_key,
        workspace = info.plane_workspace,
        project = info.plane_project_id,
        forgejo = info.urls.forgejo,
        forgejo_token = t.forgejo_token,
        owner = info.forgejo_owner,
        repo = info.forgejo_repo,
        base = info.forgejo_base,
        glitchtip = info.urls.glitchtip,
        glitchtip_token = t.glitchtip_token,
        glitchtip_org = info.glitchtip_org,
        openpanel = info.urls.openpanel,
        op_id = t.openpanel_client_id,
        op_secret = t.openpanel_client_secret,
        op_project = info.openpanel_project_id,
    )
}

fn token(config: &Path, user: &str) -> String {
    let out = Command::new(BIN)
        .args(["token", "--config"])
        .arg(config)
        .args(["--user", user])
        .output()
        .expect("loams token runs");
    assert!(
        out.status.success(),
        "loams token: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn start_dev(config: &Path, log: &Path, fault: &str) -> Reaped {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Reaped(
        Command::new(BIN)
            .args(["dev", "--config"])
            .arg(config)
            .env("LOAMS_FAULT_ABORT_AT", fault)
            .env("LOAMS_QUEUE_VISIBILITY_MS", VISIBILITY_MS)
            .env(MODEL_KEY_ENV, "test-key")
            .env("LOAMS_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("loams dev starts"),
    )
}

/// The model as a remote service: the demo cassette's answers served in order per purpose over the
/// OpenAI-compatible API, surviving every restart of `loams dev` like a real provider does (a replay inside the
/// crashing process would start its cassette over on each start). Counts the answers served per purpose.
#[derive(Clone)]
struct ModelService {
    answers: Arc<Mutex<HashMap<String, VecDeque<Value>>>>,
    served: Arc<Mutex<BTreeMap<String, u32>>>,
}

impl ModelService {
    fn new(cassette: &str) -> ModelService {
        let cassette: Value = serde_json::from_str(cassette).unwrap();
        let mut answers: HashMap<String, VecDeque<Value>> = HashMap::new();
        for c in cassette["completions"].as_array().unwrap() {
            answers
                .entry(c["purpose"].as_str().unwrap().to_string())
                .or_default()
                .push_back(c.clone());
        }
        ModelService {
            answers: Arc::new(Mutex::new(answers)),
            served: Arc::default(),
        }
    }

    /// The purpose of a request, told by its system prompt.
    fn purpose(request: &Value) -> &'static str {
        let system = request["messages"][0]["content"]
            .as_str()
            .unwrap_or_default();
        if system.starts_with("You are the fix engineer") {
            "fix"
        } else if system.starts_with("You are the senior lead") {
            "lead_review"
        } else {
            "security_audit"
        }
    }

    async fn serve(self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new().route(
            "/chat/completions",
            axum::routing::post(move |axum::Json(request): axum::Json<Value>| {
                let service = self.clone();
                async move {
                    let purpose = ModelService::purpose(&request);
                    let Some(answer) = service.answers.lock().unwrap().get_mut(purpose).and_then(VecDeque::pop_front)
                    else {
                        return (axum::http::StatusCode::BAD_REQUEST, axum::Json(json!({"error": "cassette exhausted"})));
                    };
                    *service.served.lock().unwrap().entry(purpose.to_string()).or_default() += 1;
                    (
                        axum::http::StatusCode::OK,
                        axum::Json(json!({
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer["text"]}}],
                            "usage": {"prompt_tokens": answer["input_tokens"], "completion_tokens": answer["output_tokens"]},
                        })),
                    )
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    }
}

/// Whether the run's last event is a wait's timer being scheduled: the worker then has nothing to do for it until
/// the wait ends, so deciding its approval now cannot be cut by a planned abort. (The API stores a decision and
/// then enqueues the settlement; a crash between the two would strand the run until the approval expires, which
/// this test is not about.)
async fn idle_in_wait(oncall: &ConnectClient, run: &factory::Run) -> bool {
    let request = factory::GetTimelineRequest {
        run_id: run.id.clone(),
        after_seq: run.version.saturating_sub(1),
        page_size: 1,
    };
    let timeline: Result<factory::GetTimelineResponse, _> = oncall
        .unary("/loams.factory.v1.FactoryService/GetTimeline", &request)
        .await;
    timeline.is_ok_and(|t| {
        t.events
            .last()
            .is_some_and(|e| e.r#type == "timer_scheduled")
    })
}

/// The log without its colour codes (an ESC, `[`, parameters, a final letter).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How many answers each purpose has in the cassette.
fn cassette_counts(cassette: &str) -> BTreeMap<String, u32> {
    let cassette: Value = serde_json::from_str(cassette).unwrap();
    let mut counts = BTreeMap::new();
    for c in cassette["completions"].as_array().unwrap() {
        *counts
            .entry(c["purpose"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    counts
}

async fn wait_api(api: &str) {
    let start = Instant::now();
    while !reqwest::get(format!("{api}/.well-known/jwks.json"))
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "API at {api} never came up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The counters that must not depend on timing (GlitchTip events are generated by the clock).
fn effects(state: &Value) -> Value {
    serde_json::json!({
        "messages": state["zulip"]["messages"],
        "issues": state["plane"]["issues"],
        "comments": state["plane"]["comments"],
        "prs": state["forgejo"]["prs"],
        "open_prs": state["forgejo"]["open_prs"],
        "merges": state["forgejo"]["merges"],
        "commits": state["forgejo"]["commits"],
        "branches": state["forgejo"]["branches"],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_at_every_step_boundary_the_run_completes_without_duplicates() {
    // What an uninterrupted run leaves in the apps.
    let clean = tempfile::tempdir().unwrap();
    let baseline = play(Scenario::demo(clean.path().to_path_buf()), &mut Vec::new())
        .await
        .unwrap();
    assert_eq!(baseline.first().state, "succeeded");
    let expected = effects(&baseline.sandbox_state);

    let mut cuts = BTreeSet::new();
    for plan in PLANS {
        let crashed = crashed_run(plan).await;
        assert_eq!(
            crashed.apps, expected,
            "apps after a crashed run differ from a clean run ({plan:?})"
        );
        assert_eq!(
            crashed.paid,
            cassette_counts(DEMO_CASSETTE),
            "a model answer was paid twice or never ({plan:?})"
        );
        cuts.extend(crashed.cuts);
    }
    let at = |boundary: &str| cuts.iter().filter(|(b, _)| b == boundary).count();
    let steps: BTreeSet<&String> = cuts.iter().map(|(_, step)| step).collect();
    eprintln!(
        "cut {} steps: {} after their effect, {} after their record",
        steps.len(),
        at("AfterEffect"),
        at("AfterRecord")
    );
    // The demo run performs about twenty-five steps; the two plans cut most of them, many at both boundaries.
    assert!(
        steps.len() >= 17 && at("AfterEffect") >= 16 && at("AfterRecord") >= 11,
        "too few cuts: {cuts:?}"
    );
}

/// What a run crashed according to one plan left behind.
struct Crashed {
    apps: Value,
    paid: BTreeMap<String, u32>,
    /// (boundary, step) of every abort.
    cuts: BTreeSet<(String, String)>,
}

/// Runs the demo signal on `loams dev` started again after each planned abort until the run ends.
async fn crashed_run(plan: &[&str]) -> Crashed {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let model = ModelService::new(DEMO_CASSETTE);
    let model_url = model.clone().serve().await;
    let _sandbox = Reaped(
        Command::new(BIN)
            .args(["sandbox", "--state"])
            .arg(dir.join("sandbox.json"))
            .arg("--urls-file")
            .arg(dir.join("urls.json"))
            .stdout(Stdio::null())
            .spawn()
            .expect("loams sandbox starts"),
    );
    let info: SandboxInfo = serde_json::from_str(&wait_for_file(&dir.join("urls.json"))).unwrap();
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let config_path = dir.join("loams.toml");
    std::fs::write(&config_path, config(dir, port, &info, &model_url)).unwrap();
    let log = dir.join("dev.log");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    let mut dev = start_dev(&config_path, &log, plan[0]);
    wait_api(&api).await;
    let phone = Phone::register(&api, &token(&config_path, "alice"), "alice-phone")
        .await
        .unwrap();
    let oncall = ConnectClient::new(api.clone())
        .with_header(
            "authorization",
            format!("Bearer {}", token(&config_path, "oncall")),
        )
        .unwrap();
    // The first start may abort on the run's first step before it answers: the run is then found by listing.
    let _ = reqwest::Client::new()
        .post(format!("{api}/webhooks/glitchtip/{WEBHOOK_TOKEN}"))
        .json(&json!({
            "alias": "GlitchTip", "text": "GlitchTip Alert",
            "attachments": [{"title": "ZeroDivisionError: division by zero",
                             "title_link": format!("{}/{}/issues/{}", info.urls.glitchtip, info.glitchtip_org, info.glitchtip_issue_id),
                             "text": "checkout.apply_discount", "fields": []}]
        }))
        .send()
        .await;

    let mut run_id: Option<String> = None;
    let mut starts = 1;
    let deadline = Instant::now() + Duration::from_secs(80);
    loop {
        assert!(
            Instant::now() < deadline,
            "run did not complete after {starts} starts; log: {}",
            log_text()
        );
        if let Some(status) = dev.0.try_wait().unwrap() {
            assert_eq!(
                status.signal(),
                Some(SIGABRT),
                "start {starts} ({}) ended with {status} instead of aborting at its fault; log: {}",
                plan[(starts - 1) % plan.len()],
                log_text()
            );
            dev = start_dev(&config_path, &log, plan[starts % plan.len()]);
            starts += 1;
            continue;
        }
        // While a start is down or coming up these calls fail; they are simply tried again.
        if run_id.is_none() {
            let runs: Result<factory::ListRunsResponse, _> = oncall
                .unary(
                    "/loams.factory.v1.FactoryService/ListRuns",
                    &factory::ListRunsRequest::default(),
                )
                .await;
            if let Ok(runs) = runs {
                assert!(
                    runs.runs.len() <= 1,
                    "one alert opened {} runs",
                    runs.runs.len()
                );
                run_id = runs.runs.first().map(|r| r.id.clone());
            }
        }
        if let Some(id) = &run_id {
            let run: Result<factory::GetRunResponse, _> = oncall
                .unary(
                    "/loams.factory.v1.FactoryService/GetRun",
                    &factory::GetRunRequest { run_id: id.clone() },
                )
                .await;
            if let Ok(factory::GetRunResponse { run: Some(run) }) = run {
                if matches!(run.state.as_str(), "succeeded" | "failed" | "killed") {
                    assert_eq!(run.state, "succeeded", "log: {}", log_text());
                    break;
                }
                if run.state == "waiting" && idle_in_wait(&oncall, &run).await {
                    for approval in phone.pending().await.unwrap_or_default() {
                        let _ = phone.decide(&approval.id, true).await;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(dev);

    // Every start but the last aborted at its fault, naming the step it was cut at.
    let text = strip_ansi(&log_text());
    let aborts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("fault injection: aborting the process"))
        .collect();
    assert_eq!(aborts.len(), starts - 1, "log: {text}");
    let cuts = aborts
        .iter()
        .filter_map(|l| {
            let boundary = if l.contains("AfterEffect") {
                "AfterEffect"
            } else {
                "AfterRecord"
            };
            let step = l.split("step=").nth(1)?.trim().trim_matches('"');
            Some((boundary.to_string(), step.to_string()))
        })
        .collect();
    let apps = effects(&sandbox_counts(&info.urls.forgejo).await.unwrap());
    let paid = model.served.lock().unwrap().clone();
    Crashed { apps, paid, cuts }
}
