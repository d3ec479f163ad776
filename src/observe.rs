//! What the daemon tells the outside about itself: Prometheus counters for
//! `/metrics`, and a stream of lifecycle events (stored, admitted, answered,
//! delivered, ...) that the demo prints and tests can watch.
//!
//! Every part reports through one [`Observer`], so a counter and its event
//! can never disagree.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::broadcast;

type Labels = Vec<(&'static str, String)>;

/// A step in the life of an update or a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A new journal row was committed.
    Stored {
        account: String,
        update_key: String,
        inbound_id: i64,
        conversation_id: i64,
    },
    /// An update's key was already journaled.
    Deduplicated {
        account: String,
        update_key: String,
        inbound_id: i64,
    },
    /// A journal row was settled without a run (ignored, rejected, ...).
    Settled {
        inbound_id: i64,
        disposition: &'static str,
        reason: String,
    },
    /// A runtime admitted a journal row.
    Admitted {
        inbound_id: i64,
        run_id: String,
        new_run: bool,
    },
    /// A run finished and its reply items were written.
    Answered {
        run_id: String,
        state: &'static str,
        conversation_id: i64,
    },
    /// An outbox item was acknowledged by its platform.
    Delivered {
        item_key: String,
        conversation_id: i64,
        ordinal: i64,
    },
    /// A send did not produce a receipt.
    SendFailed {
        item_key: String,
        kind: &'static str,
        detail: String,
    },
    /// Reconciliation resolved a possibly-dispatched item.
    Reconciled {
        item_key: String,
        action: &'static str,
    },
    /// A stale worker's outcome was rejected by the item's fencing token.
    Fenced { item_key: String },
    /// A schedule occurrence fired, will be retried, or failed.
    Occurrence {
        schedule_id: i64,
        key: String,
        outcome: &'static str,
    },
}

/// Counters and the event stream.
pub struct Observer {
    registry: Registry,
    updates_received: Family<Labels, Counter>,
    updates_deduplicated: Family<Labels, Counter>,
    ingress_rejected: Family<Labels, Counter>,
    dispositions: Family<Labels, Counter>,
    submissions: Family<Labels, Counter>,
    runs_finished: Family<Labels, Counter>,
    sends: Family<Labels, Counter>,
    reconciliations: Family<Labels, Counter>,
    outbox_items: Family<Labels, Gauge>,
    occurrences: Family<Labels, Counter>,
    schedule_lag: Gauge<f64, std::sync::atomic::AtomicU64>,
    oldest_unsent_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    channel_up: Family<Labels, Gauge>,
    submission_seconds: Family<Labels, Histogram>,
    pruned: Family<Labels, Counter>,
    /// Each channel account's last reported state, by configured name.
    channels: Mutex<BTreeMap<String, ChannelState>>,
    /// When each long-running loop last made progress (the watchdog).
    beats: Mutex<BTreeMap<&'static str, std::time::Instant>>,
    events: broadcast::Sender<Event>,
}

/// A channel account's connection state, as `/readyz` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChannelState {
    /// `starting`, `up` or `down`.
    pub state: &'static str,
    pub detail: String,
}

impl Default for Observer {
    fn default() -> Self {
        Self::new()
    }
}

