//! The binding-independent A2A operations over tasks kept in the platform `Store`.
//!
//! Everything a later request needs (the task, its binding to the call and caller, the claim on its
//! message id) is in one stored item per task, so any process over the same store (a restarted one, another
//! Lambda) can read, cancel or follow a task another process started. The only thing held in
//! memory is the skill run itself, which no other process could continue anyway.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use a2a::{
    A2AError, Artifact, ListTasksRequest, ListTasksResponse, Message, PartContent, Role,
    StreamResponse, Task, TaskArtifactUpdateEvent, TaskPushNotificationConfig, TaskState,
    TaskStatus, TaskStatusUpdateEvent, error_code,
};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use futures::FutureExt;
use loams_platform::{Cond, Durability, Item, Page, Store, StoreError, limits};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::auth::{ApprovalGate, GateError, Principal};
use crate::card::CardSigner;
use crate::server::{APPROVAL_ID_KEY, MAX_MESSAGE_ID, ServerOptions, TASK_KIND};
use crate::skills::{Risk, SkillError, Skills};

/// Default and largest `pageSize` of ListTasks (A2A §3.1.4 asks for 1..=100).
const DEFAULT_PAGE_SIZE: usize = 50;
const MAX_PAGE_SIZE: usize = 100;
/// Most stored tasks one ListTasks looks at; a caller with more sees the ones within this bound.
const MAX_LIST_SCAN: usize = 20_000;
/// Stored tasks ListTasks asks the store for at a time. A task record may be up to `limits::MAX_BODY` bytes (its
/// history holds the request), so a store page of `limits::MAX_PAGE` records could take 400 MB to hold; this bounds
/// one page at 40 MB, within the 256 MB of an agent's Lambda.
const LIST_STORE_PAGE: u32 = 100;
/// Most bytes of tasks (as JSON) one ListTasks page carries; the page ends early, with a token for the rest, rather
/// than grow past it. A page of 100 tasks of up to 400 KB each would be 40 MB: past the response limits of the
/// clients (ours reads at most 2 MiB by default) and of Lambda. A page holds at least one task, and one task is
/// under `limits::MAX_BODY`, well below this, so no page is larger than this.
const MAX_LIST_BYTES: usize = 1024 * 1024;
/// Longest page token accepted (a timestamp and a task id, base64url).
const MAX_PAGE_TOKEN: usize = 2 * MAX_MESSAGE_ID;

/// The served agent: its skills, its store and the host's guards.
pub(crate) struct Agent {
    pub skills: Arc<dyn Skills>,
    pub store: Arc<dyn Store>,
    pub org: String,
    pub name: String,
    /// The card's skills and their risk: the risk decides whether a call needs an approval.
    pub risks: HashMap<String, Risk>,
    /// This agent's interface URL, the audience its callers' tokens must name.
    pub audience: String,
    pub auth: Arc<dyn crate::auth::CallerAuth>,
    pub gate: Arc<dyn ApprovalGate>,
    /// The public card, unsigned; the extended card is derived from it per caller.
    pub card: a2a::AgentCard,
    pub signer: CardSigner,
    /// The signed public card, rendered once; `Err` keeps the reason signing failed so the card
    /// endpoint reports it instead of serving an unsigned card.
    pub card_doc: Result<crate::server::CardDoc, String>,
    pub options: ServerOptions,
    /// Calls webhooks (see [`crate::push`]); built on the first delivery, because building it loads the
    /// system's root certificates and most processes (a Lambda serving a card or a skill call) deliver none.
    pub push_client: OnceLock<reqwest::Client>,
}

/// Where a stream's events go; a closed receiver (the client left) ends the producer.
pub(crate) type EventTx = mpsc::Sender<Result<StreamResponse, A2AError>>;

