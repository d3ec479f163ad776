//! Shared pieces of the scenarios: the daemon's config, a callback
//! receiver that timestamps replies, an open-loop load generator, latency
//! percentiles, and CPU and memory readings from `/proc`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Clock ticks per second of `/proc/*/stat` times (`_SC_CLK_TCK`; 100 on
/// every Linux this runs on).
const CLK_TCK: f64 = 100.0;

/// The daemon's config for a benchmark: one webhook account `main` on the
/// echo runtime (no per-word delay), its callbacks to `callback_url`.
pub fn daemon_config(store: &Path, server: &str, admin: &str, callback_url: &str) -> String {
    format!(
        r#"
[store]
url = "sqlite://{store}"
synchronous = "full"

[server]
listen = "{server}"

[admin]
listen = "{admin}"

[log]
level = "warn"

[runtimes.default]
kind = "local"
model = {{ backend = "echo", token_delay_ms = 0 }}

[channels.main]
kind = "webhook"
runtime = "default"
callback_url = "{callback_url}"
callback_timeout_secs = 10
"#,
        store = store.display(),
    )
}

/// An update for the webhook channel of account `main`.
pub fn update_body(update_id: &str, chat: &str, text: &str) -> String {
    serde_json::json!({
        "update_id": update_id,
        "chat": { "id": chat, "kind": "private" },
        "sender": { "id": format!("user-{chat}"), "name": chat },
        "text": text,
    })
    .to_string()
}

/// A loopback callback receiver: answers 200 and records when each reply
/// text arrived.
#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    pub count: Arc<AtomicUsize>,
    arrivals: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Receiver {
    pub async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let count = Arc::new(AtomicUsize::new(0));
        let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let (c, a) = (count.clone(), arrivals.clone());
        let app = axum::Router::new().route(
            "/replies",
            axum::routing::post(move |body: axum::body::Bytes| {
                let at = Instant::now();
                let (c, a) = (c.clone(), a.clone());
                async move {
                    #[derive(serde::Deserialize)]
                    struct Body {
                        text: String,
                    }
                    if let Ok(b) = serde_json::from_slice::<Body>(&body) {
                        a.lock().unwrap().entry(b.text).or_insert(at);
                    }
                    c.fetch_add(1, Ordering::Relaxed);
                    "ok"
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver {
            url: format!("http://{addr}/replies"),
            count,
            arrivals,
        })
    }

    pub fn arrived(&self, text: &str) -> Option<Instant> {
        self.arrivals.lock().unwrap().get(text).copied()
    }
}

pub fn http_client(connections: usize) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .timeout(Duration::from_secs(30))
        .build()?)
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

pub fn percentiles(samples: &mut [Duration]) -> Percentiles {
    samples.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if samples.is_empty() {
        return Percentiles {
            p50: f64::NAN,
            p99: f64::NAN,
            max: f64::NAN,
        };
    }
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        ms(samples[i])
    };
    Percentiles {
        p50: at(0.50),
        p99: at(0.99),
        max: ms(samples[samples.len() - 1]),
    }
}

/// Open loop: call `send(i, intended_start)` for i in 0..count at a
/// fixed rate, each in its own task, whatever the earlier ones do, with at
/// most `in_flight` requests outstanding (a bounded set of connections; a
/// request waiting for one still counts from its intended start, so a slow
/// answer cannot hide queueing). Returns the results in order.
pub async fn open_loop<F, Fut, T>(rate: f64, count: usize, in_flight: usize, send: F) -> Vec<T>
where
    F: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let start = Instant::now() + Duration::from_millis(5);
    let mut handles = Vec::with_capacity(count);
    let mut next = 0;
    while next < count {
        let now = Instant::now();
        while next < count {
            let at = start + Duration::from_secs_f64(next as f64 / rate);
            if at > now {
                break;
            }
            let request = send(next, at);
            let permits = permits.clone();
            handles.push(tokio::spawn(async move {
                let _permit = permits.acquire_owned().await;
                request.await
            }));
            next += 1;
        }
        if next < count {
            let at = start + Duration::from_secs_f64(next as f64 / rate);
            tokio::time::sleep_until(at.into()).await;
        }
    }
    let mut out = Vec::with_capacity(count);
    for h in handles {
        out.push(h.await.expect("load task panicked"));
    }
    out
}

