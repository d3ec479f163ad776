//! Durable scheduled work: reminders and recurring agent prompts.
//!
//! The truth is in the store: each active schedule has its next due slot
//! (an indexed instant), each `(schedule, slot)` is one occurrence with a
//! stable key. The worker loop:
//!
//! 1. *materializes* due schedules: records the slots that came due (the
//!    missed-run policy decides which of several fire) and advances the
//!    schedule to its next slot, in one transaction fenced on the slot it
//!    started from, so two workers never record a slot twice;
//! 2. *claims* pending occurrences with a lease and a fencing token;
//! 3. *fires* them: a `message` is written to the outbox under the
//!    occurrence key in the same transaction that marks it fired; a `prompt`
//!    is submitted to the runtime under the occurrence key (a resubmission
//!    after a crash is the same run). Failures retry with backoff up to
//!    `max_attempts`.
//!
//! A claim whose worker died is released when its lease runs out and fires
//! then; firing is idempotent by key, so an occurrence fires once.
//! tokio-cron-scheduler is not used here: it keeps jobs in memory and turns
//! zones into fixed offsets.

pub mod chat;
pub mod ops;
pub mod spec;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono_tz::Tz;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::spec::{
    SpecError, from_ms, next_cron_slot, parse_at, parse_cron, parse_duration, parse_zone, to_ms,
};
use crate::backoff::backoff;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::observe::SharedObserver;
use crate::runtime::{Input, Runtime, Submission, SubmitError};
use crate::store::{
    Fire, ItemKind, Materialize, MissedPolicy, NewOutboxItem, NewSchedule, OccurrenceRow,
    OccurrenceState, ScheduleAction, ScheduleKind, ScheduleRow, ScheduleState, SharedStore, Slot,
    StoreError, Target,
};
use crate::surface::SurfaceKind;

/// The longest text a schedule carries.
pub const MAX_TEXT: usize = 3500;

/// Slots enumerated at most when catching up one schedule; beyond that the
/// missed ones are only counted.
const MAX_ENUMERATED: usize = 10_000;

/// When a new schedule fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum When {
    /// RFC 3339 with an offset, or a local time in `timezone`.
    At(String),
    /// A duration from now (`10m`).
    After(String),
    /// A cron expression in `timezone`.
    Every(String),
}

/// A schedule to create, as a person or a program asks for it.
#[derive(Debug, Clone)]
pub struct CreateRequest {
    pub target: Target,
    pub when: When,
    pub timezone: Option<String>,
    pub action: ScheduleAction,
    pub text: String,
    pub missed: Option<MissedPolicy>,
    pub max_attempts: Option<i64>,
    pub created_by: String,
}

/// Why a schedule was not created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("{0}")]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Check a request and turn it into a schedule row to insert.
pub fn plan_new(
    request: &CreateRequest,
    config: &Config,
    now: i64,
) -> Result<NewSchedule, SpecError> {
    let text = request.text.trim();
    if text.is_empty() {
        return Err(SpecError(
            "the schedule has no text; say what to remind or prompt".into(),
        ));
    }
    if text.chars().count() > MAX_TEXT {
        return Err(SpecError(format!(
            "the text is longer than {MAX_TEXT} characters"
        )));
    }
    let zone = request.timezone.as_deref().map(parse_zone).transpose()?;
    let (kind, spec, cron, first) = match &request.when {
        When::At(at) => {
            let instant = to_ms(parse_at(at, zone)?);
            if instant <= now {
                return Err(SpecError(format!(
                    "{} is in the past",
                    spec::show(instant, zone)
                )));
            }
            (ScheduleKind::At, at.clone(), None, instant)
        }
        When::After(after) => {
            let d = parse_duration(after)?;
            (
                ScheduleKind::After,
                after.clone(),
                None,
                now + d.as_millis() as i64,
            )
        }
        When::Every(pattern) => {
            let zone = zone.ok_or_else(|| {
                SpecError("a recurring schedule needs an explicit time zone (e.g. Europe/Berlin); the host's zone is never assumed".into())
            })?;
            let cron = parse_cron(pattern)?;
            let first = to_ms(next_cron_slot(&cron, zone, from_ms(now))?);
            (
                ScheduleKind::Every,
                pattern.clone(),
                Some(pattern.clone()),
                first,
            )
        }
    };
    let missed = match request.missed {
        Some(m) => m,
        None => {
            MissedPolicy::parse(&config.scheduler.default_missed).unwrap_or(MissedPolicy::FireOnce)
        }
    };
    Ok(NewSchedule {
        kind,
        spec,
        cron,
        timezone: request.timezone.clone(),
        action: request.action,
        text: text.to_owned(),
        target: request.target.clone(),
        first_due_at: first,
        missed,
        max_attempts: request
            .max_attempts
            .unwrap_or(config.scheduler.max_attempts)
            .max(1),
        created_by: request.created_by.clone(),
        created_at: now,
    })
}

