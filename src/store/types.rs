//! The rows and the closed enums the store speaks. Strings appear only in
//! the SQL row mapping (`as_str` / `parse`).

use serde::Serialize;
use switchboard_channel::{AttachmentRef, ChatKind, InputPolicy};

use crate::surface::SurfaceKind;

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
        #[serde(into = "&'static str")]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(s: &str) -> Option<$name> {
                match s { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl From<$name> for &'static str {
            fn from(v: $name) -> &'static str { v.as_str() }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum! {
    /// What became of a journaled update (DESIGN.md promise 3). `Pending` is
    /// the only non-final one.
    Disposition {
        Pending => "pending",
        Admitted => "admitted",
        Ignored => "ignored",
        Rejected => "rejected",
        Refused => "refused",
        Failed => "failed",
        Cancelled => "cancelled",
        Absorbed => "absorbed",
        /// A chat command handled by the core (`/stop`, `/new`, `/help`).
        Command => "command",
    }
}

string_enum! {
    /// How a run takes part in its conversation's lane.
    RunMode {
        /// Runs in turn; may take coalesced inputs while queued.
        Ordinary => "ordinary",
        /// Offered to the running run at its next step boundary; runs on
        /// its own only if that run does not complete.
        Inject => "inject",
        /// `interrupt-next`: runs before ordinary queued work.
        Urgent => "urgent",
    }
}

string_enum! {
    /// A run's state in the built-in runtime.
    RunState {
        Queued => "queued",
        Running => "running",
        InterruptRequested => "interrupt_requested",
        Completed => "completed",
        Interrupted => "interrupted",
        Superseded => "superseded",
        Absorbed => "absorbed",
        Cancelled => "cancelled",
        Failed => "failed",
    }
}

impl RunState {
    pub fn is_terminal(self) -> bool {
        !matches!(
            self,
            RunState::Queued | RunState::Running | RunState::InterruptRequested
        )
    }
}

string_enum! {
    /// An outbox item's dispatch state (DESIGN.md §4).
    DispatchState {
        NotDispatched => "not_dispatched",
        PossiblyDispatched => "possibly_dispatched",
        Acknowledged => "acknowledged",
        Failed => "failed",
        Held => "held",
        Dropped => "dropped",
    }
}

impl DispatchState {
    /// Whether an item in this state blocks later items of its lane.
    pub fn blocks_lane(self) -> bool {
        matches!(
            self,
            DispatchState::NotDispatched | DispatchState::PossiblyDispatched
        )
    }
}

string_enum! {
    /// What an outbox item is.
    ItemKind {
        /// (A chunk of) a run's final answer. The first chunk edits the
        /// run's preview when one was shown.
        Answer => "answer",
        /// A short message from Switchboard itself (failure notice,
        /// confirmation).
        Notice => "notice",
        /// The first message of a streaming answer, later edited in place.
        Preview => "preview",
        /// Replace a shown preview with the "discarded" marker (a superseded
        /// run); nothing is sent when no preview was shown.
        Discard => "discard",
    }
}

/// A journal row to insert.
#[derive(Debug, Clone)]
pub struct NewInbound {
    /// The channel account's store identity (`webhook:main`).
    pub account: String,
    pub update_key: String,
    pub chat_id: String,
    pub chat_kind: ChatKind,
    /// `None` for chats without threads.
    pub thread_id: Option<String>,
    /// The chat's space (a Discord guild), stored with its conversation.
    pub space: Option<String>,
    pub surface: SurfaceKind,
    pub sender_id: Option<String>,
    pub sender_name: Option<String>,
    pub message_id: Option<String>,
    /// The envelope's content as JSON.
    pub payload: String,
    /// `Pending`, or a final disposition decided at ingress (an unsupported
    /// update kind is `Ignored` with its reason).
    pub disposition: Disposition,
    pub reason: Option<String>,
    /// The submission idempotency key derived from the inbound key.
    pub submission_key: String,
    /// The input policy the sender asked for, if any.
    pub input_policy: Option<InputPolicy>,
    /// `/new`: the conversation is closed in the same transaction, so the
    /// next update of the chat starts a new one.
    pub closes_conversation: bool,
    /// The chat migrated to this id: its open conversations, unfinished runs,
    /// unsent replies, schedules and settings move there in the same
    /// transaction.
    pub migrates_to: Option<String>,
    /// The bot was addressed (always, in a private chat).
    pub addressed: bool,
    pub received_at: i64,
}

