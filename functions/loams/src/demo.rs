//! `loams demo` and the end-to-end scenarios: start everything in one process, post a GlitchTip alert for the
//! seeded bug, and follow the run(s) through the Connect API the phones use, deciding approvals on the terminal
//! phone (`loams phone`'s core), until every run has ended.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use loams_model::Replay;
use loams_proto::connect::ConnectClient;
use loams_proto::factory::v1 as factory;
use loams_sandbox::{ProducingMode, Sandbox, SandboxConfig, SandboxHandle};

use crate::config::Config;
use crate::phone::Phone;
use crate::stack::{Backend, Stack, sandbox_apps};

/// The recorded model answers of the demo: a first fix that fails CI, a second that passes, a lead review and a
/// security audit that approve.
pub const DEMO_CASSETTE: &str = include_str!("../demo/cassette.json");

const FACTORY: &str = "/loams.factory.v1.FactoryService";
/// How often the watcher polls the API.
const POLL: Duration = Duration::from_millis(50);

/// What the phone does with an approval request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhoneAnswer {
    Approve,
    Deny,
}

/// One end-to-end scenario.
pub struct Scenario {
    pub cassette: String,
    pub sandbox: SandboxConfig,
    pub config: Config,
    pub phone: PhoneAnswer,
    /// Kill the first run (from the phone, signed) once it reaches this stage.
    pub kill_at_stage: Option<String>,
    /// Force the sandbox GlitchTip to keep (`on`) or stop (`off`) producing events whatever production runs.
    pub glitchtip_mode: Option<ProducingMode>,
    /// Give up after this long.
    pub deadline: Duration,
    /// The on-call engineer's triage decision (through the API) for runs that wait for one (no auto-triage).
    pub triage: Option<bool>,
}

impl Scenario {
    /// The demo: auto-triage, a short observe window, fast CI polling, the phone approves.
    pub fn demo(data_dir: PathBuf) -> Scenario {
        let mut config = Config {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir,
            ..Config::default()
        };
        config.policy.auto_triage = true;
        config.factory.observe_window_ms = 1_500;
        config.factory.ci_poll_ms = 100;
        let mut sandbox = SandboxConfig::default();
        sandbox.ci.delay_ms = 150;
        Scenario {
            cassette: DEMO_CASSETTE.to_string(),
            sandbox,
            config,
            phone: PhoneAnswer::Approve,
            kill_at_stage: None,
            glitchtip_mode: None,
            deadline: Duration::from_secs(120),
            triage: None,
        }
    }
}

/// What a scenario left behind, read back through the API and the sandbox.
pub struct Report {
    pub runs: Vec<(factory::Run, Vec<factory::TimelineEvent>)>,
    /// The sandbox's counters (messages, issues, PRs, merges, ...), for duplicate checks.
    pub sandbox_state: serde_json::Value,
    pub approvals_decided: usize,
}

impl Report {
    pub fn first(&self) -> &factory::Run {
        &self.runs[0].0
    }
}

/// `loams demo`.
pub async fn run(data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let tmp;
    let data_dir = match data_dir {
        Some(dir) => dir,
        None => {
            tmp = tempfile::tempdir().context("creating a temporary data directory")?;
            tmp.path().to_path_buf()
        }
    };
    let mut out = std::io::stdout();
    let report = play(Scenario::demo(data_dir), &mut out).await?;
    let run = report.first();
    if run.state != "succeeded" {
        bail!("the demo run ended {} (expected succeeded)", run.state);
    }
    Ok(())
}

