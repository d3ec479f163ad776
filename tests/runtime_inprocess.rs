//! The runtime's parts in one process on a real SQLite file: the transient
//! delta stream of the built-in runtime, and the submitter's notice when a
//! runtime stays unreachable.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use switchboard::clock::{SharedClock, SystemClock};
use switchboard::config::{Config, StoreConfig, Synchronous};
use switchboard::observe::Observer;
use switchboard::runtime::local::{Deps, LocalRuntime};
use switchboard::runtime::{
    Admission, CloseReport, Input, RunDelta, Runtime, Stop, StopReport, Submission, SubmitError,
};
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{
    self, Disposition, JournalOutcome, NewInbound, OutboxFilter, SharedStore,
};
use switchboard::submitter::Submitter;
use switchboard::surface::{InputPolicy, SurfaceKind};
use switchboard_channel::ChatKind;
use tokio::sync::{Notify, broadcast};
use tokio_util::sync::CancellationToken;

async fn store(dir: &std::path::Path) -> SharedStore {
    store::open(
        &StoreConfig {
            url: format!("sqlite://{}", dir.join("s.db").display()),
            synchronous: Synchronous::Full,
            batch_size: 64,
            ..Default::default()
        },
        OpenMode::Daemon,
    )
    .await
    .unwrap()
}

fn config(extra: &str) -> Config {
    Config::from_toml(&format!(
        r#"
        [runtimes.default]
        kind = "local"
        model = {{ backend = "echo", token_delay_ms = 5 }}
        [channels.main]
        kind = "webhook"
        runtime = "default"
        callback_url = "http://127.0.0.1:1/replies"
        {extra}
        "#
    ))
    .unwrap()
}

#[tokio::test]
async fn the_local_runtime_streams_gap_free_deltas_that_add_up_to_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let config = config("");
    let switchboard::config::RuntimeConfig::Local(local) = &config.runtimes["default"] else {
        panic!("the test config has a local runtime")
    };
    let clock: SharedClock = Arc::new(SystemClock);
    let runtime = LocalRuntime::new(
        "default",
        local,
        Deps {
            store: store.clone(),
            batch_size: 16,
            messages: config.messages.clone(),
            shaper: Default::default(),
            clock,
            observer: Arc::new(Observer::new()),
            outbox_wake: Arc::new(Notify::new()),
        },
    )
    .unwrap();
    let mut deltas = runtime.deltas();
    let admitted = runtime
        .submit(vec![Submission {
            idempotency_key: "k1".into(),
            conversation_id: 1,
            inbound_id: None,
            account: "webhook:main".into(),
            chat_id: "c".into(),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
            input: Input::text("one two three four"),
            policy: InputPolicy::Queue,
            coalesce_pending: false,
            max_queued_inputs: 32,
            soft_interrupt: false,
        }])
        .await;
    let run_id = admitted[0].as_ref().unwrap().run_id.clone();
    let mut seen: Vec<RunDelta> = Vec::new();
    loop {
        let d = tokio::time::timeout(Duration::from_secs(5), deltas.recv())
            .await
            .unwrap()
            .unwrap();
        let done = d.text == "echo: one two three four";
        seen.push(d);
        if done {
            break;
        }
    }
    assert!(
        seen.iter()
            .all(|d| d.run_id == run_id && d.epoch == 1 && d.conversation_id == 1)
    );
    let sequences: Vec<u64> = seen.iter().map(|d| d.sequence).collect();
    assert_eq!(sequences, (1..=seen.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        seen.iter().map(|d| d.delta.as_str()).collect::<String>(),
        "echo: one two three four"
    );
    // The durable terminal record comes with the reply item.
    assert!(
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if !store
                    .outbox_list(&OutboxFilter {
                        limit: 5,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .is_empty()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .is_ok()
    );
    let report = runtime
        .close(Duration::from_secs(1), Duration::from_secs(1))
        .await;
    assert!(report.settled);
}

/// A runtime that is unreachable until told otherwise.
struct Flaky {
    up: AtomicBool,
    deltas: broadcast::Sender<RunDelta>,
}

#[async_trait]
impl Runtime for Flaky {
    fn name(&self) -> &str {
        "default"
    }
    async fn submit(&self, batch: Vec<Submission>) -> Vec<Result<Admission, SubmitError>> {
        batch
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if self.up.load(Ordering::SeqCst) {
                    Ok(Admission {
                        run_id: format!("remote-{i}"),
                        new: true,
                    })
                } else {
                    Err(SubmitError::Unavailable("connection refused".into()))
                }
            })
            .collect()
    }
    async fn stop(&self, _stop: Stop) -> Result<StopReport, SubmitError> {
        Err(SubmitError::Unavailable("down".into()))
    }
    fn deltas(&self) -> broadcast::Receiver<RunDelta> {
        self.deltas.subscribe()
    }
    async fn recover(&self) -> Result<usize, String> {
        Ok(0)
    }
    async fn close(&self, _grace: Duration, _force: Duration) -> CloseReport {
        CloseReport {
            settled: true,
            remaining: 0,
        }
    }
}

