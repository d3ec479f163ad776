//! The scheduler through the real binary: chat commands over the webhook
//! channel, the CLI and the admin API, and a SIGKILL between claiming an
//! occurrence and submitting it.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post, update};
use switchboard::store::{OccurrenceState, ScheduleState};

async fn say(client: &reqwest::Client, daemon: &Daemon, id: &str, chat: &str, text: &str) {
    let (status, body) = post(client, &daemon.updates_url("main"), &update(id, chat, text))
        .await
        .unwrap();
    assert_eq!(status.as_u16(), 202, "{body}");
}

async fn texts_for(receiver: &Receiver, chat: &str) -> Vec<String> {
    receiver
        .deliveries()
        .into_iter()
        .filter(|d| d.body.chat_id == chat)
        .map(|d| d.body.text)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remind_in_2s_is_delivered_to_the_same_chat_once() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let client = reqwest::Client::new();
    let sent = Instant::now();
    say(&client, &daemon, "1", "alice", "/remind in 2s hello").await;
    let r = &receiver;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            texts_for(r, "alice").await.len() >= 2
        })
        .await,
        "{}",
        daemon.logs()
    );
    let texts = texts_for(&receiver, "alice").await;
    assert!(
        texts[0].starts_with("Reminder ") && texts[0].contains(" set for "),
        "{texts:?}"
    );
    assert_eq!(texts[1], "hello");
    let hello_at = receiver
        .deliveries()
        .into_iter()
        .find(|d| d.body.text == "hello")
        .unwrap()
        .at;
    let waited = hello_at.duration_since(sent);
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(5),
        "delivered after {waited:?}"
    );
    // Once, and to nobody else.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        texts_for(&receiver, "alice")
            .await
            .iter()
            .filter(|t| *t == "hello")
            .count(),
        1
    );
    assert_eq!(receiver.deliveries().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_commands_manage_a_chats_schedules_and_bad_specs_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let client = reqwest::Client::new();
    let steps = [
        ("/remind at 2026-12-24 18:00 presents", "no time zone"),
        ("/timezone Mars/Olympus", "unknown time zone"),
        ("/timezone Europe/Berlin", "Time zone set to Europe/Berlin."),
        (
            "/remind at 2099-12-24 18:00 presents",
            "set for 2099-12-24 18:00 CET",
        ),
        ("/remind at 2020-01-01 10:00 too late", "is in the past"),
        (
            "/remind every \"61 * * * *\" nope",
            "invalid cron expression",
        ),
        (
            "/remind every \"0 9 * * MON-FRI\" stand-up",
            "repeating \"0 9 * * MON-FRI\"",
        ),
        ("/remind soon please", "Usage: /remind"),
        ("/schedules", "presents"),
        ("/timezone", "This chat's time zone is Europe/Berlin."),
    ];
    for (i, (text, _)) in steps.iter().enumerate() {
        say(&client, &daemon, &format!("u{i}"), "bob", text).await;
        let r = &receiver;
        assert!(
            eventually(Duration::from_secs(10), || async move {
                texts_for(r, "bob").await.len() > i
            })
            .await
        );
    }
    let replies = texts_for(&receiver, "bob").await;
    for ((text, expected), reply) in steps.iter().zip(&replies) {
        assert!(
            reply.contains(expected),
            "{text:?} got {reply:?}, expected it to contain {expected:?}"
        );
    }
    assert!(replies[8].contains("stand-up"), "{}", replies[8]);
    // Another chat cannot cancel bob's schedules; bob can.
    let store = open_store(dir.path()).await;
    let ids: Vec<i64> = store
        .schedule_list(&switchboard::store::ScheduleFilter {
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .iter()
        .map(|s| s.id)
        .collect();
    say(
        &client,
        &daemon,
        "c1",
        "eve",
        &format!("/cancel {}", ids[0]),
    )
    .await;
    say(
        &client,
        &daemon,
        "c2",
        "bob",
        &format!("/cancel {}", ids[0]),
    )
    .await;
    let r = &receiver;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            !texts_for(r, "eve").await.is_empty() && texts_for(r, "bob").await.len() > steps.len()
        })
        .await
    );
    assert_eq!(
        texts_for(&receiver, "eve").await[0],
        format!("There is no schedule {} in this chat.", ids[0])
    );
    assert_eq!(
        texts_for(&receiver, "bob").await.last().unwrap(),
        &format!("Schedule {} cancelled.", ids[0])
    );
    assert_eq!(
        store.schedule_get(ids[0]).await.unwrap().unwrap().state,
        ScheduleState::Cancelled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_the_admin_api_manage_schedules() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let client = reqwest::Client::new();
    let admin = format!("http://{}", daemon.admin);

    // The API: a remote runtime giving its agents a reminder tool.
    let r = client
        .post(format!("{admin}/v1/schedules"))
        .json(&serde_json::json!({"account": "main", "chat_id": "carol", "after": "1s", "message": "from the API"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap());
    let r = client
        .post(format!("{admin}/v1/schedules"))
        .json(&serde_json::json!({"account": "main", "chat_id": "carol", "every": "0 9 * * *", "message": "no zone"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("explicit time zone"),
        "{body}"
    );
    let r = client
        .post(format!("{admin}/v1/schedules"))
        .json(&serde_json::json!({"account": "nobody", "chat_id": "x", "after": "1s", "message": "m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);

    // The CLI.
    let out = daemon.cli(&[
        "schedule",
        "add",
        "--account",
        "main",
        "--chat",
        "carol",
        "--every",
        "0 9 * * MON-FRI",
        "--timezone",
        "America/New_York",
        "--prompt",
        "daily summary",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let added = String::from_utf8_lossy(&out.stdout).to_string();
    let id: i64 = added.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        added.contains("EST") || added.contains("EDT"),
        "times shown in the schedule's zone: {added}"
    );
    let out = daemon.cli(&[
        "schedule",
        "add",
        "--account",
        "main",
        "--chat",
        "carol",
        "--every",
        "0 9 * * *",
        "--message",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("explicit time zone"));
    for verb in ["pause", "resume", "cancel"] {
        let out = daemon.cli(&["schedule", verb, &id.to_string()]);
        assert!(
            out.status.success(),
            "{verb}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = daemon.cli(&["schedule", "resume", &id.to_string()]);
    assert!(
        !out.status.success(),
        "a cancelled schedule cannot be resumed"
    );

    // The API-made reminder fired, once.
    let rc = &receiver;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            texts_for(rc, "carol")
                .await
                .contains(&"from the API".to_owned())
        })
        .await
    );
    let list: serde_json::Value = client
        .get(format!("{admin}/v1/schedules?account=main&chat_id=carol"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let schedules = list["schedules"].as_array().unwrap();
    assert_eq!(schedules.len(), 2);
    let fired = schedules
        .iter()
        .find(|s| s["text"] == "from the API")
        .unwrap();
    assert_eq!(fired["state"], "completed");
    let detail: serde_json::Value = client
        .get(format!("{admin}/v1/schedules/{}", fired["id"]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(detail["occurrences"][0]["state"], "fired");
    let out = daemon.cli(&["schedule", "show", &fired["id"].to_string()]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(" fired "),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_claim_and_submit_fires_the_occurrence_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    // Claims are held for 3 s before firing: the kill lands in between.
    config.extra = "[scheduler]\nhold_after_claim_ms = 3000\n".into();
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let out = daemon.cli(&[
        "schedule",
        "add",
        "--account",
        "main",
        "--chat",
        "dave",
        "--after",
        "1s",
        "--prompt",
        "ping",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let store = open_store(dir.path()).await;
    let s = &store;
    let claimed = eventually(Duration::from_secs(10), || async move {
        s.occurrences_list(1, 5)
            .await
            .unwrap()
            .iter()
            .any(|o| o.state == OccurrenceState::Claimed)
    })
    .await;
    assert!(
        claimed,
        "the occurrence was never claimed; log:\n{}",
        daemon.logs()
    );
    daemon.kill();
    daemon.spawn().await;

    let r = &receiver;
    assert!(
        eventually(Duration::from_secs(20), || async move {
            texts_for(r, "dave")
                .await
                .contains(&"echo: ping".to_owned())
        })
        .await,
        "never answered; log:\n{}",
        daemon.logs()
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        texts_for(&receiver, "dave").await,
        ["echo: ping"],
        "fired exactly once"
    );
    let occurrence = &store.occurrences_list(1, 5).await.unwrap()[0];
    assert_eq!(occurrence.state, OccurrenceState::Fired);
    assert!(
        occurrence.fencing_token >= 2,
        "claimed again after the restart"
    );
    assert_eq!(
        store
            .run_inputs(occurrence.run_id.as_deref().unwrap().parse().unwrap())
            .await
            .unwrap()
            .len(),
        1
    );
    let runs = store.runs_list(None, None, 10).await.unwrap();
    assert_eq!(runs.len(), 1, "one run for the occurrence: {runs:?}");
}