/// Plays a scenario, printing the runs live to `out`; returns once every run has ended.
pub async fn play(scenario: Scenario, out: &mut dyn Write) -> anyhow::Result<Report> {
    let started = Instant::now();
    let (sandbox, stack) = start(&scenario).await?;
    let config = &scenario.config;
    writeln!(
        out,
        "loams demo: API {}  store {}",
        stack.api_url,
        config.data_dir.display()
    )?;

    // The approver's phone, and the on-call engineer's view of the runs (the run acts on their behalf, so they
    // cannot approve its actions themselves). The phone keeps its key and cache beside the store, as
    // `loams phone --data-dir` would.
    let phone = Phone::open(
        &stack.api_url,
        &config.org,
        stack.token("alice", &config.org)?,
        &config.data_dir.join("phone"),
    )?;
    let device = phone.register_device("alice-phone").await?;
    writeln!(
        out,
        "phone: device {} registered for {}",
        device.device_id, device.user
    )?;
    let oncall = ConnectClient::new(stack.api_url.clone()).with_header(
        "authorization",
        format!("Bearer {}", stack.token(&config.owner, &config.org)?),
    )?;

    let first_run = post_alert(&stack, &sandbox, config).await?;
    writeln!(
        out,
        "GlitchTip alert posted: {}  ->  run {first_run}\n",
        sandbox.alert_payload()["attachments"][0]["title"]
    )?;

    let mut seen: Vec<(String, u64)> = Vec::new();
    let mut decided = std::collections::HashSet::new();
    let mut triaged = std::collections::HashSet::new();
    let mut killed = false;
    // Runs whose end promised a successor (a regressed run opens the next generation just after it ends): the
    // scenario is over once every run has ended and each of these has its successor.
    let mut successor_due = std::collections::HashSet::new();
    loop {
        if started.elapsed() > scenario.deadline {
            bail!("scenario did not finish within {:?}", scenario.deadline);
        }
        let runs: factory::ListRunsResponse = oncall
            .unary(
                &format!("{FACTORY}/ListRuns"),
                &factory::ListRunsRequest {
                    page_size: 100,
                    ..Default::default()
                },
            )
            .await?;
        let mut all_ended = !runs.runs.is_empty();
        for run in runs.runs.iter().rev() {
            let after = match seen.iter().position(|(id, _)| *id == run.id) {
                Some(i) => seen[i].1,
                None => {
                    seen.push((run.id.clone(), 0));
                    0
                }
            };
            let timeline: factory::GetTimelineResponse = oncall
                .unary(
                    &format!("{FACTORY}/GetTimeline"),
                    &factory::GetTimelineRequest {
                        run_id: run.id.clone(),
                        after_seq: after,
                        page_size: 200,
                    },
                )
                .await?;
            for event in &timeline.events {
                writeln!(
                    out,
                    "{}",
                    timeline_line(
                        &run.id,
                        run.generation,
                        run.started_at_ms,
                        event.at_ms,
                        &event.stage,
                        &event.r#type,
                        &event.summary
                    )
                )?;
                if promises_successor(event) {
                    successor_due.insert(run.id.clone());
                }
            }
            if let Some(last) = timeline.events.last()
                && let Some(entry) = seen.iter_mut().find(|(id, _)| *id == run.id)
            {
                entry.1 = last.seq;
            }
            if !is_ended(&run.state) || timeline.has_more {
                all_ended = false;
            }
            if let Some(accept) = scenario.triage
                && run.stage_state == "await_triage"
                && triaged.insert(run.id.clone())
            {
                let _: factory::DecideTriageResponse = oncall
                    .unary(
                        &format!("{FACTORY}/DecideTriage"),
                        &factory::DecideTriageRequest {
                            run_id: run.id.clone(),
                            accept,
                            idempotency_key: format!("triage-{}", run.id),
                        },
                    )
                    .await?;
                writeln!(
                    out,
                    "           on-call {} triage of run {}",
                    if accept { "accepts" } else { "rejects" },
                    short(&run.id)
                )?;
            }
            if !killed
                && run.id == first_run
                && !is_ended(&run.state)
                && scenario.kill_at_stage.as_deref() == Some(run.stage.as_str())
            {
                phone
                    .kill(&run.id, "stopped by the on-call engineer")
                    .await?;
                killed = true;
                writeln!(
                    out,
                    "           kill switch pulled for run {} (signed on the phone)",
                    short(&run.id)
                )?;
            }
        }
        for approval in phone.pending().await? {
            if decided.insert(approval.id.clone()) {
                let approve = scenario.phone == PhoneAnswer::Approve;
                let typing = match (&approval.confirmation_phrase, approve) {
                    (Some(phrase), true) => format!(", typing {phrase:?}"),
                    _ => String::new(),
                };
                writeln!(
                    out,
                    "           phone {}: {} ({}){typing}",
                    if approve { "approves" } else { "denies" },
                    approval.summary.lines().next().unwrap_or_default(),
                    approval.id
                )?;
                let decided = phone.decide(&approval.id, approve).await?;
                writeln!(
                    out,
                    "           phone: signed with device {}, server says {:?}",
                    device.device_id, decided.state
                )?;
            }
        }
        let successors_open = successor_due
            .iter()
            .all(|parent| runs.runs.iter().any(|run| run.parent_run == *parent));
        if all_ended && successors_open {
            break;
        }
        tokio::time::sleep(POLL).await;
    }

    let mut report_runs = Vec::new();
    let runs: factory::ListRunsResponse = oncall
        .unary(
            &format!("{FACTORY}/ListRuns"),
            &factory::ListRunsRequest {
                page_size: 100,
                ..Default::default()
            },
        )
        .await?;
    for run in runs.runs.into_iter().rev() {
        let timeline: factory::GetTimelineResponse = oncall
            .unary(
                &format!("{FACTORY}/GetTimeline"),
                &factory::GetTimelineRequest {
                    run_id: run.id.clone(),
                    after_seq: 0,
                    page_size: 1000,
                },
            )
            .await?;
        report_runs.push((run, timeline.events));
    }
    let sandbox_state = sandbox_counts(&sandbox.info().urls.forgejo)
        .await
        .unwrap_or_default();
    writeln!(out)?;
    for (run, timeline) in &report_runs {
        let links = run.links.clone().unwrap_or_default();
        let took = Duration::from_millis((run.updated_at_ms - run.started_at_ms).max(0) as u64);
        writeln!(
            out,
            "run {} (generation {}): {}{} after {} events in {:.1}s",
            run.id,
            run.generation,
            run.state,
            verdict(&run.verdict),
            timeline.len(),
            took.as_secs_f64()
        )?;
        writeln!(out, "  thread: {}", or_none(&links.thread))?;
        writeln!(out, "  issue:  {}", or_none(&links.issue))?;
        writeln!(out, "  pr:     {}", or_none(&links.pr))?;
        writeln!(out, "  deploy: {}", or_none(&links.deploy_ref))?;
        if let Some(budget) = &run.budget {
            writeln!(
                out,
                "  spent:  {} tokens, ${:.4}",
                budget.tokens_spent,
                budget.spent_micros as f64 / 1e6
            )?;
        }
    }
    // What the first run touched, as the approver's phone shows it: read from the apps through Loams.
    if let Some((run, _)) = report_runs.first() {
        writeln!(out)?;
        // A panel that cannot be read says why in its line; the demo goes on.
        crate::terminal::print_panels(&phone, &run.id, out).await?;
    }
    writeln!(out, "finished in {:.1}s", started.elapsed().as_secs_f64())?;
    stack.shutdown().await;
    sandbox.shutdown().await;
    Ok(Report {
        runs: report_runs,
        sandbox_state,
        approvals_decided: decided.len(),
    })
}

