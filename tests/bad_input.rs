//! Bad input gets a clear 4xx naming the problem, is counted where an
//! operator can see it, and never affects the messages around it
//! (DESIGN.md promise 9).

mod common;

use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, post, update};
use reqwest::StatusCode;

async fn raw(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    secret: Option<&str>,
) -> (StatusCode, serde_json::Value) {
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(secret) = secret {
        request = request.header("x-switchboard-secret", secret);
    }
    let response = request.send().await.unwrap();
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    (status, response.json().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_good_ones_around_them_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let mut config = DaemonConfig::new(receiver.url());
    config.channel_extra = r#"secret = "s3cret""#.into();
    let daemon = Daemon::start(dir.path(), &config).await;
    let url = daemon.updates_url("main");
    let client = reqwest::Client::new();
    let good = |n: usize| {
        serde_json::to_vec(&update(&format!("good-{n}"), "chat", &format!("good {n}"))).unwrap()
    };

    let mut good_sent = 0;
    let send_good = async |good_sent: &mut usize| {
        let (status, body) = raw(&client, &url, good(*good_sent), Some("s3cret")).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        *good_sent += 1;
    };

    send_good(&mut good_sent).await;

    // Malformed JSON.
    let (status, body) = raw(
        &client,
        &url,
        b"{\"update_id\": 1, \"chat\": ".to_vec(),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "malformed_json", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expected JSON like"),
        "{body}"
    );
    send_good(&mut good_sent).await;

    // A missing field is named.
    let (status, body) = raw(
        &client,
        &url,
        br#"{"update_id": "x1", "text": "hi"}"#.to_vec(),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "invalid_update");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing field `chat`"),
        "{body}"
    );
    send_good(&mut good_sent).await;

    // A field of the wrong type, and an unknown field, are named.
    let (status, body) = raw(
        &client,
        &url,
        br#"{"update_id": "x2", "chat": {"id": "c"}, "text": 5}"#.to_vec(),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = raw(
        &client,
        &url,
        br#"{"update_id": "x3", "chat": {"id": "c"}, "txt": "hi"}"#.to_vec(),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown field `txt`"),
        "{body}"
    );

    // Over the 1 MiB body limit.
    let huge = serde_json::to_vec(&update("big", "chat", &"x".repeat(1_100_000))).unwrap();
    let (status, body) = raw(&client, &url, huge, Some("s3cret")).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["error"]["code"], "body_too_large", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.body_limit"),
        "{body}"
    );
    send_good(&mut good_sent).await;

    // Without the secret, and with a wrong one.
    let (status, body) = raw(&client, &url, good(999), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["code"], "bad_secret", "{body}");
    let (status, _) = raw(&client, &url, good(999), Some("s3cre")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    send_good(&mut good_sent).await;

    // An account nobody configured.
    let (status, body) = post(
        &client,
        &daemon.updates_url("nobody"),
        &update("n1", "chat", "hi"),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nobody"),
        "{body}"
    );

    // An update without text is journaled and visibly ignored, not dropped.
    let (status, body) = raw(
        &client,
        &url,
        br#"{"update_id": "notext", "chat": {"id": "chat"}}"#.to_vec(),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    send_good(&mut good_sent).await;

    // Every good message is answered, in order, and only those.
    assert!(
        receiver
            .wait_for_keys(good_sent, Duration::from_secs(20))
            .await,
        "{}",
        daemon.logs()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let texts: Vec<String> = receiver
        .deliveries()
        .into_iter()
        .map(|d| d.body.text)
        .collect();
    let expected: Vec<String> = (0..good_sent).map(|n| format!("echo: good {n}")).collect();
    assert_eq!(texts, expected);

    // The operator sees the refusals in the metrics and the log, and the
    // ignored update in the journal with its reason.
    let metrics = daemon.metrics().await;
    for reason in [
        "malformed_json",
        "invalid_update",
        "body_too_large",
        "bad_secret",
    ] {
        assert!(
            metrics.contains(&format!(
                "switchboard_ingress_rejected_total{{account=\"main\",reason=\"{reason}\"}}"
            )),
            "{reason} not counted:\n{metrics}"
        );
    }
    assert!(
        metrics.contains(
            "switchboard_ingress_rejected_total{account=\"(unknown)\",reason=\"unknown_account\"} 1"
        ),
        "{metrics}"
    );
    let logs = daemon.logs();
    assert!(
        logs.contains("request refused") && logs.contains("body_too_large"),
        "{logs}"
    );
    let out = daemon.cli(&["inbound", "list", "--disposition", "ignored"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("notext") && text.contains("the update has no text field"),
        "{text}"
    );
}

#[test]
fn a_bad_config_exits_78_naming_the_key_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        r#"
[runtimes.default]
kind = "local"
model = { backend = "echo" }
[channels.main]
kind = "webhook"
runtime = "missing"
callback_url = "http://127.0.0.1:1/replies"
"#,
    )
    .unwrap();
    for command in ["check", "run"] {
        let out = std::process::Command::new(common::BIN)
            .args([command, "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(78), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("channels.main.runtime"), "{stderr}");
        assert!(stderr.contains("add [runtimes.missing]"), "{stderr}");
    }

    std::fs::write(
        &path,
        "[store]\nurl = \"sqlite://x.db\"\nsynchronus = \"full\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown field `synchronus`") && stderr.contains("key `store`"),
        "{stderr}"
    );

    // An admin API reachable from other machines needs a token; journal
    // keys must outlive platform redeliveries.
    std::fs::write(
        &path,
        r#"
[admin]
listen = "0.0.0.0:8781"
[retention]
journal_days = 2
[runtimes.default]
kind = "local"
model = { backend = "echo" }
[channels.main]
kind = "webhook"
runtime = "default"
callback_url = "http://127.0.0.1:1/replies"
"#,
    )
    .unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("admin.listen") && stderr.contains("admin.token_file"),
        "{stderr}"
    );
    assert!(stderr.contains("retention.journal_days"), "{stderr}");
}
