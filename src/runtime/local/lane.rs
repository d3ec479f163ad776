//! One conversation's lane in the built-in runtime: the running run, the
//! queued runs in execution order, and the decision each input policy takes
//! when a new input arrives (DESIGN.md §2). Pure logic, no I/O.

use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::runtime::{Input, Route};
use crate::store::{RunMode, RunState};
use crate::surface::InputPolicy;

/// A run waiting in the lane.
#[derive(Debug, Clone)]
pub struct QueuedRun {
    pub run_id: i64,
    pub mode: RunMode,
    pub route: Arc<Route>,
    pub inputs: Vec<Input>,
}

impl QueuedRun {
    fn priority(&self) -> i64 {
        i64::from(self.mode == RunMode::Urgent)
    }

    /// Execution order: urgent first, then by arrival. Runs not admitted yet
    /// (negative provisional ids, -1 first) come after every admitted run.
    fn order(&self) -> (i64, i64) {
        let arrival = if self.run_id >= 0 {
            self.run_id
        } else {
            i64::MAX / 2 - self.run_id
        };
        (-self.priority(), arrival)
    }
}

/// An inject input offered to the running run.
#[derive(Debug, Clone)]
pub struct Offer {
    pub run_id: i64,
    pub inputs: Vec<Input>,
}

/// How the running run is told what happens to it.
#[derive(Debug, Default)]
pub struct RunControl {
    /// Cancelled when the run must end now.
    cancel: CancellationToken,
    /// The terminal state it ends in when cancelled.
    end_as: Mutex<Option<RunState>>,
    /// Inject inputs not yet taken into the run.
    offers: Mutex<Vec<Offer>>,
    /// Cancelled to cut the current model call (soft interrupt); replaced
    /// at every step.
    step: Mutex<CancellationToken>,
    /// Ended by `/stop`: its confirmation follows the run's last words.
    stopped: std::sync::atomic::AtomicBool,
}

impl RunControl {
    pub fn new() -> Arc<Self> {
        Arc::new(RunControl::default())
    }

    /// End the run now, as `state` (the first request wins).
    pub fn end(&self, state: RunState) {
        let mut end_as = self.end_as.lock().unwrap_or_else(|p| p.into_inner());
        end_as.get_or_insert(state);
        self.cancel.cancel();
    }

    /// End the run now because of `/stop` (or `/new`).
    pub fn end_stopped(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.end(RunState::Interrupted);
    }

    pub fn stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn ending(&self) -> bool {
        self.cancel.is_cancelled()
    }

    pub fn end_state(&self) -> RunState {
        self.end_as
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(RunState::Interrupted)
    }

    pub fn cancelled(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Offer an inject input; `soft` cuts the current model call at once.
    pub fn offer(&self, offer: Offer, soft: bool) {
        self.offers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(offer);
        if soft {
            self.step.lock().unwrap_or_else(|p| p.into_inner()).cancel();
        }
    }

    /// Take every offer made so far.
    pub fn take_offers(&self) -> Vec<Offer> {
        std::mem::take(&mut *self.offers.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A fresh token for the next model call. An offer that arrived with
    /// `soft` before this call started cuts it at once.
    pub fn next_step(&self) -> CancellationToken {
        let token = CancellationToken::new();
        let pending_soft = {
            let mut step = self.step.lock().unwrap_or_else(|p| p.into_inner());
            let was_cut = step.is_cancelled();
            *step = token.clone();
            was_cut
        };
        if pending_soft
            && !self
                .offers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        {
            token.cancel();
        }
        token
    }
}

/// The running run.
#[derive(Debug, Clone)]
pub struct Running {
    pub run_id: i64,
    pub control: Arc<RunControl>,
}

/// Where a new input goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// A run of its own.
    NewRun(RunMode),
    /// Join this queued ordinary run (coalescing).
    Join(i64),
}

/// What admitting one input does to the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub placement: Placement,
    /// The running run ends, in this state.
    pub interrupt: Option<(i64, RunState)>,
    /// The running run is offered the input at its next step boundary.
    pub inject_into: Option<i64>,
}

/// The lane is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull {
    pub queued: usize,
    pub max: usize,
}

/// A conversation's lane.
#[derive(Debug, Default)]
pub struct Lane {
    /// In execution order: urgent runs first (FIFO among them), then the
    /// rest in id order.
    pub queue: Vec<QueuedRun>,
    pub running: Option<Running>,
}

impl Lane {
    /// A copy to take decisions on before they are committed: the running
    /// run gets its own control, so marking it there changes nothing real.
    pub fn shadow(&self) -> Lane {
        Lane {
            queue: self.queue.clone(),
            running: self.running.as_ref().map(|r| {
                let control = RunControl::new();
                if r.control.ending() {
                    control.end(r.control.end_state());
                }
                Running {
                    run_id: r.run_id,
                    control,
                }
            }),
        }
    }

