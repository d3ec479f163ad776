//! The retention worker: old personal data is pruned in bounded batches on
//! a schedule kept by tokio-cron-scheduler (the daemon's periodic
//! housekeeping; users' durable schedules live in the store instead).

use std::time::Duration;

use tokio_cron_scheduler::{Job, JobScheduler};

use crate::clock::SharedClock;
use crate::config::RetentionConfig;
use crate::observe::SharedObserver;
use crate::store::{PruneReport, PruneRules, SharedStore};

const DAY_MS: i64 = 24 * 3600 * 1000;

/// The rules of a pruning round at `now`.
pub fn rules(config: &RetentionConfig, now: i64) -> PruneRules {
    let before = |days: u64| now - days as i64 * DAY_MS;
    PruneRules {
        payloads_before: before(config.payload_days),
        keys_before: before(config.journal_days.max(7)),
        outbox_before: before(config.outbox_days),
        runs_before: before(config.runs_days),
        batch: config.batch_size,
    }
}

/// One round: passes until one finds less than a batch of anything (with a
/// short pause between passes, so the writer stays free for messages).
pub async fn round(
    store: &SharedStore,
    config: &RetentionConfig,
    clock: &SharedClock,
    observer: &SharedObserver,
) -> PruneReport {
    let mut total = PruneReport::default();
    for _ in 0..10_000 {
        let rules = rules(config, clock.now_ms());
        match store.prune(&rules).await {
            Ok(pass) => {
                total.payloads += pass.payloads;
                total.keys += pass.keys;
                total.outbox += pass.outbox;
                total.runs += pass.runs;
                observer.pruned(&pass);
                let batch = config.batch_size as u64;
                if pass.payloads < batch
                    && pass.keys < batch
                    && pass.outbox < batch
                    && pass.runs < batch
                {
                    break;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "a retention pass failed; the next round retries");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if total.total() > 0 {
        tracing::info!(
            payloads = total.payloads,
            journal_rows = total.keys,
            replies = total.outbox,
            runs = total.runs,
            "retention pruned old data"
        );
    }
    total
}

/// Start the worker: a round now, then every `interval_minutes`.
pub async fn start(
    store: SharedStore,
    config: RetentionConfig,
    clock: SharedClock,
    observer: SharedObserver,
) -> Result<Option<JobScheduler>, String> {
    if !config.enabled {
        return Ok(None);
    }
    let scheduler = JobScheduler::new()
        .await
        .map_err(|e| format!("starting the housekeeping scheduler: {e}"))?;
    let every = Duration::from_secs(config.interval_minutes.max(1) * 60);
    let job = {
        let (store, config, clock, observer) = (
            store.clone(),
            config.clone(),
            clock.clone(),
            observer.clone(),
        );
        Job::new_repeated_async(every, move |_, _| {
            let (store, config, clock, observer) = (
                store.clone(),
                config.clone(),
                clock.clone(),
                observer.clone(),
            );
            Box::pin(async move {
                round(&store, &config, &clock, &observer).await;
            })
        })
        .map_err(|e| format!("scheduling retention: {e}"))?
    };
    scheduler
        .add(job)
        .await
        .map_err(|e| format!("scheduling retention: {e}"))?;
    scheduler
        .start()
        .await
        .map_err(|e| format!("starting the housekeeping scheduler: {e}"))?;
    // The first round does not wait a whole interval.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        round(&store, &config, &clock, &observer).await;
    });
    Ok(Some(scheduler))
}
