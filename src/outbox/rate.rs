//! Rate limits: token buckets per channel account, per chat and per group
//! chat, from the limits each adapter declares. Sends wait for a token in
//! every bucket that applies; transient edits and typing indicators take
//! one only when it is there (they are skipped, not queued). A platform's
//! "slow down" (429) pauses the chat's bucket, or the account's when the
//! platform says the limit is global, for the time it gave.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use switchboard_channel::{Limits, Rate, RateScope};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Scope {
    Account,
    Chat,
    Group,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    account: String,
    scope: Scope,
    chat: String,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    rate: Rate,
    refilled: Instant,
    paused_until: Option<Instant>,
    last_used: Instant,
}

impl Bucket {
    fn new(rate: Rate, now: Instant) -> Self {
        Bucket {
            tokens: f64::from(rate.burst.max(1)),
            rate,
            refilled: now,
            paused_until: None,
            last_used: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens =
            (self.tokens + elapsed * self.rate.per_second).min(f64::from(self.rate.burst.max(1)));
        self.refilled = now;
    }

    /// How long until a token is there (zero: now).
    fn wait(&self, now: Instant) -> Duration {
        let paused = self
            .paused_until
            .map_or(Duration::ZERO, |until| until.saturating_duration_since(now));
        let refill = if self.tokens >= 1.0 || self.rate.per_second <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - self.tokens) / self.rate.per_second)
        };
        paused.max(refill)
    }
}

/// Every bucket of a daemon.
pub struct RateLimiter {
    limits: HashMap<String, Limits>,
    buckets: Mutex<HashMap<Key, Bucket>>,
}

/// Buckets idle this long (and full) are forgotten, so memory follows
/// active chats.
const IDLE: Duration = Duration::from_secs(600);

