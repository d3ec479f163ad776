//! Reconciliation: what to do with a `possibly_dispatched` item whose lease
//! ran out (its worker died, or its send ended ambiguously).
//!
//! The item's surface decides (`on_ambiguous_send`):
//! - `idempotent`: send again under the same item key; the platform folds
//!   the duplicate (webhook receivers dedupe on `reply_key`, Discord on the
//!   nonce). When the adapter does not declare the capability this falls
//!   back to `resend` and says so in the counters.
//! - `resend`: send again, at least once, counted as a possible duplicate.
//! - `hold`: move to `held`, listed for an operator; the lane moves on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use switchboard_channel::Capabilities;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::observe::SharedObserver;
use crate::store::{OutboxItem, Reconcile, ReconcileAction, SharedStore, StoreResult};
use crate::surface::OnAmbiguousSend;

const PAGE: usize = 256;

pub struct Reconciler {
    pub store: SharedStore,
    pub config: Arc<Config>,
    /// Each channel account's capabilities, by store identity.
    pub capabilities: HashMap<String, Capabilities>,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    /// Wakes the dispatcher when items are due again.
    pub dispatcher_wake: Arc<Notify>,
}

impl Reconciler {
    /// Resolve every expired lease now. Returns how many items were resolved.
    pub async fn sweep(&self) -> StoreResult<usize> {
        let mut resolved = 0;
        loop {
            let now = self.clock.now_ms();
            let items = self.store.outbox_expired(now, PAGE).await?;
            if items.is_empty() {
                break;
            }
            let decisions: Vec<(Reconcile, &'static str)> =
                items.iter().map(|item| self.decide(item, now)).collect();
            let batch: Vec<Reconcile> = decisions.iter().map(|(r, _)| r.clone()).collect();
            let applied = self.store.outbox_reconcile(&batch).await?;
            let mut resent = false;
            for ((item, (decision, label)), ok) in items.iter().zip(&decisions).zip(applied) {
                if !ok {
                    continue;
                }
                resolved += 1;
                resent |= matches!(decision.action, ReconcileAction::Resend { .. });
                tracing::info!(item = %item.item_key, surface = %item.surface, action = label, "reconciled a possibly-dispatched item");
                self.observer.reconciled(&item.item_key, label);
            }
            if resent {
                self.dispatcher_wake.notify_one();
            }
            if items.len() < PAGE {
                break;
            }
        }
        Ok(resolved)
    }

    fn decide(&self, item: &OutboxItem, now: i64) -> (Reconcile, &'static str) {
        let policy = self.config.surface(item.surface).on_ambiguous_send;
        let idempotent_capable = self
            .capabilities
            .get(&item.account)
            .is_some_and(|c| c.idempotent_send);
        let (action, label) = match policy {
            OnAmbiguousSend::Idempotent if idempotent_capable => (
                ReconcileAction::Resend {
                    possible_duplicate: false,
                },
                "idempotent_resend",
            ),
            OnAmbiguousSend::Idempotent | OnAmbiguousSend::Resend => (
                ReconcileAction::Resend {
                    possible_duplicate: true,
                },
                "resend",
            ),
            OnAmbiguousSend::Hold => (ReconcileAction::Hold, "hold"),
        };
        (
            Reconcile {
                item_id: item.id,
                fencing_token: item.fencing_token,
                action,
                now,
            },
            label,
        )
    }

    /// Sweep every `interval` until `stop` is cancelled.
    pub async fn run(self, interval: Duration, stop: CancellationToken) {
        loop {
            self.observer.beat("reconciler");
            if let Err(e) = self.sweep().await {
                tracing::warn!(error = %e, "reconciliation sweep failed; will retry");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}