pub(crate) fn store_failure(e: StoreError) -> A2AError {
    tracing::error!(error = %e, "a2a task store");
    // The message is generic on purpose: backend details are not the caller's business.
    A2AError::internal("task store unavailable")
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub(crate) fn status(state: TaskState, message: Option<Message>, at_ms: i64) -> TaskStatus {
    TaskStatus {
        state,
        message,
        timestamp: chrono::DateTime::from_timestamp_millis(at_ms),
    }
}

pub(crate) fn check_id(what: &str, id: &str) -> Result<(), A2AError> {
    if id.is_empty() || id.len() > MAX_MESSAGE_ID || id.chars().any(char::is_control) {
        return Err(A2AError::invalid_params(format!(
            "{what} must be 1..={MAX_MESSAGE_ID} bytes without control characters"
        )));
    }
    Ok(())
}

/// `None` = the whole history; negative lengths are a caller error.
pub(crate) fn history_length(n: Option<i32>) -> Result<Option<usize>, A2AError> {
    match n {
        None => Ok(None),
        Some(n) => usize::try_from(n)
            .map(Some)
            .map_err(|_| A2AError::invalid_params("historyLength must not be negative")),
    }
}

pub(crate) fn trim_history(mut task: Task, keep: Option<usize>) -> Task {
    if let Some(keep) = keep {
        task.history = task.history.and_then(|mut h| {
            let drop = h.len().saturating_sub(keep);
            h.drain(..drop);
            (!h.is_empty()).then_some(h)
        });
    }
    task
}

/// Terminal or interrupted: the state a blocking send returns at and a stream closes at.
pub(crate) fn settled(state: &TaskState) -> bool {
    state.is_terminal() || matches!(state, TaskState::InputRequired | TaskState::AuthRequired)
}

/// The first media type a part declares that the card's input modes do not list (A2A §3.1.1:
/// ContentTypeNotSupportedError).
fn unsupported_media(message: &Message) -> Option<String> {
    message.parts.iter().find_map(|p| {
        let media = p.media_type.as_deref()?;
        let essence = media
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        (!crate::card::MODES.contains(&essence.as_str()))
            .then(|| essence.chars().take(64).collect())
    })
}

/// Deepest nesting of arrays and objects accepted in a message's data and metadata values, and in a skill's output
/// (stored at the level of a data part). serde_json parses at most 127 levels, and the stored task holds a data
/// part one level deeper than a JSON-RPC request does (two deeper than HTTP+JSON): args nested 121 levels parse in
/// the request, but their stored task would need 128 and never decode again, failing its caller's GetTask and
/// ListTasks. Skill arguments nest a few levels.
const MAX_DATA_DEPTH: usize = 32;

/// Whether a data part or a metadata value of `message` nests deeper than [`MAX_DATA_DEPTH`].
fn too_deep(message: &Message) -> bool {
    let metadata = message
        .metadata
        .iter()
        .chain(message.parts.iter().filter_map(|p| p.metadata.as_ref()))
        .flat_map(|m| m.values());
    let data = message.parts.iter().filter_map(|p| match &p.content {
        PartContent::Data(value) => Some(value),
        _ => None,
    });
    metadata
        .chain(data)
        .any(|value| nests_deeper_than(value, MAX_DATA_DEPTH))
}

/// Whether `value` has more than `levels` levels of arrays and objects; stops descending at that depth.
fn nests_deeper_than(value: &Value, levels: usize) -> bool {
    match value {
        Value::Array(items) => {
            levels == 0 || items.iter().any(|v| nests_deeper_than(v, levels - 1))
        }
        Value::Object(fields) => {
            levels == 0 || fields.values().any(|v| nests_deeper_than(v, levels - 1))
        }
        _ => false,
    }
}

/// The skill call carried by a message: exactly one data part `{"skill": "...", "args": {...}}`.
fn skill_call(message: &Message) -> Result<(String, Value), A2AError> {
    let bad = |why: &str| A2AError::invalid_params(why.to_string());
    let [part] = message.parts.as_slice() else {
        return Err(bad("the message must have exactly one part"));
    };
    let PartContent::Data(Value::Object(call)) = &part.content else {
        return Err(bad(
            "the message part must be a data part {\"skill\", \"args\"}",
        ));
    };
    let Some(Value::String(skill)) = call.get("skill") else {
        return Err(bad("the data part needs a string \"skill\""));
    };
    let Some(args @ Value::Object(_)) = call.get("args") else {
        return Err(bad("the data part needs an object \"args\""));
    };
    Ok((skill.clone(), args.clone()))
}

/// A stored task with what it is bound to. Kept beside the task (not in its metadata) so callers
/// never see the binding and cannot shape it.
#[derive(Serialize, Deserialize)]
pub(crate) struct StoredTask {
    pub(crate) task: Task,
    /// [`call_hash`] of the call that created the task.
    pub(crate) call: String,
    /// Subject of the caller that created the task.
    pub(crate) caller: String,
    /// While WORKING: until when the request that stored it runs the skill (its lease). Past it the
    /// process is taken as dead: the task may be canceled, or run again by a repeat of the call.
    /// `None` (a task stored before leases were recorded) means the WORKING status time plus the
    /// agent's lease, which is when its claim would have lapsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lease_until_ms: Option<i64>,
    /// When the stored task goes away; `None`: kept. A caller who may only read leaves no lasting record
    /// (see [`READER_TASK_RETENTION_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) expires_ms: Option<i64>,
}

/// How long the tasks of a caller who holds no write scope of the agent are kept: a person reading a panel asks
/// with a fresh message id each time, and every read would otherwise stay stored, with a copy of what it read.
/// Long enough to follow the task (GetTask, SubscribeToTask) and replay a lost answer.
pub(crate) const READER_TASK_RETENTION_MS: i64 = 60 * 60 * 1000;

/// When a new task of `caller`, started at `started_ms`, expires: within [`READER_TASK_RETENTION_MS`] for a caller
/// without the agent's write scope, never for the rest.
pub(crate) fn new_task_expiry(agent: &Agent, caller: &Principal, started_ms: i64) -> Option<i64> {
    caller
        .missing_scope(&agent.name, Risk::Write)
        .map(|_| started_ms + READER_TASK_RETENTION_MS)
}

impl StoredTask {
    fn bound_to(&self, call: &str, caller: &Principal) -> bool {
        self.call == call && self.caller == caller.subject
    }

    /// Whether a request is running the skill right now.
    fn running(&self, now_ms: i64, lease_ms: i64) -> bool {
        let until = self.lease_until_ms.unwrap_or_else(|| {
            let since = self
                .task
                .status
                .timestamp
                .map_or(0, |t| t.timestamp_millis());
            since.saturating_add(lease_ms)
        });
        !settled(&self.task.status.state) && now_ms < until
    }

    /// Whether a new request may take the task over and run the call (again): its process died, or it
    /// failed before anything reached the app.
    fn reclaimable(&self, now_ms: i64, lease_ms: i64) -> bool {
        retryable(&self.task.status)
            || (!settled(&self.task.status.state) && !self.running(now_ms, lease_ms))
    }
}

/// Hex SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes))
}

/// Hex SHA-256 over the RFC 8785 canonical form of `{"skill", "args"}`: the same call hashes the
/// same whatever its key order or whitespace.
fn call_hash(skill: &str, args: &Value) -> Result<String, A2AError> {
    let canonical = serde_json_canonicalizer::to_vec(&json!({"skill": skill, "args": args}))
        .map_err(|e| A2AError::invalid_params(format!("args cannot be canonicalised: {e}")))?;
    Ok(sha256_hex(&canonical))
}

