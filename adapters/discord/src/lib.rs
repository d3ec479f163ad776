//! Switchboard's Discord channel: the only crate that imports serenity.
//!
//! - **Ingress** ([`DiscordChannel::run`]): serenity's gateway client (with
//!   its ratelimiter disabled, the only way to point it at another base URL,
//!   and so in production too) delivers `MESSAGE_CREATE` and
//!   `MESSAGE_UPDATE`; each becomes an envelope ([`convert`]) journaled in
//!   snowflake order. The gateway never replays events to a new session, so
//!   after every fresh IDENTIFY (every `READY`, including the first after a
//!   start) the messages posted since the last journaled one of each
//!   recently active channel are fetched over REST and journaled the same way
//!   (duplicates fold away).
//! - **Delivery** ([`ChannelAdapter`]): REST with our own client ([`rest`]),
//!   because serenity drops `Retry-After` and the `X-RateLimit-*` headers
//!   the outbox needs. Creates carry a `nonce` derived from the reply item
//!   key with `enforce_nonce`, so a resend of an ambiguous send returns the
//!   existing message: the adapter declares `idempotent_send`.
//!
//! Identity: `discord:<application id>`, read from the token (its first part
//! is the bot user's id, which is the application id for applications made
//! in recent years) and checked against `GET /oauth2/applications/@me`.

pub mod convert;
pub mod rest;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::Method;
use serde_json::{Value, json};
use serenity::all::{
    Client, ClientBuilder, Context, EventHandler, GatewayError, GatewayIntents, Guild,
    GuildChannel, HttpBuilder, Message, MessageUpdateEvent, Ready,
};
use switchboard_channel::{
    AccountStatus, Capabilities, ChannelAdapter, DeliveryError, FetchError, IngressError,
    IngressSink, LengthUnit, Limits, OutboundMessage, Platform, Rate, Receipt, SendAction,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use convert::{BotContext, ChannelInfo};
use rest::{Rest, RestError};

/// Discord's public API host.
pub const DEFAULT_API_URL: &str = "https://discord.com";

/// Application flags that grant the Message Content intent.
const APP_FLAG_MESSAGE_CONTENT: u64 = 1 << 18;
const APP_FLAG_MESSAGE_CONTENT_LIMITED: u64 = 1 << 19;

/// What to do with edited messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edits {
    Ignore,
    NewInput,
}

/// How far gap backfill looks back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backfill {
    /// Channels whose latest journaled message is older than this are not
    /// looked at.
    pub max_age: Duration,
    /// At most this many channels, the most recently active first.
    pub max_channels: usize,
    /// At most this many messages per channel and gap.
    pub max_messages: usize,
}

/// One Discord account's settings, resolved by the core's config.
#[derive(Debug, Clone)]
pub struct DiscordSettings {
    pub account: String,
    pub token: String,
    /// `https://discord.com` (REST under `/api/v10`).
    pub api_url: String,
    pub edits: Edits,
    /// Journal other bots' and webhooks' messages as inputs.
    pub allow_bots: bool,
    pub reply_references: bool,
    /// Shards `first..=last` of `total`; `None`: all of Discord's
    /// recommendation in this process.
    pub shards: Option<(u32, u32, u32)>,
    pub backfill: Backfill,
    pub request_timeout: Duration,
}

/// The id a bot token names (its first part is the bot user's id, base64).
pub fn token_user_id(token: &str) -> Result<u64, String> {
    use base64::Engine;
    let first = token.split('.').next().unwrap_or_default();
    let bytes = [
        base64::engine::general_purpose::STANDARD_NO_PAD,
        base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ]
    .iter()
    .find_map(|engine| engine.decode(first.trim_end_matches('=')).ok())
    .ok_or_else(|| {
        "a Discord bot token has three parts separated by '.', the first one the bot's id in base64 (Developer Portal → Bot → Reset Token)".to_owned()
    })?;
    let id = String::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|_| token.split('.').count() == 3);
    id.ok_or_else(|| {
        "this is not a Discord bot token: it should have three parts separated by '.', the first one the bot's id in base64".to_owned()
    })
}

/// The store identity of the application a token belongs to.
pub fn identity(token: &str) -> Result<String, String> {
    token_user_id(token).map(|id| format!("discord:{id}"))
}

