//! The Discord channel end to end: a real `switchboard run` process on the
//! loopback fake Discord in `tests/fakes` (REST under `/api/v10` and the
//! gateway over WebSocket, checked against serenity 0.12.5). One test per
//! scope bullet of the Discord issue; the crash test kills the real process.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, DaemonConfig, eventually, open_store};
use serde_json::Value;
use switchboard::store::{Disposition, InboundRow, SharedStore};
use switchboard_fakes::discord::{FakeAttachment, FakeDiscord, Fault, UserMessage};

/// base64("600000000000000001") . timestamp . hmac
const TOKEN: &str = "NjAwMDAwMDAwMDAwMDAwMDAx.GfAkE1.test-secret";
const BOT: u64 = 600_000_000_000_000_001;
/// A second bot whose token Discord does not know.
const TOKEN2: &str = "NjAwMDAwMDAwMDAwMDAwMDAy.GfAkE2.revoked";
const USER: u64 = 900_001;
const USER2: u64 = 900_002;
const DM: u64 = 700_001;
const DM2: u64 = 700_002;
const GUILD: u64 = 800_000_000_000_000_001;
const TEXT: u64 = 810_001;
const THREAD: u64 = 810_002;
const OTHER_TEXT: u64 = 810_003;
const WAIT: Duration = Duration::from_secs(20);

struct Bot {
    dir: tempfile::TempDir,
    fake: FakeDiscord,
    daemon: Daemon,
    store: SharedStore,
}

struct Setup {
    channel: String,
    access: String,
    extra: String,
    token_delay_ms: u64,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            channel: String::new(),
            access: format!("dm_policy = \"open\"\ngroups = [\"{TEXT}\"]"),
            extra: String::new(),
            token_delay_ms: 0,
        }
    }
}

async fn world() -> FakeDiscord {
    let fake = FakeDiscord::start().await;
    fake.add_bot(TOKEN, BOT, BOT, "switchbot");
    fake.add_user(USER, "ann");
    fake.add_user(USER2, "bob");
    fake.add_dm_channel(DM, USER);
    fake.add_dm_channel(DM2, USER2);
    fake.add_guild(GUILD, "Guild");
    fake.add_guild_channel(GUILD, TEXT, "general");
    fake.add_guild_channel(GUILD, OTHER_TEXT, "random");
    fake.add_thread(GUILD, TEXT, THREAD);
    fake
}

impl Bot {
    async fn start(setup: Setup) -> Bot {
        Self::start_on(world().await, setup).await
    }

    async fn start_on(fake: FakeDiscord, setup: Setup) -> Bot {
        let dir = tempfile::tempdir().unwrap();
        let mut config = DaemonConfig::new("http://127.0.0.1:9/unused".into());
        config.token_delay_ms = setup.token_delay_ms;
        config.extra = format!(
            r#"
[channels.dc]
kind = "discord"
runtime = "default"
token = "{TOKEN}"
api_url = "{url}"
request_timeout_secs = 3
{channel}

[channels.dc.access]
{access}

{extra}
"#,
            url = fake.url(),
            channel = setup.channel,
            access = setup.access,
            extra = setup.extra.replace("{api}", &fake.url()),
        );
        let daemon = Daemon::start(dir.path(), &config).await;
        let store = open_store(dir.path()).await;
        Bot {
            dir,
            fake,
            daemon,
            store,
        }
    }

