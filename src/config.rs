//! Typed configuration: one TOML file plus `SWITCHBOARD__SECTION__KEY`
//! environment overrides, every key documented here and in
//! `config/switchboard.toml`, unknown keys rejected, defaults in one place.
//!
//! Loading never half-succeeds: [`Config::load`] parses, then [`Config::validate`]
//! checks cross-references (a channel's runtime exists, addresses parse) and
//! returns every problem with the key that has it and what to do about it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::surface::{
    DEFAULT_MAX_QUEUED_INPUTS, Delivery, InputPolicy, OnAmbiguousSend, SurfaceKind, SurfaceSettings,
};

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where durable state lives.
    #[serde(default)]
    pub store: StoreConfig,
    /// The public HTTP listener (webhook channel updates).
    #[serde(default)]
    pub server: ServerConfig,
    /// The operator listener (`/healthz`, `/metrics`).
    #[serde(default)]
    pub admin: AdminConfig,
    /// Log output.
    #[serde(default)]
    pub log: LogConfig,
    /// Agent runtimes, by name; channel accounts refer to them.
    #[serde(default)]
    pub runtimes: BTreeMap<String, RuntimeConfig>,
    /// Channel accounts, by name.
    #[serde(default)]
    pub channels: BTreeMap<String, ChannelConfig>,
    /// Surface settings (DESIGN.md §2), by surface name (`webhook`,
    /// `telegram.private`, ...); unset keys keep the surface's defaults.
    #[serde(default)]
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    /// The outbox dispatcher.
    #[serde(default)]
    pub outbox: OutboxConfig,
    /// The submitter (journal → runtime).
    #[serde(default)]
    pub submitter: SubmitterConfig,
    /// Stopping.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Texts Switchboard itself sends to users.
    #[serde(default)]
    pub messages: Messages,
    /// Durable user schedules (reminders, recurring prompts).
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// How long personal data is kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// `switchboard runtime serve`: the built-in runtime over the runtime
    /// protocol.
    #[serde(default)]
    pub serve: Option<ServeConfig>,
    /// The settings SIGHUP can change while the daemon runs, shared by
    /// every clone of this config (see [`LivePolicies`]).
    #[serde(skip)]
    pub live: LivePolicies,
}

/// `[serve]`: what `switchboard runtime serve` serves, and where.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// `"host:port"` to serve `/v1/...` on.
    #[serde(default = "default_serve_listen")]
    pub listen: String,
    /// The built-in runtime (`[runtimes.NAME]`, kind "local") to serve.
    pub runtime: String,
    /// Bearer token clients must send (prefer `token_file` or
    /// `SWITCHBOARD__SERVE__TOKEN`); required off loopback.
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

fn default_serve_listen() -> String {
    "127.0.0.1:8800".to_owned()
}

impl ServeConfig {
    pub fn resolve_token(&self) -> Result<Option<String>, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(Some(t.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

/// How long what users said is kept (`[retention]`). Message text is
/// personal data: it goes first; the keys that deduplicate redeliveries
/// stay longer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Run the pruning worker.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Days before the text and sender name of a settled journal row are
    /// erased (its key and disposition stay).
    #[serde(default = "default_payload_days")]
    pub payload_days: u64,
    /// Days before a journal row is deleted (at least 7: platforms redeliver
    /// for up to a day, and the key must still deduplicate).
    #[serde(default = "default_journal_days")]
    pub journal_days: u64,
    /// Days before an acknowledged, failed or dropped reply is deleted.
    #[serde(default = "default_payload_days")]
    pub outbox_days: u64,
    /// Days before a finished run (its prompt, answer, inputs, events) is
    /// deleted; older turns then leave the conversation's history.
    #[serde(default = "default_payload_days")]
    pub runs_days: u64,
    /// Minutes between pruning rounds.
    #[serde(default = "default_retention_interval")]
    pub interval_minutes: u64,
    /// Rows per kind and transaction; a round repeats until a pass finds
    /// less than this.
    #[serde(default = "default_retention_batch")]
    pub batch_size: usize,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            enabled: true,
            payload_days: default_payload_days(),
            journal_days: default_journal_days(),
            outbox_days: default_payload_days(),
            runs_days: default_payload_days(),
            interval_minutes: default_retention_interval(),
            batch_size: default_retention_batch(),
        }
    }
}

fn default_payload_days() -> u64 {
    30
}

fn default_journal_days() -> u64 {
    90
}

fn default_retention_interval() -> u64 {
    60
}

fn default_retention_batch() -> usize {
    500
}

/// What a reload (SIGHUP) can change without a restart: surface settings
/// (global, per account, per chat) and access lists. Every clone of a
/// [`Config`] shares them, so the parts that read them see a reload at once.
#[derive(Clone, Default)]
pub struct LivePolicies(Arc<arc_swap::ArcSwap<PolicySet>>);

impl fmt::Debug for LivePolicies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LivePolicies")
    }
}

/// The reloadable settings of one config file.
#[derive(Debug, Default, Clone)]
pub struct PolicySet {
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    pub channels: BTreeMap<String, ChannelPolicy>,
}

/// One channel account's reloadable settings.
#[derive(Debug, Default, Clone)]
pub struct ChannelPolicy {
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    pub chats: BTreeMap<String, SurfaceSettings>,
    pub access: AccessConfig,
}

impl PolicySet {
    fn of(config: &Config) -> PolicySet {
        PolicySet {
            surfaces: config.surfaces.clone(),
            channels: config
                .channels
                .iter()
                .map(|(name, channel)| {
                    let overrides = channel.overrides();
                    (
                        name.clone(),
                        ChannelPolicy {
                            surfaces: overrides.surfaces.clone(),
                            chats: overrides.chats.clone(),
                            access: channel.access().clone(),
                        },
                    )
                })
                .collect(),
        }
    }
}

/// What a reload did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReloadReport {
    /// Keys whose new values are in effect.
    pub applied: Vec<String>,
    /// Keys that changed in the file but only take effect after a restart.
    pub needs_restart: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// How often the scheduler looks for due slots, in milliseconds (it
    /// also wakes at the next due slot).
    #[serde(default = "default_scheduler_poll_ms")]
    pub poll_ms: u64,
    /// How long a claimed occurrence is owned, in seconds.
    #[serde(default = "default_scheduler_lease_secs")]
    pub lease_secs: u64,
    /// A slot found due later than this (seconds) was missed (the daemon
    /// was down or stalled): the schedule's missed-run policy decides.
    #[serde(default = "default_late_tolerance_secs")]
    pub late_tolerance_secs: u64,
    /// `fire-all` fires at most this many missed slots (the latest ones).
    #[serde(default = "default_max_catch_up")]
    pub max_catch_up: usize,
    /// The missed-run policy of new schedules unless they name one:
    /// `skip`, `fire-once` or `fire-all`.
    #[serde(default = "default_missed_policy")]
    pub default_missed: String,
    /// Attempts to fire an occurrence before it fails.
    #[serde(default = "default_scheduler_attempts")]
    pub max_attempts: i64,
    /// First retry delay of an occurrence, in milliseconds (doubles, with
    /// jitter, up to `retry_cap_ms`).
    #[serde(default = "default_scheduler_retry_base_ms")]
    pub retry_base_ms: u64,
    #[serde(default = "default_scheduler_retry_cap_ms")]
    pub retry_cap_ms: u64,
    /// For crash tests only: wait this long between claiming an occurrence
    /// and firing it. 0 in production.
    #[serde(default)]
    pub hold_after_claim_ms: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            poll_ms: default_scheduler_poll_ms(),
            lease_secs: default_scheduler_lease_secs(),
            late_tolerance_secs: default_late_tolerance_secs(),
            max_catch_up: default_max_catch_up(),
            default_missed: default_missed_policy(),
            max_attempts: default_scheduler_attempts(),
            retry_base_ms: default_scheduler_retry_base_ms(),
            retry_cap_ms: default_scheduler_retry_cap_ms(),
            hold_after_claim_ms: 0,
        }
    }
}

