//! A test agent served on 127.0.0.1:0 over the SQLite `:memory:` store, exercised over real HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{
    A2aClient, AgentSpec, CallError, CardError, CardSigner, ClientOptions, Jwks, Risk, SkillError,
    SkillSpec, Skills, router,
};
use loams_platform::{Sqlite, SystemClock};
use serde_json::{Value, json};
use tokio::sync::Notify;

#[derive(Default)]
struct Counter {
    calls: AtomicUsize,
    slow_started: Notify,
    slow_release: Notify,
}

fn skill(id: &str, risk: Risk) -> SkillSpec {
    SkillSpec {
        id: id.into(),
        name: id.into(),
        description: format!("the {id} skill"),
        risk,
        tags: vec![],
        examples: vec![],
    }
}

#[async_trait]
impl Skills for Counter {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: "counter".into(),
            description: "counts its calls".into(),
            version: "1.0.0".into(),
            skills: vec![
                skill("count", Risk::Write),
                skill("fail", Risk::Read),
                skill("slow", Risk::Destructive),
                skill("measure", Risk::Read),
            ],
        }
    }

    async fn invoke(&self, skill: &str, args: Value) -> Result<Value, SkillError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        match skill {
            "count" => Ok(json!({"count": n, "args": args})),
            "fail" => Err(SkillError {
                message: "app said no".into(),
                retryable: args["retryable"].as_bool().unwrap_or(false),
            }),
            "slow" => {
                self.slow_started.notify_one();
                self.slow_release.notified().await;
                Ok(json!({"count": n}))
            }
            "measure" => Ok(json!({"bytes": args.to_string().len()})),
            other => Err(SkillError::permanent(format!("no skill {other}"))),
        }
    }
}

struct Agent {
    base: String,
    jwks: Jwks,
    skills: Arc<Counter>,
    http: reqwest::Client,
}

async fn start() -> Agent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let store = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let signer = CardSigner::generate().unwrap();
    let jwks = signer.jwks().unwrap();
    let skills = Arc::new(Counter::default());
    let app = router(skills.clone(), store, "acme".into(), signer, base.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Agent {
        base,
        jwks,
        skills,
        http: reqwest::Client::new(),
    }
}

impl Agent {
    fn calls(&self) -> usize {
        self.skills.calls.load(Ordering::SeqCst)
    }

    async fn rpc_raw(
        &self,
        version: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/", self.base))
            .header("content-type", "application/json");
        if let Some(v) = version {
            req = req.header("A2A-Version", v);
        }
        req.body(body).send().await.unwrap()
    }

    async fn rpc(&self, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
        let resp = self.rpc_raw(Some("1.0"), body.to_string()).await;
        assert_eq!(resp.status(), 200);
        resp.json().await.unwrap()
    }

    async fn send(&self, message_id: &str, skill: &str, args: Value) -> Value {
        self.rpc(
            "SendMessage",
            send_params(message_id, json!({"skill": skill, "args": args})),
        )
        .await
    }
}

fn send_params(message_id: &str, data: Value) -> Value {
    json!({"message": {"messageId": message_id, "role": "ROLE_USER", "parts": [{"data": data}]}})
}

fn error_code(resp: &Value) -> i64 {
    resp["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error: {resp}"))
}

fn assert_error(resp: &Value, code: i64, reason: &str) {
    assert_eq!(error_code(resp), code, "{resp}");
    let info = &resp["error"]["data"][0];
    assert_eq!(
        info["@type"], "type.googleapis.com/google.rpc.ErrorInfo",
        "{resp}"
    );
    assert_eq!(info["reason"], reason, "{resp}");
    assert_eq!(info["domain"], "a2a-protocol.org", "{resp}");
}

