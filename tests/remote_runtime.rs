//! The `http` runtime connector (docs/runtime-protocol.md) against three
//! servers: a fault-injecting fake (streams dropped mid-run, events
//! repeated, a durable gap, restarts), `switchboard runtime serve` (every
//! input policy), and a Python standard-library runtime written from the
//! protocol document alone (tests/runtime_ref/server.py).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Daemon, DaemonConfig, Receiver, eventually, free_port, post_until_accepted};
use serde_json::{Value, json};
use switchboard_fakes::runtime::FakeRuntime;

const WAIT: Duration = Duration::from_secs(30);

fn http_runtime(url: &str) -> String {
    format!("kind = \"http\"\nbase_url = \"{url}\"\nrequest_timeout_secs = 2")
}

fn message(id: &str, chat: &str, text: &str, policy: Option<&str>) -> Value {
    let mut body = json!({
        "update_id": id,
        "chat": {"id": chat, "kind": "private"},
        "sender": {"id": format!("user-{chat}"), "name": chat},
        "text": text,
    });
    if let Some(policy) = policy {
        body["input_policy"] = json!(policy);
    }
    body
}

/// Answers by chat, in delivery order, one entry per reply key (the last
/// text each key carried).
fn answers(receiver: &Receiver) -> BTreeMap<String, Vec<String>> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for delivery in receiver.deliveries() {
        if seen.insert(delivery.body.reply_key.clone()) {
            out.entry(delivery.body.chat_id.clone())
                .or_default()
                .push(delivery.body.text.clone());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_input_is_answered_once_and_in_order_despite_drops_repeats_gaps_and_restarts() {
    let fake = FakeRuntime::start().await;
    fake.set_delay(Duration::from_millis(40));
    fake.repeat_events(true);
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.runtime = Some(http_runtime(&fake.url()));
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    let url = daemon.updates_url("main");
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut n = 0;
    let mut send = async |chats: usize, per: usize, sent: &mut BTreeMap<String, Vec<String>>| {
        for _ in 0..per {
            for c in 0..chats {
                n += 1;
                let chat = format!("chat-{c}");
                let text = format!("m{n}");
                post_until_accepted(
                    &client,
                    &url,
                    &message(&format!("u{n}"), &chat, &text, None),
                    WAIT,
                )
                .await;
                sent.entry(chat).or_default().push(format!("echo: {text}"));
            }
        }
    };

    // The stream drops after a few lines; one finished event is never
    // streamed (only a re-read after a reconnect finds it).
    fake.drop_stream_after(3);
    fake.hide_next_finished();
    send(3, 4, &mut sent).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    // The runtime restarts while messages keep coming.
    let restart = {
        let fake = fake.clone();
        tokio::spawn(async move { fake.restart(Duration::from_millis(700)).await })
    };
    send(3, 3, &mut sent).await;
    restart.await.unwrap();
    // Switchboard itself is killed and restarted too.
    daemon.kill();
    send_while_down(&sent).await;
    daemon.spawn().await;
    send(3, 3, &mut sent).await;

    let total: usize = sent.values().map(Vec::len).sum();
    let done = eventually(Duration::from_secs(60), || async {
        answers(&receiver).values().map(Vec::len).sum::<usize>() >= total
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = answers(&receiver);
    assert!(done, "answered {got:?}, sent {sent:?}\n{}", daemon.logs());
    assert_eq!(
        got, sent,
        "each input answered exactly once, in order per chat"
    );
    assert!(!fake.hidden_events().is_empty());
    assert!(fake.run_reads() > 0, "awaited runs were never re-read");
    assert!(fake.streams_opened() >= 3, "the stream never reconnected");
    assert_eq!(
        fake.runs(),
        total,
        "one run per input, whatever was retried"
    );
}

/// Nothing to send while the daemon is down (its listener is gone); kept as
/// a named step for readability.
async fn send_while_down(_: &BTreeMap<String, Vec<String>>) {
    tokio::time::sleep(Duration::from_millis(200)).await;
}

struct Served {
    child: Child,
    url: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_healthy(url: &str) {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Ok(r) = reqwest::get(format!("{url}/v1/health")).await
            && r.status().is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    panic!("the runtime server at {url} never became healthy");
}

async fn serve(dir: &Path, token_delay_ms: u64) -> Served {
    let port = free_port();
    let config = format!(
        r#"
[store]
url = "sqlite://{}"
[runtimes.echo]
kind = "local"
model = {{ backend = "echo", token_delay_ms = {token_delay_ms} }}
[serve]
listen = "127.0.0.1:{port}"
runtime = "echo"
"#,
        dir.join("served.db").display()
    );
    let path = dir.join("serve.toml");
    std::fs::write(&path, config).unwrap();
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let child = Command::new(BIN)
        .args(["runtime", "serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url).await;
    Served { child, url }
}

/// Each input policy, through the connector, against the built-in runtime
/// served over the protocol.
async fn policies_against(url: &str, dir: &Path) {
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.runtime = Some(http_runtime(url));
    let daemon = Daemon::start(dir, &config).await;
    let client = reqwest::Client::new();
    let updates = daemon.updates_url("main");
    let long = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen";
    let post =
        |id: String, chat: &'static str, text: &'static str, policy: Option<&'static str>| {
            let (client, updates) = (client.clone(), updates.clone());
            async move {
                post_until_accepted(&client, &updates, &message(&id, chat, text, policy), WAIT)
                    .await;
            }
        };
    // Let the long answer start before the next input arrives.
    let pause = || tokio::time::sleep(Duration::from_millis(500));

    post("q1".into(), "queue", long, None).await;
    pause().await;
    post("q2".into(), "queue", "after", Some("queue")).await;

    post("i1".into(), "interrupt", long, None).await;
    pause().await;
    post("i2".into(), "interrupt", "cut in", Some("interrupt")).await;

    post("n1".into(), "next", long, None).await;
    post("n2".into(), "next", "ordinary", Some("queue")).await;
    pause().await;
    post("n3".into(), "next", "urgent", Some("interrupt-next")).await;

    post("s1".into(), "supersede", long, None).await;
    pause().await;
    post("s2".into(), "supersede", "instead", Some("supersede")).await;

    post("j1".into(), "inject", long, None).await;
    pause().await;
    post("j2".into(), "inject", "also this", Some("inject")).await;

    let expect: [(&str, usize); 5] = [
        ("queue", 2),
        ("interrupt", 2),
        ("next", 3),
        ("supersede", 1),
        ("inject", 1),
    ];
    let complete = eventually(Duration::from_secs(60), || async {
        let got = answers(&receiver);
        expect
            .iter()
            .all(|(chat, n)| got.get(*chat).map_or(0, Vec::len) >= *n)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let got = answers(&receiver);
    assert!(complete, "{got:#?}\n{}", daemon.logs());
    let marker = "[interrupted]";
    // queue: the long answer whole, then the next.
    assert_eq!(
        got["queue"],
        [format!("echo: {long}"), "echo: after".into()]
    );
    // interrupt: the long answer cut and marked, then the new input.
    assert!(
        got["interrupt"][0].ends_with(marker),
        "{:?}",
        got["interrupt"]
    );
    assert!(got["interrupt"][0].len() < format!("echo: {long}").len() + marker.len());
    assert_eq!(got["interrupt"][1], "echo: cut in");
    // interrupt-next: cut, then the urgent input before the ordinary one.
    assert!(got["next"][0].ends_with(marker), "{:?}", got["next"]);
    assert_eq!(&got["next"][1..], ["echo: urgent", "echo: ordinary"]);
    // supersede: the long answer never shows (terminal-only surface).
    assert_eq!(got["supersede"], ["echo: instead"]);
    // inject: one answer that covers both inputs.
    assert_eq!(got["inject"].len(), 1, "{:?}", got["inject"]);
    assert!(
        got["inject"][0].contains("also this"),
        "{:?}",
        got["inject"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_input_policy_works_against_switchboard_runtime_serve() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve(dir.path(), 150).await;
    let daemon_dir = tempfile::tempdir().unwrap();
    policies_against(&served.url, daemon_dir.path()).await;
}

/// The Python reference runtime, or `None` (with a note) where there is no
/// python3: CI always has one.
async fn python_runtime(dir: &Path, port: u16, word_delay_ms: u64) -> Option<Served> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/runtime_ref/server.py");
    let mut child = match Command::new("python3")
        .arg(&script)
        .args([
            "--port",
            &port.to_string(),
            "--word-delay-ms",
            &word_delay_ms.to_string(),
            "--state-file",
        ])
        .arg(dir.join("ref-state.json"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            eprintln!(
                "python3 is not available ({e}); the reference-runtime test needs it (.ci/run installs it)"
            );
            return None;
        }
    };
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        line.starts_with("LISTENING"),
        "unexpected first line {line:?}"
    );
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url).await;
    Some(Served { child, url })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_written_from_the_protocol_document_alone_passes_the_connector_tests() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let Some(reference) = python_runtime(dir.path(), port, 150).await else {
        return;
    };
    let daemon_dir = tempfile::tempdir().unwrap();
    policies_against(&reference.url, daemon_dir.path()).await;
    drop(reference);

    // Killed mid-run and restarted on its state file: every input still
    // answered exactly once.
    let Some(reference) = python_runtime(dir.path(), port, 30).await else {
        return;
    };
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.runtime = Some(http_runtime(&reference.url));
    let daemon_dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(daemon_dir.path(), &config).await;
    let client = reqwest::Client::new();
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..6 {
        let chat = format!("k{}", i % 2);
        let text = format!("alpha beta gamma {i}");
        post_until_accepted(
            &client,
            &daemon.updates_url("main"),
            &message(&format!("r{i}"), &chat, &text, None),
            WAIT,
        )
        .await;
        sent.entry(chat).or_default().push(format!("echo: {text}"));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(reference);
    let _reference = python_runtime(dir.path(), port, 30).await.unwrap();
    let total: usize = sent.values().map(Vec::len).sum();
    let done = eventually(Duration::from_secs(60), || async {
        answers(&receiver).values().map(Vec::len).sum::<usize>() >= total
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = answers(&receiver);
    assert!(done, "{got:?}\n{}", daemon.logs());
    assert_eq!(got, sent);
}
