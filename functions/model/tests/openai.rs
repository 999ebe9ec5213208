//! OpenAiCompatible against a local mock of `/chat/completions`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use loams_model::{
    ANSWER_TIMEOUT, ChatMessage, ChatModel, ChatRequest, ChatResponse, MAX_TOKENS_TOLD,
    ModelConfig, ModelError, OpenAiCompatible,
};
use serde_json::{Value, json};

const KEY: &str = "sk-test-secret-key-123";

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Value>>>);

async fn handler(
    Path(scenario): Path<String>,
    State(seen): State<Seen>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if auth != format!("Bearer {KEY}") {
        return (
            StatusCode::UNAUTHORIZED,
            format!("{{\"error\":\"bad key {auth}\"}}"),
        )
            .into_response();
    }
    let Ok(v) = serde_json::from_str::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "not json").into_response();
    };
    seen.0.lock().unwrap().push(v);
    match scenario.as_str() {
        // DeepSeek's shape, with its extra fields, to prove they are tolerated.
        "ok" => Json(json!({
            "id": "cmpl-1", "object": "chat.completion", "created": 1, "model": "deepseek-chat",
            "system_fingerprint": "fp_x",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": null,
                "message": {"role": "assistant", "content": "the patch", "reasoning_content": "thinking..."}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 34, "total_tokens": 154,
                "prompt_cache_hit_tokens": 100, "prompt_cache_miss_tokens": 20,
                "completion_tokens_details": {"reasoning_tokens": 10}}
        }))
        .into_response(),
        "rate" => (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "7")], "slow down").into_response(),
        "fail" => (StatusCode::INTERNAL_SERVER_ERROR, format!("upstream exploded; key was {KEY}")).into_response(),
        "hugefail" => (StatusCode::BAD_GATEWAY,
            format!("proxy said no; key was {KEY}; {}", "x".repeat(loams_model::MAX_RESPONSE_BYTES))).into_response(),
        "malformed" => (StatusCode::OK, [("content-type", "application/json")], "{\"choices\": [").into_response(),
        "nochoice" => Json(json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}})).into_response(),
        "nochoices" => Json(json!({"usage": {"prompt_tokens": 2, "completion_tokens": 0}})).into_response(),
        "nocontent" => Json(json!({"choices": [{"message": {"role": "assistant", "content": null}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}})).into_response(),
        "nomessage" => Json(json!({"choices": [{"index": 0}], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}))
            .into_response(),
        "nousage" => Json(json!({"choices": [{"message": {"content": "the patch"}}]})).into_response(),
        "untold" => Json(json!({"choices": [{"message": {"content": "the patch"}}],
            "usage": {"prompt_tokens": u64::MAX, "completion_tokens": 1}})).into_response(),
        "most" => told(MAX_TOKENS_TOLD, MAX_TOKENS_TOLD),
        "nullchoice" => Json(json!({"choices": [null], "usage": {"prompt_tokens": 8, "completion_tokens": 9}}))
            .into_response(),
        "manychoices" => Json(json!({"choices": [{"message": {"content": "the patch"}}, {"message": 1}, 2, null],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2}})).into_response(),
        "halfusage" => Json(json!({"choices": [{"message": {"content": "the patch"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": null}})).into_response(),
        "emptyusage" => Json(json!({"choices": [{"message": {"content": "the patch"}}], "usage": {}})).into_response(),
        "mistyped" => Json(json!({"choices": "\u{7f}".repeat(100_000), "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
            .into_response(),
        "keyed" => Json(json!({"choices": format!("echo {KEY} echo"),
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}})).into_response(),
        "name256" => named(&"m".repeat(256)),
        "name257" => named(&"m".repeat(257)),
        "namectl" => named("deepseek\u{1b}[31m"),
        "namebidi" => named("deepseek-chat\u{202e}tahc"),
        "nameempty" => named(""),
        "nameollama" => named("llama3.1:8b-instruct-q4_K_M"),
        "namepath" => named("meta-llama/Llama-4-Scout-17B-16E-Instruct:v1.0@2025+fp8"),
        "thoughtful" => Json(json!({"choices": [{"message": {"content": "the patch",
                "reasoning_content": "hmm ".repeat(512 * 1024)}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 600_000}})).into_response(),
        "past_prompt" => told(MAX_TOKENS_TOLD + 1, 1),
        "past_completion" => told(1, MAX_TOKENS_TOLD + 1),
        "huge" => (StatusCode::OK, "x".repeat(loams_model::MAX_RESPONSE_BYTES + 1)).into_response(),
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

/// An answer from a model of this name.
fn named(name: &str) -> axum::response::Response {
    let usage = json!({"prompt_tokens": 1, "completion_tokens": 1});
    Json(json!({"model": name, "choices": [{"message": {"content": "the patch"}}], "usage": usage}))
        .into_response()
}

/// An answer that says it used these tokens.
fn told(prompt_tokens: u64, completion_tokens: u64) -> axum::response::Response {
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens});
    Json(json!({"choices": [{"message": {"content": "the patch"}}], "usage": usage}))
        .into_response()
}

async fn mock() -> (String, Seen) {
    let seen = Seen::default();
    let app = axum::Router::new()
        .route("/{scenario}/chat/completions", post(handler))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

fn client(base: &str, scenario: &str, key: &str) -> OpenAiCompatible {
    OpenAiCompatible::new(ModelConfig {
        base_url: format!("{base}/{scenario}/"),
        model: "deepseek-chat".into(),
        api_key: key.into(),
        timeout: Duration::from_secs(10),
    })
    .unwrap()
}

/// What the mock answers for `scenario`, asked with the right key.
async fn ask(base: &str, scenario: &str) -> Result<ChatResponse, ModelError> {
    client(base, scenario, KEY).complete(&request()).await
}

fn request() -> ChatRequest {
    ChatRequest {
        purpose: "fix".into(),
        messages: vec![
            ChatMessage::system("you fix bugs"),
            ChatMessage::user("fix it"),
        ],
        max_tokens: Some(256),
    }
}

#[tokio::test]
async fn success_parses_content_and_usage_and_sends_openai_shape() {
    let (base, seen) = mock().await;
    let resp = ask(&base, "ok").await.unwrap();
    assert_eq!(resp.text, "the patch");
    assert_eq!(resp.model, "deepseek-chat");
    assert_eq!((resp.input_tokens, resp.output_tokens), (120, 34));
    let sent = seen.0.lock().unwrap().pop().unwrap();
    assert_eq!(
        sent,
        json!({"model": "deepseek-chat", "stream": false, "max_tokens": 256, "messages": [
            {"role": "system", "content": "you fix bugs"}, {"role": "user", "content": "fix it"}]})
    );
}

#[tokio::test]
async fn wrong_key_is_a_status_error_without_the_key() {
    let (base, seen) = mock().await;
    let err = client(&base, "ok", "sk-wrong")
        .complete(&request())
        .await
        .unwrap_err();
    match &err {
        ModelError::Status { status, body } => {
            assert_eq!(*status, 401);
            // The mock echoes the presented key; the excerpt must not carry it.
            assert!(!body.contains("sk-wrong"), "{body}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(!err.is_retryable());
    assert!(seen.0.lock().unwrap().is_empty());
}

#[tokio::test]
async fn rate_limit_carries_retry_after() {
    let (base, _) = mock().await;
    let err = ask(&base, "rate").await.unwrap_err();
    assert!(
        matches!(err, ModelError::RateLimited { retry_after: Some(d) } if d == Duration::from_secs(7)),
        "{err:?}"
    );
    assert!(err.is_retryable());
}

#[tokio::test]
async fn server_error_is_retryable_and_redacted() {
    let (base, _) = mock().await;
    let err = ask(&base, "fail").await.unwrap_err();
    let ModelError::Status { status, body } = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(*status, 500);
    assert!(body.starts_with("upstream exploded"));
    assert!(!body.contains(KEY) && !err.to_string().contains(KEY));
    assert!(err.is_retryable());

    // An error body past what an answer may be: its start is read, the rest is not, and the key is still redacted.
    let err = ask(&base, "hugefail").await.unwrap_err();
    let ModelError::Status { status, body } = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(*status, 502);
    assert!(
        body.starts_with("proxy said no; key was <redacted>; xxx"),
        "{body}"
    );
    assert!(!err.to_string().contains(KEY));
}

#[tokio::test]
async fn an_answer_without_a_choice_or_content_is_unusable_but_its_tokens_are_told() {
    let (base, _) = mock().await;
    for (scenario, expected) in [
        ("nochoice", ("no choices", 1, 0)),
        ("nochoices", ("no choices", 2, 0)),
        ("nocontent", ("choice has no content", 3, 4)),
        ("nomessage", ("choice has no content", 5, 6)),
        ("nullchoice", ("no choices", 8, 9)),
    ] {
        let err = ask(&base, scenario).await.unwrap_err();
        let ModelError::Unusable {
            why,
            input_tokens,
            output_tokens,
        } = &err
        else {
            panic!("{scenario}: unexpected {err:?}")
        };
        assert_eq!(
            (why.as_str(), *input_tokens, *output_tokens),
            expected,
            "{scenario}"
        );
        assert!(!err.is_retryable());
    }
}

#[tokio::test]
async fn the_first_choice_is_the_answer_whatever_follows_it() {
    let (base, _) = mock().await;
    let answer = ask(&base, "manychoices").await.unwrap();
    assert_eq!(
        (
            answer.text.as_str(),
            answer.input_tokens,
            answer.output_tokens
        ),
        ("the patch", 1, 2)
    );
}

#[tokio::test]
async fn a_model_name_no_model_has_is_not_kept() {
    let (base, _) = mock().await;
    let longest = "m".repeat(256);
    for (scenario, kept) in [
        ("name256", longest.as_str()),
        ("name257", "deepseek-chat"),
        ("namectl", "deepseek-chat"),
        ("namebidi", "deepseek-chat"),
        ("nameempty", "deepseek-chat"),
        ("nameollama", "llama3.1:8b-instruct-q4_K_M"),
        (
            "namepath",
            "meta-llama/Llama-4-Scout-17B-16E-Instruct:v1.0@2025+fp8",
        ),
    ] {
        let answer = ask(&base, scenario).await.unwrap();
        assert_eq!(answer.model, kept, "{scenario}");
    }
}

#[tokio::test]
async fn a_reasoning_models_long_answer_is_read_and_counted() {
    // Over 2 MiB, almost all of it `reasoning_content`: past a tighter bound on bodies, but billed, so it must be read
    // and come back with its tokens.
    let (base, _) = mock().await;
    let answer = ask(&base, "thoughtful").await.unwrap();
    assert_eq!(
        (answer.text.as_str(), answer.output_tokens),
        ("the patch", 600_000)
    );
}

#[tokio::test]
async fn a_bad_answer_says_what_serde_found_and_where() {
    let (base, _) = mock().await;
    for (scenario, says) in [
        ("halfusage", "invalid type: null, expected u64"),
        ("emptyusage", "missing field `prompt_tokens`"),
        ("mistyped", "invalid type: string"),
        ("keyed", "invalid type: string"),
    ] {
        let err = ask(&base, scenario).await.unwrap_err().to_string();
        assert!(
            err.contains(says) && err.contains("(line 1, column "),
            "{scenario}: {err}"
        );
        // A peer may echo the key it was given; the reason keeps none of the peer's text.
        assert!(
            !err.contains(KEY) && !err.contains("sk-") && !err.contains("echo"),
            "{scenario}: {err}"
        );
    }
}

#[tokio::test]
async fn an_answer_at_the_most_tokens_believed_is_an_answer() {
    let (base, _) = mock().await;
    let answer = ask(&base, "most").await.unwrap();
    assert_eq!(
        (answer.input_tokens, answer.output_tokens),
        (MAX_TOKENS_TOLD, MAX_TOKENS_TOLD)
    );
}

#[tokio::test]
async fn malformed_oversized_and_unbelievable_answers_are_bad_responses() {
    let (base, _) = mock().await;
    for scenario in [
        "malformed",
        "huge",
        "nousage",
        "untold",
        "past_prompt",
        "past_completion",
        "halfusage",
        "emptyusage",
        "mistyped",
    ] {
        let err = ask(&base, scenario).await.unwrap_err();
        assert!(
            matches!(err, ModelError::BadResponse(_)),
            "{scenario}: {err:?}"
        );
        // A bad answer's reason is kept with the run: it stays short however long the answer.
        assert!(
            err.to_string().len() < 300,
            "{scenario}: {} bytes",
            err.to_string().len()
        );
        assert!(!err.is_retryable());
    }
}

#[tokio::test]
async fn unreachable_endpoint_is_a_retryable_transport_error() {
    // Bind then drop to get a port nobody listens on.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = client(&format!("http://{addr}"), "ok", KEY)
        .complete(&request())
        .await
        .unwrap_err();
    assert!(matches!(err, ModelError::Transport(_)), "{err:?}");
    assert!(err.is_retryable());
}

#[test]
fn config_is_validated_and_debug_hides_the_key() {
    let cfg = ModelConfig {
        api_key: KEY.into(),
        ..ModelConfig::default()
    };
    assert_eq!(cfg.base_url, "https://api.deepseek.com");
    assert_eq!(cfg.model, "deepseek-chat");
    assert!(!format!("{cfg:?}").contains(KEY));
    let client = OpenAiCompatible::new(cfg.clone()).unwrap();
    assert!(!format!("{client:?}").contains(KEY));
    for bad in [
        ModelConfig {
            base_url: "not a url".into(),
            ..cfg.clone()
        },
        ModelConfig {
            base_url: "ftp://x".into(),
            ..cfg.clone()
        },
        ModelConfig {
            model: " ".into(),
            ..cfg.clone()
        },
        ModelConfig {
            timeout: Duration::ZERO,
            ..cfg.clone()
        },
        ModelConfig {
            timeout: ANSWER_TIMEOUT + Duration::from_millis(1),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "bad\nkey".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "sk-clé".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "sk-key ".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: " sk-key".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "sk-live-a1 sk-old-b2".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "sk-key\tnote".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "\"sk-key\"".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "==".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "sk-a=b".into(),
            ..cfg.clone()
        },
        ModelConfig {
            api_key: "=sk-key".into(),
            ..cfg.clone()
        },
    ] {
        let bad_key = bad.api_key != cfg.api_key;
        let err = OpenAiCompatible::new(bad).unwrap_err();
        assert!(matches!(err, ModelError::Config(_)), "{err:?}");
        // A refused key is told by a fixed message, never by any part of it.
        if bad_key {
            let message = "api_key must be a bearer token: ASCII letters, digits and - . _ ~ + / (then = for \
                           padding), no spaces";
            assert!(
                matches!(&err, ModelError::Config(m) if m == message),
                "{err:?}"
            );
        }
    }
    // Keys as providers issue them, JWTs included, and none for a local server.
    for key in ["sk-proj-Ab_c.d~e+f/g==", "eyJhbGciOi.eyJzdWIi.c2ln-_", ""] {
        OpenAiCompatible::new(ModelConfig {
            api_key: key.into(),
            ..cfg.clone()
        })
        .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
}
