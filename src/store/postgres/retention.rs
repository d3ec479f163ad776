//! Retention on PostgreSQL: bounded pruning passes and conversation purges.
//!
//! Every pass reads a bounded slice of rows by id, oldest first (ids grow
//! with time), so a pass costs the same however long the history is: the
//! payload pass keeps a watermark; the deleting passes look at the oldest
//! `batch` rows and remove those old enough and settled.
//!
//! Several processes may prune at once: deleting a row twice deletes it
//! once, and the payload watermark only moves forward. A purge locks the
//! conversation (its row, its lane, its unsent replies) before it looks, so
//! nothing starts in the conversation between its checks and its writes.

use async_trait::async_trait;
use sqlx::Row;

use super::{PgStore, lock_conversation};
use crate::store::{PruneReport, PruneRules, PurgeOutcome, RetentionStore, StoreResult};

const UNFINISHED_RUNS: &str = "('queued', 'running', 'interrupt_requested')";

#[async_trait]
impl RetentionStore for PgStore {
    async fn prune(&self, rules: &PruneRules) -> StoreResult<PruneReport> {
        let batch = rules.batch.max(1) as i64;
        let mut report = PruneReport::default();

        // Payloads: walk forward from the watermark while rows are old
        // enough; clear the settled ones in that id range.
        let mut tx = self.begin().await?;
        let mark: i64 =
            sqlx::query_scalar("SELECT value FROM housekeeping WHERE name = 'payloads'")
                .fetch_optional(&mut *tx)
                .await?
                .unwrap_or(0);
        let rows =
            sqlx::query("SELECT id, received_at FROM inbound WHERE id > $1 ORDER BY id LIMIT $2")
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
                 WHERE id > $1 AND id <= $2 AND disposition != 'pending' AND payload IS NOT NULL",
            )
            .bind(mark)
            .bind(upto)
            .execute(&mut *tx)
            .await?;
            report.payloads = done.rows_affected();
            // Another process's pass may have moved it further meanwhile.
            sqlx::query(
                "INSERT INTO housekeeping (name, value) VALUES ('payloads', $1)
                 ON CONFLICT (name) DO UPDATE
                 SET value = GREATEST(housekeeping.value, excluded.value)",
            )
            .bind(upto)
            .execute(&mut *tx)
            .await?;
        }

        // Journal keys, settled outbox items, finished runs: the oldest
        // slice of each, where old enough.
        report.keys = sqlx::query(
            "DELETE FROM inbound WHERE id IN (SELECT id FROM inbound ORDER BY id LIMIT $1)
             AND received_at < $2 AND disposition != 'pending'",
        )
        .bind(batch)
        .bind(rules.keys_before)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        report.outbox = sqlx::query(
            "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT $1)
             AND state IN ('acknowledged', 'failed', 'dropped') AND settled_at < $2",
        )
        .bind(batch)
        .bind(rules.outbox_before)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let runs: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM runs WHERE id IN (SELECT id FROM runs ORDER BY id LIMIT $1)
             AND state NOT IN {UNFINISHED_RUNS} AND finished_at < $2"
        )))
        .bind(batch)
        .bind(rules.runs_before)
        .fetch_all(&mut *tx)
        .await?;
        if !runs.is_empty() {
            for table in ["run_inputs", "run_events"] {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE run_id = ANY($1)"
                )))
                .bind(&runs)
                .execute(&mut *tx)
                .await?;
            }
            report.runs = sqlx::query("DELETE FROM runs WHERE id = ANY($1)")
                .bind(&runs)
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
        let mut tx = self.begin().await?;
        // The conversation's row first: an update being journaled into it
        // finishes first, a later one finds it closed (and opens the chat's
        // next conversation).
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT id FROM conversations WHERE id = $1 FOR UPDATE")
                .bind(conversation_id)
                .fetch_optional(&mut *tx)
                .await?;
        if exists.is_none() {
            return Ok(PurgeOutcome::NotFound);
        }
        // Its lane: no run is admitted and no reply enqueued meanwhile.
        lock_conversation(&mut tx, conversation_id).await?;
        let active = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, state FROM runs WHERE conversation_id = $1 AND state IN {UNFINISHED_RUNS}
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
        // Its unsent replies, locked: a claim in progress finishes first, a
        // later one skips them.
        // (`MATERIALIZED`: the outer condition must not be pushed into the
        // locking scan, which would then skip rows a claim is changing.)
        let sending: Option<i64> = sqlx::query_scalar(
            "WITH unsent AS MATERIALIZED (
                 SELECT id, state FROM outbox WHERE conversation_id = $1
                 AND state IN ('not_dispatched', 'possibly_dispatched') FOR UPDATE)
             SELECT id FROM unsent WHERE state = 'possibly_dispatched' ORDER BY id LIMIT 1",
        )
        .bind(conversation_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(id) = sending {
            return Ok(PurgeOutcome::Busy(format!(
                "reply {id} of this conversation is being sent (possibly_dispatched); wait for it to settle (or resolve it), then purge again"
            )));
        }
        let outbox = sqlx::query("DELETE FROM outbox WHERE conversation_id = $1")
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        for table in ["run_inputs", "run_events"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE run_id IN (SELECT id FROM runs WHERE conversation_id = $1)"
            )))
            .bind(conversation_id)
            .execute(&mut *tx)
            .await?;
        }
        let runs = sqlx::query("DELETE FROM runs WHERE conversation_id = $1")
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
                settled_at = COALESCE(settled_at, $1)
             WHERE conversation_id = $2",
        )
        .bind(now)
        .bind(conversation_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(
            "UPDATE conversations SET closed_at = COALESCE(closed_at, $1), purged_at = $2
             WHERE id = $3",
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
