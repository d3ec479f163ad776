//! One process versus several on one PostgreSQL database.
//!
//! The real binary (`target/release/switchboard`, beside this program) is
//! started `processes` times on a fresh database of the server named by
//! `SWITCHBOARD_BENCH_PG_URL`, every process serving the same webhook
//! account with the echo runtime. Messages are posted round-robin across the
//! processes by many connections; the figure is messages per second from the
//! first POST to the last reply arriving at a loopback callback (end to end:
//! journal, lanes, runs, outbox, delivery), plus the POST-to-202 rate.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::Connection;

use crate::Scale;
use crate::report::Report;
use crate::scenarios::start_sink;

/// Kills the daemons when dropped (also on an early error).
struct Daemons(Vec<Child>);

impl Drop for Daemons {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn fresh_database(base: &str) -> anyhow::Result<String> {
    let name = format!("sb_bench_{}_{}", std::process::id(), rand_suffix());
    let mut admin = sqlx::PgConnection::connect(base).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await?;
    let _ = admin.close().await;
    let (prefix, _) = base
        .rsplit_once('/')
        .ok_or_else(|| anyhow::anyhow!("SWITCHBOARD_BENCH_PG_URL needs a database path"))?;
    Ok(format!("{prefix}/{name}"))
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000_000)
        .unwrap_or(0)
}

/// One run: `processes` daemons, `messages` across `chats`; returns
/// (answered per second, accepted per second).
async fn run_once(
    base: &str,
    processes: usize,
    messages: usize,
    chats: usize,
) -> anyhow::Result<(f64, f64)> {
    let binary = std::env::current_exe()?
        .parent()
        .map(|d| d.join("switchboard"))
        .ok_or_else(|| anyhow::anyhow!("no directory beside the benchmark"))?;
    anyhow::ensure!(
        binary.exists(),
        "{} is missing: build it first (cargo build --release -p switchboard)",
        binary.display()
    );
    let url = fresh_database(base).await?;
    let sink = start_sink().await?;
    let dir = tempfile::tempdir()?;
    let mut daemons = Daemons(Vec::new());
    let mut endpoints = Vec::new();
    for p in 0..processes {
        let (server, admin) = (free_port()?, free_port()?);
        let config = dir.path().join(format!("p{p}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"
[store]
url = "{url}"
[server]
listen = "127.0.0.1:{server}"
[admin]
listen = "127.0.0.1:{admin}"
[log]
level = "warn"
[runtimes.default]
kind = "local"
model = {{ backend = "echo" }}
[channels.main]
kind = "webhook"
runtime = "default"
callback_url = "{callback}"
[surfaces.webhook]
max_queued_inputs = 1000000
"#,
                callback = sink.url
            ),
        )?;
        let log = std::fs::File::create(dir.path().join(format!("p{p}.log")))?;
        daemons.0.push(
            Command::new(&binary)
                .args(["run", "--config"])
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()?,
        );
        endpoints.push((
            format!("http://127.0.0.1:{server}/v1/channels/main/updates"),
            format!("http://127.0.0.1:{admin}/healthz"),
        ));
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    for (_, health) in &endpoints {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !client
            .get(health)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            anyhow::ensure!(Instant::now() < deadline, "a daemon did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // Each chat posts its messages in order; chats run concurrently.
    let urls: Arc<Vec<String>> = Arc::new(endpoints.into_iter().map(|(u, _)| u).collect());
    let accepted = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let per_chat = messages / chats;
    let mut senders = Vec::new();
    for chat in 0..chats {
        let (client, urls, accepted) = (client.clone(), urls.clone(), accepted.clone());
        senders.push(tokio::spawn(async move {
            for i in 0..per_chat {
                let body = serde_json::json!({
                    "update_id": format!("c{chat}-m{i}"),
                    "chat": {"id": format!("chat-{chat}"), "kind": "private"},
                    "sender": {"id": format!("user-{chat}")},
                    "text": format!("message {i} of chat {chat}"),
                });
                let mut target = chat + i;
                loop {
                    let url = &urls[target % urls.len()];
                    match client.post(url).json(&body).send().await {
                        Ok(r) if r.status().as_u16() == 202 => break,
                        Ok(r) if r.status().is_client_error() => {
                            let status = r.status();
                            anyhow::bail!(
                                "the daemon refused an update with {status}: {}",
                                r.text().await.unwrap_or_default()
                            );
                        }
                        _ => {
                            target += 1;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                }
                accepted.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for s in senders {
        s.await??;
    }
    let posted = started.elapsed();
    let total = per_chat * chats;
    let deadline = Instant::now() + Duration::from_secs(600);
    while sink.received.load(Ordering::Relaxed) < total {
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} of {total} replies arrived",
            sink.received.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let answered = started.elapsed();
    drop(daemons);
    Ok((
        total as f64 / answered.as_secs_f64(),
        total as f64 / posted.as_secs_f64(),
    ))
}

pub async fn run(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let Ok(base) = std::env::var("SWITCHBOARD_BENCH_PG_URL") else {
        eprintln!(
            "  postgres: skipped (set SWITCHBOARD_BENCH_PG_URL=postgres://USER@HOST:PORT/DB, a server where the benchmark may create databases)"
        );
        return Ok(());
    };
    let (messages, chats) = if scale.quick {
        (2_000, 100)
    } else {
        (20_000, 200)
    };
    for processes in [1, 3] {
        let mut answered = Vec::new();
        let mut accepted = Vec::new();
        for rep in 0..scale.reps {
            let (a, p) = run_once(&base, processes, messages, chats).await?;
            eprintln!(
                "  postgres, {processes} process(es), run {}/{}: {a:.0} answered/s, {p:.0} accepted/s",
                rep + 1,
                scale.reps
            );
            answered.push(a);
            accepted.push(p);
        }
        let note = format!("{messages} messages, {chats} chats, echo runtime, real binary");
        report.add(
            "postgres",
            &format!("{processes} process(es): answered end to end"),
            "msgs/s",
            answered,
            &note,
        );
        report.add(
            "postgres",
            &format!("{processes} process(es): accepted (POST → 202)"),
            "msgs/s",
            accepted,
            &note,
        );
    }
    Ok(())
}
