//! A loopback fake of Discord's REST API v10 and gateway, speaking the wire
//! format serenity 0.12.5 uses.
//!
//! * REST lives under `/api/v10` and requires `Authorization: Bot <token>`
//!   (`GET /gateway` excepted, as on Discord). Point serenity at it with
//!   `HttpBuilder::new(token).proxy(fake.url()).ratelimiter_disabled(true).build()`.
//! * The gateway is a JSON-encoded WebSocket at `/gateway`; `GET /gateway` and
//!   `GET /gateway/bot` hand out `ws://127.0.0.1:PORT/gateway`, and serenity
//!   connects to `<that url>?v=10`. serenity asks for no transport
//!   compression (no `compress=zlib-stream`); its IDENTIFY says
//!   `compress: true` (payload compression), but it reads plain text frames
//!   too, so this fake never compresses anything.
//! * Sessions are per `(token, shard)`: IDENTIFY creates one (replacing an
//!   earlier one of the same token and shard), dispatches carry per-session
//!   sequence numbers, and every dispatch is logged so that RESUME replays
//!   what the client missed. A session outlives its connection (it stays
//!   resumable) until the test invalidates it, the client closes with code
//!   1000/1001, or a close code 4007/4009 ends it.
//! * Dispatch routing follows Discord: a guild event goes to the sessions
//!   whose shard owns the guild (`(guild_id >> 22) % total == shard`), a DM
//!   event to shard 0; `MESSAGE_*` need `GUILD_MESSAGES` (guilds) or
//!   `DIRECT_MESSAGES` (DMs); without `MESSAGE_CONTENT` a guild message's
//!   content, embeds and attachments arrive empty unless the bot wrote it or
//!   is mentioned in it; `GUILD_CREATE` follows READY only with `GUILDS`.
//!   The bot's own REST-created messages and edits are dispatched too.
//!   There is no membership model: every bot sees every channel.
//! * Messages created through REST carry no `guild_id` (Discord leaves it out
//!   of REST message objects); gateway events carry `guild_id` and `member`.
//! * Faults: [`FakeDiscord::fail_next`] queues a [`Fault`] for the next REST
//!   request matching a pattern such as `"POST /channels/*/messages"`.
//!
//! Everything binds to 127.0.0.1 on a free port.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, FromRequest, Multipart, Path, Query, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::{IncomingStream, Listener};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// The heartbeat interval HELLO announces unless a test sets another.
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 41_250;
/// Discord's epoch (2015-01-01T00:00:00Z) in Unix milliseconds.
pub const DISCORD_EPOCH_MS: u64 = 1_420_070_400_000;
/// The user id of the (fake) owner of every application.
pub const OWNER_ID: u64 = 80_351_110_224_678_912;

/// Gateway intent bits this fake looks at.
pub const INTENT_GUILDS: u64 = 1 << 0;
pub const INTENT_GUILD_MESSAGES: u64 = 1 << 9;
pub const INTENT_DIRECT_MESSAGES: u64 = 1 << 12;
pub const INTENT_MESSAGE_CONTENT: u64 = 1 << 15;

/// Application flags: the Message Content intent, for verified bots and
/// (limited) for bots in fewer than 100 servers.
pub const APP_FLAG_MESSAGE_CONTENT: u64 = 1 << 18;
pub const APP_FLAG_MESSAGE_CONTENT_LIMITED: u64 = 1 << 19;

const API_PREFIX: &str = "/api/v10";
const MAX_CONTENT_CHARS: usize = 2000;
const MAX_NONCE_CHARS: usize = 25;

// ---------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------

/// A misbehaviour for the next REST request that matches a pattern.
///
/// "Effect" means handling the request as usual (creating the message,
/// recording the edit, ...).
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// 429 with `Retry-After` (whole seconds, rounded up), `X-RateLimit-*`
    /// headers (`X-RateLimit-Global: true` and scope `global` when global,
    /// scope `user` otherwise) and the body
    /// `{"message": "You are being rate limited.", "retry_after": s, "global": g}`.
    /// No effect.
    RateLimited { retry_after_secs: f64, global: bool },
    /// This status and JSON body; no effect.
    Status(u16, Value),
    /// Wait, then handle the request normally.
    Hang(Duration),
    /// Apply the effect, wait, then send the normal response.
    HangAfterEffect(Duration),
    /// Wait, then close the connection without effect or response.
    HangBeforeEffect(Duration),
    /// Close the connection without effect or response.
    Close,
    /// Apply the effect, then close the connection without a response.
    CloseAfterEffect,
}

/// A message "posted by a user" (or another bot), built for [`FakeDiscord::push`].
#[derive(Clone, Debug)]
pub struct UserMessage {
    pub channel_id: u64,
    pub author_id: u64,
    pub content: String,
    /// Defaults to the name given to [`FakeDiscord::add_user`], else `user<id>`.
    pub author_name: Option<String>,
    pub author_is_bot: bool,
    /// Makes it a reply (type 19 with `message_reference` and `referenced_message`).
    pub reply_to: Option<u64>,
    pub attachments: Vec<FakeAttachment>,
}

impl UserMessage {
    pub fn new(channel_id: u64, author_id: u64, content: impl Into<String>) -> Self {
        Self {
            channel_id,
            author_id,
            content: content.into(),
            author_name: None,
            author_is_bot: false,
            reply_to: None,
            attachments: Vec::new(),
        }
    }

    pub fn author_name(mut self, name: impl Into<String>) -> Self {
        self.author_name = Some(name.into());
        self
    }

    /// The author is a bot (`author.bot = true`).
    pub fn from_bot(mut self) -> Self {
        self.author_is_bot = true;
        self
    }

    pub fn reply_to(mut self, message_id: u64) -> Self {
        self.reply_to = Some(message_id);
        self
    }

    pub fn attachment(mut self, attachment: FakeAttachment) -> Self {
        self.attachments.push(attachment);
        self
    }
}

/// An attachment of a pushed message. Unless `url` is set, the fake serves
/// the bytes itself at `http://127.0.0.1:PORT/attachments/<channel>/<id>/<filename>`.
#[derive(Clone, Debug)]
pub struct FakeAttachment {
    pub filename: String,
    pub bytes: Vec<u8>,
    pub content_type: Option<String>,
    pub url: Option<String>,
}

impl FakeAttachment {
    pub fn new(filename: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            filename: filename.into(),
            bytes: bytes.into(),
            content_type: None,
            url: None,
        }
    }

    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }
}

/// A message the bot created through `POST /channels/{id}/messages`.
#[derive(Clone, Debug, PartialEq)]
pub struct CreatedMessage {
    pub id: u64,
    pub channel_id: u64,
    pub author_id: u64,
    pub content: String,
    /// The nonce as sent (a numeric nonce is given in decimal).
    pub nonce: Option<String>,
    pub enforce_nonce: bool,
    pub reply_to: Option<u64>,
    /// Filenames of uploaded files (multipart requests).
    pub files: Vec<String>,
    /// The JSON payload as sent (`payload_json` for multipart requests).
    pub body: Value,
}

/// A create-message request answered with an existing message because of
/// `nonce` + `enforce_nonce`.
#[derive(Clone, Debug, PartialEq)]
pub struct Dedupe {
    pub channel_id: u64,
    pub nonce: String,
    pub message_id: u64,
}

/// A `PATCH /channels/{id}/messages/{id}` that succeeded.
#[derive(Clone, Debug, PartialEq)]
pub struct Edit {
    pub channel_id: u64,
    pub message_id: u64,
    pub content: Option<String>,
    pub body: Value,
}

/// A `POST /channels/{id}/typing`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Typing {
    pub channel_id: u64,
    pub user_id: u64,
}

/// An IDENTIFY that was accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identify {
    /// Without the `Bot ` prefix.
    pub token: String,
    /// `[shard_id, shard_total]`.
    pub shard: [u32; 2],
    pub intents: u64,
    pub session_id: String,
}

/// A RESUME, accepted or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    pub session_id: String,
    pub seq: u64,
    pub accepted: bool,
    /// How many logged dispatches were replayed (RESUMED not counted).
    pub replayed: usize,
}

/// A live (not invalidated) gateway session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    pub session_id: String,
    pub token: String,
    pub shard: [u32; 2],
    pub intents: u64,
    /// Whether a WebSocket connection is attached.
    pub connected: bool,
    /// The last sequence number dispatched in this session.
    pub seq: u64,
}

/// A `GET /channels/{id}/messages`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryRequest {
    pub channel_id: u64,
    pub after: Option<u64>,
    pub before: Option<u64>,
    pub around: Option<u64>,
    pub limit: Option<u64>,
}

/// Any request under `/api/v10`; `status` is `None` when the connection was
/// closed without a response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestRequest {
    pub method: String,
    /// Path below `/api/v10`, with the query string if any.
    pub path: String,
    pub status: Option<u16>,
}

// ---------------------------------------------------------------------------
// A listener whose connections a handler can kill (to close without response)
// ---------------------------------------------------------------------------

struct FakeListener(TcpListener);

/// Per-connection kill switch, handed to handlers as connect info.
#[derive(Clone, Debug)]
struct ConnKill(Arc<AtomicBool>);

impl ConnKill {
    fn kill(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

struct KillableStream {
    inner: TcpStream,
    killed: Arc<AtomicBool>,
}

fn killed_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed by fault injection",
    )
}

impl AsyncRead for KillableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.killed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.killed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.killed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Listener for FakeListener {
    type Io = KillableStream;
    type Addr = ConnKill;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let killed = Arc::new(AtomicBool::new(false));
                    let io = KillableStream {
                        inner: stream,
                        killed: Arc::clone(&killed),
                    };
                    return (io, ConnKill(killed));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(ConnKill(Arc::new(AtomicBool::new(false))))
    }
}

impl Connected<IncomingStream<'_, FakeListener>> for ConnKill {
    fn connect_info(stream: IncomingStream<'_, FakeListener>) -> Self {
        stream.remote_addr().clone()
    }
}

// ---------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct BotRec {
    token: String,
    user_id: u64,
    application_id: u64,
    username: String,
    revoked: bool,
}

#[derive(Clone, Debug)]
struct UserRec {
    name: String,
    bot: bool,
}

#[derive(Clone, Debug)]
enum ChannelRec {
    Dm {
        recipient: u64,
    },
    Text {
        guild_id: u64,
        name: String,
    },
    Thread {
        guild_id: u64,
        parent_id: u64,
        name: String,
    },
}

impl ChannelRec {
    fn guild_id(&self) -> Option<u64> {
        match self {
            Self::Dm { .. } => None,
            Self::Text { guild_id, .. } | Self::Thread { guild_id, .. } => Some(*guild_id),
        }
    }
}

#[derive(Clone, Debug)]
struct StoredMessage {
    id: u64,
    channel_id: u64,
    author_id: u64,
    guild_id: Option<u64>,
    mention_ids: Vec<u64>,
    /// The REST form of the message (no `guild_id`, no `member`).
    value: Value,
}

struct Session {
    id: String,
    token: String,
    bot_user_id: u64,
    shard: [u32; 2],
    intents: u64,
    seq: u64,
    log: Vec<(u64, String)>,
    conn: Option<u64>,
}

enum Out {
    Text(String),
    Close(u16, String),
    Drop,
}

struct ConnRec {
    tx: mpsc::UnboundedSender<Out>,
    session: Option<String>,
}

struct Bucket {
    started: Instant,
    count: u32,
}

struct StoredFile {
    content_type: Option<String>,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Records {
    created: Vec<CreatedMessage>,
    dedupes: Vec<Dedupe>,
    edits: Vec<Edit>,
    typing: Vec<Typing>,
    identifies: Vec<Identify>,
    resumes: Vec<Resume>,
    history: Vec<HistoryRequest>,
    heartbeats: u64,
    requests: Vec<RestRequest>,
    gateway_connects: Vec<String>,
}

struct Inner {
    port: u16,
    heartbeat_interval_ms: u64,
    recommended_shards: u32,
    application_flags: u64,
    nonce_window: Duration,
    rate_limit: u32,
    rate_window: Duration,
    enforce_rate_limits: bool,
    bots: Vec<BotRec>,
    users: HashMap<u64, UserRec>,
    guilds: BTreeMap<u64, String>,
    channels: BTreeMap<u64, ChannelRec>,
    /// Per channel, ascending by id.
    history: HashMap<u64, Vec<StoredMessage>>,
    /// (author, nonce) -> (message id, created at)
    nonces: HashMap<(u64, String), (u64, Instant)>,
    files: HashMap<u64, StoredFile>,
    faults: Vec<(String, Fault)>,
    last_id: u64,
    sessions: Vec<Session>,
    conns: HashMap<u64, ConnRec>,
    next_conn: u64,
    next_session: u64,
    buckets: HashMap<String, Bucket>,
    rec: Records,
}

struct Shared {
    inner: Mutex<Inner>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How a REST request's body arrived.
enum ReqBody {
    Empty,
    Json(Value),
    Invalid,
    Multipart {
        payload: Value,
        files: Vec<UploadedFile>,
    },
}

struct UploadedFile {
    filename: String,
    content_type: Option<String>,
    bytes: Vec<u8>,
}

struct Outcome {
    status: StatusCode,
    body: Option<Value>,
    headers: Vec<(HeaderName, String)>,
}

impl Outcome {
    fn ok(body: Value) -> Self {
        Self {
            status: StatusCode::OK,
            body: Some(body),
            headers: Vec::new(),
        }
    }

    fn no_content() -> Self {
        Self {
            status: StatusCode::NO_CONTENT,
            body: None,
            headers: Vec::new(),
        }
    }

    fn error(status: u16, code: i64, message: &str) -> Self {
        Self {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            body: Some(json!({"message": message, "code": code})),
            headers: Vec::new(),
        }
    }

    fn not_found() -> Self {
        Self::error(404, 0, "404: Not Found")
    }

    /// Discord's 50035 "Invalid Form Body" with one field error.
    fn form_error(field: &str, code: &str, message: &str) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            body: Some(json!({
                "message": "Invalid Form Body",
                "code": 50035,
                "errors": {field: {"_errors": [{"code": code, "message": message}]}},
            })),
            headers: Vec::new(),
        }
    }