impl RateLimiter {
    /// `limits` by channel account store identity.
    pub fn new(limits: HashMap<String, Limits>) -> Self {
        RateLimiter {
            limits,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn keys(&self, account: &str, chat: &str, group: bool) -> Vec<(Key, Rate)> {
        let Some(limits) = self.limits.get(account) else {
            return Vec::new();
        };
        let mut keys = Vec::with_capacity(3);
        let key = |scope, chat: &str| Key {
            account: account.to_owned(),
            scope,
            chat: chat.to_owned(),
        };
        if let Some(rate) = limits.per_account {
            keys.push((key(Scope::Account, ""), rate));
        }
        if let Some(rate) = limits.per_chat {
            keys.push((key(Scope::Chat, chat), rate));
        }
        if group && let Some(rate) = limits.per_group {
            keys.push((key(Scope::Group, chat), rate));
        }
        keys
    }

    /// Take a token from every bucket that applies if all have one;
    /// otherwise take nothing and say how long to wait.
    fn try_take(&self, account: &str, chat: &str, group: bool) -> Result<(), Duration> {
        let keys = self.keys(account, chat, group);
        if keys.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let mut wait = Duration::ZERO;
        for (key, rate) in &keys {
            let bucket = buckets
                .entry(key.clone())
                .or_insert_with(|| Bucket::new(*rate, now));
            bucket.refill(now);
            wait = wait.max(bucket.wait(now));
        }
        if !wait.is_zero() {
            return Err(wait);
        }
        for (key, _) in &keys {
            if let Some(bucket) = buckets.get_mut(key) {
                bucket.tokens -= 1.0;
                bucket.last_used = now;
            }
        }
        if buckets.len() > 4096 {
            buckets.retain(|_, b| {
                now.saturating_duration_since(b.last_used) < IDLE
                    || b.tokens < f64::from(b.rate.burst.max(1))
            });
        }
        Ok(())
    }

    /// Wait until every bucket that applies has a token, and take them.
    pub async fn acquire(&self, account: &str, chat: &str, group: bool) {
        loop {
            match self.try_take(account, chat, group) {
                Ok(()) => return,
                Err(wait) => tokio::time::sleep(wait).await,
            }
        }
    }

    /// Take tokens only when they are there now (transient edits, typing).
    pub fn try_acquire(&self, account: &str, chat: &str, group: bool) -> bool {
        self.try_take(account, chat, group).is_ok()
    }

    /// The platform said to wait `after`: pause the chat, or the whole
    /// account.
    pub fn pause(&self, account: &str, chat: &str, scope: RateScope, after: Duration) {
        let now = Instant::now();
        let until = now + after;
        let key = Key {
            account: account.to_owned(),
            scope: match scope {
                RateScope::Account => Scope::Account,
                RateScope::Chat => Scope::Chat,
            },
            chat: match scope {
                RateScope::Account => String::new(),
                RateScope::Chat => chat.to_owned(),
            },
        };
        // A pause applies even where the adapter declared no rate.
        let rate = self
            .keys(account, chat, false)
            .into_iter()
            .find(|(k, _)| *k == key)
            .map(|(_, r)| r)
            .unwrap_or(Rate {
                per_second: 1000.0,
                burst: 1000,
            });
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(key).or_insert_with(|| Bucket::new(rate, now));
        bucket.paused_until = Some(bucket.paused_until.map_or(until, |u| u.max(until)));
        bucket.last_used = now;
    }

    /// Whether a 429 pause applies to this chat now (the account's or its
    /// own).
    pub fn is_paused(&self, account: &str, chat: &str) -> bool {
        let now = Instant::now();
        let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        [Scope::Account, Scope::Chat].into_iter().any(|scope| {
            let key = Key {
                account: account.to_owned(),
                scope,
                chat: if scope == Scope::Account {
                    String::new()
                } else {
                    chat.to_owned()
                },
            };
            buckets
                .get(&key)
                .and_then(|b| b.paused_until)
                .is_some_and(|until| until > now)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter() -> RateLimiter {
        RateLimiter::new(
            [(
                "a".to_owned(),
                Limits {
                    max_text_len: 100,
                    length_unit: switchboard_channel::LengthUnit::Chars,
                    per_chat: Some(Rate {
                        per_second: 1.0,
                        burst: 1,
                    }),
                    per_group: Some(Rate {
                        per_second: 1.0 / 3.0,
                        burst: 2,
                    }),
                    per_account: Some(Rate {
                        per_second: 10.0,
                        burst: 5,
                    }),
                },
            )]
            .into_iter()
            .collect(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn per_chat_per_group_and_per_account_limits_hold() {
        let rl = limiter();
        let start = Instant::now();
        // Per chat: 1/s.
        rl.acquire("a", "c1", false).await;
        rl.acquire("a", "c1", false).await;
        rl.acquire("a", "c1", false).await;
        assert_eq!(start.elapsed().as_secs_f64().round(), 2.0);
        // Per account: burst 5 then 10/s, across chats.
        let rl = limiter();
        let start = Instant::now();
        for i in 0..25 {
            rl.acquire("a", &format!("chat{i}"), false).await;
        }
        let took = start.elapsed().as_secs_f64();
        assert!(
            (1.9..2.1).contains(&took),
            "25 sends at 10/s after a burst of 5 took {took}s"
        );
        // Per group: burst 2 then one every 3 s (on top of per chat).
        let rl = limiter();
        let start = Instant::now();
        for _ in 0..4 {
            rl.acquire("a", "g", true).await;
        }
        let took = start.elapsed().as_secs_f64();
        assert!((5.9..6.1).contains(&took), "{took}");
    }

    #[tokio::test(start_paused = true)]
    async fn transient_sends_never_wait_and_a_429_pauses_its_scope() {
        let rl = limiter();
        assert!(rl.try_acquire("a", "c1", false));
        assert!(
            !rl.try_acquire("a", "c1", false),
            "no token: skipped, not queued"
        );
        rl.pause("a", "c2", RateScope::Chat, Duration::from_secs(5));
        assert!(!rl.try_acquire("a", "c2", false));
        assert!(
            rl.try_acquire("a", "c3", false),
            "a chat pause leaves other chats alone"
        );
        let start = Instant::now();
        rl.acquire("a", "c2", false).await;
        assert_eq!(start.elapsed().as_secs(), 5);
        rl.pause("a", "any", RateScope::Account, Duration::from_secs(2));
        assert!(rl.is_paused("a", "c9"), "an account pause stops every chat");
        let start = Instant::now();
        rl.acquire("a", "c9", false).await;
        assert_eq!(start.elapsed().as_secs(), 2);
        for _ in 0..100 {
            assert!(
                rl.try_acquire("b", "x", false),
                "an account without declared limits is unlimited"
            );
        }
    }
}
