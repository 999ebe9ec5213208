//! Stages, guards and walls, each driven through the simulator.

mod common;

use common::*;
use loams_factory::{
    Cursor, Effect, Event, FinishStep, Input, LastRun, LastRunStatus, ObserveVerdict, Outcome,
    Reason, Rejection, Rule, Run, RunState, Verdict, decide, open, run_id, run_id_after,
};
use serde_json::json;

/// The last calls of a run that ends with its PR open: close_pr is destructive, so it is itself gated; then the
/// issue and the thread are told.
const CLOSING_CALLS: [&str; 4] = [
    "approval.close_pr",
    "forgejo.close_pr",
    "plane.comment",
    "zulip.post",
];

fn ci_hook(f: impl Fn(u32) -> &'static str + 'static) -> impl Fn(&Effect) -> Option<Outcome> {
    move |e| match e {
        Effect::Call { skill, step, .. } if skill == "ci_status" => Some(Outcome::Agent(
            json!({"state": "failure", "log": f(parts(step).1)}),
        )),
        _ => None,
    }
}

fn ended(worker: &Worker) -> (RunState, Option<Reason>) {
    match worker.log.last() {
        Some(Event::Ended { state, reason, .. }) => (*state, *reason),
        other => panic!("not ended: {other:?}"),
    }
}

fn drive(world: &mut World, ctx: loams_factory::Ctx) -> (Worker, Run) {
    let mut w = Worker::start(signal(), ctx);
    let run = w.drain(world);
    (w, run)
}

fn draft_pr_args(world: &World, run: &Run) -> serde_json::Value {
    let (e, _) = &world.performed[&format!("{}:close:{}:draft_pr", run.id, run.attempt)];
    let Effect::Call { args, skill, .. } = e else {
        panic!()
    };
    assert_eq!(skill, "open_pr");
    args.clone()
}

#[test]
fn attempts_exhausted_hand_off_as_fail_safe() {
    let mut world = World::with(ci_hook(|a| match a {
        1 => "FAIL test_one",
        2 => "FAIL test_two",
        _ => "FAIL test_three",
    }));
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::FailSafe)));
    assert_eq!(run.attempt, 3);
    let args = draft_pr_args(&world, &run);
    assert_eq!(args["draft"], true);
    assert_eq!(args["labels"], json!(["factory:needs-human"]));
    let t = trace(&world);
    assert!(
        !t.iter().any(|s| s.starts_with("approval.")),
        "no approval in a hand-off: {t:?}"
    );
    assert_eq!(
        &t[t.len() - 3..],
        ["forgejo.open_pr", "plane.comment", "zulip.post"]
    );
}

#[test]
fn a_closing_comment_tried_again_keeps_its_external_id() {
    // Attempts fail CI until fail_safe; the closing comment's first try fails retryably (its answer was lost).
    let ci = ci_hook(|_| "FAIL test_one");
    let comment_failed = std::cell::Cell::new(false);
    let mut world = World::with(move |e| match e {
        Effect::Call { skill, .. } if skill == "comment" && !comment_failed.replace(true) => {
            Some(Outcome::Failed {
                error: "HTTP 502".into(),
                retryable: true,
            })
        }
        _ => ci(e),
    });
    let (w, _) = drive(&mut world, ctx());
    assert_eq!(ended(&w).0, RunState::Failed);
    let mut comments: Vec<(String, String)> = world
        .performed
        .iter()
        .filter_map(|(step, (e, _))| match e {
            Effect::Call { skill, args, .. } if skill == "comment" => {
                Some((step.clone(), args["external_id"].as_str()?.to_string()))
            }
            _ => None,
        })
        .collect();
    comments.sort();
    assert_eq!(comments.len(), 2, "{comments:?}");
    let (first, second) = (&comments[0], &comments[1]);
    assert_ne!(first.0, second.0, "each try is its own step");
    assert!(second.0.ends_with("~2"), "{comments:?}");
    // Both tries name the same comment (the first try's step), so Plane refuses a second copy.
    assert_eq!(first.1, first.0);
    assert_eq!(second.1, first.0);
}

#[test]
fn same_ci_failure_twice_is_no_progress() {
    let mut world = World::with(ci_hook(|_| "FAIL test_checkout"));
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::NoProgress)));
    assert_eq!(run.attempt, 2);
    assert_eq!(
        draft_pr_args(&world, &run)["labels"],
        json!(["factory:needs-human"])
    );
}

#[test]
fn identical_patch_is_no_progress() {
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, .. } if purpose == "fix" => Some(Outcome::Model {
            text: fix_text(1),
            input_tokens: 10,
            output_tokens: 10,
        }),
        Effect::Call { skill, step, .. } if skill == "ci_status" => Some(Outcome::Agent(
            json!({"state": "failure", "log": format!("FAIL t{}", parts(step).1)}),
        )),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::NoProgress)));
    assert!(run.ending.unwrap().detail.contains("same patch"));
    assert!(
        !world
            .performed
            .contains_key(&format!("{}:fix:2:commit_patch", run.id))
    );
}

#[test]
fn a_check_that_passed_and_now_fails_is_oscillation() {
    let mut world = World::with(ci_hook(|a| {
        if a == 1 {
            "PASS test_a\nFAIL test_b"
        } else {
            "FAIL test_a\nPASS test_b"
        }
    }));
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::Oscillation)));
    assert!(
        run.ending
            .unwrap()
            .detail
            .contains("`test_a` passed in attempt 1 and fails in attempt 2")
    );
}

#[test]
fn lead_review_changes_go_back_to_fix_with_the_report() {
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, step, .. } if purpose == "lead_review" && parts(step).1 == 2 => {
            Some(Outcome::Model {
                text: "Please handle a missing order.\nAll good, almost".into(),
                input_tokens: 1,
                output_tokens: 1,
            })
        }
        _ => None,
    });
    let (_, run) = drive(&mut world, ctx());
    assert_eq!(run.state, RunState::Succeeded);
    assert_eq!(run.attempt, 3);
    let (fix3, _) = &world.performed[&format!("{}:fix:3:propose", run.id)];
    let Effect::Model { messages, .. } = fix3 else {
        panic!()
    };
    assert!(
        messages[1]
            .content
            .contains("Please handle a missing order.")
    );
}

#[test]
fn the_most_severe_audit_findings_reach_the_next_attempt_however_many() {
    // More blocking text than the feedback keeps (its last MAX_FEEDBACK bytes): the critical finding, listed first,
    // must still be what the next attempt reads.
    let mut report = String::from("CRITICAL src/checkout.py:1 the secret key is logged\n");
    for i in 0..30 {
        report.push_str(&format!("HIGH src/checkout.py:{i} {}\n", "h".repeat(400)));
    }
    let mut world = World::with(move |e| match e {
        Effect::Model { purpose, step, .. }
            if purpose == "security_audit" && parts(step).1 == 2 =>
        {
            Some(Outcome::Model {
                text: report.clone(),
                input_tokens: 1,
                output_tokens: 1,
            })
        }
        _ => None,
    });
    let (w, _) = drive(&mut world, ctx());
    let feedback = w
        .log
        .iter()
        .find_map(|e| match e {
            Event::AttemptFailed {
                attempt: 2,
                feedback,
                ..
            } => Some(feedback.clone()),
            _ => None,
        })
        .expect("the audit failed attempt 2");
    assert!(feedback.contains("the secret key is logged"), "{feedback}");
}

#[test]
fn high_audit_finding_goes_back_to_fix() {
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, step, .. }
            if purpose == "security_audit" && parts(step).1 == 2 =>
        {
            Some(Outcome::Model {
                text: format!(
                    "HIGH src/checkout.py:1 trusts client currency\n{}",
                    loams_factory::AUDIT_APPROVAL
                ),
                input_tokens: 1,
                output_tokens: 1,
            })
        }
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(run.state, RunState::Succeeded);
    assert_eq!(run.attempt, 3);
    assert!(
        w.log
            .iter()
            .any(|e| matches!(e, Event::SecurityAudited { approved: false, findings, .. } if findings.len() == 1))
    );
}

#[test]
fn denied_merge_compensates() {
    let mut world = World::new();
    world.deny = vec!["merge"];
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::ApprovalDenied)));
    let t = calls(&world);
    assert!(!t.contains(&"forgejo.merge".to_string()));
    assert_eq!(&t[t.len() - 4..], CLOSING_CALLS);
    assert!(run.links.deploy_ref.is_none());
}

