mod common;

use common::*;
use loams_factory::{Effect, Event, ObserveVerdict, Risk, RunState, Stage, action_hash};

#[test]
fn full_happy_path() {
    let mut world = World::new();
    let mut worker = Worker::start(signal(), ctx());
    let run = worker.drain(&mut world);

    assert_eq!(run.state, RunState::Succeeded);
    assert_eq!(run.stage, Stage::Close);
    assert_eq!(run.verdict, Some(ObserveVerdict::Resolved));
    assert_eq!(run.attempt, 2);
    assert_eq!(run.links.deploy_ref.as_deref(), Some("m3rge"));
    assert_eq!(run.links.pr_number, Some(7));
    assert_eq!(
        run.budget.tokens,
        4 * 1_200,
        "two fixes, one lead review, one audit"
    );
    assert!(run.budget.micros > 0);
    assert_eq!(run.version, worker.log.len() as u64);
    assert!(run.next_effect().is_none());
    assert_eq!(
        trace(&world),
        vec![
            "zulip.open_thread",
            "wait.await_decision",
            "plane.create_issue",
            "zulip.post",
            "forgejo.read_files",
            "model.fix",
            "forgejo.commit_patch",
            "forgejo.open_pr",
            "forgejo.ci_status",
            "wait.await_ci.0",
            "forgejo.ci_status",
            "forgejo.read_files",
            "model.fix",
            "forgejo.commit_patch",
            "forgejo.open_pr",
            "forgejo.ci_status",
            "model.lead_review",
            "model.security_audit",
            "approval.merge",
            // The settlement arrives before the expiry timer is scheduled, so no timer is needed.
            "forgejo.merge",
            "wait.await_window",
            "glitchtip.issue_events",
            "analytics.series",
            "glitchtip.resolve",
            "plane.set_state",
            "zulip.post",
        ]
    );

    let id = &run.id;
    assert!(world.performed.contains_key(&format!("{id}:fix:2:open_pr")));
    assert!(
        world
            .performed
            .contains_key(&format!("{id}:fix:1:ci_status.1"))
    );
    assert!(
        world
            .performed
            .contains_key(&format!("{id}:observe:1:issue_events"))
    );

    // Args follow the skills table.
    let (thread, _) = &world.performed[&format!("{id}:triage:0:open_thread")];
    let Effect::Call { args, .. } = thread else {
        panic!()
    };
    assert_eq!(args["channel"], "factory");
    assert_eq!(args["topic"], "KeyError: 'currency' in checkout");
    let (issue, _) = &world.performed[&format!("{id}:plan:0:create_issue")];
    let Effect::Call { args, .. } = issue else {
        panic!()
    };
    assert_eq!(args["external_id"], format!("factory:{id}"));
    let (commit, _) = &world.performed[&format!("{id}:fix:2:commit_patch")];
    let Effect::Call { args, .. } = commit else {
        panic!()
    };
    assert_eq!(args["branch"], format!("factory/{id}"));
    assert_eq!(args["files"][0]["path"], "src/checkout.py");
    assert!(
        args["files"][0]["content"]
            .as_str()
            .unwrap()
            .contains("attempt 2")
    );
    // Each commit pins the branch: the first where the base stands, the next on the factory's previous commit.
    assert_eq!(args["expected_head"], "c0ffee1");
    let (first, _) = &world.performed[&format!("{id}:fix:1:commit_patch")];
    let Effect::Call { args, .. } = first else {
        panic!()
    };
    assert_eq!(args["expected_head"], serde_json::Value::Null);

    // Attempt 2's fix prompt carries attempt 1's failing CI log.
    let (fix2, _) = &world.performed[&format!("{id}:fix:2:propose")];
    let Effect::Model { messages, .. } = fix2 else {
        panic!()
    };
    assert!(messages[1].content.contains("FAIL test_checkout"));

    // The merge approval is bound to the exact call and asked for on behalf of the owner.
    let (req, _) = &world.performed[&format!("{id}:approve:2:approval.merge")];
    let Effect::RequestApproval { approval, .. } = req else {
        panic!()
    };
    assert_eq!(
        approval.action.args,
        serde_json::json!({"number": 7, "head_sha": "c0ffee2"})
    );
    // The change itself is bound: the head commit, the patch hash and the paths, in the hash and in the summary.
    let patch_hash = run.attempts[1].patch_hash.clone().unwrap();
    let binding = format!(
        "c0ffee2; commit c0ffee2; patch {}: src/checkout.py",
        &patch_hash[..12]
    );
    assert_eq!(
        approval.action.target_commit.as_deref(),
        Some(binding.as_str())
    );
    assert!(
        approval.summary.contains(&format!(
            "Changes patch {}: src/checkout.py.",
            &patch_hash[..12]
        )),
        "{}",
        approval.summary
    );
    assert_eq!(approval.action_hash, action_hash(&approval.action));
    assert_eq!(approval.risk, Risk::Destructive);
    assert_eq!(approval.requester, "agent:loams-factory");
    assert_eq!(approval.on_behalf_of.as_deref(), Some("alice"));
    assert_eq!(approval.expires_at_ms, NOW + 72 * 3600 * 1000);
    assert_eq!(approval.confirmation_phrase.as_deref(), Some("merge #7"));
    assert_eq!(approval.to_approval().state.as_str(), "pending");
    let (merge, _) = &world.performed[&format!("{id}:deploy:2:merge")];
    let Effect::Call { approval_id, .. } = merge else {
        panic!()
    };
    assert_eq!(approval_id.as_deref(), Some(approval.id.as_str()));

    // The log is JSON with a `type` tag and folds back into the same run.
    let stored: Vec<String> = worker
        .log
        .iter()
        .map(|e| serde_json::to_string(e).unwrap())
        .collect();
    assert!(stored[0].starts_with(r#"{"type":"opened""#));
    let back: Vec<Event> = stored
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    assert_eq!(loams_factory::Run::from_events(&back).unwrap(), run);
    match worker.log.last() {
        Some(Event::Ended {
            state: RunState::Succeeded,
            follow_up: None,
            ..
        }) => {}
        other => panic!("last event {other:?}"),
    }
}
