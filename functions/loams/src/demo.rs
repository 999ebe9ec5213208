//! `loams demo` and the end-to-end scenarios: start everything in one process, post a GlitchTip alert for the
//! seeded bug, and follow the run(s) through the Connect API the phones use, deciding approvals on the terminal
//! phone (`loams phone`'s core), until every run has ended.

use std::collections::HashSet;
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
    let mut decided = HashSet::new();
    let mut triaged = HashSet::new();
    let mut killed = false;
    // Runs whose end promised a successor (a regressed run opens the next generation just after it ends). The
    // worker may still refuse to open it (a kill switch pulled meanwhile) and records that only in its log: the
    // scenario then runs into its deadline, which names the runs still waiting.
    let mut successor_due = HashSet::new();
    let mut waiting = Vec::new();
    loop {
        if started.elapsed() > scenario.deadline {
            if waiting.is_empty() {
                bail!("scenario did not finish within {:?}", scenario.deadline);
            }
            bail!(
                "scenario did not finish within {:?}: no successor opened for run(s) {} (see the worker's \
                 \"follow-up run not opened\" warning)",
                scenario.deadline,
                waiting.join(", ")
            );
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
        // Runs with events still to read: a run's `ended` event may sit on a later page.
        let mut pages_pending = HashSet::new();
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
            if timeline.has_more {
                pages_pending.insert(run.id.clone());
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
        waiting = successors_missing(&runs.runs, &successor_due);
        if waiting.is_empty() && all_read_and_ended(&runs.runs, &pages_pending) {
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

/// Whether every run has ended and its whole timeline has been read (there is at least one run).
fn all_read_and_ended(runs: &[factory::Run], pages_pending: &HashSet<String>) -> bool {
    !runs.is_empty()
        && runs
            .iter()
            .all(|run| is_ended(&run.state) && !pages_pending.contains(&run.id))
}

/// The runs in `successor_due` that no run in `runs` names as its parent, sorted.
fn successors_missing(runs: &[factory::Run], successor_due: &HashSet<String>) -> Vec<String> {
    let mut missing: Vec<String> = successor_due
        .iter()
        .filter(|parent| !runs.iter().any(|run| run.parent_run == **parent))
        .cloned()
        .collect();
    missing.sort();
    missing
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

#[cfg(test)]
mod tests {
    use super::*;
    use loams_factory::{Event, FollowUp, ObserveVerdict, Reason, RunState, Signal};

    /// `event` as the API returns it: stored by the worker as the event plus when, the stage it left and a summary.
    fn timeline_event(event: &Event) -> factory::TimelineEvent {
        let mut detail = serde_json::to_value(event).unwrap();
        let fields = detail.as_object_mut().unwrap();
        fields.insert("at_ms".into(), 1_700_000_000_000_i64.into());
        fields.insert("stage".into(), "observe".into());
        fields.insert("summary".into(), event.summary().into());
        factory::TimelineEvent {
            seq: 40,
            at_ms: 1_700_000_000_000,
            r#type: detail["type"].as_str().unwrap().into(),
            stage: "observe".into(),
            summary: event.summary(),
            detail_json: detail.to_string(),
        }
    }

    fn regressed(follow_up: Option<FollowUp>) -> Event {
        Event::Ended {
            state: RunState::Failed,
            reason: Some(Reason::Regressed),
            verdict: Some(ObserveVerdict::Regressed),
            follow_up,
        }
    }

    fn follow_up() -> FollowUp {
        FollowUp {
            generation: 2,
            parent_run: "r-1".into(),
            signal: Signal {
                source: "glitchtip".into(),
                fingerprint: "checkout-typeerror".into(),
                title: "TypeError in checkout".into(),
                link: "https://errors.example/issues/1".into(),
                glitchtip_issue_id: Some("1".into()),
                severity: "error".into(),
                generation: 2,
                parent_run: Some("r-1".into()),
            },
        }
    }

    fn run(id: &str, state: &str, parent: &str) -> factory::Run {
        factory::Run {
            id: id.into(),
            state: state.into(),
            parent_run: parent.into(),
            ..Default::default()
        }
    }

    #[test]
    fn only_an_end_with_a_follow_up_promises_a_successor() {
        assert!(promises_successor(&timeline_event(&regressed(Some(
            follow_up()
        )))));
        assert!(!promises_successor(&timeline_event(&regressed(None))));
        assert!(!promises_successor(&timeline_event(&Event::SeriesRead {
            total: 3
        })));
        let mut unreadable = timeline_event(&regressed(Some(follow_up())));
        unreadable.detail_json = "{\"type\": \"ended\"".into();
        assert!(!promises_successor(&unreadable));
    }

    #[test]
    fn the_scenario_waits_for_unread_pages_unended_runs_and_promised_successors() {
        let none = HashSet::new();
        assert!(!all_read_and_ended(&[], &none), "no run yet");
        let first = run("r-1", "failed", "");
        assert!(all_read_and_ended(std::slice::from_ref(&first), &none));
        let pending = HashSet::from(["r-1".to_string()]);
        assert!(
            !all_read_and_ended(std::slice::from_ref(&first), &pending),
            "the ended event may be on the page not read yet"
        );

        let due = HashSet::from(["r-1".to_string()]);
        assert_eq!(
            successors_missing(std::slice::from_ref(&first), &due),
            ["r-1"]
        );
        let second = run("r-2", "running", "r-1");
        let both = [first, second];
        assert!(successors_missing(&both, &due).is_empty());
        assert!(!all_read_and_ended(&both, &none), "the successor runs");
    }
}