#[test]
fn kill_input_before_merge_compensates_and_ends_killed() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    // Run until the first PR exists.
    while let Some(msg) = w.queue.pop_front() {
        w.process(&msg, &mut world, None);
        if w.run().links.pr_number.is_some() {
            break;
        }
    }
    w.queue.push_front(Some(Input::Kill {
        by: "carol".into(),
        reason: "wrong fix".into(),
    }));
    let run = w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Killed, Some(Reason::Killed)));
    assert_eq!(run.state, RunState::Killed);
    let t = calls(&world);
    assert_eq!(&t[t.len() - 4..], CLOSING_CALLS);
    assert!(!t.contains(&"model.lead_review".to_string()));
    // A second kill is a no-op.
    assert_eq!(
        decide(
            &run,
            &Input::Kill {
                by: "x".into(),
                reason: "y".into()
            },
            &ctx()
        )
        .unwrap(),
        vec![]
    );
}

#[test]
fn kill_after_merge_reverts_behind_an_approval() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    while let Some(msg) = w.queue.pop_front() {
        w.process(&msg, &mut world, None);
        if w.run().links.deploy_ref.is_some() {
            break;
        }
    }
    w.queue.push_front(Some(Input::Kill {
        by: "carol".into(),
        reason: "stop".into(),
    }));
    let run = w.drain(&mut world);
    assert_eq!(run.state, RunState::Killed);
    let t = calls(&world);
    assert_eq!(
        &t[t.len() - 4..],
        [
            "approval.revert",
            "forgejo.revert",
            "plane.comment",
            "zulip.post"
        ]
    );
    assert_eq!(
        run.links.follow_pr_url.as_deref(),
        Some("https://forgejo.example/pr/8")
    );
}

#[test]
fn org_kill_switch_stops_everything() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    for _ in 0..6 {
        let msg = w.queue.pop_front().unwrap();
        w.process(&msg, &mut world, None);
    }
    let performed = world.order.len();
    w.ctx.kill.org = true;
    let run = w.drain(&mut world);
    assert_eq!(run.state, RunState::Killed);
    assert_eq!(
        world.order.len(),
        performed,
        "no call once the organisation is killed, not even compensation"
    );
    assert!(
        w.log
            .iter()
            .any(|e| matches!(e, Event::FinishStepSkipped { .. }))
    );
}

#[test]
fn agent_kill_switch_kills_the_run_at_that_agent() {
    let mut c = ctx();
    c.kill.agents = vec!["plane".into()];
    let mut world = World::new();
    let (w, run) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Killed, Some(Reason::Killed)));
    assert!(run.links.issue_id.is_none());
    assert!(!trace(&world).iter().any(|s| s.starts_with("plane.")));
    assert_eq!(
        trace(&world).last().map(String::as_str),
        Some("zulip.post"),
        "the thread is told"
    );
}

#[test]
fn budget_stops_before_the_next_model_call() {
    let mut c = ctx();
    c.config.budget_tokens = 1_000;
    let mut world = World::new();
    let (w, run) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::Budget)));
    // Attempt 1's fix starts with nothing spent; after its 1 200 tokens attempt 2's fix does not start.
    assert_eq!(
        trace(&world)
            .iter()
            .filter(|s| s.starts_with("model."))
            .count(),
        1
    );
    assert_eq!(draft_pr_args(&world, &run)["draft"], true);
}

#[test]
fn an_organisation_over_its_monthly_budget_pays_for_no_model_call() {
    let over = [
        (
            (Some(5_000_000), None),
            loams_factory::OrgSpend {
                spent_micros: 5_000_000,
                ..Default::default()
            },
        ),
        (
            (None, Some(1_000_000)),
            loams_factory::OrgSpend {
                spent_tokens: 1_000_000,
                ..Default::default()
            },
        ),
    ];
    for ((limit_micros, limit_tokens), spend) in over {
        let mut c = ctx();
        c.config.org_budget_micros = limit_micros;
        c.config.org_budget_tokens = limit_tokens;
        c.org_spend = spend;
        let mut world = World::new();
        let (w, _) = drive(&mut world, c);
        assert_eq!(
            ended(&w),
            (RunState::Failed, Some(Reason::Budget)),
            "{spend:?}"
        );
        assert!(!trace(&world).iter().any(|s| s.starts_with("model.")));
        let detail = w.log.iter().find_map(|e| match e {
            Event::Abandoned { detail, .. } => Some(detail.clone()),
            _ => None,
        });
        assert!(
            detail
                .as_deref()
                .is_some_and(|d| d.contains("organisation's model budget")),
            "{detail:?}"
        );
    }

    // Under both limits the same run is paid for as usual.
    let mut c = ctx();
    c.config.org_budget_micros = Some(5_000_000);
    c.config.org_budget_tokens = Some(1_000_000);
    c.org_spend = loams_factory::OrgSpend {
        spent_micros: 4_999_999,
        spent_tokens: 999_999,
    };
    let mut world = World::new();
    let (w, _) = drive(&mut world, c);
    assert_eq!(ended(&w).0, RunState::Succeeded);
}

#[test]
fn policy_deny_stops_and_policy_approve_gates_writes() {
    let mut c = ctx();
    c.policy.rules = vec![Rule {
        agent: Some("plane".into()),
        skill: None,
        env: None,
        verdict: Verdict::Deny,
    }];
    let mut world = World::new();
    let (w, _) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::PolicyDenied)));
    assert!(!trace(&world).iter().any(|s| s.starts_with("plane.")));

    let mut c = ctx();
    c.policy.protected_envs = vec!["production".into()];
    let mut world = World::new();
    let (_, run) = drive(&mut world, c);
    assert_eq!(run.state, RunState::Succeeded);
    let t = trace(&world);
    assert_eq!(&t[..2], ["approval.open_thread", "zulip.open_thread"]);
    assert!(t.contains(&"approval.commit_patch".to_string()));
}

#[test]
fn a_patch_whose_commit_gate_would_make_the_run_too_large_fails_before_the_gate() {
    // A file and its patch that fit in a run together, not with the gate on committing them (protected writes),
    // whose request carries the patched file once more: judged without the gate, the run would be accepted and
    // then be more than a store keeps.
    let mut c = ctx();
    c.policy.protected_envs = vec!["production".into()];
    let mut world = World::with(large_patch_hook(20_000));
    let (w, run) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    assert!(run.ending.unwrap().detail.contains("a run keeps"));
    assert!(!trace(&world).contains(&"approval.commit_patch".to_string()));
    // The answer was paid for and stays counted.
    assert_eq!(run.budget.tokens, 1_200);
}

/// A read of `lines` lines and a fix rewriting every one of them.
fn large_patch_hook(lines: usize) -> impl Fn(&Effect) -> Option<Outcome> {
    let content = "x = 1\n".repeat(lines);
    let patched = "y = 2\n".repeat(lines);
    move |e: &Effect| match e {
        Effect::Call { skill, .. } if skill == "read_files" => Some(Outcome::Agent(
            json!({"files": [{"path": "src/checkout.py", "content": content}]}),
        )),
        Effect::Model { purpose, .. } if purpose == "fix" => Some(Outcome::Model {
            text: format!("Rewrite.\n\n=== src/checkout.py\n```python\n{patched}```\n"),
            input_tokens: 1_000,
            output_tokens: 200,
        }),
        _ => None,
    }
}

/// A run driven up to its commit with a patch of `large_patch_hook(lines)`, and its world.
fn patched(lines: usize) -> (World, Worker) {
    let mut world = World::with(large_patch_hook(lines));
    let mut w = Worker::start(signal(), ctx());
    until_run(&mut w, &mut world, |run| !run.patch.is_empty());
    (world, w)
}

#[test]
fn a_commit_gate_a_policy_opens_after_the_patch_is_judged_too() {
    // The files and patch of the test above, accepted with no environment protected; then the environment becomes
    // protected before the commit, so the gate, whose request carries the files once more, opens in a later
    // decision. It is judged there: the run fails with its reason instead of becoming more than a store keeps.
    let (mut world, mut w) = patched(20_000);
    w.ctx.policy.protected_envs = vec!["production".into()];
    let run = w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    let detail = run.ending.clone().unwrap().detail;
    assert!(
        detail.contains(":commit_patch: the files it brings") && detail.contains("a run keeps"),
        "{detail}"
    );
    assert!(run.gate.is_none());
    assert!(!trace(&world).iter().any(|s| s.ends_with(".commit_patch")));
    assert!(serde_json::to_vec(&run).unwrap().len() <= loams_factory::MAX_RUN_BYTES);
}

