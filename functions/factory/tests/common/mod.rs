//! A tiny world that answers the factory's effects the way the agents, the model, the approval API and the scheduler
//! would, and a worker that drives a run through it exactly as docs/contracts.md describes.

#![allow(dead_code)] // each test binary uses a different part of the simulator

use std::collections::{HashMap, VecDeque};

use loams_factory::{
    AUDIT_APPROVAL, Ctx, Effect, Event, Input, Outcome, Run, Signal, decide, open,
};
use serde_json::{Value, json};

pub const NOW: i64 = 1_700_000_000_000;

pub fn signal() -> Signal {
    Signal {
        source: "glitchtip".into(),
        fingerprint: "checkout-keyerror".into(),
        title: "KeyError: 'currency' in checkout".into(),
        link: "https://glitchtip.example/issues/42".into(),
        glitchtip_issue_id: Some("42".into()),
        severity: "error".into(),
        generation: 1,
        parent_run: None,
    }
}

pub fn ctx() -> Ctx {
    let mut c = Ctx::new("acme", "production", NOW);
    c.owner = Some("alice".into());
    c
}

/// `(stage, attempt, action)` of a step id.
pub fn parts(step: &str) -> (String, u32, String) {
    let p: Vec<&str> = step.splitn(4, ':').collect();
    (
        p[1].to_string(),
        p[2].parse().unwrap_or(0),
        p[3].to_string(),
    )
}

pub type Hook = Box<dyn Fn(&Effect) -> Option<Outcome>>;

pub struct World {
    /// Effects performed, first time only, keyed by step id, with the outcome given.
    pub performed: HashMap<String, (Effect, Outcome)>,
    /// Step ids in the order first performed.
    pub order: Vec<String>,
    /// Skills whose approval requests people deny.
    pub deny: Vec<&'static str>,
    /// Answers that replace the defaults for chosen effects.
    pub hook: Hook,
}

pub fn fix_text(attempt: u32) -> String {
    format!(
        "The fix:\n=== src/checkout.py\n```python\ncurrency = order.get('currency', 'EUR')  # attempt {attempt}\n```\n"
    )
}

impl World {
    pub fn new() -> World {
        World {
            performed: HashMap::new(),
            order: Vec::new(),
            deny: Vec::new(),
            hook: Box::new(|_| None),
        }
    }

    pub fn with(hook: impl Fn(&Effect) -> Option<Outcome> + 'static) -> World {
        World {
            hook: Box::new(hook),
            ..World::new()
        }
    }

    /// Whether the PR was merged: once performed, a merge stays (whether or not the run recorded its outcome).
    pub fn merged(&self) -> bool {
        self.performed
            .values()
            .any(|(e, _)| matches!(e, Effect::Call { skill, .. } if skill == "merge"))
    }

    fn default_answer(&self, effect: &Effect) -> Outcome {
        let step = effect.step();
        let (_, attempt, action) = parts(step);
        match effect {
            Effect::Wait { .. } => Outcome::Agent(json!({})),
            Effect::RequestApproval { approval, .. } => {
                Outcome::Agent(json!({"approval_id": approval.id}))
            }
            Effect::Model { purpose, .. } => {
                let text = match purpose.as_str() {
                    "fix" => fix_text(attempt),
                    "lead_review" => "All good\n".to_string(),
                    _ => format!(
                        "LOW src/checkout.py:1 default currency is hard-coded\n{AUDIT_APPROVAL}\n"
                    ),
                };
                Outcome::Model {
                    text,
                    input_tokens: 1_000,
                    output_tokens: 200,
                }
            }
            Effect::Call { agent, skill, .. } => {
                Outcome::Agent(match (agent.as_str(), skill.as_str()) {
                    ("zulip", "open_thread") => {
                        json!({"message_id": 100, "url": "https://zulip.example/#narrow/100"})
                    }
                    ("zulip", "post") => json!({"message_id": 101}),
                    ("plane", "create_issue") => {
                        json!({"id": "iss-1", "key": "SHOP-7", "url": "https://plane.example/SHOP-7", "created": true})
                    }
                    ("plane", "comment") => json!({"id": "c-1"}),
                    ("plane", "set_state") => json!({"state": "completed"}),
                    ("forgejo", "read_files") => {
                        json!({"files": [{"path": "src/checkout.py", "content": "currency = order['currency']\n"}]})
                    }
                    ("forgejo", "commit_patch") => json!({"sha": format!("c0ffee{attempt}")}),
                    ("forgejo", "open_pr") => {
                        json!({"number": 7, "url": "https://forgejo.example/pr/7", "head_sha": format!("c0ffee{attempt}"), "base": "main"})
                    }
                    // Attempt 1: pending once, then a failing test; attempt 2 passes.
                    ("forgejo", "ci_status") => match (attempt, action.as_str()) {
                        (1, "ci_status.0") => json!({"state": "pending", "log": ""}),
                        (1, _) => {
                            json!({"state": "failure", "log": "PASS test_cart\nFAIL test_checkout\n"})
                        }
                        _ => {
                            json!({"state": "success", "log": "PASS test_cart\nPASS test_checkout\n"})
                        }
                    },
                    ("forgejo", "merge") => json!({"merge_sha": "m3rge"}),
                    // Like the forgejo agent: a merged PR cannot be closed, the answer names its merge commit.
                    ("forgejo", "close_pr") if self.merged() => {
                        json!({"closed": false, "merged": true, "merge_sha": "m3rge"})
                    }
                    ("forgejo", "close_pr") => json!({"closed": true}),
                    ("forgejo", "revert") => {
                        json!({"number": 8, "url": "https://forgejo.example/pr/8", "head_sha": "r3v"})
                    }
                    ("glitchtip", "issue_events") => json!({"count": 0, "last_seen_ms": null}),
                    ("glitchtip", "resolve") => json!({"status": "resolved"}),
                    ("analytics", "series") => json!({"points": [], "total": 0}),
                    other => panic!("unexpected call {other:?}"),
                })
            }
        }
    }

