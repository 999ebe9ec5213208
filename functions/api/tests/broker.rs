//! The credential broker: agent tokens (minting and verification against an agent's URL) and the
//! approval gate over real approval records in the SQLite store, alone and behind a real A2A agent.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use loams_a2a::{
    A2aClient, AgentSpec, ApprovalGate, AuthError, CallError, CallerAuth, CardSigner, GateError,
    Guards, Risk, SkillError, SkillSpec, Skills, TokenSource,
};
use loams_api::broker::MAX_AGENT_TOKEN_TTL_S;
use loams_api::{AGENT_SUBJECT, AgentAuth, AgentTokens, ApprovalBroker, Issuer};
use loams_factory::action_hash;
use loams_factory::approval::{APPROVAL_TTL_MS, Approval, ApprovalAction, ApprovalState};
use loams_platform::{Cond, Item, ManualClock, Sqlite, Store};
use serde_json::{Value, json};

const AGENT_URL: &str = "http://127.0.0.1:4711";
const NOW: i64 = 1_800_000_000_000;

fn issuer() -> Issuer {
    Issuer::generate("loams-dev", "loams-api").unwrap()
}

fn now_s() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

#[tokio::test]
async fn agent_tokens_verify_for_their_agent_only() {
    let issuer = issuer();
    let auth = AgentAuth::new(issuer.verifier());
    let token = AgentTokens::new(issuer.clone(), "acme")
        .token(AGENT_URL, "plane")
        .await
        .unwrap();

    let principal = auth.verify(Some(&token), AGENT_URL).await.unwrap();
    assert_eq!(principal.subject, AGENT_SUBJECT);
    assert_eq!(principal.org, "acme");
    // The factory holds every scope of the agent it calls, and nothing of another.
    assert_eq!(
        principal.scopes,
        ["plane:read", "plane:write", "plane:destructive"]
    );

    assert_eq!(auth.verify(None, AGENT_URL).await, Err(AuthError::Missing));
    // Minted for another agent, or a user's API token: wrong audience.
    assert_eq!(
        auth.verify(Some(&token), "http://127.0.0.1:4712").await,
        Err(AuthError::Invalid)
    );
    let user = issuer.issue("alice", "acme", "runs", now_s(), 600).unwrap();
    assert_eq!(
        auth.verify(Some(&user), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    // A token of this issuer for this very agent, but not the factory's: only the factory calls agents.
    let someone = issuer
        .issue_for(AGENT_URL, "alice", "acme", "a2a", now_s(), 300)
        .unwrap();
    assert_eq!(
        auth.verify(Some(&someone), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    // Another key, an expired token, a token living longer than an agent token may, garbage.
    let stranger = Issuer::generate("loams-dev", "loams-api").unwrap();
    let forged = stranger
        .issue_for(AGENT_URL, AGENT_SUBJECT, "acme", "a2a", now_s(), 300)
        .unwrap();
    assert_eq!(
        auth.verify(Some(&forged), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    // Dated an hour ahead: within the lifetime limit on paper, alive for an hour longer in fact.
    let ahead = issuer
        .issue_for(AGENT_URL, AGENT_SUBJECT, "acme", "a2a", now_s() + 3600, 300)
        .unwrap();
    assert_eq!(
        auth.verify(Some(&ahead), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    let expired = issuer
        .issue_for(AGENT_URL, AGENT_SUBJECT, "acme", "a2a", now_s() - 3600, 300)
        .unwrap();
    assert_eq!(
        auth.verify(Some(&expired), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    let long = issuer
        .issue_for(
            AGENT_URL,
            AGENT_SUBJECT,
            "acme",
            "a2a",
            now_s(),
            MAX_AGENT_TOKEN_TTL_S + 1,
        )
        .unwrap();
    assert_eq!(
        auth.verify(Some(&long), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    // The same key under another issuer name.
    let pkcs8 = Issuer::generate_pkcs8().unwrap();
    let ours = Issuer::from_pkcs8(&pkcs8, "loams-dev", "loams-api").unwrap();
    let evil = Issuer::from_pkcs8(&pkcs8, "evil", "loams-api").unwrap();
    let wrong_iss = evil
        .issue_for(AGENT_URL, AGENT_SUBJECT, "acme", "a2a", now_s(), 300)
        .unwrap();
    let ours_auth = AgentAuth::new(ours.verifier());
    assert_eq!(
        ours_auth.verify(Some(&wrong_iss), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
    let right_iss = ours
        .issue_for(AGENT_URL, AGENT_SUBJECT, "acme", "a2a", now_s(), 300)
        .unwrap();
    assert!(ours_auth.verify(Some(&right_iss), AGENT_URL).await.is_ok());
    assert_eq!(
        auth.verify(Some("not.a.jwt"), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
}

#[tokio::test]
async fn panel_reads_verify_for_people_with_read_scopes_only() {
    let factory = issuer();
    let panels = Issuer::generate("loams-panel-tokens", "loams-panel-tokens").unwrap();
    let auth = AgentAuth::new(factory.verifier()).with_panels(panels.verifier());
    let alice = loams_api::Caller {
        user: "alice".into(),
        org: "acme".into(),
        scopes: vec!["plane:read".into(), "runs:read".into()],
    };
    let token = loams_api::broker::on_behalf_token(&panels, AGENT_URL, "plane", &alice).unwrap();
    let principal = auth.verify(Some(&token), AGENT_URL).await.unwrap();
    assert_eq!(
        (principal.subject.as_str(), principal.org.as_str()),
        ("user:alice", "acme")
    );
    // Only the agent's read scope travels, whatever else the person holds.
    assert_eq!(principal.scopes, ["plane:read"]);
    // For its agent only.
    assert_eq!(
        auth.verify(Some(&token), "http://127.0.0.1:4712").await,
        Err(AuthError::Invalid)
    );
    // Without panels configured the agent takes no person's token.
    assert_eq!(
        AgentAuth::new(factory.verifier())
            .verify(Some(&token), AGENT_URL)
            .await,
        Err(AuthError::Invalid)
    );
    // The panel key cannot mint the factory, nor a person with more than reads.
    for (sub, scope, ttl) in [
        (AGENT_SUBJECT, "plane:read", 60),
        ("user:alice", "plane:read plane:write", 60),
        ("alice", "plane:read", 60),
        // A read takes seconds: a panel token living for minutes was not minted for one.
        ("user:alice", "plane:read", 600),
    ] {
        let forged = panels
            .issue_for(AGENT_URL, sub, "acme", scope, now_s(), ttl)
            .unwrap();
        assert_eq!(
            auth.verify(Some(&forged), AGENT_URL).await,
            Err(AuthError::Invalid),
            "{sub} {scope}"
        );
    }
    // Nor can the factory's key mint a person.
    let person = factory
        .issue_for(AGENT_URL, "user:alice", "acme", "plane:read", now_s(), 60)
        .unwrap();
    assert_eq!(
        auth.verify(Some(&person), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
}

#[tokio::test]
async fn agent_tokens_are_reused_per_agent_and_remembered_only_verbatim() {
    let issuer = issuer();
    let tokens = AgentTokens::new(issuer.clone(), "acme");
    let first = tokens.token(AGENT_URL, "plane").await.unwrap();
    assert_eq!(tokens.token(AGENT_URL, "plane").await.unwrap(), first);
    let other_agent = "http://127.0.0.1:4712";
    assert_ne!(tokens.token(other_agent, "forgejo").await.unwrap(), first);

    let auth = AgentAuth::new(issuer.verifier());
    assert!(auth.verify(Some(&first), AGENT_URL).await.is_ok());
    assert!(auth.verify(Some(&first), AGENT_URL).await.is_ok());
    // Remembered for its own agent only, and only as the exact string that was verified.
    assert_eq!(
        auth.verify(Some(&first), other_agent).await,
        Err(AuthError::Invalid)
    );
    // A character inside the signature (the last one carries padding bits only).
    let at = first.len() - 10;
    let flipped = if &first[at..=at] == "A" { "B" } else { "A" };
    let tampered = format!("{}{flipped}{}", &first[..at], &first[at + 1..]);
    assert_eq!(
        auth.verify(Some(&tampered), AGENT_URL).await,
        Err(AuthError::Invalid)
    );
}

fn merge_args() -> Value {
    json!({"number": 7, "head_sha": "abc123"})
}

/// An approval record as the worker stores it: the engine's action for a merge (target commit with
/// the run's patch binding) and its hash.
fn approval(id: &str, skill: &str, args: Value, state: ApprovalState) -> Approval {
    let action = ApprovalAction {
        agent: "forgejo".into(),
        skill: skill.into(),
        target_commit: (skill == "merge").then(|| "abc123; patch 0123456789ab: app.py".into()),
        args,
    };
    Approval {
        id: id.into(),
        org: "acme".into(),
        run_id: "r-0123456789abcdef".into(),
        action_hash: action_hash(&action),
        action,
        summary: format!("{skill} PR #7"),
        risk: "destructive".into(),
        requester: "agent:loams-bot".into(),
        on_behalf_of: Some("oncall".into()),
        confirmation_phrase: Some(format!("{skill} #7")),
        state,
        expires_at_ms: NOW + APPROVAL_TTL_MS,
        created_at_ms: NOW - 1000,
        decision: None,
    }
}

async fn put(store: &dyn Store, a: &Approval) {
    let item = Item {
        org: a.org.clone(),
        kind: "approval".into(),
        id: a.id.clone(),
        version: 0,
        index: None,
        body: serde_json::to_vec(a).unwrap(),
        expires_ms: None,
    };
    store.put_item(&item, Cond::Any).await.unwrap();
}

struct Records {
    store: Arc<Sqlite>,
    clock: Arc<ManualClock>,
    gate: ApprovalBroker,
}

async fn records() -> Records {
    let clock = Arc::new(ManualClock::new(NOW));
    let store = Arc::new(Sqlite::memory(clock.clone()).unwrap());
    let gate = ApprovalBroker::new(store.clone(), clock.clone());
    put(
        store.as_ref(),
        &approval("ap-merge", "merge", merge_args(), ApprovalState::Approved),
    )
    .await;
    put(
        store.as_ref(),
        &approval("ap-pending", "merge", merge_args(), ApprovalState::Pending),
    )
    .await;
    put(
        store.as_ref(),
        &approval("ap-denied", "merge", merge_args(), ApprovalState::Denied),
    )
    .await;
    put(
        store.as_ref(),
        &approval(
            "ap-close",
            "close_pr",
            json!({"number": 7, "branch": "factory/r-1"}),
            ApprovalState::Approved,
        ),
    )
    .await;
    Records { store, clock, gate }
}

fn refused(r: Result<(), GateError>, why: &str) {
    match r {
        Err(GateError::Refused(m)) => assert!(m.contains(why), "{m:?} should say {why:?}"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    }
}

#[tokio::test]
async fn the_gate_admits_exactly_the_approved_call() {
    let r = records().await;
    let g = &r.gate;
    g.admit("acme", "forgejo", "merge", &merge_args(), "ap-merge")
        .await
        .unwrap();
    // The same args in another key order are the same call.
    g.admit(
        "acme",
        "forgejo",
        "merge",
        &json!({"head_sha": "abc123", "number": 7}),
        "ap-merge",
    )
    .await
    .unwrap();
    let close = json!({"number": 7, "branch": "factory/r-1"});
    g.admit("acme", "forgejo", "close_pr", &close, "ap-close")
        .await
        .unwrap();

    refused(
        g.admit(
            "acme",
            "forgejo",
            "merge",
            &json!({"number": 8, "head_sha": "abc123"}),
            "ap-merge",
        )
        .await,
        "hash",
    );
    refused(
        g.admit(
            "acme",
            "forgejo",
            "merge",
            &json!({"number": 7, "head_sha": "evil"}),
            "ap-merge",
        )
        .await,
        "hash",
    );
    refused(
        g.admit("acme", "forgejo", "close_pr", &merge_args(), "ap-merge")
            .await,
        "forgejo.merge",
    );
    refused(
        g.admit("acme", "forgejo", "revert", &close, "ap-close")
            .await,
        "forgejo.close_pr",
    );
    refused(
        g.admit("acme", "plane", "merge", &merge_args(), "ap-merge")
            .await,
        "forgejo.merge",
    );
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "ap-pending")
            .await,
        "pending",
    );
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "ap-denied")
            .await,
        "denied",
    );
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "ap-nope")
            .await,
        "no such approval",
    );
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "").await,
        "malformed",
    );
    // Records are per organisation: another org's agent finds nothing.
    refused(
        g.admit("globex", "forgejo", "merge", &merge_args(), "ap-merge")
            .await,
        "no such approval",
    );

    // A tampered record (action changed after hashing) admits neither the shown nor the hashed call.
    let mut tampered = approval(
        "ap-tampered",
        "merge",
        merge_args(),
        ApprovalState::Approved,
    );
    tampered.action.args = json!({"number": 9, "head_sha": "abc123"});
    put(r.store.as_ref(), &tampered).await;
    refused(
        g.admit(
            "acme",
            "forgejo",
            "merge",
            &tampered.action.args,
            "ap-tampered",
        )
        .await,
        "hash",
    );

    // Past its expiry a pending approval reads as expired, and an approved one releases nothing more.
    r.clock.advance(APPROVAL_TTL_MS as u64);
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "ap-pending")
            .await,
        "expired",
    );
    refused(
        g.admit("acme", "forgejo", "merge", &merge_args(), "ap-merge")
            .await,
        "expired",
    );
}

/// A forgejo stand-in counting the app calls it makes.
#[derive(Default)]
struct Forge {
    calls: AtomicUsize,
}

#[async_trait]
impl Skills for Forge {
    fn card(&self) -> AgentSpec {
        let skill = |id: &str, risk| SkillSpec {
            id: id.into(),
            name: id.into(),
            description: id.into(),
            risk,
            tags: vec![],
            examples: vec![],
        };
        AgentSpec {
            name: "forgejo".into(),
            description: "forge".into(),
            version: "1.0.0".into(),
            app: None,
            skills: vec![
                skill("merge", Risk::Destructive),
                skill("ci_status", Risk::Read),
            ],
        }
    }

    async fn invoke(&self, skill: &str, _args: Value) -> Result<Value, SkillError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(json!({"ran": skill}))
    }
}

#[tokio::test]
async fn an_agent_behind_the_broker_merges_only_with_token_and_approval() {
    let r = records().await;
    let issuer = issuer();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let signer = CardSigner::generate().unwrap();
    let jwks = signer.jwks().unwrap();
    let forge = Arc::new(Forge::default());
    let guards = Guards {
        auth: Arc::new(AgentAuth::new(issuer.verifier())),
        gate: Arc::new(ApprovalBroker::new(r.store.clone(), r.clock.clone())),
    };
    let app = loams_a2a::router(
        forge.clone(),
        r.store.clone(),
        "acme".into(),
        signer,
        base.clone(),
        guards,
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let anonymous = A2aClient::new(&base, &jwks).await.unwrap();
    let err = anonymous
        .call("s-1", "merge", merge_args(), Some("ap-merge"))
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::Http(401)), "{err}");
    // A token of another organisation is refused as well.
    let globex = A2aClient::new(&base, &jwks)
        .await
        .unwrap()
        .with_tokens(Arc::new(AgentTokens::new(issuer.clone(), "globex")));
    let err = globex
        .call("s-1", "merge", merge_args(), Some("ap-merge"))
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::Http(401)), "{err}");

    let client = A2aClient::new(&base, &jwks)
        .await
        .unwrap()
        .with_tokens(Arc::new(AgentTokens::new(issuer.clone(), "acme")));
    assert_eq!(
        client
            .call("s-read", "ci_status", json!({"sha": "abc"}), None)
            .await
            .unwrap(),
        json!({"ran": "ci_status"})
    );
    for (step, approval) in [
        ("s-2", None),
        ("s-3", Some("ap-pending")),
        ("s-4", Some("ap-close")),
    ] {
        match client
            .call(step, "merge", merge_args(), approval)
            .await
            .unwrap_err()
        {
            CallError::Skill { retryable, .. } => assert!(!retryable),
            other => panic!("{other}"),
        }
    }
    assert_eq!(
        forge.calls.load(Ordering::SeqCst),
        1,
        "no merge reached the app"
    );

    assert_eq!(
        client
            .call("s-5", "merge", merge_args(), Some("ap-merge"))
            .await
            .unwrap(),
        json!({"ran": "merge"})
    );
    assert_eq!(forge.calls.load(Ordering::SeqCst), 2);
    // The step id cannot be reused for other args (a planted result), nor replayed into a second merge.
    let err = client
        .call(
            "s-5",
            "merge",
            json!({"number": 8, "head_sha": "abc123"}),
            Some("ap-merge"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, CallError::Protocol { code: -32602, .. }),
        "{err}"
    );
    client
        .call("s-5", "merge", merge_args(), Some("ap-merge"))
        .await
        .unwrap();
    assert_eq!(forge.calls.load(Ordering::SeqCst), 2);
}
