//! The outbox on PostgreSQL: dispatch states, lanes (the `head` flag), claims
//! with leases and fencing tokens, group-committed settlements.
//!
//! What sharing the database with other processes adds to the SQLite
//! version (which has one writer, so every transaction sees a quiet lane):
//! - a claim locks its candidate heads with `FOR UPDATE SKIP LOCKED` and
//!   re-checks them under the lock, so two processes claiming at once never
//!   take the same item, nor one that stopped being due or its lane's head;
//! - every write that changes which items wait in a lane (an insert, an item
//!   leaving the lane: acknowledged, failed, held; a held item resent) and
//!   every promotion of a lane's next head happens under the conversation's
//!   lock ([`lock_conversation`]), so the `head` flag never goes stale: an
//!   insert cannot miss the release of the head it queues behind, nor two
//!   items both become head. Transactions that lock several lanes take the
//!   locks up front in key order, so two of them cannot deadlock;
//! - every write after a claim is fenced by the item's token, as on SQLite.

use std::collections::HashSet;

use async_trait::async_trait;
use sqlx::{Postgres, Row, Transaction};

use super::{PgStore, lock_conversation, lock_conversations};
use crate::store::rows::{attachments_to_db, bad_value, item_from_row, thread_to_db};
use crate::store::{
    Claim, DispatchState, NewOutboxItem, OutboxFilter, OutboxItem, OutboxStats, OutboxStore,
    Outcome, Reconcile, ReconcileAction, Resolution, Settlement, StoreResult,
};

macro_rules! outbox_columns {
    () => {
        "id, item_key, conversation_id, ordinal, account, chat_id, thread_id, surface, reply_to,
         run_id, kind, text, group_key, edits_key, state, attempts, resends, next_attempt_at,
         lease_owner, lease_expires_at, fencing_token, dispatched_at, receipt, reason, created_at,
         settled_at, attachments"
    };
}

// The hot-path statements, named as in the SQLite store.
pub(super) const INSERT_ITEM: &str =
    "INSERT INTO outbox (item_key, conversation_id, ordinal, account, chat_id, thread_id,
     surface, reply_to, run_id, kind, text, group_key, edits_key, state, head, next_attempt_at,
     created_at, attachments)
     SELECT $1, $2,
     COALESCE((SELECT MAX(ordinal) FROM outbox WHERE conversation_id = $2), 0) + 1,
     $3, $4, $5, $6, $7, $8, $9, $10, $12, $13, 'not_dispatched',
     NOT EXISTS (SELECT 1 FROM outbox WHERE conversation_id = $2
     AND state IN ('not_dispatched', 'possibly_dispatched')),
     $11, $11, $15
     WHERE $14::TEXT IS NULL OR NOT EXISTS (SELECT 1 FROM outbox WHERE edits_key = $14)
     ON CONFLICT (item_key) DO NOTHING";
pub(super) const PROMOTE_HEAD: &str = "UPDATE outbox SET head = TRUE
     WHERE id = (SELECT id FROM outbox WHERE conversation_id = $1
     AND state IN ('not_dispatched', 'possibly_dispatched')
     ORDER BY ordinal LIMIT 1)
     AND NOT head";
// Acknowledgements of a whole batch in one statement (the common outcome),
// fenced per item: `$2`, `$3`, `$4` are the items' ids, tokens and receipts.
pub(super) const ACK_MANY: &str = "UPDATE outbox SET state = 'acknowledged', head = FALSE,
     receipt = a.ack_receipt, reason = NULL, settled_at = $1, lease_owner = NULL,
     lease_expires_at = NULL
     FROM UNNEST($2::BIGINT[], $3::BIGINT[], $4::TEXT[]) AS a (ack_id, ack_token, ack_receipt)
     WHERE outbox.id = a.ack_id AND outbox.fencing_token = a.ack_token
     AND outbox.state = 'possibly_dispatched'
     RETURNING outbox.id, outbox.conversation_id";
// The next head of each lane in `$1` (conversation ids).
pub(super) const PROMOTE_MANY: &str = "UPDATE outbox SET head = TRUE
     WHERE NOT head AND id IN (
     SELECT (SELECT o.id FROM outbox o WHERE o.conversation_id = c.conversation
     AND o.state IN ('not_dispatched', 'possibly_dispatched')
     ORDER BY o.ordinal LIMIT 1)
     FROM UNNEST($1::BIGINT[]) AS c (conversation))";
