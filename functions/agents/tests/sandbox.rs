//! The agents against the real sandbox apps (loams-sandbox), through the `Skills` trait as the A2A server calls them.

use loams_a2a::Skills;
use loams_agents::*;
use loams_sandbox::SandboxInfo;
use serde_json::{Value, json};

mod common;
use common::{
    analytics_config, forgejo_config, glitchtip_config, ok, plane_config,
    recording_sandbox as sandbox, recording_sandbox_with, zulip_config,
};

#[path = "../../sandbox/tests/support/spec.rs"]
mod spec;

/// Every request the agent sent (path and method to an operation, parameters, body) and every answer it got,
/// checked against the app's description; read over the control endpoint as another process would.
async fn conform(info: &SandboxInfo) {
    let log: Vec<loams_sandbox::Exchange> =
        reqwest::get(format!("{}/_sandbox/requests", info.urls.plane))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let checked = spec::assert_exchanges_conform(&log, true);
    assert!(checked > 0, "the agent sent nothing to a described app");
}

fn zulip(info: &SandboxInfo) -> ZulipAgent {
    ZulipAgent::new(&zulip_config(info)).unwrap()
}

fn plane(info: &SandboxInfo) -> PlaneAgent {
    PlaneAgent::new(&plane_config(info)).unwrap()
}

fn forgejo(info: &SandboxInfo) -> ForgejoAgent {
    ForgejoAgent::new(&forgejo_config(info)).unwrap()
}

