//! The boundary between Switchboard's core and its platform adapters.
//!
//! Everything that crosses between a platform crate (`adapters/telegram`,
//! `adapters/discord`, `adapters/webhook`) and the core is defined here, and
//! nothing here knows a platform SDK:
//!
//! - inbound: an adapter turns a platform update into an [`Envelope`] and hands
//!   it to an [`IngressSink`]; the sink returns only after the envelope is
//!   durably journaled, and only then may the adapter acknowledge the update to
//!   its platform (webhook 200, polling offset advance);
//! - outbound: the core's dispatcher gives a [`ChannelAdapter`] an
//!   [`OutboundMessage`] and gets back a [`Receipt`] or a [`DeliveryError`]
//!   whose kind decides what the outbox does next.
//!
//! Architecture invariant: adapters do not touch the store. They see
//! envelopes, outbound messages and receipts, nothing else.

pub mod chunk;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// The platform a channel account lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    Webhook,
    Telegram,
    Discord,
}

impl Platform {
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Webhook => "webhook",
            Platform::Telegram => "telegram",
            Platform::Discord => "discord",
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What kind of chat an update came from; together with the platform it picks
/// the surface (`telegram.private`, `discord.guild`, `webhook`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatKind {
    /// A one-to-one chat with the bot (Telegram private chat, Discord DM).
    Private,
    /// A chat with several people (Telegram group or supergroup, Discord guild channel).
    Group,
}

impl ChatKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChatKind::Private => "private",
            ChatKind::Group => "group",
        }
    }

    pub fn parse(s: &str) -> Option<ChatKind> {
        match s {
            "private" => Some(ChatKind::Private),
            "group" => Some(ChatKind::Group),
            _ => None,
        }
    }
}

/// What happens to the run in flight when a new input arrives in the same
/// conversation (DESIGN.md §2). Surfaces configure a default; a caller may
/// pass one per input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputPolicy {
    /// The run in flight finishes; the new input runs after the queued work.
    Queue,
    /// The run in flight also answers the new input at its next step
    /// boundary.
    Inject,
    /// The run in flight ends, its partial answer kept and marked as cut off;
    /// the new input joins the tail of the queue.
    Interrupt,
    /// Like `interrupt`, but the new input runs before ordinary queued work.
    InterruptNext,
    /// The run in flight ends and its partial answer is dropped from later
    /// prompts (kept in the record).
    Supersede,
    /// `interrupt` on streaming surfaces, `supersede` on terminal-only ones.
    Auto,
}

impl InputPolicy {
    pub const ALL: [InputPolicy; 6] = [
        InputPolicy::Queue,
        InputPolicy::Inject,
        InputPolicy::Interrupt,
        InputPolicy::InterruptNext,
        InputPolicy::Supersede,
        InputPolicy::Auto,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            InputPolicy::Queue => "queue",
            InputPolicy::Inject => "inject",
            InputPolicy::Interrupt => "interrupt",
            InputPolicy::InterruptNext => "interrupt-next",
            InputPolicy::Supersede => "supersede",
            InputPolicy::Auto => "auto",
        }
    }

    pub fn parse(s: &str) -> Option<InputPolicy> {
        InputPolicy::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// The person (or bot) who sent an update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sender {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub is_bot: bool,
}

/// A file the user sent, passed on by reference: the bytes stay on the
/// platform and are never stored inline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentRef {
    /// A platform file id or a URL.
    pub reference: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filename: Option<String>,
}

/// What an update carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    /// A message for the bot: text (possibly empty when only files were sent)
    /// and attachment references.
    Message {
        text: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        attachments: Vec<AttachmentRef>,
    },
    /// An update kind this adapter does not turn into input. It is still
    /// journaled, with disposition `ignored` and this reason, so nothing is
    /// dropped silently.
    Unsupported { kind: String, reason: String },
    /// The chat became another chat (a Telegram group upgraded to a
    /// supergroup gets a new id). Journaled as ignored; the core moves the
    /// chat's conversations, unsent replies and schedules to the new id.
    ChatMigrated { to_chat_id: String },
}

/// One inbound update, platform-neutral.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The channel account's configured name (`[channels.NAME]`).
    pub account: String,
    /// The platform's key for this update, unique per channel account
    /// (Telegram `update_id`, Discord message snowflake, webhook `update_id`).
    pub update_key: String,
    pub chat_id: String,
    pub chat_kind: ChatKind,
    /// Forum topic or thread; part of the conversation's identity.
    pub thread_id: Option<String>,
    /// The space the chat belongs to (a Discord guild), for access
    /// decisions; `None` where the platform has none.
    pub space: Option<String>,
    pub sender: Option<Sender>,
    /// The platform message id of this update, so replies can reference it.
    pub message_id: Option<String>,
    pub content: Content,
    /// The input policy the caller asked for, overriding the surface's.
    pub input_policy: Option<InputPolicy>,
    /// In a group chat: the bot was mentioned, replied to, or given a
    /// command. Always true in private chats. Whether an unaddressed group
    /// message is answered is the core's access decision.
    pub addressed: bool,
}

