//! The submitter: journal rows → runtime submissions and chat commands.
//!
//! It reads rows that are stored but not yet admitted, oldest first. A
//! command (`/stop`, `/new`, `/help`) is handled by the core; anything else
//! goes to the runtime of its channel account with the idempotency key
//! derived from its inbound key, and the run id is recorded. Rows of one
//! conversation are handled strictly in journal order: a command acts after
//! the inputs before it were admitted and before the ones after it.
//!
//! It holds no state that matters: after a crash the same rows are still
//! pending and are submitted again under the same keys, and the runtime
//! answers with the same runs (DESIGN.md promise 2). Every row ends with a
//! recorded disposition, and every refusal is told to its sender.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use switchboard_channel::{AttachmentRef, Content};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::access::{Access, Decision};
use crate::clock::SharedClock;
use crate::commands::{self, Command};
use crate::config::Config;
use crate::keys;
use crate::lanes::Lanes;
use crate::observe::SharedObserver;
use crate::runtime::{Input, Runtime, Stop, Submission, SubmitError};
use crate::schedule;
use crate::store::{
    Admitted, Disposition, InboundRow, ItemKind, NewOutboxItem, SharedStore, StoreError,
};

/// How often the submitter looks at the journal when nothing woke it.
const IDLE_POLL: Duration = Duration::from_secs(1);

/// The same on a shared store, where rows journaled by other processes
/// wake nobody here.
const SHARED_IDLE_POLL: Duration = Duration::from_millis(250);

