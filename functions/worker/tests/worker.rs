//! The worker on the in-memory SQLite backend with scripted agents and model: whole runs driven through the queue,
//! and the crash and concurrency cases of one message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use loams_factory::approval::{Approval, ApprovalState};
use loams_factory::{
    AUDIT_APPROVAL, Envelope, Input, LEAD_APPROVAL, Outcome, Run, RunState, Signal,
    run_kill_switch_id,
};
use loams_model::{ChatModel, ChatRequest, ChatResponse, ModelError};
use loams_platform::{
    Claim, Clock, Cond, Counting, Item, ManualClock, OpCounts, Page, Queue, Sqlite, Store, Timers,
};
use loams_worker::{AgentCaller, AgentReply, Scheduler, Worker, WorkerDeps, WorkerError};
use serde_json::{Value, json};

const ORG: &str = "acme";
const PATCH: &str = "Divide by 100.\n\n=== src/checkout.py\n```python\ndef apply_discount(price, percent):\n    return price * (1 - percent / 100)\n```\n";

/// Agents that answer every skill of the contract's table, A2A-like: a repeated step id (message id) gets the
/// stored answer and performs nothing.
#[derive(Default)]
struct FakeAgents {
    /// Error events GlitchTip reports after the merge (above the threshold: regressed).
    error_events: u64,
    /// What `forgejo.read_files` answers instead of the one small file.
    read_files: Option<Value>,
    /// step id -> (agent.skill, answer), and how many times each step id was called.
    answered: Mutex<HashMap<String, (String, Value)>>,
    calls: Mutex<HashMap<String, u32>>,
    /// After answering this `agent.skill`, someone turns on the organisation's kill switch in this store.
    kill_after: Mutex<Option<(String, Arc<Sqlite>)>>,
}

impl FakeAgents {
    fn output(&self, agent: &str, skill: &str, step: &str) -> Value {
        match (agent, skill) {
            ("zulip", "open_thread") => json!({"message_id": 1, "url": "https://chat/1"}),
            ("zulip", "post") => json!({"message_id": 2}),
            ("plane", "create_issue") => {
                json!({"id": "i-1", "key": "ACME-1", "url": "https://plane/1", "created": true})
            }
            ("plane", "comment") => json!({"id": "c-1"}),
            ("plane", "set_state") => json!({"state": "completed"}),
            ("forgejo", "read_files") if self.read_files.is_some() => {
                self.read_files.clone().unwrap()
            }
            ("forgejo", "read_files") => {
                json!({"files": [{"path": "src/checkout.py", "content": "def apply_discount(price, percent):\n    return price / 0\n"}]})
            }
            ("forgejo", "commit_patch") => json!({"sha": "c0ffee"}),
            ("forgejo", "open_pr") => {
                json!({"number": 7, "url": "https://git/pr/7", "head_sha": "c0ffee"})
            }
            ("forgejo", "ci_status") => json!({"state": "success", "log": "ok"}),
            ("forgejo", "merge") => json!({"merge_sha": "m3rge"}),
            ("forgejo", "revert") => {
                json!({"number": 8, "url": "https://git/pr/8", "head_sha": "r3v"})
            }
            ("forgejo", "close_pr") => json!({"closed": true}),
            ("glitchtip", "issue_events") => {
                json!({"count": self.error_events, "last_seen_ms": null})
            }
            ("glitchtip", "resolve") => json!({"status": "resolved"}),
            ("analytics", "series") => json!({"points": [], "total": 0}),
            _ => panic!("step {step} calls {agent}.{skill}, which is not in the skills table"),
        }
    }

    fn calls_of(&self, step: &str) -> u32 {
        self.calls.lock().unwrap().get(step).copied().unwrap_or(0)
    }
}

#[async_trait]
impl AgentCaller for FakeAgents {
    async fn call(
        &self,
        agent: &str,
        step: &str,
        skill: &str,
        _args: Value,
        _approval_id: Option<&str>,
    ) -> AgentReply {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(step.to_string())
            .or_default() += 1;
        let (called, answer) = self
            .answered
            .lock()
            .unwrap()
            .entry(step.to_string())
            .or_insert_with(|| (format!("{agent}.{skill}"), self.output(agent, skill, step)))
            .clone();
        // One message id is one call: the same id for another call would be a worker bug.
        assert_eq!(
            called,
            format!("{agent}.{skill}"),
            "message id {step} reused for another call"
        );
        let kill = self
            .kill_after
            .lock()
            .unwrap()
            .clone()
            .filter(|(after, _)| *after == called);
        if let Some((_, db)) = kill {
            db.put_item(&kill_switch("org"), Cond::Any).await.unwrap();
        }
        AgentReply::Done(answer)
    }
}

/// A model that answers each purpose with a fixed text and counts what it was paid for.
#[derive(Default)]
struct FakeModel {
    paid: Mutex<Vec<String>>,
    /// What the "fix" purpose answers instead of PATCH.
    fix: Mutex<Option<String>>,
    /// Why the "fix" purpose answers a completion with nothing to use, its tokens told.
    fix_unusable: Mutex<Option<String>>,
    /// How many "fix" calls fail in transit before one gets through.
    fix_failures: Mutex<u32>,
    /// While the "fix" purpose is asked, someone turns on the kill switch of this id in this store, and the answer
    /// never comes.
    fix_killed: Mutex<Option<(Arc<Sqlite>, String)>>,
}

#[async_trait]
impl ChatModel for FakeModel {
    async fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError> {
        self.paid.lock().unwrap().push(req.purpose.clone());
        if req.purpose == "fix" {
            let mut failures = self.fix_failures.lock().unwrap();
            if *failures > 0 {
                *failures -= 1;
                return Err(ModelError::Transport("connection reset".into()));
            }
        }
        let killed = self.fix_killed.lock().unwrap().clone();
        if let Some((db, switch)) = killed.filter(|_| req.purpose == "fix") {
            db.put_item(&kill_switch(&switch), Cond::Any).await.unwrap();
            std::future::pending::<()>().await;
        }
        let unusable = self.fix_unusable.lock().unwrap().clone();
        if let Some(why) = unusable.filter(|_| req.purpose == "fix") {
            return Err(ModelError::Unusable {
                why,
                input_tokens: 100,
                output_tokens: 20,
            });
        }
        let text = match req.purpose.as_str() {
            "fix" => self
                .fix
                .lock()
                .unwrap()
                .clone()
                .unwrap_or_else(|| PATCH.to_string()),
            "lead_review" => LEAD_APPROVAL.to_string(),
            "security_audit" => format!(
                "LOW src/checkout.py:2 negative percent; exploit: none; remedy: clamp\n\n{AUDIT_APPROVAL}"
            ),
            other => panic!("unexpected purpose {other}"),
        };
        Ok(ChatResponse {
            text,
            model: "fake".into(),
            input_tokens: 100,
            output_tokens: 20,
        })
    }
}