pub(super) const RETRY: &str = "UPDATE outbox SET state = 'not_dispatched', next_attempt_at = $1,
     attempts = attempts + $2, reason = $3, lease_owner = NULL,
     lease_expires_at = NULL
     WHERE id = $4 AND fencing_token = $5 AND state = 'possibly_dispatched'";
pub(super) const FAIL: &str =
    "UPDATE outbox SET state = 'failed', head = FALSE, reason = $1, settled_at = $2,
     lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'possibly_dispatched'
     RETURNING conversation_id, group_key, ordinal";
pub(super) const FAIL_LATER_CHUNKS: &str = "UPDATE outbox SET state = 'failed', head = FALSE,
     reason = 'an earlier chunk of this answer failed', settled_at = $1
     WHERE group_key = $2 AND ordinal > $3 AND state = 'not_dispatched'";
pub(super) const FIND_BY_KEY: &str = concat!(
    "SELECT ",
    outbox_columns!(),
    " FROM outbox WHERE item_key = $1"
);
pub(super) const REPLACED: &str = "SELECT 1::BIGINT FROM outbox WHERE edits_key = $1 LIMIT 1";
pub(super) const AMBIGUOUS: &str = "UPDATE outbox SET lease_expires_at = $1, reason = $2
     WHERE id = $3 AND fencing_token = $4 AND state = 'possibly_dispatched'";
pub(super) const RESEND: &str = "UPDATE outbox SET state = 'not_dispatched', next_attempt_at = $1,
     fencing_token = fencing_token + 1, resends = resends + $2,
     lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'possibly_dispatched'";
pub(super) const HOLD: &str =
    "UPDATE outbox SET state = 'held', head = FALSE, fencing_token = fencing_token + 1,
     lease_owner = NULL, lease_expires_at = NULL, settled_at = $1
     WHERE id = $2 AND fencing_token = $3 AND state = 'possibly_dispatched'
     RETURNING conversation_id";
// Due heads, locked without waiting for rows another process is claiming or
// settling; the update re-checks each under its lock (a row changed since
// the candidates were read is taken only if it is still a due, waiting
// head).
pub(super) const CLAIM: &str = concat!(
    "WITH candidates (claim_id) AS MATERIALIZED (
         SELECT id FROM outbox
         WHERE state = 'not_dispatched' AND head AND next_attempt_at <= $3
         ORDER BY next_attempt_at, id LIMIT $4
         FOR UPDATE SKIP LOCKED)
     UPDATE outbox SET state = 'possibly_dispatched', lease_owner = $1,
        lease_expires_at = $2, fencing_token = fencing_token + 1, dispatched_at = $3
     FROM candidates
     WHERE id = candidates.claim_id
       AND state = 'not_dispatched' AND head AND next_attempt_at <= $3
     RETURNING ",
    outbox_columns!()
);
pub(super) const EXPIRED: &str = concat!(
    "SELECT ",
    outbox_columns!(),
    " FROM outbox WHERE state = 'possibly_dispatched' AND lease_expires_at <= $1
      ORDER BY lease_expires_at LIMIT $2"
);
// The conversations of some items (whose lanes a transaction will lock).
const CONVERSATIONS_OF: &str = "SELECT DISTINCT conversation_id FROM outbox WHERE id = ANY($1)";

/// The lanes (conversations) a transaction holds the locks of.
#[derive(Default)]
struct LockedLanes(HashSet<i64>);

impl LockedLanes {
    /// Lock `conversations` in the order of their lock keys (the order every
    /// multi-lane transaction takes them in, so none waits in a cycle).
    async fn lock(
        &mut self,
        tx: &mut Transaction<'static, Postgres>,
        conversations: impl IntoIterator<Item = i64>,
    ) -> StoreResult<()> {
        let todo: Vec<i64> = conversations
            .into_iter()
            .filter(|c| !self.0.contains(c))
            .collect();
        lock_conversations(tx, todo.iter().copied()).await?;
        self.0.extend(todo);
        Ok(())
    }

    /// Lock the lanes of the items `item_ids` (an item never changes
    /// conversation).
    async fn lock_items(
        &mut self,
        tx: &mut Transaction<'static, Postgres>,
        item_ids: &[i64],
    ) -> StoreResult<()> {
        if item_ids.is_empty() {
            return Ok(());
        }
        let conversations: Vec<i64> = sqlx::query_scalar(CONVERSATIONS_OF)
            .bind(item_ids)
            .fetch_all(&mut **tx)
            .await?;
        self.lock(tx, conversations).await
    }
}

