//! `loams phone`: the phone apps' screens in a terminal, over the same core (`phone.rs`). Register a device key,
//! list the pending approvals with what they would do, approve (typing the phrase of a destructive action) or deny
//! with a signature of the device key, kill a run (a step-up signed the same way), and watch a run's timeline as it
//! happens.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Subcommand};
use loams_core::{
    Approval, ApprovalState, Decision, Device, Error, Risk, Run, RunListener, RunUpdate,
};
use tokio::sync::mpsc;

use crate::demo::{short, timeline_line, verdict};
use crate::phone::{Phone, token_org};

#[derive(Args)]
pub struct PhoneArgs {
    /// The Loams API, e.g. the address `loams dev` prints (setting `server`).
    #[arg(long, env = "LOAMS_SERVER", global = true)]
    server: Option<String>,
    /// The approver's bearer token; `loams token --user NAME` mints one for `loams dev` (setting `token`).
    #[arg(long, env = "LOAMS_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// The organisation (setting `org`; default: the one the token names).
    #[arg(long, env = "LOAMS_ORG", global = true)]
    org: Option<String>,
    /// Where the phone keeps its device key and cache (setting `data_dir`; default:
    /// $XDG_DATA_HOME/loams/phone, else ~/.local/share/loams/phone).
    #[arg(long, env = "LOAMS_PHONE_DIR", global = true)]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: PhoneCommand,
}

#[derive(Subcommand)]
enum PhoneCommand {
    /// Create this phone's device key (kept in the data directory) and register it for the token's user.
    Register {
        /// The device's name as the server lists it.
        #[arg(long, default_value = "terminal")]
        name: String,
    },
    /// List the pending approvals: run, action, risk, summary, requester.
    Approvals,
    /// Approve with the device key's signature.
    Approve {
        /// The approval's id, as `loams phone approvals` lists it.
        approval: String,
        /// The confirmation phrase of a destructive action, for use without a terminal (asked for otherwise).
        #[arg(long, value_name = "PHRASE")]
        confirm: Option<String>,
    },
    /// Deny with the device key's signature.
    Deny {
        /// The approval's id, as `loams phone approvals` lists it.
        approval: String,
    },
    /// Stop a run at its next step, with the device key's signature.
    Kill {
        /// The run's id (`r-...`).
        run: String,
        /// Why, as the run's record will say (default: "killed by <user>").
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Print a run's timeline as it happens, until the run has ended.
    Watch {
        /// The run's id (`r-...`).
        run: String,
    },
    /// Show what a run touched, read from the apps through Loams as you: its issue, pull request and CI checks,
    /// chat thread, the error that opened it, and the metric it watches.
    Panels {
        /// The run's id (`r-...`).
        run: String,
    },
}

/// `loams phone ...`, printing to stdout.
pub async fn run(args: PhoneArgs) -> anyhow::Result<()> {
    let phone = open(&args)?;
    let out = &mut std::io::stdout();
    match args.command {
        PhoneCommand::Register { name } => register(&phone, &name, out).await,
        PhoneCommand::Approvals => approvals(&phone, out).await,
        PhoneCommand::Approve { approval, confirm } => {
            decide(&phone, &approval, Decision::Approve, confirm, out).await
        }
        PhoneCommand::Deny { approval } => {
            decide(&phone, &approval, Decision::Deny, None, out).await
        }
        PhoneCommand::Kill { run, reason } => kill(&phone, &run, &reason, out).await,
        PhoneCommand::Watch { run } => watch(&phone, &run, out).await,
        PhoneCommand::Panels { run } => {
            if print_panels(&phone, &run, out).await? == 0 {
                bail!("no panel of run {run} could be read (see the lines above)");
            }
            Ok(())
        }
    }
}

/// The account the settings name. Every missing setting is reported with the flag and the variable that set it.
fn open(args: &PhoneArgs) -> anyhow::Result<Phone> {
    let server = args.server.as_deref().ok_or_else(|| {
        anyhow!("setting `server` is missing: pass --server or set LOAMS_SERVER (the API address `loams dev` prints)")
    })?;
    let token = args.token.clone().ok_or_else(|| {
        anyhow!("setting `token` is missing: pass --token or set LOAMS_TOKEN (`loams token --user NAME` mints one for `loams dev`)")
    })?;
    let org = match &args.org {
        Some(org) => org.clone(),
        None => token_org(&token).ok_or_else(|| {
            anyhow!("setting `org` is missing: pass --org or set LOAMS_ORG (the token names no organisation)")
        })?,
    };
    let data_dir = match &args.data_dir {
        Some(dir) => dir.clone(),
        None => default_data_dir().ok_or_else(|| {
            anyhow!("setting `data_dir` is missing: pass --data-dir or set LOAMS_PHONE_DIR (neither XDG_DATA_HOME nor HOME is set)")
        })?,
    };
    Phone::open(server, &org, token, &data_dir)
}

fn default_data_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_DATA_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|d| !d.is_empty())
                .map(|home| PathBuf::from(home).join(".local/share"))
        })?;
    Some(base.join("loams").join("phone"))
}