struct Harness {
    clock: Arc<ManualClock>,
    db: Arc<Sqlite>,
    agents: Arc<FakeAgents>,
    model: Arc<FakeModel>,
    worker: Worker,
    scheduler: Scheduler,
}

impl Harness {
    fn new(agents: FakeAgents, max_generations: u32) -> Harness {
        Harness::with_config(
            agents,
            loams_factory::Config {
                max_generations,
                ..loams_factory::Config::default()
            },
        )
    }

    fn with_config(agents: FakeAgents, config: loams_factory::Config) -> Harness {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let db = Arc::new(Sqlite::memory(clock.clone()).unwrap());
        let agents = Arc::new(agents);
        let model = Arc::new(FakeModel::default());
        let worker = Harness::worker(&clock, &db, &agents, &model, config);
        let scheduler = Scheduler::new(db.clone(), db.clone(), clock.clone());
        Harness {
            clock,
            db,
            agents,
            model,
            worker,
            scheduler,
        }
    }

    /// A worker on the harness's backend (several may share it, like several processes).
    fn worker<B: Store + Queue + Timers + 'static>(
        clock: &Arc<ManualClock>,
        db: &Arc<B>,
        agents: &Arc<FakeAgents>,
        model: &Arc<FakeModel>,
        config: loams_factory::Config,
    ) -> Worker {
        let policy = loams_factory::Policy {
            auto_triage: true,
            ..loams_factory::Policy::default()
        };
        Worker::new(WorkerDeps {
            store: db.clone(),
            queue: db.clone(),
            timers: db.clone(),
            clock: clock.clone(),
            agents: agents.clone(),
            model: model.clone(),
            env: "prod".into(),
            config,
            policy,
            prices: loams_factory::Prices::default(),
            owner: Some("oncall".into()),
        })
    }

    async fn run(&self, id: &str) -> Run {
        let row = self.db.get_run(ORG, id).await.unwrap().unwrap();
        serde_json::from_slice(&row.snapshot).unwrap()
    }

    async fn version(&self, id: &str) -> u64 {
        self.db.get_run(ORG, id).await.unwrap().unwrap().version
    }

    async fn send(&self, run: &str, input: Option<Input>) {
        let envelope = Envelope {
            input,
            ..continuation(run)
        };
        self.db
            .send(&serde_json::to_vec(&envelope).unwrap(), 0)
            .await
            .unwrap();
    }

    /// Approves `approval` as the API does: the decision stored, then a message to the run.
    async fn approve(&self, run: &str, approval: Item) {
        let mut record: Approval = serde_json::from_slice(&approval.body).unwrap();
        record.state = ApprovalState::Approved;
        let stored = Item {
            body: serde_json::to_vec(&record).unwrap(),
            index: None,
            ..approval.clone()
        };
        self.db
            .put_item(&stored, Cond::Version(approval.version))
            .await
            .unwrap();
        let input = Input::ApprovalSettled {
            approval_id: approval.id,
            approved: true,
            by: "alice".into(),
        };
        self.send(run, Some(input)).await;
    }

    /// Drives the queue, the timers and a person approving every pending approval (as the API does) until run
    /// `id` has ended. Time moves only while nothing is left to do.
    async fn drive(&self, id: &str) -> Run {
        let mut settled = Vec::new();
        for _ in 0..2_000 {
            let run = self.run(id).await;
            if run.state.is_terminal() {
                return run;
            }
            let mut busy =
                self.worker.run_once().await.unwrap() + self.scheduler.fire_due().await.unwrap();
            let pending = self
                .db
                .list_items(ORG, "approval", Some("pending"), Page::first(10))
                .await
                .unwrap();
            for approval in pending.items {
                if !settled.contains(&approval.id) {
                    settled.push(approval.id.clone());
                    self.approve(id, approval).await;
                    busy += 1;
                }
            }
            if busy == 0 {
                self.clock.advance(5_000);
            }
        }
        panic!("run {id} did not end: {:?}", self.run(id).await);
    }
}

fn signal(fingerprint: &str) -> Signal {
    Signal {
        source: "glitchtip".into(),
        fingerprint: fingerprint.into(),
        title: "ZeroDivisionError: division by zero".into(),
        link: "https://glitchtip/issues/1".into(),
        glitchtip_issue_id: Some("1".into()),
        severity: "error".into(),
        generation: 1,
        parent_run: None,
    }
}

#[tokio::test]
async fn a_run_driven_through_the_queue_succeeds_performing_each_step_once() {
    let h = Harness::new(FakeAgents::default(), 2);
    let opened = h.worker.open(ORG, signal("fp-1")).await.unwrap();
    assert!(opened.created);
    // Opening the same signal again is a no-op.
    assert!(!h.worker.open(ORG, signal("fp-1")).await.unwrap().created);

    let run = h.drive(&opened.run_id).await;
    assert_eq!(run.state.as_str(), "succeeded", "{run:?}");
    assert_eq!(run.links.deploy_ref.as_deref(), Some("m3rge"));
    assert_eq!(
        *h.model.paid.lock().unwrap(),
        ["fix", "lead_review", "security_audit"]
    );
    let calls = h.agents.calls.lock().unwrap().clone();
    let skills: Vec<String> = {
        let answered = h.agents.answered.lock().unwrap();
        let mut s: Vec<String> = answered.values().map(|(skill, _)| skill.clone()).collect();
        s.sort();
        s
    };
    for skill in [
        "zulip.open_thread",
        "plane.create_issue",
        "forgejo.commit_patch",
        "forgejo.open_pr",
        "forgejo.merge",
        "glitchtip.resolve",
        "plane.set_state",
    ] {
        assert_eq!(
            skills.iter().filter(|s| *s == skill).count(),
            1,
            "{skill} in {skills:?}"
        );
    }
    // The second open's duplicate continuation makes some steps run twice side by side: always under the same
    // message id, so the agent performed each once, and nothing was recorded as a failure.
    assert!(calls.values().all(|n| *n <= 2), "{calls:?}");
    let events = h.db.events(ORG, &opened.run_id, 0, 500).await.unwrap();
    assert!(
        events
            .iter()
            .all(|e| serde_json::from_slice::<Value>(&e.body).unwrap()["type"] != "step_failed")
    );
    // The approval was stored once, under the request's step id.
    let approvals =
        h.db.list_items(ORG, "approval", None, Page::first(10))
            .await
            .unwrap();
    assert_eq!(approvals.items.len(), 1);
    assert!(h.db.dead_letters(10).await.unwrap().is_empty());
}

