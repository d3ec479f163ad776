//! Build the parts, run them, and stop them in order with a deadline.
//!
//! Start: open the store (migrations applied), build runtimes and channel
//! adapters, bind the listeners, then report ready; the recovery work
//! (reconciling orphaned sends, resuming runs, resubmitting pending journal
//! rows) runs after that, so start-up does not grow with the backlog.
//!
//! Stop: ingress first (updates are refused with 503 so platforms redeliver
//! them later), then the submitter, then the runtimes get their grace period,
//! then the dispatcher drains its sends in flight; whatever is unconfirmed
//! stays `possibly_dispatched` for the next start.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use switchboard_channel::{AccountStatus, ChannelAdapter, IngressSink, Platform};
use switchboard_discord::DiscordChannel;
use switchboard_telegram::TelegramChannel;
use switchboard_webhook::{IngressAccount, WebhookSender};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::clock::{SharedClock, SystemClock};
use crate::config::{ChannelConfig, Config, RuntimeConfig, parse_listen};
use crate::ingress::{AccountInfo, Ingress, RoleLeases};
use crate::lanes::Lanes;
use crate::observe::{Observer, SharedObserver};
use crate::outbox::ChatLocks;
use crate::outbox::dispatcher::Dispatcher;
use crate::outbox::rate::RateLimiter;
use crate::outbox::reconcile::Reconciler;
use crate::outbox::shape::Shaper;
use crate::outbox::stream::Streamer;
use crate::runtime::Runtime;
use crate::runtime::local::{Deps, LocalRuntime};
use crate::schedule::Scheduler;
use crate::store::sqlite::OpenMode;
use crate::store::{self, SharedStore};
use crate::submitter::Submitter;

/// A running daemon.
pub struct Daemon {
    /// The public listener's bound address (webhook channel).
    pub ingress_addr: SocketAddr,
    /// The admin listener's bound address.
    pub admin_addr: SocketAddr,
    pub observer: SharedObserver,
    pub store: SharedStore,
    config: Arc<Config>,
    ingress: Arc<Ingress>,
    runtimes: Vec<Arc<dyn Runtime>>,
    /// Stops the HTTP listeners.
    listeners_stop: CancellationToken,
    listeners: Vec<JoinHandle<()>>,
    /// Stops the platform connections (Telegram polling).
    channels_stop: CancellationToken,
    channel_tasks: Vec<JoinHandle<()>>,
    /// Periodic housekeeping (retention).
    housekeeping: Option<tokio_cron_scheduler::JobScheduler>,
    /// Stops the submitter and the reconciler.
    workers_stop: CancellationToken,
    submitter: JoinHandle<()>,
    reconciler: JoinHandle<()>,
    scheduler: JoinHandle<()>,
    /// Stops the dispatcher's claiming; `dispatch_deadline` ends its drain.
    dispatch_stop: CancellationToken,
    dispatch_deadline: CancellationToken,
    dispatcher: JoinHandle<usize>,
    /// Lane leases (shared store): renewed until the runtimes closed, then
    /// released so other processes take over at once.
    lanes: Arc<Lanes>,
    lanes_stop: CancellationToken,
    lanes_task: JoinHandle<()>,
}

/// How a shutdown went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Runs and sends in flight all settled before the deadline.
    pub settled: bool,
    /// Runs and sends still in flight when the deadline ran out.
    pub remaining: usize,
    pub took: Duration,
}

impl Daemon {
    /// Build and start every part. Returns once the listeners are bound and
    /// recovery work is queued.
    pub async fn start(config: Config) -> anyhow::Result<Daemon> {
        Self::start_with_clock(config, Arc::new(SystemClock)).await
    }