    /// Performs an effect once per step id (like an agent deduplicating on messageId): a repeat must be the very
    /// same effect and gets the stored outcome. Returns the outcome and the inputs the outside world sends later.
    pub fn perform(&mut self, effect: &Effect) -> (Outcome, Vec<Input>) {
        let step = effect.step().to_string();
        if let Some((first, outcome)) = self.performed.get(&step) {
            assert_eq!(
                first, effect,
                "step {step} performed twice with a different effect"
            );
            return (outcome.clone(), Vec::new());
        }
        let outcome = (self.hook)(effect).unwrap_or_else(|| self.default_answer(effect));
        let mut later = Vec::new();
        match effect {
            // Short timers fire; stall timeouts (hours away) never do in these tests.
            Effect::Wait { timer_id, .. }
                if timer_id.contains("await_ci") || timer_id.contains("await_window") =>
            {
                later.push(Input::TimerFired {
                    timer_id: timer_id.clone(),
                });
            }
            Effect::Wait { timer_id, .. } if timer_id.contains("await_decision") => {
                later.push(Input::TriageDecided {
                    accept: true,
                    by: "oncall".into(),
                });
            }
            Effect::RequestApproval { approval, .. } => later.push(Input::ApprovalSettled {
                approval_id: approval.id.clone(),
                approved: !self.deny.contains(&approval.action.skill.as_str()),
                by: "bob".into(),
            }),
            _ => {}
        }
        self.performed
            .insert(step.clone(), (effect.clone(), outcome.clone()));
        self.order.push(step);
        (outcome, later)
    }
}

/// Where a simulated crash stops the processing of one message (the message stays queued and is delivered again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    BeforeDecide,
    AfterInput,
    AfterPerform,
    AfterRecord,
}

pub struct Worker {
    pub log: Vec<Event>,
    /// The in-memory run, dropped by a crash and rebuilt from the log.
    pub cached: Option<Run>,
    pub queue: VecDeque<Option<Input>>,
    pub ctx: Ctx,
    /// Every input the outside world sent (settlements, timers, decisions), in order.
    pub sent: Vec<Input>,
}

impl Worker {
    pub fn start(signal: Signal, ctx: Ctx) -> Worker {
        let (run, first) = open(signal, &ctx).expect("open");
        Worker {
            log: vec![first],
            cached: Some(run),
            queue: VecDeque::from([None]),
            ctx,
            sent: Vec::new(),
        }
    }

    pub fn run(&mut self) -> Run {
        match &self.cached {
            Some(r) => r.clone(),
            None => Run::from_events(&self.log).expect("log"),
        }
    }

    fn append(&mut self, events: Vec<Event>) {
        let mut run = self.run();
        for e in events {
            run.apply(&e);
            self.log.push(e);
        }
        assert_eq!(run.version, self.log.len() as u64);
        assert_eq!(
            run,
            Run::from_events(&self.log).expect("log"),
            "incremental fold == fold of the log"
        );
        self.cached = Some(run);
    }

    /// Processes one message; `crash` aborts it at that point. Returns whether it completed (may be acked).
    pub fn process(
        &mut self,
        msg: &Option<Input>,
        world: &mut World,
        crash: Option<Crash>,
    ) -> bool {
        if crash == Some(Crash::BeforeDecide) {
            self.cached = None;
            return false;
        }
        let run = self.run();
        let input = msg.clone().unwrap_or(Input::Continue);
        let events = decide(&run, &input, &self.ctx).expect("decide");
        self.append(events);
        if crash == Some(Crash::AfterInput) {
            self.cached = None;
            return false;
        }
        let run = self.run();
        let Some(effect) = run.next_effect() else {
            return true;
        };
        let (outcome, later) = world.perform(&effect);
        self.sent.extend(later.iter().cloned());
        self.queue.extend(later.into_iter().map(Some));
        if crash == Some(Crash::AfterPerform) {
            self.cached = None;
            return false;
        }
        let events = decide(
            &run,
            &Input::Completed {
                step: effect.step().into(),
                outcome,
            },
            &self.ctx,
        )
        .expect("decide");
        self.append(events);
        if crash == Some(Crash::AfterRecord) {
            self.cached = None;
            return false;
        }
        if self.run().next_effect().is_some() {
            self.queue.push_back(None);
        }
        true
    }

    /// Delivers queued messages in order until none is left.
    pub fn drain(&mut self, world: &mut World) -> Run {
        for _ in 0..10_000 {
            let Some(msg) = self.queue.pop_front() else {
                return self.run();
            };
            assert!(self.process(&msg, world, None));
        }
        panic!("the run does not settle");
    }
}

pub fn straight(world: &mut World) -> Run {
    let mut w = Worker::start(signal(), ctx());
    w.drain(world)
}

/// `agent.skill`, model purpose, or effect kind of each performed step, in order.
pub fn trace(world: &World) -> Vec<String> {
    world
        .order
        .iter()
        .map(|s| match &world.performed[s].0 {
            Effect::Call { agent, skill, .. } => format!("{agent}.{skill}"),
            Effect::Model { purpose, .. } => format!("model.{purpose}"),
            Effect::RequestApproval { approval, .. } => {
                format!("approval.{}", approval.action.skill)
            }
            Effect::Wait { .. } => format!("wait.{}", parts(s).2),
        })
        .collect()
}

pub fn json_of(run: &Run) -> Value {
    let mut v = serde_json::to_value(run).expect("json");
    v.as_object_mut().map(|o| o.remove("version"));
    v
}