/// A Discord account: its outbound side and its gateway loop.
pub struct DiscordChannel {
    settings: DiscordSettings,
    identity: String,
    user_id: u64,
    rest: Rest,
    /// Where each channel sits, learned from GUILD_CREATE, THREAD_CREATE
    /// and, for the rest, `GET /channels/{id}`.
    channels: Mutex<HashMap<u64, ChannelInfo>>,
}

enum Event {
    Ready(Box<Ready>),
    Message(Box<Message>),
    Update(Box<MessageUpdateEvent>),
    Guild(Box<Guild>),
    Thread(Box<GuildChannel>),
}

struct Handler {
    tx: mpsc::UnboundedSender<Event>,
}

#[serenity::async_trait]
impl EventHandler for Handler {
    async fn ready(&self, _: Context, ready: Ready) {
        let _ = self.tx.send(Event::Ready(Box::new(ready)));
    }

    async fn message(&self, _: Context, message: Message) {
        let _ = self.tx.send(Event::Message(Box::new(message)));
    }

    async fn message_update(
        &self,
        _: Context,
        _: Option<Message>,
        _: Option<Message>,
        event: MessageUpdateEvent,
    ) {
        let _ = self.tx.send(Event::Update(Box::new(event)));
    }

    async fn guild_create(&self, _: Context, guild: Guild, _: Option<bool>) {
        let _ = self.tx.send(Event::Guild(Box::new(guild)));
    }

    async fn thread_create(&self, _: Context, thread: GuildChannel) {
        let _ = self.tx.send(Event::Thread(Box::new(thread)));
    }
}

/// A 25-character nonce from a reply item key: the same key, the same nonce.
fn nonce(key: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(key.as_bytes());
    digest
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
        .chars()
        .take(25)
        .collect()
}

impl DiscordChannel {
    pub fn new(settings: DiscordSettings) -> Result<DiscordChannel, String> {
        let user_id = token_user_id(&settings.token)?;
        reqwest::Url::parse(&settings.api_url)
            .map_err(|e| format!("api_url {:?} is not a URL: {e}", settings.api_url))?;
        let rest = Rest::new(&settings.api_url, &settings.token, settings.request_timeout)?;
        Ok(DiscordChannel {
            identity: format!("discord:{user_id}"),
            user_id,
            rest,
            channels: Mutex::new(HashMap::new()),
            settings,
        })
    }

    pub fn account(&self) -> &str {
        &self.settings.account
    }

    fn context(&self) -> BotContext {
        BotContext {
            account: self.settings.account.clone(),
            user_id: self.user_id,
            allow_bots: self.settings.allow_bots,
        }
    }

    fn remember(&self, info: ChannelInfo) {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(info.channel_id, info);
    }

