//! The PostgreSQL store: several Switchboard processes on one database.
//!
//! The same traits as the SQLite store, with what sharing a database needs:
//! claims (outbox items, schedule occurrences) take rows with
//! `FOR UPDATE SKIP LOCKED`, so processes never wait on each other's claims,
//! and every later write is fenced by the claim's token; anything that
//! assigns per-conversation order (outbox ordinals, lane heads, run
//! admission) first takes a transaction-scoped advisory lock on the
//! conversation, so two processes cannot interleave in one lane; unique keys
//! with `ON CONFLICT` make the journal, runs and occurrences idempotent under
//! concurrent inserts. No process owns the database, so leases found at
//! start are not orphans: they expire by time (`single_process` is false).

mod access;
mod journal;
mod leases;
mod outbox;
mod remote;
mod retention;
mod runs;
mod schedules;

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use super::sqlite::OpenMode;
use super::{Store, StoreError, StoreResult};

/// The PostgreSQL store.
pub struct PgStore {
    pool: PgPool,
    /// `postgres://host:port/db` without credentials, for logs.
    described: String,
}

impl PgStore {
    /// Connect and migrate. Several processes may do this at once:
    /// migrations take an advisory lock.
    pub async fn open(url: &str, mode: OpenMode) -> StoreResult<Self> {
        let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
            StoreError::Other(format!("store.url is not a PostgreSQL URL: {e}"))
        })?;
        let described = format!(
            "postgres://{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("postgres")
        );
        let max = match mode {
            OpenMode::Daemon => 16,
            OpenMode::Tool => 2,
        };
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        Ok(PgStore { pool, described })
    }

    /// The connection pool (copying a SQLite store in).
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn begin(&self) -> StoreResult<Transaction<'static, Postgres>> {
        Ok(self.pool.begin().await?)
    }
}

/// Serialize writers of one conversation's lane (outbox ordinals and heads,
/// run admission) until the transaction ends.
async fn lock_conversation(
    tx: &mut Transaction<'static, Postgres>,
    conversation_id: i64,
) -> StoreResult<()> {
    sqlx::query("SELECT pg_advisory_xact_lock(1, $1::int)")
        .bind((conversation_id & 0x7fff_ffff) as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Take the locks of several conversations, each once, in the order of
/// their lock keys: every transaction that locks more than one lane takes
/// them in this order, so none waits in a cycle.
async fn lock_conversations(
    tx: &mut Transaction<'static, Postgres>,
    conversation_ids: impl IntoIterator<Item = i64>,
) -> StoreResult<()> {
    let mut ids: Vec<i64> = conversation_ids.into_iter().collect();
    ids.sort_unstable_by_key(|c| (c & 0x7fff_ffff, *c));
    ids.dedup();
    for id in ids {
        lock_conversation(tx, id).await?;
    }
    Ok(())
}

#[async_trait]
impl Store for PgStore {
    fn describe(&self) -> String {
        self.described.clone()
    }

    fn single_process(&self) -> bool {
        false
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}
