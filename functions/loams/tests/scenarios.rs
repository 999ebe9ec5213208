//! End-to-end scenarios of the whole loop in one process: the sandbox apps, the five agents over A2A, the worker,
//! the API and a simulated phone, exactly as `loams demo` runs them. Each asserts the final state of the run(s)
//! and, through the sandbox's counters, that no effect happened twice.

use loams::demo::{DEMO_CASSETTE, PhoneAnswer, Report, Scenario, play};
use serde_json::Value;

async fn run(scenario: Scenario) -> (Report, String) {
    let mut out = Vec::new();
    let report = play(scenario, &mut out)
        .await
        .expect("scenario runs to the end");
    (report, String::from_utf8_lossy(&out).into_owned())
}

fn count(state: &Value, app: &str, key: &str) -> u64 {
    state[app][key]
        .as_u64()
        .unwrap_or_else(|| panic!("sandbox state has no {app}.{key}: {state}"))
}

fn types(report: &Report, run: usize) -> Vec<String> {
    report.runs[run]
        .1
        .iter()
        .map(|e| e.r#type.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_scenario_fixes_the_bug_once() {
    let dir = tempfile::tempdir().unwrap();
    let (report, out) = run(Scenario::demo(dir.path().to_path_buf())).await;
    assert_eq!(report.runs.len(), 1, "{out}");
    let run = report.first();
    assert_eq!(run.state, "succeeded", "{out}");
    assert_eq!(run.verdict, "resolved", "{out}");
    let events = types(&report, 0);
    assert_eq!(
        events.iter().filter(|t| *t == "attempt_failed").count(),
        1,
        "first attempt fails CI: {out}"
    );
    assert!(events.contains(&"merged".to_string()), "{out}");
    assert_eq!(report.approvals_decided, 1, "one merge approval: {out}");
    let s = &report.sandbox_state;
    assert_eq!(count(s, "plane", "issues"), 1, "{s}");
    assert_eq!(count(s, "forgejo", "prs"), 1, "{s}");
    assert_eq!(count(s, "forgejo", "merges"), 1, "{s}");
    assert!(out.contains("thread:") && out.contains("pr:"), "{out}");
    // The panels of the run, read through the agents at the end: the merged PR, green CI, the resolved error.
    for line in [
        "  pr:     #1 ",
        ", merged] factory/",
        "  checks: success at ",
        "[resolved]",
    ] {
        assert!(out.contains(line), "{line:?} in {out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_accepts_triage_through_the_api_and_the_run_completes() {
    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    // Without auto-triage the run waits in its triage thread until the on-call engineer decides.
    scenario.config.policy.auto_triage = false;
    scenario.triage = Some(true);
    let (report, out) = run(scenario).await;
    assert_eq!(report.runs.len(), 1, "{out}");
    let run = report.first();
    assert_eq!(run.state, "succeeded", "{out}");
    assert_eq!(run.verdict, "resolved", "{out}");
    assert!(out.contains("on-call accepts triage"), "{out}");
    let triage: Vec<Value> = report.runs[0]
        .1
        .iter()
        .filter(|e| e.r#type == "triage_decided")
        .map(|e| serde_json::from_str(&e.detail_json).unwrap())
        .collect();
    assert_eq!(triage.len(), 1, "{out}");
    assert_eq!(
        (
            &triage[0]["accept"],
            &triage[0]["automatic"],
            &triage[0]["by"]
        ),
        (
            &Value::Bool(true),
            &Value::Bool(false),
            &Value::from("oncall")
        ),
        "{out}"
    );
    let s = &report.sandbox_state;
    assert_eq!(count(s, "forgejo", "merges"), 1, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switch_stops_the_run_and_compensates() {
    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    // The fix stage lasts through two CI waits, so the watcher reliably sees it.
    scenario.kill_at_stage = Some("fix".into());
    let (report, out) = run(scenario).await;
    let run = report.first();
    assert_eq!(run.state, "killed", "{out}");
    assert!(
        out.contains("kill switch pulled") && out.contains("signed on the phone"),
        "the phone signed the kill: {out}"
    );
    let s = &report.sandbox_state;
    assert_eq!(count(s, "forgejo", "merges"), 0, "{s}");
    assert_eq!(
        count(s, "forgejo", "open_prs"),
        0,
        "the PR is closed by compensation: {s}\n{out}"
    );
    // Closing a PR is destructive, so even compensation asks a person (the safety wall); no merge approval.
    assert!(report.approvals_decided <= 1, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_exhausted_stops_before_paying_more() {
    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    // The first fix costs 976 tokens, so the budget allows the second (1,205 more), which exhausts it: the run
    // must stop there, before the review's model calls.
    scenario.config.factory.budget_tokens = 1_500;
    let (report, out) = run(scenario).await;
    let run = report.first();
    assert_eq!(run.state, "failed", "{out}");
    let events = types(&report, 0);
    assert!(
        report.runs[0]
            .1
            .iter()
            .any(|e| e.r#type == "abandoned" && e.summary.contains("budget")),
        "stopped for budget: {events:?}\n{out}"
    );
    assert_eq!(count(&report.sandbox_state, "forgejo", "merges"), 0);
    let budget = run.budget.unwrap();
    assert_eq!(
        budget.tokens_spent,
        976 + 1_205,
        "exactly the two fix calls were paid: {budget:?}"
    );
    assert!(
        !events.contains(&"lead_reviewed".to_string()),
        "no review after the budget ran out: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_safe_hands_off_after_the_last_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    scenario.config.factory.max_attempts = 1;
    let (report, out) = run(scenario).await;
    let run = report.first();
    assert_eq!(run.state, "failed", "{out}");
    assert!(
        report.runs[0]
            .1
            .iter()
            .any(|e| e.r#type == "abandoned" && e.summary.contains("fail_safe")),
        "{out}"
    );
    let s = &report.sandbox_state;
    assert_eq!(count(s, "forgejo", "merges"), 0, "{s}");
    assert_eq!(
        count(s, "forgejo", "prs"),
        1,
        "the draft PR is the same PR, not a second one: {s}"
    );
    assert_eq!(
        report.approvals_decided, 0,
        "fail_safe asks for no approval: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_reverts_and_opens_generation_two() {
    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    scenario.glitchtip_mode = Some(loams_sandbox::ProducingMode::On);
    // Two generations, each fixing in two attempts and passing both reviews.
    let mut cassette: Value = serde_json::from_str(DEMO_CASSETTE).unwrap();
    let once = cassette["completions"].as_array().unwrap().clone();
    cassette["completions"].as_array_mut().unwrap().extend(once);
    scenario.cassette = cassette.to_string();
    scenario.phone = PhoneAnswer::Approve;
    let (report, out) = run(scenario).await;
    assert_eq!(
        report.runs.len(),
        2,
        "generation 2 opened, generation 3 capped: {out}"
    );
    let (first, second) = (&report.runs[0].0, &report.runs[1].0);
    assert_eq!((first.generation, second.generation), (1, 2), "{out}");
    assert_eq!(first.verdict, "regressed", "{out}");
    assert_eq!(second.parent_run, first.id, "{out}");
    // Each generation: a merge approval and a revert approval.
    assert_eq!(report.approvals_decided, 4, "{out}");
    let s = &report.sandbox_state;
    // The reverts are pull requests a person merges; the factory merged only the two fixes.
    assert_eq!(count(s, "forgejo", "merges"), 2, "{s}");
    assert!(
        count(s, "forgejo", "open_prs") >= 1,
        "the revert pull request is open: {s}"
    );
}
