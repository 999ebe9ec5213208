//! Conformance mode ([`ServerOptions::conformance`](crate::ServerOptions), off by default): the
//! scripted agent behaviour the official A2A TCK (a2aproject/a2a-tck, branch 1.0-dev) drives by the
//! prefix of a message's `messageId` (its `scenarios/*.feature`). Only messages whose id starts
//! with `tck-` or `test-resubscribe-` are scripted; every other message is a skill call as usual.
//!
//! The TCK reuses one message id for many requests of a session and continues tasks with
//! `taskId`, so scripted messages do not follow the production rule "task id = message id, one
//! task per message id": each one without `taskId` gets a fresh task, and one with `taskId`
//! continues that (non-terminal) task. Scripted tasks live in the same store, bound to their
//! caller, so GetTask, ListTasks, CancelTask, SubscribeToTask and push work on them unchanged.

use std::sync::Arc;
use std::time::Duration;

use a2a::{A2AError, Artifact, Message, Part, Role, Task, TaskPushNotificationConfig};
use loams_platform::{Cond, Durability, StoreError};
use serde_json::json;

use crate::auth::Principal;
use crate::tasks::{self, Agent, Begun, StoredTask};

/// Message-id prefixes that put a message under a script.
const PREFIXES: [&str; 2] = ["tck-", "test-resubscribe-"];
/// How long the long-running scenario stays WORKING: twice the TCK's default
/// `TCK_STREAMING_TIMEOUT` of 2 s, as its streaming.feature asks.
const LONG_RUN: Duration = Duration::from_secs(4);
/// Whether `message` is scripted in conformance mode.
pub(crate) fn scripted(message: &Message) -> bool {
    PREFIXES.iter().any(|p| message.message_id.starts_with(p))
}

/// What a scripted message makes the agent do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    /// Complete with the agent message "Hello from TCK" (also the default for unknown prefixes).
    Complete,
    /// Complete with one artifact of the given kind.
    Artifact(Kind),
    /// Answer with a Message, no task.
    MessageReply,
    InputRequired,
    Reject,
    /// WORKING, one text artifact, COMPLETED (the streaming scenarios).
    Stream(&'static str),
    /// Two chunks of one artifact, then COMPLETED.
    Chunked,
    /// WORKING for [`LONG_RUN`], then COMPLETED (resubscription).
    LongRun,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    File,
    FileUrl,
    Data,
}

impl Script {
    fn of(message_id: &str) -> Script {
        let name = message_id.strip_prefix("tck-").unwrap_or(message_id);
        // Longest prefixes first: `artifact-file-url` before `artifact-file`.
        let table: [(&str, Script); 16] = [
            ("test-resubscribe-", Script::LongRun),
            ("artifact-file-url", Script::Artifact(Kind::FileUrl)),
            ("artifact-file", Script::Artifact(Kind::File)),
            ("artifact-text", Script::Artifact(Kind::Text)),
            ("artifact-data", Script::Artifact(Kind::Data)),
            ("message-response", Script::MessageReply),
            ("stream-002", Script::MessageReply),
            ("input-required", Script::InputRequired),
            ("reject-task", Script::Reject),
            ("stream-artifact-chunked", Script::Chunked),
            (
                "stream-artifact-text",
                Script::Stream("Streamed text content"),
            ),
            ("stream-artifact-file", Script::Artifact(Kind::File)),
            ("stream-ordering-001", Script::Stream("Ordered output")),
            ("stream-001", Script::Stream("Stream hello from TCK")),
            ("stream-003", Script::Stream("Stream task lifecycle")),
            ("complete-task", Script::Complete),
        ];
        table
            .iter()
            .find(|(p, _)| name.starts_with(p))
            .map_or(Script::Complete, |(_, s)| *s)
    }
}

fn agent_text(task: &Task, text: &str) -> Message {
    Message {
        message_id: a2a::new_message_id(),
        context_id: Some(task.context_id.clone()),
        task_id: Some(task.id.clone()),
        role: Role::Agent,
        parts: vec![Part::text(text)],
        metadata: None,
        extensions: None,
        reference_task_ids: None,
    }
}

fn artifact(task: &Task, name: &str, parts: Vec<Part>) -> Artifact {
    Artifact {
        artifact_id: format!("{}:{name}", task.id),
        name: Some(name.into()),
        description: None,
        parts,
        metadata: None,
        extensions: None,
    }
}