fn default_scheduler_poll_ms() -> u64 {
    500
}
fn default_scheduler_lease_secs() -> u64 {
    60
}
fn default_late_tolerance_secs() -> u64 {
    60
}
fn default_max_catch_up() -> usize {
    10
}
fn default_missed_policy() -> String {
    "fire-once".into()
}
fn default_scheduler_attempts() -> i64 {
    5
}
fn default_scheduler_retry_base_ms() -> u64 {
    1000
}
fn default_scheduler_retry_cap_ms() -> u64 {
    60_000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `sqlite://PATH` (relative paths are relative to the working
    /// directory; the file and its directory are created when missing).
    #[serde(default = "default_store_url")]
    pub url: String,
    /// SQLite `synchronous`: `full` (default: a commit is on disk before it
    /// is acknowledged) or `normal` (faster; a power cut can lose the last
    /// commits, a process crash cannot).
    #[serde(default)]
    pub synchronous: Synchronous,
    /// Largest number of journal rows one group commit writes.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Several processes on one PostgreSQL database: how long a process
    /// owns a conversation's lane (built-in runtime) or a single-active role
    /// (a bot's Telegram poller) without renewing it. A process that dies is
    /// replaced within this time (the poller within this plus 5 s). Renewed
    /// every third of it. Unused with SQLite (one process owns the file).
    #[serde(default = "default_store_lease_secs")]
    pub lease_secs: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    #[default]
    Full,
    Normal,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: default_store_url(),
            synchronous: Synchronous::Full,
            batch_size: default_batch_size(),
            lease_secs: default_store_lease_secs(),
        }
    }
}

fn default_store_lease_secs() -> u64 {
    15
}

fn default_store_url() -> String {
    "sqlite://data/switchboard.db".to_owned()
}

fn default_batch_size() -> usize {
    512
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// `"host:port"` of the public listener. Port 0 picks a free port.
    #[serde(default = "default_server_listen")]
    pub listen: String,
    /// Largest request body accepted, in bytes (default 1 MiB).
    #[serde(default = "default_body_limit")]
    pub body_limit: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: default_server_listen(),
            body_limit: default_body_limit(),
        }
    }
}

fn default_server_listen() -> String {
    "127.0.0.1:8780".to_owned()
}

fn default_body_limit() -> usize {
    1024 * 1024
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// `"host:port"` of the admin listener; keep it on loopback.
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// Largest attachment `GET /v1/attachments/NAME?reference=R` downloads
    /// from a platform, in bytes.
    #[serde(default = "default_max_attachment_bytes")]
    pub max_attachment_bytes: u64,
    /// Bearer token every admin request but `/healthz` must carry
    /// (`Authorization: Bearer TOKEN`). Required when `listen` is not a
    /// loopback address. Prefer `token_file` or `SWITCHBOARD__ADMIN__TOKEN`.
    #[serde(default)]
    pub token: Option<String>,
    /// A file holding the admin token (relative paths are looked up in
    /// `$CREDENTIALS_DIRECTORY` when set).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

impl AdminConfig {
    /// The bearer token, from `token` or `token_file`.
    pub fn resolve_token(&self) -> Result<Option<String>, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(Some(t.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
            max_attachment_bytes: default_max_attachment_bytes(),
            token: None,
            token_file: None,
        }
    }
}

fn default_max_attachment_bytes() -> u64 {
    20 * 1024 * 1024
}

fn default_admin_listen() -> String {
    "127.0.0.1:8781".to_owned()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A `tracing` filter (`info`, `switchboard=debug,info`). `RUST_LOG`
    /// overrides it.
    #[serde(default = "default_log_level")]
    pub level: String,
    /// `text` (default) or `json`.
    #[serde(default)]
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: default_log_level(),
            format: LogFormat::Text,
        }
    }
}

fn default_log_level() -> String {
    "info".to_owned()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// One agent runtime.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RuntimeConfig {
    /// The built-in runtime: owns runs per conversation and calls a model
    /// backend.
    Local(LocalRuntimeConfig),
    /// A runtime of your own, over the documented HTTP protocol
    /// (docs/runtime-protocol.md).
    Http(HttpRuntimeConfig),
}

/// `[runtimes.NAME] kind = "http"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRuntimeConfig {
    /// Where the runtime serves `/v1/...`, e.g. "http://127.0.0.1:8800".
    pub base_url: String,
    /// Bearer token the runtime requires (prefer `token_file` or
    /// `SWITCHBOARD__RUNTIMES__NAME__TOKEN`).
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Seconds a submission, run read or stop may take before it is retried
    /// (with the same idempotency keys).
    #[serde(default = "default_http_runtime_timeout")]
    pub request_timeout_secs: u64,
}

fn default_http_runtime_timeout() -> u64 {
    10
}

