//! The product's scenarios.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use switchboard::clock::{SharedClock, SystemClock};
use switchboard::config::{OutboxConfig, StoreConfig, Synchronous};
use switchboard::observe::Observer;
use switchboard::outbox::ChatLocks;
use switchboard::outbox::dispatcher::Dispatcher;
use switchboard::outbox::rate::RateLimiter;
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{self, ItemKind, NewOutboxItem, SharedStore};
use switchboard::surface::SurfaceKind;
use switchboard_channel::ChannelAdapter;
use switchboard_webhook::WebhookSender;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::Scale;
use crate::report::Report;

/// A loopback HTTP receiver that answers every callback 200 and counts.
pub struct Sink {
    pub url: String,
    pub received: Arc<AtomicUsize>,
}

pub async fn start_sink() -> anyhow::Result<Sink> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let received = Arc::new(AtomicUsize::new(0));
    let counter = received.clone();
    let app = axum::Router::new().route(
        "/replies",
        axum::routing::post(move |_body: axum::body::Bytes| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(Sink {
        url: format!("http://{addr}/replies"),
        received,
    })
}

pub async fn open_store(dir: &std::path::Path) -> anyhow::Result<SharedStore> {
    Ok(store::open(
        &StoreConfig {
            url: format!("sqlite://{}", dir.join("bench.db").display()),
            synchronous: Synchronous::Full,
            batch_size: 512,
            ..Default::default()
        },
        OpenMode::Daemon,
    )
    .await?)
}

const TEXT: &str =
    "a reply of about one hundred bytes, the size of a short chat answer, used by every scenario";

/// One drain of a backlog of `items` reply items across `conversations`
/// to a loopback sink through the real dispatcher and webhook adapter.
async fn drain_once(items: usize, conversations: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let store = open_store(dir.path()).await?;
    let sink = start_sink().await?;
    let account = "webhook:bench";
    let backlog: Vec<NewOutboxItem> = (0..items)
        .map(|i| NewOutboxItem {
            item_key: format!("bench-{i}"),
            conversation_id: (i % conversations) as i64 + 1,
            account: account.to_owned(),
            chat_id: format!("chat-{}", i % conversations),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
            run_id: None,
            kind: ItemKind::Answer,
            text: TEXT.to_owned(),
            group_key: None,
            edits_key: None,
            attachments: Vec::new(),
            created_at: 0,
        })
        .collect();
    for chunk in backlog.chunks(2_000) {
        store.outbox_enqueue(chunk).await?;
    }
    let adapter: Arc<dyn ChannelAdapter> = Arc::new(WebhookSender::new(
        account.to_owned(),
        reqwest::Url::parse(&sink.url)?,
        Duration::from_secs(10),
        65_536,
    )?);
    let adapters: HashMap<String, Arc<dyn ChannelAdapter>> =
        [(account.to_owned(), adapter)].into_iter().collect();
    let clock: SharedClock = Arc::new(SystemClock);
    let dispatcher = Dispatcher::new(
        store.clone(),
        adapters,
        Arc::new(RateLimiter::new(HashMap::new())),
        Arc::new(ChatLocks::default()),
        OutboxConfig::default(),
        clock,
        Arc::new(Observer::new()),
        Arc::new(Notify::new()),
        "bench".to_owned(),
    );
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = {
        let stop = stop.clone();
        tokio::spawn(async move { dispatcher.run(stop, std::future::pending()).await })
    };
    loop {
        if sink.received.load(Ordering::Relaxed) >= items {
            let stats = store.outbox_stats().await?;
            if stats.not_dispatched == 0 && stats.possibly_dispatched == 0 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    stop.cancel();
    let _ = task.await;
    store.close().await;
    Ok(items as f64 / elapsed.as_secs_f64())
}

pub async fn dispatch(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let mut samples = Vec::new();
    for rep in 0..scale.reps {
        let rate = drain_once(scale.dispatch_items, scale.dispatch_conversations).await?;
        eprintln!(
            "  dispatch run {}/{}: {rate:.0} items/s",
            rep + 1,
            scale.reps
        );
        samples.push(rate);
    }
    report.add(
        "dispatch",
        "backlog drained",
        "items/s",
        samples,
        &format!(
            "{} items, {} conversations, loopback HTTP sink",
            scale.dispatch_items, scale.dispatch_conversations
        ),
    );
    Ok(())
}
