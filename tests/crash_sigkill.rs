//! Crash safety: the real process is SIGKILLed at random points while
//! updates are being stored, submitted, run and delivered, and restarted on
//! the same SQLite file. Senders retry until they get a 202, as a platform
//! redelivers an unacknowledged update.
//!
//! Promises exercised: 1, 2, 3, 4 and 5 across crashes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, eventually, post_until_accepted, update};
use rand::RngExt;

const KILLS: usize = 12;
const CHATS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_at_random_points_loses_nothing_and_answers_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    // A slow receiver and a slowed model keep sends and runs in flight, so
    // kills land in every phase.
    let receiver = Receiver::start_with_delay(Duration::from_millis(15)).await;
    let mut config = DaemonConfig::new(receiver.url());
    config.token_delay_ms = 3;
    // Senders outpace the runs on a loaded machine; the bounded queue (which
    // refuses the 33rd waiting input with a notice, tests/policies.rs) is
    // not what this test is about.
    config.extra = "[surfaces.webhook]\nmax_queued_inputs = 100000".into();
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let url = daemon.updates_url("main");

    // Each chat sends numbered messages one after another until told to
    // stop; a message counts as sent once it got a 202.
    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for chat in 0..CHATS {
        let url = url.clone();
        let stop = stop.clone();
        senders.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let mut sent = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let body = update(
                    &format!("c{chat}-m{sent}"),
                    &format!("chat-{chat}"),
                    &format!("m {chat} {sent}"),
                );
                post_until_accepted(&client, &url, &body, Duration::from_secs(60)).await;
                sent += 1;
                let pause = rand::rng().random_range(0..20);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            sent
        }));
    }

    for _ in 0..KILLS {
        let wait = rand::rng().random_range(80..400);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        daemon.kill();
        // Sometimes come back at once, sometimes after senders hit a
        // refused connection for a while.
        let down = rand::rng().random_range(0..150);
        tokio::time::sleep(Duration::from_millis(down)).await;
        daemon.spawn().await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut sent_per_chat = Vec::new();
    for s in senders {
        sent_per_chat.push(s.await.unwrap());
    }
    let total: usize = sent_per_chat.iter().sum();
    assert!(
        total > CHATS * 5,
        "the senders barely sent anything ({total})"
    );

    // Wait for every message's answer (not just as many keys as messages: a
    // message answered under two keys must not hide an unanswered one).
    let expected: BTreeSet<String> = sent_per_chat
        .iter()
        .enumerate()
        .flat_map(|(chat, sent)| (0..*sent).map(move |i| format!("echo: m {chat} {i}")))
        .collect();
    let all_answered = eventually(Duration::from_secs(90), || async {
        let answered: BTreeSet<String> = receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect();
        expected.is_subset(&answered)
    })
    .await;
    if !all_answered {
        let answered: BTreeSet<String> = receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect();
        let missing: Vec<_> = expected.difference(&answered).collect();
        let unexpected: Vec<_> = answered.difference(&expected).collect();
        panic!(
            "{} of {total} messages were never answered: {missing:?}; answers to nothing sent: {unexpected:?}; log:\n{}",
            missing.len(),
            daemon.logs()
        );
    }
    // Let any re-delivery that is still coming arrive before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // One reply key per message, and no message without one.
    let by_key = receiver.by_key();
    let mut keys_per_message: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (key, deliveries) in &by_key {
        for d in deliveries {
            keys_per_message
                .entry(d.body.text.clone())
                .or_default()
                .insert(key.clone());
        }
    }
    for (chat, sent) in sent_per_chat.iter().enumerate() {
        for i in 0..*sent {
            let text = format!("echo: m {chat} {i}");
            let keys = keys_per_message.get(&text);
            assert!(keys.is_some(), "message {chat}/{i} was never answered");
            assert_eq!(
                keys.unwrap().len(),
                1,
                "message {chat}/{i} was answered under two reply keys: {keys:?}"
            );
        }
    }
    assert_eq!(by_key.len(), total, "replies for messages nobody sent");

    // A reply key may be re-delivered after a kill (the receiver dedupes on
    // it), but never more often than there were kills.
    let worst = by_key.values().map(Vec::len).max().unwrap();
    assert!(
        worst <= KILLS + 1,
        "a reply was delivered {worst} times across {KILLS} kills"
    );
    let redeliveries: usize = by_key.values().map(|d| d.len() - 1).sum();
    println!(
        "{total} messages, {KILLS} kills, {redeliveries} re-deliveries (receivers dedupe on reply_key)"
    );

    // Per chat, first deliveries arrive in the order the messages were sent.
    let mut first_seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for d in receiver.deliveries() {
        if seen.insert(d.body.reply_key.clone()) {
            first_seen
                .entry(d.body.chat_id.clone())
                .or_default()
                .push(d.body.text.clone());
        }
    }
    for (chat, sent) in sent_per_chat.iter().enumerate() {
        let expected: Vec<String> = (0..*sent).map(|i| format!("echo: m {chat} {i}")).collect();
        assert_eq!(
            first_seen[&format!("chat-{chat}")],
            expected,
            "chat {chat} saw replies out of order"
        );
    }

    // Nothing is left pending or unconfirmed.
    let out = daemon.cli(&["inbound", "list", "--disposition", "pending"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("admitted: {total}")) && !text.contains("pending:"),
        "{text}"
    );
}
