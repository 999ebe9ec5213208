//! A test agent served on 127.0.0.1:0 over the SQLite `:memory:` store, exercised over real HTTP.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use loams_a2a::{
    A2aClient, AgentSpec, ApprovalGate, AuthError, Binding, CallError, CallerAuth, CardError,
    CardSigner, ClientOptions, GateError, Guards, Jwks, PUSH_KIND, Principal, Risk, ServerOptions,
    SkillError, SkillSpec, Skills, TASK_KIND, TokenError, TokenSource, router_with, task_item_id,
};
use loams_platform::race::RaceBeforeWrite;
use loams_platform::{Clock, Cond, Counting, Item, OpCounts, Page, Sqlite, Store, SystemClock};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// The subject of the factory's token, which the helpers call as.
const FACTORY: &str = "agent:factory";

#[derive(Default)]
struct Counter {
    calls: AtomicUsize,
    slow_started: Notify,
    slow_release: Notify,
}

/// A value `levels` objects deep.
fn nested(levels: usize) -> Value {
    (0..levels).fold(json!(1), |inner, _| json!({"a": inner}))
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
            app: None,
            skills: vec![
                skill("count", Risk::Write),
                skill("fail", Risk::Write),
                skill("slow", Risk::Write),
                skill("measure", Risk::Read),
                skill("wipe", Risk::Destructive),
                skill("nest", Risk::Read),
                skill("peek", Risk::Read),
                skill("explode", Risk::Read),
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
            "nest" => Ok(nested(args["levels"].as_u64().unwrap_or(0) as usize)),
            // A read whose every run answers differently, so a stored answer tells itself from a fresh one.
            "peek" => Ok(json!({"run": n})),
            "explode" => panic!("the explode skill always panics"),
            other => Err(SkillError::permanent(format!("no skill {other}"))),
        }
    }
}

/// Test tokens are `subject|org|audience|scopes` (scopes space-separated), accepted when the
/// audience is the agent's; a real verifier (JWT) lives in loams-api's broker and is tested there.
struct TestAuth;

#[async_trait]
impl CallerAuth for TestAuth {
    async fn verify(&self, bearer: Option<&str>, audience: &str) -> Result<Principal, AuthError> {
        let token = bearer.ok_or(AuthError::Missing)?;
        match token.split('|').collect::<Vec<_>>().as_slice() {
            [subject, org, aud, scopes] if *aud == audience => Ok(Principal {
                subject: subject.to_string(),
                org: org.to_string(),
                scopes: scopes.split_whitespace().map(str::to_owned).collect(),
            }),
            _ => Err(AuthError::Invalid),
        }
    }
}

/// Every scope of the test agent: what the factory holds.
const ALL_SCOPES: &str = "counter:read counter:write counter:destructive";

fn token(subject: &str, org: &str, audience: &str) -> String {
    scoped_token(subject, org, audience, ALL_SCOPES)
}

fn scoped_token(subject: &str, org: &str, audience: &str, scopes: &str) -> String {
    format!("{subject}|{org}|{audience}|{scopes}")
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
    async fn token(&self, audience: &str, agent: &str) -> Result<String, TokenError> {
        let scopes = loams_a2a::every_scope(agent).join(" ");
        Ok(scoped_token(&self.0, "acme", audience, &scopes))
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
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    start_with(store, ServerOptions::default()).await
}

/// An agent over `store`, served on its own port until the test ends.
async fn start_with(store: Arc<dyn Store>, options: ServerOptions) -> Agent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (app, agent) = app(store, options, &base);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    agent
}

