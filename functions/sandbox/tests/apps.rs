//! Each fake app exercised over HTTP against a started sandbox.

use loams_sandbox::{CiCheck, CiRule, ProducingMode, Sandbox, SandboxConfig, SandboxHandle};
use serde_json::{Value, json};
use std::time::Duration;

#[path = "support/spec.rs"]
mod spec;

#[path = "support/control.rs"]
mod control;
use control::{counts, zulip_message};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn start(mut config: SandboxConfig) -> SandboxHandle {
    config.record_requests = true;
    match Sandbox::start(config).await {
        Ok(h) => h,
        Err(e) => panic!("sandbox did not start: {e}"),
    }
}

async fn json_of(resp: reqwest::Response) -> Value {
    resp.json().await.unwrap_or(Value::Null)
}

/// Every answer the sandbox gave in this test, held to the official description of its app.
fn conform(sb: &SandboxHandle) {
    let log = sb.requests();
    let checked = spec::assert_exchanges_conform(&log, false);
    assert!(checked > 0, "no exchange with a described app was recorded");
}

#[tokio::test]
async fn zulip_send_and_read_a_topic() {
    let sb = start(SandboxConfig::default()).await;
    let t = sb.tokens().clone();
    let url = format!("{}/api/v1/messages", sb.urls().zulip);
    let send = |topic: &'static str, content: &'static str| {
        client()
            .post(&url)
            .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
            .form(&[
                ("type", "channel"),
                ("to", "factory"),
                ("topic", topic),
                ("content", content),
            ])
            .send()
    };
    let first = json_of(
        send("incident 42", "first")
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_eq!(first["result"], "success");
    assert_eq!(first["msg"], "");
    assert_eq!(first["id"], 1);
    send("other topic", "noise")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    send("incident 42", "second **bold**")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let narrow = json!([{"operator": "channel", "operand": "factory"}, {"operator": "topic", "operand": "incident 42"}]);
    let resp = client()
        .get(&url)
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .query(&[
            ("anchor", "newest"),
            ("num_before", "10"),
            ("num_after", "0"),
            ("apply_markdown", "false"),
        ])
        .query(&[("narrow", narrow.to_string())])
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let body = json_of(resp).await;
    let msgs = body["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        msgs.iter()
            .map(|m| m["content"].clone())
            .collect::<Vec<_>>(),
        vec![json!("first"), json!("second **bold**")]
    );
    assert_eq!(msgs[0]["subject"], "incident 42");
    assert_eq!(msgs[0]["display_recipient"], "factory");
    assert_eq!(msgs[0]["type"], "stream");
    for k in [
        "sender_id",
        "sender_email",
        "sender_full_name",
        "stream_id",
        "timestamp",
        "id",
    ] {
        assert!(msgs[0].get(k).is_some(), "message lacks {k}");
    }
    assert_eq!(body["found_newest"], true);
    assert_eq!(body["found_oldest"], true);
    assert_eq!(body["found_anchor"], false);
    assert_eq!(body["history_limited"], false);

    // window of one before the newest: history is not exhausted
    let resp = client()
        .get(&url)
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .query(&[
            ("anchor", "newest"),
            ("num_before", "1"),
            ("num_after", "0"),
        ])
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let body = json_of(resp).await;
    assert_eq!(body["messages"].as_array().map(Vec::len), Some(1));
    assert_eq!(body["found_oldest"], false);
    assert!(
        body["messages"][0]["content"]
            .as_str()
            .unwrap_or_default()
            .starts_with("<p>")
    );

    // unknown channel, bad key, no auth
    let r = client()
        .post(&url)
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .form(&[
            ("type", "stream"),
            ("to", "nope"),
            ("topic", "x"),
            ("content", "y"),
        ])
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 400);
    assert_eq!(json_of(r).await["code"], "STREAM_DOES_NOT_EXIST");
    let r = client()
        .get(&url)
        .basic_auth(&t.zulip_email, Some("wrong"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    assert_eq!(json_of(r).await["result"], "error");
    let r = client()
        .get(format!("{}/api/v1/users/me", sb.urls().zulip))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    let me = client()
        .get(format!("{}/api/v1/users/me", sb.urls().zulip))
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(json_of(me).await["email"], t.zulip_email.as_str());
    assert_eq!(counts(&sb).await.zulip.messages, 3);
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn plane_work_items_are_idempotent_on_external_id() {
    let sb = start(SandboxConfig::default()).await;
    let info = sb.info();
    let base = format!(
        "{}/api/v1/workspaces/{}/projects/{}",
        sb.urls().plane,
        info.plane_workspace,
        info.plane_project_id
    );
    let key = info.tokens.plane_api_key.clone();
    let c = client();

    let states = json_of(
        c.get(format!("{base}/states/"))
            .header("X-API-Key", &key)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    let groups: Vec<&str> = states["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["group"].as_str())
        .collect();
    assert_eq!(
        groups,
        vec!["backlog", "unstarted", "started", "completed", "cancelled"]
    );
    let done = states["results"][3]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();

    let item = json!({"name": "Checkout crashes", "description_html": "<p>ZeroDivisionError</p>",
                      "external_source": "loams", "external_id": "factory:r-1"});
    let r = c
        .post(format!("{base}/work-items/"))
        .header("X-API-Key", &key)
        .json(&item)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 201);
    let created = json_of(r).await;
    let id = created["id"].as_str().unwrap_or_default().to_string();
    assert_eq!(created["sequence_id"], 1);
    assert_eq!(created["external_id"], "factory:r-1");

    let r = c
        .post(format!("{base}/work-items/"))
        .header("X-API-Key", &key)
        .json(&item)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 409);
    let dup = json_of(r).await;
    assert_eq!(
        dup["error"],
        "Issue with the same external id and external source already exists"
    );
    assert_eq!(dup["id"], id.as_str());

    let found = json_of(
        c.get(format!("{base}/work-items/"))
            .header("X-API-Key", &key)
            .query(&[("external_id", "factory:r-1"), ("external_source", "loams")])
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    for k in [
        "count",
        "extra_stats",
        "grouped_by",
        "next_cursor",
        "next_page_results",
        "prev_cursor",
        "prev_page_results",
        "results",
        "sub_grouped_by",
        "total_count",
        "total_pages",
        "total_results",
    ] {
        assert!(
            found.get(k).is_some(),
            "PaginatedWorkItemResponse lacks required {k}"
        );
    }
    assert_eq!(found["total_results"], 1);
    assert_eq!(found["results"][0]["id"], id.as_str());
    let none = json_of(
        c.get(format!("{base}/work-items/"))
            .header("X-API-Key", &key)
            .query(&[("external_id", "other")])
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_eq!(none["results"], json!([]));

    let r = c
        .patch(format!("{base}/work-items/{id}/"))
        .header("X-API-Key", &key)
        .json(&json!({"state": done}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    let patched = json_of(r).await;
    assert_eq!(patched["state"], done.as_str());
    assert!(patched["completed_at"].is_string());
    let r = c
        .patch(format!("{base}/work-items/{id}/"))
        .header("X-API-Key", &key)
        .json(&json!({"state": "not-a-state"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 400);

    let r = c
        .post(format!("{base}/work-items/{id}/comments/"))
        .header("X-API-Key", &key)
        .json(&json!({"comment_html": "<p>PR opened</p>"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 201);
    let comment = json_of(r).await;
    assert_eq!(comment["issue"], id.as_str());
    assert_eq!(comment["comment_html"], "<p>PR opened</p>");

    let r = c
        .get(format!(
            "{base}/work-items/00000000-0000-4000-8000-000000000000/"
        ))
        .header("X-API-Key", &key)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 404);
    let r = c
        .post(format!(
            "{base}/work-items/00000000-0000-4000-8000-000000000000/comments/"
        ))
        .header("X-API-Key", &key)
        .json(&json!({"comment_html": "x"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 404);
    let r = c
        .get(format!("{base}/work-items/{id}/"))
        .header("X-API-Key", "wrong")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    assert!(json_of(r).await["detail"].is_string());

    let n = counts(&sb).await;
    assert_eq!((n.plane.issues, n.plane.comments), (1, 1));
    conform(&sb);
    sb.shutdown().await;
}

fn b64(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

struct Forgejo {
    api: String,
    token: String,
}

impl Forgejo {
    fn new(sb: &SandboxHandle) -> Forgejo {
        let i = sb.info();
        Forgejo {
            api: format!(
                "{}/api/v1/repos/{}/{}",
                sb.urls().forgejo,
                i.forgejo_owner,
                i.forgejo_repo
            ),
            token: i.tokens.forgejo_token,
        }
    }
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = client()
            .request(method, format!("{}{path}", self.api))
            .header("Authorization", format!("token {}", self.token));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap_or_else(|e| panic!("{e}"));
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }
    async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None).await
    }
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }
    async fn file_sha(&self, path: &str, reference: &str) -> String {
        let (s, v) = self.get(&format!("/contents/{path}?ref={reference}")).await;
        assert_eq!(s, 200, "{v}");
        v["sha"].as_str().unwrap_or_default().to_string()
    }
    async fn commit(&self, branch: &str, path: &str, content: &str) -> String {
        let sha = self.file_sha(path, branch).await;
        let (s, v) = self
            .post("/contents", json!({"branch": branch, "message": "fix", "files": [{"operation": "update", "path": path, "content": b64(content), "sha": sha}]}))
            .await;
        assert_eq!(s, 201, "{v}");
        v["commit"]["sha"].as_str().unwrap_or_default().to_string()
    }
    async fn status(&self, sha: &str) -> Value {
        let (s, v) = self.get(&format!("/commits/{sha}/status")).await;
        assert_eq!(s, 200, "{v}");
        v
    }
}

async fn settle(f: &Forgejo, sha: &str) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let v = f.status(sha).await;
        if v["state"] != "pending" {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("CI never settled for {sha}");
}

#[tokio::test]
async fn forgejo_ci_pr_merge_and_production() {
    let mut config = SandboxConfig::default();
    // long enough that the first read after a commit sees `pending` even on a loaded CI machine
    config.ci.delay_ms = 2000;
    config.glitchtip.event_interval_ms = 10;
    let sb = start(config).await;
    let f = Forgejo::new(&sb);

    // branch create, duplicate 409, read back
    let (s, v) = f
        .post(
            "/branches",
            json!({"new_branch_name": "loams/r-1", "old_ref_name": "main"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["name"], "loams/r-1");
    let (s, _) = f
        .post("/branches", json!({"new_branch_name": "loams/r-1"}))
        .await;
    assert_eq!(s, 409);
    let (s, v) = f.get("/branches/loams/r-1").await;
    assert_eq!((s, v["name"].clone()), (200, json!("loams/r-1")));

    let original = {
        let (_, v) = f.get("/contents/src/checkout.py?ref=main").await;
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(v["content"].as_str().unwrap_or_default())
            .unwrap_or_default();
        String::from_utf8(raw).unwrap_or_default()
    };
    assert!(original.contains("/ 0\n"));

    // first attempt still broken: pending then failure naming what failed
    let bad = f
        .commit(
            "loams/r-1",
            "src/checkout.py",
            &original.replace("/ 0\n", "/ 10\n"),
        )
        .await;
    let first = f.status(&bad).await;
    assert_eq!(first["state"], "pending");
    assert_eq!(first["statuses"][0]["status"], "pending");
    let failed = settle(&f, &bad).await;
    assert_eq!(failed["state"], "failure");
    assert_eq!(failed["statuses"][0]["context"], "loams-ci");
    assert!(
        failed["statuses"][0]["description"]
            .as_str()
            .unwrap_or_default()
            .contains("percent / 100"),
        "{failed}"
    );
    // second attempt fixes it
    let good = f
        .commit(
            "loams/r-1",
            "src/checkout.py",
            &original.replace("/ 0\n", "/ 100\n"),
        )
        .await;
    assert_eq!(f.status(&good).await["state"], "pending");
    assert_eq!(settle(&f, &good).await["state"], "success");
    assert_eq!(f.status("loams%2Fr-1").await["sha"], good.as_str());

    // the commit diff shows the change against its parent
    let (s, diff) = f.get(&format!("/git/commits/{good}.diff")).await;
    assert_eq!(s, 200);
    let diff = diff.as_str().unwrap_or_default().to_string();
    assert!(
        diff.contains(
            "-    return price - price * percent / 10\n+    return price - price * percent / 100\n"
        ),
        "{diff}"
    );

    // PR, duplicate PR 409, merge
    let (s, pr) = f.post("/pulls", json!({"head": "loams/r-1", "base": "main", "title": "Fix discount", "body": "fixes #42"})).await;
    assert_eq!(s, 201, "{pr}");
    let number = pr["number"].as_u64().unwrap_or_default();
    assert_eq!(pr["head"]["sha"], good.as_str());
    assert_eq!(pr["mergeable"], true);
    let (s, _) = f
        .post(
            "/pulls",
            json!({"head": "loams/r-1", "base": "main", "title": "again"}),
        )
        .await;
    assert_eq!(s, 409);
    let (s, open) = f.get("/pulls?state=open").await;
    assert_eq!((s, open.as_array().map(Vec::len)), (200, Some(1)));
    // By base and head: the head branch holds a slash; an unknown pair is 404.
    let (s, by_branches) = f.get("/pulls/main/loams/r-1").await;
    assert_eq!((s, by_branches["number"].as_u64()), (200, Some(number)));
    let (s, _) = f.get("/pulls/main/loams/r-2").await;
    assert_eq!(s, 404);
    let (s, _) = f.get(&format!("/pulls/{number}/merge")).await;
    assert_eq!(s, 404);

    let before = counts(&sb).await;
    assert!(before.glitchtip.producing);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (s, _) = f
        .post(
            &format!("/pulls/{number}/merge"),
            json!({"Do": "merge", "head_commit_id": "0000000"}),
        )
        .await;
    assert_eq!(s, 409, "a stale head must not merge");
    let (s, v) = f
        .post(
            &format!("/pulls/{number}/merge"),
            json!({"Do": "merge", "head_commit_id": good, "delete_branch_after_merge": true}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, _) = f.get(&format!("/pulls/{number}/merge")).await;
    assert_eq!(s, 204);
    let (_, merged) = f.get(&format!("/pulls/{number}")).await;
    assert_eq!(
        (merged["state"].clone(), merged["merged"].clone()),
        (json!("closed"), json!(true))
    );
    let merge_sha = merged["merge_commit_sha"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(merge_sha.len(), 40);
    let (s, _) = f
        .post(&format!("/pulls/{number}/merge"), json!({"Do": "merge"}))
        .await;
    assert_eq!(s, 405, "already merged");
    let (s, _) = f.get("/branches/loams/r-1").await;
    assert_eq!(s, 404, "head branch deleted after merge");

    // production is fixed: events stop
    let after_merge = counts(&sb).await;
    assert!(!after_merge.glitchtip.producing);
    assert!(after_merge.glitchtip.events > 0);
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(
        counts(&sb).await.glitchtip.events,
        after_merge.glitchtip.events
    );
    assert_eq!(after_merge.forgejo.merges, 1);
    assert_eq!(
        (after_merge.forgejo.prs, after_merge.forgejo.open_prs),
        (1, 0)
    );

    // the merge diff against the old main is the fix
    let (_, d) = f.get(&format!("/git/commits/{merge_sha}.diff")).await;
    assert!(
        d.as_str()
            .unwrap_or_default()
            .contains("+    return price - price * percent / 100\n")
    );

    // auth and unknown ids
    let r = client()
        .get(format!("{}/pulls", f.api))
        .header("Authorization", "token wrong")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    assert!(json_of(r).await["message"].is_string());
    let (s, v) = f.get("/pulls/999").await;
    assert_eq!(s, 404);
    assert!(v["message"].is_string());
    let (s, _) = f.get("/contents/nope.txt").await;
    assert_eq!(s, 404);

    // closing a PR answers 201 and shows it closed
    let (s, _) = f
        .post("/branches", json!({"new_branch_name": "loams/r-2"}))
        .await;
    assert_eq!(s, 201);
    f.commit("loams/r-2", "README.md", "# shop\n\nchanged\n")
        .await;
    let (s, pr2) = f
        .post(
            "/pulls",
            json!({"head": "acme:loams/r-2", "base": "main", "title": "Docs"}),
        )
        .await;
    assert_eq!(s, 201, "{pr2}");
    let (s, closed) = f
        .send(
            reqwest::Method::PATCH,
            &format!("/pulls/{}", pr2["number"]),
            Some(json!({"state": "closed"})),
        )
        .await;
    assert_eq!(
        (s, closed["state"].clone(), closed["merged"].clone()),
        (201, json!("closed"), json!(false))
    );
    let (s, _) = f
        .send(reqwest::Method::DELETE, "/branches/loams/r-2", None)
        .await;
    assert_eq!(s, 204);

    // responses stay inside the official definitions
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn glitchtip_events_follow_production_and_control() {
    let mut config = SandboxConfig::default();
    config.glitchtip.event_interval_ms = 10;
    let sb = start(config).await;
    let i = sb.info();
    let url = format!(
        "{}/api/0/issues/{}/",
        sb.urls().glitchtip,
        i.glitchtip_issue_id
    );
    let auth = format!("Bearer {}", i.tokens.glitchtip_token);
    tokio::time::sleep(Duration::from_millis(45)).await;

    let issue = json_of(
        client()
            .get(&url)
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_eq!(issue["id"], "42");
    let count: u64 = issue["count"]
        .as_str()
        .and_then(|c| c.parse().ok())
        .unwrap_or_default();
    assert!(count >= 4, "{issue}");
    assert_eq!(issue["status"], "unresolved");

    // Paging over a list that grows every 10 ms would shift under the cursor: hold production still meanwhile.
    if let Err(e) = sb.set_producing(ProducingMode::Off) {
        panic!("{e}");
    }
    let r = client()
        .get(format!("{url}events/?limit=2"))
        .header("Authorization", &auth)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        r.headers()
            .get("link")
            .and_then(|l| l.to_str().ok())
            .is_some_and(|l| l.contains("rel=\"next\"; results=\"true\""))
    );
    let events = json_of(r).await;
    let list = events.as_array().cloned().unwrap_or_default();
    assert_eq!(list.len(), 2);
    assert!(
        list[0]["dateCreated"].as_str() > list[1]["dateCreated"].as_str(),
        "newest first"
    );
    let next = json_of(
        client()
            .get(format!("{url}events/?limit=2&cursor=2:0:0"))
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_ne!(next[0]["eventID"], list[0]["eventID"]);

    // stop production by control endpoint; resolve sticks
    let r = client()
        .post(format!(
            "{}/_sandbox/glitchtip/producing",
            sb.urls().glitchtip
        ))
        .json(&json!({"mode": "off"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(json_of(r).await["producing"], false);
    let r = client()
        .put(&url)
        .header("Authorization", &auth)
        .json(&json!({"status": "resolved"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let issue = json_of(
        client()
            .get(&url)
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_eq!(issue["status"], "resolved");
    let frozen = counts(&sb).await.glitchtip.events;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(counts(&sb).await.glitchtip.events, frozen);

    // forcing it on again is a regression: new events reopen the issue
    if let Err(e) = sb.set_producing(ProducingMode::On) {
        panic!("{e}");
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let issue = json_of(
        client()
            .get(&url)
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    assert_eq!(issue["status"], "unresolved");
    assert!(counts(&sb).await.glitchtip.events > frozen);

    let r = client()
        .get(&url)
        .header("Authorization", "Bearer nope")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    assert_eq!(json_of(r).await["detail"], "Unauthorized");
    let r = client()
        .get(format!("{}/api/0/issues/7/", sb.urls().glitchtip))
        .header("Authorization", &auth)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 404);

    let alert = sb.alert_payload();
    let link = alert["attachments"][0]["title_link"]
        .as_str()
        .unwrap_or_default();
    assert!(link.ends_with("/acme/issues/42"), "{link}");

    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn openpanel_chart_counts_production_errors() {
    let mut config = SandboxConfig::default();
    config.glitchtip.event_interval_ms = 10;
    let sb = start(config).await;
    let i = sb.info();
    tokio::time::sleep(Duration::from_millis(40)).await;
    let get = |series: &str| {
        client()
            .get(format!("{}/export/charts", sb.urls().openpanel))
            .header("openpanel-client-id", &i.tokens.openpanel_client_id)
            .header("openpanel-client-secret", &i.tokens.openpanel_client_secret)
            .query(&[
                ("projectId", i.openpanel_project_id.as_str()),
                ("series", series),
                ("interval", "minute"),
                ("range", "30min"),
            ])
            .send()
    };
    let chart = json_of(
        get(r#"[{"name":"checkout_error"},{"name":"page_view"}]"#)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .await;
    let s0 = &chart["series"][0];
    assert_eq!(s0["names"], json!(["checkout_error"]));
    let sum = s0["metrics"]["sum"].as_u64().unwrap_or_default();
    assert!(sum >= 4, "{chart}");
    let data_sum: u64 = s0["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["count"].as_u64())
        .sum();
    assert_eq!(data_sum, sum);
    assert!(s0["data"].as_array().map(Vec::len).unwrap_or_default() >= 30);
    assert_eq!(chart["series"][1]["metrics"]["sum"], 0);
    assert!(chart["metrics"]["sum"].as_u64() >= Some(sum));

    let r = get("not json").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 400);
    let r = client()
        .get(format!(
            "{}/export/charts?projectId=shop",
            sb.urls().openpanel
        ))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    assert_eq!(json_of(r).await["error"], "Unauthorized");
    sb.shutdown().await;
}

#[tokio::test]
async fn state_survives_a_restart_from_the_state_file() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut config = SandboxConfig {
        state_file: Some(dir.path().join("sandbox.json")),
        ..SandboxConfig::default()
    };
    config.ci = CiCheck {
        rules: vec![CiRule {
            path: "README.md".into(),
            must_contain: vec!["ok".into()],
            must_not_contain: vec![],
        }],
        delay_ms: 0,
    };
    let sb = start(config.clone()).await;
    let r = zulip_message(&sb, "kept")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    let f = Forgejo::new(&sb);
    let (s, _) = f
        .post("/branches", json!({"new_branch_name": "keep"}))
        .await;
    assert_eq!(s, 201);
    let (s, _) = f
        .post("/labels", json!({"name": "kept", "color": "#00aabb"}))
        .await;
    assert_eq!(s, 201);
    conform(&sb);
    sb.shutdown().await;

    let sb = start(config).await;
    let n = counts(&sb).await;
    assert_eq!(
        (n.zulip.messages, n.forgejo.branches, n.forgejo.labels),
        (1, 2, 1)
    );
    let f = Forgejo::new(&sb);
    let (s, _) = f
        .post("/branches", json!({"new_branch_name": "keep"}))
        .await;
    assert_eq!(s, 409, "the branch came back from the state file");
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let sb = start(SandboxConfig::default()).await;
    let f = Forgejo::new(&sb);
    let huge = "x".repeat(2 * 1024 * 1024);
    let r = client()
        .post(format!("{}/contents", f.api))
        .header("Authorization", format!("token {}", f.token))
        .header("content-type", "application/json")
        .body(format!(
            "{{\"files\":[{{\"operation\":\"create\",\"path\":\"big\",\"content\":\"{huge}\"}}]}}"
        ))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 413);
    assert_eq!(counts(&sb).await.forgejo.commits, 1);
    sb.shutdown().await;
}

/// A PR from a new branch that fixes `src/checkout.py` on top of main and appends `extra`; returns
/// (PR number, head sha).
async fn open_fix_pr(f: &Forgejo, branch: &str, extra: &str) -> (u64, String) {
    let (s, v) = f
        .post(
            "/branches",
            json!({"new_branch_name": branch, "old_ref_name": "main"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let original = {
        let (_, v) = f.get("/contents/src/checkout.py?ref=main").await;
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(v["content"].as_str().unwrap_or_default())
            .unwrap_or_default();
        String::from_utf8(raw).unwrap_or_default()
    };
    let head = f
        .commit(
            branch,
            "src/checkout.py",
            &format!("{}{extra}", original.replace("/ 0\n", "/ 100\n")),
        )
        .await;
    let (s, pr) = f
        .post(
            "/pulls",
            json!({"head": branch, "base": "main", "title": format!("Fix from {branch}")}),
        )
        .await;
    assert_eq!(s, 201, "{pr}");
    (pr["number"].as_u64().unwrap_or_default(), head)
}

async fn raw_state(sb: &SandboxHandle) -> Value {
    let r = client()
        .get(format!("{}/_sandbox/state", sb.urls().forgejo))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    json_of(r).await
}

#[tokio::test]
async fn forgejo_labels_are_created_listed_and_put_on_a_pull_request() {
    let sb = start(SandboxConfig::default()).await;
    let f = Forgejo::new(&sb);
    let (number, _) = open_fix_pr(&f, "loams/labels", "").await;

    let (s, v) = f.get("/labels").await;
    assert_eq!((s, v), (200, json!([])));
    let (s, _) = f.post("/labels", json!({"name": "factory"})).await;
    assert_eq!(s, 422, "color is required");
    let (s, _) = f.post("/labels", json!({"color": "#e4e669"})).await;
    assert_eq!(s, 422, "name is required");
    let (s, v) = f
        .post("/labels", json!({"name": "x", "color": "#zzz"}))
        .await;
    assert_eq!(s, 422, "{v}");
    let (s, factory) = f
        .post(
            "/labels",
            json!({"name": "factory", "color": "#E4E669", "description": "made by loams"}),
        )
        .await;
    assert_eq!(s, 201, "{factory}");
    assert_eq!(factory["color"], "e4e669");
    assert_eq!(factory["description"], "made by loams");
    let (s, bug) = f
        .post("/labels", json!({"name": "bug", "color": "f00"}))
        .await;
    assert_eq!((s, bug["color"].clone()), (201, json!("ff0000")));
    assert_ne!(bug["id"], factory["id"]);
    assert!(
        bug["url"]
            .as_str()
            .is_some_and(|u| u.ends_with(&format!("/labels/{}", bug["id"]))),
        "{bug}"
    );

    // listed by name, paged, with the total in a header
    let r = client()
        .get(format!("{}/labels?limit=1&page=2", f.api))
        .header("Authorization", format!("token {}", f.token))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        r.headers()
            .get("x-total-count")
            .and_then(|v| v.to_str().ok()),
        Some("2")
    );
    let page2 = json_of(r).await;
    assert_eq!(page2.as_array().map(Vec::len), Some(1));
    assert_eq!(page2[0]["name"], "factory");
    let (_, all) = f.get("/labels?limit=50").await;
    let names: Vec<&str> = all
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["name"].as_str())
        .collect();
    assert_eq!(names, ["bug", "factory"]);

    // added by id and by name; unknown ones are skipped; adding again changes nothing
    let path = format!("/issues/{number}/labels");
    let body = json!({"labels": [factory["id"], "bug", 999, "no-such-label"]});
    let (s, on_pr) = f.post(&path, body.clone()).await;
    assert_eq!(s, 200, "{on_pr}");
    let ids = |v: &Value| -> Vec<Value> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|l| l["id"].clone())
            .collect()
    };
    assert_eq!(ids(&on_pr), vec![bug["id"].clone(), factory["id"].clone()]);
    let (s, again) = f.post(&path, body).await;
    assert_eq!((s, ids(&again)), (200, ids(&on_pr)));
    let (s, listed) = f.get(&path).await;
    assert_eq!((s, ids(&listed)), (200, ids(&on_pr)));
    let (_, pr) = f.get(&format!("/pulls/{number}")).await;
    assert_eq!(ids(&pr["labels"]), ids(&on_pr));
    assert_eq!(pr["labels"][1]["name"], "factory");
    let (s, _) = f.post(&path, json!({"labels": [true]})).await;
    assert_eq!(s, 422);

    // unknown issue index, bad token
    let (s, _) = f.post("/issues/99/labels", json!({"labels": [1]})).await;
    assert_eq!(s, 404);
    let (s, _) = f.get("/issues/99/labels").await;
    assert_eq!(s, 404);
    let r = client()
        .post(format!("{}/labels", f.api))
        .json(&json!({"name": "n", "color": "#000000"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);

    let n = counts(&sb).await;
    assert_eq!(
        (n.forgejo.labels, n.forgejo.prs, n.forgejo.open_prs),
        (2, 1, 1)
    );
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn forgejo_single_commit_has_parents_files_and_stats() {
    let sb = start(SandboxConfig::default()).await;
    let f = Forgejo::new(&sb);
    let (_, old_main) = f.get("/branches/main").await;
    let old_main = old_main["commit"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (number, head) = open_fix_pr(&f, "loams/merge", "").await;
    let (s, v) = f
        .post(
            &format!("/pulls/{number}/merge"),
            json!({"Do": "merge", "head_commit_id": head}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (_, pr) = f.get(&format!("/pulls/{number}")).await;
    let merge_sha = pr["merge_commit_sha"]
        .as_str()
        .unwrap_or_default()
        .to_string();

    // a merge commit: base first, then the merged head
    let (s, c) = f.get(&format!("/git/commits/{merge_sha}?stat=false")).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["sha"], merge_sha.as_str());
    let parents: Vec<&str> = c["parents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["sha"].as_str())
        .collect();
    assert_eq!(parents, [old_main.as_str(), head.as_str()]);
    assert_eq!(c["stats"], Value::Null, "stat=false leaves the stats out");
    assert_eq!(
        c["files"],
        json!([{"filename": "src/checkout.py", "status": "modified"}])
    );
    assert!(
        c["commit"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Merge pull request")),
        "{c}"
    );
    let (_, with_stats) = f.get(&format!("/git/commits/{merge_sha}")).await;
    assert_eq!(
        with_stats["stats"],
        json!({"total": 2, "additions": 1, "deletions": 1})
    );
    // a ref names its head commit; the raw diff form is still served
    let (s, by_ref) = f.get("/git/commits/main").await;
    assert_eq!((s, by_ref["sha"].clone()), (200, json!(merge_sha)));
    let (s, d) = f.get(&format!("/git/commits/{merge_sha}.diff")).await;
    assert_eq!(s, 200);
    assert!(
        d.as_str()
            .unwrap_or_default()
            .contains("+    return price - price * percent / 100\n")
    );

    // a squash merge is linear: one parent
    let (number, head) = open_fix_pr(&f, "loams/squash", "# squashed\n").await;
    let (s, v) = f
        .post(
            &format!("/pulls/{number}/merge"),
            json!({"Do": "squash", "head_commit_id": head}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (_, c) = f.get("/git/commits/main").await;
    let parents = c["parents"].as_array().cloned().unwrap_or_default();
    assert_eq!(parents.len(), 1, "{c}");
    assert_eq!(parents[0]["sha"], merge_sha.as_str());
    // the seed commit has none
    let (_, root) = f.get(&format!("/git/commits/{old_main}")).await;
    assert_eq!(root["parents"], json!([]));

    let (s, _) = f
        .get("/git/commits/0123456789abcdef0123456789abcdef01234567")
        .await;
    assert_eq!(s, 404);
    let (s, _) = f.get("/git/commits/bad..ref").await;
    assert_eq!(s, 422);
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn plane_project_names_its_identifier() {
    let sb = start(SandboxConfig::default()).await;
    let info = sb.info();
    let key = info.tokens.plane_api_key.clone();
    let project = |slug: &str, id: &str| {
        format!(
            "{}/api/v1/workspaces/{slug}/projects/{id}/",
            sb.urls().plane
        )
    };
    let url = project(&info.plane_workspace, &info.plane_project_id);
    let r = client()
        .get(&url)
        .header("X-API-Key", &key)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    let p = json_of(r).await;
    assert_eq!(p["id"], info.plane_project_id.as_str());
    assert_eq!(p["identifier"], "OPS");
    assert_eq!(p["name"], "Operations");
    assert!(
        p["workspace"].as_str().is_some_and(|w| w.len() == 36),
        "{p}"
    );
    // the default state is the one new work items get
    let states = client()
        .get(format!("{url}states/"))
        .header("X-API-Key", &key)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let states = json_of(states).await;
    let default = states["results"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["default"] == true)
        .map(|s| s["id"].clone());
    assert_eq!(Some(p["default_state"].clone()), default);

    for (u, k, want) in [
        (url.clone(), "wrong", 401),
        (project("other", &info.plane_project_id), key.as_str(), 404),
        (
            project(
                &info.plane_workspace,
                "5f0c8d2e-0000-4000-8000-000000000000",
            ),
            key.as_str(),
            404,
        ),
    ] {
        let r = client()
            .get(&u)
            .header("X-API-Key", k)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status(), want, "{u}");
    }
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn control_state_groups_counters_by_app() {
    let sb = start(SandboxConfig::default()).await;
    let f = Forgejo::new(&sb);
    let (number, _) = open_fix_pr(&f, "loams/open", "").await;
    let s = raw_state(&sb).await;
    assert_eq!(s["forgejo"]["open_prs"], 1, "{s}");
    assert_eq!(s["forgejo"]["prs"], 1, "{s}");
    assert_eq!(s["forgejo"]["merges"], 0, "{s}");
    assert_eq!(s["plane"]["issues"], 0, "{s}");
    assert_eq!(s["zulip"]["messages"], 0, "{s}");
    assert!(s["glitchtip"]["producing"].is_boolean(), "{s}");
    let (status, _) = f
        .send(
            reqwest::Method::PATCH,
            &format!("/pulls/{number}"),
            Some(json!({"state": "closed"})),
        )
        .await;
    assert_eq!(status, 201);
    let s = raw_state(&sb).await;
    assert_eq!(
        (
            s["forgejo"]["open_prs"].clone(),
            s["forgejo"]["prs"].clone()
        ),
        (json!(0), json!(1))
    );
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn zulip_get_stream_id_by_name() {
    let sb = start(SandboxConfig::default()).await;
    let t = sb.tokens().clone();
    let url = format!("{}/api/v1/get_stream_id", sb.urls().zulip);
    let get = |stream: &'static str, key: &str| {
        client()
            .get(&url)
            .basic_auth(&t.zulip_email, Some(key))
            .query(&[("stream", stream)])
            .send()
    };
    let r = get("factory", &t.zulip_api_key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    assert_eq!(
        json_of(r).await,
        json!({"result": "success", "msg": "", "stream_id": 1})
    );
    let r = get("nonexistent", &t.zulip_api_key)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 400);
    assert_eq!(
        json_of(r).await,
        json!({"result": "error", "code": "BAD_REQUEST", "msg": "Invalid channel name 'nonexistent'"})
    );
    let r = get("factory", "wrong")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 401);
    conform(&sb);
    sb.shutdown().await;
}

#[tokio::test]
async fn the_request_log_is_served_only_when_recording() {
    let off = match Sandbox::start(SandboxConfig::default()).await {
        Ok(h) => h,
        Err(e) => panic!("{e}"),
    };
    let r = client()
        .get(format!("{}/_sandbox/requests", off.urls().zulip))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 404);
    assert!(off.requests().is_empty());
    off.shutdown().await;

    let sb = start(SandboxConfig::default()).await;
    let t = sb.tokens().clone();
    let r = client()
        .get(format!(
            "{}/api/v1/get_stream_id?stream=factory",
            sb.urls().zulip
        ))
        .basic_auth(&t.zulip_email, Some(&t.zulip_api_key))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status(), 200);
    // control requests are not part of the apps' APIs and are not logged
    counts(&sb).await;
    let served: Vec<loams_sandbox::Exchange> = client()
        .get(format!("{}/_sandbox/requests", sb.urls().forgejo))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(served, sb.requests());
    assert_eq!(served.len(), 1, "{served:?}");
    let e = &served[0];
    assert_eq!(
        (
            e.app.as_str(),
            e.method.as_str(),
            e.path.as_str(),
            e.query.as_str(),
            e.status
        ),
        (
            "zulip",
            "GET",
            "/api/v1/get_stream_id",
            "stream=factory",
            200
        )
    );
    assert_eq!(
        serde_json::from_str::<Value>(&e.response_body).unwrap_or_default(),
        json!({"result": "success", "msg": "", "stream_id": 1})
    );
    conform(&sb);
    sb.shutdown().await;
}
