//! The five real agents' served cards (issue point 8): every skill with a description, examples,
//! exactly one risk tag and the security requirement its risk calls for; each agent with its own
//! principal; the card signed.

use std::sync::Arc;

use async_trait::async_trait;
use loams_a2a::{
    ApprovalGate, AuthError, BEARER_SCHEME, CallerAuth, CardSigner, GateError, Guards,
    PRINCIPAL_EXTENSION, Principal, Risk, Skills, agent_principal, router, verify_card,
};
use loams_agents::*;
use loams_platform::{Sqlite, SystemClock};
use serde_json::Value;

struct Nobody;

#[async_trait]
impl CallerAuth for Nobody {
    async fn verify(&self, _: Option<&str>, _: &str) -> Result<Principal, AuthError> {
        Err(AuthError::Invalid)
    }
}

#[async_trait]
impl ApprovalGate for Nobody {
    async fn admit(&self, _: &str, _: &str, _: &str, _: &Value, _: &str) -> Result<(), GateError> {
        Err(GateError::Refused("none".into()))
    }
}

const APP: &str = "http://127.0.0.1:9";

fn agents() -> Vec<Arc<dyn Skills>> {
    vec![
        Arc::new(ZulipAgent::new(&ZulipConfig::new(APP, "bot@x", "k")).unwrap()),
        Arc::new(PlaneAgent::new(&PlaneConfig::new(APP, "k", "ws", "p")).unwrap()),
        Arc::new(ForgejoAgent::new(&ForgejoConfig::new(APP, "t", "o", "r")).unwrap()),
        Arc::new(GlitchTipAgent::new(&GlitchTipConfig::new(APP, "t", "o")).unwrap()),
        Arc::new(AnalyticsAgent::new(&AnalyticsConfig::new(APP, "id", "s", "p")).unwrap()),
    ]
}

/// Serves `skills` and returns its card as a client reads it, checked against the signing key.
async fn served_card(skills: Arc<dyn Skills>) -> a2a::AgentCard {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let signer = CardSigner::generate().unwrap();
    let jwks = signer.jwks().unwrap();
    let store = Arc::new(Sqlite::memory(Arc::new(SystemClock)).unwrap());
    let guards = Guards {
        auth: Arc::new(Nobody),
        gate: Arc::new(Nobody),
    };
    let app = router(skills, store, "acme".into(), signer, base.clone(), guards);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let card: a2a::AgentCard = reqwest::get(format!("{base}/.well-known/agent-card.json"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    verify_card(&card, &jwks).unwrap();
    card
}

#[tokio::test]
async fn every_agent_card_lists_its_skills_with_risk_scopes_and_its_own_principal() {
    let mut principals = Vec::new();
    for skills in agents() {
        let spec = skills.card();
        let card = served_card(skills).await;
        let name = card.name.clone();
        assert_eq!(name, spec.name);
        assert!(!card.description.is_empty(), "{name}");
        // The full skill set, in the agent's order.
        let ids: Vec<&str> = card.skills.iter().map(|s| s.id.as_str()).collect();
        let want: Vec<&str> = spec.skills.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, want, "{name}");
        for (skill, s) in card.skills.iter().zip(&spec.skills) {
            let at = format!("{name}.{}", skill.id);
            assert!(!skill.description.is_empty(), "{at}");
            assert!(
                !skill.examples.as_deref().unwrap_or_default().is_empty(),
                "{at}"
            );
            let risks: Vec<&String> = skill
                .tags
                .iter()
                .filter(|t| t.starts_with("risk:"))
                .collect();
            assert_eq!(risks, vec![s.risk.tag()], "{at}");
            let needs = skill.security_requirements.as_ref().expect(&at);
            assert_eq!(needs.len(), 1, "{at}");
            let scopes = &needs[0][BEARER_SCHEME];
            let expected: Vec<String> = match s.risk {
                Risk::Read => vec![format!("{name}:read")],
                Risk::Write => vec![format!("{name}:write")],
                Risk::Destructive => vec![format!("{name}:write"), format!("{name}:destructive")],
            };
            assert_eq!(scopes, &expected, "{at}");
        }
        // Calling the agent at all needs its read scope, under the card's bearer scheme.
        let card_needs = card.security_requirements.as_ref().unwrap();
        assert_eq!(card_needs[0][BEARER_SCHEME], vec![format!("{name}:read")]);
        assert!(
            card.security_schemes
                .as_ref()
                .unwrap()
                .contains_key(BEARER_SCHEME)
        );

        let extensions = card.capabilities.extensions.clone().unwrap_or_default();
        let ext = extensions
            .iter()
            .find(|e| e.uri == PRINCIPAL_EXTENSION)
            .unwrap_or_else(|| panic!("{name}: no principal extension"));
        let params = ext.params.as_ref().unwrap();
        assert_eq!(params["principal"], agent_principal(&name));
        principals.push(params["principal"].as_str().unwrap().to_string());
    }
    principals.sort();
    principals.dedup();
    assert_eq!(
        principals,
        [
            "agent:analytics",
            "agent:forgejo",
            "agent:glitchtip",
            "agent:plane",
            "agent:zulip"
        ]
    );
}
