//! The agent runtime behind one trait.
//!
//! The submitter hands a runtime journal rows as [`Submission`]s, each with an
//! idempotency key derived from its inbound key; the runtime answers with the
//! run that owns it. Queuing, interrupting and injecting are the runtime's
//! job (DESIGN.md §2). How answers come back is the runtime's business too:
//! the built-in runtime writes a run's terminal record and its reply items in
//! one store transaction; a remote runtime's connector writes reply items
//! keyed by durable event ids.

pub mod local;
pub mod remote;

use std::sync::Weak;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use switchboard_channel::AttachmentRef;

use crate::store::NewOutboxItem;
use crate::surface::{InputPolicy, SurfaceKind};

/// What the user said, as the runtime sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Input {
    pub text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_name: Option<String>,
}

impl Input {
    /// An input of plain text.
    pub fn text(text: impl Into<String>) -> Input {
        Input {
            text: text.into(),
            attachments: Vec::new(),
            sender_id: None,
            sender_name: None,
        }
    }
}

/// One input for a runtime, with its identity and context.
#[derive(Debug, Clone)]
pub struct Submission {
    /// Same key on every retry and after restart (DESIGN.md §3).
    pub idempotency_key: String,
    pub conversation_id: i64,
    /// The journal row this came from (`None` for scheduled prompts).
    pub inbound_id: Option<i64>,
    /// The channel account's store identity.
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    /// The platform message to reference in replies.
    pub reply_to: Option<String>,
    pub input: Input,
    /// The input policy, with `auto` already resolved by the surface.
    pub policy: InputPolicy,
    /// At most one queued successor per conversation; later inputs join it.
    pub coalesce_pending: bool,
    /// Queued inputs beyond which this one is refused.
    pub max_queued_inputs: usize,
    /// With `inject`: cut the current model call at once.
    pub soft_interrupt: bool,
}

/// The runtime's answer to a submission: the run that owns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub run_id: String,
    /// `false` when the idempotency key was seen before (the same run).
    pub new: bool,
}

/// Why a submission was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Not now (runtime unreachable, store busy, shutting down): the journal
    /// row stays pending and is submitted again later with the same key.
    #[error("runtime unavailable: {0}")]
    Unavailable(String),
    /// Never: the runtime refused this input for good.
    #[error("refused by the runtime: {0}")]
    Rejected(String),
    /// Not accepted because too much is waiting (the bounded queue); the
    /// sender is told and may send it again later.
    #[error("queue full: {0}")]
    Refused(String),
}

/// `/stop` or `/new` for one conversation.
#[derive(Debug, Clone)]
pub struct Stop {
    pub conversation_id: i64,
    /// Recorded on what was cancelled (`/stop`, `/new`).
    pub reason: String,
    /// The confirmation, sent after the interrupted run's partial answer
    /// (or at once when nothing was running); `None` sends nothing (a
    /// runtime served over the protocol has no chat to confirm in).
    pub notice: Option<NewOutboxItem>,
}

/// What a stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopReport {
    pub interrupted: Option<String>,
    pub cancelled: usize,
}

/// Where a run's answers go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The channel account's store identity.
    pub account: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub surface: SurfaceKind,
    /// The platform message the answer references.
    pub reply_to: Option<String>,
}

impl Submission {
    pub fn route(&self) -> Route {
        Route {
            account: self.account.clone(),
            chat_id: self.chat_id.clone(),
            thread_id: self.thread_id.clone(),
            surface: self.surface,
            reply_to: self.reply_to.clone(),
        }
    }
}

/// A transient piece of a streaming answer: identified by `(run, epoch,
/// sequence)`. A new epoch starts when a run starts its answer over (a
/// retried model call); `text` is the whole answer so far, so a consumer
/// that missed some deltas loses nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDelta {
    pub run_id: String,
    pub conversation_id: i64,
    pub route: std::sync::Arc<Route>,
    pub epoch: u32,
    pub sequence: u64,
    pub delta: String,
    pub text: String,
}

/// How a runtime's close went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReport {
    /// Every run in flight reached a terminal state or was handed back for
    /// recovery within the deadlines.
    pub settled: bool,
    /// Runs still in flight when the force timeout ran out.
    pub remaining: usize,
}

/// Which conversation lanes this process owns ([`crate::lanes::Lanes`]).
pub trait LaneOwnership: Send + Sync {
    /// Whether this process holds the conversation's lane lease now, by a
    /// conservative reading of its own clock.
    fn owns(&self, conversation_id: i64) -> bool;

    /// The runtime dropped the conversation's lane because [`owns`] said
    /// no; its runs wait in the store until the lane is adopted again.
    ///
    /// [`owns`]: LaneOwnership::owns
    fn lost(&self, conversation_id: i64);
}

/// An agent runtime.
#[async_trait]
pub trait Runtime: Send + Sync {
    /// The configured name (`[runtimes.NAME]`).
    fn name(&self) -> &str;

    /// Admit a batch of submissions; one result per submission, in order.
    /// A submission is only attempted when every earlier submission of the
    /// same conversation in the batch was admitted, so journal order holds.
    async fn submit(&self, batch: Vec<Submission>) -> Vec<Result<Admission, SubmitError>>;

    /// Interrupt the conversation's running run and cancel its queued
    /// inputs; the notice confirms it in the chat.
    async fn stop(&self, stop: Stop) -> Result<StopReport, SubmitError>;

    /// Transient deltas of streaming answers, for previews.
    fn deltas(&self) -> tokio::sync::broadcast::Receiver<RunDelta>;

    /// Pick up the work a previous process left (queued and running runs).
    /// Called once after start, before the submitter's first round. Returns
    /// how many runs were resumed.
    async fn recover(&self) -> Result<usize, String>;

    /// Whether this runtime keeps per-conversation lanes in this process.
    /// Processes sharing a store then own each lane one at a time
    /// ([`crate::lanes`]), and work a dead process left is picked up lane
    /// by lane with [`Runtime::adopt`] instead of by [`Runtime::recover`].
    fn owns_lanes(&self) -> bool {
        false
    }

    /// Take over the unfinished runs of one conversation whose lane this
    /// process has just acquired (queued runs resume in order, running ones
    /// are re-run or interrupted as `recover` does). Runs this process
    /// already has are left alone. Returns how many were taken over.
    async fn adopt(&self, _conversation_id: i64) -> Result<usize, String> {
        Ok(0)
    }

    /// Whether the conversation has a run in flight or queued here (its
    /// lane must stay owned).
    fn busy(&self, _conversation_id: i64) -> bool {
        false
    }

    /// Processes sharing a store: from now on, start a conversation's next
    /// run only while `lanes` says this process owns its lane; a lane lost
    /// (this process stalled past its lease) is dropped here, its runs left
    /// queued in the store for the new owner.
    fn attach_lanes(&self, _lanes: Weak<dyn LaneOwnership>) {}

    /// Stop: no new runs, `grace` for the ones in flight, then abort with
    /// reason `shutdown` and wait at most `force`.
    async fn close(&self, grace: Duration, force: Duration) -> CloseReport;

    /// Whether the runtime can take work now (readiness); the reason when
    /// not. The built-in runtime always can.
    async fn health(&self) -> Result<(), String> {
        Ok(())
    }
}
