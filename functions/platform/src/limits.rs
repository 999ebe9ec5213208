//! Formats and size limits of everything the ports accept. The numbers follow the AWS services the other
//! adapters sit on, so an input the embedded store accepts is one DynamoDB/SQS accept too.

use crate::{Result, StoreError};

/// Largest snapshot, event, item body, idempotency result or timer payload. DynamoDB caps an item at 400 KiB
/// including its keys and attribute names; this leaves room for those.
pub const MAX_BODY: usize = 400_000;
/// Largest queue message (SQS's classic limit).
pub const MAX_MESSAGE: usize = 256 * 1024;
/// Most events in one append (DynamoDB transactions hold at most 100 items: the run row plus the events).
pub const MAX_EVENTS_PER_APPEND: usize = 99;
/// Most bytes in one append, snapshot plus events (DynamoDB transactions are limited to 4 MB).
pub const MAX_APPEND_BYTES: usize = 4_000_000;
/// Largest page (list_runs, list_items, events, due, dead_letters); larger requests are capped.
pub const MAX_PAGE: u32 = 1000;
/// Most messages per receive (SQS's limit); larger requests are capped.
pub const MAX_RECEIVE: u32 = 10;
/// Longest send delay (SQS's 15 minutes); longer waits are timers.
pub const MAX_DELAY_MS: u64 = 15 * 60 * 1000;
/// Longest visibility timeout or retry delay (SQS's 12 hours).
pub const MAX_VISIBILITY_MS: u64 = 12 * 60 * 60 * 1000;
/// Longest idempotency lease.
pub const MAX_LEASE_MS: u64 = 24 * 60 * 60 * 1000;
/// Longest run id, item id, index value, idempotency key or timer id.
pub const MAX_KEY: usize = 512;
/// Longest kind or run state.
pub const MAX_NAME: usize = 64;
/// Longest cursor or receipt.
pub const MAX_TOKEN: usize = 1024;

fn invalid(msg: String) -> StoreError {
    StoreError::Invalid(msg)
}

/// org: `^[a-z0-9][a-z0-9-]{0,62}$`.
pub fn org(org: &str) -> Result<()> {
    let b = org.as_bytes();
    let ok = (1..=63).contains(&b.len())
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "org {org:?} does not match ^[a-z0-9][a-z0-9-]{{0,62}}$"
        )))
    }
}

/// An id, key or index value: 1..=MAX_KEY bytes without control characters.
pub fn key(what: &str, value: &str) -> Result<()> {
    if value.is_empty() || value.len() > MAX_KEY {
        return Err(invalid(format!(
            "{what} must be 1..={MAX_KEY} bytes, got {}",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(format!("{what} contains a control character")));
    }
    Ok(())
}

/// A kind or state: 1..=MAX_NAME of `[A-Za-z0-9_-]`.
pub fn name(what: &str, value: &str) -> Result<()> {
    let ok = (1..=MAX_NAME).contains(&value.len())
        && value
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what} {value:?} must be 1..={MAX_NAME} of [A-Za-z0-9_-]"
        )))
    }
}

pub fn body(what: &str, value: &[u8], max: usize) -> Result<()> {
    if value.len() > max {
        return Err(invalid(format!(
            "{what} is {} bytes, the limit is {max}",
            value.len()
        )));
    }
    Ok(())
}

pub fn token(what: &str, value: &str) -> Result<()> {
    if value.is_empty() || value.len() > MAX_TOKEN {
        return Err(invalid(format!("{what} must be 1..={MAX_TOKEN} bytes")));
    }
    Ok(())
}

/// A page or batch size: 0 is a caller bug, more than `max` is capped.
pub fn count(what: &str, value: u32, max: u32) -> Result<u32> {
    if value == 0 {
        return Err(invalid(format!("{what} must be at least 1")));
    }
    Ok(value.min(max))
}

pub fn duration(what: &str, value: u64, max: u64) -> Result<i64> {
    if value > max {
        return Err(invalid(format!("{what} {value} ms exceeds {max} ms")));
    }
    // max is far below i64::MAX, so this cannot fail after the check above.
    i64::try_from(value).map_err(|_| invalid(format!("{what} out of range")))
}
