//! Formats and size limits of everything the ports accept. The numbers follow the AWS services the other
//! adapters sit on, so an input the embedded store accepts is one DynamoDB/SQS accept too.

use crate::{Item, Result, StoreError};

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

/// The bytes one response may carry, spent item by item. The first item always fits, so an item over the budget
/// still goes out, on a page of its own; the others fit while the total stays within the budget, and once one does
/// not, none after it does (a page is a prefix: its token points past its last item). A listing whose
/// page ends early says that more follow, so a page of many large items (up to `MAX_BODY` each) stays within its
/// callers' response limits instead of failing every time it is asked for.
pub struct ByteBudget {
    budget: usize,
    spent: usize,
    items: usize,
    full: bool,
}

impl ByteBudget {
    pub fn new(budget: usize) -> Self {
        ByteBudget {
            budget,
            spent: 0,
            items: 0,
            full: false,
        }
    }

    /// Whether an item of `size` bytes still fits; if it does, it is spent.
    pub fn take(&mut self, size: usize) -> bool {
        let spent = self.spent.saturating_add(size);
        if self.full || (self.items > 0 && spent > self.budget) {
            self.full = true;
            return false;
        }
        self.spent = spent;
        self.items += 1;
        true
    }
}

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

/// What `Store::create_run` and `Store::append` write: the run's org and id, its state, its snapshot and its new
/// events (1..=MAX_EVENTS_PER_APPEND of at most MAX_BODY bytes each, at most MAX_APPEND_BYTES with the snapshot).
pub fn run_write<E: AsRef<[u8]>>(
    org: &str,
    id: &str,
    state: &str,
    snapshot: &[u8],
    events: &[E],
) -> Result<()> {
    self::org(org)?;
    key("run id", id)?;
    name("state", state)?;
    body("snapshot", snapshot, MAX_BODY)?;
    if events.is_empty() || events.len() > MAX_EVENTS_PER_APPEND {
        return Err(invalid(format!(
            "an append takes 1..={MAX_EVENTS_PER_APPEND} events, got {}",
            events.len()
        )));
    }
    let mut total = snapshot.len();
    for e in events {
        body("event", e.as_ref(), MAX_BODY)?;
        total += e.as_ref().len();
    }
    if total > MAX_APPEND_BYTES {
        return Err(invalid(format!(
            "append of {total} bytes exceeds {MAX_APPEND_BYTES}"
        )));
    }
    Ok(())
}

/// The item `Store::put_item` writes: its org, kind, id, index value and body.
pub fn item(item: &Item) -> Result<()> {
    org(&item.org)?;
    name("kind", &item.kind)?;
    key("item id", &item.id)?;
    if let Some(idx) = &item.index {
        key("index", idx)?;
    }
    body("item body", &item.body, MAX_BODY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid<T: std::fmt::Debug>(r: Result<T>) -> bool {
        matches!(r, Err(StoreError::Invalid(_)))
    }

    #[test]
    fn a_page_fits_its_budget_and_holds_at_least_one_item() {
        let fit = |sizes: &[usize]| {
            let mut budget = ByteBudget::new(10);
            sizes.iter().take_while(|&&size| budget.take(size)).count()
        };
        assert_eq!(fit(&[]), 0);
        assert_eq!(fit(&[4, 4, 2, 1]), 3, "4+4+2 = 10 fits, one more does not");
        assert_eq!(fit(&[11, 1]), 1, "an item over the budget goes alone");
        assert_eq!(fit(&[3, 11]), 1, "and on a page of its own");
        assert_eq!(fit(&[usize::MAX, usize::MAX]), 1, "no overflow");
        assert_eq!(fit(&[1; 5]), 5);
        let mut budget = ByteBudget::new(10);
        assert!(budget.take(8) && !budget.take(5));
        assert!(!budget.take(1), "nothing after an item that did not fit");
    }

    #[test]
    fn run_writes_take_1_to_99_events_within_the_append_bytes() {
        let one = [b"e".to_vec()];
        assert_eq!(run_write("acme", "r-1", "open", b"s", &one), Ok(()));
        assert_eq!(run_write("acme", "r-1", "open", b"s", &[b"e"]), Ok(()));
        assert!(invalid(run_write::<Vec<u8>>(
            "acme",
            "r-1",
            "open",
            b"s",
            &[]
        )));
        let most = vec![b"e".to_vec(); MAX_EVENTS_PER_APPEND];
        assert_eq!(run_write("acme", "r-1", "open", b"s", &most), Ok(()));
        let too_many = vec![b"e".to_vec(); MAX_EVENTS_PER_APPEND + 1];
        assert!(invalid(run_write("acme", "r-1", "open", b"s", &too_many)));
        // Every body within MAX_BODY, the sum at and just past MAX_APPEND_BYTES.
        let body = vec![0u8; MAX_BODY];
        let fits = vec![body.clone(); MAX_APPEND_BYTES / MAX_BODY - 1];
        assert_eq!(run_write("acme", "r-1", "open", &body, &fits), Ok(()));
        let mut over = fits;
        over.push(vec![0u8; 1]);
        assert!(invalid(run_write("acme", "r-1", "open", &body, &over)));
        assert!(invalid(run_write(
            "acme",
            "r-1",
            "open",
            b"s",
            &[vec![0u8; MAX_BODY + 1]]
        )));
        assert!(invalid(run_write("ACME", "r-1", "open", b"s", &one)));
        assert!(invalid(run_write("acme", "", "open", b"s", &one)));
        assert!(invalid(run_write("acme", "r-1", "open state", b"s", &one)));
    }

    #[test]
    fn items_are_checked_field_by_field() {
        let ok = Item {
            org: "acme".into(),
            kind: "approval".into(),
            id: "a-1".into(),
            version: 0,
            index: Some("pending".into()),
            body: vec![0u8; MAX_BODY],
            expires_ms: None,
        };
        assert_eq!(item(&ok), Ok(()));
        for bad in [
            Item {
                org: "-acme".into(),
                ..ok.clone()
            },
            Item {
                kind: "a/b".into(),
                ..ok.clone()
            },
            Item {
                id: String::new(),
                ..ok.clone()
            },
            Item {
                index: Some(String::new()),
                ..ok.clone()
            },
            Item {
                body: vec![0u8; MAX_BODY + 1],
                ..ok.clone()
            },
        ] {
            assert!(
                invalid(item(&bad)),
                "{:?}",
                (&bad.org, &bad.kind, &bad.id, &bad.index)
            );
        }
    }
}