    fn into_response(self) -> Response {
        let mut response = match self.body {
            Some(body) => (self.status, axum::Json(body)).into_response(),
            None => self.status.into_response(),
        };
        for (name, value) in self.headers {
            if let Ok(value) = HeaderValue::from_str(&value) {
                response.headers_mut().insert(name, value);
            }
        }
        response
    }
}

struct NewMessage {
    channel_id: u64,
    author_id: u64,
    content: String,
    nonce: Option<Value>,
    reply_to: Option<u64>,
    attachments: Vec<Value>,
    embeds: Vec<Value>,
    flags: u64,
}

const H_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const H_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const H_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const H_RESET_AFTER: HeaderName = HeaderName::from_static("x-ratelimit-reset-after");
const H_BUCKET: HeaderName = HeaderName::from_static("x-ratelimit-bucket");
const H_SCOPE: HeaderName = HeaderName::from_static("x-ratelimit-scope");
const H_GLOBAL: HeaderName = HeaderName::from_static("x-ratelimit-global");
const H_RETRY_AFTER: HeaderName = HeaderName::from_static("retry-after");

impl Inner {
    fn new(port: u16) -> Self {
        Self {
            port,
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            recommended_shards: 1,
            application_flags: APP_FLAG_MESSAGE_CONTENT_LIMITED,
            nonce_window: Duration::from_secs(300),
            rate_limit: 5,
            rate_window: Duration::from_secs(5),
            enforce_rate_limits: false,
            bots: Vec::new(),
            users: HashMap::new(),
            guilds: BTreeMap::new(),
            channels: BTreeMap::new(),
            history: HashMap::new(),
            nonces: HashMap::new(),
            files: HashMap::new(),
            faults: Vec::new(),
            last_id: 0,
            sessions: Vec::new(),
            conns: HashMap::new(),
            next_conn: 1,
            next_session: 1,
            buckets: HashMap::new(),
            rec: Records::default(),
        }
    }

    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn gateway_url(&self) -> String {
        format!("ws://127.0.0.1:{}/gateway", self.port)
    }

    /// A snowflake for "now", strictly greater than every earlier one.
    fn next_id(&mut self) -> u64 {
        let candidate = now_ms().saturating_sub(DISCORD_EPOCH_MS) << 22;
        let id = candidate.max(self.last_id + 1);
        self.last_id = id;
        id
    }

    fn bot_by_token(&self, token: &str) -> Option<BotRec> {
        self.bots
            .iter()
            .find(|b| b.token == token && !b.revoked)
            .cloned()
    }

    fn user_value(&self, id: u64) -> Value {
        if let Some(bot) = self.bots.iter().find(|b| b.user_id == id) {
            return user_json(id, &bot.username, true);
        }
        match self.users.get(&id) {
            Some(user) => user_json(id, &user.name, user.bot),
            None if id == OWNER_ID => user_json(id, "owner", false),
            None => user_json(id, &format!("user{id}"), false),
        }
    }

    fn find_message(&self, id: u64) -> Option<&StoredMessage> {
        self.history.values().flatten().find(|m| m.id == id)
    }

    fn last_message_id(&self, channel_id: u64) -> Value {
        self.history
            .get(&channel_id)
            .and_then(|h| h.last())
            .map_or(Value::Null, |m| json!(m.id.to_string()))
    }

    fn channel_value(&self, channel_id: u64) -> Option<Value> {
        let channel = self.channels.get(&channel_id)?;
        let last = self.last_message_id(channel_id);
        Some(match channel {
            ChannelRec::Dm { recipient } => json!({
                "id": channel_id.to_string(),
                "type": 1,
                "last_message_id": last,
                "flags": 0,
                "recipients": [self.user_value(*recipient)],
            }),
            ChannelRec::Text { guild_id, name } => json!({
                "id": channel_id.to_string(),
                "type": 0,
                "guild_id": guild_id.to_string(),
                "name": name,
                "position": 0,
                "permission_overwrites": [],
                "nsfw": false,
                "parent_id": null,
                "topic": null,
                "rate_limit_per_user": 0,
                "last_message_id": last,
                "flags": 0,
            }),
            ChannelRec::Thread {
                guild_id,
                parent_id,
                name,
            } => {
                let count = self.history.get(&channel_id).map_or(0, Vec::len);
                let created = iso8601(snowflake_ms(channel_id));
                json!({
                    "id": channel_id.to_string(),
                    "type": 11,
                    "guild_id": guild_id.to_string(),
                    "parent_id": parent_id.to_string(),
                    "owner_id": OWNER_ID.to_string(),
                    "name": name,
                    "last_message_id": last,
                    "message_count": count,
                    "total_message_sent": count,
                    "member_count": 1,
                    "rate_limit_per_user": 0,
                    "flags": 0,
                    "thread_metadata": {
                        "archived": false,
                        "auto_archive_duration": 1440,
                        "archive_timestamp": created,
                        "locked": false,
                        "create_timestamp": created,
                    },
                })
            }
        })
    }

    /// The GUILD_CREATE payload: a full guild with its channels and threads.
    fn guild_value(&self, guild_id: u64) -> Value {
        let name = self.guilds.get(&guild_id).cloned().unwrap_or_default();
        let mut channels = Vec::new();
        let mut threads = Vec::new();
        for (id, channel) in &self.channels {
            if channel.guild_id() != Some(guild_id) {
                continue;
            }
            let Some(value) = self.channel_value(*id) else {
                continue;
            };
            match channel {
                ChannelRec::Thread { .. } => threads.push(value),
                _ => channels.push(value),
            }
        }
        json!({
            "id": guild_id.to_string(),
            "name": name,
            "icon": null,
            "splash": null,
            "discovery_splash": null,
            "owner_id": OWNER_ID.to_string(),
            "verification_level": 0,
            "default_message_notifications": 0,
            "explicit_content_filter": 0,
            "roles": [],
            "emojis": [],
            "features": [],
            "mfa_level": 0,
            "application_id": null,
            "system_channel_id": null,
            "system_channel_flags": 0,
            "rules_channel_id": null,
            "vanity_url_code": null,
            "description": null,
            "banner": null,
            "premium_tier": 0,
            "premium_subscription_count": 0,
            "preferred_locale": "en-US",
            "public_updates_channel_id": null,
            "nsfw_level": 0,
            "stickers": [],
            "premium_progress_bar_enabled": false,
            "safety_alerts_channel_id": null,
            "joined_at": iso8601(snowflake_ms(guild_id)),
            "large": false,
            "unavailable": false,
            "member_count": 2,
            "voice_states": [],
            "members": [],
            "channels": channels,
            "threads": threads,
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
        })
    }

    fn build_message(&mut self, m: NewMessage) -> StoredMessage {
        let id = self.next_id();
        let guild_id = self
            .channels
            .get(&m.channel_id)
            .and_then(ChannelRec::guild_id);
        let mention_ids = parse_mentions(&m.content);
        let mentions: Vec<Value> = mention_ids.iter().map(|u| self.user_value(*u)).collect();
        let mut value = json!({
            "id": id.to_string(),
            "channel_id": m.channel_id.to_string(),
            "author": self.user_value(m.author_id),
            "content": m.content,
            "timestamp": iso8601(snowflake_ms(id)),
            "edited_timestamp": null,
            "tts": false,
            "mention_everyone": m.content.contains("@everyone") || m.content.contains("@here"),
            "mentions": mentions,
            "mention_roles": [],
            "attachments": m.attachments,
            "embeds": m.embeds,
            "pinned": false,
            "type": 0,
            "flags": m.flags,
            "components": [],
        });
        if let Some(nonce) = m.nonce {
            value["nonce"] = nonce;
        }
        if let Some(reply) = m.reply_to {
            let referenced = self.find_message(reply).cloned();
            let ref_channel = referenced.as_ref().map_or(m.channel_id, |r| r.channel_id);
            let mut reference = json!({
                "type": 0,
                "message_id": reply.to_string(),
                "channel_id": ref_channel.to_string(),
            });
            if let Some(g) = self
                .channels
                .get(&ref_channel)
                .and_then(ChannelRec::guild_id)
            {
                reference["guild_id"] = json!(g.to_string());
            }
            value["message_reference"] = reference;
            value["referenced_message"] = referenced.map_or(Value::Null, |r| {
                let mut v = r.value;
                if let Some(o) = v.as_object_mut() {
                    o.remove("referenced_message");
                }
                v
            });
            value["type"] = json!(19);
        }
        StoredMessage {
            id,
            channel_id: m.channel_id,
            author_id: m.author_id,
            guild_id,
            mention_ids,
            value,
        }
    }

    fn store_file(&mut self, channel_id: u64, file: UploadedFile, url: Option<String>) -> Value {
        let id = self.next_id();
        let url = url.unwrap_or_else(|| {
            format!(
                "{}/attachments/{channel_id}/{id}/{}",
                self.base_url(),
                file.filename
            )
        });
        let value = json!({
            "id": id.to_string(),
            "filename": file.filename,
            "size": file.bytes.len(),
            "url": url,
            "proxy_url": url,
            "content_type": file.content_type,
        });
        self.files.insert(
            id,
            StoredFile {
                content_type: file.content_type,
                bytes: file.bytes,
            },
        );
        value
    }

    /// Stores a new message in its channel's history and dispatches MESSAGE_CREATE.
    fn store_and_dispatch(&mut self, msg: StoredMessage) {
        self.dispatch_message("MESSAGE_CREATE", &msg);
        self.history.entry(msg.channel_id).or_default().push(msg);
    }

    fn dispatch_message(&mut self, event: &str, msg: &StoredMessage) {
        let mut d = msg.value.clone();
        if let Some(g) = msg.guild_id {
            d["guild_id"] = json!(g.to_string());
            d["member"] = json!({
                "roles": [],
                "joined_at": iso8601(snowflake_ms(g)),
                "deaf": false,
                "mute": false,
                "flags": 0,
                "pending": false,
                "premium_since": null,
            });
        }
        let intent = if msg.guild_id.is_some() {
            INTENT_GUILD_MESSAGES
        } else {
            INTENT_DIRECT_MESSAGES
        };
        let (guild_id, author, mentions) = (msg.guild_id, msg.author_id, msg.mention_ids.clone());
        self.broadcast(event, guild_id, intent, |session| {
            let mut payload = d.clone();
            let sees_content = session.intents & INTENT_MESSAGE_CONTENT != 0
                || guild_id.is_none()
                || author == session.bot_user_id
                || mentions.contains(&session.bot_user_id);
            if !sees_content {
                redact(&mut payload);
                if let Some(referenced) = payload.get_mut("referenced_message")
                    && referenced.is_object()
                {
                    redact(referenced);
                }
            }
            payload
        });
    }

    fn broadcast(
        &mut self,
        event: &str,
        guild_id: Option<u64>,
        intent: u64,
        make: impl Fn(&Session) -> Value,
    ) {
        let Inner {
            sessions, conns, ..
        } = self;
        for session in sessions.iter_mut() {
            if owns(session.shard, guild_id) && session.intents & intent != 0 {
                let d = make(session);
                emit(session, conns, event, d);
            }
        }
    }

    fn send(&self, conn: u64, out: Out) {
        if let Some(c) = self.conns.get(&conn) {
            let _ = c.tx.send(out);
        }
    }

    // --- gateway ------------------------------------------------------------

    fn client_frame(&mut self, conn: u64, text: &str) {
        let Ok(frame) = serde_json::from_str::<Value>(text) else {
            self.send(
                conn,
                Out::Close(4002, "Error while decoding payload.".into()),
            );
            return;
        };
        let authenticated = self.conns.get(&conn).is_some_and(|c| c.session.is_some());
        match frame.get("op").and_then(Value::as_u64) {
            Some(1) => {
                self.rec.heartbeats += 1;
                self.send(
                    conn,
                    Out::Text(json!({"op": 11, "d": null, "s": null, "t": null}).to_string()),
                );
            }
            Some(2) => self.identify(conn, &frame["d"]),
            Some(6) => self.resume(conn, &frame["d"]),
            Some(3 | 4 | 8 | 31) => {
                if !authenticated {
                    self.send(conn, Out::Close(4003, "Not authenticated.".into()));
                }
            }
            _ => self.send(conn, Out::Close(4001, "Unknown opcode.".into())),
        }
    }

