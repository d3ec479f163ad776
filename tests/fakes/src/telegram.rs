//! A loopback fake of the Telegram Bot API.
//!
//! [`FakeTelegram::start`] binds `127.0.0.1:0` and serves the Bot API wire
//! format: `POST` (or `GET`) `/bot<TOKEN>/<method>` with a JSON,
//! `application/x-www-form-urlencoded` or `multipart/form-data` body (teloxide
//! sends `setWebhook`, `sendPhoto`, `sendDocument`, `sendVoice`, … as
//! multipart, everything else as JSON), answering `{"ok":true,"result":…}` or
//! `{"ok":false,"error_code":N,"description":"…","parameters":{…}}` with the
//! HTTP status equal to `error_code`. Files registered with
//! [`FakeTelegram::add_file`] are served at `GET /file/bot<TOKEN>/<file_path>`
//! (the path may be percent-encoded, as teloxide does with the `/` inside a
//! file path).
//!
//! The base URL for clients is [`FakeTelegram::url`] (`http://127.0.0.1:PORT`,
//! no trailing path); clients append `/bot<TOKEN>/<method>` themselves.
//!
//! Tests push updates ([`FakeTelegram::push_message`] and friends); they wait
//! in the bot's queue for `getUpdates` (long polling, Telegram's confirmation
//! semantics) or, while a webhook is set, are POSTed to it (with retries).
//! Every request is recorded, and faults can be injected per token and method
//! ([`FakeTelegram::fail_next`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, FromRequest, Multipart, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::serve::{IncomingStream, Listener};
use serde_json::{Map, Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Largest message text, in UTF-16 code units after entity parsing.
pub const MAX_TEXT_LEN: usize = 4096;
/// Largest media caption, in UTF-16 code units after entity parsing.
pub const MAX_CAPTION_LEN: usize = 1024;

const DESC_UNAUTHORIZED: &str = "Unauthorized";
const DESC_METHOD_NOT_FOUND: &str = "Not Found: method not found";
const DESC_WEBHOOK_CONFLICT: &str = "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first";
const DESC_TERMINATED: &str = "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running";
const DESC_NOT_MODIFIED: &str = "Bad Request: message is not modified: specified new message content and reply markup are exactly the same as a current content and reply markup of the message";
const DESC_CHAT_NOT_FOUND: &str = "Bad Request: chat not found";
const DESC_TEXT_EMPTY: &str = "Bad Request: message text is empty";
const DESC_TOO_LONG: &str = "Bad Request: message is too long";
const DESC_EDIT_TOO_LONG: &str = "Bad Request: MESSAGE_TOO_LONG";
const DESC_CAPTION_TOO_LONG: &str = "Bad Request: message caption is too long";
const DESC_EDIT_NOT_FOUND: &str = "Bad Request: message to edit not found";
const DESC_UPGRADED: &str = "Bad Request: group chat was upgraded to a supergroup chat";
const DESC_QUERY_INVALID: &str =
    "Bad Request: query is too old and response timeout expired or query id is invalid";

/// Update kinds Telegram delivers when `allowed_updates` is unset or empty.
const NOT_DELIVERED_BY_DEFAULT: [&str; 3] =
    ["chat_member", "message_reaction", "message_reaction_count"];

/// Methods the fake implements, in their canonical spelling (Telegram matches
/// method names case-insensitively).
const METHODS: [&str; 18] = [
    "getMe",
    "getUpdates",
    "setWebhook",
    "deleteWebhook",
    "getWebhookInfo",
    "sendMessage",
    "editMessageText",
    "deleteMessage",
    "sendChatAction",
    "sendMessageDraft",
    "answerCallbackQuery",
    "setMyCommands",
    "getMyCommands",
    "deleteMyCommands",
    "getFile",
    "sendPhoto",
    "sendDocument",
    "logOut",
];

// ---------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------

/// A fault injected with [`FakeTelegram::fail_next`] for one call of a method.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// 429 `Too Many Requests: retry after N` with `parameters.retry_after = N`.
    RetryAfter(u64),
    /// An error answer: `error_code` (and HTTP status) and `description`.
    Status(u16, String),
    /// Wait, then handle the request normally: the side effect happens after
    /// the wait, even if the client has given up meanwhile.
    Hang(Duration),
    /// Wait, then drop the connection without answering; the side effect
    /// never happens.
    HangBeforeEffect(Duration),
    /// Perform the side effect (e.g. record the message as sent), wait, then
    /// answer normally (if the client still listens).
    HangAfterEffect(Duration),
    /// Drop the connection without answering; no side effect.
    Close,
    /// Answer with this HTTP status and this raw body (e.g. broken JSON).
    Raw(u16, String),
}

/// A message a bot sent (`sendMessage`, `sendPhoto`, `sendDocument`).
#[derive(Clone, Debug, PartialEq)]
pub struct SentMessage {
    pub token: String,
    /// `sendMessage`, `sendPhoto` or `sendDocument`.
    pub method: String,
    pub chat_id: i64,
    pub message_id: i64,
    /// The text (caption for media) as the client gave it; the latest one
    /// after edits.
    pub text: String,
    /// The text users see, after entity parsing (tags stripped, entities
    /// decoded).
    pub visible_text: String,
    pub parse_mode: Option<String>,
    /// Entities of the visible text (UTF-16 offsets), as Telegram reports them.
    pub entities: Vec<Value>,
    pub reply_parameters: Option<Value>,
    pub thread_id: Option<i64>,
    pub reply_markup: Option<Value>,
    /// For media: the `photo`/`document` argument (file id, URL or
    /// `attach://…`).
    pub media: Option<String>,
    /// How many successful edits the message has had.
    pub edit_count: u32,
    /// Whether the bot deleted it (`deleteMessage`).
    pub deleted: bool,
    /// The raw request body (multipart and form fields as strings).
    pub body: Value,
}

/// A successful `editMessageText`.
#[derive(Clone, Debug, PartialEq)]
pub struct Edit {
    pub token: String,
    pub chat_id: i64,
    pub message_id: i64,
    pub text: String,
    pub visible_text: String,
    pub parse_mode: Option<String>,
    pub body: Value,
}

/// A successful `sendMessageDraft`.
#[derive(Clone, Debug, PartialEq)]
pub struct Draft {
    pub token: String,
    pub chat_id: i64,
    pub draft_id: i64,
    pub text: String,
    pub visible_text: String,
    pub parse_mode: Option<String>,
    pub thread_id: Option<i64>,
    pub body: Value,
}

/// A successful `sendChatAction`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatAction {
    pub token: String,
    pub chat_id: i64,
    pub action: String,
    pub thread_id: Option<i64>,
}

/// A successful `answerCallbackQuery`.
#[derive(Clone, Debug, PartialEq)]
pub struct CallbackAnswer {
    pub token: String,
    pub callback_query_id: String,
    /// The `data` of the answered query (from the pushed update).
    pub data: Option<String>,
    pub text: Option<String>,
    pub show_alert: bool,
    pub body: Value,
}

/// One `setMyCommands` call.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandSet {
    /// `(command, description)` pairs.
    pub commands: Vec<(String, String)>,
    pub scope: Option<Value>,
    pub language_code: Option<String>,
}

/// One attempt to POST an update to a bot's webhook.
#[derive(Clone, Debug, PartialEq)]
pub struct PushAttempt {
    pub token: String,
    pub url: String,
    pub update_id: i64,
    /// 1 for the first attempt of this update.
    pub attempt: u32,
    /// The HTTP status the receiver answered, `None` when it did not answer.
    pub status: Option<u16>,
    pub error: Option<String>,
    /// The `X-Telegram-Bot-Api-Secret-Token` header sent, if any.
    pub secret: Option<String>,
    pub body: Value,
}

/// How the fake retries webhook deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WebhookRetry {
    /// Attempts per update (at least 1); the update is dropped after the last.
    pub attempts: u32,
    /// Delay between attempts.
    pub delay: Duration,
    /// Timeout of one attempt.
    pub timeout: Duration,
}

impl Default for WebhookRetry {
    fn default() -> Self {
        Self {
            attempts: 3,
            delay: Duration::from_millis(100),
            timeout: Duration::from_secs(5),
        }
    }
}

/// Options of a pushed user message ([`FakeTelegram::push_message_with`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MessageOpts {
    /// Forum topic: sets `message_thread_id` and `is_topic_message: true`.
    pub thread_id: Option<i64>,
    /// `reply_to_message`: a message (e.g. one the bot sent) in the same chat.
    pub reply_to: Option<i64>,
    /// Explicit entities; when `None` the fake adds `bot_command` entities for
    /// `/command[@bot]` and `mention` entities for `@username`.
    pub entities: Option<Vec<Value>>,
    /// `from.is_bot`.
    pub from_is_bot: bool,
    /// Extra fields merged into the message object.
    pub extra: Map<String, Value>,
}

impl MessageOpts {
    pub fn thread(mut self, thread_id: i64) -> Self {
        self.thread_id = Some(thread_id);
        self
    }

    pub fn reply_to(mut self, message_id: i64) -> Self {
        self.reply_to = Some(message_id);
        self
    }

    pub fn entities(mut self, entities: Vec<Value>) -> Self {
        self.entities = Some(entities);
        self
    }

    pub fn from_bot(mut self) -> Self {
        self.from_is_bot = true;
        self
    }

    pub fn extra(mut self, key: &str, value: Value) -> Self {
        self.extra.insert(key.to_owned(), value);
        self
    }
}

// ---------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------

struct Shared {
    state: Mutex<St>,
    /// Woken on every state change that a long poll or a webhook worker may
    /// wait for.
    notify: Notify,
}

#[derive(Default)]
struct St {
    bots: HashMap<String, BotSt>,
    chats: HashMap<i64, ChatSt>,
    users: HashMap<i64, UserInfo>,
    files: HashMap<String, FileEntry>,
    file_seq: u64,
    callback_queries: HashMap<String, CallbackSt>,
    faults: HashMap<(String, String), VecDeque<Fault>>,
    sent: Vec<SentMessage>,
    edits: Vec<Edit>,
    drafts: Vec<Draft>,
    chat_actions: Vec<ChatAction>,
    callback_answers: Vec<CallbackAnswer>,
    requests: Vec<(String, Value)>,
    push_attempts: Vec<PushAttempt>,
    webhook_retry: WebhookRetry,
    shutdown: bool,
}

struct BotSt {
    id: i64,
    username: String,
    revoked: bool,
    next_update_id: i64,
    queue: VecDeque<Value>,
    allowed_updates: Option<Vec<String>>,
    webhook: Option<WebhookSt>,
    webhook_gen: u64,
    poll_seq: u64,
    active_poll: Option<u64>,
    /// Long polls ended early, with the description they answer.
    terminated_polls: HashMap<u64, &'static str>,
    /// `getUpdates` calls answered 409 because a newer call replaced them
    /// (two pollers of one bot at once).
    poll_conflicts: usize,
    get_updates_calls: Vec<(i64, u64)>,
    command_sets: Vec<CommandSet>,
    commands: HashMap<(String, String), Vec<(String, String)>>,
    last_webhook_error: Option<(i64, String)>,
}

#[derive(Clone)]
struct WebhookSt {
    url: String,
    secret: Option<String>,
    max_connections: i64,
}

struct ChatSt {
    id: i64,
    kind: String,
    title: String,
    next_message_id: i64,
    messages: BTreeMap<i64, Value>,
    migrated_to: Option<i64>,
}

#[derive(Clone)]
struct UserInfo {
    first_name: String,
    username: Option<String>,
}

struct FileEntry {
    unique_id: String,
    path: String,
    bytes: Vec<u8>,
}

struct CallbackSt {
    token: String,
    data: Option<String>,
    answered: bool,
}

impl St {
    fn bot(&mut self, token: &str) -> &mut BotSt {
        self.bots
            .get_mut(token)
            .unwrap_or_else(|| panic!("FakeTelegram: unknown bot token {token:?}"))
    }

    fn user_json(&self, id: i64, is_bot: bool) -> Value {
        let info = self.users.get(&id).cloned().unwrap_or_else(|| UserInfo {
            first_name: format!("User{id}"),
            username: Some(format!("user{id}")),
        });
        let mut user = json!({"id": id, "is_bot": is_bot, "first_name": info.first_name});
        if let Some(username) = info.username {
            user["username"] = json!(username);
        }
        user
    }

    fn bot_json(&self, token: &str) -> Value {
        let bot = &self.bots[token];
        json!({"id": bot.id, "is_bot": true, "first_name": bot.username, "username": bot.username})
    }

    /// The chat, created on first use (private for positive ids, a
    /// supergroup for `-100…` ids, a group otherwise).
    fn chat_or_create(&mut self, chat_id: i64) -> &mut ChatSt {
        self.chats.entry(chat_id).or_insert_with(|| {
            let kind = if chat_id > 0 {
                "private"
            } else if chat_id <= -1_000_000_000_000 {
                "supergroup"
            } else {
                "group"
            };
            ChatSt::new(chat_id, kind, &format!("Chat{chat_id}"))
        })
    }

    fn chat_json(&self, chat_id: i64) -> Value {
        let chat = &self.chats[&chat_id];
        match chat.kind.as_str() {
            "private" => {
                let mut v = json!({"id": chat.id, "type": "private", "first_name": chat.title});
                if let Some(Some(username)) = self.users.get(&chat.id).map(|u| u.username.clone()) {
                    v["username"] = json!(username);
                }
                v
            }
            "forum" => {
                json!({"id": chat.id, "type": "supergroup", "title": chat.title, "is_forum": true})
            }
            kind => json!({"id": chat.id, "type": kind, "title": chat.title}),
        }
    }

    /// Enqueues an update for a bot, assigning its `update_id`; updates of a
    /// kind the bot's `allowed_updates` excludes are not queued (like
    /// Telegram, which does not create them).
    fn enqueue(&mut self, token: &str, mut update: Value) -> i64 {
        let bot = self.bot(token);
        let update_id = bot.next_update_id;
        bot.next_update_id += 1;
        let obj = update
            .as_object_mut()
            .expect("an update must be a JSON object");
        obj.insert("update_id".to_owned(), json!(update_id));
        let kind = obj
            .keys()
            .find(|k| k.as_str() != "update_id")
            .cloned()
            .unwrap_or_default();
        let allowed = match &bot.allowed_updates {
            Some(list) if !list.is_empty() => list.contains(&kind),
            _ => !NOT_DELIVERED_BY_DEFAULT.contains(&kind.as_str()),
        };
        if allowed {
            bot.queue.push_back(update);
        }
        update_id
    }

    fn new_file_id(&mut self, prefix: &str) -> String {
        self.file_seq += 1;
        format!("{prefix}{}", self.file_seq)
    }

    fn register_file(&mut self, file_id: &str, bytes: Vec<u8>) {
        self.file_seq += 1;
        let entry = FileEntry {
            unique_id: format!("u{}", self.file_seq),
            path: format!("documents/file_{}", self.file_seq),
            bytes,
        };
        self.files.insert(file_id.to_owned(), entry);
    }

    fn file_json(&self, file_id: &str) -> Value {
        let (unique, size) = match self.files.get(file_id) {
            Some(f) => (f.unique_id.clone(), f.bytes.len()),
            None => (format!("u-{file_id}"), 0),
        };
        json!({"file_id": file_id, "file_unique_id": unique, "file_size": size})
    }

    /// Resolves a `chat_id` argument to a known chat, answering the errors
    /// Telegram answers for unknown and migrated chats.
    fn resolve_chat(&self, params: &Params) -> Result<i64, Reply> {
        let chat_id = match params.get("chat_id") {
            None => return Err(Reply::err(400, "Bad Request: chat_id is empty")),
            Some(Value::Number(n)) => n.as_i64(),
            Some(Value::String(s)) => match s.parse::<i64>() {
                Ok(id) => Some(id),
                Err(_) => {
                    let name = s.trim_start_matches('@');
                    self.users
                        .iter()
                        .find(|(id, u)| {
                            u.username.as_deref() == Some(name) && self.chats.contains_key(id)
                        })
                        .map(|(id, _)| *id)
                }
            },
            Some(_) => None,
        };
        let Some(chat) = chat_id.and_then(|id| self.chats.get(&id)) else {
            return Err(Reply::err(400, DESC_CHAT_NOT_FOUND));
        };
        if let Some(new_id) = chat.migrated_to {
            return Err(Reply::err_with(
                400,
                DESC_UPGRADED,
                json!({"migrate_to_chat_id": new_id}),
            ));
        }
        Ok(chat.id)
    }

