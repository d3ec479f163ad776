//! The outbox: reply items leave through their channel adapters with
//! explicit dispatch states (DESIGN.md §4).
//!
//! - [`dispatcher`] claims lane heads (committing `possibly_dispatched`
//!   before the platform call), sends them, and group-commits the outcomes.
//! - [`reconcile`] resolves `possibly_dispatched` items whose lease ran out
//!   by their surface's `on_ambiguous_send`.
//!
//! Architecture invariant: no message is created that was not first durably
//! marked `possibly_dispatched`, and every state write after a claim carries
//! the claim's fencing token.

pub mod dispatcher;
pub mod reconcile;

use std::time::Duration;

use rand::RngExt;

/// The delay before retry number `attempt` (1-based) after `NotSent`:
/// exponential from `base`, capped at `cap`, with jitter in [50%, 100%] so
/// a burst of failures does not come back as a burst.
pub fn backoff(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
    let full = exp.min(cap);
    let factor = rand::rng().random_range(0.5..=1.0);
    full.mul_f64(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        for _ in 0..100 {
            let first = backoff(1, base, cap);
            assert!(
                first >= Duration::from_millis(50) && first <= base,
                "{first:?}"
            );
            let third = backoff(3, base, cap);
            assert!(third >= Duration::from_millis(200) && third <= Duration::from_millis(400));
            assert!(backoff(30, base, cap) <= cap);
        }
    }
}