/// `forgejo.read_files`'s answer: these files, each holding `content`.
fn files_read(paths: &[&str], content: &str) -> Value {
    let files: Vec<Value> = paths
        .iter()
        .map(|path| json!({"path": path, "content": content}))
        .collect();
    json!({ "files": files })
}

fn harness_reading(files: Value) -> Harness {
    Harness::new(
        FakeAgents {
            read_files: Some(files),
            ..FakeAgents::default()
        },
        2,
    )
}

fn times_answered(h: &Harness, skill: &str) -> usize {
    let answered = h.agents.answered.lock().unwrap();
    answered.values().filter(|(s, _)| s == skill).count()
}

#[tokio::test]
async fn files_too_large_for_a_run_to_keep_fail_the_step_and_the_run_says_why() {
    // Two files within the engine's limit for one file, together more than a run may hold: before, the store
    // refused every append of the files read, and the run waited for ever on a dead-lettered message.
    let content = "x = 1\n".repeat(40_000);
    let h = harness_reading(files_read(&["src/checkout.py", "src/cart.py"], &content));
    let opened = h.worker.open(ORG, signal("fp-large")).await.unwrap();
    let run = h.drive(&opened.run_id).await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let ending = run.ending.expect("an ended run has its ending");
    assert!(ending.detail.contains("a run keeps"), "{ending:?}");
    assert!(run.files.is_empty(), "{} files kept", run.files.len());
    // Not retried: the same files would be too large again.
    assert_eq!(times_answered(&h, "forgejo.read_files"), 1);
    assert!(h.db.dead_letters(10).await.unwrap().is_empty());
}

/// Drives a run whose fix answer cannot be used until it fails saying `why`: the answer was paid once, the run's
/// budget counts it, and no message was dead-lettered on the way.
async fn fails_after_one_paid_fix(h: &Harness, fingerprint: &str, why: &str) -> Run {
    let opened = h.worker.open(ORG, signal(fingerprint)).await.unwrap();
    let run = h.drive(&opened.run_id).await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let detail = &run.ending.as_ref().expect("ended").detail;
    assert!(detail.contains(why), "{detail}");
    assert_eq!(*h.model.paid.lock().unwrap(), ["fix"]);
    assert_eq!(run.budget.tokens, 120);
    assert!(h.db.dead_letters(10).await.unwrap().is_empty());
    run
}

#[tokio::test]
async fn a_patch_too_large_for_the_run_fails_the_step_after_recording_the_paid_answer() {
    let h = harness_reading(files_read(&["src/checkout.py"], &"x = 1\n".repeat(25_000)));
    let patch = format!(
        "Rewrite.\n\n=== src/checkout.py\n```python\n{}```\n",
        "y = 2\n".repeat(33_000)
    );
    *h.model.fix.lock().unwrap() = Some(patch);
    let run = fails_after_one_paid_fix(&h, "fp-large-patch", "a run keeps").await;
    assert!(run.patch.is_empty());
}

#[tokio::test]
async fn a_model_answer_larger_than_a_store_keeps_is_paid_once_and_fails_the_step() {
    // Kept whole as the call's idempotency result, the answer was refused by the store on every delivery and paid
    // for again each time the claim's lease ran out, until the message was dead-lettered.
    let h = Harness::new(FakeAgents::default(), 2);
    *h.model.fix.lock().unwrap() = Some("x".repeat(loams_platform::limits::MAX_BODY));
    fails_after_one_paid_fix(&h, "fp-huge-answer", "a store keeps").await;
}

/// The tokens the organisation's spend counts this month.
async fn org_tokens(h: &Harness) -> u64 {
    let spend = h.db.list_items(ORG, "spend", None, Page::first(10));
    (spend.await.unwrap().items.iter())
        .map(|item| serde_json::from_slice::<Value>(&item.body).unwrap()["tokens"].clone())
        .map(|tokens| tokens.as_u64().unwrap())
        .sum()
}

#[tokio::test]
async fn an_answer_without_a_choice_is_paid_once_counted_and_fails_the_step() {
    // The provider bills a completion that tells its tokens but holds no answer: the run and the organisation count
    // them, and the call is not bought again.
    let h = Harness::new(FakeAgents::default(), 2);
    *h.model.fix_unusable.lock().unwrap() = Some("no choices".into());
    fails_after_one_paid_fix(&h, "fp-no-choice", "no choices").await;
    assert_eq!(org_tokens(&h).await, 120);
}

#[tokio::test]
async fn an_unusable_answer_whose_reason_is_larger_than_a_store_keeps_is_paid_once() {
    // A client's reason for an unusable answer is kept with it: one past what a store keeps would have been refused
    // on every delivery, the answer bought again each time the claim's lease ran out.
    let h = Harness::new(FakeAgents::default(), 2);
    *h.model.fix_unusable.lock().unwrap() = Some("x".repeat(loams_platform::limits::MAX_BODY));
    fails_after_one_paid_fix(&h, "fp-huge-reason", "a store keeps").await;
    assert_eq!(org_tokens(&h).await, 120);
}

