//! The AWS adapters (feature `aws`): [`DynamoStore`] implements `Store` and `Timers` on one DynamoDB table,
//! [`SqsQueue`] implements `Queue` on an SQS standard queue with a dead-letter queue.
//!
//! The table (see `dynamo.rs` for every key): `pk`/`sk` strings, one sparse global secondary index `gsi1`
//! (`gsi1pk`/`gsi1sk`, projection KEYS_ONLY so that rewriting a run's snapshot never writes the index), TTL on
//! `expires_at` (epoch seconds), streams on (NEW_AND_OLD_IMAGES), on-demand billing. Every key starts with the
//! org except the global timer index key.
//!
//! [`provision_table`] and [`provision_queue`] create these resources (idempotently); the tests and
//! `loams dev` against moto use them, a deployed stack gets them from the SAM template instead.

mod batch;
mod blob;
mod dynamo;
mod sqs;

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection,
    ProjectionType, ScalarAttributeType, StreamSpecification, StreamViewType, TableStatus,
    TimeToLiveSpecification, TimeToLiveStatus,
};
use aws_sdk_sqs::types::QueueAttributeName;

use crate::{Result, StoreError};

pub use batch::{BatchOutcome, batch_item_failures};
pub use dynamo::DynamoStore;
pub use sqs::{BODY_ENCODING_ATTRIBUTE, SqsQueue, decode_body};

/// Attempts per SDK call (the first try included). The SDK's standard retry mode backs off on throttling
/// (`ProvisionedThroughputExceededException`, `ThrottlingException`, `RequestLimitExceeded`) and transient
/// errors; what is still failing after these attempts surfaces as `StoreError::Backend`.
pub const SDK_MAX_ATTEMPTS: u32 = 5;

/// The TTL attribute of the table.
pub const TTL_ATTRIBUTE: &str = "expires_at";
/// The name of the sparse global secondary index.
pub const GSI1: &str = "gsi1";

/// SDK configuration from the environment (region, credentials, `AWS_ENDPOINT_URL*`), as on Lambda, with
/// standard retries.
pub async fn config_from_env() -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .retry_config(RetryConfig::standard().with_max_attempts(SDK_MAX_ATTEMPTS))
        .load()
        .await
}

/// SDK configuration for a local emulator (moto) at `endpoint`: dummy credentials and region `us-east-1`,
/// so nothing of the host's AWS setup leaks in.
pub async fn local_config(endpoint: &str) -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .empty_test_environment()
        .test_credentials()
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .retry_config(RetryConfig::standard().with_max_attempts(SDK_MAX_ATTEMPTS))
        .load()
        .await
}

/// A queue with its dead-letter queue, as [`provision_queue`] made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueUrls {
    pub queue_url: String,
    pub dead_letter_url: String,
}

/// Settings of a provisioned queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSpec {
    /// Receives after which SQS moves a message to the dead-letter queue (`maxReceiveCount`, 1..=1000).
    pub max_receives: u32,
    /// The queue's default visibility timeout in seconds (receives set their own).
    pub visibility_timeout_s: u32,
}

impl Default for QueueSpec {
    fn default() -> Self {
        Self {
            max_receives: crate::DEFAULT_MAX_RECEIVES,
            visibility_timeout_s: 30,
        }
    }
}

/// Longest wait for a new table to become active.
const TABLE_WAIT: Duration = Duration::from_secs(60);
/// SQS's largest message size (1 MiB); bodies that are not plain text are base64-encoded, so the port's
/// 256 KiB limit needs more than SQS's old 256 KiB default.
const MAX_MESSAGE_SIZE: &str = "1048576";
/// 14 days, SQS's longest retention, for dead letters that wait for a human.
const DEAD_LETTER_RETENTION_S: &str = "1209600";

/// Creates the table if it does not exist, waits until it and its index are active, and turns TTL on.
pub async fn provision_table(ddb: &aws_sdk_dynamodb::Client, table: &str) -> Result<()> {
    let s = |name: &str| -> Result<AttributeDefinition> {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(build_err)
    };
    let key = |name: &str, kind: KeyType| -> Result<KeySchemaElement> {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(kind)
            .build()
            .map_err(build_err)
    };
    let gsi = GlobalSecondaryIndex::builder()
        .index_name(GSI1)
        .key_schema(key("gsi1pk", KeyType::Hash)?)
        .key_schema(key("gsi1sk", KeyType::Range)?)
        .projection(
            Projection::builder()
                .projection_type(ProjectionType::KeysOnly)
                .build(),
        )
        .build()
        .map_err(build_err)?;
    let created = ddb
        .create_table()
        .table_name(table)
        .attribute_definitions(s("pk")?)
        .attribute_definitions(s("sk")?)
        .attribute_definitions(s("gsi1pk")?)
        .attribute_definitions(s("gsi1sk")?)
        .key_schema(key("pk", KeyType::Hash)?)
        .key_schema(key("sk", KeyType::Range)?)
        .global_secondary_indexes(gsi)
        .billing_mode(BillingMode::PayPerRequest)
        .stream_specification(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::NewAndOldImages)
                .build()
                .map_err(build_err)?,
        )
        .send()
        .await;
    match created {
        Ok(_) => {}
        Err(e) if e.code() == Some("ResourceInUseException") => {}
        Err(e) => return Err(sdk_err("CreateTable", e)),
    }
    wait_active(ddb, table).await?;
    let ttl = ddb
        .describe_time_to_live()
        .table_name(table)
        .send()
        .await
        .map_err(|e| sdk_err("DescribeTimeToLive", e))?;
    let on = ttl.time_to_live_description().is_some_and(|d| {
        d.attribute_name() == Some(TTL_ATTRIBUTE)
            && matches!(
                d.time_to_live_status(),
                Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
            )
    });
    if !on {
        ddb.update_time_to_live()
            .table_name(table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .enabled(true)
                    .attribute_name(TTL_ATTRIBUTE)
                    .build()
                    .map_err(build_err)?,
            )
            .send()
            .await
            .map_err(|e| sdk_err("UpdateTimeToLive", e))?;
    }
    Ok(())
}

