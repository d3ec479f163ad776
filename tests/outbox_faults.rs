//! The outbox against a platform that fails on purpose: an adapter in the
//! test tree, driven by the real dispatcher and reconciler on a real SQLite
//! file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use switchboard::clock::{SharedClock, SystemClock};
use switchboard::config::{Config, StoreConfig, Synchronous};
use switchboard::observe::{Event, Observer};
use switchboard::outbox::ChatLocks;
use switchboard::outbox::dispatcher::Dispatcher;
use switchboard::outbox::rate::RateLimiter;
use switchboard::outbox::reconcile::Reconciler;
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{self, DispatchState, ItemKind, NewOutboxItem, OutboxFilter, SharedStore};
use switchboard::surface::SurfaceKind;
use switchboard_channel::{
    Capabilities, ChannelAdapter, DeliveryError, LengthUnit, Limits, OutboundMessage, Platform,
    Rate, RateScope, Receipt,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The fault a send meets on its first attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Fault {
    None,
    RetryAfter,
    NotSent,
    Permanent,
    /// The message reached the platform; the answer was lost.
    AmbiguousAfter,
    /// The message never arrived; the answer was lost.
    AmbiguousBefore,
}

/// Fixed proportions: 4% of each fault, 80% none.
fn fault_of(index: usize) -> Fault {
    match index % 25 {
        0 => Fault::RetryAfter,
        1 => Fault::NotSent,
        2 => Fault::Permanent,
        3 => Fault::AmbiguousAfter,
        4 => Fault::AmbiguousBefore,
        _ => Fault::None,
    }
}

/// A platform that fails on purpose and records what it delivered.
struct FakePlatform {
    identity: String,
    /// Folds a resend of the same key into the first message (like a
    /// Discord nonce).
    idempotent: bool,
    faults: HashMap<String, Fault>,
    limits: Limits,
    attempts: Mutex<HashMap<String, u32>>,
    /// Every message the platform created: (key, conversation, ordinal, when).
    delivered: Mutex<Vec<(String, i64, i64, Instant)>>,
    /// Sends that block (key → how long), for lease-expiry tests.
    stall_first: Mutex<HashMap<String, Duration>>,
    /// Answer the first send with a global 429 of this length.
    global_429: Mutex<Option<Duration>>,
    /// When that 429 was answered.
    answered_429: Mutex<Option<Instant>>,
}

impl FakePlatform {
    fn new(identity: &str, idempotent: bool) -> Self {
        FakePlatform {
            identity: identity.to_owned(),
            idempotent,
            faults: HashMap::new(),
            limits: Limits {
                max_text_len: 4096,
                length_unit: LengthUnit::Chars,
                per_chat: None,
                per_group: None,
                per_account: None,
            },
            attempts: Mutex::new(HashMap::new()),
            delivered: Mutex::new(Vec::new()),
            stall_first: Mutex::new(HashMap::new()),
            global_429: Mutex::new(None),
            answered_429: Mutex::new(None),
        }
    }

    fn deliver(&self, m: &OutboundMessage) -> Receipt {
        let mut delivered = self.delivered.lock().unwrap();
        if !(self.idempotent && delivered.iter().any(|(k, ..)| *k == m.item_key)) {
            delivered.push((
                m.item_key.clone(),
                m.meta.conversation_id,
                m.meta.ordinal,
                Instant::now(),
            ));
        }
        Receipt {
            message_ids: vec![format!("msg-{}", m.item_key)],
        }
    }
}

#[async_trait]
impl ChannelAdapter for FakePlatform {
    fn identity(&self) -> &str {
        &self.identity
    }
    fn platform(&self) -> Platform {
        Platform::Webhook
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            idempotent_send: self.idempotent,
            edit: false,
            typing: false,
            drafts: false,
        }
    }
    async fn send(&self, m: &OutboundMessage) -> Result<Receipt, DeliveryError> {
        if let Some(after) = self.global_429.lock().unwrap().take() {
            *self.answered_429.lock().unwrap() = Some(Instant::now());
            return Err(DeliveryError::RetryAfter {
                after,
                scope: RateScope::Account,
            });
        }
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let n = attempts.entry(m.item_key.clone()).or_default();
            *n += 1;
            *n
        };
        let stall = self.stall_first.lock().unwrap().remove(&m.item_key);
        if let Some(stall) = stall {
            tokio::time::sleep(stall).await;
        }
        let fault = if attempt == 1 {
            self.faults.get(&m.item_key).copied().unwrap_or(Fault::None)
        } else {
            Fault::None
        };
        match fault {
            Fault::None => Ok(self.deliver(m)),
            Fault::RetryAfter => Err(DeliveryError::RetryAfter {
                after: Duration::from_millis(20),
                scope: RateScope::Chat,
            }),
            Fault::NotSent => Err(DeliveryError::NotSent("connection refused".into())),
            Fault::Permanent => Err(DeliveryError::Permanent("chat not found".into())),
            Fault::AmbiguousAfter => {
                self.deliver(m);
                Err(DeliveryError::Ambiguous(
                    "timed out after the request left".into(),
                ))
            }
            Fault::AmbiguousBefore => Err(DeliveryError::Ambiguous("timed out".into())),
        }
    }
}