/// The store id of the task `task_id` that the caller `subject` sent to `agent`: `<agent>:<caller>:<task id>`.
/// The task id is the message id itself, already the caller's unique, deterministic key for the call. Keyed by
/// their caller, each caller's task ids are its own (another caller's message ids are no concern of it), and
/// ListTasks reads a caller's tasks by id prefix, with no index to write on every task. The subject is hashed so
/// any subject fits the store's key limits.
pub fn task_item_id(agent: &str, subject: &str, task_id: &str) -> String {
    format!("{}{task_id}", caller_prefix(agent, subject))
}

/// The start of every id of `subject`'s tasks on `agent` (see [`task_item_id`]); fixed-length after the agent
/// name, so one caller's prefix never starts another's.
pub(crate) fn caller_prefix(agent: &str, subject: &str) -> String {
    format!("{agent}:{}:", &sha256_hex(subject.as_bytes())[..32])
}

impl Agent {
    async fn load(
        &self,
        subject: &str,
        task_id: &str,
    ) -> Result<Option<(StoredTask, u64)>, A2AError> {
        check_id("task id", task_id)?;
        let Some(item) = self
            .store
            .get_item(
                &self.org,
                TASK_KIND,
                &task_item_id(&self.name, subject, task_id),
            )
            .await
            .map_err(store_failure)?
        else {
            return Ok(None);
        };
        let stored = decode_task(&item.body).map_err(|e| {
            tracing::error!(agent = %self.name, item = %item.id, error = %e, "stored a2a task does not decode");
            A2AError::internal("stored task is unreadable")
        })?;
        Ok(Some((stored, item.version)))
    }

    /// The task `task_id` if the caller `subject` created it, with its store version. Someone else's
    /// task answers exactly as a missing one does, so task ids reveal nothing to other callers.
    pub(crate) async fn own(&self, subject: &str, task_id: &str) -> Result<(Task, u64), A2AError> {
        let (stored, version) = self.own_record(subject, task_id).await?;
        Ok((stored.task, version))
    }

    /// [`Agent::own`] with the whole stored record.
    pub(crate) async fn own_record(
        &self,
        subject: &str,
        task_id: &str,
    ) -> Result<(StoredTask, u64), A2AError> {
        match self.load(subject, task_id).await? {
            Some((stored, version)) if stored.caller == subject => Ok((stored, version)),
            _ => Err(A2AError::task_not_found(task_id)),
        }
    }

    /// Stores `record` as `body` if `cond` holds. `durability` is `Replayable` only for the finished task of a read
    /// ([`read_then_store`]): lost to a power failure, it is made again by running the read again.
    pub(crate) async fn put(
        &self,
        record: &StoredTask,
        body: Vec<u8>,
        cond: Cond,
        durability: Durability,
    ) -> Result<u64, StoreError> {
        let item = Item {
            org: self.org.clone(),
            kind: TASK_KIND.to_string(),
            id: task_item_id(&self.name, &record.caller, &record.task.id),
            version: 0,
            index: None,
            body,
            expires_ms: record.expires_ms,
        };
        self.store.put_item_with(&item, cond, durability).await
    }

    /// The stored bytes of the WORKING `record` with this request's lease, which starts with the write that takes
    /// it, whatever came before.
    fn leased(&self, record: &mut StoredTask) -> Result<Vec<u8>, A2AError> {
        record.lease_until_ms = Some(now_ms().saturating_add(self.lease_ms()));
        storable(record)
    }