    /// Builds (but does not store) a new message in a chat.
    fn new_message(&mut self, chat_id: i64, from: Value) -> Map<String, Value> {
        let chat = self.chat_or_create(chat_id);
        let message_id = chat.next_message_id;
        chat.next_message_id += 1;
        let mut msg = Map::new();
        msg.insert("message_id".into(), json!(message_id));
        msg.insert("from".into(), from);
        msg.insert("chat".into(), self.chat_json(chat_id));
        msg.insert("date".into(), json!(now_unix()));
        msg
    }

    fn store_message(&mut self, chat_id: i64, msg: &Map<String, Value>) {
        let id = msg["message_id"].as_i64().unwrap_or_default();
        self.chat_or_create(chat_id)
            .messages
            .insert(id, Value::Object(msg.clone()));
    }

    /// A stored message for embedding as `reply_to_message` (Telegram does
    /// not nest those).
    fn reply_target(&self, chat_id: i64, message_id: i64) -> Option<Value> {
        let mut target = self.chats.get(&chat_id)?.messages.get(&message_id)?.clone();
        if let Some(obj) = target.as_object_mut() {
            obj.remove("reply_to_message");
        }
        Some(target)
    }

    fn sent_mut(&mut self, chat_id: i64, message_id: i64) -> Option<&mut SentMessage> {
        self.sent
            .iter_mut()
            .find(|s| s.chat_id == chat_id && s.message_id == message_id)
    }
}

impl ChatSt {
    fn new(id: i64, kind: &str, title: &str) -> Self {
        Self {
            id,
            kind: kind.to_owned(),
            title: title.to_owned(),
            next_message_id: 1,
            messages: BTreeMap::new(),
            migrated_to: None,
        }
    }
}

impl BotSt {
    fn new(id: i64, username: &str) -> Self {
        Self {
            id,
            username: username.to_owned(),
            revoked: false,
            next_update_id: 1,
            queue: VecDeque::new(),
            allowed_updates: None,
            webhook: None,
            webhook_gen: 0,
            poll_seq: 0,
            active_poll: None,
            terminated_polls: HashMap::new(),
            poll_conflicts: 0,
            get_updates_calls: Vec::new(),
            command_sets: Vec::new(),
            commands: HashMap::new(),
            last_webhook_error: None,
        }
    }
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// The public handle
// ---------------------------------------------------------------------------

/// A running fake Telegram Bot API server. Cheap to clone; the server stops
/// when the last clone is dropped.
#[derive(Clone)]
pub struct FakeTelegram {
    shared: Arc<Shared>,
    url: String,
    _guard: Arc<ServerGuard>,
}

struct ServerGuard {
    shared: Arc<Shared>,
    task: tokio::task::AbortHandle,
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        self.task.abort();
        lock(&self.shared).shutdown = true;
        self.shared.notify.notify_waiters();
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, St> {
    shared
        .state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl FakeTelegram {
    /// Binds `127.0.0.1:0` and starts serving on the current tokio runtime.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            state: Mutex::new(St::default()),
            notify: Notify::new(),
        });
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let server = axum::serve(
            KillListener { inner: listener },
            app.into_make_service_with_connect_info::<ConnHandle>(),
        );
        let task = tokio::spawn(async move {
            if let Err(err) = server.await {
                tracing::warn!(%err, "fake Telegram server stopped");
            }
        });
        let guard = ServerGuard {
            shared: shared.clone(),
            task: task.abort_handle(),
        };
        Self {
            shared,
            url: format!("http://{addr}"),
            _guard: Arc::new(guard),
        }
    }

    /// The base URL for clients, `http://127.0.0.1:PORT` (for teloxide:
    /// `Bot::new(token).set_api_url(Url::parse(&fake.url())?)`).
    pub fn url(&self) -> String {
        self.url.clone()
    }

    fn st(&self) -> MutexGuard<'_, St> {
        lock(&self.shared)
    }

    fn wake(&self) {
        self.shared.notify.notify_waiters();
    }

    // --- setup --------------------------------------------------------------

    /// Declares a bot; requests with other tokens answer 401.
    pub fn add_bot(&self, token: &str, bot_id: i64, username: &str) {
        self.st()
            .bots
            .insert(token.to_owned(), BotSt::new(bot_id, username));
    }

    /// From now on, requests with this token answer 401 `Unauthorized`.
    pub fn revoke(&self, token: &str) {
        self.st().bot(token).revoked = true;
        self.wake();
    }

    /// Declares a chat: `kind` is `private`, `group`, `supergroup`, `forum`
    /// (a supergroup with topics) or `channel`; `title_or_name` is the title
    /// (the first name of the user for private chats).
    pub fn add_chat(&self, chat_id: i64, kind: &str, title_or_name: &str) {
        let mut st = self.st();
        let chat = st.chat_or_create(chat_id);
        chat.kind = kind.to_owned();
        chat.title = title_or_name.to_owned();
    }

    /// Declares a user's names (used in `from` of pushed updates and in
    /// private chats); unknown users are `User<id>` / `user<id>`.
    pub fn add_user(&self, user_id: i64, first_name: &str, username: Option<&str>) {
        let info = UserInfo {
            first_name: first_name.to_owned(),
            username: username.map(str::to_owned),
        };
        self.st().users.insert(user_id, info);
    }

    /// Migrates a group to a supergroup: afterwards anything sent to `old_id`
    /// answers 400 `group chat was upgraded to a supergroup chat` with
    /// `parameters.migrate_to_chat_id`.
    pub fn migrate_chat(&self, old_id: i64, new_id: i64) {
        let mut st = self.st();
        let title = st.chat_or_create(old_id).title.clone();
        st.chat_or_create(old_id).migrated_to = Some(new_id);
        st.chats
            .entry(new_id)
            .or_insert_with(|| ChatSt::new(new_id, "supergroup", &title));
    }

    /// Registers a file for `getFile`, downloads and sending by file id.
    pub fn add_file(&self, file_id: &str, bytes: impl Into<Vec<u8>>) {
        self.st().register_file(file_id, bytes.into());
    }

    /// Sets how webhook deliveries are retried.
    pub fn set_webhook_retry(&self, retry: WebhookRetry) {
        self.st().webhook_retry = retry;
    }

    /// Injects a fault into the next call of `method` (case-insensitive) with
    /// `token`; calling it again queues more faults for the calls after.
    pub fn fail_next(&self, token: &str, method: &str, fault: Fault) {
        self.fail_next_n(token, method, 1, fault);
    }

    /// Injects the same fault into the next `n` calls of `method` with `token`.
    pub fn fail_next_n(&self, token: &str, method: &str, n: usize, fault: Fault) {
        let key = (token.to_owned(), method.to_ascii_lowercase());
        let mut st = self.st();
        let queue = st.faults.entry(key).or_default();
        queue.extend(std::iter::repeat_n(fault, n));
    }

    // --- pushing updates ----------------------------------------------------

    fn push(&self, token: &str, update: Value) -> i64 {
        let id = self.st().enqueue(token, update);
        self.wake();
        id
    }

    /// Pushes a text message from a user; returns `(update_id, message_id)`.
    pub fn push_message(&self, token: &str, chat_id: i64, from: i64, text: &str) -> (i64, i64) {
        self.push_message_with(token, chat_id, from, text, MessageOpts::default())
    }

    /// Pushes a text message with options; returns `(update_id, message_id)`.
    pub fn push_message_with(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        text: &str,
        opts: MessageOpts,
    ) -> (i64, i64) {
        let mut content = Map::new();
        content.insert("text".into(), json!(text));
        let entities = opts.entities.clone().unwrap_or_else(|| auto_entities(text));
        if !entities.is_empty() {
            content.insert("entities".into(), Value::Array(entities));
        }
        self.push_user_message(token, chat_id, from, content, opts)
    }

    fn push_user_message(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        content: Map<String, Value>,
        opts: MessageOpts,
    ) -> (i64, i64) {
        let (update_id, message_id) = {
            let mut st = self.st();
            assert!(
                st.bots.contains_key(token),
                "FakeTelegram: unknown bot token {token:?}"
            );
            let from_json = st.user_json(from, opts.from_is_bot);
            let mut msg = st.new_message(chat_id, from_json);
            if let Some(thread) = opts.thread_id {
                msg.insert("message_thread_id".into(), json!(thread));
                msg.insert("is_topic_message".into(), json!(true));
            }
            if let Some(reply_to) = opts.reply_to {
                let target = st.reply_target(chat_id, reply_to).unwrap_or_else(|| {
                    panic!("FakeTelegram: no message {reply_to} in chat {chat_id} to reply to")
                });
                msg.insert("reply_to_message".into(), target);
            }
            msg.extend(content);
            msg.extend(opts.extra);
            st.store_message(chat_id, &msg);
            let message_id = msg["message_id"].as_i64().unwrap_or_default();
            (st.enqueue(token, json!({"message": msg})), message_id)
        };
        self.wake();
        (update_id, message_id)
    }

    /// Edits a stored (user) message and pushes an `edited_message` update.
    pub fn push_edited_message(
        &self,
        token: &str,
        chat_id: i64,
        message_id: i64,
        text: &str,
    ) -> i64 {
        let update = {
            let mut st = self.st();
            let chat = st.chat_or_create(chat_id);
            let msg = chat.messages.get_mut(&message_id).unwrap_or_else(|| {
                panic!("FakeTelegram: no message {message_id} in chat {chat_id} to edit")
            });
            msg["text"] = json!(text);
            msg["edit_date"] = json!(now_unix());
            let entities = auto_entities(text);
            if let Some(obj) = msg.as_object_mut() {
                obj.remove("entities");
                if !entities.is_empty() {
                    obj.insert("entities".into(), Value::Array(entities));
                }
            }
            json!({"edited_message": msg.clone()})
        };
        self.push(token, update)
    }

    /// Pushes a `callback_query` (a button press on message `message_id`);
    /// returns the update id. The query id is `cbq-<update_id>`. When the
    /// message is unknown it is sent as an inaccessible message (`date: 0`).
    pub fn push_callback_query(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        data: &str,
        message_id: i64,
    ) -> i64 {
        let update_id = {
            let mut st = self.st();
            st.chat_or_create(chat_id);
            let message = st.chats[&chat_id]
                .messages
                .get(&message_id)
                .cloned()
                .unwrap_or_else(
                    || json!({"message_id": message_id, "chat": st.chat_json(chat_id), "date": 0}),
                );
            let from_json = st.user_json(from, false);
            let next_id = st.bot(token).next_update_id;
            let query_id = format!("cbq-{next_id}");
            let update = json!({"callback_query": {
                "id": query_id,
                "from": from_json,
                "message": message,
                "chat_instance": format!("ci{chat_id}"),
                "data": data,
            }});
            let callback = CallbackSt {
                token: token.to_owned(),
                data: Some(data.to_owned()),
                answered: false,
            };
            st.callback_queries.insert(query_id, callback);
            st.enqueue(token, update)
        };
        self.wake();
        update_id
    }

    /// Pushes a photo message; returns `(update_id, message_id)`.
    pub fn push_photo(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        file_id: &str,
        caption: Option<&str>,
    ) -> (i64, i64) {
        let mut size = self.st().file_json(file_id);
        size["width"] = json!(800);
        size["height"] = json!(600);
        let mut content = Map::new();
        content.insert("photo".into(), json!([size]));
        if let Some(caption) = caption {
            content.insert("caption".into(), json!(caption));
        }
        self.push_user_message(token, chat_id, from, content, MessageOpts::default())
    }

    /// Pushes a document message; returns `(update_id, message_id)`.
    pub fn push_document(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        file_id: &str,
        file_name: &str,
        caption: Option<&str>,
    ) -> (i64, i64) {
        let mut doc = self.st().file_json(file_id);
        doc["file_name"] = json!(file_name);
        doc["mime_type"] = json!("application/octet-stream");
        let mut content = Map::new();
        content.insert("document".into(), doc);
        if let Some(caption) = caption {
            content.insert("caption".into(), json!(caption));
        }
        self.push_user_message(token, chat_id, from, content, MessageOpts::default())
    }

    /// Pushes a voice message; returns `(update_id, message_id)`.
    pub fn push_voice(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        file_id: &str,
        duration_secs: u32,
    ) -> (i64, i64) {
        let mut voice = self.st().file_json(file_id);
        voice["duration"] = json!(duration_secs);
        voice["mime_type"] = json!("audio/ogg");
        let mut content = Map::new();
        content.insert("voice".into(), voice);
        self.push_user_message(token, chat_id, from, content, MessageOpts::default())
    }

    /// Pushes a (regular, static) sticker message; returns `(update_id,
    /// message_id)`.
    pub fn push_sticker(
        &self,
        token: &str,
        chat_id: i64,
        from: i64,
        file_id: &str,
        emoji: &str,
    ) -> (i64, i64) {
        let mut sticker = self.st().file_json(file_id);
        for (key, value) in [
            ("width", json!(512)),
            ("height", json!(512)),
            ("type", json!("regular")),
            ("is_animated", json!(false)),
            ("is_video", json!(false)),
            ("emoji", json!(emoji)),
        ] {
            sticker[key] = value;
        }
        let mut content = Map::new();
        content.insert("sticker".into(), sticker);
        self.push_user_message(token, chat_id, from, content, MessageOpts::default())
    }

    /// Migrates `old_chat_id` to `new_chat_id` (as [`Self::migrate_chat`]) and
    /// pushes the service message with `migrate_to_chat_id` in the old chat;
    /// returns the update id.
    pub fn push_migration(&self, token: &str, old_chat_id: i64, new_chat_id: i64) -> i64 {
        let update_id = {
            let mut st = self.st();
            assert!(
                st.bots.contains_key(token),
                "FakeTelegram: unknown bot token {token:?}"
            );
            let from = json!({"id": 1087968824, "is_bot": true, "first_name": "Group", "username": "GroupAnonymousBot"});
            let mut msg = st.new_message(old_chat_id, from);
            msg.insert("migrate_to_chat_id".into(), json!(new_chat_id));
            st.store_message(old_chat_id, &msg);
            st.enqueue(token, json!({"message": msg}))
        };
        self.migrate_chat(old_chat_id, new_chat_id);
        self.wake();
        update_id
    }

    /// Pushes an arbitrary update object (the fake sets `update_id`), e.g.
    /// `{"my_chat_member": {…}}`; returns the update id.
    pub fn push_raw(&self, token: &str, update: Value) -> i64 {
        self.push(token, update)
    }

    // --- inspection -----------------------------------------------------------

    /// Messages bots sent to a chat, in order, with their current texts.
    pub fn sent(&self, chat_id: i64) -> Vec<SentMessage> {
        self.st()
            .sent
            .iter()
            .filter(|s| s.chat_id == chat_id)
            .cloned()
            .collect()
    }

    /// All messages bots sent, in order.
    pub fn all_sent(&self) -> Vec<SentMessage> {
        self.st().sent.clone()
    }

    pub fn edits(&self) -> Vec<Edit> {
        self.st().edits.clone()
    }

    pub fn drafts(&self) -> Vec<Draft> {
        self.st().drafts.clone()
    }

    pub fn chat_actions(&self) -> Vec<ChatAction> {
        self.st().chat_actions.clone()
    }

    pub fn callback_answers(&self) -> Vec<CallbackAnswer> {
        self.st().callback_answers.clone()
    }

    /// The commands of the latest `setMyCommands` call of the bot (whatever
    /// its scope), as `(command, description)`.
    pub fn commands(&self, token: &str) -> Vec<(String, String)> {
        self.st()
            .bot(token)
            .command_sets
            .last()
            .map(|c| c.commands.clone())
            .unwrap_or_default()
    }

    /// Every `setMyCommands` call of the bot, in order.
    pub fn command_sets(&self, token: &str) -> Vec<CommandSet> {
        self.st().bot(token).command_sets.clone()
    }

    /// Raw bodies of every request to `method` (case-insensitive), in order,
    /// including faulted and failed ones (multipart/form fields as strings,
    /// query parameters merged in).
    pub fn requests(&self, method: &str) -> Vec<Value> {
        self.st()
            .requests
            .iter()
            .filter(|(m, _)| m.eq_ignore_ascii_case(method))
            .map(|(_, body)| body.clone())
            .collect()
    }

    /// `(offset, timeout)` of every `getUpdates` call of the bot (absent
    /// parameters count as 0, their default).
    pub fn get_updates_calls(&self, token: &str) -> Vec<(i64, u64)> {
        self.st().bot(token).get_updates_calls.clone()
    }

    /// Unconfirmed updates in the bot's queue.
    pub fn pending(&self, token: &str) -> usize {
        self.st().bot(token).queue.len()
    }

    /// How many `getUpdates` calls were answered 409 because another call
    /// for the same bot replaced them: two processes polling one bot.
    pub fn poll_conflicts(&self, token: &str) -> usize {
        self.st().bot(token).poll_conflicts
    }

    /// The bot's webhook `(url, secret_token)`, if one is set.
    pub fn webhook(&self, token: &str) -> Option<(String, Option<String>)> {
        self.st()
            .bot(token)
            .webhook
            .as_ref()
            .map(|w| (w.url.clone(), w.secret.clone()))
    }

    /// Every webhook delivery attempt, in order.
    pub fn push_attempts(&self) -> Vec<PushAttempt> {
        self.st().push_attempts.clone()
    }

    /// A stored message (sent by a bot or pushed), as Telegram would show it.
    pub fn message(&self, chat_id: i64, message_id: i64) -> Option<Value> {
        self.st()
            .chats
            .get(&chat_id)?
            .messages
            .get(&message_id)
            .cloned()
    }

    /// Polls `check` every 10 ms until it returns `Some` or `timeout` passes.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        check: impl Fn(&Self) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = check(self) {
                return Some(found);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until at least `count` messages were sent to the chat.
    pub async fn wait_sent(
        &self,
        chat_id: i64,
        count: usize,
        timeout: Duration,
    ) -> Option<Vec<SentMessage>> {
        self.wait_for(timeout, |fake| {
            Some(fake.sent(chat_id)).filter(|s| s.len() >= count)
        })
        .await
    }
}