    /// Where a channel sits. `guild_hint` is the guild a gateway event named
    /// (REST messages carry none).
    async fn channel_info(&self, channel_id: u64, guild_hint: Option<u64>) -> ChannelInfo {
        if let Some(info) = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&channel_id)
        {
            return *info;
        }
        let fetched = self
            .rest
            .call(Method::GET, &format!("/channels/{channel_id}"), None, None)
            .await;
        let info = match fetched {
            Ok(channel) => {
                let id = |v: &Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
                let thread = matches!(channel["type"].as_u64(), Some(10..=12));
                ChannelInfo {
                    channel_id,
                    guild_id: id(&channel["guild_id"]).or(guild_hint),
                    parent_id: if thread {
                        id(&channel["parent_id"])
                    } else {
                        None
                    },
                }
            }
            Err(e) => {
                tracing::warn!(account = %self.settings.account, channel = channel_id, error = %e, "could not look the channel up; treating it as its own chat");
                return ChannelInfo {
                    channel_id,
                    guild_id: guild_hint,
                    parent_id: None,
                };
            }
        };
        self.remember(info);
        info
    }

    /// Connect and receive until `stop`. A revoked token or a refused intent
    /// stops this account only, with the reason reported.
    pub async fn run(self: Arc<Self>, sink: Arc<dyn IngressSink>, stop: CancellationToken) {
        let account = self.settings.account.clone();
        sink.report_status(&account, AccountStatus::Starting);
        let mut failures = 0u32;
        loop {
            match self.session(&sink, &stop).await {
                Ok(()) => return,
                Err(Fatal(reason)) => {
                    sink.report_status(&account, AccountStatus::Down(reason));
                    return;
                }
                Err(Retry(reason)) => {
                    failures = failures.saturating_add(1);
                    let wait = Duration::from_secs(1u64 << failures.min(6).saturating_sub(1))
                        .min(Duration::from_secs(30));
                    sink.report_status(
                        &account,
                        AccountStatus::Down(format!("{reason}; retrying in {}s", wait.as_secs())),
                    );
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// One client's life: check the token, pick the intents, run the gateway.
    async fn session(
        self: &Arc<Self>,
        sink_arc: &Arc<dyn IngressSink>,
        stop: &CancellationToken,
    ) -> Result<(), Stop> {
        let sink = &**sink_arc;
        let account = &self.settings.account;
        let app = match self
            .rest
            .call(Method::GET, "/oauth2/applications/@me", None, None)
            .await
        {
            Ok(app) => app,
            Err(RestError::Status { status: 401, .. }) => return Err(Fatal(revoked(account))),
            Err(e) => return Err(Retry(format!("GET /oauth2/applications/@me failed ({e})"))),
        };
        let app_id = app["id"].as_str().unwrap_or_default();
        if app_id != self.user_id.to_string() {
            tracing::warn!(account = %account, application = app_id, bot_user = self.user_id, "the application id differs from the bot's user id; the store identity uses the bot's user id");
        }
        let flags = app["flags"].as_u64().unwrap_or(0);
        let mut intents = GatewayIntents::GUILDS
            | GatewayIntents::GUILD_MESSAGES
            | GatewayIntents::DIRECT_MESSAGES;
        let content = flags & (APP_FLAG_MESSAGE_CONTENT | APP_FLAG_MESSAGE_CONTENT_LIMITED) != 0;
        if content {
            intents |= GatewayIntents::MESSAGE_CONTENT;
        } else {
            tracing::warn!(account = %account, "the Message Content intent is not enabled for this application: guild messages arrive empty unless they mention the bot (DMs are unaffected). Enable it in the Developer Portal → your application → Bot → Privileged Gateway Intents, then restart");
        }
        let http = HttpBuilder::new(&self.settings.token)
            .proxy(self.settings.api_url.trim_end_matches('/'))
            .ratelimiter_disabled(true)
            .build();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut client: Client = ClientBuilder::new_with_http(http, intents)
            .event_handler(Handler { tx })
            .await
            .map_err(|e| Retry(format!("building the gateway client: {e}")))?;
        let manager = client.shard_manager.clone();
        let shards = self.settings.shards;
        let mut gateway = tokio::spawn(async move {
            match shards {
                // serenity's range end is inclusive.
                Some((first, last, total)) => client.start_shard_range(first..last, total).await,
                None => client.start().await,
            }
        });
        let backfilling = Arc::new(AtomicBool::new(false));
        let again = Arc::new(AtomicBool::new(false));
        let shard_text = match shards {
            Some((first, last, total)) => format!(", shards {first}-{last} of {total}"),
            None => String::new(),
        };
        let without_content = if content {
            ""
        } else {
            " (without the Message Content intent: guild messages only when they mention the bot)"
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    manager.shutdown_all().await;
                    gateway.abort();
                    break Ok(());
                }
                ended = &mut gateway => {
                    break Err(match ended {
                        Ok(Err(serenity::Error::Gateway(GatewayError::InvalidAuthentication))) => Fatal(revoked(account)),
                        Ok(Err(serenity::Error::Gateway(GatewayError::DisallowedGatewayIntents | GatewayError::InvalidGatewayIntents))) => Fatal(format!(
                            "Discord refused the gateway intents of channels.{account}; enable the Message Content intent in the Developer Portal (Bot → Privileged Gateway Intents) and restart"
                        )),
                        Ok(Err(e)) => Retry(format!("the gateway connection ended: {e}")),
                        Ok(Ok(())) => Retry("the gateway connection ended".into()),
                        Err(e) => Retry(format!("the gateway task failed: {e}")),
                    });
                }
                event = rx.recv() => {
                    let Some(event) = event else { continue };
                    match event {
                        Event::Ready(ready) => {
                            sink.report_status(account, AccountStatus::Up(format!(
                                "gateway as {}{shard_text}{without_content}", ready.user.name
                            )));
                            // Every fresh IDENTIFY may follow a gap. A READY
                            // during a backfill makes it run once more.
                            again.store(true, Ordering::SeqCst);
                            if !backfilling.swap(true, Ordering::SeqCst) {
                                let this = self.clone();
                                let running = backfilling.clone();
                                let again = again.clone();
                                let sink = sink_arc.clone();
                                tokio::spawn(async move {
                                    loop {
                                        while again.swap(false, Ordering::SeqCst) {
                                            this.backfill(&*sink).await;
                                        }
                                        running.store(false, Ordering::SeqCst);
                                        // A READY between the last check and
                                        // now found us still running.
                                        if !again.load(Ordering::SeqCst)
                                            || running.swap(true, Ordering::SeqCst)
                                        {
                                            break;
                                        }
                                    }
                                });
                            }
                        }
                        Event::Message(first) => {
                            // serenity runs each event in its own task: put
                            // what arrived together back in snowflake order.
                            let mut batch = vec![first];
                            let mut rest = Vec::new();
                            while let Ok(more) = rx.try_recv() {
                                match more {
                                    Event::Message(m) => batch.push(m),
                                    other => rest.push(other),
                                }
                            }
                            batch.sort_by_key(|m| m.id);
                            for message in batch {
                                let guild = message.guild_id.map(|g| g.get());
                                self.ingest(sink, &message, guild, message.id.to_string()).await;
                            }
                            for other in rest {
                                self.side_event(sink, other).await;
                            }
                        }
                        other => self.side_event(sink, other).await,
                    }
                }
            }
        }
    }

    async fn side_event(&self, sink: &dyn IngressSink, event: Event) {
        match event {
            Event::Guild(guild) => {
                let guild_id = guild.id.get();
                for channel in guild.channels.keys() {
                    self.remember(ChannelInfo {
                        channel_id: channel.get(),
                        guild_id: Some(guild_id),
                        parent_id: None,
                    });
                }
                for thread in &guild.threads {
                    self.remember(ChannelInfo {
                        channel_id: thread.id.get(),
                        guild_id: Some(guild_id),
                        parent_id: thread.parent_id.map(|p| p.get()),
                    });
                }
            }
            Event::Thread(thread) => self.remember(ChannelInfo {
                channel_id: thread.id.get(),
                guild_id: Some(thread.guild_id.get()),
                parent_id: thread.parent_id.map(|p| p.get()),
            }),
            Event::Update(update) => self.ingest_edit(sink, &update).await,
            // Handled by the session loop.
            Event::Ready(_) | Event::Message(_) => {}
        }
    }

    /// Journal one message (our own are skipped). Failures are logged: the
    /// next backfill fetches what could not be stored.
    async fn ingest(
        &self,
        sink: &dyn IngressSink,
        message: &Message,
        guild: Option<u64>,
        key: String,
    ) {
        let info = self.channel_info(message.channel_id.get(), guild).await;
        let Some(envelope) = convert::convert(&self.context(), message, info, key) else {
            return;
        };
        match sink.accept(envelope).await {
            Ok(_) => {}
            Err(IngressError::Unavailable(_)) => {}
            Err(e @ IngressError::Store(_)) => {
                tracing::error!(account = %self.settings.account, message = %message.id, error = %e, "could not journal a Discord message; the next backfill fetches it again")
            }
            Err(e) => {
                sink.record_rejection(&self.settings.account, "unusable_update", &e.to_string())
            }
        }
    }

    async fn ingest_edit(&self, sink: &dyn IngressSink, update: &MessageUpdateEvent) {
        // Embeds unfurling also send MESSAGE_UPDATE; only edits carry an
        // edit time.
        let Some(edited) = update.edited_timestamp else {
            return;
        };
        if update
            .author
            .as_ref()
            .is_some_and(|a| a.id.get() == self.user_id)
        {
            return;
        }
        let key = format!("{}:edit:{}", update.id, edited.unix_timestamp());
        let channel = update.channel_id.get();
        let guild = update.guild_id.map(|g| g.get());
        match self.settings.edits {
            Edits::NewInput => {
                // The event carries only what changed: read the message.
                match self
                    .rest
                    .call(
                        Method::GET,
                        &format!("/channels/{channel}/messages/{}", update.id),
                        None,
                        None,
                    )
                    .await
                    .map(serde_json::from_value::<Message>)
                {
                    Ok(Ok(message)) => self.ingest(sink, &message, guild, key).await,
                    Ok(Err(e)) => tracing::warn!(error = %e, "an edited message could not be read"),
                    Err(e) => tracing::warn!(error = %e, "an edited message could not be fetched"),
                }
            }
            Edits::Ignore => {
                let info = self.channel_info(channel, guild).await;
                let (chat_id, thread_id) = info.chat_and_thread();
                let envelope = switchboard_channel::Envelope {
                    account: self.settings.account.clone(),
                    update_key: key,
                    chat_id,
                    chat_kind: if info.guild_id.is_some() {
                        switchboard_channel::ChatKind::Group
                    } else {
                        switchboard_channel::ChatKind::Private
                    },
                    thread_id,
                    space: info.guild_id.map(|g| g.to_string()),
                    sender: None,
                    message_id: Some(update.id.to_string()),
                    content: switchboard_channel::Content::Unsupported {
                        kind: "message_update".into(),
                        reason: format!(
                            "message edits are ignored (channels.{}.edits = \"ignore\")",
                            self.settings.account
                        ),
                    },
                    input_policy: None,
                    addressed: false,
                };
                if let Err(e) = sink.accept(envelope).await {
                    tracing::debug!(error = %e, "an ignored edit was not journaled");
                }
            }
        }
    }

    /// Fetch what was posted since the last journaled message of each
    /// recently active channel, and journal it (duplicates fold away).
    async fn backfill(&self, sink: &dyn IngressSink) {
        let account = &self.settings.account;
        let bounds = self.settings.backfill;
        let chats = match sink
            .recent_chats(account, bounds.max_age, bounds.max_channels)
            .await
        {
            Ok(chats) => chats,
            Err(e) => {
                tracing::warn!(account = %account, error = %e, "backfill could not list recent channels");
                return;
            }
        };
        let mut fetched = 0usize;
        for chat in chats {
            let channel = chat.thread_id.as_deref().unwrap_or(&chat.chat_id);
            let (Ok(channel_id), Some(Ok(mut after))) = (
                channel.parse::<u64>(),
                chat.last_message_id.as_deref().map(str::parse::<u64>),
            ) else {
                continue;
            };
            let mut taken = 0usize;
            while taken < bounds.max_messages {
                let limit = (bounds.max_messages - taken).min(100);
                let page = self
                    .rest
                    .call(
                        Method::GET,
                        &format!("/channels/{channel_id}/messages?after={after}&limit={limit}"),
                        None,
                        None,
                    )
                    .await;
                let mut messages: Vec<Message> = match page {
                    Ok(Value::Array(items)) => items
                        .into_iter()
                        .filter_map(|m| serde_json::from_value(m).ok())
                        .collect(),
                    Ok(_) => Vec::new(),
                    Err(RestError::Wait { after: wait, .. }) => {
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(account = %account, channel = channel_id, error = %e, "backfill could not read a channel");
                        break;
                    }
                };
                let count = messages.len();
                messages.sort_by_key(|m| m.id);
                for message in &messages {
                    after = after.max(message.id.get());
                    self.ingest(sink, message, None, message.id.to_string())
                        .await;
                }
                taken += count;
                fetched += count;
                if count < limit {
                    break;
                }
            }
        }
        if fetched > 0 {
            tracing::info!(account = %account, messages = fetched, "backfilled messages posted while no session was receiving them");
        }
    }

    fn target(message: &OutboundMessage) -> &str {
        message.thread_id.as_deref().unwrap_or(&message.chat_id)
    }

    async fn create(&self, message: &OutboundMessage) -> Result<Vec<String>, RestError> {
        let channel = Self::target(message);
        let path = format!("/channels/{channel}/messages");
        let mut bodies = Vec::new();
        let text = message.text.trim();
        if !text.is_empty() || message.attachments.is_empty() {
            let mut body = json!({
                "content": if text.is_empty() { "(empty answer)" } else { text },
                "nonce": nonce(&message.item_key),
                "enforce_nonce": true,
                "allowed_mentions": {"parse": [], "replied_user": false},
            });
            if self.settings.reply_references
                && let Some(reply_to) = &message.reply_to
            {
                body["message_reference"] =
                    json!({"message_id": reply_to, "fail_if_not_exists": false});
            }
            bodies.push(body);
        }
        // Files a runtime attached are links (Discord shows a preview).
        for (i, file) in message.attachments.iter().enumerate() {
            bodies.push(json!({
                "content": file.reference,
                "nonce": nonce(&format!("{}#{i}", message.item_key)),
                "enforce_nonce": true,
                "allowed_mentions": {"parse": []},
            }));
        }
        let mut ids = Vec::new();
        for body in bodies {
            let created = self
                .rest
                .call(Method::POST, &path, Some(&body), Some(channel))
                .await?;
            ids.push(created["id"].as_str().unwrap_or_default().to_owned());
        }
        Ok(ids)
    }

    async fn edit(
        &self,
        message: &OutboundMessage,
        message_id: &str,
    ) -> Result<Vec<String>, RestError> {
        let channel = Self::target(message);
        let body = json!({"content": message.text, "allowed_mentions": {"parse": []}});
        match self
            .rest
            .call(
                Method::PATCH,
                &format!("/channels/{channel}/messages/{message_id}"),
                Some(&body),
                Some(channel),
            )
            .await
        {
            Ok(_) => Ok(vec![message_id.to_owned()]),
            // The preview was deleted: the answer becomes a new message.
            Err(RestError::Status {
                code: Some(10008), ..
            }) => self.create(message).await,
            Err(e) => Err(e),
        }
    }
}

enum Stop {
    Fatal(String),
    Retry(String),
}
use Stop::{Fatal, Retry};

fn revoked(account: &str) -> String {
    format!(
        "Discord answered 401 Unauthorized: the token of channels.{account} is wrong or was reset. Reset it in the Developer Portal (Bot → Reset Token), update the config and restart; other accounts keep working"
    )
}

#[async_trait]
impl ChannelAdapter for DiscordChannel {
    fn identity(&self) -> &str {
        &self.identity
    }

    fn platform(&self) -> Platform {
        Platform::Discord
    }

    /// 2000 characters a message; about 5 messages per 5 s per channel and
    /// 50 requests a second per bot. Discord's own headers tighten these at
    /// run time (an empty bucket waits for its reset).
    fn limits(&self) -> Limits {
        Limits {
            max_text_len: 2000,
            length_unit: LengthUnit::Chars,
            per_chat: Some(Rate {
                per_second: 1.0,
                burst: 5,
            }),
            per_group: None,
            per_account: Some(Rate {
                per_second: 50.0,
                burst: 50,
            }),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            idempotent_send: true,
            edit: true,
            typing: true,
            drafts: false,
        }
    }

    async fn send(&self, message: &OutboundMessage) -> Result<Receipt, DeliveryError> {
        let sent = match &message.action {
            SendAction::Create => self.create(message).await,
            SendAction::Edit { message_id } => self.edit(message, message_id).await,
        };
        sent.map(|message_ids| Receipt { message_ids })
            .map_err(RestError::into_delivery)
    }

    async fn typing(&self, chat_id: &str, thread_id: Option<&str>) -> Result<(), DeliveryError> {
        let channel = thread_id.unwrap_or(chat_id);
        self.rest
            .call(
                Method::POST,
                &format!("/channels/{channel}/typing"),
                None,
                None,
            )
            .await
            .map(|_| ())
            .map_err(RestError::into_delivery)
    }

    async fn fetch_attachment(
        &self,
        reference: &str,
        max_bytes: u64,
    ) -> Result<Vec<u8>, FetchError> {
        if !reference.starts_with("http://") && !reference.starts_with("https://") {
            return Err(FetchError::NotFound(format!(
                "{reference:?} is not an attachment URL"
            )));
        }
        self.rest.download(reference, max_bytes).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_bot_and_nonces_are_short_and_stable() {
        // "123456789012345678" in base64, then two more parts.
        let token = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GAbCdE.xyz";
        assert_eq!(token_user_id(token).unwrap(), 123_456_789_012_345_678);
        assert_eq!(identity(token).unwrap(), "discord:123456789012345678");
        assert!(token_user_id("not-a-token").is_err());
        assert!(token_user_id("bm90IGFuIGlk.a.b").is_err());
        assert_eq!(nonce("run-1-answer-1").len(), 25);
        assert_eq!(nonce("run-1-answer-1"), nonce("run-1-answer-1"));
        assert_ne!(nonce("run-1-answer-1"), nonce("run-1-answer-2"));
    }
}