/// The outcome of handing an envelope to the core, known only after commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AcceptStatus {
    /// A new journal row was committed.
    Accepted,
    /// The same `(account, update_key)` was journaled before; nothing changed.
    Duplicate,
}

/// What the core tells an adapter once an envelope is durably journaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub status: AcceptStatus,
    pub inbound_id: i64,
    pub conversation_id: i64,
}

/// Why the core did not journal an envelope.
#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// The daemon is shutting down or not ready; the platform should retry later.
    #[error("switchboard is not accepting updates right now: {0}")]
    Unavailable(String),
    /// No channel account of that name is configured.
    #[error("unknown channel account {0:?}")]
    UnknownAccount(String),
    /// The envelope itself is not acceptable (the reason names the field).
    #[error("{0}")]
    Invalid(String),
    /// The store failed; nothing was journaled. Retrying is safe.
    #[error("the journal could not store the update: {0}")]
    Store(String),
}

/// The core's entry point for inbound updates.
#[async_trait]
pub trait IngressSink: Send + Sync {
    /// Journal the envelope and return once the row is committed (or was
    /// already there). Only after `Ok` may the adapter acknowledge the update
    /// to its platform.
    async fn accept(&self, envelope: Envelope) -> Result<Accepted, IngressError>;

    /// Record a request the adapter refused before it became an envelope
    /// (malformed JSON, missing field, oversize body, bad secret), so an
    /// operator can see it in logs and metrics. `code` is a short stable
    /// label (`malformed_json`, `body_too_large`, ...).
    fn record_rejection(&self, account: &str, code: &str, detail: &str);

    /// Report the account's connection state (shown on `/readyz` and as the
    /// `switchboard_channel_up` gauge). Accounts that never report are up.
    fn report_status(&self, account: &str, status: AccountStatus) {
        let _ = (account, status);
    }

    /// Hold the single-active role `role` (such as a bot's poller) for
    /// this process: `Ok(true)` while it is this process's. Processes that
    /// share a store take turns through a lease with a fencing token; call
    /// again at least every [`IngressSink::role_renewal`] to keep it. With a
    /// store one process owns, every role is always this process's.
    async fn hold_role(&self, role: &str) -> Result<bool, IngressError> {
        let _ = role;
        Ok(true)
    }

    /// How often a held role must be renewed.
    fn role_renewal(&self) -> Duration {
        Duration::from_secs(5)
    }

    /// Give a role up (stopping), so another process takes it at once.
    async fn release_role(&self, role: &str) {
        let _ = role;
    }

    /// The account's chats with journaled updates received within `within`,
    /// most recently active first, at most `limit`, each with the platform
    /// message id of its latest journaled update: what a channel that cannot
    /// replay missed events (Discord) fetches again after a gap.
    async fn recent_chats(
        &self,
        account: &str,
        within: Duration,
        limit: usize,
    ) -> Result<Vec<RecentChat>, IngressError> {
        let _ = (account, within, limit);
        Ok(Vec::new())
    }
}

/// A chat with recent journaled updates ([`IngressSink::recent_chats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecentChat {
    pub chat_id: String,
    pub thread_id: Option<String>,
    /// The platform message id of the chat's latest journaled update.
    pub last_message_id: Option<String>,
}

/// A channel account's connection to its platform, as its adapter sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountStatus {
    /// Connecting (checking the token, registering a webhook).
    Starting,
    /// Receiving updates; the detail says how (`polling as @bot`).
    Up(String),
    /// Not receiving updates; the reason names the problem and the fix.
    /// Other accounts are unaffected.
    Down(String),
}

/// Whether an outbound message creates a new platform message or edits one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SendAction {
    Create,
    Edit { message_id: String },
}

/// Core bookkeeping that some adapters pass on (the webhook channel puts it
/// in its callback body); platform adapters may ignore it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboundMeta {
    pub conversation_id: i64,
    pub ordinal: i64,
    pub run_id: Option<String>,
}