#[tokio::test]
async fn zulip_post_and_read_a_topic() {
    let (sb, info) = sandbox().await;
    let agent = zulip(&info);
    let channel = info.zulip_channel.clone();
    let first = ok(
        &agent,
        "open_thread",
        json!({"channel": channel, "topic": "checkout 500s", "content": "Investigating"}),
    )
    .await;
    let url = first["url"].as_str().unwrap();
    assert!(
        url.starts_with(&format!("{}/#narrow/channel/", info.urls.zulip)),
        "{url}"
    );
    assert!(
        url.ends_with(&format!(
            "/topic/checkout.20500s/near/{}",
            first["message_id"]
        )),
        "{url}"
    );
    let second = ok(
        &agent,
        "post",
        json!({"channel": channel, "topic": "checkout 500s", "content": "PR **#1** opened"}),
    )
    .await;
    assert_ne!(first["message_id"], second["message_id"]);
    ok(
        &agent,
        "post",
        json!({"channel": channel, "topic": "other", "content": "noise"}),
    )
    .await;
    let read = ok(
        &agent,
        "read",
        json!({"channel": channel, "topic": "checkout 500s"}),
    )
    .await;
    let messages = read["messages"].as_array().unwrap();
    let contents: Vec<&str> = messages
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["Investigating", "PR **#1** opened"]);
    assert_eq!(messages[0]["id"], first["message_id"]);
    assert_eq!(messages[0]["sender"], json!(info.tokens.zulip_email));

    let err = agent
        .invoke(
            "post",
            json!({"channel": "no-such-channel", "topic": "t", "content": "x"}),
        )
        .await
        .unwrap_err();
    assert!(!err.retryable, "{err:?}");
    let err = agent
        .invoke("post", json!({"channel": channel, "topic": "t"}))
        .await
        .unwrap_err();
    assert!(!err.retryable && err.message.contains("content"), "{err:?}");

    // Wrong credentials: a permanent error that does not echo the key.
    let bad = ZulipAgent::new(&ZulipConfig {
        api_key: "wrong-key-123".into(),
        ..zulip_config(&info)
    })
    .unwrap();
    let err = bad
        .invoke("read", json!({"channel": channel, "topic": "t"}))
        .await
        .unwrap_err();
    assert!(
        !err.retryable && err.message.contains("401") && !err.message.contains("wrong-key-123"),
        "{err:?}"
    );
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn plane_create_is_create_if_absent_then_comment_and_state() {
    let (sb, info) = sandbox().await;
    let agent = plane(&info);
    let args = json!({"external_id": "factory:r-0123456789abcdef", "title": "checkout 500s", "description": "ZeroDivisionError <in> checkout"});
    let first = ok(&agent, "create_issue", args.clone()).await;
    assert_eq!(first["created"], json!(true));
    assert!(
        first["key"].as_str().unwrap().starts_with("OPS-"),
        "{first}"
    );
    assert!(
        first["url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/acme/browse/{}/", first["key"].as_str().unwrap()))
    );
    let again = ok(&agent, "create_issue", args).await;
    assert_eq!(again["created"], json!(false));
    assert_eq!((&again["id"], &again["key"]), (&first["id"], &first["key"]));
    let other = ok(
        &agent,
        "create_issue",
        json!({"external_id": "factory:r-other", "title": "x"}),
    )
    .await;
    assert_ne!(other["id"], first["id"]);

    let id = first["id"].as_str().unwrap();
    let c = ok(
        &agent,
        "comment",
        json!({"issue_id": id, "body": "Fix proposed"}),
    )
    .await;
    assert!(c["id"].as_str().is_some_and(|s| !s.is_empty()));

    // A comment with an external id is made once; the repeat's 409 names it, and it is checked before it is
    // returned. Plane looks for the external id project-wide, so the comment a 409 names can be another one.
    let keyed = json!({"issue_id": id, "body": "PR opened", "external_id": "factory:r-0123456789abcdef:pr"});
    let made = ok(&agent, "comment", keyed.clone()).await;
    assert_eq!(ok(&agent, "comment", keyed).await, made);
    assert_eq!(sb.counts().plane.comments, 2);
    for (issue, body, needle) in [
        (&other["id"], "PR opened", "a comment on another work item"),
        (
            &first["id"],
            "PR merged",
            "a different comment on this work item",
        ),
    ] {
        let err = agent
            .invoke(
                "comment",
                json!({"issue_id": issue, "body": body, "external_id": "factory:r-0123456789abcdef:pr"}),
            )
            .await
            .unwrap_err();
        assert!(!err.retryable);
        assert!(
            err.message.contains(needle) && err.message.contains(made["id"].as_str().unwrap()),
            "{}",
            err.message
        );
    }
    assert_eq!(sb.counts().plane.comments, 2);

    let s = ok(
        &agent,
        "set_state",
        json!({"issue_id": id, "state": "completed"}),
    )
    .await;
    assert_eq!(s["state"], json!("completed"));
    // The panel read: the item with its state's name and group, key and link as create_issue gave them.
    let shown = ok(&agent, "get_issue", json!({"issue_id": id})).await;
    assert_eq!(
        shown,
        json!({"found": true, "id": id, "key": first["key"], "title": "checkout 500s", "state": s["state_name"],
               "state_group": "completed", "external_id": "factory:r-0123456789abcdef", "url": first["url"]})
    );
    assert_eq!(
        ok(
            &agent,
            "get_issue",
            json!({"issue_id": "0c2b1a9e-0000-4000-8000-000000000000"})
        )
        .await,
        json!({"found": false})
    );
    let err = agent
        .invoke("set_state", json!({"issue_id": id, "state": "done"}))
        .await
        .unwrap_err();
    assert!(!err.retryable);
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn forgejo_patch_pr_ci_merge_flow() {
    let (sb, info) = sandbox().await;
    let agent = forgejo(&info);
    let base = info.forgejo_base.clone();
    let read = ok(
        &agent,
        "read_files",
        json!({"paths": ["src/checkout.py", "missing.txt"], "ref": base}),
    )
    .await;
    let original = read["files"][0]["content"].as_str().unwrap().to_string();
    assert!(original.contains("def apply_discount"));
    assert_eq!(
        read["files"][1],
        json!({"path": "missing.txt", "content": null})
    );

    let fixed = original.replace("/ 0", "/ 100");
    let branch = "factory/r-0123456789abcdef";
    let patch = json!({"branch": branch, "base": base, "message": "Fix division", "files": [{"path": "src/checkout.py", "content": fixed}]});
    let c1 = ok(&agent, "commit_patch", patch.clone()).await;
    // Repeating the same patch makes no new commit.
    let c2 = ok(&agent, "commit_patch", patch).await;
    assert_eq!(c1["sha"], c2["sha"]);
    let on_branch = ok(
        &agent,
        "read_files",
        json!({"paths": ["src/checkout.py"], "ref": branch}),
    )
    .await;
    assert_eq!(on_branch["files"][0]["content"], json!(fixed));
    let to_base = agent.invoke("commit_patch", json!({"branch": base, "base": base, "message": "x", "files": [{"path": "a", "content": "b"}]})).await;
    assert!(to_base.is_err_and(|e| !e.retryable));

    let pr_args = json!({"branch": branch, "base": base, "title": "Fix checkout", "body": "Divides by 100", "draft": true});
    let pr = ok(&agent, "open_pr", pr_args.clone()).await;
    assert_eq!(pr["head_sha"], c1["sha"]);
    let pr2 = ok(&agent, "open_pr", pr_args).await;
    assert_eq!(pr2["number"], pr["number"]);
    let number = pr["number"].as_u64().unwrap();

    let ci = ok(&agent, "ci_status", json!({"sha": c1["sha"]})).await;
    assert!(
        ["pending", "success", "failure", "error"].contains(&ci["state"].as_str().unwrap()),
        "{ci}"
    );
    // Each check as a panel lists it, with the log the factory reads made of the same statuses.
    for check in ci["checks"].as_array().unwrap() {
        let context = check["context"].as_str().unwrap();
        assert!(ci["log"].as_str().unwrap().contains(context), "{ci}");
    }

    // The panel read of the PR.
    let shown = ok(&agent, "get_pr", json!({"number": number})).await;
    assert_eq!(
        (
            &shown["found"],
            &shown["state"],
            &shown["merged"],
            &shown["head_branch"],
            &shown["head_sha"],
            &shown["base_branch"]
        ),
        (
            &json!(true),
            &json!("open"),
            &json!(false),
            &json!(branch),
            &c1["sha"],
            &json!(base)
        ),
        "{shown}"
    );
    assert_eq!(
        (&shown["title"], &shown["url"]),
        (&json!("WIP: Fix checkout"), &pr["url"])
    );
    assert_eq!(
        ok(&agent, "get_pr", json!({"number": 9999})).await,
        json!({"found": false})
    );

    // A draft (WIP) PR cannot be merged: the server refuses, and the error is permanent.
    let wip = agent
        .invoke("merge", json!({"number": number, "head_sha": c1["sha"]}))
        .await;
    assert!(wip.is_err_and(|e| !e.retryable && e.message.contains("405")));
    // Open-or-update: the same branch without draft updates the title of the same PR.
    let ready = ok(
        &agent,
        "open_pr",
        json!({"branch": branch, "base": base, "title": "Fix checkout", "body": "Divides by 100"}),
    )
    .await;
    assert_eq!(ready["number"], pr["number"]);

    let wrong = agent
        .invoke(
            "merge",
            json!({"number": number, "head_sha": "0000000000000000000000000000000000000000"}),
        )
        .await;
    assert!(wrong.is_err_and(|e| !e.retryable && e.message.contains("approved")));
    let merged = ok(
        &agent,
        "merge",
        json!({"number": number, "head_sha": c1["sha"]}),
    )
    .await;
    let merge_sha = merged["merge_sha"].as_str().unwrap().to_string();
    let again = ok(
        &agent,
        "merge",
        json!({"number": number, "head_sha": c1["sha"]}),
    )
    .await;
    assert_eq!(again["merge_sha"], json!(merge_sha));
    let shown = ok(&agent, "get_pr", json!({"number": number})).await;
    assert_eq!(
        (
            &shown["state"],
            &shown["merged"],
            &shown["merge_commit_sha"]
        ),
        (&json!("closed"), &json!(true), &json!(merge_sha))
    );
    // A merged PR cannot be closed: close_pr says so with the merge commit (a run that lost the merge's answer
    // reverts instead), and leaves the branch alone.
    let close = json!({"number": number, "branch": branch});
    assert_eq!(
        ok(&agent, "close_pr", close.clone()).await,
        json!({"closed": false, "merged": true, "merge_sha": merge_sha})
    );
    assert_eq!(
        ok(&agent, "close_pr", close).await["merge_sha"],
        json!(merge_sha)
    );
    let kept = ok(
        &agent,
        "read_files",
        json!({"paths": ["src/checkout.py"], "ref": branch}),
    )
    .await;
    assert_eq!(kept["files"][0]["content"], json!(fixed));
    let after = ok(&agent, "read_files", json!({"paths": ["src/checkout.py"]})).await;
    assert_eq!(after["files"][0]["content"], json!(fixed));
    conform(&info).await;
    sb.shutdown().await;
}

