//! The built-in runtime: owns the runs of each conversation, applies the
//! input policies, keeps durable run records, and calls a model backend.
//!
//! Each conversation with work has a [`lane::Lane`]: the running run and the
//! queued runs in execution order, driven by one task that exits when the
//! lane is empty (memory follows active conversations, not all of them).
//! The store is the truth and every decision is durable before it acts:
//! - an input is admitted (its run queued, or joined to a queued run, or an
//!   interrupt of the running run requested) in one transaction before the
//!   lane changes;
//! - a run's terminal record, its reply items, its terminal event and the
//!   absorption of inject runs it answered are one transaction;
//! - after a crash, `recover` rebuilds the lanes from the store: queued runs
//!   resume in order, running runs are re-run (or interrupted, by config),
//!   runs asked to end are ended.

pub mod exec;
pub mod history;
pub mod lane;
pub mod model;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, Semaphore, broadcast};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::lane::{Lane, Offer, Placement, QueuedRun, RunControl, Running};
use self::model::Model;
use super::{
    Admission, CloseReport, Input, LaneOwnership, Route, RunDelta, Runtime, Stop, StopReport,
    Submission, SubmitError,
};
use crate::clock::SharedClock;
use crate::config::{HistoryConfig, LocalRuntimeConfig, Messages, OnRestart};
use crate::observe::SharedObserver;
use crate::outbox::shape::Shaper;
use crate::store::batch::Batcher;
use crate::store::{
    Admit, AdmitTarget, NewRun, RunFinish, RunMode, RunRow, RunState, SharedStore, StopRequest,
};

/// What the runtime shares with its lane tasks.
pub(crate) struct Inner {
    name: String,
    store: SharedStore,
    model: Box<dyn Model>,
    system_prompt: Option<String>,
    history: HistoryConfig,
    run_timeout: Duration,
    on_restart: OnRestart,
    messages: Messages,
    shaper: Shaper,
    lanes: Mutex<HashMap<i64, Lane>>,
    permits: Semaphore,
    starts: Batcher<i64, ()>,
    finishes: Batcher<RunFinish, bool>,
    clock: SharedClock,
    observer: SharedObserver,
    outbox_wake: Arc<Notify>,
    deltas: broadcast::Sender<RunDelta>,
    tracker: TaskTracker,
    /// Cancelled when the grace period of a shutdown ends.
    abort: CancellationToken,
    closing: AtomicBool,
    /// Serializes admissions and stops, so each lane decision is taken on
    /// the lane as the previous decision left it.
    admission: tokio::sync::Mutex<()>,
    /// Lane ownership when processes share the store (unset: every lane
    /// is this process's).
    owner: OnceLock<Weak<dyn LaneOwnership>>,
}

/// The built-in runtime.
pub struct LocalRuntime {
    inner: Arc<Inner>,
}

/// Everything the runtime needs from the daemon.
pub struct Deps {
    pub store: SharedStore,
    pub batch_size: usize,
    pub messages: Messages,
    /// Splits answers at each channel account's limit.
    pub shaper: Shaper,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    pub outbox_wake: Arc<Notify>,
}

impl LocalRuntime {
    /// Durably end one run (the protocol's interrupt): a queued run is
    /// cancelled, a running one ends at its next step boundary as
    /// `end_as` (`interrupted` or `superseded`). Returns the state after the
    /// request; `None` for an unknown run.
    pub async fn interrupt_run(
        &self,
        run_id: i64,
        end_as: RunState,
        reason: &str,
    ) -> Result<Option<RunState>, String> {
        let inner = &self.inner;
        let _serial = inner.admission.lock().await;
        let state = inner
            .store
            .runs_interrupt(run_id, end_as, reason, inner.clock.now_ms())
            .await
            .map_err(|e| e.to_string())?;
        let conversation = match state {
            Some(RunState::Cancelled | RunState::InterruptRequested) => inner
                .store
                .run_get(run_id)
                .await
                .map_err(|e| e.to_string())?
                .map(|r| r.conversation_id),
            _ => None,
        };
        if let Some(conversation_id) = conversation {
            let mut lanes = inner.lanes();
            if let Some(lane) = lanes.get_mut(&conversation_id) {
                lane.remove(&[run_id]);
                if let Some(running) = &lane.running
                    && running.run_id == run_id
                {
                    running.control.end(end_as);
                }
            }
            drop(lanes);
            if state == Some(RunState::Cancelled) {
                inner
                    .observer
                    .run_finished(&run_id.to_string(), "cancelled", conversation_id);
            }
        }
        Ok(state)
    }

