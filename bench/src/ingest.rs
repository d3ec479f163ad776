//! Ingest and end to end, against the real daemon started in-process.
//!
//! The daemon runs on its own tokio runtime whose threads are named
//! `sb-daemon` (SQLite's worker threads are `sqlx-sqlite-*`), so the CPU
//! this program's own load generator and callback receiver use can be told
//! apart from the daemon's by reading `/proc/self/task/*/stat`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use switchboard::config::Config;
use switchboard::daemon::Daemon;
use switchboard::store::SharedStore;

use crate::Scale;
use crate::report::Report;
use crate::util::{self, CpuSplit, Receiver};

/// Concurrent connections of the ingest generator.
const CONNECTIONS: usize = 64;
/// Chats the updates are spread over (a conversation holds at most 32
/// queued inputs; spreading keeps every update admissible).
const CHATS: usize = 4_000;

/// A daemon on its own runtime, with its callback receiver.
struct InProcess {
    runtime: Option<tokio::runtime::Runtime>,
    daemon: Option<Daemon>,
    store: SharedStore,
    updates_url: String,
    receiver: Receiver,
    _dir: tempfile::TempDir,
}

impl InProcess {
    async fn start() -> anyhow::Result<InProcess> {
        let dir = tempfile::tempdir_in(crate::scratch_dir())?;
        let receiver = Receiver::start().await?;
        let text = util::daemon_config(
            &dir.path().join("switchboard.db"),
            "127.0.0.1:0",
            "127.0.0.1:0",
            &receiver.url,
        );
        let config = Config::from_toml(&text).map_err(|e| anyhow::anyhow!("config: {e:?}"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sb-daemon")
            .enable_all()
            .build()?;
        let daemon = runtime.spawn(Daemon::start(config)).await??;
        Ok(InProcess {
            store: daemon.store.clone(),
            updates_url: format!("http://{}/v1/channels/main/updates", daemon.ingress_addr),
            daemon: Some(daemon),
            runtime: Some(runtime),
            receiver,
            _dir: dir,
        })
    }

    /// Journal rows that have left `pending` (admitted, or settled otherwise).
    async fn settled(&self) -> anyhow::Result<(i64, i64)> {
        let counts = self.store.journal_counts().await?;
        let mut settled = 0;
        let mut admitted = 0;
        for (d, n) in counts {
            match d.as_str() {
                "pending" => {}
                "admitted" => {
                    admitted += n;
                    settled += n;
                }
                _ => settled += n,
            }
        }
        Ok((settled, admitted))
    }

    async fn stop(mut self) -> anyhow::Result<()> {
        if let (Some(daemon), Some(runtime)) = (self.daemon.take(), self.runtime.take()) {
            let _ = runtime.spawn(daemon.shutdown()).await;
            runtime.shutdown_background();
        }
        Ok(())
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        // On an error path: stop the daemon's threads without blocking.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn post(client: &reqwest::Client, url: &str, body: String) -> anyhow::Result<u16> {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    Ok(response.status().as_u16())
}

struct IngestRun {
    accepted_per_s: f64,
    admitted_per_s: f64,
    latency: util::Percentiles,
    cpu: CpuSplit,
    wall: f64,
}

async fn ingest_once(updates: usize, latency_secs: f64, rep: usize) -> anyhow::Result<IngestRun> {
    let daemon = InProcess::start().await?;
    let client = util::http_client(CONNECTIONS)?;
    // Warm the connections up.
    post(
        &client,
        &daemon.updates_url,
        util::update_body("warm", "warm", "hello"),
    )
    .await?;

    // Throughput: every connection posts as fast as it is answered.
    let cpu_before = util::cpu_split();
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..CONNECTIONS {
        let (client, url, next) = (client.clone(), daemon.updates_url.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= updates {
                    return anyhow::Ok(());
                }
                let body =
                    util::update_body(&format!("r{rep}-{i}"), &format!("c{}", i % CHATS), "hi");
                let status = post(&client, &url, body).await?;
                anyhow::ensure!(status == 202, "update {i} answered {status}");
            }
        }));
    }
    for w in workers {
        w.await??;
    }
    let accepted = started.elapsed();
    let total = updates as i64 + 1;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (settled, _) = daemon.settled().await?;
        if settled >= total {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {settled} of {total} updates were admitted within 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admitted = started.elapsed();
    let cpu = util::cpu_split().since(cpu_before);
    let (_, admitted_count) = daemon.settled().await?;
    anyhow::ensure!(
        admitted_count >= total,
        "{admitted_count} of {total} updates admitted (the rest settled otherwise)"
    );
    // Let the replies drain before measuring latency.
    let drain = Instant::now() + Duration::from_secs(120);
    while daemon.receiver.count.load(Ordering::Relaxed) < total as usize && Instant::now() < drain {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Latency at a fixed offered load of 1,000 updates/s.
    let rate = 1_000.0;
    let count = (rate * latency_secs) as usize;
    let url = daemon.updates_url.clone();
    let results = util::open_loop(rate, count, CONNECTIONS, |i, at| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let body = util::update_body(&format!("l{rep}-{i}"), &format!("c{}", i % CHATS), "hi");
            let status = post(&client, &url, body).await;
            (status, at.elapsed())
        }
    })
    .await;
    let mut latencies = Vec::with_capacity(results.len());
    for (status, took) in results {
        let status = status?;
        anyhow::ensure!(status == 202, "an update answered {status}");
        latencies.push(took);
    }
    daemon.stop().await?;
    Ok(IngestRun {
        accepted_per_s: updates as f64 / accepted.as_secs_f64(),
        admitted_per_s: updates as f64 / admitted.as_secs_f64(),
        latency: util::percentiles(&mut latencies),
        cpu,
        wall: admitted.as_secs_f64(),
    })
}