/// SendMessage / SendStreamingMessage of a scripted message.
pub(crate) async fn begin(
    agent: &Arc<Agent>,
    caller: &Principal,
    message: Message,
    push: Option<TaskPushNotificationConfig>,
) -> Result<Begun, A2AError> {
    let script = Script::of(&message.message_id);
    // A continued task keeps its expiry; a new one gets the caller's (see `tasks::new_task_expiry`).
    let (mut task, expires_ms) = match &message.task_id {
        Some(task_id) => {
            let (stored, _) = agent.own_record(&caller.subject, task_id).await?;
            let (task, expires_ms) = (stored.task, stored.expires_ms);
            if task.status.state.is_terminal() {
                return Err(A2AError::unsupported_operation(format!(
                    "task {task_id} is in a terminal state and takes no more messages"
                )));
            }
            if message
                .context_id
                .as_ref()
                .is_some_and(|c| c != &task.context_id)
            {
                return Err(A2AError::invalid_params(
                    "contextId does not match the task's context",
                ));
            }
            (task, expires_ms)
        }
        None => {
            if script == Script::MessageReply {
                let context_id = message
                    .context_id
                    .clone()
                    .unwrap_or_else(a2a::new_context_id);
                return Ok(Begun::Reply(Message {
                    message_id: a2a::new_message_id(),
                    context_id: Some(context_id),
                    task_id: None,
                    role: Role::Agent,
                    parts: vec![Part::text("Direct message response")],
                    metadata: None,
                    extensions: None,
                    reference_task_ids: None,
                }));
            }
            let now = tasks::now_ms();
            let task = Task {
                id: a2a::new_task_id(),
                context_id: message
                    .context_id
                    .clone()
                    .unwrap_or_else(a2a::new_context_id),
                status: tasks::status(a2a::TaskState::Submitted, None, now),
                artifacts: None,
                history: None,
                metadata: None,
            };
            (task, tasks::new_task_expiry(agent, caller, now))
        }
    };
    let mut history = task.history.take().unwrap_or_default();
    history.push(Message {
        task_id: Some(task.id.clone()),
        context_id: Some(task.context_id.clone()),
        ..message
    });
    task.history = Some(history);
    task.status = tasks::status(a2a::TaskState::Working, None, tasks::now_ms());
    let mut record = StoredTask {
        task,
        call: format!("conformance:{script:?}"),
        caller: caller.subject.clone(),
        // No skill runs for a scripted task, so it may be canceled at once.
        lease_until_ms: Some(0),
        expires_ms,
    };
    let body = tasks::storable(&mut record)?;
    let version = agent
        .put(&record, body, Cond::Any, Durability::Durable)
        .await
        .map_err(tasks::store_failure)?;
    let task_id = record.task.id.clone();
    if let Some(config) = push {
        crate::push::create_config(agent, &record, config).await?;
    }
    let shown = record.task.clone();
    crate::push::notify(
        agent,
        &record.caller,
        &task_id,
        vec![a2a::StreamResponse::Task(shown.clone())],
    )
    .await;
    let run = tokio::spawn(run(agent.clone(), record, version, script));
    Ok(Begun::Started(shown, run))
}

/// Plays `script` on the WORKING task and stores the outcome, unless the task changed meanwhile
/// (it was canceled): then the stored task stands.
async fn run(
    agent: Arc<Agent>,
    mut record: StoredTask,
    version: u64,
    script: Script,
) -> Result<Task, A2AError> {
    if script == Script::LongRun {
        tokio::time::sleep(LONG_RUN).await;
    }
    let working = record.task.clone();
    let task = &mut record.task;
    let done = |task: &Task, state, text: &str| {
        tasks::status(state, Some(agent_text(task, text)), tasks::now_ms())
    };
    use a2a::TaskState::{Completed, InputRequired, Rejected};
    match script {
        Script::Complete | Script::MessageReply | Script::LongRun => {
            task.status = done(task, Completed, "Hello from TCK");
        }
        Script::Artifact(kind) => {
            let part = match kind {
                Kind::Text => Part::text("Generated text content"),
                Kind::File => Part::raw(b"file content".to_vec())
                    .with_filename("output.txt")
                    .with_media_type("text/plain"),
                Kind::FileUrl => Part::url("https://example.com/output.txt")
                    .with_filename("output.txt")
                    .with_media_type("text/plain"),
                Kind::Data => Part::data(json!({"key": "value", "count": 42})),
            };
            task.artifacts = Some(vec![artifact(task, "output", vec![part])]);
            task.status = done(task, Completed, "Hello from TCK");
        }
        Script::InputRequired => task.status = done(task, InputRequired, "Input required"),
        Script::Reject => task.status = done(task, Rejected, "rejected"),
        Script::Stream(text) => {
            task.artifacts = Some(vec![artifact(task, "output", vec![Part::text(text)])]);
            task.status = done(task, Completed, "Stream completed");
        }
        Script::Chunked => {
            let parts = vec![Part::text("chunk-1 "), Part::text("chunk-2")];
            task.artifacts = Some(vec![artifact(task, "output", parts)]);
            task.status = done(task, Completed, "Stream completed");
        }
    }
    let body = tasks::storable(&mut record)?;
    match agent
        .put(&record, body, Cond::Version(version), Durability::Durable)
        .await
    {
        Ok(_) => {}
        Err(StoreError::Conflict) => {
            let (stored, _) = agent.own(&record.caller, &record.task.id).await?;
            return Ok(stored);
        }
        Err(e) => return Err(tasks::store_failure(e)),
    }
    crate::push::notify(
        &agent,
        &record.caller,
        &record.task.id,
        tasks::changes(&working, &record.task),
    )
    .await;
    Ok(record.task)
}
