//! Moving a deployment from SQLite to PostgreSQL: `switchboard copy-store`.
//!
//! Every table of the SQLite store is copied row by row, ids included, into
//! an empty PostgreSQL store (migrated first), in one transaction: the copy
//! is all or nothing, and a failed copy leaves the target empty to try
//! again. Columns are the PostgreSQL schema's (`migrations/postgres` mirrors
//! `migrations/sqlite`), each value converted to the column's type; id
//! sequences then continue after the copied ids. Leases are not copied:
//! they belong to processes, and the daemons must be stopped while copying.

use std::str::FromStr;

use futures::TryStreamExt;

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteRow};
use sqlx::{Postgres, Row, ValueRef};

use super::postgres::PgStore;
use super::sqlite::OpenMode;
use super::{StoreError, StoreResult};

/// The tables in an order that satisfies their foreign keys.
const TABLES: &[&str] = &[
    "conversations",
    "inbound",
    "runs",
    "run_inputs",
    "run_events",
    "outbox",
    "channel_accounts",
    "chat_settings",
    "schedules",
    "occurrences",
    "pairings",
    "chat_migrations",
    "housekeeping",
    "remote_runs",
    "remote_cursors",
];

/// How many rows one INSERT carries at most (PostgreSQL allows 65,535
/// parameters per statement).
const ROWS_PER_INSERT: usize = 200;

/// What was copied: rows per table.
#[derive(Debug, Default)]
pub struct CopyReport {
    pub tables: Vec<(String, u64)>,
}

impl CopyReport {
    pub fn total(&self) -> u64 {
        self.tables.iter().map(|(_, n)| n).sum()
    }
}

/// Copy the SQLite store at `from` (`sqlite://PATH`) into the PostgreSQL
/// store at `to`, which must be empty.
pub async fn sqlite_to_postgres(from: &str, to: &str) -> StoreResult<CopyReport> {
    let path = from.strip_prefix("sqlite://").ok_or_else(|| {
        StoreError::Other(format!(
            "--from must be a SQLite store (sqlite://PATH), not {from:?}"
        ))
    })?;
    if !to.starts_with("postgres://") && !to.starts_with("postgresql://") {
        return Err(StoreError::Other(format!(
            "--to must be a PostgreSQL store (postgres://USER@HOST:PORT/DB), not {to:?}"
        )));
    }
    if !std::path::Path::new(path).exists() {
        return Err(StoreError::Other(format!(
            "there is no SQLite store at {path}; check --from"
        )));
    }
    let source = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::from_str(from)
                .map_err(|e| StoreError::Other(format!("--from: {e}")))?
                .read_only(true),
        )
        .await?;
    let target = PgStore::open(to, OpenMode::Tool).await?;
    let pool = target.pool();

    let mut tx = pool.begin().await?;
    for table in TABLES {
        let rows: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
                .fetch_one(&mut *tx)
                .await?;
        if rows > 0 {
            return Err(StoreError::Other(format!(
                "the PostgreSQL store is not empty ({table} has {rows} rows); copy into a new database"
            )));
        }
    }

    let mut report = CopyReport::default();
    for table in TABLES {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT column_name::TEXT, data_type::TEXT FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = $1
             ORDER BY ordinal_position",
        )
        .bind(table)
        .fetch_all(&mut *tx)
        .await?;
        let names: Vec<&str> = columns.iter().map(|(n, _)| n.as_str()).collect();
        let select = format!("SELECT {} FROM {table} ORDER BY rowid", names.join(", "));
        // Streamed in chunks, so a large journal never sits in memory whole.
        let read_error = |e: sqlx::Error| {
            StoreError::Other(format!(
                "reading {table} from the SQLite store: {e} (is it a Switchboard store of this version? run `switchboard migrate` on it first)"
            ))
        };
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(select)).fetch(&source);
        let mut copied: u64 = 0;
        let mut chunk: Vec<SqliteRow> = Vec::with_capacity(ROWS_PER_INSERT);
        loop {
            let next = rows.try_next().await.map_err(read_error)?;
            let done = next.is_none();
            chunk.extend(next);
            if chunk.len() == ROWS_PER_INSERT || (done && !chunk.is_empty()) {
                insert_chunk(&mut tx, table, &columns, &chunk).await?;
                copied += chunk.len() as u64;
                chunk.clear();
            }
            if done {
                break;
            }
        }
        drop(rows);
        if names.contains(&"id") {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT setval(pg_get_serial_sequence('{table}', 'id'), GREATEST(COALESCE(MAX(id), 0), 1), MAX(id) IS NOT NULL) FROM {table}"
            )))
            .execute(&mut *tx)
            .await?;
        }
        report.tables.push(((*table).to_owned(), copied));
    }
    tx.commit().await?;
    source.close().await;
    pool.close().await;
    Ok(report)
}

/// One multi-row INSERT of `rows` into `table`.
async fn insert_chunk(
    tx: &mut sqlx::Transaction<'static, Postgres>,
    table: &str,
    columns: &[(String, String)],
    rows: &[SqliteRow],
) -> StoreResult<()> {
    let names: Vec<&str> = columns.iter().map(|(n, _)| n.as_str()).collect();
    let mut sql = format!("INSERT INTO {table} ({}) VALUES ", names.join(", "));
    let mut n = 0;
    for r in 0..rows.len() {
        if r > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for c in 0..columns.len() {
            if c > 0 {
                sql.push_str(", ");
            }
            n += 1;
            sql.push_str(&format!("${n}"));
        }
        sql.push(')');
    }
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for row in rows {
        for (i, (name, kind)) in columns.iter().enumerate() {
            query = bind(query, row, i, kind)
                .map_err(|e| StoreError::Other(format!("{table}.{name}: {e}")))?;
        }
    }
    query.execute(&mut **tx).await?;
    Ok(())
}

/// Bind column `i` of a SQLite row as the PostgreSQL column type `kind`.
fn bind<'q>(
    query: Query<'q, Postgres, PgArguments>,
    row: &SqliteRow,
    i: usize,
    kind: &str,
) -> Result<Query<'q, Postgres, PgArguments>, String> {
    let null = row.try_get_raw(i).map_err(|e| e.to_string())?.is_null();
    let e = |e: sqlx::Error| e.to_string();
    Ok(match kind {
        "bigint" | "integer" | "smallint" => {
            let v: Option<i64> = if null {
                None
            } else {
                Some(row.try_get(i).map_err(e)?)
            };
            match kind {
                "bigint" => query.bind(v),
                "integer" => query.bind(v.map(|v| v as i32)),
                _ => query.bind(v.map(|v| v as i16)),
            }
        }
        "boolean" => {
            let v: Option<i64> = if null {
                None
            } else {
                Some(row.try_get(i).map_err(e)?)
            };
            query.bind(v.map(|v| v != 0))
        }
        "double precision" | "real" => {
            let v: Option<f64> = if null {
                None
            } else {
                Some(row.try_get(i).map_err(e)?)
            };
            query.bind(v)
        }
        "bytea" => {
            let v: Option<Vec<u8>> = if null {
                None
            } else {
                Some(row.try_get(i).map_err(e)?)
            };
            query.bind(v)
        }
        "text" | "character varying" => {
            let v: Option<String> = if null {
                None
            } else {
                Some(row.try_get(i).map_err(e)?)
            };
            query.bind(v)
        }
        other => return Err(format!("no conversion for the column type {other}")),
    })
}