// ---------------------------------------------------------------------------
// Connections that a handler can drop without answering
// ---------------------------------------------------------------------------

struct KillListener {
    inner: TcpListener,
}

/// Per-connection switch: once killed, the connection's IO fails, so hyper
/// drops the connection without writing a response.
#[derive(Default)]
struct KillSwitch {
    killed: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl KillSwitch {
    fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        if let Some(waker) = self.waker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            waker.wake();
        }
    }

    fn check(&self, cx: &Context<'_>) -> io::Result<()> {
        *self.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        if self.killed.load(Ordering::SeqCst) {
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "killed by the fake",
            ))
        } else {
            Ok(())
        }
    }
}

#[derive(Clone)]
struct ConnHandle(Arc<KillSwitch>);

impl std::fmt::Debug for ConnHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnHandle")
    }
}

struct KillableStream {
    inner: TcpStream,
    switch: Arc<KillSwitch>,
}

impl Listener for KillListener {
    type Io = KillableStream;
    type Addr = ConnHandle;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let switch = Arc::new(KillSwitch::default());
                    return (
                        KillableStream {
                            inner: stream,
                            switch: switch.clone(),
                        },
                        ConnHandle(switch),
                    );
                }
                Err(err) => {
                    tracing::debug!(%err, "fake Telegram accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(ConnHandle(Arc::default()))
    }
}

impl Connected<IncomingStream<'_, KillListener>> for ConnHandle {
    fn connect_info(stream: IncomingStream<'_, KillListener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl AsyncRead for KillableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.switch.check(cx)?;
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.switch.check(cx)?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.switch.check(cx)?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------
// Request handling
// ---------------------------------------------------------------------------

/// An answer in the Bot API format.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: Value,
}

impl Reply {
    fn ok(result: Value) -> Self {
        Self {
            status: 200,
            body: json!({"ok": true, "result": result}),
        }
    }

    fn err(code: u16, description: &str) -> Self {
        Self {
            status: code,
            body: json!({"ok": false, "error_code": code, "description": description}),
        }
    }

    fn err_with(code: u16, description: &str, parameters: Value) -> Self {
        let mut reply = Self::err(code, description);
        reply.body["parameters"] = parameters;
        reply
    }

    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body.to_string(),
        )
            .into_response()
    }
}

enum Outcome {
    Reply(Reply),
    Raw(u16, String),
    Close,
}

/// Request parameters: query string and body merged into one object (JSON
/// values as sent; form and multipart fields as strings; uploaded files as
/// `{"upload": file_name, "size": n}`).
#[derive(Default)]
struct Params {
    map: Map<String, Value>,
    uploads: HashMap<String, (Option<String>, Vec<u8>)>,
}

impl Params {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn str(&self, key: &str) -> Option<String> {
        match self.get(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            _ => None,
        }
    }

