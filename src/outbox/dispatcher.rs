//! The dispatcher: claim lane heads, send them, record the outcomes.
//!
//! One claim transaction marks a batch of heads `possibly_dispatched` with a
//! lease and a fresh fencing token; no transaction is open while a send is
//! in flight; outcomes are written through a group-commit writer, fenced by
//! the token. Acknowledging an item makes the next item of its lane the head,
//! which the next claim picks up, so a conversation's items leave in ordinal
//! order while conversations go out concurrently.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use switchboard_channel::{
    ChannelAdapter, DeliveryError, OutboundMessage, OutboundMeta, Receipt, SendAction,
};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::ChatLocks;
use super::backoff;
use super::rate::RateLimiter;
use crate::clock::SharedClock;
use crate::config::OutboxConfig;
use crate::observe::SharedObserver;
use crate::store::batch::Batcher;
use crate::store::{Claim, DispatchState, ItemKind, OutboxItem, Outcome, Settlement, SharedStore};

/// How often an idle dispatcher looks for due items (retries whose time has
/// come); new items wake it at once.
const IDLE_POLL: Duration = Duration::from_millis(500);

/// Retry delay for an item whose channel account this daemon does not run.
const NO_ADAPTER_RETRY: Duration = Duration::from_secs(60);

pub struct Dispatcher {
    store: SharedStore,
    adapters: HashMap<String, Arc<dyn ChannelAdapter>>,
    rate: Arc<RateLimiter>,
    chat_locks: Arc<ChatLocks>,
    config: OutboxConfig,
    clock: SharedClock,
    observer: SharedObserver,
    wake: Arc<Notify>,
    owner: String,
    settle: Batcher<Settlement, bool>,
}