/// A Forgejo client for the sandbox's repository acting with `token`.
fn forgejo_client(info: &SandboxInfo, token: &str) -> ForgejoClient {
    ForgejoClient::new(&ForgejoConfig {
        token: token.into(),
        ..forgejo_config(info)
    })
    .unwrap()
}

/// Someone with push access who is not the factory.
fn intruder(info: &SandboxInfo) -> ForgejoClient {
    forgejo_client(info, &info.tokens.forgejo_token)
}

fn change(path: &str, content: &str) -> forgejo::FileChange {
    forgejo::FileChange {
        path: path.into(),
        content: Some(content.as_bytes().to_vec()),
    }
}

async fn refused(agent: &ForgejoAgent, skill: &str, args: Value, needle: &str) {
    match agent.invoke(skill, args.clone()).await {
        Ok(v) => panic!("{skill}({args}) succeeded: {v}"),
        Err(e) => assert!(!e.retryable && e.message.contains(needle), "{e:?}"),
    }
}

#[tokio::test]
async fn forgejo_commit_patch_refuses_branches_it_did_not_make() {
    let (sb, info) = sandbox().await;
    let agent = forgejo(&info);
    let other = intruder(&info);
    let base = info.forgejo_base.clone();
    let base_head = other.branch_head(&base).await.unwrap();
    let fixed = "def apply_discount(price, percent):\n    return price * percent / 100\n";
    let files = json!([{"path": "src/checkout.py", "content": fixed}]);

    // A branch prepared in advance under the predictable name, with a backdoor under a commit that even carries
    // the factory's exact file: refused, and nothing is committed on top.
    let branch = "factory/r-aaaaaaaaaaaaaaaa";
    assert!(other.create_branch(branch, &base).await.unwrap());
    let planted = [
        change("src/checkout.py", fixed),
        change("src/backdoor.py", "import os\n"),
    ];
    let foreign = other
        .apply_changes(branch, &base_head, "innocent", &planted)
        .await
        .unwrap();
    let patch = json!({"branch": branch, "base": base, "message": "Fix", "files": files});
    refused(
        &agent,
        "commit_patch",
        patch.clone(),
        "refusing to commit on top",
    )
    .await;
    let mut explicit_null = patch.clone();
    explicit_null["expected_head"] = Value::Null;
    refused(&agent, "commit_patch", explicit_null, &foreign).await;
    assert_eq!(other.branch_head(branch).await.unwrap(), foreign);

    // A branch that stands where the base does is fine; then each commit is pinned to the previous one.
    let branch = "factory/r-bbbbbbbbbbbbbbbb";
    assert!(other.create_branch(branch, &base).await.unwrap());
    let first = json!({"branch": branch, "base": base, "message": "Fix", "files": files});
    let c1 = ok(&agent, "commit_patch", first).await["sha"]
        .as_str()
        .unwrap()
        .to_string();
    let again = json!({"branch": branch, "base": base, "expected_head": c1, "message": "Fix 2",
        "files": [{"path": "src/checkout.py", "content": format!("{fixed}# 2\n")}]});
    let c2 = ok(&agent, "commit_patch", again.clone()).await["sha"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(c1, c2);
    // A retry whose answer was lost gets its own commit back.
    assert_eq!(ok(&agent, "commit_patch", again).await["sha"], json!(c2));
    // Pinned to a commit the branch has moved past (someone pushed since): refused, the branch is left as it is.
    let pushed = other
        .apply_changes(
            branch,
            &c2,
            "one more thing",
            &[change("src/backdoor.py", "x\n")],
        )
        .await
        .unwrap();
    let third = json!({"branch": branch, "base": base, "expected_head": c2, "message": "Fix 3",
        "files": [{"path": "src/checkout.py", "content": format!("{fixed}# 3\n")}]});
    refused(&agent, "commit_patch", third, "refusing to commit on top").await;
    assert_eq!(other.branch_head(branch).await.unwrap(), pushed);
    // Nor may a first commit land on it.
    refused(
        &agent,
        "commit_patch",
        json!({"branch": branch, "base": base, "message": "Fix", "files": files}),
        "head of the base",
    )
    .await;
    // A pinned commit to a branch that is gone is refused rather than recreated from base.
    let gone = json!({"branch": "factory/r-cccccccccccccccc", "base": base, "expected_head": c2, "message": "Fix", "files": files});
    refused(&agent, "commit_patch", gone, "no longer exists").await;
    refused(&agent, "commit_patch", json!({"branch": branch, "base": base, "expected_head": "not-a-sha", "message": "m", "files": files}), "expected_head").await;

    // The PR answer names its base.
    let pr = ok(
        &agent,
        "open_pr",
        json!({"branch": branch, "base": base, "title": "Fix", "body": ""}),
    )
    .await;
    assert_eq!(pr["base"], json!(base));
    assert_eq!(
        pr["head_sha"],
        json!(pushed),
        "the factory sees the foreign head and refuses to go on"
    );
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn forgejo_adopts_only_its_own_prs_and_merges_only_into_its_base() {
    let (sb, info) = sandbox().await;
    let agent = forgejo(&info);
    let maintainer = forgejo_client(&info, &info.tokens.forgejo_maintainer_token);
    let base = info.forgejo_base.clone();
    let commit = |branch: &str| {
        let files = json!([{"path": "NOTES.md", "content": branch}]);
        json!({"branch": branch, "base": base, "message": "m", "files": files})
    };

    // A person opened a PR from the agent's branch first: it is theirs, not adopted, and left as they wrote it.
    let branch = "factory/r-theirs";
    ok(&agent, "commit_patch", commit(branch)).await;
    let theirs = maintainer
        .create_pr(branch, &base, "Mine", "by hand")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(theirs.user.as_ref().unwrap().login, "maintainer");
    let prs = sb.counts().forgejo.prs;
    let args =
        json!({"branch": branch, "base": base, "title": "Fix", "body": "b", "labels": ["factory"]});
    refused(
        &agent,
        "open_pr",
        args,
        "opened by `maintainer`, not by this agent's account `loams-bot`",
    )
    .await;
    let kept = maintainer.get_pr(theirs.number).await.unwrap();
    assert_eq!(
        (kept.title.as_str(), kept.body.as_deref()),
        ("Mine", Some("by hand"))
    );
    assert_eq!(sb.counts().forgejo.prs, prs);

    // The agent's own PR, retargeted after it was opened: not merged into the other branch.
    let branch = "factory/r-retarget";
    let sha = ok(&agent, "commit_patch", commit(branch)).await["sha"].clone();
    let ours = ok(
        &agent,
        "open_pr",
        json!({"branch": branch, "base": base, "title": "Fix", "body": ""}),
    )
    .await;
    let number = ours["number"].as_u64().unwrap();
    assert!(maintainer.create_branch("release", &base).await.unwrap());
    let moved = maintainer
        .edit_pr(number, &json!({"base": "release"}))
        .await
        .unwrap();
    assert_eq!(moved.base.name, "release");
    let merges = sb.counts().forgejo.merges;
    refused(
        &agent,
        "merge",
        json!({"number": number, "head_sha": sha}),
        &format!("is into `release`, not the configured base `{base}`"),
    )
    .await;
    assert!(!maintainer.get_pr(number).await.unwrap().merged);
    assert_eq!(sb.counts().forgejo.merges, merges);
    // Set back, the same PR merges.
    maintainer
        .edit_pr(number, &json!({"base": base}))
        .await
        .unwrap();
    let merged = ok(&agent, "merge", json!({"number": number, "head_sha": sha})).await;
    assert!(merged["merge_sha"].as_str().is_some(), "{merged}");
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn forgejo_close_pr_deletes_its_branch() {
    let (sb, info) = sandbox().await;
    let agent = forgejo(&info);
    let base = info.forgejo_base.clone();
    let branch = "factory/r-close";
    ok(&agent, "commit_patch", json!({"branch": branch, "base": base, "message": "m", "files": [{"path": "NOTES.md", "content": "n"}]})).await;
    let pr = ok(
        &agent,
        "open_pr",
        json!({"branch": branch, "base": base, "title": "t", "body": ""}),
    )
    .await;
    let number = pr["number"].as_u64().unwrap();
    let wrong = agent
        .invoke(
            "close_pr",
            json!({"number": number, "branch": "factory/other"}),
        )
        .await;
    assert!(wrong.is_err_and(|e| !e.retryable));
    assert_eq!(
        ok(
            &agent,
            "close_pr",
            json!({"number": number, "branch": branch})
        )
        .await,
        json!({"closed": true})
    );
    // Repeat is fine (already closed, branch already gone).
    assert_eq!(
        ok(
            &agent,
            "close_pr",
            json!({"number": number, "branch": branch})
        )
        .await,
        json!({"closed": true})
    );
    let gone = ok(
        &agent,
        "read_files",
        json!({"paths": ["NOTES.md"], "ref": branch}),
    )
    .await;
    assert_eq!(gone["files"][0]["content"], json!(null));
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn glitchtip_counts_events_and_resolves() {
    // One event for the whole test (the next is an hour away), so counts and times read twice agree.
    let (sb, info) = recording_sandbox_with(loams_sandbox::SandboxConfig {
        glitchtip: loams_sandbox::GlitchtipSeed {
            event_interval_ms: 3_600_000,
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let agent = GlitchTipAgent::new(&glitchtip_config(&info)).unwrap();
    let id = info.glitchtip_issue_id.to_string();
    let all = ok(
        &agent,
        "issue_events",
        json!({"issue_id": id, "since_ms": 0}),
    )
    .await;
    let total = all["count"].as_u64().unwrap();
    assert!(total > 0, "{all}");
    let last = all["last_seen_ms"].as_i64().unwrap();
    let recent = ok(
        &agent,
        "issue_events",
        json!({"issue_id": id, "since_ms": last + 1}),
    )
    .await;
    assert!(recent["count"].as_u64().unwrap() < total.max(1), "{recent}");
    let shown = ok(&agent, "get_issue", json!({"issue_id": id})).await;
    assert_eq!(
        (&shown["found"], &shown["id"], &shown["status"]),
        (&json!(true), &json!(id), &json!("unresolved"))
    );
    assert!(shown["event_count"].as_u64().unwrap() >= total, "{shown}");
    assert_eq!(shown["last_seen_ms"], json!(last));
    assert!(shown["first_seen_ms"].as_i64().unwrap() <= last);
    assert!(!shown["title"].as_str().unwrap().is_empty());
    assert_eq!(
        shown["url"],
        json!(format!(
            "{}/{}/issues/{id}",
            info.urls.glitchtip.trim_end_matches('/'),
            info.glitchtip_org
        ))
    );
    assert_eq!(
        ok(&agent, "get_issue", json!({"issue_id": 999_999})).await,
        json!({"found": false})
    );
    let r = ok(
        &agent,
        "resolve",
        json!({"issue_id": info.glitchtip_issue_id}),
    )
    .await;
    assert_eq!(r["status"], json!("resolved"));
    let missing = agent
        .invoke("resolve", json!({"issue_id": 999_999}))
        .await
        .unwrap_err();
    assert!(!missing.retryable, "{missing:?}");
    conform(&info).await;
    sb.shutdown().await;
}

#[tokio::test]
async fn analytics_series_counts_days() {
    let (sb, info) = sandbox().await;
    let cfg = analytics_config(&info);
    let agent = AnalyticsAgent::new(&cfg).unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let since = before - 3 * 86_400_000;
    let s = ok(
        &agent,
        "series",
        json!({"event": "checkout_error", "since_ms": since}),
    )
    .await;
    let points = s["points"].as_array().unwrap();
    assert!((3..=4).contains(&points.len()), "{s}");
    let sum: f64 = points.iter().map(|p| p["count"].as_f64().unwrap()).sum();
    assert_eq!(s["total"].as_f64().unwrap(), sum);
    // OpenPanel's range ends in whole seconds: the query's end is the call's time rounded up, so the events of the
    // current second (all of them, in a run shorter than a second) are counted.
    assert!(sum > 0.0, "{s}");
    let sent = sb.requests();
    let query = &sent.iter().find(|e| e.app == "openpanel").unwrap().query;
    let end = reqwest::Url::parse(&format!("http://q/?{query}"))
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "endDate")
        .unwrap()
        .1
        .into_owned();
    let whole_seconds_after = |ms: i64| {
        let (y, m, d) = loams_platform::calendar::civil_from_days(ms.div_euclid(86_400_000));
        let secs = (ms.rem_euclid(86_400_000) + 999) / 1000;
        format!(
            "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        )
    };
    assert!(
        end >= whole_seconds_after(before),
        "{end} ends before the call"
    );
    // A start in the future (a series started at the next whole second after a merge, read within that second)
    // counts nothing rather than failing.
    let future = since + 4 * 86_400_000;
    let empty = ok(
        &agent,
        "series",
        json!({"event": "checkout_error", "since_ms": future}),
    )
    .await;
    assert_eq!(empty, json!({"points": [], "total": 0}));
    let bad = AnalyticsAgent::new(&AnalyticsConfig {
        client_secret: "nope".into(),
        ..cfg
    })
    .unwrap();
    let err = bad
        .invoke("series", json!({"event": "x", "since_ms": since}))
        .await
        .unwrap_err();
    assert!(!err.retryable && err.message.contains("401"), "{err:?}");
    sb.shutdown().await;
}