/// A scenario's world: the sandbox apps (GlitchTip producing as the scenario says) and the whole stack of
/// `loams dev` on them, the model replaying the scenario's cassette. `play` runs it; tests that drive the stack
/// themselves (the `loams phone` commands) start it the same way.
pub async fn start(scenario: &Scenario) -> anyhow::Result<(SandboxHandle, Stack)> {
    let sandbox = Sandbox::start(scenario.sandbox.clone())
        .await
        .context("starting the sandbox apps")?;
    if let Some(mode) = scenario.glitchtip_mode {
        sandbox
            .set_producing(mode)
            .context("switching GlitchTip production")?;
    }
    let model =
        Arc::new(Replay::from_json_str(&scenario.cassette).context("reading the cassette")?);
    let config = &scenario.config;
    let apps = sandbox_apps(&sandbox.info());
    let stack = Stack::start(config, &apps, model, Backend::from_config(config).await?).await?;
    Ok((sandbox, stack))
}

/// Posts the alert the sandbox's GlitchTip sends for the seeded bug to the stack's webhook, as GlitchTip would;
/// returns the id of the run it opened.
pub async fn post_alert(
    stack: &Stack,
    sandbox: &SandboxHandle,
    config: &Config,
) -> anyhow::Result<String> {
    let hook = format!(
        "{}/webhooks/glitchtip/{}",
        stack.api_url,
        crate::stack::webhook_token(config)?
    );
    let response = reqwest::Client::new()
        .post(&hook)
        .json(&sandbox.alert_payload())
        .send()
        .await
        .context("posting the alert")?;
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    body["run"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow!("webhook answered {status}: {body}"))
}

/// Whether `event` ends its run and asks for a successor run.
fn promises_successor(event: &factory::TimelineEvent) -> bool {
    event.r#type == "ended"
        && matches!(
            serde_json::from_str(&event.detail_json),
            Ok(loams_factory::Event::Ended {
                follow_up: Some(_),
                ..
            })
        )
}

fn is_ended(state: &str) -> bool {
    loams_factory::RunState::parse(state).is_some_and(loams_factory::RunState::is_terminal)
}

/// A run id shortened for a line of output.
pub(crate) fn short(run: &str) -> &str {
    run.get(..8).unwrap_or(run)
}

/// One timeline event as `loams demo` and `loams phone watch` print it, timed from the run's start.
pub(crate) fn timeline_line(
    run_id: &str,
    generation: u32,
    started_at_ms: i64,
    at_ms: i64,
    stage: &str,
    kind: &str,
    summary: &str,
) -> String {
    let at = Duration::from_millis((at_ms - started_at_ms).max(0) as u64);
    format!(
        "{:>7.2}s  {} g{}  {:<8} {:<22} {}",
        at.as_secs_f64(),
        short(run_id),
        generation,
        stage,
        kind,
        summary
    )
}

/// A run's verdict after its state, as ` [resolved]`; nothing without one.
pub(crate) fn verdict(verdict: &str) -> String {
    if verdict.is_empty() {
        String::new()
    } else {
        format!(" [{verdict}]")
    }
}

fn or_none(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

/// The sandbox's counters, read from its control endpoint.
pub async fn sandbox_counts(any_app_url: &str) -> anyhow::Result<serde_json::Value> {
    let url = format!("{any_app_url}/_sandbox/state");
    Ok(reqwest::get(&url).await?.error_for_status()?.json().await?)
}
