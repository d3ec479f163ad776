//! RunStore on PostgreSQL.
use super::PgStore;
#[allow(unused_imports)]
use crate::store::*;
#[allow(unused_imports)]
use crate::surface::SurfaceKind;
use async_trait::async_trait;

#[async_trait]
impl RunStore for PgStore {
    async fn runs_admit(&self, _batch: &[Admit]) -> StoreResult<Vec<AdmitOutcome>> {
        todo!("postgres")
    }

    async fn runs_start(&self, _run_ids: &[i64], _now: i64) -> StoreResult<()> {
        todo!("postgres")
    }

    async fn runs_finish(&self, _batch: &[RunFinish]) -> StoreResult<Vec<bool>> {
        todo!("postgres")
    }

    async fn runs_stop(&self, _request: &StopRequest) -> StoreResult<StopOutcome> {
        todo!("postgres")
    }

    async fn runs_unfinished(&self, _after_id: i64, _limit: usize) -> StoreResult<Vec<RunRow>> {
        todo!("postgres")
    }

    async fn runs_unfinished_in(&self, _conversation_id: i64) -> StoreResult<Vec<RunRow>> {
        todo!("postgres")
    }

    async fn run_inputs(&self, _run_id: i64) -> StoreResult<Vec<InputRow>> {
        todo!("postgres")
    }

    async fn runs_history(&self, _conversation_id: i64, _limit: usize) -> StoreResult<Vec<RunRow>> {
        todo!("postgres")
    }

    async fn run_get(&self, _run_id: i64) -> StoreResult<Option<RunRow>> {
        todo!("postgres")
    }

    async fn runs_interrupt(
        &self,
        _run_id: i64,
        _end_as: RunState,
        _reason: &str,
        _now: i64,
    ) -> StoreResult<Option<RunState>> {
        todo!("postgres")
    }

    async fn run_events_after(&self, _after: i64, _limit: usize) -> StoreResult<Vec<RunEventRow>> {
        todo!("postgres")
    }

    async fn run_terminal_event(&self, _run_id: i64) -> StoreResult<Option<i64>> {
        todo!("postgres")
    }

    async fn conversation_for_key(
        &self,
        _account: &str,
        _key: &str,
        _surface: SurfaceKind,
        _now: i64,
    ) -> StoreResult<i64> {
        todo!("postgres")
    }

    async fn conversation_key(&self, _conversation_id: i64) -> StoreResult<Option<String>> {
        todo!("postgres")
    }

    async fn runs_list(
        &self,
        _conversation_id: Option<i64>,
        _state: Option<RunState>,
        _limit: usize,
    ) -> StoreResult<Vec<RunRow>> {
        todo!("postgres")
    }
}