pub async fn ingest(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let mut accepted = Vec::new();
    let mut admitted = Vec::new();
    let mut p50 = Vec::new();
    let mut p99 = Vec::new();
    let mut gen_cpu = Vec::new();
    let mut daemon_cpu = Vec::new();
    let mut sqlite_cpu = Vec::new();
    let mut busiest_cpu = Vec::new();
    for rep in 0..scale.reps {
        let run = ingest_once(scale.ingest_updates, scale.latency_secs, rep).await?;
        eprintln!(
            "  ingest run {}/{}: {:.0} updates/s answered 202, {:.0}/s admitted; at 1,000/s p50 {:.2} ms, p99 {:.2} ms; CPU (% of one core): generator {:.0}, daemon {:.0} (SQLite threads {:.0}, busiest thread {:.0})",
            rep + 1,
            scale.reps,
            run.accepted_per_s,
            run.admitted_per_s,
            run.latency.p50,
            run.latency.p99,
            100.0 * run.cpu.generator / run.wall,
            100.0 * run.cpu.daemon / run.wall,
            100.0 * run.cpu.sqlite / run.wall,
            100.0 * run.cpu.busiest / run.wall,
        );
        sqlite_cpu.push(100.0 * run.cpu.sqlite / run.wall);
        busiest_cpu.push(100.0 * run.cpu.busiest / run.wall);
        accepted.push(run.accepted_per_s);
        admitted.push(run.admitted_per_s);
        p50.push(run.latency.p50);
        p99.push(run.latency.p99);
        gen_cpu.push(100.0 * run.cpu.generator / run.wall);
        daemon_cpu.push(100.0 * run.cpu.daemon / run.wall);
    }
    let note = format!(
        "{} updates, {CONNECTIONS} connections, {CHATS} chats",
        scale.ingest_updates
    );
    report.add(
        "ingest",
        "updates answered 202",
        "updates/s",
        accepted,
        &note,
    );
    report.add(
        "ingest",
        "updates stored and admitted",
        "updates/s",
        admitted,
        &note,
    );
    report.add(
        "ingest",
        "POST->202 p50 at 1,000/s",
        "ms",
        p50,
        &format!("{} s open loop", scale.latency_secs),
    );
    report.add(
        "ingest",
        "POST->202 p99 at 1,000/s",
        "ms",
        p99,
        &format!("{} s open loop", scale.latency_secs),
    );
    report.add(
        "ingest",
        "CPU, load generator + receiver",
        "% core",
        gen_cpu,
        "during the throughput phase",
    );
    report.add(
        "ingest",
        "CPU, daemon",
        "% core",
        daemon_cpu,
        "during the throughput phase",
    );
    report.add(
        "ingest",
        "CPU, daemon's SQLite threads",
        "% core",
        sqlite_cpu,
        "during the throughput phase",
    );
    report.add(
        "ingest",
        "CPU, daemon's busiest thread",
        "% core",
        busiest_cpu,
        "during the throughput phase",
    );
    Ok(())
}

