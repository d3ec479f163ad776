//! The outbox across a crash, through the real binary: SIGKILL while sends
//! are in flight to a slow receiver, restart, and reconciliation by the
//! surface's policy; with `hold`, the unconfirmed items wait for an
//! operator, who settles them from the CLI and the admin API. Also: long
//! answers split into chunks, each its own item.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post, update};
use switchboard::store::{DispatchState, OutboxFilter, SharedStore};

async fn count(store: &SharedStore, state: DispatchState) -> usize {
    store
        .outbox_list(&OutboxFilter {
            state: Some(state),
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_items_survive_a_crash_and_an_operator_settles_them() {
    let dir = tempfile::tempdir().unwrap();
    // The receiver takes 3 s per reply, so the sends are in flight when the
    // daemon dies.
    let receiver = Receiver::start_with_delay(Duration::from_secs(3)).await;
    let mut config = DaemonConfig::new(receiver.url());
    config.extra = "[surfaces.webhook]\non_ambiguous_send = \"hold\"\n".into();
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let store = open_store(dir.path()).await;
    let client = reqwest::Client::new();
    for chat in 0..6 {
        post(
            &client,
            &daemon.updates_url("main"),
            &update(&format!("u{chat}"), &format!("chat-{chat}"), "hi"),
        )
        .await
        .unwrap();
    }
    let s = &store;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            count(s, DispatchState::PossiblyDispatched).await == 6
        })
        .await,
        "the six replies never were in flight together"
    );
    daemon.kill();
    daemon.spawn().await;

    // At start, unconfirmed sends are reconciled: `hold` parks them.
    assert!(
        eventually(Duration::from_secs(10), || async move {
            count(s, DispatchState::Held).await == 6
        })
        .await
    );
    let out = daemon.cli(&["outbox", "list", "--state", "held"]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        listed.lines().filter(|l| l.contains(" held ")).count(),
        6,
        "{listed}"
    );
    let metrics = daemon.metrics().await;
    assert!(
        metrics.contains("switchboard_outbox_items{state=\"held\"} 6"),
        "{metrics}"
    );

    // Settle them: two from the CLI, the rest through the admin API.
    let held = store
        .outbox_list(&OutboxFilter {
            state: Some(DispatchState::Held),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let ids: Vec<i64> = held.iter().map(|i| i.id).collect();
    let key_of: HashMap<i64, String> = held.iter().map(|i| (i.id, i.item_key.clone())).collect();
    let out = daemon.cli(&["outbox", "resolve", &ids[0].to_string(), "--as-sent"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = daemon.cli(&["outbox", "resolve", &ids[1].to_string(), "--resend"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = daemon.cli(&["outbox", "resolve", &ids[1].to_string(), "--drop"]);
    assert!(!out.status.success(), "only held items can be resolved");
    let admin = format!("http://{}", daemon.admin);
    for (id, action) in [
        (ids[2], "drop"),
        (ids[3], "drop"),
        (ids[4], "as-sent"),
        (ids[5], "resend"),
    ] {
        let r = client
            .post(format!("{admin}/v1/outbox/{id}/resolve"))
            .json(&serde_json::json!({ "action": action }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    }
    let r = client
        .post(format!("{admin}/v1/outbox/{}/resolve", ids[0]))
        .json(&serde_json::json!({"action": "drop"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let r = client
        .post(format!("{admin}/v1/outbox/{}/resolve", ids[0]))
        .json(&serde_json::json!({"action": "burn"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);

    // The resent ones arrive; the others are settled without a send.
    let state_of = |id: i64| {
        let store = store.clone();
        async move { store.outbox_get(id).await.unwrap().unwrap().state }
    };
    assert!(
        eventually(Duration::from_secs(15), || async {
            state_of(ids[1]).await == DispatchState::Acknowledged
                && state_of(ids[5]).await == DispatchState::Acknowledged
        })
        .await,
        "resent items were not delivered; log:\n{}",
        daemon.logs()
    );
    assert_eq!(state_of(ids[0]).await, DispatchState::Acknowledged);
    assert_eq!(state_of(ids[4]).await, DispatchState::Acknowledged);
    assert_eq!(state_of(ids[2]).await, DispatchState::Dropped);
    assert_eq!(state_of(ids[3]).await, DispatchState::Dropped);
    let listing = client
        .get(format!("{admin}/v1/outbox?state=dropped"))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    assert_eq!(listing["items"].as_array().unwrap().len(), 2);

    // Nothing was sent that the operator did not ask for: the first
    // process's sends were cut before the receiver answered, so only the two
    // resends ever completed.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut copies: HashMap<String, usize> = HashMap::new();
    for d in receiver.deliveries() {
        *copies.entry(d.body.reply_key).or_default() += 1;
    }
    for id in [ids[0], ids[2], ids[3], ids[4]] {
        assert!(
            !copies.contains_key(&key_of[&id]),
            "{} was sent again",
            key_of[&id]
        );
    }
    for id in [ids[1], ids[5]] {
        assert_eq!(copies.get(&key_of[&id]), Some(&1), "{}", key_of[&id]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_answers_become_chunks_each_delivered_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.channel_extra = "max_reply_chars = 120".into();
    let daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    let paragraph = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do";
    let code = "```python\nprint('a')\nprint('b')\nprint('c')\nprint('d')\nprint('e')\nprint('f')\nprint('g')\n```";
    let text = format!("{paragraph}\n\n{paragraph}\n\n{code}\n\n{paragraph}");
    post(
        &client,
        &daemon.updates_url("main"),
        &update("1", "chat", &text),
    )
    .await
    .unwrap();
    let full = format!("echo: {text}");
    let s = &receiver;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            s.deliveries()
                .iter()
                .any(|d| d.body.reply_key.ends_with("-answer-4"))
        })
        .await,
        "{:?}",
        receiver
            .deliveries()
            .iter()
            .map(|d| d.body.reply_key.clone())
            .collect::<Vec<_>>()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = receiver.deliveries();
    let keys: Vec<String> = replies.iter().map(|d| d.body.reply_key.clone()).collect();
    assert!(
        keys.iter()
            .enumerate()
            .all(|(i, k)| k.ends_with(&format!("-answer-{}", i + 1))),
        "{keys:?}"
    );
    for r in &replies {
        assert!(r.body.text.chars().count() <= 120, "{:?}", r.body.text);
        let fences = r.body.text.lines().filter(|l| l.starts_with("```")).count();
        assert_eq!(fences % 2, 0, "unbalanced fence in {:?}", r.body.text);
    }
    let words = |t: &str| {
        t.split_whitespace()
            .filter(|w| !w.starts_with("```"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let joined = replies
        .iter()
        .map(|r| r.body.text.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        words(&joined),
        words(&full),
        "the chunks hold the whole answer in order"
    );
    let ordinals: Vec<i64> = replies.iter().map(|r| r.body.ordinal).collect();
    assert_eq!(ordinals, (1..=replies.len() as i64).collect::<Vec<_>>());
}
