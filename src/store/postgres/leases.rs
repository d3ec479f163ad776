//! Leases on PostgreSQL: one row per role; taking it over is an atomic
//! upsert that only succeeds when it is free, expired, or already ours.

use async_trait::async_trait;

use super::PgStore;
use crate::store::{LeaseStore, StoreResult};

#[async_trait]
impl LeaseStore for PgStore {
    async fn lease_acquire(
        &self,
        name: &str,
        owner: &str,
        ttl_ms: i64,
        now: i64,
    ) -> StoreResult<Option<i64>> {
        let token: Option<i64> = sqlx::query_scalar(
            "INSERT INTO leases (name, owner, token, expires_at) VALUES ($1, $2, 1, $3 + $4)
             ON CONFLICT (name) DO UPDATE SET
                 token = CASE WHEN leases.owner = excluded.owner THEN leases.token ELSE leases.token + 1 END,
                 owner = excluded.owner,
                 expires_at = excluded.expires_at
             WHERE leases.owner = excluded.owner OR leases.expires_at <= $3
             RETURNING token",
        )
        .bind(name)
        .bind(owner)
        .bind(now)
        .bind(ttl_ms)
        .fetch_optional(&self.pool)
        .await?;
        Ok(token)
    }

    async fn lease_release(&self, name: &str, owner: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM leases WHERE name = $1 AND owner = $2")
            .bind(name)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