#[test]
fn a_late_commit_gate_on_a_retry_fails_the_retry_not_the_failed_commit() {
    // The commit fails for a passing reason and the environment is protected by the time that failure is decided:
    // the guards gate the retry, whose gate would carry the files. The failure is kept as it came, and the step
    // refused for the size is the retry, not the commit that timed out.
    let (_, mut w) = patched(20_000);
    let run = w.run();
    let commit = run.next_effect().unwrap();
    assert!(
        commit.step().ends_with(":commit_patch"),
        "{}",
        commit.step()
    );
    let mut protected = w.ctx.clone();
    protected.policy.protected_envs = vec!["production".into()];
    let timed_out = Input::Completed {
        step: commit.step().into(),
        outcome: Outcome::Failed {
            error: "timed out".into(),
            retryable: true,
        },
    };
    let events = loams_factory::decide(&run, &timed_out, &protected).unwrap();
    let failed = failed_steps(&events);
    assert_eq!(failed.len(), 2, "{events:?}");
    assert_eq!(failed[0], (commit.step(), true));
    // The retried call itself (its step carries the retry's count), not its approval.
    let retry = format!("{}~2", commit.step());
    assert_eq!(failed[1], (retry.as_str(), false));
    assert!(!events.iter().any(
        |e| matches!(e, Event::GateOpened { request } if request.action.skill == "commit_patch")
    ));
    assert_eq!(
        after(&run, &events).ending.map(|e| e.reason),
        Some(Some(Reason::StepFailed))
    );
}

/// A run driven in `world` until its next effect is the one `next` picks, that effect, and the context it ran in.
fn until_next(
    world: &mut World,
    next: impl Fn(&Effect) -> bool,
) -> (Run, Effect, loams_factory::Ctx) {
    let mut w = Worker::start(signal(), ctx());
    until_run(&mut w, world, |run| {
        run.next_effect().is_some_and(|e| next(&e))
    });
    let run = w.run();
    let effect = run.next_effect().unwrap();
    (run, effect, w.ctx)
}

/// The steps `events` fail, each with whether it may be retried.
fn failed_steps(events: &[Event]) -> Vec<(&str, bool)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::StepFailed {
                step, retryable, ..
            } => Some((step.as_str(), *retryable)),
            _ => None,
        })
        .collect()
}

/// `run` as `events` leave it.
fn after(run: &Run, events: &[Event]) -> Run {
    let mut run = run.clone();
    for e in events {
        run.apply(e);
    }
    run
}

#[test]
fn a_kill_with_a_read_too_large_to_keep_ends_the_run_as_killed() {
    // The organisation is killed while a read brings a file the run cannot keep: the files go, the kill stays, and
    // the run ends killed, not failed for the size (whose refusal is recorded all the same).
    let reads = |e: &Effect| matches!(e, Effect::Call { skill, .. } if skill == "read_files");
    let (run, read, mut killed) = until_next(&mut World::new(), reads);
    killed.kill.org = true;
    // 258,000 bytes, within one file's limit; over 300,000 as JSON (each newline escaped).
    let content = "x = 1\n".repeat(43_000);
    let answered = Input::Completed {
        step: read.step().into(),
        outcome: Outcome::Agent(
            json!({"files": [{"path": "src/checkout.py", "content": content}]}),
        ),
    };
    let events = decide(&run, &answered, &killed).unwrap();
    assert!(!events.iter().any(|e| matches!(e, Event::FilesRead { .. })));
    // The refusal is on record, under the read.
    assert_eq!(failed_steps(&events), [(read.step(), false)]);
    let ending = after(&run, &events).ending.expect("the run ends");
    assert_eq!(
        (ending.state, ending.reason),
        (RunState::Killed, Some(Reason::Killed)),
        "{events:?}"
    );
}

#[test]
fn an_agent_kill_with_a_patch_too_large_to_keep_ends_the_run_as_killed() {
    // Forgejo is switched off while the fix brings a patch the run cannot keep: the guards would end the run killed
    // at the commit that follows; without the patch the run still ends killed, its answer's tokens counted.
    let fixes = |e: &Effect| matches!(e, Effect::Model { purpose, .. } if purpose == "fix");
    let (run, fix, mut killed) = until_next(&mut World::with(large_patch_hook(22_000)), fixes);
    killed.kill.agents = vec!["forgejo".into()];
    let answered = Input::Completed {
        step: fix.step().into(),
        outcome: large_patch_hook(22_000)(&fix).unwrap(),
    };
    let events = decide(&run, &answered, &killed).unwrap();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, Event::PatchProposed { .. }))
    );
    assert_eq!(failed_steps(&events), [(fix.step(), false)]);
    let ended = after(&run, &events);
    assert_eq!(ended.budget.tokens, run.budget.tokens + 1_200);
    let ending = ended.ending.expect("the run ends");
    assert_eq!(
        (ending.state, ending.reason),
        (RunState::Killed, Some(Reason::Killed)),
        "{events:?}"
    );
    assert!(ending.detail.contains("agent forgejo"), "{}", ending.detail);
}

#[test]
fn a_retried_fix_whose_patch_is_too_large_fails_under_its_own_step() {
    // The first call of the fix fails for a passing reason; its retry brings a patch the run cannot keep. The step
    // that fails is the retry that answered, although the answer's tokens (progress) reset the count of retries.
    let fixes = |e: &Effect| matches!(e, Effect::Model { purpose, .. } if purpose == "fix");
    let (run, fix, ctx) = until_next(&mut World::with(large_patch_hook(22_000)), fixes);
    let limited = Input::Completed {
        step: fix.step().into(),
        outcome: Outcome::Failed {
            error: "rate limited".into(),
            retryable: true,
        },
    };
    let run = after(&run, &decide(&run, &limited, &ctx).unwrap());
    let retry = run.next_effect().unwrap();
    assert_eq!(retry.step(), format!("{}~2", fix.step()));
    let answered = Input::Completed {
        step: retry.step().into(),
        outcome: large_patch_hook(22_000)(&retry).unwrap(),
    };
    let events = decide(&run, &answered, &ctx).unwrap();
    let failed = failed_steps(&events);
    assert_eq!(failed, [(retry.step(), false)], "{events:?}");
}

#[test]
fn a_commit_gate_a_policy_opens_after_the_patch_opens_when_it_fits() {
    // Smaller files: the late gate fits, the commit is approved and made, and the run stays within what a store keeps
    // at every step.
    let (mut world, mut w) = patched(13_500);
    w.ctx.policy.protected_envs = vec!["production".into()];
    until_run(&mut w, &mut world, |run| {
        let size = serde_json::to_vec(run).unwrap().len();
        assert!(
            size <= loams_factory::MAX_RUN_BYTES + loams_factory::RUN_HEADROOM_BYTES,
            "{size}"
        );
        run.state.is_terminal()
    });
    // The world fails the first attempt's CI and the second proposes the same patch, so the run stops there.
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::NoProgress)));
    let t = trace(&world);
    assert!(t.contains(&"approval.commit_patch".to_string()));
    assert!(t.contains(&"forgejo.commit_patch".to_string()));
}

#[test]
fn what_a_run_records_after_its_last_files_fits_in_the_headroom() {
    // Files that bring the run just under MAX_RUN_BYTES on its only attempt, then a CI failure whose log is made to
    // cost the most JSON (distinct checks of quotes and backslashes, escaped to two bytes each; control characters,
    // six, are dropped), kept as the report's checks, its signature and the feedback, then the hand-off and ending.
    let content = "x = 1\n".repeat(41_800);
    let log: String = (0..60)
        .map(|i| format!("FAIL c{i:02}{}\u{1}\n", "\"\\".repeat(95)))
        .collect();
    let hook = move |e: &Effect| match e {
        Effect::Call { skill, .. } if skill == "read_files" => Some(Outcome::Agent(
            json!({"files": [{"path": "src/checkout.py", "content": content}]}),
        )),
        Effect::Call { skill, .. } if skill == "ci_status" => {
            Some(Outcome::Agent(json!({"state": "failure", "log": log})))
        }
        _ => None,
    };
    let mut c = ctx();
    c.config.max_attempts = 1;
    let mut world = World::with(hook);
    let (w, run) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::FailSafe)));
    assert_eq!(run.files.len(), 1, "the files were not kept");
    let size = serde_json::to_vec(&run).unwrap().len();
    assert!(
        size > loams_factory::MAX_RUN_BYTES
            && size <= loams_factory::MAX_RUN_BYTES + loams_factory::RUN_HEADROOM_BYTES,
        "the run ended at {size} bytes"
    );
}

