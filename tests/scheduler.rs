//! The scheduler engine on a real SQLite file with a clock the test moves:
//! no real sleeping. Prompt actions go to a runtime that counts what it is
//! given and can be made unreachable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use switchboard::clock::{ManualClock, SharedClock};
use switchboard::config::{Config, StoreConfig, Synchronous};
use switchboard::observe::Observer;
use switchboard::runtime::{
    Admission, CloseReport, RunDelta, Runtime, Stop, StopReport, Submission, SubmitError,
};
use switchboard::schedule::{CreateRequest, Scheduler, When, create};
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{
    self, MissedPolicy, OccurrenceState, OutboxFilter, ScheduleAction, ScheduleState, SharedStore,
    Target,
};
use switchboard::surface::SurfaceKind;
use switchboard_channel::ChatKind;
use tokio::sync::{Notify, broadcast};

/// A runtime that records every submission and can refuse them.
struct Counting {
    up: AtomicBool,
    submissions: Mutex<Vec<String>>,
    deltas: broadcast::Sender<RunDelta>,
}

impl Counting {
    fn new() -> Arc<Self> {
        Arc::new(Counting {
            up: AtomicBool::new(true),
            submissions: Mutex::new(Vec::new()),
            deltas: broadcast::channel(1).0,
        })
    }

    fn count(&self, key: &str) -> usize {
        self.submissions
            .lock()
            .unwrap()
            .iter()
            .filter(|k| *k == key)
            .count()
    }
}

#[async_trait]
impl Runtime for Counting {
    fn name(&self) -> &str {
        "default"
    }
    async fn submit(&self, batch: Vec<Submission>) -> Vec<Result<Admission, SubmitError>> {
        batch
            .into_iter()
            .map(|s| {
                self.submissions
                    .lock()
                    .unwrap()
                    .push(s.idempotency_key.clone());
                if self.up.load(Ordering::SeqCst) {
                    Ok(Admission {
                        run_id: format!("run-for-{}", s.idempotency_key),
                        new: true,
                    })
                } else {
                    Err(SubmitError::Unavailable("connection refused".into()))
                }
            })
            .collect()
    }
    async fn stop(&self, _stop: Stop) -> Result<StopReport, SubmitError> {
        Ok(StopReport::default())
    }
    fn deltas(&self) -> broadcast::Receiver<RunDelta> {
        self.deltas.subscribe()
    }
    async fn recover(&self) -> Result<usize, String> {
        Ok(0)
    }
    async fn close(&self, _g: Duration, _f: Duration) -> CloseReport {
        CloseReport {
            settled: true,
            remaining: 0,
        }
    }
}

struct Bench {
    _dir: tempfile::TempDir,
    store: SharedStore,
    config: Arc<Config>,
    clock: Arc<ManualClock>,
    runtime: Arc<Counting>,
}

fn ms(rfc3339: &str) -> i64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .unwrap()
        .timestamp_millis()
}

impl Bench {
    async fn new(start: &str, extra: &str) -> Bench {
        let dir = tempfile::tempdir().unwrap();
        let store = store::open(
            &StoreConfig {
                url: format!("sqlite://{}", dir.path().join("s.db").display()),
                synchronous: Synchronous::Full,
                batch_size: 64,
                ..Default::default()
            },
            OpenMode::Daemon,
        )
        .await
        .unwrap();
        let config = Config::from_toml(&format!(
            r#"
            [runtimes.default]
            kind = "local"
            model = {{ backend = "echo" }}
            [channels.main]
            kind = "webhook"
            runtime = "default"
            callback_url = "http://127.0.0.1:1/"
            [scheduler]
            retry_base_ms = 1000
            retry_cap_ms = 2000
            {extra}
            "#
        ))
        .unwrap();
        Bench {
            _dir: dir,
            store,
            config: Arc::new(config),
            clock: ManualClock::new(ms(start)),
            runtime: Counting::new(),
        }
    }