fn app(store: Arc<dyn Store>, options: ServerOptions, base: &str) -> (axum::Router, Agent) {
    let signer = CardSigner::generate().unwrap();
    let jwks = signer.jwks().unwrap();
    let skills = Arc::new(Counter::default());
    let gate = Arc::new(TestGate::default());
    let guards = Guards {
        auth: Arc::new(TestAuth),
        gate: gate.clone(),
    };
    let app = router_with(
        skills.clone(),
        store,
        "acme".into(),
        signer,
        base.to_string(),
        guards,
        options,
    );
    let agent = Agent {
        base: base.to_string(),
        jwks,
        skills,
        gate,
        http: reqwest::Client::new(),
    };
    (app, agent)
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
            .with_tokens(Arc::new(TestTokens(FACTORY.into())))
    }

    async fn rpc_raw(
        &self,
        version: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        self.rpc_as(Some(&token(FACTORY, "acme", &self.base)), version, body)
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

    /// `rpc` with another caller's token.
    async fn rpc_by(&self, bearer: &str, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
        let resp = self
            .rpc_as(Some(bearer), Some("1.0"), body.to_string())
            .await;
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

/// An A2A error (-32001..=-32009) carries an ErrorInfo with its reason; a JSON-RPC standard error
/// has no A2A reason and so no `data` (the TCK's JSONRPC-ERR-003 refuses `INVALID_PARAMS` etc.).
fn assert_error(resp: &Value, code: i64, reason: &str) {
    assert_eq!(error_code(resp), code, "{resp}");
    if !(-32009..=-32001).contains(&code) {
        assert!(resp["error"].get("data").is_none(), "{resp}");
        return;
    }
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
        json!([
            {"url": agent.base, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
            {"url": agent.base, "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0"},
        ])
    );
    // What the card offers is what the server does (tested below): streaming, push notifications
    // and the extended card, every call behind a bearer JWT.
    let caps = &card["capabilities"];
    assert_eq!(
        (
            &caps["streaming"],
            &caps["pushNotifications"],
            &caps["extendedAgentCard"]
        ),
        (&json!(true), &json!(true), &json!(true))
    );
    assert_eq!(
        caps["extensions"][0]["params"]["principal"],
        "agent:counter"
    );
    assert_eq!(
        card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["bearerFormat"],
        "JWT"
    );
    assert_eq!(
        card["securityRequirements"],
        json!([{"schemes": {"bearer": {"list": ["counter:read"]}}}])
    );
    assert_eq!(
        card["defaultInputModes"],
        json!(["application/json", "text/plain"])
    );
    assert_eq!(card["skills"][0]["tags"], json!(["risk:write"]));
    assert_eq!(card["skills"][4]["tags"], json!(["risk:destructive"]));
    assert_eq!(
        card["skills"][4]["securityRequirements"],
        json!([{"schemes": {"bearer": {"list": ["counter:write", "counter:destructive"]}}}])
    );
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
    assert_eq!(client.card().skills.len(), 8);
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
    // A repeat the caller follows (returnImmediately) is claimed, and finds the stored task: nothing runs.
    let mut repeat = send_params(
        "m-big",
        json!({"skill": "measure", "args": {"content": big}}),
    );
    repeat["configuration"] = json!({"returnImmediately": true});
    let repeat = agent.rpc("SendMessage", repeat).await;
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
async fn messages_nested_too_deep_to_store_are_refused_and_store_nothing() {
    let agent = start().await;
    // The deepest args the request parser takes (levels 7..=127 of the request); their stored task would need 128.
    let deep = agent.send("m-deep", "count", nested(121)).await;
    assert_error(&deep, -32602, "INVALID_PARAMS");
    let got = agent.rpc("GetTask", json!({"id": "m-deep"})).await;
    assert_error(&got, -32001, "TASK_NOT_FOUND");
    // The limit, from both sides: the data part {"skill", "args"} is one level more than its args.
    let over = agent.send("m-33", "count", nested(32)).await;
    assert_error(&over, -32602, "INVALID_PARAMS");
    let at = agent.send("m-32", "count", nested(31)).await;
    assert_eq!(
        at["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{at}"
    );
    // Message and part metadata are stored too.
    let call = json!({"skill": "count", "args": {}});
    let mut message_meta = send_params("m-meta", call.clone());
    message_meta["message"]["metadata"] = json!({"x": nested(33)});
    let mut part_meta = send_params("m-part-meta", call);
    part_meta["message"]["parts"][0]["metadata"] = json!({"x": nested(33)});
    for params in [message_meta, part_meta] {
        let refused = agent.rpc("SendMessage", params).await;
        assert_error(&refused, -32602, "INVALID_PARAMS");
    }
    // An output nested deeper than the limit fails the task for good (not retryable); at the limit it completes.
    let too_deep = agent.send("m-out-33", "nest", json!({"levels": 33})).await;
    assert_eq!(
        too_deep["result"]["task"]["status"]["state"], "TASK_STATE_FAILED",
        "{too_deep}"
    );
    assert_eq!(
        too_deep["result"]["task"]["status"]["message"]["parts"][1]["data"]["retryable"], false,
        "{too_deep}"
    );
    let deepest = agent.send("m-out-32", "nest", json!({"levels": 32})).await;
    assert_eq!(
        deepest["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{deepest}"
    );
    let listed = agent.rpc("ListTasks", json!({})).await;
    assert_eq!(listed["result"]["totalSize"], 3, "{listed}");
}

#[tokio::test]
async fn a_skill_cut_off_at_its_time_limit_fails_for_good() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    // The skill's time limit is four fifths of the claim's lease: 240 ms.
    let options = ServerOptions {
        claim_lease: Duration::from_millis(300),
        ..fast_polling()
    };
    let agent = start_with(store, options).await;
    let sent = agent.send("m-cut", "slow", json!({})).await;
    let task = &sent["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{sent}");
    let parts = &task["status"]["message"]["parts"];
    assert!(
        parts[0]["text"]
            .as_str()
            .unwrap()
            .contains("whether it took effect is unknown"),
        "{sent}"
    );
    // Not retryable: a repeat under a new message id could make the effect twice.
    assert_eq!(parts[1]["data"]["retryable"], false, "{sent}");
    // The same message id gets the same failure, without running the skill again.
    let repeat = agent.send("m-cut", "slow", json!({})).await;
    assert_eq!(
        repeat["result"]["task"]["status"]["state"],
        "TASK_STATE_FAILED"
    );
    assert_eq!(agent.calls(), 1);
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
        .bearer_auth(token(FACTORY, "acme", &agent.base))
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
        -32602,
        "INVALID_PARAMS",
    );
    for method in [
        "CreateTaskPushNotificationConfig",
        "GetTaskPushNotificationConfig",
        "ListTaskPushNotificationConfigs",
        "DeleteTaskPushNotificationConfig",
    ] {
        let params = json!({"taskId": "x", "id": "y", "url": "https://hooks.example.com/"});
        assert_error(&agent.rpc(method, params).await, -32001, "TASK_NOT_FOUND");
    }
    let other_tenant = json!({"id": "x", "tenant": "globex"});
    assert_error(
        &agent.rpc("GetTask", other_tenant).await,
        -32602,
        "INVALID_PARAMS",
    );
    let wrong_type: Value = agent
        .http
        .post(format!("{}/", agent.base))
        .header("content-type", "text/plain")
        .header("A2A-Version", "1.0")
        .bearer_auth(token(FACTORY, "acme", &agent.base))
        .body(call.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_error(&wrong_type, -32005, "CONTENT_TYPE_NOT_SUPPORTED");

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
        .with_tokens(Arc::new(TestTokens(FACTORY.into())));
    let err = client
        .call("m-small", "count", json!({}), None)
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::InvalidResponse(_)), "{err}");

    // Long enough to fetch the card on a loaded machine; the slow skill is not released before the call ends.
    let hasty = ClientOptions {
        timeout: Duration::from_secs(2),
        ..ClientOptions::default()
    };
    let client = A2aClient::with_options(&agent.base, &agent.jwks, hasty)
        .await
        .unwrap()
        .with_tokens(Arc::new(TestTokens(FACTORY.into())));
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
    let other_agent = token(FACTORY, "acme", "http://127.0.0.1:1");
    let other_org = token(FACTORY, "globex", &agent.base);
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
            format!("Basic {}", token(FACTORY, "acme", &agent.base)),
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
    // The stored answer does not depend on the gate: a replay is not even asked about.
    let asked_before = agent.gate.asked.lock().unwrap().len();
    let replayed = client
        .call("m-wipe-4", "wipe", target.clone(), Some("ap-down"))
        .await
        .unwrap();
    assert_eq!(replayed, json!({"wiped": {"target": "db"}}));
    assert_eq!(agent.gate.asked.lock().unwrap().len(), asked_before);
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
async fn a_message_id_is_bound_to_its_call_and_owned_by_its_caller() {
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
    // The write ran once; the read ran (a read is stored once it has run) and its answer was refused.
    assert_eq!(agent.calls(), 2);

    // Another caller can neither read nor cancel the task: it does not exist for them.
    let mallory = token("agent:mallory", "acme", &agent.base);
    for method in ["GetTask", "CancelTask"] {
        let resp = agent
            .rpc_by(&mallory, method, json!({"id": "m-bound"}))
            .await;
        assert_error(&resp, -32001, "TASK_NOT_FOUND");
    }
    // Message ids are each caller's own: the same id and call from another caller is their own task, run for
    // them, which neither shows nor changes the first caller's.
    let call = json!({"skill": "count", "args": {"n": 1, "m": 2}});
    let theirs = agent
        .rpc_by(&mallory, "SendMessage", send_params("m-bound", call))
        .await;
    let task = &theirs["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{theirs}");
    assert_ne!(task["artifacts"], first["result"]["task"]["artifacts"]);
    assert_eq!(agent.calls(), 3, "mallory's call ran for mallory");
    let own = agent.rpc("GetTask", json!({"id": "m-bound"})).await;
    assert_eq!(
        own["result"]["artifacts"],
        first["result"]["task"]["artifacts"]
    );
    assert_eq!(own["result"]["status"], first["result"]["task"]["status"]);
}

#[tokio::test]
async fn a_skill_runs_only_for_a_caller_holding_its_scopes() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store.clone(), ServerOptions::default()).await;
    let reader = scoped_token("user:alice", "acme", &agent.base, "counter:read");
    let send_as = |id: &str, skill: &str| {
        json!({"jsonrpc": "2.0", "id": 3, "method": "SendMessage",
               "params": send_params(id, json!({"skill": skill, "args": {}}))})
        .to_string()
    };
    let read: Value = agent
        .rpc_as(Some(&reader), Some("1.0"), send_as("m-read", "measure"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        read["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{read}"
    );
    assert_eq!(agent.calls(), 1);
    // A write skill under a read-only token fails for good, naming the scope, and never runs.
    let write: Value = agent
        .rpc_as(Some(&reader), Some("1.0"), send_as("m-write", "count"))
        .await
        .json()
        .await
        .unwrap();
    let status = &write["result"]["task"]["status"];
    assert_eq!(status["state"], "TASK_STATE_FAILED", "{write}");
    assert_eq!(status["message"]["parts"][1]["data"]["retryable"], false);
    let why = status["message"]["parts"][0]["text"].as_str().unwrap();
    assert!(why.contains("does not grant counter:write"), "{why}");
    // A destructive skill names the write scope first (it needs both), before any approval is asked.
    let wipe: Value = agent
        .rpc_as(Some(&reader), Some("1.0"), send_as("m-wipe", "wipe"))
        .await
        .json()
        .await
        .unwrap();
    let why = wipe["result"]["task"]["status"]["message"]["parts"][0]["text"]
        .as_str()
        .unwrap();
    assert!(why.contains("does not grant counter:write"), "{why}");
    assert!(agent.gate.asked.lock().unwrap().is_empty());
    // Scopes of another agent grant nothing here.
    let elsewhere = scoped_token("user:alice", "acme", &agent.base, "plane:read plane:write");
    let other: Value = agent
        .rpc_as(Some(&elsewhere), Some("1.0"), send_as("m-other", "measure"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        other["result"]["task"]["status"]["state"], "TASK_STATE_FAILED",
        "{other}"
    );
    assert_eq!(agent.calls(), 1);

    // A reader's tasks go away within the hour; the factory's (write scope held) are kept.
    agent.send("m-factory", "measure", json!({})).await;
    let expiry =
        |subject: &'static str, id: &'static str| stored_expiry(store.as_ref(), subject, id);
    let now = SystemClock.now_ms();
    for id in ["m-read", "m-write"] {
        let expires = expiry("user:alice", id)
            .await
            .expect("a reader's task expires");
        assert!(
            (now..=now + 3_600_000).contains(&expires),
            "{id}: {expires} vs {now}"
        );
    }
    assert_eq!(expiry(FACTORY, "m-factory").await, None);
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

// ---------------------------------------------------------------------------------------------
// HTTP+JSON binding, streaming, ListTasks, the extended card and tasks across restarts
// ---------------------------------------------------------------------------------------------

const ERROR_INFO: &str = "type.googleapis.com/google.rpc.ErrorInfo";

impl Agent {
    /// An HTTP+JSON request as `agent:factory` with `A2A-Version: 1.0`.
    async fn rest_raw(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("A2A-Version", "1.0")
            .header("accept", "application/a2a+json")
            .bearer_auth(token(FACTORY, "acme", &self.base));
        if let Some(body) = body {
            req = req
                .header("content-type", "application/a2a+json")
                .body(body.to_string());
        }
        req.send().await.unwrap()
    }

    /// Status, content type and JSON body of an HTTP+JSON request.
    async fn rest(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, String, Value) {
        let resp = self.rest_raw(method, path, body).await;
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let text = resp.text().await.unwrap();
        (
            status,
            content_type,
            serde_json::from_str(&text).unwrap_or(Value::Null),
        )
    }

    /// A JSON-RPC request as `agent:factory`, its response not yet read (for streams).
    async fn rpc_stream(&self, method: &str, params: Value) -> reqwest::Response {
        let body = json!({"jsonrpc": "2.0", "id": "s", "method": method, "params": params});
        self.rpc_raw(Some("1.0"), body.to_string()).await
    }
}

/// The JSON of each `data:` line of an SSE response, read to its end.
async fn sse_events(resp: reqwest::Response) -> Vec<Value> {
    assert_eq!(resp.status(), 200);
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let text = resp.text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim()).unwrap())
        .collect()
}

fn assert_rest_error(got: &(u16, String, Value), http: u16, status: &str, reason: &str) {
    let (code, content_type, body) = got;
    assert_eq!(*code, http, "{body}");
    assert_eq!(content_type, "application/a2a+json");
    assert_eq!(body["error"]["code"], http, "{body}");
    assert_eq!(body["error"]["status"], status, "{body}");
    assert_eq!(body["error"]["details"][0]["@type"], ERROR_INFO, "{body}");
    assert_eq!(body["error"]["details"][0]["reason"], reason, "{body}");
    assert_eq!(
        body["error"]["details"][0]["domain"], "a2a-protocol.org",
        "{body}"
    );
}

fn rest_send(message_id: &str, skill: &str, args: Value) -> Value {
    json!({"message": {"messageId": message_id, "role": "ROLE_USER",
        "parts": [{"data": {"skill": skill, "args": args}}]}})
}

use reqwest::Method;

#[tokio::test]
async fn http_json_binding_serves_every_rpc() {
    let agent = start().await;
    let (status, content_type, body) = agent
        .rest(
            Method::POST,
            "/message:send",
            Some(rest_send("r-1", "count", json!({}))),
        )
        .await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "application/a2a+json"),
        "{body}"
    );
    assert_eq!(body["task"]["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(body["task"]["artifacts"][0]["parts"][0]["data"]["count"], 1);
    // The same call over the other binding is the same task: the skill does not run again.
    let rpc = agent.send("r-1", "count", json!({})).await;
    assert_eq!(
        rpc["result"]["task"]["artifacts"],
        body["task"]["artifacts"]
    );
    assert_eq!(agent.calls(), 1);

    // GetTask with a trailing slash, the tenant prefix and an escaped id.
    for path in [
        "/tasks/r-1",
        "/tasks/r-1/",
        "/acme/tasks/r-1",
        "/tasks/r%2D1",
    ] {
        let (status, _, body) = agent.rest(Method::GET, path, None).await;
        assert_eq!(status, 200, "{path}: {body}");
        assert_eq!(body["id"], "r-1", "{path}");
        assert_eq!(body["history"][0]["messageId"], "r-1", "{path}");
    }
    let (_, _, body) = agent
        .rest(Method::GET, "/tasks/r-1?historyLength=0", None)
        .await;
    assert!(body.get("history").is_none(), "{body}");
    assert_eq!(body["status"]["state"], "TASK_STATE_COMPLETED");

    let not_found = agent.rest(Method::GET, "/tasks/nope", None).await;
    assert_rest_error(&not_found, 404, "NOT_FOUND", "TASK_NOT_FOUND");
    let cancel = agent
        .rest(Method::POST, "/acme/tasks/r-1:cancel", None)
        .await;
    assert_rest_error(&cancel, 409, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE");
    for method in [Method::GET, Method::POST] {
        let subscribe = agent.rest(method, "/tasks/r-1:subscribe", None).await;
        assert_rest_error(&subscribe, 400, "UNIMPLEMENTED", "UNSUPPORTED_OPERATION");
    }
    let tenant = agent.rest(Method::GET, "/globex/tasks/r-1", None).await;
    assert_rest_error(&tenant, 400, "INVALID_ARGUMENT", "INVALID_PARAMS");
    // Webhooks inside the agent's network are refused unless the server allows them.
    for url in [
        "http://127.0.0.1:9/h",
        "http://169.254.169.254/",
        "http://[::1]/",
        "ftp://x/",
    ] {
        let push = agent
            .rest(
                Method::POST,
                "/tasks/r-1/pushNotificationConfigs",
                Some(json!({"url": url})),
            )
            .await;
        assert_rest_error(&push, 400, "INVALID_ARGUMENT", "INVALID_PARAMS");
    }
    let (status, _, deleted) = agent
        .rest(Method::DELETE, "/tasks/r-1/pushNotificationConfigs/c", None)
        .await;
    assert_eq!((status, deleted), (200, json!({})));
    let push = agent
        .rest(Method::GET, "/tasks/nope/pushNotificationConfigs", None)
        .await;
    assert_rest_error(&push, 404, "NOT_FOUND", "TASK_NOT_FOUND");
    let bad_body = agent
        .rest(Method::POST, "/message:send", Some(json!({"message": 1})))
        .await;
    assert_rest_error(&bad_body, 400, "INVALID_ARGUMENT", "INVALID_PARAMS");
    let (status, _, _) = agent.rest(Method::GET, "/no/such/route", None).await;
    assert_eq!(status, 404);
    let (status, _, _) = agent.rest(Method::DELETE, "/tasks/r-1", None).await;
    assert_eq!(status, 404);

    // A missing version header means 0.3; the query parameter counts too.
    let bearer = token(FACTORY, "acme", &agent.base);
    let resp = agent
        .http
        .get(format!("{}/tasks/r-1", agent.base))
        .bearer_auth(&bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["error"]["details"][0]["reason"],
        "VERSION_NOT_SUPPORTED"
    );
    let resp = agent
        .http
        .get(format!("{}/tasks/r-1?A2A-Version=1.0", agent.base))
        .bearer_auth(&bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // No token: 401 with a challenge and nothing run.
    let resp = agent
        .http
        .post(format!("{}/message:send", agent.base))
        .header("A2A-Version", "1.0")
        .header("content-type", "application/json")
        .body(rest_send("r-2", "count", json!({})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["status"], "UNAUTHENTICATED");

    let resp = agent
        .http
        .post(format!("{}/message:send", agent.base))
        .header("A2A-Version", "1.0")
        .header("content-type", "text/plain")
        .bearer_auth(&bearer)
        .body(rest_send("r-3", "count", json!({})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);
    // A client that did not ask for application/a2a+json gets application/json (A2A 1.0.0).
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["error"]["details"][0]["reason"],
        "CONTENT_TYPE_NOT_SUPPORTED"
    );
    assert_eq!(agent.calls(), 1);
}

#[tokio::test]
async fn the_extended_card_needs_a_caller_and_states_its_limits() {
    let agent = start().await;
    let (status, _, card) = agent.rest(Method::GET, "/extendedAgentCard", None).await;
    assert_eq!(status, 200, "{card}");
    let parsed: a2a::AgentCard = serde_json::from_value(card.clone()).unwrap();
    loams_a2a::verify_card(&parsed, &agent.jwks).unwrap();
    let ext = &card["capabilities"]["extensions"][0];
    assert_eq!(ext["uri"], loams_a2a::CALLER_LIMITS_EXTENSION);
    assert_eq!(ext["params"]["subject"], FACTORY);
    assert_eq!(ext["params"]["approvalRequiredSkills"], json!(["wipe"]));
    assert_eq!(ext["params"]["maxRequestBytes"], 1024 * 1024);

    let rpc = agent.rpc("GetExtendedAgentCard", json!({})).await;
    assert_eq!(
        rpc["result"]["capabilities"]["extensions"][0]["params"]["subject"],
        FACTORY
    );

    let resp = agent
        .http
        .get(format!("{}/extendedAgentCard", agent.base))
        .header("A2A-Version", "1.0")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
}

#[tokio::test]
async fn streaming_over_both_bindings() {
    let agent = start().await;
    let rpc = sse_events(
        agent
            .rpc_stream(
                "SendStreamingMessage",
                send_params("st-1", json!({"skill": "count", "args": {}})),
            )
            .await,
    )
    .await;
    assert_eq!(rpc.len(), 3, "{rpc:?}");
    for event in &rpc {
        assert_eq!(event["jsonrpc"], "2.0");
        assert_eq!(event["id"], "s");
    }
    assert_eq!(
        rpc[0]["result"]["task"]["status"]["state"],
        "TASK_STATE_WORKING"
    );
    assert_eq!(
        rpc[1]["result"]["artifactUpdate"]["artifact"]["parts"][0]["data"]["count"],
        1
    );
    assert_eq!(rpc[1]["result"]["artifactUpdate"]["lastChunk"], true);
    assert_eq!(
        rpc[2]["result"]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(rpc[2]["result"]["statusUpdate"]["taskId"], "st-1");

    let rest = sse_events(
        agent
            .rest_raw(
                Method::POST,
                "/message:stream",
                Some(rest_send("st-2", "count", json!({}))),
            )
            .await,
    )
    .await;
    let kinds: Vec<&str> = rest
        .iter()
        .map(|e| e.as_object().unwrap().keys().next().unwrap().as_str())
        .collect();
    assert_eq!(
        kinds,
        ["task", "artifactUpdate", "statusUpdate"],
        "{rest:?}"
    );
    assert_eq!(
        rest[2]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );

    // A finished call streamed again is its stored task alone; the skill does not run again.
    let again = sse_events(
        agent
            .rest_raw(
                Method::POST,
                "/message:stream",
                Some(rest_send("st-2", "count", json!({}))),
            )
            .await,
    )
    .await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0]["task"]["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(agent.calls(), 2);

    // Validation errors come before the stream, as plain errors.
    let bad = agent
        .rest(
            Method::POST,
            "/message:stream",
            Some(rest_send("st-3", "launch", json!({}))),
        )
        .await;
    assert_rest_error(&bad, 400, "INVALID_ARGUMENT", "INVALID_PARAMS");
}

fn fast_polling() -> ServerOptions {
    ServerOptions {
        poll_interval: Duration::from_millis(20),
        ..ServerOptions::default()
    }
}

#[tokio::test]
async fn a_blocking_read_is_stored_once_it_has_run_and_anything_else_is_claimed_first() {
    let store = Arc::new(Counting::new(
        Sqlite::memory(Arc::new(SystemClock)).unwrap(),
    ));
    let agent = start_with(store.clone(), ServerOptions::default()).await;
    // (item writes, of those replayable, item reads) since `before`.
    let ops = |before: &OpCounts| {
        let d = store.counts().since(before);
        (d.put_item, d.replayable_puts, d.get_item + d.list_items)
    };

    // A read the caller waits for changes nothing and needs no claim: one write, which a power loss may undo
    // (the read would run again).
    let before = store.counts();
    let read = agent.send("m-read-once", "peek", json!({})).await;
    let task = &read["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{read}");
    assert_eq!(task["artifacts"][0]["parts"][0]["data"]["run"], 1);
    assert_eq!(ops(&before), (1, 1, 0), "one replayable write and no read");
    let got = agent.rpc("GetTask", json!({"id": "m-read-once"})).await;
    assert_eq!(got["result"]["status"], task["status"], "{got}");
    assert_eq!(got["result"]["artifacts"], task["artifacts"], "{got}");
    // A repeat runs the read again (run 2) and answers the stored task (run 1).
    let repeat = agent.send("m-read-once", "peek", json!({})).await;
    assert_eq!(repeat["result"], read["result"]);
    assert_eq!(agent.calls(), 2);

    // A write is claimed (stored WORKING) before it runs, then finished, and its push configs are looked up; both
    // writes are durable.
    let before = store.counts();
    agent.send("m-write", "count", json!({})).await;
    assert_eq!(ops(&before), (2, 0, 1));

    // So is a read whose caller follows the task instead of waiting for it.
    let before = store.counts();
    let mut send = send_params("m-read-later", json!({"skill": "measure", "args": {}}));
    send["configuration"] = json!({"returnImmediately": true});
    let started = agent.rpc("SendMessage", send).await;
    assert_eq!(
        started["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{started}"
    );
    let mut state = Value::Null;
    for _ in 0..200 {
        let got = agent.rpc("GetTask", json!({"id": "m-read-later"})).await;
        state = got["result"]["status"]["state"].clone();
        if state == "TASK_STATE_COMPLETED" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state, "TASK_STATE_COMPLETED");
    let later = store.counts().since(&before);
    assert_eq!((later.put_item, later.replayable_puts), (2, 0));
}

#[tokio::test]
async fn return_immediately_then_subscribe_over_get_post_and_json_rpc() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store, fast_polling()).await;
    let mut send = rest_send("sub-1", "slow", json!({}));
    send["configuration"] = json!({"returnImmediately": true});
    let (status, _, body) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["task"]["status"]["state"], "TASK_STATE_WORKING");
    agent.skills.slow_started.notified().await;

    let by_get = agent
        .rest_raw(Method::GET, "/tasks/sub-1:subscribe", None)
        .await;
    let by_post = agent
        .rest_raw(Method::POST, "/acme/tasks/sub-1:subscribe/", None)
        .await;
    let by_rpc = agent
        .rpc_stream("SubscribeToTask", json!({"id": "sub-1"}))
        .await;
    let (_, _, working) = agent.rest(Method::GET, "/tasks/sub-1", None).await;
    assert_eq!(working["status"]["state"], "TASK_STATE_WORKING");
    agent.skills.slow_release.notify_one();

    for events in [sse_events(by_get).await, sse_events(by_post).await] {
        assert_eq!(
            events[0]["task"]["status"]["state"], "TASK_STATE_WORKING",
            "{events:?}"
        );
        assert_eq!(
            events[1]["artifactUpdate"]["artifact"]["parts"][0]["data"]["count"],
            1
        );
        assert_eq!(
            events[2]["statusUpdate"]["status"]["state"],
            "TASK_STATE_COMPLETED"
        );
        assert_eq!(events.len(), 3);
    }
    let rpc = sse_events(by_rpc).await;
    assert_eq!(
        rpc.last().unwrap()["result"]["statusUpdate"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    let (_, _, done) = agent.rest(Method::GET, "/tasks/sub-1", None).await;
    assert_eq!(done["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(agent.calls(), 1);
}

/// A task started by a process that then dies stays readable, subscribable and (once the dead
/// process's claim has lapsed) cancelable from a new process over the same store, and a repeat of
/// the call gets the canceled task instead of a second run.
#[tokio::test]
async fn tasks_survive_a_restart() {
    // The lease must outlast a new agent's start and two calls on a loaded machine.
    let (store, options, send) = abandoned("rs-1", 3000).await;

    let agent = start_with(store, options).await;
    let (_, _, task) = agent.rest(Method::GET, "/tasks/rs-1", None).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_WORKING", "{task}");
    // While the dead process's claim holds, nobody can tell it is dead: not cancelable yet.
    let early = agent.rest(Method::POST, "/tasks/rs-1:cancel", None).await;
    assert_rest_error(&early, 409, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE");

    let subscription = agent
        .rest_raw(Method::GET, "/tasks/rs-1:subscribe", None)
        .await;
    tokio::time::sleep(Duration::from_millis(3050)).await;
    let canceled = agent.rpc("CancelTask", json!({"id": "rs-1"})).await;
    assert_eq!(
        canceled["result"]["status"]["state"], "TASK_STATE_CANCELED",
        "{canceled}"
    );
    let events = sse_events(subscription).await;
    assert_eq!(events[0]["task"]["status"]["state"], "TASK_STATE_WORKING");
    assert_eq!(
        events.last().unwrap()["statusUpdate"]["status"]["state"],
        "TASK_STATE_CANCELED"
    );

    let (_, _, repeat) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(
        repeat["task"]["status"]["state"], "TASK_STATE_CANCELED",
        "{repeat}"
    );
    assert_eq!(agent.calls(), 0);
    let again = agent.rest(Method::POST, "/tasks/rs-1:cancel", None).await;
    assert_rest_error(&again, 409, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE");
}

/// A `slow` call `message_id` (with returnImmediately) left WORKING over a fresh store by a process that was killed,
/// runtime and skill run and all, once the skill had started; the agents' lease is `lease_ms`. Returns the store, the
/// options and the send, for a new process over the same store.
async fn abandoned(message_id: &str, lease_ms: u64) -> (Arc<dyn Store>, ServerOptions, Value) {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let options = ServerOptions {
        claim_lease: Duration::from_millis(lease_ms),
        ..fast_polling()
    };
    let mut send = rest_send(message_id, "slow", json!({}));
    send["configuration"] = json!({"returnImmediately": true});
    // The first process runs in its own runtime so that it can be killed, skill run and all.
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let base = format!("http://{}", std_listener.local_addr().unwrap());
    let (app, old) = app(store.clone(), options.clone(), &base);
    first.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
        axum::serve(listener, app).await.unwrap()
    });
    let (status, _, body) = old
        .rest(Method::POST, "/message:send", Some(send.clone()))
        .await;
    assert_eq!(
        (status, &body["task"]["status"]["state"]),
        (200, &json!("TASK_STATE_WORKING"))
    );
    old.skills.slow_started.notified().await;
    first.shutdown_background();
    (store, options, send)
}

/// A call whose process died mid-skill runs again when it is repeated after the lease: nobody else can finish it.
#[tokio::test]
async fn a_call_left_by_a_dead_process_runs_again_after_its_lease() {
    // The lease must outlast a new agent's start and a call, and its four fifths (the skill's time limit) the
    // release below, on a loaded machine.
    let (store, options, send) = abandoned("rd-1", 3000).await;

    let agent = start_with(store, options).await;
    let (_, _, early) = agent
        .rest(Method::POST, "/message:send", Some(send.clone()))
        .await;
    assert_eq!(
        early["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{early}"
    );
    assert_eq!(
        agent.calls(),
        0,
        "within the lease the repeat only shows the task"
    );

    tokio::time::sleep(Duration::from_millis(3050)).await;
    let (_, _, taken) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(
        taken["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{taken}"
    );
    agent.skills.slow_started.notified().await;
    assert_eq!(agent.calls(), 1);
    agent.skills.slow_release.notify_one();
    let done = loop {
        let (_, _, task) = agent.rest(Method::GET, "/tasks/rd-1", None).await;
        if task["status"]["state"] != "TASK_STATE_WORKING" {
            break task;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(done["status"]["state"], "TASK_STATE_COMPLETED", "{done}");
    assert_eq!(agent.calls(), 1);
}

/// Two repeats taking over the same abandoned call: the one whose write lands second sees the other's WORKING
/// task and runs nothing.
#[tokio::test]
async fn of_two_repeats_taking_over_a_call_only_one_runs_it() {
    let (store, options, send) = abandoned("rt-1", 300).await;
    tokio::time::sleep(Duration::from_millis(350)).await;

    // The rival takes the task over with the very record this request is about to write.
    let racing = Arc::new(RaceBeforeWrite::new(store, TASK_KIND, |_, losing| {
        losing.clone()
    }));
    let agent = start_with(racing.clone(), options).await;
    let (status, _, lost) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(
        (status, &lost["task"]["status"]["state"]),
        (200, &json!("TASK_STATE_WORKING")),
        "{lost}"
    );
    assert!(
        racing.raced(),
        "the repeat must have tried to take the task over"
    );
    assert_eq!(
        agent.calls(),
        0,
        "the request that lost the takeover runs nothing"
    );
}

/// A push config the caller got wrong stores nothing: the message id is still free for a corrected send.
#[tokio::test]
async fn a_refused_push_config_leaves_the_message_id_free() {
    let agent = start().await;
    let mut send = rest_send("pc-1", "count", json!({}));
    send["configuration"] =
        json!({"taskPushNotificationConfig": {"url": "ftp://example.invalid/hook"}});
    let (status, _, refused) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(status, 400, "{refused}");
    let missing = agent.rest(Method::GET, "/tasks/pc-1", None).await;
    assert_rest_error(&missing, 404, "NOT_FOUND", "TASK_NOT_FOUND");

    let (_, _, done) = agent
        .rest(
            Method::POST,
            "/message:send",
            Some(rest_send("pc-1", "count", json!({}))),
        )
        .await;
    assert_eq!(
        done["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{done}"
    );
    assert_eq!(agent.calls(), 1);
}

/// The expiry of `subject`'s stored task `task_id` (which must be stored).
async fn stored_expiry(store: &dyn Store, subject: &str, task_id: &str) -> Option<i64> {
    let key = task_item_id("counter", subject, task_id);
    let item = store.get_item("acme", TASK_KIND, &key).await.unwrap();
    item.expect("the task is stored").expires_ms
}

/// Rewrites the stored record of `subject`'s task `task_id` with `edit`.
async fn rewrite_stored(
    store: &dyn Store,
    subject: &str,
    task_id: &str,
    edit: impl FnOnce(&mut Value),
) {
    let id = task_item_id("counter", subject, task_id);
    let mut item = store
        .get_item("acme", TASK_KIND, &id)
        .await
        .unwrap()
        .unwrap();
    let mut record: Value = serde_json::from_slice(&item.body).unwrap();
    edit(&mut record);
    item.body = serde_json::to_vec(&record).unwrap();
    store.put_item(&item, Cond::Any).await.unwrap();
}

/// Rewrites the stored task `task_id` as the code before leases wrote it (no lease in the record), with `state`.
async fn as_stored_before_leases(store: &Arc<dyn Store>, task_id: &str, state: &str) {
    rewrite_stored(store.as_ref(), FACTORY, task_id, |record| {
        record.as_object_mut().unwrap().remove("lease_until_ms");
        record["task"]["status"]["state"] = json!(state);
    })
    .await;
}

/// Tasks stored before the lease was kept in the record: a WORKING one counts as run until its status time plus
/// the lease (when its claim would have lapsed), a retryable failure is run again, a permanent one is not.
#[tokio::test]
async fn tasks_stored_before_leases_keep_their_meaning() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    // Long enough for the calls made within it on a loaded machine.
    let options = ServerOptions {
        claim_lease: Duration::from_millis(2000),
        ..fast_polling()
    };
    let agent = start_with(store.clone(), options).await;

    agent.send("old-working", "count", json!({})).await;
    as_stored_before_leases(&store, "old-working", "TASK_STATE_WORKING").await;
    let early = agent
        .rest(Method::POST, "/tasks/old-working:cancel", None)
        .await;
    assert_rest_error(&early, 409, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE");
    let shown = agent.send("old-working", "count", json!({})).await;
    assert_eq!(
        shown["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{shown}"
    );
    assert_eq!(agent.calls(), 1, "within the lease nothing runs again");
    tokio::time::sleep(Duration::from_millis(2050)).await;
    let taken = agent.send("old-working", "count", json!({})).await;
    assert_eq!(
        taken["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{taken}"
    );
    assert_eq!(
        agent.calls(),
        2,
        "after the lease a repeat takes the call over"
    );

    agent
        .send("old-retry", "fail", json!({"retryable": true}))
        .await;
    as_stored_before_leases(&store, "old-retry", "TASK_STATE_FAILED").await;
    agent
        .send("old-retry", "fail", json!({"retryable": true}))
        .await;
    assert_eq!(agent.calls(), 4, "a retryable failure runs again");

    agent
        .send("old-final", "fail", json!({"retryable": false}))
        .await;
    as_stored_before_leases(&store, "old-final", "TASK_STATE_FAILED").await;
    agent
        .send("old-final", "fail", json!({"retryable": false}))
        .await;
    assert_eq!(
        agent.calls(),
        5,
        "a permanent failure is the recorded outcome"
    );
}

#[tokio::test]
async fn list_tasks_reads_the_store_a_bounded_page_at_a_time() {
    // A stored task may be 400 KB: a listing must not ask the store for a thousand of them at once.
    let store = Arc::new(Counting::new(
        Sqlite::memory(Arc::new(SystemClock)).unwrap(),
    ));
    let agent = start_with(store.clone(), ServerOptions::default()).await;
    for i in 0..250 {
        agent
            .send(&format!("p-{i}"), "count", json!({"i": i}))
            .await;
    }
    let before = store.counts().list_items;
    let page = agent.rpc("ListTasks", json!({"pageSize": 10})).await;
    assert_eq!(page["result"]["totalSize"], 250, "{page}");
    assert_eq!(page["result"]["tasks"].as_array().unwrap().len(), 10);
    assert_eq!(
        store.counts().list_items - before,
        3,
        "250 tasks in store pages of 100"
    );
}

#[tokio::test]
async fn a_damaged_task_record_is_left_out_of_listings_and_reported_by_get() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store.clone(), ServerOptions::default()).await;
    agent.send("m-kept", "count", json!({})).await;
    agent.send("m-damaged", "count", json!({})).await;
    let mut item = store
        .get_item(
            "acme",
            TASK_KIND,
            &task_item_id("counter", FACTORY, "m-damaged"),
        )
        .await
        .unwrap()
        .unwrap();
    item.body = b"{not json".to_vec();
    store.put_item(&item, Cond::Any).await.unwrap();

    let listed = agent.rpc("ListTasks", json!({})).await;
    assert_eq!(listed["result"]["totalSize"], 1, "{listed}");
    assert_eq!(listed["result"]["tasks"][0]["id"], "m-kept", "{listed}");
    let got = agent.rpc("GetTask", json!({"id": "m-damaged"})).await;
    assert_error(&got, -32603, "");
    assert_eq!(
        got["error"]["message"], "stored task is unreadable",
        "{got}"
    );
}

#[tokio::test]
async fn list_tasks_ends_a_page_early_rather_than_outgrow_a_clients_response_limit() {
    // 16 tasks of about 150 KB (their history holds the request): 2.4 MB in one page of 100, more than our own
    // client reads by default (2 MiB). The agent ends each page near 1 MiB and hands out a token for the rest.
    let agent = start().await;
    let pad = "x".repeat(150_000);
    for i in 0..16 {
        agent
            .send(&format!("big-{i}"), "measure", json!({"pad": pad}))
            .await;
    }
    let client = agent.client().await;
    let mut seen = Vec::new();
    let mut token = None;
    let mut pages = 0;
    loop {
        let page = client
            .list_tasks(a2a::ListTasksRequest {
                context_id: None,
                status: None,
                page_size: Some(100),
                page_token: token.take(),
                history_length: None,
                status_timestamp_after: None,
                include_artifacts: None,
                tenant: None,
            })
            .await
            .unwrap();
        pages += 1;
        assert_eq!(page.total_size, 16);
        assert!(!page.tasks.is_empty());
        let bytes = serde_json::to_vec(&page.tasks).unwrap().len();
        assert!(bytes <= 1024 * 1024, "page of {bytes} bytes");
        assert!(
            page.tasks
                .iter()
                .all(|t| t.history.as_ref().is_some_and(|h| !h.is_empty())),
            "whole tasks, history kept"
        );
        seen.extend(page.tasks.into_iter().map(|t| t.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = Some(page.next_page_token);
    }
    assert!(pages >= 3, "{pages} pages");
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 16, "every task once: {seen:?}");
}

#[tokio::test]
async fn list_tasks_filters_and_pages() {
    let agent = start().await;
    for i in 0..5 {
        let mut send = rest_send(&format!("l-{i}"), "count", json!({"i": i}));
        send["message"]["contextId"] = json!(format!("ctx-{}", i % 2));
        let (status, _, _) = agent.rest(Method::POST, "/message:send", Some(send)).await;
        assert_eq!(status, 200);
    }
    agent.send("l-fail", "fail", json!({})).await;

    let mut seen = Vec::new();
    let mut token = String::new();
    let mut last_time = chrono::DateTime::<chrono::Utc>::MAX_UTC;
    loop {
        let (status, _, page) = agent
            .rest(
                Method::GET,
                &format!("/tasks?pageSize=2&pageToken={token}"),
                None,
            )
            .await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["pageSize"], 2);
        assert_eq!(page["totalSize"], 6);
        for task in page["tasks"].as_array().unwrap() {
            assert!(
                task.get("artifacts").is_none(),
                "artifacts only on request: {task}"
            );
            // Compared as times: the text drops the fraction on a whole second, so it does not sort.
            let time = task["status"]["timestamp"]
                .as_str()
                .unwrap()
                .parse::<chrono::DateTime<chrono::Utc>>()
                .unwrap();
            assert!(time <= last_time, "newest first: {time} after {last_time}");
            last_time = time;
            seen.push(task["id"].as_str().unwrap().to_string());
        }
        token = page["nextPageToken"].as_str().unwrap().to_string();
        if token.is_empty() {
            break;
        }
    }
    seen.sort();
    assert_eq!(seen, ["l-0", "l-1", "l-2", "l-3", "l-4", "l-fail"]);

    let (_, _, failed) = agent
        .rest(Method::GET, "/tasks?status=TASK_STATE_FAILED", None)
        .await;
    assert_eq!(failed["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(failed["tasks"][0]["id"], "l-fail");
    let (_, _, ctx) = agent
        .rest(
            Method::GET,
            "/acme/tasks?contextId=ctx-1&includeArtifacts=true&historyLength=0",
            None,
        )
        .await;
    let ids: Vec<&str> = ctx["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&"l-1") && ids.contains(&"l-3"), "{ids:?}");
    assert!(ctx["tasks"][0]["artifacts"].is_array());
    assert!(ctx["tasks"][0].get("history").is_none());
    let (_, _, future) = agent
        .rest(
            Method::GET,
            "/tasks?statusTimestampAfter=2999-01-01T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(future["totalSize"], 0);

    let rpc = agent.rpc("ListTasks", json!({"pageSize": 1})).await;
    assert_eq!(rpc["result"]["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(rpc["result"]["totalSize"], 6);
    assert!(!rpc["result"]["nextPageToken"].as_str().unwrap().is_empty());

    // Another caller's list is its own.
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}});
    let other: Value = agent
        .rpc_as(
            Some(&token_for("agent:other", &agent.base)),
            Some("1.0"),
            body.to_string(),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(other["result"]["totalSize"], 0, "{other}");

    for query in [
        "pageSize=0",
        "pageSize=101",
        "pageToken=%21",
        "status=DONE",
        "historyLength=-1",
    ] {
        let bad = agent
            .rest(Method::GET, &format!("/tasks?{query}"), None)
            .await;
        assert_rest_error(&bad, 400, "INVALID_ARGUMENT", "INVALID_PARAMS");
    }
}

fn token_for(subject: &str, base: &str) -> String {
    token(subject, "acme", base)
}

async fn client_on(agent: &Agent, binding: Binding) -> A2aClient {
    let options = ClientOptions {
        binding,
        ..ClientOptions::default()
    };
    A2aClient::with_options(&agent.base, &agent.jwks, options)
        .await
        .unwrap()
        .with_tokens(Arc::new(TestTokens(FACTORY.into())))
}

fn message(message_id: &str, skill: &str) -> a2a::Message {
    serde_json::from_value(json!({"messageId": message_id, "role": "ROLE_USER",
        "parts": [{"data": {"skill": skill, "args": {}}}]}))
    .unwrap()
}

fn request(message_id: &str, skill: &str, immediately: bool) -> a2a::SendMessageRequest {
    a2a::SendMessageRequest {
        message: message(message_id, skill),
        configuration: immediately.then_some(a2a::SendMessageConfiguration {
            accepted_output_modes: None,
            task_push_notification_config: None,
            history_length: None,
            return_immediately: Some(true),
        }),
        metadata: None,
        tenant: None,
    }
}

/// The kinds of events a streamed `count` sends under `message_id`, checking that it ends completed.
async fn streamed_kinds(client: &A2aClient, message_id: &str) -> Vec<&'static str> {
    let mut stream = client
        .send_streaming(request(message_id, "count", false))
        .await
        .unwrap();
    let mut kinds = Vec::new();
    while let Some(event) = stream.next().await {
        kinds.push(match event.unwrap() {
            a2a::StreamResponse::Task(_) => "task",
            a2a::StreamResponse::ArtifactUpdate(_) => "artifact",
            a2a::StreamResponse::StatusUpdate(u) => {
                assert_eq!(u.status.state, a2a::TaskState::Completed);
                "status"
            }
            a2a::StreamResponse::Message(_) => "message",
        });
    }
    kinds
}

#[tokio::test]
async fn client_speaks_both_bindings() {
    let agent = start_with(
        Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap()),
        fast_polling(),
    )
    .await;
    for (n, binding) in [Binding::JsonRpc, Binding::HttpJson]
        .into_iter()
        .enumerate()
    {
        let client = client_on(&agent, binding).await;
        assert_eq!(client.binding(), binding);
        let id = |what: &str| format!("{what}-{n}");

        let out = client
            .call(&id("c"), "count", json!({}), None)
            .await
            .unwrap();
        assert!(out["count"].is_number(), "{out}");

        let task = client.get_task(&id("c"), Some(0)).await.unwrap();
        assert_eq!(task.status.state, a2a::TaskState::Completed);
        assert!(task.history.is_none());
        match client.get_task("nope", None).await.unwrap_err() {
            CallError::Protocol { code, .. } => assert_eq!(code, -32001, "{binding:?}"),
            other => panic!("{other}"),
        }
        match client.cancel_task(&id("c")).await.unwrap_err() {
            CallError::Protocol { code, .. } => assert_eq!(code, -32002, "{binding:?}"),
            other => panic!("{other}"),
        }
        match client.subscribe(&id("c")).await.unwrap_err() {
            CallError::Protocol { code, .. } => assert_eq!(code, -32004, "{binding:?}"),
            other => panic!("{other}"),
        }

        assert_eq!(
            streamed_kinds(&client, &id("s")).await,
            ["task", "artifact", "status"],
            "{binding:?}"
        );

        // returnImmediately, then follow the task to its end.
        let a2a::SendMessageResponse::Task(working) = client
            .send(request(&id("slow"), "slow", true))
            .await
            .unwrap()
        else {
            panic!("expected a task")
        };
        assert_eq!(working.status.state, a2a::TaskState::Working);
        agent.skills.slow_started.notified().await;
        let release = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            agent.skills.slow_release.notify_one();
        };
        let slow = id("slow");
        let (done, ()) = tokio::join!(client.follow(&slow), release);
        let done = done.unwrap();
        assert_eq!(done.status.state, a2a::TaskState::Completed, "{binding:?}");
        assert!(done.artifacts.is_some());

        let page = client
            .list_tasks(a2a::ListTasksRequest {
                context_id: None,
                status: Some(a2a::TaskState::Completed),
                page_size: Some(10),
                page_token: None,
                history_length: None,
                status_timestamp_after: None,
                include_artifacts: Some(true),
                tenant: None,
            })
            .await
            .unwrap();
        assert_eq!(page.total_size, 3 * (n as i32 + 1), "{binding:?}");
        assert!(page.tasks.iter().all(|t| t.artifacts.is_some()));

        let card = client.extended_card().await.unwrap();
        let ext = &card.capabilities.extensions.unwrap()[0];
        assert_eq!(ext.params.as_ref().unwrap()["subject"], FACTORY);

        let anonymous = A2aClient::with_options(
            &agent.base,
            &agent.jwks,
            ClientOptions {
                binding,
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap();
        assert!(matches!(
            anonymous.get_task(&id("c"), None).await.unwrap_err(),
            CallError::Http(401)
        ));
    }
}

#[tokio::test]
async fn an_in_process_client_reaches_its_agent_through_the_router_alone() {
    // Nothing listens on a freshly closed port, so every answer below came from the router, not a connection.
    let base = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let (router, agent) = app(
        Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap()),
        fast_polling(),
        &base,
    );
    assert!(matches!(
        A2aClient::new(&base, &agent.jwks).await.unwrap_err(),
        CallError::Transport(_)
    ));
    let in_process = |options: ClientOptions| {
        let (base, jwks, router) = (base.clone(), agent.jwks.clone(), router.clone());
        async move {
            A2aClient::in_process(&base, &jwks, options, router)
                .await
                .unwrap()
        }
    };
    for (n, binding) in [Binding::JsonRpc, Binding::HttpJson]
        .into_iter()
        .enumerate()
    {
        let options = ClientOptions {
            binding,
            ..ClientOptions::default()
        };
        let anonymous = in_process(options.clone()).await;
        let client = anonymous
            .clone()
            .with_tokens(Arc::new(TestTokens(FACTORY.into())));
        let id = |what: &str| format!("{what}-{n}");

        let out = client
            .call(&id("c"), "count", json!({}), None)
            .await
            .unwrap();
        assert!(out["count"].is_number(), "{out}");
        let again = client
            .call(&id("c"), "count", json!({}), None)
            .await
            .unwrap();
        assert_eq!(
            again, out,
            "the same message id is answered from the task store"
        );
        let task = client.get_task(&id("c"), Some(0)).await.unwrap();
        assert_eq!(task.status.state, a2a::TaskState::Completed);
        // A protocol error comes back through the router as over HTTP.
        assert!(matches!(
            client.cancel_task(&id("c")).await.unwrap_err(),
            CallError::Protocol { code: -32002, .. }
        ));
        assert_eq!(
            streamed_kinds(&client, &id("s")).await,
            ["task", "artifact", "status"],
            "{binding:?}"
        );

        // The agent still checks who calls, in process as over HTTP.
        assert!(matches!(
            anonymous.get_task(&id("c"), None).await.unwrap_err(),
            CallError::Http(401)
        ));

        // The time limits hold as over HTTP: a call's, and a stream's over its whole body.
        // Long enough for the card and a stream's first event on a loaded machine; the slow skill waits past both.
        let hasty = in_process(ClientOptions {
            timeout: Duration::from_secs(2),
            stream_timeout: Duration::from_secs(3),
            ..options
        })
        .await
        .with_tokens(Arc::new(TestTokens(FACTORY.into())));
        let slow = hasty.call(&id("slow"), "slow", json!({}), None).await;
        assert!(
            matches!(&slow, Err(CallError::Transport(why)) if why.contains("no answer within")),
            "{slow:?}"
        );
        let mut stream = hasty.subscribe(&id("slow")).await.unwrap();
        let first = stream.next().await.unwrap().unwrap();
        assert!(
            matches!(first, a2a::StreamResponse::Task(ref t) if t.status.state == a2a::TaskState::Working),
            "{first:?}"
        );
        let ended = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("the stream's own deadline ends it");
        assert!(
            matches!(&ended, Some(Err(CallError::Transport(why))) if why.contains("no answer within")),
            "{ended:?}"
        );
        agent.skills.slow_release.notify_one();
    }
    assert_eq!(
        agent.calls(),
        2 * 3,
        "count, streamed count and slow, per binding"
    );

    // A handler that panics fails that call alone, without its message (call errors reach run timelines).
    async fn panics() -> &'static str {
        panic!("secret detail")
    }
    let panicking = axum::Router::new().fallback(panics);
    let failed = A2aClient::in_process(&base, &agent.jwks, ClientOptions::default(), panicking)
        .await
        .unwrap_err();
    assert!(
        matches!(&failed, CallError::Transport(why) if why == "the agent failed"),
        "{failed:?}"
    );
    assert_eq!(
        in_process(ClientOptions::default()).await.card().name,
        "counter"
    );
}

/// The server closes a subscription after `max_follow`; `follow` subscribes again until the task
/// settles.
#[tokio::test]
async fn follow_resubscribes_after_a_dropped_stream() {
    let options = ServerOptions {
        max_follow: Duration::from_millis(60),
        ..fast_polling()
    };
    let agent = start_with(
        Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap()),
        options,
    )
    .await;
    let client = client_on(&agent, Binding::HttpJson).await;
    client.send(request("f-1", "slow", true)).await.unwrap();
    agent.skills.slow_started.notified().await;
    let mut first = client.subscribe("f-1").await.unwrap();
    let mut events = 0;
    while let Some(event) = first.next().await {
        event.unwrap();
        events += 1;
    }
    assert_eq!(events, 1, "the stream closes with the task still working");

    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        agent.skills.slow_release.notify_one();
    };
    let (done, ()) = tokio::join!(client.follow("f-1"), release);
    assert_eq!(done.unwrap().status.state, a2a::TaskState::Completed);
}

/// A webhook receiver on 127.0.0.1: records every POST (path, headers, body) and answers 503 to
/// the first one, so delivery has to retry.
#[derive(Default)]
struct Hooks {
    seen: Mutex<Vec<(String, reqwest::header::HeaderMap, Value)>>,
    arrived: Notify,
}

async fn start_hooks() -> (String, Arc<Hooks>) {
    let hooks = Arc::new(Hooks::default());
    let state = hooks.clone();
    let app = axum::Router::new().fallback(
        move |uri: axum::http::Uri, headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let hooks = state.clone();
            async move {
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let first = {
                    let mut seen = hooks.seen.lock().unwrap();
                    seen.push((uri.path().to_string(), headers, body));
                    seen.len() == 1
                };
                hooks.arrived.notify_one();
                if first {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                } else {
                    axum::http::StatusCode::OK
                }
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, hooks)
}

impl Hooks {
    /// The bodies that reached `path` (after the refused first one), waiting until `pred` holds.
    async fn wait_for(
        &self,
        pred: impl Fn(&[(String, reqwest::header::HeaderMap, Value)]) -> bool,
    ) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if pred(&self.seen.lock().unwrap()) {
                    return;
                }
                self.arrived.notified().await;
            }
        })
        .await
        .expect("webhook deliveries did not arrive");
    }
}

/// Options for webhooks on 127.0.0.1 (the test receiver), retried quickly.
fn push_to_local_hooks() -> ServerOptions {
    ServerOptions {
        push: loams_a2a::PushOptions {
            allow_private_targets: true,
            backoff: Duration::from_millis(20),
            ..loams_a2a::PushOptions::default()
        },
        ..fast_polling()
    }
}

/// A task keeps the expiry it was first stored with, and its push configs carry that one: a repeat of the call by
/// the same subject under a token with more scopes (whose new task would be kept for good) neither makes a reader's
/// task permanent when it takes it over nor gives a config it adds meanwhile a longer life.
#[tokio::test]
async fn a_tasks_expiry_is_the_one_it_was_first_stored_with() {
    let (hook_url, _hooks) = start_hooks().await;
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store.clone(), push_to_local_hooks()).await;
    let reader = scoped_token("user:alice", "acme", &agent.base, "counter:read");
    let writer = scoped_token(
        "user:alice",
        "acme",
        &agent.base,
        "counter:read counter:write",
    );
    let peek = || send_params("m-e", json!({"skill": "peek", "args": {}}));
    let expiry = || stored_expiry(store.as_ref(), "user:alice", "m-e");
    let lease = |until_ms: i64| {
        move |record: &mut Value| {
            record["task"]["status"]["state"] = json!("TASK_STATE_WORKING");
            record["lease_until_ms"] = json!(until_ms);
        }
    };
    let read = agent.rpc_by(&reader, "SendMessage", peek()).await;
    assert_eq!(
        read["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{read}"
    );
    let first = expiry().await;
    assert!(first.is_some());
    let now_ms = SystemClock.now_ms();

    // Being run (its lease is on): a repeat with a webhook adds the config to the stored task, expiring with it.
    rewrite_stored(store.as_ref(), "user:alice", "m-e", lease(now_ms + 60_000)).await;
    let mut with_hook = peek();
    with_hook["configuration"] =
        json!({"taskPushNotificationConfig": {"id": "h", "url": format!("{hook_url}/h")}});
    let running = agent.rpc_by(&writer, "SendMessage", with_hook).await;
    assert_eq!(
        running["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{running}"
    );
    let configs = store
        .list_items("acme", PUSH_KIND, None, Page::first(10))
        .await
        .unwrap()
        .items;
    assert_eq!(configs.len(), 1);
    assert_eq!(configs[0].expires_ms, first);

    // Its run lapsed: the writer's repeat takes it over, and the task still expires when it did.
    rewrite_stored(store.as_ref(), "user:alice", "m-e", lease(now_ms - 1)).await;
    let taken = agent.rpc_by(&writer, "SendMessage", peek()).await;
    assert_eq!(
        taken["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{taken}"
    );
    assert_eq!(
        taken["result"]["task"]["artifacts"][0]["parts"][0]["data"]["run"],
        2
    );
    assert_eq!(expiry().await, first);
}

/// A takeover that finds the stored task gone at its write (it expired in between) stores a new task, with this
/// request's expiry rather than the one of the task that went.
#[tokio::test]
async fn a_takeover_that_finds_the_task_gone_stores_a_new_one() {
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let first = start_with(store.clone(), ServerOptions::default()).await;
    let reader = scoped_token("user:alice", "acme", &first.base, "counter:read");
    let peek = || send_params("m-g", json!({"skill": "peek", "args": {}}));
    let read = first.rpc_by(&reader, "SendMessage", peek()).await;
    assert_eq!(
        read["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{read}"
    );
    rewrite_stored(store.as_ref(), "user:alice", "m-g", |record| {
        record["task"]["status"]["state"] = json!("TASK_STATE_WORKING");
        record["lease_until_ms"] = json!(0);
    })
    .await;

    // The reader's task expires just before the writer's takeover is written.
    let racing = Arc::new(RaceBeforeWrite::new(
        store.clone(),
        TASK_KIND,
        |stored, _| Item {
            expires_ms: Some(1),
            ..stored
        },
    ));
    let agent = start_with(racing.clone(), ServerOptions::default()).await;
    let writer = scoped_token(
        "user:alice",
        "acme",
        &agent.base,
        "counter:read counter:write",
    );
    let taken = agent.rpc_by(&writer, "SendMessage", peek()).await;
    assert!(
        racing.raced(),
        "the repeat must have tried to take the task over"
    );
    assert_eq!(
        taken["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{taken}"
    );
    assert_eq!(
        stored_expiry(store.as_ref(), "user:alice", "m-g").await,
        None,
        "the writer's task is kept"
    );
}

/// The blocking read's answers when its message id is taken: a read being run elsewhere answers as stored, one whose
/// run lapsed is taken over and its webhooks hear the outcome, and a panicking read fails its call alone.
#[tokio::test]
async fn a_blocking_read_over_a_stored_task_answers_or_takes_it_over() {
    let (hook_url, hooks) = start_hooks().await;
    let options = push_to_local_hooks();
    let store = Arc::new(Counting::new(
        Sqlite::memory(Arc::new(SystemClock)).unwrap(),
    ));
    let agent = start_with(store.clone(), options).await;
    let set_lease = |until_ms: i64| {
        move |record: &mut Value| {
            record["task"]["status"]["state"] = json!("TASK_STATE_WORKING");
            record["lease_until_ms"] = json!(until_ms);
        }
    };
    let now_ms = SystemClock.now_ms();
    let run =
        |resp: &Value| resp["result"]["task"]["artifacts"][0]["parts"][0]["data"]["run"].clone();

    let first = agent.send("m-peek", "peek", json!({})).await;
    assert_eq!(run(&first), 1, "{first}");
    assert_eq!(
        store.counts().replayable_puts,
        1,
        "a new read task is replayable"
    );

    // Stored as being run by another request (its lease is on): the answer is that WORKING task.
    rewrite_stored(
        store.as_ref(),
        FACTORY,
        "m-peek",
        set_lease(now_ms + 60_000),
    )
    .await;
    let running = agent.send("m-peek", "peek", json!({})).await;
    let state = &running["result"]["task"]["status"]["state"];
    assert_eq!(state, "TASK_STATE_WORKING", "{running}");

    // Its run lapsed (the process died): this read takes the task over, and the task's webhook hears of it.
    let (status, _, config) = agent
        .rest(
            Method::POST,
            "/tasks/m-peek/pushNotificationConfigs",
            Some(json!({"url": format!("{hook_url}/peek")})),
        )
        .await;
    assert_eq!(status, 200, "{config}");
    rewrite_stored(store.as_ref(), FACTORY, "m-peek", set_lease(now_ms - 1)).await;
    let before = store.counts();
    let taken = agent.send("m-peek", "peek", json!({})).await;
    assert_eq!(run(&taken), 3, "{taken}");
    // The first try (only if absent, replayable) is refused; the takeover replaces a durable record whose webhook
    // hears of it, so it is durable too.
    let takeover = store.counts().since(&before);
    assert_eq!(
        (
            takeover.put_item,
            takeover.conflicts,
            takeover.replayable_puts
        ),
        (2, 1, 1)
    );
    let got = agent.rpc("GetTask", json!({"id": "m-peek"})).await;
    assert_eq!(got["result"]["artifacts"][0]["parts"][0]["data"]["run"], 3);
    hooks
        .wait_for(|seen| {
            seen.iter().any(|(p, _, body)| {
                p == "/peek"
                    && body["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
                    && body["task"]["artifacts"][0]["parts"][0]["data"]["run"] == 3
            })
        })
        .await;

    let exploded = agent.send("m-explode", "explode", json!({})).await;
    assert_error(&exploded, -32603, "");
    assert_eq!(
        exploded["error"]["message"],
        "the skill run ended abnormally: it panicked"
    );
    let after = agent.send("m-after", "peek", json!({})).await;
    assert_eq!(run(&after), 5, "the agent goes on serving");
}

/// With serde_json's `raw_value` on (axum asks for it), a `Value` parse reads the string under the private key
/// `$serde_json::private::RawValue` as JSON again, with a nesting limit of its own: nested, one body could go deep
/// enough to overflow the stack and abort the process. Bodies holding the key, however escaped, are refused unparsed.
#[tokio::test]
async fn serde_json_private_keys_are_refused_before_parsing() {
    let agent = start().await;
    let mut nested = json!(1).to_string();
    for _ in 0..8 {
        nested = json!({"$serde_json::private::RawValue": nested}).to_string();
    }
    let rpc = format!(
        r#"{{"jsonrpc":"2.0","id":3,"method":"SendMessage","params":{{"message":{{"messageId":"m-priv","role":"ROLE_USER","parts":[{{"data":{{"skill":"peek","args":{nested}}}}}]}}}}}}"#
    );
    let resp: Value = agent.rpc_raw(Some("1.0"), rpc).await.json().await.unwrap();
    assert_error(&resp, -32700, "PARSE_ERROR");
    // Sent as written: parsing it into a `Value` here would meet the same key.
    let escaped = r#"{"message":{"messageId":"m-priv-2","role":"ROLE_USER","parts":[{"data":{"skill":"peek","args":{"\u0024serde_json::private::RawValue":"{}"}}}]}}"#;
    let resp = agent
        .http
        .post(format!("{}/message:send", agent.base))
        .header("A2A-Version", "1.0")
        .header("content-type", "application/a2a+json")
        .bearer_auth(token(FACTORY, "acme", &agent.base))
        .body(escaped)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(agent.calls(), 0, "nothing ran");
    // The prefix in values (data, not keys) passes.
    let ok = agent
        .send(
            "m-after-priv",
            "peek",
            json!({"note": "$serde_json::private::RawValue", "tags": ["$serde_json::private::Number"]}),
        )
        .await;
    assert_eq!(
        ok["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{ok}"
    );
}

#[tokio::test]
async fn push_notification_configs_and_delivery() {
    let (hook_url, hooks) = start_hooks().await;
    let options = push_to_local_hooks();
    let agent = start_with(
        Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap()),
        options,
    )
    .await;

    let mut send = rest_send("p-1", "slow", json!({}));
    send["configuration"] = json!({
        "returnImmediately": true,
        "taskPushNotificationConfig": {
            "url": format!("{hook_url}/first"),
            "id": "first",
            "token": "tok",
            "authentication": {"scheme": "Bearer", "credentials": "cred"},
        },
    });
    let (status, _, body) = agent.rest(Method::POST, "/message:send", Some(send)).await;
    assert_eq!(status, 200, "{body}");
    agent.skills.slow_started.notified().await;

    let (status, _, second) = agent
        .rest(
            Method::POST,
            "/tasks/p-1/pushNotificationConfigs",
            Some(json!({"url": format!("{hook_url}/second")})),
        )
        .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["taskId"], "p-1");
    let second_id = second["id"].as_str().unwrap().to_string();
    let (_, _, listed) = agent
        .rest(Method::GET, "/tasks/p-1/pushNotificationConfigs", None)
        .await;
    assert_eq!(listed["configs"].as_array().unwrap().len(), 2, "{listed}");
    let got = agent
        .rpc(
            "GetTaskPushNotificationConfig",
            json!({"taskId": "p-1", "id": "first"}),
        )
        .await;
    assert_eq!(got["result"]["token"], "tok");

    agent.skills.slow_release.notify_one();
    let completed = |path: &str, seen: &[(String, reqwest::header::HeaderMap, Value)]| {
        seen.iter().any(|(p, _, body)| {
            p == path && body["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
        })
    };
    let tasks_at_first = |seen: &[(String, reqwest::header::HeaderMap, Value)]| {
        seen.iter()
            .filter(|(p, _, b)| p == "/first" && b.get("task").is_some())
            .count()
    };
    // The WORKING task is refused once (503) and delivered again; artifact and status follow (the
    // order across separate updates is not guaranteed, a retry may come after a later update).
    hooks
        .wait_for(|seen| {
            completed("/first", seen) && completed("/second", seen) && tasks_at_first(seen) == 2
        })
        .await;

    let seen = hooks.seen.lock().unwrap().clone();
    let first: Vec<&(String, reqwest::header::HeaderMap, Value)> =
        seen.iter().filter(|(p, ..)| p == "/first").collect();
    assert_eq!(first[0].2["task"]["status"]["state"], "TASK_STATE_WORKING");
    assert!(
        first
            .iter()
            .any(|(_, _, b)| b["artifactUpdate"]["artifact"]["parts"][0]["data"]["count"] == 1)
    );
    let headers = &first[0].1;
    assert_eq!(headers["authorization"], "Bearer cred");
    assert_eq!(headers["x-a2a-notification-token"], "tok");
    assert_eq!(headers["a2a-notification-token"], "tok");
    assert_eq!(headers["content-type"], "application/a2a+json");
    // The second webhook was registered while the skill ran: it gets the updates from then on.
    assert!(
        seen.iter()
            .filter(|(p, ..)| p == "/second")
            .all(|(_, h, b)| { b.get("task").is_none() && !h.contains_key("authorization") })
    );

    let deleted = agent
        .rpc(
            "DeleteTaskPushNotificationConfig",
            json!({"taskId": "p-1", "id": second_id}),
        )
        .await;
    assert_eq!(deleted["result"], json!({}));
    let listed = agent
        .rpc("ListTaskPushNotificationConfigs", json!({"taskId": "p-1"}))
        .await;
    assert_eq!(listed["result"]["configs"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn push_configs_belong_to_one_task_of_one_caller() {
    let (hook_url, hooks) = start_hooks().await;
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store, push_to_local_hooks()).await;
    let mallory = token("agent:mallory", "acme", &agent.base);
    let as_mallory = |method: &'static str, params: Value| agent.rpc_by(&mallory, method, params);
    let config = |task: &str, id: &str, path: &str| json!({"taskId": task, "id": id, "url": format!("{hook_url}/{path}")});
    let slow_with = |config: Value| {
        let mut params = send_params("x", json!({"skill": "slow", "args": {}}));
        params["configuration"] =
            json!({"returnImmediately": true, "taskPushNotificationConfig": config});
        params
    };
    // The factory's task "x" and mallory's task "x" run at once, each with a webhook of its own.
    let ours = agent
        .rpc("SendMessage", slow_with(config("x", "d", "factory")))
        .await;
    assert_eq!(
        ours["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{ours}"
    );
    agent.skills.slow_started.notified().await;
    let theirs = as_mallory("SendMessage", slow_with(config("x", "d", "mallory"))).await;
    assert_eq!(
        theirs["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{theirs}"
    );
    agent.skills.slow_started.notified().await;
    // Both complete; each webhook hears of its own task only (the factory's skill ran first, as call 1).
    agent.skills.slow_release.notify_one();
    agent.skills.slow_release.notify_one();
    type Seen = [(String, reqwest::header::HeaderMap, Value)];
    let heard = |seen: &Seen, path: &str| -> (bool, Vec<Value>) {
        let at: Vec<&Value> = seen
            .iter()
            .filter(|(p, ..)| p == path)
            .map(|(_, _, b)| b)
            .collect();
        let completed = at
            .iter()
            .any(|b| b["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED");
        let counts = at
            .iter()
            .filter_map(|b| b.get("artifactUpdate"))
            .map(|a| a["artifact"]["parts"][0]["data"]["count"].clone())
            .collect();
        (completed, counts)
    };
    hooks
        .wait_for(|seen| heard(seen, "/factory").0 && heard(seen, "/mallory").0)
        .await;
    let seen = hooks.seen.lock().unwrap().clone();
    assert_eq!(heard(&seen, "/factory").1, [json!(1)], "{seen:?}");
    assert_eq!(heard(&seen, "/mallory").1, [json!(2)], "{seen:?}");

    // Mallory adds a config to her task "x"; the factory's task "x" keeps its one (listed below).
    let made = as_mallory(
        "CreateTaskPushNotificationConfig",
        config("x", "e", "mallory"),
    )
    .await;
    assert_eq!(made["result"]["id"], "e", "{made}");

    // A task id may hold any character: the configs of task "x" are not those of task "x:y".
    agent.send("x:y", "count", json!({})).await;
    let made = agent
        .rpc(
            "CreateTaskPushNotificationConfig",
            config("x:y", "c", "other"),
        )
        .await;
    assert_eq!(made["result"]["id"], "c", "{made}");
    let list = |task: &str| json!({"taskId": task});
    for (task, id, path) in [("x:y", "c", "other"), ("x", "d", "factory")] {
        let listed = agent
            .rpc("ListTaskPushNotificationConfigs", list(task))
            .await;
        assert_eq!(
            listed["result"]["configs"],
            json!([config(task, id, path)]),
            "{listed}"
        );
    }
    let listed = as_mallory("ListTaskPushNotificationConfigs", list("x")).await;
    assert_eq!(
        listed["result"]["configs"],
        json!([config("x", "d", "mallory"), config("x", "e", "mallory")]),
        "{listed}"
    );
    let none = as_mallory("ListTaskPushNotificationConfigs", list("x:y")).await;
    assert_error(&none, -32001, "TASK_NOT_FOUND");
}

/// A reader's task expires within the hour (see `a_skill_runs_only_for_a_caller_holding_its_scopes`); its push
/// configs, with their webhook credentials, go with it. The factory's are kept, as its tasks are.
#[tokio::test]
async fn a_readers_push_configs_expire_with_its_task() {
    let (hook_url, _hooks) = start_hooks().await;
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store.clone(), push_to_local_hooks()).await;
    let reader = scoped_token("user:alice", "acme", &agent.base, "counter:read");
    let hook = |id: &str| json!({"id": id, "url": format!("{hook_url}/{id}")});
    let with_hook = |message_id: &str, id: &str| {
        let mut params = send_params(message_id, json!({"skill": "measure", "args": {}}));
        params["configuration"] = json!({"taskPushNotificationConfig": hook(id)});
        params
    };
    let sent = agent
        .rpc_by(&reader, "SendMessage", with_hook("m-read", "r1"))
        .await;
    assert_eq!(
        sent["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{sent}"
    );
    let mut second = hook("r2");
    second["taskId"] = json!("m-read");
    let made = agent
        .rpc_by(&reader, "CreateTaskPushNotificationConfig", second)
        .await;
    assert_eq!(made["result"]["id"], "r2", "{made}");
    let kept = agent.rpc("SendMessage", with_hook("m-kept", "f1")).await;
    assert_eq!(
        kept["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{kept}"
    );

    let expiry =
        |subject: &'static str, id: &'static str| stored_expiry(store.as_ref(), subject, id);
    let reader_task = expiry("user:alice", "m-read").await;
    assert!(reader_task.is_some());
    assert_eq!(expiry(FACTORY, "m-kept").await, None);
    let configs = store
        .list_items("acme", PUSH_KIND, None, Page::first(10))
        .await
        .unwrap()
        .items;
    let mut expiries: Vec<(String, Option<i64>)> = configs
        .iter()
        .map(|c| {
            let body: Value = serde_json::from_slice(&c.body).unwrap();
            (body["id"].as_str().unwrap().to_string(), c.expires_ms)
        })
        .collect();
    expiries.sort();
    assert_eq!(
        expiries,
        [
            ("f1".to_string(), None),
            ("r1".to_string(), reader_task),
            ("r2".to_string(), reader_task)
        ]
    );
}

fn text_message(message_id: &str, task_id: Option<&str>) -> Value {
    let mut m = json!({"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": "hi"}]});
    if let Some(t) = task_id {
        m["taskId"] = json!(t);
    }
    json!({"message": m})
}

#[tokio::test]
async fn conformance_mode_is_off_by_default() {
    let agent = start().await;
    // A TCK message id is an ordinary message: without a skill call it is refused, nothing runs.
    let resp = agent
        .rpc("SendMessage", text_message("tck-complete-task-1", None))
        .await;
    assert_error(&resp, -32602, "INVALID_PARAMS");
    assert_eq!(agent.calls(), 0);
}

/// Scripted tasks follow the retention rule of every task: a reader's goes within the hour, and continuing it
/// keeps its expiry.
#[tokio::test]
async fn conformance_mode_keeps_a_readers_task_for_the_hour_only() {
    let options = ServerOptions {
        conformance: true,
        ..fast_polling()
    };
    let store: Arc<dyn Store> = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let agent = start_with(store.clone(), options).await;
    let reader = scoped_token("user:alice", "acme", &agent.base, "counter:read");
    let waiting = agent
        .rpc_by(
            &reader,
            "SendMessage",
            text_message("tck-input-required-r", None),
        )
        .await;
    let state = &waiting["result"]["task"]["status"]["state"];
    assert_eq!(state, "TASK_STATE_INPUT_REQUIRED", "{waiting}");
    let task_id = waiting["result"]["task"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let expiry = || stored_expiry(store.as_ref(), "user:alice", &task_id);
    let first = expiry().await;
    let now = SystemClock.now_ms();
    assert!(
        first.is_some_and(|e| e > now && e <= now + 3_600_000),
        "{first:?}"
    );
    let done = agent
        .rpc_by(
            &reader,
            "SendMessage",
            text_message("tck-complete-r", Some(&task_id)),
        )
        .await;
    let state = &done["result"]["task"]["status"]["state"];
    assert_eq!(state, "TASK_STATE_COMPLETED", "{done}");
    assert_eq!(expiry().await, first);
}

#[tokio::test]
async fn conformance_mode_plays_the_tck_scenarios() {
    let options = ServerOptions {
        conformance: true,
        ..fast_polling()
    };
    let agent = start_with(
        Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap()),
        options,
    )
    .await;
    // The TCK reuses message ids: each send is a new task with a server-made id.
    let a = agent
        .rpc("SendMessage", text_message("tck-complete-task-s", None))
        .await;
    let b = agent
        .rpc("SendMessage", text_message("tck-complete-task-s", None))
        .await;
    assert_eq!(
        a["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(
        a["result"]["task"]["status"]["message"]["parts"][0]["text"],
        "Hello from TCK"
    );
    assert_ne!(a["result"]["task"]["id"], b["result"]["task"]["id"]);
    assert_ne!(a["result"]["task"]["id"], "tck-complete-task-s");

    let reply = agent
        .rpc("SendMessage", text_message("tck-message-response-s", None))
        .await;
    assert_eq!(reply["result"]["message"]["role"], "ROLE_AGENT");
    assert!(reply["result"].get("task").is_none(), "{reply}");

    let data = agent
        .rpc("SendMessage", text_message("tck-artifact-data-s", None))
        .await;
    assert_eq!(
        data["result"]["task"]["artifacts"][0]["parts"][0]["data"]["count"],
        42
    );

    // INPUT_REQUIRED, then continued by taskId (given with proto field names) to COMPLETED; a
    // subscriber to the interrupted task sees it through to the end.
    let waiting = agent
        .rpc("SendMessage", text_message("tck-input-required-s", None))
        .await;
    assert_eq!(
        waiting["result"]["task"]["status"]["state"],
        "TASK_STATE_INPUT_REQUIRED"
    );
    let task_id = waiting["result"]["task"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The answer's headers come once the subscription has read the waiting task; only its body is left to read.
    let subscribed = agent
        .http
        .get(format!("{}/tasks/{task_id}:subscribe", agent.base))
        .header("A2A-Version", "1.0")
        .bearer_auth(token(FACTORY, "acme", &agent.base))
        .send()
        .await
        .unwrap();
    let subscription = tokio::spawn(async move { subscribed.text().await.unwrap() });
    let done = agent
        .rpc(
            "SendMessage",
            json!({"message": {"message_id": "tck-complete-task-s", "role": "ROLE_USER",
                "parts": [{"text": "go on"}], "task_id": task_id}}),
        )
        .await;
    assert_eq!(
        done["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
    assert_eq!(
        done["result"]["task"]["history"].as_array().unwrap().len(),
        2
    );
    let events = tokio::time::timeout(Duration::from_secs(5), subscription)
        .await
        .unwrap()
        .unwrap();
    let last = events.lines().rfind(|l| l.starts_with("data:")).unwrap();
    assert!(last.contains("TASK_STATE_COMPLETED"), "{events}");

    // A finished task takes no more messages; an unknown one is TaskNotFound.
    let again = agent
        .rpc(
            "SendMessage",
            text_message("tck-complete-task-s", Some(&task_id)),
        )
        .await;
    assert_error(&again, -32004, "UNSUPPORTED_OPERATION");
    let unknown = agent
        .rpc(
            "SendMessage",
            text_message("tck-complete-task-s", Some("nope")),
        )
        .await;
    assert_error(&unknown, -32001, "TASK_NOT_FOUND");
    // Skill calls are unchanged.
    let call = agent.send("c-1", "count", json!({})).await;
    assert_eq!(call["result"]["task"]["id"], "c-1");
    assert_eq!(agent.calls(), 1);
}
