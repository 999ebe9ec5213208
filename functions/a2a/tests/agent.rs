//! A test agent served on 127.0.0.1:0 over the SQLite `:memory:` store, exercised over real HTTP.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{
    A2aClient, AgentSpec, ApprovalGate, AuthError, CallError, CallerAuth, CardError, CardSigner,
    ClientOptions, GateError, Guards, Jwks, Principal, Risk, SkillError, SkillSpec, Skills,
    TokenError, TokenSource, router,
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
                skill("slow", Risk::Write),
                skill("measure", Risk::Read),
                skill("wipe", Risk::Destructive),
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
            "wipe" => Ok(json!({"wiped": args})),
            other => Err(SkillError::permanent(format!("no skill {other}"))),
        }
    }
}

/// Test tokens are `subject|org|audience`, accepted when the audience is the agent's; a real
/// verifier (JWT) lives in loams-api's broker and is tested there.
struct TestAuth;

#[async_trait]
impl CallerAuth for TestAuth {
    async fn verify(&self, bearer: Option<&str>, audience: &str) -> Result<Principal, AuthError> {
        let token = bearer.ok_or(AuthError::Missing)?;
        match token.split('|').collect::<Vec<_>>().as_slice() {
            [subject, org, aud] if *aud == audience => Ok(Principal {
                subject: subject.to_string(),
                org: org.to_string(),
            }),
            _ => Err(AuthError::Invalid),
        }
    }
}

fn token(subject: &str, org: &str, audience: &str) -> String {
    format!("{subject}|{org}|{audience}")
}

/// One question to the gate: org, agent, skill, args, approval id.
type Asked = (String, String, String, Value, String);

/// Admits approval `ap-ok` for `wipe {"target": "db"}` only; `ap-down` cannot be checked.
#[derive(Default)]
struct TestGate {
    asked: Mutex<Vec<Asked>>,
}

#[async_trait]
impl ApprovalGate for TestGate {
    async fn admit(
        &self,
        org: &str,
        agent: &str,
        skill: &str,
        args: &Value,
        approval_id: &str,
    ) -> Result<(), GateError> {
        self.asked.lock().unwrap().push((
            org.into(),
            agent.into(),
            skill.into(),
            args.clone(),
            approval_id.into(),
        ));
        match approval_id {
            "ap-down" => Err(GateError::Unavailable("store down".into())),
            "ap-ok" if skill == "wipe" && *args == json!({"target": "db"}) => Ok(()),
            "ap-ok" => Err(GateError::Refused("the action hash does not match".into())),
            _ => Err(GateError::Refused("not approved".into())),
        }
    }
}

struct TestTokens(String);

#[async_trait]
impl TokenSource for TestTokens {
    async fn token(&self, audience: &str) -> Result<String, TokenError> {
        Ok(token(&self.0, "acme", audience))
    }
}

struct Agent {
    base: String,
    jwks: Jwks,
    skills: Arc<Counter>,
    gate: Arc<TestGate>,
    http: reqwest::Client,
}

async fn start() -> Agent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let store = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let signer = CardSigner::generate().unwrap();
    let jwks = signer.jwks().unwrap();
    let skills = Arc::new(Counter::default());
    let gate = Arc::new(TestGate::default());
    let guards = Guards {
        auth: Arc::new(TestAuth),
        gate: gate.clone(),
    };
    let app = router(
        skills.clone(),
        store,
        "acme".into(),
        signer,
        base.clone(),
        guards,
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Agent {
        base,
        jwks,
        skills,
        gate,
        http: reqwest::Client::new(),
    }
}

impl Agent {
    fn calls(&self) -> usize {
        self.skills.calls.load(Ordering::SeqCst)
    }

    /// A client calling as `agent:factory`, the subject the raw helpers use too.
    async fn client(&self) -> A2aClient {
        A2aClient::new(&self.base, &self.jwks)
            .await
            .unwrap()
            .with_tokens(Arc::new(TestTokens("agent:factory".into())))
    }

    async fn rpc_raw(
        &self,
        version: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        self.rpc_as(
            Some(&token("agent:factory", "acme", &self.base)),
            version,
            body,
        )
        .await
    }