#[tokio::test]
async fn a_run_just_within_the_limit_still_takes_every_later_step_its_revert_included() {
    // Files that bring the run's JSON just under MAX_RUN_BYTES: the steps after them (reviews, approvals, merge,
    // a regressed observation, the revert and its gate, the ending) grow it past that, and none may be refused.
    let content = "x = 1\n".repeat(21_280);
    let h = Harness::new(
        FakeAgents {
            read_files: Some(files_read(&["src/checkout.py", "src/cart.py"], &content)),
            error_events: 50,
            ..FakeAgents::default()
        },
        1,
    );
    let opened = h.worker.open(ORG, signal("fp-near-limit")).await.unwrap();
    let run = h.drive(&opened.run_id).await;
    let size = serde_json::to_vec(&run).unwrap().len();
    assert!(
        size > loams_factory::MAX_RUN_BYTES,
        "the run is {size} bytes: not near the limit"
    );
    assert_eq!(run.state, RunState::Failed, "{:?}", run.ending);
    assert_eq!(run.files.len(), 2);
    assert_eq!(times_answered(&h, "forgejo.revert"), 1);
    assert!(h.db.dead_letters(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn two_workers_on_the_same_message_record_the_step_once_under_one_message_id() {
    let h = Harness::new(FakeAgents::default(), 2);
    let config = loams_factory::Config {
        max_generations: 2,
        ..loams_factory::Config::default()
    };
    let second = Harness::worker(&h.clock, &h.db, &h.agents, &h.model, config);
    let id = h.worker.open(ORG, signal("fp-2")).await.unwrap().run_id;
    let envelope = continuation(&id);
    let before = h.version(&id).await;

    // One step each: further along, one worker may find the other holding the fix's model call (`InProgress`),
    // which is the settlement's business, not this test's.
    let (a, b) = tokio::join!(
        h.worker.handle_steps(&envelope, 1, None),
        second.handle_steps(&envelope, 1, None)
    );
    a.unwrap();
    b.unwrap();

    let run = h.run(&id).await;
    let step = format!("{id}:triage:0:open_thread");
    // Whether the second worker performed the same step alongside (then under the same message id, answered from
    // the agent's task store) or, coming later, the next one depends on timing; the thread is opened once either way.
    assert!((1..=2).contains(&h.agents.calls_of(&step)));
    assert_eq!(run.links.thread_message_id, Some(1));
    // One thread opened, triage decided, the issue created by one of them afterwards: never a step twice.
    let events = h.db.events(ORG, &id, before, 100).await.unwrap();
    let kinds: Vec<String> = events
        .iter()
        .map(|e| {
            serde_json::from_slice::<Value>(&e.body).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "thread_opened").count(),
        1,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "step_failed").count(),
        0,
        "{kinds:?}"
    );
}

/// The message that carries run `run` on from where it is, as the worker itself sends it.
fn continuation(run: &str) -> Envelope {
    Envelope {
        org: ORG.into(),
        run: run.into(),
        input: None,
    }
}

/// Drives run `id` until its next effect is the fix model call; returns that call's step id.
async fn until_fix(h: &Harness, id: &str) -> String {
    for _ in 0..50 {
        let run = h.run(id).await;
        if let Some(loams_factory::Effect::Model { step, .. }) = run.next_effect() {
            return step;
        }
        h.worker
            .handle_steps(&continuation(id), 1, None)
            .await
            .unwrap();
    }
    panic!("the run never reached its fix");
}

#[tokio::test]
async fn a_kill_stops_the_wait_for_a_model_answer_and_ends_the_run() {
    // An answer may take minutes: a kill of the run or of its organisation meanwhile ends the wait within seconds,
    // and the run with it, instead of when the answer comes; during the step's last try too, which a recorded
    // failure would have turned into the run's failure.
    // The run's switch with a message of one step (a message that came back moves its run by one): the kill ends
    // the run in that message (the announcing of its end follows in the next).
    for (scope, steps) in [("org", 16), ("run", 16), ("run", 1)] {
        let h = Harness::new(FakeAgents::default(), 2);
        let id = h
            .worker
            .open(ORG, signal("fp-kill-answer"))
            .await
            .unwrap()
            .run_id;
        let step = until_fix(&h, &id).await;
        let switch = match scope {
            "org" => "org".to_string(),
            _ => run_kill_switch_id(&id),
        };
        let failures = if steps == 1 {
            0
        } else {
            loams_factory::MAX_STEP_RETRIES - 1
        };
        *h.model.fix_failures.lock().unwrap() = failures;
        *h.model.fix_killed.lock().unwrap() = Some((h.db.clone(), switch));
        for d in h.db.receive(10, 1_000).await.unwrap() {
            h.db.ack(&d.receipt).await.unwrap();
        }
        let envelope = continuation(&id);
        let handled = h.worker.handle_steps(&envelope, steps, None);
        tokio::time::timeout(std::time::Duration::from_secs(60), handled)
            .await
            .unwrap_or_else(|_| panic!("{scope}: still waiting for the answer after the kill"))
            .unwrap();
        let run = h.run(&id).await;
        let ended = run.ending.as_ref().map(|ending| ending.state);
        assert_eq!(
            ended,
            Some(RunState::Killed),
            "{scope}, {steps} steps: {run:?}"
        );
        if steps > 1 {
            assert_eq!(run.state, RunState::Killed, "{scope}: {:?}", run.ending);
        } else {
            let queued = h.db.receive(10, 1_000).await.unwrap();
            let runs: Vec<String> = (queued.iter())
                .map(|d| serde_json::from_slice::<Envelope>(&d.body).unwrap().run)
                .collect();
            assert_eq!(
                runs,
                std::slice::from_ref(&id),
                "the announcing of the end is not queued"
            );
        }
        let tries = failures as usize + 1;
        assert_eq!(*h.model.paid.lock().unwrap(), vec!["fix"; tries], "{scope}");
        // The stopped call's claim is given up, not held for its lease.
        let key = match tries {
            1 => format!("model:{step}"),
            n => format!("model:{step}~{n}"),
        };
        let claim = h.db.claim(ORG, &key, h.clock.now_ms(), 1_000).await;
        assert_eq!(claim.unwrap(), Claim::New, "{scope}: {key}");
    }
}

#[tokio::test]
async fn a_model_call_claimed_elsewhere_is_retried_later_and_a_finished_one_reused() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-3")).await.unwrap().run_id;
    // Drain the open's continuation so the queue holds only what this test sends.
    let step = until_fix(&h, &id).await;
    for d in h.db.receive(10, 1_000).await.unwrap() {
        h.db.ack(&d.receipt).await.unwrap();
    }

    // Another worker holds the call: the message is not lost and the model is not paid.
    let key = format!("model:{step}");
    assert_eq!(
        h.db.claim(ORG, &key, h.clock.now_ms(), 180_000)
            .await
            .unwrap(),
        Claim::New
    );
    h.send(&id, None).await;
    let envelope = continuation(&id);
    assert!(matches!(
        h.worker.handle(&envelope).await,
        Err(WorkerError::InProgress { .. })
    ));
    assert_eq!(h.worker.run_once().await.unwrap(), 1);
    assert!(h.model.paid.lock().unwrap().is_empty());
    // Not lost and not spun on: the continuation waits in the timer store (waiting out a lease must not use up
    // the message's receives and dead-letter it).
    assert_eq!(h.worker.run_once().await.unwrap(), 0);
    assert_eq!(h.scheduler.fire_due().await.unwrap(), 0, "not due yet");

    // The holder finishes: the retry reuses its answer.
    let outcome = Outcome::Model {
        text: PATCH.into(),
        input_tokens: 7,
        output_tokens: 3,
    };
    h.db.finish(
        ORG,
        &key,
        &serde_json::to_vec(&outcome).unwrap(),
        h.clock.now_ms(),
    )
    .await
    .unwrap();
    // The retry is due a third of the way into the lease, before the answer timeout the lease outlasts.
    h.clock
        .advance(loams_model::ANSWER_TIMEOUT.as_millis() as u64);
    assert_eq!(h.scheduler.fire_due().await.unwrap(), 1);
    assert_eq!(h.worker.run_once().await.unwrap(), 1);
    // The message carries the run on past the fix (to the reviews, which are paid): the fix itself is not.
    assert!(
        !h.model.paid.lock().unwrap().iter().any(|p| p == "fix"),
        "paid twice for {step}"
    );
    let answered: Vec<Value> =
        h.db.events(ORG, &id, 0, 500)
            .await
            .unwrap()
            .iter()
            .map(|e| serde_json::from_slice::<Value>(&e.body).unwrap())
            .filter(|e| e["type"] == "model_answered" && e["step"] == step.as_str())
            .collect();
    assert_eq!(answered.len(), 1, "{answered:?}");
    assert_eq!(
        (
            answered[0]["input_tokens"].as_u64(),
            answered[0]["output_tokens"].as_u64()
        ),
        (Some(7), Some(3)),
        "the reused answer is the one recorded"
    );
    assert!(
        h.run(&id)
            .await
            .patch
            .iter()
            .any(|f| f.path == "src/checkout.py")
    );
}

#[tokio::test]
async fn a_regressed_run_opens_its_follow_up_unless_the_cap_refuses() {
    for (cap, runs) in [(2, 2), (1, 1)] {
        let h = Harness::new(
            FakeAgents {
                error_events: 50,
                ..FakeAgents::default()
            },
            cap,
        );
        let id = h.worker.open(ORG, signal("fp-4")).await.unwrap().run_id;
        let run = h.drive(&id).await;
        assert_eq!(run.state.as_str(), "failed");
        assert_eq!(run.follow_up.is_some(), cap == 2, "{:?}", run.follow_up);
        let all =
            h.db.list_runs(ORG, None, Page::first(10))
                .await
                .unwrap()
                .items;
        assert_eq!(all.len(), runs, "cap {cap}");
        if cap == 2 {
            let next = all.iter().find(|r| r.id != id).unwrap();
            let next: Run = serde_json::from_slice(&next.snapshot).unwrap();
            assert_eq!(
                (next.generation, next.parent_run.as_deref()),
                (2, Some(id.as_str()))
            );
        }
        // The revert went through its approval.
        assert!(
            h.agents
                .answered
                .lock()
                .unwrap()
                .values()
                .any(|(s, _)| s == "forgejo.revert")
        );
    }
}

#[tokio::test]
async fn a_follow_up_lost_in_a_crash_is_opened_by_the_next_message_of_the_ended_run() {
    // A regressed run that ended and opened its successor...
    let h = Harness::new(
        FakeAgents {
            error_events: 50,
            ..FakeAgents::default()
        },
        2,
    );
    let id = h.worker.open(ORG, signal("fp-8")).await.unwrap().run_id;
    let ended = h.drive(&id).await;
    assert!(ended.follow_up.is_some());
    let row = h.db.get_run(ORG, &id).await.unwrap().unwrap();

    // ...copied into a store where the process died right after recording the end: no successor yet.
    let crashed = Harness::new(
        FakeAgents {
            error_events: 50,
            ..FakeAgents::default()
        },
        2,
    );
    crashed
        .db
        .create_run(ORG, &id, &row.state, &row.snapshot, b"{}", 0)
        .await
        .unwrap();
    assert_eq!(
        crashed
            .db
            .list_runs(ORG, None, Page::first(10))
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // The redelivered message of the ended run opens it; another one changes nothing more.
    for _ in 0..2 {
        crashed.worker.handle(&continuation(&id)).await.unwrap();
    }
    let all = crashed
        .db
        .list_runs(ORG, None, Page::first(10))
        .await
        .unwrap()
        .items;
    assert_eq!(all.len(), 2, "exactly one successor");
    let next: Run =
        serde_json::from_slice(&all.iter().find(|r| r.id != id).unwrap().snapshot).unwrap();
    assert_eq!(
        (next.generation, next.parent_run.as_deref()),
        (2, Some(id.as_str()))
    );
}

#[tokio::test]
async fn a_malformed_message_is_acked_and_dropped() {
    let h = Harness::new(FakeAgents::default(), 2);
    h.db.send(b"{not an envelope", 0).await.unwrap();
    assert_eq!(h.worker.run_once().await.unwrap(), 1);
    h.clock.advance(10 * 60_000);
    assert_eq!(
        h.worker.run_once().await.unwrap(),
        0,
        "the message came back"
    );
    assert!(h.db.dead_letters(10).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_timer_fired_twice_changes_nothing_the_second_time() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-5")).await.unwrap().run_id;
    // Run until the run waits on a timer (the approval of the merge).
    let mut timer = None;
    for _ in 0..100 {
        let run = h.run(&id).await;
        if let Some(w) = run.wait.as_ref().filter(|w| w.scheduled) {
            timer = Some(w.timer_id.clone());
            break;
        }
        h.worker.run_once().await.unwrap();
        h.scheduler.fire_due().await.unwrap();
    }
    let timer_id = timer.expect("the run never waited on a timer");
    let fired = Some(Input::TimerFired {
        timer_id: timer_id.clone(),
    });
    h.send(&id, fired.clone()).await;
    h.worker.run_once().await.unwrap();
    let after_first = h.version(&id).await;
    assert!(
        h.run(&id)
            .await
            .wait
            .as_ref()
            .is_none_or(|w| w.timer_id != timer_id)
    );

    h.send(&id, fired).await;
    assert!(h.worker.run_once().await.unwrap() >= 1);
    // The first firing's continuation may still be queued; what counts is that the duplicate added nothing.
    let events = h.db.events(ORG, &id, after_first, 100).await.unwrap();
    let fired_again = events
        .iter()
        .filter(|e| serde_json::from_slice::<Value>(&e.body).unwrap()["type"] == "timer_fired")
        .filter(|e| {
            serde_json::from_slice::<Value>(&e.body).unwrap()["timer_id"] == timer_id.as_str()
        })
        .count();
    assert_eq!(fired_again, 0);
}

#[tokio::test]
async fn a_step_performed_again_after_a_crash_reuses_its_message_id() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-6")).await.unwrap().run_id;
    let run = h.run(&id).await;
    let Some(loams_factory::Effect::Call { step, .. }) = run.next_effect() else {
        panic!("no call first")
    };
    // A crash after the effect and before the record: the agent answered, the run does not know.
    let agent_reply = h
        .agents
        .call("zulip", &step, "open_thread", json!({}), None)
        .await;
    assert!(matches!(agent_reply, AgentReply::Done(_)));
    // The message comes back after the crash.
    h.worker
        .handle_received(&continuation(&id), 2, None)
        .await
        .unwrap();
    assert_eq!(
        h.agents.calls_of(&step),
        2,
        "the redo used another message id"
    );
    assert_eq!(
        h.agents.answered.lock().unwrap().len(),
        1,
        "one call performed once, answered twice"
    );
    assert_eq!(h.run(&id).await.links.thread_message_id, Some(1));
}

#[tokio::test]
async fn a_decision_stored_without_its_message_reaches_the_run_at_the_next_recheck() {
    use loams_factory::approval::{Approval, ApprovalState, DecisionProof};
    use loams_platform::{Cond, Timers};

    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-9")).await.unwrap().run_id;
    // Run until the merge approval is stored and the run rests on its timer.
    let mut parked = None;
    for _ in 0..100 {
        let run = h.run(&id).await;
        if let Some(w) = run
            .wait
            .as_ref()
            .filter(|w| w.scheduled && w.kind == loams_factory::WaitKind::Approval)
        {
            parked = Some(w.clone());
            break;
        }
        h.worker.run_once().await.unwrap();
        h.scheduler.fire_due().await.unwrap();
    }
    let wait = parked.expect("the run never waited on its approval");
    let rests_at = h.clock.now_ms();
    while h.worker.run_once().await.unwrap() > 0 {}
    let stored = h.db.due(rests_at + 60_000, 10).await.unwrap();
    assert!(
        stored
            .iter()
            .any(|t| t.id == wait.timer_id && t.due_ms == rests_at + 60_000),
        "a re-check a minute away, not the 72 h expiry: {stored:?}"
    );

    // A person approves; the API stores the decision and dies before enqueueing the settlement.
    let approval_id = h.run(&id).await.gate.and_then(|g| g.approval_id).unwrap();
    let item =
        h.db.get_item(ORG, "approval", &approval_id)
            .await
            .unwrap()
            .unwrap();
    let mut approval: Approval = serde_json::from_slice(&item.body).unwrap();
    approval.state = ApprovalState::Approved;
    approval.decision = Some(DecisionProof {
        device_id: "dev-1".into(),
        signature: vec![1],
        challenge: vec![2],
        decided_at_ms: rests_at,
        decided_by: "alice".into(),
    });
    let settled = loams_platform::Item {
        body: serde_json::to_vec(&approval).unwrap(),
        index: None,
        ..item.clone()
    };
    h.db.put_item(&settled, Cond::Version(item.version))
        .await
        .unwrap();
    assert_eq!(
        h.worker.run_once().await.unwrap(),
        0,
        "no message tells the run"
    );
    assert!(h.run(&id).await.gate.is_some());

    // The re-check fires a minute later: the worker reads the decision and the run merges.
    h.clock.advance(60_000);
    assert_eq!(h.scheduler.fire_due().await.unwrap(), 1);
    for _ in 0..20 {
        h.worker.run_once().await.unwrap();
    }
    assert!(
        h.agents
            .answered
            .lock()
            .unwrap()
            .values()
            .any(|(s, _)| s == "forgejo.merge"),
        "the run did not merge"
    );
    let run = h.run(&id).await;
    assert!(run.links.deploy_ref.is_some());
    let record = run.approvals.iter().find(|a| a.id == approval.id).unwrap();
    assert_eq!(
        (record.state, record.by.as_deref()),
        (ApprovalState::Approved, Some("alice"))
    );
    assert!(
        h.clock.now_ms() - rests_at <= 60_000,
        "learned within one re-check"
    );
}

#[tokio::test]
async fn a_first_delivery_carries_the_run_through_several_steps_a_redelivered_one_through_one() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-chain")).await.unwrap().run_id;
    for d in h.db.receive(10, 1_000).await.unwrap() {
        h.db.ack(&d.receipt).await.unwrap();
    }
    let envelope = continuation(&id);
    let total = |h: &Harness| h.agents.calls.lock().unwrap().values().sum::<u32>();

    // Came back after a crash: one step, then a fresh message (receive count 1) for the rest.
    h.worker.handle_received(&envelope, 2, None).await.unwrap();
    assert_eq!(total(&h), 1);
    let fresh = h.db.receive(10, 1_000).await.unwrap();
    assert_eq!(
        fresh.iter().map(|d| d.receive_count).collect::<Vec<_>>(),
        [1]
    );
    h.db.ack(&fresh[0].receipt).await.unwrap();

    // A first delivery goes on until the run has to wait, each step recorded before the next.
    let version = h.version(&id).await;
    h.worker.handle_received(&envelope, 1, None).await.unwrap();
    let calls = total(&h) - 1;
    assert!(calls >= 2, "{:?}", h.agents.calls.lock().unwrap());
    assert!(
        h.version(&id).await - version >= u64::from(calls),
        "every effect has its record"
    );
}

#[tokio::test]
async fn a_settlement_message_without_a_stored_decision_releases_nothing() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h
        .worker
        .open(ORG, signal("fp-forged"))
        .await
        .unwrap()
        .run_id;
    let mut approval = None;
    for _ in 0..200 {
        assert!(!h.run(&id).await.state.is_terminal());
        h.worker.run_once().await.unwrap();
        h.scheduler.fire_due().await.unwrap();
        if let Some(item) =
            h.db.list_items(ORG, "approval", Some("pending"), Page::first(1))
                .await
                .unwrap()
                .items
                .pop()
        {
            approval = Some(item);
            break;
        }
        h.clock.advance(5_000);
    }
    let approval = approval.expect("the run asks for an approval");
    let version = h.version(&id).await;
    // Whoever can send to the queue says the gate is approved; nothing was decided through the API.
    let forged = Input::ApprovalSettled {
        approval_id: approval.id.clone(),
        approved: true,
        by: "mallory".into(),
    };
    h.send(&id, Some(forged)).await;
    while h.worker.run_once().await.unwrap() > 0 {}
    let run = h.run(&id).await;
    assert!(run.gate.is_some(), "still gated: {run:?}");
    let events = h.db.events(ORG, &id, version, 100).await.unwrap();
    assert!(
        events.iter().all(
            |e| serde_json::from_slice::<Value>(&e.body).unwrap()["type"] != "approval_settled"
        )
    );
    // The real decision, stored and then announced, goes through.
    h.approve(&id, approval).await;
    while h.worker.run_once().await.unwrap() > 0 {}
    assert!(h.run(&id).await.gate.is_none());
}

