//! Switchboard's Telegram channel: the only crate that knows the Bot API.
//!
//! - **Ingress** ([`TelegramChannel::run`]): long polling with our own
//!   `getUpdates` loop, so an update is confirmed to Telegram (the next call's
//!   higher `offset`) only after its journal row is committed; or a webhook
//!   ([`webhook_router`]) that checks Telegram's secret header and answers 200
//!   only after the commit. Both turn raw update JSON into envelopes with
//!   [`convert`], so kinds no library knows are journaled as ignored rather
//!   than dropped.
//! - **Delivery** ([`ChannelAdapter`]): `sendMessage` with the runtime's
//!   Markdown rendered to Telegram HTML ([`render`]), falling back to plain
//!   text when Telegram rejects the entities; `editMessageText` for streaming
//!   previews; `sendMessageDraft` for drafts in private chats;
//!   `sendChatAction` for typing; `sendPhoto`/`sendDocument` for files.
//!   Errors map to the outbox's kinds (DESIGN.md §4).
//!
//! The account's identity is `telegram:<bot id>`. The bot id is the token's
//! prefix, which is what `getMe` reports for it (checked at start), so a
//! token for another bot never reuses this bot's journal keys.

pub mod convert;
pub mod render;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use switchboard_channel::{
    AccountStatus, AttachmentRef, Capabilities, ChannelAdapter, DeliveryError, FetchError,
    IngressError, IngressSink, LengthUnit, Limits, OutboundMessage, Platform, Rate, RateScope,
    Receipt, SendAction,
};
use teloxide::payloads::setters::*;
use teloxide::requests::Requester;
use teloxide::types::{
    BotCommand, CallbackQueryId, ChatAction, ChatId, FileId, InputFile, MessageId, ParseMode,
    ReplyParameters, ThreadId,
};
use teloxide::{ApiError, Bot, RequestError};
use tokio_util::sync::CancellationToken;

/// How often a process standing by for a bot's poller role asks again: a
/// dead poller is replaced within its lease plus this (the promise is the
/// lease plus 5 s; 2 s leaves room for a slow database and scheduling).
const POLLER_STANDBY_RETRY: Duration = Duration::from_secs(2);

pub use convert::{BotContext, Edits};

/// The public Bot API.
pub const DEFAULT_API_URL: &str = "https://api.telegram.org";

/// How the account receives updates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Long polling with `getUpdates`.
    Polling,
    /// Telegram POSTs updates to `public_url`, which must reach this
    /// daemon's `/telegram/<account>` route (directly or through a reverse
    /// proxy). `secret` is sent back in `X-Telegram-Bot-Api-Secret-Token`.
    Webhook { public_url: String, secret: String },
}

/// One Telegram account's settings, resolved by the core's config.
#[derive(Debug, Clone)]
pub struct TelegramSettings {
    /// The configured name (`[channels.NAME]`).
    pub account: String,
    pub token: String,
    /// The Bot API base URL, without `/bot<token>`.
    pub api_url: String,
    pub mode: Mode,
    /// How long one `getUpdates` call waits for updates.
    pub poll_timeout: Duration,
    /// The HTTP timeout of every other request (a send that times out is
    /// ambiguous).
    pub request_timeout: Duration,
    pub edits: Edits,
    /// Replies reference the user's message (`reply_parameters`).
    pub reply_references: bool,
    /// Stream previews in private chats as `sendMessageDraft` drafts.
    pub drafts: bool,
    /// The command menu registered with `setMyCommands`: `(name, description)`
    /// without the slash.
    pub commands: Vec<(String, String)>,
}

/// The secret a webhook is registered with when the config names none:
/// derived from the token (so every daemon sharing the token agrees and a
/// restart does not need to re-register), and useless without it.
pub fn derived_webhook_secret(token: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("switchboard telegram webhook secret\n{token}"));
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The store identity of the bot a token belongs to: `telegram:<bot id>`.
pub fn identity(token: &str) -> Result<String, String> {
    bot_id(token).map(|id| format!("telegram:{id}"))
}

fn bot_id(token: &str) -> Result<i64, String> {
    let (id, secret) = token.split_once(':').ok_or_else(|| {
        "a Telegram bot token looks like 123456789:AA... (from @BotFather); this one has no ':'"
            .to_owned()
    })?;
    if secret.is_empty() {
        return Err("the Telegram bot token has nothing after ':'".to_owned());
    }
    id.parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| "a Telegram bot token starts with the bot's numeric id, then ':'".to_owned())
}