    pub async fn start_with_clock(config: Config, clock: SharedClock) -> anyhow::Result<Daemon> {
        let config = Arc::new(config);
        let store = store::open(&config.store, OpenMode::Daemon)
            .await
            .context("opening the store")?;
        let observer: SharedObserver = Arc::new(Observer::new());
        let submitter_wake = Arc::new(Notify::new());
        let dispatcher_wake = Arc::new(Notify::new());
        let scheduler_wake = Arc::new(Notify::new());
        let owner = lease_owner(clock.now_ms());
        let started_ms = clock.now_ms();

        // Channel accounts: their ingress side and their adapters.
        let mut accounts = Vec::new();
        let mut adapters: HashMap<String, Arc<dyn ChannelAdapter>> = HashMap::new();
        let mut account_names = HashMap::new();
        let mut webhook_accounts = HashMap::new();
        let mut telegram: Vec<Arc<TelegramChannel>> = Vec::new();
        let mut discord: Vec<Arc<DiscordChannel>> = Vec::new();
        for (name, channel) in &config.channels {
            match channel {
                ChannelConfig::Webhook(w) => {
                    let identity = switchboard_webhook::identity(name);
                    let secret = w
                        .resolve_secret()
                        .map_err(|e| anyhow::anyhow!("channels.{name}.secret_file: {e}"))?;
                    let url = reqwest::Url::parse(&w.callback_url)
                        .with_context(|| format!("channels.{name}.callback_url"))?;
                    let sender = WebhookSender::new(
                        identity.clone(),
                        url,
                        w.callback_timeout(),
                        w.max_reply_chars,
                    )
                    .with_context(|| format!("building the HTTP client of channels.{name}"))?
                    .signed(w.resolve_signing_secret().map_err(|e| {
                        anyhow::anyhow!("channels.{name}.callback_signing_secret_file: {e}")
                    })?);
                    adapters.insert(identity.clone(), Arc::new(sender));
                    webhook_accounts.insert(name.clone(), IngressAccount { secret });
                    account_names.insert(identity.clone(), (name.clone(), w.runtime.clone()));
                    accounts.push(AccountInfo {
                        name: name.clone(),
                        identity,
                        platform: Platform::Webhook,
                    });
                }
                ChannelConfig::Telegram(t) => {
                    let menu = crate::commands::MENU
                        .iter()
                        .map(|(n, d)| ((*n).to_owned(), (*d).to_owned()))
                        .collect();
                    let channel = t
                        .settings(name, menu)
                        .and_then(TelegramChannel::new)
                        .map_err(|e| anyhow::anyhow!("channels.{name}: {e}"))?;
                    let channel = Arc::new(channel);
                    let identity = channel.identity().to_owned();
                    adapters.insert(identity.clone(), channel.clone());
                    telegram.push(channel);
                    account_names.insert(identity.clone(), (name.clone(), t.runtime.clone()));
                    accounts.push(AccountInfo {
                        name: name.clone(),
                        identity,
                        platform: Platform::Telegram,
                    });
                }
                ChannelConfig::Discord(d) => {
                    let channel = d
                        .settings(name)
                        .and_then(DiscordChannel::new)
                        .map_err(|e| anyhow::anyhow!("channels.{name}: {e}"))?;
                    let channel = Arc::new(channel);
                    let identity = channel.identity().to_owned();
                    adapters.insert(identity.clone(), channel.clone());
                    discord.push(channel);
                    account_names.insert(identity.clone(), (name.clone(), d.runtime.clone()));
                    accounts.push(AccountInfo {
                        name: name.clone(),
                        identity,
                        platform: Platform::Discord,
                    });
                }
            }
        }

        // Replies are shaped (split at each platform's limit) by the runtimes
        // that write them.
        let shaper = Shaper::new(adapters.clone());

        // Runtimes, by name.
        let mut runtimes: HashMap<String, Arc<dyn Runtime>> = HashMap::new();
        for (name, runtime) in &config.runtimes {
            let built: Arc<dyn Runtime> = match runtime {
                RuntimeConfig::Http(http) => Arc::new(
                    crate::runtime::remote::RemoteRuntime::new(
                        name,
                        http,
                        crate::runtime::remote::RemoteDeps {
                            store: store.clone(),
                            shaper: shaper.clone(),
                            messages: config.messages.clone(),
                            clock: clock.clone(),
                            observer: observer.clone(),
                            outbox_wake: dispatcher_wake.clone(),
                        },
                    )
                    .map_err(anyhow::Error::msg)?,
                ),
                RuntimeConfig::Local(local) => Arc::new(
                    LocalRuntime::new(
                        name,
                        local,
                        Deps {
                            store: store.clone(),
                            batch_size: config.store.batch_size,
                            messages: config.messages.clone(),
                            shaper: shaper.clone(),
                            clock: clock.clone(),
                            observer: observer.clone(),
                            outbox_wake: dispatcher_wake.clone(),
                        },
                    )
                    .map_err(anyhow::Error::msg)?,
                ),
            };
            runtimes.insert(name.clone(), built);
        }

        let accounts_registered = accounts.clone();
        let (ingress, _journal_task) = Ingress::start(
            store.clone(),
            accounts,
            config.store.batch_size,
            clock.clone(),
            observer.clone(),
            submitter_wake.clone(),
            RoleLeases {
                owner: owner.clone(),
                ttl: Duration::from_secs(config.store.lease_secs),
            },
        );

        // Listeners.
        let listeners_stop = CancellationToken::new();
        let server_addr = parse_listen(&config.server.listen).map_err(anyhow::Error::msg)?;
        let admin_addr = parse_listen(&config.admin.listen).map_err(anyhow::Error::msg)?;
        let server_listener = TcpListener::bind(server_addr)
            .await
            .with_context(|| format!("binding server.listen {server_addr}"))?;
        let admin_listener = TcpListener::bind(admin_addr)
            .await
            .with_context(|| format!("binding admin.listen {admin_addr}"))?;
        let ingress_addr = server_listener.local_addr()?;
        let admin_addr = admin_listener.local_addr()?;
        let sink: Arc<dyn IngressSink> = ingress.clone();
        for name in webhook_accounts.keys() {
            sink.report_status(
                name,
                AccountStatus::Up(format!("webhook channel at /v1/channels/{name}/updates")),
            );
        }
        let telegram_webhooks = telegram
            .iter()
            .map(|c| (c.account().to_owned(), c.clone()))
            .collect();
        let public =
            switchboard_webhook::router(webhook_accounts, sink.clone(), config.server.body_limit)
                .merge(switchboard_telegram::webhook_router(
                    telegram_webhooks,
                    sink.clone(),
                ));
        let admin = crate::admin::router(crate::admin::AdminState {
            observer: observer.clone(),
            store: store.clone(),
            clock: clock.clone(),
            config: config.clone(),
            scheduler_wake: scheduler_wake.clone(),
            runtimes: runtimes.values().cloned().collect(),
            token: config
                .admin
                .resolve_token()
                .map_err(|e| anyhow::anyhow!("admin.token_file: {e}"))?,
            adapters: adapters
                .iter()
                .filter_map(|(identity, adapter)| {
                    let (name, _) = account_names.get(identity)?;
                    Some((name.clone(), adapter.clone()))
                })
                .collect(),
        });
        let listeners = vec![
            spawn_server("server", server_listener, public, listeners_stop.clone()),
            spawn_server("admin", admin_listener, admin, listeners_stop.clone()),
        ];

        // Workers.
        let capabilities = adapters
            .iter()
            .map(|(id, a)| (id.clone(), a.capabilities()))
            .collect();
        let rate = Arc::new(RateLimiter::new(
            adapters
                .iter()
                .map(|(id, a)| (id.clone(), a.limits()))
                .collect(),
        ));
        let chat_locks = Arc::new(ChatLocks::default());
        let streamer = Arc::new(Streamer {
            store: store.clone(),
            adapters: adapters.clone(),
            config: config.clone(),
            account_names: account_names
                .iter()
                .map(|(id, (name, _))| (id.clone(), name.clone()))
                .collect(),
            rate: rate.clone(),
            chat_locks: chat_locks.clone(),
            clock: clock.clone(),
            dispatcher_wake: dispatcher_wake.clone(),
        });
        let dispatcher = Dispatcher::new(
            store.clone(),
            adapters,
            rate.clone(),
            chat_locks.clone(),
            config.outbox.clone(),
            clock.clone(),
            observer.clone(),
            dispatcher_wake.clone(),
            owner.clone(),
        );
        let reconciler = Reconciler {
            store: store.clone(),
            config: config.clone(),
            capabilities,
            clock: clock.clone(),
            observer: observer.clone(),
            dispatcher_wake: dispatcher_wake.clone(),
        };
        // Operator tools name accounts by their configured name.
        for account in &accounts_registered {
            store
                .channel_account_register(
                    &account.name,
                    &account.identity,
                    account.platform.as_str(),
                    started_ms,
                )
                .await
                .context("registering channel accounts")?;
        }
        let lanes = Lanes::new(
            store.clone(),
            owner.clone(),
            Duration::from_secs(config.store.lease_secs),
            clock.clone(),
            runtimes.values().cloned().collect(),
        );
        let lanes_stop = CancellationToken::new();
        let lanes_task = tokio::spawn(lanes.clone().run(lanes_stop.clone()));
        let scheduler = Scheduler {
            lanes: lanes.clone(),
            store: store.clone(),
            runtimes: runtimes.clone(),
            accounts: account_names.clone(),
            config: config.clone(),
            clock: clock.clone(),
            observer: observer.clone(),
            outbox_wake: dispatcher_wake.clone(),
            wake: scheduler_wake.clone(),
            owner: owner.clone(),
        };
        let submitter = Submitter {
            lanes: lanes.clone(),
            store: store.clone(),
            runtimes: runtimes.clone(),
            accounts: account_names,
            config: config.clone(),
            clock: clock.clone(),
            observer: observer.clone(),
            wake: submitter_wake,
            outbox_wake: dispatcher_wake.clone(),
            scheduler_wake: scheduler_wake.clone(),
            access: accounts_registered
                .iter()
                .map(|a| (a.identity.clone(), a.platform))
                .collect(),
        };

        let workers_stop = CancellationToken::new();
        for runtime in runtimes.values() {
            let streamer = streamer.clone();
            let deltas = runtime.deltas();
            let stop = workers_stop.clone();
            tokio::spawn(async move { streamer.run(deltas, stop).await });
        }
        let dispatch_stop = CancellationToken::new();
        let dispatch_deadline = CancellationToken::new();
        let dispatcher = {
            let stop = dispatch_stop.clone();
            let deadline = dispatch_deadline.clone();
            tokio::spawn(async move { dispatcher.run(stop, deadline.cancelled_owned()).await })
        };

        // Recovery runs after start returns (after READY): reconcile
        // orphaned sends, then resume runs, then start submitting.
        let recovery_store = store.clone();
        let recovery_clock = clock.clone();
        let runtime_list: Vec<Arc<dyn Runtime>> = runtimes.values().cloned().collect();
        let reconcile_interval = Duration::from_secs(config.outbox.reconcile_interval_secs);
        let reconciler = {
            let stop = workers_stop.clone();
            tokio::spawn(async move {
                if recovery_store.single_process() {
                    match recovery_store
                        .outbox_expire_all_leases(recovery_clock.now_ms())
                        .await
                    {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(
                            items = n,
                            "found sends a previous process left unconfirmed; reconciling"
                        ),
                        Err(e) => tracing::warn!(error = %e, "could not release orphaned leases"),
                    }
                }
                reconciler.run(reconcile_interval, stop).await
            })
        };
        let scheduler = {
            let stop = workers_stop.clone();
            tokio::spawn(async move { scheduler.run(stop).await })
        };
        let submitter = {
            let stop = workers_stop.clone();
            let runtimes = runtime_list.clone();
            let recovery_store_for_runs = store.clone();
            tokio::spawn(async move {
                // On a shared store the lanes of the built-in runtime are
                // taken over one by one as their leases run out
                // (crate::lanes); the other runtimes recover here.
                let shared = !recovery_store_for_runs.single_process();
                for runtime in runtimes.iter().filter(|r| !(shared && r.owns_lanes())) {
                    match runtime.recover().await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(
                            runtime = runtime.name(),
                            runs = n,
                            "resumed runs a previous process left"
                        ),
                        Err(e) => {
                            tracing::error!(runtime = runtime.name(), error = %e, "could not resume runs")
                        }
                    }
                }
                submitter.run(stop).await
            })
        };

