//! `switchboard demo`: the whole loop in one process, on a temporary SQLite
//! file, with no tokens and no network beyond loopback.
//!
//! It starts the daemon with a webhook channel account whose callback URL
//! is a small receiver inside this process, posts a handful of updates (one
//! of them twice, as a platform redelivering it would), prints every step as
//! it happens, then prints the journal and the outbox and exits 0 when every
//! distinct message got exactly one reply.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use switchboard_webhook::CallbackBody;

use crate::cli;
use crate::config::Config;
use crate::daemon::Daemon;
use crate::observe::Event;

/// What the demo posts: (update id, chat, chat kind, sender, text).
const UPDATES: &[(&str, &str, &str, &str, &str)] = &[
    ("u1", "alice", "private", "Alice", "hello"),
    ("u2", "bob", "private", "Bob", "good morning"),
    (
        "u3",
        "alice",
        "private",
        "Alice",
        "how does the outbox work?",
    ),
    // The platform did not see our 202 for u1 and sends it again.
    ("u1", "alice", "private", "Alice", "hello"),
    ("u4", "team", "group", "Carol", "ship it"),
    ("u5", "bob", "private", "Bob", "thanks!"),
];

type Received = Arc<Mutex<Vec<CallbackBody>>>;

pub async fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let receiver = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the demo's callback receiver")?;
    let receiver_addr = receiver.local_addr()?;
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/replies", post(receive))
        .with_state((received.clone(), started));
    tokio::spawn(async move {
        let _ = axum::serve(receiver, app).await;
    });

    let db = dir.path().join("switchboard.db");
    let config = Config::from_toml(&format!(
        r#"
        [store]
        url = "sqlite://{db}"
        [server]
        listen = "127.0.0.1:0"
        [admin]
        listen = "127.0.0.1:0"
        [runtimes.default]
        kind = "local"
        model = {{ backend = "echo" }}
        [channels.demo]
        kind = "webhook"
        runtime = "default"
        callback_url = "http://{receiver_addr}/replies"
        "#,
        db = db.display()
    ))
    .context("the demo's built-in config")?;

    println!("Switchboard demo");
    println!(
        "  store:    {} (temporary SQLite file, synchronous=FULL)",
        db.display()
    );
    let daemon = Daemon::start(config).await?;
    println!(
        "  ingress:  http://{}/v1/channels/demo/updates",
        daemon.ingress_addr
    );
    println!("  callback: http://{receiver_addr}/replies (a receiver inside this process)");
    println!("  runtime:  built-in, echo model\n");

    let mut events = daemon.observer.subscribe();
    let printer = tokio::spawn(async move {
        while let Ok(event) = events.recv().await {
            print_event(started, &event);
        }
    });

    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/channels/demo/updates", daemon.ingress_addr);
    let mut distinct = BTreeMap::new();
    let mut duplicates_reported = 0;
    let first_post = Instant::now();
    for (update_id, chat, kind, sender, text) in UPDATES {
        let body = serde_json::json!({
            "update_id": update_id,
            "chat": { "id": chat, "kind": kind },
            "sender": { "id": sender.to_lowercase(), "name": sender },
            "text": text,
        });
        let response = client.post(&url).json(&body).send().await?;
        let status = response.status();
        let answer: serde_json::Value = response.json().await?;
        println!(
            "{:>7}  POST     update {update_id} from {sender} in {chat:?}: {text:?} → {status} {}",
            elapsed(started),
            answer
        );
        if answer["status"] == "duplicate" {
            duplicates_reported += 1;
        }
        distinct.insert(*update_id, *text);
        // Let the steps of one update show before the next one starts.
        tokio::time::sleep(Duration::from_millis(40)).await;
    }

    let deadline = Instant::now() + Duration::from_secs(10);
    while received.lock().unwrap_or_else(|p| p.into_inner()).len() < distinct.len() {
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let delivered_at = first_post.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;

    println!("\nJournal (switchboard inbound list):");
    print!("{}", cli::inbound_list(&daemon.store, None, 50).await?);
    println!("\nOutbox (switchboard outbox list):");
    print!("{}", cli::outbox_list(&daemon.store, None, None, 50).await?);

    let replies = received.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &replies {
        *per_key.entry(r.reply_key.as_str()).or_default() += 1;
    }
    let report = daemon.shutdown().await;
    printer.abort();

    println!("\nFigures:");
    println!("  updates posted:          {}", UPDATES.len());
    println!("  distinct messages:       {}", distinct.len());
    println!("  reported as duplicate:   {duplicates_reported}");
    println!(
        "  replies received:        {} ({} distinct reply keys)",
        replies.len(),
        per_key.len()
    );
    println!(
        "  first post → last reply: {} ms (the demo waits 40 ms between posts)",
        delivered_at.as_millis()
    );
    println!(
        "  shutdown:                {} in {} ms",
        if report.settled {
            "settled"
        } else {
            "timed out"
        },
        report.took.as_millis()
    );

    if per_key.len() != distinct.len() || replies.len() != distinct.len() {
        bail!(
            "expected exactly one reply per distinct message ({}), got {} replies under {} keys",
            distinct.len(),
            replies.len(),
            per_key.len()
        );
    }
    if duplicates_reported != UPDATES.len() - distinct.len() {
        bail!("the redelivered update was not reported as a duplicate");
    }
    println!("\nOK: one reply per distinct message; the redelivery was recognised as a duplicate.");
    Ok(())
}

