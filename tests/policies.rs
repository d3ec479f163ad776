//! The input policies of the built-in runtime, driven through the webhook
//! channel with the echo model slowed down (50 ms a word), asserting what
//! the user receives and what the run records say (DESIGN.md §2).

mod common;

use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, eventually, open_store, post, run_of};
use reqwest::StatusCode;
use switchboard::store::{Disposition, RunMode, RunRow, RunState, SharedStore};

/// A message whose echo takes a while: 25 words at 50 ms.
fn long(tag: &str) -> String {
    let words = [
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
        "twenty",
        "twentyone",
        "twentytwo",
        "last",
    ];
    format!("{tag} {}", words.join(" "))
}

struct Chat {
    _dir: tempfile::TempDir,
    daemon: Daemon,
    receiver: Receiver,
    store: SharedStore,
    client: reqwest::Client,
    next_update: std::cell::Cell<u32>,
}

impl Chat {
    async fn start(extra: &str) -> Chat {
        Self::start_with(extra, "").await
    }

    async fn start_with(extra: &str, channel_extra: &str) -> Chat {
        let dir = tempfile::tempdir().unwrap();
        let receiver = Receiver::start().await;
        let mut config = DaemonConfig::new(receiver.url());
        config.token_delay_ms = 50;
        config.extra = extra.to_owned();
        config.channel_extra = channel_extra.to_owned();
        let daemon = Daemon::start(dir.path(), &config).await;
        let store = open_store(dir.path()).await;
        Chat {
            _dir: dir,
            daemon,
            receiver,
            store,
            client: reqwest::Client::new(),
            next_update: std::cell::Cell::new(0),
        }
    }

    /// Send a message in `chat` with an optional per-input policy; returns
    /// the journal row id.
    async fn send_in(&self, chat: &str, text: &str, policy: Option<&str>) -> i64 {
        let n = self.next_update.get() + 1;
        self.next_update.set(n);
        let mut body = serde_json::json!({
            "update_id": format!("u{n}"),
            "chat": { "id": chat },
            "text": text,
        });
        if let Some(policy) = policy {
            body["input_policy"] = policy.into();
        }
        let (status, answer) = post(&self.client, &self.daemon.updates_url("main"), &body)
            .await
            .unwrap();
        assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
        answer["inbound_id"].as_i64().unwrap()
    }

    async fn send(&self, text: &str, policy: Option<&str>) -> i64 {
        self.send_in("chat", text, policy).await
    }

    /// The run of a journal row, once admitted.
    async fn run(&self, inbound: i64) -> RunRow {
        let store = &self.store;
        assert!(
            eventually(Duration::from_secs(10), || async move {
                run_of(store, inbound).await.is_some()
            })
            .await,
            "inbound {inbound} was never admitted"
        );
        run_of(store, inbound).await.unwrap()
    }

    /// Wait until the run of a journal row is running and has streamed at
    /// least a few words.
    async fn wait_running(&self, inbound: i64) -> RunRow {
        let store = &self.store;
        let ok = eventually(Duration::from_secs(10), || async move {
            matches!(run_of(store, inbound).await, Some(r) if r.state == RunState::Running)
        })
        .await;
        assert!(
            ok,
            "the run of inbound {inbound} never started; log:\n{}",
            self.daemon.logs()
        );
        // A few words in, so there is a partial answer to keep or drop.
        tokio::time::sleep(Duration::from_millis(250)).await;
        run_of(store, inbound).await.unwrap()
    }

