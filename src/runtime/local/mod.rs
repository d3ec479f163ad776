//! The built-in runtime: owns the runs of each conversation, keeps durable
//! run records, and calls a model backend.
//!
//! Each conversation with work has a lane: a queue of run ids and at most
//! one running run, driven by one task that exits when the queue is empty
//! (so memory follows active conversations, not all of them). The store is
//! the truth: a run is admitted (queued) durably before it is in a lane, and
//! its terminal record and reply items are written in one transaction, so a
//! crash at any point leaves either a queued/running run (re-run at start) or
//! a finished run with its reply items.

pub mod model;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::model::{Model, ModelRequest};
use super::{Admission, CloseReport, Input, Runtime, Submission, SubmitError};
use crate::clock::SharedClock;
use crate::config::LocalRuntimeConfig;
use crate::keys;
use crate::observe::SharedObserver;
use crate::store::batch::Batcher;
use crate::store::{ItemKind, NewReply, NewRun, RunFinish, RunRow, RunState, SharedStore};
use crate::surface::InputPolicy;

/// The text users see when a run fails.
const FAILURE_NOTICE: &str = "Sorry, I could not answer that message. Please try again.";

/// One run waiting in a lane.
#[derive(Debug, Clone)]
struct Queued {
    run_id: i64,
    priority: i64,
    input: Input,
}

#[derive(Default)]
struct Lane {
    queue: VecDeque<Queued>,
    running: Option<i64>,
}

impl Lane {
    fn knows(&self, run_id: i64) -> bool {
        self.running == Some(run_id) || self.queue.iter().any(|q| q.run_id == run_id)
    }

    /// Insert keeping (priority desc, arrival) order.
    fn push(&mut self, run: Queued) {
        let at = self
            .queue
            .iter()
            .position(|q| q.priority < run.priority)
            .unwrap_or(self.queue.len());
        self.queue.insert(at, run);
    }
}

struct Inner {
    name: String,
    store: SharedStore,
    model: Box<dyn Model>,
    lanes: Mutex<HashMap<i64, Lane>>,
    permits: Semaphore,
    starts: Batcher<i64, ()>,
    finishes: Batcher<RunFinish, bool>,
    clock: SharedClock,
    observer: SharedObserver,
    outbox_wake: Arc<Notify>,
    tracker: TaskTracker,
    /// Cancelled when the grace period ends: running model calls stop.
    abort: CancellationToken,
    closing: AtomicBool,
}

/// The built-in runtime.
pub struct LocalRuntime {
    inner: Arc<Inner>,
}

impl LocalRuntime {
    pub fn new(
        name: &str,
        config: &LocalRuntimeConfig,
        store: SharedStore,
        batch_size: usize,
        clock: SharedClock,
        observer: SharedObserver,
        outbox_wake: Arc<Notify>,
    ) -> Self {
        let start_store = store.clone();
        let start_clock = clock.clone();
        let (starts, _) = Batcher::spawn("run start", batch_size, move |ids: Vec<i64>| {
            let store = start_store.clone();
            let now = start_clock.now_ms();
            async move {
                store.runs_start(&ids, now).await?;
                Ok(vec![(); ids.len()])
            }
        });
        let finish_store = store.clone();
        let (finishes, _) =
            Batcher::spawn("run finish", batch_size, move |batch: Vec<RunFinish>| {
                let store = finish_store.clone();
                async move { store.runs_finish(&batch).await }
            });
        LocalRuntime {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                store,
                model: model::build(&config.model),
                lanes: Mutex::new(HashMap::new()),
                permits: Semaphore::new(config.max_concurrent_runs),
                starts,
                finishes,
                clock,
                observer,
                outbox_wake,
                tracker: TaskTracker::new(),
                abort: CancellationToken::new(),
                closing: AtomicBool::new(false),
            }),
        }
    }
}

impl Inner {
    /// Put a run in its conversation's lane, starting the lane's task when
    /// the lane was idle. A run the lane already knows is not added twice.
    fn enqueue(self: &Arc<Self>, conversation_id: i64, run: Queued) {
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let idle = !lanes.contains_key(&conversation_id);
        let lane = lanes.entry(conversation_id).or_default();
        if lane.knows(run.run_id) {
            return;
        }
        lane.push(run);
        if idle {
            let inner = self.clone();
            self.tracker
                .spawn(async move { inner.drive_lane(conversation_id).await });
        }
    }

    /// Run a conversation's queued runs one after another until none is left.
    async fn drive_lane(self: Arc<Self>, conversation_id: i64) {
        loop {
            let next = {
                let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
                let Some(lane) = lanes.get_mut(&conversation_id) else {
                    return;
                };
                lane.running = None;
                // While closing, queued runs stay queued in the store and
                // are resumed by the next start.
                let next = if self.closing.load(Ordering::SeqCst) {
                    None
                } else {
                    lane.queue.pop_front()
                };
                match next {
                    Some(run) => {
                        lane.running = Some(run.run_id);
                        run
                    }
                    None => {
                        lanes.remove(&conversation_id);
                        return;
                    }
                }
            };
            let Ok(_permit) = self.permits.acquire().await else {
                return;
            };
            self.execute(conversation_id, next).await;
        }
    }