        let housekeeping = crate::retention::start(
            store.clone(),
            config.retention.clone(),
            clock.clone(),
            observer.clone(),
        )
        .await
        .map_err(anyhow::Error::msg)?;

        // Platform connections last: updates may flow from here on.
        let channels_stop = CancellationToken::new();
        let mut channel_tasks: Vec<JoinHandle<()>> = telegram
            .into_iter()
            .map(|channel| {
                let sink = sink.clone();
                let stop = channels_stop.clone();
                tokio::spawn(async move { channel.run(sink, stop).await })
            })
            .collect();
        channel_tasks.extend(discord.into_iter().map(|channel| {
            let sink = sink.clone();
            let stop = channels_stop.clone();
            tokio::spawn(async move { channel.run(sink, stop).await })
        }));

        tracing::info!(
            store = %store.describe(),
            server = %ingress_addr,
            admin = %admin_addr,
            channels = config.channels.len(),
            runtimes = config.runtimes.len(),
            "switchboard is ready"
        );
        Ok(Daemon {
            ingress_addr,
            admin_addr,
            observer,
            store,
            config,
            ingress,
            runtimes: runtime_list,
            listeners_stop,
            listeners,
            channels_stop,
            channel_tasks,
            housekeeping,
            workers_stop,
            submitter,
            reconciler,
            scheduler,
            dispatch_stop,
            dispatch_deadline,
            dispatcher,
            lanes,
            lanes_stop,
            lanes_task,
        })
    }

    /// Apply the reloadable parts of a freshly loaded config (SIGHUP):
    /// surface settings and access lists take effect at once; the report
    /// names what needs a restart.
    pub fn reload(&self, new: &Config) -> crate::config::ReloadReport {
        self.config.reload_from(new)
    }

    /// One line for the service manager's STATUS.
    pub fn status_line(&self) -> String {
        let channels = self.observer.channel_states();
        let up = channels.values().filter(|c| c.state == "up").count();
        format!(
            "ready: {up}/{} channel accounts up, store {}, admin on {}",
            channels.len().max(self.config.channels.len()),
            self.store.describe(),
            self.admin_addr
        )
    }

    /// Stop in order within the configured grace and force timeouts.
    pub async fn shutdown(mut self) -> ShutdownReport {
        let started = Instant::now();
        let grace = Duration::from_secs(self.config.shutdown.grace_secs);
        let force = Duration::from_secs(self.config.shutdown.force_secs);
        tracing::info!(
            grace_s = grace.as_secs(),
            force_s = force.as_secs(),
            "stopping: ingress first"
        );
        // The listeners stay up until the end and answer 503, so platforms
        // see "try again later" rather than a refused connection.
        self.ingress.stop_accepting();
        self.channels_stop.cancel();
        for task in self.channel_tasks {
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        self.workers_stop.cancel();
        if let Some(mut housekeeping) = self.housekeeping.take() {
            let _ = housekeeping.shutdown().await;
        }
        let _ = self.submitter.await;
        let _ = self.reconciler.await;
        let _ = self.scheduler.await;

        // Runtimes and the dispatcher share the deadline: runs in flight may
        // still produce reply items during the grace period, and the
        // dispatcher keeps claiming until the runtimes are done.
        let closes = self
            .runtimes
            .iter()
            .map(|r| r.close(grace, force))
            .collect::<Vec<_>>();
        let reports = futures::future::join_all(closes).await;
        self.lanes_stop.cancel();
        let _ = self.lanes_task.await;
        self.lanes.release_all().await;
        let runs_left: usize = reports.iter().map(|r| r.remaining).sum();
        let runs_settled = reports.iter().all(|r| r.settled);
        self.dispatch_stop.cancel();
        let deadline = self.dispatch_deadline.clone();
        let left = (grace + force).saturating_sub(started.elapsed());
        let timer = tokio::spawn(async move {
            tokio::time::sleep(left).await;
            deadline.cancel();
        });
        let sends_left = self.dispatcher.await.unwrap_or(0);
        timer.abort();
        self.listeners_stop.cancel();
        for listener in self.listeners {
            let _ = tokio::time::timeout(Duration::from_secs(1), listener).await;
        }
        self.store.close().await;
        let report = ShutdownReport {
            settled: runs_settled && sends_left == 0,
            remaining: runs_left + sends_left,
            took: started.elapsed(),
        };
        if report.settled {
            tracing::info!(took_ms = report.took.as_millis() as u64, "shutdown settled");
        } else {
            tracing::warn!(
                took_ms = report.took.as_millis() as u64,
                remaining = report.remaining,
                "shutdown timed out; unfinished work is recovered at the next start"
            );
        }
        report
    }
}

fn spawn_server(
    name: &'static str,
    listener: TcpListener,
    router: axum::Router,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let served = axum::serve(listener, router)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(listener = name, error = %e, "listener stopped");
        }
    })
}

/// A name for this process in leases: host, pid and start time, so a
/// restarted process never mistakes an old lease for its own.
fn lease_owner(now_ms: i64) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".to_owned());
    format!("{host}:{}:{now_ms}", std::process::id())
}
