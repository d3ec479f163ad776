//! The peer: apalis 1.0 with its SQLite storage (apalis-sqlite 1.0),
//! enqueueing and processing the same number of jobs as our dispatch
//! drains, with the same payload, the same work per job (one POST to a
//! loopback HTTP sink) and the same SQLite durability (WAL,
//! `synchronous=FULL`).
//!
//! apalis-sqlite's own `SqliteStorage::setup` sets `synchronous = OFF` on
//! the connection it runs on; it is not used here. The pool's connections
//! are opened with WAL and FULL, and the storage's migrations are applied
//! directly, so every commit is on disk before it returns, as ours are.

use std::str::FromStr;
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_sqlite::{Config, SqliteStorage};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use crate::Scale;
use crate::report::Report;
use crate::scenarios::start_sink;

const PAYLOAD: &str =
    "a reply of about one hundred bytes, the size of a short chat answer, used by every scenario";

/// In-flight jobs, as many as our dispatcher's default concurrency.
const CONCURRENCY: usize = 128;

#[derive(Clone)]
struct Http {
    client: reqwest::Client,
    url: String,
}

async fn deliver(payload: String, http: Data<Http>) -> Result<(), BoxDynError> {
    let response = http.client.post(&http.url).body(payload).send().await?;
    if !response.status().is_success() {
        return Err(format!("sink answered {}", response.status()).into());
    }
    Ok(())
}

struct PeerRun {
    enqueue_per_s: f64,
    process_per_s: f64,
}

async fn run_once(jobs: usize) -> anyhow::Result<PeerRun> {
    let dir = tempfile::tempdir_in(crate::scratch_dir())?;
    let options = SqliteConnectOptions::from_str("sqlite://")?
        .filename(dir.path().join("apalis.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    SqliteStorage::migrations().run(&pool).await?;
    let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&pool)
        .await?;
    anyhow::ensure!(sync == 2, "the peer's connection is not synchronous=FULL");

    let sink = start_sink().await?;
    // apalis-sqlite's defaults (batches of 10); `BENCH_APALIS_BATCH=N`
    // tries another batch size.
    let mut config = Config::default().queue("bench");
    if let Some(n) = std::env::var("BENCH_APALIS_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config = config.batch_size(n);
    }
    let mut storage = SqliteStorage::<String>::new(&pool).with_config(config);

    let started = Instant::now();
    storage
        .push_bulk(vec![PAYLOAD.to_owned(); jobs])
        .await
        .map_err(|e| anyhow::anyhow!("apalis push: {e:?}"))?;
    let enqueued = started.elapsed();

    let http = Http {
        client: reqwest::Client::new(),
        url: sink.url.clone(),
    };
    let worker = WorkerBuilder::new("bench-peer")
        .backend(storage)
        .data(http)
        .concurrency(CONCURRENCY)
        .build(deliver);
    let done_pool = pool.clone();
    let started = Instant::now();
    let run = tokio::spawn(worker.run_with_ctx(move |ctx| {
        let done_pool = done_pool.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(600);
            loop {
                let done: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM Jobs WHERE status = 'Done'")
                        .fetch_one(&done_pool)
                        .await
                        .unwrap_or(0);
                if done as usize >= jobs || Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ctx.stop()?;
            Ok(())
        }
    }));
    let mut elapsed = None;
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM Jobs WHERE status = 'Done'")
            .fetch_one(&pool)
            .await?;
        if done as usize >= jobs {
            elapsed = Some(started.elapsed());
            break;
        }
        if run.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(30), run).await;
    let elapsed = elapsed.ok_or_else(|| anyhow::anyhow!("the apalis worker stopped early"))?;
    pool.close().await;
    Ok(PeerRun {
        enqueue_per_s: jobs as f64 / enqueued.as_secs_f64(),
        process_per_s: jobs as f64 / elapsed.as_secs_f64(),
    })
}

pub async fn run(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let mut enqueue = Vec::new();
    let mut process = Vec::new();
    for rep in 0..scale.reps {
        let r = run_once(scale.dispatch_items).await?;
        eprintln!(
            "  peer run {}/{}: enqueued {:.0} jobs/s, processed {:.0} jobs/s",
            rep + 1,
            scale.reps,
            r.enqueue_per_s,
            r.process_per_s
        );
        enqueue.push(r.enqueue_per_s);
        process.push(r.process_per_s);
    }
    let note = format!(
        "apalis-sqlite 1.0, {} jobs, {} B payload, POST to loopback sink, concurrency {CONCURRENCY}",
        scale.dispatch_items,
        PAYLOAD.len()
    );
    report.add("peer", "apalis: jobs enqueued", "jobs/s", enqueue, &note);
    report.add("peer", "apalis: jobs processed", "jobs/s", process, &note);
    Ok(())
}
