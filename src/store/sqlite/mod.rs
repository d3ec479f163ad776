//! The SQLite store: the embedded default.
//!
//! One writer connection (SQLite allows one writer at a time anyway, so a
//! pool of writers would only trade waiting for `SQLITE_BUSY`) and a small
//! pool of readers; WAL lets them read while the writer commits. Write
//! transactions start with `BEGIN IMMEDIATE` so a transaction never has to
//! upgrade its lock halfway (an operator's CLI may write to the same file).
//!
//! A daemon holds an exclusive lock on `<db>.lock` for as long as it runs:
//! SQLite is a single-process deployment, which is what lets start-up treat
//! every outbox lease it finds as orphaned.

mod access;
mod journal;
mod leases;
mod outbox;
mod remote;
mod retention;
mod runs;
mod schedules;

pub use schedules::occurrence_key;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use async_trait::async_trait;

use super::{Store, StoreError, StoreResult};
use crate::config::Synchronous;

/// The writer connection's page cache, in KiB.
const WRITER_CACHE_KIB: u32 = 32 * 1024;

/// How a process opens the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// The daemon: takes the exclusive process lock.
    Daemon,
    /// An operator tool (`outbox list`, `inbound list`, `migrate`): no lock,
    /// works beside a running daemon.
    Tool,
}

/// The SQLite store.
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    path: PathBuf,
    /// Held for the life of the store in `Daemon` mode; dropping it
    /// releases the lock.
    _lock: Option<File>,
}

