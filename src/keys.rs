//! The identity chain of DESIGN.md §3: how each key is derived from the one
//! before it, in one place, so a restart derives the same keys.

use sha2::{Digest, Sha256};

/// The submission idempotency key of an inbound update: a stable function of
/// the inbound key `(channel account, platform update key)`, so every retry
/// and every restart submits under the same key.
pub fn submission_key(account: &str, update_key: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(account.as_bytes());
    hash.update([0u8]);
    hash.update(update_key.as_bytes());
    let digest = hash.finalize();
    format!("in-{}", hex::encode(&digest[..16]))
}

/// The reply item key of part `part` (1-based) of a run's final answer.
pub fn answer_item_key(run_id: &str, part: usize) -> String {
    format!("run-{run_id}-answer-{part}")
}

/// The group of the chunks of a run's final answer.
pub fn answer_group(run_id: &str) -> String {
    format!("run-{run_id}-answer")
}

/// The reply item key of a run's streaming preview.
pub fn preview_item_key(run_id: &str) -> String {
    format!("run-{run_id}-preview")
}

/// The reply item key of a notice a run sends (a failure notice).
pub fn run_notice_key(run_id: i64, what: &str) -> String {
    run_notice_key_for(&run_id.to_string(), what)
}

/// [`run_notice_key`] for any run key.
pub fn run_notice_key_for(run: &str, what: &str) -> String {
    format!("run-{run}-{what}")
}

/// A remote runtime's run, as Switchboard names it: the runtime's own run id
/// is only unique within that runtime.
pub fn remote_run_key(runtime: &str, run_id: &str) -> String {
    format!("{runtime}:{run_id}")
}

/// The reply item key of part `part` of the answer a remote runtime's
/// durable event `event_id` carries: a repeated event yields the same keys.
pub fn event_item_key(run: &str, event_id: i64, part: usize) -> String {
    format!("run-{run}-ev{event_id}-{part}")
}

/// The reply item key of a notice about an inbound row (a failure notice, a
/// refusal): one per row and reason, so a retry never sends it twice.
pub fn notice_item_key(inbound_id: i64, what: &str) -> String {
    format!("in-{inbound_id}-{what}")
}

/// The lease a process holds while it owns a conversation's lane (several
/// processes on one store). `journal_pending_for` spells the same name in
/// SQL (`'lane:' || conversation_id`).
pub fn lane_lease(conversation_id: i64) -> String {
    format!("lane:{conversation_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submission_keys_are_stable_and_distinct() {
        assert_eq!(
            submission_key("webhook:a", "1"),
            submission_key("webhook:a", "1")
        );
        assert_ne!(
            submission_key("webhook:a", "1"),
            submission_key("webhook:b", "1")
        );
        // The separator keeps ("a", "b1") and ("ab", "1") apart.
        assert_ne!(submission_key("a", "b1"), submission_key("ab", "1"));
    }
}
