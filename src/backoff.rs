//! Exponential backoff with jitter, shared by every retry loop.

use std::time::Duration;

use rand::RngExt;

/// The delay before retry number `attempt` (1-based): exponential from
/// `base`, capped at `cap`, with jitter in [50%, 100%] so a burst of
/// failures does not come back as a burst.
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
