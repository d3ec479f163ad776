//! The Telegram channel end to end: a real `switchboard run` process polling
//! (or receiving webhooks from) the loopback fake Bot API in
//! `tests/fakes`, which speaks the real JSON. One test per scope bullet of
//! the Telegram issue; the crash test kills the real process.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, DaemonConfig, eventually, open_store};
use serde_json::{Value, json};
use sqlx::Connection;
use switchboard::store::{Disposition, InboundRow, SharedStore};
use switchboard_fakes::telegram::{FakeTelegram, Fault, MessageOpts, SentMessage, WebhookRetry};

const TOKEN: &str = "4242:TEST-token-a";
const BOT_ID: i64 = 4242;
const USERNAME: &str = "switch_bot";
const WAIT: Duration = Duration::from_secs(20);

/// A daemon with a Telegram account `tg` on the fake.
struct Bot {
    dir: tempfile::TempDir,
    fake: FakeTelegram,
    daemon: Daemon,
    store: SharedStore,
}

struct Setup {
    /// Keys for `[channels.tg]`.
    channel: String,
    /// Keys for `[channels.tg.access]`.
    access: String,
    /// More TOML (surfaces, runtimes).
    extra: String,
    token_delay_ms: u64,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            channel: String::new(),
            access: "dm_policy = \"open\"".into(),
            extra: String::new(),
            token_delay_ms: 0,
        }
    }
}

impl Bot {
    async fn start(setup: Setup) -> Bot {
        let fake = FakeTelegram::start().await;
        fake.add_bot(TOKEN, BOT_ID, USERNAME);
        Self::start_on(fake, setup).await
    }

