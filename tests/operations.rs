//! Operating the daemon: SIGTERM under load, sd_notify to a fake
//! NOTIFY_SOCKET, SIGHUP reloads, Prometheus text that parses and moves,
//! the admin token, what the logs never contain, `purge` and `doctor`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonConfig, Receiver, eventually, open_store, post, post_until_accepted, update,
};

fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the metrics are Prometheus text");
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(ref h) => {
                h.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_stops_in_time_exits_zero_and_loses_or_repeats_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start_with_delay(Duration::from_millis(10)).await;
    let mut config = DaemonConfig::new(receiver.url());
    config.token_delay_ms = 2;
    config.extra = "[surfaces.webhook]\nmax_queued_inputs = 100000".into();
    let mut daemon = Daemon::start(dir.path(), &config).await;
    let url = daemon.updates_url("main");

    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for chat in 0..8 {
        let (url, stop) = (url.clone(), stop.clone());
        senders.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut accepted = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let body = update(
                    &format!("c{chat}-{n}"),
                    &format!("chat-{chat}"),
                    &format!("m {chat} {n}"),
                );
                // Only what got a 202 counts; 503 while stopping is "later".
                if let Some((status, _)) = post(&client, &url, &body).await
                    && status.as_u16() == 202
                {
                    accepted.push(body);
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            accepted
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let asked = Instant::now();
    // shutdown.grace_secs = 5, force_secs = 2 in the test config.
    let code = daemon.terminate(Duration::from_secs(7 + 3));
    let took = asked.elapsed();
    stop.store(true, Ordering::SeqCst);
    assert_eq!(
        code,
        Some(0),
        "SIGTERM must exit 0; log:\n{}",
        daemon.logs()
    );
    assert!(took < Duration::from_secs(7), "took {took:?}");
    assert!(
        daemon.logs().contains("shutdown settled") || daemon.logs().contains("shutdown timed out")
    );

    let mut accepted = Vec::new();
    for s in senders {
        accepted.extend(s.await.unwrap());
    }
    assert!(accepted.len() > 50, "too little load: {}", accepted.len());
    daemon.spawn().await;
    let want: std::collections::BTreeSet<String> = accepted
        .iter()
        .map(|b| format!("echo: {}", b["text"].as_str().unwrap()))
        .collect();
    let all = eventually(Duration::from_secs(60), || async {
        let got: std::collections::BTreeSet<String> = receiver
            .deliveries()
            .into_iter()
            .map(|d| d.body.text)
            .collect();
        want.is_subset(&got)
    })
    .await;
    assert!(all, "an accepted message was lost across the restart");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut per_text: BTreeMap<String, usize> = BTreeMap::new();
    for (_, deliveries) in receiver.by_key() {
        *per_text.entry(deliveries[0].body.text.clone()).or_default() += 1;
    }
    let twice: Vec<_> = per_text.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "answered under two reply keys: {twice:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_manager_hears_ready_then_watchdog_then_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let receiver = Receiver::start().await;
    let mut daemon = Daemon::start_with_env(
        dir.path(),
        &DaemonConfig::new(receiver.url()),
        vec![
            ("NOTIFY_SOCKET".into(), socket_path.display().to_string()),
            ("WATCHDOG_USEC".into(), "400000".into()),
        ],
    )
    .await;
    let mut seen: Vec<String> = Vec::new();
    let read_until = |seen: &mut Vec<String>, want: &str, timeout: Duration| {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = socket.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                for line in text.lines() {
                    seen.push(line.to_owned());
                }
                if seen.iter().any(|l| l == want) {
                    return true;
                }
            }
        }
        false
    };
    assert!(
        read_until(&mut seen, "READY=1", Duration::from_secs(10)),
        "{seen:?}"
    );
    assert!(
        read_until(&mut seen, "WATCHDOG=1", Duration::from_secs(5)),
        "{seen:?}"
    );
    // Pings keep coming while the loops run (every half interval).
    let before = seen.iter().filter(|l| *l == "WATCHDOG=1").count();
    std::thread::sleep(Duration::from_millis(900));
    let mut buf = [0u8; 4096];
    socket.set_nonblocking(true).unwrap();
    while let Ok(n) = socket.recv(&mut buf) {
        seen.extend(
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .map(str::to_owned),
        );
    }
    socket.set_nonblocking(false).unwrap();
    assert!(
        seen.iter().filter(|l| *l == "WATCHDOG=1").count() >= before + 2,
        "{seen:?}"
    );
    daemon.signal("TERM");
    assert!(
        read_until(&mut seen, "STOPPING=1", Duration::from_secs(10)),
        "{seen:?}"
    );
    let position = |what: &str| seen.iter().position(|l| l == what).unwrap();
    assert!(position("READY=1") < position("WATCHDOG=1"));
    assert!(position("WATCHDOG=1") < position("STOPPING=1"));
    assert!(
        seen.iter().any(|l| l.starts_with("STATUS=ready:")),
        "{seen:?}"
    );
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_changes_a_surface_policy_and_the_log_level_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.token_delay_ms = 150;
    config.extra = "[surfaces.webhook]\ninput_policy = \"queue\"".into();
    let daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    let url = daemon.updates_url("main");
    let long = "one two three four five six seven eight nine ten eleven twelve";

    let send = |id: &str, text: &str| {
        let (client, url) = (client.clone(), url.clone());
        let body = update(id, "alice", text);
        async move { post_until_accepted(&client, &url, &body, Duration::from_secs(10)).await }
    };
    let answered = |text: String| {
        let receiver = &receiver;
        async move {
            eventually(Duration::from_secs(30), || async {
                receiver
                    .deliveries()
                    .iter()
                    .any(|d| d.body.text.starts_with(&text))
            })
            .await
        }
    };
    // queue: the first answer finishes before the second is answered.
    send("a1", long).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    send("b1", "next").await;
    assert!(answered("echo: next".into()).await);
    let first = receiver
        .deliveries()
        .into_iter()
        .find(|d| d.body.text.starts_with("echo: one"))
        .unwrap();
    assert_eq!(first.body.text, format!("echo: {long}"));

    // The same file with interrupt, and a changed key that needs a restart.
    let text = std::fs::read_to_string(&daemon.config_path)
        .unwrap()
        .replace("input_policy = \"queue\"", "input_policy = \"interrupt\"")
        .replace("level = \"info\"", "level = \"debug\"")
        .replace("backoff_base_ms = 50", "backoff_base_ms = 60");
    std::fs::write(&daemon.config_path, text).unwrap();
    daemon.signal("HUP");
    assert!(
        eventually(Duration::from_secs(10), || async {
            daemon.logs().contains("configuration reloaded")
        })
        .await
    );
    let logs = daemon.logs();
    let reload_line = logs
        .lines()
        .find(|l| l.contains("configuration reloaded"))
        .unwrap();
    assert!(
        reload_line.contains("surfaces.webhook") && reload_line.contains("log.level"),
        "{reload_line}"
    );
    assert!(
        logs.contains("take effect only after a restart") && logs.contains("outbox"),
        "{logs}"
    );

    // interrupt: the running answer is cut off by the next message.
    send("a2", long).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    send("b2", "again").await;
    assert!(answered("echo: again".into()).await);
    let cut = receiver
        .deliveries()
        .into_iter()
        .rfind(|d| d.body.text.starts_with("echo: one"))
        .unwrap();
    assert!(
        cut.body.text.ends_with("[interrupted]"),
        "{}",
        cut.body.text
    );
    // The log level changed too: debug lines appear now.
    assert!(
        daemon.logs().contains("DEBUG"),
        "debug logging did not start"
    );

    // A broken file keeps the running configuration.
    std::fs::write(&daemon.config_path, "this is not toml [").unwrap();
    daemon.signal("HUP");
    assert!(
        eventually(Duration::from_secs(10), || async {
            daemon.logs().contains("keeping the running one")
        })
        .await
    );
    send("c", "still fine").await;
    assert!(answered("echo: still fine".into()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_move_the_admin_token_guards_and_logs_keep_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    let token = "an-admin-token-of-some-length";
    config.channel_extra = "secret = \"webhook-secret-9f8e7d\"".into();
    let daemon = Daemon::start_with_env(
        dir.path(),
        &config,
        vec![("SWITCHBOARD__ADMIN__TOKEN".into(), token.into())],
    )
    .await;
    let client = reqwest::Client::new();
    let admin = format!("http://{}", daemon.admin);

    // /healthz is open; everything else needs the token.
    assert_eq!(
        client
            .get(format!("{admin}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        client
            .get(format!("{admin}/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let scrape = || async {
        client
            .get(format!("{admin}/metrics"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let before = scrape().await;
    let received = |t: &str| metric(t, "switchboard_updates_received_total", &[]);
    let submitted = |t: &str| metric(t, "switchboard_submission_duration_seconds_count", &[]);
    let ready = client
        .get(format!("{admin}/readyz"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let ready: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(ready["store"]["state"], "up");
    assert_eq!(ready["runtimes"]["default"]["state"], "up");

    let secret_text = "the-private-words-of-alice";
    let request = client
        .post(daemon.updates_url("main"))
        .header("X-Switchboard-Secret", "webhook-secret-9f8e7d")
        .json(&update("u1", "alice", secret_text))
        .send()
        .await
        .unwrap();
    assert_eq!(request.status(), 202);
    assert!(receiver.wait_for_keys(1, Duration::from_secs(10)).await);
    // The receiver has the reply before the dispatcher records the ack.
    let acked = |text: &str| {
        metric(
            text,
            "switchboard_outbox_sends_total",
            &[("outcome", "acknowledged")],
        ) >= 1.0
    };
    let mut after = scrape().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !acked(&after) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = scrape().await;
    }
    assert_eq!(received(&after) - received(&before), 1.0, "{after}");
    assert!(submitted(&after) > submitted(&before), "{after}");
    assert!(acked(&after), "{after}");

    // At info level, neither secrets nor what users said reach the log.
    let logs = daemon.logs();
    for never in ["webhook-secret-9f8e7d", token, secret_text] {
        assert!(!logs.contains(never), "{never:?} is in the log:\n{logs}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_removes_a_conversation_and_its_tombstones_keep_duplicates_out() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.token_delay_ms = 100;
    let daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    let url = daemon.updates_url("main");
    let first = post_until_accepted(
        &client,
        &url,
        &update("p1", "bob", "my address is 1 Main St"),
        Duration::from_secs(10),
    )
    .await;
    let conversation = first["conversation_id"].as_i64().unwrap().to_string();

    // While its run is active, a purge is refused and says why.
    let busy = daemon.cli(&["purge", "conversation", &conversation]);
    assert_eq!(busy.status.code(), Some(3), "{busy:?}");
    assert!(String::from_utf8_lossy(&busy.stderr).contains("/stop"));

    assert!(receiver.wait_for_keys(1, Duration::from_secs(20)).await);
    let store = open_store(dir.path()).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            store.runs_unfinished(0, 10).await.unwrap().is_empty()
        })
        .await
    );
    let done = daemon.cli(&["purge", "conversation", &conversation]);
    assert!(done.status.success(), "{done:?}");
    let row = store
        .journal_get(first["inbound_id"].as_i64().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.payload, row.sender_id), (None, None));
    // The same update again is a duplicate of the tombstone: nothing new.
    let (status, again) = post(
        &client,
        &url,
        &update("p1", "bob", "my address is 1 Main St"),
    )
    .await
    .unwrap();
    assert_eq!(status.as_u16(), 202);
    assert_eq!(again["status"], "duplicate");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.distinct_keys(), 1);
    let missing = daemon.cli(&["purge", "conversation", "99999"]);
    assert_eq!(missing.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_the_bot_and_fails_on_readable_secrets() {
    let fake = switchboard_fakes::telegram::FakeTelegram::start().await;
    fake.add_bot("4242:doctor-token", 4242, "doctor_bot");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("telegram-token");
    std::fs::write(&token_file, "4242:doctor-token\n").unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut config = DaemonConfig::new("http://127.0.0.1:9/unused".into());
    config.extra = format!(
        "[channels.tg]\nkind = \"telegram\"\nruntime = \"default\"\ntoken_file = \"{}\"\napi_url = \"{}\"\n",
        token_file.display(),
        fake.url()
    );
    let path = dir.path().join("switchboard.toml");
    std::fs::write(&path, config.render(dir.path())).unwrap();
    let doctor = |path: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_switchboard"))
            .args(["doctor", "--config"])
            .arg(path)
            .output()
            .unwrap()
    };
    let out = tokio::task::spawn_blocking({
        let path = path.clone();
        move || doctor(&path)
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("PASS channel tg") && text.contains("@doctor_bot"),
        "{text}"
    );
    assert!(
        text.contains("FAIL channels.tg.token_file") && text.contains("chmod 600"),
        "{text}"
    );
    assert!(
        text.contains("PASS store") && text.contains("PASS admin"),
        "{text}"
    );
    assert!(
        !text.contains("doctor-token"),
        "the token was printed: {text}"
    );

    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = tokio::task::spawn_blocking(move || doctor(&path))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
