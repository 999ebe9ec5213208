//! Chooses the adapters behind the ports from the `[backend]` settings: the embedded SQLite store (the default),
//! or DynamoDB (`Store` + `Timers`) and SQS (`Queue`), each on its own, against AWS or a local emulator.

use anyhow::bail;

use crate::config::{Config, QueueKind, StoreKind};
use crate::stack::Backend;

impl Backend {
    /// The backend the configuration names. With `backend.aws_endpoint` (moto), the table and the queue are
    /// created when absent; on AWS they must exist (the SAM template makes them).
    pub async fn from_config(config: &Config) -> anyhow::Result<Backend> {
        let b = &config.backend;
        if !b.uses_aws() {
            return Backend::sqlite(&config.data_dir);
        }
        aws_backend(config, embedded(config)?, b.aws_endpoint.is_some()).await
    }

    /// The Lambda functions' backend, DynamoDB and SQS only, on an SDK configuration the caller built, and creating
    /// nothing, not even on an emulator: their table and queue come from the template (a cold start must not pay
    /// for checking them), and their agents read their secret with the same configuration. Never the embedded
    /// store, so a Lambda binary does not carry SQLite.
    #[cfg(feature = "aws")]
    pub async fn open_on(config: &Config, sdk: &aws_config::SdkConfig) -> anyhow::Result<Backend> {
        let b = &config.backend;
        if (b.store, b.queue) != (StoreKind::Dynamodb, QueueKind::Sqs) {
            bail!("setting `backend`: a Lambda function runs on DynamoDB and SQS only");
        }
        aws_backend_on(config, None, false, sdk).await
    }
}

/// The embedded store, when some part of the backend (timers live with the store) is not on AWS.
fn embedded(config: &Config) -> anyhow::Result<Option<Backend>> {
    Ok(match (config.backend.store, config.backend.queue) {
        (StoreKind::Sqlite, _) | (_, QueueKind::Sqlite) => Some(Backend::sqlite(&config.data_dir)?),
        _ => None,
    })
}

#[cfg(not(feature = "aws"))]
async fn aws_backend(
    _config: &Config,
    _embedded: Option<Backend>,
    _provision: bool,
) -> anyhow::Result<Backend> {
    // `Config::validate` refuses this first; kept so a config built in code fails the same way.
    bail!("setting `backend`: this build has no AWS adapters (build loams with `--features aws`)")
}

#[cfg(feature = "aws")]
async fn aws_backend(
    config: &Config,
    embedded: Option<Backend>,
    provision: bool,
) -> anyhow::Result<Backend> {
    let sdk = sdk_config(config.backend.aws_endpoint.as_deref()).await;
    aws_backend_on(config, embedded, provision, &sdk).await
}

#[cfg(feature = "aws")]
async fn aws_backend_on(
    config: &Config,
    embedded: Option<Backend>,
    provision: bool,
    sdk: &aws_config::SdkConfig,
) -> anyhow::Result<Backend> {
    use std::sync::Arc;

    use anyhow::Context;
    use loams_platform::aws::{self, DynamoStore, QueueSpec, QueueUrls, SqsQueue};
    use loams_platform::{Clock, Queue, Store, SystemClock, Timers};

    let b = &config.backend;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let (store, timers): (Arc<dyn Store>, Arc<dyn Timers>) = match (b.store, &embedded) {
        (StoreKind::Dynamodb, _) => {
            let ddb = aws_sdk_dynamodb::Client::new(sdk);
            if provision {
                aws::provision_table(&ddb, &b.table)
                    .await
                    .with_context(|| {
                        format!("setting `backend.table`: creating table {}", b.table)
                    })?;
            }
            let dynamo = Arc::new(DynamoStore::new(ddb, b.table.clone(), clock.clone()));
            (dynamo.clone(), dynamo)
        }
        (StoreKind::Sqlite, Some(e)) => (e.store.clone(), e.timers.clone()),
        (StoreKind::Sqlite, None) => {
            bail!("setting `backend.store`: the embedded store was not opened")
        }
    };
    let queue: Arc<dyn Queue> = match (b.queue, &embedded) {
        (QueueKind::Sqs, _) => {
            let sqs = aws_sdk_sqs::Client::new(sdk);
            let urls = match (&b.queue_url, &b.dead_letter_url) {
                (Some(queue_url), Some(dead_letter_url)) => QueueUrls {
                    queue_url: queue_url.clone(),
                    dead_letter_url: dead_letter_url.clone(),
                },
                _ if provision => aws::provision_queue(&sqs, &b.queue_name, QueueSpec::default())
                    .await
                    .with_context(|| {
                        format!(
                            "setting `backend.queue_name`: creating queue {}",
                            b.queue_name
                        )
                    })?,
                _ => bail!(
                    "setting `backend.queue_url`: required unless the queue is created on an emulator"
                ),
            };
            // Long polling: an idle worker then costs one receive per wait instead of one per pause. Short
            // against an emulator, so that stopping (which lets the outstanding receive finish) stays quick.
            let wait_s = if b.aws_endpoint.is_some() { 1 } else { 5 };
            Arc::new(SqsQueue::new(sqs, urls, clock.clone()).with_wait_time(wait_s))
        }
        (QueueKind::Sqlite, Some(e)) => e.queue.clone(),
        (QueueKind::Sqlite, None) => {
            bail!("setting `backend.queue`: the embedded queue was not opened")
        }
    };
    Ok(Backend {
        store,
        queue,
        timers,
        clock,
    })
}

/// The SDK configuration: a local emulator's (dummy credentials, fixed region), or the environment's.
#[cfg(feature = "aws")]
pub async fn sdk_config(endpoint: Option<&str>) -> aws_config::SdkConfig {
    match endpoint {
        Some(endpoint) => loams_platform::aws::local_config(endpoint).await,
        None => loams_platform::aws::config_from_env().await,
    }
}