/// The outcome of journaling one update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalOutcome {
    Accepted {
        inbound_id: i64,
        conversation_id: i64,
    },
    Duplicate {
        inbound_id: i64,
        conversation_id: i64,
    },
}

/// A journal row.
#[derive(Debug, Clone, Serialize)]
pub struct InboundRow {
    pub id: i64,
    pub account: String,
    pub update_key: String,
    pub conversation_id: i64,
    pub chat_id: String,
    pub chat_kind: ChatKind,
    pub thread_id: Option<String>,
    pub space: Option<String>,
    pub surface: SurfaceKind,
    pub sender_id: Option<String>,
    pub sender_name: Option<String>,
    pub message_id: Option<String>,
    /// `None` once pruned.
    pub payload: Option<String>,
    pub disposition: Disposition,
    pub reason: Option<String>,
    pub submission_key: String,
    pub input_policy: Option<InputPolicy>,
    pub addressed: bool,
    pub run_id: Option<String>,
    pub received_at: i64,
    pub settled_at: Option<i64>,
}

/// A chat with recent updates: what a channel re-reads after a gap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecentChat {
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub last_message_id: Option<String>,
    pub last_received_at: i64,
}

/// A journal row's admission by a runtime.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub inbound_id: i64,
    pub run_id: String,
}

/// A new run: where its answers go and how it takes part in its lane.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub conversation_id: i64,
    /// The runtime's configured name.
    pub runtime: String,
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    /// The platform message this run answers, for reply references.
    pub reply_to: Option<String>,
    pub mode: RunMode,
    pub created_at: i64,
}

/// Which run an admitted input belongs to.
#[derive(Debug, Clone)]
pub enum AdmitTarget {
    /// A run of its own.
    NewRun(NewRun),
    /// Join a queued ordinary run (coalescing). If that run is no longer
    /// queued, the input gets a new ordinary run with the same routing.
    Join { run_id: i64 },
    /// Join the run that the admission at `index` of the same batch
    /// belongs to (coalescing with an input admitted moments before).
    JoinBatch { index: usize },
}

/// One input to admit, with the lane decision taken for it.
#[derive(Debug, Clone)]
pub struct Admit {
    pub idempotency_key: String,
    pub conversation_id: i64,
    pub inbound_id: Option<i64>,
    /// The input as JSON.
    pub input: String,
    pub target: AdmitTarget,
    /// A running run this input ends (`interrupt`, `interrupt-next`,
    /// `supersede`): it becomes `interrupt_requested` in the same
    /// transaction, ending as `end_as`.
    pub interrupt: Option<(i64, RunState)>,
    pub created_at: i64,
}

/// What admitting an input did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmitOutcome {
    /// The run that owns the input.
    pub run_id: i64,
    /// `false` when the idempotency key was admitted before.
    pub new: bool,
    /// The run's state now.
    pub state: RunState,
    /// For an absorbed run: the run that answered its inputs.
    pub absorbed_by: Option<i64>,
}

/// A run record.
#[derive(Debug, Clone, Serialize)]
pub struct RunRow {
    pub id: i64,
    pub conversation_id: i64,
    pub runtime: String,
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    pub reply_to: Option<String>,
    pub mode: RunMode,
    pub state: RunState,
    /// Urgent runs have a higher priority; within one priority runs execute
    /// in id order.
    pub priority: i64,
    pub end_as: Option<RunState>,
    /// A confirmation to send after the run's last words (`/stop`), JSON.
    pub end_notice: Option<String>,
    /// The user turns this run answered (JSON array of strings).
    pub prompt: Option<String>,
    pub answer: Option<String>,
    pub reason: Option<String>,
    pub absorbed_by: Option<i64>,
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
}

/// An admitted input.
#[derive(Debug, Clone, Serialize)]
pub struct InputRow {
    pub id: i64,
    pub idempotency_key: String,
    pub run_id: i64,
    pub conversation_id: i64,
    pub inbound_id: Option<i64>,
    /// The input as JSON.
    pub input: String,
    pub created_at: i64,
}