    /// How long a stored WORKING task counts as being run by the request that stored it.
    fn lease_ms(&self) -> i64 {
        i64::try_from(self.options.claim_lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// Gives up a WORKING task this request stored (at `version`) when it cannot go on before the skill
    /// starts: the task fails as retryable, so a repeat of the call runs at once instead of after the lease.
    /// Conditional on the version, so a task someone else has taken over meanwhile is left alone.
    async fn withdraw(&self, record: &mut StoredTask, version: u64, why: &str) {
        let (id, context) = (&record.task.id, &record.task.context_id);
        record.task.status = failed_status(id, context, why, true, now_ms());
        let withdrawn = match storable(record) {
            Ok(body) => self
                .put(record, body, Cond::Version(version), Durability::Durable)
                .await
                .map(drop)
                .map_err(store_failure),
            Err(e) => Err(e),
        };
        if let Err(e) = withdrawn {
            tracing::warn!(error = %e, "withdrawing an a2a task");
        }
    }
}

/// What storing a new task found for its message id.
enum Claimed {
    /// This request stored it, at this version; `replaced`: over a task left unfinished or failed retryably.
    Ours { version: u64, replaced: bool },
    /// The same call, finished: its recorded task.
    Finished(Task),
    /// The same call, being run by another request: the task as stored.
    Running(StoredTask),
}

/// Stores `record` as the claim on its message id: WORKING with this request's lease, or (a read, see
/// [`read_then_store`]) already finished. The task item is its own claim, so starting a call is one conditional
/// write. A task left by a process that died (lease over), or a failure that may be repeated, is taken over at its
/// version; of two requests racing for it, one wins.
///
/// `body` is the record's stored bytes ([`Agent::leased`] for a WORKING one); each further try renews them.
async fn claim(
    agent: &Agent,
    record: &mut StoredTask,
    caller: &Principal,
    body: Vec<u8>,
    durability: Durability,
) -> Result<Claimed, A2AError> {
    let mut cond = Cond::Absent;
    let mut first = Some(body);
    // A takeover keeps the stored task's expiry; a new task, this request's.
    let own_expiry = record.expires_ms;
    for _ in 0..CLAIM_ATTEMPTS {
        let body = match first.take() {
            Some(body) => body,
            None if settled(&record.task.status.state) => storable(record)?,
            None => agent.leased(record)?,
        };
        // Only a new task may be replayable: a takeover replaces a durable record, whose push configs hear of it.
        let durability = if cond == Cond::Absent {
            durability
        } else {
            Durability::Durable
        };
        match agent.put(record, body, cond, durability).await {
            Ok(version) => {
                let replaced = cond != Cond::Absent;
                return Ok(Claimed::Ours { version, replaced });
            }
            Err(StoreError::Conflict) => {}
            Err(e) => return Err(store_failure(e)),
        }
        let Some((stored, version)) = agent.load(&record.caller, &record.task.id).await? else {
            record.expires_ms = own_expiry;
            cond = Cond::Absent;
            continue;
        };
        if !stored.bound_to(&record.call, caller) {
            return Err(reused(&record.task.id));
        }
        let (now, lease_ms) = (now_ms(), agent.lease_ms());
        if stored.reclaimable(now, lease_ms) {
            // A task's expiry is the one it was first stored with, which its push configs carry too: a reader's
            // task taken over under a token with more scopes still goes within the hour of its first storing.
            record.expires_ms = stored.expires_ms;
            cond = Cond::Version(version);
        } else if stored.running(now, lease_ms) {
            return Ok(Claimed::Running(stored));
        } else {
            return Ok(Claimed::Finished(stored.task));
        }
    }
    Err(A2AError::internal(
        "the task kept changing while being started; send the message again",
    ))
}

/// Tries at storing a new task before giving up: each lost one means another request changed it meanwhile.
const CLAIM_ATTEMPTS: usize = 3;

fn decode_task(bytes: &[u8]) -> serde_json::Result<StoredTask> {
    serde_json::from_slice(bytes)
}

/// The refusal of a reused message id: the caller's stored task under it is of another call and is not
/// shown.
fn reused(task_id: &str) -> A2AError {
    A2AError::invalid_params(format!(
        "messageId {task_id} was already used for a different call"
    ))
}

/// The approval named in the message metadata, if any.
fn approval_id(message: &Message) -> Result<Option<String>, A2AError> {
    match message
        .metadata
        .as_ref()
        .and_then(|m| m.get(APPROVAL_ID_KEY))
    {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) => {
            check_id(APPROVAL_ID_KEY, id)?;
            Ok(Some(id.clone()))
        }
        Some(_) => Err(A2AError::invalid_params(format!(
            "metadata {APPROVAL_ID_KEY} must be a string"
        ))),
    }
}

/// Whether a call may run: the caller must hold every scope the skill requires, and a destructive
/// skill needs an approval the host admits for exactly this call. `Ok(Err(_))` is a refusal (the
/// task fails for good); `Err(_)` means nothing could be decided.
async fn gate(
    agent: &Agent,
    caller: &Principal,
    skill: &str,
    risk: Risk,
    args: &Value,
    approval_id: Option<&str>,
) -> Result<Result<(), SkillError>, GateError> {
    if let Some(refusal) = scope_refusal(agent, caller, skill, risk) {
        return Ok(Err(refusal));
    }
    let refused = |why: String| Ok(Err(refusal(agent, skill, &why)));
    if risk != Risk::Destructive {
        return Ok(Ok(()));
    }
    let Some(approval_id) = approval_id else {
        return refused(format!(
            "a destructive skill needs a settled approval (message metadata {APPROVAL_ID_KEY})"
        ));
    };
    match agent
        .gate
        .admit(&agent.org, &agent.name, skill, args, approval_id)
        .await
    {
        Ok(()) => Ok(Ok(())),
        Err(GateError::Refused(why)) => refused(format!("approval {approval_id}: {why}")),
        Err(e) => Err(e),
    }
}

/// The refusal of a call whose caller lacks a scope the skill requires.
fn scope_refusal(agent: &Agent, caller: &Principal, skill: &str, risk: Risk) -> Option<SkillError> {
    let scope = caller.missing_scope(&agent.name, risk)?;
    Some(refusal(
        agent,
        skill,
        &format!("the caller's token does not grant {scope}"),
    ))
}

fn refusal(agent: &Agent, skill: &str, why: &str) -> SkillError {
    SkillError::permanent(format!("{}.{skill} refused: {why}", agent.name))
}

/// What SendMessage found for a message id.
pub(crate) enum Begun {
    /// The call already ran: its recorded task.
    Stored(Task),
    /// Another request is running the call: the task as last stored.
    Elsewhere(Task),
    /// This request started the call: the stored WORKING task and the run, which goes on (and
    /// records its outcome) even if the caller stops waiting.
    Started(Task, JoinHandle<Result<Task, A2AError>>),
    /// The agent answered with a message and made no task (conformance mode only).
    Reply(Message),
}

/// SendMessage up to the start of the skill, exactly once per message id of a caller: validate, store
/// the WORKING task (which is the claim on the id, see [`claim`]), ask the approval gate, then spawn
/// the run. A repeat of the same call by the same caller gets the stored task (the WORKING one
/// during the run); the id reused by the caller for another call is refused; another caller's same
/// id is another task. The exception is a read the caller waits for (`waits`: a blocking
/// SendMessage), see [`read_then_store`].
///
/// An approval binds agent, skill and args, not the message id: another message id carrying the
/// same approved call is admitted and repeats the identical action, which the app treats as a
/// no-op (merge of a merged PR answers the same merge sha, closing a closed PR stays closed). A
/// replay with the same message id is the dedupe case and runs nothing.
pub(crate) async fn begin(
    agent: &Arc<Agent>,
    caller: &Principal,
    message: Message,
    push: Option<TaskPushNotificationConfig>,
    waits: bool,
) -> Result<Begun, A2AError> {
    check_id("messageId", &message.message_id)?;
    if let Some(ctx) = &message.context_id {
        check_id("contextId", ctx)?;
    }
    if message.role != Role::User {
        return Err(A2AError::invalid_params(
            "the message role must be ROLE_USER",
        ));
    }
    if too_deep(&message) {
        return Err(A2AError::invalid_params(format!(
            "message data and metadata may nest at most {MAX_DATA_DEPTH} levels"
        )));
    }
    if let Some(media) = unsupported_media(&message) {
        return Err(A2AError::new(
            error_code::CONTENT_TYPE_NOT_SUPPORTED,
            format!("media type {media:?} is not among the card's input modes"),
        ));
    }
    if agent.options.conformance && crate::conformance::scripted(&message) {
        return crate::conformance::begin(agent, caller, message, push).await;
    }
    if let Some(task_id) = &message.task_id
        && task_id != &message.message_id
    {
        // Every call is its own task (no multi-turn skills): continuing another task is not
        // offered. A task id that names no task of this caller is TaskNotFound (A2A §3.4.2).
        agent.own(&caller.subject, task_id).await?;
        return Err(A2AError::unsupported_operation(
            "this agent does not continue tasks; send a new message without taskId",
        ));
    }
    let (skill, args) = skill_call(&message)?;
    let Some(&risk) = agent.risks.get(&skill) else {
        let shown: String = skill.chars().take(64).collect();
        return Err(A2AError::invalid_params(format!("unknown skill {shown:?}")));
    };
    let approval_id = approval_id(&message)?;
    let call = call_hash(&skill, &args)?;

    let task_id = message.message_id.clone();
    let context_id = message
        .context_id
        .clone()
        .unwrap_or_else(|| task_id.clone());
    let started = now_ms();
    let mut record = StoredTask {
        task: Task {
            id: task_id.clone(),
            context_id: context_id.clone(),
            status: status(TaskState::Working, None, started),
            artifacts: None,
            history: Some(vec![Message {
                task_id: Some(task_id.clone()),
                context_id: Some(context_id.clone()),
                ..message
            }]),
            metadata: None,
        },
        call,
        caller: caller.subject.clone(),
        lease_until_ms: None,
        expires_ms: new_task_expiry(agent, caller, started),
    };

    // A config the caller got wrong is refused before anything is stored.
    if let Some(config) = &push {
        crate::push::check_config(config, &agent.options.push)?;
    }
    if risk == Risk::Read && waits && push.is_none() {
        return read_then_store(agent, caller, record, skill, args).await;
    }
    // The WORKING task is stored before anyone is told about it: with returnImmediately the caller's next
    // request may reach another process. A repeat of a stored call ends here, without asking the gate.
    let body = agent.leased(&mut record)?;
    let version = match claim(agent, &mut record, caller, body, Durability::Durable).await? {
        Claimed::Ours { version, .. } => version,
        // A finished task sends no more updates: a webhook given now has nothing to get.
        Claimed::Finished(task) => return Ok(Begun::Stored(task)),
        Claimed::Running(stored) => {
            if let Some(config) = push {
                crate::push::create_config(agent, &stored, config).await?;
            }
            return Ok(Begun::Elsewhere(stored.task));
        }
    };
    let admitted = match gate(agent, caller, &skill, risk, &args, approval_id.as_deref()).await {
        Ok(admitted) => admitted,
        Err(e) => {
            // Nothing ran: the same call can be decided again at once.
            tracing::error!(error = %e, "a2a approval gate");
            let why = "the approval check is unavailable";
            agent.withdraw(&mut record, version, why).await;
            return Err(A2AError::internal(why));
        }
    };
    let with_push = push.is_some();
    if let Some(config) = push
        && let Err(e) = crate::push::create_config(agent, &record, config).await
    {
        agent
            .withdraw(
                &mut record,
                version,
                "the push notification config could not be stored",
            )
            .await;
        return Err(e);
    }
    let shown = record.task.clone();
    // Only a config given with this message can exist yet: CreateTaskPushNotificationConfig needs
    // the stored task, which was written a moment ago. A config registered from now on gets the
    // updates from now on, so the store is not read for configs on this hot path (one read less
    // per SendMessage).
    if with_push {
        let update = vec![StreamResponse::Task(shown.clone())];
        crate::push::notify(agent, &caller.subject, &task_id, update).await;
    }
    let run = tokio::spawn(run(agent.clone(), record, version, skill, args, admitted));
    Ok(Begun::Started(shown, run))
}

/// Runs a read for a caller who waits for its answer, then stores the finished task: one store write, where a call
/// with an effect takes two writes and a read (the WORKING claim, the outcome, the push configs to notify). A read
/// changes nothing at its app, so running it more than once does no harm, and it needs no claim. What that changes:
/// until the read ends its task is not stored (GetTask, CancelTask, SubscribeToTask and push-config calls on its id
/// answer TaskNotFound, and no push config can name it, so none is read); a process that dies during it stores
/// nothing, as does a caller leaving before the answer (the read stops with its request); a repeat of a stored call
/// runs the read again and answers the stored task, as [`claim`] finds it; a message id reused for another call
/// runs the read before the request is refused; and a new task is stored replayable (`Durability::Replayable`), so a
/// power loss soon after the answer may take it with it: its id then answers TaskNotFound, and a repeat runs the
/// read again (a takeover of a stored task is durable, see [`claim`]).
async fn read_then_store(
    agent: &Arc<Agent>,
    caller: &Principal,
    mut record: StoredTask,
    skill: String,
    args: Value,
) -> Result<Begun, A2AError> {
    let admitted = scope_refusal(agent, caller, &skill, Risk::Read).map_or(Ok(()), Err);
    // A skill that panics fails its call alone, as a spawned run does (see `finish`).
    let body = AssertUnwindSafe(settle(agent, &mut record, &skill, args, admitted))
        .catch_unwind()
        .await
        .map_err(|_| A2AError::internal("the skill run ended abnormally: it panicked"))??;
    Ok(
        match claim(agent, &mut record, caller, body, Durability::Replayable).await? {
            Claimed::Ours { replaced, .. } => {
                if replaced {
                    // The task taken over was stored before, and may have push configs.
                    let update = vec![StreamResponse::Task(record.task.clone())];
                    crate::push::notify(agent, &record.caller, &record.task.id, update).await;
                }
                Begun::Stored(record.task)
            }
            Claimed::Finished(task) => Begun::Stored(task),
            Claimed::Running(stored) => Begun::Elsewhere(stored.task),
        },
    )
}

/// Runs an admitted call (or records its refusal), stores the finished task and settles the claim.
async fn run(
    agent: Arc<Agent>,
    mut record: StoredTask,
    working_version: u64,
    skill: String,
    args: Value,
    admitted: Result<(), SkillError>,
) -> Result<Task, A2AError> {
    let working = record.task.clone();
    let body = settle(&agent, &mut record, &skill, args, admitted).await?;
    let task_id = record.task.id.clone();
    // Conditional on the WORKING version: if the task changed meanwhile, another process took it
    // over after this run's lease ran out (and, say, canceled it); its record stands.
    match agent
        .put(
            &record,
            body,
            Cond::Version(working_version),
            Durability::Durable,
        )
        .await
    {
        Ok(_) => {}
        Err(StoreError::Conflict) => {
            tracing::warn!(task = %task_id, "a2a task changed while its skill ran; keeping the stored one");
            return match agent.load(&record.caller, &task_id).await? {
                Some((stored, _)) => Ok(stored.task),
                None => Err(A2AError::task_not_found(&task_id)),
            };
        }
        Err(e) => {
            // The effect may have happened but is not recorded. The store failing here is rare and the caller
            // hears an error either way; a repeat of the call runs the skill again once the lease is over (most
            // skills look up what they may have made).
            return Err(store_failure(e));
        }
    }
    let update = changes(&working, &record.task);
    crate::push::notify(&agent, &record.caller, &task_id, update).await;
    Ok(record.task)
}

/// Runs an admitted call (or takes its refusal) and sets `record` to the finished task: COMPLETED with the skill's
/// output, or FAILED. Returns the record's stored bytes.
async fn settle(
    agent: &Agent,
    record: &mut StoredTask,
    skill: &str,
    args: Value,
    admitted: Result<(), SkillError>,
) -> Result<Vec<u8>, A2AError> {
    // A skill must end before its claim's lease does, or a repeat would run it a second time
    // alongside. Cut off, its effect is unknown, and not every skill can be repeated safely (a
    // chat message has no dedupe key): the failure is final, and a person looks at what happened.
    let timeout = agent.options.skill_timeout();
    let outcome = match admitted {
        Err(refusal) => Err(refusal),
        Ok(()) => match tokio::time::timeout(timeout, agent.skills.invoke(skill, args)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(SkillError::permanent(format!(
                "the skill did not finish within {} ms; whether it took effect is unknown",
                timeout.as_millis()
            ))),
        },
    };
    let finished = now_ms();
    // Once settled the lease no longer counts (see `running`); a retryable failure (nothing happened on the
    // app's side) lets a repeat of the same message id try again at once (see `reclaimable`).
    let task_id = record.task.id.clone();
    let context_id = record.task.context_id.clone();
    // An output the store could not read back (an app's JSON passed through) fails like one too large to store.
    let outcome = outcome.and_then(|output| {
        if nests_deeper_than(&output, MAX_DATA_DEPTH) {
            Err(SkillError::permanent(format!(
                "skill output nests deeper than {MAX_DATA_DEPTH} levels"
            )))
        } else {
            Ok(output)
        }
    });
    let task = &mut record.task;
    match outcome {
        Ok(output) => {
            task.status = status(TaskState::Completed, None, finished);
            task.artifacts = Some(vec![Artifact {
                artifact_id: format!("{task_id}:output"),
                name: Some("output".into()),
                description: None,
                parts: vec![a2a::Part::data(output)],
                metadata: None,
                extensions: None,
            }]);
        }
        Err(e) => {
            task.status = failed_status(&task_id, &context_id, &e.message, e.retryable, finished)
        }
    }
    let mut body = storable(record)?;
    if body.len() > limits::MAX_BODY {
        // Too big to store means too big to dedupe; report it as a permanent failure of the call.
        let why = format!("skill output exceeds {} bytes", limits::MAX_BODY);
        record.task.artifacts = None;
        record.task.status = failed_status(&task_id, &context_id, &why, false, finished);
        body = storable(record)?;
    }
    Ok(body)
}

/// The record's stored bytes. The history holds the request, which may be large (file contents
/// for a commit); when the record would not fit in a store item the history is dropped, since the
/// caller has the request anyway. Still too large is left to the caller to handle.
pub(crate) fn storable(record: &mut StoredTask) -> Result<Vec<u8>, A2AError> {
    let encode =
        |r: &StoredTask| serde_json::to_vec(r).map_err(|e| A2AError::internal(e.to_string()));
    let body = encode(record)?;
    if body.len() <= limits::MAX_BODY || record.task.history.is_none() {
        return Ok(body);
    }
    record.task.history = None;
    encode(record)
}

fn agent_message(task_id: &str, context_id: &str, suffix: &str, parts: Vec<a2a::Part>) -> Message {
    Message {
        message_id: format!("{task_id}:{suffix}"),
        context_id: Some(context_id.to_string()),
        task_id: Some(task_id.to_string()),
        role: Role::Agent,
        parts,
        metadata: None,
        extensions: None,
        reference_task_ids: None,
    }
}

fn failed_status(
    task_id: &str,
    context_id: &str,
    error: &str,
    retryable: bool,
    at_ms: i64,
) -> TaskStatus {
    let message = agent_message(
        task_id,
        context_id,
        "status",
        vec![
            a2a::Part::text(error),
            a2a::Part::data(json!({"retryable": retryable})),
        ],
    );
    status(TaskState::Failed, Some(message), at_ms)
}

/// Whether `status` is a failure that [`failed_status`] marked retryable.
pub(crate) fn retryable(status: &TaskStatus) -> bool {
    status.state == TaskState::Failed
        && status.message.as_ref().is_some_and(|m| {
            m.parts.iter().any(|p| match &p.content {
                PartContent::Data(v) => v.get("retryable").and_then(Value::as_bool) == Some(true),
                _ => false,
            })
        })
}

pub(crate) async fn get_task(
    agent: &Agent,
    caller: &Principal,
    task_id: &str,
    history: Option<i32>,
) -> Result<Task, A2AError> {
    let history = history_length(history)?;
    let (task, _) = agent.own(&caller.subject, task_id).await?;
    Ok(trim_history(task, history))
}

/// CancelTask. A running skill cannot be withdrawn (its effect on the app may already have
/// happened), so a task is cancelable only while nobody runs it: its lease ran out, as after the
/// process that started it died. The canceled task is written at the version read, so a run that
/// finished meanwhile keeps its outcome, and a repeat of the call returns the canceled task instead
/// of running the skill.
pub(crate) async fn cancel_task(
    agent: &Arc<Agent>,
    caller: &Principal,
    task_id: &str,
) -> Result<Task, A2AError> {
    let not_cancelable = |why: &str| {
        A2AError::new(
            error_code::TASK_NOT_CANCELABLE,
            format!("task {task_id} {why}"),
        )
    };
    let (mut record, version) = agent.own_record(&caller.subject, task_id).await?;
    if record.task.status.state.is_terminal() {
        return Err(not_cancelable("is in a terminal state"));
    }
    let now = now_ms();
    if record.running(now, agent.lease_ms()) {
        return Err(not_cancelable(
            "is running a skill that cannot be interrupted",
        ));
    }
    let before = record.task.clone();
    let message = agent_message(
        task_id,
        &record.task.context_id,
        "canceled",
        vec![a2a::Part::text("canceled by the caller")],
    );
    record.task.status = status(TaskState::Canceled, Some(message), now);
    let body = storable(&mut record)?;
    agent
        .put(&record, body, Cond::Version(version), Durability::Durable)
        .await
        .map_err(|e| match e {
            StoreError::Conflict => not_cancelable("changed while being canceled"),
            other => store_failure(other),
        })?;
    let update = changes(&before, &record.task);
    crate::push::notify(agent, &caller.subject, task_id, update).await;
    Ok(record.task)
}

/// SubscribeToTask: the caller's non-terminal task, to be followed with [`follow`].
pub(crate) async fn subscribable(
    agent: &Agent,
    caller: &Principal,
    task_id: &str,
) -> Result<Task, A2AError> {
    let (task, _) = agent.own(&caller.subject, task_id).await?;
    if task.status.state.is_terminal() {
        return Err(A2AError::unsupported_operation(format!(
            "task {task_id} is in a terminal state and has no more updates"
        )));
    }
    Ok(task)
}

/// The events that turn `before` into `after`: new artifacts, then the status if it changed.
pub(crate) fn changes(before: &Task, after: &Task) -> Vec<StreamResponse> {
    let mut events = Vec::new();
    let known: Vec<&str> = before
        .artifacts
        .iter()
        .flatten()
        .map(|a| a.artifact_id.as_str())
        .collect();
    for artifact in after.artifacts.iter().flatten() {
        if !known.contains(&artifact.artifact_id.as_str()) {
            events.push(StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
                task_id: after.id.clone(),
                context_id: after.context_id.clone(),
                artifact: artifact.clone(),
                append: None,
                last_chunk: Some(true),
                metadata: None,
            }));
        }
    }
    if after.status != before.status {
        events.push(StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: after.id.clone(),
            context_id: after.context_id.clone(),
            status: after.status.clone(),
            metadata: None,
        }));
    }
    events
}

