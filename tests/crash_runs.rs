//! Recovery of the built-in runtime: the real process is SIGKILLed while
//! runs are queued and running, and restarted on the same SQLite file.
//! Queued runs resume in their persisted order; running runs are re-run
//! (`on_restart = "rerun"`, the default) or end as interrupted
//! (`on_restart = "interrupt"`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post_until_accepted, update};
use switchboard::store::{RunState, SharedStore};

const CHATS: usize = 6;
const PER_CHAT: usize = 5;

async fn running_runs(store: &SharedStore) -> usize {
    store
        .runs_unfinished(0, 1000)
        .await
        .unwrap()
        .iter()
        .filter(|r| r.state == RunState::Running)
        .count()
}

/// Post every message of every chat at once (they queue behind each
/// other), then kill the daemon three times while runs are in flight.
async fn run_with_kills(on_restart: &str) -> (Receiver, Daemon, SharedStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.runtime = Some(format!(
        "kind = \"local\"\non_restart = \"{on_restart}\"\nmodel = {{ backend = \"echo\", token_delay_ms = 40 }}"
    ));
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let store = open_store(dir.path()).await;
    let client = reqwest::Client::new();
    let url = daemon.updates_url("main");
    for i in 0..PER_CHAT {
        for chat in 0..CHATS {
            let body = update(
                &format!("c{chat}-m{i}"),
                &format!("chat-{chat}"),
                &format!("m {chat} {i} five words here"),
            );
            post_until_accepted(&client, &url, &body, Duration::from_secs(10)).await;
        }
    }
    for _ in 0..3 {
        let s = &store;
        assert!(
            eventually(Duration::from_secs(20), || async move {
                running_runs(s).await > 0
            })
            .await,
            "no run was ever running"
        );
        daemon.kill();
        daemon.spawn().await;
    }
    (receiver, daemon, store, dir)
}

/// The first delivery of each reply key, per chat, in arrival order.
fn first_texts(receiver: &Receiver) -> BTreeMap<String, Vec<String>> {
    let mut seen = BTreeSet::new();
    let mut per_chat: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in receiver.deliveries() {
        if seen.insert(d.body.reply_key.clone()) {
            per_chat
                .entry(d.body.chat_id)
                .or_default()
                .push(d.body.text);
        }
    }
    per_chat
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_survive_sigkill_and_every_input_is_answered_once_in_order() {
    let (receiver, daemon, store, _dir) = run_with_kills("rerun").await;
    let total = CHATS * PER_CHAT;
    assert!(
        receiver.wait_for_keys(total, Duration::from_secs(60)).await,
        "only {} of {total} answered; log:\n{}",
        receiver.distinct_keys(),
        daemon.logs()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        receiver.distinct_keys(),
        total,
        "exactly one reply key per input"
    );
    for (chat, texts) in first_texts(&receiver) {
        let n: usize = chat.trim_start_matches("chat-").parse().unwrap();
        let expected: Vec<String> = (0..PER_CHAT)
            .map(|i| format!("echo: m {n} {i} five words here"))
            .collect();
        assert_eq!(texts, expected, "{chat} out of order or incomplete");
    }
    // One run per input, each completed: a re-run kept its run.
    let rows = store.journal_list(None, 1000).await.unwrap();
    let runs: BTreeSet<String> = rows
        .iter()
        .map(|r| r.run_id.clone().expect("admitted"))
        .collect();
    assert_eq!(runs.len(), total);
    for run in &runs {
        let run = store.run_get(run.parse().unwrap()).await.unwrap().unwrap();
        assert_eq!(run.state, RunState::Completed);
        assert_eq!(store.run_inputs(run.id).await.unwrap().len(), 1);
    }
    assert!(
        daemon
            .logs()
            .contains("resumed runs a previous process left"),
        "{}",
        daemon.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_restart_interrupt_a_run_cut_by_a_crash_is_marked_and_the_rest_resume() {
    let (receiver, daemon, store, _dir) = run_with_kills("interrupt").await;
    let total = CHATS * PER_CHAT;
    assert!(
        receiver.wait_for_keys(total, Duration::from_secs(60)).await,
        "only {} of {total} answered; log:\n{}",
        receiver.distinct_keys(),
        daemon.logs()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rows = store.journal_list(None, 1000).await.unwrap();
    let mut interrupted = 0;
    for row in &rows {
        let run = store
            .run_get(row.run_id.as_deref().unwrap().parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        match run.state {
            RunState::Completed => {}
            RunState::Interrupted => interrupted += 1,
            other => panic!("run {} ended {other}", run.id),
        }
    }
    assert!(interrupted >= 1, "the kills interrupted no run");
    // Every input still got exactly one reply, in order: the interrupted
    // ones a marker.
    for (chat, texts) in first_texts(&receiver) {
        let n: usize = chat.trim_start_matches("chat-").parse().unwrap();
        assert_eq!(texts.len(), PER_CHAT, "{chat}: {texts:?}");
        for (i, text) in texts.iter().enumerate() {
            let full = format!("echo: m {n} {i} five words here");
            assert!(
                text == &full || text == "[interrupted]",
                "{chat} #{i}: {text:?}"
            );
        }
    }
}
