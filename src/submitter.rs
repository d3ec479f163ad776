//! The submitter: journal rows → runtime submissions.
//!
//! It reads rows that are stored but not yet admitted, oldest first, hands
//! them to the runtime of their channel account with the idempotency key
//! derived from their inbound key, and records the run ids. It holds no
//! state of its own: after a crash the same rows are still pending and are
//! submitted again under the same keys, and the runtime answers with the
//! same runs (DESIGN.md promise 2).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use switchboard_channel::{AttachmentRef, Content};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::observe::SharedObserver;
use crate::runtime::{Input, Runtime, Submission, SubmitError};
use crate::store::{Admitted, Disposition, InboundRow, SharedStore};
use crate::surface::SurfaceKind;

/// How often the submitter looks at the journal when nothing woke it.
const IDLE_POLL: Duration = Duration::from_secs(1);

pub struct Submitter {
    pub store: SharedStore,
    /// Runtimes by configured name.
    pub runtimes: HashMap<String, Arc<dyn Runtime>>,
    /// The runtime name of each channel account, by store identity.
    pub account_runtime: HashMap<String, String>,
    pub config: Arc<Config>,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    pub wake: Arc<Notify>,
}

/// What one round achieved.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub read: usize,
    pub admitted: usize,
    pub settled: usize,
    /// Rows left pending because their runtime was unavailable.
    pub deferred: usize,
}

impl Submitter {
    /// Submit until `stop` is cancelled.
    pub async fn run(self, stop: CancellationToken) {
        let retry = Duration::from_secs(self.config.submitter.retry_secs);
        loop {
            let round = match self.round().await {
                Ok(round) => round,
                Err(e) => {
                    tracing::warn!(error = %e, "submitter could not read the journal; retrying");
                    Round {
                        deferred: 1,
                        ..Round::default()
                    }
                }
            };
            let progressed = round.admitted + round.settled > 0;
            if progressed && round.read == self.config.submitter.batch_size {
                // A full batch: there is probably more waiting.
                if stop.is_cancelled() {
                    return;
                }
                continue;
            }
            let pause = if round.deferred > 0 && !progressed {
                retry
            } else {
                IDLE_POLL
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One pass over the oldest pending rows.
    pub async fn round(&self) -> Result<Round, crate::store::StoreError> {
        let rows = self
            .store
            .journal_pending(self.config.submitter.batch_size)
            .await?;
        let mut round = Round {
            read: rows.len(),
            ..Round::default()
        };
        if rows.is_empty() {
            return Ok(round);
        }
        // Group by runtime, keeping journal order within each group.
        let mut groups: Vec<(String, Vec<InboundRow>)> = Vec::new();
        for row in rows {
            let runtime = self.account_runtime.get(&row.account).cloned();
            let Some(runtime) = runtime else {
                // The account was removed from the config while rows of it
                // were pending: keep them for when it comes back.
                round.deferred += 1;
                continue;
            };
            match groups.iter_mut().find(|(name, _)| *name == runtime) {
                Some((_, g)) => g.push(row),
                None => groups.push((runtime, vec![row])),
            }
        }
        let now = self.clock.now_ms();
        let mut admitted = Vec::new();
        for (runtime_name, rows) in groups {
            let Some(runtime) = self.runtimes.get(&runtime_name) else {
                round.deferred += rows.len();
                continue;
            };
            let mut submissions = Vec::with_capacity(rows.len());
            let mut submitted_rows = Vec::with_capacity(rows.len());
            for row in rows {
                match self.submission(&row) {
                    Ok(s) => {
                        submissions.push(s);
                        submitted_rows.push(row);
                    }
                    Err(reason) => {
                        self.settle(&row, Disposition::Rejected, &reason, now)
                            .await?;
                        round.settled += 1;
                    }
                }
            }
            let results = runtime.submit(submissions).await;
            let mut blocked: HashSet<i64> = HashSet::new();
            for (row, result) in submitted_rows.iter().zip(results) {
                if blocked.contains(&row.conversation_id) {
                    round.deferred += 1;
                    continue;
                }
                match result {
                    Ok(admission) => {
                        self.observer.admitted(
                            &runtime_name,
                            row.id,
                            &admission.run_id,
                            admission.new,
                        );
                        admitted.push(Admitted {
                            inbound_id: row.id,
                            run_id: admission.run_id,
                        });
                    }
                    Err(SubmitError::Unavailable(why)) => {
                        tracing::warn!(inbound_id = row.id, runtime = %runtime_name, %why, "runtime unavailable; will resubmit");
                        self.observer
                            .submission_failed(&runtime_name, "unavailable");
                        blocked.insert(row.conversation_id);
                        round.deferred += 1;
                    }
                    Err(SubmitError::Rejected(why)) => {
                        self.observer.submission_failed(&runtime_name, "rejected");
                        self.settle(row, Disposition::Rejected, &why, now).await?;
                        round.settled += 1;
                    }
                }
            }
        }
        round.admitted = admitted.len();
        self.store.journal_admit(&admitted, now).await?;
        Ok(round)
    }

    fn submission(&self, row: &InboundRow) -> Result<Submission, String> {
        let payload = row
            .payload
            .as_deref()
            .ok_or_else(|| "the payload was pruned before the update was submitted".to_owned())?;
        let content: Content = serde_json::from_str(payload)
            .map_err(|e| format!("the stored payload cannot be read: {e}"))?;
        let (text, attachments): (String, Vec<AttachmentRef>) = match content {
            Content::Message { text, attachments } => (text, attachments),
            Content::Unsupported { kind, .. } => {
                return Err(format!("update kind {kind:?} cannot be submitted"));
            }
        };
        let surface = self.config.surface(row.surface);
        Ok(Submission {
            idempotency_key: row.submission_key.clone(),
            conversation_id: row.conversation_id,
            inbound_id: Some(row.id),
            account: row.account.clone(),
            chat_id: row.chat_id.clone(),
            thread_id: row.thread_id.clone(),
            surface: row.surface,
            reply_to: row.message_id.clone(),
            input: Input {
                text,
                attachments,
                sender_id: row.sender_id.clone(),
                sender_name: row.sender_name.clone(),
            },
            policy: resolve_auto(surface.input_policy, surface.delivery, row.surface),
        })
    }

    async fn settle(
        &self,
        row: &InboundRow,
        disposition: Disposition,
        reason: &str,
        now: i64,
    ) -> Result<(), crate::store::StoreError> {
        if self
            .store
            .journal_settle(row.id, disposition, reason, now)
            .await?
        {
            tracing::info!(inbound_id = row.id, disposition = %disposition, reason, "update settled without a run");
            self.observer.settled(row.id, disposition.as_str(), reason);
        }
        Ok(())
    }
}

/// `auto` asks one question: did anyone see the partial answer? On a
/// streaming surface they did (`interrupt`); otherwise not (`supersede`).
fn resolve_auto(
    policy: crate::surface::InputPolicy,
    delivery: crate::surface::Delivery,
    _surface: SurfaceKind,
) -> crate::surface::InputPolicy {
    use crate::surface::{Delivery, InputPolicy};
    match (policy, delivery) {
        (InputPolicy::Auto, Delivery::Streaming) => InputPolicy::Interrupt,
        (InputPolicy::Auto, Delivery::TerminalOnly) => InputPolicy::Supersede,
        (p, _) => p,
    }
}