    pub fn new(name: &str, config: &LocalRuntimeConfig, deps: Deps) -> Result<Self, String> {
        let model =
            model::build(&config.model).map_err(|e| format!("runtimes.{name}.model: {e}"))?;
        let start_store = deps.store.clone();
        let start_clock = deps.clock.clone();
        let (starts, _) = Batcher::spawn("run start", deps.batch_size, move |ids: Vec<i64>| {
            let store = start_store.clone();
            let now = start_clock.now_ms();
            async move {
                store.runs_start(&ids, now).await?;
                Ok(vec![(); ids.len()])
            }
        });
        let finish_store = deps.store.clone();
        let (finishes, _) = Batcher::spawn(
            "run finish",
            deps.batch_size,
            move |batch: Vec<RunFinish>| {
                let store = finish_store.clone();
                async move { store.runs_finish(&batch).await }
            },
        );
        Ok(LocalRuntime {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                store: deps.store,
                model,
                system_prompt: config.system_prompt.clone(),
                history: config.history.clone(),
                run_timeout: Duration::from_secs(config.run_timeout_secs),
                on_restart: config.on_restart,
                messages: deps.messages,
                shaper: deps.shaper,
                lanes: Mutex::new(HashMap::new()),
                permits: Semaphore::new(config.max_concurrent_runs),
                starts,
                finishes,
                clock: deps.clock,
                observer: deps.observer,
                outbox_wake: deps.outbox_wake,
                deltas: broadcast::channel(1024).0,
                tracker: TaskTracker::new(),
                abort: CancellationToken::new(),
                closing: AtomicBool::new(false),
                admission: tokio::sync::Mutex::new(()),
                owner: OnceLock::new(),
            }),
        })
    }
}