    fn identify(&mut self, conn: u64, d: &Value) {
        if self.conns.get(&conn).is_some_and(|c| c.session.is_some()) {
            self.send(conn, Out::Close(4005, "Already authenticated.".into()));
            return;
        }
        let token = strip_bot(d.get("token").and_then(Value::as_str).unwrap_or(""));
        let Some(bot) = self.bot_by_token(token) else {
            self.send(conn, Out::Close(4004, "Authentication failed.".into()));
            return;
        };
        let shard = match d.get("shard") {
            None | Some(Value::Null) => Some([0, 1]),
            Some(s) => s.as_array().and_then(|a| {
                let id = u32::try_from(a.first()?.as_u64()?).ok()?;
                let total = u32::try_from(a.get(1)?.as_u64()?).ok()?;
                (a.len() == 2 && total > 0 && id < total).then_some([id, total])
            }),
        };
        let Some(shard) = shard else {
            self.send(conn, Out::Close(4010, "Invalid shard.".into()));
            return;
        };
        let Some(intents) = d.get("intents").and_then(Value::as_u64) else {
            self.send(conn, Out::Close(4013, "Invalid intent(s).".into()));
            return;
        };
        // A privileged intent the application was not granted.
        if intents & INTENT_MESSAGE_CONTENT != 0
            && self.application_flags
                & (APP_FLAG_MESSAGE_CONTENT | APP_FLAG_MESSAGE_CONTENT_LIMITED)
                == 0
        {
            self.send(conn, Out::Close(4014, "Disallowed intent(s).".into()));
            return;
        }

        // A new IDENTIFY replaces an earlier session of the same bot and shard.
        let replaced: Vec<Option<u64>> = self
            .sessions
            .iter()
            .filter(|s| s.token == bot.token && s.shard == shard)
            .map(|s| s.conn)
            .collect();
        for old in replaced.into_iter().flatten() {
            if let Some(c) = self.conns.get_mut(&old) {
                c.session = None;
            }
        }
        self.sessions
            .retain(|s| !(s.token == bot.token && s.shard == shard));

        let n = self.next_session;
        self.next_session += 1;
        let session_id = format!(
            "{:016x}{:016x}",
            n,
            now_ms().wrapping_mul(0x9e37_79b9_7f4a_7c15)
        );
        self.rec.identifies.push(Identify {
            token: bot.token.clone(),
            shard,
            intents,
            session_id: session_id.clone(),
        });
        if let Some(c) = self.conns.get_mut(&conn) {
            c.session = Some(session_id.clone());
        }

        let owned: Vec<u64> = self
            .guilds
            .keys()
            .copied()
            .filter(|g| owns(shard, Some(*g)))
            .collect();
        let mut user = self.user_value(bot.user_id);
        user["verified"] = json!(true);
        user["mfa_enabled"] = json!(false);
        user["email"] = Value::Null;
        let ready = json!({
            "v": 10,
            "user": user,
            "guilds": owned.iter().map(|g| json!({"id": g.to_string(), "unavailable": true})).collect::<Vec<_>>(),
            "session_id": session_id,
            "resume_gateway_url": self.gateway_url(),
            "shard": shard,
            "application": {"id": bot.application_id.to_string(), "flags": 0},
            "private_channels": [],
            "relationships": [],
            "presences": [],
            "user_settings": {},
            "geo_ordered_rtc_regions": [],
            "guild_join_requests": [],
        });
        let guild_creates: Vec<Value> = if intents & INTENT_GUILDS != 0 {
            owned.iter().map(|g| self.guild_value(*g)).collect()
        } else {
            Vec::new()
        };

        let mut session = Session {
            id: session_id,
            token: bot.token.clone(),
            bot_user_id: bot.user_id,
            shard,
            intents,
            seq: 0,
            log: Vec::new(),
            conn: Some(conn),
        };
        emit(&mut session, &self.conns, "READY", ready);
        for guild in guild_creates {
            emit(&mut session, &self.conns, "GUILD_CREATE", guild);
        }
        self.sessions.push(session);
    }

    fn resume(&mut self, conn: u64, d: &Value) {
        let session_id = d
            .get("session_id")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let token = strip_bot(d.get("token").and_then(Value::as_str).unwrap_or("")).to_owned();
        let seq = d.get("seq").and_then(Value::as_u64).unwrap_or(0);
        if self.conns.get(&conn).is_some_and(|c| c.session.is_some()) {
            self.send(conn, Out::Close(4005, "Already authenticated.".into()));
            return;
        }
        let valid_token = self.bot_by_token(&token).is_some();
        let found = self
            .sessions
            .iter()
            .position(|s| s.id == session_id && s.token == token && valid_token && seq <= s.seq);
        let Some(index) = found else {
            self.rec.resumes.push(Resume {
                session_id,
                seq,
                accepted: false,
                replayed: 0,
            });
            self.send(
                conn,
                Out::Text(json!({"op": 9, "d": false, "s": null, "t": null}).to_string()),
            );
            return;
        };
        let Inner {
            sessions, conns, ..
        } = self;
        let session = &mut sessions[index];
        if let Some(old) = session.conn.take()
            && let Some(c) = conns.get_mut(&old)
        {
            c.session = None;
        }
        session.conn = Some(conn);
        let mut replayed = 0;
        if let Some(c) = conns.get_mut(&conn) {
            c.session = Some(session.id.clone());
            for (s, frame) in &session.log {
                if *s > seq {
                    let _ = c.tx.send(Out::Text(frame.clone()));
                    replayed += 1;
                }
            }
        }
        emit(
            session,
            conns,
            "RESUMED",
            json!({"_trace": ["fake-gateway"]}),
        );
        self.rec.resumes.push(Resume {
            session_id,
            seq,
            accepted: true,
            replayed,
        });
    }

    /// A connection ended. A client close with 1000/1001 ends the session
    /// that was attached (Discord invalidates it); otherwise it stays resumable.
    fn conn_closed(&mut self, conn: u64, client_close: Option<u16>) {
        let attached = self.conns.remove(&conn).and_then(|c| c.session);
        for session in &mut self.sessions {
            if session.conn == Some(conn) {
                session.conn = None;
            }
        }
        if matches!(client_close, Some(1000 | 1001))
            && let Some(session_id) = attached
        {
            self.sessions.retain(|s| s.id != session_id);
        }
    }

    /// Detaches every session from its connection and sends `out` to every
    /// connection (one `Out` per connection, built by `make`).
    fn for_each_conn(&mut self, make: impl Fn() -> Out) {
        for session in &mut self.sessions {
            session.conn = None;
        }
        for conn in self.conns.values_mut() {
            conn.session = None;
            let _ = conn.tx.send(make());
        }
    }

    // --- REST ---------------------------------------------------------------

    fn take_fault(&mut self, method: &Method, rel_path: &str) -> Option<Fault> {
        let index = self
            .faults
            .iter()
            .position(|(pattern, _)| pattern_matches(pattern, method, rel_path))?;
        Some(self.faults.remove(index).1)
    }

    fn bucket_headers(
        &mut self,
        method: &Method,
        segs: &[&str],
        consume: bool,
    ) -> (Vec<(HeaderName, String)>, Option<f64>) {
        let template: Vec<&str> = segs
            .iter()
            .map(|s| if s.parse::<u64>().is_ok() { "{id}" } else { s })
            .collect();
        let template = format!("{} /{}", method, template.join("/"));
        let major = match segs {
            ["channels" | "guilds" | "webhooks", id, ..] => *id,
            _ => "",
        };
        let mut hasher = DefaultHasher::new();
        template.hash(&mut hasher);
        let bucket_hash = format!("{:016x}", hasher.finish());
        let (limit, window) = (self.rate_limit, self.rate_window);
        let bucket = self
            .buckets
            .entry(format!("{bucket_hash}:{major}"))
            .or_insert_with(|| Bucket {
                started: Instant::now(),
                count: 0,
            });
        if bucket.started.elapsed() >= window {
            bucket.started = Instant::now();
            bucket.count = 0;
        }
        let reset_after = window
            .saturating_sub(bucket.started.elapsed())
            .as_secs_f64();
        let exceeded = bucket.count >= limit;
        if consume && !exceeded {
            bucket.count += 1;
        }
        let remaining = limit.saturating_sub(bucket.count);
        let reset_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            + reset_after;
        let headers = vec![
            (H_LIMIT, limit.to_string()),
            (H_REMAINING, remaining.to_string()),
            (H_RESET, format!("{reset_at:.3}")),
            (H_RESET_AFTER, format!("{reset_after:.3}")),
            (H_BUCKET, bucket_hash),
        ];
        let limited = (exceeded && self.enforce_rate_limits).then_some(reset_after);
        (headers, limited)
    }

    fn rest(
        &mut self,
        method: &Method,
        rel: &str,
        uri: &Uri,
        auth: Option<&str>,
        body: ReqBody,
    ) -> Outcome {
        let segs: Vec<&str> = rel.trim_matches('/').split('/').collect();
        if method == Method::GET && segs == ["gateway"] {
            return Outcome::ok(json!({"url": self.gateway_url()}));
        }
        let bot = auth
            .and_then(|a| a.strip_prefix("Bot "))
            .and_then(|t| self.bot_by_token(t.trim()));
        let Some(bot) = bot else {
            return Outcome::error(401, 0, "401: Unauthorized");
        };
        let (headers, limited) = self.bucket_headers(method, &segs, true);
        if let Some(retry_after) = limited {
            let mut out = rate_limited(retry_after, false);
            out.headers.extend(headers);
            return out;
        }
        let mut out = self.route(method, &segs, uri, &bot, body);
        out.headers.extend(headers);
        out
    }

