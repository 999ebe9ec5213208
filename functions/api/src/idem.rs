//! Idempotent writes: the first call with a key performs the write and records its response; a repeat gets the
//! recorded response and performs nothing.

use loams_platform::Claim;
use prost::Message;

use crate::{ApiError, ApiState, Caller};

/// Longest idempotency key accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 128;

pub(crate) async fn once<M, F, Fut>(
    state: &ApiState,
    caller: &Caller,
    method: &str,
    key: &str,
    write: F,
) -> Result<M, ApiError>
where
    M: Message + Default,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<M, ApiError>>,
{
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY || key.chars().any(char::is_control) {
        return Err(ApiError::InvalidArgument(format!(
            "idempotency_key is required (1..={MAX_IDEMPOTENCY_KEY} bytes, no control characters)"
        )));
    }
    // The user is part of the key so one person's key can never replay another person's answer.
    // Length-prefixed: a user name containing ':' cannot make two (user, key) pairs spell the same record.
    let record = format!("api:{method}:{}:{}:{key}", caller.user.len(), caller.user);
    let org = caller.org.as_str();
    match state
        .store
        .claim(org, &record, state.now_ms(), state.config.write_lease_ms)
        .await?
    {
        Claim::Done(bytes) => M::decode(bytes.as_slice())
            .map_err(|e| ApiError::Internal(format!("stored response of {record}: {e}"))),
        Claim::InProgress => Err(ApiError::Aborted(
            "a call with this idempotency key is in progress".into(),
        )),
        Claim::New => match write().await {
            Ok(resp) => {
                if let Err(e) = state
                    .store
                    .finish(org, &record, &resp.encode_to_vec(), state.now_ms())
                    .await
                {
                    // The write happened; failing the call now would make the client retry a done write. The lease
                    // runs out and a repeat then meets the already-applied state, which every write tolerates.
                    tracing::warn!(error = %e, key = %record, "recording an idempotent response failed");
                }
                Ok(resp)
            }
            Err(err) => {
                // Nothing was written (every refusal changes nothing), so the same key may be tried again.
                if let Err(e) = state.store.release(org, &record).await {
                    tracing::warn!(error = %e, key = %record, "releasing an idempotency claim failed");
                }
                Err(err)
            }
        },
    }
}
