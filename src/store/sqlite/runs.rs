//! Durable runs of the built-in runtime on SQLite.

use async_trait::async_trait;
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::outbox::insert_item;
use super::{SqliteStore, bad_value, thread_from_db, thread_to_db};
use crate::store::{
    NewOutboxItem, NewRun, RunAdmission, RunFinish, RunRow, RunState, RunStore, StoreResult,
};
use crate::surface::SurfaceKind;

macro_rules! run_columns {
    () => {
        "id, idempotency_key, conversation_id, runtime, account, chat_id, thread_id, surface,
         reply_to, input, state, priority, answer, reason, created_at, started_at, finished_at"
    };
}

pub(super) const ADMIT: &str =
    "INSERT INTO runs (idempotency_key, conversation_id, runtime, account, chat_id,
        thread_id, surface, reply_to, input, state, priority, created_at)
     VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?)
     ON CONFLICT (idempotency_key) DO NOTHING RETURNING id";
pub(super) const FIND_BY_KEY: &str = "SELECT id, state FROM runs WHERE idempotency_key = ?";
pub(super) const START: &str =
    "UPDATE runs SET state = 'running', started_at = ? WHERE id = ? AND state = 'queued'";
pub(super) const FINISH: &str = "UPDATE runs SET state = ?, answer = ?, reason = ?, finished_at = ?
     WHERE id = ? AND state IN ('queued', 'running', 'interrupt_requested')
     RETURNING conversation_id, account, chat_id, thread_id, surface, reply_to";
pub(super) const UNFINISHED: &str = concat!(
    "SELECT ",
    run_columns!(),
    " FROM runs WHERE state IN ('queued', 'running', 'interrupt_requested') AND id > ?
      ORDER BY id LIMIT ?"
);

fn run_from_row(row: &SqliteRow) -> StoreResult<RunRow> {
    let surface: String = row.try_get("surface")?;
    let state: String = row.try_get("state")?;
    Ok(RunRow {
        id: row.try_get("id")?,
        idempotency_key: row.try_get("idempotency_key")?,
        conversation_id: row.try_get("conversation_id")?,
        runtime: row.try_get("runtime")?,
        account: row.try_get("account")?,
        chat_id: row.try_get("chat_id")?,
        thread_id: thread_from_db(row.try_get("thread_id")?),
        surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        reply_to: row.try_get("reply_to")?,
        input: row.try_get("input")?,
        state: RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        priority: row.try_get("priority")?,
        answer: row.try_get("answer")?,
        reason: row.try_get("reason")?,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

#[async_trait]
impl RunStore for SqliteStore {
    async fn runs_admit(&self, batch: &[NewRun]) -> StoreResult<Vec<RunAdmission>> {
        let mut tx = self.begin_write().await?;
        let mut out = Vec::with_capacity(batch.len());
        for run in batch {
            let inserted: Option<i64> = sqlx::query_scalar(ADMIT)
                .bind(&run.idempotency_key)
                .bind(run.conversation_id)
                .bind(&run.runtime)
                .bind(&run.account)
                .bind(&run.chat_id)
                .bind(thread_to_db(&run.thread_id))
                .bind(run.surface.as_str())
                .bind(&run.reply_to)
                .bind(&run.input)
                .bind(run.priority)
                .bind(run.created_at)
                .fetch_optional(&mut *tx)
                .await?;
            let admission = match inserted {
                Some(run_id) => RunAdmission {
                    run_id,
                    new: true,
                    state: RunState::Queued,
                },
                None => {
                    let row = sqlx::query(FIND_BY_KEY)
                        .bind(&run.idempotency_key)
                        .fetch_one(&mut *tx)
                        .await?;
                    let state: String = row.try_get(1)?;
                    RunAdmission {
                        run_id: row.try_get(0)?,
                        new: false,
                        state: RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
                    }
                }
            };
            out.push(admission);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn runs_start(&self, run_ids: &[i64], now: i64) -> StoreResult<()> {
        if run_ids.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for id in run_ids {
            sqlx::query(START)
                .bind(now)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn runs_finish(&self, batch: &[RunFinish]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin_write().await?;
        let mut out = Vec::with_capacity(batch.len());
        for finish in batch {
            let routed = sqlx::query(FINISH)
                .bind(finish.state.as_str())
                .bind(&finish.answer)
                .bind(&finish.reason)
                .bind(finish.now)
                .bind(finish.run_id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(route) = routed else {
                out.push(false);
                continue;
            };
            let surface: String = route.try_get("surface")?;
            let surface =
                SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?;
            for reply in &finish.replies {
                let item = NewOutboxItem {
                    item_key: reply.item_key.clone(),
                    conversation_id: route.try_get("conversation_id")?,
                    account: route.try_get("account")?,
                    chat_id: route.try_get("chat_id")?,
                    thread_id: thread_from_db(route.try_get("thread_id")?),
                    surface,
                    reply_to: route.try_get("reply_to")?,
                    run_id: Some(finish.run_id.to_string()),
                    kind: reply.kind,
                    text: reply.text.clone(),
                    created_at: finish.now,
                };
                insert_item(&mut tx, &item).await?;
            }
            out.push(true);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn runs_unfinished(&self, after_id: i64, limit: usize) -> StoreResult<Vec<RunRow>> {
        let rows = sqlx::query(UNFINISHED)
            .bind(after_id)
            .bind(limit as i64)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn run_get(&self, run_id: i64) -> StoreResult<Option<RunRow>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM runs WHERE id = ?"
        ))
        .bind(run_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(run_from_row).transpose()
    }
}