    fn scheduler(&self, owner: &str) -> Scheduler {
        let runtime: Arc<dyn Runtime> = self.runtime.clone();
        let clock: SharedClock = self.clock.clone();
        Scheduler {
            lanes: switchboard::lanes::Lanes::new(
                self.store.clone(),
                owner.to_owned(),
                Duration::from_secs(15),
                clock.clone(),
                vec![runtime.clone()],
            ),
            store: self.store.clone(),
            runtimes: [("default".to_owned(), runtime)].into_iter().collect(),
            accounts: [(
                "webhook:main".to_owned(),
                ("main".to_owned(), "default".to_owned()),
            )]
            .into_iter()
            .collect(),
            config: self.config.clone(),
            clock,
            observer: Arc::new(Observer::new()),
            outbox_wake: Arc::new(Notify::new()),
            wake: Arc::new(Notify::new()),
            owner: owner.to_owned(),
        }
    }

    async fn add(
        &self,
        when: When,
        zone: Option<&str>,
        action: ScheduleAction,
        text: &str,
        missed: Option<MissedPolicy>,
        attempts: Option<i64>,
    ) -> i64 {
        let request = CreateRequest {
            target: Target {
                account: "webhook:main".into(),
                chat_id: "chat".into(),
                thread_id: None,
                chat_kind: ChatKind::Private,
                surface: SurfaceKind::Webhook,
            },
            when,
            timezone: zone.map(str::to_owned),
            action,
            text: text.into(),
            missed,
            max_attempts: attempts,
            created_by: "test".into(),
        };
        create(&self.store, &self.config, self.clock.now_ms(), &request)
            .await
            .unwrap()
            .id
    }

    /// Occurrences of a schedule, oldest slot first: (slot, state).
    async fn occurrences(&self, id: i64) -> Vec<(i64, OccurrenceState)> {
        let mut o: Vec<(i64, OccurrenceState)> = self
            .store
            .occurrences_list(id, 1000)
            .await
            .unwrap()
            .iter()
            .map(|o| (o.slot_at, o.state))
            .collect();
        o.reverse();
        o
    }

    async fn fired_slots(&self, id: i64) -> Vec<i64> {
        self.occurrences(id)
            .await
            .into_iter()
            .filter(|(_, s)| *s == OccurrenceState::Fired)
            .map(|(t, _)| t)
            .collect()
    }
}

use switchboard::clock::Clock as _;

/// Step the clock to each instant and let the scheduler work there;
/// returns the slots fired at each step.
async fn walk(b: &Bench, scheduler: &Scheduler, id: i64, instants: &[&str]) -> Vec<Vec<i64>> {
    let mut out = Vec::new();
    for t in instants {
        let before = b.fired_slots(id).await.len();
        b.clock.set(ms(t));
        scheduler.work().await.unwrap();
        out.push(b.fired_slots(id).await[before..].to_vec());
    }
    out
}

