//! The partial-batch-response rule of an SQS-triggered Lambda (`ReportBatchItemFailures`).

use std::collections::HashSet;

/// What happened to one message of a batch, in the order the batch delivered them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOutcome {
    /// The SQS message id (what `batchItemFailures[].itemIdentifier` names).
    pub id: String,
    /// The FIFO `MessageGroupId`; `None` on standard queues.
    pub group: Option<String>,
    pub succeeded: bool,
}

/// The item identifiers to report as `batchItemFailures`, in batch order.
///
/// Standard queue (`fifo == false`): exactly the failed messages; the others are deleted by Lambda.
///
/// FIFO queue: the first failure in a message group and every later message of that group fail, whatever their
/// own outcome, so that SQS redelivers the group's tail in order (a later message must not be deleted before
/// an earlier one of its group succeeded). Other groups are unaffected. A FIFO message without a group (which
/// SQS does not produce) is treated as one group of its own kind: all such messages share it, the cautious
/// reading of "ordered with each other".
pub fn batch_item_failures(outcomes: &[BatchOutcome], fifo: bool) -> Vec<String> {
    if !fifo {
        return outcomes
            .iter()
            .filter(|o| !o.succeeded)
            .map(|o| o.id.clone())
            .collect();
    }
    let mut failed_groups: HashSet<Option<&str>> = HashSet::new();
    let mut failures = Vec::new();
    for o in outcomes {
        let group = o.group.as_deref();
        if !o.succeeded || failed_groups.contains(&group) {
            failed_groups.insert(group);
            failures.push(o.id.clone());
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(id: &str, group: Option<&str>, succeeded: bool) -> BatchOutcome {
        BatchOutcome {
            id: id.into(),
            group: group.map(Into::into),
            succeeded,
        }
    }

    #[test]
    fn standard_queue_reports_only_the_failures() {
        let batch = [
            o("m1", None, true),
            o("m2", None, false),
            o("m3", None, true),
            o("m4", None, false),
        ];
        assert_eq!(batch_item_failures(&batch, false), ["m2", "m4"]);
        assert!(batch_item_failures(&[o("m1", None, true)], false).is_empty());
        assert!(batch_item_failures(&[], false).is_empty());
    }

    #[test]
    fn fifo_fails_the_rest_of_the_failing_group_only() {
        let batch = [
            o("a1", Some("g1"), true),
            o("b1", Some("g2"), true),
            o("a2", Some("g1"), false),
            o("b2", Some("g2"), true),
            o("a3", Some("g1"), true),
            o("c1", Some("g3"), false),
            o("a4", Some("g1"), true),
            o("b3", Some("g2"), true),
        ];
        assert_eq!(batch_item_failures(&batch, true), ["a2", "a3", "c1", "a4"]);
    }

    #[test]
    fn fifo_successes_before_the_failure_are_kept() {
        let batch = [
            o("a1", Some("g"), true),
            o("a2", Some("g"), true),
            o("a3", Some("g"), false),
        ];
        assert_eq!(batch_item_failures(&batch, true), ["a3"]);
    }

    #[test]
    fn the_same_batch_on_a_standard_queue_keeps_later_successes() {
        let batch = [o("a1", Some("g"), false), o("a2", Some("g"), true)];
        assert_eq!(batch_item_failures(&batch, false), ["a1"]);
        assert_eq!(batch_item_failures(&batch, true), ["a1", "a2"]);
    }

    #[test]
    fn fifo_messages_without_group_share_one() {
        let batch = [
            o("x1", None, false),
            o("y1", Some("g"), true),
            o("x2", None, true),
        ];
        assert_eq!(batch_item_failures(&batch, true), ["x1", "x2"]);
    }
}
