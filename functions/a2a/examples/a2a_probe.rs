//! Exercises [`loams_a2a::A2aClient`] against any A2A 1.0 agent whose skill echoes text back
//! (`echo: <text>`), over JSON-RPC and HTTP+JSON: blocking send, stream, get, list, cancel of a
//! finished task and subscribe to it (both refused). For interoperability tests against other
//! implementations (tests/a2a_interop runs it against an a2a-sdk server).
//!
//! `a2a_probe <agent base URL> <JWKS JSON the card must be signed with>`; exits non-zero with the
//! first failure.

use a2a::{
    ListTasksRequest, Message, Part, Role, SendMessageRequest, SendMessageResponse, StreamResponse,
    TaskState, error_code,
};
use loams_a2a::{A2aClient, Binding, CallError, ClientOptions, Jwks};

type Failure = Box<dyn std::error::Error>;

fn request(text: &str) -> SendMessageRequest {
    SendMessageRequest {
        message: Message {
            message_id: format!("probe-{}-{text}", std::process::id()),
            context_id: None,
            task_id: None,
            role: Role::User,
            parts: vec![Part::text(text)],
            metadata: None,
            extensions: None,
            reference_task_ids: None,
        },
        configuration: None,
        metadata: None,
        tenant: None,
    }
}

fn check(ok: bool, what: &str) -> Result<(), Failure> {
    if ok { Ok(()) } else { Err(what.into()) }
}

fn protocol_code(result: Result<impl std::fmt::Debug, CallError>) -> Option<i32> {
    match result {
        Err(CallError::Protocol { code, .. }) => Some(code),
        _ => None,
    }
}

async fn probe(url: &str, jwks: &Jwks, binding: Binding) -> Result<(), Failure> {
    let options = ClientOptions {
        binding,
        ..ClientOptions::default()
    };
    let client = A2aClient::with_options(url, jwks, options).await?;
    let tag = match binding {
        Binding::JsonRpc => "jsonrpc",
        Binding::HttpJson => "rest",
    };

    let SendMessageResponse::Task(task) = client.send(request(&format!("{tag}-send"))).await?
    else {
        return Err("send answered a message, not a task".into());
    };
    check(
        task.status.state == TaskState::Completed,
        "send: task not completed",
    )?;
    let echoed = task
        .artifacts
        .iter()
        .flatten()
        .flat_map(|a| &a.parts)
        .find_map(|p| p.as_text());
    check(
        echoed == Some(&format!("echo: {tag}-send")),
        "send: no echo artifact",
    )?;

    let mut stream = client
        .send_streaming(request(&format!("{tag}-stream")))
        .await?;
    let mut last_state = None;
    let mut events = 0;
    while let Some(event) = stream.next().await {
        events += 1;
        match event? {
            StreamResponse::Task(t) => last_state = Some(t.status.state),
            StreamResponse::StatusUpdate(u) => last_state = Some(u.status.state),
            _ => {}
        }
    }
    check(
        events >= 2 && last_state == Some(TaskState::Completed),
        "stream: did not end completed",
    )?;

    let got = client.get_task(&task.id, None).await?;
    check(
        got.status.state == TaskState::Completed,
        "get: not completed",
    )?;

    let page = client
        .list_tasks(ListTasksRequest {
            context_id: None,
            status: None,
            page_size: Some(50),
            page_token: None,
            history_length: None,
            status_timestamp_after: None,
            include_artifacts: None,
            tenant: None,
        })
        .await?;
    check(
        page.tasks.iter().any(|t| t.id == task.id),
        "list: task missing",
    )?;

    check(
        protocol_code(client.cancel_task(&task.id).await) == Some(error_code::TASK_NOT_CANCELABLE),
        "cancel of a finished task: not TaskNotCancelable",
    )?;
    check(
        protocol_code(client.get_task("no-such-task", None).await)
            == Some(error_code::TASK_NOT_FOUND),
        "get of an unknown task: not TaskNotFound",
    )?;
    let subscribed = client.subscribe(&task.id).await.map(|_| ());
    check(
        protocol_code(subscribed) == Some(error_code::UNSUPPORTED_OPERATION),
        "subscribe to a finished task: not UnsupportedOperation",
    )?;
    println!("ok {tag}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(jwks)) = (args.next(), args.next()) else {
        return Err("usage: a2a_probe <agent URL> <JWKS JSON>".into());
    };
    let jwks: Jwks = serde_json::from_str(&jwks)?;
    for binding in [Binding::JsonRpc, Binding::HttpJson] {
        probe(&url, &jwks, binding)
            .await
            .map_err(|e| format!("{binding:?}: {e}"))?;
    }
    Ok(())
}