struct Harness {
    _dir: tempfile::TempDir,
    store: SharedStore,
    config: Arc<Config>,
    observer: Arc<Observer>,
    wake: Arc<Notify>,
    stop: CancellationToken,
}

impl Harness {
    async fn new(extra: &str) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let store = store::open(
            &StoreConfig {
                url: format!("sqlite://{}", dir.path().join("o.db").display()),
                synchronous: Synchronous::Full,
                batch_size: 512,
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
            [outbox]
            backoff_base_ms = 10
            backoff_cap_ms = 50
            reconcile_after_secs = 0
            [surfaces.webhook]
            on_ambiguous_send = "hold"
            {extra}
            "#
        ))
        .unwrap();
        Harness {
            _dir: dir,
            store,
            config: Arc::new(config),
            observer: Arc::new(Observer::new()),
            wake: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
        }
    }

    fn dispatcher(&self, platforms: &[Arc<FakePlatform>], owner: &str) -> Dispatcher {
        let adapters: HashMap<String, Arc<dyn ChannelAdapter>> = platforms
            .iter()
            .map(|p| (p.identity.clone(), p.clone() as Arc<dyn ChannelAdapter>))
            .collect();
        let rate = Arc::new(RateLimiter::new(
            adapters
                .iter()
                .map(|(k, a)| (k.clone(), a.limits()))
                .collect(),
        ));
        let clock: SharedClock = Arc::new(SystemClock);
        Dispatcher::new(
            self.store.clone(),
            adapters,
            rate,
            Arc::new(ChatLocks::default()),
            self.config.outbox.clone(),
            clock,
            self.observer.clone(),
            self.wake.clone(),
            owner.to_owned(),
        )
    }

    fn spawn_dispatcher(&self, platforms: &[Arc<FakePlatform>], owner: &str) {
        let d = self.dispatcher(platforms, owner);
        let stop = self.stop.clone();
        tokio::spawn(async move { d.run(stop, std::future::pending()).await });
    }

    fn spawn_reconciler(&self, platforms: &[Arc<FakePlatform>], every: Duration) {
        let r = Reconciler {
            store: self.store.clone(),
            config: self.config.clone(),
            capabilities: platforms
                .iter()
                .map(|p| (p.identity.clone(), p.capabilities()))
                .collect(),
            clock: Arc::new(SystemClock),
            observer: self.observer.clone(),
            dispatcher_wake: self.wake.clone(),
        };
        let stop = self.stop.clone();
        tokio::spawn(async move { r.run(every, stop).await });
    }

    async fn wait_settled(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.store.outbox_stats().await.unwrap();
            if stats.not_dispatched == 0 && stats.possibly_dispatched == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "not settled: {stats:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn item(key: String, conversation_id: i64, account: &str, surface: SurfaceKind) -> NewOutboxItem {
    NewOutboxItem {
        item_key: key.clone(),
        conversation_id,
        account: account.to_owned(),
        chat_id: format!("chat-{conversation_id}"),
        thread_id: None,
        surface,
        reply_to: None,
        run_id: None,
        kind: ItemKind::Answer,
        text: key,
        group_key: None,
        edits_key: None,
        attachments: Vec::new(),
        created_at: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_items_with_a_fifth_failing_end_as_their_faults_dictate() {
    const CONVERSATIONS: usize = 100;
    const PER_CONVERSATION: usize = 100;
    let harness = Harness::new("").await;
    // Three accounts, three reconciliation policies: telegram.private
    // resends (a duplicate is possible), discord.dm resends under the
    // platform's idempotency key, webhook (configured) holds.
    let setups = [
        ("fake:resend", false, SurfaceKind::TelegramPrivate),
        ("fake:idempotent", true, SurfaceKind::DiscordDm),
        ("fake:hold", true, SurfaceKind::Webhook),
    ];
    let mut platforms: Vec<FakePlatform> = setups
        .iter()
        .map(|(id, idem, _)| FakePlatform::new(id, *idem))
        .collect();
    let mut expected: HashMap<String, (Fault, usize)> = HashMap::new();
    let mut items = Vec::new();
    let mut index = 0;
    for i in 0..PER_CONVERSATION {
        for c in 0..CONVERSATIONS {
            let setup = c % 3;
            let (account, _, surface) = setups[setup];
            let key = format!("c{c}-i{i}");
            let fault = fault_of(index);
            index += 1;
            platforms[setup].faults.insert(key.clone(), fault);
            expected.insert(key.clone(), (fault, setup));
            items.push(item(key, c as i64 + 1, account, surface));
        }
    }
    for chunk in items.chunks(500) {
        harness.store.outbox_enqueue(chunk).await.unwrap();
    }
    let platforms: Vec<Arc<FakePlatform>> = platforms.into_iter().map(Arc::new).collect();
    let started = Instant::now();
    harness.spawn_dispatcher(&platforms, "worker-1");
    harness.spawn_reconciler(&platforms, Duration::from_millis(50));
    harness.wait_settled(Duration::from_secs(120)).await;
    println!("10,000 items settled in {:?}", started.elapsed());

    // Every item ends in the state its fault dictates.
    let all = harness
        .store
        .outbox_list(&OutboxFilter {
            limit: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        all.len(),
        CONVERSATIONS * PER_CONVERSATION,
        "nothing missing"
    );
    let mut tally: BTreeMap<(usize, Fault, &'static str), usize> = BTreeMap::new();
    for it in &all {
        let (fault, setup) = expected[&it.item_key];
        let want = match (fault, setup) {
            (Fault::Permanent, _) => DispatchState::Failed,
            (Fault::AmbiguousAfter | Fault::AmbiguousBefore, 2) => DispatchState::Held,
            _ => DispatchState::Acknowledged,
        };
        assert_eq!(
            it.state, want,
            "{} with {fault:?} on setup {setup}: {:?}",
            it.item_key, it.reason
        );
        *tally.entry((setup, fault, it.state.as_str())).or_default() += 1;
        match fault {
            Fault::NotSent => assert_eq!(it.attempts, 1, "{}", it.item_key),
            Fault::RetryAfter => {
                assert_eq!(it.attempts, 0, "RetryAfter does not count: {}", it.item_key)
            }
            _ => {}
        }
    }
    println!("(setup, fault, state) → items: {tally:?}");

    for (setup, platform) in platforms.iter().enumerate() {
        let delivered = platform.delivered.lock().unwrap().clone();
        // No conversation sees an item before an earlier one.
        let mut last: HashMap<i64, i64> = HashMap::new();
        let mut seen: HashSet<String> = HashSet::new();
        for (key, conversation, ordinal, _) in &delivered {
            if seen.insert(key.clone()) {
                let previous = last.insert(*conversation, *ordinal).unwrap_or(0);
                assert!(
                    *ordinal > previous,
                    "conversation {conversation} saw #{ordinal} after #{previous}"
                );
            }
        }
        let mut copies: HashMap<&str, usize> = HashMap::new();
        for (key, ..) in &delivered {
            *copies.entry(key.as_str()).or_default() += 1;
        }
        let duplicates: usize = copies.values().map(|n| n - 1).sum();
        let ambiguous_after = expected
            .values()
            .filter(|(f, s)| *s == setup && *f == Fault::AmbiguousAfter)
            .count();
        match setup {
            0 => assert_eq!(
                duplicates, ambiguous_after,
                "resend: one duplicate per send that arrived but was not confirmed"
            ),
            _ => assert_eq!(duplicates, 0, "setup {setup}: no duplicates"),
        }
        // Nothing missing: every item that should have reached the platform
        // did.
        for (key, (fault, s)) in &expected {
            if *s != setup {
                continue;
            }
            let should_arrive = match fault {
                Fault::Permanent => false,
                Fault::AmbiguousBefore => setup != 2,
                _ => true,
            };
            assert_eq!(
                copies.contains_key(key.as_str()),
                should_arrive,
                "{key} ({fault:?}) on setup {setup}"
            );
        }
        println!(
            "setup {setup}: {} messages delivered, {duplicates} duplicates",
            delivered.len()
        );
    }
    harness.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_workers_late_outcome_is_rejected_by_the_fencing_token() {
    let harness = Harness::new("").await;
    let mut config = (*harness.config).clone();
    config.outbox.lease_secs = 1;
    let harness = Harness {
        config: Arc::new(config),
        ..harness
    };
    let platform = Arc::new(FakePlatform::new("fake:idempotent", true));
    // The first send hangs past its lease.
    platform
        .stall_first
        .lock()
        .unwrap()
        .insert("x".into(), Duration::from_millis(2500));
    harness
        .store
        .outbox_enqueue(&[item(
            "x".into(),
            1,
            "fake:idempotent",
            SurfaceKind::DiscordDm,
        )])
        .await
        .unwrap();
    let mut events = harness.observer.subscribe();
    harness.spawn_dispatcher(std::slice::from_ref(&platform), "worker-1");
    tokio::time::sleep(Duration::from_millis(200)).await;
    harness.spawn_dispatcher(std::slice::from_ref(&platform), "worker-2");
    harness.spawn_reconciler(std::slice::from_ref(&platform), Duration::from_millis(100));

    let mut fenced = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !fenced && Instant::now() < deadline {
        if let Ok(Ok(Event::Fenced { item_key })) =
            tokio::time::timeout(Duration::from_millis(200), events.recv()).await
        {
            assert_eq!(item_key, "x");
            fenced = true;
        }
    }
    assert!(fenced, "the stale worker's late ack was not rejected");
    let x = harness.store.outbox_get_by_key("x").await.unwrap().unwrap();
    assert_eq!(x.state, DispatchState::Acknowledged);
    // Claimed (1), reconciled for a resend (2), claimed again (3): the
    // newest claim's outcome stands.
    assert_eq!(x.fencing_token, 3);
    assert_eq!(*platform.attempts.lock().unwrap().get("x").unwrap(), 2);
    assert_eq!(
        platform.delivered.lock().unwrap().len(),
        1,
        "the resend used the idempotency key"
    );
    harness.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_chat_and_per_account_rate_limits_hold_and_a_global_429_pauses_all() {
    let harness = Harness::new("").await;
    let mut platform = FakePlatform::new("fake:limited", true);
    platform.limits.per_chat = Some(Rate {
        per_second: 2.0,
        burst: 1,
    });
    platform.limits.per_account = Some(Rate {
        per_second: 5.0,
        burst: 2,
    });
    let platform = Arc::new(platform);
    // A global 429 on the very first send.
    *platform.global_429.lock().unwrap() = Some(Duration::from_millis(800));
    let mut items = Vec::new();
    for i in 0..6 {
        for c in 1..=4 {
            items.push(item(
                format!("c{c}-{i}"),
                c,
                "fake:limited",
                SurfaceKind::DiscordDm,
            ));
        }
    }
    harness.store.outbox_enqueue(&items).await.unwrap();
    let started = Instant::now();
    harness.spawn_dispatcher(std::slice::from_ref(&platform), "worker-1");
    harness.wait_settled(Duration::from_secs(30)).await;
    let delivered = platform.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 24);
    // Sends already in flight when the 429 came may land; none starts
    // during the pause.
    let paused_at = platform.answered_429.lock().unwrap().unwrap();
    for (key, _, _, at) in &delivered {
        let since = at.saturating_duration_since(paused_at);
        assert!(
            *at < paused_at + Duration::from_millis(50) || since >= Duration::from_millis(780),
            "{key} was sent {since:?} into an 800 ms global pause"
        );
    }
    // Per chat: 2/s, so consecutive sends in one chat are ≥ ~0.5 s apart.
    let mut per_chat: HashMap<i64, Vec<Instant>> = HashMap::new();
    for (_, c, _, at) in &delivered {
        per_chat.entry(*c).or_default().push(*at);
    }
    for (c, times) in &per_chat {
        for pair in times.windows(2) {
            let gap = pair[1].duration_since(pair[0]);
            assert!(
                gap >= Duration::from_millis(450),
                "chat {c}: two sends {gap:?} apart"
            );
        }
    }
    // Per account: at most burst + rate × window in any window.
    let mut times: Vec<Instant> = delivered.iter().map(|d| d.3).collect();
    times.sort();
    for (i, t) in times.iter().enumerate() {
        let in_window = times[i..]
            .iter()
            .take_while(|u| u.duration_since(*t) < Duration::from_secs(1))
            .count();
        assert!(in_window <= 7, "{in_window} sends within one second");
    }
    println!("24 sends over 4 chats took {:?}", started.elapsed());
    harness.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_a_chunk_fails_the_later_chunks_of_its_answer_fail_with_it() {
    let harness = Harness::new("").await;
    let mut platform = FakePlatform::new("fake:resend", false);
    platform
        .faults
        .insert("run-1-answer-2".into(), Fault::Permanent);
    let platform = Arc::new(platform);
    let mut items = Vec::new();
    for part in 1..=4 {
        let mut it = item(
            format!("run-1-answer-{part}"),
            1,
            "fake:resend",
            SurfaceKind::TelegramPrivate,
        );
        it.group_key = Some("run-1-answer".into());
        items.push(it);
    }
    items.push(item(
        "next-answer".into(),
        1,
        "fake:resend",
        SurfaceKind::TelegramPrivate,
    ));
    harness.store.outbox_enqueue(&items).await.unwrap();
    harness.spawn_dispatcher(std::slice::from_ref(&platform), "worker-1");
    harness.wait_settled(Duration::from_secs(10)).await;
    let state = |k: &'static str| {
        let store = harness.store.clone();
        async move { store.outbox_get_by_key(k).await.unwrap().unwrap() }
    };
    assert_eq!(
        state("run-1-answer-1").await.state,
        DispatchState::Acknowledged
    );
    assert_eq!(state("run-1-answer-2").await.state, DispatchState::Failed);
    for later in ["run-1-answer-3", "run-1-answer-4"] {
        let it = state(later).await;
        assert_eq!(
            (it.state, it.reason.as_deref()),
            (
                DispatchState::Failed,
                Some("an earlier chunk of this answer failed")
            )
        );
    }
    assert_eq!(
        state("next-answer").await.state,
        DispatchState::Acknowledged,
        "the lane goes on"
    );
    let keys: Vec<String> = platform
        .delivered
        .lock()
        .unwrap()
        .iter()
        .map(|d| d.0.clone())
        .collect();
    assert_eq!(keys, ["run-1-answer-1", "next-answer"]);
    harness.stop.cancel();
}
