//! The inbound journal and the conversation map on SQLite.

use async_trait::async_trait;
use sqlx::Row;

use super::SqliteStore;
use super::outbox::insert_item;
use crate::store::rows::{bad_value, inbound_from_row, thread_from_db, thread_to_db};
use crate::store::{
    Admitted, Disposition, InboundRow, JournalOutcome, JournalStore, NewInbound, NewOutboxItem,
    RecentChat, StoreResult,
};

macro_rules! inbound_select {
    () => {
        "SELECT i.id, i.account, i.update_key, i.conversation_id, c.chat_id, c.chat_kind,
                c.thread_id, c.space, c.surface, i.sender_id, i.sender_name, i.message_id, i.payload,
                i.input_policy, i.addressed, i.disposition, i.reason, i.submission_key, i.run_id,
                i.received_at, i.settled_at
         FROM inbound i JOIN conversations c ON c.id = i.conversation_id "
    };
}

pub(super) const FIND_UPDATE: &str =
    "SELECT id, conversation_id FROM inbound WHERE account = ? AND update_key = ?";
pub(super) const FIND_CONVERSATION: &str = "SELECT id FROM conversations
     WHERE account = ? AND chat_id = ? AND thread_id = ? AND closed_at IS NULL";
pub(super) const PENDING: &str = concat!(
    inbound_select!(),
    "WHERE i.disposition = 'pending' ORDER BY i.id LIMIT ?"
);
// The lease name is `keys::lane_lease`.
pub(super) const PENDING_FOR: &str = concat!(
    inbound_select!(),
    "WHERE i.disposition = 'pending'
       AND NOT EXISTS (SELECT 1 FROM leases l
                       WHERE l.name = 'lane:' || i.conversation_id
                         AND l.owner <> ?1 AND l.expires_at > ?2)
     ORDER BY i.id LIMIT ?3"
);
// Not a per-message path: it runs once per gateway session. It reads the
// account's open conversations through conversations_current and one row
// each through inbound_by_conversation, then sorts them (a temporary B-tree
// over open conversations, not over history).
pub(super) const RECENT_CHATS: &str = "SELECT c.chat_id, c.thread_id, i.message_id, i.received_at
     FROM conversations c
     JOIN inbound i ON i.id = (SELECT id FROM inbound WHERE conversation_id = c.id ORDER BY id DESC LIMIT 1)
     WHERE c.account = ?1 AND c.closed_at IS NULL AND i.received_at >= ?2
     ORDER BY i.received_at DESC LIMIT ?3";
pub(super) const ADMIT: &str =
    "UPDATE inbound SET disposition = 'admitted', run_id = ?, settled_at = ?
     WHERE id = ? AND disposition = 'pending'";