    fn i64(&self, key: &str) -> Option<i64> {
        match self.get(key)? {
            Value::Number(n) => n.as_i64(),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn bool(&self, key: &str) -> bool {
        match self.get(key) {
            Some(Value::Bool(b)) => *b,
            Some(Value::String(s)) => matches!(s.as_str(), "true" | "True" | "1"),
            Some(Value::Number(n)) => n.as_i64() == Some(1),
            _ => false,
        }
    }

    /// A JSON-typed parameter (objects and arrays arrive as JSON strings in
    /// form and multipart bodies).
    fn json(&self, key: &str) -> Option<Value> {
        match self.get(key)? {
            Value::String(s) => serde_json::from_str(s).ok(),
            other => Some(other.clone()),
        }
    }

    fn body(&self) -> Value {
        Value::Object(self.map.clone())
    }
}

async fn read_params(req: Request) -> Result<Params, String> {
    let mut params = Params::default();
    if let Some(query) = req.uri().query() {
        for (k, v) in parse_urlencoded(query) {
            params.map.insert(k, Value::String(v));
        }
    }
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if content_type.starts_with("multipart/form-data") {
        let mut multipart = Multipart::from_request(req, &())
            .await
            .map_err(|e| e.body_text())?;
        while let Some(field) = multipart.next_field().await.map_err(|e| e.body_text())? {
            let name = field.name().unwrap_or_default().to_owned();
            let file_name = field.file_name().map(str::to_owned);
            let bytes = field.bytes().await.map_err(|e| e.body_text())?;
            if file_name.is_some() {
                params.map.insert(
                    name.clone(),
                    json!({"upload": file_name, "size": bytes.len()}),
                );
                params.uploads.insert(name, (file_name, bytes.to_vec()));
            } else {
                params.map.insert(
                    name,
                    Value::String(String::from_utf8_lossy(&bytes).into_owned()),
                );
            }
        }
        return Ok(params);
    }
    let bytes = axum::body::to_bytes(req.into_body(), 64 << 20)
        .await
        .map_err(|e| e.to_string())?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(params);
    }
    if content_type.starts_with("application/x-www-form-urlencoded") {
        for (k, v) in parse_urlencoded(&String::from_utf8_lossy(&bytes)) {
            params.map.insert(k, Value::String(v));
        }
        return Ok(params);
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => params.map.extend(map),
        Ok(_) => return Err("Bad Request: request body must be a JSON object".into()),
        Err(err) => return Err(format!("Bad Request: can't parse JSON: {err}")),
    }
    Ok(params)
}

fn parse_urlencoded(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && bytes[i + 1].is_ascii_hexdigit()
            && bytes[i + 2].is_ascii_hexdigit()
        {
            let hex = [bytes[i + 1], bytes[i + 2]];
            let hex = std::str::from_utf8(&hex).expect("ASCII hex digits");
            out.push(u8::from_str_radix(hex, 16).expect("hex digits"));
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn canonical_method(method: &str) -> String {
    METHODS
        .iter()
        .find(|m| m.eq_ignore_ascii_case(method))
        .map(|m| (*m).to_owned())
        .unwrap_or_else(|| method.to_owned())
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(conn): ConnectInfo<ConnHandle>,
    req: Request,
) -> Response {
    let path = percent_decode(req.uri().path());
    if let Some(rest) = path.strip_prefix("/file/bot") {
        return serve_file(&shared, rest);
    }
    let Some((token, method)) = path
        .strip_prefix("/bot")
        .and_then(|rest| rest.split_once('/'))
    else {
        return Reply::err(404, "Not Found").into_response();
    };
    let (token, method) = (token.to_owned(), canonical_method(method));
    let params = match read_params(req).await {
        Ok(params) => params,
        Err(description) => return Reply::err(400, &description).into_response(),
    };
    let fault = {
        let mut st = lock(&shared);
        st.requests.push((method.clone(), params.body()));
        if st.bots.get(&token).is_none_or(|b| b.revoked) {
            return Reply::err(401, DESC_UNAUTHORIZED).into_response();
        }
        st.faults
            .get_mut(&(token.clone(), method.to_ascii_lowercase()))
            .and_then(VecDeque::pop_front)
    };
    // The work runs in its own task so that a client hanging up never cancels
    // a side effect half-way (or a long poll's bookkeeping).
    let task = tokio::spawn(run(shared, token, method, params, fault));
    match task.await {
        Ok(Outcome::Reply(reply)) => reply.into_response(),
        Ok(Outcome::Raw(status, body)) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Ok(Outcome::Close) => {
            conn.0.kill();
            StatusCode::OK.into_response()
        }
        Err(err) => Reply::err(500, &format!("Internal Server Error: {err}")).into_response(),
    }
}

async fn run(
    shared: Arc<Shared>,
    token: String,
    method: String,
    params: Params,
    fault: Option<Fault>,
) -> Outcome {
    let reply = match fault {
        None => dispatch(&shared, &token, &method, &params).await,
        Some(Fault::RetryAfter(secs)) => Reply::err_with(
            429,
            &format!("Too Many Requests: retry after {secs}"),
            json!({"retry_after": secs}),
        ),
        Some(Fault::Status(code, description)) => Reply::err(code, &description),
        Some(Fault::Raw(status, body)) => return Outcome::Raw(status, body),
        Some(Fault::Hang(wait)) => {
            tokio::time::sleep(wait).await;
            dispatch(&shared, &token, &method, &params).await
        }
        Some(Fault::HangAfterEffect(wait)) => {
            let reply = dispatch(&shared, &token, &method, &params).await;
            tokio::time::sleep(wait).await;
            reply
        }
        Some(Fault::HangBeforeEffect(wait)) => {
            tokio::time::sleep(wait).await;
            return Outcome::Close;
        }
        Some(Fault::Close) => return Outcome::Close,
    };
    Outcome::Reply(reply)
}

fn serve_file(shared: &Shared, rest: &str) -> Response {
    let Some((token, file_path)) = rest.split_once('/') else {
        return Reply::err(404, "Not Found").into_response();
    };
    let st = lock(shared);
    if st.bots.get(token).is_none_or(|b| b.revoked) {
        return Reply::err(401, DESC_UNAUTHORIZED).into_response();
    }
    match st.files.values().find(|f| f.path == file_path) {
        Some(file) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            file.bytes.clone(),
        )
            .into_response(),
        None => Reply::err(404, "Not Found").into_response(),
    }
}

async fn dispatch(shared: &Arc<Shared>, token: &str, method: &str, params: &Params) -> Reply {
    if method == "getUpdates" {
        return get_updates(shared, token, params).await;
    }
    let mut spawn_worker = None;
    let reply = {
        let mut st = lock(shared);
        if st.bots.get(token).is_none_or(|b| b.revoked) {
            return Reply::err(401, DESC_UNAUTHORIZED);
        }
        match method {
            "getMe" => get_me(&st, token),
            "logOut" => Reply::ok(json!(true)),
            "setWebhook" => {
                let reply = set_webhook(&mut st, token, params);
                if reply.status == 200 && st.bots[token].webhook.is_some() {
                    spawn_worker = Some(st.bots[token].webhook_gen);
                }
                reply
            }
            "deleteWebhook" => delete_webhook(&mut st, token, params),
            "getWebhookInfo" => get_webhook_info(&st, token),
            "sendMessage" => send_message(&mut st, token, params),
            "editMessageText" => edit_message_text(&mut st, token, params),
            "deleteMessage" => delete_message(&mut st, params),
            "sendChatAction" => send_chat_action(&mut st, token, params),
            "sendMessageDraft" => send_message_draft(&mut st, token, params),
            "answerCallbackQuery" => answer_callback_query(&mut st, token, params),
            "setMyCommands" => set_my_commands(&mut st, token, params),
            "getMyCommands" => get_my_commands(&mut st, token, params),
            "deleteMyCommands" => delete_my_commands(&mut st, token, params),
            "getFile" => get_file(&st, params),
            "sendPhoto" => send_media(&mut st, token, params, "sendPhoto", "photo"),
            "sendDocument" => send_media(&mut st, token, params, "sendDocument", "document"),
            _ => Reply::err(404, DESC_METHOD_NOT_FOUND),
        }
    };
    shared.notify.notify_waiters();
    if let Some(generation) = spawn_worker {
        tokio::spawn(webhook_worker(shared.clone(), token.to_owned(), generation));
    }
    reply
}

// ---------------------------------------------------------------------------
// Methods
// ---------------------------------------------------------------------------

fn get_me(st: &St, token: &str) -> Reply {
    let mut me = st.bot_json(token);
    for (key, value) in [
        ("can_join_groups", true),
        ("can_read_all_group_messages", false),
        ("supports_inline_queries", false),
        ("can_connect_to_business", false),
        ("has_main_web_app", false),
    ] {
        me[key] = json!(value);
    }
    Reply::ok(me)
}

async fn get_updates(shared: &Arc<Shared>, token: &str, params: &Params) -> Reply {
    let offset = params.i64("offset").unwrap_or(0);
    let limit = params.i64("limit").unwrap_or(100).clamp(1, 100) as usize;
    let timeout = params.i64("timeout").unwrap_or(0).max(0) as u64;
    let allowed = params.json("allowed_updates");
    let my_poll = {
        let mut st = lock(shared);
        let bot = st.bot(token);
        if bot.webhook.is_some() {
            return Reply::err(409, DESC_WEBHOOK_CONFLICT);
        }
        bot.get_updates_calls.push((offset, timeout));
        if let Some(Value::Array(kinds)) = allowed {
            bot.allowed_updates = Some(
                kinds
                    .iter()
                    .filter_map(|k| k.as_str().map(str::to_owned))
                    .collect(),
            );
        }
        if offset > 0 {
            bot.queue
                .retain(|u| u["update_id"].as_i64().unwrap_or(0) >= offset);
        } else if offset < 0 {
            let keep = offset.unsigned_abs() as usize;
            while bot.queue.len() > keep {
                bot.queue.pop_front();
            }
        }
        bot.poll_seq += 1;
        let me = bot.poll_seq;
        if let Some(previous) = bot.active_poll.replace(me) {
            bot.terminated_polls.insert(previous, DESC_TERMINATED);
        }
        me
    };
    shared.notify.notify_waiters();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    loop {
        let notified = shared.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut st = lock(shared);
            let shutdown = st.shutdown;
            let bot = st.bot(token);
            if let Some(description) = bot.terminated_polls.remove(&my_poll) {
                if description == DESC_TERMINATED {
                    bot.poll_conflicts += 1;
                }
                return Reply::err(409, description);
            }
            if bot.revoked {
                return Reply::err(401, DESC_UNAUTHORIZED);
            }
            let updates: Vec<Value> = bot.queue.iter().take(limit).cloned().collect();
            if !updates.is_empty() || shutdown || tokio::time::Instant::now() >= deadline {
                if bot.active_poll == Some(my_poll) {
                    bot.active_poll = None;
                }
                return Reply::ok(Value::Array(updates));
            }
        }
        tokio::select! {
            () = &mut notified => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

fn valid_secret(secret: &str) -> bool {
    (1..=256).contains(&secret.len())
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn set_webhook(st: &mut St, token: &str, params: &Params) -> Reply {
    let url = params.str("url").unwrap_or_default();
    let secret = params.str("secret_token").filter(|s| !s.is_empty());
    if let Some(secret) = &secret
        && !valid_secret(secret)
    {
        return Reply::err(
            400,
            "Bad Request: secret token contains unallowed characters",
        );
    }
    let drop_pending = params.bool("drop_pending_updates");
    let allowed = params.json("allowed_updates");
    let max_connections = params.i64("max_connections").unwrap_or(40);
    if !url.is_empty() && !url.starts_with("http://") && !url.starts_with("https://") {
        return Reply::err(
            400,
            "Bad Request: bad webhook: HTTPS url must be provided for webhook",
        );
    }
    let bot = st.bot(token);
    if let Some(Value::Array(kinds)) = allowed {
        bot.allowed_updates = Some(
            kinds
                .iter()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect(),
        );
    }
    if drop_pending {
        bot.queue.clear();
    }
    bot.webhook_gen += 1;
    bot.last_webhook_error = None;
    bot.webhook = (!url.is_empty()).then_some(WebhookSt {
        url,
        secret,
        max_connections,
    });
    if bot.webhook.is_some() {
        // Like Telegram: a webhook ends any long poll in progress.
        if let Some(poll) = bot.active_poll.take() {
            bot.terminated_polls.insert(poll, DESC_WEBHOOK_CONFLICT);
        }
    }
    Reply::ok(json!(true))
}

fn delete_webhook(st: &mut St, token: &str, params: &Params) -> Reply {
    let drop_pending = params.bool("drop_pending_updates");
    let bot = st.bot(token);
    bot.webhook = None;
    bot.webhook_gen += 1;
    if drop_pending {
        bot.queue.clear();
    }
    Reply::ok(json!(true))
}

fn get_webhook_info(st: &St, token: &str) -> Reply {
    let bot = &st.bots[token];
    let mut info = json!({
        "url": bot.webhook.as_ref().map(|w| w.url.clone()).unwrap_or_default(),
        "has_custom_certificate": false,
        "pending_update_count": bot.queue.len(),
    });
    if let Some(webhook) = &bot.webhook {
        info["max_connections"] = json!(webhook.max_connections);
        if let Some((date, message)) = &bot.last_webhook_error {
            info["last_error_date"] = json!(date);
            info["last_error_message"] = json!(message);
        }
    }
    if let Some(allowed) = &bot.allowed_updates {
        info["allowed_updates"] = json!(allowed);
    }
    Reply::ok(info)
}

/// Parses `text` under `parse_mode`, answering Telegram's errors.
fn format_text(
    text: &str,
    parse_mode: Option<&str>,
    entities: Option<Value>,
) -> Result<Formatted, Reply> {
    let parsed = match parse_mode.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") => Ok(Formatted {
            text: text.to_owned(),
            entities: match entities {
                Some(Value::Array(list)) => list,
                _ => Vec::new(),
            },
        }),
        Some("html") => parse_html(text),
        Some("markdownv2") => parse_markdown_v2(text),
        Some("markdown") => parse_markdown_legacy(text),
        Some(other) => {
            return Err(Reply::err(
                400,
                &format!("Bad Request: unsupported parse_mode \"{other}\""),
            ));
        }
    };
    parsed
        .map_err(|reason| Reply::err(400, &format!("Bad Request: can't parse entities: {reason}")))
}

fn check_text(formatted: &Formatted, too_long: &str) -> Result<(), Reply> {
    if formatted.text.trim().is_empty() {
        return Err(Reply::err(400, DESC_TEXT_EMPTY));
    }
    if utf16_len(&formatted.text) > MAX_TEXT_LEN {
        return Err(Reply::err(400, too_long));
    }
    Ok(())
}

/// `reply_parameters` (or the legacy `reply_to_message_id`) → the message to
/// embed as `reply_to_message`.
fn reply_to(
    st: &St,
    chat_id: i64,
    params: &Params,
) -> Result<(Option<Value>, Option<Value>), Reply> {
    let reply_parameters = params.json("reply_parameters").or_else(|| {
        params
            .i64("reply_to_message_id")
            .map(|id| json!({"message_id": id}))
    });
    let Some(rp) = &reply_parameters else {
        return Ok((None, None));
    };
    let target_chat = rp.get("chat_id").and_then(Value::as_i64).unwrap_or(chat_id);
    let message_id = rp.get("message_id").and_then(Value::as_i64).unwrap_or(0);
    let allow_missing = rp
        .get("allow_sending_without_reply")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        || params.bool("allow_sending_without_reply");
    match st.reply_target(target_chat, message_id) {
        Some(target) => Ok((reply_parameters, Some(target))),
        None if allow_missing => Ok((reply_parameters, None)),
        None => Err(Reply::err(
            400,
            "Bad Request: message to be replied not found",
        )),
    }
}

fn inline_markup(params: &Params) -> Option<Value> {
    params
        .json("reply_markup")
        .filter(|m| m.get("inline_keyboard").is_some())
}

fn send_message(st: &mut St, token: &str, params: &Params) -> Reply {
    match try_send_message(st, token, params) {
        Ok(reply) | Err(reply) => reply,
    }
}

fn try_send_message(st: &mut St, token: &str, params: &Params) -> Result<Reply, Reply> {
    let chat_id = st.resolve_chat(params)?;
    let text = params.str("text").unwrap_or_default();
    let parse_mode = params.str("parse_mode").filter(|p| !p.is_empty());
    let formatted = format_text(&text, parse_mode.as_deref(), params.json("entities"))?;
    check_text(&formatted, DESC_TOO_LONG)?;
    let (reply_parameters, target) = reply_to(st, chat_id, params)?;
    let thread_id = params.i64("message_thread_id");
    let bot_json = st.bot_json(token);
    let mut msg = st.new_message(chat_id, bot_json);
    if let Some(thread) = thread_id {
        msg.insert("message_thread_id".into(), json!(thread));
        msg.insert("is_topic_message".into(), json!(true));
    }
    if let Some(target) = target {
        msg.insert("reply_to_message".into(), target);
    }
    msg.insert("text".into(), json!(formatted.text));
    if !formatted.entities.is_empty() {
        msg.insert("entities".into(), json!(formatted.entities));
    }
    let markup = inline_markup(params);
    if let Some(markup) = &markup {
        msg.insert("reply_markup".into(), markup.clone());
    }
    st.store_message(chat_id, &msg);
    let message_id = msg["message_id"].as_i64().unwrap_or_default();
    st.sent.push(SentMessage {
        token: token.to_owned(),
        method: "sendMessage".into(),
        chat_id,
        message_id,
        text,
        visible_text: formatted.text,
        parse_mode,
        entities: formatted.entities,
        reply_parameters,
        thread_id,
        reply_markup: params.json("reply_markup"),
        media: None,
        edit_count: 0,
        deleted: false,
        body: params.body(),
    });
    Ok(Reply::ok(Value::Object(msg)))
}

fn send_media(st: &mut St, token: &str, params: &Params, method: &str, field: &str) -> Reply {
    match try_send_media(st, token, params, method, field) {
        Ok(reply) | Err(reply) => reply,
    }
}

fn try_send_media(
    st: &mut St,
    token: &str,
    params: &Params,
    method: &str,
    field: &str,
) -> Result<Reply, Reply> {
    let chat_id = st.resolve_chat(params)?;
    let media_arg = params.str(field);
    let upload = match &media_arg {
        Some(arg) => arg
            .strip_prefix("attach://")
            .and_then(|name| params.uploads.get(name)),
        None => params.uploads.get(field),
    };
    let file_id = match (upload, &media_arg) {
        (Some((file_name, bytes)), _) => {
            let id = st.new_file_id("upload-");
            st.register_file(&id, bytes.clone());
            if let Some(name) = file_name {
                st.files.get_mut(&id).expect("just registered").path = format!("documents/{name}");
            }
            id
        }
        (None, Some(arg)) if arg.starts_with("http://") || arg.starts_with("https://") => {
            let id = st.new_file_id("url-");
            st.register_file(&id, Vec::new());
            id
        }
        (None, Some(arg)) if st.files.contains_key(arg) => arg.clone(),
        (None, Some(_)) => {
            return Err(Reply::err(
                400,
                "Bad Request: wrong file identifier/HTTP URL specified",
            ));
        }
        (None, None) => {
            return Err(Reply::err(
                400,
                &format!("Bad Request: there is no {field} in the request"),
            ));
        }
    };
    let caption = params.str("caption").unwrap_or_default();
    let parse_mode = params.str("parse_mode").filter(|p| !p.is_empty());
    let formatted = format_text(
        &caption,
        parse_mode.as_deref(),
        params.json("caption_entities"),
    )?;
    if utf16_len(&formatted.text) > MAX_CAPTION_LEN {
        return Err(Reply::err(400, DESC_CAPTION_TOO_LONG));
    }
    let (reply_parameters, target) = reply_to(st, chat_id, params)?;
    let thread_id = params.i64("message_thread_id");
    let bot_json = st.bot_json(token);
    let mut file = st.file_json(&file_id);
    let mut msg = st.new_message(chat_id, bot_json);
    if let Some(thread) = thread_id {
        msg.insert("message_thread_id".into(), json!(thread));
        msg.insert("is_topic_message".into(), json!(true));
    }
    if let Some(target) = target {
        msg.insert("reply_to_message".into(), target);
    }
    if field == "photo" {
        file["width"] = json!(800);
        file["height"] = json!(600);
        msg.insert("photo".into(), json!([file]));
    } else {
        if let Some((Some(name), _)) = upload {
            file["file_name"] = json!(name);
        }
        msg.insert("document".into(), file);
    }
    if !formatted.text.is_empty() {
        msg.insert("caption".into(), json!(formatted.text));
        if !formatted.entities.is_empty() {
            msg.insert("caption_entities".into(), json!(formatted.entities));
        }
    }
    if let Some(markup) = inline_markup(params) {
        msg.insert("reply_markup".into(), markup);
    }
    st.store_message(chat_id, &msg);
    let message_id = msg["message_id"].as_i64().unwrap_or_default();
    st.sent.push(SentMessage {
        token: token.to_owned(),
        method: method.to_owned(),
        chat_id,
        message_id,
        text: caption,
        visible_text: formatted.text,
        parse_mode,
        entities: formatted.entities,
        reply_parameters,
        thread_id,
        reply_markup: params.json("reply_markup"),
        media: media_arg,
        edit_count: 0,
        deleted: false,
        body: params.body(),
    });
    Ok(Reply::ok(Value::Object(msg)))
}

fn edit_message_text(st: &mut St, token: &str, params: &Params) -> Reply {
    match try_edit_message_text(st, token, params) {
        Ok(reply) | Err(reply) => reply,
    }
}

fn try_edit_message_text(st: &mut St, token: &str, params: &Params) -> Result<Reply, Reply> {
    if params.get("inline_message_id").is_some() {
        return Err(Reply::err(400, DESC_EDIT_NOT_FOUND));
    }
    let chat_id = st.resolve_chat(params)?;
    let Some(message_id) = params.i64("message_id") else {
        return Err(Reply::err(
            400,
            "Bad Request: message identifier is not specified",
        ));
    };
    let bot_id = st.bots[token].id;
    let Some(current) = st.chats[&chat_id].messages.get(&message_id).cloned() else {
        return Err(Reply::err(400, DESC_EDIT_NOT_FOUND));
    };
    if current["from"]["id"].as_i64() != Some(bot_id) {
        return Err(Reply::err(400, "Bad Request: message can't be edited"));
    }
    if current.get("text").is_none() {
        return Err(Reply::err(
            400,
            "Bad Request: there is no text in the message to edit",
        ));
    }
    let text = params.str("text").unwrap_or_default();
    let parse_mode = params.str("parse_mode").filter(|p| !p.is_empty());
    let formatted = format_text(&text, parse_mode.as_deref(), params.json("entities"))?;
    check_text(&formatted, DESC_EDIT_TOO_LONG)?;
    let markup = inline_markup(params);
    let old_entities = current
        .get("entities")
        .cloned()
        .unwrap_or_else(|| json!([]));
    if current["text"] == json!(formatted.text)
        && old_entities == json!(formatted.entities)
        && current.get("reply_markup") == markup.as_ref()
    {
        return Err(Reply::err(400, DESC_NOT_MODIFIED));
    }
    let mut msg = current;
    let obj = msg.as_object_mut().expect("stored messages are objects");
    obj.insert("text".into(), json!(formatted.text));
    obj.remove("entities");
    if !formatted.entities.is_empty() {
        obj.insert("entities".into(), json!(formatted.entities));
    }
    obj.remove("reply_markup");
    if let Some(markup) = markup {
        obj.insert("reply_markup".into(), markup);
    }
    obj.insert("edit_date".into(), json!(now_unix()));
    st.chat_or_create(chat_id)
        .messages
        .insert(message_id, msg.clone());
    if let Some(sent) = st.sent_mut(chat_id, message_id) {
        sent.text = text.clone();
        sent.visible_text = formatted.text.clone();
        sent.parse_mode = parse_mode.clone();
        sent.entities = formatted.entities.clone();
        sent.edit_count += 1;
    }
    st.edits.push(Edit {
        token: token.to_owned(),
        chat_id,
        message_id,
        text,
        visible_text: formatted.text,
        parse_mode,
        body: params.body(),
    });
    Ok(Reply::ok(msg))
}

fn delete_message(st: &mut St, params: &Params) -> Reply {
    let chat_id = match st.resolve_chat(params) {
        Ok(id) => id,
        Err(reply) => return reply,
    };
    let message_id = params.i64("message_id").unwrap_or(0);
    match st.chat_or_create(chat_id).messages.remove(&message_id) {
        Some(_) => {
            if let Some(sent) = st.sent_mut(chat_id, message_id) {
                sent.deleted = true;
            }
            Reply::ok(json!(true))
        }
        None => Reply::err(400, "Bad Request: message to delete not found"),
    }
}

const CHAT_ACTIONS: [&str; 11] = [
    "typing",
    "upload_photo",
    "record_video",
    "upload_video",
    "record_voice",
    "upload_voice",
    "upload_document",
    "choose_sticker",
    "find_location",
    "record_video_note",
    "upload_video_note",
];

fn send_chat_action(st: &mut St, token: &str, params: &Params) -> Reply {
    let chat_id = match st.resolve_chat(params) {
        Ok(id) => id,
        Err(reply) => return reply,
    };
    let action = params.str("action").unwrap_or_default();
    if !CHAT_ACTIONS.contains(&action.as_str()) {
        return Reply::err(400, "Bad Request: wrong parameter action in request");
    }
    st.chat_actions.push(ChatAction {
        token: token.to_owned(),
        chat_id,
        action,
        thread_id: params.i64("message_thread_id"),
    });
    Reply::ok(json!(true))
}

fn send_message_draft(st: &mut St, token: &str, params: &Params) -> Reply {
    match try_send_message_draft(st, token, params) {
        Ok(reply) | Err(reply) => reply,
    }
}

fn try_send_message_draft(st: &mut St, token: &str, params: &Params) -> Result<Reply, Reply> {
    let chat_id = st.resolve_chat(params)?;
    let draft_id = params.i64("draft_id").unwrap_or(0);
    if draft_id == 0 {
        return Err(Reply::err(400, "Bad Request: draft_id must be non-zero"));
    }
    let text = params.str("text").unwrap_or_default();
    let parse_mode = params.str("parse_mode").filter(|p| !p.is_empty());
    let formatted = format_text(&text, parse_mode.as_deref(), params.json("entities"))?;
    check_text(&formatted, DESC_TOO_LONG)?;
    st.drafts.push(Draft {
        token: token.to_owned(),
        chat_id,
        draft_id,
        text,
        visible_text: formatted.text,
        parse_mode,
        thread_id: params.i64("message_thread_id"),
        body: params.body(),
    });
    Ok(Reply::ok(json!(true)))
}

fn answer_callback_query(st: &mut St, token: &str, params: &Params) -> Reply {
    let id = params.str("callback_query_id").unwrap_or_default();
    let Some(query) = st
        .callback_queries
        .get_mut(&id)
        .filter(|q| q.token == token && !q.answered)
    else {
        return Reply::err(400, DESC_QUERY_INVALID);
    };
    query.answered = true;
    let data = query.data.clone();
    st.callback_answers.push(CallbackAnswer {
        token: token.to_owned(),
        callback_query_id: id,
        data,
        text: params.str("text"),
        show_alert: params.bool("show_alert"),
        body: params.body(),
    });
    Reply::ok(json!(true))
}

fn commands_key(params: &Params) -> (String, String) {
    let scope = params
        .json("scope")
        .filter(|s| s["type"] != "default")
        .map(|s| s.to_string())
        .unwrap_or_default();
    (scope, params.str("language_code").unwrap_or_default())
}

fn set_my_commands(st: &mut St, token: &str, params: &Params) -> Reply {
    let Some(Value::Array(list)) = params.json("commands") else {
        return Reply::err(400, "Bad Request: commands must be an array");
    };
    let mut commands = Vec::new();
    for c in &list {
        let (Some(command), Some(description)) = (c["command"].as_str(), c["description"].as_str())
        else {
            return Reply::err(400, "Bad Request: can't parse BotCommand");
        };
        let valid = (1..=32).contains(&command.len())
            && command
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Reply::err(400, "Bad Request: BOT_COMMAND_INVALID");
        }
        if !(1..=256).contains(&description.chars().count()) {
            return Reply::err(400, "Bad Request: BOT_COMMAND_DESCRIPTION_INVALID");
        }
        commands.push((command.to_owned(), description.to_owned()));
    }
    let key = commands_key(params);
    let bot = st.bot(token);
    bot.command_sets.push(CommandSet {
        commands: commands.clone(),
        scope: params.json("scope"),
        language_code: params.str("language_code"),
    });
    bot.commands.insert(key, commands);
    Reply::ok(json!(true))
}

fn get_my_commands(st: &mut St, token: &str, params: &Params) -> Reply {
    let key = commands_key(params);
    let commands = st
        .bot(token)
        .commands
        .get(&key)
        .cloned()
        .unwrap_or_default();
    let list: Vec<Value> = commands
        .iter()
        .map(|(c, d)| json!({"command": c, "description": d}))
        .collect();
    Reply::ok(Value::Array(list))
}

fn delete_my_commands(st: &mut St, token: &str, params: &Params) -> Reply {
    let key = commands_key(params);
    st.bot(token).commands.remove(&key);
    Reply::ok(json!(true))
}

fn get_file(st: &St, params: &Params) -> Reply {
    let file_id = params.str("file_id").unwrap_or_default();
    match st.files.get(&file_id) {
        Some(file) => Reply::ok(json!({
            "file_id": file_id,
            "file_unique_id": file.unique_id,
            "file_size": file.bytes.len(),
            "file_path": file.path,
        })),
        None => Reply::err(400, "Bad Request: invalid file id"),
    }
}

// ---------------------------------------------------------------------------
// Webhook delivery
// ---------------------------------------------------------------------------

async fn webhook_worker(shared: Arc<Shared>, token: String, generation: u64) {
    loop {
        let notified = shared.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let job = {
            let st = lock(&shared);
            let Some(bot) = st.bots.get(&token) else {
                return;
            };
            let Some(webhook) = bot
                .webhook
                .clone()
                .filter(|_| bot.webhook_gen == generation && !st.shutdown)
            else {
                return;
            };
            bot.queue
                .front()
                .cloned()
                .map(|update| (update, webhook, st.webhook_retry))
        };
        let Some((update, webhook, retry)) = job else {
            notified.await;
            continue;
        };
        let update_id = update["update_id"].as_i64().unwrap_or_default();
        let body = update.to_string();
        for attempt in 1..=retry.attempts.max(1) {
            if attempt > 1 {
                tokio::time::sleep(retry.delay).await;
            }
            let result = post_json(
                &webhook.url,
                webhook.secret.as_deref(),
                body.as_bytes(),
                retry.timeout,
            )
            .await;
            let mut st = lock(&shared);
            let (status, error) = match &result {
                Ok(status) => (Some(*status), None),
                Err(err) => (None, Some(err.clone())),
            };
            st.push_attempts.push(PushAttempt {
                token: token.clone(),
                url: webhook.url.clone(),
                update_id,
                attempt,
                status,
                error: error.clone(),
                secret: webhook.secret.clone(),
                body: update.clone(),
            });
            let Some(bot) = st.bots.get_mut(&token) else {
                return;
            };
            if bot.webhook_gen != generation {
                return;
            }
            match (status, error) {
                (Some(code), _) if (200..300).contains(&code) => break,
                (Some(code), _) => {
                    bot.last_webhook_error = Some((
                        now_unix(),
                        format!("Wrong response from the webhook: {code}"),
                    ));
                }
                (None, Some(err)) => bot.last_webhook_error = Some((now_unix(), err)),
                (None, None) => {}
            }
        }
        {
            let mut st = lock(&shared);
            let Some(bot) = st.bots.get_mut(&token) else {
                return;
            };
            if bot.webhook_gen != generation {
                return;
            }
            if bot.queue.front().and_then(|u| u["update_id"].as_i64()) == Some(update_id) {
                bot.queue.pop_front();
            }
        }
        shared.notify.notify_waiters();
    }
}

/// A minimal HTTP/1.1 client (the fake has no HTTP client dependency):
/// POSTs `body` as JSON to an `http://` URL and returns the status code.
async fn post_json(
    url: &str,
    secret: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<u16, String> {
    let attempt = async {
        let rest = url
            .strip_prefix("http://")
            .ok_or("the fake delivers webhooks to http:// URLs only")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let addr = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let mut stream = TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        if let Some(secret) = secret {
            head.push_str(&format!("X-Telegram-Bot-Api-Secret-Token: {secret}\r\n"));
        }
        head.push_str("\r\n");
        stream
            .write_all(head.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        stream.write_all(body).await.map_err(|e| e.to_string())?;
        let mut response = Vec::new();
        let mut chunk = [0u8; 4096];
        let status_line = loop {
            if let Some(end) = response.windows(2).position(|w| w == b"\r\n") {
                break String::from_utf8_lossy(&response[..end]).into_owned();
            }
            let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed without a response".to_owned());
            }
            response.extend_from_slice(&chunk[..n]);
        };
        // Drain the rest so the receiver finishes its response cleanly.
        while let Ok(n) = stream.read(&mut chunk).await {
            if n == 0 {
                break;
            }
        }
        status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse::<u16>().ok())
            .ok_or_else(|| format!("bad status line {status_line:?}"))
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()))
}