pub struct Submitter {
    pub store: SharedStore,
    /// Runtimes by configured name.
    pub runtimes: HashMap<String, Arc<dyn Runtime>>,
    /// Channel accounts by store identity: (configured name, runtime name).
    pub accounts: HashMap<String, (String, String)>,
    pub config: Arc<Config>,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    pub wake: Arc<Notify>,
    /// Wakes the dispatcher when a notice was written.
    pub outbox_wake: Arc<Notify>,
    /// Wakes the scheduler when a schedule was created.
    pub scheduler_wake: Arc<Notify>,
    /// The platform of each channel account whose access is checked, by
    /// store identity. The rules themselves are read from the live config
    /// for every row, so a reload (SIGHUP) changes them at once.
    pub access: HashMap<String, switchboard_channel::Platform>,
    /// Lane ownership among processes sharing the store: rows of a
    /// conversation are only submitted by the process holding its lane.
    pub lanes: Arc<Lanes>,
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

/// What became of one row in a round.
enum Step {
    /// A submission for its runtime.
    Submit(Box<Submission>),
    /// A command the core handles, with its arguments.
    Command(Command, String),
    /// Settled without a run.
    Settle(Disposition, String),
}

/// Rows waiting for an unreachable runtime: since when, and whether the
/// sender was told.
#[derive(Default)]
struct Waiting {
    since: HashMap<i64, i64>,
    told: HashSet<i64>,
}

impl Submitter {
    /// Submit until `stop` is cancelled.
    pub async fn run(self, stop: CancellationToken) {
        let retry = Duration::from_secs(self.config.submitter.retry_secs);
        let mut waiting = Waiting::default();
        loop {
            self.observer.beat("submitter");
            let round = match self.round(&mut waiting).await {
                Ok(round) => round,
                Err(e) => {
                    tracing::warn!(error = %e, "submitter could not read or write the journal; retrying");
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
            } else if self.lanes.shared() {
                SHARED_IDLE_POLL
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
    async fn round(&self, waiting: &mut Waiting) -> Result<Round, StoreError> {
        let limit = self.config.submitter.batch_size;
        let rows = if self.lanes.shared() {
            let now = self.clock.now_ms();
            self.store
                .journal_pending_for(self.lanes.owner(), now, limit)
                .await?
        } else {
            self.store.journal_pending(limit).await?
        };
        let mut round = Round {
            read: rows.len(),
            ..Round::default()
        };
        let now = self.clock.now_ms();
        // Conversations whose earlier row could not be handled this round:
        // their later rows wait, so journal order holds.
        let mut blocked: HashSet<i64> = HashSet::new();
        // Consecutive submissions to one runtime go out as one batch.
        let mut batch: Vec<(InboundRow, Submission)> = Vec::new();
        let mut batch_runtime: Option<String> = None;
        for row in rows {
            if blocked.contains(&row.conversation_id) {
                round.deferred += 1;
                continue;
            }
            if !self.lanes.hold(row.conversation_id).await? {
                // Another process serves this conversation now; it reads
                // the row from the shared journal.
                blocked.insert(row.conversation_id);
                continue;
            }
            let Some((_, runtime_name)) = self.accounts.get(&row.account) else {
                // The account was removed from the config while rows of it
                // were pending: keep them for when it comes back.
                blocked.insert(row.conversation_id);
                round.deferred += 1;
                continue;
            };
            let runtime_name = runtime_name.clone();
            // Who may talk to the bot is decided once, here, for every
            // channel; refusals are journaled with their reason.
            let access = self.access.get(&row.account).and_then(|platform| {
                let (name, _) = self.accounts.get(&row.account)?;
                let rules = self.config.access_for(name)?;
                Some(Access::resolve(&rules, *platform))
            });
            if let Some(access) = access {
                match access
                    .check(&self.store, &self.config.messages, &row, now)
                    .await?
                {
                    Decision::Allow => {}
                    Decision::Ignore(reason) => {
                        self.settle(&row, Disposition::Ignored, &reason, None, now)
                            .await?;
                        round.settled += 1;
                        continue;
                    }
                    Decision::Refuse { reason, reply } => {
                        let notice = reply.map(|text| self.notice(&row, "access", &text, now));
                        self.settle(&row, Disposition::Refused, &reason, notice.as_ref(), now)
                            .await?;
                        round.settled += 1;
                        continue;
                    }
                }
            }
            match self.step(&row) {
                Step::Submit(submission) => {
                    if batch_runtime.as_deref().is_some_and(|r| r != runtime_name) {
                        self.flush(
                            &mut batch,
                            &batch_runtime,
                            &mut blocked,
                            &mut round,
                            waiting,
                            now,
                        )
                        .await?;
                    }
                    batch_runtime = Some(runtime_name);
                    batch.push((row, *submission));
                }
                Step::Command(command, args) => {
                    // Everything before the command is admitted first.
                    self.flush(
                        &mut batch,
                        &batch_runtime,
                        &mut blocked,
                        &mut round,
                        waiting,
                        now,
                    )
                    .await?;
                    if blocked.contains(&row.conversation_id) {
                        round.deferred += 1;
                        continue;
                    }
                    if self
                        .command(&row, command, &args, &runtime_name, now)
                        .await?
                    {
                        round.settled += 1;
                    } else {
                        blocked.insert(row.conversation_id);
                        round.deferred += 1;
                    }
                }
                Step::Settle(disposition, reason) => {
                    // A rejected message is answered with a notice; an
                    // ignored update kind expects no answer.
                    let notice = (disposition == Disposition::Rejected).then(|| {
                        self.notice(&row, "rejected", &self.config.messages.run_failed, now)
                    });
                    self.settle(&row, disposition, &reason, notice.as_ref(), now)
                        .await?;
                    round.settled += 1;
                }
            }
        }
        self.flush(
            &mut batch,
            &batch_runtime,
            &mut blocked,
            &mut round,
            waiting,
            now,
        )
        .await?;
        Ok(round)
    }

    /// What to do with one row.
    fn step(&self, row: &InboundRow) -> Step {
        let Some(payload) = row.payload.as_deref() else {
            return Step::Settle(
                Disposition::Rejected,
                "the payload was pruned before the update was submitted".into(),
            );
        };
        let content: Content = match serde_json::from_str(payload) {
            Ok(c) => c,
            Err(e) => {
                return Step::Settle(
                    Disposition::Rejected,
                    format!("the stored payload cannot be read: {e}"),
                );
            }
        };
        let (text, attachments): (String, Vec<AttachmentRef>) = match content {
            Content::Message { text, attachments } => (text, attachments),
            Content::Unsupported { kind, .. } => {
                return Step::Settle(
                    Disposition::Ignored,
                    format!("update kind {kind:?} cannot be submitted"),
                );
            }
            Content::ChatMigrated { to_chat_id } => {
                return Step::Settle(
                    Disposition::Ignored,
                    format!("the chat migrated to {to_chat_id}"),
                );
            }
        };
        if let Some((command, args)) = commands::parse(&text) {
            return Step::Command(command, args.to_owned());
        }
        let account_name = self
            .accounts
            .get(&row.account)
            .map(|(name, _)| name.as_str())
            .unwrap_or_default();
        let surface = self
            .config
            .surface_for(account_name, row.surface, &row.chat_id);
        Step::Submit(Box::new(Submission {
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
            policy: surface.policy_for(row.input_policy),
            coalesce_pending: surface.coalesce_pending,
            max_queued_inputs: surface.max_queued_inputs,
            soft_interrupt: surface.soft_interrupt,
        }))
    }

    /// Submit the gathered batch to its runtime and record the outcomes.
    async fn flush(
        &self,
        batch: &mut Vec<(InboundRow, Submission)>,
        runtime_name: &Option<String>,
        blocked: &mut HashSet<i64>,
        round: &mut Round,
        waiting: &mut Waiting,
        now: i64,
    ) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let (rows, submissions): (Vec<InboundRow>, Vec<Submission>) =
            std::mem::take(batch).into_iter().unzip();
        let name = runtime_name.clone().unwrap_or_default();
        let Some(runtime) = self.runtimes.get(&name) else {
            round.deferred += rows.len();
            blocked.extend(rows.iter().map(|r| r.conversation_id));
            return Ok(());
        };
        let started = std::time::Instant::now();
        let results = runtime.submit(submissions).await;
        self.observer
            .submission_latency(runtime.name(), started.elapsed());
        let mut admitted = Vec::new();
        for (row, result) in rows.iter().zip(results) {
            if blocked.contains(&row.conversation_id) {
                round.deferred += 1;
                continue;
            }
            match result {
                Ok(admission) => {
                    waiting.since.remove(&row.id);
                    waiting.told.remove(&row.id);
                    self.observer
                        .admitted(&name, row.id, &admission.run_id, admission.new);
                    admitted.push(Admitted {
                        inbound_id: row.id,
                        run_id: admission.run_id,
                    });
                }
                Err(SubmitError::Unavailable(why)) => {
                    tracing::warn!(inbound_id = row.id, runtime = %name, %why, "runtime unavailable; will resubmit");
                    self.observer.submission_failed(&name, "unavailable");
                    blocked.insert(row.conversation_id);
                    round.deferred += 1;
                    self.tell_if_waiting_long(row, waiting, now).await?;
                }
                Err(SubmitError::Refused(why)) => {
                    self.observer.submission_failed(&name, "refused");
                    let notice = self.notice(row, "refused", &self.config.messages.queue_full, now);
                    self.settle(row, Disposition::Refused, &why, Some(&notice), now)
                        .await?;
                    round.settled += 1;
                }
                Err(SubmitError::Rejected(why)) => {
                    self.observer.submission_failed(&name, "rejected");
                    let notice =
                        self.notice(row, "rejected", &self.config.messages.run_failed, now);
                    self.settle(row, Disposition::Rejected, &why, Some(&notice), now)
                        .await?;
                    round.settled += 1;
                }
            }
        }
        round.admitted += admitted.len();
        self.store.journal_admit(&admitted, now).await
    }

    /// Handle a command row. Returns `false` when it must wait (its
    /// runtime is unavailable).
    async fn command(
        &self,
        row: &InboundRow,
        command: Command,
        args: &str,
        runtime_name: &str,
        now: i64,
    ) -> Result<bool, StoreError> {
        let messages = &self.config.messages;
        let stop_with = |text: &str| Stop {
            conversation_id: row.conversation_id,
            reason: command.name().to_owned(),
            notice: Some(self.notice(row, command.name().trim_start_matches('/'), text, now)),
        };
        let reply =
            |text: String| self.notice(row, command.name().trim_start_matches('/'), &text, now);
        match command {
            Command::Help => {
                let notice = self.notice(row, "help", &messages.help, now);
                self.settle(
                    row,
                    Disposition::Command,
                    command.name(),
                    Some(&notice),
                    now,
                )
                .await?;
            }
            Command::Remind => {
                let text =
                    schedule::chat::remind(&self.store, &self.config, now, row, args).await?;
                self.settle(
                    row,
                    Disposition::Command,
                    command.name(),
                    Some(&reply(text)),
                    now,
                )
                .await?;
                self.scheduler_wake.notify_one();
            }
            Command::Schedules => {
                let text = schedule::chat::list(&self.store, row).await?;
                self.settle(
                    row,
                    Disposition::Command,
                    command.name(),
                    Some(&reply(text)),
                    now,
                )
                .await?;
            }
            Command::Cancel => {
                let text = schedule::chat::cancel(&self.store, now, row, args).await?;
                self.settle(
                    row,
                    Disposition::Command,
                    command.name(),
                    Some(&reply(text)),
                    now,
                )
                .await?;
            }
            Command::Timezone => {
                let text = schedule::chat::timezone(&self.store, now, row, args).await?;
                self.settle(
                    row,
                    Disposition::Command,
                    command.name(),
                    Some(&reply(text)),
                    now,
                )
                .await?;
            }
            Command::Stop | Command::New => {
                let Some(runtime) = self.runtimes.get(runtime_name) else {
                    return Ok(false);
                };
                // `/new` closed the conversation at ingress; what was still
                // running or waiting in it is stopped, so nothing from the
                // old conversation arrives after the confirmation.
                let text = if command == Command::Stop {
                    &messages.stopped
                } else {
                    &messages.new_conversation
                };
                match runtime.stop(stop_with(text)).await {
                    Ok(report) => {
                        tracing::info!(conversation = row.conversation_id, command = command.name(), interrupted = ?report.interrupted, cancelled = report.cancelled, "command handled");
                        self.settle(row, Disposition::Command, command.name(), None, now)
                            .await?;
                    }
                    Err(e) => {
                        tracing::warn!(inbound_id = row.id, error = %e, "could not stop; will retry");
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    /// Tell the sender once when their message has waited longer than
    /// `submitter.unreachable_notice_secs` for an unreachable runtime. The
    /// row stays pending and is answered when the runtime is back.
    async fn tell_if_waiting_long(
        &self,
        row: &InboundRow,
        waiting: &mut Waiting,
        now: i64,
    ) -> Result<(), StoreError> {
        let since = *waiting.since.entry(row.id).or_insert(now);
        let limit = (self.config.submitter.unreachable_notice_secs * 1000) as i64;
        if now - since >= limit && waiting.told.insert(row.id) {
            let notice = self.notice(
                row,
                "unreachable",
                &self.config.messages.runtime_unreachable,
                now,
            );
            self.store.outbox_enqueue(&[notice]).await?;
            self.outbox_wake.notify_one();
        }
        Ok(())
    }

    /// A notice to the sender of a row, in its conversation's lane; its key
    /// is one per row and purpose, so a retry never sends it twice.
    fn notice(&self, row: &InboundRow, what: &str, text: &str, now: i64) -> NewOutboxItem {
        NewOutboxItem {
            item_key: keys::notice_item_key(row.id, what),
            conversation_id: row.conversation_id,
            account: row.account.clone(),
            chat_id: row.chat_id.clone(),
            thread_id: row.thread_id.clone(),
            surface: row.surface,
            reply_to: row.message_id.clone(),
            run_id: None,
            kind: ItemKind::Notice,
            text: text.to_owned(),
            group_key: None,
            edits_key: None,
            attachments: Vec::new(),
            created_at: now,
        }
    }

    async fn settle(
        &self,
        row: &InboundRow,
        disposition: Disposition,
        reason: &str,
        notice: Option<&NewOutboxItem>,
        now: i64,
    ) -> Result<(), StoreError> {
        if self
            .store
            .journal_settle(row.id, disposition, reason, notice, now)
            .await?
        {
            tracing::info!(inbound_id = row.id, disposition = %disposition, reason, "update settled without a run");
            self.observer.settled(row.id, disposition.as_str(), reason);
            if notice.is_some() {
                self.outbox_wake.notify_one();
            }
        }
        Ok(())
    }
}