/// A Telegram account: its outbound side, and its ingress loop.
pub struct TelegramChannel {
    settings: TelegramSettings,
    identity: String,
    bot_id: i64,
    bot: Bot,
    /// For the calls teloxide has no method for or parses too eagerly
    /// (`getUpdates` as raw JSON, `sendMessageDraft`, file downloads).
    http: reqwest::Client,
    /// The bot's username (lowercase), once `getMe` answered; until then
    /// webhook updates are refused so Telegram retries them.
    username: RwLock<String>,
}

/// Errors of the raw calls.
#[derive(Debug)]
enum RawError {
    /// Telegram answered `ok: false`.
    Api {
        code: i64,
        description: String,
        retry_after: Option<u64>,
    },
    /// No answer, or not Telegram's JSON.
    Transport(String),
}

impl std::fmt::Display for RawError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RawError::Api {
                code, description, ..
            } => write!(f, "{code} {description}"),
            RawError::Transport(e) => f.write_str(e),
        }
    }
}

impl TelegramChannel {
    pub fn new(settings: TelegramSettings) -> Result<TelegramChannel, String> {
        let bot_id = bot_id(&settings.token)?;
        let api_url = reqwest::Url::parse(&settings.api_url)
            .map_err(|e| format!("api_url {:?} is not a URL: {e}", settings.api_url))?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(settings.request_timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        let bot = Bot::with_client(settings.token.clone(), client).set_api_url(api_url);
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(TelegramChannel {
            identity: format!("telegram:{bot_id}"),
            bot_id,
            bot,
            http,
            username: RwLock::new(String::new()),
            settings,
        })
    }

    pub fn account(&self) -> &str {
        &self.settings.account
    }

    fn context(&self) -> BotContext {
        BotContext {
            account: self.settings.account.clone(),
            bot_id: self.bot_id,
            username: self.username.read().map(|u| u.clone()).unwrap_or_default(),
            edits: self.settings.edits,
        }
    }

    fn method_url(&self, method: &str) -> String {
        format!(
            "{}/bot{}/{method}",
            self.settings.api_url.trim_end_matches('/'),
            self.settings.token
        )
    }

    /// A Bot API call with a JSON body, answered as raw JSON.
    async fn call_raw(
        &self,
        method: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, RawError> {
        let response = self
            .http
            .post(self.method_url(method))
            .json(body)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| RawError::Transport(describe_reqwest(&e)))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| RawError::Transport(describe_reqwest(&e)))?;
        let value: Value = serde_json::from_str(&text).map_err(|_| {
            RawError::Transport(format!(
                "HTTP {status} with a body that is not Bot API JSON: {}",
                text.chars().take(120).collect::<String>()
            ))
        })?;
        if value["ok"].as_bool() == Some(true) {
            return Ok(value["result"].clone());
        }
        Err(RawError::Api {
            code: value["error_code"]
                .as_i64()
                .unwrap_or(i64::from(status.as_u16())),
            description: value["description"].as_str().unwrap_or_default().to_owned(),
            retry_after: value["parameters"]["retry_after"].as_u64(),
        })
    }

    /// Check the token, register the command menu and the webhook (or
    /// remove it, for polling), then receive updates until `stop`. A revoked
    /// token stops this account only, with the reason reported.
    pub async fn run(self: Arc<Self>, sink: Arc<dyn IngressSink>, stop: CancellationToken) {
        let account = self.settings.account.clone();
        sink.report_status(&account, AccountStatus::Starting);
        let mut backoff = Backoff::default();
        let no_arguments = json!({});
        let me = loop {
            let attempt = tokio::select! {
                _ = stop.cancelled() => return,
                me = self.call_raw("getMe", &no_arguments, self.settings.request_timeout) => me,
            };
            match attempt {
                Ok(me) => break me,
                Err(RawError::Api {
                    code: 401 | 404, ..
                }) => {
                    sink.report_status(&account, revoked(&account));
                    return;
                }
                Err(e) => {
                    let wait = backoff.next(retry_after(&e));
                    sink.report_status(
                        &account,
                        AccountStatus::Down(format!(
                            "getMe failed ({e}); retrying in {}s. Check channels.{account}.api_url and the network",
                            wait.as_secs()
                        )),
                    );
                    if sleep_or_stop(wait, &stop).await {
                        return;
                    }
                }
            }
        };
        if me["id"].as_i64() != Some(self.bot_id) {
            sink.report_status(
                &account,
                AccountStatus::Down(format!(
                    "getMe says this token belongs to bot {}, not {} as its prefix says; check channels.{account}.token",
                    me["id"], self.bot_id
                )),
            );
            return;
        }
        let username = me["username"].as_str().unwrap_or_default().to_lowercase();
        if let Ok(mut u) = self.username.write() {
            *u = username.clone();
        }
        tracing::info!(account = %account, bot = %format!("@{username}"), id = self.bot_id, "Telegram token checked");
        self.register_commands().await;
        match &self.settings.mode {
            Mode::Polling => self.poll(&*sink, &username, &stop).await,
            Mode::Webhook { public_url, secret } => {
                self.set_webhook(&*sink, &username, public_url, secret, &stop)
                    .await
            }
        }
    }