#[test]
fn auto_triage_needs_no_person() {
    let mut c = ctx();
    c.policy.auto_triage = true;
    let mut world = World::new();
    let (w, run) = drive(&mut world, c);
    assert_eq!(run.state, RunState::Succeeded);
    assert!(!trace(&world).contains(&"wait.await_decision".to_string()));
    assert!(w.log.iter().any(|e| matches!(
        e,
        Event::TriageDecided {
            automatic: true,
            ..
        }
    )));
}

fn until_run(w: &mut Worker, world: &mut World, done: impl Fn(&Run) -> bool) {
    while let Some(msg) = w.queue.pop_front() {
        w.process(&msg, world, None);
        if done(&w.run()) {
            return;
        }
    }
    panic!("never reached the wanted state");
}

/// Runs until the run rests at `cursor` with nothing to do but wait.
fn until(w: &mut Worker, world: &mut World, cursor: Cursor) {
    until_run(w, world, |r| {
        r.cursor == cursor && r.next_effect().is_none()
    });
}

/// The trace without timers, whose presence depends on how fast a settlement arrives.
fn calls(world: &World) -> Vec<String> {
    trace(world)
        .into_iter()
        .filter(|s| !s.starts_with("wait."))
        .collect()
}

#[test]
fn triage_wait_stalls_and_rejection_ends_the_run() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    until(&mut w, &mut world, Cursor::AwaitTriage);
    w.queue.clear();
    let run = w.run();
    let wait = run.wait.clone().unwrap();
    assert_eq!(wait.timer_id, format!("{}:triage:0:await_decision", run.id));
    assert_eq!(
        decide(
            &run,
            &Input::TimerFired {
                timer_id: "other".into()
            },
            &w.ctx
        )
        .unwrap(),
        vec![]
    );
    // The stall timeout is a day away; a timer fired after it is the deadline, whichever timer it is.
    w.ctx.now_ms = wait.due_ms;
    w.queue.push_back(Some(Input::TimerFired {
        timer_id: wait.timer_id,
    }));
    let run = w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::Stalled)));
    assert_eq!(run.links.issue_id, None);
    assert_eq!(trace(&world).last().map(String::as_str), Some("zulip.post"));

    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    until(&mut w, &mut world, Cursor::AwaitTriage);
    w.queue.clear();
    w.queue.push_back(Some(Input::TriageDecided {
        accept: false,
        by: "oncall".into(),
    }));
    w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::TriageRejected)));
}

fn count_hook(count: u64) -> impl Fn(&Effect) -> Option<Outcome> {
    move |e| match e {
        Effect::Call { skill, .. } if skill == "issue_events" => {
            Some(Outcome::Agent(json!({"count": count, "last_seen_ms": NOW})))
        }
        _ => None,
    }
}

#[test]
fn regression_reverts_behind_approval_and_asks_for_a_follow_up() {
    let mut world = World::with(count_hook(50));
    let (w, run) = drive(&mut world, ctx());
    let Some(Event::Ended {
        state,
        reason,
        verdict,
        follow_up,
    }) = w.log.last()
    else {
        panic!()
    };
    assert_eq!(
        (*state, *reason, *verdict),
        (
            RunState::Failed,
            Some(Reason::Regressed),
            Some(ObserveVerdict::Regressed)
        )
    );
    let t = calls(&world);
    assert_eq!(
        &t[t.len() - 4..],
        [
            "approval.revert",
            "forgejo.revert",
            "plane.comment",
            "zulip.post"
        ]
    );
    let (revert, _) = &world.performed[&format!("{}:close:2:revert", run.id)];
    let Effect::Call {
        args, approval_id, ..
    } = revert
    else {
        panic!()
    };
    assert_eq!(args["merge_sha"], "m3rge");
    assert!(approval_id.is_some());

    let follow = follow_up.clone().expect("follow-up below the cap");
    assert_eq!(follow.generation, 2);
    assert_eq!(follow.parent_run, run.id);
    // The follow-up opens despite the fingerprint's cooldown; its own regression hits the generation cap (2).
    let mut c = ctx();
    c.last_run = Some(LastRun {
        run_id: run.id.clone(),
        at_ms: NOW,
    });
    let (child, _) = open(follow.signal.clone(), &c).unwrap();
    assert_eq!(child.generation, 2);
    assert_eq!(child.parent_run.as_deref(), Some(run.id.as_str()));
    let mut world = World::with(count_hook(50));
    let mut w = Worker::start(follow.signal, c);
    w.drain(&mut world);
    assert!(matches!(
        w.log.last(),
        Some(Event::Ended {
            follow_up: None,
            reason: Some(Reason::Regressed),
            ..
        })
    ));
}

#[test]
fn inconclusive_extends_once_then_asks_a_person() {
    let mut world = World::with(count_hook(2));
    let mut w = Worker::start(signal(), ctx());
    until(&mut w, &mut world, Cursor::AwaitVerdict);
    let run = w.run();
    assert_eq!(run.observe_round, 2);
    assert!(
        world
            .performed
            .contains_key(&format!("{}:observe:2:issue_events", run.id))
    );
    assert_eq!(run.state, RunState::Waiting);
    assert!(
        decide(
            &run,
            &Input::VerdictGiven {
                verdict: ObserveVerdict::Inconclusive,
                by: "bob".into()
            },
            &w.ctx
        )
        .is_err()
    );
    w.queue.clear();
    w.queue.push_back(Some(Input::VerdictGiven {
        verdict: ObserveVerdict::Resolved,
        by: "bob".into(),
    }));
    let run = w.drain(&mut world);
    assert_eq!(run.state, RunState::Succeeded);
    assert!(
        w.log
            .iter()
            .any(|e| matches!(e, Event::VerdictReached { by: Some(b), .. } if b == "bob"))
    );
}

#[test]
fn ill_typed_output_is_a_recorded_failure() {
    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "open_pr" => {
            Some(Outcome::Agent(json!({"number": "seven"})))
        }
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    assert!(run.ending.unwrap().detail.contains("`number`"));
    assert!(w.log.iter().any(|e| matches!(
        e,
        Event::StepFailed {
            retryable: false,
            ..
        }
    )));
}

#[test]
fn a_failed_attempt_keeps_a_bounded_reason() {
    // A patch whose path is the model's long line: the attempt's reason quotes it, and the run keeps the reason.
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, .. } if purpose == "fix" => Some(Outcome::Model {
            text: format!("Fix.\n\n=== {}\n```\nx\n```\n", "\"".repeat(100_000)),
            input_tokens: 1,
            output_tokens: 1,
        }),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::FailSafe)));
    let reasons: Vec<usize> = w
        .log
        .iter()
        .filter_map(|e| match e {
            Event::AttemptFailed { reason, .. } => Some(reason.len()),
            _ => None,
        })
        .collect();
    assert!(
        !reasons.is_empty() && reasons.iter().all(|n| *n <= 2_000),
        "{reasons:?}"
    );
    assert!(serde_json::to_vec(&run).unwrap().len() < 50_000);
}

#[test]
fn retryable_failure_retries_under_a_new_step_id() {
    let mut world = World::with(|e| match e {
        Effect::Call { skill, step, .. } if skill == "create_issue" && !step.ends_with("~3") => {
            Some(Outcome::Failed {
                error: "503".into(),
                retryable: true,
            })
        }
        _ => None,
    });
    let (_, run) = drive(&mut world, ctx());
    assert_eq!(run.state, RunState::Succeeded);
    for s in ["create_issue", "create_issue~2", "create_issue~3"] {
        assert!(
            world
                .performed
                .contains_key(&format!("{}:plan:0:{s}", run.id)),
            "{s}"
        );
    }

    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "create_issue" => Some(Outcome::Failed {
            error: "503".into(),
            retryable: true,
        }),
        _ => None,
    });
    let (w, _) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
}