/// A reply item a finishing run creates.
#[derive(Debug, Clone)]
pub struct NewReply {
    pub item_key: String,
    pub kind: ItemKind,
    pub text: String,
    /// Chunks of one answer share a group.
    pub group_key: Option<String>,
    /// The item (a preview) whose message this one edits, when it exists.
    pub edits_key: Option<String>,
    /// Files sent with the text (the first chunk of an answer carries them).
    pub attachments: Vec<AttachmentRef>,
}

/// A run's terminal record and the reply items it creates, written in one
/// transaction with a durable terminal event.
#[derive(Debug, Clone)]
pub struct RunFinish {
    pub run_id: i64,
    pub state: RunState,
    pub answer: Option<String>,
    /// The user turns the run answered (JSON array), for later prompts.
    pub prompt: Option<String>,
    pub reason: Option<String>,
    pub replies: Vec<NewReply>,
    /// Queued inject runs whose inputs this run answered: they become
    /// `absorbed` (only when this run completes).
    pub absorb: Vec<i64>,
    pub now: i64,
}

/// `/stop` (or `/new`) for one conversation.
#[derive(Debug, Clone)]
pub struct StopRequest {
    pub conversation_id: i64,
    /// Recorded on cancelled runs and their journal rows.
    pub reason: String,
    /// Written now when no run is running; otherwise the running run writes
    /// it after its interrupted answer.
    pub notice: Option<NewOutboxItem>,
    pub now: i64,
}

/// What a stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// The running run, now `interrupt_requested`.
    pub interrupted: Option<i64>,
    /// Queued runs, now `cancelled`.
    pub cancelled: Vec<i64>,
}

/// An outbox item to add.
#[derive(Debug, Clone)]
pub struct NewOutboxItem {
    pub item_key: String,
    pub conversation_id: i64,
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    pub reply_to: Option<String>,
    pub run_id: Option<String>,
    pub kind: ItemKind,
    pub text: String,
    pub group_key: Option<String>,
    pub edits_key: Option<String>,
    pub attachments: Vec<AttachmentRef>,
    pub created_at: i64,
}

/// An outbox item.
#[derive(Debug, Clone, Serialize)]
pub struct OutboxItem {
    pub id: i64,
    pub item_key: String,
    pub conversation_id: i64,
    pub ordinal: i64,
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    pub reply_to: Option<String>,
    pub run_id: Option<String>,
    pub kind: ItemKind,
    pub text: String,
    pub group_key: Option<String>,
    pub edits_key: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentRef>,
    pub state: DispatchState,
    /// `NotSent` outcomes so far.
    pub attempts: i64,
    /// Resends after an ambiguous outcome (possible duplicates on `resend`
    /// surfaces).
    pub resends: i64,
    pub next_attempt_at: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<i64>,
    pub fencing_token: i64,
    pub dispatched_at: Option<i64>,
    /// The receipt as JSON, once acknowledged.
    pub receipt: Option<String>,
    /// Why it failed, or the last error.
    pub reason: Option<String>,
    pub created_at: i64,
    pub settled_at: Option<i64>,
}

/// A claim of due lane heads.
#[derive(Debug, Clone)]
pub struct Claim {
    pub owner: String,
    pub now: i64,
    pub lease_until: i64,
    pub limit: usize,
}

/// A dispatch outcome to record.
#[derive(Debug, Clone)]
pub struct Settlement {
    pub item_id: i64,
    pub fencing_token: i64,
    pub outcome: Outcome,
    pub now: i64,
}

/// What the dispatcher learnt from one send.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The platform confirmed it; `receipt` is JSON.
    Acknowledged { receipt: String },
    /// Not delivered; due again at `next_attempt_at`. `counts` says whether
    /// it uses up an attempt (`NotSent` does, `RetryAfter` does not).
    Retry {
        next_attempt_at: i64,
        counts: bool,
        reason: String,
    },
    /// Permanently refused or out of attempts.
    Failed { reason: String },
    /// Outcome unknown: stays `possibly_dispatched`; reconciled once its
    /// lease runs out at `reconcile_at`.
    Ambiguous { reason: String, reconcile_at: i64 },
}

