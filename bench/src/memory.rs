//! Memory and recovery, against the real `switchboard` binary run as a
//! child process (so the load generator's memory is not counted), on a
//! store preloaded with raw SQL: conversations, a journal and an outbox of
//! `rows` rows each, `pending` of them still to do.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{Connection, SqliteConnection};
use switchboard::config::{StoreConfig, Synchronous};
use switchboard::store::sqlite::OpenMode;
use switchboard::store::{Disposition, NewInbound};
use switchboard::surface::SurfaceKind;
use switchboard_channel::{ChatKind, Content};
use tokio::net::UnixDatagram;

use crate::Scale;
use crate::report::Report;
use crate::util::{self, Receiver};

const TEXT: &str =
    "a reply of about one hundred bytes, the size of a short chat answer, used by every scenario";
const ACCOUNT: &str = "webhook:main";

/// Sizes of a preloaded store.
#[derive(Debug, Clone, Copy)]
pub struct FixtureSize {
    pub conversations: usize,
    /// Rows in the journal, and rows in the outbox.
    pub rows: usize,
    /// Of those, journal rows still `pending` and outbox items still
    /// `not_dispatched` (each).
    pub pending: usize,
}

/// Build a store file of `size`: migrations by the real store, bulk rows
/// with raw SQL in large transactions, the pending journal rows through
/// the store's own `journal_insert` (so they are exactly what ingress
/// writes).
pub async fn build_fixture(path: &Path, size: FixtureSize) -> anyhow::Result<()> {
    let started = Instant::now();
    let config = StoreConfig {
        url: format!("sqlite://{}", path.display()),
        synchronous: Synchronous::Full,
        batch_size: 512,
        ..Default::default()
    };
    let store = switchboard::store::open(&config, OpenMode::Tool).await?;
    store.close().await;

    let options = SqliteConnectOptions::from_str("sqlite://")?
        .filename(path)
        .journal_mode(SqliteJournalMode::Wal)
        // Building the fixture is not measured; FULL would only slow it.
        .pragma("synchronous", "OFF")
        .pragma("cache_size", "-262144");
    let mut conn = SqliteConnection::connect_with(&options).await?;
    let now = 1_700_000_000_000_i64;
    let payload = serde_json::to_string(&Content::Message {
        text: TEXT.to_owned(),
        attachments: Vec::new(),
    })?;
    let conv = size.conversations as i64;
    let rows = size.rows as i64;
    let pending = size.pending as i64;
    anyhow::ensure!(
        pending * 2 <= conv && rows >= conv,
        "fixture sizes do not fit"
    );

    let mut tx = conn.begin().await?;
    sqlx::query(
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?1)
         INSERT INTO conversations (id, account, chat_id, thread_id, chat_kind, surface, created_at)
         SELECT i + 1, ?2, 'chat-' || i, '', 'private', 'webhook', ?3 FROM n",
    )
    .bind(conv)
    .bind(ACCOUNT)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    eprintln!(
        "  fixture: {conv} conversations ({:.1} s)",
        started.elapsed().as_secs_f64()
    );

    // The journal: settled rows, in chunks of 200,000 per transaction.
    let settled = rows - pending;
    let chunk = 200_000_i64;
    let mut from = 0;
    while from < settled {
        let to = (from + chunk).min(settled);
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?2)
             INSERT INTO inbound (id, account, update_key, conversation_id, sender_id, sender_name,
                                  payload, disposition, submission_key, received_at, settled_at)
             SELECT i + 1, ?3, 'u-' || i, (i % ?4) + 1, 'user-' || (i % ?4), 'bench',
                    ?5, 'admitted', printf('in-%032x', i), ?6, ?6 FROM n",
        )
        .bind(from)
        .bind(to)
        .bind(ACCOUNT)
        .bind(conv)
        .bind(&payload)
        .bind(now)
        .execute(&mut conn)
        .await?;
        from = to;
        eprintln!(
            "  fixture: journal {to}/{settled} settled rows ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
    }

    // The outbox: `rows / conv` ordinals per conversation; the last
    // ordinal of the first `pending` conversations is still to send (their
    // lane heads), everything else acknowledged.
    let mut from = 0;
    while from < rows {
        let to = (from + chunk).min(rows);
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?2),
             r(i, todo) AS (SELECT i, (i >= ?3 - ?4 AND i % ?4 < ?5) FROM n)
             INSERT INTO outbox (id, item_key, conversation_id, ordinal, account, chat_id, surface,
                                 run_id, kind, text, state, head, attempts, next_attempt_at,
                                 dispatched_at, created_at, settled_at)
             SELECT i + 1, 'fx-' || i, (i % ?4) + 1, (i / ?4) + 1, ?6, 'chat-' || (i % ?4),
                    'webhook', 'fx-run-' || i, 'answer', ?7,
                    CASE WHEN todo THEN 'not_dispatched' ELSE 'acknowledged' END,
                    todo, NOT todo, ?8,
                    CASE WHEN todo THEN NULL ELSE ?8 END, ?8,
                    CASE WHEN todo THEN NULL ELSE ?8 END
             FROM r",
        )
        .bind(from)
        .bind(to)
        .bind(rows)
        .bind(conv)
        .bind(pending)
        .bind(ACCOUNT)
        .bind(TEXT)
        .bind(now)
        .execute(&mut conn)
        .await?;
        from = to;
        eprintln!(
            "  fixture: outbox {to}/{rows} rows ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
    }
    conn.close().await?;

    // Pending journal rows, as ingress writes them, in conversations whose
    // outbox lanes are idle.
    let store = switchboard::store::open(&config, OpenMode::Tool).await?;
    let batch: Vec<NewInbound> = (0..pending)
        .map(|k| {
            let chat = format!("chat-{}", conv - 1 - k);
            let update_key = format!("p-{k}");
            NewInbound {
                submission_key: switchboard::keys::submission_key(ACCOUNT, &update_key),
                account: ACCOUNT.to_owned(),
                update_key,
                chat_id: chat.clone(),
                chat_kind: ChatKind::Private,
                thread_id: None,
                space: None,
                surface: SurfaceKind::Webhook,
                sender_id: Some(format!("user-{chat}")),
                sender_name: Some("bench".to_owned()),
                message_id: None,
                payload: payload.clone(),
                disposition: Disposition::Pending,
                reason: None,
                input_policy: None,
                closes_conversation: false,
                migrates_to: None,
                addressed: true,
                received_at: now,
            }
        })
        .collect();
    for chunk in batch.chunks(1_000) {
        store.journal_insert(chunk).await?;
    }
    store.close().await;

    let mut conn = SqliteConnection::connect_with(&options).await?;
    let (inbound, waiting): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM inbound), (SELECT count(*) FROM inbound WHERE disposition = 'pending')",
    )
    .fetch_one(&mut conn)
    .await?;
    let (outbox, unsent): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox WHERE state = 'not_dispatched')",
    )
    .fetch_one(&mut conn)
    .await?;
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    anyhow::ensure!(
        inbound == rows && waiting == pending && outbox == rows && unsent == pending,
        "fixture came out wrong: journal {inbound} ({waiting} pending), outbox {outbox} ({unsent} unsent)"
    );
    let bytes = std::fs::metadata(path)?.len();
    eprintln!(
        "  fixture ready: {conv} conversations, journal {inbound} rows ({waiting} pending), outbox {outbox} rows ({unsent} unsent), {:.0} MB, built in {:.1} s",
        bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A `switchboard run` child process with its own directory and ports,
/// started with `NOTIFY_SOCKET` pointing at a datagram socket we hold.
pub struct Daemon {
    child: Child,
    notify: UnixDatagram,
    pub started: Instant,
    pub updates_url: String,
    pub store: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    /// Start the binary on the store at `dir/switchboard.db` (created when
    /// missing).
    pub fn spawn(dir: &Path, callback_url: &str) -> anyhow::Result<Daemon> {
        let binary = util::switchboard_binary()?;
        let store = dir.join("switchboard.db");
        let server = format!("127.0.0.1:{}", util::free_port()?);
        let admin = format!("127.0.0.1:{}", util::free_port()?);
        let mut config = util::daemon_config(&store, &server, &admin, callback_url);
        config.push_str("\n[shutdown]\ngrace_secs = 2\nforce_secs = 1\n");
        let config_path = dir.join("switchboard.toml");
        std::fs::write(&config_path, config)?;
        let socket = dir.join("notify.sock");
        let _ = std::fs::remove_file(&socket);
        let notify = UnixDatagram::bind(&socket)?;
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let started = Instant::now();
        let child = Command::new(binary)
            .args(["run", "--config"])
            .arg(&config_path)
            .env_remove("RUST_LOG")
            .env("NOTIFY_SOCKET", &socket)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        Ok(Daemon {
            child,
            notify,
            started,
            updates_url: format!("http://{server}/v1/channels/main/updates"),
            store,
            dir: dir.to_owned(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait for `READY=1` on the notify socket; the time since spawn.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<Duration> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 4096];
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "switchboard exited during start ({status}); log:\n{}",
                    std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "switchboard sent no READY=1 within {timeout:?}"
            );
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(50), self.notify.recv(&mut buf)).await
            {
                let at = self.started.elapsed();
                if String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == "READY=1")
                {
                    return Ok(at);
                }
            }
        }
    }

    pub fn rss_mb(&self) -> f64 {
        util::rss_mb(self.pid()).unwrap_or(f64::NAN)
    }

    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Journal rows still pending and outbox items not yet acknowledged, read
