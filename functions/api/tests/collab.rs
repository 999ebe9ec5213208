//! CollabService against real A2A agents whose registration is wrong: an agent whose card names another agent, or
//! one whose card sends calls to another address than the one configured, gets no panel token and shows no address.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use loams_a2a::{
    AgentSpec, AppLinks, CardSigner, Guards, Jwks, Risk, SkillError, SkillSpec, Skills,
};
use loams_api::{
    AgentAuth, AgentLink, ApiConfig, ApiError, ApiState, ApprovalBroker, Collab, Issuer,
    RegisteredApp, RunOpener, router,
};
use loams_factory::Signal;
use loams_platform::{Clock, Sqlite, Store, SystemClock};
use loams_proto::collab::v1 as pc;
use loams_proto::connect::{Code, ConnectClient};
use serde_json::{Value, json};

const RUN: &str = "r-0123456789abcdef";
const WEB: &str = "http://127.0.0.1:9";

/// An agent named `name`, counting the skills it runs.
struct Forge {
    name: &'static str,
    calls: AtomicUsize,
}

#[async_trait]
impl Skills for Forge {
    fn card(&self) -> AgentSpec {
        AgentSpec {
            name: self.name.into(),
            description: "forge".into(),
            version: "1.0.0".into(),
            app: Some(AppLinks {
                web_url: WEB.into(),
                deep_link_templates: [(
                    "pull_request".to_string(),
                    format!("{WEB}/o/r/pulls/{{number}}"),
                )]
                .into(),
            }),
            // Every skill the panel reads below call: only the registry's checks can stop a read.
            skills: ["get_pr", "get_issue"]
                .map(|id| SkillSpec {
                    id: id.into(),
                    name: id.into(),
                    description: id.into(),
                    risk: Risk::Read,
                    tags: vec![],
                    examples: vec![],
                })
                .into(),
        }
    }

    async fn invoke(&self, _skill: &str, args: Value) -> Result<Value, SkillError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(
            json!({"number": args["number"], "title": "Fix", "state": "open", "url": format!("{WEB}/o/r/pulls/7"),
                  "head_branch": "factory/x", "head_sha": "abc", "base_branch": "main"}),
        )
    }
}

struct NoRuns;

#[async_trait]
impl RunOpener for NoRuns {
    async fn open(&self, _: &str, _: &str, _: Signal) -> Result<String, ApiError> {
        Err(ApiError::Unavailable("not in this test".into()))
    }
}

/// Serves `router` on a port of its own until the test ends; its address.
async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

