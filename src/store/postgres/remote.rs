//! RemoteStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl RemoteStore for PgStore {
    async fn remote_await(&self, _runs: &[RemoteRun]) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn remote_awaited(
        &self,
        _runtime: &str,
        _after: Option<(i64, String)>,
        _limit: usize,
    ) -> StoreResult<Vec<RemoteRun>> {
        todo!("postgres")
    }

    async fn remote_get(&self, _runtime: &str, _run_id: &str) -> StoreResult<Option<RemoteRun>> {
        todo!("postgres")
    }

    async fn remote_awaited_of(
        &self,
        _runtime: &str,
        _conversation_id: i64,
    ) -> StoreResult<Vec<RemoteRun>> {
        todo!("postgres")
    }

    async fn remote_cursor(&self, _runtime: &str) -> StoreResult<i64> {
        todo!("postgres")
    }

    async fn remote_finish(
        &self,
        _runtime: &str,
        _run_id: &str,
        _event_id: i64,
        _replies: &[NewOutboxItem],
        _now: i64,
    ) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn remote_advance(&self, _runtime: &str, _event_id: i64) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn remote_stop_notice(
        &self,
        _runtime: &str,
        _interrupted: Option<&str>,
        _notice: &NewOutboxItem,
    ) -> StoreResult<()> {
        todo!("postgres")
    }
}
