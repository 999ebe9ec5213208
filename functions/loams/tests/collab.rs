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
    let forgejo = &apps.apps[2];
    assert_eq!(forgejo.kind(), pc::AppKind::Forgejo);
    assert_eq!(forgejo.base_url, info.urls.forgejo.trim_end_matches('/'));
    let pr_link = forgejo.deep_link_templates["pull_request"]
        .replace("{number}", &links.pr_number.to_string());
    assert_eq!(
        pr_link, links.pr,
        "the template makes the run's own PR link"
    );
    let plane = &apps.apps[1];

    // Plane: the run's work item.
    let issue: pc::Issue = call(
        &oncall,
        "GetIssue",
        &pc::GetIssueRequest {
            issue_id: links.issue_id.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(issue.id, links.issue_id);
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
        &pc::GetPullRequestRequest {
            number: links.pr_number,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (pr.number, pr.state.as_str(), pr.merged),
        (links.pr_number, "open", false)
    );
    assert_eq!(pr.head_branch, format!("factory/{run_id}"));
    assert_eq!(pr.head_sha, links.commit_sha);
    assert_eq!(pr.base_branch, info.forgejo_base);
    assert_eq!(pr.url, links.pr);
    let checks: pc::ListCheckRunsResponse = call(
        &oncall,
        "ListCheckRuns",
        &pc::ListCheckRunsRequest {
            sha: links.commit_sha.clone(),
        },
    )
    .await
    .unwrap();
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

    // Zulip: the run's triage thread.
    let thread: pc::Thread = call(
        &oncall,
        "GetThread",
        &pc::GetThreadRequest {
            channel: links.thread_channel.clone(),
            topic: links.thread_topic.clone(),
        },
    )
    .await
    .unwrap();
    assert!(!thread.messages.is_empty());
    assert!(
        thread
            .messages
            .iter()
            .any(|m| m.content.contains(&issue.url)),
        "the issue link was posted: {thread:?}"
    );

    // GlitchTip: the error issue that opened the run.
    let error: pc::ErrorIssue = call(
        &oncall,
        "GetErrorIssue",
        &pc::GetErrorIssueRequest {
            issue_id: links.error_issue_id.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(error.id, info.glitchtip_issue_id.to_string());
    assert_eq!(error.status, "unresolved");
    assert!(
        error.event_count > 0 && error.first_seen_ms <= error.last_seen_ms,
        "{error:?}"
    );
    assert_eq!(error.title, run.signal.unwrap().title);

    // OpenPanel: the metric the factory watches, since a day ago.
    let event = loams_factory::Config::default().analytics_event;
    let since_ms = SystemClock.now_ms() - 86_400_000;
    let series: pc::MetricSeries = call(
        &oncall,
        "GetMetricSeries",
        &pc::GetMetricSeriesRequest {
            event: event.clone(),
            since_ms,
        },
    )
    .await
    .unwrap();
    assert_eq!(series.event, event);
    assert!(series.total > 0 && !series.points.is_empty(), "{series:?}");

    // Reading changed nothing in any app (GlitchTip's events are production's, which goes on meanwhile).
    let mut after = sandbox.counts();
    after.glitchtip.events = before.glitchtip.events;
    assert_eq!(after, before);

    // What is missing is NotFound; bad references are refused before any agent is asked.
    let missing = call::<_, pc::PullRequest>(
        &oncall,
        "GetPullRequest",
        &pc::GetPullRequestRequest { number: 9999 },
    )
    .await
    .unwrap_err();
    assert_eq!(missing.code, Code::NotFound, "{missing:?}");
    let refusals = [
        call::<_, pc::ErrorIssue>(
            &oncall,
            "GetErrorIssue",
            &pc::GetErrorIssueRequest {
                issue_id: "12ab".into(),
            },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::ErrorIssue>(
            &oncall,
            "GetErrorIssue",
            &pc::GetErrorIssueRequest {
                issue_id: "1".repeat(21),
            },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::Issue>(
            &oncall,
            "GetIssue",
            &pc::GetIssueRequest {
                issue_id: String::new(),
            },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::Issue>(
            &oncall,
            "GetIssue",
            &pc::GetIssueRequest {
                issue_id: "x".repeat(257),
            },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::PullRequest>(
            &oncall,
            "GetPullRequest",
            &pc::GetPullRequestRequest { number: 0 },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::MetricSeries>(
            &oncall,
            "GetMetricSeries",
            &pc::GetMetricSeriesRequest {
                event: "e\n".into(),
                since_ms: 0,
            },
        )
        .await
        .err()
        .map(|e| e.code),
        call::<_, pc::MetricSeries>(
            &oncall,
            "GetMetricSeries",
            &pc::GetMetricSeriesRequest {
                event: "e".into(),
                since_ms: -1,
            },
        )
        .await
        .err()
        .map(|e| e.code),
    ];
    for (i, refused) in refusals.into_iter().enumerate() {
        assert_eq!(refused, Some(Code::InvalidArgument), "refusal {i}");
    }
    let checks_refused = call::<_, pc::ListCheckRunsResponse>(
        &oncall,
        "ListCheckRuns",
        &pc::ListCheckRunsRequest {
            sha: "not-hex".into(),
        },
    )
    .await;
    assert_eq!(checks_refused.unwrap_err().code, Code::InvalidArgument);
    let thread_refused = call::<_, pc::Thread>(
        &oncall,
        "GetThread",
        &pc::GetThreadRequest {
            channel: "c".into(),
            topic: "t".repeat(61),
        },
    )
    .await;
    assert_eq!(thread_refused.unwrap_err().code, Code::InvalidArgument);

    // The caller's rights: a token without `plane:read` reads no Plane panel, and the registry says so.
    let narrow = stack
        .issuer
        .issue(
            "auditor",
            &org,
            "runs:read forgejo:read",
            SystemClock.now_ms() as u64 / 1000,
            600,
        )
        .unwrap();
    let auditor = client(&stack.api_url, &narrow);
    let denied = call::<_, pc::Issue>(
        &auditor,
        "GetIssue",
        &pc::GetIssueRequest {
            issue_id: links.issue_id.clone(),
        },
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
    let allowed: pc::PullRequest = call(
        &auditor,
        "GetPullRequest",
        &pc::GetPullRequestRequest {
            number: links.pr_number,
        },
    )
    .await
    .unwrap();
    assert_eq!(allowed.number, links.pr_number);

    // Another organisation's caller finds no app and reads nothing of this one.
    let outsider = client(&stack.api_url, &stack.token("mallory", "globex").unwrap());
    let none: pc::ListAppsResponse = call(&outsider, "ListApps", &pc::ListAppsRequest {})
        .await
        .unwrap();
    assert!(none.apps.is_empty());
    let refused = call::<_, pc::Issue>(
        &outsider,
        "GetIssue",
        &pc::GetIssueRequest {
            issue_id: links.issue_id.clone(),
        },
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code, Code::FailedPrecondition, "{refused:?}");

    stack.shutdown().await;
    sandbox.shutdown().await;
}
