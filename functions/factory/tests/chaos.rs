//! Any interleaving of duplicated, delayed and reordered messages and crashes ends in the straight run's state,
//! and no step id is ever performed with a different effect (the simulator asserts that on every repeat).

mod common;

use common::*;
use loams_factory::{Effect, Input, RunState};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Deliver the message at this index (modulo the queue length) and ack it.
    Deliver(usize),
    /// Deliver it but lose the ack: it is delivered again later.
    Redeliver(usize),
    /// Deliver it and crash at a point: in-memory state is lost, the message stays queued.
    Crash(usize, u8),
    /// A stale copy of an input already seen arrives again.
    Replay(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<usize>().prop_map(Op::Deliver),
        2 => any::<usize>().prop_map(Op::Redeliver),
        2 => (any::<usize>(), 0u8..4).prop_map(|(i, c)| Op::Crash(i, c)),
        1 => any::<usize>().prop_map(Op::Replay),
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn chaos_ends_like_the_straight_run(ops in prop::collection::vec(op(), 0..120)) {
        let mut straight_world = World::new();
        let expected = straight(&mut straight_world);
        prop_assert_eq!(expected.state, RunState::Succeeded);

        let mut world = World::new();
        let mut worker = Worker::start(signal(), ctx());
        let mut seen: Vec<Input> = Vec::new();
        for op in ops {
            if worker.queue.is_empty() {
                break;
            }
            let len = worker.queue.len();
            match op {
                Op::Deliver(i) | Op::Redeliver(i) | Op::Crash(i, _) => {
                    let idx = i % len;
                    let msg = worker.queue[idx].clone();
                    let crash_at = if let Op::Crash(_, c) = op { Some(crash(c)) } else { None };
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
            }
        }
        let run = worker.drain(&mut world);
        prop_assert_eq!(json_of(&run), json_of(&expected));

        // The chaotic run performed exactly the straight run's calls, model calls and approval requests, each with
        // the same effect. Timers may differ: one made unnecessary by an earlier settlement may or may not be set.
        let is_wait = |e: &Effect| matches!(e, Effect::Wait { .. });
        let mut got: Vec<&String> = world.performed.iter().filter(|(_, (e, _))| !is_wait(e)).map(|(s, _)| s).collect();
        let mut want: Vec<&String> =
            straight_world.performed.iter().filter(|(_, (e, _))| !is_wait(e)).map(|(s, _)| s).collect();
        got.sort();
        want.sort();
        prop_assert_eq!(got, want);
        for (step, (effect, _)) in &world.performed {
            if !is_wait(effect) {
                prop_assert_eq!(effect, &straight_world.performed[step].0);
            }
        }
    }
}
