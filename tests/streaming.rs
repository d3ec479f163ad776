//! Streaming delivery through the real binary and the webhook channel (a
//! receiver that applies `edits`): the durable preview, throttled transient
//! edits, the exact final text as the last edit, the cut-off marker of an
//! interrupted run, and the "discarded" marker of a superseded one.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, DaemonConfig, Delivery, Receiver, eventually, open_store, post, run_of};

struct Setup {
    _dir: tempfile::TempDir,
    daemon: Daemon,
    receiver: Receiver,
    store: switchboard::store::SharedStore,
    client: reqwest::Client,
}

async fn setup(extra_chat_settings: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.token_delay_ms = 100;
    config.channel_extra =
        format!("[channels.main.chats.live]\ndelivery = \"streaming\"\n{extra_chat_settings}");
    let daemon = Daemon::start(dir.path(), &config).await;
    let store = open_store(dir.path()).await;
    Setup {
        _dir: dir,
        daemon,
        receiver,
        store,
        client: reqwest::Client::new(),
    }
}

impl Setup {
    async fn send(&self, id: &str, text: &str, policy: Option<&str>) -> i64 {
        let mut body = serde_json::json!({"update_id": id, "chat": {"id": "live"}, "text": text});
        if let Some(p) = policy {
            body["input_policy"] = p.into();
        }
        let (status, answer) = post(&self.client, &self.daemon.updates_url("main"), &body)
            .await
            .unwrap();
        assert_eq!(status.as_u16(), 202, "{answer}");
        answer["inbound_id"].as_i64().unwrap()
    }

    async fn run_id(&self, inbound: i64) -> i64 {
        let store = &self.store;
        assert!(
            eventually(Duration::from_secs(10), || async move {
                run_of(store, inbound).await.is_some()
            })
            .await
        );
        run_of(store, inbound).await.unwrap().id
    }

    /// Wait for a body with this reply key.
    async fn wait_for(&self, key: &str) {
        let r = &self.receiver;
        assert!(
            eventually(Duration::from_secs(20), || async move {
                r.deliveries().iter().any(|d| d.body.reply_key == key)
            })
            .await,
            "{key} never arrived; got {:?}; log:\n{}",
            self.receiver
                .deliveries()
                .iter()
                .map(|d| d.body.reply_key.clone())
                .collect::<Vec<_>>(),
            self.daemon.logs()
        );
    }

    fn of_run(&self, run: i64) -> Vec<Delivery> {
        let prefix = format!("run-{run}-");
        self.receiver
            .deliveries()
            .into_iter()
            .filter(|d| d.body.reply_key.starts_with(&prefix))
            .collect()
    }
}

fn words(n: usize) -> String {
    (1..=n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_is_a_preview_throttled_edits_and_the_exact_final_text() {
    let s = setup("").await;
    let inbound = s.send("1", &words(30), None).await;
    let run = s.run_id(inbound).await;
    let final_key = format!("run-{run}-answer-1");
    s.wait_for(&final_key).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let bodies = s.of_run(run);
    let preview_key = format!("run-{run}-preview");
    let full = format!("echo: {}", words(30));

    // The preview: a message of its own, the answer's first words.
    assert_eq!(bodies[0].body.reply_key, preview_key);
    assert_eq!(bodies[0].body.edits, None);
    assert!(full.starts_with(&bodies[0].body.text) && bodies[0].body.text.len() < full.len());

    // Then transient edits of it, growing, at most one a second.
    let edits: Vec<&Delivery> = bodies[1..bodies.len() - 1].iter().collect();
    assert!(!edits.is_empty(), "a 3-second answer shows edits");
    let mut previous = bodies[0].body.text.len();
    let mut last_at: Option<Instant> = Some(bodies[0].at);
    for e in &edits {
        assert!(
            e.body
                .reply_key
                .starts_with(&format!("{preview_key}-edit-")),
            "{}",
            e.body.reply_key
        );
        assert_eq!(e.body.edits.as_deref(), Some(preview_key.as_str()));
        assert!(
            full.starts_with(&e.body.text) && e.body.text.len() > previous,
            "edits grow: {:?}",
            e.body.text
        );
        previous = e.body.text.len();
        if let Some(t) = last_at {
            assert!(
                e.at.duration_since(t) >= Duration::from_millis(900),
                "two updates {:?} apart",
                e.at.duration_since(t)
            );
        }
        last_at = Some(e.at);
    }
    let took = bodies
        .last()
        .unwrap()
        .at
        .duration_since(bodies[0].at)
        .as_secs_f64();
    assert!(
        edits.len() as f64 <= took + 1.0,
        "{} edits in {took:.1}s",
        edits.len()
    );

    // The final answer is the last body: an edit of the preview carrying the
    // exact final text.
    let last = bodies.last().unwrap();
    assert_eq!(last.body.reply_key, final_key);
    assert_eq!(last.body.edits.as_deref(), Some(preview_key.as_str()));
    assert_eq!(last.body.text, full);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_stream_ends_with_its_partial_text_and_the_marker() {
    let s = setup("").await;
    let a = s.send("1", &words(40), None).await;
    let run_a = s.run_id(a).await;
    s.wait_for(&format!("run-{run_a}-preview")).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let b = s.send("2", "stop that", Some("interrupt")).await;
    let run_b = s.run_id(b).await;
    s.wait_for(&format!("run-{run_b}-answer-1")).await;
    let a_bodies = s.of_run(run_a);
    let last = a_bodies.last().unwrap();
    assert_eq!(last.body.reply_key, format!("run-{run_a}-answer-1"));
    assert_eq!(
        last.body.edits.as_deref(),
        Some(format!("run-{run_a}-preview").as_str())
    );
    let partial = last
        .body
        .text
        .strip_suffix("\n\n[interrupted]")
        .expect("the cut-off marker");
    assert!(format!("echo: {}", words(40)).starts_with(partial));
    assert_eq!(s.of_run(run_b).last().unwrap().body.text, "echo: stop that");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_stream_is_replaced_by_the_discarded_marker() {
    let s = setup("input_policy = \"supersede\"\n").await;
    let a = s.send("1", &words(40), None).await;
    let run_a = s.run_id(a).await;
    s.wait_for(&format!("run-{run_a}-preview")).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let b = s.send("2", "never mind", None).await;
    let run_b = s.run_id(b).await;
    s.wait_for(&format!("run-{run_b}-answer-1")).await;
    let last_a = s.of_run(run_a).last().unwrap().clone();
    assert_eq!(last_a.body.reply_key, format!("run-{run_a}-discarded"));
    assert_eq!(
        last_a.body.edits.as_deref(),
        Some(format!("run-{run_a}-preview").as_str())
    );
    assert_eq!(last_a.body.text, "[discarded]");
}