async fn register(phone: &Phone, name: &str, out: &mut dyn Write) -> anyhow::Result<()> {
    let device = phone
        .register_device(name)
        .await
        .context("registering the device")?;
    // The start of X: enough to tell two keys apart by eye.
    let key: String = device
        .public_key
        .get(1..9)
        .unwrap_or_default()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    writeln!(
        out,
        "device {} registered for {} as {:?} (P-256 key {key}...)",
        device.device_id, device.user, device.name
    )?;
    Ok(())
}

async fn approvals(phone: &Phone, out: &mut dyn Write) -> anyhow::Result<()> {
    // Offline, the cached list is still worth reading, with how old it is.
    let pending = match phone.pending().await {
        Ok(pending) => pending,
        Err(Error::Offline(why)) => {
            eprintln!("offline ({why}): the approvals as last read");
            phone.cached_pending()?
        }
        Err(e) => return Err(e).context("listing the pending approvals"),
    };
    if pending.is_empty() {
        writeln!(out, "no pending approvals")?;
    }
    for approval in &pending {
        describe(approval, out)?;
    }
    Ok(())
}

/// An approval as the phone's Approvals screen shows it: the server-rendered summary, verbatim.
fn describe(a: &Approval, out: &mut dyn Write) -> anyhow::Result<()> {
    let now = now_ms();
    let risk = match a.risk {
        Risk::Read => "read",
        Risk::Write => "write",
        Risk::Destructive => "destructive",
        Risk::Unknown => "unknown risk",
    };
    writeln!(out, "approval {}", a.id)?;
    writeln!(out, "  run:       {}", a.run_id)?;
    writeln!(out, "  action:    {}.{} ({risk})", a.agent, a.skill)?;
    // What the signature covers, with the agent and skill: the summary below is the server's rendering of it.
    writeln!(out, "  arguments: {}", a.args_json)?;
    if !a.target_commit.is_empty() {
        writeln!(out, "  commit:    {}", a.target_commit)?;
    }
    if let Some(phrase) = &a.confirmation_phrase {
        writeln!(out, "  to approve, type: {phrase}")?;
    }
    let mut lines = a.summary.lines();
    writeln!(out, "  summary:   {}", lines.next().unwrap_or_default())?;
    for line in lines {
        writeln!(out, "             {line}")?;
    }
    writeln!(
        out,
        "  requested: by {} on behalf of {}, {} ago; expires in {}",
        a.requester,
        a.on_behalf_of,
        span(now - a.created_at_ms),
        span(a.expires_at_ms - now)
    )?;
    writeln!(out, "  as of:     {} ago", span(now - a.confirmed_at_ms))?;
    Ok(())
}

async fn decide(
    phone: &Phone,
    approval_id: &str,
    decision: Decision,
    confirm: Option<String>,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    // Before anything is read or asked: without a device key nothing can be signed.
    let device = signing_device(phone)?;
    let approval = phone
        .approval(approval_id)
        .await
        .with_context(|| format!("reading approval {approval_id}"))?;
    describe(&approval, out)?;
    if approval.state != ApprovalState::Pending {
        bail!(
            "approval {approval_id} is no longer pending ({:?}{})",
            approval.state,
            if approval.decided_by.is_empty() {
                String::new()
            } else {
                format!(" by {}", approval.decided_by)
            }
        );
    }
    let typed = match (&approval.confirmation_phrase, decision) {
        (Some(phrase), Decision::Approve) => Some(match confirm {
            Some(typed) => typed,
            None => ask(phrase, approval_id).await?,
        }),
        _ => confirm,
    };
    // Signed over the action just shown (agent, skill, arguments, commit), without reading it again.
    let decided = phone
        .decide_shown(&approval, decision, typed)
        .await
        .with_context(|| format!("deciding approval {approval_id}"))?;
    writeln!(
        out,
        "{} {} ({}.{}), signed by device {}",
        match decided.decision {
            Some(Decision::Approve) => "approved",
            Some(Decision::Deny) => "denied",
            None => "decided",
        },
        decided.id,
        decided.agent,
        decided.skill,
        device.device_id
    )?;
    Ok(())
}