#[tokio::test]
async fn card_is_signed_cached_and_describes_the_agent() {
    let agent = start().await;
    let resp = agent
        .http
        .get(format!("{}/.well-known/agent-card.json", agent.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["cache-control"], "max-age=300");
    let etag = resp.headers()["etag"].clone();
    assert!(resp.headers().contains_key("last-modified"));
    let card: Value = resp.json().await.unwrap();
    assert_eq!(card["name"], "counter");
    assert_eq!(
        card["supportedInterfaces"],
        json!([{"url": agent.base, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}])
    );
    assert_eq!(
        card["capabilities"],
        json!({"streaming": false, "pushNotifications": false})
    );
    assert_eq!(
        card["defaultInputModes"],
        json!(["application/json", "text/plain"])
    );
    assert_eq!(card["skills"][0]["tags"], json!(["risk:write"]));
    assert_eq!(card["skills"][2]["tags"], json!(["risk:destructive"]));
    assert_eq!(card["provider"]["url"], agent.base);

    let again = agent
        .http
        .get(format!("{}/.well-known/agent-card.json", agent.base))
        .header("if-none-match", etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);

    let client = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    assert_eq!(client.card().skills.len(), 4);
}

#[tokio::test]
async fn client_refuses_cards_it_cannot_trust() {
    let agent = start().await;
    let stranger = CardSigner::generate().unwrap().jwks().unwrap();
    let err = A2aClient::new(&agent.base, &stranger).await.unwrap_err();
    assert!(
        matches!(err, CallError::Card(CardError::UntrustedKey)),
        "{err}"
    );
    assert!(!err.retryable());

    // A card whose content was changed after signing (here: a risk tag downgraded) is refused.
    let mut card: a2a::AgentCard = agent
        .http
        .get(format!("{}/.well-known/agent-card.json", agent.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    loams_a2a::verify_card(&card, &agent.jwks).unwrap();
    card.skills[2].tags = vec!["risk:read".into()];
    assert!(matches!(
        loams_a2a::verify_card(&card, &agent.jwks),
        Err(CardError::BadSignature)
    ));
    card.signatures = None;
    assert!(matches!(
        loams_a2a::verify_card(&card, &agent.jwks),
        Err(CardError::Unsigned)
    ));
}

#[tokio::test]
async fn send_message_completes_and_repeats_do_not_rerun_the_skill() {
    let agent = start().await;
    let first = agent
        .send("r-1:fix:1:open_pr", "count", json!({"x": 1}))
        .await;
    let task = &first["result"]["task"];
    assert_eq!(task["id"], "r-1:fix:1:open_pr", "{first}");
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(task["artifacts"].as_array().unwrap().len(), 1);
    assert_eq!(
        task["artifacts"][0]["parts"],
        json!([{"data": {"count": 1, "args": {"x": 1}}}])
    );
    assert_eq!(first["id"], 7);

    let repeat = agent
        .send("r-1:fix:1:open_pr", "count", json!({"x": 1}))
        .await;
    assert_eq!(repeat["result"], first["result"]);
    assert_eq!(agent.calls(), 1);

    let other = agent.send("r-1:fix:1:other", "count", json!({})).await;
    assert_eq!(
        other["result"]["task"]["artifacts"][0]["parts"][0]["data"]["count"],
        2
    );

    // The client maps the same exchange onto the skill output, deduplicated as well.
    let client = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    let out = client
        .call("r-1:fix:1:open_pr", "count", json!({"x": 1}), None)
        .await
        .unwrap();
    assert_eq!(out, json!({"count": 1, "args": {"x": 1}}));
    assert_eq!(agent.calls(), 2);
}

#[tokio::test]
async fn large_requests_are_stored_without_history_and_still_deduplicated() {
    let agent = start().await;
    let big = "x".repeat(600 * 1024);
    let first = agent
        .send("m-big", "measure", json!({"content": big}))
        .await;
    let task = &first["result"]["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_COMPLETED",
        "{}",
        task["status"]
    );
    assert!(task.get("history").is_none());
    assert_eq!(
        task["artifacts"][0]["parts"][0]["data"]["bytes"],
        600 * 1024 + 14
    );
    let repeat = agent
        .send("m-big", "measure", json!({"content": "x"}))
        .await;
    assert_eq!(repeat["result"], first["result"]);
    assert_eq!(agent.calls(), 1);

    // An output too large to record cannot be deduplicated: a permanent failure, said so.
    let huge = agent
        .send(
            "m-huge",
            "count",
            json!({"content": "y".repeat(450 * 1024)}),
        )
        .await;
    let status = &huge["result"]["task"]["status"];
    assert_eq!(status["state"], "TASK_STATE_FAILED");
    assert_eq!(status["message"]["parts"][1]["data"]["retryable"], false);
    assert!(
        status["message"]["parts"][0]["text"]
            .as_str()
            .unwrap()
            .contains("exceeds")
    );
}

#[tokio::test]
async fn concurrent_repeat_sees_the_task_working() {
    let agent = Arc::new(start().await);
    let slow = {
        let agent = agent.clone();
        tokio::spawn(async move { agent.send("m-slow", "slow", json!({})).await })
    };
    agent.skills.slow_started.notified().await;
    let during = agent.send("m-slow", "slow", json!({})).await;
    assert_eq!(
        during["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{during}"
    );
    let got = agent.rpc("GetTask", json!({"id": "m-slow"})).await;
    assert_eq!(
        got["result"]["status"]["state"], "TASK_STATE_WORKING",
        "{got}"
    );
    let cancel = agent.rpc("CancelTask", json!({"id": "m-slow"})).await;
    assert_error(&cancel, -32002, "TASK_NOT_CANCELABLE");

    let client = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    let err = client.call("m-slow", "slow", json!({}), None).await.unwrap_err();
    assert!(
        matches!(err, CallError::InProgress(_)) && err.retryable(),
        "{err}"
    );

    agent.skills.slow_release.notify_one();
    let done = slow.await.unwrap();
    assert_eq!(
        done["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{done}"
    );
    assert_eq!(
        client.call("m-slow", "slow", json!({}), None).await.unwrap(),
        json!({"count": 1})
    );
    assert_eq!(agent.calls(), 1);
}

#[tokio::test]
async fn get_task_honours_history_length_and_cancel_errors() {
    let agent = start().await;
    agent.send("m-get", "count", json!({})).await;

    let full = agent.rpc("GetTask", json!({"id": "m-get"})).await;
    assert_eq!(full["result"]["id"], "m-get");
    assert_eq!(full["result"]["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(full["result"]["history"][0]["messageId"], "m-get");
    assert_eq!(full["result"]["history"][0]["role"], "ROLE_USER");

    let none = agent
        .rpc("GetTask", json!({"id": "m-get", "historyLength": 0}))
        .await;
    assert!(none["result"].get("history").is_none(), "{none}");
    assert_eq!(none["result"]["status"]["state"], "TASK_STATE_COMPLETED");

    let negative = agent
        .rpc("GetTask", json!({"id": "m-get", "historyLength": -1}))
        .await;
    assert_error(&negative, -32602, "INVALID_PARAMS");

    assert_error(
        &agent.rpc("GetTask", json!({"id": "nope"})).await,
        -32001,
        "TASK_NOT_FOUND",
    );
    assert_error(
        &agent.rpc("CancelTask", json!({"id": "nope"})).await,
        -32001,
        "TASK_NOT_FOUND",
    );
    assert_error(
        &agent.rpc("CancelTask", json!({"id": "m-get"})).await,
        -32002,
        "TASK_NOT_CANCELABLE",
    );
}

#[tokio::test]
async fn skill_failures_become_failed_tasks_with_the_retryable_flag() {
    let agent = start().await;
    let permanent = agent
        .send("m-fail", "fail", json!({"retryable": false}))
        .await;
    let status = &permanent["result"]["task"]["status"];
    assert_eq!(status["state"], "TASK_STATE_FAILED", "{permanent}");
    assert_eq!(status["message"]["role"], "ROLE_AGENT");
    assert_eq!(
        status["message"]["parts"],
        json!([{"text": "app said no"}, {"data": {"retryable": false}}])
    );
    // A permanent failure is the recorded outcome: repeating returns it without a new attempt.
    agent
        .send("m-fail", "fail", json!({"retryable": false}))
        .await;
    assert_eq!(agent.calls(), 1);

    let client = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    let err = client
        .call("m-retry", "fail", json!({"retryable": true}), None)
        .await
        .unwrap_err();
    match &err {
        CallError::Skill { message, retryable } => assert!(message == "app said no" && *retryable),
        other => panic!("{other}"),
    }
    assert!(err.retryable());
    // A retryable failure had no effect, so the same message id gets a fresh attempt.
    assert!(
        client
            .call("m-retry", "fail", json!({"retryable": true}), None)
            .await
            .is_err()
    );
    assert_eq!(agent.calls(), 3);
    let stored = agent.rpc("GetTask", json!({"id": "m-retry"})).await;
    assert_eq!(stored["result"]["status"]["state"], "TASK_STATE_FAILED");
}

#[tokio::test]
async fn protocol_errors() {
    let agent = start().await;
    let call =
        json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}).to_string();

    for version in [None, Some(""), Some("0.3"), Some("2.0")] {
        let resp: Value = agent
            .rpc_raw(version, call.clone())
            .await
            .json()
            .await
            .unwrap();
        assert_error(&resp, -32009, "VERSION_NOT_SUPPORTED");
        assert_eq!(resp["id"], 1);
    }
    // The version may also come as a query parameter.
    let resp: Value = agent
        .http
        .post(format!("{}/?A2A-Version=1.0", agent.base))
        .body(call.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_error(&resp, -32001, "TASK_NOT_FOUND");

    let resp: Value = agent
        .rpc_raw(Some("1.0"), "{not json")
        .await
        .json()
        .await
        .unwrap();
    assert_error(&resp, -32700, "PARSE_ERROR");
    assert_eq!(resp["id"], Value::Null);

    let resp: Value = agent
        .rpc_raw(Some("1.0"), json!([1, 2]).to_string())
        .await
        .json()
        .await
        .unwrap();
    assert_error(&resp, -32600, "INVALID_REQUEST");
    let resp: Value = agent
        .rpc_raw(
            Some("1.0"),
            json!({"id": 3, "method": "GetTask"}).to_string(),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_error(&resp, -32600, "INVALID_REQUEST");
    assert_eq!(resp["id"], 3);

    for method in ["message/send", "Frobnicate"] {
        assert_error(
            &agent.rpc(method, json!({})).await,
            -32601,
            "METHOD_NOT_FOUND",
        );
    }
    assert_error(
        &agent.rpc("SendStreamingMessage", json!({})).await,
        -32004,
        "UNSUPPORTED_OPERATION",
    );

    assert_error(
        &agent.rpc("SendMessage", json!({"message": 5})).await,
        -32602,
        "INVALID_PARAMS",
    );
    let text_part =
        json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}});
    assert_error(
        &agent.rpc("SendMessage", text_part).await,
        -32602,
        "INVALID_PARAMS",
    );
    let unknown = send_params("m", json!({"skill": "launch", "args": {}}));
    assert_error(
        &agent.rpc("SendMessage", unknown).await,
        -32602,
        "INVALID_PARAMS",
    );
    let long_id = send_params(&"x".repeat(300), json!({"skill": "count", "args": {}}));
    assert_error(
        &agent.rpc("SendMessage", long_id).await,
        -32602,
        "INVALID_PARAMS",
    );
    assert_eq!(agent.calls(), 0);

    let huge = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{{"id":"{}"}}}}"#,
        "x".repeat(1024 * 1024)
    );
    assert_eq!(agent.rpc_raw(Some("1.0"), huge).await.status(), 413);
}

#[tokio::test]
async fn client_reports_protocol_and_transport_errors() {
    let agent = start().await;
    let client = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    let err = client.call("m-x", "launch", json!({}), None).await.unwrap_err();
    assert!(
        matches!(err, CallError::Protocol { code: -32602, .. }),
        "{err}"
    );
    assert!(!err.retryable());

    let small = ClientOptions {
        max_response_bytes: 200,
        ..ClientOptions::default()
    };
    let client = A2aClient::with_options(&agent.base, &agent.jwks, small)
        .await
        .unwrap();
    let err = client
        .call("m-small", "count", json!({}), None)
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::InvalidResponse(_)), "{err}");

    let hasty = ClientOptions {
        timeout: Duration::from_millis(200),
        ..ClientOptions::default()
    };
    let client = A2aClient::with_options(&agent.base, &agent.jwks, hasty)
        .await
        .unwrap();
    let err = client.call("m-hasty", "slow", json!({}), None).await.unwrap_err();
    assert!(
        matches!(err, CallError::Transport(_)) && err.retryable(),
        "{err}"
    );
    agent.skills.slow_release.notify_one();

    // Nothing listens on a freshly closed port.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let err = A2aClient::new(&dead, &agent.jwks).await.unwrap_err();
    assert!(
        matches!(err, CallError::Transport(_)) && err.retryable(),
        "{err}"
    );
}