// ---------------------------------------------------------------------------
// Text formatting: HTML and Markdown parsing, entities
// ---------------------------------------------------------------------------

/// Visible text and its entities (UTF-16 offsets, Bot API JSON).
#[derive(Debug, Default, PartialEq)]
struct Formatted {
    text: String,
    entities: Vec<Value>,
}

fn utf16_len(s: &str) -> usize {
    s.encode_utf16().count()
}

fn entity(kind: &str, offset: usize, length: usize) -> Value {
    json!({"type": kind, "offset": offset, "length": length})
}

fn sort_entities(entities: &mut [Value]) {
    entities.sort_by_key(|e| {
        (
            e["offset"].as_u64().unwrap_or(0),
            std::cmp::Reverse(e["length"].as_u64().unwrap_or(0)),
        )
    });
}

/// Decodes an HTML entity at the start of `s` (which starts with `&`):
/// `&lt;` `&gt;` `&amp;` `&quot;` and numeric ones, as Telegram supports.
fn decode_entity(s: &str) -> Option<(char, usize)> {
    let end = s.bytes().take(12).position(|b| b == b';')?;
    let name = &s[1..end];
    let ch = match name {
        "lt" => '<',
        "gt" => '>',
        "amp" => '&',
        "quot" => '"',
        _ => {
            let code =
                if let Some(hex) = name.strip_prefix("#x").or_else(|| name.strip_prefix("#X")) {
                    u32::from_str_radix(hex, 16).ok()?
                } else {
                    name.strip_prefix('#')?.parse::<u32>().ok()?
                };
            char::from_u32(code).filter(|c| *c != '\0')?
        }
    };
    Some((ch, end + 1))
}

fn decode_attr(value: &str) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < value.len() {
        if value.as_bytes()[i] == b'&'
            && let Some((ch, len)) = decode_entity(&value[i..])
        {
            out.push(ch);
            i += len;
            continue;
        }
        let ch = value[i..].chars().next().expect("in bounds");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

const HTML_TAGS: [&str; 16] = [
    "a",
    "b",
    "strong",
    "i",
    "em",
    "s",
    "strike",
    "del",
    "u",
    "ins",
    "tg-spoiler",
    "tg-emoji",
    "span",
    "pre",
    "code",
    "blockquote",
];

struct OpenTag {
    tag: String,
    start: usize,
    arg: Option<String>,
}

/// Telegram's HTML parse mode (tdlib's rules and error texts), stricter in
/// one point: a `&` that does not start a supported entity is an error.
fn parse_html(input: &str) -> Result<Formatted, String> {
    let bytes = input.as_bytes();
    let len = bytes.len();
    let mut out = String::new();
    let mut out16 = 0;
    let mut stack: Vec<OpenTag> = Vec::new();
    let mut entities = Vec::new();
    let is_name = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
    let mut i = 0;
    while i < len {
        let c = bytes[i];
        if c == b'&' {
            let Some((ch, n)) = decode_entity(&input[i..]) else {
                return Err(format!(
                    "Unsupported entity or unescaped \"&\" at byte offset {i}; escape it as \"&amp;\""
                ));
            };
            out.push(ch);
            out16 += ch.len_utf16();
            i += n;
            continue;
        }
        if c != b'<' {
            let ch = input[i..].chars().next().expect("in bounds");
            out.push(ch);
            out16 += ch.len_utf16();
            i += ch.len_utf8();
            continue;
        }
        let begin = i;
        i += 1;
        if bytes.get(i) == Some(&b'/') {
            i += 1;
            let name_start = i;
            while i < len && is_name(bytes[i]) {
                i += 1;
            }
            let name = input[name_start..i].to_ascii_lowercase();
            while i < len && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            if i >= len || bytes[i] != b'>' {
                return Err(format!("Unclosed end tag at byte offset {begin}"));
            }
            i += 1;
            let Some(open) = stack.pop() else {
                return Err(format!("Unexpected end tag at byte offset {begin}"));
            };
            if !name.is_empty() && name != open.tag {
                return Err(format!(
                    "Unmatched end tag at byte offset {begin}, expected \"</{}>\", found \"</{name}>\"",
                    open.tag
                ));
            }
            let length = out16 - open.start;
            if open.tag == "code"
                && let Some(parent) = stack.last_mut()
                && parent.tag == "pre"
                && parent.arg.is_none()
                && open.arg.is_some()
            {
                // <pre><code class="language-x"> is one `pre` entity with a language.
                parent.arg = open.arg;
                continue;
            }
            if length == 0 {
                continue;
            }
            let e = match open.tag.as_str() {
                "a" => match open.arg.as_deref().and_then(normalize_url) {
                    Some(url) => {
                        let mut e = entity("text_link", open.start, length);
                        e["url"] = json!(url);
                        e
                    }
                    None => continue,
                },
                "b" | "strong" => entity("bold", open.start, length),
                "i" | "em" => entity("italic", open.start, length),
                "u" | "ins" => entity("underline", open.start, length),
                "s" | "strike" | "del" => entity("strikethrough", open.start, length),
                "tg-spoiler" | "span" => entity("spoiler", open.start, length),
                "code" => entity("code", open.start, length),
                "pre" => {
                    let mut e = entity("pre", open.start, length);
                    if let Some(language) = open.arg {
                        e["language"] = json!(language);
                    }
                    e
                }
                "blockquote" if open.arg.is_some() => {
                    entity("expandable_blockquote", open.start, length)
                }
                "blockquote" => entity("blockquote", open.start, length),
                "tg-emoji" => {
                    let mut e = entity("custom_emoji", open.start, length);
                    e["custom_emoji_id"] = json!(open.arg.unwrap_or_default());
                    e
                }
                _ => continue,
            };
            entities.push(e);
            continue;
        }
        let name_start = i;
        while i < len && is_name(bytes[i]) {
            i += 1;
        }
        let tag = input[name_start..i].to_ascii_lowercase();
        if !HTML_TAGS.contains(&tag.as_str()) {
            return Err(format!(
                "Unsupported start tag \"{tag}\" at byte offset {begin}"
            ));
        }
        let mut attrs: Vec<(String, Option<String>)> = Vec::new();
        loop {
            while i < len && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            if i >= len {
                return Err(format!("Unclosed start tag at byte offset {begin}"));
            }
            if bytes[i] == b'>' {
                i += 1;
                break;
            }
            let attr_start = i;
            while i < len && is_name(bytes[i]) {
                i += 1;
            }
            let attr = input[attr_start..i].to_ascii_lowercase();
            if attr.is_empty() {
                return Err(format!(
                    "Empty attribute name in the tag \"{tag}\" at byte offset {begin}"
                ));
            }
            while i < len && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            if i >= len {
                return Err(format!("Unclosed start tag at byte offset {begin}"));
            }
            if bytes[i] != b'=' {
                attrs.push((attr, None));
                continue;
            }
            i += 1;
            while i < len && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            if i >= len {
                return Err(format!("Unclosed start tag at byte offset {begin}"));
            }
            let value = if bytes[i] == b'"' || bytes[i] == b'\'' {
                let quote = bytes[i];
                i += 1;
                let value_start = i;
                while i < len && bytes[i] != quote {
                    i += 1;
                }
                if i >= len {
                    return Err(format!(
                        "Unclosed end of attribute value at byte offset {value_start}"
                    ));
                }
                i += 1;
                decode_attr(&input[value_start..i - 1])
            } else {
                let value_start = i;
                while i < len
                    && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'.' || bytes[i] == b'-')
                {
                    i += 1;
                }
                if i == value_start {
                    return Err(format!(
                        "Expected equal sign in declaration of an attribute of the tag \"{tag}\" at byte offset {begin}"
                    ));
                }
                input[value_start..i].to_owned()
            };
            attrs.push((attr, Some(value)));
        }
        let attr = |name: &str| {
            attrs
                .iter()
                .find(|(a, _)| a == name)
                .map(|(_, v)| v.clone().unwrap_or_default())
        };
        let arg = match tag.as_str() {
            "a" => attr("href"),
            "code" => attr("class").and_then(|c| c.strip_prefix("language-").map(str::to_owned)),
            "span" => {
                if attr("class").as_deref() != Some("tg-spoiler") {
                    return Err(format!(
                        "Tag \"span\" must have class \"tg-spoiler\" at byte offset {begin}"
                    ));
                }
                None
            }
            "tg-emoji" => match attr("emoji-id") {
                Some(id) if !id.is_empty() => Some(id),
                _ => {
                    return Err(format!(
                        "Tag \"tg-emoji\" must have attribute \"emoji-id\" at byte offset {begin}"
                    ));
                }
            },
            "blockquote" => attr("expandable").map(|_| String::new()),
            _ => None,
        };
        stack.push(OpenTag {
            tag,
            start: out16,
            arg,
        });
    }
    if let Some(open) = stack.last() {
        return Err(format!(
            "Can't find end tag corresponding to start tag \"{}\"",
            open.tag
        ));
    }
    sort_entities(&mut entities);
    Ok(Formatted {
        text: out,
        entities,
    })
}