#[tokio::test]
async fn dst_gaps_and_overlaps_fire_at_defined_instants_in_two_zones() {
    // Berlin, spring forward on 2026-03-29: 02:30 does not exist.
    let b = Bench::new("2026-03-27T12:00:00Z", "").await;
    let s = b.scheduler("w");
    let id = b
        .add(
            When::Every("30 2 * * *".into()),
            Some("Europe/Berlin"),
            ScheduleAction::Message,
            "tea",
            None,
            None,
        )
        .await;
    let steps = walk(
        &b,
        &s,
        id,
        &[
            "2026-03-28T01:29:59Z", // 02:29:59 CET: not yet
            "2026-03-28T01:30:00Z", // 02:30 CET
            "2026-03-29T00:59:59Z", // 01:59:59 CET, the gap starts at 02:00
            "2026-03-29T01:00:00Z", // 03:00 CEST: the first valid instant after the gap
            "2026-03-30T00:30:00Z", // 02:30 CEST
        ],
    )
    .await;
    assert_eq!(
        steps,
        [
            vec![],
            vec![ms("2026-03-28T01:30:00Z")],
            vec![],
            vec![ms("2026-03-29T01:00:00Z")],
            vec![ms("2026-03-30T00:30:00Z")]
        ]
    );

    // Berlin, fall back on 2026-10-25: 02:30 happens twice; it fires once.
    let b = Bench::new("2026-10-24T12:00:00Z", "").await;
    let s = b.scheduler("w");
    let id = b
        .add(
            When::Every("30 2 * * *".into()),
            Some("Europe/Berlin"),
            ScheduleAction::Message,
            "tea",
            None,
            None,
        )
        .await;
    let steps = walk(
        &b,
        &s,
        id,
        &[
            "2026-10-25T00:30:00Z", // 02:30 CEST, the first
            "2026-10-25T01:30:00Z", // 02:30 CET, the repeat: nothing
            "2026-10-26T01:30:00Z", // 02:30 CET the next day
        ],
    )
    .await;
    assert_eq!(
        steps,
        [
            vec![ms("2026-10-25T00:30:00Z")],
            vec![],
            vec![ms("2026-10-26T01:30:00Z")]
        ]
    );

    // New York: spring forward 2026-03-08 (02:15 missing), fall back
    // 2026-11-01 (01:30 twice).
    let b = Bench::new("2026-03-07T00:00:00Z", "").await;
    let s = b.scheduler("w");
    let id = b
        .add(
            When::Every("15 2 * * *".into()),
            Some("America/New_York"),
            ScheduleAction::Message,
            "x",
            None,
            None,
        )
        .await;
    let steps = walk(
        &b,
        &s,
        id,
        &[
            "2026-03-07T07:15:00Z",
            "2026-03-08T07:00:00Z",
            "2026-03-09T06:15:00Z",
        ],
    )
    .await;
    assert_eq!(
        steps,
        [
            vec![ms("2026-03-07T07:15:00Z")],
            vec![ms("2026-03-08T07:00:00Z")],
            vec![ms("2026-03-09T06:15:00Z")]
        ],
        "02:15 EST, then 03:00 EDT (the gap's end), then 02:15 EDT"
    );
    let b = Bench::new("2026-10-31T12:00:00Z", "").await;
    let s = b.scheduler("w");
    let id = b
        .add(
            When::Every("30 1 * * *".into()),
            Some("America/New_York"),
            ScheduleAction::Message,
            "x",
            None,
            None,
        )
        .await;
    let steps = walk(
        &b,
        &s,
        id,
        &[
            "2026-11-01T05:30:00Z",
            "2026-11-01T06:30:00Z",
            "2026-11-02T06:30:00Z",
        ],
    )
    .await;
    assert_eq!(
        steps,
        [
            vec![ms("2026-11-01T05:30:00Z")],
            vec![],
            vec![ms("2026-11-02T06:30:00Z")]
        ]
    );

    // A local `at` time inside a gap fires at the gap's end.
    let b = Bench::new("2026-03-28T00:00:00Z", "").await;
    let s = b.scheduler("w");
    let id = b
        .add(
            When::At("2026-03-29 02:30".into()),
            Some("Europe/Berlin"),
            ScheduleAction::Message,
            "x",
            None,
            None,
        )
        .await;
    let steps = walk(
        &b,
        &s,
        id,
        &["2026-03-29T00:59:59Z", "2026-03-29T01:00:00Z"],
    )
    .await;
    assert_eq!(steps, [vec![], vec![ms("2026-03-29T01:00:00Z")]]);
    assert_eq!(
        b.store.schedule_get(id).await.unwrap().unwrap().state,
        ScheduleState::Completed
    );
}

