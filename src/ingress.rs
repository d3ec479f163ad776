//! Ingress: envelopes from the adapters become journal rows.
//!
//! [`Ingress`] is the core's [`IngressSink`]. It resolves the account's store
//! identity and the surface, and writes the row through the journal's
//! group-commit writer; it returns only after the commit, which is what lets
//! an adapter acknowledge the update to its platform (DESIGN.md promise 1).
//! Deciding what to do with the row is the submitter's job, not this one's.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use switchboard_channel::{
    AcceptStatus, Accepted, AccountStatus, Content, Envelope, IngressError, IngressSink, Platform,
    RecentChat,
};
use tokio::sync::Notify;

use crate::clock::SharedClock;
use crate::commands::{self, Command};
use crate::keys;
use crate::observe::SharedObserver;
use crate::store::batch::{BatchError, Batcher};
use crate::store::{Disposition, JournalOutcome, NewInbound, SharedStore};
use crate::surface::SurfaceKind;

/// A channel account as ingress knows it.
#[derive(Debug, Clone)]
pub struct AccountInfo {
    /// The configured name (`[channels.NAME]`).
    pub name: String,
    /// The store identity (`webhook:NAME`, `telegram:<bot id>`).
    pub identity: String,
    pub platform: Platform,
}

/// The core's ingress sink.
pub struct Ingress {
    accounts: HashMap<String, AccountInfo>,
    store: SharedStore,
    journal: Batcher<NewInbound, JournalOutcome>,
    accepting: AtomicBool,
    clock: SharedClock,
    observer: SharedObserver,
    submitter_wake: Arc<Notify>,
    /// This process's name in leases, and how long a single-active role
    /// (a bot's Telegram poller) is held without renewal.
    owner: String,
    role_ttl: Duration,
}

/// How single-active roles are leased: this process's name in leases and
/// how long a role is held without renewal.
pub struct RoleLeases {
    pub owner: String,
    pub ttl: Duration,
}

impl Ingress {
    /// Start the journal's group-commit writer and return the sink with the
    /// writer's task.
    pub fn start(
        store: SharedStore,
        accounts: Vec<AccountInfo>,
        batch_size: usize,
        clock: SharedClock,
        observer: SharedObserver,
        submitter_wake: Arc<Notify>,
        roles: RoleLeases,
    ) -> (Arc<Ingress>, tokio::task::JoinHandle<()>) {
        let writer = store.clone();
        let (journal, task) =
            Batcher::spawn("journal", batch_size, move |batch: Vec<NewInbound>| {
                let store = writer.clone();
                async move { store.journal_insert(&batch).await }
            });
        let ingress = Arc::new(Ingress {
            accounts: accounts.into_iter().map(|a| (a.name.clone(), a)).collect(),
            store,
            journal,
            accepting: AtomicBool::new(true),
            clock,
            observer,
            submitter_wake,
            owner: roles.owner,
            role_ttl: roles.ttl,
        });
        (ingress, task)
    }

    /// From now on every update is refused as unavailable (shutdown's first
    /// step: the platform keeps the update and redelivers it later).
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::SeqCst);
    }

    fn to_row(
        &self,
        account: &AccountInfo,
        envelope: Envelope,
    ) -> Result<NewInbound, IngressError> {
        let (disposition, reason) = match &envelope.content {
            Content::Message { .. } => (Disposition::Pending, None),
            Content::Unsupported { kind, reason } => (
                Disposition::Ignored,
                Some(format!("unsupported update kind {kind:?}: {reason}")),
            ),
            Content::ChatMigrated { to_chat_id } => (
                Disposition::Ignored,
                Some(format!(
                    "chat {} migrated to {to_chat_id}; its conversations, unsent replies and schedules moved there",
                    envelope.chat_id
                )),
            ),
        };
        let migrates_to = match &envelope.content {
            Content::ChatMigrated { to_chat_id } => Some(to_chat_id.clone()),
            _ => None,
        };
        let payload = serde_json::to_string(&envelope.content)
            .map_err(|e| IngressError::Invalid(format!("content cannot be stored: {e}")))?;
        // `/new` closes the conversation in the journal's own transaction,
        // so the chat's next update, however soon, starts a new one.
        let closes_conversation = matches!(
            &envelope.content,
            Content::Message { text, .. } if matches!(commands::parse(text), Some((Command::New, _)))
        );
        let (sender_id, sender_name) = match envelope.sender {
            Some(s) => (Some(s.id), s.name),
            None => (None, None),
        };
        Ok(NewInbound {
            submission_key: keys::submission_key(&account.identity, &envelope.update_key),
            account: account.identity.clone(),
            update_key: envelope.update_key,
            chat_id: envelope.chat_id,
            chat_kind: envelope.chat_kind,
            thread_id: envelope.thread_id,
            space: envelope.space,
            surface: SurfaceKind::of(account.platform, envelope.chat_kind),
            sender_id,
            sender_name,
            message_id: envelope.message_id,
            payload,
            disposition,
            reason,
            input_policy: envelope.input_policy,
            closes_conversation,
            migrates_to,
            addressed: envelope.addressed,
            received_at: self.clock.now_ms(),
        })
    }
}

