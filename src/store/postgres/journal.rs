//! JournalStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl JournalStore for PgStore {
    async fn journal_insert(&self, _batch: &[NewInbound]) -> StoreResult<Vec<JournalOutcome>> {
        todo!("postgres")
    }

    async fn journal_pending(&self, _limit: usize) -> StoreResult<Vec<InboundRow>> {
        todo!("postgres")
    }

    async fn journal_pending_for(
        &self,
        _owner: &str,
        _now: i64,
        _limit: usize,
    ) -> StoreResult<Vec<InboundRow>> {
        todo!("postgres")
    }

    async fn journal_admit(&self, _admissions: &[Admitted], _now: i64) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn journal_settle(
        &self,
        _inbound_id: i64,
        _disposition: Disposition,
        _reason: &str,
        _notice: Option<&NewOutboxItem>,
        _now: i64,
    ) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn journal_get(&self, _inbound_id: i64) -> StoreResult<Option<InboundRow>> {
        todo!("postgres")
    }

    async fn journal_list(
        &self,
        _disposition: Option<Disposition>,
        _limit: usize,
    ) -> StoreResult<Vec<InboundRow>> {
        todo!("postgres")
    }

    async fn journal_counts(&self) -> StoreResult<Vec<(Disposition, i64)>> {
        todo!("postgres")
    }

    async fn journal_recent_chats(
        &self,
        _account: &str,
        _since: i64,
        _limit: usize,
    ) -> StoreResult<Vec<RecentChat>> {
        todo!("postgres")
    }
}