    async fn register_commands(&self) {
        let commands: Vec<BotCommand> = self
            .settings
            .commands
            .iter()
            .map(|(name, description)| BotCommand::new(name.clone(), description.clone()))
            .collect();
        if commands.is_empty() {
            return;
        }
        if let Err(e) = self.bot.set_my_commands(commands).await {
            // The menu is a convenience: commands work without it.
            tracing::warn!(account = %self.settings.account, error = %redact_token(&e.to_string()), "could not register the command menu");
        }
    }

    async fn set_webhook(
        &self,
        sink: &dyn IngressSink,
        username: &str,
        public_url: &str,
        secret: &str,
        stop: &CancellationToken,
    ) {
        let account = &self.settings.account;
        let mut backoff = Backoff::default();
        loop {
            let body = json!({"url": public_url, "secret_token": secret, "allowed_updates": []});
            match self
                .call_raw("setWebhook", &body, self.settings.request_timeout)
                .await
            {
                Ok(_) => {
                    sink.report_status(
                        account,
                        AccountStatus::Up(format!("webhook {public_url} as @{username}")),
                    );
                    return;
                }
                Err(RawError::Api {
                    code: 401 | 404, ..
                }) => {
                    sink.report_status(account, revoked(account));
                    return;
                }
                Err(RawError::Api {
                    code: 400,
                    description,
                    ..
                }) => {
                    sink.report_status(
                        account,
                        AccountStatus::Down(format!(
                            "Telegram refused the webhook {public_url}: {description}. Set channels.{account}.webhook_url to a public https URL that reaches /telegram/{account}"
                        )),
                    );
                    return;
                }
                Err(e) => {
                    let wait = backoff.next(retry_after(&e));
                    sink.report_status(
                        account,
                        AccountStatus::Down(format!(
                            "setWebhook failed ({e}); retrying in {}s",
                            wait.as_secs()
                        )),
                    );
                    if sleep_or_stop(wait, stop).await {
                        return;
                    }
                }
            }
        }
    }

    /// Wait until this process holds the bot's poller role (standing by,
    /// and saying so, while another process polls). `false` when stopping.
    async fn hold_poller(
        &self,
        sink: &dyn IngressSink,
        role: &str,
        username: &str,
        stop: &CancellationToken,
    ) -> bool {
        let account = &self.settings.account;
        let mut standing_by = false;
        loop {
            match sink.hold_role(role).await {
                Ok(true) => {
                    if standing_by {
                        tracing::info!(account = %account, "took over polling from another process");
                        sink.report_status(
                            account,
                            AccountStatus::Up(format!("polling as @{username}")),
                        );
                    }
                    return true;
                }
                Ok(false) if !standing_by => {
                    standing_by = true;
                    sink.report_status(
                        account,
                        AccountStatus::Up(format!(
                            "standing by: another process polls @{username}"
                        )),
                    );
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(account = %account, error = %e, "could not check the poller role; retrying");
                }
            }
            if sleep_or_stop(POLLER_STANDBY_RETRY, stop).await {
                return false;
            }
        }
    }