    async fn rpc_as(
        &self,
        bearer: Option<&str>,
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
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
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
    assert_eq!(card["skills"][4]["tags"], json!(["risk:destructive"]));
    assert_eq!(card["provider"]["url"], agent.base);

    let again = agent
        .http
        .get(format!("{}/.well-known/agent-card.json", agent.base))
        .header("if-none-match", etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);

    let client = agent.client().await;
    assert_eq!(client.card().skills.len(), 5);
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
    let client = agent.client().await;
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
        .send("m-big", "measure", json!({"content": big}))
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

    let client = agent.client().await;
    let err = client
        .call("m-slow", "slow", json!({}), None)
        .await
        .unwrap_err();
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
        client
            .call("m-slow", "slow", json!({}), None)
            .await
            .unwrap(),
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

    let client = agent.client().await;
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
        .bearer_auth(token("agent:factory", "acme", &agent.base))
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
    let client = agent.client().await;
    let err = client
        .call("m-x", "launch", json!({}), None)
        .await
        .unwrap_err();
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
        .unwrap()
        .with_tokens(Arc::new(TestTokens("agent:factory".into())));
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
        .unwrap()
        .with_tokens(Arc::new(TestTokens("agent:factory".into())));
    let err = client
        .call("m-hasty", "slow", json!({}), None)
        .await
        .unwrap_err();
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

#[tokio::test]
async fn calls_without_a_valid_token_for_this_agent_are_refused_and_run_nothing() {
    let agent = start().await;
    let send = json!({"jsonrpc": "2.0", "id": 9, "method": "SendMessage",
        "params": send_params("m-auth", json!({"skill": "count", "args": {}}))})
    .to_string();
    let other_agent = token("agent:factory", "acme", "http://127.0.0.1:1");
    let other_org = token("agent:factory", "globex", &agent.base);
    let long = "x".repeat(loams_a2a::MAX_BEARER_BYTES + 1);
    let cases: [(Option<&str>, &str); 5] = [
        (None, "missing"),
        (Some("garbage"), "invalid"),
        (Some(&other_agent), "wrong audience"),
        (Some(&other_org), "another organisation"),
        (Some(&long), "oversized"),
    ];
    for (bearer, why) in cases {
        let resp = agent.rpc_as(bearer, Some("1.0"), send.clone()).await;
        assert_eq!(resp.status(), 401, "{why}");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer", "{why}");
        let body: Value = resp.json().await.unwrap();
        assert_error(&body, -32600, "INVALID_REQUEST");
        assert_eq!(body["id"], 9, "{why}");
    }
    // A non-bearer scheme is no token either.
    let resp = agent
        .http
        .post(format!("{}/", agent.base))
        .header("A2A-Version", "1.0")
        .header(
            "authorization",
            format!("Basic {}", token("agent:factory", "acme", &agent.base)),
        )
        .body(send.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(agent.calls(), 0);

    // GetTask and CancelTask are guarded the same way; the card stays public.
    agent.send("m-auth", "count", json!({})).await;
    for method in ["GetTask", "CancelTask"] {
        let call = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": {"id": "m-auth"}});
        let resp = agent.rpc_as(None, Some("1.0"), call.to_string()).await;
        assert_eq!(resp.status(), 401, "{method}");
        let body: Value = resp.json().await.unwrap();
        assert!(body.get("result").is_none(), "{body}");
    }
    let card = agent
        .http
        .get(format!("{}/.well-known/agent-card.json", agent.base))
        .send()
        .await
        .unwrap();
    assert_eq!(card.status(), 200);

    // The client without a token source is refused too, with a permanent error.
    let anonymous = A2aClient::new(&agent.base, &agent.jwks).await.unwrap();
    let err = anonymous
        .call("m-anon", "count", json!({}), None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, CallError::Http(401)) && !err.retryable(),
        "{err}"
    );
    assert_eq!(agent.calls(), 1);
}

#[tokio::test]
async fn destructive_skills_run_only_with_an_admitted_approval() {
    let agent = start().await;
    let client = agent.client().await;
    let target = json!({"target": "db"});

    // No approval named: refused for good without asking the gate or the app.
    let err = client
        .call("m-wipe-1", "wipe", target.clone(), None)
        .await
        .unwrap_err();
    match &err {
        CallError::Skill { message, retryable } => {
            assert!(!retryable);
            assert!(message.contains("needs a settled approval"), "{message}");
        }
        other => panic!("{other}"),
    }
    assert!(agent.gate.asked.lock().unwrap().is_empty());

    // The gate refuses (not approved, or approved for other args): a failed task, no app call.
    for (id, approval, args) in [
        ("m-wipe-2", "ap-pending", target.clone()),
        ("m-wipe-3", "ap-ok", json!({"target": "prod"})),
    ] {
        let err = client
            .call(id, "wipe", args, Some(approval))
            .await
            .unwrap_err();
        match &err {
            CallError::Skill { message, retryable } => {
                assert!(!retryable, "{message}");
                assert!(message.contains(approval), "{message}");
            }
            other => panic!("{other}"),
        }
    }
    assert_eq!(agent.calls(), 0);
    // The refusal is the recorded outcome of that message id.
    let stored = agent.rpc("GetTask", json!({"id": "m-wipe-2"})).await;
    assert_eq!(stored["result"]["status"]["state"], "TASK_STATE_FAILED");

    // A gate that cannot decide leaves the message id free for a later try.
    let err = client
        .call("m-wipe-4", "wipe", target.clone(), Some("ap-down"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, CallError::Protocol { code: -32603, .. }) && err.retryable(),
        "{err}"
    );
    assert_eq!(agent.calls(), 0);

    // Admitted: the skill runs once, and the gate saw exactly this call.
    let out = client
        .call("m-wipe-4", "wipe", target.clone(), Some("ap-ok"))
        .await
        .unwrap();
    assert_eq!(out, json!({"wiped": {"target": "db"}}));
    assert_eq!(agent.calls(), 1);
    let asked = agent.gate.asked.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        asked,
        (
            "acme".into(),
            "counter".into(),
            "wipe".into(),
            target.clone(),
            "ap-ok".into()
        )
    );
    // A replay of the message id is answered from the store; a new message id repeats the
    // identical approved call (the app treats it as a no-op).
    client
        .call("m-wipe-4", "wipe", target.clone(), Some("ap-ok"))
        .await
        .unwrap();
    assert_eq!(agent.calls(), 1);
    client
        .call("m-wipe-5", "wipe", target.clone(), Some("ap-ok"))
        .await
        .unwrap();
    assert_eq!(agent.calls(), 2);

    // Non-destructive skills ignore the gate.
    let before = agent.gate.asked.lock().unwrap().len();
    client
        .call("m-count", "count", json!({}), None)
        .await
        .unwrap();
    assert_eq!(agent.gate.asked.lock().unwrap().len(), before);
    // A malformed approval id is a bad request.
    let bad = json!({"message": {"messageId": "m-wipe-6", "role": "ROLE_USER",
        "parts": [{"data": {"skill": "wipe", "args": target}}], "metadata": {"approval_id": 5}}});
    assert_error(
        &agent.rpc("SendMessage", bad).await,
        -32602,
        "INVALID_PARAMS",
    );
}

#[tokio::test]
async fn a_message_id_is_bound_to_its_call_and_its_caller() {
    let agent = start().await;
    let first = agent
        .send("m-bound", "count", json!({"n": 1, "m": 2}))
        .await;
    assert_eq!(
        first["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    // Same call, keys in another order: the dedupe case.
    let same = agent
        .send("m-bound", "count", json!({"m": 2, "n": 1}))
        .await;
    assert_eq!(same["result"], first["result"]);
    // Other args or another skill under the same id: refused, the stored task not shown.
    for (skill, args) in [
        ("count", json!({"n": 2, "m": 2})),
        ("measure", json!({"n": 1, "m": 2})),
    ] {
        let resp = agent.send("m-bound", skill, args).await;
        assert_error(&resp, -32602, "INVALID_PARAMS");
        assert!(resp.get("result").is_none(), "{resp}");
    }
    assert_eq!(agent.calls(), 1);

    // Another caller can neither replay, read nor cancel the task: it does not exist for them.
    let mallory = token("agent:mallory", "acme", &agent.base);
    let as_mallory = |method: &str, params: Value| {
        json!({"jsonrpc": "2.0", "id": 2, "method": method, "params": params}).to_string()
    };
    let replay: Value = agent
        .rpc_as(
            Some(&mallory),
            Some("1.0"),
            as_mallory(
                "SendMessage",
                send_params(
                    "m-bound",
                    json!({"skill": "count", "args": {"n": 1, "m": 2}}),
                ),
            ),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_error(&replay, -32602, "INVALID_PARAMS");
    for method in ["GetTask", "CancelTask"] {
        let resp: Value = agent
            .rpc_as(
                Some(&mallory),
                Some("1.0"),
                as_mallory(method, json!({"id": "m-bound"})),
            )
            .await
            .json()
            .await
            .unwrap();
        assert_error(&resp, -32001, "TASK_NOT_FOUND");
    }
    assert_eq!(agent.calls(), 1);
    // The creator still reads it.
    let own = agent.rpc("GetTask", json!({"id": "m-bound"})).await;
    assert_eq!(own["result"]["status"]["state"], "TASK_STATE_COMPLETED");
}

#[tokio::test]
async fn a_running_message_id_is_bound_as_well() {
    let agent = Arc::new(start().await);
    let slow = {
        let agent = agent.clone();
        tokio::spawn(async move { agent.send("m-run", "slow", json!({"a": 1})).await })
    };
    agent.skills.slow_started.notified().await;
    let other = agent.send("m-run", "slow", json!({"a": 2})).await;
    assert_error(&other, -32602, "INVALID_PARAMS");
    let same = agent.send("m-run", "slow", json!({"a": 1})).await;
    assert_eq!(
        same["result"]["task"]["status"]["state"],
        "TASK_STATE_WORKING"
    );
    agent.skills.slow_release.notify_one();
    slow.await.unwrap();
    assert_eq!(agent.calls(), 1);
}
