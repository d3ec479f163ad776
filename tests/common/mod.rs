//! Shared helpers for the integration tests: a real `switchboard` process on
//! a real SQLite file, a loopback callback receiver that records what it
//! gets, and small HTTP helpers. Every test gets its own directory and ports.

#![allow(dead_code)]

pub mod openai;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post as route_post;
use switchboard_webhook::CallbackBody;

pub const BIN: &str = env!("CARGO_BIN_EXE_switchboard");

/// A port that was free a moment ago. The daemon binds it by number so a
/// restarted process comes back on the same address.
///
/// Ports come from 20000..32000, below Linux's ephemeral range
/// (32768..60999): a port handed out by `bind(0)` or used as the source of
/// an outgoing connection can then never be the one a daemon is about to
/// bind (CI once lost a test to exactly that race). A per-process start and
/// an atomic counter keep parallel tests and test binaries apart.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = (std::process::id() * 97) % 12000;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20000 + ((start + n) % 12000) as u16;
        if StdListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// One reply as the receiver saw it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub body: CallbackBody,
    pub at: Instant,
}

#[derive(Default)]
struct ReceiverState {
    deliveries: Vec<Delivery>,
    /// Answer this status instead of 200 for the next N requests.
    fail_next: Vec<StatusCode>,
    delay: Duration,
}

/// A loopback HTTP server that plays a webhook receiver: it records every
/// callback POST.
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    state: Arc<Mutex<ReceiverState>>,
}

impl Receiver {
    pub async fn start() -> Receiver {
        Self::start_with_delay(Duration::ZERO).await
    }

    /// Every callback takes `delay` before it is answered (sends stay in
    /// flight longer).
    pub async fn start_with_delay(delay: Duration) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(ReceiverState {
            delay,
            ..ReceiverState::default()
        }));
        let app = axum::Router::new()
            .route("/replies", route_post(receive))
            .with_state(state.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}/replies", self.addr)
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state.lock().unwrap().deliveries.clone()
    }

    /// Answer the next requests with these statuses, in order.
    pub fn fail_next(&self, statuses: Vec<StatusCode>) {
        let mut s = self.state.lock().unwrap();
        s.fail_next = statuses;
        s.fail_next.reverse();
    }

    /// Distinct reply keys seen so far.
    pub fn distinct_keys(&self) -> usize {
        let s = self.state.lock().unwrap();
        let mut keys: Vec<&str> = s
            .deliveries
            .iter()
            .map(|d| d.body.reply_key.as_str())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys.len()
    }

    /// Wait until at least `n` distinct reply keys arrived.
    pub async fn wait_for_keys(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.distinct_keys() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.distinct_keys() >= n
    }

    /// Deliveries grouped by reply key.
    pub fn by_key(&self) -> BTreeMap<String, Vec<Delivery>> {
        let mut map: BTreeMap<String, Vec<Delivery>> = BTreeMap::new();
        for d in self.deliveries() {
            map.entry(d.body.reply_key.clone()).or_default().push(d);
        }
        map
    }
}

async fn receive(
    State(state): State<Arc<Mutex<ReceiverState>>>,
    Json(body): Json<CallbackBody>,
) -> StatusCode {
    let delay = state.lock().unwrap().delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut s = state.lock().unwrap();
    if let Some(status) = s.fail_next.pop() {
        return status;
    }
    s.deliveries.push(Delivery {
        body,
        at: Instant::now(),
    });
    StatusCode::OK
}

/// Settings for a test daemon's config file.
pub struct DaemonConfig {
    pub callback_url: String,
    pub server_port: u16,
    pub admin_port: u16,
    /// Extra TOML appended to the config (more sections, overrides).
    pub extra: String,
    /// Extra keys for `[channels.main]`.
    pub channel_extra: String,
    /// The echo model's per-word delay.
    pub token_delay_ms: u64,
    /// Replaces the body of `[runtimes.default]` when set.
    pub runtime: Option<String>,
    /// `store.url`; a SQLite file in the daemon's directory when unset.
    pub store_url: Option<String>,
    /// Extra keys for `[store]`.
    pub store_extra: String,
}

impl DaemonConfig {
    pub fn new(callback_url: String) -> Self {
        DaemonConfig {
            callback_url,
            server_port: free_port(),
            admin_port: free_port(),
            extra: String::new(),
            channel_extra: String::new(),
            token_delay_ms: 0,
            runtime: None,
            store_url: None,
            store_extra: String::new(),
        }
    }

    pub fn render(&self, dir: &Path) -> String {
        format!(
            r#"
[store]
url = "{store}"
{store_extra}

[server]
listen = "127.0.0.1:{server}"

[admin]
listen = "127.0.0.1:{admin}"

[log]
level = "info"

[runtimes.default]
{runtime}

[channels.main]
kind = "webhook"
runtime = "default"
callback_url = "{callback}"
callback_timeout_secs = 5
{channel_extra}

[outbox]
backoff_base_ms = 50
backoff_cap_ms = 500
reconcile_interval_secs = 1
reconcile_after_secs = 2

[shutdown]
grace_secs = 5
force_secs = 2

{extra}
"#,
            store = self
                .store_url
                .clone()
                .unwrap_or_else(|| format!("sqlite://{}", dir.join("switchboard.db").display())),
            store_extra = self.store_extra,
            server = self.server_port,
            admin = self.admin_port,
            runtime = self.runtime.clone().unwrap_or_else(|| format!(
                "kind = \"local\"\nmodel = {{ backend = \"echo\", token_delay_ms = {} }}",
                self.token_delay_ms
            )),
            callback = self.callback_url,
            channel_extra = self.channel_extra,
            extra = self.extra,
        )
    }
}