/// beside the running daemon.
async fn backlog(store: &Path) -> anyhow::Result<(i64, i64)> {
    let options = SqliteConnectOptions::from_str("sqlite://")?
        .filename(store)
        .read_only(true);
    let mut conn = SqliteConnection::connect_with(&options).await?;
    let row: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM inbound WHERE disposition = 'pending'),
                (SELECT count(*) FROM outbox WHERE state IN ('not_dispatched', 'possibly_dispatched'))",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    Ok(row)
}

/// Copy the fixture's store file into a fresh directory.
fn copy_fixture(template: &Path) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir_in(crate::scratch_dir())?;
    std::fs::copy(template, dir.path().join("switchboard.db"))?;
    Ok(dir)
}

pub struct Fixture {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
    pub size: FixtureSize,
}

pub async fn fixture(size: FixtureSize) -> anyhow::Result<Fixture> {
    let dir = tempfile::tempdir_in(crate::scratch_dir())?;
    let path = dir.path().join("template.db");
    build_fixture(&path, size).await?;
    Ok(Fixture {
        _dir: dir,
        path,
        size,
    })
}

/// A steady open-loop load of `rate` updates/s for `secs`, fire and forget;
/// counts answers that were not 202.
async fn steady_load(url: String, rate: f64, secs: f64, errors: Arc<AtomicUsize>) {
    let client = util::http_client(64).expect("http client");
    let count = (rate * secs) as usize;
    let start = Instant::now();
    let permits = Arc::new(tokio::sync::Semaphore::new(64));
    for i in 0..count {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (client, url, errors) = (client.clone(), url.clone(), errors.clone());
        let permits = permits.clone();
        tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            let body = util::update_body(&format!("s-{i}"), &format!("s{}", i % 2_000), "hi");
            let ok = client
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .is_ok_and(|r| r.status().as_u16() == 202);
            if !ok {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
}

pub async fn memory(report: &mut Report, scale: Scale, fixture: &Fixture) -> anyhow::Result<()> {
    let receiver = Receiver::start().await?;

    // Idle, on an empty store.
    let mut idle = Vec::new();
    let idle_reps = if scale.quick {
        scale.reps.min(2)
    } else {
        scale.reps
    };
    for rep in 0..idle_reps {
        let dir = tempfile::tempdir_in(crate::scratch_dir())?;
        let mut daemon = Daemon::spawn(dir.path(), &receiver.url)?;
        daemon.wait_ready(Duration::from_secs(60)).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss = daemon.rss_mb();
        eprintln!(
            "  memory run {}/{idle_reps}: idle RSS {rss:.1} MiB",
            rep + 1
        );
        idle.push(rss);
        daemon.kill();
    }
    report.add(
        "memory",
        "RSS idle after start",
        "MiB",
        idle,
        "empty store, 2 s after READY",
    );

    // With the preloaded store: after the pending work is done.
    let size = fixture.size;
    let loaded_reps = if scale.quick { 1 } else { scale.reps.min(3) };
    let mut loaded = Vec::new();
    let mut peak = Vec::new();
    for rep in 0..loaded_reps {
        let dir = copy_fixture(&fixture.path)?;
        let mut daemon = Daemon::spawn(dir.path(), &receiver.url)?;
        daemon.wait_ready(Duration::from_secs(120)).await?;
        let mut max: f64 = 0.0;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            max = max.max(daemon.rss_mb());
            let (journal, outbox) = backlog(&daemon.store).await?;
            eprintln!(
                "  memory run {}/{} (preloaded): {:.1} s after start, RSS {:.1} MiB, {journal} journal rows pending, {outbox} outbox items unsent",
                rep + 1,
                loaded_reps,
                daemon.started.elapsed().as_secs_f64(),
                daemon.rss_mb()
            );
            if journal == 0 && outbox == 0 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the preloaded backlog was not done within 5 minutes"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss = daemon.rss_mb();
        max = max.max(rss);
        eprintln!(
            "  memory run {}/{} (preloaded): backlog done, RSS {rss:.1} MiB (peak {max:.1} MiB)",
            rep + 1,
            loaded_reps
        );
        loaded.push(rss);
        peak.push(max);
        daemon.kill();
    }
    let note = format!(
        "{} conversations, {} outbox + {} journal rows, {} of each pending at start",
        size.conversations, size.rows, size.rows, size.pending
    );
    report.add(
        "memory",
        "RSS preloaded, backlog done",
        "MiB",
        loaded,
        &note,
    );
    report.add(
        "memory",
        "RSS preloaded, peak while recovering",
        "MiB",
        peak,
        &note,
    );

    // The soak: a steady load on an empty store, RSS sampled.
    let dir = tempfile::tempdir_in(crate::scratch_dir())?;
    let mut daemon = Daemon::spawn(dir.path(), &receiver.url)?;
    daemon.wait_ready(Duration::from_secs(60)).await?;
    let rate = scale.soak_rate;
    let secs = scale.soak_secs as f64;
    let errors = Arc::new(AtomicUsize::new(0));
    let cpu_before = (util::cpu_split(), util::process_cpu(daemon.pid()));
    let started = Instant::now();
    let load = tokio::spawn(steady_load(
        daemon.updates_url.clone(),
        rate,
        secs,
        errors.clone(),
    ));
    let interval = Duration::from_secs(scale.soak_sample_secs);
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let mut next = started + interval;
    while !load.is_finished() {
        tokio::time::sleep_until(next.into()).await;
        next += interval;
        let t = started.elapsed().as_secs_f64();
        let rss = daemon.rss_mb();
        eprintln!(
            "  soak {t:.0}/{secs:.0} s at {rate:.0} updates/s: RSS {rss:.1} MiB, {} replies received, {} errors",
            receiver.count.load(Ordering::Relaxed),
            errors.load(Ordering::Relaxed)
        );
        samples.push((t, rss));
    }
    load.await?;
    let wall = started.elapsed().as_secs_f64();
    let gen_cpu = util::cpu_split().since(cpu_before.0).generator;
    let daemon_cpu = util::process_cpu(daemon.pid()) - cpu_before.1;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = daemon.rss_mb();
    daemon.kill();
    let errors = errors.load(Ordering::Relaxed);
    anyhow::ensure!(!samples.is_empty(), "the soak took no samples");
    let start = samples[0].1;
    let max = samples.iter().map(|s| s.1).fold(end, f64::max);
    let note =
        format!("{rate:.0} updates/s for {secs:.0} s, sampled every {interval:?}; {errors} errors");
    report.add(
        "soak",
        "RSS at start (first sample)",
        "MiB",
        vec![start],
        &note,
    );
    report.add("soak", "RSS max", "MiB", vec![max], &note);
    report.add("soak", "RSS at end", "MiB", vec![end], &note);
    report.add(
        "soak",
        "CPU, load generator + receiver",
        "% core",
        vec![100.0 * gen_cpu / wall],
        "",
    );
    report.add(
        "soak",
        "CPU, daemon (child process)",
        "% core",
        vec![100.0 * daemon_cpu / wall],
        "",
    );
    report.set_series("soak RSS (s, MiB)", samples);
    Ok(())
}

pub async fn recovery(report: &mut Report, scale: Scale, fixture: &Fixture) -> anyhow::Result<()> {
    let receiver = Receiver::start().await?;
    let mut ready = Vec::new();
    for rep in 0..scale.reps {
        let dir = copy_fixture(&fixture.path)?;
        let mut daemon = Daemon::spawn(dir.path(), &receiver.url)?;
        let took = daemon.wait_ready(Duration::from_secs(120)).await?;
        eprintln!(
            "  recovery run {}/{}: READY after {:.0} ms",
            rep + 1,
            scale.reps,
            took.as_secs_f64() * 1e3
        );
        ready.push(took.as_secs_f64() * 1e3);
        daemon.kill();
    }
    let size = fixture.size;
    report.add(
        "recovery",
        "process start -> READY=1",
        "ms",
        ready,
        &format!(
            "{} journal + {} outbox rows, {} + {} pending",
            size.rows, size.rows, size.pending, size.pending
        ),
    );
    Ok(())
}
