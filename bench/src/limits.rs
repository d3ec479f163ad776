//! What the disk allows: raw SQLite with the same settings Switchboard uses
//! (WAL, synchronous=FULL, one connection writing), measured in the same
//! run so the product's figures can be stated as a fraction of them.

use std::str::FromStr;
use std::time::Instant;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{Connection, SqliteConnection};

use crate::Scale;
use crate::report::Report;

async fn connect(dir: &std::path::Path) -> anyhow::Result<SqliteConnection> {
    let options = SqliteConnectOptions::from_str("sqlite://")?
        .filename(dir.join("limits.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let mut conn = SqliteConnection::connect_with(&options).await?;
    sqlx::query(
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL, payload TEXT NOT NULL)",
    )
    .execute(&mut conn)
    .await?;
    sqlx::query("CREATE INDEX jobs_queued ON jobs (id) WHERE state = 'queued'")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

const PAYLOAD: &str =
    "a reply of about one hundred bytes, the size of a short chat answer, used by every scenario";

/// One row per transaction.
async fn single_row_commits(rows: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let mut conn = connect(dir.path()).await?;
    let start = Instant::now();
    for _ in 0..rows {
        sqlx::query("INSERT INTO jobs (state, payload) VALUES ('queued', ?)")
            .bind(PAYLOAD)
            .execute(&mut conn)
            .await?;
    }
    Ok(rows as f64 / start.elapsed().as_secs_f64())
}

/// 100 rows per transaction, in one multi-row statement: what the disk
/// allows when a commit carries many rows.
async fn batched_rows(rows: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let mut conn = connect(dir.path()).await?;
    let sql = format!(
        "INSERT INTO jobs (state, payload) VALUES {}",
        vec!["('queued', ?)"; 100].join(", ")
    );
    let start = Instant::now();
    for _ in 0..rows.div_ceil(100) {
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.clone()));
        for _ in 0..100 {
            query = query.bind(PAYLOAD);
        }
        query.execute(&mut conn).await?;
    }
    Ok((rows.div_ceil(100) * 100) as f64 / start.elapsed().as_secs_f64())
}

/// A job queue at its simplest: claim one job in one transaction, mark it
/// done in another.
async fn claim_ack(jobs: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let mut conn = connect(dir.path()).await?;
    let mut tx = conn.begin().await?;
    for _ in 0..jobs {
        sqlx::query("INSERT INTO jobs (state, payload) VALUES ('queued', ?)")
            .bind(PAYLOAD)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    let start = Instant::now();
    for _ in 0..jobs {
        let id: i64 = sqlx::query_scalar(
            "UPDATE jobs SET state = 'claimed' WHERE id = (SELECT id FROM jobs WHERE state = 'queued' ORDER BY id LIMIT 1) RETURNING id",
        )
        .fetch_one(&mut conn)
        .await?;
        sqlx::query("UPDATE jobs SET state = 'done' WHERE id = ?")
            .bind(id)
            .execute(&mut conn)
            .await?;
    }
    Ok(jobs as f64 / start.elapsed().as_secs_f64())
}

pub async fn run(report: &mut Report, scale: Scale) -> anyhow::Result<()> {
    let mut single = Vec::new();
    let mut batched = Vec::new();
    let mut claims = Vec::new();
    for _ in 0..scale.reps {
        single.push(single_row_commits(scale.limit_rows).await?);
        batched.push(batched_rows(scale.limit_rows * 5).await?);
        claims.push(claim_ack(scale.limit_rows).await?);
    }
    report.add(
        "limits",
        "single-row insert commits",
        "rows/s",
        single,
        "raw SQLite",
    );
    report.add(
        "limits",
        "batched inserts (100 rows/commit)",
        "rows/s",
        batched,
        "raw SQLite",
    );
    report.add(
        "limits",
        "claim+ack, one transaction each",
        "jobs/s",
        claims,
        "raw SQLite",
    );
    Ok(())
}
