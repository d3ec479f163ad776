//! The whole loop through the real binary: webhook channel in, SQLite
//! journal, built-in echo runtime, outbox, callback receiver out.
//!
//! Promises exercised: 1 (202 only after the row is stored: a duplicate
//! post sees the first one's row), 2 (one update, one run, also under
//! concurrent duplicates), 3 (every update settles), 5 (causal order per
//! conversation, conversations independent).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, post, update};
use reqwest::StatusCode;

const CHATS: usize = 20;
const PER_CHAT: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_message_answered_once_in_order_despite_duplicate_posts() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let url = daemon.updates_url("main");
    let client = reqwest::Client::new();

    // Each chat sends its messages one after another; each message is posted
    // twice, the two posts racing each other (a platform redelivering while
    // the first request is still in flight). Chats run concurrently.
    let mut senders = Vec::new();
    for chat in 0..CHATS {
        let client = client.clone();
        let url = url.clone();
        senders.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..PER_CHAT {
                let body = update(
                    &format!("c{chat}-m{i}"),
                    &format!("chat-{chat}"),
                    &format!("msg {chat}-{i}"),
                );
                let (a, b) = tokio::join!(post(&client, &url, &body), post(&client, &url, &body));
                let (a, b) = (a.expect("daemon reachable"), b.expect("daemon reachable"));
                assert_eq!(a.0, StatusCode::ACCEPTED, "{}", a.1);
                assert_eq!(b.0, StatusCode::ACCEPTED, "{}", b.1);
                // Both posts name the same journal row.
                assert_eq!(a.1["inbound_id"], b.1["inbound_id"]);
                let mut pair = [
                    a.1["status"].as_str().unwrap().to_owned(),
                    b.1["status"].as_str().unwrap().to_owned(),
                ];
                pair.sort();
                statuses.push(pair);
            }
            statuses
        }));
    }
    for sender in senders {
        for pair in sender.await.unwrap() {
            assert_eq!(
                pair,
                ["accepted".to_owned(), "duplicate".to_owned()],
                "exactly one of two posts is new"
            );
        }
    }

    let total = CHATS * PER_CHAT;
    assert!(
        receiver.wait_for_keys(total, Duration::from_secs(60)).await,
        "only {} of {total} replies arrived; log:\n{}",
        receiver.distinct_keys(),
        daemon.logs()
    );
    // Give any stray second delivery time to show up before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let deliveries = receiver.deliveries();
    assert_eq!(deliveries.len(), total, "no reply was delivered twice");
    let keys: HashSet<&str> = deliveries
        .iter()
        .map(|d| d.body.reply_key.as_str())
        .collect();
    assert_eq!(keys.len(), total, "exactly one reply_key per message");

    // Per chat: replies arrive in the order the messages were sent, with
    // ordinals 1..=PER_CHAT.
    let mut per_chat: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for d in &deliveries {
        per_chat
            .entry(d.body.chat_id.clone())
            .or_default()
            .push((d.body.ordinal, d.body.text.clone()));
    }
    assert_eq!(per_chat.len(), CHATS);
    for (chat, replies) in per_chat {
        let n: usize = chat.trim_start_matches("chat-").parse().unwrap();
        let expected: Vec<(i64, String)> = (0..PER_CHAT)
            .map(|i| ((i + 1) as i64, format!("echo: msg {n}-{i}")))
            .collect();
        assert_eq!(
            replies, expected,
            "chat {chat} got its replies out of order"
        );
    }

    // Every journal row settled as admitted; the operator can see it.
    let out = daemon.cli(&["inbound", "list", "--limit", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("admitted: {total}")), "{text}");
    assert!(!text.contains("pending"), "{text}");
    let out = daemon.cli(&["outbox", "list", "--limit", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("acknowledged: {total}")), "{text}");

    // The counters moved with the traffic.
    let metrics = daemon.metrics().await;
    assert!(
        metrics.contains(&format!(
            "switchboard_updates_received_total{{account=\"webhook:main\"}} {total}"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "switchboard_updates_deduplicated_total{{account=\"webhook:main\"}} {total}"
        )),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_cleanly_and_a_restart_sends_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let url = daemon.updates_url("main");
    let client = reqwest::Client::new();
    for i in 0..20 {
        let (status, _) = post(
            &client,
            &url,
            &update(&format!("u{i}"), "chat", &format!("m{i}")),
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::ACCEPTED);
    }
    assert!(receiver.wait_for_keys(20, Duration::from_secs(20)).await);
    assert_eq!(
        daemon.terminate(Duration::from_secs(15)),
        Some(0),
        "exit 0 on SIGTERM"
    );
    assert!(
        daemon.logs().contains("shutdown settled"),
        "{}",
        daemon.logs()
    );

    daemon.spawn().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        receiver.deliveries().len(),
        20,
        "a restart resent an acknowledged reply"
    );
}