/// Insert one item at the end of its conversation's lane. It is the lane's
/// head when nothing earlier in the lane is still waiting. Returns whether
/// a row was added (`false`: the item key existed). Takes the conversation's
/// lock, so concurrent writers of one lane cannot pick the same ordinal or
/// both become head.
pub(super) async fn insert_item(
    tx: &mut Transaction<'static, Postgres>,
    item: &NewOutboxItem,
) -> StoreResult<bool> {
    insert_item_unless(tx, item, None).await
}

/// Insert one item unless an item that edits `unless_key` exists.
pub(super) async fn insert_item_unless(
    tx: &mut Transaction<'static, Postgres>,
    item: &NewOutboxItem,
    unless_key: Option<&str>,
) -> StoreResult<bool> {
    lock_conversation(tx, item.conversation_id).await?;
    let done = sqlx::query(INSERT_ITEM)
        .bind(&item.item_key)
        .bind(item.conversation_id)
        .bind(&item.account)
        .bind(&item.chat_id)
        .bind(thread_to_db(&item.thread_id))
        .bind(item.surface.as_str())
        .bind(&item.reply_to)
        .bind(&item.run_id)
        .bind(item.kind.as_str())
        .bind(&item.text)
        .bind(item.created_at)
        .bind(&item.group_key)
        .bind(&item.edits_key)
        .bind(unless_key)
        .bind(attachments_to_db(&item.attachments)?)
        .execute(&mut **tx)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Make the lowest waiting item of a conversation its lane's head (after
/// the previous head was released). The caller holds the lane's lock.
async fn promote_head(
    tx: &mut Transaction<'static, Postgres>,
    conversation_id: i64,
) -> StoreResult<()> {
    sqlx::query(PROMOTE_HEAD)
        .bind(conversation_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// After a write that may have moved an item out of its lane's way (it
/// returns the item's conversation when it applied), promote the lane's next
/// item, under the lane's lock. Returns whether the write applied.
async fn release_lane(
    tx: &mut Transaction<'static, Postgres>,
    locked: &mut LockedLanes,
    conversation: Option<i64>,
) -> StoreResult<bool> {
    if let Some(conversation_id) = conversation {
        locked.lock(tx, [conversation_id]).await?;
        promote_head(tx, conversation_id).await?;
    }
    Ok(conversation.is_some())
}

#[async_trait]
impl OutboxStore for PgStore {
    async fn outbox_enqueue(&self, items: &[NewOutboxItem]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin().await?;
        // All the batch's lanes up front, in order: `insert_item` takes each
        // again (a no-op), so a batch spanning several lanes cannot deadlock
        // with another.
        LockedLanes::default()
            .lock(&mut tx, items.iter().map(|i| i.conversation_id))
            .await?;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(insert_item(&mut tx, item).await?);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn outbox_claim(&self, claim: &Claim) -> StoreResult<Vec<OutboxItem>> {
        let mut tx = self.begin().await?;
        let rows = sqlx::query(CLAIM)
            .bind(&claim.owner)
            .bind(claim.lease_until)
            .bind(claim.now)
            .bind(claim.limit as i64)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut items = rows
            .iter()
            .map(item_from_row)
            .collect::<StoreResult<Vec<_>>>()?;
        items.sort_by_key(|i| (i.next_attempt_at, i.id));
        Ok(items)
    }

    async fn outbox_settle(&self, batch: &[Settlement]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin().await?;
        let mut out = vec![false; batch.len()];
        // The lanes this batch may release (acknowledged and failed items
        // leave them), locked before any item is touched.
        let mut locked = LockedLanes::default();
        let releasing: Vec<i64> = batch
            .iter()
            .filter(|s| {
                matches!(
                    s.outcome,
                    Outcome::Acknowledged { .. } | Outcome::Failed { .. }
                )
            })
            .map(|s| s.item_id)
            .collect();
        locked.lock_items(&mut tx, &releasing).await?;
        // Acknowledgements, the common outcome, go in two statements for the
        // whole batch: one fenced update, one promotion of the lanes' next
        // heads. The rarer outcomes go one by one below.
        let mut ack_ids = Vec::new();
        let mut ack_tokens = Vec::new();
        let mut ack_receipts = Vec::new();
        for s in batch {
            if let Outcome::Acknowledged { receipt } = &s.outcome {
                ack_ids.push(s.item_id);
                ack_tokens.push(s.fencing_token);
                ack_receipts.push(receipt.as_str());
            }
        }
        if !ack_ids.is_empty() {
            let now = batch.iter().map(|s| s.now).max().unwrap_or_default();
            let acked = sqlx::query(ACK_MANY)
                .bind(now)
                .bind(&ack_ids)
                .bind(&ack_tokens)
                .bind(&ack_receipts)
                .fetch_all(&mut *tx)
                .await?;
            let mut conversations = Vec::with_capacity(acked.len());
            let mut done = HashSet::with_capacity(acked.len());
            for row in &acked {
                done.insert(row.try_get::<i64, _>(0)?);
                conversations.push(row.try_get::<i64, _>(1)?);
            }
            if !conversations.is_empty() {
                locked.lock(&mut tx, conversations.iter().copied()).await?;
                sqlx::query(PROMOTE_MANY)
                    .bind(&conversations)
                    .execute(&mut *tx)
                    .await?;
            }
            for (slot, s) in out.iter_mut().zip(batch) {
                if matches!(s.outcome, Outcome::Acknowledged { .. }) {
                    *slot = done.contains(&s.item_id);
                }
            }
        }
        for (slot, s) in out.iter_mut().zip(batch) {
            let applied = match &s.outcome {
                Outcome::Acknowledged { .. } => continue,
                Outcome::Retry {
                    next_attempt_at,
                    counts,
                    reason,
                } => {
                    sqlx::query(RETRY)
                        .bind(next_attempt_at)
                        .bind(i64::from(*counts))
                        .bind(reason)
                        .bind(s.item_id)
                        .bind(s.fencing_token)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                        == 1
                }
                Outcome::Failed { reason } => {
                    let failed = sqlx::query(FAIL)
                        .bind(reason)
                        .bind(s.now)
                        .bind(s.item_id)
                        .bind(s.fencing_token)
                        .fetch_optional(&mut *tx)
                        .await?;
                    let conversation = match failed {
                        Some(row) => {
                            // The chunks of one answer share a fate.
                            let group: Option<String> = row.try_get("group_key")?;
                            if let Some(group) = group {
                                sqlx::query(FAIL_LATER_CHUNKS)
                                    .bind(s.now)
                                    .bind(group)
                                    .bind(row.try_get::<i64, _>("ordinal")?)
                                    .execute(&mut *tx)
                                    .await?;
                            }
                            Some(row.try_get::<i64, _>("conversation_id")?)
                        }
                        None => None,
                    };
                    release_lane(&mut tx, &mut locked, conversation).await?
                }
                Outcome::Ambiguous {
                    reason,
                    reconcile_at,
                } => {
                    sqlx::query(AMBIGUOUS)
                        .bind(reconcile_at)
                        .bind(reason)
                        .bind(s.item_id)
                        .bind(s.fencing_token)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                        == 1
                }
            };
            *slot = applied;
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn outbox_expired(&self, now: i64, limit: usize) -> StoreResult<Vec<OutboxItem>> {
        let rows = sqlx::query(EXPIRED)
            .bind(now)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(item_from_row).collect()
    }

    async fn outbox_reconcile(&self, batch: &[Reconcile]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin().await?;
        // Held items leave their lanes: lock those lanes first.
        let mut locked = LockedLanes::default();
        let holding: Vec<i64> = batch
            .iter()
            .filter(|r| r.action == ReconcileAction::Hold)
            .map(|r| r.item_id)
            .collect();
        locked.lock_items(&mut tx, &holding).await?;
        let mut out = Vec::with_capacity(batch.len());
        for r in batch {
            let applied = match r.action {
                ReconcileAction::Resend { possible_duplicate } => {
                    sqlx::query(RESEND)
                        .bind(r.now)
                        .bind(i64::from(possible_duplicate))
                        .bind(r.item_id)
                        .bind(r.fencing_token)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                        == 1
                }
                ReconcileAction::Hold => {
                    let conversation: Option<i64> = sqlx::query_scalar(HOLD)
                        .bind(r.now)
                        .bind(r.item_id)
                        .bind(r.fencing_token)
                        .fetch_optional(&mut *tx)
                        .await?;
                    release_lane(&mut tx, &mut locked, conversation).await?
                }
            };
            out.push(applied);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn outbox_expire_all_leases(&self, now: i64) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let done = sqlx::query(
            "UPDATE outbox SET lease_expires_at = $1
             WHERE state = 'possibly_dispatched' AND (lease_expires_at IS NULL OR lease_expires_at > $1)",
        )
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn outbox_get(&self, id: i64) -> StoreResult<Option<OutboxItem>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            outbox_columns!(),
            " FROM outbox WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(item_from_row).transpose()
    }

    async fn outbox_get_by_key(&self, item_key: &str) -> StoreResult<Option<OutboxItem>> {
        let row = sqlx::query(FIND_BY_KEY)
            .bind(item_key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(item_from_row).transpose()
    }

    async fn outbox_replaced(&self, edits_key: &str) -> StoreResult<bool> {
        let found: Option<i64> = sqlx::query_scalar(REPLACED)
            .bind(edits_key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(found.is_some())
    }

    async fn outbox_enqueue_preview(&self, item: &NewOutboxItem) -> StoreResult<bool> {
        let mut tx = self.begin().await?;
        // The items that replace a preview are written to the same lane, so
        // the lane's lock (taken by the insert) orders the check and them.
        let added = insert_item_unless(&mut tx, item, Some(&item.item_key)).await?;
        tx.commit().await?;
        Ok(added)
    }

    async fn outbox_resolve(&self, id: i64, resolution: Resolution, now: i64) -> StoreResult<bool> {
        let mut tx = self.begin().await?;
        let sql = match resolution {
            Resolution::AsSent => {
                "UPDATE outbox SET state = 'acknowledged', receipt = '{\"operator\":\"as-sent\"}',
                    reason = 'resolved as sent by an operator', settled_at = $1
                 WHERE id = $2 AND state = 'held'"
            }
            Resolution::Drop => {
                "UPDATE outbox SET state = 'dropped', reason = 'dropped by an operator',
                    settled_at = $1
                 WHERE id = $2 AND state = 'held'"
            }
            // Sent again now, out of its lane's order: the lane moved on
            // when the item was held.
            Resolution::Resend => {
                "UPDATE outbox SET state = 'not_dispatched', head = TRUE, next_attempt_at = $1,
                    fencing_token = fencing_token + 1, resends = resends + 1,
                    reason = 'resent by an operator', settled_at = NULL
                 WHERE id = $2 AND state = 'held'"
            }
        };
        if resolution == Resolution::Resend {
            // The item waits in its lane again: an insert into the lane must
            // see it (and queue behind it).
            LockedLanes::default().lock_items(&mut tx, &[id]).await?;
        }
        let done = sqlx::query(sql)
            .bind(now)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn outbox_stats(&self) -> StoreResult<OutboxStats> {
        let count = |state: &'static str| {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM outbox WHERE state = $1")
                .bind(state)
                .fetch_one(&self.pool)
        };
        Ok(OutboxStats {
            not_dispatched: count("not_dispatched").await?,
            possibly_dispatched: count("possibly_dispatched").await?,
            held: count("held").await?,
            oldest_unsent_created_at: sqlx::query_scalar(
                "SELECT created_at FROM outbox WHERE state = 'not_dispatched' ORDER BY id LIMIT 1",
            )
            .fetch_optional(&self.pool)
            .await?,
        })
    }

    async fn outbox_list(&self, filter: &OutboxFilter) -> StoreResult<Vec<OutboxItem>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            outbox_columns!(),
            " FROM outbox WHERE ($1::TEXT IS NULL OR state = $1)
              AND ($2::BIGINT IS NULL OR conversation_id = $2)
              ORDER BY id DESC LIMIT $3"
        ))
        .bind(filter.state.map(|s| s.as_str()))
        .bind(filter.conversation_id)
        .bind(filter.limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(item_from_row).collect()
    }

    async fn outbox_counts(&self) -> StoreResult<Vec<(DispatchState, i64)>> {
        let rows = sqlx::query("SELECT state, COUNT(*) FROM outbox GROUP BY state")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let s: String = row.try_get(0)?;
                let n: i64 = row.try_get(1)?;
                Ok((
                    DispatchState::parse(&s).ok_or_else(|| bad_value("state", &s))?,
                    n,
                ))
            })
            .collect()
    }
}