    /// The long-polling loop. The offset only moves past an update once its
    /// journal row is committed, so an update is never confirmed to Telegram
    /// before it is ours; after a crash Telegram sends the unconfirmed ones
    /// again and the journal deduplicates them.
    async fn poll(&self, sink: &dyn IngressSink, username: &str, stop: &CancellationToken) {
        let account = &self.settings.account;
        // A webhook and getUpdates exclude each other; keep pending updates.
        if let Err(e) = self
            .call_raw(
                "deleteWebhook",
                &json!({"drop_pending_updates": false}),
                self.settings.request_timeout,
            )
            .await
        {
            tracing::warn!(account = %account, error = %e, "deleteWebhook failed; getUpdates will say if a webhook is still set");
        }
        // Exactly one process polls a bot (Telegram answers 409 to a second
        // poller): processes sharing a store take turns through this role.
        let role = format!("poller:{}", self.identity);
        let mut offset: i64 = 0;
        let mut backoff = Backoff::default();
        let mut up = false;
        loop {
            if !self.hold_poller(sink, &role, username, stop).await {
                sink.release_role(&role).await;
                return;
            }
            let body = json!({
                "offset": offset,
                "timeout": self.settings.poll_timeout.as_secs(),
                "allowed_updates": [],
            });
            let request = self.call_raw(
                "getUpdates",
                &body,
                self.settings.poll_timeout + Duration::from_secs(15),
            );
            tokio::pin!(request);
            // The role is renewed while the long poll waits; a process that
            // lost it (it stalled past the lease) stops polling at once.
            let answer = loop {
                tokio::select! {
                    _ = stop.cancelled() => {
                        sink.release_role(&role).await;
                        return;
                    }
                    answer = &mut request => break Some(answer),
                    _ = tokio::time::sleep(sink.role_renewal()) => {
                        if !matches!(sink.hold_role(&role).await, Ok(true)) {
                            tracing::warn!(account = %account, "lost the poller role to another process; standing by");
                            break None;
                        }
                    }
                }
            };
            let Some(answer) = answer else {
                up = false;
                continue;
            };
            let updates = match answer {
                Ok(Value::Array(updates)) => updates,
                Ok(other) => {
                    tracing::warn!(account = %account, answer = %other, "getUpdates answered something that is not a list");
                    Vec::new()
                }
                Err(RawError::Api {
                    code: 401 | 404, ..
                }) => {
                    sink.report_status(account, revoked(account));
                    sink.release_role(&role).await;
                    return;
                }
                Err(e) => {
                    let wait = backoff.next(retry_after(&e));
                    let reason = match &e {
                        RawError::Api {
                            code: 409,
                            description,
                            ..
                        } => format!(
                            "getUpdates refused with 409 ({description}): another process polls this bot, or a webhook is set. Stop the other poller, or set channels.{account}.mode = \"webhook\"; retrying in {}s",
                            wait.as_secs()
                        ),
                        _ => format!("getUpdates failed ({e}); retrying in {}s", wait.as_secs()),
                    };
                    up = false;
                    sink.report_status(account, AccountStatus::Down(reason));
                    if sleep_or_stop(wait, stop).await {
                        sink.release_role(&role).await;
                        return;
                    }
                    continue;
                }
            };
            if !up {
                up = true;
                backoff = Backoff::default();
                sink.report_status(
                    account,
                    AccountStatus::Up(format!("polling as @{username}")),
                );
            }
            for update in updates {
                let Some(update_id) = update["update_id"].as_i64() else {
                    continue;
                };
                match self.ingest(sink, &update).await {
                    Ok(()) => offset = offset.max(update_id + 1),
                    // Shutting down: leave the update unconfirmed.
                    Err(IngressError::Unavailable(_)) => {
                        sink.release_role(&role).await;
                        return;
                    }
                    Err(IngressError::Store(e)) => {
                        tracing::error!(account = %account, error = %e, "could not journal a Telegram update; it stays unconfirmed and is fetched again");
                        if sleep_or_stop(backoff.next(None), stop).await {
                            sink.release_role(&role).await;
                            return;
                        }
                        break;
                    }
                    Err(e) => {
                        // Not an update we can ever store: recorded, then
                        // confirmed, so it cannot wedge the account.
                        sink.record_rejection(account, "unusable_update", &e.to_string());
                        offset = offset.max(update_id + 1);
                    }
                }
            }
        }
    }

    /// Journal one update; once committed, stop a pressed button spinning.
    async fn ingest(&self, sink: &dyn IngressSink, update: &Value) -> Result<(), IngressError> {
        let (envelope, callback) = convert::convert(&self.context(), update);
        sink.accept(envelope).await?;
        if let Some(id) = callback {
            let bot = self.bot.clone();
            tokio::spawn(async move {
                if let Err(e) = bot.answer_callback_query(CallbackQueryId(id)).await {
                    tracing::debug!(error = %redact_token(&e.to_string()), "answerCallbackQuery failed (the button spins until Telegram gives up)");
                }
            });
        }
        Ok(())
    }

    fn chat(&self, chat_id: &str) -> Result<ChatId, DeliveryError> {
        chat_id
            .parse::<i64>()
            .map(ChatId)
            .map_err(|_| DeliveryError::Permanent(format!("{chat_id:?} is not a Telegram chat id")))
    }