/// The registered, unrevoked device key that signs decisions and kills.
fn signing_device(phone: &Phone) -> anyhow::Result<Device> {
    match phone.device()?.filter(|d| d.revoked_at_ms == 0) {
        Some(device) => Ok(device),
        None => bail!("this phone has no registered device key: run `loams phone register` first"),
    }
}

async fn kill(
    phone: &Phone,
    run_id: &str,
    reason: &str,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let device = signing_device(phone)?;
    let run = phone
        .kill(run_id, reason)
        .await
        .with_context(|| format!("killing run {run_id}"))?;
    writeln!(
        out,
        "kill switch set for run {} (now {} at {}), signed by device {}; it stops at its next step",
        run.id, run.state, run.stage, device.device_id
    )?;
    Ok(())
}

/// App text as one line for a terminal: written by other people, so no control or format character (an escape
/// sequence could rewrite the screen, a bidi override reorder it) and no line break gets through; cut at `max`
/// characters.
fn plain(text: &str, max: usize) -> String {
    let shown = |c: char| loams_proto::is_plain_text(c.encode_utf8(&mut [0; 4]));
    let line: String = text
        .chars()
        .map(|c| if shown(c) { c } else { ' ' })
        .take(max)
        .collect();
    if text.chars().count() > max {
        format!("{line}...")
    } else {
        line
    }
}

/// A panel that could not be read, and why (a run that has not made the object yet, an app not readable by
/// this person, an app not answering): the other panels are still shown.
fn unread(e: &Error) -> String {
    format!("- ({e})")
}

/// The run's panels, each read on its own through the server (`loams phone panels`, and the demo's end); how many
/// could be read.
pub(crate) async fn print_panels(
    phone: &Phone,
    run_id: &str,
    out: &mut dyn Write,
) -> anyhow::Result<usize> {
    let mut read = 0;
    let mut shown = |line: Result<String, Error>| match line {
        Ok(line) => {
            read += 1;
            line
        }
        Err(e) => unread(&e),
    };
    let panels = phone.panels();
    writeln!(
        out,
        "panels of run {run_id}, read from the apps through Loams:"
    )?;
    let issue = shown(panels.issue(run_id).await.map(|i| {
        format!(
            "{} {} [{}] {}",
            plain(&i.key, 32),
            plain(&i.title, 80),
            plain(&i.state, 32),
            i.url
        )
    }));
    writeln!(out, "  issue:  {issue}")?;
    let pr = shown(panels.pull_request(run_id).await.map(|p| {
        format!(
            "#{} {} [{}{}] {} -> {} {}",
            p.number,
            plain(&p.title, 80),
            plain(&p.state, 16),
            if p.merged { ", merged" } else { "" },
            plain(&p.head_branch, 64),
            plain(&p.base_branch, 64),
            p.url
        )
    }));
    writeln!(out, "  pr:     {pr}")?;
    let checks = shown(panels.check_runs(run_id).await.map(|c| {
        let each: Vec<String> = c
            .checks
            .iter()
            .map(|r| format!("{} {}", plain(&r.name, 40), plain(&r.state, 16)))
            .collect();
        format!(
            "{} at {} ({})",
            plain(&c.state, 16),
            short_sha(&c.sha),
            each.join(", ")
        )
    }));
    writeln!(out, "  checks: {checks}")?;
    let thread = shown(panels.thread(run_id).await.map(|t| {
        let last = t.messages.last().map(|m| {
            format!(
                ": last {}: {}",
                plain(&m.sender_name, 40),
                plain(&m.content, 80)
            )
        });
        format!(
            "#{} > {}, {} messages{}",
            plain(&t.channel, 40),
            plain(&t.topic, 60),
            t.messages.len(),
            last.unwrap_or_default()
        )
    }));
    writeln!(out, "  thread: {thread}")?;
    let error = shown(panels.error_issue(run_id).await.map(|e| {
        format!(
            "{} [{}] {} events, {}",
            plain(&e.title, 80),
            plain(&e.status, 16),
            e.event_count,
            e.url
        )
    }));
    writeln!(out, "  error:  {error}")?;
    let metric = shown(panels.metric_series(run_id, 0).await.map(|m| {
        // The day of each point: OpenPanel dates them with a time of day.
        let day = |date: &str| plain(date.split(['T', ' ']).next().unwrap_or_default(), 10);
        let days: Vec<String> = m
            .points
            .iter()
            .map(|p| format!("{} {}", day(&p.date), p.count))
            .collect();
        format!(
            "{} total {} ({})",
            plain(&m.event, 64),
            m.total,
            days.join(", ")
        )
    }));
    writeln!(out, "  metric: {metric}")?;
    Ok(read)
}