impl HttpRuntimeConfig {
    pub fn resolve_token(&self) -> Result<Option<String>, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(Some(t.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalRuntimeConfig {
    /// The model backend.
    pub model: ModelConfig,
    /// How many runs (across all conversations) may execute at once.
    #[serde(default = "default_max_concurrent_runs")]
    pub max_concurrent_runs: usize,
    /// A system prompt given to every model call.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Seconds a run may take in all; past that it fails and the user gets
    /// `messages.run_timeout`.
    #[serde(default = "default_run_timeout_secs")]
    pub run_timeout_secs: u64,
    /// What a start does with runs a dead process left running: `rerun`
    /// (default; model calls have no external effects) or `interrupt`.
    #[serde(default)]
    pub on_restart: OnRestart,
    /// What each model call sees of the conversation.
    #[serde(default)]
    pub history: HistoryConfig,
}

fn default_max_concurrent_runs() -> usize {
    256
}

fn default_run_timeout_secs() -> u64 {
    300
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnRestart {
    #[default]
    Rerun,
    Interrupt,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryConfig {
    /// Earlier turns (one run each) a model call sees at most.
    #[serde(default = "default_history_turns")]
    pub max_turns: usize,
    /// Approximate token budget for those turns (4 characters a token);
    /// the oldest turns are left out first.
    #[serde(default = "default_history_tokens")]
    pub max_tokens: usize,
    /// How an interrupted turn reaches the model: `assistant-marked`
    /// (default: the partial answer plus a marker), `system-note` (the
    /// partial answer, then a system message saying it was cut off), or
    /// `omit` (only the user's words).
    #[serde(default)]
    pub interrupted_assistant: InterruptedAssistant,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            max_turns: default_history_turns(),
            max_tokens: default_history_tokens(),
            interrupted_assistant: InterruptedAssistant::AssistantMarked,
        }
    }
}

fn default_history_turns() -> usize {
    20
}

fn default_history_tokens() -> usize {
    8000
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InterruptedAssistant {
    #[default]
    AssistantMarked,
    SystemNote,
    Omit,
}

/// A model backend of the local runtime.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModelConfig {
    /// Deterministic: answers `echo: <text>`. The demo and test backend.
    Echo(EchoConfig),
    /// Any OpenAI-compatible streaming chat-completions server.
    Openai(OpenAiConfig),
    /// A local program: JSON request on stdin, the answer streamed on stdout.
    Command(CommandConfig),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EchoConfig {
    /// Delay per word of the answer, in milliseconds, so streaming and
    /// interruption can be seen. 0 answers at once.
    #[serde(default)]
    pub token_delay_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiConfig {
    /// The API base, up to and including `/v1` (OpenAI
    /// `https://api.openai.com/v1`, Ollama `http://127.0.0.1:11434/v1`,
    /// llama.cpp `http://127.0.0.1:8080/v1`).
    pub base_url: String,
    /// The model name the server knows.
    pub model: String,
    /// API key (prefer `api_key_file` or the environment).
    #[serde(default)]
    pub api_key: Option<String>,
    /// A file holding the API key.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Seconds to wait for the response to start.
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Seconds to wait between two pieces of a streaming response.
    #[serde(default = "default_idle_timeout_secs")]
    pub idle_timeout_secs: u64,
    /// Retries after 429, 5xx or a broken stream, with exponential backoff.
    #[serde(default = "default_model_retries")]
    pub max_retries: u32,
    /// First retry delay in milliseconds (doubles per retry; a Retry-After
    /// header wins).
    #[serde(default = "default_retry_base_ms")]
    pub retry_base_ms: u64,
    /// Sampling temperature, when set.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Largest answer in tokens, when set.
    #[serde(default)]
    pub max_tokens: Option<u32>,
}

fn default_request_timeout_secs() -> u64 {
    60
}
fn default_idle_timeout_secs() -> u64 {
    60
}
fn default_model_retries() -> u32 {
    3
}
fn default_retry_base_ms() -> u64 {
    500
}

impl OpenAiConfig {
    pub fn resolve_api_key(&self) -> Result<Option<String>, String> {
        match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => Ok(Some(k.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandConfig {
    /// The program to run for every run.
    pub program: PathBuf,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Seconds a run of the program may take before it is killed.
    #[serde(default = "default_command_timeout_secs")]
    pub timeout_secs: u64,
}

fn default_command_timeout_secs() -> u64 {
    120
}

/// Texts Switchboard itself sends to users.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Messages {
    /// When a run fails.
    #[serde(default = "default_msg_run_failed")]
    pub run_failed: String,
    /// When a run takes longer than its runtime's `run_timeout_secs`.
    #[serde(default = "default_msg_run_timeout")]
    pub run_timeout: String,
    /// When the runtime stays unreachable longer than
    /// `submitter.unreachable_notice_secs` (the message is still answered
    /// once it is reachable again).
    #[serde(default = "default_msg_runtime_unreachable")]
    pub runtime_unreachable: String,
    /// When a conversation already has `max_queued_inputs` waiting.
    #[serde(default = "default_msg_queue_full")]
    pub queue_full: String,
    /// Appended to the partial answer of an interrupted run.
    #[serde(default = "default_msg_interrupted_marker")]
    pub interrupted_marker: String,
    /// What a streaming preview becomes when its run is superseded.
    #[serde(default = "default_msg_discarded_marker")]
    pub discarded_marker: String,
    /// The confirmation of `/stop`.
    #[serde(default = "default_msg_stopped")]
    pub stopped: String,
    /// The confirmation of `/new`.
    #[serde(default = "default_msg_new_conversation")]
    pub new_conversation: String,
    /// The answer to `/help`.
    #[serde(default = "default_msg_help")]
    pub help: String,
    /// To an unknown user under the `pairing` policy; `{code}` and
    /// `{minutes}` are filled in.
    #[serde(default = "default_msg_pairing")]
    pub pairing: String,
    /// To a user not on the `allowlist`.
    #[serde(default = "default_msg_not_allowed")]
    pub not_allowed: String,
}

impl Default for Messages {
    fn default() -> Self {
        Messages {
            run_failed: default_msg_run_failed(),
            run_timeout: default_msg_run_timeout(),
            runtime_unreachable: default_msg_runtime_unreachable(),
            queue_full: default_msg_queue_full(),
            interrupted_marker: default_msg_interrupted_marker(),
            discarded_marker: default_msg_discarded_marker(),
            stopped: default_msg_stopped(),
            new_conversation: default_msg_new_conversation(),
            help: default_msg_help(),
            pairing: default_msg_pairing(),
            not_allowed: default_msg_not_allowed(),
        }
    }
}

fn default_msg_run_failed() -> String {
    "Sorry, something went wrong and I could not answer that.".into()
}
fn default_msg_run_timeout() -> String {
    "Sorry, that took too long and I gave up on it.".into()
}
fn default_msg_runtime_unreachable() -> String {
    "I can't reach my runtime right now. I'll answer as soon as I can.".into()
}
fn default_msg_queue_full() -> String {
    "Too many of your messages are waiting for an answer; this one was not accepted. Please wait and send it again.".into()
}
fn default_msg_interrupted_marker() -> String {
    "[interrupted]".into()
}
fn default_msg_discarded_marker() -> String {
    "[discarded]".into()
}
fn default_msg_stopped() -> String {
    "Stopped.".into()
}
fn default_msg_new_conversation() -> String {
    "Started a new conversation.".into()
}
fn default_msg_pairing() -> String {
    "Hi! I don't know you yet. Ask my operator to approve you with: switchboard pair approve {code} (the code is valid for {minutes} minutes).".into()
}
fn default_msg_not_allowed() -> String {
    "Sorry, I only talk to people on my list.".into()
}
fn default_msg_help() -> String {
    "Commands:\n/stop - stop the current answer and drop the messages waiting for one\n/new - start a new conversation\n/remind in 10m <text> | at 2026-12-24 18:00 <text> | every \"0 9 * * MON-FRI\" <text> - set a reminder\n/schedules - this chat's reminders\n/cancel <id> - cancel one\n/timezone Europe/Berlin - set this chat's time zone\n/help - this list".into()
}

/// One channel account.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ChannelConfig {
    /// The generic HTTP channel.
    Webhook(WebhookChannelConfig),
    /// A Telegram bot.
    Telegram(TelegramChannelConfig),
    /// A Discord bot.
    Discord(DiscordChannelConfig),
}

impl ChannelConfig {
    pub fn runtime(&self) -> &str {
        match self {
            ChannelConfig::Webhook(c) => &c.runtime,
            ChannelConfig::Telegram(c) => &c.runtime,
            ChannelConfig::Discord(c) => &c.runtime,
        }
    }

    pub fn access(&self) -> &AccessConfig {
        match self {
            ChannelConfig::Webhook(c) => &c.access,
            ChannelConfig::Telegram(c) => &c.access,
            ChannelConfig::Discord(c) => &c.access,
        }
    }

    pub fn overrides(&self) -> Overrides<'_> {
        match self {
            ChannelConfig::Webhook(c) => Overrides {
                surfaces: &c.surfaces,
                chats: &c.chats,
            },
            ChannelConfig::Telegram(c) => Overrides {
                surfaces: &c.surfaces,
                chats: &c.chats,
            },
            ChannelConfig::Discord(c) => Overrides {
                surfaces: &c.surfaces,
                chats: &c.chats,
            },
        }
    }
}

/// `[channels.NAME] kind = "telegram"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelegramChannelConfig {
    /// Name of the runtime (`[runtimes.NAME]`) this bot talks to.
    pub runtime: String,
    /// The bot token from @BotFather. Prefer `token_file` or the
    /// environment (`SWITCHBOARD__CHANNELS__NAME__TOKEN`).
    #[serde(default)]
    pub token: Option<String>,
    /// A file holding the token (relative paths are looked up in
    /// `$CREDENTIALS_DIRECTORY` when set).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// The Bot API base URL (a local Bot API server, or a test fake).
    #[serde(default = "default_telegram_api_url")]
    pub api_url: String,
    /// `polling` (getUpdates; works anywhere) or `webhook` (Telegram POSTs
    /// to `webhook_url`, which must reach `/telegram/NAME` on
    /// `server.listen`).
    #[serde(default)]
    pub mode: TelegramMode,
    /// The public https URL Telegram POSTs updates to (`mode = "webhook"`).
    #[serde(default)]
    pub webhook_url: Option<String>,
    /// The `secret_token` the webhook is registered with (1-256 of
    /// `A-Za-z0-9_-`). Default: derived from the token.
    #[serde(default)]
    pub webhook_secret: Option<String>,
    /// Seconds one getUpdates long poll waits.
    #[serde(default = "default_poll_timeout_secs")]
    pub poll_timeout_secs: u64,
    /// Seconds any other Bot API request may take; a send that takes longer
    /// is ambiguous.
    #[serde(default = "default_telegram_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Edited messages: `ignore` (journaled with the reason) or `new-input`.
    #[serde(default)]
    pub edits: TelegramEdits,
    /// Replies quote the message they answer.
    #[serde(default = "default_true")]
    pub reply_references: bool,
    /// Stream answers in private chats as drafts (`sendMessageDraft`)
    /// instead of an edited preview message.
    #[serde(default)]
    pub drafts: bool,
    /// Surface settings for this account only, by surface name.
    #[serde(default)]
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    /// Surface settings for single chats of this account, by chat id.
    #[serde(default)]
    pub chats: BTreeMap<String, SurfaceSettings>,
    /// Who may talk to the bot.
    #[serde(default)]
    pub access: AccessConfig,
}

/// `[channels.NAME] kind = "discord"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscordChannelConfig {
    /// Name of the runtime (`[runtimes.NAME]`) this bot talks to.
    pub runtime: String,
    /// The bot token (Developer Portal → Bot → Reset Token). Prefer
    /// `token_file` or `SWITCHBOARD__CHANNELS__NAME__TOKEN`.
    #[serde(default)]
    pub token: Option<String>,
    /// A file holding the token (relative paths are looked up in
    /// `$CREDENTIALS_DIRECTORY` when set).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Discord's base URL (REST under `/api/v10`; a test fake).
    #[serde(default = "default_discord_api_url")]
    pub api_url: String,
    /// Edited messages: `ignore` (journaled with the reason) or `new-input`.
    #[serde(default)]
    pub edits: TelegramEdits,
    /// Take other bots' and webhooks' messages as inputs.
    #[serde(default)]
    pub allow_bots: bool,
    /// Replies reference the message they answer.
    #[serde(default = "default_true")]
    pub reply_references: bool,
    /// Run shards `range[0]..=range[1]` of `total` in this process.
    #[serde(default)]
    pub shards: Option<ShardsConfig>,
    /// Gap backfill: channels whose latest journaled message is older than
    /// this many hours are not re-read after a reconnect.
    #[serde(default = "default_backfill_max_age_hours")]
    pub backfill_max_age_hours: u64,
    /// Gap backfill: at most this many channels, the most recent first.
    #[serde(default = "default_backfill_max_channels")]
    pub backfill_max_channels: usize,
    /// Gap backfill: at most this many messages per channel and gap.
    #[serde(default = "default_backfill_max_messages")]
    pub backfill_max_messages: usize,
    /// Seconds one REST request may take; a send that takes longer is
    /// ambiguous (and resent safely: creates carry a nonce).
    #[serde(default = "default_discord_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Surface settings for this account only, by surface name.
    #[serde(default)]
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    /// Surface settings for single channels of this account, by channel id.
    #[serde(default)]
    pub chats: BTreeMap<String, SurfaceSettings>,
    /// Who may talk to the bot.
    #[serde(default)]
    pub access: AccessConfig,
}

/// `shards = { range = [0, 1], total = 4 }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardsConfig {
    /// First and last shard (inclusive) run by this process.
    pub range: [u32; 2],
    pub total: u32,
}

fn default_discord_api_url() -> String {
    switchboard_discord::DEFAULT_API_URL.to_owned()
}

fn default_backfill_max_age_hours() -> u64 {
    24
}

fn default_backfill_max_channels() -> usize {
    100
}

fn default_backfill_max_messages() -> usize {
    200
}

fn default_discord_request_timeout_secs() -> u64 {
    15
}

impl DiscordChannelConfig {
    pub fn resolve_token(&self) -> Result<String, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(t.trim().to_owned()),
            (None, Some(path)) => read_secret_file(path),
            (None, None) => Err(
                "no token; set token_file (or token, or SWITCHBOARD__CHANNELS__NAME__TOKEN)".into(),
            ),
        }
    }

    pub fn settings(&self, name: &str) -> Result<switchboard_discord::DiscordSettings, String> {
        Ok(switchboard_discord::DiscordSettings {
            account: name.to_owned(),
            token: self.resolve_token()?,
            api_url: self.api_url.clone(),
            edits: match self.edits {
                TelegramEdits::Ignore => switchboard_discord::Edits::Ignore,
                TelegramEdits::NewInput => switchboard_discord::Edits::NewInput,
            },
            allow_bots: self.allow_bots,
            reply_references: self.reply_references,
            shards: self.shards.map(|s| (s.range[0], s.range[1], s.total)),
            backfill: switchboard_discord::Backfill {
                max_age: Duration::from_secs(self.backfill_max_age_hours * 3600),
                max_channels: self.backfill_max_channels,
                max_messages: self.backfill_max_messages,
            },
            request_timeout: Duration::from_secs(self.request_timeout_secs),
        })
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TelegramMode {
    #[default]
    Polling,
    Webhook,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TelegramEdits {
    #[default]
    Ignore,
    NewInput,
}

fn default_telegram_api_url() -> String {
    switchboard_telegram::DEFAULT_API_URL.to_owned()
}

fn default_poll_timeout_secs() -> u64 {
    30
}

fn default_telegram_request_timeout_secs() -> u64 {
    20
}

fn default_true() -> bool {
    true
}

impl TelegramChannelConfig {
    /// The token, from `token` or `token_file`.
    pub fn resolve_token(&self) -> Result<String, String> {
        match (&self.token, &self.token_file) {
            (Some(t), _) => Ok(t.trim().to_owned()),
            (None, Some(path)) => read_secret_file(path),
            (None, None) => Err(
                "no token; set token_file (or token, or SWITCHBOARD__CHANNELS__NAME__TOKEN)".into(),
            ),
        }
    }

    /// The adapter's settings. `commands` is the menu to register.
    pub fn settings(
        &self,
        name: &str,
        commands: Vec<(String, String)>,
    ) -> Result<switchboard_telegram::TelegramSettings, String> {
        use switchboard_telegram::{Edits, Mode};
        let token = self.resolve_token()?;
        let mode = match self.mode {
            TelegramMode::Polling => Mode::Polling,
            TelegramMode::Webhook => Mode::Webhook {
                public_url: self.webhook_url.clone().unwrap_or_default(),
                secret: self
                    .webhook_secret
                    .clone()
                    .unwrap_or_else(|| switchboard_telegram::derived_webhook_secret(&token)),
            },
        };
        Ok(switchboard_telegram::TelegramSettings {
            account: name.to_owned(),
            token,
            api_url: self.api_url.clone(),
            mode,
            poll_timeout: Duration::from_secs(self.poll_timeout_secs),
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            edits: match self.edits {
                TelegramEdits::Ignore => Edits::Ignore,
                TelegramEdits::NewInput => Edits::NewInput,
            },
            reply_references: self.reply_references,
            drafts: self.drafts,
            commands,
        })
    }
}

/// Who may talk to a channel account (`[channels.NAME.access]`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessConfig {
    /// Private chats: `open` (anyone), `allowlist` (`allow_users` only) or
    /// `pairing` (an unknown user gets a code an operator approves with
    /// `switchboard pair approve CODE`). Default: `pairing` on Telegram and
    /// Discord, `open` on the webhook channel.
    #[serde(default)]
    pub dm_policy: Option<DmPolicy>,
    /// Users admitted in private chats under `allowlist` (platform user ids).
    #[serde(default)]
    pub allow_users: Vec<String>,
    /// Users always admitted, whatever the policy.
    #[serde(default)]
    pub owners: Vec<String>,
    /// Group chats the bot answers in (chat ids). Unset: none on Telegram
    /// and Discord, all on the webhook channel.
    #[serde(default)]
    pub groups: Option<Vec<String>>,
    /// Discord: guilds (server ids) whose every channel the bot answers in,
    /// besides the channels in `groups`.
    #[serde(default)]
    pub guilds: Vec<String>,
    /// In allowed groups: `mention` (answer only when mentioned or replied
    /// to; the default on Telegram and Discord) or `all`.
    #[serde(default)]
    pub group_trigger: Option<GroupTrigger>,
    /// Minutes a pairing code stays valid (default 60).
    #[serde(default)]
    pub pairing_ttl_minutes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DmPolicy {
    Open,
    Allowlist,
    Pairing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupTrigger {
    Mention,
    All,
}

/// A channel account's surface overrides.
pub struct Overrides<'a> {
    /// By surface name.
    pub surfaces: &'a BTreeMap<String, SurfaceSettings>,
    /// By platform chat id.
    pub chats: &'a BTreeMap<String, SurfaceSettings>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookChannelConfig {
    /// Name of the runtime (`[runtimes.NAME]`) this account talks to.
    pub runtime: String,
    /// Where replies are POSTed.
    pub callback_url: String,
    /// Shared secret required in `X-Switchboard-Secret` (optional).
    #[serde(default)]
    pub secret: Option<String>,
    /// A file holding the shared secret (relative paths are looked up in
    /// `$CREDENTIALS_DIRECTORY` when set).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Seconds one callback POST may take before its outcome is ambiguous.
    #[serde(default = "default_callback_timeout_secs")]
    pub callback_timeout_secs: u64,
    /// Longest reply text one callback carries, in characters; longer
    /// answers are split into several replies (at paragraphs, lines,
    /// words; code fences closed and reopened).
    #[serde(default = "default_max_reply_chars")]
    pub max_reply_chars: usize,
    /// Key for signing reply callbacks (HMAC-SHA256 over the timestamp and
    /// the body, in `X-Switchboard-Signature`); unset: unsigned. Prefer
    /// `callback_signing_secret_file` or the environment.
    #[serde(default)]
    pub callback_signing_secret: Option<String>,
    #[serde(default)]
    pub callback_signing_secret_file: Option<PathBuf>,
    /// Surface settings for this account only, by surface name.
    #[serde(default)]
    pub surfaces: BTreeMap<String, SurfaceSettings>,
    /// Surface settings for single chats of this account, by chat id.
    #[serde(default)]
    pub chats: BTreeMap<String, SurfaceSettings>,
    /// Who may talk to the bot.
    #[serde(default)]
    pub access: AccessConfig,
}

fn default_callback_timeout_secs() -> u64 {
    10
}

fn default_max_reply_chars() -> usize {
    65_536
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// Sends that may be in flight at once (across all lanes).
    #[serde(default = "default_outbox_concurrency")]
    pub concurrency: usize,
    /// `NotSent` attempts before an item is `failed`.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// First retry delay after `NotSent`, in milliseconds; doubles per
    /// attempt with jitter.
    #[serde(default = "default_backoff_base_ms")]
    pub backoff_base_ms: u64,
    /// Largest retry delay, in milliseconds.
    #[serde(default = "default_backoff_cap_ms")]
    pub backoff_cap_ms: u64,
    /// How long a claim (lease) lasts, in seconds. A possibly-dispatched item
    /// whose lease has run out is reconciled by its surface's
    /// `on_ambiguous_send`.
    #[serde(default = "default_lease_secs")]
    pub lease_secs: u64,
    /// After an ambiguous send, seconds to wait before reconciling it.
    #[serde(default = "default_reconcile_after_secs")]
    pub reconcile_after_secs: u64,
    /// How often the reconciler looks for expired leases, in seconds.
    #[serde(default = "default_reconcile_interval_secs")]
    pub reconcile_interval_secs: u64,
    /// Streaming surfaces: at most one transient edit of a preview per chat
    /// this often, in milliseconds.
    #[serde(default = "default_edit_interval_ms")]
    pub edit_interval_ms: u64,
    /// Terminal-only surfaces: how often the typing indicator is renewed
    /// while a run is active, in milliseconds.
    #[serde(default = "default_typing_interval_ms")]
    pub typing_interval_ms: u64,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            concurrency: default_outbox_concurrency(),
            max_attempts: default_max_attempts(),
            backoff_base_ms: default_backoff_base_ms(),
            backoff_cap_ms: default_backoff_cap_ms(),
            lease_secs: default_lease_secs(),
            reconcile_after_secs: default_reconcile_after_secs(),
            reconcile_interval_secs: default_reconcile_interval_secs(),
            edit_interval_ms: default_edit_interval_ms(),
            typing_interval_ms: default_typing_interval_ms(),
        }
    }
}

fn default_outbox_concurrency() -> usize {
    128
}
fn default_max_attempts() -> u32 {
    8
}
fn default_backoff_base_ms() -> u64 {
    500
}
fn default_backoff_cap_ms() -> u64 {
    5 * 60 * 1000
}
fn default_lease_secs() -> u64 {
    60
}
fn default_reconcile_after_secs() -> u64 {
    30
}
fn default_reconcile_interval_secs() -> u64 {
    5
}
fn default_edit_interval_ms() -> u64 {
    1000
}
fn default_typing_interval_ms() -> u64 {
    4000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitterConfig {
    /// Journal rows read per round.
    #[serde(default = "default_submit_batch")]
    pub batch_size: usize,
    /// Seconds between retries while the runtime refuses submissions.
    #[serde(default = "default_submit_retry_secs")]
    pub retry_secs: u64,
    /// Seconds a message may wait on an unreachable runtime before its
    /// sender is told (`messages.runtime_unreachable`).
    #[serde(default = "default_unreachable_notice_secs")]
    pub unreachable_notice_secs: u64,
}

impl Default for SubmitterConfig {
    fn default() -> Self {
        SubmitterConfig {
            batch_size: default_submit_batch(),
            retry_secs: default_submit_retry_secs(),
            unreachable_notice_secs: default_unreachable_notice_secs(),
        }
    }
}

fn default_submit_batch() -> usize {
    512
}
fn default_submit_retry_secs() -> u64 {
    2
}
fn default_unreachable_notice_secs() -> u64 {
    60
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Seconds in-flight runs and sends get to finish after SIGTERM.
    #[serde(default = "default_grace_secs")]
    pub grace_secs: u64,
    /// Seconds to wait after aborting what the grace period did not settle.
    #[serde(default = "default_force_secs")]
    pub force_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            grace_secs: default_grace_secs(),
            force_secs: default_force_secs(),
        }
    }
}

fn default_grace_secs() -> u64 {
    30
}
fn default_force_secs() -> u64 {
    5
}

/// A configuration problem: the key that has it and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config file {path} has {} problem(s):\n{}", problems.len(), problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        path: String,
        problems: Vec<ConfigProblem>,
    },
}

