//! Agent cards against the contracts table, and zulip.open_thread against a mock of the two Zulip endpoints it
//! needs that the sandbox does not serve (`GET /get_stream_id`).

use axum::extract::Query;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use loams_a2a::{Risk, Skills};
use loams_agents::*;
use serde_json::{Value, json};
use std::collections::HashMap;

fn risks(agent: &dyn Skills) -> Vec<(String, Risk)> {
    agent
        .card()
        .skills
        .into_iter()
        .map(|s| (s.id, s.risk))
        .collect()
}

#[test]
fn cards_match_the_contract_table() {
    let z = ZulipAgent::new(&ZulipConfig::new("http://127.0.0.1:1", "bot@x", "k")).unwrap();
    let p = PlaneAgent::new(&PlaneConfig::new("http://127.0.0.1:1", "k", "acme", "p")).unwrap();
    let f = ForgejoAgent::new(&ForgejoConfig::new(
        "http://127.0.0.1:1",
        "t",
        "acme",
        "shop",
    ))
    .unwrap();
    let g = GlitchTipAgent::new(&GlitchTipConfig::new("http://127.0.0.1:1", "t", "acme")).unwrap();
    let a = AnalyticsAgent::new(&AnalyticsConfig::new(
        "http://127.0.0.1:1",
        "id",
        "s",
        "shop",
    ))
    .unwrap();
    use Risk::*;
    let expect = |v: &[(&str, Risk)]| {
        v.iter()
            .map(|(s, r)| ((*s).to_string(), *r))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        risks(&z),
        expect(&[("open_thread", Write), ("post", Write), ("read", Read)])
    );
    assert_eq!(
        risks(&p),
        expect(&[
            ("create_issue", Write),
            ("get_issue", Read),
            ("comment", Write),
            ("set_state", Write)
        ])
    );
    assert_eq!(
        risks(&f),
        expect(&[
            ("read_files", Read),
            ("commit_patch", Write),
            ("open_pr", Write),
            ("get_pr", Read),
            ("ci_status", Read),
            ("merge", Destructive),
            ("close_pr", Destructive),
            ("revert", Destructive),
        ])
    );
    assert_eq!(
        risks(&g),
        expect(&[
            ("issue_events", Read),
            ("get_issue", Read),
            ("resolve", Write)
        ])
    );
    assert_eq!(risks(&a), expect(&[("series", Read)]));
    for (agent, name) in [
        (&z as &dyn Skills, "zulip"),
        (&p, "plane"),
        (&f, "forgejo"),
        (&g, "glitchtip"),
        (&a, "analytics"),
    ] {
        let card = agent.card();
        assert_eq!(card.name, name);
        for s in card.skills {
            assert!(
                !s.description.is_empty() && !s.examples.is_empty(),
                "{name}.{}",
                s.id
            );
            // Examples are valid JSON args.
            for e in &s.examples {
                serde_json::from_str::<Value>(e).unwrap();
            }
        }
    }
}

#[test]
fn bad_config_is_refused() {
    assert!(ZulipAgent::new(&ZulipConfig::new("not a url", "bot@x", "k")).is_err());
    assert!(PlaneAgent::new(&PlaneConfig::new("http://x", "", "acme", "p")).is_err());
    assert!(ForgejoAgent::new(&ForgejoConfig::new("http://x", "t\n", "acme", "shop")).is_err());
    assert!(GlitchTipAgent::new(&GlitchTipConfig::new("ftp://x", "t", "acme")).is_err());
}

#[tokio::test]
async fn unknown_skill_and_bad_args_are_permanent() {
    let g = GlitchTipAgent::new(&GlitchTipConfig::new("http://127.0.0.1:1", "t", "acme")).unwrap();
    let e = g.invoke("delete_everything", json!({})).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("delete_everything"));
    let e = g
        .invoke("resolve", json!({"issue_id": 1, "extra": true}))
        .await
        .unwrap_err();
    assert!(!e.retryable && e.message.contains("extra"));
}

#[tokio::test]
async fn unreachable_app_is_retryable() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let g =
        GlitchTipAgent::new(&GlitchTipConfig::new(format!("http://{addr}"), "t", "acme")).unwrap();
    let e = g
        .invoke("resolve", json!({"issue_id": 1}))
        .await
        .unwrap_err();
    assert!(e.retryable, "{e:?}");
}

#[tokio::test]
async fn zulip_open_thread_posts_and_links_the_topic() {
    // Shapes from zulip.yaml: get-stream-id and send-message examples.
    let app = axum::Router::new()
        .route(
            "/api/v1/get_stream_id",
            get(|Query(q): Query<HashMap<String, String>>| async move {
                match q.get("stream").map(String::as_str) {
                    Some("incident room") => axum::Json(json!({"msg": "", "result": "success", "stream_id": 15})),
                    _ => axum::Json(json!({"result": "error", "msg": "Invalid channel name", "code": "BAD_REQUEST"})),
                }
            }),
        )
        .route(
            "/api/v1/messages",
            post(|headers: HeaderMap, body: String| async move {
                // Basic bot@x:k, form-encoded stream message.
                assert_eq!(headers["authorization"], "Basic Ym90QHg6aw==");
                assert!(body.contains("type=stream") && body.contains("to=incident+room") && body.contains("topic=checkout+500s"));
                axum::Json(json!({"id": 42, "msg": "", "result": "success"}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let z = ZulipAgent::new(&ZulipConfig::new(format!("http://{addr}"), "bot@x", "k")).unwrap();
    let out = z
        .invoke(
            "open_thread",
            json!({"channel": "incident room", "topic": "checkout 500s", "content": "hi"}),
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        json!({"message_id": 42, "url": format!("http://{addr}/#narrow/channel/15-incident-room/topic/checkout.20500s/near/42")})
    );
    let err = z
        .invoke(
            "open_thread",
            json!({"channel": "nope", "topic": "t", "content": "hi"}),
        )
        .await
        .unwrap_err();
    assert!(
        !err.retryable && err.message.contains("Invalid channel name"),
        "{err:?}"
    );
}