#[tokio::test]
async fn an_agent_registered_under_another_name_or_address_gets_no_panel_read() {
    let db = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let worker = Issuer::generate("loams-agent-tokens", "loams-agent-tokens").unwrap();
    let panels = Issuer::generate("loams-panel-tokens", "loams-panel-tokens").unwrap();

    // Two agents, a forgejo and a glitchtip, each card naming its own URL on 127.0.0.1.
    let signer = CardSigner::generate().unwrap();
    let trusted: Jwks = signer.jwks().unwrap();
    let key = signer.to_pkcs8().unwrap();
    let mut agents = Vec::new();
    for name in ["forgejo", "glitchtip"] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{port}");
        let skills = Arc::new(Forge {
            name,
            calls: AtomicUsize::new(0),
        });
        let guards = Guards {
            auth: Arc::new(AgentAuth::new(worker.verifier()).with_panels(panels.verifier())),
            gate: Arc::new(ApprovalBroker::new(db.clone(), Arc::new(SystemClock))),
        };
        let signer = CardSigner::from_pkcs8(&key).unwrap();
        let agent = loams_a2a::router(
            skills.clone(),
            db.clone(),
            "acme".into(),
            signer,
            url.clone(),
            guards,
        );
        tokio::spawn(async move { axum::serve(listener, agent).await.unwrap() });
        agents.push((skills, url, port));
    }
    let [(forge, forge_url, _), (glitchtip, _, glitchtip_port)] = &agents[..] else {
        unreachable!()
    };

    // Registered rightly: forgejo. Under another name: plane, at the forgejo agent (its card says forgejo). At
    // another address: glitchtip, rightly named, registered as localhost while its card sends calls to 127.0.0.1.
    let link = |url: &str| Some(AgentLink::new(url, trusted.clone()));
    let registry = vec![
        RegisteredApp {
            id: "forgejo".into(),
            agent: link(forge_url),
        },
        RegisteredApp {
            id: "plane".into(),
            agent: link(forge_url),
        },
        RegisteredApp {
            id: "glitchtip".into(),
            agent: link(&format!("http://localhost:{glitchtip_port}")),
        },
    ];
    let people = Issuer::generate("https://loams.test", "loams-api").unwrap();
    let state = ApiState {
        store: db.clone(),
        queue: db.clone(),
        verifier: people.verifier(),
        clock: Arc::new(SystemClock),
        config: Arc::new(ApiConfig::default()),
        opener: Arc::new(NoRuns),
        jwks: None,
        collab: Arc::new(Collab::new("acme", "prod", registry, panels)),
    };
    let api = serve(router(state)).await;

    // A run that made issue, PR and was opened by GlitchTip issue 42.
    let signal = Signal {
        source: "glitchtip".into(),
        fingerprint: "glitchtip:42".into(),
        title: "boom".into(),
        link: "https://gt.example/a/issues/42".into(),
        glitchtip_issue_id: Some("42".into()),
        severity: "error".into(),
        generation: 1,
        parent_run: None,
    };
    let now = SystemClock.now_ms();
    let (mut run, opened) =
        loams_factory::open(signal, &loams_factory::Ctx::new("acme", "prod", now)).unwrap();
    run.id = RUN.into();
    run.links.issue_id = Some("5f0c".into());
    run.links.pr_number = Some(7);
    let snapshot = serde_json::to_vec(&run).unwrap();
    let event = serde_json::to_vec(&opened).unwrap();
    assert!(
        db.create_run("acme", RUN, "running", &snapshot, &event, now)
            .await
            .unwrap()
    );

    let token = people
        .issue(
            "oncall",
            "acme",
            loams_api::scope::ALL,
            now as u64 / 1000,
            600,
        )
        .unwrap();
    let phone = ConnectClient::new(&api)
        .with_header("authorization", format!("Bearer {token}"))
        .unwrap();
    let path = |m: &str| format!("/loams.collab.v1.CollabService/{m}");

    // The registry shows addresses for the rightly registered agent only.
    let apps: pc::ListAppsResponse = phone
        .unary(&path("ListApps"), &pc::ListAppsRequest {})
        .await
        .unwrap();
    let shown: Vec<(&str, &str, usize)> = apps
        .apps
        .iter()
        .map(|a| {
            (
                a.id.as_str(),
                a.base_url.as_str(),
                a.deep_link_templates.len(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [("forgejo", WEB, 1), ("plane", "", 0), ("glitchtip", "", 0)]
    );

    // The rightly registered agent answers; the others are refused before any token is sent, naming nothing.
    let pr: pc::PullRequest = phone
        .unary(
            &path("GetPullRequest"),
            &pc::GetPullRequestRequest { run_id: RUN.into() },
        )
        .await
        .unwrap();
    assert_eq!(
        (pr.number, pr.url.as_str()),
        (7, "http://127.0.0.1:9/o/r/pulls/7")
    );
    assert_eq!(forge.calls.load(Ordering::SeqCst), 1);
    let wrong_name = phone
        .unary::<_, pc::Issue>(
            &path("GetIssue"),
            &pc::GetIssueRequest { run_id: RUN.into() },
        )
        .await
        .unwrap_err();
    let wrong_address = phone
        .unary::<_, pc::ErrorIssue>(
            &path("GetErrorIssue"),
            &pc::GetErrorIssueRequest { run_id: RUN.into() },
        )
        .await
        .unwrap_err();
    for refused in [wrong_name, wrong_address] {
        assert_eq!(refused.code, Code::Internal, "{refused:?}");
        assert_eq!(refused.message, "internal error");
    }
    assert_eq!(
        forge.calls.load(Ordering::SeqCst),
        1,
        "no read reached the agent"
    );
    assert_eq!(
        glitchtip.calls.load(Ordering::SeqCst),
        0,
        "no read reached the agent"
    );
    let tasks = db.list_items(
        "acme",
        loams_a2a::TASK_KIND,
        None,
        loams_platform::Page {
            cursor: None,
            limit: 10,
        },
    );
    assert_eq!(
        tasks.await.unwrap().items.len(),
        1,
        "only the one read left a task"
    );
}