#[tokio::test]
async fn missed_run_policies_after_a_downtime() {
    let b = Bench::new(
        "2026-06-01T00:00:30Z",
        "late_tolerance_secs = 10\nmax_catch_up = 3\n",
    )
    .await;
    let s = b.scheduler("w");
    let every = || When::Every("* * * * *".into());
    let skip = b
        .add(
            every(),
            Some("UTC"),
            ScheduleAction::Message,
            "skip",
            Some(MissedPolicy::Skip),
            None,
        )
        .await;
    let once = b
        .add(
            every(),
            Some("UTC"),
            ScheduleAction::Message,
            "once",
            Some(MissedPolicy::FireOnce),
            None,
        )
        .await;
    let all = b
        .add(
            every(),
            Some("UTC"),
            ScheduleAction::Message,
            "all",
            Some(MissedPolicy::FireAll),
            None,
        )
        .await;
    // Down from 00:00:30 to 00:10:30: the slots 00:01 .. 00:10 were missed.
    b.clock.set(ms("2026-06-01T00:10:30Z"));
    s.work().await.unwrap();
    let minute = |m: u32| ms(&format!("2026-06-01T00:{m:02}:00Z"));
    assert_eq!(b.fired_slots(skip).await, Vec::<i64>::new());
    assert_eq!(
        b.fired_slots(once).await,
        [minute(10)],
        "one catch-up for the latest missed slot"
    );
    assert_eq!(
        b.fired_slots(all).await,
        [minute(8), minute(9), minute(10)],
        "the latest max_catch_up slots"
    );
    for (id, skipped) in [(skip, 10), (once, 9), (all, 7)] {
        let row = b.store.schedule_get(id).await.unwrap().unwrap();
        assert_eq!(row.skipped, skipped, "schedule {id}");
        assert_eq!(
            row.next_due_at,
            Some(minute(11)),
            "advanced past the downtime"
        );
        // The skip is visible, with the count and the policy.
        let o = b.store.occurrences_list(id, 20).await.unwrap();
        let visible = o
            .iter()
            .find(|o| o.state == OccurrenceState::Skipped)
            .expect("a skipped occurrence is recorded");
        assert!(
            visible
                .reason
                .as_deref()
                .unwrap()
                .contains(&format!("{skipped} missed slot(s)")),
            "{:?}",
            visible.reason
        );
    }
    // The fired messages reached the outbox once each.
    let items = b
        .store
        .outbox_list(&OutboxFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(items.len(), 4);
    // Back to normal: the next slot fires on time for all three.
    b.clock.set(ms("2026-06-01T00:11:00Z"));
    s.work().await.unwrap();
    for id in [skip, once, all] {
        assert_eq!(b.fired_slots(id).await.last(), Some(&minute(11)));
    }
}

#[tokio::test]
async fn a_one_off_that_exhausts_its_attempts_fails_and_a_recurring_one_moves_on() {
    let b = Bench::new("2026-06-01T00:00:00Z", "").await;
    let s = b.scheduler("w");
    b.runtime.up.store(false, Ordering::SeqCst);
    let once = b
        .add(
            When::After("1m".into()),
            None,
            ScheduleAction::Prompt,
            "ping",
            None,
            Some(3),
        )
        .await;
    let every = b
        .add(
            When::Every("*/5 * * * *".into()),
            Some("UTC"),
            ScheduleAction::Prompt,
            "tick",
            None,
            Some(2),
        )
        .await;
    let mut t = ms("2026-06-01T00:01:00Z");
    for _ in 0..4 {
        b.clock.set(t);
        s.work().await.unwrap();
        t += 3_000; // past the largest backoff (2 s)
    }
    let once_row = b.store.schedule_get(once).await.unwrap().unwrap();
    assert_eq!(
        (once_row.state, once_row.failed),
        (ScheduleState::Failed, 1)
    );
    let o = &b.store.occurrences_list(once, 5).await.unwrap()[0];
    assert_eq!((o.state, o.attempts), (OccurrenceState::Failed, 3));
    assert!(
        o.reason
            .as_deref()
            .unwrap()
            .contains("gave up after 3 attempt(s)"),
        "{:?}",
        o.reason
    );
    assert_eq!(b.runtime.count(&o.key), 3, "one submission per attempt");

    // The recurring one: its 00:05 slot fails after two attempts while the
    // runtime is down ...
    for t in [
        "2026-06-01T00:05:00Z",
        "2026-06-01T00:05:03Z",
        "2026-06-01T00:05:06Z",
    ] {
        b.clock.set(ms(t));
        s.work().await.unwrap();
    }
    assert_eq!(
        b.occurrences(every).await,
        [(ms("2026-06-01T00:05:00Z"), OccurrenceState::Failed)]
    );
    let every_row = b.store.schedule_get(every).await.unwrap().unwrap();
    assert_eq!(
        (every_row.state, every_row.failed),
        (ScheduleState::Active, 1),
        "a recurring schedule goes on"
    );
    assert_eq!(every_row.next_due_at, Some(ms("2026-06-01T00:10:00Z")));
    // ... and its next slot fires once the runtime is back.
    b.runtime.up.store(true, Ordering::SeqCst);
    b.clock.set(ms("2026-06-01T00:10:00Z"));
    s.work().await.unwrap();
    assert_eq!(
        b.occurrences(every).await,
        [
            (ms("2026-06-01T00:05:00Z"), OccurrenceState::Failed),
            (ms("2026-06-01T00:10:00Z"), OccurrenceState::Fired)
        ]
    );
}

#[tokio::test]
async fn two_workers_racing_on_one_store_never_fire_an_occurrence_twice() {
    let b = Bench::new("2026-06-01T00:00:00Z", "").await;
    let (w1, w2) = (b.scheduler("worker-1"), b.scheduler("worker-2"));
    let mut prompts = Vec::new();
    let mut messages = Vec::new();
    for i in 0..60 {
        prompts.push(
            b.add(
                When::After(format!("{}s", 1 + i % 5)),
                None,
                ScheduleAction::Prompt,
                &format!("p{i}"),
                None,
                None,
            )
            .await,
        );
        messages.push(
            b.add(
                When::After(format!("{}s", 1 + i % 5)),
                None,
                ScheduleAction::Message,
                &format!("m{i}"),
                None,
                None,
            )
            .await,
        );
    }
    let every = b
        .add(
            When::Every("* * * * * *".into()),
            Some("UTC"),
            ScheduleAction::Prompt,
            "each second",
            None,
            None,
        )
        .await;
    // Both workers step through ten seconds together, concurrently.
    for second in 1..=10 {
        b.clock.set(ms("2026-06-01T00:00:00Z") + second * 1000);
        for _ in 0..3 {
            let (a, c) = tokio::join!(w1.work(), w2.work());
            a.unwrap();
            c.unwrap();
        }
    }
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for key in b.runtime.submissions.lock().unwrap().iter() {
        *per_key.entry(key.clone()).or_default() += 1;
    }
    for id in prompts.iter().chain([&every]) {
        for o in b.store.occurrences_list(*id, 100).await.unwrap() {
            assert_eq!(o.state, OccurrenceState::Fired, "{}", o.key);
            assert_eq!(
                per_key.get(&o.key),
                Some(&1),
                "{} submitted {:?} times",
                o.key,
                per_key.get(&o.key)
            );
        }
    }
    assert_eq!(
        b.store.occurrences_list(every, 100).await.unwrap().len(),
        10,
        "one occurrence per slot"
    );
    let items = b
        .store
        .outbox_list(&OutboxFilter {
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(items.len(), messages.len(), "each message delivered once");
    let total: usize = per_key.values().sum();
    assert_eq!(total, prompts.len() + 10, "no submission twice");
}

#[tokio::test]
async fn paused_schedules_wait_and_cancelled_ones_never_fire() {
    let b = Bench::new("2026-06-01T00:00:00Z", "late_tolerance_secs = 5\n").await;
    let s = b.scheduler("w");
    let every = b
        .add(
            When::Every("*/10 * * * * *".into()),
            Some("UTC"),
            ScheduleAction::Message,
            "x",
            Some(MissedPolicy::FireOnce),
            None,
        )
        .await;
    let once = b
        .add(
            When::After("30s".into()),
            None,
            ScheduleAction::Message,
            "y",
            None,
            None,
        )
        .await;
    use switchboard::schedule::ops::transition;
    transition(&b.store, b.clock.now_ms(), every, "pause")
        .await
        .unwrap();
    transition(&b.store, b.clock.now_ms(), once, "cancel")
        .await
        .unwrap();
    b.clock.set(ms("2026-06-01T00:01:00Z"));
    s.work().await.unwrap();
    assert!(b.fired_slots(every).await.is_empty() && b.fired_slots(once).await.is_empty());
    assert!(
        transition(&b.store, b.clock.now_ms(), once, "resume")
            .await
            .is_err(),
        "a cancelled schedule stays cancelled"
    );
    transition(&b.store, b.clock.now_ms(), every, "resume")
        .await
        .unwrap();
    s.work().await.unwrap();
    assert_eq!(
        b.fired_slots(every).await,
        [ms("2026-06-01T00:01:00Z")],
        "resumed: the missed-run policy applies"
    );
}
