//! Retention on SQLite: bounded pruning passes and conversation purges.
//!
//! Every pass reads a bounded slice of rows by rowid, oldest first (ids
//! grow with time), so a pass costs the same however long the history is:
//! the payload pass keeps a watermark; the deleting passes look at the
//! oldest `batch` rows and remove those old enough and settled.

use async_trait::async_trait;
use sqlx::Row;

use super::SqliteStore;
use crate::store::{PruneReport, PruneRules, PurgeOutcome, RetentionStore, StoreResult};

const UNFINISHED_RUNS: &str = "('queued', 'running', 'interrupt_requested')";

#[async_trait]
impl RetentionStore for SqliteStore {
    async fn prune(&self, rules: &PruneRules) -> StoreResult<PruneReport> {
        let batch = rules.batch.max(1) as i64;
        let mut report = PruneReport::default();

        // Payloads: walk forward from the watermark while rows are old
        // enough; clear the settled ones in that id range.
        let mut tx = self.begin_write().await?;
        let mark: i64 =
            sqlx::query_scalar("SELECT value FROM housekeeping WHERE name = 'payloads'")
                .fetch_optional(&mut *tx)
                .await?
                .unwrap_or(0);
        let rows =
            sqlx::query("SELECT id, received_at FROM inbound WHERE id > ? ORDER BY id LIMIT ?")
                .bind(mark)
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
        let mut upto = mark;
        for row in &rows {
            let received: i64 = row.try_get("received_at")?;
            if received >= rules.payloads_before {
                break;
            }
            upto = row.try_get("id")?;
        }
        if upto > mark {
            let done = sqlx::query(
                "UPDATE inbound SET payload = NULL, sender_name = NULL
                 WHERE id > ? AND id <= ? AND disposition != 'pending' AND payload IS NOT NULL",
            )
            .bind(mark)
            .bind(upto)
            .execute(&mut *tx)
            .await?;
            report.payloads = done.rows_affected();
            sqlx::query(
                "INSERT INTO housekeeping (name, value) VALUES ('payloads', ?)
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            )
            .bind(upto)
            .execute(&mut *tx)
            .await?;
        }

        // Journal keys, settled outbox items, finished runs: the oldest
        // slice of each, where old enough.
        report.keys = sqlx::query(
            "DELETE FROM inbound WHERE id IN (SELECT id FROM inbound ORDER BY id LIMIT ?)
             AND received_at < ? AND disposition != 'pending'",
        )
        .bind(batch)
        .bind(rules.keys_before)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        report.outbox = sqlx::query(
            "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT ?)
             AND state IN ('acknowledged', 'failed', 'dropped') AND settled_at < ?",
        )
        .bind(batch)
        .bind(rules.outbox_before)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let runs: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM runs WHERE id IN (SELECT id FROM runs ORDER BY id LIMIT ?)
             AND state NOT IN {UNFINISHED_RUNS} AND finished_at < ?"
        )))
        .bind(batch)
        .bind(rules.runs_before)
        .fetch_all(&mut *tx)
        .await?;
        if !runs.is_empty() {
            let ids = serde_json::to_string(&runs).unwrap_or_else(|_| "[]".into());
            for table in ["run_inputs", "run_events"] {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE run_id IN (SELECT value FROM json_each(?))"
                )))
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
            }
            report.runs =
                sqlx::query("DELETE FROM runs WHERE id IN (SELECT value FROM json_each(?))")
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
        }
        tx.commit().await?;
        Ok(report)
    }

    async fn purge_conversation(
        &self,
        conversation_id: i64,
        now: i64,
    ) -> StoreResult<PurgeOutcome> {
        let mut tx = self.begin_write().await?;
        let exists: Option<i64> = sqlx::query_scalar("SELECT id FROM conversations WHERE id = ?")
            .bind(conversation_id)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Ok(PurgeOutcome::NotFound);
        }
        let active = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, state FROM runs WHERE conversation_id = ? AND state IN {UNFINISHED_RUNS}
             ORDER BY id LIMIT 1"
        )))
        .bind(conversation_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(run) = active {
            let id: i64 = run.try_get("id")?;
            let state: String = run.try_get("state")?;
            return Ok(PurgeOutcome::Busy(format!(
                "run {id} of this conversation is {state}; send /stop in the chat (or wait for it to finish), then purge again"
            )));
        }
        let sending: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM outbox WHERE conversation_id = ? AND state = 'possibly_dispatched' LIMIT 1",
        )
        .bind(conversation_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(id) = sending {
            return Ok(PurgeOutcome::Busy(format!(
                "reply {id} of this conversation is being sent (possibly_dispatched); wait for it to settle (or resolve it), then purge again"
            )));
        }
        let outbox = sqlx::query("DELETE FROM outbox WHERE conversation_id = ?")
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        for table in ["run_inputs", "run_events"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE run_id IN (SELECT id FROM runs WHERE conversation_id = ?)"
            )))
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?;
        }
        let runs = sqlx::query("DELETE FROM runs WHERE conversation_id = ?")
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        // Tombstones: the keys stay, so a redelivery is a duplicate; what
        // was said and who said it go.
        let inbound = sqlx::query(
            "UPDATE inbound SET payload = NULL, sender_id = NULL, sender_name = NULL,
                message_id = NULL, reason = 'purged by an operator',
                disposition = CASE disposition WHEN 'pending' THEN 'ignored' ELSE disposition END,
                settled_at = COALESCE(settled_at, ?)
             WHERE conversation_id = ?",
        )
        .bind(now)
        .bind(conversation_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(
            "UPDATE conversations SET closed_at = COALESCE(closed_at, ?), purged_at = ? WHERE id = ?",
        )
        .bind(now)
        .bind(now)
        .bind(conversation_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(PurgeOutcome::Purged {
            inbound,
            runs,
            outbox,
        })
    }
}