    async fn create(
        &self,
        chat: ChatId,
        message: &OutboundMessage,
    ) -> Result<Vec<String>, RequestError> {
        let mut ids = Vec::new();
        let text = message.text.trim();
        let single_caption = message.attachments.len() == 1 && text.encode_utf16().count() <= 1024;
        if !text.is_empty() && !single_caption {
            ids.push(self.send_text(chat, message).await?);
        }
        for (i, file) in message.attachments.iter().enumerate() {
            let caption = (single_caption && i == 0 && !text.is_empty()).then_some(text);
            ids.push(self.send_file(chat, message, file, caption).await?);
        }
        if ids.is_empty() {
            // An empty answer still tells the user something happened.
            let mut empty = message.clone();
            empty.text = "(empty answer)".to_owned();
            ids.push(self.send_text(chat, &empty).await?);
        }
        Ok(ids)
    }

    fn reply_parameters(&self, message: &OutboundMessage) -> Option<ReplyParameters> {
        let id = message.reply_to.as_deref()?.parse::<i32>().ok()?;
        self.settings.reply_references.then(|| ReplyParameters {
            allow_sending_without_reply: Some(true),
            ..ReplyParameters::new(MessageId(id))
        })
    }

    fn thread(message: &OutboundMessage) -> Option<ThreadId> {
        let id = message.thread_id.as_deref()?.parse::<i32>().ok()?;
        Some(ThreadId(MessageId(id)))
    }

    /// `sendMessage` as HTML; as plain text when Telegram rejects the
    /// entities (the Markdown could not be rendered into what it accepts).
    async fn send_text(
        &self,
        chat: ChatId,
        message: &OutboundMessage,
    ) -> Result<String, RequestError> {
        let html = render::to_html(&message.text);
        let mut request = self
            .bot
            .send_message(chat, html)
            .parse_mode(ParseMode::Html);
        if let Some(reply) = self.reply_parameters(message) {
            request = request.reply_parameters(reply);
        }
        if let Some(thread) = Self::thread(message) {
            request = request.message_thread_id(thread);
        }
        match request.await {
            Ok(sent) => Ok(sent.id.0.to_string()),
            Err(RequestError::Api(ApiError::CantParseEntities(why))) => {
                tracing::warn!(chat = %chat, %why, "Telegram rejected the formatting; sending plain text");
                let mut plain = self.bot.send_message(chat, message.text.clone());
                if let Some(reply) = self.reply_parameters(message) {
                    plain = plain.reply_parameters(reply);
                }
                if let Some(thread) = Self::thread(message) {
                    plain = plain.message_thread_id(thread);
                }
                Ok(plain.await?.id.0.to_string())
            }
            Err(e) => Err(e),
        }
    }