/// One message for the adapter to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundMessage {
    /// The reply item key: stable across retries and restarts. Adapters with
    /// an idempotency mechanism (Discord nonce, webhook `reply_key`) derive
    /// it from this.
    pub item_key: String,
    pub chat_id: String,
    pub thread_id: Option<String>,
    pub text: String,
    /// Files to send with the text (platform file ids or URLs), with the
    /// platform's matching send method.
    pub attachments: Vec<AttachmentRef>,
    /// The platform message id this answers, when the surface references it.
    pub reply_to: Option<String>,
    pub action: SendAction,
    pub meta: OutboundMeta,
}

/// The platform's confirmation of a send.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Platform message ids created or edited (one per message).
    pub message_ids: Vec<String>,
}

/// Which rate-limit bucket a platform's "slow down" applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateScope {
    Chat,
    Account,
}

/// Why a send did not produce a receipt. The kind decides the outbox's next
/// step (DESIGN.md §4).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeliveryError {
    /// The platform asked us to wait; due again after `after`, not counted as
    /// an attempt.
    #[error("rate limited for {after:?}")]
    RetryAfter { after: Duration, scope: RateScope },
    /// Certainly not delivered (connection refused, 5xx before acceptance);
    /// retried with backoff and counted as an attempt.
    #[error("not sent: {0}")]
    NotSent(String),
    /// Refused for good (blocked, chat gone, invalid request).
    #[error("refused: {0}")]
    Permanent(String),
    /// The request may have reached the platform (timeout after it left);
    /// the item stays possibly-dispatched until reconciliation.
    #[error("outcome unknown: {0}")]
    Ambiguous(String),
}

/// Why an attachment could not be downloaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("this channel cannot download attachments")]
    Unsupported,
    #[error("the platform does not know that file: {0}")]
    NotFound(String),
    #[error("the file is {size} bytes, over the {limit}-byte limit")]
    TooLarge { size: u64, limit: u64 },
    #[error("the download failed: {0}")]
    Failed(String),
}

/// How a platform counts text length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LengthUnit {
    /// Unicode scalar values.
    Chars,
    /// UTF-16 code units (Telegram counts after entity parsing in these).
    Utf16,
}

/// A token-bucket rate: `burst` sends at once, refilled at `per_second`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: u32,
}

/// The platform's limits, declared by the adapter and enforced by the core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub max_text_len: usize,
    pub length_unit: LengthUnit,
    pub per_chat: Option<Rate>,
    pub per_group: Option<Rate>,
    pub per_account: Option<Rate>,
}

/// What the platform can do, declared by the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// A resend with the same item key never creates a second message
    /// (Discord nonce, webhook receivers deduplicating on `reply_key`).
    pub idempotent_send: bool,
    /// Sent messages can be edited (streaming previews).
    pub edit: bool,
    /// A typing indicator exists.
    pub typing: bool,
    /// Transient drafts can be streamed into private chats
    /// ([`ChannelAdapter::draft`]; Telegram `sendMessageDraft`).
    pub drafts: bool,
}

/// One channel account's outbound side.
#[async_trait]
pub trait ChannelAdapter: Send + Sync {
    /// The account's store identity (`webhook:<name>`, `telegram:<bot id>`,
    /// `discord:<application id>`).
    fn identity(&self) -> &str;
    fn platform(&self) -> Platform;
    fn limits(&self) -> Limits;
    fn capabilities(&self) -> Capabilities;
    /// Send one message (create, or edit when `message.action` says so).
    /// Must not retry on its own: the outbox decides.
    async fn send(&self, message: &OutboundMessage) -> Result<Receipt, DeliveryError>;

    /// Show a typing indicator in a chat (transient; never retried).
    async fn typing(&self, chat_id: &str, thread_id: Option<&str>) -> Result<(), DeliveryError> {
        let _ = (chat_id, thread_id);
        Ok(())
    }

    /// Show `text` as the draft of a reply being written in a private chat.
    /// Drafts are transient: the final answer is still sent as a message.
    /// `draft_id` is non-zero and the same for every draft of one answer.
    async fn draft(
        &self,
        chat_id: &str,
        thread_id: Option<&str>,
        draft_id: i64,
        text: &str,
    ) -> Result<(), DeliveryError> {
        let _ = (chat_id, thread_id, draft_id, text);
        Err(DeliveryError::Permanent(
            "this channel has no drafts".into(),
        ))
    }

    /// Download an attachment the platform holds (`reference` as given in an
    /// [`AttachmentRef`]), refusing anything larger than `max_bytes`.
    async fn fetch_attachment(
        &self,
        reference: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>, FetchError> {
        let _ = (reference, max_bytes);
        Err(FetchError::Unsupported)
    }

    /// Split a final answer into the messages this platform can take.
    fn split(&self, text: &str) -> Vec<String> {
        let limits = self.limits();
        chunk::split(text, limits.max_text_len, limits.length_unit)
    }
}