impl SqliteStore {
    /// Open (creating when missing) and migrate.
    pub async fn open(path: &Path, synchronous: Synchronous, mode: OpenMode) -> StoreResult<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Other(format!(
                    "cannot create the store directory {}: {e}",
                    dir.display()
                ))
            })?;
        }
        let lock = match mode {
            OpenMode::Daemon => Some(take_process_lock(path)?),
            OpenMode::Tool => None,
        };
        let synchronous = match synchronous {
            Synchronous::Full => SqliteSynchronous::Full,
            Synchronous::Normal => SqliteSynchronous::Normal,
        };
        let base = SqliteConnectOptions::from_str("sqlite://")
            .map_err(StoreError::Database)?
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // The writer touches lane heads all over the outbox; with SQLite's
        // default 2 MB page cache a busy outbox is read from the OS page by
        // page (measured: a fifth of the dispatcher's CPU was pread). The
        // cache grows only as pages are used, up to this.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(
                base.clone()
                    .create_if_missing(true)
                    .pragma("cache_size", format!("-{}", WRITER_CACHE_KIB)),
            )
            .await?;
        sqlx::migrate!("./migrations/sqlite").run(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(base.read_only(true))
            .await?;
        Ok(SqliteStore {
            writer,
            reader,
            path: path.to_owned(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn begin_write(&self) -> StoreResult<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    fn single_process(&self) -> bool {
        true
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.reader).await?;
        Ok(())
    }

    /// Close the pools (the last connection checkpoints the WAL).
    async fn close(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }
}

fn take_process_lock(path: &Path) -> StoreResult<File> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| StoreError::Other(format!("cannot open {}: {e}", lock_path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Other(format!(
            "another switchboard daemon is using {}; stop it first (an SQLite store serves one daemon; use PostgreSQL for several)",
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Other(format!(
            "cannot lock {}: {e}",
            lock_path.display()
        ))),
    }
}

/// Promise 10: every hot-path statement reads through an index. SQLite's
/// own planner is asked about the very statements the store runs; a full
/// table scan or a sort of an unbounded result fails the test.
#[cfg(test)]
mod plan_tests {
    use sqlx::Row;

    use super::*;

    const HOT_PATHS: &[(&str, &str)] = &[
        ("journal: find update", journal::FIND_UPDATE),
        ("journal: find conversation", journal::FIND_CONVERSATION),
        ("journal: pending", journal::PENDING),
        ("journal: admit", journal::ADMIT),
        ("runs: find input", runs::FIND_INPUT),
        ("runs: insert run", runs::INSERT_RUN),
        ("runs: insert input", runs::INSERT_INPUT),
        ("runs: request interrupt", runs::REQUEST_INTERRUPT),
        ("runs: start", runs::START),
        ("runs: finish", runs::FINISH),
        ("runs: absorb", runs::ABSORB),
        ("runs: settle inputs", runs::SETTLE_INPUTS),
        ("runs: terminal event", runs::TERMINAL_EVENT),
        ("runs: unfinished", runs::UNFINISHED),
        ("runs: history", runs::HISTORY),
        ("runs: inputs", runs::INPUTS),
        ("runs: active of conversation", runs::ACTIVE_OF_CONVERSATION),
        ("outbox: insert item", outbox::INSERT_ITEM),
        ("outbox: promote head", outbox::PROMOTE_HEAD),
        ("outbox: claim", outbox::CLAIM),
        ("outbox: ack many", outbox::ACK_MANY),
        ("outbox: promote many", outbox::PROMOTE_MANY),
        ("outbox: retry", outbox::RETRY),
        ("outbox: fail", outbox::FAIL),
        ("outbox: fail later chunks", outbox::FAIL_LATER_CHUNKS),
        ("outbox: find by key", outbox::FIND_BY_KEY),
        ("outbox: replaced", outbox::REPLACED),
        ("outbox: ambiguous", outbox::AMBIGUOUS),
        ("outbox: resend", outbox::RESEND),
        ("outbox: hold", outbox::HOLD),
        ("outbox: expired", outbox::EXPIRED),
        ("schedules: due", schedules::DUE),
        ("schedules: advance", schedules::ADVANCE),
        ("occurrences: insert", schedules::INSERT_OCCURRENCE),
        ("occurrences: claim", schedules::CLAIM),
        ("occurrences: fired", schedules::FIRED),
        ("occurrences: retry", schedules::RETRY),
        ("occurrences: failed", schedules::FAILED),
        ("occurrences: release expired", schedules::RELEASE_EXPIRED),
    ];

    #[tokio::test]
    async fn batch_statements_find_their_rows_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(
            &dir.path().join("plan.db"),
            Synchronous::Full,
            OpenMode::Tool,
        )
        .await
        .unwrap();
        for sql in [outbox::ACK_MANY, outbox::PROMOTE_MANY] {
            let plan: Vec<String> =
                sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                    .fetch_all(&store.writer)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get::<String, _>(3))
                    .collect();
            assert!(
                plan.iter()
                    .any(|d| d.starts_with("SEARCH outbox USING INTEGER PRIMARY KEY")
                        || d.starts_with("SEARCH outbox USING COVERING INDEX")),
                "{plan:?}"
            );
        }
    }

    #[tokio::test]
    async fn hot_paths_read_through_indexes() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(
            &dir.path().join("plan.db"),
            Synchronous::Full,
            OpenMode::Tool,
        )
        .await
        .unwrap();
        // Statistics as a busy store would have them, so the planner's
        // choices are the ones it makes in production.
        sqlx::query("ANALYZE").execute(&store.writer).await.unwrap();
        let mut problems = Vec::new();
        for (name, sql) in HOT_PATHS {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                .fetch_all(&store.writer)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            for row in rows {
                let detail: String = row.get(3);
                // Scanning the constant row of an INSERT ... SELECT, or the
                // JSON list a batch statement was given, reads no table.
                let scan = detail.starts_with("SCAN ")
                    && !detail.contains(" USING ")
                    && detail != "SCAN CONSTANT ROW"
                    && !detail.contains("VIRTUAL TABLE");
                let sort = detail.contains("TEMP B-TREE");
                if scan || sort {
                    problems.push(format!("{name}: {detail}"));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "hot paths without an index:\n{}",
            problems.join("\n")
        );
    }
}