impl Observer {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let mut family = |name: &str, help: &str| {
            let f = Family::<Labels, Counter>::default();
            registry.register(name, help, f.clone());
            f
        };
        let updates_received = family(
            "switchboard_updates_received",
            "Updates journaled for the first time, by channel account",
        );
        let updates_deduplicated = family(
            "switchboard_updates_deduplicated",
            "Updates whose key was already journaled, by channel account",
        );
        let ingress_rejected = family(
            "switchboard_ingress_rejected",
            "Requests refused before they became an update (malformed, oversize, bad secret), by channel account and reason",
        );
        let dispositions = family(
            "switchboard_updates_settled",
            "Journal rows settled, by disposition",
        );
        let submissions = family(
            "switchboard_submissions",
            "Submissions to a runtime, by runtime and outcome",
        );
        let runs_finished = family(
            "switchboard_runs_finished",
            "Runs of the built-in runtime that reached a terminal state, by state",
        );
        let sends = family(
            "switchboard_outbox_sends",
            "Outbox send attempts, by channel account and outcome",
        );
        let reconciliations = family(
            "switchboard_outbox_reconciliations",
            "Possibly-dispatched items resolved by reconciliation, by action",
        );
        let outbox_items = Family::<Labels, Gauge>::default();
        registry.register(
            "switchboard_outbox_items",
            "Outbox items waiting, unconfirmed or held, by dispatch state",
            outbox_items.clone(),
        );
        let oldest_unsent_age = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "switchboard_outbox_oldest_unsent_age_seconds",
            "Age of the oldest not-dispatched outbox item (0 when none)",
            oldest_unsent_age.clone(),
        );
        let occurrences = Family::<Labels, Counter>::default();
        registry.register(
            "switchboard_schedule_occurrences",
            "Schedule occurrences handled, by outcome (fired, retry, failed)",
            occurrences.clone(),
        );
        let schedule_lag = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "switchboard_schedule_lag_seconds",
            "How late the last schedule occurrence was handled after its slot",
            schedule_lag.clone(),
        );
        let submission_seconds = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 4.0, 10))
        });
        registry.register(
            "switchboard_submission_duration_seconds",
            "How long a runtime took to admit a batch of submissions, by runtime",
            submission_seconds.clone(),
        );
        let pruned = Family::<Labels, Counter>::default();
        registry.register(
            "switchboard_retention_pruned",
            "Rows the retention worker pruned, by kind (payloads erased, journal rows, replies, runs)",
            pruned.clone(),
        );
        let channel_up = Family::<Labels, Gauge>::default();
        registry.register(
            "switchboard_channel_up",
            "1 while a channel account receives updates, 0 while it is starting or down",
            channel_up.clone(),
        );
        let (events, _) = broadcast::channel(4096);
        Observer {
            registry,
            updates_received,
            updates_deduplicated,
            ingress_rejected,
            dispositions,
            submissions,
            runs_finished,
            sends,
            reconciliations,
            outbox_items,
            occurrences,
            schedule_lag,
            oldest_unsent_age,
            channel_up,
            submission_seconds,
            pruned,
            channels: Mutex::new(BTreeMap::new()),
            beats: Mutex::new(BTreeMap::new()),
            events,
        }
    }

    /// A receiver of every event from now on. A slow receiver misses events
    /// (it is told how many), it never slows the daemon down.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    fn emit(&self, event: Event) {
        // No receivers is the normal case outside the demo and tests.
        let _ = self.events.send(event);
    }

    /// The counters in the Prometheus text format.
    pub fn encode_metrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn stored(&self, account: &str, update_key: &str, inbound_id: i64, conversation_id: i64) {
        self.updates_received
            .get_or_create(&vec![("account", account.to_owned())])
            .inc();
        self.emit(Event::Stored {
            account: account.to_owned(),
            update_key: update_key.to_owned(),
            inbound_id,
            conversation_id,
        });
    }

    pub fn deduplicated(&self, account: &str, update_key: &str, inbound_id: i64) {
        self.updates_deduplicated
            .get_or_create(&vec![("account", account.to_owned())])
            .inc();
        self.emit(Event::Deduplicated {
            account: account.to_owned(),
            update_key: update_key.to_owned(),
            inbound_id,
        });
    }

    pub fn rejected(&self, account: &str, code: &str) {
        self.ingress_rejected
            .get_or_create(&vec![
                ("account", account.to_owned()),
                ("reason", code.to_owned()),
            ])
            .inc();
    }

    pub fn settled(&self, inbound_id: i64, disposition: &'static str, reason: &str) {
        self.dispositions
            .get_or_create(&vec![("disposition", disposition.to_owned())])
            .inc();
        self.emit(Event::Settled {
            inbound_id,
            disposition,
            reason: reason.to_owned(),
        });
    }

    pub fn admitted(&self, runtime: &str, inbound_id: i64, run_id: &str, new_run: bool) {
        self.submissions
            .get_or_create(&vec![
                ("runtime", runtime.to_owned()),
                (
                    "outcome",
                    if new_run { "admitted" } else { "duplicate" }.to_owned(),
                ),
            ])
            .inc();
        self.dispositions
            .get_or_create(&vec![("disposition", "admitted".to_owned())])
            .inc();
        self.emit(Event::Admitted {
            inbound_id,
            run_id: run_id.to_owned(),
            new_run,
        });
    }

    /// One call of a runtime's `submit` (its latency as the submitter sees
    /// it: network and admission included).
    pub fn submission_latency(&self, runtime: &str, took: std::time::Duration) {
        self.submission_seconds
            .get_or_create(&vec![("runtime", runtime.to_owned())])
            .observe(took.as_secs_f64());
    }

    pub fn pruned(&self, pass: &crate::store::PruneReport) {
        for (kind, n) in [
            ("payloads", pass.payloads),
            ("journal_rows", pass.keys),
            ("replies", pass.outbox),
            ("runs", pass.runs),
        ] {
            if n > 0 {
                self.pruned
                    .get_or_create(&vec![("kind", kind.to_owned())])
                    .inc_by(n);
            }
        }
    }

    pub fn submission_failed(&self, runtime: &str, outcome: &'static str) {
        self.submissions
            .get_or_create(&vec![
                ("runtime", runtime.to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
    }

    pub fn run_finished(&self, run_id: &str, state: &'static str, conversation_id: i64) {
        self.runs_finished
            .get_or_create(&vec![("state", state.to_owned())])
            .inc();
        self.emit(Event::Answered {
            run_id: run_id.to_owned(),
            state,
            conversation_id,
        });
    }

    pub fn delivered(&self, account: &str, item_key: &str, conversation_id: i64, ordinal: i64) {
        self.sends
            .get_or_create(&vec![
                ("account", account.to_owned()),
                ("outcome", "acknowledged".to_owned()),
            ])
            .inc();
        self.emit(Event::Delivered {
            item_key: item_key.to_owned(),
            conversation_id,
            ordinal,
        });
    }

    pub fn send_failed(&self, account: &str, item_key: &str, kind: &'static str, detail: &str) {
        self.sends
            .get_or_create(&vec![
                ("account", account.to_owned()),
                ("outcome", kind.to_owned()),
            ])
            .inc();
        self.emit(Event::SendFailed {
            item_key: item_key.to_owned(),
            kind,
            detail: detail.to_owned(),
        });
    }

    /// Set the outbox gauges from figures read at scrape time.
    pub fn set_outbox_gauges(&self, stats: &crate::store::OutboxStats, now_ms: i64) {
        for (state, n) in [
            ("not_dispatched", stats.not_dispatched),
            ("possibly_dispatched", stats.possibly_dispatched),
            ("held", stats.held),
        ] {
            self.outbox_items
                .get_or_create(&vec![("state", state.to_owned())])
                .set(n);
        }
        let age = stats
            .oldest_unsent_created_at
            .map_or(0.0, |t| ((now_ms - t).max(0) as f64) / 1000.0);
        self.oldest_unsent_age.set(age);
    }

    pub fn occurrence(&self, schedule_id: i64, key: &str, outcome: &'static str, lag_ms: i64) {
        self.occurrences
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
        self.schedule_lag.set(lag_ms.max(0) as f64 / 1000.0);
        self.emit(Event::Occurrence {
            schedule_id,
            key: key.to_owned(),
            outcome,
        });
    }

    /// A stale worker's outcome was rejected by the fencing token.
    pub fn fenced(&self, item_key: &str) {
        self.sends
            .get_or_create(&vec![
                ("account", String::new()),
                ("outcome", "fenced".to_owned()),
            ])
            .inc();
        self.emit(Event::Fenced {
            item_key: item_key.to_owned(),
        });
    }

    /// A channel account's adapter reported its state (only configured
    /// account names reach this, so labels cannot grow without bound).
    pub fn channel_status(&self, account: &str, status: &switchboard_channel::AccountStatus) {
        use switchboard_channel::AccountStatus::*;
        let (state, detail) = match status {
            Starting => ("starting", String::new()),
            Up(d) => ("up", d.clone()),
            Down(d) => ("down", d.clone()),
        };
        self.channel_up
            .get_or_create(&vec![("account", account.to_owned())])
            .set(i64::from(state == "up"));
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels.insert(account.to_owned(), ChannelState { state, detail });
    }

    /// A long-running loop went round once (or is idle and well).
    pub fn beat(&self, name: &'static str) {
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, std::time::Instant::now());
    }

    /// Loops that have not beaten within `within`.
    pub fn stalled_loops(&self, within: std::time::Duration) -> Vec<&'static str> {
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, at)| at.elapsed() > within)
            .map(|(name, _)| *name)
            .collect()
    }

    /// Every channel account's state, by configured name.
    pub fn channel_states(&self) -> BTreeMap<String, ChannelState> {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn reconciled(&self, item_key: &str, action: &'static str) {
        self.reconciliations
            .get_or_create(&vec![("action", action.to_owned())])
            .inc();
        self.emit(Event::Reconciled {
            item_key: item_key.to_owned(),
            action,
        });
    }
}

pub type SharedObserver = Arc<Observer>;