#[async_trait]
impl IngressSink for Ingress {
    async fn accept(&self, envelope: Envelope) -> Result<Accepted, IngressError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(IngressError::Unavailable(
                "switchboard is shutting down".into(),
            ));
        }
        let account = self
            .accounts
            .get(&envelope.account)
            .ok_or_else(|| IngressError::UnknownAccount(envelope.account.clone()))?;
        let row = self.to_row(account, envelope)?;
        let update_key = row.update_key.clone();
        let ignored = row
            .reason
            .clone()
            .filter(|_| row.disposition == Disposition::Ignored);
        let outcome = self
            .journal
            .call(row, "journal")
            .await
            .map_err(|e| match e {
                BatchError::Closed(_) => {
                    IngressError::Unavailable("switchboard is shutting down".into())
                }
                BatchError::Store(e) => IngressError::Store(e.to_string()),
            })?;
        Ok(match outcome {
            JournalOutcome::Accepted {
                inbound_id,
                conversation_id,
            } => {
                self.observer
                    .stored(&account.identity, &update_key, inbound_id, conversation_id);
                match ignored {
                    Some(reason) => {
                        tracing::info!(inbound_id, account = %account.name, %reason, "update ignored");
                        self.observer
                            .settled(inbound_id, Disposition::Ignored.as_str(), &reason);
                    }
                    None => self.submitter_wake.notify_one(),
                }
                Accepted {
                    status: AcceptStatus::Accepted,
                    inbound_id,
                    conversation_id,
                }
            }
            JournalOutcome::Duplicate {
                inbound_id,
                conversation_id,
            } => {
                self.observer
                    .deduplicated(&account.identity, &update_key, inbound_id);
                Accepted {
                    status: AcceptStatus::Duplicate,
                    inbound_id,
                    conversation_id,
                }
            }
        })
    }

    async fn recent_chats(
        &self,
        account: &str,
        within: Duration,
        limit: usize,
    ) -> Result<Vec<RecentChat>, IngressError> {
        let info = self
            .accounts
            .get(account)
            .ok_or_else(|| IngressError::UnknownAccount(account.to_owned()))?;
        let since = self.clock.now_ms() - within.as_millis() as i64;
        let chats = self
            .store
            .journal_recent_chats(&info.identity, since, limit)
            .await
            .map_err(|e| IngressError::Store(e.to_string()))?;
        Ok(chats
            .into_iter()
            .map(|c| RecentChat {
                chat_id: c.chat_id,
                thread_id: c.thread_id,
                last_message_id: c.last_message_id,
            })
            .collect())
    }

    async fn hold_role(&self, role: &str) -> Result<bool, IngressError> {
        if self.store.single_process() {
            return Ok(true);
        }
        self.store
            .lease_acquire(
                role,
                &self.owner,
                self.role_ttl.as_millis() as i64,
                self.clock.now_ms(),
            )
            .await
            .map(|token| token.is_some())
            .map_err(|e| IngressError::Store(e.to_string()))
    }

    fn role_renewal(&self) -> Duration {
        self.role_ttl / 3
    }

    async fn release_role(&self, role: &str) {
        if self.store.single_process() {
            return;
        }
        if let Err(e) = self.store.lease_release(role, &self.owner).await {
            tracing::warn!(role, error = %e, "could not release a role; its lease runs out by itself");
        }
    }

    fn report_status(&self, account: &str, status: AccountStatus) {
        if !self.accounts.contains_key(account) {
            return;
        }
        match &status {
            AccountStatus::Down(reason) => {
                tracing::error!(account, %reason, "channel account is down")
            }
            AccountStatus::Up(detail) => tracing::info!(account, %detail, "channel account is up"),
            AccountStatus::Starting => {}
        }
        self.observer.channel_status(account, &status);
    }

    fn record_rejection(&self, account: &str, code: &str, detail: &str) {
        tracing::warn!(account, code, detail, "request refused");
        // The account name comes from the request path: only configured
        // names become metric labels, so junk requests cannot grow memory.
        let label = if self.accounts.contains_key(account) {
            account
        } else {
            "(unknown)"
        };
        self.observer.rejected(label, code);
    }
}
