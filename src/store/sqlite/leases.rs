//! Leases on SQLite (one process owns the file, so these always go to it,
//! but the same code paths run as on PostgreSQL).

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::{LeaseStore, StoreResult};

#[async_trait]
impl LeaseStore for SqliteStore {
    async fn lease_acquire(
        &self,
        name: &str,
        owner: &str,
        ttl_ms: i64,
        now: i64,
    ) -> StoreResult<Option<i64>> {
        let mut tx = self.begin_write().await?;
        let token: Option<i64> = sqlx::query_scalar(
            "INSERT INTO leases (name, owner, token, expires_at) VALUES (?1, ?2, 1, ?3 + ?4)
             ON CONFLICT (name) DO UPDATE SET
                 token = CASE WHEN leases.owner = excluded.owner THEN leases.token ELSE leases.token + 1 END,
                 owner = excluded.owner,
                 expires_at = excluded.expires_at
             WHERE leases.owner = excluded.owner OR leases.expires_at <= ?3
             RETURNING token",
        )
        .bind(name)
        .bind(owner)
        .bind(now)
        .bind(ttl_ms)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(token)
    }

    async fn lease_release(&self, name: &str, owner: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM leases WHERE name = ? AND owner = ?")
            .bind(name)
            .bind(owner)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}