    async fn start_on(fake: FakeTelegram, setup: Setup) -> Bot {
        let dir = tempfile::tempdir().unwrap();
        let mut config = DaemonConfig::new("http://127.0.0.1:9/unused".into());
        config.token_delay_ms = setup.token_delay_ms;
        let channel = setup
            .channel
            .replace("{server}", &config.server_port.to_string());
        let extra = setup.extra.replace("{api}", &fake.url());
        config.extra = format!(
            r#"
[channels.tg]
kind = "telegram"
runtime = "default"
token = "{TOKEN}"
api_url = "{url}"
poll_timeout_secs = 1
request_timeout_secs = 3
{channel}

[channels.tg.access]
{access}

{extra}
"#,
            url = fake.url(),
            access = setup.access,
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

    async fn wait_up(&self, account: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let (_, body) = self.readyz().await;
            if body["channels"][account]["state"] == "up" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{account} never came up: {body}\n{}",
                self.daemon.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The first settled journal row `pred` accepts.
    async fn row(&self, what: &str, pred: impl Fn(&InboundRow) -> bool) -> InboundRow {
        let deadline = Instant::now() + WAIT;
        loop {
            let rows = self.store.journal_list(None, 500).await.unwrap();
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

    /// The journal row of a platform update key, once it is settled.
    async fn settled(&self, key: &str) -> InboundRow {
        self.row(key, |r| r.update_key == key).await
    }

    /// Messages in `chat` that reply to `message_id`, once there are `n`
    /// whose visible text is final (`pred`).
    async fn answers(&self, chat: i64, message_id: i64, want: &str) -> Vec<SentMessage> {
        let found = self
            .fake
            .wait_for(WAIT, |f| {
                let answers = replies_to(&f.sent(chat), message_id);
                answers
                    .iter()
                    .any(|m| m.visible_text == want)
                    .then_some(answers)
            })
            .await;
        found.unwrap_or_else(|| {
            panic!(
                "no answer {want:?} to message {message_id} in chat {chat}; sent: {:#?}\n{}",
                self.fake.sent(chat),
                self.daemon.logs()
            )
        })
    }
}

fn replies_to(sent: &[SentMessage], message_id: i64) -> Vec<SentMessage> {
    sent.iter()
        .filter(|m| {
            m.reply_parameters
                .as_ref()
                .and_then(|r| r["message_id"].as_i64())
                == Some(message_id)
        })
        .cloned()
        .collect()
}

/// Terminal-only private chats: one `sendMessage` per answer.
const TERMINAL_PRIVATE: &str = "[surfaces.\"telegram.private\"]\ndelivery = \"terminal-only\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_answers_private_messages_with_formatting_menu_and_long_polls() {
    let bot = Bot::start(Setup::default()).await;
    bot.wait_up("tg").await;
    let (status, ready) = bot.readyz().await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["channels"]["tg"]["detail"], "polling as @switch_bot");

    // The command menu is the core's commands.
    let menu: Vec<String> = bot
        .fake
        .commands(TOKEN)
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    for command in [
        "help",
        "stop",
        "new",
        "remind",
        "schedules",
        "cancel",
        "timezone",
    ] {
        assert!(menu.contains(&command.to_owned()), "{menu:?}");
    }

    let (_, msg) = bot
        .fake
        .push_message(TOKEN, 100, 100, "hello *world* & <you>");
    let answers = bot.answers(100, msg, "echo: hello world & <you>").await;
    assert_eq!(
        answers.len(),
        1,
        "one message, edited into the answer: {answers:#?}"
    );
    let answer = &answers[0];
    assert_eq!(answer.parse_mode.as_deref(), Some("HTML"));
    assert!(
        answer.entities.iter().any(|e| e["type"] == "italic"),
        "Markdown became Telegram entities: {answer:#?}"
    );
    let row = bot.settled(&format!("100:{msg}")).await;
    assert_eq!(row.disposition, Disposition::Admitted);

    // Every update was confirmed after it was stored, with long polls.
    assert!(
        eventually(WAIT, || async { bot.fake.pending(TOKEN) == 0 }).await,
        "the update was never confirmed"
    );
    let calls = bot.fake.get_updates_calls(TOKEN);
    assert!(calls.iter().all(|(_, timeout)| *timeout == 1), "{calls:?}");
    let offsets: Vec<i64> = calls.iter().map(|(o, _)| *o).collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    // Edits are ignored by default, with the reason recorded.
    bot.fake.push_edited_message(TOKEN, 100, msg, "hello again");
    let prefix = format!("100:{msg}:edit:");
    let edit = bot
        .row("the edit", |r| r.update_key.starts_with(&prefix))
        .await;
    assert_eq!(edit.disposition, Disposition::Ignored);
    assert!(
        edit.reason
            .as_deref()
            .unwrap_or_default()
            .contains("edits are ignored"),
        "{edit:?}"
    );
}

/// Holds SQLite's write lock on the daemon's store, so journal commits wait.
async fn hold_write_lock(dir: &std::path::Path) -> sqlx::SqliteConnection {
    let url = format!("sqlite://{}", dir.join("switchboard.db").display());
    let mut conn = sqlx::SqliteConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_are_confirmed_only_after_their_journal_commit_and_redelivered_after_a_crash() {
    let mut bot = Bot::start(Setup {
        extra: TERMINAL_PRIVATE.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;

    // While the store cannot commit, the update is fetched but never
    // confirmed: no later getUpdates asks for an offset past it.
    let lock = hold_write_lock(bot.dir.path()).await;
    let (update_id, msg) = bot.fake.push_message(TOKEN, 100, 100, "kept");
    assert!(
        eventually(WAIT, || async {
            bot.fake
                .get_updates_calls(TOKEN)
                .iter()
                .filter(|(o, _)| *o <= update_id)
                .count()
                >= 2
        })
        .await,
        "the daemon should have fetched the update"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(bot.fake.pending(TOKEN), 1, "confirmed before it was stored");
    assert!(
        bot.fake
            .get_updates_calls(TOKEN)
            .iter()
            .all(|(o, _)| *o <= update_id),
        "an offset past an unstored update was sent"
    );

    // Crash with the update unstored; Telegram still has it.
    bot.daemon.kill();
    drop(lock);
    bot.daemon.spawn().await;
    bot.answers(100, msg, "echo: kept").await;
    assert!(eventually(WAIT, || async { bot.fake.pending(TOKEN) == 0 }).await);

    // An update fetched again after a restart is deduplicated by the journal:
    // the fake re-delivers everything unconfirmed, so push one, crash right
    // after it is stored, and check it is answered once.
    let (_, msg2) = bot.fake.push_message(TOKEN, 100, 100, "once");
    bot.settled(&format!("100:{msg2}")).await;
    bot.daemon.kill();
    bot.daemon.spawn().await;
    bot.answers(100, msg2, "echo: once").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        replies_to(&bot.fake.sent(100), msg2).len(),
        1,
        "answered once"
    );
    assert_eq!(replies_to(&bot.fake.sent(100), msg).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_mode_registers_the_secret_refuses_requests_without_it_and_acks_after_commit() {
    let fake = FakeTelegram::start().await;
    fake.add_bot(TOKEN, BOT_ID, USERNAME);
    fake.set_webhook_retry(WebhookRetry {
        attempts: 50,
        delay: Duration::from_millis(200),
        timeout: Duration::from_secs(1),
    });
    let bot = Bot::start_on(
        fake,
        Setup {
            channel: "mode = \"webhook\"\nwebhook_url = \"http://127.0.0.1:{server}/telegram/tg\"\nwebhook_secret = \"s3cret-XYZ_1\"".into(),
            extra: TERMINAL_PRIVATE.into(),
            ..Setup::default()
        },
    )
    .await;
    bot.wait_up("tg").await;
    let url = format!("http://{}/telegram/tg", bot.daemon.server);
    assert_eq!(
        bot.fake.webhook(TOKEN),
        Some((url.clone(), Some("s3cret-XYZ_1".into())))
    );

    let (update_id, msg) = bot.fake.push_message(TOKEN, 100, 100, "via webhook");
    bot.answers(100, msg, "echo: via webhook").await;
    let attempts: Vec<_> = bot
        .fake
        .push_attempts()
        .into_iter()
        .filter(|a| a.update_id == update_id)
        .collect();
    assert_eq!(attempts.last().unwrap().status, Some(200));
    assert_eq!(attempts[0].secret.as_deref(), Some("s3cret-XYZ_1"));

    // Requests without the secret, or with a wrong one, are refused and
    // counted.
    let client = reqwest::Client::new();
    let body = json!({"update_id": 999, "message": {"message_id": 1, "date": 0, "chat": {"id": 5, "type": "private"}, "text": "forged"}});
    let none = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(none.status().as_u16(), 401);
    let wrong = client
        .post(&url)
        .header("X-Telegram-Bot-Api-Secret-Token", "guess")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let metrics = bot.daemon.metrics().await;
    assert!(
        metrics
            .contains(r#"switchboard_ingress_rejected_total{account="tg",reason="bad_secret"} 2"#),
        "{metrics}"
    );
    assert!(
        bot.store
            .journal_list(None, 100)
            .await
            .unwrap()
            .iter()
            .all(|r| r.update_key != "5:1"),
        "a forged update was journaled"
    );

    // 200 only after the commit: while the store cannot commit, Telegram's
    // deliveries get no 200; once it can, the update is stored and answered.
    let lock = hold_write_lock(bot.dir.path()).await;
    let (update_id, msg) = bot.fake.push_message(TOKEN, 100, 100, "after commit");
    assert!(
        eventually(WAIT, || async {
            bot.fake
                .push_attempts()
                .iter()
                .filter(|a| a.update_id == update_id)
                .count()
                >= 2
        })
        .await
    );
    assert!(
        bot.fake
            .push_attempts()
            .iter()
            .filter(|a| a.update_id == update_id)
            .all(|a| a.status != Some(200)),
        "acknowledged before it was stored"
    );
    drop(lock);
    bot.answers(100, msg, "echo: after commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_wait_retry_after_and_rejected_formatting_falls_back_to_plain_text() {
    let bot = Bot::start(Setup {
        extra: TERMINAL_PRIVATE.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;

    bot.fake
        .fail_next(TOKEN, "sendMessage", Fault::RetryAfter(2));
    let pushed = Instant::now();
    let (_, msg) = bot.fake.push_message(TOKEN, 100, 100, "slow down");
    bot.answers(100, msg, "echo: slow down").await;
    assert!(
        pushed.elapsed() >= Duration::from_secs(2),
        "retry_after was not waited: {:?}",
        pushed.elapsed()
    );
    assert_eq!(bot.fake.requests("sendMessage").len(), 2);
    let item = bot
        .store
        .outbox_list(&switchboard::store::OutboxFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.chat_id == "100")
        .unwrap();
    assert_eq!(item.attempts, 0, "a 429 is not counted as an attempt");

    bot.fake.fail_next(
        TOKEN,
        "sendMessage",
        Fault::Status(
            400,
            "Bad Request: can't parse entities: Unsupported start tag \"x\" at byte offset 6"
                .into(),
        ),
    );
    let (_, msg) = bot.fake.push_message(TOKEN, 100, 100, "**bold** move");
    let answers = bot.answers(100, msg, "echo: **bold** move").await;
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].parse_mode, None, "sent as plain text");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_group_keeps_its_conversation_and_access() {
    let bot = Bot::start(Setup {
        access: "groups = [\"-5\"]\ngroup_trigger = \"all\"".into(),
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;
    bot.fake.add_chat(-5, "group", "Team");

    let (_, one) = bot.fake.push_message(TOKEN, -5, 7, "one");
    bot.answers(-5, one, "echo: one").await;
    let first = bot.settled(&format!("-5:{one}")).await;

    bot.fake.push_migration(TOKEN, -5, -1009);
    let migration = bot
        .row("the migration", |r| {
            r.update_key.starts_with("-5:") && r.update_key != first.update_key
        })
        .await;
    assert_eq!(migration.disposition, Disposition::Ignored);
    assert!(
        migration
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("migrated to -1009"),
        "{migration:?}"
    );

    // The supergroup continues the conversation and is still allowed.
    let (_, two) = bot.fake.push_message(TOKEN, -1009, 7, "two");
    bot.answers(-1009, two, "echo: two").await;
    let second = bot.settled(&format!("-1009:{two}")).await;
    assert_eq!(second.conversation_id, first.conversation_id);
    assert_eq!(second.disposition, Disposition::Admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buttons_edits_commands_for_other_bots_unknown_kinds_and_attachments() {
    let bot = Bot::start(Setup {
        channel: "edits = \"new-input\"".into(),
        access: "dm_policy = \"open\"\ngroups = [\"-7\"]".into(),
        extra: TERMINAL_PRIVATE.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;

    // An edit becomes a new input.
    let (_, msg) = bot.fake.push_message(TOKEN, 100, 100, "frist");
    bot.answers(100, msg, "echo: frist").await;
    bot.fake.push_edited_message(TOKEN, 100, msg, "first");
    let answered = bot
        .fake
        .wait_for(WAIT, |f| {
            f.sent(100)
                .into_iter()
                .find(|m| m.visible_text == "echo: first")
        })
        .await;
    assert!(answered.is_some(), "the edit was not answered");

    // A button press is an input, and the button stops spinning.
    let answer_id = bot.fake.sent(100)[0].message_id;
    bot.fake
        .push_callback_query(TOKEN, 100, 100, "pressed-yes", answer_id);
    assert!(
        bot.fake
            .wait_for(WAIT, |f| f
                .sent(100)
                .into_iter()
                .find(|m| m.visible_text == "echo: pressed-yes"))
            .await
            .is_some()
    );
    assert!(
        bot.fake
            .wait_for(WAIT, |f| f
                .callback_answers()
                .into_iter()
                .find(|a| a.data.as_deref() == Some("pressed-yes")))
            .await
            .is_some(),
        "answerCallbackQuery was not called"
    );

    // Commands: the core's /help (and /start), and commands for another
    // bot in a group are ignored with the reason.
    let (_, help) = bot.fake.push_message(TOKEN, 100, 100, "/start");
    let help_row = bot.settled(&format!("100:{help}")).await;
    assert_eq!(help_row.disposition, Disposition::Command);
    let (_, other) = bot.fake.push_message(TOKEN, -7, 100, "/stop@other_bot");
    let row = bot.settled(&format!("-7:{other}")).await;
    assert_eq!(row.disposition, Disposition::Ignored);
    assert!(row.reason.unwrap().contains("@other_bot"));

    // Forum topics are conversations of their own, answered in the topic.
    bot.fake.add_chat(-7, "forum", "Forum");
    let (_, in_five) = bot.fake.push_message_with(
        TOKEN,
        -7,
        100,
        "@switch_bot topic five",
        MessageOpts::default().thread(5),
    );
    let (_, in_six) = bot.fake.push_message_with(
        TOKEN,
        -7,
        100,
        "@switch_bot topic six",
        MessageOpts::default().thread(6),
    );
    let five = bot
        .answers(-7, in_five, "echo: @switch_bot topic five")
        .await;
    assert_eq!(five[0].thread_id, Some(5));
    let six = bot.answers(-7, in_six, "echo: @switch_bot topic six").await;
    assert_eq!(six[0].thread_id, Some(6));
    let (five, six) = (
        bot.settled(&format!("-7:{in_five}")).await,
        bot.settled(&format!("-7:{in_six}")).await,
    );
    assert_eq!(five.thread_id.as_deref(), Some("5"));
    assert_ne!(five.conversation_id, six.conversation_id);

    // Unknown update kinds are journaled as ignored, with their kind.
    let id = bot.fake.push_raw(
        TOKEN,
        json!({"my_chat_member": {"chat": {"id": -7, "type": "group", "title": "T"}, "from": {"id": 1, "is_bot": false, "first_name": "A"}, "date": 0,
            "old_chat_member": {"status": "left", "user": {"id": BOT_ID, "is_bot": true, "first_name": "b"}},
            "new_chat_member": {"status": "member", "user": {"id": BOT_ID, "is_bot": true, "first_name": "b"}}}}),
    );
    let row = bot.settled(&format!("upd:{id}")).await;
    assert_eq!(row.disposition, Disposition::Ignored);
    assert!(row.reason.unwrap().contains("my_chat_member"));

    // Attachments reach the runtime as references, never bytes, and can be
    // downloaded on demand within the size cap.
    bot.fake.add_file("photo-1", vec![7u8; 3000]);
    let (_, photo) = bot
        .fake
        .push_photo(TOKEN, 100, 100, "photo-1", Some("look"));
    bot.answers(100, photo, "echo: look").await;
    let row = bot.settled(&format!("100:{photo}")).await;
    let payload: Value = serde_json::from_str(row.payload.as_deref().unwrap()).unwrap();
    assert_eq!(payload["attachments"][0]["reference"], "photo-1");
    assert_eq!(payload["attachments"][0]["size"], 3000);
    let file = reqwest::get(format!(
        "http://{}/v1/attachments/tg?reference=photo-1",
        bot.daemon.admin
    ))
    .await
    .unwrap();
    assert_eq!(file.status().as_u16(), 200);
    assert_eq!(file.bytes().await.unwrap().len(), 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_and_group_mentions_through_telegram() {
    let bot = Bot::start(Setup {
        access: "groups = [\"-7\"]".into(),
        extra: TERMINAL_PRIVATE.into(),
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;

    // An unknown user gets a code; an operator approves it; then answered.
    let (_, hello) = bot.fake.push_message(TOKEN, 200, 200, "hello?");
    let row = bot.settled(&format!("200:{hello}")).await;
    assert_eq!(row.disposition, Disposition::Refused);
    let reason = row.reason.unwrap();
    let code = reason
        .split("code ")
        .nth(1)
        .unwrap()
        .trim_end_matches(')')
        .to_owned();
    assert!(
        bot.fake
            .wait_for(WAIT, |f| f
                .sent(200)
                .into_iter()
                .find(|m| m.visible_text.contains(&code)))
            .await
            .is_some(),
        "the code was not sent to the user"
    );
    let approve = bot.daemon.cli(&["pair", "approve", &code]);
    assert!(approve.status.success(), "{approve:?}");
    let (_, again) = bot.fake.push_message(TOKEN, 200, 200, "now?");
    bot.answers(200, again, "echo: now?").await;

    // In an allowed group: only mentions and replies to the bot.
    let (_, chatter) = bot.fake.push_message(TOKEN, -7, 200, "lunch?");
    let row = bot.settled(&format!("-7:{chatter}")).await;
    assert_eq!(row.disposition, Disposition::Ignored);
    let (_, mention) = bot
        .fake
        .push_message(TOKEN, -7, 200, "@switch_bot what time is it");
    let answer = bot
        .answers(-7, mention, "echo: @switch_bot what time is it")
        .await;
    let (_, reply) = bot.fake.push_message_with(
        TOKEN,
        -7,
        200,
        "and tomorrow?",
        MessageOpts::default().reply_to(answer[0].message_id),
    );
    bot.answers(-7, reply, "echo: and tomorrow?").await;
    // Groups outside the allowlist are ignored.
    let (_, stranger) = bot.fake.push_message(TOKEN, -8, 200, "@switch_bot hi");
    let row = bot.settled(&format!("-8:{stranger}")).await;
    assert_eq!(row.disposition, Disposition::Ignored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_stops_only_its_account() {
    let fake = FakeTelegram::start().await;
    fake.add_bot(TOKEN, BOT_ID, USERNAME);
    // The second bot's token is unknown to Telegram: 401.
    let bot = Bot::start_on(
        fake,
        Setup {
            extra: format!(
                "{TERMINAL_PRIVATE}\n[channels.tg2]\nkind = \"telegram\"\nruntime = \"default\"\ntoken = \"777:revoked\"\napi_url = \"{{api}}\"\n[channels.tg2.access]\ndm_policy = \"open\"\n"
            ),
            ..Setup::default()
        },
    )
    .await;
    bot.wait_up("tg").await;
    let deadline = Instant::now() + WAIT;
    let (status, ready) = loop {
        let (status, ready) = bot.readyz().await;
        if ready["channels"]["tg2"]["state"] == "down" {
            break (status, ready);
        }
        assert!(
            Instant::now() < deadline,
            "tg2 never reported down: {ready}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status, 503, "{ready}");
    let detail = ready["channels"]["tg2"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("401") && detail.contains("BotFather") && detail.contains("channels.tg2"),
        "{detail}"
    );
    let metrics = bot.daemon.metrics().await;
    assert!(
        metrics.contains(r#"switchboard_channel_up{account="tg2"} 0"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"switchboard_channel_up{account="tg"} 1"#),
        "{metrics}"
    );
    assert!(
        !bot.daemon.logs().contains("777:revoked"),
        "the token reached the log"
    );

    // The other account keeps working.
    let (_, msg) = bot.fake.push_message(TOKEN, 100, 100, "still here");
    bot.answers(100, msg, "echo: still here").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_stream_into_private_chats_then_the_answer_is_sent() {
    let bot = Bot::start(Setup {
        channel: "drafts = true".into(),
        token_delay_ms: 150,
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;
    let text = "one two three four five six seven eight nine ten eleven twelve";
    let (_, msg) = bot.fake.push_message(TOKEN, 100, 100, text);
    let answers = bot.answers(100, msg, &format!("echo: {text}")).await;
    assert_eq!(answers.len(), 1);
    let drafts = bot.fake.drafts();
    assert!(drafts.len() >= 2, "{drafts:#?}");
    assert!(
        drafts
            .iter()
            .all(|d| d.draft_id == drafts[0].draft_id && d.chat_id == 100)
    );
    assert!(bot.fake.edits().is_empty(), "drafts replace preview edits");
    assert_eq!(answers[0].edit_count, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_polling_and_answering_answers_every_message() {
    let mut bot = Bot::start(Setup {
        token_delay_ms: 15,
        ..Setup::default()
    })
    .await;
    bot.wait_up("tg").await;

    // Three users keep writing while the daemon is killed three times.
    let mut pushed: Vec<(i64, i64, String)> = Vec::new();
    let started = Instant::now();
    let kills = [700u64, 1600, 2500];
    let mut next_kill = 0;
    for n in 0..45 {
        let chat = 101 + (n % 3);
        let text = format!("message {n} from {chat} with a few words");
        let (_, id) = bot.fake.push_message(TOKEN, chat, chat, &text);
        pushed.push((chat, id, text));
        tokio::time::sleep(Duration::from_millis(60)).await;
        if next_kill < kills.len() && started.elapsed() >= Duration::from_millis(kills[next_kill]) {
            bot.daemon.kill();
            bot.daemon.spawn().await;
            next_kill += 1;
        }
    }
    assert_eq!(
        next_kill,
        kills.len(),
        "the daemon was not killed three times"
    );

    for (chat, id, text) in &pushed {
        bot.answers(*chat, *id, &format!("echo: {text}")).await;
    }
    assert!(eventually(WAIT, || async { bot.fake.pending(TOKEN) == 0 }).await);
    // Let late duplicates, if any, arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let resends: i64 = bot
        .store
        .outbox_list(&switchboard::store::OutboxFilter {
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .iter()
        .map(|i| i.resends)
        .sum();
    let mut extra = 0;
    for (chat, id, _) in &pushed {
        let answers = replies_to(&bot.fake.sent(*chat), *id);
        assert!(!answers.is_empty());
        extra += answers.len() - 1;
    }
    // Telegram has no idempotency key: a send cut off by SIGKILL after it
    // reached Telegram is resent (surface default `resend`), and counted.
    // Every extra message must be one of those counted resends.
    assert!(
        extra as i64 <= resends,
        "{extra} duplicate answers but only {resends} counted resends"
    );
    let rows = bot.store.journal_list(None, 1000).await.unwrap();
    for (chat, id, _) in &pushed {
        let key = format!("{chat}:{id}");
        let matching: Vec<_> = rows.iter().filter(|r| r.update_key == key).collect();
        assert_eq!(matching.len(), 1, "{key}");
        assert_eq!(matching[0].disposition, Disposition::Admitted, "{key}");
    }
    eprintln!(
        "{} messages, 3 kills: {extra} duplicate answers, {resends} counted resends",
        pushed.len()
    );
}
