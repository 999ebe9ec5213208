//! The app clients under injected faults (loams-sandbox fault rules): which calls are retried, how 429 is waited
//! out, that a create whose answer is lost is never made twice, and what the errors say.

use std::time::{Duration, Instant};

use loams_a2a::Skills;
use loams_agents::*;
use loams_sandbox::{Fault, Sandbox, SandboxConfig, SandboxHandle, SandboxInfo};
use serde_json::{Value, json};

mod common;
use common::{
    analytics_config, forgejo_config, glitchtip_config, ok, plane_config, recording_sandbox,
};

/// Short enough to keep the tests fast, long enough for a loaded CI machine to answer a healthy request.
const TIMEOUT: Duration = Duration::from_millis(1500);

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 4,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
        max_retry_after: Duration::from_secs(5),
        max_elapsed: Duration::from_secs(30),
    }
}

async fn sandbox() -> (SandboxHandle, SandboxInfo) {
    let handle = Sandbox::start(SandboxConfig::default()).await.unwrap();
    let info = handle.info();
    (handle, info)
}

/// The recorded requests to `app` as `METHOD path`, oldest first.
fn sent(sb: &SandboxHandle, app: &str) -> Vec<String> {
    sb.requests()
        .into_iter()
        .filter(|e| e.app == app)
        .map(|e| format!("{} {}", e.method, e.path))
        .collect()
}

fn two_days_ago() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    now.as_millis() as i64 - 2 * 86_400_000
}

/// How many requests each armed rule has hit, in arming order.
fn fired(sb: &SandboxHandle) -> Vec<u32> {
    sb.faults().iter().map(|f| f.fired).collect()
}

fn zulip_config(info: &SandboxInfo) -> ZulipConfig {
    ZulipConfig {
        timeout: TIMEOUT,
        ..common::zulip_config(info)
    }
}

// Each agent with the short per-attempt timeout and fast retries.

fn zulip(info: &SandboxInfo) -> ZulipAgent {
    ZulipAgent::new(&zulip_config(info))
        .unwrap()
        .with_retry(fast_retry())
        .unwrap()
}

fn plane(info: &SandboxInfo) -> PlaneAgent {
    let cfg = PlaneConfig {
        timeout: TIMEOUT,
        ..plane_config(info)
    };
    PlaneAgent::new(&cfg)
        .unwrap()
        .with_retry(fast_retry())
        .unwrap()
}

fn forgejo(info: &SandboxInfo) -> ForgejoAgent {
    let cfg = ForgejoConfig {
        timeout: TIMEOUT,
        ..forgejo_config(info)
    };
    ForgejoAgent::new(&cfg)
        .unwrap()
        .with_retry(fast_retry())
        .unwrap()
}

fn glitchtip(info: &SandboxInfo) -> GlitchTipAgent {
    let cfg = GlitchTipConfig {
        timeout: TIMEOUT,
        ..glitchtip_config(info)
    };
    GlitchTipAgent::new(&cfg)
        .unwrap()
        .with_retry(fast_retry())
        .unwrap()
}

fn analytics(info: &SandboxInfo) -> AnalyticsAgent {
    let cfg = AnalyticsConfig {
        timeout: TIMEOUT,
        ..analytics_config(info)
    };
    AnalyticsAgent::new(&cfg)
        .unwrap()
        .with_retry(fast_retry())
        .unwrap()
}

/// `commit_patch` args writing `content` to `FIX.md` on `branch`.
fn fix_commit(branch: &str, base: &str, content: &str) -> Value {
    let files = json!([{"path": "FIX.md", "content": content}]);
    json!({"branch": branch, "base": base, "message": "Fix", "files": files})
}

fn plane_items(info: &SandboxInfo) -> String {
    format!(
        "/api/v1/workspaces/{}/projects/{}/work-items/",
        info.plane_workspace, info.plane_project_id
    )
}

fn forgejo_repo(info: &SandboxInfo, rest: &str) -> String {
    format!(
        "/api/v1/repos/{}/{}/{rest}",
        info.forgejo_owner, info.forgejo_repo
    )
}