fn short_sha(sha: &str) -> &str {
    sha.get(..12).unwrap_or(sha)
}

/// Asks the person at the terminal to type the phrase; without a terminal there is nobody to ask.
async fn ask(phrase: &str, approval_id: &str) -> anyhow::Result<String> {
    if !std::io::stdin().is_terminal() {
        bail!(
            "approval {approval_id} is destructive: approving it needs its phrase typed; pass --confirm {phrase:?} (or run in a terminal to type it)"
        );
    }
    eprint!("type {phrase:?} to approve: ");
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).map(|_| line)
    })
    .await
    .context("reading the confirmation")??;
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

/// Hands the core's updates, which arrive on its own task, to the printing loop.
struct Forward(mpsc::UnboundedSender<RunUpdate>);

impl RunListener for Forward {
    fn on_update(&self, update: RunUpdate) {
        let _ = self.0.send(update);
    }
}

async fn watch(phone: &Phone, run_id: &str, out: &mut dyn Write) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Held until the end: dropping it stops the watch.
    let _watch = phone
        .watch(run_id, Arc::new(Forward(tx)))
        .await
        .with_context(|| format!("watching run {run_id}"))?;
    let mut run: Option<Run> = None;
    let mut offline = String::new();
    while let Some(update) = rx.recv().await {
        match update {
            RunUpdate::Snapshot {
                run: cached,
                events,
            } => {
                if let Some(cached) = &cached {
                    run_header(cached, out)?;
                }
                run = cached;
                print_events(run.as_ref(), &events, out)?;
            }
            RunUpdate::Run { run: now } => {
                match &run {
                    None => run_header(&now, out)?,
                    Some(before) if before.state != now.state => {
                        writeln!(out, "           run {} is {}", short(&now.id), now.state)?
                    }
                    Some(_) => {}
                }
                run = Some(now);
            }
            RunUpdate::Events { events } => print_events(run.as_ref(), &events, out)?,
            RunUpdate::Confirmed { .. } => {}
            RunUpdate::Connection { connected, detail } => {
                if connected {
                    if !offline.is_empty() {
                        eprintln!("reconnected ({detail})");
                    }
                    offline.clear();
                } else {
                    eprintln!("not connected: {detail}");
                    offline = detail;
                }
            }
            RunUpdate::Finished => {
                let run = run.ok_or_else(|| anyhow!("run {run_id} ended unseen"))?;
                writeln!(
                    out,
                    "run {} ended {}{}",
                    run.id,
                    run.state,
                    verdict(&run.verdict)
                )?;
                return Ok(());
            }
        }
        out.flush()?;
    }
    // The core gives up only on what retrying cannot mend (unknown run, no permission, token refused).
    bail!("the watch of run {run_id} stopped: {offline}")
}

fn run_header(run: &Run, out: &mut dyn Write) -> anyhow::Result<()> {
    writeln!(
        out,
        "run {} (generation {}): {}  [{}]",
        run.id, run.generation, run.signal.title, run.state
    )?;
    Ok(())
}

fn print_events(
    run: Option<&Run>,
    events: &[loams_core::TimelineEvent],
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    for e in events {
        // Before the run itself has been read (a cold cache), times count from its first event shown.
        let (generation, started) =
            run.map_or((0, events[0].at_ms), |r| (r.generation, r.started_at_ms));
        writeln!(
            out,
            "{}",
            timeline_line(
                &e.run_id, generation, started, e.at_ms, &e.stage, &e.kind, &e.summary
            )
        )?;
    }
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// A time span as a person reads it at a glance: `45s`, `12m`, `71h 59m`.
fn span(ms: i64) -> String {
    let s = Duration::from_millis(ms.max(0) as u64).as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        _ => format!("{}h {}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn app_text_is_one_plain_line() {
        // An escape sequence, a line break, a bidi override and a zero-width space all become spaces.
        assert_eq!(
            plain("fix\x1b[2J\u{202E}evil\nline\u{200B}end", 80),
            "fix [2J evil line end"
        );
        // Cut at characters, not bytes, and marked.
        assert_eq!(plain("ééééé", 3), "ééé...");
        assert_eq!(plain("abc", 3), "abc");
    }

    #[test]
    fn spans_read_at_a_glance() {
        assert_eq!(span(-5), "0s");
        assert_eq!(span(59_999), "59s");
        assert_eq!(span(60_000), "1m");
        assert_eq!(span(72 * 3_600_000 - 60_000), "71h 59m");
    }
}
