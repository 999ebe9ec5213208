//! Any interleaving of duplicated, delayed and reordered messages, crashes and a kill at any point ends in the state
//! of the straight run, and no step id is ever performed with a different effect (the simulator asserts that on
//! every repeat). The paths covered: the happy path, a denied merge approval, and a regression caught by observe.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use common::*;
use loams_factory::{Effect, Event, Input, Outcome, Reason, Run, RunState};
use proptest::prelude::*;
use serde_json::json;

#[derive(Clone, Copy, Debug)]
enum Path {
    Happy,
    DeniedMerge,
    Regression,
}

impl Path {
    fn world(self) -> World {
        let mut world = match self {
            Path::Regression => World::with(|e| match e {
                Effect::Call { skill, .. } if skill == "issue_events" => {
                    Some(Outcome::Agent(json!({"count": 40, "last_seen_ms": NOW})))
                }
                _ => None,
            }),
            Path::Happy | Path::DeniedMerge => World::new(),
        };
        if let Path::DeniedMerge = self {
            world.deny = vec!["merge"];
        }
        world
    }

    fn ending(self) -> (RunState, Option<Reason>) {
        match self {
            Path::Happy => (RunState::Succeeded, None),
            Path::DeniedMerge => (RunState::Failed, Some(Reason::ApprovalDenied)),
            Path::Regression => (RunState::Failed, Some(Reason::Regressed)),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Deliver the message at this index (modulo the queue length) and ack it.
    Deliver(usize),
    /// Deliver it but lose the ack: it is delivered again later.
    Redeliver(usize),
    /// Deliver it and crash at a point: in-memory state is lost, the message stays queued.
    Crash(usize, u8),
    /// A stale copy of an input already seen arrives again, now.
    Replay(usize),
    /// A timer or an approval settlement already seen is sent again and waits in the queue.
    Duplicate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<usize>().prop_map(Op::Deliver),
        2 => any::<usize>().prop_map(Op::Redeliver),
        2 => (any::<usize>(), 0u8..4).prop_map(|(i, c)| Op::Crash(i, c)),
        1 => any::<usize>().prop_map(Op::Replay),
        1 => any::<usize>().prop_map(Op::Duplicate),
    ]
}

fn path() -> impl Strategy<Value = Path> {
    prop_oneof![
        Just(Path::Happy),
        Just(Path::DeniedMerge),
        Just(Path::Regression)
    ]
}

fn crash(c: u8) -> Crash {
    match c {
        0 => Crash::BeforeDecide,
        1 => Crash::AfterInput,
        2 => Crash::AfterPerform,
        _ => Crash::AfterRecord,
    }
}

fn kill() -> Input {
    Input::Kill {
        by: "carol".into(),
        reason: "stop".into(),
    }
}

fn is_wait(e: &Effect) -> bool {
    matches!(e, Effect::Wait { .. })
}

/// What the straight run of a path ends as, and the steps it performed (effect and outcome by step id).
type Straight = (Run, HashMap<String, (Effect, Outcome)>);

thread_local! {
    /// The straight run of each path, computed once per test thread rather than once per case.
    static STRAIGHT: RefCell<HashMap<u8, Rc<Straight>>> = RefCell::new(HashMap::new());
}

fn straight_of(path: Path) -> Rc<Straight> {
    STRAIGHT.with(|cache| {
        Rc::clone(cache.borrow_mut().entry(path as u8).or_insert_with(|| {
            let mut world = path.world();
            let run = straight(&mut world);
            Rc::new((run, world.performed))
        }))
    })
}

/// Non-timer steps performed, sorted.
fn steps(performed: &HashMap<String, (Effect, Outcome)>) -> Vec<&String> {
    let mut s: Vec<&String> = performed
        .iter()
        .filter(|(_, (e, _))| !is_wait(e))
        .map(|(s, _)| s)
        .collect();
    s.sort();
    s
}

fn chaos(path: Path, ops: Vec<Op>, kill_at: Option<usize>) -> Result<(), TestCaseError> {
    let straight = straight_of(path);
    let (expected, straight_performed) = (&straight.0, &straight.1);
    prop_assert_eq!(
        (
            expected.state,
            expected.ending.as_ref().and_then(|e| e.reason)
        ),
        path.ending()
    );

    let mut world = path.world();
    let mut worker = Worker::start(signal(), ctx());
    let mut seen: Vec<Input> = Vec::new();
    for (n, op) in ops.into_iter().enumerate() {
        if kill_at == Some(n) {
            worker.queue.push_back(Some(kill()));
        }
        if worker.queue.is_empty() {
            break;
        }
        let len = worker.queue.len();
        match op {
            Op::Deliver(i) | Op::Redeliver(i) | Op::Crash(i, _) => {
                let idx = i % len;
                let msg = worker.queue[idx].clone();
                let crash_at = if let Op::Crash(_, c) = op {
                    Some(crash(c))
                } else {
                    None
                };
                let done = worker.process(&msg, &mut world, crash_at);
                if done && matches!(op, Op::Deliver(_)) {
                    let _ = worker.queue.remove(idx);
                }
                if let Some(input) = msg {
                    seen.push(input);
                }
            }
            Op::Replay(i) => {
                if !seen.is_empty() {
                    let input = seen[i % seen.len()].clone();
                    worker.process(&Some(input), &mut world, None);
                }
            }
            Op::Duplicate(i) => {
                let settled: Vec<&Input> = seen
                    .iter()
                    .filter(|m| {
                        matches!(m, Input::TimerFired { .. } | Input::ApprovalSettled { .. })
                    })
                    .collect();
                if !settled.is_empty() {
                    worker
                        .queue
                        .push_back(Some(settled[i % settled.len()].clone()));
                }
            }
        }
    }
    let run = worker.drain(&mut world);

    // Where the kill took effect, the reference is the straight run from the state the kill found: the recorded log
    // up to it, continued by a worker that is never disturbed. It gets the kill, then everything the outside world
    // sent during the chaotic run (a settlement of an approval requested before the kill is still to come); what
    // the prefix already consumed is a duplicate and must change nothing.
    let cut = worker.log.iter().position(|e| {
        matches!(
            e,
            Event::Abandoned {
                state: RunState::Killed,
                ..
            }
        )
    });
    let Some(cut) = cut else {
        prop_assert_eq!(json_of(&run), json_of(expected));
        // Exactly the straight run's calls, model calls and approval requests, each with the same effect. Timers
        // may differ: one made unnecessary by an earlier settlement may or may not be set.
        prop_assert_eq!(steps(&world.performed), steps(straight_performed));
        for (step, (effect, _)) in &world.performed {
            if !is_wait(effect) {
                prop_assert_eq!(effect, &straight_performed[step].0);
            }
        }
        return Ok(());
    };
    prop_assert_eq!(run.state, RunState::Killed);
    let mut reference = Worker::start(signal(), ctx());
    reference.log = worker.log[..cut].to_vec();
    reference.cached = None;
    reference.queue = std::iter::once(kill())
        .chain(worker.sent.iter().cloned())
        .map(Some)
        .collect();
    // The reference continues in the world the kill found: a merge performed before it (its outcome perhaps lost
    // to a crash) is still merged there.
    let mut reference_world = path.world();
    reference_world.performed.extend(
        world
            .performed
            .iter()
            .filter(|(_, (e, _))| matches!(e, Effect::Call { skill, .. } if skill == "merge"))
            .map(|(s, p)| (s.clone(), p.clone())),
    );
    let want = reference.drain(&mut reference_world);
    prop_assert_eq!(json_of(&run), json_of(&want));
    // Compensation did what the straight continuation did, each step with the same effect, and no destructive call
    // ran without the approval recorded for it.
    for (step, (effect, _)) in &reference_world.performed {
        if !is_wait(effect) {
            prop_assert_eq!(
                world.performed.get(step).map(|p| &p.0),
                Some(effect),
                "step {}",
                step
            );
        }
    }
    for (effect, _) in world.performed.values() {
        if let Effect::Call {
            skill,
            approval_id,
            step,
            ..
        } = effect
            && matches!(skill.as_str(), "merge" | "close_pr" | "revert")
        {
            prop_assert!(approval_id.is_some(), "{} ran without an approval", step);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn chaos_ends_like_the_straight_run(
        path in path(),
        ops in prop::collection::vec(op(), 0..160),
        kill_at in prop::option::weighted(0.4, 0..160usize),
    ) {
        chaos(path, ops, kill_at)?;
    }
}