#[tokio::test]
async fn idempotent_calls_are_retried_after_5xx_drops_and_timeouts() {
    let (sb, info) = sandbox().await;
    let issue = info.glitchtip_issue_id;

    // GET after two 503s.
    sb.inject(Fault::status("glitchtip", 2, 503)).unwrap();
    let events = ok(
        &glitchtip(&info),
        "issue_events",
        json!({"issue_id": issue, "since_ms": 0}),
    )
    .await;
    assert!(events["count"].as_u64().unwrap() > 0, "{events}");
    assert_eq!(fired(&sb), [2]);
    sb.clear_faults();

    // GET after a dropped connection.
    sb.inject(Fault::drop_connection("openpanel", 1)).unwrap();
    ok(
        &analytics(&info),
        "series",
        json!({"event": "checkout_error", "since_ms": two_days_ago()}),
    )
    .await;
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    // GET whose answer comes after the client's timeout: abandoned and asked again.
    sb.inject(Fault::delay("forgejo", 1, TIMEOUT * 3).method("GET"))
        .unwrap();
    let t0 = Instant::now();
    let read = ok(
        &forgejo(&info),
        "read_files",
        json!({"paths": ["README.md"]}),
    )
    .await;
    assert!(
        read["files"][0]["content"]
            .as_str()
            .unwrap()
            .contains("shop")
    );
    let took = t0.elapsed();
    assert!(
        took >= TIMEOUT && took < TIMEOUT * 3,
        "timed out once, then answered: {took:?}"
    );
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    // PUT after a 502 whose change was applied (resolving twice is harmless).
    sb.inject(
        Fault::status("glitchtip", 1, 502)
            .method("PUT")
            .after_effect(),
    )
    .unwrap();
    let r = ok(&glitchtip(&info), "resolve", json!({"issue_id": issue})).await;
    assert_eq!(r["status"], "resolved");
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    // A PATCH to an absolute value is made idempotent by our code, and retried.
    let agent = plane(&info);
    let item = ok(
        &agent,
        "create_issue",
        json!({"external_id": "factory:r-retry", "title": "t"}),
    )
    .await;
    sb.inject(Fault::status("plane", 1, 500).method("PATCH"))
        .unwrap();
    let s = ok(
        &agent,
        "set_state",
        json!({"issue_id": item["id"], "state": "started"}),
    )
    .await;
    assert_eq!(s["state"], "started");
    assert_eq!(fired(&sb), [1]);
    sb.shutdown().await;
}

#[tokio::test]
async fn retries_are_bounded_and_errors_name_the_call_and_the_apps_message() {
    let (sb, info) = sandbox().await;
    sb.inject(Fault::status("openpanel", 10, 503)).unwrap();
    let err = analytics(&info)
        .invoke(
            "series",
            json!({"event": "checkout_error", "since_ms": two_days_ago()}),
        )
        .await
        .unwrap_err();
    assert_eq!(fired(&sb), [4], "max_attempts bounds the tries");
    assert!(err.retryable, "{err:?}");
    for part in [
        "openpanel",
        "GET /export/charts",
        "HTTP 503",
        "after 4 attempt(s)",
        "sandbox: injected HTTP 503",
    ] {
        assert!(err.message.contains(part), "{part} in {}", err.message);
    }
    sb.clear_faults();

    // A client error is the app's answer: not retried, and its message is passed on.
    let err = glitchtip(&info)
        .invoke("resolve", json!({"issue_id": 999_999}))
        .await
        .unwrap_err();
    assert!(!err.retryable, "{err:?}");
    assert!(
        err.message
            .starts_with("glitchtip: PUT /api/0/issues/999999/: HTTP 404 (after 1 attempt(s)):"),
        "{}",
        err.message
    );

    // Nothing listening: connection errors are retried for every method (nothing was sent), then reported.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut cfg = zulip_config(&info);
    cfg.base_url = format!("http://{closed}");
    let client = ZulipClient::new(&cfg)
        .unwrap()
        .with_retry(fast_retry())
        .unwrap();
    let err = client.send("factory", "t", "x").await.unwrap_err();
    assert!(
        matches!(&err, AgentError::Transport { call, message, .. }
            if call == "POST /api/v1/messages" && message.contains("after 4 attempt(s)")),
        "{err}"
    );
    assert!(err.retryable());
    sb.shutdown().await;
}