/// The skills the fake agents performed.
fn performed(h: &Harness) -> Vec<String> {
    h.agents
        .answered
        .lock()
        .unwrap()
        .values()
        .map(|(skill, _)| skill.clone())
        .collect()
}

#[tokio::test]
async fn a_kill_switch_turned_on_during_a_step_stops_the_run_before_the_same_message_makes_another()
{
    let h = Harness::new(FakeAgents::default(), 2);
    *h.agents.kill_after.lock().unwrap() = Some(("zulip.open_thread".into(), h.db.clone()));
    let id = h
        .worker
        .open(ORG, signal("fp-kill-mid"))
        .await
        .unwrap()
        .run_id;
    for d in h.db.receive(10, 1_000).await.unwrap() {
        h.db.ack(&d.receipt).await.unwrap();
    }
    // One message, which would otherwise carry the run on to the issue and the fix.
    h.worker.handle(&continuation(&id)).await.unwrap();
    let done = performed(&h);
    assert!(done.contains(&"zulip.open_thread".to_string()), "{done:?}");
    assert!(
        !done.contains(&"plane.create_issue".to_string()),
        "the next step ran after the kill: {done:?}"
    );
    let run = h.run(&id).await;
    assert!(run.ending.is_some() || run.state.is_terminal(), "{run:?}");
}