fn normalize_url(url: &str) -> Option<String> {
    let url = url.trim();
    if url.is_empty() || url.contains(char::is_whitespace) {
        return None;
    }
    if url.starts_with("tg://user") {
        // A text_mention needs a user object the fake does not have.
        return None;
    }
    if let Some((scheme, rest)) = url.split_once("://") {
        let ok = !rest.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        return ok.then(|| {
            if rest.contains('/') {
                url.to_owned()
            } else {
                format!("{url}/")
            }
        });
    }
    Some(if url.contains('/') {
        format!("http://{url}")
    } else {
        format!("http://{url}/")
    })
}

const MARKDOWN_V2_RESERVED: &str = "_*[]()~`>#+-=|{}.!";

struct OpenMd {
    kind: &'static str,
    start: usize,
    begin: usize,
}

/// Telegram's MarkdownV2 (tdlib's rules and error texts, simplified: block
/// quotes are accepted but produce no entity, custom emoji are not
/// supported).
fn parse_markdown_v2(input: &str) -> Result<Formatted, String> {
    let chars: Vec<(usize, char)> = input.char_indices().collect();
    let at = |k: usize| chars.get(k).map(|&(_, c)| c);
    let mut out = String::new();
    let mut out16 = 0;
    let mut stack: Vec<OpenMd> = Vec::new();
    let mut entities = Vec::new();
    let mut k = 0;
    let push = |out: &mut String, out16: &mut usize, c: char| {
        out.push(c);
        *out16 += c.len_utf16();
    };
    while k < chars.len() {
        let (pos, c) = chars[k];
        let next = at(k + 1);
        if c == '\\' && next.is_some_and(|n| (1..=126).contains(&(n as u32))) {
            push(&mut out, &mut out16, next.expect("checked"));
            k += 2;
            continue;
        }
        let top = stack.last().map(|o| o.kind);
        if matches!(top, Some("code") | Some("pre")) {
            if c == '`' && top == Some("code") {
                let open = stack.pop().expect("top exists");
                if out16 > open.start {
                    entities.push(entity("code", open.start, out16 - open.start));
                }
                k += 1;
                continue;
            }
            if c == '`' && top == Some("pre") && next == Some('`') && at(k + 2) == Some('`') {
                let open = stack.pop().expect("top exists");
                if out16 > open.start {
                    entities.push(entity("pre", open.start, out16 - open.start));
                }
                k += 3;
                continue;
            }
            push(&mut out, &mut out16, c);
            k += 1;
            continue;
        }
        if !MARKDOWN_V2_RESERVED.contains(c) {
            push(&mut out, &mut out16, c);
            k += 1;
            continue;
        }
        // Closing the innermost entity?
        let closing = match (top, c) {
            (Some("underline"), '_') if next == Some('_') => Some(2),
            (Some("italic"), '_') | (Some("bold"), '*') | (Some("strikethrough"), '~') => Some(1),
            (Some("spoiler"), '|') if next == Some('|') => Some(2),
            (Some("text_link"), ']') => Some(1),
            _ => None,
        };
        if let Some(width) = closing {
            let open = stack.pop().expect("top exists");
            k += width;
            let length = out16 - open.start;
            if open.kind == "text_link" {
                let mut url = String::new();
                if at(k) == Some('(') {
                    k += 1;
                    loop {
                        match at(k) {
                            None => {
                                return Err(format!(
                                    "Can't find end of a URL at byte offset {pos}"
                                ));
                            }
                            Some(')') => {
                                k += 1;
                                break;
                            }
                            Some('\\') if at(k + 1).is_some() => {
                                url.push(at(k + 1).expect("checked"));
                                k += 2;
                            }
                            Some(u) => {
                                url.push(u);
                                k += 1;
                            }
                        }
                    }
                }
                if let (Some(url), true) = (normalize_url(&url), length > 0) {
                    let mut e = entity("text_link", open.start, length);
                    e["url"] = json!(url);
                    entities.push(e);
                }
            } else if length > 0 {
                entities.push(entity(open.kind, open.start, length));
            }
            continue;
        }
        let line_start = k == 0 || at(k - 1) == Some('\n');
        let (kind, width) = match c {
            '_' if next == Some('_') => ("underline", 2),
            '_' => ("italic", 1),
            '*' => ("bold", 1),
            '~' => ("strikethrough", 1),
            '|' if next == Some('|') => ("spoiler", 2),
            '[' => ("text_link", 1),
            '`' if next == Some('`') && at(k + 2) == Some('`') => ("pre", 3),
            '`' => ("code", 1),
            '>' if line_start => {
                k += 1;
                continue;
            }
            _ => {
                return Err(format!(
                    "Character '{c}' is reserved and must be escaped with the preceding '\\'"
                ));
            }
        };
        k += width;
        if kind == "pre" {
            // An optional language on the opening line.
            let mut j = k;
            while at(j).is_some_and(|ch| ch != '\n' && ch != '`' && !ch.is_whitespace()) {
                j += 1;
            }
            if j > k && at(j) == Some('\n') {
                k = j + 1;
            } else if at(k) == Some('\n') {
                k += 1;
            }
        }
        stack.push(OpenMd {
            kind,
            start: out16,
            begin: pos,
        });
    }
    if let Some(open) = stack.last() {
        let name = match open.kind {
            "bold" => "Bold",
            "italic" => "Italic",
            "underline" => "Underline",
            "strikethrough" => "Strikethrough",
            "spoiler" => "Spoiler",
            "code" => "Code",
            "pre" => "Pre",
            _ => "TextUrl",
        };
        return Err(format!(
            "Can't find end of {name} entity at byte offset {}",
            open.begin
        ));
    }
    sort_entities(&mut entities);
    Ok(Formatted {
        text: out,
        entities,
    })
}

/// Telegram's legacy Markdown: `*bold*`, `_italic_`, `` `code` ``,
/// ```` ```pre``` ````, `[text](url)`; no nesting, no reserved characters.
fn parse_markdown_legacy(input: &str) -> Result<Formatted, String> {
    let chars: Vec<(usize, char)> = input.char_indices().collect();
    let mut out = String::new();
    let mut out16 = 0;
    let mut entities = Vec::new();
    let mut k = 0;
    while k < chars.len() {
        let (pos, c) = chars[k];
        let (kind, close): (&str, &[char]) = match c {
            '*' => ("bold", &['*']),
            '_' => ("italic", &['_']),
            '`' if chars.get(k + 1).map(|x| x.1) == Some('`')
                && chars.get(k + 2).map(|x| x.1) == Some('`') =>
            {
                ("pre", &['`', '`', '`'])
            }
            '`' => ("code", &['`']),
            '[' => ("text_link", &[']']),
            '\\' if chars.get(k + 1).is_some_and(|x| "*_`[".contains(x.1)) => {
                let ch = chars[k + 1].1;
                out.push(ch);
                out16 += ch.len_utf16();
                k += 2;
                continue;
            }
            _ => {
                out.push(c);
                out16 += c.len_utf16();
                k += 1;
                continue;
            }
        };
        k += close.len();
        let start = out16;
        let mut found = false;
        while k < chars.len() {
            if chars[k..]
                .iter()
                .map(|x| x.1)
                .take(close.len())
                .eq(close.iter().copied())
            {
                k += close.len();
                found = true;
                break;
            }
            out.push(chars[k].1);
            out16 += chars[k].1.len_utf16();
            k += 1;
        }
        if !found {
            return Err(format!(
                "Can't find end of the entity starting at byte offset {pos}"
            ));
        }
        let length = out16 - start;
        if kind == "text_link" {
            let mut url = String::new();
            if chars.get(k).map(|x| x.1) == Some('(') {
                k += 1;
                while k < chars.len() && chars[k].1 != ')' {
                    url.push(chars[k].1);
                    k += 1;
                }
                k += 1;
            }
            if let (Some(url), true) = (normalize_url(&url), length > 0) {
                let mut e = entity("text_link", start, length);
                e["url"] = json!(url);
                entities.push(e);
            }
        } else if length > 0 {
            entities.push(entity(kind, start, length));
        }
    }
    sort_entities(&mut entities);
    Ok(Formatted {
        text: out,
        entities,
    })
}

