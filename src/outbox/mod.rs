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
pub mod rate;
pub mod reconcile;
pub mod shape;
pub mod stream;

pub use crate::backoff::backoff;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

/// Per-chat order between durable sends and transient edits: the final
/// answer that edits a preview and a transient edit of the same preview
/// never overlap, so a stale edit cannot land after the final text.
/// Striped, so memory does not grow with the number of chats.
pub struct ChatLocks {
    stripes: Vec<tokio::sync::Mutex<()>>,
}

impl Default for ChatLocks {
    fn default() -> Self {
        ChatLocks {
            stripes: (0..256).map(|_| tokio::sync::Mutex::new(())).collect(),
        }
    }
}

impl ChatLocks {
    pub async fn lock(&self, account: &str, chat: &str) -> tokio::sync::MutexGuard<'_, ()> {
        let mut h = DefaultHasher::new();
        (account, chat).hash(&mut h);
        self.stripes[(h.finish() % self.stripes.len() as u64) as usize]
            .lock()
            .await
    }
}
