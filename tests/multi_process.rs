//! Several daemons on one PostgreSQL database (DESIGN.md §5): 10,000
//! messages through the webhook channel spread over three processes, one of
//! them SIGKILLed mid-way and restarted. Every message is answered exactly
//! once and in order per conversation, no schedule occurrence fires twice,
//! and the Telegram poller role moves to a survivor (against the loopback
//! fake Bot API, which counts two pollers at once as 409 conflicts).

mod common;
mod pg;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Daemon, DaemonConfig, Receiver, eventually, update};
use switchboard::store::sqlite::OpenMode;
use switchboard_fakes::telegram::FakeTelegram;

const CHATS: usize = 100;
const PER_CHAT: usize = 100;
const TOKEN: &str = "4242:multi-process-token";
const BOT_ID: i64 = 4242;
const LEASE_SECS: u64 = 3;

/// POST an update to the daemon `first` in `urls`, moving on to the next
/// when one is down or refuses (503), the way a load balancer would; returns
/// once one answered 202.
async fn post_spread(
    client: &reqwest::Client,
    urls: &[String],
    first: usize,
    body: &serde_json::Value,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut i = first;
    loop {
        if let Some((status, _)) = common::post(client, &urls[i % urls.len()], body).await
            && status == reqwest::StatusCode::ACCEPTED
        {
            return;
        }
        assert!(Instant::now() < deadline, "{body} was never accepted");
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn channel_detail(daemon: &Daemon, account: &str) -> String {
    let Ok(r) = reqwest::get(format!("http://{}/readyz", daemon.admin)).await else {
        return String::new();
    };
    let body: serde_json::Value = r.json().await.unwrap_or_default();
    format!(
        "{} {}",
        body["channels"][account]["state"].as_str().unwrap_or(""),
        body["channels"][account]["detail"].as_str().unwrap_or("")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_daemons_on_one_database_answer_every_message_once_through_a_sigkill() {
    let Some(url) = pg::fresh_database().await else {
        return;
    };
    let receiver = Receiver::start().await;
    let telegram = FakeTelegram::start().await;
    telegram.add_bot(TOKEN, BOT_ID, "multibot");
    telegram.add_user(7, "Ann", None);
    telegram.add_chat(7, "private", "Ann");

    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let configs: Vec<DaemonConfig> = (0..3)
        .map(|_| {
            let mut c = DaemonConfig::new(receiver.url());
            c.store_url = Some(url.clone());
            c.store_extra = format!("lease_secs = {LEASE_SECS}");
            c.extra = format!(
                r#"
[surfaces.webhook]
max_queued_inputs = 100000

[channels.tg]
kind = "telegram"
runtime = "default"
token = "{TOKEN}"
api_url = "{api}"
poll_timeout_secs = 1
request_timeout_secs = 3

[channels.tg.access]
dm_policy = "open"
"#,
                api = telegram.url()
            );
            c
        })
        .collect();
    // The first daemon takes the poller role; the others stand by.
    let mut daemons = vec![Daemon::start(dirs[0].path(), &configs[0]).await];
    assert!(
        eventually(Duration::from_secs(20), || async {
            channel_detail(&daemons[0], "tg")
                .await
                .starts_with("up polling as")
        })
        .await,
        "the first daemon never polled: {}",
        daemons[0].logs()
    );
    for i in 1..3 {
        daemons.push(Daemon::start(dirs[i].path(), &configs[i]).await);
    }
    for d in &daemons[1..] {
        assert!(
            eventually(Duration::from_secs(20), || async {
                channel_detail(d, "tg").await.contains("standing by")
            })
            .await,
            "a second process must stand by, not poll: {}",
            d.logs()
        );
    }
    let urls: Vec<String> = daemons.iter().map(|d| d.updates_url("main")).collect();

    // A recurring prompt every two seconds, fired by whichever process
    // claims each occurrence.
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/schedules", daemons[1].admin))
        .json(&serde_json::json!({
            "account": "main", "chat_id": "ticks",
            "every": "*/2 * * * * *", "timezone": "UTC", "prompt": "tick"
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap());
    let schedule_id = r.json::<serde_json::Value>().await.unwrap()["schedule"]["id"]
        .as_i64()
        .unwrap();

    // Each chat sends its messages one after another, spread round-robin
    // over the three processes.
    let accepted = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut senders = Vec::new();
    for chat in 0..CHATS {
        let urls = urls.clone();
        let accepted = accepted.clone();
        senders.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            for i in 0..PER_CHAT {
                let body = update(
                    &format!("c{chat}-m{i}"),
                    &format!("chat-{chat}"),
                    &format!("m {chat} {i}"),
                );
                post_spread(&client, &urls, chat + i, &body).await;
                accepted.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }

    // Mid-way, the poller dies.
    assert!(
        eventually(Duration::from_secs(120), || async {
            accepted.load(Ordering::SeqCst) >= CHATS * PER_CHAT / 2
        })
        .await,
        "half the messages were never accepted"
    );
    daemons[0].kill();
    let killed_at = Instant::now();
    let survivor = loop {
        let mut found = None;
        for (i, d) in daemons.iter().enumerate().skip(1) {
            if channel_detail(d, "tg").await.starts_with("up polling as") {
                found = Some(i);
            }
        }
        if let Some(i) = found {
            break i;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(LEASE_SECS + 5),
            "no survivor took over polling within the lease plus 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let takeover = killed_at.elapsed();
    daemons[0].spawn().await;

    for s in senders {
        s.await.unwrap();
    }
    let posting = started.elapsed();
    // A Telegram message after the takeover is answered (by the new poller).
    telegram.push_message(TOKEN, 7, 7, "after the takeover");
    assert!(
        eventually(Duration::from_secs(30), || async {
            telegram
                .sent(7)
                .iter()
                .any(|m| m.text.contains("after the takeover"))
        })
        .await,
        "the Telegram message was never answered; survivor log:\n{}",
        daemons[survivor].logs()
    );
    assert_eq!(
        telegram.poll_conflicts(TOKEN),
        0,
        "two processes polled the bot at the same time"
    );

    // Every message answered, exactly once, in order per chat.
    let expected: BTreeSet<String> = (0..CHATS)
        .flat_map(|c| (0..PER_CHAT).map(move |i| format!("echo: m {c} {i}")))
        .collect();
    let answered = || {
        receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect::<BTreeSet<String>>()
    };
    if !eventually(Duration::from_secs(180), || async {
        expected.is_subset(&answered())
    })
    .await
    {
        let missing: Vec<_> = expected.difference(&answered()).take(20).cloned().collect();
        panic!(
            "{} messages were never answered, e.g. {missing:?}; logs:\n{}\n{}\n{}",
            expected.difference(&answered()).count(),
            daemons[0].logs(),
            daemons[1].logs(),
            daemons[2].logs()
        );
    }
    let drained = started.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut keys_per_text: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut first_seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for d in receiver.deliveries() {
        keys_per_text
            .entry(d.body.text.clone())
            .or_default()
            .insert(d.body.reply_key.clone());
        if seen.insert(d.body.reply_key.clone()) {
            first_seen
                .entry(d.body.chat_id.clone())
                .or_default()
                .push(d.body.text.clone());
        }
    }
    for text in &expected {
        assert_eq!(
            keys_per_text[text].len(),
            1,
            "{text:?} was answered under several reply keys: {:?}",
            keys_per_text[text]
        );
    }
    for c in 0..CHATS {
        let want: Vec<String> = (0..PER_CHAT).map(|i| format!("echo: m {c} {i}")).collect();
        assert_eq!(
            first_seen[&format!("chat-{c}")],
            want,
            "chat {c} saw replies out of order"
        );
    }

    // Every fired occurrence answered once; none twice.
    let store = switchboard::store::open(
        &switchboard::config::StoreConfig {
            url: url.clone(),
            ..Default::default()
        },
        OpenMode::Tool,
    )
    .await
    .unwrap();
    let ticks_answered = || {
        receiver
            .deliveries()
            .into_iter()
            .filter(|d| d.body.chat_id == "ticks")
            .map(|d| d.body.reply_key)
            .collect::<BTreeSet<String>>()
    };
    let r = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/schedules/{schedule_id}/pause",
            daemons[2].admin
        ))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let fired = || async {
        store
            .occurrences_list(schedule_id, 10_000)
            .await
            .unwrap()
            .into_iter()
            .filter(|o| o.state == switchboard::store::OccurrenceState::Fired)
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            ticks_answered().len() == fired().await
        })
        .await,
        "{} occurrences fired but {} distinct answers arrived",
        fired().await,
        ticks_answered().len()
    );
    assert!(
        fired().await >= 3,
        "the schedule barely fired ({})",
        fired().await
    );
    let counts = store.journal_counts().await.unwrap();
    assert!(
        counts
            .iter()
            .all(|(d, _)| *d != switchboard::store::Disposition::Pending),
        "rows left pending: {counts:?}"
    );
    let redeliveries = receiver.deliveries().len() - seen.len();
    println!(
        "{} messages over 3 processes: posted in {posting:?}, all answered after {drained:?}; \
         poller taken over {takeover:?} after the kill; {} occurrences fired; \
         {redeliveries} re-deliveries (receivers dedupe on reply_key)",
        CHATS * PER_CHAT,
        fired().await
    );
}

/// Moving a deployment: a SQLite store copied with `switchboard copy-store`
/// into PostgreSQL carries on where it stopped: old updates stay
/// deduplicated, conversations keep their history, ids continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_store_copied_into_postgres_carries_on() {
    let Some(url) = pg::fresh_database().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    // More rows than one INSERT of the copy carries (200).
    for i in 0..250 {
        let body = update(
            &format!("u{i}"),
            &format!("chat-{}", i % 4),
            &format!("before {i}"),
        );
        common::post_until_accepted(
            &client,
            &daemon.updates_url("main"),
            &body,
            Duration::from_secs(10),
        )
        .await;
    }
    assert!(receiver.wait_for_keys(250, Duration::from_secs(60)).await);
    assert_eq!(daemon.terminate(Duration::from_secs(20)), Some(0));

    let sqlite = format!("sqlite://{}", dir.path().join("switchboard.db").display());
    let out = std::process::Command::new(common::BIN)
        .args(["copy-store", "--from", &sqlite, "--to", &url])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("inbound: 250"), "{stdout}");

    // Copying again into the same (now full) database is refused.
    let again = std::process::Command::new(common::BIN)
        .args(["copy-store", "--from", &sqlite, "--to", &url])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("not empty"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    config.store_url = Some(url.clone());
    let daemon = Daemon::start(dir.path(), &config).await;
    // A redelivered old update is still a duplicate; new ones are answered.
    let (status, body) = common::post(
        &client,
        &daemon.updates_url("main"),
        &update("u3", "chat-3", "before 3"),
    )
    .await
    .unwrap();
    assert_eq!(status.as_u16(), 202);
    assert_eq!(body["status"], "duplicate", "{body}");
    for i in 0..8 {
        let body = update(
            &format!("v{i}"),
            &format!("chat-{}", i % 4),
            &format!("after {i}"),
        );
        common::post_until_accepted(
            &client,
            &daemon.updates_url("main"),
            &body,
            Duration::from_secs(10),
        )
        .await;
    }
    assert!(
        receiver.wait_for_keys(258, Duration::from_secs(30)).await,
        "{}",
        daemon.logs()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.distinct_keys(), 258, "nothing answered twice");
    let store = switchboard::store::open(
        &switchboard::config::StoreConfig {
            url,
            ..Default::default()
        },
        OpenMode::Tool,
    )
    .await
    .unwrap();
    let rows = store.journal_list(None, 1_000).await.unwrap();
    let old = rows.iter().find(|r| r.update_key == "u3").unwrap();
    let new = rows.iter().find(|r| r.update_key == "v3").unwrap();
    assert_eq!(
        old.conversation_id, new.conversation_id,
        "the chat's conversation carried over"
    );
    assert!(new.id > old.id, "ids continue after the copied ones");
}