#[test]
fn duplicates_and_stale_inputs_are_ignored() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    let run = w.run();
    let effect = run.next_effect().unwrap();
    let (outcome, _) = world.perform(&effect);
    let done = Input::Completed {
        step: effect.step().into(),
        outcome,
    };
    let ev = decide(&run, &done, &w.ctx).unwrap();
    assert!(!ev.is_empty());
    let mut after = run.clone();
    ev.iter().for_each(|e| after.apply(e));
    assert_eq!(
        decide(&after, &done, &w.ctx).unwrap(),
        vec![],
        "duplicate completion"
    );
    let stale = Input::Completed {
        step: format!("{}:fix:9:open_pr", run.id),
        outcome: Outcome::Agent(json!({})),
    };
    assert_eq!(decide(&after, &stale, &w.ctx).unwrap(), vec![]);
    let foreign = Input::Completed {
        step: "r-ffffffffffffffff:triage:0:open_thread".into(),
        outcome: Outcome::Agent(json!({})),
    };
    assert!(matches!(
        decide(&after, &foreign, &w.ctx),
        Err(Rejection::InvalidInput(_))
    ));
    assert_eq!(
        decide(
            &after,
            &Input::ApprovalSettled {
                approval_id: "nope".into(),
                approved: true,
                by: "b".into()
            },
            &w.ctx
        )
        .unwrap(),
        vec![]
    );

    // An approval settled twice counts once.
    until_run(&mut w, &mut world, |r| {
        r.gate.is_some() && r.cursor == Cursor::Merge
    });
    let run = w.run();
    let gate = run.gate.clone().expect("merge gate");
    let settle = Input::ApprovalSettled {
        approval_id: gate.request.id.clone(),
        approved: true,
        by: "bob".into(),
    };
    let ev = decide(&run, &settle, &w.ctx).unwrap();
    let mut after = run.clone();
    ev.iter().for_each(|e| after.apply(e));
    assert!(
        matches!(after.next_effect(), Some(Effect::Call { ref skill, .. }) if skill == "merge")
    );
    assert_eq!(decide(&after, &settle, &w.ctx).unwrap(), vec![]);
    // The stale expiry timer of the settled approval does nothing.
    let timer = Input::TimerFired {
        timer_id: format!("{}.wait", gate.request.id),
    };
    assert_eq!(decide(&after, &timer, &w.ctx).unwrap(), vec![]);
}

#[test]
fn safety_wall_holds_without_an_approval_whatever_the_policy() {
    let mut c = ctx();
    c.policy.rules = vec![Rule {
        agent: None,
        skill: None,
        env: None,
        verdict: Verdict::Allow,
    }];
    let mut world = World::new();
    let mut w = Worker::start(signal(), c);
    until_run(&mut w, &mut world, |r| {
        r.gate.is_some() && r.cursor == Cursor::Merge
    });
    let run = w.run();
    assert!(
        run.gate.is_some(),
        "merge gated although the policy allows everything"
    );
    assert_eq!(run.stage, loams_factory::Stage::Approve);
    // Even with the gate removed by hand, next_effect refuses the unapproved destructive call.
    let mut forged = run.clone();
    forged.gate = None;
    forged.wait = None;
    assert_eq!(forged.next_effect(), None);
}

#[test]
fn open_refusals() {
    let c = ctx();
    let (run, e) = open(signal(), &c).unwrap();
    assert_eq!(run.version, 1);
    assert_eq!(
        run.id,
        run_id("acme", "checkout-keyerror", 1),
        "a fingerprint's first run"
    );
    assert_eq!(
        open(signal(), &c).unwrap().1,
        e,
        "opening twice gives the same first event"
    );
    let mut s = signal();
    s.generation = 3;
    s.parent_run = Some("r-1".into());
    assert_eq!(
        open(s, &ctx()).unwrap_err(),
        Rejection::GenerationCap {
            generation: 3,
            cap: 2
        }
    );
    let mut k = ctx();
    k.kill.org = true;
    assert!(matches!(open(signal(), &k), Err(Rejection::Killed(_))));
    let mut s = signal();
    s.title = "x".repeat(10_000);
    assert!(matches!(open(s, &ctx()), Err(Rejection::InvalidSignal(_))));
    let mut bad = ctx();
    bad.org = "Not An Org".into();
    assert!(matches!(
        open(signal(), &bad),
        Err(Rejection::InvalidSignal(_))
    ));
    let mut bad = ctx();
    bad.last_run = Some(LastRun {
        run_id: "../../x".into(),
        at_ms: NOW,
    });
    assert!(matches!(
        open(signal(), &bad),
        Err(Rejection::InvalidInput(_))
    ));
}

/// The context of an alert for the same fingerprint `after_ms` after the last run opened.
fn later(last: &Run, after_ms: i64, status: LastRunStatus) -> loams_factory::Ctx {
    let mut c = ctx();
    c.now_ms = NOW + after_ms;
    c.last_run = Some(LastRun {
        run_id: last.id.clone(),
        at_ms: NOW,
    });
    c.last_run_status = status;
    c
}

#[test]
fn repeated_alerts_join_the_open_run_then_cool_down_then_open_a_new_lineage() {
    let cooldown = ctx().config.cooldown_ms as i64;
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    until(&mut w, &mut world, Cursor::AwaitTriage);
    let first = w.run();

    // While the run is open, however long it takes, a repeat alert is the same run (create-if-absent: a no-op).
    for after in [1, cooldown, 10 * cooldown] {
        let (again, _) = open(signal(), &later(&first, after, LastRunStatus::Open)).unwrap();
        assert_eq!(again.id, first.id, "{after} ms after opening");
    }
    // Without the state, the run is taken for open during the cooldown after its opening.
    assert_eq!(
        open(
            signal(),
            &later(&first, cooldown - 1, LastRunStatus::Unknown)
        )
        .unwrap()
        .0
        .id,
        first.id
    );

    // The run ends; within the cooldown after its end a new alert is refused, not silently mapped to the old run.
    w.queue.clear();
    w.queue.push_back(Some(Input::TriageDecided {
        accept: false,
        by: "oncall".into(),
    }));
    w.drain(&mut world);
    assert!(w.run().state.is_terminal());
    let ended_at = NOW + 5_000;
    let ended = LastRunStatus::Ended { at_ms: ended_at };
    assert_eq!(
        open(signal(), &later(&first, 6_000, ended)).unwrap_err(),
        Rejection::Cooldown {
            until_ms: ended_at + cooldown
        }
    );
    assert_eq!(
        open(signal(), &later(&first, 5_000 + cooldown - 1, ended)).unwrap_err(),
        Rejection::Cooldown {
            until_ms: ended_at + cooldown
        }
    );

    // After the cooldown: a new lineage with its own id, derived from the run it follows, so two workers agree.
    let c = later(&first, 5_000 + cooldown, ended);
    let (second, opened) = open(signal(), &c).unwrap();
    assert_ne!(second.id, first.id);
    assert_eq!(
        second.id,
        run_id_after("acme", "checkout-keyerror", 1, Some(&first.id))
    );
    assert_eq!(open(signal(), &c).unwrap().1, opened);
    assert_eq!(second.generation, 1);
    assert_eq!(second.state, RunState::Open);
    // Unknown state: the cooldown counts from the last opening.
    assert_eq!(
        open(signal(), &later(&first, cooldown, LastRunStatus::Unknown))
            .unwrap()
            .0
            .id,
        second.id
    );
    // The new lineage runs through on its own ids.
    let mut world = World::new();
    let mut w2 = Worker::start(signal(), c);
    let run = w2.drain(&mut world);
    assert_eq!(run.state, RunState::Succeeded);
    assert!(
        world
            .order
            .iter()
            .all(|s| s.starts_with(&format!("{}:", second.id)))
    );
}

#[test]
fn follow_up_generations_get_their_own_ids_per_lineage() {
    let mut a = signal();
    a.generation = 2;
    a.parent_run = Some("r-00000000000000aa".into());
    let mut b = a.clone();
    b.parent_run = Some("r-00000000000000bb".into());
    // The cooldown of an ended run does not stop the lineage's own follow-up.
    let mut c = ctx();
    c.last_run = Some(LastRun {
        run_id: "r-00000000000000aa".into(),
        at_ms: NOW,
    });
    c.last_run_status = LastRunStatus::Ended { at_ms: NOW };
    let (ra, _) = open(a, &c).unwrap();
    let (rb, _) = open(b, &c).unwrap();
    assert_ne!(ra.id, rb.id);
    assert_eq!(
        ra.id,
        run_id_after("acme", "checkout-keyerror", 2, Some("r-00000000000000aa"))
    );
}