#[tokio::test]
async fn rate_limits_wait_for_retry_after_for_any_method() {
    let (sb, info) = sandbox().await;
    let agent = plane(&info);
    // A 429 means the request was not processed, so even a plain POST is sent again, after the wait asked for.
    sb.inject(Fault::rate_limited("plane", 1, "1").method("POST"))
        .unwrap();
    let t0 = Instant::now();
    let item = ok(
        &agent,
        "create_issue",
        json!({"external_id": "factory:r-429", "title": "t"}),
    )
    .await;
    assert!(t0.elapsed() >= Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(item["created"], true);
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    sb.inject(Fault::rate_limited("plane", 1, "0").method("POST"))
        .unwrap();
    ok(
        &agent,
        "comment",
        json!({"issue_id": item["id"], "body": "no external id"}),
    )
    .await;
    assert_eq!(sb.counts().plane.comments, 1);
    sb.clear_faults();

    // Past the cap: fail at once and say so, rather than hold the caller for two minutes.
    sb.inject(Fault::rate_limited("plane", 1, "120")).unwrap();
    let t0 = Instant::now();
    let err = agent
        .invoke(
            "create_issue",
            json!({"external_id": "factory:r-429b", "title": "t"}),
        )
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert!(err.retryable);
    assert!(
        err.message.contains("rate limited (HTTP 429)")
            && err.message.contains("asked to wait 120 s")
            && err.message.contains(&format!("GET {}", plane_items(&info))),
        "{}",
        err.message
    );
    assert_eq!(sb.counts().plane.issues, 1);
    sb.shutdown().await;
}

#[tokio::test]
async fn lost_answers_to_plane_creates_make_no_duplicates() {
    let (sb, info) = sandbox().await;
    let agent = plane(&info);
    // The work item is made, the answer lost; it is found by its external id instead of being sent again.
    sb.inject(
        Fault::drop_connection("plane", 1)
            .method("POST")
            .path_prefix(&plane_items(&info))
            .after_effect(),
    )
    .unwrap();
    let item = ok(
        &agent,
        "create_issue",
        json!({"external_id": "factory:r-drop", "title": "t"}),
    )
    .await;
    assert_eq!(fired(&sb), [1]);
    assert_eq!(sb.counts().plane.issues, 1);
    let id = item["id"].as_str().unwrap().to_string();
    sb.clear_faults();

    // The same for a comment with an external id: one comment, and its id is the one answered.
    sb.inject(
        Fault::drop_connection("plane", 1)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    let args = json!({"issue_id": id, "body": "PR opened", "external_id": "factory:r-drop:pr"});
    let first = ok(&agent, "comment", args.clone()).await;
    assert_eq!(sb.counts().plane.comments, 1);
    assert_eq!(ok(&agent, "comment", args).await, first);
    assert_eq!(sb.counts().plane.comments, 1);
    sb.clear_faults();

    // Without one there is no way to tell: the client says so and does not send it again.
    sb.inject(
        Fault::drop_connection("plane", 1)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    let err = agent
        .invoke("comment", json!({"issue_id": id, "body": "no key"}))
        .await
        .unwrap_err();
    assert!(!err.retryable);
    assert!(
        err.message.contains("outcome unknown") && err.message.contains("/comments/"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [1]);
    assert_eq!(sb.counts().plane.comments, 2);
    sb.shutdown().await;
}

#[tokio::test]
async fn lost_answers_to_zulip_sends_are_looked_up_not_resent() {
    let (sb, info) = sandbox().await;
    let agent = zulip(&info);
    let channel = info.zulip_channel.clone();
    let read_topic = || async {
        ok(
            &agent,
            "read",
            json!({"channel": channel, "topic": "incident"}),
        )
        .await["messages"]
            .as_array()
            .unwrap()
            .len()
    };

    // Dropped after the message was stored: found in the topic, reported as sent, not posted twice.
    sb.inject(
        Fault::drop_connection("zulip", 1)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    let sent = ok(
        &agent,
        "post",
        json!({"channel": channel, "topic": "incident", "content": "Investigating"}),
    )
    .await;
    assert!(sent["message_id"].as_u64().is_some(), "{sent}");
    assert_eq!(sb.counts().zulip.messages, 1);
    sb.clear_faults();

    // Answered after our timeout, but stored: the same.
    sb.inject(
        Fault::delay("zulip", 1, TIMEOUT * 2)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    let late = ok(
        &agent,
        "post",
        json!({"channel": channel, "topic": "incident", "content": "Still investigating"}),
    )
    .await;
    assert_ne!(late["message_id"], sent["message_id"]);
    assert_eq!(sb.counts().zulip.messages, 2);
    sb.clear_faults();

    // Dropped before the app saw it: not in the topic, so the unknown outcome is reported, nothing resent.
    sb.inject(Fault::drop_connection("zulip", 1).method("POST"))
        .unwrap();
    let client = ZulipClient::new(&zulip_config(&info))
        .unwrap()
        .with_retry(fast_retry())
        .unwrap();
    let err = client
        .send(&info.zulip_channel, "incident", "Fixed")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::Uncertain { call, .. } if call == "POST /api/v1/messages"),
        "{err}"
    );
    assert!(!err.retryable());
    assert_eq!(fired(&sb), [1]);
    assert_eq!(sb.counts().zulip.messages, 2);
    assert_eq!(read_topic().await, 2);
    sb.shutdown().await;
}

#[tokio::test]
async fn lost_answers_to_forgejo_commits_prs_and_labels_make_no_duplicates() {
    let (sb, info) = sandbox().await;
    let agent = forgejo(&info);
    let base = info.forgejo_base.clone();
    let branch = "factory/r-drop";
    let before = sb.counts().forgejo;

    // Every create of the flow loses its answer once after taking effect: branch, commit, PR, label.
    for rest in ["branches", "contents", "pulls", "labels"] {
        sb.inject(
            Fault::drop_connection("forgejo", 1)
                .method("POST")
                .path_prefix(&forgejo_repo(&info, rest))
                .after_effect(),
        )
        .unwrap();
    }
    let commit = ok(&agent, "commit_patch", fix_commit(branch, &base, "fixed\n")).await;
    let pr = ok(
        &agent,
        "open_pr",
        json!({"branch": branch, "base": base, "title": "Fix", "body": "b", "labels": ["factory"]}),
    )
    .await;
    assert_eq!(fired(&sb), [1, 1, 1, 1]);
    assert_eq!(pr["head_sha"], commit["sha"]);
    let after = sb.counts().forgejo;
    assert_eq!(after.branches, before.branches + 1);
    assert_eq!(after.commits, before.commits + 1);
    assert_eq!(after.prs, before.prs + 1);
    assert_eq!(after.labels, before.labels + 1);
    sb.shutdown().await;
}

#[tokio::test]
async fn a_5xx_or_a_failed_lookup_after_a_lost_send_is_uncertain_and_never_retryable() {
    let (sb, info) = sandbox().await;
    let agent = zulip(&info);
    let post = |content: &str| {
        agent.invoke(
            "post",
            json!({"channel": info.zulip_channel, "topic": "incident", "content": content}),
        )
    };

    // A gateway's 504 while Zulip stored the message: looked up and found, not sent again.
    sb.inject(Fault::status("zulip", 1, 504).method("POST").after_effect())
        .unwrap();
    let sent = post("Investigating").await.unwrap();
    assert!(sent["message_id"].as_u64().is_some(), "{sent}");
    assert_eq!(sb.counts().zulip.messages, 1);
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    // The answer is lost and the lookup fails as well: the outcome stays unknown. The lookup's own 503 would
    // count as retryable, and a retry of the skill would post the message a second time.
    sb.inject(
        Fault::drop_connection("zulip", 1)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    sb.inject(
        Fault::status("zulip", 100, 503)
            .method("GET")
            .path_prefix("/api/v1/messages"),
    )
    .unwrap();
    let err = post("Fixed").await.unwrap_err();
    assert!(!err.retryable, "{err:?}");
    for part in [
        "POST /api/v1/messages: outcome unknown",
        "looking for its effect failed too",
        "GET /api/v1/messages: HTTP 503",
    ] {
        assert!(err.message.contains(part), "{part} in {}", err.message);
    }
    assert_eq!(fired(&sb), [1, 4]);
    assert_eq!(sb.counts().zulip.messages, 2);
    sb.clear_faults();

    // The same for a Forgejo label: its first listing passes (a no-op delay uses up the rule), the create's
    // answer is lost, and every later listing fails.
    let forgejo = forgejo(&info);
    let branch = "factory/r-label";
    ok(
        &forgejo,
        "commit_patch",
        fix_commit(branch, &info.forgejo_base, "x\n"),
    )
    .await;
    let labels = forgejo_repo(&info, "labels");
    let before = sb.counts().forgejo.labels;
    for (method, rule) in [
        ("GET", Fault::delay("forgejo", 1, Duration::ZERO)),
        ("POST", Fault::drop_connection("forgejo", 1).after_effect()),
        ("GET", Fault::status("forgejo", 100, 503)),
    ] {
        sb.inject(rule.method(method).path_prefix(&labels)).unwrap();
    }
    let err = forgejo
        .invoke(
            "open_pr",
            json!({"branch": branch, "base": info.forgejo_base, "title": "Fix", "body": "b", "labels": ["new-label"]}),
        )
        .await
        .unwrap_err();
    assert!(!err.retryable, "{err:?}");
    assert!(
        err.message
            .contains(&format!("POST {labels}: outcome unknown"))
            && err.message.contains("looking for its effect failed too"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [1, 1, 4]);
    assert_eq!(sb.counts().forgejo.labels, before + 1);
    sb.clear_faults();

    // A 5xx to a plain POST with no way to look it up: reported as unknown, not retryable, not resent.
    let plane = plane(&info);
    let item = ok(
        &plane,
        "create_issue",
        json!({"external_id": "factory:r-5xx", "title": "t"}),
    )
    .await;
    sb.inject(Fault::status("plane", 1, 502).method("POST").after_effect())
        .unwrap();
    let err = plane
        .invoke("comment", json!({"issue_id": item["id"], "body": "no key"}))
        .await
        .unwrap_err();
    assert!(!err.retryable, "{err:?}");
    assert!(
        err.message.contains("outcome unknown") && err.message.contains("HTTP 502"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [1]);
    assert_eq!(sb.counts().plane.comments, 1);
    sb.shutdown().await;
}

#[tokio::test]
async fn creates_the_app_dedupes_non_atomically_are_looked_up_never_sent_again() {
    let (sb, info) = recording_sandbox().await;
    let agent = plane(&info);
    let items = plane_items(&info);
    let find = format!("GET {items}");
    let create = format!("POST {items}");

    // Created, but answered after our timeout: found by its external id, never sent a second time.
    sb.inject(
        Fault::delay("plane", 1, TIMEOUT * 2)
            .method("POST")
            .after_effect(),
    )
    .unwrap();
    let item = ok(
        &agent,
        "create_issue",
        json!({"external_id": "factory:r-late", "title": "t"}),
    )
    .await;
    assert_eq!(item["created"], true);
    assert_eq!(sb.counts().plane.issues, 1);
    assert_eq!(sent(&sb, "plane"), [&*find, &create, &find]);
    sb.clear_faults();

    // A 503, here before Plane saw it: the lookup finds nothing, but Plane might still be making the item, so the
    // create is not sent again; the call fails as unknown and not retryable, naming the create.
    let before = sent(&sb, "plane").len();
    sb.inject(Fault::status("plane", 1, 503).method("POST"))
        .unwrap();
    let args = json!({"external_id": "factory:r-503", "title": "t"});
    let err = agent
        .invoke("create_issue", args.clone())
        .await
        .unwrap_err();
    assert!(!err.retryable, "{err:?}");
    assert!(
        err.message.contains(&format!("{create}: outcome unknown"))
            && err.message.contains("HTTP 503")
            && err.message.contains("not found right after"),
        "{}",
        err.message
    );
    assert_eq!(sb.counts().plane.issues, 1);
    // The refused POST never reached the recorder: lookup, lookup, and no second create.
    assert_eq!(sent(&sb, "plane")[before..], [&*find, &find]);
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();
    // Looked up again later (the caller's decision, as the error asks), it is created once.
    let second = ok(&agent, "create_issue", args).await;
    assert_eq!(second["created"], true);
    assert_eq!(sb.counts().plane.issues, 2);
    assert_eq!(sent(&sb, "plane")[before + 2..], [&*find, &create]);

    // A comment with an external id, made but answered 500: found among the item's comments.
    let comments = format!("{items}{}/comments/", item["id"].as_str().unwrap());
    sb.inject(Fault::status("plane", 1, 500).method("POST").after_effect())
        .unwrap();
    let c = ok(
        &agent,
        "comment",
        json!({"issue_id": item["id"], "body": "PR opened", "external_id": "factory:r-late:pr"}),
    )
    .await;
    assert!(c["id"].as_str().is_some(), "{c}");
    assert_eq!(sb.counts().plane.comments, 1);
    let to_comments: Vec<String> = sent(&sb, "plane")
        .into_iter()
        .filter(|r| r.ends_with(&comments))
        .collect();
    assert_eq!(
        to_comments,
        [format!("POST {comments}"), format!("GET {comments}")]
    );
    sb.clear_faults();

    // A pull request, opened but answered 502: found by its branches.
    let forgejo = forgejo(&info);
    let branch = "factory/r-pr-5xx";
    ok(
        &forgejo,
        "commit_patch",
        fix_commit(branch, &info.forgejo_base, "x\n"),
    )
    .await;
    let prs = sb.counts().forgejo.prs;
    let pulls = forgejo_repo(&info, "pulls");
    sb.inject(
        Fault::status("forgejo", 1, 502)
            .method("POST")
            .path_prefix(&pulls)
            .after_effect(),
    )
    .unwrap();
    let pr = ok(
        &forgejo,
        "open_pr",
        json!({"branch": branch, "base": info.forgejo_base, "title": "Fix", "body": "b"}),
    )
    .await;
    assert!(pr["number"].as_u64().is_some(), "{pr}");
    assert_eq!(fired(&sb), [1]);
    assert_eq!(sb.counts().forgejo.prs, prs + 1);
    let creates = sent(&sb, "forgejo")
        .iter()
        .filter(|r| **r == format!("POST {pulls}"))
        .count();
    assert_eq!(creates, 1);
    sb.shutdown().await;
}

#[tokio::test]
async fn a_call_ends_within_its_time_limit() {
    let (sb, info) = sandbox().await;
    let limited = |max_elapsed: Duration| {
        ZulipAgent::new(&zulip_config(&info))
            .unwrap()
            .with_retry(RetryPolicy {
                max_elapsed,
                ..fast_retry()
            })
            .unwrap()
    };
    let read = json!({"channel": info.zulip_channel, "topic": "incident"});

    // A Retry-After within the cap but past the time left: fail at once instead of waiting to no purpose.
    sb.inject(Fault::rate_limited("zulip", 1, "3")).unwrap();
    let t0 = Instant::now();
    let err = limited(Duration::from_secs(2))
        .invoke("read", read.clone())
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(err.retryable);
    assert!(
        err.message
            .contains("rate limited (HTTP 429) after 1 attempt(s)")
            && err.message.contains("asked to wait 3 s"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [1]);
    sb.clear_faults();

    // Answers that never come in time: the second attempt only gets what is left of the limit (1.4 s, under the
    // 1.5 s per attempt), and there is no third although the policy allows four. The 0.4 s over the one-second
    // floor for a new attempt is room for a late timer on a loaded machine.
    sb.inject(Fault::delay("zulip", 10, TIMEOUT * 4).method("GET"))
        .unwrap();
    let limit = TIMEOUT + Duration::from_millis(1400);
    let t0 = Instant::now();
    let err = limited(limit)
        .invoke("read", read.clone())
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert!(
        took >= limit && took < limit + TIMEOUT / 2,
        "ended at the limit: {took:?}"
    );
    assert!(err.retryable);
    assert!(
        err.message.contains("timeout after 2 attempt(s)")
            && err.message.contains("time limit of 2.9 s is spent"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [2]);
    sb.clear_faults();

    // Less than a second left after the first timeout: no attempt that would time out at once, the call ends
    // there with the time-limit error.
    sb.inject(Fault::delay("zulip", 10, TIMEOUT * 4).method("GET"))
        .unwrap();
    let limit = TIMEOUT + Duration::from_millis(700);
    let t0 = Instant::now();
    let err = limited(limit).invoke("read", read).await.unwrap_err();
    let took = t0.elapsed();
    assert!(took >= TIMEOUT && took < limit, "ended early: {took:?}");
    assert!(err.retryable);
    assert!(
        err.message.contains("timeout after 1 attempt(s)")
            && err.message.contains("time limit of 2.2 s is spent"),
        "{}",
        err.message
    );
    assert_eq!(fired(&sb), [1]);

    // The limit must be positive.
    assert!(
        ZulipAgent::new(&zulip_config(&info))
            .unwrap()
            .with_retry(RetryPolicy {
                max_elapsed: Duration::ZERO,
                ..fast_retry()
            })
            .is_err()
    );
    sb.shutdown().await;
}