/// A kill switch item (kind `kill`) with id `id`: `org`, `agent:<name>` or a run's.
fn kill_switch(id: &str) -> Item {
    Item {
        org: ORG.into(),
        kind: "kill".into(),
        id: id.into(),
        version: 0,
        index: None,
        body: b"{}".to_vec(),
        expires_ms: None,
    }
}

/// A run opened on a counting backend that holds the kill switches of `killed_before` earlier runs (never removed),
/// its first message taken off the queue.
struct AfterKilledRuns {
    db: Arc<Counting<Sqlite>>,
    agents: Arc<FakeAgents>,
    worker: Worker,
    id: String,
}

impl AfterKilledRuns {
    async fn new(killed_before: usize) -> AfterKilledRuns {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let db = Arc::new(Counting::new(Sqlite::memory(clock.clone()).unwrap()));
        for n in 0..killed_before {
            let switch = kill_switch(&run_kill_switch_id(&format!("old-{n:04}")));
            db.inner().put_item(&switch, Cond::Absent).await.unwrap();
        }
        let agents = Arc::new(FakeAgents::default());
        let worker = Harness::worker(
            &clock,
            &db,
            &agents,
            &Arc::new(FakeModel::default()),
            loams_factory::Config::default(),
        );
        let id = worker
            .open(ORG, signal("fp-many-killed"))
            .await
            .unwrap()
            .run_id;
        for d in db.inner().receive(10, 1_000).await.unwrap() {
            db.inner().ack(&d.receipt).await.unwrap();
        }
        AfterKilledRuns {
            db,
            agents,
            worker,
            id,
        }
    }