#[test]
fn oversized_model_answer_is_paid_and_recorded_as_a_failure() {
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, .. } if purpose == "fix" => Some(Outcome::Model {
            text: "x".repeat(loams_factory::MAX_MODEL_TEXT + 1),
            input_tokens: 5,
            output_tokens: 7,
        }),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    assert_eq!(run.budget.tokens, 12);
    // Before any commit there is no PR to close: only the issue and the thread are told.
    assert_eq!(
        &calls(&world)[calls(&world).len() - 2..],
        ["plane.comment", "zulip.post"]
    );
}

#[test]
fn wire_shapes() {
    let (_, e) = open(signal(), &ctx()).unwrap();
    let v = serde_json::to_value(&e).unwrap();
    assert_eq!(v["type"], "opened");
    let env = loams_factory::Envelope {
        org: "acme".into(),
        run: "r-1".into(),
        input: Some(Input::Kill {
            by: "a".into(),
            reason: "b".into(),
        }),
    };
    let json = serde_json::to_string(&env).unwrap();
    assert_eq!(
        json,
        r#"{"org":"acme","run":"r-1","input":{"type":"kill","by":"a","reason":"b"}}"#
    );
    let back: loams_factory::Envelope =
        serde_json::from_str(r#"{"org":"acme","run":"r-1"}"#).unwrap();
    assert_eq!(back.input, None);
    let done: Input =
        serde_json::from_str(r#"{"type":"completed","step":"s","outcome":{"agent":{"sha":"x"}}}"#)
            .unwrap();
    assert_eq!(
        done,
        Input::Completed {
            step: "s".into(),
            outcome: Outcome::Agent(json!({"sha": "x"}))
        }
    );
}

#[test]
fn a_patch_outside_the_target_files_fails_the_attempt_and_never_reaches_forgejo() {
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, step, .. } if purpose == "fix" && parts(step).1 == 1 => {
            Some(Outcome::Model {
                text: format!(
                    "{}=== .forgejo/workflows/ci.yml\n```yaml\non: push\n```\n",
                    fix_text(1)
                ),
                input_tokens: 10,
                output_tokens: 10,
            })
        }
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(
        run.state,
        RunState::Succeeded,
        "attempt 2 proposes an allowed patch"
    );
    let refused = w.log.iter().find_map(|e| match e {
        Event::AttemptFailed {
            attempt: 1,
            reason,
            feedback,
        } => Some((reason.clone(), feedback.clone())),
        _ => None,
    });
    let (reason, feedback) = refused.expect("attempt 1 failed");
    assert!(
        reason.contains(".forgejo/workflows/ci.yml") && reason.contains("never changed"),
        "{reason}"
    );
    assert!(
        feedback.contains("Change only these files: src/checkout.py"),
        "{feedback}"
    );
    assert!(
        !w.log
            .iter()
            .any(|e| matches!(e, Event::PatchProposed { files, .. } if files.len() > 1))
    );
    for (effect, _) in world.performed.values() {
        if let Effect::Call { agent, args, .. } = effect {
            assert!(
                !(agent == "forgejo" && args.to_string().contains(".forgejo/")),
                "{args}"
            );
        }
    }
    assert!(
        !world
            .performed
            .contains_key(&format!("{}:fix:1:commit_patch", run.id))
    );

    // A file that is not CI but not configured either is refused the same way.
    let mut world = World::with(|e| match e {
        Effect::Model { purpose, .. } if purpose == "fix" => Some(Outcome::Model {
            text: "=== src/payments.py\n```\nx = 1\n```\n".into(),
            input_tokens: 1,
            output_tokens: 1,
        }),
        _ => None,
    });
    let (w, _) = drive(&mut world, ctx());
    let outside = "not one of the configured target files";
    assert!(
        w.log
            .iter()
            .any(|e| matches!(e, Event::AttemptFailed { reason, .. } if reason.contains(outside)))
    );
    assert!(!trace(&world).contains(&"forgejo.commit_patch".to_string()));
}

#[test]
fn the_merge_approval_binds_the_changed_paths_and_patch() {
    // Two runs whose commits get the same head sha but whose patches differ need different approvals.
    let approval_of = |attempt_text: &'static str| {
        let mut world = World::with(move |e| match e {
            Effect::Model { purpose, step, .. } if purpose == "fix" && parts(step).1 == 2 => {
                Some(Outcome::Model {
                    text: format!("=== src/checkout.py\n```\n{attempt_text}\n```\n"),
                    input_tokens: 1,
                    output_tokens: 1,
                })
            }
            _ => None,
        });
        let (_, run) = drive(&mut world, ctx());
        let (e, _) = &world.performed[&format!("{}:approve:2:approval.merge", run.id)];
        let Effect::RequestApproval { approval, .. } = e else {
            panic!()
        };
        approval.clone()
    };
    let a = approval_of("x = 1");
    let b = approval_of("x = 2");
    assert_eq!(
        a.action.args, b.action.args,
        "the call itself is the same: {{number, head_sha}}"
    );
    assert_ne!(a.action.target_commit, b.action.target_commit);
    assert_ne!(a.action_hash, b.action_hash);
    assert!(a.summary.contains("src/checkout.py"), "{}", a.summary);
}

fn series_hook(errors: u64, total: u64) -> impl Fn(&Effect) -> Option<Outcome> {
    move |e| match e {
        Effect::Call { skill, .. } if skill == "issue_events" => Some(Outcome::Agent(
            json!({"count": errors, "last_seen_ms": null}),
        )),
        Effect::Call { skill, .. } if skill == "series" => {
            Some(Outcome::Agent(json!({"points": [], "total": total})))
        }
        _ => None,
    }
}

#[test]
fn analytics_errors_keep_a_quiet_glitchtip_from_resolving_and_can_regress_alone() {
    // GlitchTip quiet, analytics still counting checkout errors: not resolved; after two windows a person decides.
    let mut world = World::with(series_hook(0, 3));
    let mut w = Worker::start(signal(), ctx());
    until(&mut w, &mut world, Cursor::AwaitVerdict);
    let run = w.run();
    assert_eq!(run.observation.series_total, Some(3));
    assert!(w.log.iter().all(|e| !matches!(
        e,
        Event::VerdictReached {
            verdict: ObserveVerdict::Resolved,
            ..
        }
    )));
    assert!(w.log.iter().any(|e| matches!(
        e,
        Event::VerdictReached {
            verdict: ObserveVerdict::Inconclusive,
            ..
        }
    )));

    // Analytics above the threshold regress the fix although GlitchTip saw nothing.
    let mut world = World::with(series_hook(0, 40));
    let (w, _) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::Regressed)));

    // A signal without a GlitchTip issue resolves on a silent analytics series alone.
    let mut s = signal();
    s.glitchtip_issue_id = None;
    let mut world = World::with(series_hook(0, 0));
    let mut c = ctx();
    c.now_ms = NOW + 250;
    let mut w = Worker::start(s, c);
    let run = w.drain(&mut world);
    assert_eq!(run.state, RunState::Succeeded);
    assert!(!trace(&world).contains(&"glitchtip.issue_events".to_string()));
    // The analytics export reads whole seconds: the series starts at the first whole second after the merge.
    assert_eq!(run.links.merged_at_ms, Some(NOW + 250));
    let (series, _) = &world.performed[&format!("{}:observe:1:series", run.id)];
    let Effect::Call { args, .. } = series else {
        panic!()
    };
    assert_eq!(args["since_ms"], NOW + 1_000);
}

#[test]
fn a_sub_second_observe_window_reads_an_empty_future_series_and_resolves() {
    // The window ends before the series' first whole second: the analytics agent answers a start in the future
    // with an empty series, which counts as no analytics errors.
    let mut c = ctx();
    c.now_ms = NOW + 250;
    c.config.observe_window_ms = 500;
    let read_at = NOW + 250 + 500;
    let mut world = World::with(move |e| match e {
        Effect::Call { skill, args, .. } if skill == "series" => {
            assert!(
                args["since_ms"].as_i64().is_some_and(|t| t > read_at),
                "{args}"
            );
            Some(Outcome::Agent(json!({"points": [], "total": 0})))
        }
        _ => None,
    });
    let (w, run) = drive(&mut world, c);
    assert_eq!(ended(&w), (RunState::Succeeded, None));
    assert_eq!(run.observation.series_total, Some(0));
    assert_eq!(run.verdict, Some(ObserveVerdict::Resolved));
}

