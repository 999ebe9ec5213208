use std::sync::Arc;

use loams_model::{ChatMessage, ChatModel, ChatRequest, ModelError, Replay};

fn req(purpose: &str) -> ChatRequest {
    ChatRequest {
        purpose: purpose.into(),
        messages: vec![ChatMessage::user("x")],
        max_tokens: None,
    }
}

const CASSETTE: &str = r#"{"completions": [
  {"purpose": "fix", "text": "fix 1", "input_tokens": 10, "output_tokens": 2},
  {"purpose": "lead_review", "text": "looks good", "input_tokens": 5, "output_tokens": 3},
  {"purpose": "fix", "text": "fix 2", "input_tokens": 11, "output_tokens": 4}
]}"#;

#[tokio::test]
async fn serves_in_order_per_purpose_then_exhausts() {
    let replay = Replay::from_json_str(CASSETTE).unwrap();
    assert_eq!(replay.remaining("fix"), 2);
    let r = replay.complete(&req("fix")).await.unwrap();
    assert_eq!(
        (r.text.as_str(), r.input_tokens, r.output_tokens),
        ("fix 1", 10, 2)
    );
    assert_eq!(
        replay.complete(&req("lead_review")).await.unwrap().text,
        "looks good"
    );
    assert_eq!(replay.complete(&req("fix")).await.unwrap().text, "fix 2");
    let err = replay.complete(&req("fix")).await.unwrap_err();
    assert!(
        matches!(&err, ModelError::CassetteExhausted { purpose } if purpose == "fix"),
        "{err:?}"
    );
    assert!(err.to_string().contains("fix"));
    let err = replay.complete(&req("security_audit")).await.unwrap_err();
    assert!(
        matches!(&err, ModelError::CassetteExhausted { purpose } if purpose == "security_audit")
    );
}

#[tokio::test]
async fn concurrent_callers_each_get_a_distinct_completion() {
    let items: Vec<String> = (0..50)
        .map(|i| format!(r#"{{"purpose":"fix","text":"t{i}","input_tokens":1,"output_tokens":1}}"#))
        .collect();
    let replay = Arc::new(
        Replay::from_json_str(&format!(r#"{{"completions":[{}]}}"#, items.join(","))).unwrap(),
    );
    let mut handles = Vec::new();
    for _ in 0..50 {
        let r = replay.clone();
        handles.push(tokio::spawn(async move {
            r.complete(&req("fix")).await.unwrap().text
        }));
    }
    let mut got = Vec::new();
    for h in handles {
        got.push(h.await.unwrap());
    }
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 50);
    assert_eq!(replay.remaining("fix"), 0);
}

#[test]
fn bad_cassettes_are_config_errors() {
    for bad in [
        "",
        "not json",
        r#"{"completions": {}}"#,
        r#"{"completions": [{"purpose": "fix", "text": "x", "input_tokens": 1}]}"#,
        r#"{"completions": [{"purpose": "fix", "text": "x", "input_tokens": -1, "output_tokens": 1}]}"#,
        r#"{"completions": [{"purpose": "", "text": "x", "input_tokens": 1, "output_tokens": 1}]}"#,
        r#"{"completions": [], "extra": 1}"#,
    ] {
        let err = Replay::from_json_str(bad).unwrap_err();
        assert!(matches!(err, ModelError::Config(_)), "{bad}: {err:?}");
    }
}

#[tokio::test]
async fn loads_from_file_and_reports_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cassette.json");
    std::fs::write(&path, CASSETTE).unwrap();
    let replay = Replay::from_file(&path).unwrap();
    assert_eq!(replay.complete(&req("fix")).await.unwrap().text, "fix 1");
    let err = Replay::from_file(dir.path().join("missing.json")).unwrap_err();
    assert!(
        matches!(err, ModelError::Config(ref m) if m.contains("missing.json")),
        "{err:?}"
    );
}