/// Move a chat's state to its new id (a Telegram group that became a
/// supergroup). A conversation that already exists under the new id (its
/// updates arrived first) keeps the new id; the old one is closed instead.
async fn migrate_chat(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    account: &str,
    from: &str,
    to: &str,
    at: i64,
) -> StoreResult<()> {
    let statements = [
        "UPDATE conversations SET closed_at = created_at
         WHERE account = ?1 AND chat_id = ?2 AND closed_at IS NULL AND EXISTS (
             SELECT 1 FROM conversations n WHERE n.account = ?1 AND n.chat_id = ?3
                 AND n.thread_id = conversations.thread_id AND n.closed_at IS NULL)",
        "UPDATE conversations SET chat_id = ?3
         WHERE account = ?1 AND chat_id = ?2 AND closed_at IS NULL",
        "UPDATE runs SET chat_id = ?3
         WHERE account = ?1 AND chat_id = ?2 AND state IN ('queued', 'running', 'interrupt_requested')",
        "UPDATE outbox SET chat_id = ?3
         WHERE account = ?1 AND chat_id = ?2 AND state IN ('not_dispatched', 'possibly_dispatched')",
        "UPDATE schedules SET chat_id = ?3 WHERE account = ?1 AND chat_id = ?2",
        "UPDATE OR IGNORE chat_settings SET chat_id = ?3 WHERE account = ?1 AND chat_id = ?2",
    ];
    for sql in statements {
        sqlx::query(sql)
            .bind(account)
            .bind(from)
            .bind(to)
            .execute(&mut **tx)
            .await?;
    }
    sqlx::query(
        "INSERT OR IGNORE INTO chat_migrations (account, from_chat, to_chat, migrated_at)
         VALUES (?, ?, ?, ?)",
    )
    .bind(account)
    .bind(from)
    .bind(to)
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[async_trait]
impl JournalStore for SqliteStore {
    async fn journal_insert(&self, batch: &[NewInbound]) -> StoreResult<Vec<JournalOutcome>> {
        let mut tx = self.begin_write().await?;
        let mut outcomes = Vec::with_capacity(batch.len());
        for item in batch {
            let existing = sqlx::query(FIND_UPDATE)
                .bind(&item.account)
                .bind(&item.update_key)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(row) = existing {
                outcomes.push(JournalOutcome::Duplicate {
                    inbound_id: row.try_get(0)?,
                    conversation_id: row.try_get(1)?,
                });
                continue;
            }
            let thread = thread_to_db(&item.thread_id);
            let conversation: Option<i64> = sqlx::query_scalar(FIND_CONVERSATION)
                .bind(&item.account)
                .bind(&item.chat_id)
                .bind(thread)
                .fetch_optional(&mut *tx)
                .await?;
            let conversation_id = match conversation {
                Some(id) => id,
                None => {
                    sqlx::query_scalar(
                        "INSERT INTO conversations (account, chat_id, thread_id, chat_kind, surface, created_at, space)
                         VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    )
                    .bind(&item.account)
                    .bind(&item.chat_id)
                    .bind(thread)
                    .bind(item.chat_kind.as_str())
                    .bind(item.surface.as_str())
                    .bind(item.received_at)
                    .bind(&item.space)
                    .fetch_one(&mut *tx)
                    .await?
                }
            };
            let settled_at = (item.disposition != Disposition::Pending).then_some(item.received_at);
            let inbound_id: i64 = sqlx::query_scalar(
                "INSERT INTO inbound (account, update_key, conversation_id, sender_id, sender_name,
                    message_id, payload, input_policy, addressed, disposition, reason,
                    submission_key, received_at, settled_at)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(&item.account)
            .bind(&item.update_key)
            .bind(conversation_id)
            .bind(&item.sender_id)
            .bind(&item.sender_name)
            .bind(&item.message_id)
            .bind(&item.payload)
            .bind(item.input_policy.map(|p| p.as_str()))
            .bind(item.addressed)
            .bind(item.disposition.as_str())
            .bind(&item.reason)
            .bind(&item.submission_key)
            .bind(item.received_at)
            .bind(settled_at)
            .fetch_one(&mut *tx)
            .await?;
            if item.closes_conversation {
                sqlx::query("UPDATE conversations SET closed_at = ? WHERE id = ?")
                    .bind(item.received_at)
                    .bind(conversation_id)
                    .execute(&mut *tx)
                    .await?;
            }
            if let Some(to) = &item.migrates_to {
                migrate_chat(&mut tx, &item.account, &item.chat_id, to, item.received_at).await?;
            }
            outcomes.push(JournalOutcome::Accepted {
                inbound_id,
                conversation_id,
            });
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    async fn journal_pending(&self, limit: usize) -> StoreResult<Vec<InboundRow>> {
        let rows = sqlx::query(PENDING)
            .bind(limit as i64)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(inbound_from_row).collect()
    }

    async fn journal_pending_for(
        &self,
        owner: &str,
        now: i64,
        limit: usize,
    ) -> StoreResult<Vec<InboundRow>> {
        let rows = sqlx::query(PENDING_FOR)
            .bind(owner)
            .bind(now)
            .bind(limit as i64)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(inbound_from_row).collect()
    }

    async fn journal_admit(&self, admissions: &[Admitted], now: i64) -> StoreResult<()> {
        if admissions.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for a in admissions {
            sqlx::query(ADMIT)
                .bind(&a.run_id)
                .bind(now)
                .bind(a.inbound_id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn journal_settle(
        &self,
        inbound_id: i64,
        disposition: Disposition,
        reason: &str,
        notice: Option<&NewOutboxItem>,
        now: i64,
    ) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE inbound SET disposition = ?, reason = ?, settled_at = ?
             WHERE id = ? AND disposition = 'pending'",
        )
        .bind(disposition.as_str())
        .bind(reason)
        .bind(now)
        .bind(inbound_id)
        .execute(&mut *tx)
        .await?;
        let changed = done.rows_affected() == 1;
        if changed && let Some(notice) = notice {
            insert_item(&mut tx, notice).await?;
        }
        tx.commit().await?;
        Ok(changed)
    }

    async fn journal_get(&self, inbound_id: i64) -> StoreResult<Option<InboundRow>> {
        let row = sqlx::query(concat!(inbound_select!(), "WHERE i.id = ?"))
            .bind(inbound_id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(inbound_from_row).transpose()
    }

    async fn journal_list(
        &self,
        disposition: Option<Disposition>,
        limit: usize,
    ) -> StoreResult<Vec<InboundRow>> {
        let rows = match disposition {
            Some(d) => {
                sqlx::query(concat!(
                    inbound_select!(),
                    "WHERE i.disposition = ? ORDER BY i.id DESC LIMIT ?"
                ))
                .bind(d.as_str())
                .bind(limit as i64)
                .fetch_all(&self.reader)
                .await?
            }
            None => {
                sqlx::query(concat!(inbound_select!(), "ORDER BY i.id DESC LIMIT ?"))
                    .bind(limit as i64)
                    .fetch_all(&self.reader)
                    .await?
            }
        };
        rows.iter().map(inbound_from_row).collect()
    }

    async fn journal_recent_chats(
        &self,
        account: &str,
        since: i64,
        limit: usize,
    ) -> StoreResult<Vec<RecentChat>> {
        // One index probe per open conversation of the account (the latest
        // row through inbound_by_conversation); the newest first.
        let rows = sqlx::query(RECENT_CHATS)
            .bind(account)
            .bind(since)
            .bind(limit as i64)
            .fetch_all(&self.reader)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(RecentChat {
                    chat_id: row.try_get("chat_id")?,
                    thread_id: thread_from_db(row.try_get("thread_id")?),
                    last_message_id: row.try_get("message_id")?,
                    last_received_at: row.try_get("received_at")?,
                })
            })
            .collect()
    }

    async fn journal_counts(&self) -> StoreResult<Vec<(Disposition, i64)>> {
        let rows = sqlx::query("SELECT disposition, COUNT(*) FROM inbound GROUP BY disposition")
            .fetch_all(&self.reader)
            .await?;
        rows.iter()
            .map(|row| {
                let d: String = row.try_get(0)?;
                let n: i64 = row.try_get(1)?;
                Ok((
                    Disposition::parse(&d).ok_or_else(|| bad_value("disposition", &d))?,
                    n,
                ))
            })
            .collect()
    }
}