    fn route(
        &mut self,
        method: &Method,
        segs: &[&str],
        uri: &Uri,
        bot: &BotRec,
        body: ReqBody,
    ) -> Outcome {
        let id = |s: &str| s.parse::<u64>().ok();
        match (method.as_str(), segs) {
            ("GET", ["gateway", "bot"]) => Outcome::ok(json!({
                "url": self.gateway_url(),
                "shards": self.recommended_shards,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": 999,
                    "reset_after": 14_400_000,
                    "max_concurrency": 1,
                },
            })),
            ("GET", ["users", "@me"]) => {
                let mut user = self.user_value(bot.user_id);
                user["verified"] = json!(true);
                user["mfa_enabled"] = json!(false);
                user["locale"] = json!("en-US");
                user["email"] = Value::Null;
                Outcome::ok(user)
            }
            ("GET", ["oauth2", "applications", "@me"]) => Outcome::ok(json!({
                "id": bot.application_id.to_string(),
                "name": bot.username,
                "icon": null,
                "description": "",
                "summary": "",
                "type": null,
                "bot_public": true,
                "bot_require_code_grant": false,
                "verify_key": "0".repeat(64),
                "flags": self.application_flags,
                "owner": self.user_value(OWNER_ID),
                "team": null,
                "bot": self.user_value(bot.user_id),
                "rpc_origins": [],
                "redirect_uris": [],
                "interactions_endpoint_url": null,
                "role_connections_verification_url": null,
                "tags": [],
                "approximate_guild_count": self.guilds.len(),
            })),
            ("GET", ["channels", c]) => match id(c).and_then(|c| self.channel_value(c)) {
                Some(v) => Outcome::ok(v),
                None => Outcome::error(404, 10003, "Unknown Channel"),
            },
            ("GET", ["channels", c, "messages"]) => match id(c) {
                Some(c) => self.get_messages(c, uri),
                None => Outcome::error(404, 10003, "Unknown Channel"),
            },
            ("POST", ["channels", c, "messages"]) => match id(c) {
                Some(c) => self.create_message(bot, c, body),
                None => Outcome::error(404, 10003, "Unknown Channel"),
            },
            ("GET", ["channels", c, "messages", m]) => match (id(c), id(m)) {
                (Some(c), Some(m)) if self.channels.contains_key(&c) => {
                    match self
                        .history
                        .get(&c)
                        .and_then(|h| h.iter().find(|x| x.id == m))
                    {
                        Some(msg) => Outcome::ok(msg.value.clone()),
                        None => Outcome::error(404, 10008, "Unknown Message"),
                    }
                }
                _ => Outcome::error(404, 10003, "Unknown Channel"),
            },
            ("PATCH", ["channels", c, "messages", m]) => match (id(c), id(m)) {
                (Some(c), Some(m)) => self.edit_message(bot, c, m, body),
                _ => Outcome::error(404, 10003, "Unknown Channel"),
            },
            ("POST", ["channels", c, "typing"]) => match id(c) {
                Some(c) if self.channels.contains_key(&c) => {
                    self.rec.typing.push(Typing {
                        channel_id: c,
                        user_id: bot.user_id,
                    });
                    Outcome::no_content()
                }
                _ => Outcome::error(404, 10003, "Unknown Channel"),
            },
            _ => Outcome::not_found(),
        }
    }

    fn get_messages(&mut self, channel_id: u64, uri: &Uri) -> Outcome {
        let query: HashMap<String, String> =
            Query::try_from_uri(uri).map(|q| q.0).unwrap_or_default();
        let mut parsed = HashMap::new();
        for key in ["after", "before", "around", "limit"] {
            if let Some(raw) = query.get(key) {
                match raw.parse::<u64>() {
                    Ok(v) => {
                        parsed.insert(key, v);
                    }
                    Err(_) => {
                        let (code, message) = if key == "limit" {
                            ("NUMBER_TYPE_COERCE", format!("Value \"{raw}\" is not int."))
                        } else {
                            (
                                "NUMBER_TYPE_COERCE",
                                format!("Value \"{raw}\" is not snowflake."),
                            )
                        };
                        return Outcome::form_error(key, code, &message);
                    }
                }
            }
        }
        let request = HistoryRequest {
            channel_id,
            after: parsed.get("after").copied(),
            before: parsed.get("before").copied(),
            around: parsed.get("around").copied(),
            limit: parsed.get("limit").copied(),
        };
        self.rec.history.push(request.clone());
        if !self.channels.contains_key(&channel_id) {
            return Outcome::error(404, 10003, "Unknown Channel");
        }
        let limit = request.limit.unwrap_or(50);
        if limit == 0 {
            return Outcome::form_error(
                "limit",
                "NUMBER_TYPE_MIN",
                "Must be greater than or equal to 1.",
            );
        }
        if limit > 100 {
            return Outcome::form_error(
                "limit",
                "NUMBER_TYPE_MAX",
                "Must be less than or equal to 100.",
            );
        }
        let limit = usize::try_from(limit).unwrap_or(100);
        let all = self.history.get(&channel_id).map_or(&[][..], Vec::as_slice);
        let mut picked: Vec<&StoredMessage> = if let Some(after) = request.after {
            all.iter().filter(|m| m.id > after).take(limit).collect()
        } else if let Some(before) = request.before {
            let older: Vec<&StoredMessage> = all.iter().filter(|m| m.id < before).collect();
            older[older.len().saturating_sub(limit)..].to_vec()
        } else if let Some(around) = request.around {
            let pos = all.partition_point(|m| m.id < around);
            let start = pos.saturating_sub(limit / 2);
            all.iter().skip(start).take(limit).collect()
        } else {
            all[all.len().saturating_sub(limit)..].iter().collect()
        };
        picked.reverse();
        Outcome::ok(Value::Array(
            picked.into_iter().map(|m| m.value.clone()).collect(),
        ))
    }

    fn create_message(&mut self, bot: &BotRec, channel_id: u64, body: ReqBody) -> Outcome {
        if !self.channels.contains_key(&channel_id) {
            return Outcome::error(404, 10003, "Unknown Channel");
        }
        let (payload, files) = match body {
            ReqBody::Json(v) => (v, Vec::new()),
            ReqBody::Multipart { payload, files } => (payload, files),
            ReqBody::Empty => (json!({}), Vec::new()),
            ReqBody::Invalid => {
                return Outcome::error(400, 50109, "The request body contains invalid JSON.");
            }
        };
        let content = payload
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if content.chars().count() > MAX_CONTENT_CHARS {
            return Outcome::form_error(
                "content",
                "BASE_TYPE_MAX_LENGTH",
                "Must be 2000 or fewer in length.",
            );
        }
        let nonce = payload.get("nonce").filter(|n| !n.is_null()).cloned();
        let nonce_key = match &nonce {
            None => None,
            Some(Value::String(s)) if s.chars().count() > MAX_NONCE_CHARS => {
                return Outcome::form_error(
                    "nonce",
                    "BASE_TYPE_MAX_LENGTH",
                    "Must be 25 or fewer in length.",
                );
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            Some(_) => {
                return Outcome::form_error(
                    "nonce",
                    "NONCE_TYPE_INVALID",
                    "Nonce must be an integer or a string.",
                );
            }
        };
        let enforce_nonce = payload
            .get("enforce_nonce")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let embeds: Vec<Value> = payload
            .get("embeds")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|e| {
                        let mut e = e.clone();
                        if e.get("type").is_none() {
                            e["type"] = json!("rich");
                        }
                        e
                    })
                    .collect()
            })
            .unwrap_or_default();
        let has_stickers = payload
            .get("sticker_ids")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty());
        let has_poll = payload.get("poll").is_some_and(|p| !p.is_null());
        if content.is_empty() && embeds.is_empty() && files.is_empty() && !has_stickers && !has_poll
        {
            return Outcome::error(400, 50006, "Cannot send an empty message");
        }
        let reply_to = match payload.get("message_reference") {
            Some(r) if r.is_object() => {
                let target = r.get("message_id").and_then(id_of);
                let fail = r
                    .get("fail_if_not_exists")
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
                match target {
                    Some(t) if self.find_message(t).is_some() => Some(t),
                    Some(_) if fail => {
                        return Outcome::form_error(
                            "message_reference",
                            "MESSAGE_REFERENCE_UNKNOWN_MESSAGE",
                            "Unknown message",
                        );
                    }
                    _ => None,
                }
            }
            _ => None,
        };

        let window = self.nonce_window;
        self.nonces.retain(|_, (_, at)| at.elapsed() < window);
        if enforce_nonce
            && let Some(key) = &nonce_key
            && let Some((existing_id, _)) = self.nonces.get(&(bot.user_id, key.clone()))
        {
            let existing_id = *existing_id;
            if let Some(existing) = self.find_message(existing_id) {
                let value = existing.value.clone();
                self.rec.dedupes.push(Dedupe {
                    channel_id: existing.channel_id,
                    nonce: key.clone(),
                    message_id: existing_id,
                });
                return Outcome::ok(value);
            }
        }

        let filenames: Vec<String> = files.iter().map(|f| f.filename.clone()).collect();
        let attachments: Vec<Value> = files
            .into_iter()
            .map(|f| self.store_file(channel_id, f, None))
            .collect();
        let flags = payload.get("flags").and_then(Value::as_u64).unwrap_or(0);
        let msg = self.build_message(NewMessage {
            channel_id,
            author_id: bot.user_id,
            content: content.clone(),
            nonce,
            reply_to,
            attachments,
            embeds,
            flags,
        });
        if let Some(key) = &nonce_key {
            self.nonces
                .insert((bot.user_id, key.clone()), (msg.id, Instant::now()));
        }
        self.rec.created.push(CreatedMessage {
            id: msg.id,
            channel_id,
            author_id: bot.user_id,
            content,
            nonce: nonce_key,
            enforce_nonce,
            reply_to,
            files: filenames,
            body: payload,
        });
        let value = msg.value.clone();
        self.store_and_dispatch(msg);
        Outcome::ok(value)
    }

    fn edit_message(
        &mut self,
        bot: &BotRec,
        channel_id: u64,
        message_id: u64,
        body: ReqBody,
    ) -> Outcome {
        if !self.channels.contains_key(&channel_id) {
            return Outcome::error(404, 10003, "Unknown Channel");
        }
        let payload = match body {
            ReqBody::Json(v) => v,
            ReqBody::Multipart { payload, .. } => payload,
            ReqBody::Empty => json!({}),
            ReqBody::Invalid => {
                return Outcome::error(400, 50109, "The request body contains invalid JSON.");
            }
        };
        let Some(author) = self
            .history
            .get(&channel_id)
            .and_then(|h| h.iter().find(|m| m.id == message_id))
            .map(|m| m.author_id)
        else {
            return Outcome::error(404, 10008, "Unknown Message");
        };
        if author != bot.user_id {
            return Outcome::error(403, 50005, "Cannot edit a message authored by another user");
        }
        let new_content = match payload.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Null) => Some(String::new()),
            _ => None,
        };
        if let Some(c) = &new_content
            && c.chars().count() > MAX_CONTENT_CHARS
        {
            return Outcome::form_error(
                "content",
                "BASE_TYPE_MAX_LENGTH",
                "Must be 2000 or fewer in length.",
            );
        }
        let mentions: Option<Vec<Value>> = new_content.as_ref().map(|c| {
            parse_mentions(c)
                .iter()
                .map(|u| self.user_value(*u))
                .collect()
        });
        let edited_at = iso8601(now_ms());
        let Some(msg) = self
            .history
            .get_mut(&channel_id)
            .and_then(|h| h.iter_mut().find(|m| m.id == message_id))
        else {
            return Outcome::error(404, 10008, "Unknown Message");
        };
        if let (Some(c), Some(mentions)) = (&new_content, mentions) {
            msg.value["content"] = json!(c);
            msg.value["mentions"] = Value::Array(mentions);
            msg.mention_ids = parse_mentions(c);
        }
        if let Some(embeds) = payload.get("embeds").filter(|e| e.is_array()) {
            msg.value["embeds"] = embeds.clone();
        }
        if let Some(flags) = payload.get("flags").and_then(Value::as_u64) {
            msg.value["flags"] = json!(flags);
        }
        msg.value["edited_timestamp"] = json!(edited_at);
        let msg = msg.clone();
        self.rec.edits.push(Edit {
            channel_id,
            message_id,
            content: new_content,
            body: payload,
        });
        self.dispatch_message("MESSAGE_UPDATE", &msg);
        Outcome::ok(msg.value)
    }
}

/// Sends one dispatch in a session: assigns the next sequence number, logs it
/// for RESUME, and writes it to the attached connection (if any).
fn emit(session: &mut Session, conns: &HashMap<u64, ConnRec>, event: &str, d: Value) {
    session.seq += 1;
    let frame = json!({"op": 0, "t": event, "s": session.seq, "d": d}).to_string();
    session.log.push((session.seq, frame.clone()));
    if let Some(conn) = session.conn.and_then(|c| conns.get(&c)) {
        let _ = conn.tx.send(Out::Text(frame));
    }
}

/// Whether a shard receives events of a guild (`None`: a DM, shard 0).
fn owns(shard: [u32; 2], guild_id: Option<u64>) -> bool {
    match guild_id {
        Some(g) => (g >> 22) % u64::from(shard[1].max(1)) == u64::from(shard[0]),
        None => shard[0] == 0,
    }
}

fn redact(message: &mut Value) {
    message["content"] = json!("");
    message["embeds"] = json!([]);
    message["attachments"] = json!([]);
    message["components"] = json!([]);
}

fn user_json(id: u64, name: &str, bot: bool) -> Value {
    json!({
        "id": id.to_string(),
        "username": name,
        "discriminator": "0",
        "global_name": null,
        "avatar": null,
        "bot": bot,
        "public_flags": 0,
        "flags": 0,
    })
}

fn strip_bot(token: &str) -> &str {
    let token = token.trim();
    token.strip_prefix("Bot ").unwrap_or(token).trim()
}

