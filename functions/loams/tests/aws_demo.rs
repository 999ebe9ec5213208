//! The demo scenario end to end with the AWS adapters (DynamoDB store and timers, SQS queue) against a local
//! moto server: the same stack, agents, worker and API as `loams demo`, only the backend differs.
//!
//! ```sh
//! eval "$(tests/moto/start)"
//! cargo test -p loams --features aws --test aws_demo
//! tests/moto/stop
//! ```
#![cfg(feature = "aws")]

use loams::backend::sdk_config;
use loams::config::{QueueKind, StoreKind};
use loams::demo::{Scenario, play};
use loams_platform::aws::{QueueSpec, delete_queue, delete_table, provision_queue};

fn endpoint() -> String {
    match std::env::var("LOAMS_AWS_ENDPOINT") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "LOAMS_AWS_ENDPOINT is not set: this test needs a moto server. Run `eval \"$(tests/moto/start)\"` \
             first (and `tests/moto/stop` after)"
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_scenario_on_dynamodb_and_sqs() {
    let endpoint = endpoint();
    // Names of their own, so parallel runs on one moto do not share a table or queue.
    let suffix = format!(
        "{}-{}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed().unwrap().as_millis()
    );
    let table = format!("loams-demo-{suffix}");
    let queue_name = format!("loams-demo-{suffix}");

    let dir = tempfile::tempdir().unwrap();
    let mut scenario = Scenario::demo(dir.path().to_path_buf());
    let backend = &mut scenario.config.backend;
    backend.store = StoreKind::Dynamodb;
    backend.queue = QueueKind::Sqs;
    backend.aws_endpoint = Some(endpoint.clone());
    backend.table = table.clone();
    backend.queue_name = queue_name.clone();
    scenario.config.validate().unwrap();

    let mut out = Vec::new();
    let result = play(scenario, &mut out).await;
    let out = String::from_utf8_lossy(&out).into_owned();

    // The backend really was AWS: the table holds the run, the queue exists (both made by `loams` itself).
    let sdk = sdk_config(Some(&endpoint)).await;
    let ddb = aws_sdk_dynamodb::Client::new(&sdk);
    let items = ddb.scan().table_name(&table).send().await.unwrap().count();
    let sqs = aws_sdk_sqs::Client::new(&sdk);
    let queue_made = sqs
        .get_queue_url()
        .queue_name(&queue_name)
        .send()
        .await
        .is_ok();
    // Looks both queues up (creating nothing, they exist) for the clean-up.
    let urls = provision_queue(&sqs, &queue_name, QueueSpec::default())
        .await
        .unwrap();
    delete_table(&ddb, &table).await.unwrap();
    delete_queue(&sqs, &urls).await.unwrap();

    let report = result.unwrap_or_else(|e| panic!("scenario failed: {e:#}\n{out}"));
    assert!(
        items > 10,
        "the run's records are in DynamoDB ({items} items)\n{out}"
    );
    assert!(queue_made, "loams made its SQS queue\n{out}");
    assert!(
        !dir.path().join("loams.db").exists(),
        "nothing went to the embedded store\n{out}"
    );
    assert_eq!(report.runs.len(), 1, "{out}");
    let run = report.first();
    assert_eq!(
        (run.state.as_str(), run.verdict.as_str()),
        ("succeeded", "resolved"),
        "{out}"
    );
    let events: Vec<&str> = report.runs[0].1.iter().map(|e| e.r#type.as_str()).collect();
    assert_eq!(
        events.iter().filter(|t| **t == "attempt_failed").count(),
        1,
        "first attempt fails CI: {out}"
    );
    assert!(events.contains(&"merged"), "{out}");
    assert_eq!(report.approvals_decided, 1, "one merge approval: {out}");
    let s = &report.sandbox_state;
    for (app, key, want) in [
        ("plane", "issues", 1),
        ("forgejo", "prs", 1),
        ("forgejo", "merges", 1),
    ] {
        assert_eq!(
            s[app][key].as_u64(),
            Some(want),
            "{app}.{key} exactly once: {s}"
        );
    }
}