/// Streams `first`, then every change of the stored task until it settles (terminal or
/// interrupted), the subscriber leaves, or `max_follow` passes (the client may subscribe again).
/// Reading the store, not a channel, is what lets a restarted process serve the subscription.
pub(crate) async fn follow(agent: Arc<Agent>, caller: Principal, first: Task, tx: EventTx) {
    let deadline = Instant::now() + agent.options.max_follow;
    let mut last = first.clone();
    if tx.send(Ok(StreamResponse::Task(first))).await.is_err() {
        return;
    }
    // A task that is already interrupted (INPUT_REQUIRED) is followed until it moves on: its
    // subscriber is waiting for what the next message makes of it. Otherwise the stream ends at
    // the next settled state, as a SendStreamingMessage stream does.
    let mut moved = !settled(&last.status.state);
    while !(last.status.state.is_terminal() || moved && settled(&last.status.state))
        && Instant::now() < deadline
    {
        tokio::time::sleep(agent.options.poll_interval).await;
        if tx.is_closed() {
            return;
        }
        let now = match agent.own(&caller.subject, &last.id).await {
            Ok((task, _)) => task,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        moved |= now.status != last.status;
        for event in changes(&last, &now) {
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
        last = now;
    }
}

/// Streams a call this request started: the WORKING task, then what its run changed.
pub(crate) async fn stream_run(
    working: Task,
    run: JoinHandle<Result<Task, A2AError>>,
    tx: EventTx,
) {
    if tx
        .send(Ok(StreamResponse::Task(working.clone())))
        .await
        .is_err()
    {
        return;
    }
    let outcome = match run.await {
        Ok(outcome) => outcome,
        Err(e) => Err(A2AError::internal(format!(
            "the skill run ended abnormally: {e}"
        ))),
    };
    match outcome {
        Ok(done) => {
            for event in changes(&working, &done) {
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        }
        Err(e) => {
            let _ = tx.send(Err(e)).await;
        }
    }
}

/// Waits for a run this request started (blocking SendMessage).
pub(crate) async fn finish(run: JoinHandle<Result<Task, A2AError>>) -> Result<Task, A2AError> {
    run.await
        .map_err(|e| A2AError::internal(format!("the skill run ended abnormally: {e}")))?
}

/// Keyset position of a task in ListTasks order (newest status first, then by id).
#[derive(Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Clone)]
struct Position {
    /// Negated status time in ms, so ascending order is newest first.
    t: i64,
    i: String,
}

impl Position {
    fn of(task: &Task) -> Self {
        Position {
            t: -task.status.timestamp.map_or(0, |t| t.timestamp_millis()),
            i: task.id.clone(),
        }
    }

    fn token(&self) -> String {
        B64.encode(serde_json::to_vec(self).unwrap_or_default())
    }

    fn parse(token: &str) -> Result<Self, A2AError> {
        let bad = || A2AError::invalid_params("invalid pageToken");
        if token.len() > MAX_PAGE_TOKEN {
            return Err(bad());
        }
        let bytes = B64.decode(token).map_err(|_| bad())?;
        serde_json::from_slice(&bytes).map_err(|_| bad())
    }
}

/// The size of `task` as JSON, counted without keeping the text.
fn json_len(task: &Task) -> usize {
    let mut size = ByteCount(0);
    // Serialising a task to a counter cannot fail; counted as nothing if it did.
    let _ = serde_json::to_writer(&mut size, task);
    size.0
}

/// Counts the bytes written to it, to size JSON without keeping it.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// ListTasks over the caller's tasks on this agent, newest status first, with keyset pagination
/// (a page token names the last task shown, so inserts do not shift later pages).
pub(crate) async fn list_tasks(
    agent: &Agent,
    caller: &Principal,
    req: &ListTasksRequest,
) -> Result<ListTasksResponse, A2AError> {
    let page_size = match req.page_size {
        None => DEFAULT_PAGE_SIZE,
        Some(n) => usize::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_PAGE_SIZE).contains(n))
            .ok_or_else(|| {
                A2AError::invalid_params(format!("pageSize must be 1..={MAX_PAGE_SIZE}"))
            })?,
    };
    let history = history_length(req.history_length)?;
    let after = match req.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => Some(Position::parse(token)?),
    };
    if let Some(ctx) = &req.context_id {
        check_id("contextId", ctx)?;
    }
    let prefix = caller_prefix(&agent.name, &caller.subject);
    // Each kept task is cut to what the response shows at once, so the scan holds one store page plus at most
    // 2 × pageSize shown tasks.
    let shown = |task: Task| {
        let mut task = trim_history(task, history);
        if req.include_artifacts != Some(true) {
            task.artifacts = None;
        }
        task
    };
    // The scan counts every match (totalSize) and keeps only the matches after the token's
    // position, cut back to the page from time to time, so the page needs no second read.
    let mut total = 0usize;
    let mut after_token = 0usize;
    let mut page_tasks: Vec<(Position, Task)> = Vec::new();
    let mut page = Page::first(LIST_STORE_PAGE);
    let mut scanned = 0usize;
    let (mut unreadable, mut first_unreadable) = (0usize, None::<String>);
    loop {
        let got = agent
            .store
            .list_items_with_prefix(&agent.org, TASK_KIND, &prefix, page.clone())
            .await
            .map_err(store_failure)?;
        scanned += got.items.len();
        for item in &got.items {
            // A damaged record must not hide the caller's others: it is left out, and reported below.
            let Ok(stored) = decode_task(&item.body) else {
                unreadable += 1;
                first_unreadable.get_or_insert_with(|| item.id.clone());
                continue;
            };
            // The prefix holds a hash of the subject: check the subject itself.
            if stored.caller != caller.subject {
                continue;
            }
            let task = stored.task;
            let keep = req
                .context_id
                .as_ref()
                .is_none_or(|c| &task.context_id == c)
                && req
                    .status
                    .as_ref()
                    .is_none_or(|s| *s == TaskState::Unspecified || &task.status.state == s)
                && req
                    .status_timestamp_after
                    .is_none_or(|t| task.status.timestamp.is_some_and(|ts| ts > t));
            if !keep {
                continue;
            }
            total += 1;
            let position = Position::of(&task);
            if after.as_ref().is_some_and(|a| position <= *a) {
                continue;
            }
            after_token += 1;
            page_tasks.push((position, shown(task)));
            if page_tasks.len() >= 2 * page_size {
                page_tasks.sort_by(|a, b| a.0.cmp(&b.0));
                page_tasks.truncate(page_size);
            }
        }
        match got.next {
            Some(next) if scanned < MAX_LIST_SCAN => page.cursor = Some(next),
            Some(_) => {
                tracing::warn!(agent = %agent.name, "ListTasks stopped after {MAX_LIST_SCAN} tasks");
                break;
            }
            None => break,
        }
    }
    if let Some(first) = first_unreadable {
        // Once per listing, not per record: every listing of this caller meets the same records.
        tracing::error!(agent = %agent.name, unreadable, first = %first, "ListTasks left out task records that do not decode");
    }
    page_tasks.sort_by(|a, b| a.0.cmp(&b.0));
    page_tasks.truncate(page_size);
    let mut budget = limits::ByteBudget::new(MAX_LIST_BYTES);
    let fit = page_tasks
        .iter()
        .take_while(|(_, task)| budget.take(json_len(task)))
        .count();
    let cut_short = fit < page_tasks.len();
    page_tasks.truncate(fit);
    let next_page_token = if after_token > page_size || cut_short {
        page_tasks
            .last()
            .map(|(p, _)| p.token())
            .unwrap_or_default()
    } else {
        String::new()
    };
    let tasks = page_tasks.into_iter().map(|(_, task)| task).collect();
    Ok(ListTasksResponse {
        tasks,
        next_page_token,
        page_size: i32::try_from(page_size).unwrap_or(i32::MAX),
        total_size: i32::try_from(total).unwrap_or(i32::MAX),
    })
}
