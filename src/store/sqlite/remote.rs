//! Remote runtimes on SQLite: awaited runs and event cursors.

use async_trait::async_trait;
use sqlx::Row;

use super::SqliteStore;
use super::outbox::insert_item;
use crate::store::rows::{bad_value, remote_from_row, thread_from_db, thread_to_db};
use crate::store::{NewOutboxItem, RemoteRun, RemoteStore, StoreResult};
use crate::surface::SurfaceKind;

const COLUMNS: &str = "runtime, run_id, conversation_id, account, chat_id, thread_id, surface,
    reply_to, end_notice, state, event_id, created_at";

async fn advance(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    runtime: &str,
    event_id: i64,
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO remote_cursors (runtime, event_id) VALUES (?1, ?2)
         ON CONFLICT (runtime) DO UPDATE SET event_id = MAX(event_id, excluded.event_id)",
    )
    .bind(runtime)
    .bind(event_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[async_trait]
impl RemoteStore for SqliteStore {
    async fn remote_await(&self, runs: &[RemoteRun]) -> StoreResult<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for run in runs {
            sqlx::query(
                "INSERT INTO remote_runs (runtime, run_id, conversation_id, account, chat_id,
                    thread_id, surface, reply_to, state, created_at)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'awaited', ?)
                 ON CONFLICT (runtime, run_id) DO NOTHING",
            )
            .bind(&run.runtime)
            .bind(&run.run_id)
            .bind(run.conversation_id)
            .bind(&run.account)
            .bind(&run.chat_id)
            .bind(thread_to_db(&run.thread_id))
            .bind(run.surface.as_str())
            .bind(&run.reply_to)
            .bind(run.created_at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn remote_awaited(
        &self,
        runtime: &str,
        after: Option<(i64, String)>,
        limit: usize,
    ) -> StoreResult<Vec<RemoteRun>> {
        let (at, id) = after.unwrap_or((i64::MIN, String::new()));
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM remote_runs WHERE runtime = ? AND state = 'awaited'
             AND (created_at, run_id) > (?, ?) ORDER BY created_at, run_id LIMIT ?"
        )))
        .bind(runtime)
        .bind(at)
        .bind(id)
        .bind(limit as i64)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(remote_from_row).collect()
    }

    async fn remote_get(&self, runtime: &str, run_id: &str) -> StoreResult<Option<RemoteRun>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM remote_runs WHERE runtime = ? AND run_id = ?"
        )))
        .bind(runtime)
        .bind(run_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(remote_from_row).transpose()
    }

    async fn remote_awaited_of(
        &self,
        runtime: &str,
        conversation_id: i64,
    ) -> StoreResult<Vec<RemoteRun>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM remote_runs
             WHERE runtime = ? AND conversation_id = ? AND state = 'awaited'"
        )))
        .bind(runtime)
        .bind(conversation_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(remote_from_row).collect()
    }

    async fn remote_cursor(&self, runtime: &str) -> StoreResult<i64> {
        let cursor: Option<i64> =
            sqlx::query_scalar("SELECT event_id FROM remote_cursors WHERE runtime = ?")
                .bind(runtime)
                .fetch_optional(&self.reader)
                .await?;
        Ok(cursor.unwrap_or(0))
    }

    async fn remote_finish(
        &self,
        runtime: &str,
        run_id: &str,
        event_id: i64,
        replies: &[NewOutboxItem],
        now: i64,
    ) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let finished = sqlx::query(
            "UPDATE remote_runs SET state = 'finished', event_id = ?, finished_at = ?
             WHERE runtime = ? AND run_id = ? AND state = 'awaited'
             RETURNING conversation_id, account, chat_id, thread_id, surface, end_notice",
        )
        .bind(event_id)
        .bind(now)
        .bind(runtime)
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await?;
        let changed = finished.is_some();
        if let Some(row) = finished {
            for reply in replies {
                insert_item(&mut tx, reply).await?;
            }
            // The /stop confirmation comes after the run's last words.
            let notice: Option<String> = row.try_get("end_notice")?;
            if let Some(notice) =
                notice.and_then(|n| serde_json::from_str::<serde_json::Value>(&n).ok())
            {
                let surface: String = row.try_get("surface")?;
                let item = NewOutboxItem {
                    item_key: notice["item_key"].as_str().unwrap_or_default().to_owned(),
                    conversation_id: row.try_get("conversation_id")?,
                    account: row.try_get("account")?,
                    chat_id: row.try_get("chat_id")?,
                    thread_id: thread_from_db(row.try_get("thread_id")?),
                    surface: SurfaceKind::parse(&surface)
                        .ok_or_else(|| bad_value("surface", &surface))?,
                    reply_to: None,
                    run_id: Some(crate::keys::remote_run_key(runtime, run_id)),
                    kind: crate::store::ItemKind::Notice,
                    text: notice["text"].as_str().unwrap_or_default().to_owned(),
                    group_key: None,
                    edits_key: None,
                    attachments: Vec::new(),
                    created_at: now,
                };
                insert_item(&mut tx, &item).await?;
            }
        }
        advance(&mut tx, runtime, event_id).await?;
        tx.commit().await?;
        Ok(changed)
    }

    async fn remote_advance(&self, runtime: &str, event_id: i64) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        advance(&mut tx, runtime, event_id).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn remote_stop_notice(
        &self,
        runtime: &str,
        interrupted: Option<&str>,
        notice: &NewOutboxItem,
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let deferred = match interrupted {
            Some(run_id) => {
                let json = serde_json::json!({"item_key": notice.item_key, "text": notice.text})
                    .to_string();
                sqlx::query(
                    "UPDATE remote_runs SET end_notice = ?
                     WHERE runtime = ? AND run_id = ? AND state = 'awaited'",
                )
                .bind(json)
                .bind(runtime)
                .bind(run_id)
                .execute(&mut *tx)
                .await?
                .rows_affected()
                    == 1
            }
            None => false,
        };
        if !deferred {
            insert_item(&mut tx, notice).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
