//! The outbox against a callback receiver that refuses: NotSent is retried
//! with backoff and counted, RetryAfter waits without counting, Permanent
//! fails the item with its reason and releases the lane.

mod common;

use std::time::Duration;

use common::{Daemon, DaemonConfig, Receiver, post, update};
use reqwest::StatusCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_callbacks_are_retried_or_failed_by_kind() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let daemon = Daemon::start(dir.path(), &DaemonConfig::new(receiver.url())).await;
    let url = daemon.updates_url("main");
    let client = reqwest::Client::new();

    // Two 5xx (NotSent) and a 429 (RetryAfter), then success.
    receiver.fail_next(vec![
        StatusCode::INTERNAL_SERVER_ERROR,
        StatusCode::SERVICE_UNAVAILABLE,
        StatusCode::TOO_MANY_REQUESTS,
    ]);
    post(&client, &url, &update("a", "chat", "first"))
        .await
        .unwrap();
    assert!(
        receiver.wait_for_keys(1, Duration::from_secs(20)).await,
        "{}",
        daemon.logs()
    );

    // A 410 is permanent: the item fails with the reason, and the next
    // message of the same chat still goes out.
    receiver.fail_next(vec![StatusCode::GONE]);
    post(&client, &url, &update("b", "chat", "second"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    post(&client, &url, &update("c", "chat", "third"))
        .await
        .unwrap();
    assert!(
        receiver.wait_for_keys(2, Duration::from_secs(20)).await,
        "{}",
        daemon.logs()
    );

    let texts: Vec<String> = receiver
        .deliveries()
        .into_iter()
        .map(|d| d.body.text)
        .collect();
    assert_eq!(texts, ["echo: first", "echo: third"]);

    let out = daemon.cli(&["outbox", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    let line = |text: &str| {
        table
            .lines()
            .find(|l| l.contains(text))
            .unwrap_or_default()
            .to_owned()
    };
    let first = line("echo: first");
    assert!(first.contains("acknowledged"), "{table}");
    // Two NotSent attempts counted; the 429 was not.
    assert!(
        first.split_whitespace().nth(4) == Some("2"),
        "attempts of the first item:\n{table}"
    );
    let second = line("echo: second");
    assert!(
        second.contains("failed") && second.contains("callback answered 410 Gone"),
        "{table}"
    );

    let metrics = daemon.metrics().await;
    assert!(
        metrics.contains(
            "switchboard_outbox_sends_total{account=\"webhook:main\",outcome=\"not_sent\"} 2"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "switchboard_outbox_sends_total{account=\"webhook:main\",outcome=\"retry_after\"} 1"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "switchboard_outbox_sends_total{account=\"webhook:main\",outcome=\"failed\"} 1"
        ),
        "{metrics}"
    );
}
