//! AccessStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl AccessStore for PgStore {
    async fn pairing_get(&self, _account: &str, _user_id: &str) -> StoreResult<Option<PairingRow>> {
        todo!("postgres")
    }

    async fn pairing_issue(
        &self,
        _account: &str,
        _user_id: &str,
        _user_name: Option<&str>,
        _code: &str,
        _now: i64,
        _expires_at: i64,
    ) -> StoreResult<PairingRow> {
        todo!("postgres")
    }

    async fn pairing_approve(&self, _code: &str, _now: i64) -> StoreResult<Option<PairingRow>> {
        todo!("postgres")
    }

    async fn pairing_admit(&self, _account: &str, _user_id: &str, _now: i64) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn pairing_revoke(&self, _account: &str, _user_id: &str, _now: i64) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn chat_origins(&self, _account: &str, _chat_id: &str) -> StoreResult<Vec<String>> {
        todo!("postgres")
    }

    async fn pairing_list(
        &self,
        _account: Option<&str>,
        _limit: usize,
    ) -> StoreResult<Vec<PairingRow>> {
        todo!("postgres")
    }
}
