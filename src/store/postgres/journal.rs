//! The inbound journal and the conversation map on PostgreSQL.
//!
//! Several processes journal at once: the journal key and the open
//! conversation of a chat are unique, and inserts use `ON CONFLICT`, so two
//! processes inserting the same update (or opening the same conversation)
//! both succeed with one row, the later one seeing the winner's ids. A
//! batch first locks the chats it touches, in one global order, so batches
//! that share chats take turns instead of deadlocking on each other's
//! uncommitted rows.

use async_trait::async_trait;
use sqlx::Row;
use sqlx::{Postgres, Transaction};

use super::PgStore;
use super::outbox::insert_item;
use crate::store::rows::{bad_value, inbound_from_row, thread_from_db, thread_to_db};
use crate::store::{
    Admitted, Disposition, InboundRow, JournalOutcome, JournalStore, NewInbound, NewOutboxItem,
    RecentChat, StoreError, StoreResult,
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
    "SELECT id, conversation_id FROM inbound WHERE account = $1 AND update_key = $2";
// `FOR SHARE`: a `/new`, a chat migration or a purge that closes or moves
// the conversation meanwhile waits for this transaction; one that got there
// first makes this find nothing (the row no longer matches once it
// commits), so the update opens the chat's next conversation as it would
// have after it.
pub(super) const FIND_CONVERSATION: &str = "SELECT id FROM conversations
     WHERE account = $1 AND chat_id = $2 AND thread_id = $3 AND closed_at IS NULL
     FOR SHARE";
// Another process opening the same conversation at once: one insert wins,
// the other inserts nothing and finds the winner's row.
pub(super) const INSERT_CONVERSATION: &str =
    "INSERT INTO conversations (account, chat_id, thread_id, chat_kind, surface, created_at, space)
     VALUES ($1, $2, $3, $4, $5, $6, $7)
     ON CONFLICT (account, chat_id, thread_id) WHERE closed_at IS NULL DO NOTHING
     RETURNING id";
// Another process journaling the same update at once: one insert wins, the
// other inserts nothing and reports the winner's row as a duplicate.
pub(super) const INSERT_UPDATE: &str =
    "INSERT INTO inbound (account, update_key, conversation_id, sender_id, sender_name,
        message_id, payload, input_policy, addressed, disposition, reason,
        submission_key, received_at, settled_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
     ON CONFLICT (account, update_key) DO NOTHING
     RETURNING id";
pub(super) const PENDING: &str = concat!(
    inbound_select!(),
    "WHERE i.disposition = 'pending' ORDER BY i.id LIMIT $1"
);
// The lease name is `keys::lane_lease`.
pub(super) const PENDING_FOR: &str = concat!(
    inbound_select!(),
    "WHERE i.disposition = 'pending'
       AND NOT EXISTS (SELECT 1 FROM leases l
                       WHERE l.name = 'lane:' || i.conversation_id
                         AND l.owner <> $1 AND l.expires_at > $2)
     ORDER BY i.id LIMIT $3"
);
// Not a per-message path: it runs once per gateway session. It reads the
// account's open conversations through conversations_current and one row
// each through inbound_by_conversation, then sorts them (over open
// conversations, not over history).
pub(super) const RECENT_CHATS: &str = "SELECT c.chat_id, c.thread_id, i.message_id, i.received_at
     FROM conversations c
     JOIN inbound i ON i.id = (SELECT id FROM inbound WHERE conversation_id = c.id ORDER BY id DESC LIMIT 1)
     WHERE c.account = $1 AND c.closed_at IS NULL AND i.received_at >= $2
     ORDER BY i.received_at DESC LIMIT $3";
pub(super) const ADMIT: &str =
    "UPDATE inbound SET disposition = 'admitted', run_id = $1, settled_at = $2
     WHERE id = $3 AND disposition = 'pending'";

// Transaction-scoped advisory locks on chats, taken in ascending key order.
// (The class, `jour` in ASCII, keeps them apart from `lock_conversation`'s.)
pub(super) const LOCK_CHATS: &str =
    "SELECT pg_advisory_xact_lock(1785689458, k) FROM unnest($1::int4[]) AS k";

/// How many times a journal batch is tried when PostgreSQL aborts it to
/// break a deadlock (with a writer that does not take the chat locks, such
/// as a purge or a settlement).
const INSERT_ATTEMPTS: usize = 3;

/// How many times one update looks for (or opens) its conversation when the
/// conversation keeps being opened and closed by others meanwhile.
const CONVERSATION_ATTEMPTS: usize = 4;

/// Whether PostgreSQL aborted the transaction to break a deadlock (or a
/// serialization conflict): trying it again is safe, nothing was written.
fn is_deadlock(error: &StoreError) -> bool {
    match error {
        StoreError::Database(sqlx::Error::Database(e)) => {
            matches!(e.code().as_deref(), Some("40P01") | Some("40001"))
        }
        _ => false,
    }
}

/// The advisory lock key of a chat (all its threads): a stable hash of
/// `(account, chat_id)`. Different chats may share a key; they then merely
/// take turns.
fn chat_lock_key(account: &str, chat_id: &str) -> i32 {
    // FNV-1a, folded to 32 bits.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in account.bytes().chain([0]).chain(chat_id.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash ^ (hash >> 32)) as u32 as i32
}

/// Lock every chat the batch journals into or migrates to, in key order,
/// until the transaction ends.
async fn lock_chats(
    tx: &mut Transaction<'static, Postgres>,
    batch: &[NewInbound],
) -> StoreResult<()> {
    let mut keys: Vec<i32> = batch
        .iter()
        .flat_map(|item| {
            let to = item.migrates_to.as_deref();
            std::iter::once(chat_lock_key(&item.account, &item.chat_id))
                .chain(to.map(|to| chat_lock_key(&item.account, to)))
        })
        .collect();
    keys.sort_unstable();
    keys.dedup();
    sqlx::query(LOCK_CHATS)
        .bind(keys)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Move a chat's state to its new id (a Telegram group that became a
/// supergroup). A conversation that already exists under the new id (its
/// updates arrived first) keeps the new id; the old one is closed instead.
async fn migrate_chat(
    tx: &mut Transaction<'static, Postgres>,
    account: &str,
    from: &str,
    to: &str,
    at: i64,
) -> StoreResult<()> {
    let statements = [
        "UPDATE conversations SET closed_at = created_at
         WHERE account = $1 AND chat_id = $2 AND closed_at IS NULL AND EXISTS (
             SELECT 1 FROM conversations n WHERE n.account = $1 AND n.chat_id = $3
                 AND n.thread_id = conversations.thread_id AND n.closed_at IS NULL)",
        "UPDATE conversations SET chat_id = $3
         WHERE account = $1 AND chat_id = $2 AND closed_at IS NULL",
        "UPDATE runs SET chat_id = $3
         WHERE account = $1 AND chat_id = $2 AND state IN ('queued', 'running', 'interrupt_requested')",
        "UPDATE outbox SET chat_id = $3
         WHERE account = $1 AND chat_id = $2 AND state IN ('not_dispatched', 'possibly_dispatched')",
        "UPDATE schedules SET chat_id = $3 WHERE account = $1 AND chat_id = $2",
        // SQLite's `UPDATE OR IGNORE`: settings the new chat has already
        // win; the old chat's stay where they are.
        "UPDATE chat_settings SET chat_id = $3 WHERE account = $1 AND chat_id = $2
         AND NOT EXISTS (SELECT 1 FROM chat_settings n WHERE n.account = $1 AND n.chat_id = $3)",
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
        "INSERT INTO chat_migrations (account, from_chat, to_chat, migrated_at)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(account)
    .bind(from)
    .bind(to)
    .bind(at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The open conversation of the update's chat, opened when there is none.
async fn resolve_conversation(
    tx: &mut Transaction<'static, Postgres>,
    item: &NewInbound,
) -> StoreResult<i64> {
    let thread = thread_to_db(&item.thread_id);
    for _ in 0..CONVERSATION_ATTEMPTS {
        let found: Option<i64> = sqlx::query_scalar(FIND_CONVERSATION)
            .bind(&item.account)
            .bind(&item.chat_id)
            .bind(thread)
            .fetch_optional(&mut **tx)
            .await?;
        if let Some(id) = found {
            return Ok(id);
        }
        let created: Option<i64> = sqlx::query_scalar(INSERT_CONVERSATION)
            .bind(&item.account)
            .bind(&item.chat_id)
            .bind(thread)
            .bind(item.chat_kind.as_str())
            .bind(item.surface.as_str())
            .bind(item.received_at)
            .bind(&item.space)
            .fetch_optional(&mut **tx)
            .await?;
        if let Some(id) = created {
            return Ok(id);
        }
        // Another process opened it first (and committed): look again.
    }
    Err(StoreError::Other(format!(
        "the conversation of chat {:?} of {} kept changing while journaling",
        item.chat_id, item.account
    )))
}

/// Journal one batch in `tx` (see [`JournalStore::journal_insert`]).
async fn insert_batch(
    tx: &mut Transaction<'static, Postgres>,
    batch: &[NewInbound],
) -> StoreResult<Vec<JournalOutcome>> {
    lock_chats(tx, batch).await?;
    let mut outcomes = Vec::with_capacity(batch.len());
    for item in batch {
        let existing = sqlx::query(FIND_UPDATE)
            .bind(&item.account)
            .bind(&item.update_key)
            .fetch_optional(&mut **tx)
            .await?;
        if let Some(row) = existing {
            outcomes.push(JournalOutcome::Duplicate {
                inbound_id: row.try_get(0)?,
                conversation_id: row.try_get(1)?,
            });
            continue;
        }
        let conversation_id = resolve_conversation(tx, item).await?;
        let settled_at = (item.disposition != Disposition::Pending).then_some(item.received_at);
        let inserted: Option<i64> = sqlx::query_scalar(INSERT_UPDATE)
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
            .fetch_optional(&mut **tx)
            .await?;
        let Some(inbound_id) = inserted else {
            // Another process journaled the same update meanwhile (its
            // insert committed first): a duplicate of its row.
            let row = sqlx::query(FIND_UPDATE)
                .bind(&item.account)
                .bind(&item.update_key)
                .fetch_one(&mut **tx)
                .await?;
            outcomes.push(JournalOutcome::Duplicate {
                inbound_id: row.try_get(0)?,
                conversation_id: row.try_get(1)?,
            });
            continue;
        };
        if item.closes_conversation {
            sqlx::query("UPDATE conversations SET closed_at = $1 WHERE id = $2")
                .bind(item.received_at)
                .bind(conversation_id)
                .execute(&mut **tx)
                .await?;
        }
        if let Some(to) = &item.migrates_to {
            migrate_chat(tx, &item.account, &item.chat_id, to, item.received_at).await?;
        }
        outcomes.push(JournalOutcome::Accepted {
            inbound_id,
            conversation_id,
        });
    }
    Ok(outcomes)
}

#[async_trait]
impl JournalStore for PgStore {
    async fn journal_insert(&self, batch: &[NewInbound]) -> StoreResult<Vec<JournalOutcome>> {
        let mut attempt = 1;
        loop {
            let mut tx = self.begin().await?;
            let result = match insert_batch(&mut tx, batch).await {
                Ok(outcomes) => tx.commit().await.map(|()| outcomes).map_err(Into::into),
                Err(e) => Err(e),
            };
            match result {
                Err(e) if attempt < INSERT_ATTEMPTS && is_deadlock(&e) => attempt += 1,
                result => return result,
            }
        }
    }

    async fn journal_pending(&self, limit: usize) -> StoreResult<Vec<InboundRow>> {
        let rows = sqlx::query(PENDING)
            .bind(limit as i64)
            .fetch_all(&self.pool)
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
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(inbound_from_row).collect()
    }

    async fn journal_admit(&self, admissions: &[Admitted], now: i64) -> StoreResult<()> {
        if admissions.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin().await?;
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
        let mut tx = self.begin().await?;
        let done = sqlx::query(
            "UPDATE inbound SET disposition = $1, reason = $2, settled_at = $3
             WHERE id = $4 AND disposition = 'pending'",
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
        let row = sqlx::query(concat!(inbound_select!(), "WHERE i.id = $1"))
            .bind(inbound_id)
            .fetch_optional(&self.pool)
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
                    "WHERE i.disposition = $1 ORDER BY i.id DESC LIMIT $2"
                ))
                .bind(d.as_str())
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(concat!(inbound_select!(), "ORDER BY i.id DESC LIMIT $1"))
                    .bind(limit as i64)
                    .fetch_all(&self.pool)
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
            .fetch_all(&self.pool)
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
            .fetch_all(&self.pool)
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