async fn receive(
    State((received, started)): State<(Received, Instant)>,
    Json(body): Json<CallbackBody>,
) -> &'static str {
    println!(
        "{:>7}  RECEIVE  reply {} for chat {:?} (conversation {}, #{}): {:?}",
        elapsed(started),
        body.reply_key,
        body.chat_id,
        body.conversation_id,
        body.ordinal,
        body.text
    );
    received
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(body);
    "ok"
}

fn elapsed(started: Instant) -> String {
    format!("+{}ms", started.elapsed().as_millis())
}

fn print_event(started: Instant, event: &Event) {
    let at = elapsed(started);
    let line = match event {
        Event::Stored {
            update_key,
            inbound_id,
            conversation_id,
            ..
        } => format!(
            "stored   update {update_key} as inbound #{inbound_id} in conversation {conversation_id} (committed before the 202)"
        ),
        Event::Deduplicated {
            update_key,
            inbound_id,
            ..
        } => format!(
            "dedup    update {update_key} is already inbound #{inbound_id}; nothing new stored, no second run"
        ),
        Event::Settled {
            inbound_id,
            disposition,
            reason,
        } => format!("settled  inbound #{inbound_id}: {disposition} ({reason})"),
        Event::Admitted {
            inbound_id,
            run_id,
            new_run,
        } => format!(
            "admitted inbound #{inbound_id} → run {run_id}{}",
            if *new_run { "" } else { " (existing run)" }
        ),
        Event::Answered { run_id, state, .. } => {
            format!(
                "answered run {run_id} {state}; its reply item was written in the same transaction"
            )
        }
        Event::Delivered {
            item_key,
            conversation_id,
            ordinal,
        } => {
            format!("acked    {item_key} (conversation {conversation_id}, #{ordinal}) acknowledged")
        }
        Event::SendFailed {
            item_key,
            kind,
            detail,
        } => format!("send     {item_key}: {kind}: {detail}"),
        Event::Reconciled { item_key, action } => format!("reconcile {item_key}: {action}"),
        Event::Occurrence {
            schedule_id,
            key,
            outcome,
        } => format!("schedule {schedule_id}: {key} {outcome}"),
        Event::Fenced { item_key } => {
            format!("fenced   {item_key}: a stale worker's outcome was rejected")
        }
    };
    println!("{at:>7}  {line}");
}
