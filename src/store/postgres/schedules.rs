//! ScheduleStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl ScheduleStore for PgStore {
    async fn schedule_create(&self, _schedule: &NewSchedule) -> StoreResult<i64> {
        todo!("postgres")
    }

    async fn schedule_get(&self, _id: i64) -> StoreResult<Option<ScheduleRow>> {
        todo!("postgres")
    }

    async fn schedule_list(&self, _filter: &ScheduleFilter) -> StoreResult<Vec<ScheduleRow>> {
        todo!("postgres")
    }

    async fn schedule_transition(
        &self,
        _id: i64,
        _from: &[ScheduleState],
        _to: ScheduleState,
        _now: i64,
    ) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn schedules_due(&self, _now: i64, _limit: usize) -> StoreResult<Vec<ScheduleRow>> {
        todo!("postgres")
    }

    async fn schedules_materialize(&self, _plans: &[Materialize]) -> StoreResult<Vec<bool>> {
        todo!("postgres")
    }

    async fn occurrences_claim(
        &self,
        _owner: &str,
        _now: i64,
        _lease_until: i64,
        _limit: usize,
    ) -> StoreResult<Vec<(OccurrenceRow, ScheduleRow)>> {
        todo!("postgres")
    }

    async fn occurrence_settle(
        &self,
        _id: i64,
        _token: i64,
        _fire: &Fire,
        _now: i64,
    ) -> StoreResult<bool> {
        todo!("postgres")
    }

    async fn occurrences_release_expired(&self, _now: i64) -> StoreResult<u64> {
        todo!("postgres")
    }

    async fn occurrences_expire_all_leases(&self, _now: i64) -> StoreResult<u64> {
        todo!("postgres")
    }

    async fn occurrences_list(
        &self,
        _schedule_id: i64,
        _limit: usize,
    ) -> StoreResult<Vec<OccurrenceRow>> {
        todo!("postgres")
    }

    async fn chat_timezone(&self, _account: &str, _chat_id: &str) -> StoreResult<Option<String>> {
        todo!("postgres")
    }

    async fn set_chat_timezone(
        &self,
        _account: &str,
        _chat_id: &str,
        _zone: &str,
        _now: i64,
    ) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn conversation_current(&self, _target: &Target, _now: i64) -> StoreResult<i64> {
        todo!("postgres")
    }

    async fn channel_account_register(
        &self,
        _name: &str,
        _identity: &str,
        _platform: &str,
        _now: i64,
    ) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn channel_account(&self, _name: &str) -> StoreResult<Option<(String, String)>> {
        todo!("postgres")
    }
}
