//! The native panels as a phone reads them: CollabService on the demo's stack, while the demo's run waits for its
//! merge approval. Every object the run made (its Plane issue, Forgejo pull request and CI checks, Zulip thread,
//! and the GlitchTip issue that opened it, and the analytics series) is read through the app's agent as the caller,
//! changes nothing in the apps, and is refused without the app's read scope.

use std::time::{Duration, Instant};

use loams::demo::{self, Scenario, post_alert};
use loams_platform::{Clock, SystemClock};
use loams_proto::collab::v1 as pc;
use loams_proto::connect::{Code, ConnectClient, ConnectError, ConnectMessage};
use loams_proto::factory::v1 as pf;

const COLLAB: &str = "/loams.collab.v1.CollabService";

fn client(base: &str, token: &str) -> ConnectClient {
    ConnectClient::new(base)
        .with_header("authorization", format!("Bearer {token}"))
        .unwrap()
}

async fn call<Req: ConnectMessage, Resp: ConnectMessage>(
    c: &ConnectClient,
    method: &str,
    req: &Req,
) -> Result<Resp, ConnectError> {
    c.unary(&format!("{COLLAB}/{method}"), req).await
}

/// The run once it has passed review and waits for the merge approval: every panel object exists by then.
async fn run_awaiting_merge(c: &ConnectClient, run_id: &str) -> pf::Run {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got: pf::GetRunResponse = c
            .unary(
                "/loams.factory.v1.FactoryService/GetRun",
                &pf::GetRunRequest {
                    run_id: run_id.into(),
                },
            )
            .await
            .unwrap();
        let run = got.run.unwrap();
        // At the merge step the run waits for the approver: nothing it made changes until they decide.
        if run.stage_state == "merge" {
            return run;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not reach its merge approval: {run:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panels_read_what_the_run_made_through_the_agents_as_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = Scenario::demo(dir.path().to_path_buf());
    let (sandbox, stack) = demo::start(&scenario).await.unwrap();
    let org = scenario.config.org.clone();
    let run_id = post_alert(&stack, &sandbox, &scenario.config)
        .await
        .unwrap();
    let oncall = client(&stack.api_url, &stack.token("oncall", &org).unwrap());
    let run = run_awaiting_merge(&oncall, &run_id).await;
    let links = run.links.clone().unwrap();
    let info = sandbox.info();
    let before = sandbox.counts();
    let of_run = || run_id.clone();

    // The registry: the five apps, configured, readable, with their web addresses and links from the agents' cards.
    let apps: pc::ListAppsResponse = call(&oncall, "ListApps", &pc::ListAppsRequest {})
        .await
        .unwrap();
    let ids: Vec<&str> = apps.apps.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["zulip", "plane", "forgejo", "glitchtip", "analytics"]);
    assert!(
        apps.apps
            .iter()
            .all(|a| a.configured && a.readable && a.environment == scenario.config.env)
    );
    let [zulip, plane, forgejo, glitchtip, analytics] = &apps.apps[..] else {
        panic!("{apps:?}")
    };
    assert_eq!(
        (
            zulip.kind(),
            plane.kind(),
            forgejo.kind(),
            glitchtip.kind(),
            analytics.kind()
        ),
        (
            pc::AppKind::Zulip,
            pc::AppKind::Plane,
            pc::AppKind::Forgejo,
            pc::AppKind::Glitchtip,
            pc::AppKind::Openpanel
        )
    );
    assert_eq!(forgejo.base_url, info.urls.forgejo.trim_end_matches('/'));
    assert_eq!(
        glitchtip.base_url,
        info.urls.glitchtip.trim_end_matches('/')
    );
    // Zulip's links cannot be written as templates: none. OpenPanel's agent knows only its API: no address at all.
    assert_eq!(zulip.base_url, info.urls.zulip.trim_end_matches('/'));
    assert!(zulip.deep_link_templates.is_empty());
    assert!(analytics.base_url.is_empty() && analytics.deep_link_templates.is_empty());

    // Plane: the run's work item; the registry's template makes the run's own link.
    let issue: pc::Issue = call(
        &oncall,
        "GetIssue",
        &pc::GetIssueRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!(issue.url, links.issue);
    assert_eq!(
        plane.deep_link_templates["issue"].replace("{key}", &issue.key),
        links.issue
    );
    assert_eq!(issue.external_id, format!("factory:{run_id}"));
    assert!(
        ["backlog", "unstarted", "started"].contains(&issue.state_group.as_str()),
        "an open work item: {issue:?}"
    );
    assert!(
        !issue.title.is_empty() && !issue.state.is_empty(),
        "{issue:?}"
    );

    // Forgejo: the pull request and the CI checks of its commit.
    let pr: pc::PullRequest = call(
        &oncall,
        "GetPullRequest",
        &pc::GetPullRequestRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!((pr.state.as_str(), pr.merged), ("open", false));
    assert_eq!(pr.head_branch, format!("factory/{run_id}"));
    assert_eq!(pr.base_branch, info.forgejo_base);
    assert_eq!(pr.url, links.pr);
    assert_eq!(
        forgejo.deep_link_templates["pull_request"].replace("{number}", &pr.number.to_string()),
        links.pr
    );
    let checks: pc::ListCheckRunsResponse = call(
        &oncall,
        "ListCheckRuns",
        &pc::ListCheckRunsRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!(
        checks.sha, pr.head_sha,
        "the run's latest commit is its PR's head"
    );
    assert_eq!(
        checks.state, "success",
        "the second attempt passed CI: {checks:?}"
    );
    assert!(!checks.check_runs.is_empty());
    assert!(
        checks
            .check_runs
            .iter()
            .all(|c| c.state == "success" && !c.name.is_empty()),
        "{checks:?}"
    );
    let commit = forgejo.deep_link_templates["commit"].replace("{sha}", &checks.sha);
    assert!(
        commit.starts_with(&forgejo.base_url) && commit.ends_with(&checks.sha),
        "{commit}"
    );

    // Zulip: the run's triage thread, where the issue link was posted.
    let thread: pc::Thread = call(
        &oncall,
        "GetThread",
        &pc::GetThreadRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!(thread.channel, info.zulip_channel);
    assert!(
        thread
            .messages
            .iter()
            .any(|m| m.content.contains(&issue.url)),
        "{thread:?}"
    );

    // GlitchTip: the error issue that opened the run, its link made by the registry's template too.
    let error: pc::ErrorIssue = call(
        &oncall,
        "GetErrorIssue",
        &pc::GetErrorIssueRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!(error.id, info.glitchtip_issue_id.to_string());
    assert_eq!(error.status, "unresolved");
    assert!(
        error.event_count > 0 && error.first_seen_ms <= error.last_seen_ms,
        "{error:?}"
    );
    let signal = run.signal.clone().unwrap();
    assert_eq!(
        (error.title.as_str(), error.url.as_str()),
        (signal.title.as_str(), signal.link.as_str())
    );
    assert_eq!(
        glitchtip.deep_link_templates["error_issue"].replace("{id}", &error.id),
        error.url
    );

    // OpenPanel: the event the run watches, from a day before the run (the default) or a given time.
    let event = loams_factory::Config::default().analytics_event;
    let series: pc::MetricSeries = call(
        &oncall,
        "GetMetricSeries",
        &pc::GetMetricSeriesRequest {
            run_id: of_run(),
            since_ms: 0,
        },
    )
    .await
    .unwrap();
    assert_eq!(series.event, event);
    assert!(series.total > 0 && !series.points.is_empty(), "{series:?}");
    let now = SystemClock.now_ms();
    for since_ms in [now - 91 * 86_400_000, now + 86_400_000, -1] {
        let refused = call::<_, pc::MetricSeries>(
            &oncall,
            "GetMetricSeries",
            &pc::GetMetricSeriesRequest {
                run_id: of_run(),
                since_ms,
            },
        )
        .await;
        assert_eq!(
            refused.unwrap_err().code,
            Code::InvalidArgument,
            "{since_ms}"
        );
    }

    // Reading changed nothing in any app (GlitchTip's events are production's, which goes on meanwhile).
    let mut after = sandbox.counts();
    after.glitchtip.events = before.glitchtip.events;
    assert_eq!(after, before);

    // A run that is not there (or not the caller's organisation's) has no panels; a malformed id is refused.
    let missing = call::<_, pc::Issue>(
        &oncall,
        "GetIssue",
        &pc::GetIssueRequest {
            run_id: "r-0000000000000000".into(),
        },
    )
    .await
    .unwrap_err();
    assert_eq!(missing.code, Code::NotFound, "{missing:?}");
    let malformed = call::<_, pc::Issue>(
        &oncall,
        "GetIssue",
        &pc::GetIssueRequest {
            run_id: String::new(),
        },
    )
    .await
    .unwrap_err();
    assert_eq!(malformed.code, Code::InvalidArgument, "{malformed:?}");

    // The caller's rights: a token without `plane:read` reads no Plane panel, and the registry says so and shows
    // it no address; without `runs:read` no panel at all.
    let now_s = SystemClock.now_ms() as u64 / 1000;
    let narrow = stack
        .issuer
        .issue("auditor", &org, "runs:read forgejo:read", now_s, 600)
        .unwrap();
    let auditor = client(&stack.api_url, &narrow);
    let denied = call::<_, pc::Issue>(
        &auditor,
        "GetIssue",
        &pc::GetIssueRequest { run_id: of_run() },
    )
    .await
    .unwrap_err();
    assert_eq!(denied.code, Code::PermissionDenied, "{denied:?}");
    let seen: pc::ListAppsResponse = call(&auditor, "ListApps", &pc::ListAppsRequest {})
        .await
        .unwrap();
    let readable: Vec<&str> = seen
        .apps
        .iter()
        .filter(|a| a.readable)
        .map(|a| a.id.as_str())
        .collect();
    assert_eq!(readable, ["forgejo"]);
    assert!(
        seen.apps
            .iter()
            .filter(|a| !a.readable)
            .all(|a| a.base_url.is_empty() && a.deep_link_templates.is_empty())
    );
    let allowed: pc::PullRequest = call(
        &auditor,
        "GetPullRequest",
        &pc::GetPullRequestRequest { run_id: of_run() },
    )
    .await
    .unwrap();
    assert_eq!(allowed.number, pr.number);
    let no_runs = stack
        .issuer
        .issue("viewer", &org, "forgejo:read", now_s, 600)
        .unwrap();
    let refused = call::<_, pc::PullRequest>(
        &client(&stack.api_url, &no_runs),
        "GetPullRequest",
        &pc::GetPullRequestRequest { run_id: of_run() },
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code, Code::PermissionDenied, "{refused:?}");

    // Another organisation's caller finds no app, and this organisation's run is not there for them.
    let outsider = client(&stack.api_url, &stack.token("mallory", "globex").unwrap());
    let none: pc::ListAppsResponse = call(&outsider, "ListApps", &pc::ListAppsRequest {})
        .await
        .unwrap();
    assert!(none.apps.is_empty());
    let hidden = call::<_, pc::Issue>(
        &outsider,
        "GetIssue",
        &pc::GetIssueRequest { run_id: of_run() },
    )
    .await
    .unwrap_err();
    assert_eq!(hidden.code, Code::NotFound, "{hidden:?}");

    stack.shutdown().await;
    sandbox.shutdown().await;
}