    /// Wait for `n` replies, then a little longer to catch any extra one;
    /// returns the texts in arrival order.
    async fn replies(&self, n: usize) -> Vec<String> {
        assert!(
            self.receiver
                .wait_for_keys(n, Duration::from_secs(30))
                .await,
            "only {} of {n} replies arrived: {:?}; log:\n{}",
            self.receiver.distinct_keys(),
            self.texts(),
            self.daemon.logs()
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        self.texts()
    }

    fn texts(&self) -> Vec<String> {
        self.receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect()
    }

    async fn disposition(&self, inbound: i64) -> (Disposition, Option<String>) {
        let row = self.store.journal_get(inbound).await.unwrap().unwrap();
        (row.disposition, row.reason)
    }
}

/// A cut-off answer: a proper prefix of the full echo, with the marker.
fn assert_cut(reply: &str, full: &str) {
    let partial = reply
        .strip_suffix("\n\n[interrupted]")
        .unwrap_or_else(|| panic!("no cut-off marker on {reply:?}"));
    assert!(
        full.starts_with(partial) && partial.len() < full.len(),
        "{partial:?} is not a proper prefix of {full:?}"
    );
    assert!(!partial.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_runs_the_new_input_after_the_one_in_flight() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let texts = chat.replies(2).await;
    assert_eq!(
        texts,
        [format!("echo: {}", long("A")), "echo: B".to_owned()]
    );
    let (ra, rb) = (chat.run(a).await, chat.run(b).await);
    assert_eq!(
        (ra.state, rb.state),
        (RunState::Completed, RunState::Completed)
    );
    assert!(
        rb.started_at.unwrap() >= ra.finished_at.unwrap(),
        "B started before A finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inject_is_answered_by_the_running_run_and_absorbed_when_it_completes() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", Some("inject")).await;
    // One reply: the run answered A, then (one more model call at its step
    // boundary) B.
    let texts = chat.replies(1).await;
    assert_eq!(texts, [format!("echo: {}\n\necho: B", long("A"))]);
    let (ra, rb) = (chat.run(a).await, chat.run(b).await);
    assert_eq!(ra.state, RunState::Completed);
    assert_eq!(
        (rb.state, rb.mode, rb.absorbed_by),
        (RunState::Absorbed, RunMode::Inject, Some(ra.id))
    );
    let (disposition, reason) = chat.disposition(b).await;
    assert_eq!(disposition, Disposition::Absorbed);
    assert_eq!(
        reason.as_deref(),
        Some(format!("answered by run {}", ra.id).as_str())
    );
    assert!(
        ra.prompt.as_deref().unwrap().contains("\"B\""),
        "the run's turn includes B: {:?}",
        ra.prompt
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_run_absorbs_nothing_and_the_injected_input_runs_itself() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", Some("inject")).await;
    let c = chat.send("C", Some("interrupt")).await;
    let texts = chat.replies(3).await;
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert_cut(&texts[0], &format!("echo: {}", long("A")));
    assert_eq!(&texts[1..], ["echo: B", "echo: C"]);
    assert_eq!(chat.run(a).await.state, RunState::Interrupted);
    let rb = chat.run(b).await;
    assert_eq!((rb.state, rb.absorbed_by), (RunState::Completed, None));
    assert_eq!(chat.run(c).await.state, RunState::Completed);
    assert_eq!(chat.disposition(b).await.0, Disposition::Admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_interrupt_cuts_the_call_and_the_same_run_answers_the_new_input() {
    let chat = Chat::start("[surfaces.webhook]\nsoft_interrupt = true\n").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let sent_b = std::time::Instant::now();
    let b = chat.send("B", Some("inject")).await;
    let texts = chat.replies(1).await;
    assert_eq!(texts.len(), 1, "{texts:?}");
    let (cut, rest) = texts[0].split_once("\n\n").unwrap();
    assert!(
        format!("echo: {}", long("A")).starts_with(cut) && !cut.contains("last"),
        "A's call was not cut: {cut:?}"
    );
    assert_eq!(rest, "echo: B");
    // A's full echo would have taken about a second more.
    let answered = chat.receiver.deliveries()[0].at;
    assert!(
        answered.duration_since(sent_b) < Duration::from_millis(900),
        "the cut was not immediate"
    );
    let (ra, rb) = (chat.run(a).await, chat.run(b).await);
    assert_eq!(ra.state, RunState::Completed);
    assert_eq!(
        (rb.state, rb.absorbed_by),
        (RunState::Absorbed, Some(ra.id))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_ends_the_run_keeping_its_partial_answer_marked() {
    let chat = Chat::start("[surfaces.webhook]\ninput_policy = \"interrupt\"\n").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let texts = chat.replies(2).await;
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert_cut(&texts[0], &format!("echo: {}", long("A")));
    assert_eq!(texts[1], "echo: B");
    let ra = chat.run(a).await;
    assert_eq!(ra.state, RunState::Interrupted);
    assert!(
        texts[0].starts_with(ra.answer.as_deref().unwrap()),
        "the record keeps the partial answer"
    );
    assert_eq!(chat.run(b).await.state, RunState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_next_runs_before_queued_work_which_keeps_its_identity() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let b_run_before = chat.run(b).await.id;
    let c = chat.send("C", Some("interrupt-next")).await;
    let texts = chat.replies(3).await;
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert_cut(&texts[0], &format!("echo: {}", long("A")));
    assert_eq!(
        &texts[1..],
        ["echo: C", "echo: B"],
        "A stops, C runs, then B"
    );
    let (rb, rc) = (chat.run(b).await, chat.run(c).await);
    assert_eq!(rb.id, b_run_before, "B keeps its run");
    assert_eq!(
        (rb.state, rc.state, rc.mode, rc.priority),
        (RunState::Completed, RunState::Completed, RunMode::Urgent, 1)
    );
    assert!(rb.started_at.unwrap() >= rc.finished_at.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_inputs_stay_fifo_and_never_coalesce() {
    let chat = Chat::start("[surfaces.webhook]\ncoalesce_pending = true\n").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let c = chat.send("C", Some("interrupt-next")).await;
    let d = chat.send("D", Some("interrupt-next")).await;
    let texts = chat.replies(4).await;
    assert_eq!(&texts[1..], ["echo: C", "echo: D", "echo: B"], "{texts:?}");
    let (rb, rc, rd) = (chat.run(b).await, chat.run(c).await, chat.run(d).await);
    assert!(rb.id != rc.id && rc.id != rd.id && rb.id != rd.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supersede_drops_the_run_in_flight_from_what_the_user_sees() {
    let chat = Chat::start("[surfaces.webhook]\ninput_policy = \"supersede\"\n").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let texts = chat.replies(1).await;
    assert_eq!(
        texts,
        ["echo: B"],
        "nothing of A on a terminal-only surface"
    );
    let ra = chat.run(a).await;
    assert_eq!(ra.state, RunState::Superseded);
    let partial = ra.answer.unwrap();
    assert!(
        !partial.is_empty() && format!("echo: {}", long("A")).starts_with(&partial),
        "kept in the record: {partial:?}"
    );
    assert_eq!(chat.run(b).await.state, RunState::Completed);
    // The superseded turn is not part of the conversation's history.
    let history = chat
        .store
        .runs_history(ra.conversation_id, 10)
        .await
        .unwrap();
    assert!(history.iter().all(|r| r.id != ra.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_supersedes_on_terminal_only_and_interrupts_on_streaming_surfaces() {
    let chat = Chat::start_with(
        "[surfaces.webhook]\ninput_policy = \"auto\"\n",
        "[channels.main.chats.watcher]\ndelivery = \"streaming\"\n",
    )
    .await;
    let a = chat.send_in("plain", &long("A"), None).await;
    let x = chat.send_in("watcher", &long("X"), None).await;
    chat.wait_running(a).await;
    chat.wait_running(x).await;
    chat.send_in("plain", "B", None).await;
    chat.send_in("watcher", "Y", None).await;
    chat.replies(3).await;
    assert_eq!(
        chat.run(a).await.state,
        RunState::Superseded,
        "terminal-only: nobody saw the partial"
    );
    assert_eq!(
        chat.run(x).await.state,
        RunState::Interrupted,
        "streaming: the partial was seen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalescing_gives_later_inputs_one_successor_run() {
    let chat = Chat::start("[surfaces.webhook]\ncoalesce_pending = true\n").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let c = chat.send("C", None).await;
    let d = chat.send("D", None).await;
    let texts = chat.replies(2).await;
    assert_eq!(
        texts,
        [
            format!("echo: {}", long("A")),
            "echo: B\n\nC\n\nD".to_owned()
        ]
    );
    let (rb, rc, rd) = (chat.run(b).await, chat.run(c).await, chat.run(d).await);
    assert_eq!(
        (rb.id, rb.id),
        (rc.id, rd.id),
        "all three submissions resolve to one run"
    );
    assert_eq!(rb.state, RunState::Completed);
    assert_eq!(chat.store.run_inputs(rb.id).await.unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_interrupts_cancels_what_waits_and_confirms() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let b = chat.send("B", None).await;
    let c = chat.send("C", None).await;
    let stop = chat.send("/stop", None).await;
    let texts = chat.replies(2).await;
    assert_eq!(texts.len(), 2, "{texts:?}");
    assert_cut(&texts[0], &format!("echo: {}", long("A")));
    assert_eq!(texts[1], "Stopped.");
    assert_eq!(chat.run(a).await.state, RunState::Interrupted);
    for queued in [b, c] {
        assert_eq!(
            chat.disposition(queued).await,
            (Disposition::Cancelled, Some("/stop".into()))
        );
        assert_eq!(chat.run(queued).await.state, RunState::Cancelled);
    }
    assert_eq!(
        chat.disposition(stop).await,
        (Disposition::Command, Some("/stop".into()))
    );
    // The conversation goes on.
    chat.send("D", None).await;
    assert_eq!(chat.replies(3).await[2], "echo: D");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_33rd_queued_input_is_refused_visibly() {
    let chat = Chat::start("").await;
    let a = chat.send(&long("A"), None).await;
    chat.wait_running(a).await;
    let mut queued = Vec::new();
    for i in 0..33 {
        queued.push(chat.send(&format!("q{i}"), None).await);
    }
    let refused = *queued.last().unwrap();
    let store = &chat.store;
    assert!(
        eventually(Duration::from_secs(10), || async move {
            store
                .journal_get(refused)
                .await
                .unwrap()
                .unwrap()
                .disposition
                == Disposition::Refused
        })
        .await
    );
    let (_, reason) = chat.disposition(refused).await;
    assert!(reason.unwrap().contains("limit is 32"));
    // The refusal and the admissions before it are written by separate
    // statements of one round; wait for both.
    for q in &queued[..32] {
        assert!(
            eventually(Duration::from_secs(10), || async {
                chat.disposition(*q).await.0 == Disposition::Admitted
            })
            .await,
            "{:?}",
            chat.disposition(*q).await
        );
    }
    // The sender is told at once, while A is still running.
    let texts = chat.replies(1).await;
    assert!(
        texts[0].starts_with("Too many of your messages are waiting"),
        "{texts:?}"
    );
    chat.send("/stop", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_starts_a_fresh_conversation_and_help_lists_commands() {
    let chat = Chat::start("").await;
    let first = chat.send("hello", None).await;
    chat.replies(1).await;
    chat.send("/new", None).await;
    let after = chat.send("again", None).await;
    let help = chat.send("/help", None).await;
    let texts = chat.replies(4).await;
    assert_eq!(texts[1], "Started a new conversation.");
    // A command is answered at once, even ahead of an answer still being
    // generated; answers of runs keep the order of their inputs.
    assert!(texts[2..].contains(&"echo: again".to_owned()), "{texts:?}");
    let help_text = texts[2..]
        .iter()
        .find(|t| t.starts_with("Commands:"))
        .expect("the /help answer");
    assert!(
        help_text.contains("/stop") && help_text.contains("/new"),
        "{help_text}"
    );
    let c1 = chat
        .store
        .journal_get(first)
        .await
        .unwrap()
        .unwrap()
        .conversation_id;
    let c2 = chat
        .store
        .journal_get(after)
        .await
        .unwrap()
        .unwrap()
        .conversation_id;
    assert_ne!(c1, c2);
    assert_eq!(chat.disposition(help).await.0, Disposition::Command);
}