fn id_of(value: &Value) -> Option<u64> {
    match value {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// User ids mentioned as `<@id>` or `<@!id>`, in order, without repeats.
fn parse_mentions(content: &str) -> Vec<u64> {
    let mut ids = Vec::new();
    let mut rest = content;
    while let Some(start) = rest.find("<@") {
        rest = &rest[start + 2..];
        let body = rest.strip_prefix('!').unwrap_or(rest);
        let digits: String = body.chars().take_while(char::is_ascii_digit).collect();
        if !digits.is_empty()
            && body[digits.len()..].starts_with('>')
            && let Ok(id) = digits.parse::<u64>()
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    ids
}

/// `"POST /channels/*/messages"`: an optional method (or `*`), then a path
/// below `/api/v10` (the prefix may be included) whose `*` segments match any
/// one segment. The query string is ignored.
fn pattern_matches(pattern: &str, method: &Method, rel_path: &str) -> bool {
    let pattern = pattern.trim();
    let (method_pattern, path_pattern) = match pattern.split_once(' ') {
        Some((m, p)) => (Some(m.trim()), p.trim()),
        None => (None, pattern),
    };
    if let Some(m) = method_pattern
        && m != "*"
        && !m.eq_ignore_ascii_case(method.as_str())
    {
        return false;
    }
    let path_pattern = path_pattern.split('?').next().unwrap_or("");
    let path_pattern = path_pattern
        .strip_prefix(API_PREFIX)
        .unwrap_or(path_pattern);
    let want: Vec<&str> = path_pattern.trim_matches('/').split('/').collect();
    let have: Vec<&str> = rel_path.trim_matches('/').split('/').collect();
    want.len() == have.len() && want.iter().zip(&have).all(|(w, h)| *w == "*" || w == h)
}

fn rate_limited(retry_after: f64, global: bool) -> Outcome {
    let mut headers = vec![
        (H_RETRY_AFTER, format!("{}", retry_after.ceil().max(0.0))),
        (H_SCOPE, if global { "global" } else { "user" }.to_owned()),
    ];
    if global {
        headers.push((H_GLOBAL, "true".to_owned()));
    }
    Outcome {
        status: StatusCode::TOO_MANY_REQUESTS,
        body: Some(json!({
            "message": "You are being rate limited.",
            "retry_after": retry_after,
            "global": global,
        })),
        headers,
    }
}

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

fn snowflake_ms(id: u64) -> u64 {
    (id >> 22) + DISCORD_EPOCH_MS
}

/// `2024-01-02T03:04:05.678000+00:00`, the form Discord uses.
fn iso8601(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let millis = unix_ms % 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let of_day = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}000+00:00",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

// ---------------------------------------------------------------------------
// HTTP handlers
// ---------------------------------------------------------------------------

async fn read_body(req: Request) -> ReqBody {
    let content_type = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if content_type.starts_with("multipart/form-data") {
        let Ok(mut multipart) = Multipart::from_request(req, &()).await else {
            return ReqBody::Invalid;
        };
        let mut payload = json!({});
        let mut files = Vec::new();
        while let Ok(Some(field)) = multipart.next_field().await {
            let name = field.name().unwrap_or("").to_owned();
            let filename = field.file_name().map(str::to_owned);
            let field_type = field.content_type().map(str::to_owned);
            let Ok(bytes) = field.bytes().await else {
                return ReqBody::Invalid;
            };
            if name == "payload_json" {
                match serde_json::from_slice(&bytes) {
                    Ok(v) => payload = v,
                    Err(_) => return ReqBody::Invalid,
                }
            } else if name.starts_with("files[") || filename.is_some() {
                files.push(UploadedFile {
                    filename: filename.unwrap_or(name),
                    content_type: field_type,
                    bytes: bytes.to_vec(),
                });
            }
        }
        return ReqBody::Multipart { payload, files };
    }
    let Ok(bytes) = axum::body::to_bytes(req.into_body(), 16 * 1024 * 1024).await else {
        return ReqBody::Invalid;
    };
    if bytes.is_empty() {
        return ReqBody::Empty;
    }
    serde_json::from_slice(&bytes).map_or(ReqBody::Invalid, ReqBody::Json)
}

async fn handle_rest(shared: &Shared, req: Request, rel: &str) -> Outcome {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let auth = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = read_body(req).await;
    shared
        .lock()
        .rest(&method, rel, &uri, auth.as_deref(), body)
}

async fn rest_entry(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(conn): ConnectInfo<ConnKill>,
    req: Request,
) -> Response {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |p| p.as_str().to_owned());
    let Some(rel) = uri.path().strip_prefix(API_PREFIX).map(str::to_owned) else {
        return Outcome::not_found().into_response();
    };
    let logged_path = path_and_query
        .strip_prefix(API_PREFIX)
        .unwrap_or(&path_and_query)
        .to_owned();
    let fault = shared.lock().take_fault(&method, &rel);
    let outcome = match fault {
        None => Some(handle_rest(&shared, req, &rel).await),
        Some(Fault::RateLimited {
            retry_after_secs,
            global,
        }) => {
            let segs: Vec<&str> = rel.trim_matches('/').split('/').collect();
            let (mut headers, _) = shared.lock().bucket_headers(&method, &segs, false);
            for (name, value) in &mut headers {
                if *name == H_REMAINING {
                    *value = "0".to_owned();
                }
                if *name == H_RESET_AFTER {
                    *value = format!("{retry_after_secs:.3}");
                }
            }
            let mut out = rate_limited(retry_after_secs, global);
            out.headers.extend(headers);
            Some(out)
        }
        Some(Fault::Status(code, body)) => Some(Outcome {
            status: StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            body: Some(body),
            headers: Vec::new(),
        }),
        Some(Fault::Hang(d)) => {
            tokio::time::sleep(d).await;
            Some(handle_rest(&shared, req, &rel).await)
        }
        Some(Fault::HangAfterEffect(d)) => {
            let out = handle_rest(&shared, req, &rel).await;
            tokio::time::sleep(d).await;
            Some(out)
        }
        Some(Fault::HangBeforeEffect(d)) => {
            tokio::time::sleep(d).await;
            None
        }
        Some(Fault::Close) => None,
        Some(Fault::CloseAfterEffect) => {
            let _ = handle_rest(&shared, req, &rel).await;
            None
        }
    };
    shared.lock().rec.requests.push(RestRequest {
        method: method.to_string(),
        path: logged_path,
        status: outcome.as_ref().map(|o| o.status.as_u16()),
    });
    match outcome {
        Some(out) => out.into_response(),
        None => {
            conn.kill();
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn attachment_entry(
    State(shared): State<Arc<Shared>>,
    Path((_channel, id, _name)): Path<(u64, u64, String)>,
) -> Response {
    let inner = shared.lock();
    match inner.files.get(&id) {
        Some(file) => {
            let content_type = file
                .content_type
                .clone()
                .unwrap_or_else(|| "application/octet-stream".to_owned());
            ([(CONTENT_TYPE, content_type)], file.bytes.clone()).into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn gateway_entry(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    ws: WebSocketUpgrade,
) -> Response {
    let query = uri.query().unwrap_or("").to_owned();
    shared.lock().rec.gateway_connects.push(query.clone());
    ws.on_upgrade(move |socket| run_gateway(shared, socket, query))
}

async fn run_gateway(shared: Arc<Shared>, mut socket: WebSocket, query: String) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let conn = {
        let mut inner = shared.lock();
        let conn = inner.next_conn;
        inner.next_conn += 1;
        let params: HashMap<&str, &str> = query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let first = if params.get("v").is_some_and(|v| *v != "10") {
            Out::Close(4012, "Invalid API version.".into())
        } else if params.get("encoding").is_some_and(|e| *e != "json") {
            Out::Close(4002, "This fake only speaks encoding=json.".into())
        } else if params.contains_key("compress") {
            Out::Close(
                4000,
                "This fake does not implement transport compression.".into(),
            )
        } else {
            Out::Text(
                json!({
                    "op": 10,
                    "d": {"heartbeat_interval": inner.heartbeat_interval_ms, "_trace": ["fake-gateway"]},
                    "s": null,
                    "t": null,
                })
                .to_string(),
            )
        };
        let _ = tx.send(first);
        inner.conns.insert(conn, ConnRec { tx, session: None });
        conn
    };
    let mut client_close = None;
    loop {
        tokio::select! {
            out = rx.recv() => match out {
                Some(Out::Text(text)) => {
                    if socket.send(WsMessage::Text(text.into())).await.is_err() {
                        break;
                    }
                }
                Some(Out::Close(code, reason)) => {
                    let frame = CloseFrame { code, reason: reason.into() };
                    let _ = socket.send(WsMessage::Close(Some(frame))).await;
                    break;
                }
                Some(Out::Drop) | None => break,
            },
            message = socket.recv() => match message {
                Some(Ok(WsMessage::Text(text))) => shared.lock().client_frame(conn, text.as_str()),
                Some(Ok(WsMessage::Binary(_))) => {
                    shared.lock().send(conn, Out::Close(4002, "Error while decoding payload.".into()));
                }
                Some(Ok(WsMessage::Close(frame))) => {
                    client_close = Some(frame.map_or(1005, |f| f.code));
                    // Reading on flushes the automatic close reply.
                    let _ = tokio::time::timeout(Duration::from_secs(1), async {
                        while let Some(Ok(_)) = socket.recv().await {}
                    })
                    .await;
                    break;
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => break,
            },
        }
    }
    shared.lock().conn_closed(conn, client_close);
}

// ---------------------------------------------------------------------------
// The fake
// ---------------------------------------------------------------------------

/// A fake Discord on 127.0.0.1. Dropping it stops the server and drops every
/// gateway connection.
pub struct FakeDiscord {
    shared: Arc<Shared>,
    addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeDiscord {
    fn drop(&mut self) {
        self.server.abort();
        let inner = self.shared.lock();
        for conn in inner.conns.values() {
            let _ = conn.tx.send(Out::Drop);
        }
    }
}

impl FakeDiscord {
    /// Binds 127.0.0.1:0 and serves REST (`/api/v10/...`), the gateway
    /// (`/gateway`) and attachment downloads (`/attachments/...`).
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::new(addr.port())),
        });
        let app = Router::new()
            .route("/gateway", get(gateway_entry))
            .route("/attachments/{channel}/{id}/{name}", get(attachment_entry))
            .fallback(rest_entry)
            .with_state(Arc::clone(&shared));
        let server = tokio::spawn(async move {
            let service = app.into_make_service_with_connect_info::<ConnKill>();
            if let Err(error) = axum::serve(FakeListener(listener), service).await {
                tracing::warn!(%error, "fake discord server stopped");
            }
        });
        Self {
            shared,
            addr,
            server,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.lock()
    }

    /// `http://127.0.0.1:PORT`: what serenity's `HttpBuilder::proxy` takes.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://127.0.0.1:PORT/api/v10`.
    pub fn api_url(&self) -> String {
        format!("http://{}{API_PREFIX}", self.addr)
    }

    /// `ws://127.0.0.1:PORT/gateway`, as `GET /gateway` returns it.
    pub fn gateway_url(&self) -> String {
        format!("ws://{}/gateway", self.addr)
    }

    // --- setup --------------------------------------------------------------

    /// Registers a bot: its token (without `Bot `), user, application and name.
    pub fn add_bot(&self, token: &str, user_id: u64, application_id: u64, username: &str) {
        let mut inner = self.lock();
        inner.bots.retain(|b| b.token != token);
        inner.bots.push(BotRec {
            token: token.to_owned(),
            user_id,
            application_id,
            username: username.to_owned(),
            revoked: false,
        });
    }

    /// Revokes a token: REST answers 401 and its gateway connections are
    /// closed with 4004 (sessions forgotten).
    pub fn revoke(&self, token: &str) {
        let mut inner = self.lock();
        for bot in inner.bots.iter_mut().filter(|b| b.token == token) {
            bot.revoked = true;
        }
        let conns: Vec<u64> = inner
            .sessions
            .iter()
            .filter(|s| s.token == token)
            .filter_map(|s| s.conn)
            .collect();
        inner.sessions.retain(|s| s.token != token);
        for conn in conns {
            if let Some(c) = inner.conns.get_mut(&conn) {
                c.session = None;
            }
            inner.send(conn, Out::Close(4004, "Authentication failed.".into()));
        }
    }

    /// Names a (non-bot) user for author objects and mentions.
    pub fn add_user(&self, user_id: u64, username: &str) {
        self.lock().users.insert(
            user_id,
            UserRec {
                name: username.to_owned(),
                bot: false,
            },
        );
    }

    pub fn add_dm_channel(&self, channel_id: u64, recipient_id: u64) {
        self.lock().channels.insert(
            channel_id,
            ChannelRec::Dm {
                recipient: recipient_id,
            },
        );
    }

    /// Adds a guild. Connected sessions are not told (no GUILD_CREATE); add
    /// guilds before the client identifies.
    pub fn add_guild(&self, guild_id: u64, name: &str) {
        self.lock().guilds.insert(guild_id, name.to_owned());
    }

    /// Adds a text channel (type 0); adds the guild too if unknown.
    pub fn add_guild_channel(&self, guild_id: u64, channel_id: u64, name: &str) {
        let mut inner = self.lock();
        inner
            .guilds
            .entry(guild_id)
            .or_insert_with(|| format!("guild-{guild_id}"));
        inner.channels.insert(
            channel_id,
            ChannelRec::Text {
                guild_id,
                name: name.to_owned(),
            },
        );
    }

    /// Adds a public thread (type 11) under `parent_id`.
    pub fn add_thread(&self, guild_id: u64, parent_id: u64, thread_id: u64) {
        let mut inner = self.lock();
        inner
            .guilds
            .entry(guild_id)
            .or_insert_with(|| format!("guild-{guild_id}"));
        inner.channels.insert(
            thread_id,
            ChannelRec::Thread {
                guild_id,
                parent_id,
                name: format!("thread-{thread_id}"),
            },
        );
    }

    /// The heartbeat interval announced in later HELLOs.
    pub fn set_heartbeat_interval(&self, ms: u64) {
        self.lock().heartbeat_interval_ms = ms;
    }

    /// The application's `flags` (default: the Message Content intent is
    /// enabled, `APP_FLAG_MESSAGE_CONTENT_LIMITED`). Without a message
    /// content flag, an IDENTIFY asking for `MESSAGE_CONTENT` is closed with
    /// 4014, as Discord does.
    pub fn set_application_flags(&self, flags: u64) {
        self.lock().application_flags = flags;
    }

    /// `shards` in `GET /gateway/bot` (default 1).
    pub fn set_recommended_shards(&self, shards: u32) {
        self.lock().recommended_shards = shards.max(1);
    }

    /// How long a nonce dedupes (default 5 minutes).
    pub fn set_nonce_window(&self, window: Duration) {
        self.lock().nonce_window = window;
    }

    /// Per-route bucket size reported in `X-RateLimit-*` (default 5 per 5 s,
    /// keyed by route and channel). With `enforce`, exceeding it answers 429
    /// (`global: false`); by default the headers are informational only.
    pub fn set_rate_limit(&self, limit: u32, window: Duration, enforce: bool) {
        let mut inner = self.lock();
        inner.rate_limit = limit.max(1);
        inner.rate_window = window;
        inner.enforce_rate_limits = enforce;
        inner.buckets.clear();
    }

    /// Queues `fault` for the next REST request matching `pattern`
    /// (`"POST /channels/*/messages"`, `"PATCH /channels/1/messages/*"`,
    /// `"/users/@me"` for any method). Faults are used once, in order.
    pub fn fail_next(&self, pattern: &str, fault: Fault) {
        self.lock().faults.push((pattern.to_owned(), fault));
    }

    // --- events -------------------------------------------------------------

    /// A user posts `content` in `channel_id`: stored in the history and
    /// dispatched as MESSAGE_CREATE. Returns the message id.
    pub fn push_message(&self, channel_id: u64, author_id: u64, content: &str) -> u64 {
        self.push(UserMessage::new(channel_id, author_id, content))
    }

    /// Like [`Self::push_message`] with the options of [`UserMessage`].
    ///
    /// # Panics
    ///
    /// If the channel is unknown.
    pub fn push(&self, message: UserMessage) -> u64 {
        let mut inner = self.lock();
        assert!(
            inner.channels.contains_key(&message.channel_id),
            "push: unknown channel {}; add it first",
            message.channel_id
        );
        if message.author_name.is_some() || message.author_is_bot {
            let name = message
                .author_name
                .clone()
                .or_else(|| inner.users.get(&message.author_id).map(|u| u.name.clone()))
                .unwrap_or_else(|| format!("user{}", message.author_id));
            inner.users.insert(
                message.author_id,
                UserRec {
                    name,
                    bot: message.author_is_bot,
                },
            );
        }
        let attachments: Vec<Value> = message
            .attachments
            .into_iter()
            .map(|a| {
                let file = UploadedFile {
                    filename: a.filename,
                    content_type: a.content_type,
                    bytes: a.bytes,
                };
                inner.store_file(message.channel_id, file, a.url)
            })
            .collect();
        let stored = inner.build_message(NewMessage {
            channel_id: message.channel_id,
            author_id: message.author_id,
            content: message.content,
            nonce: None,
            reply_to: message.reply_to,
            attachments,
            embeds: Vec::new(),
            flags: 0,
        });
        let id = stored.id;
        inner.store_and_dispatch(stored);
        id
    }

    /// The author edits a message: content replaced, `edited_timestamp` set,
    /// MESSAGE_UPDATE (full message) dispatched.
    ///
    /// # Panics
    ///
    /// If the message is unknown.
    pub fn push_message_update(&self, channel_id: u64, message_id: u64, content: &str) {
        let mut inner = self.lock();
        let mentions: Vec<Value> = parse_mentions(content)
            .iter()
            .map(|u| inner.user_value(*u))
            .collect();
        let msg = inner
            .history
            .get_mut(&channel_id)
            .and_then(|h| h.iter_mut().find(|m| m.id == message_id))
            .expect("push_message_update: unknown message");
        msg.value["content"] = json!(content);
        msg.value["mentions"] = Value::Array(mentions);
        msg.value["edited_timestamp"] = json!(iso8601(now_ms()));
        msg.mention_ids = parse_mentions(content);
        let msg = msg.clone();
        inner.dispatch_message("MESSAGE_UPDATE", &msg);
    }

    /// A message is deleted: removed from the history, MESSAGE_DELETE dispatched.
    pub fn push_message_delete(&self, channel_id: u64, message_id: u64) {
        let mut inner = self.lock();
        if let Some(history) = inner.history.get_mut(&channel_id) {
            history.retain(|m| m.id != message_id);
        }
        let guild_id = inner
            .channels
            .get(&channel_id)
            .and_then(ChannelRec::guild_id);
        let mut d = json!({"id": message_id.to_string(), "channel_id": channel_id.to_string()});
        if let Some(g) = guild_id {
            d["guild_id"] = json!(g.to_string());
        }
        let intent = if guild_id.is_some() {
            INTENT_GUILD_MESSAGES
        } else {
            INTENT_DIRECT_MESSAGES
        };
        inner.broadcast("MESSAGE_DELETE", guild_id, intent, |_| d.clone());
    }

    /// Sends INVALID_SESSION (op 9, `d: false`) on every connected session
    /// and forgets all sessions: clients must IDENTIFY again, and whatever is
    /// pushed before they do is never dispatched (only kept in the history).
    pub fn invalidate_session(&self) {
        let mut inner = self.lock();
        let frame = json!({"op": 9, "d": false, "s": null, "t": null}).to_string();
        let conns: Vec<u64> = inner.sessions.iter().filter_map(|s| s.conn).collect();
        inner.sessions.clear();
        for conn in conns {
            if let Some(c) = inner.conns.get_mut(&conn) {
                c.session = None;
            }
            inner.send(conn, Out::Text(frame.clone()));
        }
    }

    /// Sends RECONNECT (op 7) on every connected session; sessions stay
    /// resumable and keep logging dispatches until the client resumes.
    pub fn request_reconnect(&self) {
        let inner = self.lock();
        let frame = json!({"op": 7, "d": null, "s": null, "t": null}).to_string();
        for conn in inner.sessions.iter().filter_map(|s| s.conn) {
            inner.send(conn, Out::Text(frame.clone()));
        }
    }

    /// Drops every gateway connection without a close frame. Sessions stay
    /// resumable; dispatches from now on are buffered for RESUME.
    pub fn drop_connection(&self) {
        self.lock().for_each_conn(|| Out::Drop);
    }

    /// Closes every gateway connection with `code`. 4007 and 4009 also end
    /// the sessions (as on Discord); other codes leave them resumable.
    pub fn close_connection(&self, code: u16) {
        let mut inner = self.lock();
        if matches!(code, 4007 | 4009) {
            inner.sessions.clear();
        }
        inner.for_each_conn(|| Out::Close(code, format!("closed by test ({code})")));
    }

    // --- inspection ---------------------------------------------------------

    /// Messages the bot created in `channel_id`, in order (dedupes excluded).
    pub fn created_messages(&self, channel_id: u64) -> Vec<CreatedMessage> {
        self.lock()
            .rec
            .created
            .iter()
            .filter(|m| m.channel_id == channel_id)
            .cloned()
            .collect()
    }

    /// Every message the bot created, in order.
    pub fn all_created_messages(&self) -> Vec<CreatedMessage> {
        self.lock().rec.created.clone()
    }

    /// Create requests answered with an existing message (nonce dedupe).
    pub fn dedupes(&self) -> Vec<Dedupe> {
        self.lock().rec.dedupes.clone()
    }

    pub fn edits(&self) -> Vec<Edit> {
        self.lock().rec.edits.clone()
    }

    pub fn typing(&self) -> Vec<Typing> {
        self.lock().rec.typing.clone()
    }

    pub fn identifies(&self) -> Vec<Identify> {
        self.lock().rec.identifies.clone()
    }

    pub fn resumes(&self) -> Vec<Resume> {
        self.lock().rec.resumes.clone()
    }

    /// Live sessions, in creation order.
    pub fn sessions(&self) -> Vec<SessionInfo> {
        self.lock()
            .sessions
            .iter()
            .map(|s| SessionInfo {
                session_id: s.id.clone(),
                token: s.token.clone(),
                shard: s.shard,
                intents: s.intents,
                connected: s.conn.is_some(),
                seq: s.seq,
            })
            .collect()
    }

    pub fn history_requests(&self) -> Vec<HistoryRequest> {
        self.lock().rec.history.clone()
    }

    /// The stored messages of a channel (REST form), oldest first.
    pub fn history(&self, channel_id: u64) -> Vec<Value> {
        self.lock()
            .history
            .get(&channel_id)
            .map(|h| h.iter().map(|m| m.value.clone()).collect())
            .unwrap_or_default()
    }

    /// Heartbeats received (each was acknowledged with op 11).
    pub fn heartbeats(&self) -> u64 {
        self.lock().rec.heartbeats
    }

    /// Every REST request, in arrival order of its completion.
    pub fn requests(&self) -> Vec<RestRequest> {
        self.lock().rec.requests.clone()
    }

    /// The query string of every gateway connection (serenity: `v=10`).
    pub fn gateway_connections(&self) -> Vec<String> {
        self.lock().rec.gateway_connects.clone()
    }

    /// Polls `condition` every 10 ms until it holds (true) or `timeout` passes (false).
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&Self) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if condition(self) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::ops::Range;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use futures::{SinkExt, StreamExt};
    use serde_json::{Value, json};
    use serenity::builder::{CreateAttachment, CreateMessage, EditMessage};
    use serenity::client::{ClientBuilder, Context, EventHandler};
    use serenity::gateway::{GatewayError, ShardManager};
    use serenity::http::{Http, HttpBuilder, HttpError, MessagePagination};
    use serenity::model::channel::{Channel, ChannelType, Message, MessageType, Nonce};
    use serenity::model::event::{MessageUpdateEvent, ResumedEvent};
    use serenity::model::gateway::{GatewayIntents, Ready};
    use serenity::model::guild::Guild;
    use serenity::model::id::{ChannelId, MessageId};
    use tokio::sync::mpsc;
    use tokio_tungstenite::tungstenite::Message as WsFrame;

    use super::{
        Dedupe, FakeAttachment, FakeDiscord, Fault, HistoryRequest, Identify, OWNER_ID, Typing,
        UserMessage,
    };

    const TOKEN: &str = "fake-bot-token";
    const BOT_ID: u64 = 500_000_000_000_000_001;
    const APP_ID: u64 = 600_000_000_000_000_001;
    const USER: u64 = 400_000_000_000_000_001;
    const GUILD: u64 = 700_000_000_000_000_000;
    const TEXT: u64 = 710_000_000_000_000_000;
    const THREAD: u64 = 720_000_000_000_000_000;
    const DM: u64 = 730_000_000_000_000_000;

    async fn world() -> FakeDiscord {
        let fake = FakeDiscord::start().await;
        fake.add_bot(TOKEN, BOT_ID, APP_ID, "switchboard");
        fake.add_user(USER, "alice");
        fake.add_guild(GUILD, "The Guild");
        fake.add_guild_channel(GUILD, TEXT, "general");
        fake.add_thread(GUILD, TEXT, THREAD);
        fake.add_dm_channel(DM, USER);
        fake
    }

    fn serenity_http(fake: &FakeDiscord, token: &str) -> Http {
        HttpBuilder::new(token)
            .proxy(fake.url())
            .ratelimiter_disabled(true)
            .build()
    }

    /// (HTTP status, Discord error code) of an unsuccessful request.
    fn discord_error(error: &serenity::Error) -> (u16, isize) {
        match error {
            serenity::Error::Http(HttpError::UnsuccessfulRequest(response)) => {
                (response.status_code.as_u16(), response.error.code)
            }
            other => panic!("expected an unsuccessful response, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn rest_api_through_serenity_http() {
        let fake = world().await;
        let http = serenity_http(&fake, TOKEN);

        let me = http.get_current_user().await.unwrap();
        assert_eq!(me.id.get(), BOT_ID);
        assert_eq!(me.name, "switchboard");
        assert!(me.bot);
        let app = http.get_current_application_info().await.unwrap();
        assert_eq!(app.id.get(), APP_ID);
        assert_eq!(app.owner.map(|o| o.id.get()), Some(OWNER_ID));
        assert_eq!(http.get_gateway().await.unwrap().url, fake.gateway_url());
        let bot_gateway = http.get_bot_gateway().await.unwrap();
        assert_eq!(
            (bot_gateway.url, bot_gateway.shards),
            (fake.gateway_url(), 1)
        );

        // Create with a nonce; the same nonce with enforce_nonce returns the same message.
        let channel = ChannelId::new(TEXT);
        let builder = CreateMessage::new()
            .content("hello")
            .nonce(Nonce::String("n-1".into()))
            .enforce_nonce(true);
        let first = channel.send_message(&http, builder.clone()).await.unwrap();
        assert_eq!(first.content, "hello");
        assert_eq!(first.author.id.get(), BOT_ID);
        assert_eq!(first.kind, MessageType::Regular);
        assert!(matches!(&first.nonce, Some(Nonce::String(n)) if n == "n-1"));
        assert_eq!(
            first.guild_id, None,
            "REST message objects carry no guild_id"
        );
        let again = channel.send_message(&http, builder).await.unwrap();
        assert_eq!(again.id, first.id);
        assert_eq!(fake.created_messages(TEXT).len(), 1);
        assert_eq!(
            fake.dedupes(),
            vec![Dedupe {
                channel_id: TEXT,
                nonce: "n-1".into(),
                message_id: first.id.get()
            }]
        );
        // Without enforce_nonce the nonce does not dedupe.
        let third = channel
            .send_message(
                &http,
                CreateMessage::new()
                    .content("hello")
                    .nonce(Nonce::String("n-1".into())),
            )
            .await
            .unwrap();
        assert!(third.id > first.id);
        let created = fake.created_messages(TEXT);
        assert_eq!(created.len(), 2);
        assert_eq!(created[0].nonce.as_deref(), Some("n-1"));
        assert!(created[0].enforce_nonce && !created[1].enforce_nonce);

        // A reply.
        let reply = channel
            .send_message(
                &http,
                CreateMessage::new()
                    .content("re")
                    .reference_message((channel, first.id)),
            )
            .await
            .unwrap();
        assert_eq!(reply.kind, MessageType::InlineReply);
        assert_eq!(reply.referenced_message.map(|m| m.id), Some(first.id));
        assert_eq!(
            fake.created_messages(TEXT)[2].reply_to,
            Some(first.id.get())
        );

        // Edit and typing.
        let edited = channel
            .edit_message(&http, first.id, EditMessage::new().content("hello, edited"))
            .await
            .unwrap();
        assert_eq!(edited.content, "hello, edited");
        assert!(edited.edited_timestamp.is_some());
        let edits = fake.edits();
        assert_eq!(edits.len(), 1);
        assert_eq!(
            (edits[0].message_id, edits[0].content.as_deref()),
            (first.id.get(), Some("hello, edited"))
        );
        channel.broadcast_typing(&http).await.unwrap();
        assert_eq!(
            fake.typing(),
            vec![Typing {
                channel_id: TEXT,
                user_id: BOT_ID
            }]
        );

        // History, newest first, honouring `after` and `limit`.
        let pushed = fake.push(UserMessage::new(TEXT, USER, "from alice").attachment(
            FakeAttachment::new("a.txt", b"attached".to_vec()).content_type("text/plain"),
        ));
        let page = http
            .get_messages(channel, Some(MessagePagination::After(first.id)), Some(10))
            .await
            .unwrap();
        let ids: Vec<u64> = page.iter().map(|m| m.id.get()).collect();
        assert_eq!(ids, vec![pushed, reply.id.get(), third.id.get()]);
        assert_eq!(page[0].author.name, "alice");
        assert!(!page[0].author.bot);
        let page = http
            .get_messages(channel, Some(MessagePagination::After(first.id)), Some(2))
            .await
            .unwrap();
        let ids: Vec<u64> = page.iter().map(|m| m.id.get()).collect();
        assert_eq!(
            ids,
            vec![reply.id.get(), third.id.get()],
            "after: the oldest `limit` after the id"
        );
        let latest = http.get_messages(channel, None, Some(1)).await.unwrap();
        assert_eq!(latest[0].id.get(), pushed);
        assert_eq!(
            fake.history_requests()[0],
            HistoryRequest {
                channel_id: TEXT,
                after: Some(first.id.get()),
                before: None,
                around: None,
                limit: Some(10)
            }
        );

        // The pushed attachment is downloadable from the fake.
        let alice = http
            .get_message(channel, MessageId::new(pushed))
            .await
            .unwrap();
        let attachment = &alice.attachments[0];
        assert_eq!(
            (attachment.filename.as_str(), attachment.size),
            ("a.txt", 8)
        );
        let body = reqwest::get(&attachment.url)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&body[..], b"attached");

        // A file upload (multipart with payload_json).
        let with_file = channel
            .send_message(
                &http,
                CreateMessage::new()
                    .content("file")
                    .add_file(CreateAttachment::bytes(b"hello file".to_vec(), "b.txt")),
            )
            .await
            .unwrap();
        assert_eq!(with_file.attachments[0].filename, "b.txt");
        assert_eq!(
            fake.created_messages(TEXT).last().unwrap().files,
            vec!["b.txt".to_owned()]
        );
        let body = reqwest::get(&with_file.attachments[0].url)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&body[..], b"hello file");

        // Channels.
        match http.get_channel(ChannelId::new(DM)).await.unwrap() {
            Channel::Private(dm) => assert_eq!(dm.recipient.id.get(), USER),
            other => panic!("expected a DM, got {other:?}"),
        }
        match http.get_channel(channel).await.unwrap() {
            Channel::Guild(text) => {
                assert_eq!((text.kind, text.guild_id.get()), (ChannelType::Text, GUILD));
            }
            other => panic!("expected a guild channel, got {other:?}"),
        }
        match http.get_channel(ChannelId::new(THREAD)).await.unwrap() {
            Channel::Guild(thread) => {
                assert_eq!(thread.kind, ChannelType::PublicThread);
                assert_eq!(thread.parent_id.map(|p| p.get()), Some(TEXT));
            }
            other => panic!("expected a thread, got {other:?}"),
        }
        // A DM message through REST: no guild.
        let dm = ChannelId::new(DM)
            .send_message(&http, CreateMessage::new().content("psst"))
            .await
            .unwrap();
        assert_eq!(dm.guild_id, None);
        assert_eq!(fake.created_messages(DM).len(), 1);
    }

    #[tokio::test]
    async fn rest_errors_rate_limits_and_faults() {
        let fake = world().await;
        let http = serenity_http(&fake, TOKEN);
        let channel = ChannelId::new(TEXT);

        // 401 for unknown and revoked tokens.
        let stranger = serenity_http(&fake, "not-a-token");
        let error = stranger.get_current_user().await.unwrap_err();
        assert_eq!(discord_error(&error), (401, 0));

        // Content limits: serenity's builder refuses > 2000 characters itself;
        // through Http::send_message the fake answers 400/50035.
        let long = "x".repeat(2001);
        let error = channel
            .send_message(&http, CreateMessage::new().content(long.clone()))
            .await
            .unwrap_err();
        assert!(matches!(error, serenity::Error::Model(_)), "{error:?}");
        let error = http
            .send_message(channel, Vec::new(), &CreateMessage::new().content(long))
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (400, 50035));
        if let serenity::Error::Http(HttpError::UnsuccessfulRequest(response)) = &error {
            assert_eq!(response.error.errors[0].path, "content");
        }
        let error = channel
            .send_message(
                &http,
                CreateMessage::new()
                    .content("n")
                    .nonce(Nonce::String("x".repeat(26))),
            )
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (400, 50035));
        let error = ChannelId::new(1)
            .send_message(&http, CreateMessage::new().content("nowhere"))
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (404, 10003));

        // Unknown message; someone else's message.
        let error = channel
            .edit_message(&http, MessageId::new(42), EditMessage::new().content("x"))
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (404, 10008));
        let alices = fake.push_message(TEXT, USER, "mine");
        let error = channel
            .edit_message(
                &http,
                MessageId::new(alices),
                EditMessage::new().content("x"),
            )
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (403, 50005));

        // 429: serenity (rate limiter disabled) surfaces it as an unsuccessful
        // request whose body it cannot decode (no "code" field): code -1.
        fake.fail_next(
            "POST /channels/*/messages",
            Fault::RateLimited {
                retry_after_secs: 0.5,
                global: false,
            },
        );
        let error = channel
            .send_message(&http, CreateMessage::new().content("limited"))
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (429, -1));
        assert!(fake.created_messages(TEXT).is_empty());

        let client = reqwest::Client::new();
        let auth = format!("Bot {TOKEN}");
        fake.fail_next(
            "GET /users/@me",
            Fault::RateLimited {
                retry_after_secs: 1.25,
                global: true,
            },
        );
        let response = client
            .get(format!("{}/users/@me", fake.api_url()))
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 429);
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(header("retry-after").as_deref(), Some("2"));
        assert_eq!(header("x-ratelimit-global").as_deref(), Some("true"));
        assert_eq!(header("x-ratelimit-scope").as_deref(), Some("global"));
        let body: Value = response.json().await.unwrap();
        assert_eq!(
            body,
            json!({"message": "You are being rate limited.", "retry_after": 1.25, "global": true})
        );

        // Rate-limit headers on ordinary responses.
        let response = client
            .get(format!("{}/users/@me", fake.api_url()))
            .header("Authorization", &auth)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        for name in [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "x-ratelimit-reset-after",
            "x-ratelimit-bucket",
        ] {
            assert!(response.headers().contains_key(name), "missing {name}");
        }

        // Enforced buckets: the third typing request in the window is refused.
        fake.set_rate_limit(2, Duration::from_secs(30), true);
        channel.broadcast_typing(&http).await.unwrap();
        channel.broadcast_typing(&http).await.unwrap();
        let error = channel.broadcast_typing(&http).await.unwrap_err();
        assert_eq!(discord_error(&error), (429, -1));
        ChannelId::new(DM).broadcast_typing(&http).await.unwrap();
        fake.set_rate_limit(5, Duration::from_secs(5), false);

        // A scripted status.
        fake.fail_next(
            "POST /channels/*/messages",
            Fault::Status(500, json!({"message": "Internal Server Error", "code": 0})),
        );
        let error = channel
            .send_message(&http, CreateMessage::new().content("boom"))
            .await
            .unwrap_err();
        assert_eq!(discord_error(&error), (500, 0));

        // Close without effect: a transport error, nothing created.
        fake.fail_next("POST /channels/*/messages", Fault::Close);
        let error = channel
            .send_message(&http, CreateMessage::new().content("lost"))
            .await
            .unwrap_err();
        assert!(
            matches!(error, serenity::Error::Http(HttpError::Request(_))),
            "{error:?}"
        );
        assert!(fake.created_messages(TEXT).is_empty());

        // Close after the effect: the message exists; the retry with the same
        // nonce gets it back instead of a duplicate.
        let builder = CreateMessage::new()
            .content("exactly once")
            .nonce(Nonce::String("retry-1".into()))
            .enforce_nonce(true);
        fake.fail_next("POST /channels/*/messages", Fault::CloseAfterEffect);
        let error = channel
            .send_message(&http, builder.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(error, serenity::Error::Http(HttpError::Request(_))),
            "{error:?}"
        );
        assert_eq!(fake.created_messages(TEXT).len(), 1);
        let retried = channel.send_message(&http, builder).await.unwrap();
        assert_eq!(retried.id.get(), fake.created_messages(TEXT)[0].id);
        assert_eq!(fake.created_messages(TEXT).len(), 1);

        // Hangs, seen through a client with a 150 ms timeout.
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(150))
            .build()
            .unwrap();
        let post = |content: &str| {
            impatient
                .post(format!("{}/channels/{TEXT}/messages", fake.api_url()))
                .header("Authorization", &auth)
                .json(&json!({"content": content}))
                .send()
        };
        fake.fail_next(
            "POST /channels/*/messages",
            Fault::HangBeforeEffect(Duration::from_millis(400)),
        );
        assert!(post("never").await.unwrap_err().is_timeout());
        fake.fail_next(
            "POST /channels/*/messages",
            Fault::HangAfterEffect(Duration::from_millis(400)),
        );
        assert!(post("created anyway").await.unwrap_err().is_timeout());
        tokio::time::sleep(Duration::from_millis(400)).await;
        let contents: Vec<String> = fake
            .created_messages(TEXT)
            .into_iter()
            .map(|m| m.content)
            .collect();
        assert_eq!(contents, vec!["exactly once", "created anyway"]);
        fake.fail_next("GET /users/@me", Fault::Hang(Duration::from_millis(200)));
        let started = Instant::now();
        http.get_current_user().await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));

        // Revocation.
        fake.revoke(TOKEN);
        assert_eq!(
            discord_error(&http.get_current_user().await.unwrap_err()),
            (401, 0)
        );
        let statuses: Vec<Option<u16>> = fake.requests().iter().map(|r| r.status).collect();
        assert!(
            statuses.contains(&None),
            "closed requests are recorded without a status"
        );
    }

    #[test]
    fn timestamps_mentions_and_patterns() {
        assert_eq!(super::iso8601(0), "1970-01-01T00:00:00.000000+00:00");
        assert_eq!(
            super::iso8601(super::DISCORD_EPOCH_MS),
            "2015-01-01T00:00:00.000000+00:00"
        );
        assert_eq!(
            super::iso8601(951_825_845_123),
            "2000-02-29T12:04:05.123000+00:00"
        );
        assert_eq!(
            super::parse_mentions("<@1> <@!22> <@1> <@x> <@3"),
            vec![1, 22]
        );
        let post = axum::http::Method::POST;
        assert!(super::pattern_matches(
            "POST /channels/*/messages",
            &post,
            "/channels/5/messages"
        ));
        assert!(super::pattern_matches(
            "/api/v10/channels/5/messages",
            &post,
            "/channels/5/messages"
        ));
        assert!(!super::pattern_matches(
            "PATCH /channels/*/messages",
            &post,
            "/channels/5/messages"
        ));
        assert!(!super::pattern_matches(
            "POST /channels/*",
            &post,
            "/channels/5/messages"
        ));
    }

    // --- the raw gateway protocol --------------------------------------------

    type Ws = tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >;

    async fn connect(fake: &FakeDiscord) -> Ws {
        let url = format!("{}?v=10&encoding=json", fake.gateway_url());
        tokio_tungstenite::connect_async(url).await.unwrap().0
    }

    async fn recv(ws: &mut Ws) -> Value {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(5), ws.next())
                .await
                .expect("no frame within 5 s")
                .expect("stream ended")
                .expect("websocket error");
            match frame {
                WsFrame::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
                WsFrame::Close(frame) => panic!("closed: {frame:?}"),
                _ => {}
            }
        }
    }

    async fn recv_close(ws: &mut Ws) -> u16 {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(5), ws.next())
                .await
                .expect("no frame within 5 s");
            match frame {
                Some(Ok(WsFrame::Close(Some(frame)))) => return u16::from(frame.code),
                Some(Ok(WsFrame::Close(None))) => return 1005,
                Some(Ok(_)) => {}
                other => panic!("expected a close frame, got {other:?}"),
            }
        }
    }

    async fn send(ws: &mut Ws, value: Value) {
        ws.send(WsFrame::Text(value.to_string().into()))
            .await
            .unwrap();
    }

    fn identify(token: &str, intents: u64, shard: [u32; 2]) -> Value {
        json!({"op": 2, "d": {
            "token": format!("Bot {token}"),
            "intents": intents,
            "shard": shard,
            "compress": true,
            "large_threshold": 250,
            "properties": {"os": "linux", "browser": "test", "device": "test"},
        }})
    }

    #[tokio::test]
    async fn gateway_protocol_identify_dispatch_resume() {
        let fake = world().await;
        fake.set_heartbeat_interval(1234);
        let mut ws = connect(&fake).await;
        let hello = recv(&mut ws).await;
        assert_eq!(
            (
                hello["op"].as_u64(),
                hello["d"]["heartbeat_interval"].as_u64()
            ),
            (Some(10), Some(1234))
        );

        // No MESSAGE_CONTENT intent.
        let intents =
            super::INTENT_GUILDS | super::INTENT_GUILD_MESSAGES | super::INTENT_DIRECT_MESSAGES;
        send(&mut ws, identify(TOKEN, intents, [0, 1])).await;
        let ready = recv(&mut ws).await;
        assert_eq!(
            (
                ready["op"].as_u64(),
                ready["t"].as_str(),
                ready["s"].as_u64()
            ),
            (Some(0), Some("READY"), Some(1))
        );
        let d = &ready["d"];
        assert_eq!(d["v"], 10);
        assert_eq!(d["user"]["id"], BOT_ID.to_string());
        assert_eq!(
            d["guilds"],
            json!([{"id": GUILD.to_string(), "unavailable": true}])
        );
        assert_eq!(d["application"]["id"], APP_ID.to_string());
        assert_eq!(d["shard"], json!([0, 1]));
        assert_eq!(d["resume_gateway_url"], fake.gateway_url());
        let session_id = d["session_id"].as_str().unwrap().to_owned();
        assert_eq!(
            fake.identifies(),
            vec![Identify {
                token: TOKEN.into(),
                shard: [0, 1],
                intents,
                session_id: session_id.clone()
            }]
        );
        let guild = recv(&mut ws).await;
        assert_eq!(
            (guild["t"].as_str(), guild["s"].as_u64()),
            (Some("GUILD_CREATE"), Some(2))
        );
        assert_eq!(guild["d"]["channels"][0]["id"], TEXT.to_string());
        assert_eq!(guild["d"]["threads"][0]["id"], THREAD.to_string());

        send(&mut ws, json!({"op": 1, "d": 2})).await;
        assert_eq!(recv(&mut ws).await["op"], 11);
        assert_eq!(fake.heartbeats(), 1);

        // Guild content is withheld without MESSAGE_CONTENT, unless the bot is mentioned.
        fake.push_message(TEXT, USER, "secret");
        let created = recv(&mut ws).await;
        assert_eq!(
            (created["t"].as_str(), created["s"].as_u64()),
            (Some("MESSAGE_CREATE"), Some(3))
        );
        assert_eq!(created["d"]["content"], "");
        assert_eq!(created["d"]["guild_id"], GUILD.to_string());
        assert_eq!(created["d"]["author"]["username"], "alice");
        fake.push_message(TEXT, USER, &format!("<@{BOT_ID}> hi"));
        let mention = recv(&mut ws).await;
        assert_eq!(mention["d"]["content"], format!("<@{BOT_ID}> hi"));
        assert_eq!(mention["d"]["mentions"][0]["id"], BOT_ID.to_string());
        fake.push_message(DM, USER, "dm text");
        let dm = recv(&mut ws).await;
        assert_eq!(
            (dm["s"].as_u64(), dm["d"]["content"].as_str()),
            (Some(5), Some("dm text"))
        );
        assert!(dm["d"].get("guild_id").is_none());

        // Drop the connection; what is pushed meanwhile is replayed on RESUME.
        drop(ws);
        assert!(
            fake.wait_until(Duration::from_secs(5), |f| !f.sessions()[0].connected)
                .await
        );
        let missed = [
            fake.push_message(DM, USER, "missed 1"),
            fake.push_message(DM, USER, "missed 2"),
        ];
        assert_eq!(fake.sessions()[0].seq, 7);
        let mut ws = connect(&fake).await;
        assert_eq!(recv(&mut ws).await["op"], 10);
        send(&mut ws, json!({"op": 6, "d": {"token": format!("Bot {TOKEN}"), "session_id": session_id, "seq": 5}})).await;
        for (seq, id) in [(6, missed[0]), (7, missed[1])] {
            let replayed = recv(&mut ws).await;
            assert_eq!(replayed["s"], seq);
            assert_eq!(replayed["d"]["id"], id.to_string());
        }
        let resumed = recv(&mut ws).await;
        assert_eq!(
            (resumed["t"].as_str(), resumed["s"].as_u64()),
            (Some("RESUMED"), Some(8))
        );
        let resumes = fake.resumes();
        assert_eq!(
            (resumes.len(), resumes[0].accepted, resumes[0].replayed),
            (1, true, 2)
        );

        // An unknown session cannot resume: op 9, d false. Then an unknown opcode.
        let mut other = connect(&fake).await;
        recv(&mut other).await;
        send(&mut other, json!({"op": 6, "d": {"token": format!("Bot {TOKEN}"), "session_id": "nope", "seq": 1}})).await;
        let invalid = recv(&mut other).await;
        assert_eq!(
            (invalid["op"].as_u64(), invalid["d"].as_bool()),
            (Some(9), Some(false))
        );
        send(&mut other, json!({"op": 42, "d": null})).await;
        assert_eq!(recv_close(&mut other).await, 4001);

        // Bad token: 4004. Bad shard: 4010.
        let mut bad = connect(&fake).await;
        recv(&mut bad).await;
        send(&mut bad, identify("wrong", intents, [0, 1])).await;
        assert_eq!(recv_close(&mut bad).await, 4004);
        let mut bad = connect(&fake).await;
        recv(&mut bad).await;
        send(&mut bad, identify(TOKEN, intents, [2, 2])).await;
        assert_eq!(recv_close(&mut bad).await, 4010);

        // RECONNECT and INVALID_SESSION on demand, a close code on demand.
        fake.request_reconnect();
        assert_eq!(recv(&mut ws).await["op"], 7);
        fake.invalidate_session();
        let invalid = recv(&mut ws).await;
        assert_eq!(
            (invalid["op"].as_u64(), invalid["d"].as_bool()),
            (Some(9), Some(false))
        );
        assert!(fake.sessions().is_empty());
        fake.push_message(DM, USER, "nobody hears this");
        send(&mut ws, identify(TOKEN, intents, [0, 1])).await;
        let ready = recv(&mut ws).await;
        assert_eq!(
            (ready["t"].as_str(), ready["s"].as_u64()),
            (Some("READY"), Some(1))
        );
        assert_eq!(recv(&mut ws).await["t"], "GUILD_CREATE");
        fake.close_connection(4000);
        assert_eq!(recv_close(&mut ws).await, 4000);
        assert_eq!(
            fake.sessions().len(),
            1,
            "4000 leaves the session resumable"
        );
        assert_eq!(fake.gateway_connections()[0], "v=10&encoding=json");
    }

    // --- serenity's client against the fake gateway ----------------------------

    #[derive(Debug)]
    enum Seen {
        Ready {
            session_id: String,
            shard: Option<[u32; 2]>,
            guilds: Vec<u64>,
        },
        Resumed,
        GuildCreate(u64),
        Message(Box<Message>),
        Updated {
            id: u64,
            content: Option<String>,
        },
    }

    struct Handler(mpsc::UnboundedSender<Seen>);

    #[serenity::async_trait]
    impl EventHandler for Handler {
        async fn ready(&self, _: Context, ready: Ready) {
            let _ = self.0.send(Seen::Ready {
                session_id: ready.session_id,
                shard: ready.shard.map(|s| [s.id.0, s.total]),
                guilds: ready.guilds.iter().map(|g| g.id.get()).collect(),
            });
        }

        async fn resume(&self, _: Context, _: ResumedEvent) {
            let _ = self.0.send(Seen::Resumed);
        }

        async fn guild_create(&self, _: Context, guild: Guild, _: Option<bool>) {
            let _ = self.0.send(Seen::GuildCreate(guild.id.get()));
        }

        async fn message(&self, _: Context, message: Message) {
            let _ = self.0.send(Seen::Message(Box::new(message)));
        }

        async fn message_update(
            &self,
            _: Context,
            _: Option<Message>,
            _: Option<Message>,
            event: MessageUpdateEvent,
        ) {
            let _ = self.0.send(Seen::Updated {
                id: event.id.get(),
                content: event.content,
            });
        }
    }

    /// Events seen by the handler. serenity spawns one task per event, so
    /// their order is not guaranteed: waits look at everything seen so far.
    struct Probe {
        rx: mpsc::UnboundedReceiver<Seen>,
        seen: Vec<Seen>,
        task: tokio::task::JoinHandle<serenity::Result<()>>,
        manager: Arc<ShardManager>,
    }

    impl Probe {
        async fn wait<T>(&mut self, what: &str, mut pick: impl FnMut(&Seen) -> Option<T>) -> T {
            if let Some(found) = self.seen.iter().find_map(&mut pick) {
                return found;
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let Ok(event) = tokio::time::timeout_at(deadline, self.rx.recv()).await else {
                    panic!("timed out waiting for {what}; seen: {:#?}", self.seen);
                };
                let event = event.expect("handler channel closed");
                let found = pick(&event);
                self.seen.push(event);
                if let Some(found) = found {
                    return found;
                }
            }
        }

        async fn message(&mut self, content: &str) -> Message {
            self.wait(content, |e| match e {
                Seen::Message(m) if m.content == content => Some((**m).clone()),
                _ => None,
            })
            .await
        }

        /// Lets in-flight events arrive, then counts messages with `content`.
        async fn count(&mut self, content: &str) -> usize {
            tokio::time::sleep(Duration::from_millis(300)).await;
            while let Ok(event) = self.rx.try_recv() {
                self.seen.push(event);
            }
            self.seen
                .iter()
                .filter(|e| matches!(e, Seen::Message(m) if m.content == content))
                .count()
        }

        fn readies(&self) -> Vec<(String, Option<[u32; 2]>, Vec<u64>)> {
            self.seen
                .iter()
                .filter_map(|e| match e {
                    Seen::Ready {
                        session_id,
                        shard,
                        guilds,
                    } => Some((session_id.clone(), *shard, guilds.clone())),
                    _ => None,
                })
                .collect()
        }

        async fn stop(self) {
            self.manager.shutdown_all().await;
            self.task.abort();
        }
    }

    const INTENTS: GatewayIntents = GatewayIntents::GUILDS
        .union(GatewayIntents::GUILD_MESSAGES)
        .union(GatewayIntents::DIRECT_MESSAGES)
        .union(GatewayIntents::MESSAGE_CONTENT);

    async fn start_client(
        fake: &FakeDiscord,
        token: &str,
        shards: Option<(Range<u32>, u32)>,
    ) -> Probe {
        let http = serenity_http(fake, token);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut client = ClientBuilder::new_with_http(http, INTENTS)
            .event_handler(Handler(tx))
            .await
            .expect("serenity client");
        let manager = Arc::clone(&client.shard_manager);
        let task = tokio::spawn(async move {
            match shards {
                Some((range, total)) => client.start_shard_range(range, total).await,
                None => client.start().await,
            }
        });
        Probe {
            rx,
            seen: Vec::new(),
            task,
            manager,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serenity_client_ready_events_heartbeats_and_resume() {
        let fake = world().await;
        fake.set_heartbeat_interval(150);
        let mut probe = start_client(&fake, TOKEN, None).await;

        let (session_id, shard, guilds) = probe
            .wait("READY", |e| match e {
                Seen::Ready {
                    session_id,
                    shard,
                    guilds,
                } => Some((session_id.clone(), *shard, guilds.clone())),
                _ => None,
            })
            .await;
        assert_eq!(session_id, fake.sessions()[0].session_id);
        assert_eq!((shard, guilds), (Some([0, 1]), vec![GUILD]));
        probe
            .wait("GUILD_CREATE", |e| {
                matches!(e, Seen::GuildCreate(GUILD)).then_some(())
            })
            .await;
        assert_eq!(fake.gateway_connections(), vec!["v=10".to_owned()]);
        let identifies = fake.identifies();
        assert_eq!(identifies.len(), 1);
        assert_eq!(
            (identifies[0].token.as_str(), identifies[0].shard),
            (TOKEN, [0, 1])
        );
        assert_eq!(identifies[0].intents, INTENTS.bits());

        // Guild, thread and DM messages; a reply with an attachment.
        let first = fake.push_message(TEXT, USER, "first");
        let seen = probe.message("first").await;
        assert_eq!(seen.id.get(), first);
        assert_eq!(seen.guild_id.map(|g| g.get()), Some(GUILD));
        assert_eq!((seen.channel_id.get(), seen.author.id.get()), (TEXT, USER));
        fake.push_message(THREAD, USER, "in thread");
        assert_eq!(probe.message("in thread").await.channel_id.get(), THREAD);
        fake.push_message(DM, USER, "in dm");
        assert_eq!(probe.message("in dm").await.guild_id, None);
        fake.push(
            UserMessage::new(TEXT, 123, "a reply")
                .from_bot()
                .author_name("otherbot")
                .reply_to(first)
                .attachment(FakeAttachment::new("x.png", vec![1, 2, 3])),
        );
        let reply = probe.message("a reply").await;
        assert!(reply.author.bot);
        assert_eq!(reply.referenced_message.map(|m| m.id.get()), Some(first));
        assert_eq!(reply.attachments[0].filename, "x.png");

        // The bot's own REST messages come back as MESSAGE_CREATE, with the nonce.
        let http = serenity_http(&fake, TOKEN);
        let sent = ChannelId::new(TEXT)
            .send_message(
                &http,
                CreateMessage::new()
                    .content("from the bot")
                    .nonce(Nonce::String("gw-1".into()))
                    .enforce_nonce(true),
            )
            .await
            .unwrap();
        let echoed = probe.message("from the bot").await;
        assert_eq!((echoed.id, echoed.author.id.get()), (sent.id, BOT_ID));
        assert!(matches!(&echoed.nonce, Some(Nonce::String(n)) if n == "gw-1"));
        fake.push_message_update(TEXT, first, "first, edited");
        let updated = probe
            .wait("MESSAGE_UPDATE", |e| match e {
                Seen::Updated { id, content } if *id == first => content.clone(),
                _ => None,
            })
            .await;
        assert_eq!(updated, "first, edited");

        // Heartbeats at 150 ms (serenity checks about every 500 ms) are acked:
        // no reconnect happens.
        assert!(
            fake.wait_until(Duration::from_secs(5), |f| f.heartbeats() >= 3)
                .await
        );
        assert_eq!(fake.identifies().len(), 1);
        assert!(fake.resumes().is_empty());

        // RECONNECT: serenity resumes on the gateway URL and gets what was sent meanwhile.
        fake.request_reconnect();
        fake.push_message(TEXT, USER, "during reconnect");
        probe.message("during reconnect").await;
        probe
            .wait("RESUMED", |e| matches!(e, Seen::Resumed).then_some(()))
            .await;
        assert!(
            fake.wait_until(Duration::from_secs(5), |f| f.resumes().len() == 1)
                .await
        );
        assert!(fake.resumes()[0].accepted);
        assert_eq!(fake.resumes()[0].session_id, session_id);

        // A dropped connection: events are buffered and replayed on RESUME.
        fake.drop_connection();
        fake.push_message(DM, USER, "while down");
        probe.message("while down").await;
        assert!(
            fake.wait_until(Duration::from_secs(5), |f| f.resumes().len() == 2)
                .await
        );
        let resume = &fake.resumes()[1];
        assert!(resume.accepted && resume.replayed >= 1, "{resume:?}");
        assert_eq!(fake.gateway_connections(), vec!["v=10".to_owned(); 3]);
        assert_eq!(fake.identifies().len(), 1);
        for content in ["first", "during reconnect", "while down"] {
            assert_eq!(probe.count(content).await, 1, "{content} delivered once");
        }
        probe.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serenity_client_identifies_again_after_invalid_session() {
        let fake = world().await;
        let mut probe = start_client(&fake, TOKEN, None).await;
        let first_session = probe
            .wait("READY", |e| match e {
                Seen::Ready { session_id, .. } => Some(session_id.clone()),
                _ => None,
            })
            .await;
        let before = fake.push_message(TEXT, USER, "before");
        probe.message("before").await;

        fake.invalidate_session();
        let lost = fake.push_message(TEXT, USER, "lost in the gap");
        // serenity restarts the shard (its shard manager waits up to 5 s for the
        // old runner) and IDENTIFYs again.
        let second_session = probe
            .wait("a second READY", |e| match e {
                Seen::Ready { session_id, .. } if *session_id != first_session => {
                    Some(session_id.clone())
                }
                _ => None,
            })
            .await;
        assert_eq!(fake.identifies().len(), 2);
        assert_eq!(fake.sessions().len(), 1);
        assert_eq!(fake.sessions()[0].session_id, second_session);
        fake.push_message(TEXT, USER, "after");
        probe.message("after").await;
        assert_eq!(probe.count("lost in the gap").await, 0);

        // The gap is visible through the history endpoint.
        let http = serenity_http(&fake, TOKEN);
        let page = http
            .get_messages(
                ChannelId::new(TEXT),
                Some(MessagePagination::After(MessageId::new(before))),
                Some(100),
            )
            .await
            .unwrap();
        assert!(page.iter().any(|m| m.id.get() == lost));
        probe.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serenity_client_shard_range() {
        let fake = world().await;
        // (guild_id >> 22) % 3 picks the shard.
        let (g0, g1, g2) = (3000_u64 << 22, 3001_u64 << 22, 3002_u64 << 22);
        let (c0, c1, c2) = (
            900_000_000_000_000_000,
            900_000_000_000_000_001,
            900_000_000_000_000_002,
        );
        fake.add_guild_channel(g0, c0, "zero");
        fake.add_guild_channel(g1, c1, "one");
        fake.add_guild_channel(g2, c2, "two");

        // serenity 0.12 treats the range end as inclusive: 1..2 starts shards 1 and 2.
        let mut probe = start_client(&fake, TOKEN, Some((1..2, 3))).await;
        for shard in [1, 2] {
            probe
                .wait("READY of each shard", |e| match e {
                    Seen::Ready {
                        shard: Some([id, 3]),
                        ..
                    } if *id == shard => Some(()),
                    _ => None,
                })
                .await;
        }
        let shards: BTreeSet<[u32; 2]> = fake.identifies().iter().map(|i| i.shard).collect();
        assert_eq!(shards, BTreeSet::from([[1, 3], [2, 3]]));
        let mut readies = probe.readies();
        readies.sort_by_key(|r| r.1);
        for (ready, shard) in readies.iter().zip([1, 2]) {
            let mut expected: Vec<u64> = [GUILD, g0, g1, g2]
                .into_iter()
                .filter(|g| (g >> 22) % 3 == shard)
                .collect();
            expected.sort_unstable();
            assert_eq!(ready.2, expected, "READY guilds of shard {shard}");
        }
        assert!(readies[0].2.contains(&g1) && readies[1].2.contains(&g2));

        fake.push_message(c2, USER, "to shard 2");
        fake.push_message(c1, USER, "to shard 1");
        fake.push_message(c0, USER, "to shard 0");
        fake.push_message(DM, USER, "dm goes to shard 0");
        probe.message("to shard 2").await;
        probe.message("to shard 1").await;
        assert_eq!(probe.count("to shard 2").await, 1);
        assert_eq!(probe.count("to shard 0").await, 0);
        assert_eq!(probe.count("dm goes to shard 0").await, 0);
        probe.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serenity_client_with_revoked_token_fails() {
        let fake = world().await;
        fake.revoke(TOKEN);
        let probe = start_client(&fake, TOKEN, None).await;
        let result = tokio::time::timeout(Duration::from_secs(10), probe.task)
            .await
            .expect("client.start() returns")
            .expect("client task");
        assert!(
            matches!(
                result,
                Err(serenity::Error::Gateway(
                    GatewayError::InvalidAuthentication
                ))
            ),
            "{result:?}"
        );
        assert!(fake.identifies().is_empty());
    }
}