/// Create a schedule.
pub async fn create(
    store: &SharedStore,
    config: &Config,
    now: i64,
    request: &CreateRequest,
) -> Result<ScheduleRow, CreateError> {
    let new = plan_new(request, config, now)?;
    let id = store.schedule_create(&new).await?;
    Ok(store
        .schedule_get(id)
        .await?
        .ok_or_else(|| StoreError::Other(format!("schedule {id} vanished")))?)
}

/// What one step of the worker did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WorkReport {
    pub materialized: usize,
    pub fired: usize,
    pub retried: usize,
    pub failed: usize,
    pub released: u64,
}

/// The scheduler worker.
/// How soon a prompt whose lane another process holds is tried again.
const LANE_BUSY_RETRY_MS: i64 = 1_000;

pub struct Scheduler {
    pub store: SharedStore,
    /// Runtimes by configured name.
    pub runtimes: HashMap<String, Arc<dyn Runtime>>,
    /// Channel accounts by store identity: (configured name, runtime name).
    pub accounts: HashMap<String, (String, String)>,
    pub config: Arc<Config>,
    pub clock: SharedClock,
    pub observer: SharedObserver,
    pub outbox_wake: Arc<Notify>,
    /// Woken when a schedule is created in this process.
    pub wake: Arc<Notify>,
    /// This process's name in leases.
    pub owner: String,
    /// Lane ownership among processes sharing the store: a prompt enters a
    /// conversation only through the process holding its lane.
    pub lanes: Arc<crate::lanes::Lanes>,
}