impl Inner {
    fn lanes(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Lane>> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lane of a conversation, created (with its task) when idle.
    fn lane_mut<'a>(
        self: &Arc<Self>,
        lanes: &'a mut HashMap<i64, Lane>,
        conversation_id: i64,
    ) -> &'a mut Lane {
        if !lanes.contains_key(&conversation_id) {
            let inner = self.clone();
            self.tracker
                .spawn(async move { inner.drive(conversation_id).await });
        }
        lanes.entry(conversation_id).or_default()
    }

    /// Whether this process may start the conversation's next run.
    fn owns(&self, conversation_id: i64) -> bool {
        match self.owner.get().map(Weak::upgrade) {
            Some(Some(owner)) => owner.owns(conversation_id),
            _ => true,
        }
    }

    /// Run a conversation's queued runs one after another until none is
    /// left (or the runtime is closing: queued runs then stay queued in the
    /// store for the next start).
    async fn drive(self: Arc<Self>, conversation_id: i64) {
        let mut absorbed: Vec<i64> = Vec::new();
        loop {
            let (run, control) = {
                let mut lanes = self.lanes();
                let Some(lane) = lanes.get_mut(&conversation_id) else {
                    return;
                };
                lane.running = None;
                lane.remove(&absorbed);
                if !self.owns(conversation_id) {
                    // Another process took the lane over (this one stalled
                    // past its lease); it adopts the queued runs from the
                    // store, so running them here too would answer twice.
                    tracing::warn!(
                        conversation_id,
                        left = lane.queue_len(),
                        "lost the conversation's lane to another process; leaving its runs to it"
                    );
                    lanes.remove(&conversation_id);
                    drop(lanes);
                    if let Some(Some(owner)) = self.owner.get().map(Weak::upgrade) {
                        owner.lost(conversation_id);
                    }
                    return;
                }
                let next = if self.closing.load(Ordering::SeqCst) {
                    None
                } else {
                    lane.pop_next()
                };
                match next {
                    Some(run) => {
                        let control = RunControl::new();
                        lane.running = Some(Running {
                            run_id: run.run_id,
                            control: control.clone(),
                        });
                        (run, control)
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
            absorbed = self.execute(conversation_id, run, control).await;
        }
    }

    /// Write a finished run, retrying store failures until it is written
    /// or the daemon stops (then the run is recovered at the next start).
    async fn finish(&self, mut finish: RunFinish, conversation_id: i64) -> bool {
        if self.shaper.is_detached() {
            finish.replies.clear();
        }
        let run_id = finish.run_id;
        let state = finish.state;
        let absorbed = finish.absorb.clone();
        let mut delay = Duration::from_millis(100);
        loop {
            match self.finishes.call(finish.clone(), "run finish").await {
                Ok(applied) => {
                    if applied {
                        self.observer.run_finished(
                            &run_id.to_string(),
                            state.as_str(),
                            conversation_id,
                        );
                        if state == RunState::Completed {
                            for id in &absorbed {
                                self.observer.run_finished(
                                    &id.to_string(),
                                    RunState::Absorbed.as_str(),
                                    conversation_id,
                                );
                            }
                        }
                        self.outbox_wake.notify_one();
                    }
                    return applied;
                }
                Err(e) => {
                    tracing::warn!(run_id, error = %e, "could not record a finished run; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = self.abort.cancelled() => return false,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Put the conversation's unfinished runs this lane does not know
    /// (except `skip`) into it, in order. The caller holds `admission`.
    async fn adopt(self: &Arc<Self>, conversation_id: i64, skip: &[i64]) -> Result<usize, String> {
        let rows = self
            .store
            .runs_unfinished_in(conversation_id)
            .await
            .map_err(|e| e.to_string())?;
        // Queued runs the store no longer has unfinished were ended
        // elsewhere (another process ran them while this one stalled).
        {
            let unfinished: Vec<i64> = rows.iter().map(|r| r.id).collect();
            let mut lanes = self.lanes();
            if let Some(lane) = lanes.get_mut(&conversation_id) {
                let gone: Vec<i64> = lane
                    .queued_ids()
                    .into_iter()
                    .filter(|id| *id >= 0 && !unfinished.contains(id) && !skip.contains(id))
                    .collect();
                lane.remove(&gone);
            }
        }
        let mut adopted = 0;
        for row in rows.iter().filter(|r| !skip.contains(&r.id)) {
            let known = self
                .lanes()
                .get(&conversation_id)
                .is_some_and(|lane| lane.knows(row.id));
            if !known {
                adopted += usize::from(self.resume(row).await?);
            }
        }
        Ok(adopted)
    }

    /// Pick up one unfinished run found in the store (at start, or when
    /// this process takes over the conversation's lane): a queued run
    /// joins its lane, a running one is re-run or interrupted by config,
    /// one asked to end is ended. Returns whether it joined a lane.
    async fn resume(self: &Arc<Self>, row: &RunRow) -> Result<bool, String> {
        if row.runtime != self.name {
            return Ok(false);
        }
        let resume = match (row.state, self.on_restart) {
            (RunState::Queued, _) | (RunState::Running, OnRestart::Rerun) => true,
            (RunState::Running, OnRestart::Interrupt) => {
                self.end_recovered(row, RunState::Interrupted).await?;
                false
            }
            (RunState::InterruptRequested, _) => {
                self.end_recovered(row, row.end_as.unwrap_or(RunState::Interrupted))
                    .await?;
                false
            }
            _ => false,
        };
        if !resume {
            return Ok(false);
        }
        let inputs = self
            .store
            .run_inputs(row.id)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .map(|i| input_of(&i.input))
            .collect();
        let mut lanes = self.lanes();
        self.lane_mut(&mut lanes, row.conversation_id)
            .insert(QueuedRun {
                run_id: row.id,
                mode: row.mode,
                route: Arc::new(Route {
                    account: row.account.clone(),
                    chat_id: row.chat_id.clone(),
                    thread_id: row.thread_id.clone(),
                    surface: row.surface,
                    reply_to: row.reply_to.clone(),
                }),
                inputs,
            });
        Ok(true)
    }

    /// End a run found `running` or `interrupt_requested` at start. What it
    /// had said before the crash is lost; the user still learns it ended.
    async fn end_recovered(&self, row: &RunRow, state: RunState) -> Result<(), String> {
        let own: Vec<String> = self
            .store
            .run_inputs(row.id)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .map(|i| input_of(&i.input).text)
            .collect();
        let finish = exec::ended_without_partial(
            self,
            row.id,
            &row.account,
            state,
            row.end_notice.is_some(),
            &own,
        );
        self.finish(finish, row.conversation_id).await;
        Ok(())
    }
}

fn new_run(s: &Submission, runtime: &str, mode: RunMode, now: i64) -> NewRun {
    NewRun {
        conversation_id: s.conversation_id,
        runtime: runtime.to_owned(),
        account: s.account.clone(),
        chat_id: s.chat_id.clone(),
        thread_id: s.thread_id.clone(),
        surface: s.surface,
        reply_to: s.reply_to.clone(),
        mode,
        created_at: now,
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
        let _serial = inner.admission.lock().await;
        let now = inner.clock.now_ms();

        // Decide on copies of the lanes, so inputs of one batch see the
        // decisions taken for the ones before them.
        let mut shadows: HashMap<i64, Lane> = {
            let lanes = inner.lanes();
            batch
                .iter()
                .map(|s| {
                    (
                        s.conversation_id,
                        lanes
                            .get(&s.conversation_id)
                            .map(Lane::shadow)
                            .unwrap_or_default(),
                    )
                })
                .collect()
        };
        let mut results: Vec<Option<Result<Admission, SubmitError>>> = vec![None; batch.len()];
        let mut planned: Vec<(usize, lane::Plan)> = Vec::new();
        let mut admits: Vec<Admit> = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            let shadow = shadows.entry(s.conversation_id).or_default();
            let plan = match shadow.plan(s.policy, s.coalesce_pending, s.max_queued_inputs) {
                Ok(plan) => plan,
                Err(full) => {
                    results[i] = Some(Err(SubmitError::Refused(format!(
                        "{} inputs are already waiting in this conversation (the limit is {})",
                        full.queued, full.max
                    ))));
                    continue;
                }
            };
            // Provisional ids for runs this batch creates: -(index + 1).
            let provisional = -(admits.len() as i64) - 1;
            let target = match plan.placement {
                Placement::NewRun(mode) => {
                    shadow.insert(QueuedRun {
                        run_id: provisional,
                        mode,
                        route: Arc::new(s.route()),
                        inputs: vec![s.input.clone()],
                    });
                    AdmitTarget::NewRun(new_run(s, &inner.name, mode, now))
                }
                Placement::Join(run_id) => {
                    shadow.join(run_id, s.input.clone());
                    if run_id < 0 {
                        AdmitTarget::JoinBatch {
                            index: (-run_id - 1) as usize,
                        }
                    } else {
                        AdmitTarget::Join { run_id }
                    }
                }
            };
            if let Some((_, state)) = plan.interrupt {
                shadow.mark_ending(state);
            }
            admits.push(Admit {
                idempotency_key: s.idempotency_key.clone(),
                conversation_id: s.conversation_id,
                inbound_id: s.inbound_id,
                // Serializing a plain struct of strings cannot fail.
                input: serde_json::to_string(&s.input).unwrap_or_default(),
                target,
                interrupt: plan.interrupt,
                created_at: now,
            });
            planned.push((i, plan));
        }

        let outcomes = match inner.store.runs_admit(&admits).await {
            Ok(outcomes) => outcomes,
            Err(e) => {
                let why = e.to_string();
                return results
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|| Err(SubmitError::Unavailable(why.clone()))))
                    .collect();
            }
        };

        // A duplicate whose run waits in the store but not in this lane was
        // admitted by another process that has since lost the lane: take
        // the conversation's unknown runs over before anything new joins
        // the lane, so they keep their order.
        let fresh: Vec<i64> = outcomes
            .iter()
            .filter(|o| o.new)
            .map(|o| o.run_id)
            .collect();
        let mut orphaned: Vec<i64> = Vec::new();
        for ((i, _), outcome) in planned.iter().zip(&outcomes) {
            let conversation_id = batch[*i].conversation_id;
            let unfinished = matches!(outcome.state, RunState::Queued | RunState::Running);
            if !outcome.new
                && unfinished
                && !orphaned.contains(&conversation_id)
                && !inner
                    .lanes()
                    .get(&conversation_id)
                    .is_some_and(|lane| lane.knows(outcome.run_id))
            {
                orphaned.push(conversation_id);
            }
        }
        for conversation_id in orphaned {
            match inner.adopt(conversation_id, &fresh).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    conversation_id,
                    runs = n,
                    "took over runs another process admitted"
                ),
                Err(e) => {
                    tracing::warn!(conversation_id, error = %e, "could not take over runs another process admitted")
                }
            }
        }

        // Apply the committed decisions to the real lanes.
        {
            let mut lanes = inner.lanes();
            for ((i, plan), outcome) in planned.into_iter().zip(outcomes) {
                let s = &batch[i];
                results[i] = Some(Ok(Admission {
                    run_id: outcome.run_id.to_string(),
                    new: outcome.new,
                }));
                if !outcome.new {
                    continue;
                }
                let lane = self.inner.lane_mut(&mut lanes, s.conversation_id);
                let joined = matches!(plan.placement, Placement::Join(_))
                    && lane.join(outcome.run_id, s.input.clone());
                if !joined {
                    let mode = match plan.placement {
                        Placement::NewRun(mode) => mode,
                        Placement::Join(_) => RunMode::Ordinary,
                    };
                    lane.insert(QueuedRun {
                        run_id: outcome.run_id,
                        mode,
                        route: Arc::new(s.route()),
                        inputs: vec![s.input.clone()],
                    });
                }
                if let Some(running) = &lane.running {
                    if let Some((id, state)) = plan.interrupt
                        && running.run_id == id
                    {
                        running.control.end(state);
                    }
                    if plan.inject_into == Some(running.run_id) && !running.control.ending() {
                        running.control.offer(
                            Offer {
                                run_id: outcome.run_id,
                                inputs: vec![s.input.clone()],
                            },
                            s.soft_interrupt,
                        );
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(SubmitError::Unavailable("not admitted".into()))))
            .collect()
    }

    async fn stop(&self, stop: Stop) -> Result<StopReport, SubmitError> {
        let inner = &self.inner;
        let _serial = inner.admission.lock().await;
        let outcome = inner
            .store
            .runs_stop(&StopRequest {
                conversation_id: stop.conversation_id,
                reason: stop.reason.clone(),
                notice: stop.notice,
                now: inner.clock.now_ms(),
            })
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))?;
        {
            let mut lanes = inner.lanes();
            if let Some(lane) = lanes.get_mut(&stop.conversation_id) {
                lane.remove(&outcome.cancelled);
                if let Some(running) = &lane.running {
                    let hit = outcome.interrupted == Some(running.run_id)
                        || outcome.cancelled.contains(&running.run_id);
                    if hit {
                        running.control.end_stopped();
                    }
                }
            }
        }
        for id in &outcome.cancelled {
            inner.observer.run_finished(
                &id.to_string(),
                RunState::Cancelled.as_str(),
                stop.conversation_id,
            );
        }
        inner.outbox_wake.notify_one();
        Ok(StopReport {
            interrupted: outcome.interrupted.map(|id| id.to_string()),
            cancelled: outcome.cancelled.len(),
        })
    }

    fn deltas(&self) -> broadcast::Receiver<RunDelta> {
        self.inner.deltas.subscribe()
    }

    async fn recover(&self) -> Result<usize, String> {
        const PAGE: usize = 512;
        let mut after = 0;
        let mut resumed = 0;
        loop {
            let rows = self
                .inner
                .store
                .runs_unfinished(after, PAGE)
                .await
                .map_err(|e| e.to_string())?;
            for row in &rows {
                resumed += usize::from(self.inner.resume(row).await?);
            }
            match rows.last() {
                Some(last) if rows.len() == PAGE => after = last.id,
                _ => break,
            }
        }
        Ok(resumed)
    }

    fn owns_lanes(&self) -> bool {
        true
    }

    async fn adopt(&self, conversation_id: i64) -> Result<usize, String> {
        // Serialized with admissions, so a submission that follows sees the
        // adopted runs in the lane.
        let _serial = self.inner.admission.lock().await;
        self.inner.adopt(conversation_id, &[]).await
    }

    fn busy(&self, conversation_id: i64) -> bool {
        self.inner.lanes().contains_key(&conversation_id)
    }

    fn attach_lanes(&self, lanes: Weak<dyn LaneOwnership>) {
        let _ = self.inner.owner.set(lanes);
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
        let running = inner
            .lanes()
            .values()
            .filter(|l| l.running.is_some())
            .count();
        tracing::warn!(
            runs = running,
            "grace period over: aborting runs in flight (reason: shutdown); they re-run at the next start"
        );
        inner.abort.cancel();
        let settled = tokio::time::timeout(force, inner.tracker.wait())
            .await
            .is_ok();
        CloseReport {
            settled,
            remaining: if settled { 0 } else { running },
        }
    }
}

/// A stored input (JSON), or its raw text when it is not JSON.
fn input_of(stored: &str) -> Input {
    serde_json::from_str::<Input>(stored).unwrap_or_else(|_| Input::text(stored))
}