    async fn readyz(&self) -> (u16, Value) {
        let r = reqwest::get(format!("http://{}/readyz", self.daemon.admin))
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    async fn wait_state(&self, account: &str, state: &str) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let (_, body) = self.readyz().await;
            if body["channels"][account]["state"] == state {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "{account} never became {state}: {body}\n{}",
                self.daemon.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn row(&self, what: &str, pred: impl Fn(&InboundRow) -> bool) -> InboundRow {
        let deadline = Instant::now() + WAIT;
        loop {
            let rows = self.store.journal_list(None, 1000).await.unwrap();
            if let Some(row) = rows
                .into_iter()
                .find(|r| r.disposition != Disposition::Pending && pred(r))
            {
                return row;
            }
            assert!(
                Instant::now() < deadline,
                "{what} was never settled\n{}",
                self.daemon.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn settled(&self, key: &str) -> InboundRow {
        self.row(key, |r| r.update_key == key).await
    }

    /// The bot's messages in `channel` that reply to `to`, once one shows
    /// `want`.
    async fn answers(&self, channel: u64, to: u64, want: &str) -> Vec<Value> {
        let mut found = Vec::new();
        let ok = self
            .fake
            .wait_until(WAIT, |f| {
                found = replies(f, channel, to);
                found.iter().any(|m| m["content"] == want)
            })
            .await;
        assert!(
            ok,
            "no answer {want:?} to {to} in {channel}: {:#?}\n{}",
            self.fake.history(channel),
            self.daemon.logs()
        );
        found
    }
}

fn replies(fake: &FakeDiscord, channel: u64, to: u64) -> Vec<Value> {
    fake.history(channel)
        .into_iter()
        .filter(|m| {
            let id = |v: &Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
            id(&m["author"]["id"]) == Some(BOT)
                && id(&m["message_reference"]["message_id"]) == Some(to)
        })
        .collect()
}

const TERMINAL_DM: &str = "[surfaces.\"discord.dm\"]\ndelivery = \"terminal-only\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dms_are_answered_with_nonces_references_and_streaming_edits() {
    let bot = Bot::start(Setup {
        token_delay_ms: 40,
        ..Setup::default()
    })
    .await;
    let ready = bot.wait_state("dc", "up").await;
    assert!(
        ready["channels"]["dc"]["detail"]
            .as_str()
            .unwrap()
            .contains("gateway as switchbot"),
        "{ready}"
    );
    let identify = &bot.fake.identifies()[0];
    assert_ne!(identify.intents & (1 << 15), 0, "message content requested");

    let text = "one two three four five six seven eight";
    let msg = bot.fake.push_message(DM, USER, text);
    let answers = bot.answers(DM, msg, &format!("echo: {text}")).await;
    assert_eq!(answers.len(), 1, "one message, edited into the answer");
    let created = bot.fake.created_messages(DM);
    assert_eq!(created.len(), 1);
    assert!(created[0].enforce_nonce);
    assert_eq!(created[0].nonce.as_deref().map(str::len), Some(25));
    assert!(!bot.fake.edits().is_empty(), "the preview was edited");
    let row = bot.settled(&msg.to_string()).await;
    assert_eq!(row.disposition, Disposition::Admitted);
    assert_eq!(row.chat_kind, switchboard_channel::ChatKind::Private);

    // The text command forms.
    let stop = bot.fake.push_message(DM, USER, "!help");
    assert_eq!(
        bot.settled(&stop.to_string()).await.disposition,
        Disposition::Command
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guild_channels_threads_mentions_bots_edits_and_attachments() {
    let bot = Bot::start(Setup {
        extra: TERMINAL_DM.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;

    // Mention-or-reply only in guild channels.
    let chatter = bot.fake.push_message(TEXT, USER, "lunch anyone?");
    assert_eq!(
        bot.settled(&chatter.to_string()).await.disposition,
        Disposition::Ignored
    );
    let mention = bot
        .fake
        .push_message(TEXT, USER, &format!("<@{BOT}> what time is it"));
    let answer = bot.answers(TEXT, mention, "echo: what time is it").await;
    let row = bot.settled(&mention.to_string()).await;
    assert_eq!(row.space.as_deref(), Some(GUILD.to_string().as_str()));
    let answer_id: u64 = answer[0]["id"].as_str().unwrap().parse().unwrap();
    let reply = bot
        .fake
        .push(UserMessage::new(TEXT, USER, "and tomorrow?").reply_to(answer_id));
    bot.answers(TEXT, reply, "echo: and tomorrow?").await;
    // Typing while the run worked (guild channels are terminal-only).
    assert!(
        bot.fake.typing().iter().any(|t| t.channel_id == TEXT),
        "no typing indicator"
    );

    // A thread is its own conversation inside its parent channel (which the
    // allowlist names).
    let in_thread = bot
        .fake
        .push_message(THREAD, USER, &format!("<@{BOT}> in the thread"));
    bot.answers(THREAD, in_thread, "echo: in the thread").await;
    let thread_row = bot.settled(&in_thread.to_string()).await;
    assert_eq!(
        (thread_row.chat_id.as_str(), thread_row.thread_id.as_deref()),
        (TEXT.to_string().as_str(), Some(THREAD.to_string().as_str()))
    );
    assert_ne!(thread_row.conversation_id, row.conversation_id);

    // Channels that are not allowed, other bots, our own messages.
    let elsewhere = bot
        .fake
        .push_message(OTHER_TEXT, USER, &format!("<@{BOT}> hi"));
    let row = bot.settled(&elsewhere.to_string()).await;
    assert_eq!(row.disposition, Disposition::Ignored);
    assert!(row.reason.unwrap().contains("access.guilds"));
    let from_bot = bot.fake.push(
        UserMessage::new(TEXT, 555, format!("<@{BOT}> beep"))
            .from_bot()
            .author_name("otherbot"),
    );
    let row = bot.settled(&from_bot.to_string()).await;
    assert_eq!(row.disposition, Disposition::Ignored);
    assert!(row.reason.unwrap().contains("allow_bots"));
    let rows = bot.store.journal_list(None, 1000).await.unwrap();
    for own in bot.fake.created_messages(TEXT) {
        assert!(
            rows.iter().all(|r| r.update_key != own.id.to_string()),
            "the bot's own message was journaled"
        );
    }

    // Edits are ignored by default, with the reason.
    let dm = bot.fake.push_message(DM, USER, "frist");
    bot.answers(DM, dm, "echo: frist").await;
    bot.fake.push_message_update(DM, dm, "first");
    let prefix = format!("{dm}:edit:");
    let edit = bot
        .row("the edit", |r| r.update_key.starts_with(&prefix))
        .await;
    assert_eq!(edit.disposition, Disposition::Ignored);
    assert!(edit.reason.unwrap().contains("edits are ignored"));

    // Attachments reach the runtime as references and download on demand.
    let with_file = bot.fake.push(
        UserMessage::new(DM, USER, "look")
            .attachment(FakeAttachment::new("cat.png", vec![9u8; 2048]).content_type("image/png")),
    );
    bot.answers(DM, with_file, "echo: look").await;
    let row = bot.settled(&with_file.to_string()).await;
    let payload: Value = serde_json::from_str(row.payload.as_deref().unwrap()).unwrap();
    let url = payload["attachments"][0]["reference"].as_str().unwrap();
    assert!(url.starts_with("http"), "{payload}");
    assert_eq!(payload["attachments"][0]["size"], 2048);
    assert_eq!(payload["attachments"][0]["media_type"], "image/png");
    let client = reqwest::Client::new();
    let file = client
        .get(format!("http://{}/v1/attachments/dc", bot.daemon.admin))
        .query(&[("reference", url)])
        .send()
        .await
        .unwrap();
    assert_eq!(file.status().as_u16(), 200);
    assert_eq!(file.bytes().await.unwrap().len(), 2048);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_as_new_inputs_and_guild_allowlists() {
    let bot = Bot::start(Setup {
        channel: "edits = \"new-input\"".into(),
        access: format!("dm_policy = \"open\"\nguilds = [\"{GUILD}\"]\ngroup_trigger = \"all\""),
        extra: TERMINAL_DM.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;
    let msg = bot
        .fake
        .push_message(OTHER_TEXT, USER, "any channel of the guild");
    bot.answers(OTHER_TEXT, msg, "echo: any channel of the guild")
        .await;
    bot.fake.push_message_update(OTHER_TEXT, msg, "edited text");
    assert!(
        bot.fake
            .wait_until(WAIT, |f| f
                .history(OTHER_TEXT)
                .iter()
                .any(|m| m["content"] == "echo: edited text"))
            .await,
        "the edit was not answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_after_an_invalid_session_and_after_a_restart() {
    let mut bot = Bot::start(Setup {
        extra: TERMINAL_DM.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;
    let first = bot.fake.push_message(DM, USER, "before the gap");
    bot.answers(DM, first, "echo: before the gap").await;

    // Invalid session: what is posted before the new IDENTIFY is never
    // dispatched; the backfill after READY finds it.
    let identifies = bot.fake.identifies().len();
    bot.fake.invalidate_session();
    let gap = bot.fake.push_message(DM, USER, "during the gap");
    bot.answers(DM, gap, "echo: during the gap").await;
    assert!(bot.fake.identifies().len() > identifies);
    assert!(
        bot.fake
            .history_requests()
            .iter()
            .any(|h| h.channel_id == DM && h.after == Some(first)),
        "{:?}",
        bot.fake.history_requests()
    );

    // A restart: what is posted while the daemon is down is backfilled
    // after its first IDENTIFY; nothing is answered twice.
    bot.daemon.kill();
    let down = bot.fake.push_message(DM, USER, "while down");
    bot.daemon.spawn().await;
    bot.answers(DM, down, "echo: while down").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for id in [first, gap, down] {
        assert_eq!(replies(&bot.fake, DM, id).len(), 1, "{id} answered once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_create_is_resent_with_its_nonce_and_discord_returns_the_same_message() {
    let bot = Bot::start(Setup {
        extra: TERMINAL_DM.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;
    // The message is created, then the connection drops without an answer.
    bot.fake
        .fail_next("POST /channels/*/messages", Fault::CloseAfterEffect);
    let msg = bot.fake.push_message(DM, USER, "are you there");
    bot.answers(DM, msg, "echo: are you there").await;
    assert!(
        eventually(WAIT, || async { !bot.fake.dedupes().is_empty() }).await,
        "the resend was not deduplicated by its nonce\n{}",
        bot.daemon.logs()
    );
    assert_eq!(replies(&bot.fake, DM, msg).len(), 1, "one message");
    // The fake counts the dedupe before it answers; the ack is written after.
    let items = || async {
        bot.store
            .outbox_list(&switchboard::store::OutboxFilter {
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap()
    };
    assert!(
        eventually(WAIT, || async {
            items()
                .await
                .iter()
                .all(|i| i.state == switchboard::store::DispatchState::Acknowledged)
        })
        .await,
        "{:#?}",
        items().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_and_refusals() {
    let bot = Bot::start(Setup {
        extra: TERMINAL_DM.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;

    // A channel 429 waits Retry-After, then sends.
    bot.fake.fail_next(
        "POST /channels/*/messages",
        Fault::RateLimited {
            retry_after_secs: 1.5,
            global: false,
        },
    );
    let pushed = Instant::now();
    let msg = bot.fake.push_message(DM, USER, "slow");
    bot.answers(DM, msg, "echo: slow").await;
    assert!(pushed.elapsed() >= Duration::from_millis(1500));

    // A global 429 holds every channel of the account.
    bot.fake.fail_next(
        "POST /channels/*/messages",
        Fault::RateLimited {
            retry_after_secs: 2.0,
            global: true,
        },
    );
    let pushed = Instant::now();
    let a = bot.fake.push_message(DM, USER, "global one");
    bot.answers(DM, a, "echo: global one").await;
    let b = bot.fake.push_message(DM2, USER2, "global two");
    bot.answers(DM2, b, "echo: global two").await;
    assert!(pushed.elapsed() >= Duration::from_secs(2));

    // Other 4xx are never retried: one request, the item failed.
    let posts_before = bot
        .fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/messages"))
        .count();
    bot.fake.fail_next(
        "POST /channels/*/messages",
        Fault::Status(
            403,
            serde_json::json!({"message": "Missing Permissions", "code": 50013}),
        ),
    );
    let refused = bot.fake.push_message(DM, USER, "refused");
    let store = &bot.store;
    assert!(
        eventually(WAIT, || async {
            store
                .outbox_list(&switchboard::store::OutboxFilter {
                    limit: 100,
                    ..Default::default()
                })
                .await
                .unwrap()
                .iter()
                .any(|i| i.state == switchboard::store::DispatchState::Failed)
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let posts_after = bot
        .fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/messages"))
        .count();
    assert_eq!(posts_after, posts_before + 1, "a 403 was retried");
    assert!(replies(&bot.fake, DM, refused).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_downs_only_its_account_and_a_missing_intent_is_explained() {
    let fake = world().await;
    fake.set_application_flags(0);
    let bot = Bot::start_on(
        fake,
        Setup {
            extra: format!(
                "{TERMINAL_DM}\n[channels.dc2]\nkind = \"discord\"\nruntime = \"default\"\ntoken = \"{TOKEN2}\"\napi_url = \"{{api}}\"\n"
            ),
            ..Setup::default()
        },
    )
    .await;
    let ready = bot.wait_state("dc2", "down").await;
    let detail = ready["channels"]["dc2"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("401") && detail.contains("channels.dc2"),
        "{detail}"
    );
    let (status, _) = bot.readyz().await;
    assert_eq!(status, 503);

    // The Message Content intent is not granted: the bot connects without
    // it, says so, and still answers DMs and mentions.
    let ready = bot.wait_state("dc", "up").await;
    assert!(
        ready["channels"]["dc"]["detail"]
            .as_str()
            .unwrap()
            .contains("Message Content"),
        "{ready}"
    );
    assert!(bot.daemon.logs().contains("Privileged Gateway Intents"));
    assert!(
        bot.fake
            .identifies()
            .iter()
            .all(|i| i.intents & (1 << 15) == 0)
    );
    let msg = bot.fake.push_message(DM, USER, "still here");
    bot.answers(DM, msg, "echo: still here").await;
    assert!(
        !bot.daemon.logs().contains("test-secret"),
        "the token was logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_ranges_identify_only_their_shards() {
    let bot = Bot::start(Setup {
        channel: "shards = { range = [1, 2], total = 4 }".into(),
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;
    assert!(
        bot.fake
            .wait_until(WAIT, |f| f.identifies().len() >= 2)
            .await
    );
    let mut shards: Vec<[u32; 2]> = bot.fake.identifies().iter().map(|i| i.shard).collect();
    shards.sort();
    shards.dedup();
    assert_eq!(shards, [[1, 4], [2, 4]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_answering_answers_every_message_once_without_duplicates() {
    let mut bot = Bot::start(Setup {
        token_delay_ms: 15,
        ..Setup::default()
    })
    .await;
    bot.wait_state("dc", "up").await;

    let mut pushed: Vec<(u64, u64, String)> = Vec::new();
    let started = Instant::now();
    let kills = [600u64, 1500, 2400];
    let mut next_kill = 0;
    for n in 0..36 {
        let (channel, user) = if n % 2 == 0 { (DM, USER) } else { (DM2, USER2) };
        let text = format!("message {n} with some words");
        let id = bot.fake.push_message(channel, user, &text);
        pushed.push((channel, id, text));
        tokio::time::sleep(Duration::from_millis(70)).await;
        if next_kill < kills.len() && started.elapsed() >= Duration::from_millis(kills[next_kill]) {
            // Land the kill while a create is in flight: the next one takes
            // effect (the message exists), then hangs before answering.
            let before = bot.fake.all_created_messages().len();
            bot.fake.fail_next(
                "POST /channels/*/messages",
                Fault::HangAfterEffect(Duration::from_secs(3)),
            );
            bot.fake
                .wait_until(WAIT, |f| f.all_created_messages().len() > before)
                .await;
            bot.daemon.kill();
            bot.daemon.spawn().await;
            next_kill += 1;
        }
    }
    assert_eq!(next_kill, kills.len());
    for (channel, id, text) in &pushed {
        bot.answers(*channel, *id, &format!("echo: {text}")).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (channel, id, _) in &pushed {
        assert_eq!(
            replies(&bot.fake, *channel, *id).len(),
            1,
            "message {id} answered more than once"
        );
    }
    // Each kill cut a create off after Discord had made the message: each
    // was resent with its nonce and answered with the existing message.
    assert!(
        bot.fake.dedupes().len() >= kills.len(),
        "{:?}",
        bot.fake.dedupes()
    );
    let rows = bot.store.journal_list(None, 1000).await.unwrap();
    for (_, id, _) in &pushed {
        assert_eq!(
            rows.iter()
                .filter(|r| r.update_key == id.to_string())
                .count(),
            1
        );
    }
    let unanswered_posts = bot
        .fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.status.is_none())
        .count();
    eprintln!(
        "{} messages, 3 kills: {unanswered_posts} requests without an answer, {} nonce dedupes by the fake, {} history reads",
        pushed.len(),
        bot.fake.dedupes().len(),
        bot.fake.history_requests().len()
    );
    let _ = &bot.dir;
}