    /// Record on a shadow that the running run was asked to end.
    pub fn mark_ending(&mut self, state: RunState) {
        if let Some(r) = &self.running {
            r.control.end(state);
        }
    }

    /// Queued runs.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// The ids of the queued runs, in execution order.
    pub fn queued_ids(&self) -> Vec<i64> {
        self.queue.iter().map(|q| q.run_id).collect()
    }

    /// Inputs waiting in queued runs.
    pub fn queued_inputs(&self) -> usize {
        self.queue.iter().map(|q| q.inputs.len()).sum()
    }

    pub fn knows(&self, run_id: i64) -> bool {
        self.running.as_ref().is_some_and(|r| r.run_id == run_id)
            || self.queue.iter().any(|q| q.run_id == run_id)
    }

    /// The decision for a new input under `policy` (already resolved from
    /// `auto`).
    pub fn plan(
        &self,
        policy: InputPolicy,
        coalesce: bool,
        max_queued: usize,
    ) -> Result<Plan, QueueFull> {
        let queued = self.queued_inputs();
        if queued >= max_queued {
            return Err(QueueFull {
                queued,
                max: max_queued,
            });
        }
        // A run already asked to end takes no more inputs and needs no
        // second interrupt.
        let running = self
            .running
            .as_ref()
            .filter(|r| !r.control.ending())
            .map(|r| r.run_id);
        // With coalescing there is at most one ordinary successor, and
        // later inputs join it. Urgent and inject runs never take others.
        let successor = coalesce
            .then(|| {
                self.queue
                    .iter()
                    .rev()
                    .find(|q| q.mode == RunMode::Ordinary)
                    .map(|q| q.run_id)
            })
            .flatten();
        let ordinary = successor.map_or(Placement::NewRun(RunMode::Ordinary), Placement::Join);
        let plan = match policy {
            InputPolicy::Queue | InputPolicy::Auto => Plan {
                placement: ordinary,
                interrupt: None,
                inject_into: None,
            },
            InputPolicy::Inject => match running {
                Some(run_id) => Plan {
                    placement: Placement::NewRun(RunMode::Inject),
                    interrupt: None,
                    inject_into: Some(run_id),
                },
                None => Plan {
                    placement: ordinary,
                    interrupt: None,
                    inject_into: None,
                },
            },
            InputPolicy::Interrupt => Plan {
                placement: ordinary,
                interrupt: running.map(|r| (r, RunState::Interrupted)),
                inject_into: None,
            },
            InputPolicy::Supersede => Plan {
                placement: ordinary,
                interrupt: running.map(|r| (r, RunState::Superseded)),
                inject_into: None,
            },
            InputPolicy::InterruptNext => Plan {
                placement: Placement::NewRun(RunMode::Urgent),
                interrupt: running.map(|r| (r, RunState::Interrupted)),
                inject_into: None,
            },
        };
        Ok(plan)
    }

    /// Put a run in execution order.
    pub fn insert(&mut self, run: QueuedRun) {
        if self.knows(run.run_id) {
            return;
        }
        let at = self
            .queue
            .iter()
            .position(|q| q.order() > run.order())
            .unwrap_or(self.queue.len());
        self.queue.insert(at, run);
    }

    /// Add an input to a queued run (coalescing). Returns `false` when the
    /// run is not queued here.
    pub fn join(&mut self, run_id: i64, input: Input) -> bool {
        match self.queue.iter_mut().find(|q| q.run_id == run_id) {
            Some(q) => {
                q.inputs.push(input);
                true
            }
            None => false,
        }
    }

    /// Remove queued runs (cancelled, or absorbed by the run that answered
    /// their inputs).
    pub fn remove(&mut self, run_ids: &[i64]) {
        self.queue.retain(|q| !run_ids.contains(&q.run_id));
    }