/// Entities Telegram adds to user texts: `bot_command` for `/cmd[@bot]` and
/// `mention` for `@username`.
fn auto_entities(text: &str) -> Vec<Value> {
    let chars: Vec<char> = text.chars().collect();
    let mut entities = Vec::new();
    let mut offset16 = 0;
    let mut k = 0;
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    while k < chars.len() {
        let boundary =
            k == 0 || !(word(chars[k - 1]) || chars[k - 1] == '/' || chars[k - 1] == '@');
        let c = chars[k];
        if boundary && (c == '/' || c == '@') {
            let mut j = k + 1;
            while j < chars.len() && word(chars[j]) {
                j += 1;
            }
            let name_len = j - k - 1;
            if c == '/' && (1..=64).contains(&name_len) {
                if j < chars.len() && chars[j] == '@' {
                    let mut m = j + 1;
                    while m < chars.len() && word(chars[m]) {
                        m += 1;
                    }
                    if m - j > 3 {
                        j = m;
                    }
                }
                entities.push(entity("bot_command", offset16, j - k));
            } else if c == '@' && (5..=32).contains(&name_len) {
                entities.push(entity("mention", offset16, j - k));
            }
            if entities
                .last()
                .is_some_and(|e| e["offset"] == json!(offset16))
            {
                offset16 += j - k;
                k = j;
                continue;
            }
        }
        offset16 += c.len_utf16();
        k += 1;
    }
    entities
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    use axum::body::Bytes;
    use axum::http::HeaderMap;
    use axum::routing::post;
    use teloxide::net::Download;
    use teloxide::prelude::*;
    use teloxide::types::{
        BotCommand, ChatAction as TgChatAction, FileId, InlineKeyboardButton, InlineKeyboardMarkup,
        InputFile, MessageEntityKind, MessageId, ParseMode, ReplyParameters, ThreadId, UpdateKind,
    };
    use teloxide::{ApiError, RequestError};

    use super::*;

    const TOKEN: &str = "123456:TEST-token";
    const BOT_ID: i64 = 123456;
    const USER: i64 = 42;
    const GROUP: i64 = -100;

    fn teloxide_bot(fake: &FakeTelegram, token: &str) -> Bot {
        Bot::new(token).set_api_url(reqwest::Url::parse(&fake.url()).unwrap())
    }

    fn impatient_bot(fake: &FakeTelegram, timeout: Duration) -> Bot {
        let client = reqwest::Client::builder().timeout(timeout).build().unwrap();
        Bot::with_client(TOKEN, client).set_api_url(reqwest::Url::parse(&fake.url()).unwrap())
    }

    async fn setup() -> (FakeTelegram, Bot) {
        let fake = FakeTelegram::start().await;
        fake.add_bot(TOKEN, BOT_ID, "switchboard_bot");
        fake.add_user(USER, "Alice", Some("alice"));
        fake.add_chat(USER, "private", "Alice");
        fake.add_chat(GROUP, "group", "Team");
        let bot = teloxide_bot(&fake, TOKEN);
        (fake, bot)
    }

    fn ids(updates: &[Update]) -> Vec<i64> {
        updates.iter().map(|u| i64::from(u.id.0)).collect()
    }

    fn message(update: &Update) -> &Message {
        match &update.kind {
            UpdateKind::Message(m) => m,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    async fn raw_post(fake: &FakeTelegram, token: &str, method: &str, body: Value) -> (u16, Value) {
        let url = format!("{}/bot{token}/{method}", fake.url());
        let resp = reqwest::Client::new()
            .post(url)
            .json(&body)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    #[tokio::test]
    async fn get_me_and_token_checks() {
        let (fake, bot) = setup().await;
        let me = bot.get_me().await.unwrap();
        assert_eq!(me.user.id, UserId(BOT_ID as u64));
        assert!(me.user.is_bot);
        assert_eq!(me.user.username.as_deref(), Some("switchboard_bot"));
        assert!(me.can_join_groups);

        let stranger = teloxide_bot(&fake, "999:unknown");
        let err = stranger.get_me().await.unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::InvalidToken)),
            "{err:?}"
        );

        fake.revoke(TOKEN);
        let err = bot.get_me().await.unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::InvalidToken)),
            "{err:?}"
        );
        assert_eq!(fake.requests("getme").len(), 3);

        // The exact 401 body.
        let (status, body) = raw_post(&fake, TOKEN, "getMe", json!({})).await;
        assert_eq!(status, 401);
        assert_eq!(
            body,
            json!({"ok": false, "error_code": 401, "description": "Unauthorized"})
        );
    }

    #[tokio::test]
    async fn get_updates_redelivers_until_confirmed() {
        let (fake, bot) = setup().await;
        let (u1, m1) = fake.push_message(TOKEN, USER, USER, "hello");
        let (u2, _) = fake.push_message(TOKEN, GROUP, USER, "/start@switchboard_bot now");
        assert!(u2 > u1);

        let first = bot.get_updates().timeout(0).await.unwrap();
        assert_eq!(ids(&first), vec![u1, u2]);
        let hello = message(&first[0]);
        assert_eq!(hello.text(), Some("hello"));
        assert_eq!(i64::from(hello.id.0), m1);
        assert!(hello.chat.is_private());
        assert_eq!(hello.from.as_ref().unwrap().id, UserId(USER as u64));
        let command = message(&first[1]);
        assert!(command.chat.is_group());
        let entity = &command.entities().unwrap()[0];
        assert_eq!(entity.kind, MessageEntityKind::BotCommand);
        assert_eq!(
            (entity.offset, entity.length),
            (0, "/start@switchboard_bot".len())
        );

        // Not confirmed (a crashed client): delivered again.
        let again = bot.get_updates().offset(0).timeout(0).await.unwrap();
        assert_eq!(ids(&again), vec![u1, u2]);

        // Offset u1 + 1 confirms u1 only.
        let rest = bot
            .get_updates()
            .offset(u1 as i32 + 1)
            .timeout(0)
            .await
            .unwrap();
        assert_eq!(ids(&rest), vec![u2]);
        assert_eq!(fake.pending(TOKEN), 1);
        let none = bot
            .get_updates()
            .offset(u2 as i32 + 1)
            .timeout(0)
            .await
            .unwrap();
        assert!(none.is_empty());
        assert_eq!(fake.pending(TOKEN), 0);
        assert_eq!(
            fake.get_updates_calls(TOKEN),
            vec![(0, 0), (0, 0), (u1 + 1, 0), (u2 + 1, 0)]
        );

        // Limit.
        for i in 0..3 {
            fake.push_message(TOKEN, USER, USER, &format!("m{i}"));
        }
        let limited = bot.get_updates().limit(2).timeout(0).await.unwrap();
        assert_eq!(limited.len(), 2);

        // A negative offset keeps only the newest updates (teloxide's
        // drop_pending_updates uses -1).
        let (last, _) = fake.push_message(TOKEN, USER, USER, "newest");
        let newest = bot
            .get_updates()
            .offset(-1)
            .limit(1)
            .timeout(0)
            .await
            .unwrap();
        assert_eq!(ids(&newest), vec![last]);
        assert_eq!(fake.pending(TOKEN), 1);
    }

    #[tokio::test]
    async fn long_poll_waits_and_wakes() {
        let (fake, bot) = setup().await;
        let started = Instant::now();
        let empty = bot.get_updates().timeout(1).await.unwrap();
        assert!(empty.is_empty());
        assert!(
            started.elapsed() >= Duration::from_millis(950),
            "{:?}",
            started.elapsed()
        );

        let poller = tokio::spawn({
            let bot = bot.clone();
            async move { bot.get_updates().timeout(1).await }
        });
        fake.wait_for(Duration::from_secs(2), |f| {
            (f.get_updates_calls(TOKEN).len() == 2).then_some(())
        })
        .await
        .expect("second poll arrived");
        let started = Instant::now();
        let (update_id, _) = fake.push_message(TOKEN, USER, USER, "wake up");
        let got = poller.await.unwrap().unwrap();
        assert_eq!(ids(&got), vec![update_id]);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn overlapping_polls_terminate_the_earlier_one() {
        let (fake, bot) = setup().await;
        let first = tokio::spawn({
            let bot = bot.clone();
            async move { bot.get_updates().timeout(1).await }
        });
        fake.wait_for(Duration::from_secs(2), |f| {
            (f.get_updates_calls(TOKEN).len() == 1).then_some(())
        })
        .await
        .expect("first poll arrived");
        let second = bot.get_updates().timeout(0).await.unwrap();
        assert!(second.is_empty());
        let err = first.await.unwrap().unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::Api(ApiError::TerminatedByOtherGetUpdates)
            ),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn send_message_html_reply_and_thread() {
        let (fake, bot) = setup().await;
        let html = r#"<b>Hi</b> &lt;you&gt; &amp; <a href="https://example.com/x">link</a>"#;
        let msg = bot
            .send_message(ChatId(GROUP), html)
            .parse_mode(ParseMode::Html)
            .await
            .unwrap();
        assert_eq!(msg.text(), Some("Hi <you> & link"));
        assert!(msg.chat.is_group());
        assert_eq!(msg.chat.title(), Some("Team"));
        assert_eq!(msg.from.as_ref().unwrap().id, UserId(BOT_ID as u64));
        let entities = msg.entities().unwrap();
        assert_eq!(entities[0].kind, MessageEntityKind::Bold);
        assert_eq!((entities[0].offset, entities[0].length), (0, 2));
        assert!(
            matches!(&entities[1].kind, MessageEntityKind::TextLink { url } if url.as_str() == "https://example.com/x")
        );
        assert_eq!((entities[1].offset, entities[1].length), (11, 4));

        let reply = bot
            .send_message(ChatId(GROUP), "second")
            .reply_parameters(ReplyParameters::new(msg.id))
            .message_thread_id(ThreadId(MessageId(7)))
            .await
            .unwrap();
        assert_eq!(reply.id.0, msg.id.0 + 1);
        assert_eq!(reply.reply_to_message().unwrap().id, msg.id);
        assert_eq!(reply.thread_id, Some(ThreadId(MessageId(7))));

        let sent = fake.sent(GROUP);
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0].text, html);
        assert_eq!(sent[0].visible_text, "Hi <you> & link");
        assert_eq!(sent[0].parse_mode.as_deref(), Some("HTML"));
        assert_eq!(sent[0].message_id, i64::from(msg.id.0));
        assert_eq!(sent[1].thread_id, Some(7));
        assert_eq!(
            sent[1].reply_parameters.as_ref().unwrap()["message_id"],
            json!(msg.id.0)
        );
        assert_eq!(sent[1].body["chat_id"], json!(GROUP));
        assert!(fake.sent(USER).is_empty());

        // Replying to a message that does not exist.
        let err = bot
            .send_message(ChatId(GROUP), "x")
            .reply_parameters(ReplyParameters::new(MessageId(999)))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageToReplyNotFound)),
            "{err:?}"
        );

        // Unknown chat.
        let err = bot.send_message(ChatId(777), "x").await.unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::ChatNotFound)),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn html_errors_are_cant_parse_entities() {
        let (fake, bot) = setup().await;
        let cases = [
            (
                "<foo>x</foo>",
                "Unsupported start tag \"foo\" at byte offset 0",
            ),
            ("1 < 2", "Unsupported start tag \"\" at byte offset 2"),
            ("line<br>break", "Unsupported start tag \"br\""),
            ("fish & chips", "byte offset 5"),
            (
                "<b>bold",
                "Can't find end tag corresponding to start tag \"b\"",
            ),
            (
                "<b>x</i>",
                "Unmatched end tag at byte offset 4, expected \"</b>\", found \"</i>\"",
            ),
            ("x</b>", "Unexpected end tag at byte offset 1"),
            (
                "<span>x</span>",
                "Tag \"span\" must have class \"tg-spoiler\"",
            ),
        ];
        for (text, reason) in cases {
            let err = bot
                .send_message(ChatId(USER), text)
                .parse_mode(ParseMode::Html)
                .await
                .unwrap_err();
            match err {
                RequestError::Api(ApiError::CantParseEntities(description)) => {
                    assert!(
                        description.starts_with("Bad Request: can't parse entities: "),
                        "{description}"
                    );
                    assert!(description.contains(reason), "{text:?}: {description}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        // Valid HTML with every supported tag passes.
        let ok = "<b>b</b><strong>s</strong><i>i</i><em>e</em><u>u</u><ins>n</ins><s>s</s><strike>k</strike>\
                  <del>d</del><tg-spoiler>t</tg-spoiler><span class=\"tg-spoiler\">p</span><code>c</code>\
                  <pre><code class=\"language-rust\">fn</code></pre><blockquote expandable>q</blockquote>\
                  <tg-emoji emoji-id=\"5368324170671202286\">👍</tg-emoji>&#65;&#x42;&quot;";
        let msg = bot
            .send_message(ChatId(USER), ok)
            .parse_mode(ParseMode::Html)
            .await
            .unwrap();
        assert_eq!(msg.text(), Some("bsieunskdtpcfnq👍AB\""));
        let pre = msg
            .entities()
            .unwrap()
            .iter()
            .find(|e| matches!(e.kind, MessageEntityKind::Pre { .. }))
            .unwrap();
        assert_eq!(
            pre.kind,
            MessageEntityKind::Pre {
                language: Some("rust".into())
            }
        );
        assert_eq!(fake.sent(USER).len(), 1, "failed sends are not recorded");
    }

    #[tokio::test]
    async fn text_length_counts_utf16_after_parsing() {
        let (fake, bot) = setup().await;
        let chat = ChatId(USER);
        let too_long = |r: Result<Message, RequestError>| {
            matches!(r, Err(RequestError::Api(ApiError::MessageIsTooLong)))
        };
        assert!(bot.send_message(chat, "a".repeat(4096)).await.is_ok());
        assert!(too_long(bot.send_message(chat, "a".repeat(4097)).await));
        // 4096 visible characters from 16384 bytes of HTML.
        let html = "&lt;".repeat(4096);
        assert!(
            bot.send_message(chat, html)
                .parse_mode(ParseMode::Html)
                .await
                .is_ok()
        );
        let html = format!("<b>{}</b>", "x".repeat(4096));
        assert!(
            bot.send_message(chat, html)
                .parse_mode(ParseMode::Html)
                .await
                .is_ok()
        );
        assert!(too_long(
            bot.send_message(chat, "&lt;".repeat(4097))
                .parse_mode(ParseMode::Html)
                .await
        ));
        // Astral characters count twice.
        assert!(bot.send_message(chat, "😀".repeat(2048)).await.is_ok());
        assert!(too_long(bot.send_message(chat, "😀".repeat(2049)).await));
        // Empty after parsing.
        let err = bot
            .send_message(chat, "<b></b>")
            .parse_mode(ParseMode::Html)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageTextIsEmpty)),
            "{err:?}"
        );
        assert_eq!(fake.sent(USER).len(), 4);
    }

    #[tokio::test]
    async fn markdown_v2_reserved_characters() {
        let (_fake, bot) = setup().await;
        let msg = bot
            .send_message(ChatId(USER), "*bold* and _it_ end\\.")
            .parse_mode(ParseMode::MarkdownV2)
            .await
            .unwrap();
        assert_eq!(msg.text(), Some("bold and it end."));
        assert_eq!(msg.entities().unwrap().len(), 2);
        let err = bot
            .send_message(ChatId(USER), "end.")
            .parse_mode(ParseMode::MarkdownV2)
            .await
            .unwrap_err();
        match err {
            RequestError::Api(ApiError::CantParseEntities(d)) => {
                assert!(
                    d.contains(
                        "Character '.' is reserved and must be escaped with the preceding '\\'"
                    ),
                    "{d}"
                )
            }
            other => panic!("{other:?}"),
        }
        let err = bot
            .send_message(ChatId(USER), "*open")
            .parse_mode(ParseMode::MarkdownV2)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, RequestError::Api(ApiError::CantParseEntities(d)) if d.contains("Can't find end of Bold entity at byte offset 0")),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn edit_message_text() {
        let (fake, bot) = setup().await;
        let chat = ChatId(USER);
        let msg = bot.send_message(chat, "draft").await.unwrap();
        let edited = bot
            .edit_message_text(chat, msg.id, "<i>final</i>")
            .parse_mode(ParseMode::Html)
            .await
            .unwrap();
        assert_eq!(edited.text(), Some("final"));
        assert_eq!(edited.id, msg.id);
        assert!(edited.edit_date().is_some());
        let sent = fake.sent(USER);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].text, "<i>final</i>");
        assert_eq!(sent[0].visible_text, "final");
        assert_eq!(sent[0].edit_count, 1);
        assert_eq!(fake.edits().len(), 1);
        assert_eq!(fake.edits()[0].text, "<i>final</i>");

        let err = bot
            .edit_message_text(chat, msg.id, "<i>final</i>")
            .parse_mode(ParseMode::Html)
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageNotModified)),
            "{err:?}"
        );
        // Same visible text but different formatting is a modification.
        bot.edit_message_text(chat, msg.id, "final").await.unwrap();
        assert_eq!(fake.edits().len(), 2);

        let err = bot
            .edit_message_text(chat, MessageId(999), "x")
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageToEditNotFound)),
            "{err:?}"
        );
        let (_, user_msg) = fake.push_message(TOKEN, USER, USER, "mine");
        let err = bot
            .edit_message_text(chat, MessageId(user_msg as i32), "x")
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageCantBeEdited)),
            "{err:?}"
        );
        let err = bot
            .edit_message_text(chat, msg.id, "y".repeat(4097))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::EditedMessageIsTooLong)),
            "{err:?}"
        );

        bot.delete_message(chat, msg.id).await.unwrap();
        assert!(fake.sent(USER)[0].deleted);
        let err = bot.delete_message(chat, msg.id).await.unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageToDeleteNotFound)),
            "{err:?}"
        );
        let err = bot
            .edit_message_text(chat, msg.id, "gone")
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::MessageToEditNotFound)),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn injected_errors() {
        let (fake, bot) = setup().await;
        fake.fail_next(TOKEN, "sendMessage", Fault::RetryAfter(7));
        let err = bot.send_message(ChatId(USER), "hi").await.unwrap_err();
        assert!(
            matches!(err, RequestError::RetryAfter(s) if s.seconds() == 7),
            "{err:?}"
        );
        let body = fake.requests("sendMessage");
        assert_eq!(body.len(), 1, "the failed request is recorded");
        assert!(fake.sent(USER).is_empty(), "no side effect");
        bot.send_message(ChatId(USER), "hi").await.unwrap();
        assert_eq!(fake.sent(USER).len(), 1);

        // The raw 429 body.
        fake.fail_next(TOKEN, "sendMessage", Fault::RetryAfter(3));
        let (status, body) = raw_post(
            &fake,
            TOKEN,
            "sendMessage",
            json!({"chat_id": USER, "text": "x"}),
        )
        .await;
        assert_eq!(status, 429);
        assert_eq!(
            body,
            json!({"ok": false, "error_code": 429, "description": "Too Many Requests: retry after 3", "parameters": {"retry_after": 3}})
        );

        fake.fail_next_n(
            TOKEN,
            "sendmessage",
            2,
            Fault::Status(403, "Forbidden: bot was blocked by the user".into()),
        );
        for _ in 0..2 {
            let err = bot.send_message(ChatId(USER), "hi").await.unwrap_err();
            assert!(
                matches!(err, RequestError::Api(ApiError::BotBlocked)),
                "{err:?}"
            );
        }
        fake.fail_next(TOKEN, "getMe", Fault::Raw(200, "not json".into()));
        let err = bot.get_me().await.unwrap_err();
        assert!(matches!(err, RequestError::InvalidJson { .. }), "{err:?}");
        // Faults are per token and method: other methods are unaffected.
        fake.fail_next(TOKEN, "getMe", Fault::Close);
        bot.send_message(ChatId(USER), "still fine").await.unwrap();
        assert_eq!(fake.sent(USER).len(), 2);
    }

    #[tokio::test]
    async fn close_and_hang_faults() {
        let (fake, bot) = setup().await;
        fake.fail_next(TOKEN, "sendMessage", Fault::Close);
        let err = bot.send_message(ChatId(USER), "a").await.unwrap_err();
        assert!(matches!(err, RequestError::Network(_)), "{err:?}");
        assert!(fake.sent(USER).is_empty());

        // The effect happens, but the answer comes after the client gave up.
        let impatient = impatient_bot(&fake, Duration::from_millis(300));
        fake.fail_next(
            TOKEN,
            "sendMessage",
            Fault::HangAfterEffect(Duration::from_secs(2)),
        );
        let err = impatient.send_message(ChatId(USER), "b").await.unwrap_err();
        assert!(
            matches!(&err, RequestError::Network(e) if e.is_timeout()),
            "{err:?}"
        );
        assert_eq!(
            fake.sent(USER)
                .iter()
                .map(|s| s.text.as_str())
                .collect::<Vec<_>>(),
            ["b"]
        );

        // No effect, ever.
        fake.fail_next(
            TOKEN,
            "sendMessage",
            Fault::HangBeforeEffect(Duration::from_millis(500)),
        );
        let err = impatient.send_message(ChatId(USER), "c").await.unwrap_err();
        assert!(
            matches!(&err, RequestError::Network(e) if e.is_timeout()),
            "{err:?}"
        );
        fake.fail_next(
            TOKEN,
            "sendMessage",
            Fault::HangBeforeEffect(Duration::from_millis(100)),
        );
        let err = bot.send_message(ChatId(USER), "d").await.unwrap_err();
        assert!(matches!(err, RequestError::Network(_)), "{err:?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(fake.sent(USER).len(), 1);

        // A slow but successful answer.
        fake.fail_next(
            TOKEN,
            "sendMessage",
            Fault::Hang(Duration::from_millis(300)),
        );
        let started = Instant::now();
        let msg = bot.send_message(ChatId(USER), "e").await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(msg.text(), Some("e"));
        assert_eq!(fake.sent(USER).len(), 2);
    }

    #[tokio::test]
    async fn migration() {
        let (fake, bot) = setup().await;
        let new_id = -1_001_234_567_890;
        fake.migrate_chat(GROUP, new_id);
        let err = bot.send_message(ChatId(GROUP), "hi").await.unwrap_err();
        assert!(
            matches!(err, RequestError::MigrateToChatId(ChatId(id)) if id == new_id),
            "{err:?}"
        );
        let (status, body) = raw_post(
            &fake,
            TOKEN,
            "sendMessage",
            json!({"chat_id": GROUP, "text": "x"}),
        )
        .await;
        assert_eq!(status, 400);
        assert_eq!(body["description"], DESC_UPGRADED);
        assert_eq!(body["parameters"], json!({"migrate_to_chat_id": new_id}));
        let msg = bot.send_message(ChatId(new_id), "hi").await.unwrap();
        assert!(msg.chat.is_supergroup());
        assert_eq!(msg.chat.title(), Some("Team"));

        let other_new = -1_009_999;
        let update_id = fake.push_migration(TOKEN, -200, other_new);
        let updates = bot.get_updates().timeout(0).await.unwrap();
        assert_eq!(ids(&updates), vec![update_id]);
        assert_eq!(
            message(&updates[0]).migrate_to_chat_id(),
            Some(&ChatId(other_new))
        );
        let err = bot.send_message(ChatId(-200), "x").await.unwrap_err();
        assert!(
            matches!(err, RequestError::MigrateToChatId(ChatId(id)) if id == other_new),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn webhook_conflicts_with_get_updates() {
        let (fake, bot) = setup().await;
        // A long poll in progress ends when a webhook is set.
        let poll = tokio::spawn({
            let bot = bot.clone();
            async move { bot.get_updates().timeout(1).await }
        });
        fake.wait_for(Duration::from_secs(2), |f| {
            (f.get_updates_calls(TOKEN).len() == 1).then_some(())
        })
        .await
        .expect("poll arrived");
        let url = reqwest::Url::parse("http://127.0.0.1:9/hook").unwrap();
        bot.set_webhook(url).secret_token("s3cr3t").await.unwrap();
        let err = poll.await.unwrap().unwrap_err();
        assert!(
            matches!(&err, RequestError::Api(ApiError::Unknown(d)) if d == DESC_WEBHOOK_CONFLICT),
            "{err:?}"
        );
        assert_eq!(
            fake.webhook(TOKEN),
            Some(("http://127.0.0.1:9/hook".into(), Some("s3cr3t".into())))
        );
        // teloxide sends setWebhook as multipart: fields arrive as strings.
        assert_eq!(fake.requests("setWebhook")[0]["secret_token"], "s3cr3t");
        let info = bot.get_webhook_info().await.unwrap();
        assert_eq!(info.url.unwrap().as_str(), "http://127.0.0.1:9/hook");

        let err = bot.get_updates().await.unwrap_err();
        match err {
            // teloxide only knows a different wording, so Telegram's real text is `Unknown`.
            RequestError::Api(ApiError::Unknown(description)) => {
                assert_eq!(description, DESC_WEBHOOK_CONFLICT)
            }
            other => panic!("{other:?}"),
        }
        let (status, _) = raw_post(&fake, TOKEN, "getUpdates", json!({})).await;
        assert_eq!(status, 409);

        let err = bot
            .set_webhook(reqwest::Url::parse("http://127.0.0.1:9/x").unwrap())
            .secret_token("bad secret!")
            .await;
        assert!(err.is_err());

        bot.delete_webhook().await.unwrap();
        assert_eq!(fake.webhook(TOKEN), None);
        assert!(bot.get_webhook_info().await.unwrap().url.is_none());
        assert!(bot.get_updates().timeout(0).await.unwrap().is_empty());
    }

    #[derive(Default)]
    struct Receiver {
        hits: Mutex<Vec<(Option<String>, Value)>>,
        fail_first: AtomicBool,
        fail_all: AtomicBool,
    }

    async fn start_receiver() -> (Arc<Receiver>, String) {
        async fn hook(
            State(rx): State<Arc<Receiver>>,
            headers: HeaderMap,
            body: Bytes,
        ) -> StatusCode {
            let secret = headers
                .get("x-telegram-bot-api-secret-token")
                .map(|v| v.to_str().unwrap().to_owned());
            rx.hits
                .lock()
                .unwrap()
                .push((secret, serde_json::from_slice(&body).unwrap()));
            if rx.fail_all.load(Ordering::SeqCst) || rx.fail_first.swap(false, Ordering::SeqCst) {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::OK
            }
        }
        let rx = Arc::new(Receiver::default());
        let app = Router::new()
            .route("/hook", post(hook))
            .with_state(rx.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (rx, url)
    }

    #[tokio::test]
    async fn webhook_push_with_secret_and_retries() {
        let (fake, bot) = setup().await;
        let (rx, hook_url) = start_receiver().await;
        fake.set_webhook_retry(WebhookRetry {
            attempts: 3,
            delay: Duration::from_millis(50),
            timeout: Duration::from_secs(2),
        });
        let (queued_before, _) = fake.push_message(TOKEN, USER, USER, "queued before the webhook");
        let (status, body) = raw_post(
            &fake,
            TOKEN,
            "setWebhook",
            json!({"url": hook_url, "secret_token": "hook-secret", "drop_pending_updates": true}),
        )
        .await;
        assert_eq!((status, body), (200, json!({"ok": true, "result": true})));
        assert_eq!(
            fake.pending(TOKEN),
            0,
            "drop_pending_updates dropped update {queued_before}"
        );

        rx.fail_first.store(true, Ordering::SeqCst);
        let (update_id, _) = fake.push_message(TOKEN, USER, USER, "via webhook");
        let attempts = fake
            .wait_for(Duration::from_secs(3), |f| {
                Some(f.push_attempts()).filter(|a| a.iter().any(|p| p.status == Some(200)))
            })
            .await
            .expect("delivered");
        let summary: Vec<_> = attempts
            .iter()
            .map(|a| (a.update_id, a.attempt, a.status))
            .collect();
        assert_eq!(
            summary,
            vec![(update_id, 1, Some(500)), (update_id, 2, Some(200))]
        );
        assert!(
            attempts
                .iter()
                .all(|a| a.secret.as_deref() == Some("hook-secret") && a.url == hook_url)
        );
        {
            let hits = rx.hits.lock().unwrap();
            assert_eq!(hits.len(), 2);
            assert_eq!(hits[1].0.as_deref(), Some("hook-secret"));
            assert_eq!(hits[1].1["update_id"], json!(update_id));
            assert_eq!(hits[1].1["message"]["text"], "via webhook");
            let update: Update = serde_json::from_str(&hits[1].1.to_string()).unwrap();
            assert_eq!(message(&update).text(), Some("via webhook"));
        }
        fake.wait_for(Duration::from_secs(1), |f| {
            (f.pending(TOKEN) == 0).then_some(())
        })
        .await
        .expect("confirmed");

        // A receiver that keeps failing: the update is dropped after the last attempt.
        rx.fail_all.store(true, Ordering::SeqCst);
        let (failing, _) = fake.push_message(TOKEN, USER, USER, "lost");
        fake.wait_for(Duration::from_secs(3), |f| {
            (f.push_attempts()
                .iter()
                .filter(|a| a.update_id == failing)
                .count()
                == 3
                && f.pending(TOKEN) == 0)
                .then_some(())
        })
        .await
        .expect("three attempts, then dropped");
        let info = bot.get_webhook_info().await.unwrap();
        assert_eq!(
            info.last_error_message.as_deref(),
            Some("Wrong response from the webhook: 500")
        );
        assert_eq!(rx.hits.lock().unwrap().len(), 5);

        // Without a secret no header is sent.
        rx.fail_all.store(false, Ordering::SeqCst);
        bot.set_webhook(reqwest::Url::parse(&hook_url).unwrap())
            .await
            .unwrap();
        fake.push_message(TOKEN, USER, USER, "no secret");
        fake.wait_for(Duration::from_secs(3), |_| {
            (rx.hits.lock().unwrap().len() == 6).then_some(())
        })
        .await
        .expect("delivered");
        assert_eq!(rx.hits.lock().unwrap()[5].0, None);
    }

    #[tokio::test]
    async fn commands_actions_callbacks() {
        let (fake, bot) = setup().await;
        let commands = vec![
            BotCommand::new("new", "Start a new conversation"),
            BotCommand::new("stop", "Stop the run"),
        ];
        bot.set_my_commands(commands.clone()).await.unwrap();
        assert_eq!(bot.get_my_commands().await.unwrap(), commands);
        assert_eq!(
            fake.commands(TOKEN),
            vec![
                ("new".to_owned(), "Start a new conversation".to_owned()),
                ("stop".to_owned(), "Stop the run".to_owned())
            ]
        );
        let err = bot
            .set_my_commands([BotCommand::new("Bad-Name", "x")])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, RequestError::Api(ApiError::Unknown(d)) if d == "Bad Request: BOT_COMMAND_INVALID"),
            "{err:?}"
        );

        bot.send_chat_action(ChatId(USER), TgChatAction::Typing)
            .await
            .unwrap();
        assert_eq!(
            fake.chat_actions(),
            vec![ChatAction {
                token: TOKEN.into(),
                chat_id: USER,
                action: "typing".into(),
                thread_id: None
            }]
        );

        let keyboard = InlineKeyboardMarkup::new([[InlineKeyboardButton::callback("Yes", "yes")]]);
        let msg = bot
            .send_message(ChatId(USER), "pick")
            .reply_markup(keyboard)
            .await
            .unwrap();
        assert!(msg.reply_markup().is_some());
        let update_id = fake.push_callback_query(TOKEN, USER, USER, "yes", i64::from(msg.id.0));
        let updates = bot.get_updates().timeout(0).await.unwrap();
        assert_eq!(ids(&updates), vec![update_id]);
        let UpdateKind::CallbackQuery(query) = &updates[0].kind else {
            panic!("{:?}", updates[0].kind)
        };
        assert_eq!(query.data.as_deref(), Some("yes"));
        assert_eq!(query.from.id, UserId(USER as u64));
        let pressed = query.message.as_ref().unwrap().regular_message().unwrap();
        assert_eq!(pressed.id, msg.id);
        assert_eq!(pressed.text(), Some("pick"));

        bot.answer_callback_query(query.id.clone())
            .text("Done")
            .await
            .unwrap();
        let answers = fake.callback_answers();
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].callback_query_id, format!("cbq-{update_id}"));
        assert_eq!(answers[0].text.as_deref(), Some("Done"));
        assert_eq!(answers[0].data.as_deref(), Some("yes"));
        let err = bot
            .answer_callback_query(query.id.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::InvalidQueryId)),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn files_and_media() {
        let (fake, bot) = setup().await;
        fake.add_file("file-abc", b"hello file".to_vec());
        let file = bot.get_file(FileId("file-abc".into())).await.unwrap();
        assert_eq!(file.meta.size, 10);
        assert!(
            file.path.contains('/'),
            "teloxide percent-encodes the slash: {}",
            file.path
        );
        let mut downloaded = Vec::new();
        bot.download_file(&file.path, &mut downloaded)
            .await
            .unwrap();
        assert_eq!(downloaded, b"hello file");
        let err = bot.get_file(FileId("nope".into())).await.unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::FileIdInvalid)),
            "{err:?}"
        );

        // sendPhoto by file id (teloxide sends multipart).
        let msg = bot
            .send_photo(ChatId(USER), InputFile::file_id(FileId("file-abc".into())))
            .caption("<b>look</b>")
            .parse_mode(ParseMode::Html)
            .await
            .unwrap();
        assert_eq!(msg.photo().unwrap()[0].file.id, FileId("file-abc".into()));
        assert_eq!(msg.caption(), Some("look"));
        assert_eq!(fake.requests("sendPhoto")[0]["photo"], "file-abc");
        assert_eq!(fake.requests("sendPhoto")[0]["chat_id"], USER.to_string());

        // sendDocument by URL and by upload.
        let url = reqwest::Url::parse("https://example.com/report.pdf").unwrap();
        let doc = bot
            .send_document(ChatId(USER), InputFile::url(url))
            .await
            .unwrap();
        assert!(doc.document().is_some());
        let upload = InputFile::memory(b"uploaded bytes".to_vec()).file_name("notes.txt");
        let doc = bot.send_document(ChatId(USER), upload).await.unwrap();
        let document = doc.document().unwrap();
        assert_eq!(document.file_name.as_deref(), Some("notes.txt"));
        let file = bot.get_file(document.file.id.clone()).await.unwrap();
        let mut downloaded = Vec::new();
        bot.download_file(&file.path, &mut downloaded)
            .await
            .unwrap();
        assert_eq!(downloaded, b"uploaded bytes");

        let sent = fake.sent(USER);
        assert_eq!(
            sent.iter().map(|s| s.method.as_str()).collect::<Vec<_>>(),
            ["sendPhoto", "sendDocument", "sendDocument"]
        );
        assert_eq!(sent[0].text, "<b>look</b>");
        assert_eq!(sent[0].media.as_deref(), Some("file-abc"));

        let err = bot
            .send_photo(ChatId(USER), InputFile::file_id(FileId("unknown".into())))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::Api(ApiError::WrongFileIdOrUrl)),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn pushed_update_kinds_parse_in_teloxide() {
        let (fake, bot) = setup().await;
        fake.add_chat(-1_005, "forum", "Forum");
        fake.add_file("ph", vec![0; 5]);
        let question = bot.send_message(ChatId(-1_005), "question").await.unwrap();
        let (_, reply_id) = fake.push_message_with(
            TOKEN,
            -1_005,
            USER,
            "@switchboard_bot answer",
            MessageOpts::default()
                .reply_to(i64::from(question.id.0))
                .thread(7),
        );
        fake.push_edited_message(TOKEN, -1_005, reply_id, "edited answer");
        fake.push_photo(TOKEN, USER, USER, "ph", Some("a photo"));
        fake.push_document(TOKEN, USER, USER, "ph", "doc.bin", None);
        fake.push_voice(TOKEN, USER, USER, "ph", 3);
        fake.push_sticker(TOKEN, USER, USER, "ph", "👍");
        fake.push_message_with(TOKEN, GROUP, 77, "beep", MessageOpts::default().from_bot());
        let pending_before = fake.pending(TOKEN);
        fake.push_raw(TOKEN, json!({"chat_member": {"x": 1}}));
        assert_eq!(
            fake.pending(TOKEN),
            pending_before,
            "chat_member is not delivered by default"
        );
        let raw_id = fake.push_raw(TOKEN, json!({"some_future_kind": {"x": 1}}));

        let updates = bot.get_updates().timeout(0).await.unwrap();
        assert_eq!(updates.len(), 8);
        let reply = message(&updates[0]);
        assert_eq!(reply.thread_id, Some(ThreadId(MessageId(7))));
        assert!(reply.is_topic_message);
        assert!(reply.chat.is_supergroup());
        let replied = reply.reply_to_message().unwrap();
        assert_eq!(replied.from.as_ref().unwrap().id, UserId(BOT_ID as u64));
        let mention = &reply.entities().unwrap()[0];
        assert_eq!(
            (mention.kind.clone(), mention.offset, mention.length),
            (MessageEntityKind::Mention, 0, 16)
        );
        let UpdateKind::EditedMessage(edited) = &updates[1].kind else {
            panic!("{:?}", updates[1].kind)
        };
        assert_eq!(edited.text(), Some("edited answer"));
        assert!(edited.edit_date().is_some());
        let photo = message(&updates[2]);
        assert_eq!(photo.photo().unwrap()[0].file.size, 5);
        assert_eq!(photo.caption(), Some("a photo"));
        assert_eq!(
            message(&updates[3])
                .document()
                .unwrap()
                .file_name
                .as_deref(),
            Some("doc.bin")
        );
        assert_eq!(message(&updates[4]).voice().unwrap().duration.seconds(), 3);
        assert_eq!(
            message(&updates[5]).sticker().unwrap().emoji.as_deref(),
            Some("👍")
        );
        assert!(message(&updates[6]).from.as_ref().unwrap().is_bot);
        assert!(
            matches!(&updates[7].kind, UpdateKind::Error(v) if v["some_future_kind"]["x"] == 1)
        );
        assert_eq!(i64::from(updates[7].id.0), raw_id);
    }

    #[tokio::test]
    async fn drafts_forms_and_unknown_methods() {
        let (fake, _bot) = setup().await;
        let (status, body) = raw_post(
            &fake,
            TOKEN,
            "sendMessageDraft",
            json!({"chat_id": USER, "draft_id": 5, "text": "<b>Thinking</b>…", "parse_mode": "HTML", "message_thread_id": 3}),
        )
        .await;
        assert_eq!((status, body), (200, json!({"ok": true, "result": true})));
        let drafts = fake.drafts();
        assert_eq!(drafts.len(), 1);
        assert_eq!(
            (drafts[0].draft_id, drafts[0].visible_text.as_str()),
            (5, "Thinking…")
        );
        assert_eq!(drafts[0].thread_id, Some(3));
        let (status, body) = raw_post(
            &fake,
            TOKEN,
            "sendMessageDraft",
            json!({"chat_id": USER, "draft_id": 5, "text": "x".repeat(4097)}),
        )
        .await;
        assert_eq!(status, 400);
        assert_eq!(body["description"], DESC_TOO_LONG);
        assert_eq!(fake.drafts().len(), 1);

        let client = reqwest::Client::new();
        let resp = client
            .post(format!("{}/bot{TOKEN}/sendMessage", fake.url()))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("chat_id=42&text=hello+world%21")
            .send()
            .await
            .unwrap();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["result"]["text"], "hello world!");
        let resp = client
            .get(format!("{}/bot{TOKEN}/getMe", fake.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);

        let (status, body) = raw_post(&fake, TOKEN, "frobnicate", json!({})).await;
        assert_eq!(status, 404);
        assert_eq!(
            body,
            json!({"ok": false, "error_code": 404, "description": "Not Found: method not found"})
        );
    }
}