#[tokio::test]
async fn a_message_waiting_on_an_unreachable_runtime_gets_one_notice_and_is_answered_later() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let config = Arc::new(config(
        "[submitter]\nretry_secs = 1\nunreachable_notice_secs = 1\n",
    ));
    let inbound = match store
        .journal_insert(&[NewInbound {
            account: "webhook:main".into(),
            update_key: "1".into(),
            chat_id: "c".into(),
            chat_kind: ChatKind::Private,
            thread_id: None,
            surface: SurfaceKind::Webhook,
            sender_id: None,
            sender_name: None,
            message_id: None,
            payload: r#"{"type":"message","text":"hi"}"#.into(),
            disposition: Disposition::Pending,
            reason: None,
            submission_key: "in-1".into(),
            input_policy: None,
            closes_conversation: false,
            migrates_to: None,
            space: None,
            addressed: true,
            received_at: 0,
        }])
        .await
        .unwrap()[0]
    {
        JournalOutcome::Accepted { inbound_id, .. } => inbound_id,
        other => panic!("{other:?}"),
    };
    let flaky = Arc::new(Flaky {
        up: AtomicBool::new(false),
        deltas: broadcast::channel(1).0,
    });
    let runtime: Arc<dyn Runtime> = flaky.clone();
    let lanes = switchboard::lanes::Lanes::new(
        store.clone(),
        "test".into(),
        Duration::from_secs(15),
        Arc::new(SystemClock),
        vec![runtime.clone()],
    );
    let submitter = Submitter {
        lanes,
        store: store.clone(),
        runtimes: [("default".to_owned(), runtime)].into_iter().collect(),
        accounts: [(
            "webhook:main".to_owned(),
            ("main".to_owned(), "default".to_owned()),
        )]
        .into_iter()
        .collect(),
        config,
        clock: Arc::new(SystemClock),
        observer: Arc::new(Observer::new()),
        wake: Arc::new(Notify::new()),
        outbox_wake: Arc::new(Notify::new()),
        scheduler_wake: Arc::new(Notify::new()),
        access: Default::default(),
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(submitter.run(stop.clone()));

    let notices = || async {
        store
            .outbox_list(&OutboxFilter {
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_iter()
            .filter(|i| i.item_key == format!("in-{inbound}-unreachable"))
            .count()
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while notices().await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("no unreachable notice");
    let row = store.journal_get(inbound).await.unwrap().unwrap();
    assert_eq!(
        row.disposition,
        Disposition::Pending,
        "the message still waits to be answered"
    );
    // More failed attempts do not tell the sender again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(notices().await, 1);

    flaky.up.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), async {
        while store
            .journal_get(inbound)
            .await
            .unwrap()
            .unwrap()
            .disposition
            != Disposition::Admitted
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("never admitted once the runtime was back");
    stop.cancel();
    task.await.unwrap();
}

/// A platform that records typing indicators.
struct Typist {
    typing: std::sync::Mutex<Vec<std::time::Instant>>,
}

#[async_trait]
impl switchboard_channel::ChannelAdapter for Typist {
    fn identity(&self) -> &str {
        "webhook:main"
    }
    fn platform(&self) -> switchboard_channel::Platform {
        switchboard_channel::Platform::Webhook
    }
    fn limits(&self) -> switchboard_channel::Limits {
        switchboard_channel::Limits {
            max_text_len: 4096,
            length_unit: switchboard_channel::LengthUnit::Chars,
            per_chat: None,
            per_group: None,
            per_account: None,
        }
    }
    fn capabilities(&self) -> switchboard_channel::Capabilities {
        switchboard_channel::Capabilities {
            idempotent_send: false,
            edit: true,
            typing: true,
            drafts: false,
        }
    }
    async fn send(
        &self,
        _m: &switchboard_channel::OutboundMessage,
    ) -> Result<switchboard_channel::Receipt, switchboard_channel::DeliveryError> {
        Ok(switchboard_channel::Receipt::default())
    }
    async fn typing(
        &self,
        _chat: &str,
        _thread: Option<&str>,
    ) -> Result<(), switchboard_channel::DeliveryError> {
        self.typing.lock().unwrap().push(std::time::Instant::now());
        Ok(())
    }
}

#[tokio::test]
async fn a_terminal_only_surface_shows_typing_while_the_run_is_active() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path()).await;
    let config = Arc::new(config("[outbox]\ntyping_interval_ms = 200\n"));
    let switchboard::config::RuntimeConfig::Local(local) = &config.runtimes["default"] else {
        panic!("the test config has a local runtime")
    };
    let mut local = local.clone();
    local.model = switchboard::config::ModelConfig::Echo(switchboard::config::EchoConfig {
        token_delay_ms: 60,
    });
    let typist = Arc::new(Typist {
        typing: std::sync::Mutex::new(Vec::new()),
    });
    let adapters: std::collections::HashMap<String, Arc<dyn switchboard_channel::ChannelAdapter>> =
        [(
            "webhook:main".to_owned(),
            typist.clone() as Arc<dyn switchboard_channel::ChannelAdapter>,
        )]
        .into_iter()
        .collect();
    let clock: SharedClock = Arc::new(SystemClock);
    let runtime = LocalRuntime::new(
        "default",
        &local,
        Deps {
            store: store.clone(),
            batch_size: 16,
            messages: config.messages.clone(),
            shaper: switchboard::outbox::shape::Shaper::new(adapters.clone()),
            clock: clock.clone(),
            observer: Arc::new(Observer::new()),
            outbox_wake: Arc::new(Notify::new()),
        },
    )
    .unwrap();
    let streamer = Arc::new(switchboard::outbox::stream::Streamer {
        store: store.clone(),
        adapters: adapters.clone(),
        config: config.clone(),
        account_names: [("webhook:main".to_owned(), "main".to_owned())]
            .into_iter()
            .collect(),
        rate: Arc::new(switchboard::outbox::rate::RateLimiter::new(
            Default::default(),
        )),
        chat_locks: Arc::new(switchboard::outbox::ChatLocks::default()),
        clock,
        dispatcher_wake: Arc::new(Notify::new()),
    });
    let stop = CancellationToken::new();
    tokio::spawn(streamer.run(runtime.deltas(), stop.clone()));
    let started = std::time::Instant::now();
    runtime
        .submit(vec![Submission {
            idempotency_key: "k".into(),
            conversation_id: 1,
            inbound_id: None,
            account: "webhook:main".into(),
            chat_id: "c".into(),
            thread_id: None,
            surface: SurfaceKind::Webhook,
            reply_to: None,
            input: Input::text("a b c d e f g h i j k l"),
            policy: InputPolicy::Queue,
            coalesce_pending: false,
            max_queued_inputs: 32,
            soft_interrupt: false,
        }])
        .await;
    // 14 words at 60 ms: about 0.85 s of output, typing renewed every 200 ms.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let typing = typist.typing.lock().unwrap().clone();
    assert!(typing.len() >= 3, "typing shown {} times", typing.len());
    assert!(
        typing.len() <= 6,
        "typing renewed more often than configured: {}",
        typing.len()
    );
    assert!(
        typing
            .iter()
            .all(|t| t.duration_since(started) < Duration::from_millis(1000)),
        "typing after the run ended"
    );
    stop.cancel();
}
