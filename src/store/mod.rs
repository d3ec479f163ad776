//! All durable state, behind interfaces split by module (journal, runs,
//! outbox). One backend-neutral contract, implemented for SQLite (the
//! embedded default) and shaped so a PostgreSQL implementation can follow
//! without changing callers; `tests/store_conformance.rs` is the suite every
//! backend must pass.
//!
//! Conventions every implementation keeps:
//! - times are milliseconds since the Unix epoch, passed in by the caller
//!   (so tests control the clock);
//! - every hot-path read goes through an index and reads a bounded number of
//!   rows (DESIGN.md promise 10);
//! - batch methods write all their items in one transaction (group commit)
//!   and report one outcome per item, in input order;
//! - every outbox state write after a claim is fenced by the item's fencing
//!   token: a write with a stale token changes nothing and reports `false`.

pub mod batch;
pub mod copy;
pub mod postgres;
mod rows;
pub mod sqlite;
mod types;

use std::sync::Arc;

use async_trait::async_trait;

use crate::config::{StoreConfig, StoreLocation};
use crate::surface::SurfaceKind;
pub use types::*;

/// A store failure. Callers treat every variant as "nothing was written".
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Database(#[from] sqlx::Error),
    #[error("store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("store: {0}")]
    Other(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// The inbound journal and the conversation map.
#[async_trait]
pub trait JournalStore: Send + Sync {
    /// Journal a batch of updates in one transaction. A key already present
    /// (also earlier in the same batch) is a duplicate and changes nothing.
    /// The conversation is resolved (or created) in the same transaction.
    async fn journal_insert(&self, batch: &[NewInbound]) -> StoreResult<Vec<JournalOutcome>>;

    /// Rows not yet handed to a runtime, oldest first.
    async fn journal_pending(&self, limit: usize) -> StoreResult<Vec<InboundRow>>;

    /// [`journal_pending`](Self::journal_pending) for one of several
    /// processes on a shared store: rows of conversations whose lane lease
    /// ([`crate::keys::lane_lease`]) another owner holds unexpired at `now`
    /// are left out, so a busy conversation owned elsewhere does not fill
    /// this process's window.
    async fn journal_pending_for(
        &self,
        owner: &str,
        now: i64,
        limit: usize,
    ) -> StoreResult<Vec<InboundRow>>;

    /// Record admissions (run ids) in one transaction. Only rows still
    /// `pending` change.
    async fn journal_admit(&self, admissions: &[Admitted], now: i64) -> StoreResult<()>;

    /// Record a final disposition other than admission (ignored, rejected,
    /// refused, command, ...), with its reason, and the notice that tells the
    /// sender, in one transaction. Only rows still `pending` change; the
    /// notice is written only when the row changed.
    async fn journal_settle(
        &self,
        inbound_id: i64,
        disposition: Disposition,
        reason: &str,
        notice: Option<&NewOutboxItem>,
        now: i64,
    ) -> StoreResult<bool>;

    async fn journal_get(&self, inbound_id: i64) -> StoreResult<Option<InboundRow>>;

    /// Newest first, at most `limit`, optionally one disposition only.
    async fn journal_list(
        &self,
        disposition: Option<Disposition>,
        limit: usize,
    ) -> StoreResult<Vec<InboundRow>>;

    /// Counts per disposition (for `inbound list` summaries and metrics).
    async fn journal_counts(&self) -> StoreResult<Vec<(Disposition, i64)>>;

    /// The account's open conversations whose latest update arrived at or
    /// after `since`, newest first, at most `limit`, with that update's
    /// platform message id (gap backfill after a reconnect).
    async fn journal_recent_chats(
        &self,
        account: &str,
        since: i64,
        limit: usize,
    ) -> StoreResult<Vec<RecentChat>>;
}

/// Durable runs of the built-in runtime.
#[async_trait]
pub trait RunStore: Send + Sync {
    /// Admit a batch of inputs in one transaction. An idempotency key
    /// already present returns its run (`new == false`) and changes
    /// nothing.
    async fn runs_admit(&self, batch: &[Admit]) -> StoreResult<Vec<AdmitOutcome>>;

    /// Mark queued runs running. Runs in any other state are left alone.
    async fn runs_start(&self, run_ids: &[i64], now: i64) -> StoreResult<()>;

    /// Write terminal records, their reply items and terminal events, each
    /// completion atomically (one transaction for the batch). A run that is
    /// already terminal changes nothing and reports `false`. Absorbed runs
    /// and the journal rows of their inputs are settled in the same
    /// transaction.
    async fn runs_finish(&self, batch: &[RunFinish]) -> StoreResult<Vec<bool>>;

    /// Cancel a conversation's queued runs (their journal rows become
    /// `cancelled`) and mark its running run `interrupt_requested`, in one
    /// transaction; the notice is written now when nothing was running.
    async fn runs_stop(&self, request: &StopRequest) -> StoreResult<StopOutcome>;

    /// Runs not yet terminal with an id above `after_id`, in id order (a
    /// page of the recovery scan).
    async fn runs_unfinished(&self, after_id: i64, limit: usize) -> StoreResult<Vec<RunRow>>;

    /// One conversation's runs not yet terminal, in id order (a process
    /// taking over the conversation's lane from one that died).
    async fn runs_unfinished_in(&self, conversation_id: i64) -> StoreResult<Vec<RunRow>>;

    /// The inputs a run owns, in admission order.
    async fn run_inputs(&self, run_id: i64) -> StoreResult<Vec<InputRow>>;

    /// The conversation's most recent turns that reach prompts (completed
    /// and interrupted runs), the last to finish first. (Runs of one
    /// conversation run one at a time, so these all finished before the run
    /// that asks.)
    async fn runs_history(&self, conversation_id: i64, limit: usize) -> StoreResult<Vec<RunRow>>;

    async fn run_get(&self, run_id: i64) -> StoreResult<Option<RunRow>>;

    /// Durably end one run: a queued run is `cancelled` (with its terminal
    /// event), a running one becomes `interrupt_requested` ending as
    /// `end_as`. Returns the run's state afterwards (`None`: no such run);
    /// a terminal run is left as it is.
    async fn runs_interrupt(
        &self,
        run_id: i64,
        end_as: RunState,
        reason: &str,
        now: i64,
    ) -> StoreResult<Option<RunState>>;

    /// Terminal events with an id above `after`, in id order (the event
    /// stream of `switchboard runtime serve`).
    async fn run_events_after(&self, after: i64, limit: usize) -> StoreResult<Vec<RunEventRow>>;

    /// The id of a run's terminal event, once it has one.
    async fn run_terminal_event(&self, run_id: i64) -> StoreResult<Option<i64>>;

    /// The open conversation keyed `(account, key)`, created when missing
    /// (conversations of a client of `switchboard runtime serve`).
    async fn conversation_for_key(
        &self,
        account: &str,
        key: &str,
        surface: SurfaceKind,
        now: i64,
    ) -> StoreResult<i64>;

    /// The key of a conversation made by [`RunStore::conversation_for_key`].
    async fn conversation_key(&self, conversation_id: i64) -> StoreResult<Option<String>>;

    /// Newest first, at most `limit`, optionally one conversation and/or
    /// one state (an operator's view; not a hot path).
    async fn runs_list(
        &self,
        conversation_id: Option<i64>,
        state: Option<RunState>,
        limit: usize,
    ) -> StoreResult<Vec<RunRow>>;
}

/// The outbox: reply items and their dispatch states (DESIGN.md §4).
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Add items (each gets the next ordinal of its conversation). An item
    /// key already present changes nothing.
    async fn outbox_enqueue(&self, items: &[NewOutboxItem]) -> StoreResult<Vec<bool>>;

    /// Claim due lane heads: each becomes `possibly_dispatched` with a new
    /// fencing token and a lease, in one transaction. At most one item per
    /// conversation is ever claimable at a time.
    async fn outbox_claim(&self, claim: &Claim) -> StoreResult<Vec<OutboxItem>>;

    /// Apply dispatch outcomes, fenced, in one transaction. One `bool` per
    /// settlement: `false` when its fencing token was stale.
    async fn outbox_settle(&self, batch: &[Settlement]) -> StoreResult<Vec<bool>>;

    /// `possibly_dispatched` items whose lease ran out before `now`.
    async fn outbox_expired(&self, now: i64, limit: usize) -> StoreResult<Vec<OutboxItem>>;

    /// Resolve an expired possibly-dispatched item, fenced.
    async fn outbox_reconcile(&self, batch: &[Reconcile]) -> StoreResult<Vec<bool>>;

    /// End every lease now (start-up of a single-process store, whose
    /// previous owner is known to be dead). Returns how many were ended.
    async fn outbox_expire_all_leases(&self, now: i64) -> StoreResult<u64>;

    async fn outbox_get(&self, id: i64) -> StoreResult<Option<OutboxItem>>;

    async fn outbox_get_by_key(&self, item_key: &str) -> StoreResult<Option<OutboxItem>>;

    /// Add a streaming preview unless an item that replaces it (its answer,
    /// a failure notice, a discard marker: any item whose `edits_key` is the
    /// preview's key) already exists: a preview must never come after its
    /// answer.
    async fn outbox_enqueue_preview(&self, item: &NewOutboxItem) -> StoreResult<bool>;

    /// Whether an item that replaces `edits_key` (a preview) exists.
    async fn outbox_replaced(&self, edits_key: &str) -> StoreResult<bool>;

    /// An operator settles a `held` item. `false` when it is not held.
    async fn outbox_resolve(&self, id: i64, resolution: Resolution, now: i64) -> StoreResult<bool>;

    /// Items waiting or unconfirmed, and the age of the oldest unsent one,
    /// read through indexes (for `/metrics`).
    async fn outbox_stats(&self) -> StoreResult<OutboxStats>;

    /// Newest first, at most `limit`, optionally one state and/or one
    /// conversation.
    async fn outbox_list(&self, filter: &OutboxFilter) -> StoreResult<Vec<OutboxItem>>;

    /// Counts of items per dispatch state.
    async fn outbox_counts(&self) -> StoreResult<Vec<(DispatchState, i64)>>;
}

/// Durable schedules, their occurrences, and chat settings.
#[async_trait]
pub trait ScheduleStore: Send + Sync {
    async fn schedule_create(&self, schedule: &NewSchedule) -> StoreResult<i64>;

    async fn schedule_get(&self, id: i64) -> StoreResult<Option<ScheduleRow>>;

    /// Newest first.
    async fn schedule_list(&self, filter: &ScheduleFilter) -> StoreResult<Vec<ScheduleRow>>;

    /// Move a schedule from one of `from` to `to` (pause, resume, cancel).
    /// `false` when it was in none of them.
    async fn schedule_transition(
        &self,
        id: i64,
        from: &[ScheduleState],
        to: ScheduleState,
        now: i64,
    ) -> StoreResult<bool>;

    /// Active schedules whose next slot is due by `now`, oldest due first.
    async fn schedules_due(&self, now: i64, limit: usize) -> StoreResult<Vec<ScheduleRow>>;

    /// Record slots and advance each schedule, in one transaction; a plan
    /// whose schedule was advanced (or paused) meanwhile changes nothing and
    /// reports `false`. A slot recorded before is not recorded twice.
    async fn schedules_materialize(&self, plans: &[Materialize]) -> StoreResult<Vec<bool>>;

    /// Claim due pending occurrences with a lease and a new fencing token.
    async fn occurrences_claim(
        &self,
        owner: &str,
        now: i64,
        lease_until: i64,
        limit: usize,
    ) -> StoreResult<Vec<(OccurrenceRow, ScheduleRow)>>;

    /// Record how firing went, fenced; a one-off schedule ends with its
    /// occurrence (completed or failed). A fired message's outbox item is
    /// written in the same transaction.
    async fn occurrence_settle(
        &self,
        id: i64,
        token: i64,
        fire: &Fire,
        now: i64,
    ) -> StoreResult<bool>;

    /// Claimed occurrences whose lease ran out go back to pending under a
    /// new token (their worker died). Returns how many.
    async fn occurrences_release_expired(&self, now: i64) -> StoreResult<u64>;

    /// End every occurrence lease now (start of a single-process store).
    async fn occurrences_expire_all_leases(&self, now: i64) -> StoreResult<u64>;

    /// A schedule's occurrences, newest slot first.
    async fn occurrences_list(
        &self,
        schedule_id: i64,
        limit: usize,
    ) -> StoreResult<Vec<OccurrenceRow>>;

    async fn chat_timezone(&self, account: &str, chat_id: &str) -> StoreResult<Option<String>>;

    async fn set_chat_timezone(
        &self,
        account: &str,
        chat_id: &str,
        zone: &str,
        now: i64,
    ) -> StoreResult<()>;

    /// The current conversation of a chat, created when there is none.
    async fn conversation_current(&self, target: &Target, now: i64) -> StoreResult<i64>;

    /// Record a channel account's store identity under its configured name.
    async fn channel_account_register(
        &self,
        name: &str,
        identity: &str,
        platform: &str,
        now: i64,
    ) -> StoreResult<()>;

    /// A registered account's store identity and platform, by name.
    async fn channel_account(&self, name: &str) -> StoreResult<Option<(String, String)>>;
}

/// Pairing of unknown direct-message users with operators.
#[async_trait]
pub trait AccessStore: Send + Sync {
    async fn pairing_get(&self, account: &str, user_id: &str) -> StoreResult<Option<PairingRow>>;

    /// A code for an unknown user: the pending one while it has not expired,
    /// else a new one (`code` is used only then).
    async fn pairing_issue(
        &self,
        account: &str,
        user_id: &str,
        user_name: Option<&str>,
        code: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<PairingRow>;

    /// Approve a pending, unexpired code. `None` when there is none.
    async fn pairing_approve(&self, code: &str, now: i64) -> StoreResult<Option<PairingRow>>;

    /// Approve a user directly (an operator who knows the id).
    async fn pairing_admit(&self, account: &str, user_id: &str, now: i64) -> StoreResult<()>;

    /// Revoke a user's pairing. `false` when there was none.
    async fn pairing_revoke(&self, account: &str, user_id: &str, now: i64) -> StoreResult<bool>;

    /// The chats that became `chat_id` (directly or through a chain of
    /// migrations), oldest last.
    async fn chat_origins(&self, account: &str, chat_id: &str) -> StoreResult<Vec<String>>;

    /// Newest first, optionally one account's.
    async fn pairing_list(
        &self,
        account: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<PairingRow>>;
}

/// Remote runtimes: the runs Switchboard waits for and the event cursor.
#[async_trait]
pub trait RemoteStore: Send + Sync {
    /// Record admitted runs as awaited (a run already known is left alone:
    /// coalesced inputs share a run).
    async fn remote_await(&self, runs: &[RemoteRun]) -> StoreResult<()>;

    /// Runs of `runtime` still awaited, oldest first by `(created_at,
    /// run_id)`, after the run `after` names (paging).
    async fn remote_awaited(
        &self,
        runtime: &str,
        after: Option<(i64, String)>,
        limit: usize,
    ) -> StoreResult<Vec<RemoteRun>>;

    async fn remote_get(&self, runtime: &str, run_id: &str) -> StoreResult<Option<RemoteRun>>;

    /// The awaited runs of one conversation (few: its backlog).
    async fn remote_awaited_of(
        &self,
        runtime: &str,
        conversation_id: i64,
    ) -> StoreResult<Vec<RemoteRun>>;

    /// The last durable event id processed (0 before the first).
    async fn remote_cursor(&self, runtime: &str) -> StoreResult<i64>;

    /// A run's `run.finished`: mark it finished, write its reply items (and
    /// its `/stop` confirmation after them) and advance the cursor to
    /// `event_id`, in one transaction. `false` when the run was not awaited
    /// (a repeated event): nothing is written but the cursor.
    async fn remote_finish(
        &self,
        runtime: &str,
        run_id: &str,
        event_id: i64,
        replies: &[NewOutboxItem],
        now: i64,
    ) -> StoreResult<bool>;

    /// Advance the cursor past an event that needs nothing (never moves it
    /// back).
    async fn remote_advance(&self, runtime: &str, event_id: i64) -> StoreResult<()>;

    /// `/stop` on a remote conversation: the confirmation waits for the
    /// interrupted run's last words when one was interrupted (and is still
    /// awaited), and is written now otherwise.
    async fn remote_stop_notice(
        &self,
        runtime: &str,
        interrupted: Option<&str>,
        notice: &NewOutboxItem,
    ) -> StoreResult<()>;
}

/// Single-active roles shared between processes (a Telegram bot's poller,
/// one conversation's lane in the built-in runtime). A lease has one owner
/// until it expires; the owner renews it by acquiring again. Each change of
/// owner raises the token, so a holder can tell it was taken over.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// Take or renew `name` for `owner` until `now + ttl_ms`. Returns the
    /// lease's token when `owner` holds it afterwards, `None` when another
    /// owner holds an unexpired lease.
    async fn lease_acquire(
        &self,
        name: &str,
        owner: &str,
        ttl_ms: i64,
        now: i64,
    ) -> StoreResult<Option<i64>>;

    /// Give up `name` if `owner` holds it (a no-op otherwise).
    async fn lease_release(&self, name: &str, owner: &str) -> StoreResult<()>;
}

/// Retention: pruning old personal data in bounded batches, and purging
/// one conversation on request.
#[async_trait]
pub trait RetentionStore: Send + Sync {
    /// One bounded pass over each kind of old data.
    async fn prune(&self, rules: &PruneRules) -> StoreResult<PruneReport>;

    /// Remove one conversation's messages, runs and replies in one
    /// transaction, keeping its journal keys as tombstones (so a late
    /// redelivery is still a duplicate). Refuses while a run of it is
    /// active or one of its replies is being sent.
    async fn purge_conversation(&self, conversation_id: i64, now: i64)
    -> StoreResult<PurgeOutcome>;
}

/// Everything durable.
#[async_trait]
pub trait Store:
    JournalStore
    + RunStore
    + OutboxStore
    + ScheduleStore
    + AccessStore
    + RetentionStore
    + RemoteStore
    + LeaseStore
{
    /// A short description for logs (`sqlite:data/switchboard.db`).
    fn describe(&self) -> String;

    /// Whether one process owns the whole store (SQLite), so that leases
    /// found at start-up are known to be orphaned.
    fn single_process(&self) -> bool;

    /// A round trip to the store (readiness).
    async fn ping(&self) -> StoreResult<()>;

    /// Flush and close. Calls after this fail.
    async fn close(&self);
}

pub type SharedStore = Arc<dyn Store>;

/// Open the store a config names, apply migrations, and return it.
pub async fn open(config: &StoreConfig, mode: sqlite::OpenMode) -> StoreResult<SharedStore> {
    match config.location().map_err(StoreError::Other)? {
        StoreLocation::Sqlite(path) => {
            let store = sqlite::SqliteStore::open(&path, config.synchronous, mode).await?;
            Ok(Arc::new(store))
        }
        StoreLocation::Postgres(url) => {
            let store = postgres::PgStore::open(&url, mode).await?;
            Ok(Arc::new(store))
        }
    }
}
