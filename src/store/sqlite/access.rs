//! Pairings of direct-message users on SQLite.

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::rows::pairing_from_row;
use crate::store::{AccessStore, PairingRow, StoreResult};

const COLUMNS: &str =
    "account, user_id, user_name, code, state, created_at, expires_at, decided_at";

#[async_trait]
impl AccessStore for SqliteStore {
    async fn chat_origins(&self, account: &str, chat_id: &str) -> StoreResult<Vec<String>> {
        let rows: Vec<String> = sqlx::query_scalar(
            "WITH RECURSIVE origin(chat, depth) AS (
                 SELECT ?2, 0
                 UNION
                 SELECT m.from_chat, o.depth + 1 FROM chat_migrations m
                 JOIN origin o ON m.account = ?1 AND m.to_chat = o.chat
                 WHERE o.depth < 8)
             SELECT chat FROM origin WHERE depth > 0 ORDER BY depth",
        )
        .bind(account)
        .bind(chat_id)
        .fetch_all(&self.reader)
        .await?;
        Ok(rows)
    }

    async fn pairing_get(&self, account: &str, user_id: &str) -> StoreResult<Option<PairingRow>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM pairings WHERE account = ? AND user_id = ?"
        )))
        .bind(account)
        .bind(user_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(pairing_from_row).transpose()
    }

    async fn pairing_issue(
        &self,
        account: &str,
        user_id: &str,
        user_name: Option<&str>,
        code: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<PairingRow> {
        let mut tx = self.begin_write().await?;
        // A pending code that has not expired is kept; anything else (none,
        // expired, revoked) gets the new one.
        sqlx::query(
            "INSERT INTO pairings (account, user_id, user_name, code, state, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, 'pending', ?5, ?6)
             ON CONFLICT (account, user_id) DO UPDATE SET
                code = CASE WHEN pairings.state = 'pending' AND pairings.expires_at > ?5
                            THEN pairings.code ELSE excluded.code END,
                created_at = CASE WHEN pairings.state = 'pending' AND pairings.expires_at > ?5
                            THEN pairings.created_at ELSE excluded.created_at END,
                expires_at = CASE WHEN pairings.state = 'pending' AND pairings.expires_at > ?5
                            THEN pairings.expires_at ELSE excluded.expires_at END,
                user_name = COALESCE(excluded.user_name, pairings.user_name),
                state = CASE WHEN pairings.state = 'approved' THEN 'approved' ELSE 'pending' END,
                decided_at = CASE WHEN pairings.state = 'approved' THEN pairings.decided_at ELSE NULL END",
        )
        .bind(account)
        .bind(user_id)
        .bind(user_name)
        .bind(code)
        .bind(now)
        .bind(expires_at)
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM pairings WHERE account = ? AND user_id = ?"
        )))
        .bind(account)
        .bind(user_id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        pairing_from_row(&row)
    }

    async fn pairing_approve(&self, code: &str, now: i64) -> StoreResult<Option<PairingRow>> {
        let mut tx = self.begin_write().await?;
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE pairings SET state = 'approved', decided_at = ?
             WHERE code = ? AND state = 'pending' AND expires_at > ? RETURNING {COLUMNS}"
        )))
        .bind(now)
        .bind(code.trim().to_ascii_uppercase())
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        row.as_ref().map(pairing_from_row).transpose()
    }

    async fn pairing_admit(&self, account: &str, user_id: &str, now: i64) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO pairings (account, user_id, code, state, created_at, expires_at, decided_at)
             VALUES (?1, ?2, 'admitted-' || ?1 || '-' || ?2, 'approved', ?3, ?3, ?3)
             ON CONFLICT (account, user_id) DO UPDATE SET state = 'approved', decided_at = ?3",
        )
        .bind(account)
        .bind(user_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn pairing_revoke(&self, account: &str, user_id: &str, now: i64) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE pairings SET state = 'revoked', decided_at = ? WHERE account = ? AND user_id = ?",
        )
        .bind(now)
        .bind(account)
        .bind(user_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn pairing_list(
        &self,
        account: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<PairingRow>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM pairings WHERE (?1 IS NULL OR account = ?1)
             ORDER BY created_at DESC LIMIT ?2"
        )))
        .bind(account)
        .bind(limit as i64)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(pairing_from_row).collect()
    }
}
