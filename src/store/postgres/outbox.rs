//! OutboxStore on PostgreSQL.
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;
use sqlx::{Postgres, Transaction};

use super::{PgStore, lock_conversation, thread_to_db};

/// Insert one item at the end of its conversation's lane (the lane's head
/// when nothing earlier waits). `false` when the item key existed. Takes the
/// conversation's lock, so concurrent writers of one lane cannot pick the
/// same ordinal or both become head.
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
    let attachments = if item.attachments.is_empty() {
        None
    } else {
        Some(
            serde_json::to_string(&item.attachments)
                .map_err(|e| StoreError::Other(e.to_string()))?,
        )
    };
    let done = sqlx::query(
        "INSERT INTO outbox (item_key, conversation_id, ordinal, account, chat_id, thread_id,
         surface, reply_to, run_id, kind, text, group_key, edits_key, state, head, next_attempt_at,
         created_at, attachments)
         SELECT $1, $2,
         COALESCE((SELECT MAX(ordinal) FROM outbox WHERE conversation_id = $2), 0) + 1,
         $3, $4, $5, $6, $7, $8, $9, $10, $12, $13, 'not_dispatched',
         NOT EXISTS (SELECT 1 FROM outbox WHERE conversation_id = $2
         AND state IN ('not_dispatched', 'possibly_dispatched')),
         $11, $11, $15
         WHERE $14::text IS NULL OR NOT EXISTS (SELECT 1 FROM outbox WHERE edits_key = $14)
         ON CONFLICT (item_key) DO NOTHING",
    )
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
    .bind(attachments)
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

#[async_trait]
impl OutboxStore for PgStore {
    async fn outbox_enqueue(&self, _items: &[NewOutboxItem]) -> StoreResult<Vec<bool>> {
        todo!("postgres")
    }

    async fn outbox_claim(&self, _claim: &Claim) -> StoreResult<Vec<OutboxItem>> {
        todo!("postgres")
    }

    async fn outbox_settle(&self, _batch: &[Settlement]) -> StoreResult<Vec<bool>> {
        todo!("postgres")
    }

    async fn outbox_expired(&self, _now: i64, _limit: usize) -> StoreResult<Vec<OutboxItem>> {
        todo!("postgres")
    }

    async fn outbox_reconcile(&self, _batch: &[Reconcile]) -> StoreResult<Vec<bool>> {
        todo!("postgres")
    }

    async fn outbox_expire_all_leases(&self, _now: i64) -> StoreResult<u64> {
        todo!("postgres")
    }

    async fn outbox_get(&self, _id: i64) -> StoreResult<Option<OutboxItem>> {
        todo!("postgres")
    }

    async fn outbox_get_by_key(&self, _item_key: &str) -> StoreResult<Option<OutboxItem>> {
        todo!("postgres")
    }

    async fn outbox_enqueue_preview(&self, _item: &NewOutboxItem) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn outbox_replaced(&self, _edits_key: &str) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn outbox_resolve(
        &self,
        _id: i64,
        _resolution: Resolution,
        _now: i64,
    ) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn outbox_stats(&self) -> StoreResult<OutboxStats> {
        todo!("postgres")
    }

    async fn outbox_list(&self, _filter: &OutboxFilter) -> StoreResult<Vec<OutboxItem>> {
        todo!("postgres")
    }

    async fn outbox_counts(&self) -> StoreResult<Vec<(DispatchState, i64)>> {
        todo!("postgres")
    }
}