    async fn execute(&self, conversation_id: i64, run: Queued) {
        // Recording `running` is for operators and recovery; the answer does
        // not wait for it (the finish write is guarded by state, so the
        // order of the two commits does not matter).
        let starts = self.starts.clone();
        let run_id = run.run_id;
        tokio::spawn(async move {
            let _ = starts.call(run_id, "run start").await;
        });
        let request = ModelRequest {
            input: run.input.text.clone(),
        };
        let result = tokio::select! {
            result = self.model.generate(&request) => result,
            // Shutdown after the grace period: the run stays `running` in
            // the store and is re-run by the next start.
            _ = self.abort.cancelled() => return,
        };
        let now = self.clock.now_ms();
        let run_key = run_id.to_string();
        let finish = match result {
            Ok(answer) => RunFinish {
                run_id,
                state: RunState::Completed,
                replies: vec![NewReply {
                    item_key: keys::answer_item_key(&run_key, 1),
                    kind: ItemKind::Answer,
                    text: answer.clone(),
                }],
                answer: Some(answer),
                reason: None,
                now,
            },
            Err(e) => {
                tracing::warn!(run_id, runtime = %self.name, error = %e, "run failed");
                RunFinish {
                    run_id,
                    state: RunState::Failed,
                    answer: None,
                    reason: Some(e.to_string()),
                    replies: vec![NewReply {
                        item_key: format!("run-{run_key}-failure"),
                        kind: ItemKind::Notice,
                        text: FAILURE_NOTICE.to_owned(),
                    }],
                    now,
                }
            }
        };
        let state = finish.state;
        // A store failure here must not lose the answer: retry until it is
        // written or the daemon stops (then the run is re-run at start).
        let mut delay = Duration::from_millis(100);
        loop {
            match self.finishes.call(finish.clone(), "run finish").await {
                Ok(true) => {
                    self.observer
                        .run_finished(&run_key, state.as_str(), conversation_id);
                    self.outbox_wake.notify_one();
                    return;
                }
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(run_id, error = %e, "could not record a finished run; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.abort.cancelled() => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

fn queued_from_row(row: &RunRow) -> Queued {
    let input = serde_json::from_str::<Input>(&row.input).unwrap_or_else(|_| Input {
        text: row.input.clone(),
        attachments: Vec::new(),
        sender_id: None,
        sender_name: None,
    });
    Queued {
        run_id: row.id,
        priority: row.priority,
        input,
    }
}

#[async_trait]
impl Runtime for LocalRuntime {
    fn name(&self) -> &str {
        &self.inner.name
    }

    async fn submit(&self, batch: Vec<Submission>) -> Vec<Result<Admission, SubmitError>> {
        let inner = &self.inner;
        if inner.closing.load(Ordering::SeqCst) {
            return batch
                .iter()
                .map(|_| {
                    Err(SubmitError::Unavailable(
                        "the runtime is shutting down".into(),
                    ))
                })
                .collect();
        }
        let now = inner.clock.now_ms();
        let runs: Vec<NewRun> = batch
            .iter()
            .map(|s| NewRun {
                idempotency_key: s.idempotency_key.clone(),
                conversation_id: s.conversation_id,
                runtime: inner.name.clone(),
                account: s.account.clone(),
                chat_id: s.chat_id.clone(),
                thread_id: s.thread_id.clone(),
                surface: s.surface,
                reply_to: s.reply_to.clone(),
                // Serializing a plain struct of strings cannot fail.
                input: serde_json::to_string(&s.input).unwrap_or_default(),
                priority: i64::from(s.policy == InputPolicy::InterruptNext),
                created_at: now,
            })
            .collect();
        match inner.store.runs_admit(&runs).await {
            Ok(admissions) => batch
                .into_iter()
                .zip(admissions)
                .map(|(submission, admission)| {
                    // A new run, or a known one the lanes may have lost
                    // track of (the lane ignores runs it already has).
                    if admission.new || !admission.state.is_terminal() {
                        inner.enqueue(
                            submission.conversation_id,
                            Queued {
                                run_id: admission.run_id,
                                priority: i64::from(
                                    submission.policy == InputPolicy::InterruptNext,
                                ),
                                input: submission.input,
                            },
                        );
                    }
                    Ok(Admission {
                        run_id: admission.run_id.to_string(),
                        new: admission.new,
                    })
                })
                .collect(),
            Err(e) => {
                let why = e.to_string();
                batch
                    .iter()
                    .map(|_| Err(SubmitError::Unavailable(why.clone())))
                    .collect()
            }
        }
    }

    async fn recover(&self) -> Result<usize, String> {
        const PAGE: usize = 512;
        let inner = &self.inner;
        let mut after = 0;
        let mut resumed = 0;
        loop {
            let rows = inner
                .store
                .runs_unfinished(after, PAGE)
                .await
                .map_err(|e| e.to_string())?;
            for row in rows.iter().filter(|r| r.runtime == inner.name) {
                inner.enqueue(row.conversation_id, queued_from_row(row));
                resumed += 1;
            }
            match rows.last() {
                Some(last) if rows.len() == PAGE => after = last.id,
                _ => break,
            }
        }
        Ok(resumed)
    }

    async fn close(&self, grace: Duration, force: Duration) -> CloseReport {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::SeqCst);
        inner.tracker.close();
        if tokio::time::timeout(grace, inner.tracker.wait())
            .await
            .is_ok()
        {
            return CloseReport {
                settled: true,
                remaining: 0,
            };
        }
        inner.abort.cancel();
        let settled = tokio::time::timeout(force, inner.tracker.wait())
            .await
            .is_ok();
        let remaining = if settled {
            0
        } else {
            inner
                .lanes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .filter(|l| l.running.is_some())
                .count()
        };
        CloseReport { settled, remaining }
    }
}