async fn wait_active(ddb: &aws_sdk_dynamodb::Client, table: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + TABLE_WAIT;
    loop {
        let d = ddb
            .describe_table()
            .table_name(table)
            .send()
            .await
            .map_err(|e| sdk_err("DescribeTable", e))?;
        let desc = d.table();
        let table_ok = desc.and_then(|t| t.table_status()) == Some(&TableStatus::Active);
        let indexes_ok = desc.is_some_and(|t| {
            t.global_secondary_indexes()
                .iter()
                .all(|g| g.index_status() == Some(&aws_sdk_dynamodb::types::IndexStatus::Active))
        });
        if table_ok && indexes_ok {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(StoreError::Backend(format!(
                "table {table} not active after {TABLE_WAIT:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Deletes the table (tests and teardown); a missing table is not an error.
pub async fn delete_table(ddb: &aws_sdk_dynamodb::Client, table: &str) -> Result<()> {
    match ddb.delete_table().table_name(table).send().await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(()),
        Err(e) => Err(sdk_err("DeleteTable", e)),
    }
}

/// Creates (or finds) the dead-letter queue `<name>-dlq` and the queue `name` redriving into it after
/// `spec.max_receives` receives. Standard queues: the worker's processing is idempotent, so at-least-once
/// delivery without FIFO's throughput limits is what it needs.
pub async fn provision_queue(
    sqs: &aws_sdk_sqs::Client,
    name: &str,
    spec: QueueSpec,
) -> Result<QueueUrls> {
    if !(1..=1000).contains(&spec.max_receives) {
        return Err(StoreError::Invalid(format!(
            "max_receives {} is outside SQS's 1..=1000",
            spec.max_receives
        )));
    }
    let dead_letter_url = create_queue(
        sqs,
        &format!("{name}-dlq"),
        [(
            QueueAttributeName::MessageRetentionPeriod,
            DEAD_LETTER_RETENTION_S.to_owned(),
        )],
    )
    .await?;
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(&dead_letter_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| sqs_err("GetQueueAttributes", e))?;
    let arn = attrs
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn))
        .ok_or_else(|| StoreError::Backend("the dead-letter queue has no ARN".into()))?;
    let redrive = format!(
        r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":{}}}"#,
        spec.max_receives
    );
    let queue_url = create_queue(
        sqs,
        name,
        [
            (QueueAttributeName::RedrivePolicy, redrive),
            (
                QueueAttributeName::VisibilityTimeout,
                spec.visibility_timeout_s.to_string(),
            ),
        ],
    )
    .await?;
    Ok(QueueUrls {
        queue_url,
        dead_letter_url,
    })
}

/// Creates (or finds) the queue `name` with `attributes`, and with the largest message size, which the queue
/// and its dead-letter queue must share: a dead letter is a message the queue took. Returns its url.
async fn create_queue(
    sqs: &aws_sdk_sqs::Client,
    name: &str,
    attributes: impl IntoIterator<Item = (QueueAttributeName, String)>,
) -> Result<String> {
    let mut req = sqs
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::MaximumMessageSize, MAX_MESSAGE_SIZE);
    for (k, v) in attributes {
        req = req.attributes(k, v);
    }
    req.send()
        .await
        .map_err(|e| sqs_err("CreateQueue", e))?
        .queue_url()
        .map(str::to_owned)
        .ok_or_else(|| StoreError::Backend("CreateQueue returned no queue url".into()))
}

/// Deletes a queue and its dead-letter queue (tests and teardown); missing queues are not an error.
pub async fn delete_queue(sqs: &aws_sdk_sqs::Client, urls: &QueueUrls) -> Result<()> {
    for url in [&urls.queue_url, &urls.dead_letter_url] {
        match sqs.delete_queue().queue_url(url).send().await {
            Ok(_) => {}
            Err(e) if e.code() == Some("AWS.SimpleQueueService.NonExistentQueue") => {}
            Err(e) if e.code() == Some("QueueDoesNotExist") => {}
            Err(e) => return Err(sqs_err("DeleteQueue", e)),
        }
    }
    Ok(())
}

/// A failed DynamoDB call that no condition explains: throttling after the SDK's retries, a missing table,
/// a network failure.
pub(crate) fn sdk_err<E, R>(op: &str, e: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    StoreError::Backend(format!("dynamodb {op}: {}", describe(&e)))
}

pub(crate) fn sqs_err<E, R>(op: &str, e: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    StoreError::Backend(format!("sqs {op}: {}", describe(&e)))
}

/// The service's code and message when it answered (the full context would include the raw response), the
/// whole chain of causes when it did not (timeouts, connection errors).
fn describe<E, R>(e: &SdkError<E, R>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match e.code() {
        Some(code) => format!("{code}: {}", e.message().unwrap_or("(no message)")),
        None => DisplayErrorContext(e).to_string(),
    }
}

/// A request the SDK refused to build: a required field was missing, which is a bug here.
pub(crate) fn build_err(e: aws_sdk_dynamodb::error::BuildError) -> StoreError {
    StoreError::Backend(format!("building a DynamoDB request: {e}"))
}