/// CPU seconds (user + system) of a process or of some of this process's
/// threads, from `/proc`.
fn stat_cpu(path: &Path) -> Option<(String, f64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // After the command: state is field 3; utime 14 and stime 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / CLK_TCK))
}

/// CPU seconds used by a whole process.
pub fn process_cpu(pid: u32) -> f64 {
    stat_cpu(Path::new(&format!("/proc/{pid}/stat"))).map_or(0.0, |(_, s)| s)
}

/// CPU seconds used by this process's threads, split into the daemon's
/// (threads named `sb-daemon*` and SQLite's `sqlx-sqlite-*` workers) and
/// the rest (the load generator, the callback receiver, the harness).
#[derive(Debug, Clone, Default)]
pub struct CpuSplit {
    /// Per daemon thread: (thread id, CPU seconds).
    pub threads: Vec<(u64, f64)>,
    /// Every daemon thread, SQLite's included.
    pub daemon: f64,
    /// SQLite's worker threads alone (the store's one writer connection
    /// and its readers).
    pub sqlite: f64,
    /// The busiest single daemon thread.
    pub busiest: f64,
    pub generator: f64,
}

pub fn cpu_split() -> CpuSplit {
    let mut split = CpuSplit::default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return split;
    };
    for task in tasks.flatten() {
        if let Some((comm, secs)) = stat_cpu(&task.path().join("stat")) {
            if comm.starts_with("sqlx-sqlite") {
                split.sqlite += secs;
            }
            if comm.starts_with("sb-daemon") || comm.starts_with("sqlx-sqlite") {
                split.daemon += secs;
                let id = task
                    .file_name()
                    .to_string_lossy()
                    .parse::<u64>()
                    .unwrap_or(0);
                split.threads.push((id, secs));
            } else {
                split.generator += secs;
            }
        }
    }
    split
}

impl CpuSplit {
    pub fn since(self, before: CpuSplit) -> CpuSplit {
        let busiest = self
            .threads
            .iter()
            .map(|(id, secs)| {
                let earlier = before
                    .threads
                    .iter()
                    .find(|(b, _)| b == id)
                    .map_or(0.0, |(_, s)| *s);
                secs - earlier
            })
            .fold(0.0, f64::max);
        CpuSplit {
            threads: Vec::new(),
            daemon: self.daemon - before.daemon,
            sqlite: self.sqlite - before.sqlite,
            busiest,
            generator: self.generator - before.generator,
        }
    }
}

/// Resident set size of a process in MB (`VmRSS`).
pub fn rss_mb(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Where the real `switchboard` binary is: beside this program (both are
/// built into the same target directory), built on demand when missing.
pub fn switchboard_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no directory"))?;
    let bin = dir.join("switchboard");
    if bin.exists() {
        return Ok(bin);
    }
    let release = dir.file_name().is_some_and(|n| n == "release");
    let target = dir
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no target directory"))?;
    eprintln!(
        "  building the switchboard binary ({}), which the memory and recovery scenarios run as a child process...",
        if release { "release" } else { "debug" }
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = std::process::Command::new(cargo);
    // Built beside this program (same packages, so the same features and
    // no dependency is compiled again): only the binary is linked.
    cmd.args([
        "build",
        "-p",
        "switchboard-bench",
        "-p",
        "switchboard",
        "--bin",
        "switchboard",
    ])
    .env("CARGO_TARGET_DIR", target)
    .current_dir(env!("CARGO_MANIFEST_DIR"));
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "building the switchboard binary failed");
    anyhow::ensure!(bin.exists(), "{} is missing after the build", bin.display());
    Ok(bin)
}

/// A port free a moment ago, for a child daemon's listeners.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