impl Scheduler {
    /// Work until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        if self.store.single_process() {
            // Claims a dead process left are released at once.
            if let Err(e) = self
                .store
                .occurrences_expire_all_leases(self.clock.now_ms())
                .await
            {
                tracing::warn!(error = %e, "could not release orphaned occurrence claims");
            }
        }
        let poll = Duration::from_millis(self.config.scheduler.poll_ms);
        let mut failures = 0u32;
        loop {
            self.observer.beat("scheduler");
            let pause = match self.work().await {
                Ok(report) => {
                    failures = 0;
                    if report.fired + report.retried + report.failed + report.materialized > 0 {
                        Duration::ZERO
                    } else {
                        poll
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "scheduler step failed; backing off");
                    backoff(
                        failures,
                        Duration::from_millis(200),
                        Duration::from_secs(10),
                    )
                }
            };
            if !pause.is_zero() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            } else if stop.is_cancelled() {
                return;
            }
        }
    }

    /// One step: release dead claims, advance due schedules, fire due
    /// occurrences.
    pub async fn work(&self) -> Result<WorkReport, StoreError> {
        let mut report = WorkReport::default();
        let now = self.clock.now_ms();
        report.released = self.store.occurrences_release_expired(now).await?;
        let due = self.store.schedules_due(now, 256).await?;
        if !due.is_empty() {
            let mut plans = Vec::with_capacity(due.len());
            for schedule in &due {
                match self.plan(schedule, now) {
                    Ok(plan) => plans.push(plan),
                    Err(e) => {
                        tracing::error!(schedule = schedule.id, error = %e, "schedule cannot be computed; marking it failed");
                        self.store
                            .schedule_transition(
                                schedule.id,
                                &[ScheduleState::Active],
                                ScheduleState::Failed,
                                now,
                            )
                            .await?;
                    }
                }
            }
            let advanced = self.store.schedules_materialize(&plans).await?;
            report.materialized = advanced.iter().filter(|a| **a).count();
        }
        let lease_until = now + (self.config.scheduler.lease_secs * 1000) as i64;
        let claimed = self
            .store
            .occurrences_claim(&self.owner, now, lease_until, 64)
            .await?;
        if !claimed.is_empty() && self.config.scheduler.hold_after_claim_ms > 0 {
            tokio::time::sleep(Duration::from_millis(
                self.config.scheduler.hold_after_claim_ms,
            ))
            .await;
        }
        for (occurrence, schedule) in claimed {
            let fire = self.fire(&occurrence, &schedule).await;
            let outcome = match &fire {
                Fire::Fired { .. } => "fired",
                Fire::Retry { .. } => "retry",
                Fire::Defer { .. } => "deferred",
                Fire::Failed { .. } => "failed",
            };
            let now = self.clock.now_ms();
            if self
                .store
                .occurrence_settle(occurrence.id, occurrence.fencing_token, &fire, now)
                .await?
            {
                self.observer.occurrence(
                    schedule.id,
                    &occurrence.key,
                    outcome,
                    now - occurrence.slot_at,
                );
                match fire {
                    Fire::Fired { item, .. } => {
                        report.fired += 1;
                        if item.is_some() {
                            self.outbox_wake.notify_one();
                        }
                        tracing::info!(schedule = schedule.id, occurrence = %occurrence.key, lag_ms = now - occurrence.slot_at, "schedule fired");
                    }
                    Fire::Retry { reason, .. } => {
                        report.retried += 1;
                        tracing::warn!(schedule = schedule.id, occurrence = %occurrence.key, %reason, "occurrence will be retried");
                    }
                    Fire::Defer { reason, .. } => {
                        tracing::debug!(schedule = schedule.id, occurrence = %occurrence.key, %reason, "occurrence deferred");
                    }
                    Fire::Failed { reason } => {
                        report.failed += 1;
                        tracing::warn!(schedule = schedule.id, occurrence = %occurrence.key, %reason, "occurrence failed");
                    }
                }
            } else {
                tracing::info!(occurrence = %occurrence.key, "outcome not recorded: a newer claim owns the occurrence");
            }
        }
        Ok(report)
    }

    /// Which slots a due schedule records now, and its next slot.
    pub fn plan(&self, schedule: &ScheduleRow, now: i64) -> Result<Materialize, SpecError> {
        let due = schedule.next_due_at.unwrap_or(now);
        let tolerance = (self.config.scheduler.late_tolerance_secs * 1000) as i64;
        let mut plan = Materialize {
            schedule_id: schedule.id,
            from_due: due,
            slots: Vec::new(),
            next_due_at: None,
            skipped_uncounted: 0,
            complete: false,
            now,
        };
        // Every slot that came due, oldest first.
        let mut came_due = vec![due];
        if schedule.kind == ScheduleKind::Every {
            let zone: Tz = parse_zone(schedule.timezone.as_deref().unwrap_or_default())?;
            let cron = parse_cron(schedule.cron.as_deref().unwrap_or_default())?;
            let mut slot = due;
            let mut uncounted = 0i64;
            loop {
                slot = to_ms(next_cron_slot(&cron, zone, from_ms(slot))?);
                if slot > now {
                    break;
                }
                if came_due.len() < MAX_ENUMERATED {
                    came_due.push(slot);
                } else {
                    // A very long outage: count the rest without keeping
                    // them, and jump to the first slot after now.
                    uncounted += 1;
                    if uncounted > 1_000_000 {
                        slot = to_ms(next_cron_slot(&cron, zone, from_ms(now))?);
                        break;
                    }
                }
            }
            plan.skipped_uncounted = uncounted;
            plan.next_due_at = Some(slot);
        }
        let (missed, on_time): (Vec<i64>, Vec<i64>) =
            came_due.into_iter().partition(|s| now - s > tolerance);
        let skipped = |slot: i64, why: String| Slot {
            slot_at: slot,
            state: OccurrenceState::Skipped,
            reason: Some(why),
        };
        let fire = |slot: i64| Slot {
            slot_at: slot,
            state: OccurrenceState::Pending,
            reason: None,
        };
        let late = |slot: i64| format!("missed by {}s", (now - slot) / 1000);
        let fired_missed: Vec<i64> = match schedule.missed {
            MissedPolicy::Skip => Vec::new(),
            MissedPolicy::FireOnce if on_time.is_empty() => {
                missed.last().copied().into_iter().collect()
            }
            MissedPolicy::FireOnce => Vec::new(),
            MissedPolicy::FireAll => {
                let keep = self.config.scheduler.max_catch_up.min(missed.len());
                missed[missed.len() - keep..].to_vec()
            }
        };
        // Missed slots that do not fire: the latest is recorded (visible in
        // `schedule show`), the others only counted.
        let not_fired: Vec<i64> = missed
            .iter()
            .copied()
            .filter(|s| !fired_missed.contains(s))
            .collect();
        if let Some(&latest) = not_fired.last() {
            plan.slots.push(skipped(
                latest,
                format!(
                    "{} (missed-run policy {}); {} missed slot(s) in all",
                    late(latest),
                    schedule.missed,
                    not_fired.len()
                ),
            ));
            plan.skipped_uncounted += not_fired.len() as i64 - 1;
        }
        plan.slots.extend(fired_missed.into_iter().map(fire));
        plan.slots.extend(on_time.into_iter().map(fire));
        plan.slots.sort_by_key(|s| s.slot_at);
        if schedule.kind != ScheduleKind::Every {
            // A one-off whose only slot was skipped has nothing left.
            plan.complete = plan
                .slots
                .iter()
                .all(|s| s.state == OccurrenceState::Skipped);
        }
        Ok(plan)
    }

    /// Fire one claimed occurrence; the caller records the outcome.
    async fn fire(&self, occurrence: &OccurrenceRow, schedule: &ScheduleRow) -> Fire {
        let now = self.clock.now_ms();
        let attempt = occurrence.attempts + 1;
        let retry_or_fail = |reason: String| {
            if attempt >= schedule.max_attempts {
                Fire::Failed {
                    reason: format!("gave up after {attempt} attempt(s): {reason}"),
                }
            } else {
                let delay = backoff(
                    attempt as u32,
                    Duration::from_millis(self.config.scheduler.retry_base_ms),
                    Duration::from_millis(self.config.scheduler.retry_cap_ms),
                );
                Fire::Retry {
                    next_attempt_at: now + delay.as_millis() as i64,
                    reason,
                }
            }
        };
        let conversation_id = match self.store.conversation_current(&schedule.target, now).await {
            Ok(id) => id,
            Err(e) => return retry_or_fail(format!("could not resolve the conversation: {e}")),
        };
        match schedule.action {
            ScheduleAction::Message => Fire::Fired {
                run_id: None,
                item: Some(Box::new(NewOutboxItem {
                    item_key: occurrence.key.clone(),
                    conversation_id,
                    account: schedule.target.account.clone(),
                    chat_id: schedule.target.chat_id.clone(),
                    thread_id: schedule.target.thread_id.clone(),
                    surface: schedule.target.surface,
                    reply_to: None,
                    run_id: None,
                    kind: ItemKind::Notice,
                    text: schedule.text.clone(),
                    group_key: None,
                    edits_key: None,
                    attachments: Vec::new(),
                    created_at: now,
                })),
            },
            ScheduleAction::Prompt => {
                let Some((name, runtime_name)) = self.accounts.get(&schedule.target.account) else {
                    return retry_or_fail(format!(
                        "channel account {} is not configured in this daemon",
                        schedule.target.account
                    ));
                };
                let Some(runtime) = self.runtimes.get(runtime_name) else {
                    return retry_or_fail(format!("runtime {runtime_name} is not running"));
                };
                // The input enters the conversation's lane on the `schedule`
                // surface; its answer is delivered the target surface's way.
                let schedule_surface = self.config.surface(SurfaceKind::Schedule);
                let target_surface = self.config.surface_for(
                    name,
                    schedule.target.surface,
                    &schedule.target.chat_id,
                );
                let policy = match schedule_surface.input_policy {
                    crate::surface::InputPolicy::Auto => target_surface.policy_for(None),
                    p => p,
                };
                let submission = Submission {
                    idempotency_key: occurrence.key.clone(),
                    conversation_id,
                    inbound_id: None,
                    account: schedule.target.account.clone(),
                    chat_id: schedule.target.chat_id.clone(),
                    thread_id: schedule.target.thread_id.clone(),
                    surface: schedule.target.surface,
                    reply_to: None,
                    input: Input::text(schedule.text.clone()),
                    policy,
                    coalesce_pending: schedule_surface.coalesce_pending,
                    max_queued_inputs: schedule_surface.max_queued_inputs,
                    soft_interrupt: schedule_surface.soft_interrupt,
                };
                match self.lanes.hold(conversation_id).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Another process serves the conversation now; this
                        // is not an attempt, so a busy lane never uses up
                        // the occurrence's retries.
                        return Fire::Defer {
                            next_attempt_at: now + LANE_BUSY_RETRY_MS,
                            reason: "another process holds the conversation's lane".into(),
                        };
                    }
                    Err(e) => return retry_or_fail(format!("could not take the lane: {e}")),
                }
                match runtime.submit(vec![submission]).await.into_iter().next() {
                    Some(Ok(admission)) => Fire::Fired {
                        run_id: Some(admission.run_id),
                        item: None,
                    },
                    Some(Err(SubmitError::Rejected(why))) => Fire::Failed {
                        reason: format!("the runtime refused it: {why}"),
                    },
                    Some(Err(e)) => retry_or_fail(e.to_string()),
                    None => retry_or_fail("the runtime gave no answer".into()),
                }
            }
        }
    }
}

/// A zone named in a schedule, for showing its times.
pub fn zone_of(schedule: &ScheduleRow) -> Option<Tz> {
    schedule
        .timezone
        .as_deref()
        .and_then(|z| parse_zone(z).ok())
}
