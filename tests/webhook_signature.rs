//! Signed reply callbacks: every POST carries a timestamp and an
//! HMAC-SHA256 over "<timestamp>.<body>", checked here with an independent
//! implementation (ring), as a receiver following docs/webhook-channel.md
//! would.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use common::{Daemon, DaemonConfig, post_until_accepted, update};

const KEY: &str = "a-long-signing-key-for-tests";

type Seen = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

async fn capture(State(seen): State<Seen>, headers: HeaderMap, body: Bytes) -> &'static str {
    seen.lock().unwrap().push((headers, body));
    "ok"
}

/// The receiver's check from docs/webhook-channel.md.
fn verify(key: &[u8], headers: &HeaderMap, body: &[u8], max_age: u64) -> bool {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (ts, sig) = (
        header("x-switchboard-timestamp"),
        header("x-switchboard-signature"),
    );
    let Ok(ts_num) = ts.parse::<u64>() else {
        return false;
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if now.abs_diff(ts_num) > max_age {
        return false;
    }
    let Some(hex) = sig.strip_prefix("v1=") else {
        return false;
    };
    let Some(tag) = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
    else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut message = ts.into_bytes();
    message.push(b'.');
    message.extend_from_slice(body);
    ring::hmac::verify(&key, &message, &tag).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_signed_and_forgeries_and_replays_fail_the_documented_check() {
    let seen: Seen = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/replies", post(capture))
        .with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let mut config = DaemonConfig::new(format!("http://{addr}/replies"));
    config.channel_extra = format!("callback_signing_secret = \"{KEY}\"");
    let daemon = Daemon::start(dir.path(), &config).await;
    let client = reqwest::Client::new();
    for i in 0..3 {
        post_until_accepted(
            &client,
            &daemon.updates_url("main"),
            &update(&format!("u{i}"), "alice", &format!("hello {i}")),
            Duration::from_secs(10),
        )
        .await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while seen.lock().unwrap().len() < 3 {
        assert!(std::time::Instant::now() < deadline, "replies never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let requests = seen.lock().unwrap().clone();
    for (headers, body) in &requests {
        assert!(
            verify(KEY.as_bytes(), headers, body, 300),
            "a genuine reply failed verification"
        );
        // A forged body, a wrong key and a replay all fail the same check.
        let mut forged = body.to_vec();
        forged.extend_from_slice(b" ");
        assert!(!verify(KEY.as_bytes(), headers, &forged, 300));
        assert!(!verify(b"another key", headers, body, 300));
        let mut old = headers.clone();
        old.insert("x-switchboard-timestamp", "1000000000".parse().unwrap());
        assert!(!verify(KEY.as_bytes(), &old, body, 300));
    }
}