/// Delivers messages until the next one would perform the approved merge, then performs it and crashes before
/// recording its outcome; the message stays queued for redelivery.
fn merge_then_crash(w: &mut Worker, world: &mut World) {
    while let Some(msg) = w.queue.pop_front() {
        let run = w.run();
        let mut next = run.clone();
        for e in decide(&run, &msg.clone().unwrap_or(Input::Continue), &w.ctx).unwrap() {
            next.apply(&e);
        }
        if matches!(next.next_effect(), Some(Effect::Call { skill, .. }) if skill == "merge") {
            assert!(!w.process(&msg, world, Some(Crash::AfterPerform)));
            w.queue.push_front(msg);
            assert!(world.merged());
            assert_eq!(
                w.run().links.deploy_ref,
                None,
                "the merge's outcome is lost"
            );
            return;
        }
        w.process(&msg, world, None);
    }
    panic!("never reached the merge");
}

#[test]
fn a_kill_after_a_merge_whose_outcome_was_lost_reverts_it() {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    merge_then_crash(&mut w, &mut world);
    w.queue.push_front(Some(Input::Kill {
        by: "carol".into(),
        reason: "stop".into(),
    }));
    let run = w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Killed, Some(Reason::Killed)));
    // Closing finds the PR merged: the run learns the deploy and reverts it behind its own approval.
    let t = calls(&world);
    assert_eq!(
        &t[t.len() - 6..],
        [
            "approval.close_pr",
            "forgejo.close_pr",
            "approval.revert",
            "forgejo.revert",
            "plane.comment",
            "zulip.post"
        ]
    );
    assert_eq!(t.iter().filter(|s| *s == "forgejo.merge").count(), 1);
    assert!(
        w.log
            .iter()
            .any(|e| matches!(e, Event::MergeFound { merge_sha } if merge_sha == "m3rge"))
    );
    assert_eq!(run.links.deploy_ref.as_deref(), Some("m3rge"));
    assert_eq!(
        run.links.follow_pr_url.as_deref(),
        Some("https://forgejo.example/pr/8")
    );
    let (revert, _) = &world.performed[&format!("{}:close:2:revert", run.id)];
    let Effect::Call {
        args, approval_id, ..
    } = revert
    else {
        panic!()
    };
    assert_eq!(args["merge_sha"], "m3rge");
    assert!(approval_id.is_some());
}

#[test]
fn another_stop_after_a_lost_merge_records_the_deploy_and_leaves_it() {
    // The merge is performed but answered with a permanent failure (say, a timeout on the way back): the run stops
    // as a failed step and means to close the PR, which turns out merged. Only a kill reverts a deploy.
    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "merge" => Some(Outcome::Failed {
            error: "connection reset".into(),
            retryable: false,
        }),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    let t = calls(&world);
    assert_eq!(&t[t.len() - 4..], CLOSING_CALLS);
    assert_eq!(run.links.deploy_ref.as_deref(), Some("m3rge"));
    assert!(
        !w.log
            .iter()
            .any(|e| matches!(e, Event::FinishStepSkipped { .. }))
    );

    // A close answer that neither closed nor found a merge is a failed step, skipped.
    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "merge" => Some(Outcome::Failed {
            error: "no".into(),
            retryable: false,
        }),
        Effect::Call { skill, .. } if skill == "close_pr" => {
            Some(Outcome::Agent(json!({"closed": false})))
        }
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(run.links.deploy_ref, None);
    let skipped_close = |e: &Event| {
        matches!(
            e,
            Event::FinishStepSkipped {
                action: FinishStep::ClosePr,
                ..
            }
        )
    };
    assert!(w.log.iter().any(skipped_close));
}