    /// The next run to execute.
    pub fn pop_next(&mut self) -> Option<QueuedRun> {
        (!self.queue.is_empty()).then(|| self.queue.remove(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(t: &str) -> Input {
        Input {
            text: t.into(),
            attachments: vec![],
            sender_id: None,
            sender_name: None,
        }
    }

    fn queued(run_id: i64, mode: RunMode) -> QueuedRun {
        QueuedRun {
            run_id,
            mode,
            route: Arc::new(Route {
                account: "webhook:a".into(),
                chat_id: "c".into(),
                thread_id: None,
                surface: crate::surface::SurfaceKind::Webhook,
                reply_to: None,
            }),
            inputs: vec![input("x")],
        }
    }

    fn with_running(run_id: i64) -> Lane {
        Lane {
            queue: vec![],
            running: Some(Running {
                run_id,
                control: RunControl::new(),
            }),
        }
    }

    #[test]
    fn urgent_runs_go_first_and_stay_fifo_among_themselves() {
        let mut lane = Lane::default();
        lane.insert(queued(2, RunMode::Ordinary));
        lane.insert(queued(3, RunMode::Urgent));
        lane.insert(queued(4, RunMode::Ordinary));
        lane.insert(queued(5, RunMode::Urgent));
        let order: Vec<i64> = std::iter::from_fn(|| lane.pop_next().map(|q| q.run_id)).collect();
        assert_eq!(order, [3, 5, 2, 4]);
    }

    #[test]
    fn runs_not_admitted_yet_queue_after_admitted_ones_in_arrival_order() {
        let mut lane = Lane::default();
        lane.insert(queued(-1, RunMode::Ordinary));
        lane.insert(queued(7, RunMode::Ordinary));
        lane.insert(queued(-2, RunMode::Ordinary));
        lane.insert(queued(-3, RunMode::Urgent));
        let order: Vec<i64> = lane.queue.iter().map(|q| q.run_id).collect();
        assert_eq!(order, [-3, 7, -1, -2]);
    }

    #[test]
    fn each_policy_decides_as_designed() {
        let lane = with_running(1);
        let plan = |p| lane.plan(p, false, 32).unwrap();
        assert_eq!(
            plan(InputPolicy::Queue),
            Plan {
                placement: Placement::NewRun(RunMode::Ordinary),
                interrupt: None,
                inject_into: None
            }
        );
        assert_eq!(
            plan(InputPolicy::Inject),
            Plan {
                placement: Placement::NewRun(RunMode::Inject),
                interrupt: None,
                inject_into: Some(1)
            }
        );
        assert_eq!(
            plan(InputPolicy::Interrupt).interrupt,
            Some((1, RunState::Interrupted))
        );
        assert_eq!(
            plan(InputPolicy::Supersede).interrupt,
            Some((1, RunState::Superseded))
        );
        let next = plan(InputPolicy::InterruptNext);
        assert_eq!(next.placement, Placement::NewRun(RunMode::Urgent));
        assert_eq!(next.interrupt, Some((1, RunState::Interrupted)));
    }

    #[test]
    fn inject_without_a_running_run_is_an_ordinary_input() {
        let lane = Lane::default();
        let plan = lane.plan(InputPolicy::Inject, false, 32).unwrap();
        assert_eq!(plan.placement, Placement::NewRun(RunMode::Ordinary));
        assert_eq!(plan.inject_into, None);
    }

    #[test]
    fn a_run_already_ending_is_not_interrupted_or_injected_again() {
        let lane = with_running(1);
        lane.running
            .as_ref()
            .unwrap()
            .control
            .end(RunState::Interrupted);
        assert_eq!(
            lane.plan(InputPolicy::Interrupt, false, 32)
                .unwrap()
                .interrupt,
            None
        );
        assert_eq!(
            lane.plan(InputPolicy::Inject, false, 32)
                .unwrap()
                .inject_into,
            None
        );
    }

    #[test]
    fn coalescing_joins_the_ordinary_successor_only() {
        let mut lane = with_running(1);
        lane.insert(queued(2, RunMode::Ordinary));
        lane.insert(queued(3, RunMode::Urgent));
        assert_eq!(
            lane.plan(InputPolicy::Queue, true, 32).unwrap().placement,
            Placement::Join(2)
        );
        assert_eq!(
            lane.plan(InputPolicy::InterruptNext, true, 32)
                .unwrap()
                .placement,
            Placement::NewRun(RunMode::Urgent),
            "urgent inputs never coalesce into an ordinary pending run"
        );
        assert_eq!(
            lane.plan(InputPolicy::Queue, false, 32).unwrap().placement,
            Placement::NewRun(RunMode::Ordinary)
        );
    }

    #[test]
    fn the_queue_is_bounded_by_inputs() {
        let mut lane = with_running(1);
        for i in 0..3 {
            lane.insert(queued(10 + i, RunMode::Ordinary));
        }
        assert_eq!(
            lane.plan(InputPolicy::Queue, false, 3),
            Err(QueueFull { queued: 3, max: 3 })
        );
        assert!(lane.plan(InputPolicy::Queue, false, 4).is_ok());
    }

    #[test]
    fn a_soft_offer_cuts_the_current_step() {
        let control = RunControl::new();
        let step = control.next_step();
        control.offer(
            Offer {
                run_id: 2,
                inputs: vec![input("b")],
            },
            false,
        );
        assert!(
            !step.is_cancelled(),
            "a plain inject waits for the step boundary"
        );
        control.offer(
            Offer {
                run_id: 3,
                inputs: vec![input("c")],
            },
            true,
        );
        assert!(step.is_cancelled());
        assert_eq!(control.take_offers().len(), 2);
    }
}