/// A reconciliation decision for an expired possibly-dispatched item.
#[derive(Debug, Clone)]
pub struct Reconcile {
    pub item_id: i64,
    pub fencing_token: i64,
    pub action: ReconcileAction,
    pub now: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileAction {
    /// Back to `not_dispatched`, due now. `possible_duplicate` counts it as
    /// a possible duplicate (the `resend` policy).
    Resend { possible_duplicate: bool },
    /// To `held`, for an operator.
    Hold,
}

/// An operator's decision on a `held` item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// It did arrive: `acknowledged`.
    AsSent,
    /// Send it (again): `not_dispatched`, due now.
    Resend,
    /// Do not send it: `dropped`.
    Drop,
}

/// Bounded outbox figures for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxStats {
    pub not_dispatched: i64,
    pub possibly_dispatched: i64,
    pub held: i64,
    /// When the oldest `not_dispatched` item was created.
    pub oldest_unsent_created_at: Option<i64>,
}

/// Which outbox items to list.
#[derive(Debug, Clone, Default)]
pub struct OutboxFilter {
    pub state: Option<DispatchState>,
    pub conversation_id: Option<i64>,
    pub limit: usize,
}

string_enum! {
    /// When a schedule fires.
    ScheduleKind {
        /// Once, at an instant.
        At => "at",
        /// Once, a duration after it was created.
        After => "after",
        /// At each slot of a cron expression in a time zone.
        Every => "every",
    }
}

string_enum! {
    /// What a schedule does when it fires.
    ScheduleAction {
        /// Deliver fixed text to the conversation through the outbox.
        Message => "message",
        /// Submit text to the runtime as an input of the conversation.
        Prompt => "prompt",
    }
}

string_enum! {
    ScheduleState {
        Active => "active",
        Paused => "paused",
        Completed => "completed",
        Failed => "failed",
        Cancelled => "cancelled",
    }
}

string_enum! {
    /// What happens to slots that passed while nothing could fire them.
    MissedPolicy {
        /// Fire none of them.
        Skip => "skip",
        /// Fire one catch-up occurrence for the latest.
        FireOnce => "fire-once",
        /// Fire them all, up to `scheduler.max_catch_up`.
        FireAll => "fire-all",
    }
}

string_enum! {
    OccurrenceState {
        Pending => "pending",
        Claimed => "claimed",
        Fired => "fired",
        Failed => "failed",
        Skipped => "skipped",
    }
}

/// Where a schedule's output goes: a chat of a channel account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    /// The channel account's store identity.
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub chat_kind: ChatKind,
    /// The target conversation's surface (replies are delivered its way).
    pub surface: SurfaceKind,
}

/// A schedule to create.
#[derive(Debug, Clone)]
pub struct NewSchedule {
    pub kind: ScheduleKind,
    /// The spec as given (for people).
    pub spec: String,
    pub cron: Option<String>,
    pub timezone: Option<String>,
    pub action: ScheduleAction,
    pub text: String,
    pub target: Target,
    pub first_due_at: i64,
    pub missed: MissedPolicy,
    pub max_attempts: i64,
    /// Who created it (`chat:<inbound id>`, `cli`, `api`).
    pub created_by: String,
    pub created_at: i64,
}

/// A schedule.
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleRow {
    pub id: i64,
    pub kind: ScheduleKind,
    pub spec: String,
    pub cron: Option<String>,
    pub timezone: Option<String>,
    pub action: ScheduleAction,
    pub text: String,
    pub target: Target,
    pub state: ScheduleState,
    pub next_due_at: Option<i64>,
    pub missed: MissedPolicy,
    pub max_attempts: i64,
    pub fired: i64,
    pub failed: i64,
    pub skipped: i64,
    pub created_by: String,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One occurrence.
#[derive(Debug, Clone, Serialize)]
pub struct OccurrenceRow {
    pub id: i64,
    pub schedule_id: i64,
    pub slot_at: i64,
    pub key: String,
    pub state: OccurrenceState,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<i64>,
    pub fencing_token: i64,
    pub reason: Option<String>,
    pub run_id: Option<String>,
    pub fired_at: Option<i64>,
    pub created_at: i64,
}

/// One slot a materialization records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub slot_at: i64,
    /// `Pending` (to fire) or `Skipped` (missed, by policy).
    pub state: OccurrenceState,
    pub reason: Option<String>,
}