/// A `switchboard run` process on a config file in its own directory.
pub struct Daemon {
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub server: SocketAddr,
    pub admin: SocketAddr,
    child: Option<Child>,
    starts: usize,
    /// Extra environment for the process.
    pub env: Vec<(String, String)>,
}

impl Daemon {
    /// Write the config and start the process; returns once `/healthz`
    /// answers.
    pub async fn start(dir: &Path, config: &DaemonConfig) -> Daemon {
        Self::start_with_env(dir, config, Vec::new()).await
    }

    /// Like [`Daemon::start`], with extra environment variables.
    pub async fn start_with_env(
        dir: &Path,
        config: &DaemonConfig,
        env: Vec<(String, String)>,
    ) -> Daemon {
        let config_path = dir.join("switchboard.toml");
        std::fs::write(&config_path, config.render(dir)).unwrap();
        let mut daemon = Daemon {
            dir: dir.to_owned(),
            config_path,
            server: SocketAddr::from(([127, 0, 0, 1], config.server_port)),
            admin: SocketAddr::from(([127, 0, 0, 1], config.admin_port)),
            child: None,
            starts: 0,
            env,
        };
        daemon.spawn().await;
        daemon
    }

    /// (Re)start the process on the same config and store.
    pub async fn spawn(&mut self) {
        assert!(self.child.is_none(), "already running");
        self.starts += 1;
        let log =
            std::fs::File::create(self.dir.join(format!("daemon-{}.log", self.starts))).unwrap();
        let child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(&self.config_path)
            .env_remove("RUST_LOG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting switchboard");
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(30)).await;
    }

    pub async fn wait_healthy(&mut self, timeout: Duration) {
        let client = reqwest::Client::new();
        let url = format!("http://{}/healthz", self.admin);
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                return;
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "switchboard exited during start ({status}); log:\n{}",
                    self.logs()
                );
            }
            assert!(
                Instant::now() < deadline,
                "switchboard did not become healthy; log:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Send a signal (`"HUP"`, `"TERM"`) without waiting.
    pub fn signal(&self, name: &str) {
        let pid = self.pid().expect("not running");
        let status = Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Wait for the process to exit on its own; its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("switchboard did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM, then wait for the exit; returns the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("switchboard did not exit within {timeout:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every log file of every start, concatenated.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for i in 1..=self.starts {
            if let Ok(text) = std::fs::read_to_string(self.dir.join(format!("daemon-{i}.log"))) {
                out.push_str(&format!("--- start {i} ---\n{text}"));
            }
        }
        out
    }

    pub fn updates_url(&self, account: &str) -> String {
        format!("http://{}/v1/channels/{account}/updates", self.server)
    }

    /// Run a `switchboard` subcommand against this daemon's config.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(&self.config_path)
            .output()
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A webhook update body.
pub fn update(update_id: &str, chat: &str, text: &str) -> serde_json::Value {
    serde_json::json!({
        "update_id": update_id,
        "chat": { "id": chat, "kind": "private" },
        "sender": { "id": format!("user-{chat}"), "name": chat },
        "text": text,
    })
}

/// POST an update; `None` when the daemon could not be reached.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Option<(StatusCode, serde_json::Value)> {
    let response = client.post(url).json(body).send().await.ok()?;
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let json = response.json().await.unwrap_or(serde_json::Value::Null);
    Some((status, json))
}

/// POST until the daemon answers 202 (retrying refused connections, 503s
/// and dropped requests, the way a platform redelivers).
pub async fn post_until_accepted(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some((status, json)) = post(client, url, body).await {
            if status == StatusCode::ACCEPTED {
                return json;
            }
            assert!(
                status == StatusCode::SERVICE_UNAVAILABLE || status.is_server_error(),
                "unexpected answer {status}: {json}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "update {body} was never accepted"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The daemon's store, opened beside it the way operator tools open it.
pub async fn open_store(dir: &Path) -> switchboard::store::SharedStore {
    let config = switchboard::config::StoreConfig {
        url: format!("sqlite://{}", dir.join("switchboard.db").display()),
        synchronous: switchboard::config::Synchronous::Full,
        batch_size: 64,
        ..Default::default()
    };
    switchboard::store::open(&config, switchboard::store::sqlite::OpenMode::Tool)
        .await
        .unwrap()
}

/// The run a journal row was admitted to, once it was.
pub async fn run_of(
    store: &switchboard::store::SharedStore,
    inbound_id: i64,
) -> Option<switchboard::store::RunRow> {
    let row = store.journal_get(inbound_id).await.unwrap()?;
    let run_id: i64 = row.run_id?.parse().unwrap();
    store.run_get(run_id).await.unwrap()
}

/// Poll `check` until it holds or `timeout` passes; returns whether it held.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
}