/// The exit status for bad configuration (`EX_CONFIG` from sysexits.h);
/// the systemd unit does not restart on it.
pub const EXIT_CONFIG: i32 = 78;

impl Config {
    /// Read `path`, apply `SWITCHBOARD__...` environment overrides, and
    /// validate.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        if !path.exists() {
            return Err(ConfigError::Parse {
                path: shown,
                message: "no such file; pass --config PATH (see config/switchboard.toml)".into(),
            });
        }
        let raw = config::Config::builder()
            .add_source(config::File::from(path).format(config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix("SWITCHBOARD")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()
            .map_err(|e| ConfigError::Parse {
                path: shown.clone(),
                message: e.to_string(),
            })?;
        let config: Config = raw.try_deserialize().map_err(|e| ConfigError::Parse {
            path: shown.clone(),
            message: explain_serde(&e.to_string()),
        })?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config.publish())
        } else {
            Err(ConfigError::Invalid {
                path: shown,
                problems,
            })
        }
    }

    /// Parse a TOML string without environment overrides (tests, examples).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let raw = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()
            .map_err(|e| ConfigError::Parse {
                path: "<string>".into(),
                message: e.to_string(),
            })?;
        let config: Config = raw.try_deserialize().map_err(|e| ConfigError::Parse {
            path: "<string>".into(),
            message: explain_serde(&e.to_string()),
        })?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config.publish())
        } else {
            Err(ConfigError::Invalid {
                path: "<string>".into(),
                problems,
            })
        }
    }

    /// Every cross-reference and value problem, each naming its key.
    pub fn validate(&self) -> Vec<ConfigProblem> {
        let mut problems = Vec::new();
        let mut problem =
            |key: String, message: String| problems.push(ConfigProblem { key, message });

        if let Err(e) = self.store.location() {
            problem("store.url".into(), e);
        }
        if self.store.lease_secs < 3 {
            problem(
                "store.lease_secs".into(),
                format!(
                    "is {}, but a lease must last at least 3 seconds to be renewed in time (default 15)",
                    self.store.lease_secs
                ),
            );
        }
        if self.store.batch_size == 0 {
            problem("store.batch_size".into(), "must be at least 1".into());
        }
        if let Err(e) = parse_listen(&self.server.listen) {
            problem("server.listen".into(), e);
        }
        match parse_listen(&self.admin.listen) {
            Err(e) => problem("admin.listen".into(), e),
            Ok(addr)
                if !addr.ip().is_loopback()
                    && self.admin.token.is_none()
                    && self.admin.token_file.is_none() =>
            {
                problem(
                    "admin.listen".into(),
                    format!(
                        "{addr} is reachable from other machines, and the admin API can resolve held replies and read every message: set admin.token_file (or SWITCHBOARD__ADMIN__TOKEN) to require a bearer token, or listen on 127.0.0.1"
                    ),
                )
            }
            Ok(_) => {}
        }
        if matches!(&self.admin.token, Some(t) if t.len() < 16) {
            problem(
                "admin.token".into(),
                "is shorter than 16 characters; use a long random string (e.g. `openssl rand -hex 32`)".into(),
            );
        }
        if self.retention.journal_days < 7 {
            problem(
                "retention.journal_days".into(),
                "must be at least 7: journal keys deduplicate platform redeliveries, which can come a day late (Telegram keeps updates 24 h)".into(),
            );
        }
        if self.retention.payload_days > self.retention.journal_days {
            problem(
                "retention.payload_days".into(),
                "is longer than retention.journal_days; payloads go with their rows, so it would have no effect".into(),
            );
        }
        if self.retention.interval_minutes == 0 || self.retention.batch_size == 0 {
            problem(
                "retention.interval_minutes".into(),
                "retention.interval_minutes and retention.batch_size must be at least 1".into(),
            );
        }
        if self.server.body_limit < 1024 {
            problem(
                "server.body_limit".into(),
                "is below 1024 bytes; no useful update fits (the default is 1048576)".into(),
            );
        }
        if self.runtimes.is_empty() {
            problem(
                "runtimes".into(),
                "no runtime is configured; add [runtimes.default] with kind = \"local\" and model = { backend = \"echo\" }".into(),
            );
        }
        for (name, runtime) in &self.runtimes {
            if !valid_name(name) {
                problem(
                    format!("runtimes.{name}"),
                    "names may use lowercase letters, digits, '-' and '_'".into(),
                );
            }
            match runtime {
                RuntimeConfig::Http(http) => {
                    match reqwest::Url::parse(&http.base_url) {
                        Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
                        _ => problem(
                            format!("runtimes.{name}.base_url"),
                            format!(
                                "{:?} is not an http(s) URL; use e.g. \"http://127.0.0.1:8800\"",
                                http.base_url
                            ),
                        ),
                    }
                    if http.token.is_some() && http.token_file.is_some() {
                        problem(
                            format!("runtimes.{name}.token"),
                            "set either token or token_file, not both".into(),
                        );
                    }
                    if http.request_timeout_secs == 0 {
                        problem(
                            format!("runtimes.{name}.request_timeout_secs"),
                            "must be at least 1".into(),
                        );
                    }
                }
                RuntimeConfig::Local(local) => {
                    if local.max_concurrent_runs == 0 {
                        problem(
                            format!("runtimes.{name}.max_concurrent_runs"),
                            "must be at least 1".into(),
                        );
                    }
                    if local.run_timeout_secs == 0 {
                        problem(
                            format!("runtimes.{name}.run_timeout_secs"),
                            "must be at least 1".into(),
                        );
                    }
                    if local.history.max_turns > 1000 {
                        problem(
                            format!("runtimes.{name}.history.max_turns"),
                            "is above 1000; history is read per model call, keep it small".into(),
                        );
                    }
                    match &local.model {
                        ModelConfig::Echo(_) => {}
                        ModelConfig::Openai(o) => {
                            match reqwest::Url::parse(&o.base_url) {
                                Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
                                _ => problem(
                                    format!("runtimes.{name}.model.base_url"),
                                    format!(
                                        "{:?} is not an http(s) URL; use e.g. \"http://127.0.0.1:11434/v1\"",
                                        o.base_url
                                    ),
                                ),
                            }
                            if o.model.is_empty() {
                                problem(
                                    format!("runtimes.{name}.model.model"),
                                    "is empty; name the model the server serves".into(),
                                );
                            }
                            if o.api_key.is_some() && o.api_key_file.is_some() {
                                problem(
                                    format!("runtimes.{name}.model.api_key"),
                                    "set either api_key or api_key_file, not both".into(),
                                );
                            }
                        }
                        ModelConfig::Command(c) => {
                            if c.program.as_os_str().is_empty() {
                                problem(
                                    format!("runtimes.{name}.model.program"),
                                    "is empty; name the program to run".into(),
                                );
                            }
                            if c.timeout_secs == 0 {
                                problem(
                                    format!("runtimes.{name}.model.timeout_secs"),
                                    "must be at least 1".into(),
                                );
                            }
                        }
                    }
                }
            }
        }
        if let Some(serve) = &self.serve {
            match self.runtimes.get(&serve.runtime) {
                Some(RuntimeConfig::Local(_)) => {}
                Some(_) => problem(
                    "serve.runtime".into(),
                    format!(
                        "runtimes.{} is not a built-in (kind = \"local\") runtime; only those can be served",
                        serve.runtime
                    ),
                ),
                None => problem(
                    "serve.runtime".into(),
                    format!(
                        "{:?} names no runtime; add [runtimes.{}]",
                        serve.runtime, serve.runtime
                    ),
                ),
            }
            match parse_listen(&serve.listen) {
                Err(e) => problem("serve.listen".into(), e),
                Ok(addr)
                    if !addr.ip().is_loopback()
                        && serve.token.is_none()
                        && serve.token_file.is_none() =>
                {
                    problem(
                        "serve.listen".into(),
                        format!(
                            "{addr} is reachable from other machines; set serve.token_file (a bearer token clients must send) or listen on 127.0.0.1"
                        ),
                    )
                }
                Ok(_) => {}
            }
        }
        if self.channels.is_empty() && self.serve.is_none() {
            problem(
                "channels".into(),
                "no channel account is configured; add [channels.NAME] with kind = \"webhook\", \"telegram\" or \"discord\""
                    .into(),
            );
        }
        let mut telegram_bots: BTreeMap<String, String> = BTreeMap::new();
        for (name, channel) in &self.channels {
            if !valid_name(name) {
                problem(
                    format!("channels.{name}"),
                    "names may use lowercase letters, digits, '-' and '_' (they appear in URLs and environment variables)".into(),
                );
            }
            if !self.runtimes.contains_key(channel.runtime()) {
                let known: Vec<&str> = self.runtimes.keys().map(String::as_str).collect();
                problem(
                    format!("channels.{name}.runtime"),
                    format!(
                        "{:?} names no runtime; add [runtimes.{}] or use one of: {}",
                        channel.runtime(),
                        channel.runtime(),
                        if known.is_empty() {
                            "(none configured)".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
            }
            for surface in channel.overrides().surfaces.keys() {
                if SurfaceKind::parse(surface).is_none() {
                    problem(
                        format!("channels.{name}.surfaces.{surface}"),
                        format!(
                            "is not a surface; use one of: {}",
                            SurfaceKind::ALL
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                }
            }
            match channel {
                ChannelConfig::Webhook(w) => {
                    match reqwest::Url::parse(&w.callback_url) {
                        Ok(url) if url.scheme() == "http" || url.scheme() == "https" => {}
                        Ok(url) => problem(
                            format!("channels.{name}.callback_url"),
                            format!("scheme {:?} is not http or https", url.scheme()),
                        ),
                        Err(e) => problem(
                            format!("channels.{name}.callback_url"),
                            format!(
                                "{:?} is not a URL ({e}); use e.g. \"http://127.0.0.1:8090/replies\"",
                                w.callback_url
                            ),
                        ),
                    }
                    if w.secret.is_some() && w.secret_file.is_some() {
                        problem(
                            format!("channels.{name}.secret"),
                            "set either secret or secret_file, not both".into(),
                        );
                    }
                    if matches!(&w.secret, Some(s) if s.is_empty()) {
                        problem(
                            format!("channels.{name}.secret"),
                            "is empty; remove it to accept unauthenticated updates, or set a secret".into(),
                        );
                    }
                    if w.max_reply_chars < 64 {
                        problem(
                            format!("channels.{name}.max_reply_chars"),
                            "is below 64; replies that short cannot hold a code fence line".into(),
                        );
                    }
                    if w.callback_timeout_secs == 0 {
                        problem(
                            format!("channels.{name}.callback_timeout_secs"),
                            "must be at least 1".into(),
                        );
                    }
                }
                ChannelConfig::Telegram(t) => {
                    validate_telegram(name, t, &mut problem, &mut telegram_bots)
                }
                ChannelConfig::Discord(d) => {
                    validate_discord(name, d, &mut problem, &mut telegram_bots)
                }
            }
        }
        for (name, settings) in &self.surfaces {
            if SurfaceKind::parse(name).is_none() {
                problem(
                    format!("surfaces.{name}"),
                    format!(
                        "is not a surface; use one of: {}",
                        SurfaceKind::ALL
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
            }
            let _ = settings;
        }
        if self.outbox.concurrency == 0 {
            problem("outbox.concurrency".into(), "must be at least 1".into());
        }
        if self.outbox.max_attempts == 0 {
            problem("outbox.max_attempts".into(), "must be at least 1".into());
        }
        if self.outbox.lease_secs == 0 {
            problem("outbox.lease_secs".into(), "must be at least 1".into());
        }
        if crate::store::MissedPolicy::parse(&self.scheduler.default_missed).is_none() {
            problem(
                "scheduler.default_missed".into(),
                format!(
                    "{:?} is not a missed-run policy; use skip, fire-once or fire-all",
                    self.scheduler.default_missed
                ),
            );
        }
        if self.scheduler.max_attempts < 1 {
            problem("scheduler.max_attempts".into(), "must be at least 1".into());
        }
        if self.submitter.batch_size == 0 {
            problem("submitter.batch_size".into(), "must be at least 1".into());
        }
        problems
    }

    /// The settings of a surface: built-in defaults, then `[surfaces.NAME]`.
    pub fn surface(&self, kind: SurfaceKind) -> ResolvedSurface {
        let live = self.live.0.load();
        let configured = live
            .surfaces
            .get(kind.as_str())
            .cloned()
            .unwrap_or_default();
        ResolvedSurface::resolve(kind, &configured)
    }

    /// The settings for one chat: built-in defaults, then `[surfaces.NAME]`,
    /// then the account's `[channels.ACCOUNT.surfaces.NAME]`, then its
    /// `[channels.ACCOUNT.chats."CHAT"]`.
    pub fn surface_for(&self, account: &str, kind: SurfaceKind, chat_id: &str) -> ResolvedSurface {
        let live = self.live.0.load();
        let mut settings = live
            .surfaces
            .get(kind.as_str())
            .cloned()
            .unwrap_or_default();
        if let Some(channel) = live.channels.get(account) {
            if let Some(s) = channel.surfaces.get(kind.as_str()) {
                settings = settings.overlay(s);
            }
            if let Some(s) = channel.chats.get(chat_id) {
                settings = settings.overlay(s);
            }
        }
        ResolvedSurface::resolve(kind, &settings)
    }

    /// A channel account's access rules as they are now (SIGHUP reloads
    /// them).
    pub fn access_for(&self, account: &str) -> Option<AccessConfig> {
        self.live
            .0
            .load()
            .channels
            .get(account)
            .map(|c| c.access.clone())
    }

    /// Make this config's reloadable settings the live ones (done by
    /// [`Config::load`] and [`Config::from_toml`]).
    fn publish(self) -> Config {
        self.live.0.store(Arc::new(PolicySet::of(&self)));
        self
    }

    /// Apply what can change without a restart from `new` (a freshly loaded
    /// file) and name what cannot. Only the reloadable parts of `self`
    /// change; everything else keeps running as it started.
    pub fn reload_from(&self, new: &Config) -> ReloadReport {
        let mut report = ReloadReport::default();
        let old = self.live.0.load_full();
        let next = PolicySet::of(new);
        let differs = |a: &dyn fmt::Debug, b: &dyn fmt::Debug| format!("{a:?}") != format!("{b:?}");
        for name in old.surfaces.keys().chain(next.surfaces.keys()) {
            if differs(&old.surfaces.get(name), &next.surfaces.get(name))
                && !report.applied.contains(&format!("surfaces.{name}"))
            {
                report.applied.push(format!("surfaces.{name}"));
            }
        }
        for (name, channel) in &next.channels {
            let Some(before) = old.channels.get(name) else {
                continue;
            };
            for (key, a, b) in [
                (
                    "surfaces",
                    &before.surfaces as &dyn fmt::Debug,
                    &channel.surfaces as &dyn fmt::Debug,
                ),
                ("chats", &before.chats, &channel.chats),
                ("access", &before.access, &channel.access),
            ] {
                if differs(a, b) {
                    report.applied.push(format!("channels.{name}.{key}"));
                }
            }
        }
        // Everything else needs a restart; channels are compared without
        // their reloadable parts.
        let strip = |c: &ChannelConfig| {
            let text = format!("{c:?}");
            text.split("surfaces:")
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        let sections: [(&str, String, String); 11] = [
            (
                "serve",
                format!("{:?}", self.serve),
                format!("{:?}", new.serve),
            ),
            (
                "retention",
                format!("{:?}", self.retention),
                format!("{:?}", new.retention),
            ),
            (
                "store",
                format!("{:?}", self.store),
                format!("{:?}", new.store),
            ),
            (
                "server",
                format!("{:?}", self.server),
                format!("{:?}", new.server),
            ),
            (
                "admin",
                format!("{:?}", self.admin),
                format!("{:?}", new.admin),
            ),
            (
                "runtimes",
                format!("{:?}", self.runtimes),
                format!("{:?}", new.runtimes),
            ),
            (
                "outbox",
                format!("{:?}", self.outbox),
                format!("{:?}", new.outbox),
            ),
            (
                "submitter",
                format!("{:?}", self.submitter),
                format!("{:?}", new.submitter),
            ),
            (
                "shutdown",
                format!("{:?}", self.shutdown),
                format!("{:?}", new.shutdown),
            ),
            (
                "messages",
                format!("{:?}", self.messages),
                format!("{:?}", new.messages),
            ),
            (
                "scheduler",
                format!("{:?}", self.scheduler),
                format!("{:?}", new.scheduler),
            ),
        ];
        for (key, a, b) in sections {
            if a != b {
                report.needs_restart.push(key.to_owned());
            }
        }
        for name in self.channels.keys().chain(new.channels.keys()) {
            let changed = match (self.channels.get(name), new.channels.get(name)) {
                (Some(a), Some(b)) => strip(a) != strip(b),
                _ => true,
            };
            let key = format!("channels.{name}");
            if changed && !report.needs_restart.contains(&key) {
                report.needs_restart.push(key);
            }
        }
        // Accounts that only exist after a restart get their policies then.
        let mut applied = next;
        applied
            .channels
            .retain(|name, _| self.channels.contains_key(name));
        for (name, policy) in &old.channels {
            applied
                .channels
                .entry(name.clone())
                .or_insert_with(|| policy.clone());
        }
        self.live.0.store(Arc::new(applied));
        report
    }
}

/// A surface's effective settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedSurface {
    pub input_policy: InputPolicy,
    pub delivery: Delivery,
    pub on_ambiguous_send: OnAmbiguousSend,
    pub coalesce_pending: bool,
    pub max_queued_inputs: usize,
    pub soft_interrupt: bool,
}

impl ResolvedSurface {
    fn resolve(kind: SurfaceKind, settings: &SurfaceSettings) -> ResolvedSurface {
        let defaults = kind.defaults();
        ResolvedSurface {
            input_policy: settings.input_policy.unwrap_or(defaults.input_policy),
            delivery: settings.delivery.unwrap_or(defaults.delivery),
            on_ambiguous_send: settings
                .on_ambiguous_send
                .unwrap_or(defaults.on_ambiguous_send),
            coalesce_pending: settings.coalesce_pending.unwrap_or(false),
            max_queued_inputs: settings
                .max_queued_inputs
                .unwrap_or(DEFAULT_MAX_QUEUED_INPUTS),
            soft_interrupt: settings.soft_interrupt.unwrap_or(false),
        }
    }

    /// The policy an input gets: the caller's when given, else this
    /// surface's, with `auto` answered by the surface's delivery: did anyone
    /// see the partial answer? On a streaming surface they did (`interrupt`);
    /// otherwise not (`supersede`).
    pub fn policy_for(&self, requested: Option<InputPolicy>) -> InputPolicy {
        match (requested.unwrap_or(self.input_policy), self.delivery) {
            (InputPolicy::Auto, Delivery::Streaming) => InputPolicy::Interrupt,
            (InputPolicy::Auto, Delivery::TerminalOnly) => InputPolicy::Supersede,
            (p, _) => p,
        }
    }
}

/// Where the store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    Sqlite(PathBuf),
    /// A `postgres://` (or `postgresql://`) connection URL.
    Postgres(String),
}

impl StoreConfig {
    pub fn location(&self) -> Result<StoreLocation, String> {
        if let Some(path) = self.url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(
                    "sqlite:// needs a file path, e.g. \"sqlite://data/switchboard.db\"".into(),
                );
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(path)));
        }
        if self.url.starts_with("postgres://") || self.url.starts_with("postgresql://") {
            return Ok(StoreLocation::Postgres(self.url.clone()));
        }
        Err(format!(
            "{:?} is not a supported store URL; use \"sqlite://PATH\" or \"postgres://USER@HOST:PORT/DB\"",
            self.url
        ))
    }
}

/// Parse a `"host:port"` listen address.
pub fn parse_listen(value: &str) -> Result<SocketAddr, String> {
    value.parse::<SocketAddr>().map_err(|_| {
        format!("{value:?} is not an address; write \"host:port\" with an IP host, e.g. \"127.0.0.1:8780\"")
    })
}

fn validate_telegram(
    name: &str,
    t: &TelegramChannelConfig,
    problem: &mut impl FnMut(String, String),
    bots: &mut BTreeMap<String, String>,
) {
    let key = |k: &str| format!("channels.{name}.{k}");
    match (&t.token, &t.token_file) {
        (Some(_), Some(_)) => problem(
            key("token"),
            "set either token or token_file, not both".into(),
        ),
        (None, None) => problem(
            key("token"),
            format!(
                "no bot token; set token_file (a file holding the token from @BotFather), token, or the environment variable SWITCHBOARD__CHANNELS__{}__TOKEN",
                name.to_uppercase()
            ),
        ),
        (Some(token), None) => match switchboard_telegram::identity(token.trim()) {
            Ok(identity) => {
                if let Some(other) = bots.insert(identity.clone(), name.to_owned()) {
                    problem(
                        key("token"),
                        format!(
                            "channels.{other} uses the same bot ({identity}); one bot can be one channel account only"
                        ),
                    );
                }
            }
            Err(e) => problem(key("token"), e),
        },
        // The file is read when the daemon starts (`check` warns when it cannot).
        (None, Some(_)) => {}
    }
    match reqwest::Url::parse(&t.api_url) {
        Ok(url) if url.scheme() == "http" || url.scheme() == "https" => {}
        _ => problem(
            key("api_url"),
            format!(
                "{:?} is not an http(s) URL; leave it out to use {}",
                t.api_url,
                switchboard_telegram::DEFAULT_API_URL
            ),
        ),
    }
    match (t.mode, &t.webhook_url) {
        (TelegramMode::Webhook, None) => problem(
            key("webhook_url"),
            format!(
                "mode = \"webhook\" needs the public https URL that reaches /telegram/{name} on server.listen (e.g. through a reverse proxy), or use mode = \"polling\""
            ),
        ),
        (TelegramMode::Webhook, Some(url)) => match reqwest::Url::parse(url) {
            Ok(u) if u.scheme() == "https" || u.scheme() == "http" => {}
            _ => problem(key("webhook_url"), format!("{url:?} is not an https URL")),
        },
        (TelegramMode::Polling, Some(_)) => problem(
            key("webhook_url"),
            "is only used with mode = \"webhook\"; remove it or set the mode".into(),
        ),
        (TelegramMode::Polling, None) => {}
    }
    if let Some(secret) = &t.webhook_secret
        && (secret.is_empty()
            || secret.len() > 256
            || !secret
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'))
    {
        problem(
            key("webhook_secret"),
            "must be 1-256 characters of A-Z, a-z, 0-9, '_' and '-' (Telegram's rule); or leave it out to derive one from the token".into(),
        );
    }
    if !(1..=50).contains(&t.poll_timeout_secs) {
        problem(
            key("poll_timeout_secs"),
            "must be between 1 and 50 seconds".into(),
        );
    }
    if t.request_timeout_secs == 0 {
        problem(key("request_timeout_secs"), "must be at least 1".into());
    }
}

fn validate_discord(
    name: &str,
    d: &DiscordChannelConfig,
    problem: &mut impl FnMut(String, String),
    bots: &mut BTreeMap<String, String>,
) {
    let key = |k: &str| format!("channels.{name}.{k}");
    match (&d.token, &d.token_file) {
        (Some(_), Some(_)) => problem(
            key("token"),
            "set either token or token_file, not both".into(),
        ),
        (None, None) => problem(
            key("token"),
            format!(
                "no bot token; set token_file (a file holding the token from the Developer Portal), token, or SWITCHBOARD__CHANNELS__{}__TOKEN",
                name.to_uppercase()
            ),
        ),
        (Some(token), None) => match switchboard_discord::identity(token.trim()) {
            Ok(identity) => {
                if let Some(other) = bots.insert(identity.clone(), name.to_owned()) {
                    problem(
                        key("token"),
                        format!(
                            "channels.{other} uses the same bot ({identity}); one bot can be one channel account only (split it with shards across processes instead)"
                        ),
                    );
                }
            }
            Err(e) => problem(key("token"), e),
        },
        (None, Some(_)) => {}
    }
    match reqwest::Url::parse(&d.api_url) {
        Ok(url) if url.scheme() == "http" || url.scheme() == "https" => {}
        _ => problem(
            key("api_url"),
            format!(
                "{:?} is not an http(s) URL; leave it out to use {}",
                d.api_url,
                switchboard_discord::DEFAULT_API_URL
            ),
        ),
    }
    if let Some(shards) = d.shards
        && (shards.total == 0
            || shards.range[0] > shards.range[1]
            || shards.range[1] >= shards.total)
    {
        problem(
            key("shards"),
            format!(
                "range {:?} of total {} is not a shard range; shards are numbered 0..total-1, e.g. {{ range = [0, 1], total = 4 }}",
                shards.range, shards.total
            ),
        );
    }
    if d.backfill_max_messages == 0 || d.backfill_max_channels == 0 {
        problem(
            key("backfill_max_messages"),
            "backfill_max_messages and backfill_max_channels must be at least 1 (messages missed during a gap are only found by backfill)".into(),
        );
    }
    if d.request_timeout_secs == 0 {
        problem(key("request_timeout_secs"), "must be at least 1".into());
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// serde's messages name the field but not always the fix; add the fix for
/// the commonest one.
fn explain_serde(message: &str) -> String {
    if message.contains("unknown field") {
        format!("{message}; remove the key or check its spelling against config/switchboard.toml")
    } else if message.contains("missing field") {
        format!("{message}; add it (every key is documented in config/switchboard.toml)")
    } else {
        message.to_owned()
    }
}

/// Read a secret from a file; a relative path is looked up in
/// `$CREDENTIALS_DIRECTORY` (systemd `LoadCredential=`) when that is set.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let full = match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) if path.is_relative() => Path::new(&dir).join(path),
        _ => path.to_owned(),
    };
    let text = std::fs::read_to_string(&full)
        .map_err(|e| format!("cannot read {}: {e}", full.display()))?;
    let secret = text.trim_end_matches(['\n', '\r']).to_owned();
    if secret.is_empty() {
        return Err(format!("{} is empty", full.display()));
    }
    Ok(secret)
}

impl WebhookChannelConfig {
    /// The shared secret, from `secret` or `secret_file`.
    pub fn resolve_secret(&self) -> Result<Option<String>, String> {
        match (&self.secret, &self.secret_file) {
            (Some(s), _) => Ok(Some(s.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The callback signing key, from the key or its file.
    pub fn resolve_signing_secret(&self) -> Result<Option<String>, String> {
        match (
            &self.callback_signing_secret,
            &self.callback_signing_secret_file,
        ) {
            (Some(s), _) => Ok(Some(s.clone())),
            (None, Some(path)) => read_secret_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    pub fn callback_timeout(&self) -> Duration {
        Duration::from_secs(self.callback_timeout_secs)
    }
}