    async fn switch_on(&self, id: &str) {
        self.db
            .inner()
            .put_item(&kill_switch(id), Cond::Absent)
            .await
            .unwrap();
    }

    /// Takes one step of the run; returns what it cost the backend.
    async fn step(&self) -> OpCounts {
        let before = self.db.counts();
        self.worker
            .handle_steps(&continuation(&self.id), 1, None)
            .await
            .unwrap();
        self.db.counts().since(&before)
    }

    /// The run's state, or the state it is ending in while its closing steps are still to come.
    async fn state(&self) -> RunState {
        let row = self.db.get_run(ORG, &self.id).await.unwrap().unwrap();
        let run: Run = serde_json::from_slice(&row.snapshot).unwrap();
        run.ending.as_ref().map_or(run.state, |ending| ending.state)
    }

    fn performed(&self) -> Vec<String> {
        let answered = self.agents.answered.lock().unwrap();
        answered.values().map(|(skill, _)| skill.clone()).collect()
    }
}

#[tokio::test]
async fn the_switches_of_runs_killed_before_cost_a_step_one_read_at_most_and_its_own_switch_still_stops_it()
 {
    let fresh = AfterKilledRuns::new(0).await;
    let few = AfterKilledRuns::new(20).await;
    let crowded = AfterKilledRuns::new(500).await;
    let fresh_step = fresh.step().await;
    // A fresh organisation's listing ends on its first page, which then holds every run switch there is.
    assert_eq!((fresh_step.list_items, fresh_step.get_item), (1, 0));
    let few_step = few.step().await;
    assert_eq!(
        crowded.step().await,
        few_step,
        "a step reads the same after 500 killed runs as after 20"
    );
    // Past one page of run switches, the run's own is read by its id: one read more than in a fresh organisation.
    assert_eq!(
        few_step,
        OpCounts {
            get_item: fresh_step.get_item + 1,
            ..fresh_step
        }
    );
    crowded.switch_on(&run_kill_switch_id(&crowded.id)).await;
    // The alert repeating while the run is open belongs to that run, which its switch now refuses (read by the id
    // the opening would use).
    let reopened = crowded.worker.open(ORG, signal("fp-many-killed")).await;
    assert!(
        matches!(&reopened, Err(WorkerError::OpenRefused(why)) if why.contains(&crowded.id)),
        "{reopened:?}"
    );
    crowded.step().await;
    assert_eq!(crowded.state().await, RunState::Killed);
}

