//! RetentionStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl RetentionStore for PgStore {
    async fn prune(&self, _rules: &PruneRules) -> StoreResult<PruneReport> {
        todo!("postgres")
    }

    async fn purge_conversation(
        &self,
        _conversation_id: i64,
        _now: i64,
    ) -> StoreResult<PurgeOutcome> {
        todo!("postgres")
    }
}