impl Dispatcher {
    /// `adapters` by channel account store identity; `owner` names this
    /// process in leases.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: SharedStore,
        adapters: HashMap<String, Arc<dyn ChannelAdapter>>,
        rate: Arc<RateLimiter>,
        chat_locks: Arc<ChatLocks>,
        config: OutboxConfig,
        clock: SharedClock,
        observer: SharedObserver,
        wake: Arc<Notify>,
        owner: String,
    ) -> Self {
        let settle_store = store.clone();
        let (settle, _) = Batcher::spawn("outbox settle", 512, move |batch: Vec<Settlement>| {
            let store = settle_store.clone();
            async move { store.outbox_settle(&batch).await }
        });
        Dispatcher {
            store,
            adapters,
            rate,
            chat_locks,
            config,
            clock,
            observer,
            wake,
            owner,
            settle,
        }
    }

    /// Dispatch until `stop` is cancelled, then give sends in flight until
    /// `drain` ends; whatever is still unconfirmed stays `possibly_dispatched`
    /// for reconciliation at the next start. Returns the number of sends
    /// still in flight when it gave up.
    pub async fn run(
        self,
        stop: CancellationToken,
        drain: impl std::future::Future<Output = ()>,
    ) -> usize {
        let this = Arc::new(self);
        let mut in_flight: JoinSet<()> = JoinSet::new();
        let mut claim_failures = 0u32;
        loop {
            this.observer.beat("dispatcher");
            if stop.is_cancelled() {
                break;
            }
            // Finished sends still count in the set until joined: join them
            // all first, so one claim fills every free slot (one claim per
            // joined send would turn a wave of N settlements into N claims).
            while in_flight.try_join_next().is_some() {}
            let free = this.config.concurrency.saturating_sub(in_flight.len());
            let mut claimed = 0;
            if free > 0 {
                let now = this.clock.now_ms();
                let claim = Claim {
                    owner: this.owner.clone(),
                    now,
                    lease_until: now + (this.config.lease_secs * 1000) as i64,
                    limit: free,
                };
                match this.store.outbox_claim(&claim).await {
                    Ok(items) => {
                        claim_failures = 0;
                        claimed = items.len();
                        for item in items {
                            let this = this.clone();
                            in_flight.spawn(async move { this.send_one(item).await });
                        }
                    }
                    Err(e) => {
                        claim_failures += 1;
                        tracing::warn!(error = %e, "outbox claim failed; backing off");
                    }
                }
            }
            if claimed > 0 && claimed == free {
                // Everything we had room for was due: make room, then claim
                // again.
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = in_flight.join_next() => {}
                }
                continue;
            }
            let pause = if claim_failures > 0 {
                backoff(
                    claim_failures,
                    Duration::from_millis(100),
                    Duration::from_secs(5),
                )
            } else {
                IDLE_POLL
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = this.wake.notified() => {}
                Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
        // Stop claiming; let sends in flight finish within the deadline.
        let drained = async { while in_flight.join_next().await.is_some() {} };
        tokio::select! {
            _ = drained => 0,
            _ = drain => {
                let left = in_flight.len();
                in_flight.abort_all();
                left
            }
        }
    }

    async fn send_one(&self, item: OutboxItem) {
        let outcome = match self.adapters.get(&item.account) {
            Some(adapter) => self.deliver(adapter.as_ref(), &item).await,
            None => {
                tracing::warn!(item = %item.item_key, account = %item.account, "no channel account runs this item's account; retrying later");
                Outcome::Retry {
                    next_attempt_at: self.clock.now_ms() + NO_ADAPTER_RETRY.as_millis() as i64,
                    counts: false,
                    reason: format!(
                        "channel account {} is not running in this daemon",
                        item.account
                    ),
                }
            }
        };
        let settlement = Settlement {
            item_id: item.id,
            fencing_token: item.fencing_token,
            outcome: outcome.clone(),
            now: self.clock.now_ms(),
        };
        match self.settle.call(settlement, "outbox settle").await {
            Ok(true) => self.report(&item, &outcome),
            Ok(false) => {
                tracing::info!(item = %item.item_key, token = item.fencing_token, "outcome not recorded: a newer claim owns the item");
                self.observer.fenced(&item.item_key);
            }
            Err(e) => {
                // The item stays possibly_dispatched; its lease runs out and
                // reconciliation resolves it.
                tracing::warn!(item = %item.item_key, error = %e, "could not record a send outcome");
            }
        }
        if matches!(
            outcome,
            Outcome::Acknowledged { .. } | Outcome::Failed { .. }
        ) {
            // The lane moved on: its next item may be claimable now.
            self.wake.notify_one();
        }
    }

    /// Send one claimed item through its adapter, within the rate limits.
    async fn deliver(&self, adapter: &dyn ChannelAdapter, item: &OutboxItem) -> Outcome {
        let action = match self.action_for(item).await {
            Ok(Some(action)) => action,
            // A discard marker for a preview that was never shown: nothing
            // to do, and nothing to tell.
            Ok(None) => {
                return Outcome::Acknowledged {
                    receipt: r#"{"message_ids":[],"skipped":"no preview was shown"}"#.to_owned(),
                };
            }
            Err(e) => {
                return Outcome::Retry {
                    next_attempt_at: self.clock.now_ms() + 1000,
                    counts: false,
                    reason: format!("could not read the preview this item edits: {e}"),
                };
            }
        };
        let message = OutboundMessage {
            item_key: item.item_key.clone(),
            chat_id: item.chat_id.clone(),
            thread_id: item.thread_id.clone(),
            text: item.text.clone(),
            attachments: item.attachments.clone(),
            reply_to: item.reply_to.clone(),
            action,
            meta: OutboundMeta {
                conversation_id: item.conversation_id,
                ordinal: item.ordinal,
                run_id: item.run_id.clone(),
            },
        };
        let group = item.surface.is_group();
        self.rate.acquire(&item.account, &item.chat_id, group).await;
        // An edit of a preview must not overlap a transient edit of it.
        let _order = match message.action {
            SendAction::Edit { .. } => {
                Some(self.chat_locks.lock(&item.account, &item.chat_id).await)
            }
            SendAction::Create => None,
        };
        let result = adapter.send(&message).await;
        if let Err(DeliveryError::RetryAfter { after, scope }) = &result {
            self.rate
                .pause(&item.account, &item.chat_id, *scope, *after);
        }
        self.outcome(item, result)
    }

    /// Create a message, or edit the preview this item replaces when that
    /// preview was shown. `None`: the item only edits, and there is nothing
    /// to edit.
    async fn action_for(
        &self,
        item: &OutboxItem,
    ) -> Result<Option<SendAction>, crate::store::StoreError> {
        let Some(key) = &item.edits_key else {
            return Ok(Some(SendAction::Create));
        };
        let shown = self
            .store
            .outbox_get_by_key(key)
            .await?
            .filter(|p| p.state == DispatchState::Acknowledged)
            .and_then(|p| p.receipt)
            .and_then(|r| serde_json::from_str::<Receipt>(&r).ok())
            .and_then(|r| r.message_ids.into_iter().next());
        Ok(match (shown, item.kind) {
            (Some(message_id), _) => Some(SendAction::Edit { message_id }),
            (None, ItemKind::Discard) => None,
            (None, _) => Some(SendAction::Create),
        })
    }

    fn outcome(
        &self,
        item: &OutboxItem,
        result: Result<switchboard_channel::Receipt, DeliveryError>,
    ) -> Outcome {
        let now = self.clock.now_ms();
        match result {
            Ok(receipt) => Outcome::Acknowledged {
                receipt: serde_json::to_string(&receipt).unwrap_or_default(),
            },
            Err(DeliveryError::RetryAfter { after, .. }) => Outcome::Retry {
                next_attempt_at: now + after.as_millis() as i64,
                counts: false,
                reason: format!("rate limited for {after:?}"),
            },
            Err(DeliveryError::NotSent(why)) => {
                let attempt = (item.attempts + 1) as u32;
                if attempt >= self.config.max_attempts {
                    Outcome::Failed {
                        reason: format!("gave up after {attempt} attempts: {why}"),
                    }
                } else {
                    let delay = backoff(
                        attempt,
                        Duration::from_millis(self.config.backoff_base_ms),
                        Duration::from_millis(self.config.backoff_cap_ms),
                    );
                    Outcome::Retry {
                        next_attempt_at: now + delay.as_millis() as i64,
                        counts: true,
                        reason: why,
                    }
                }
            }
            Err(DeliveryError::Permanent(why)) => Outcome::Failed { reason: why },
            Err(DeliveryError::Ambiguous(why)) => Outcome::Ambiguous {
                reason: why,
                reconcile_at: now + (self.config.reconcile_after_secs * 1000) as i64,
            },
        }
    }

    fn report(&self, item: &OutboxItem, outcome: &Outcome) {
        match outcome {
            Outcome::Acknowledged { .. } => {
                tracing::debug!(item = %item.item_key, conversation = item.conversation_id, ordinal = item.ordinal, "delivered");
                self.observer.delivered(
                    &item.account,
                    &item.item_key,
                    item.conversation_id,
                    item.ordinal,
                );
            }
            Outcome::Retry { reason, counts, .. } => {
                let kind = if *counts { "not_sent" } else { "retry_after" };
                tracing::info!(item = %item.item_key, kind, reason, "send will be retried");
                self.observer
                    .send_failed(&item.account, &item.item_key, kind, reason);
            }
            Outcome::Failed { reason } => {
                tracing::warn!(item = %item.item_key, reason, "send failed for good");
                self.observer
                    .send_failed(&item.account, &item.item_key, "failed", reason);
            }
            Outcome::Ambiguous { reason, .. } => {
                tracing::warn!(item = %item.item_key, reason, "send outcome unknown; will reconcile");
                self.observer
                    .send_failed(&item.account, &item.item_key, "ambiguous", reason);
            }
        }
    }
}