#[tokio::test]
async fn a_kill_switch_of_a_scope_this_build_does_not_know_is_left_to_the_workers_that_do() {
    // Written by a later version during a rolling deploy, say: killing the organisation's runs for it would be final.
    let run = AfterKilledRuns::new(3).await;
    run.switch_on("env:staging").await;
    run.step().await;
    assert_ne!(run.state().await, RunState::Killed);
    assert_eq!(run.performed(), ["zulip.open_thread"]);
    // The switches this build knows still stop it.
    run.switch_on("org").await;
    run.step().await;
    assert_eq!(run.state().await, RunState::Killed);
}

#[tokio::test]
async fn a_run_switch_on_the_last_listing_page_stops_its_run_without_another_read() {
    let run = AfterKilledRuns::new(3).await;
    run.switch_on(&run_kill_switch_id(&run.id)).await;
    let step = run.step().await;
    assert_eq!((step.list_items, step.get_item), (1, 0));
    assert_eq!(run.performed(), Vec::<String>::new());
    assert_eq!(run.state().await, RunState::Killed);
}

#[tokio::test]
async fn a_run_switch_on_a_later_last_listing_page_stops_its_run_without_another_read() {
    let run = AfterKilledRuns::new(3).await;
    for n in 0..10 {
        run.switch_on(&format!("agent:other-{n:02}")).await;
    }
    run.switch_on(&run_kill_switch_id(&run.id)).await;
    let step = run.step().await;
    assert_eq!((step.list_items, step.get_item), (2, 0));
    assert_eq!(run.state().await, RunState::Killed);
}

#[tokio::test]
async fn the_organisation_and_agent_switches_are_read_past_a_listing_page_among_the_switches_of_killed_runs()
 {
    for last in ["agent:zulip", "org"] {
        let run = AfterKilledRuns::new(500).await;
        // More agent switches than one listing page holds, the one that matters after them all.
        for n in 0..20 {
            run.switch_on(&format!("agent:other-{n:02}")).await;
        }
        run.switch_on(last).await;
        run.step().await;
        assert_eq!(
            run.performed(),
            Vec::<String>::new(),
            "{last}: the first step calls zulip"
        );
        assert_eq!(run.state().await, RunState::Killed, "{last}");
    }
}

#[tokio::test]
async fn a_message_that_used_up_its_steps_hands_the_run_to_a_fresh_message() {
    let h = Harness::new(FakeAgents::default(), 2);
    let id = h.worker.open(ORG, signal("fp-cap")).await.unwrap().run_id;
    for d in h.db.receive(10, 1_000).await.unwrap() {
        h.db.ack(&d.receipt).await.unwrap();
    }
    h.worker
        .handle_steps(&continuation(&id), 2, None)
        .await
        .unwrap();
    assert_eq!(performed(&h).len(), 2);
    let next = h.db.receive(10, 1_000).await.unwrap();
    assert_eq!(next.len(), 1, "one continuation");
    let envelope: Envelope = serde_json::from_slice(&next[0].body).unwrap();
    assert_eq!(
        (envelope.run.as_str(), envelope.input.is_none()),
        (id.as_str(), true)
    );
}

#[tokio::test]
async fn an_organisation_over_its_monthly_budget_opens_runs_that_pay_for_no_model_call() {
    // Each fake answer costs 100 input and 20 output tokens: 49 micro-dollars at the default prices.
    let h = Harness::with_config(
        FakeAgents::default(),
        loams_factory::Config {
            org_budget_micros: Some(100),
            ..loams_factory::Config::default()
        },
    );
    let first = h
        .worker
        .open(ORG, signal("fp-budget-1"))
        .await
        .unwrap()
        .run_id;
    // Spent 0, then 49, then 98 when its three calls start: all under the limit.
    assert_eq!(h.drive(&first).await.state.as_str(), "succeeded");
    assert_eq!(h.model.paid.lock().unwrap().len(), 3);

    let second = h
        .worker
        .open(ORG, signal("fp-budget-2"))
        .await
        .unwrap()
        .run_id;
    let run = h.drive(&second).await;
    assert_eq!(run.state.as_str(), "failed", "{run:?}");
    assert_eq!(
        h.model.paid.lock().unwrap().len(),
        3,
        "nothing more was paid"
    );
    let reasons: Vec<Value> =
        h.db.events(ORG, &second, 0, 500)
            .await
            .unwrap()
            .iter()
            .map(|e| serde_json::from_slice::<Value>(&e.body).unwrap())
            .filter(|e| e["type"] == "abandoned")
            .collect();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert_eq!(reasons[0]["reason"], "budget");
    assert!(
        reasons[0]["detail"]
            .as_str()
            .unwrap()
            .contains("147 micro-dollars (limit 100), 360 tokens (limit none)"),
        "{reasons:?}"
    );
}

#[tokio::test]
async fn a_spend_that_cannot_be_counted_keeps_the_paid_answer_and_pays_nothing_twice() {
    let h = Harness::new(FakeAgents::default(), 2);
    // Every shard of this month's spend is unreadable, so every count fails.
    let (year, month, _) = loams_platform::calendar::civil_from_days(
        h.clock
            .now_ms()
            .div_euclid(loams_platform::calendar::DAY_MS),
    );
    let month = format!("model:{year:04}-{month:02}");
    let mut broken = Vec::new();
    for shard in 0..8 {
        let item = Item {
            org: ORG.into(),
            kind: "spend".into(),
            id: format!("{month}:{shard}"),
            version: 0,
            index: Some(month.clone()),
            body: b"not json".to_vec(),
            expires_ms: None,
        };
        h.db.put_item(&item, Cond::Any).await.unwrap();
        broken.push(item.id);
    }
    let id = h
        .worker
        .open(ORG, signal("fp-uncounted"))
        .await
        .unwrap()
        .run_id;
    assert_eq!(h.drive(&id).await.state.as_str(), "succeeded");
    // Each answer was stored and used: no call was paid twice.
    assert_eq!(
        *h.model.paid.lock().unwrap(),
        ["fix", "lead_review", "security_audit"]
    );
    // And the counting really failed: the shards it would have written are untouched.
    for id in broken {
        let item = h.db.get_item(ORG, "spend", &id).await.unwrap().unwrap();
        assert_eq!(item.body, b"not json", "{id}");
    }
}