    /// A file by platform file id or URL: images with `sendPhoto`, anything
    /// else with `sendDocument`.
    async fn send_file(
        &self,
        chat: ChatId,
        message: &OutboundMessage,
        file: &AttachmentRef,
        caption: Option<&str>,
    ) -> Result<String, RequestError> {
        let input = match reqwest::Url::parse(&file.reference) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => InputFile::url(url),
            _ => InputFile::file_id(FileId(file.reference.clone())),
        };
        let photo = file
            .media_type
            .as_deref()
            .is_some_and(|t| t.starts_with("image/") && t != "image/webp" && t != "image/gif");
        let reply = self.reply_parameters(message);
        let thread = Self::thread(message);
        let sent = if photo {
            let mut request = self.bot.send_photo(chat, input);
            if let Some(c) = caption {
                request = request
                    .caption(render::to_html(c))
                    .parse_mode(ParseMode::Html);
            }
            if let Some(r) = reply {
                request = request.reply_parameters(r);
            }
            if let Some(t) = thread {
                request = request.message_thread_id(t);
            }
            request.await?
        } else {
            let mut request = self.bot.send_document(chat, input);
            if let Some(c) = caption {
                request = request
                    .caption(render::to_html(c))
                    .parse_mode(ParseMode::Html);
            }
            if let Some(r) = reply {
                request = request.reply_parameters(r);
            }
            if let Some(t) = thread {
                request = request.message_thread_id(t);
            }
            request.await?
        };
        Ok(sent.id.0.to_string())
    }

    async fn edit(
        &self,
        chat: ChatId,
        message_id: &str,
        message: &OutboundMessage,
    ) -> Result<Vec<String>, RequestError> {
        let Ok(id) = message_id.parse::<i32>() else {
            return self.create(chat, message).await;
        };
        let html = render::to_html(&message.text);
        let edited = match self
            .bot
            .edit_message_text(chat, MessageId(id), html)
            .parse_mode(ParseMode::Html)
            .await
        {
            Ok(_) | Err(RequestError::Api(ApiError::MessageNotModified)) => Ok(()),
            Err(RequestError::Api(ApiError::CantParseEntities(_))) => {
                match self
                    .bot
                    .edit_message_text(chat, MessageId(id), message.text.clone())
                    .await
                {
                    Ok(_) | Err(RequestError::Api(ApiError::MessageNotModified)) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        match edited {
            Ok(()) => {
                let mut ids = vec![message_id.to_owned()];
                for file in &message.attachments {
                    ids.push(self.send_file(chat, message, file, None).await?);
                }
                Ok(ids)
            }
            // The preview is gone (deleted by the user): the answer is sent
            // as a new message rather than lost.
            Err(RequestError::Api(ApiError::MessageToEditNotFound)) => {
                self.create(chat, message).await
            }
            Err(e) => Err(e),
        }
    }

    /// Download a file Telegram holds (`getFile`, then the file URL),
    /// refusing more than `max_bytes` before and while reading it.
    async fn download(&self, file_id: &str, max_bytes: u64) -> Result<Vec<u8>, FetchError> {
        let file = self
            .call_raw(
                "getFile",
                &json!({"file_id": file_id}),
                self.settings.request_timeout,
            )
            .await
            .map_err(|e| match e {
                RawError::Api {
                    code: 400,
                    description,
                    ..
                } => FetchError::NotFound(description),
                e => FetchError::Failed(e.to_string()),
            })?;
        if let Some(size) = file["file_size"].as_u64()
            && size > max_bytes
        {
            return Err(FetchError::TooLarge {
                size,
                limit: max_bytes,
            });
        }
        let path = file["file_path"].as_str().ok_or_else(|| {
            FetchError::Failed(
                "getFile gave no file_path (files over 20 MB cannot be downloaded by bots)".into(),
            )
        })?;
        let url = format!(
            "{}/file/bot{}/{path}",
            self.settings.api_url.trim_end_matches('/'),
            self.settings.token
        );
        let mut response = self
            .http
            .get(url)
            .timeout(self.settings.request_timeout * 3)
            .send()
            .await
            .map_err(|e| FetchError::Failed(describe_reqwest(&e)))?;
        if !response.status().is_success() {
            return Err(FetchError::Failed(format!("HTTP {}", response.status())));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| FetchError::Failed(describe_reqwest(&e)))?
        {
            bytes.extend_from_slice(&chunk);
            if bytes.len() as u64 > max_bytes {
                return Err(FetchError::TooLarge {
                    size: bytes.len() as u64,
                    limit: max_bytes,
                });
            }
        }
        Ok(bytes)
    }
}

#[async_trait]
impl ChannelAdapter for TelegramChannel {
    fn identity(&self) -> &str {
        &self.identity
    }

    fn platform(&self) -> Platform {
        Platform::Telegram
    }

    /// Telegram's published flood limits (Bot FAQ): about one message a
    /// second per chat with short bursts, 20 a minute per group, 30 a second
    /// overall. Text is limited to 4096 UTF-16 units after entity parsing.
    fn limits(&self) -> Limits {
        Limits {
            max_text_len: 4096,
            length_unit: LengthUnit::Utf16,
            per_chat: Some(Rate {
                per_second: 1.0,
                burst: 3,
            }),
            per_group: Some(Rate {
                per_second: 20.0 / 60.0,
                burst: 3,
            }),
            per_account: Some(Rate {
                per_second: 30.0,
                burst: 30,
            }),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            idempotent_send: false,
            edit: true,
            typing: true,
            drafts: self.settings.drafts,
        }
    }

    async fn send(&self, message: &OutboundMessage) -> Result<Receipt, DeliveryError> {
        let mut chat = self.chat(&message.chat_id)?;
        // A group that became a supergroup answers with its new id: the
        // message goes there (the journal moves the conversation when the
        // migration update arrives).
        for _ in 0..2 {
            let sent = match &message.action {
                SendAction::Create => self.create(chat, message).await,
                SendAction::Edit { message_id } => self.edit(chat, message_id, message).await,
            };
            match sent {
                Ok(message_ids) => return Ok(Receipt { message_ids }),
                Err(RequestError::MigrateToChatId(to)) if to != chat => {
                    tracing::info!(from = %chat, to = %to, "chat migrated; sending to its new id");
                    chat = to;
                }
                Err(e) => return Err(map_error(e)),
            }
        }
        Err(DeliveryError::Permanent(format!(
            "chat {} keeps migrating",
            message.chat_id
        )))
    }

    async fn typing(&self, chat_id: &str, thread_id: Option<&str>) -> Result<(), DeliveryError> {
        let chat = self.chat(chat_id)?;
        let mut request = self.bot.send_chat_action(chat, ChatAction::Typing);
        if let Some(thread) = thread_id.and_then(|t| t.parse::<i32>().ok()) {
            request = request.message_thread_id(ThreadId(MessageId(thread)));
        }
        request.await.map(|_| ()).map_err(map_error)
    }

    async fn draft(
        &self,
        chat_id: &str,
        thread_id: Option<&str>,
        draft_id: i64,
        text: &str,
    ) -> Result<(), DeliveryError> {
        let chat = self.chat(chat_id)?;
        let mut body = json!({
            "chat_id": chat.0,
            "draft_id": draft_id,
            "text": render::to_html(text),
            "parse_mode": "HTML",
        });
        if let Some(thread) = thread_id.and_then(|t| t.parse::<i64>().ok()) {
            body["message_thread_id"] = json!(thread);
        }
        match self
            .call_raw("sendMessageDraft", &body, self.settings.request_timeout)
            .await
        {
            Ok(_) => Ok(()),
            Err(RawError::Api {
                code: 429,
                retry_after,
                ..
            }) => Err(DeliveryError::RetryAfter {
                after: Duration::from_secs(retry_after.unwrap_or(1)),
                scope: RateScope::Chat,
            }),
            Err(e) => Err(DeliveryError::Permanent(e.to_string())),
        }
    }

    async fn fetch_attachment(
        &self,
        reference: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>, FetchError> {
        self.download(reference, max_bytes).await
    }
}

/// The outbox's view of a failed request (DESIGN.md §4).
fn map_error(error: RequestError) -> DeliveryError {
    match error {
        RequestError::RetryAfter(seconds) => DeliveryError::RetryAfter {
            after: seconds.duration(),
            scope: RateScope::Chat,
        },
        // The account is unusable until the token is fixed; the ingress loop
        // reports it down. Waiting keeps the replies for when it is.
        RequestError::Api(ApiError::InvalidToken) => DeliveryError::RetryAfter {
            after: Duration::from_secs(60),
            scope: RateScope::Account,
        },
        RequestError::Api(ApiError::Unknown(description)) if is_server_error(&description) => {
            DeliveryError::Ambiguous(description)
        }
        // Everything else Telegram answers is a refusal that a retry would
        // only repeat (blocked, chat not found, not enough rights, bad request).
        RequestError::Api(e) => DeliveryError::Permanent(e.to_string()),
        RequestError::MigrateToChatId(to) => {
            DeliveryError::Permanent(format!("the chat migrated to {to}"))
        }
        RequestError::Network(e) if e.is_connect() => DeliveryError::NotSent(describe_reqwest(&e)),
        RequestError::Network(e) if e.is_builder() => {
            DeliveryError::Permanent(describe_reqwest(&e))
        }
        RequestError::Network(e) => DeliveryError::Ambiguous(describe_reqwest(&e)),
        // Not Telegram's JSON (a proxy's 502 page): it may have been sent.
        RequestError::InvalidJson { raw, .. } => DeliveryError::Ambiguous(format!(
            "an answer that is not Bot API JSON: {}",
            raw.chars().take(120).collect::<String>()
        )),
        RequestError::Io(e) => DeliveryError::NotSent(e.to_string()),
    }
}

fn is_server_error(description: &str) -> bool {
    let d = description.to_ascii_lowercase();
    [
        "internal server error",
        "bad gateway",
        "gateway timeout",
        "service unavailable",
    ]
    .iter()
    .any(|s| d.contains(s))
}

fn describe_reqwest(e: &reqwest::Error) -> String {
    use std::error::Error;
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    redact_token(&text)
}

/// Every `/bot<token>` in a text (the token is part of every Bot API URL)
/// becomes `/bot<token>`, so no log line or error carries it.
fn redact_token(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("/bot") {
        out.push_str(&rest[..start + 4]);
        let after = &rest[start + 4..];
        let end = after.find(['/', ' ', ')', '"']).unwrap_or(after.len());
        out.push_str("<token>");
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn revoked(account: &str) -> AccountStatus {
    AccountStatus::Down(format!(
        "Telegram answered 401 Unauthorized: the token of channels.{account} is wrong or was revoked. Get a new one from @BotFather, update the config and restart; other accounts keep working"
    ))
}

fn retry_after(error: &RawError) -> Option<Duration> {
    match error {
        RawError::Api {
            retry_after: Some(s),
            ..
        } => Some(Duration::from_secs(*s)),
        _ => None,
    }
}

/// Waits between failed polls: 1 s doubling to 30 s, or what Telegram asks.
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    fn next(&mut self, asked: Option<Duration>) -> Duration {
        self.failures = self.failures.saturating_add(1);
        asked.unwrap_or_else(|| {
            Duration::from_secs(1u64 << self.failures.min(6).saturating_sub(1))
                .min(Duration::from_secs(30))
        })
    }
}

/// Sleep, unless stopped first (then `true`).
async fn sleep_or_stop(wait: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(wait) => false,
    }
}

struct WebhookState {
    channels: HashMap<String, Arc<TelegramChannel>>,
    sink: Arc<dyn IngressSink>,
}

/// The route Telegram POSTs updates to: `/telegram/<account>`, for every
/// webhook-mode account in `channels` (by configured name).
pub fn webhook_router(
    channels: HashMap<String, Arc<TelegramChannel>>,
    sink: Arc<dyn IngressSink>,
) -> Router {
    Router::new()
        .route("/telegram/{account}", post(webhook_update))
        .with_state(Arc::new(WebhookState { channels, sink }))
}

async fn webhook_update(
    State(state): State<Arc<WebhookState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let sink = &state.sink;
    let Some(channel) = state.channels.get(&account) else {
        sink.record_rejection(
            &account,
            "unknown_account",
            "no Telegram webhook account of that name",
        );
        return (
            StatusCode::NOT_FOUND,
            "no Telegram webhook account of that name\n",
        )
            .into_response();
    };
    let Mode::Webhook { secret, .. } = &channel.settings.mode else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let given = headers
        .get("x-telegram-bot-api-secret-token")
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if !bool::from(subtle::ConstantTimeEq::ct_eq(given, secret.as_bytes())) {
        sink.record_rejection(
            &account,
            "bad_secret",
            "X-Telegram-Bot-Api-Secret-Token is missing or wrong",
        );
        return (
            StatusCode::UNAUTHORIZED,
            "X-Telegram-Bot-Api-Secret-Token is missing or wrong\n",
        )
            .into_response();
    }
    if channel
        .username
        .read()
        .map(|u| u.is_empty())
        .unwrap_or(true)
    {
        // getMe has not answered yet: Telegram retries later.
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, "5")],
            "starting\n",
        )
            .into_response();
    }
    let update: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            sink.record_rejection(
                &account,
                "malformed_json",
                "the body is not a Telegram update object",
            );
            return (
                StatusCode::BAD_REQUEST,
                "the body is not a Telegram update object\n",
            )
                .into_response();
        }
    };
    match channel.ingest(&**sink, &update).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(IngressError::Unavailable(why)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, "5")],
            format!("{why}\n"),
        )
            .into_response(),
        Err(IngressError::Store(why)) => {
            (StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")).into_response()
        }
        Err(e) => {
            sink.record_rejection(&account, "unusable_update", &e.to_string());
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_come_from_the_token_prefix() {
        assert_eq!(identity("123456:AAbb").unwrap(), "telegram:123456");
        assert!(identity("nocolon").unwrap_err().contains("BotFather"));
        assert!(identity("abc:def").is_err());
        assert!(identity("123:").is_err());
    }

    #[test]
    fn derived_secrets_are_stable_valid_and_token_specific() {
        let a = derived_webhook_secret("1:a");
        assert_eq!(a, derived_webhook_secret("1:a"));
        assert_ne!(a, derived_webhook_secret("1:b"));
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric()));
    }

    #[test]
    fn tokens_never_reach_error_texts() {
        let client = reqwest::Client::new();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt
            .block_on(client.get("http://127.0.0.1:1/bot123:SECRET/getMe").send())
            .unwrap_err();
        let text = describe_reqwest(&e);
        assert!(!text.contains("SECRET"), "{text}");
        assert!(text.contains("/bot<token>/getMe"), "{text}");
    }

    #[test]
    fn backoff_doubles_to_thirty_seconds_unless_told() {
        let mut b = Backoff::default();
        let waits: Vec<u64> = (0..7).map(|_| b.next(None).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(b.next(Some(Duration::from_secs(3))).as_secs(), 3);
    }
}