#[test]
fn a_pr_head_other_than_the_factory_commit_fails_the_attempt_and_nothing_runs_on_it() {
    // Someone pushed to the work branch between the commit and opening the PR: the head is theirs.
    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "open_pr" => Some(Outcome::Agent(
            json!({"number": 7, "url": "https://forgejo.example/pr/7", "head_sha": "bad0bad", "base": "main"}),
        )),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    let reason = w.log.iter().find_map(|e| match e {
        Event::AttemptFailed {
            attempt: 1, reason, ..
        } => Some(reason.clone()),
        _ => None,
    });
    let reason = reason.expect("attempt 1 failed");
    assert!(
        reason.contains("tampering suspected")
            && reason.contains("bad0bad")
            && reason.contains("c0ffee1"),
        "{reason}"
    );
    assert_eq!(run.attempts[0].failure.as_deref(), Some(reason.as_str()));
    assert_eq!(run.attempt, 1, "no further attempt builds on that branch");
    let t = calls(&world);
    for never in [
        "forgejo.ci_status",
        "model.lead_review",
        "model.security_audit",
        "approval.merge",
        "forgejo.merge",
    ] {
        assert!(!t.iter().any(|s| s == never), "{never} ran: {t:?}");
    }
    // The PR is recorded so the ending closes it (and deletes the branch).
    assert_eq!(run.links.pr_number, Some(7));
    assert_eq!(&t[t.len() - 4..], CLOSING_CALLS);

    // A PR into another base than the one asked for is refused the same way: no CI, no merge.
    let mut world = World::with(|e| match e {
        Effect::Call { skill, .. } if skill == "open_pr" => Some(Outcome::Agent(
            json!({"number": 7, "url": "https://forgejo.example/pr/7", "head_sha": "c0ffee1", "base": "release"}),
        )),
        _ => None,
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    assert!(run.ending.unwrap().detail.contains("`release`"));
    assert!(!calls(&world).iter().any(|s| s == "forgejo.ci_status"));
}

#[test]
fn commits_are_pinned_and_a_refused_commit_stops_the_run() {
    // Attempt 2 must land on attempt 1's commit; the agent finds the branch moved and refuses for good.
    let mut world = World::with(|e| {
        match e {
        Effect::Call { skill, step, .. } if skill == "commit_patch" && parts(step).1 == 2 => Some(Outcome::Failed {
            error: "forgejo: branch `factory/x` is at bad0bad, not at c0ffee1 (the previous commit)".into(),
            retryable: false,
        }),
        _ => None,
    }
    });
    let (w, run) = drive(&mut world, ctx());
    assert_eq!(ended(&w), (RunState::Failed, Some(Reason::StepFailed)));
    assert!(run.ending.unwrap().detail.contains("bad0bad"));
    let (e, _) = &world.performed[&format!("{}:fix:2:commit_patch", run.id)];
    let Effect::Call { args, .. } = e else {
        panic!()
    };
    assert_eq!(args["expected_head"], "c0ffee1");
    assert_eq!(
        run.links.commit_sha.as_deref(),
        Some("c0ffee1"),
        "the refused commit is not recorded"
    );
    assert!(
        !world
            .performed
            .contains_key(&format!("{}:fix:2:open_pr", run.id))
    );
    let t = calls(&world);
    assert!(!t.iter().any(|s| s == "forgejo.merge"), "{t:?}");
    assert_eq!(&t[t.len() - 4..], CLOSING_CALLS);
}

#[test]
fn every_attempt_is_a_whole_change_against_the_base() {
    // Attempt 1 rewrites two files (one of them badly) and fails CI; attempt 2 changes only one. Whatever attempt 1
    // committed, attempt 2's commit puts every other target file back as it is on the base, so the branch differs
    // from the base by exactly the patch the reviews and the approval see.
    let mut ctx = ctx();
    ctx.config.target_files = vec!["src/checkout.py".into(), "src/auth.py".into()];
    let mut world = World::with(|e| {
        match e {
        Effect::Call { skill, .. } if skill == "read_files" => Some(Outcome::Agent(json!({"files": [
            {"path": "src/checkout.py", "content": "currency = order['currency']\n"},
            {"path": "src/auth.py", "content": "def allowed(user):\n    return user.admin\n"},
        ]}))),
        Effect::Model { purpose, step, .. } if purpose == "fix" && parts(step).1 == 1 => Some(Outcome::Model {
            text: "=== src/checkout.py\n```python\ncurrency = 'EUR'\n```\n=== src/auth.py\n```python\ndef allowed(user):\n    return True\n```\n".into(),
            input_tokens: 10,
            output_tokens: 10,
        }),
        _ => None,
    }
    });
    let (w, run) = drive(&mut world, ctx);
    assert_eq!(ended(&w).0, RunState::Succeeded);
    for attempt in [1, 2] {
        let (e, _) = &world.performed[&format!("{}:fix:{attempt}:read_files", run.id)];
        let Effect::Call { args, .. } = e else {
            panic!()
        };
        assert_eq!(args["ref"], "main", "attempt {attempt} reads the base");
    }
    let (e, _) = &world.performed[&format!("{}:fix:2:commit_patch", run.id)];
    let Effect::Call { args, .. } = e else {
        panic!()
    };
    let files = args["files"].as_array().unwrap();
    let auth = files
        .iter()
        .find(|f| f["path"] == "src/auth.py")
        .expect("auth.py is committed back");
    assert_eq!(
        auth["content"],
        "def allowed(user):\n    return user.admin\n"
    );
    assert!(files.iter().any(
        |f| f["path"] == "src/checkout.py" && f["content"] != "currency = order['currency']\n"
    ));
    // The approval binds and shows this attempt's patch: one file.
    assert!(
        run.change_binding().ends_with(": src/checkout.py"),
        "{}",
        run.change_binding()
    );
}

/// Drives the run to its merge gate with the approval stored and its first timer scheduled, the settlement's
/// message lost (as when the API dies between storing a decision and enqueueing it).
fn parked_at_merge_gate(ctx: loams_factory::Ctx) -> (Worker, World) {
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx);
    until_run(&mut w, &mut world, |r| {
        r.cursor == Cursor::Merge && r.gate.as_ref().is_some_and(|g| g.approval_id.is_some())
    });
    w.queue
        .retain(|m| !matches!(m, Some(Input::ApprovalSettled { .. })));
    let run = w.drain(&mut world);
    assert!(
        run.gate.is_some() && run.next_effect().is_none(),
        "parked: {run:?}"
    );
    (w, world)
}

/// The timer the run waits on now and when it fires, as the worker schedules it.
fn current_timer(w: &mut Worker, world: &mut World) -> (String, i64) {
    let run = w.run();
    if let Some(Effect::Wait { .. }) = run.next_effect() {
        assert!(w.process(&None, world, None));
    }
    let run = w.run();
    let wait = run.wait.expect("waiting");
    assert!(wait.scheduled, "the timer is stored before the run rests");
    let Some((Effect::Wait { due_ms, .. }, _)) = world.performed.get(&wait.timer_id) else {
        panic!("timer {} never scheduled", wait.timer_id)
    };
    (wait.timer_id.clone(), *due_ms)
}

#[test]
fn a_long_wait_is_rechecked_every_minute_until_its_deadline() {
    let (mut w, mut world) = parked_at_merge_gate(ctx());
    let run = w.run();
    let gate = run.gate.clone().unwrap();
    let wait = run.wait.clone().unwrap();
    assert_eq!(
        wait.due_ms, gate.request.expires_at_ms,
        "the real deadline stays in the run"
    );
    let (first, fires) = current_timer(&mut w, &mut world);
    assert_eq!(first, format!("{}.wait", gate.request.id));
    assert_eq!(
        fires,
        w.ctx.now_ms + 60_000,
        "the first re-check is a minute away, not at the 72 h expiry"
    );

    // The re-check finds nothing new: a fresh timer a minute later, the approval still pending.
    w.ctx.now_ms = fires;
    let before = w.log.len();
    assert!(w.process(
        &Some(Input::TimerFired {
            timer_id: first.clone()
        }),
        &mut world,
        None
    ));
    assert!(
        matches!(w.log[before], Event::WaitRechecked { .. }),
        "{:?}",
        &w.log[before..]
    );
    let (second, fires) = current_timer(&mut w, &mut world);
    assert_eq!(second, format!("{first}.recheck1"));
    assert_eq!(fires, w.ctx.now_ms + 60_000);
    let run = w.run();
    assert_eq!(run.state, RunState::Waiting);
    assert!(
        run.gate.is_some()
            && run
                .approvals
                .iter()
                .all(|a| a.state == loams_factory::approval::ApprovalState::Pending)
    );
    // The fired timer is spent: firing it again changes nothing.
    assert_eq!(
        decide(&run, &Input::TimerFired { timer_id: first }, &w.ctx).unwrap(),
        vec![]
    );

    // Re-checks go on, each under its own id, and the last one before the deadline waits exactly until it.
    w.ctx.now_ms = wait.due_ms - 30_000;
    assert!(w.process(
        &Some(Input::TimerFired { timer_id: second }),
        &mut world,
        None
    ));
    let (third, fires) = current_timer(&mut w, &mut world);
    assert_eq!(third, format!("{}.wait.recheck2", gate.request.id));
    assert_eq!(fires, wait.due_ms, "no re-check past the deadline");

    // The deadline is honoured: the approval expired, the run stops as before.
    w.ctx.now_ms = fires;
    w.queue
        .push_back(Some(Input::TimerFired { timer_id: third }));
    w.drain(&mut world);
    assert!(!world.merged());
    let detail = w.log.iter().find_map(|e| match e {
        Event::Abandoned { reason, detail, .. } => Some((*reason, detail.clone())),
        _ => None,
    });
    assert_eq!(
        detail,
        Some((Reason::Stalled, "the approval expired".into()))
    );
}

#[test]
fn a_recheck_that_fires_after_the_deadline_is_the_deadline() {
    let (mut w, mut world) = parked_at_merge_gate(ctx());
    let (first, _) = current_timer(&mut w, &mut world);
    let run = w.run();
    w.ctx.now_ms = run.wait.clone().unwrap().due_ms + 1;
    let ev = decide(
        &run,
        &Input::TimerFired {
            timer_id: first.clone(),
        },
        &w.ctx,
    )
    .unwrap();
    assert_eq!(ev[0], Event::TimerFired { timer_id: first });
    assert!(
        ev.iter().any(|e| matches!(
            e,
            Event::Abandoned {
                reason: Reason::Stalled,
                ..
            }
        )),
        "{ev:?}"
    );
}

#[test]
fn a_settlement_learned_from_the_store_moves_a_parked_run_on() {
    let (mut w, mut world) = parked_at_merge_gate(ctx());
    let (first, fires) = current_timer(&mut w, &mut world);
    let approval_id = w.run().gate.unwrap().approval_id.unwrap();
    // The re-check's message: the worker read the decision from the store and records it before the timer.
    w.ctx.now_ms = fires;
    let settle = Input::ApprovalSettled {
        approval_id,
        approved: true,
        by: "bob".into(),
    };
    w.queue.push_back(Some(settle));
    w.queue
        .push_back(Some(Input::TimerFired { timer_id: first }));
    let run = w.drain(&mut world);
    assert!(world.merged(), "merged within a re-check of the decision");
    assert_eq!(run.state, RunState::Succeeded);
    assert!(
        !w.log
            .iter()
            .any(|e| matches!(e, Event::TimerFired { timer_id } if timer_id.ends_with(".wait")))
    );
}

#[test]
fn a_kill_switch_reaches_a_parked_run_at_its_next_recheck() {
    let (mut w, mut world) = parked_at_merge_gate(ctx());
    let (first, fires) = current_timer(&mut w, &mut world);
    // The switch is stored but the `Kill` message is lost: the re-check's decide reads it.
    w.ctx.now_ms = fires;
    w.ctx.kill.runs = vec![w.run().id];
    w.queue
        .push_back(Some(Input::TimerFired { timer_id: first }));
    w.drain(&mut world);
    assert_eq!(ended(&w), (RunState::Killed, Some(Reason::Killed)));
    assert!(!world.merged());
}

#[test]
fn short_waits_have_no_recheck_and_the_interval_has_a_floor() {
    // CI polls (2 s) fire at their deadline: one timer, as before.
    let mut world = World::new();
    let mut w = Worker::start(signal(), ctx());
    until_run(&mut w, &mut world, |r| {
        r.wait
            .as_ref()
            .is_some_and(|x| x.kind == loams_factory::WaitKind::Ci)
    });
    let wait = w.run().wait.unwrap();
    assert!(!wait.is_recheck());
    assert_eq!(wait.fires_at_ms(), wait.due_ms);

    // A zero interval would wake the run in a loop; it is held to a second.
    let mut c = ctx();
    c.config.recheck_ms = 0;
    // CI polls a second apart need no re-check either (the simulator fires CI timers on a frozen clock).
    c.config.ci_poll_ms = 1_000;
    let (mut w, mut world) = parked_at_merge_gate(c);
    let (_, fires) = current_timer(&mut w, &mut world);
    assert_eq!(fires, w.ctx.now_ms + 1_000);
}