/// Advancing one due schedule: the slots it records and its next due slot,
/// in one transaction, only if nobody advanced it first.
#[derive(Debug, Clone)]
pub struct Materialize {
    pub schedule_id: i64,
    /// The `next_due_at` this plan was made from (the fence).
    pub from_due: i64,
    pub slots: Vec<Slot>,
    /// `None`: no more slots (a one-off).
    pub next_due_at: Option<i64>,
    /// Missed slots counted but not recorded one by one.
    pub skipped_uncounted: i64,
    /// A one-off whose only slot was skipped ends here.
    pub complete: bool,
    pub now: i64,
}

/// How firing an occurrence went.
#[derive(Debug, Clone)]
pub enum Fire {
    /// Fired: the run it submitted, or the outbox item it delivers (written
    /// in the same transaction).
    Fired {
        run_id: Option<String>,
        item: Option<Box<NewOutboxItem>>,
    },
    /// Try again later (counts an attempt).
    Retry {
        next_attempt_at: i64,
        reason: String,
    },
    /// Not attempted (another process serves the target conversation's
    /// lane): try again later without counting an attempt.
    Defer {
        next_attempt_at: i64,
        reason: String,
    },
    /// Out of attempts or refused for good.
    Failed { reason: String },
}

/// Which schedules to list.
#[derive(Debug, Clone, Default)]
pub struct ScheduleFilter {
    pub account: Option<String>,
    pub chat_id: Option<String>,
    pub state: Option<ScheduleState>,
    pub limit: usize,
}

string_enum! {
    PairingState {
        Pending => "pending",
        Approved => "approved",
        Revoked => "revoked",
    }
}

/// A direct-message user's pairing with an operator.
#[derive(Debug, Clone, Serialize)]
pub struct PairingRow {
    pub account: String,
    pub user_id: String,
    pub user_name: Option<String>,
    pub code: String,
    pub state: PairingState,
    pub created_at: i64,
    pub expires_at: i64,
    pub decided_at: Option<i64>,
}

/// What one pruning pass may remove (times in ms since the epoch: rows
/// older than these go), at most `batch` rows per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PruneRules {
    /// Journal payloads and sender names of settled rows.
    pub payloads_before: i64,
    /// Journal rows themselves (their keys deduplicate redeliveries).
    pub keys_before: i64,
    /// Settled outbox items (acknowledged, failed, dropped).
    pub outbox_before: i64,
    /// Finished runs with their inputs and events.
    pub runs_before: i64,
    pub batch: usize,
}

/// Rows one pruning pass changed, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PruneReport {
    pub payloads: u64,
    pub keys: u64,
    pub outbox: u64,
    pub runs: u64,
}

impl PruneReport {
    pub fn total(&self) -> u64 {
        self.payloads + self.keys + self.outbox + self.runs
    }
}

/// What purging a conversation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PurgeOutcome {
    /// Removed; its journal rows remain as key-only tombstones.
    Purged {
        inbound: u64,
        runs: u64,
        outbox: u64,
    },
    NotFound,
    /// Work of the conversation is in progress (the reason names it).
    Busy(String),
}

/// A run admitted on a remote runtime that Switchboard waits for, with where
/// its answer goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRun {
    pub runtime: String,
    /// The runtime's run id.
    pub run_id: String,
    pub conversation_id: i64,
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    pub reply_to: Option<String>,
    /// A `/stop` confirmation to send after its last words (`{"item_key",
    /// "text"}`).
    pub end_notice: Option<String>,
    /// Still waiting for its `run.finished`.
    pub awaited: bool,
    pub event_id: Option<i64>,
    pub created_at: i64,
}

/// A durable event of the built-in runtime (its runs' terminal records).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunEventRow {
    pub id: i64,
    pub run_id: i64,
    pub conversation_id: i64,
    pub state: RunState,
    /// JSON: `state`, `answer`, `reason`, and `answered_by` for absorbed runs.
    pub payload: String,
    pub created_at: i64,
}