/// One fixed offered load: POST at `rate` for `secs`, each message a
/// distinct text; latency from the intended POST time to its reply at the
/// callback receiver.
async fn e2e_load(
    daemon: &InProcess,
    client: &reqwest::Client,
    rate: f64,
    secs: f64,
    tag: &str,
) -> anyhow::Result<(util::Percentiles, CpuSplit, f64)> {
    let count = ((rate * secs) as usize).max(1);
    let url = daemon.updates_url.clone();
    let tag = tag.to_owned();
    let cpu_before = util::cpu_split();
    let started = Instant::now();
    let results = util::open_loop(rate, count, CONNECTIONS, |i, at| {
        let (client, url, tag) = (client.clone(), url.clone(), tag.clone());
        async move {
            let text = format!("{tag}-{i}");
            let body = util::update_body(&text, &format!("e{}", i % CHATS), &text);
            (post(&client, &url, body).await, text, at)
        }
    })
    .await;
    let mut waiting = Vec::with_capacity(count);
    for (status, text, at) in results {
        let status = status?;
        anyhow::ensure!(status == 202, "an update answered {status}");
        waiting.push((format!("echo: {text}"), at));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut latencies = Vec::with_capacity(count);
    for (reply, at) in waiting {
        loop {
            if let Some(arrived) = daemon.receiver.arrived(&reply) {
                latencies.push(arrived.saturating_duration_since(at));
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "reply {reply:?} did not arrive within 2 minutes"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    Ok((
        util::percentiles(&mut latencies),
        util::cpu_split().since(cpu_before),
        wall,
    ))
}

pub async fn end_to_end(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let loads: &[(f64, f64)] = if scale.quick {
        &[(100.0, 2.0), (1_000.0, 2.0), (5_000.0, 0.5)]
    } else {
        &[(100.0, 10.0), (1_000.0, 10.0), (5_000.0, 5.0)]
    };
    let mut rows: Vec<[Vec<f64>; 4]> = loads.iter().map(|_| Default::default()).collect();
    for rep in 0..scale.reps {
        let daemon = InProcess::start().await?;
        let client = util::http_client(CONNECTIONS)?;
        // Warm up: connections, the conversations' first rows.
        e2e_load(&daemon, &client, 500.0, 0.5, &format!("w{rep}")).await?;
        for (k, &(rate, secs)) in loads.iter().enumerate() {
            let (p, cpu, wall) =
                e2e_load(&daemon, &client, rate, secs, &format!("r{rep}-{rate}")).await?;
            eprintln!(
                "  end to end run {}/{} at {rate:.0}/s for {secs} s: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; CPU (% of one core): generator {:.0}, daemon {:.0} (SQLite threads {:.0}, busiest thread {:.0})",
                rep + 1,
                scale.reps,
                p.p50,
                p.p99,
                p.max,
                100.0 * cpu.generator / wall,
                100.0 * cpu.daemon / wall,
                100.0 * cpu.sqlite / wall,
                100.0 * cpu.busiest / wall,
            );
            rows[k][0].push(p.p50);
            rows[k][1].push(p.p99);
            rows[k][2].push(p.max);
            rows[k][3].push(100.0 * cpu.generator / wall);
        }
        daemon.stop().await?;
    }
    for (k, &(rate, secs)) in loads.iter().enumerate() {
        let [p50, p99, max, cpu] = std::mem::take(&mut rows[k]);
        let note = format!("{secs} s open loop, POST -> callback");
        report.add("e2e", &format!("p50 at {rate:.0}/s"), "ms", p50, &note);
        report.add("e2e", &format!("p99 at {rate:.0}/s"), "ms", p99, &note);
        report.add("e2e", &format!("max at {rate:.0}/s"), "ms", max, &note);
        report.add(
            "e2e",
            &format!("CPU, load generator at {rate:.0}/s"),
            "% core",
            cpu,
            "generator + receiver",
        );
    }
    Ok(())
}
