//! Schedules and occurrences on PostgreSQL.
//!
//! As on SQLite, with what several processes need: advancing a schedule is
//! fenced by its due slot (the row lock makes a second process's plan for
//! the same slot wait, then find the slot moved and change nothing), an
//! occurrence is unique per (schedule, slot), and claims lock pending
//! occurrences with `FOR UPDATE SKIP LOCKED`, re-checked under the lock, so
//! two schedulers never claim the same occurrence; every write after a claim
//! is fenced by its token.

use async_trait::async_trait;
use sqlx::Row;

use super::PgStore;
use super::outbox::insert_item;
use crate::store::rows::{occurrence_from_row, schedule_from_row, thread_to_db};
use crate::store::sqlite::occurrence_key;
use crate::store::{
    Fire, Materialize, NewSchedule, OccurrenceRow, OccurrenceState, ScheduleFilter, ScheduleRow,
    ScheduleState, ScheduleStore, StoreResult, Target,
};

macro_rules! schedule_columns {
    () => {
        "id, kind, spec, cron, timezone, action, text, account, chat_id, thread_id, chat_kind,
         surface, state, next_due_at, missed_policy, max_attempts, fired, failed, skipped,
         created_by, created_at, updated_at"
    };
}

macro_rules! occurrence_columns {
    () => {
        "id, schedule_id, slot_at, occurrence_key, state, attempts, next_attempt_at, lease_owner,
         lease_expires_at, fencing_token, reason, run_id, fired_at, created_at"
    };
}

pub(super) const DUE: &str = concat!(
    "SELECT ",
    schedule_columns!(),
    " FROM schedules WHERE state = 'active' AND next_due_at <= $1 ORDER BY next_due_at LIMIT $2"
);
pub(super) const ADVANCE: &str = "UPDATE schedules SET next_due_at = $1, skipped = skipped + $2,
        state = CASE WHEN $3 THEN 'completed' ELSE state END, updated_at = $4
     WHERE id = $5 AND next_due_at = $6 AND state = 'active'";
// No conflict target: the key is made of (schedule, slot), so either unique
// constraint means "recorded before", and neither may fail the batch.
pub(super) const INSERT_OCCURRENCE: &str =
    "INSERT INTO occurrences (schedule_id, slot_at, occurrence_key,
        state, next_attempt_at, reason, created_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7)
     ON CONFLICT DO NOTHING";
// Due occurrences, locked without waiting for ones another process is
// claiming or settling; the update re-checks each under its lock.
pub(super) const CLAIM: &str = concat!(
    "WITH candidates (claim_id) AS MATERIALIZED (
         SELECT id FROM occurrences WHERE state = 'pending' AND next_attempt_at <= $3
         ORDER BY next_attempt_at LIMIT $4
         FOR UPDATE SKIP LOCKED)
     UPDATE occurrences SET state = 'claimed', lease_owner = $1, lease_expires_at = $2,
        fencing_token = fencing_token + 1
     FROM candidates
     WHERE id = candidates.claim_id AND state = 'pending' AND next_attempt_at <= $3
     RETURNING ",
    occurrence_columns!()
);
pub(super) const FIRED: &str = "UPDATE occurrences SET state = 'fired', run_id = $1, fired_at = $2,
        attempts = attempts + 1, reason = NULL, lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'claimed' RETURNING schedule_id";
pub(super) const RETRY: &str =
    "UPDATE occurrences SET state = 'pending', next_attempt_at = $1, reason = $2,
        attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'claimed' RETURNING schedule_id";
pub(super) const DEFER: &str =
    "UPDATE occurrences SET state = 'pending', next_attempt_at = $1, reason = $2,
        lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'claimed' RETURNING schedule_id";
pub(super) const FAILED: &str =
    "UPDATE occurrences SET state = 'failed', reason = $1, fired_at = $2,
        attempts = attempts + 1, lease_owner = NULL, lease_expires_at = NULL
     WHERE id = $3 AND fencing_token = $4 AND state = 'claimed' RETURNING schedule_id";
pub(super) const RELEASE_EXPIRED: &str = "UPDATE occurrences SET state = 'pending',
        fencing_token = fencing_token + 1, lease_owner = NULL, lease_expires_at = NULL
     WHERE state = 'claimed' AND lease_expires_at <= $1";
// The open conversation of a chat.
const FIND_CONVERSATION: &str = "SELECT id FROM conversations
     WHERE account = $1 AND chat_id = $2 AND thread_id = $3 AND closed_at IS NULL";
// A new open conversation; nothing when another process made one first.
const INSERT_CONVERSATION: &str =
    "INSERT INTO conversations (account, chat_id, thread_id, chat_kind, surface, created_at)
     VALUES ($1, $2, $3, $4, $5, $6)
     ON CONFLICT (account, chat_id, thread_id) WHERE closed_at IS NULL DO NOTHING
     RETURNING id";

#[async_trait]
impl ScheduleStore for PgStore {
    async fn schedule_create(&self, s: &NewSchedule) -> StoreResult<i64> {
        let mut tx = self.begin().await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO schedules (kind, spec, cron, timezone, action, text, account, chat_id,
                thread_id, chat_kind, surface, state, next_due_at, missed_policy, max_attempts,
                created_by, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'active', $12, $13, $14, $15,
                $16, $17) RETURNING id",
        )
        .bind(s.kind.as_str())
        .bind(&s.spec)
        .bind(&s.cron)
        .bind(&s.timezone)
        .bind(s.action.as_str())
        .bind(&s.text)
        .bind(&s.target.account)
        .bind(&s.target.chat_id)
        .bind(thread_to_db(&s.target.thread_id))
        .bind(s.target.chat_kind.as_str())
        .bind(s.target.surface.as_str())
        .bind(s.first_due_at)
        .bind(s.missed.as_str())
        .bind(s.max_attempts)
        .bind(&s.created_by)
        .bind(s.created_at)
        .bind(s.created_at)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id)
    }

    async fn schedule_get(&self, id: i64) -> StoreResult<Option<ScheduleRow>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            schedule_columns!(),
            " FROM schedules WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(schedule_from_row).transpose()
    }

    async fn schedule_list(&self, f: &ScheduleFilter) -> StoreResult<Vec<ScheduleRow>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            schedule_columns!(),
            " FROM schedules WHERE ($1::TEXT IS NULL OR account = $1)
              AND ($2::TEXT IS NULL OR chat_id = $2)
              AND ($3::TEXT IS NULL OR state = $3) ORDER BY id DESC LIMIT $4"
        ))
        .bind(&f.account)
        .bind(&f.chat_id)
        .bind(f.state.map(|s| s.as_str()))
        .bind(f.limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(schedule_from_row).collect()
    }

    async fn schedule_transition(
        &self,
        id: i64,
        from: &[ScheduleState],
        to: ScheduleState,
        now: i64,
    ) -> StoreResult<bool> {
        let allowed: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let mut tx = self.begin().await?;
        let done = sqlx::query(
            "UPDATE schedules SET state = $1, updated_at = $2
             WHERE id = $3 AND state = ANY($4)",
        )
        .bind(to.as_str())
        .bind(now)
        .bind(id)
        .bind(&allowed)
        .execute(&mut *tx)
        .await?;
        // Pending occurrences of a cancelled schedule do not fire.
        if done.rows_affected() == 1 && to == ScheduleState::Cancelled {
            sqlx::query(
                "UPDATE occurrences SET state = 'skipped', reason = 'the schedule was cancelled'
                 WHERE schedule_id = $1 AND state = 'pending'",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn schedules_due(&self, now: i64, limit: usize) -> StoreResult<Vec<ScheduleRow>> {
        let rows = sqlx::query(DUE)
            .bind(now)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(schedule_from_row).collect()
    }

    async fn schedules_materialize(&self, plans: &[Materialize]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin().await?;
        let mut out = Vec::with_capacity(plans.len());
        for p in plans {
            let skipped = p
                .slots
                .iter()
                .filter(|s| s.state == OccurrenceState::Skipped)
                .count() as i64
                + p.skipped_uncounted;
            // Fenced by the due slot the plan was made from: a plan of
            // another process for the same slot waits for this row, then
            // finds it advanced and changes nothing.
            let advanced = sqlx::query(ADVANCE)
                .bind(p.next_due_at)
                .bind(skipped)
                .bind(p.complete)
                .bind(p.now)
                .bind(p.schedule_id)
                .bind(p.from_due)
                .execute(&mut *tx)
                .await?
                .rows_affected()
                == 1;
            if advanced {
                for slot in &p.slots {
                    sqlx::query(INSERT_OCCURRENCE)
                        .bind(p.schedule_id)
                        .bind(slot.slot_at)
                        .bind(occurrence_key(p.schedule_id, slot.slot_at))
                        .bind(slot.state.as_str())
                        .bind(p.now)
                        .bind(&slot.reason)
                        .bind(p.now)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            out.push(advanced);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn occurrences_claim(
        &self,
        owner: &str,
        now: i64,
        lease_until: i64,
        limit: usize,
    ) -> StoreResult<Vec<(OccurrenceRow, ScheduleRow)>> {
        let mut tx = self.begin().await?;
        let rows = sqlx::query(CLAIM)
            .bind(owner)
            .bind(lease_until)
            .bind(now)
            .bind(limit as i64)
            .fetch_all(&mut *tx)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let occurrence = occurrence_from_row(row)?;
            let schedule = sqlx::query(concat!(
                "SELECT ",
                schedule_columns!(),
                " FROM schedules WHERE id = $1"
            ))
            .bind(occurrence.schedule_id)
            .fetch_one(&mut *tx)
            .await?;
            out.push((occurrence, schedule_from_row(&schedule)?));
        }
        tx.commit().await?;
        out.sort_by_key(|(o, _)| (o.next_attempt_at, o.id));
        Ok(out)
    }

    async fn occurrence_settle(
        &self,
        id: i64,
        token: i64,
        fire: &Fire,
        now: i64,
    ) -> StoreResult<bool> {
        let mut tx = self.begin().await?;
        let schedule: Option<i64> = match fire {
            Fire::Fired { run_id, item } => {
                let schedule: Option<i64> = sqlx::query_scalar(FIRED)
                    .bind(run_id)
                    .bind(now)
                    .bind(id)
                    .bind(token)
                    .fetch_optional(&mut *tx)
                    .await?;
                if let (Some(_), Some(item)) = (schedule, item) {
                    insert_item(&mut tx, item).await?;
                }
                if let Some(schedule_id) = schedule {
                    sqlx::query(
                        "UPDATE schedules SET fired = fired + 1, updated_at = $1,
                            state = CASE WHEN kind IN ('at', 'after') AND state IN ('active', 'paused')
                                    THEN 'completed' ELSE state END
                         WHERE id = $2",
                    )
                    .bind(now)
                    .bind(schedule_id)
                    .execute(&mut *tx)
                    .await?;
                }
                schedule
            }
            Fire::Retry {
                next_attempt_at,
                reason,
            } => {
                sqlx::query_scalar(RETRY)
                    .bind(next_attempt_at)
                    .bind(reason)
                    .bind(id)
                    .bind(token)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            Fire::Defer {
                next_attempt_at,
                reason,
            } => {
                sqlx::query_scalar(DEFER)
                    .bind(next_attempt_at)
                    .bind(reason)
                    .bind(id)
                    .bind(token)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            Fire::Failed { reason } => {
                let schedule: Option<i64> = sqlx::query_scalar(FAILED)
                    .bind(reason)
                    .bind(now)
                    .bind(id)
                    .bind(token)
                    .fetch_optional(&mut *tx)
                    .await?;
                if let Some(schedule_id) = schedule {
                    // A one-off has nothing left: it failed. A recurring one
                    // goes on to its next slot.
                    sqlx::query(
                        "UPDATE schedules SET failed = failed + 1, updated_at = $1,
                            state = CASE WHEN kind IN ('at', 'after') AND state IN ('active', 'paused')
                                    THEN 'failed' ELSE state END
                         WHERE id = $2",
                    )
                    .bind(now)
                    .bind(schedule_id)
                    .execute(&mut *tx)
                    .await?;
                }
                schedule
            }
        };
        tx.commit().await?;
        Ok(schedule.is_some())
    }

    async fn occurrences_release_expired(&self, now: i64) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let done = sqlx::query(RELEASE_EXPIRED)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn occurrences_expire_all_leases(&self, now: i64) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let done =
            sqlx::query("UPDATE occurrences SET lease_expires_at = $1 WHERE state = 'claimed'")
                .bind(now)
                .execute(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn occurrences_list(
        &self,
        schedule_id: i64,
        limit: usize,
    ) -> StoreResult<Vec<OccurrenceRow>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            occurrence_columns!(),
            " FROM occurrences WHERE schedule_id = $1 ORDER BY slot_at DESC LIMIT $2"
        ))
        .bind(schedule_id)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(occurrence_from_row).collect()
    }

    async fn chat_timezone(&self, account: &str, chat_id: &str) -> StoreResult<Option<String>> {
        Ok(sqlx::query_scalar(
            "SELECT timezone FROM chat_settings WHERE account = $1 AND chat_id = $2",
        )
        .bind(account)
        .bind(chat_id)
        .fetch_optional(&self.pool)
        .await?
        .flatten())
    }

    async fn set_chat_timezone(
        &self,
        account: &str,
        chat_id: &str,
        zone: &str,
        now: i64,
    ) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO chat_settings (account, chat_id, timezone, updated_at)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (account, chat_id) DO UPDATE SET timezone = excluded.timezone,
                updated_at = excluded.updated_at",
        )
        .bind(account)
        .bind(chat_id)
        .bind(zone)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn conversation_current(&self, target: &Target, now: i64) -> StoreResult<i64> {
        let mut tx = self.begin().await?;
        let thread = thread_to_db(&target.thread_id);
        let find = || {
            sqlx::query_scalar::<_, i64>(FIND_CONVERSATION)
                .bind(&target.account)
                .bind(&target.chat_id)
                .bind(thread)
        };
        let existing: Option<i64> = find().fetch_optional(&mut *tx).await?;
        let id = match existing {
            Some(id) => id,
            None => {
                let created: Option<i64> = sqlx::query_scalar(INSERT_CONVERSATION)
                    .bind(&target.account)
                    .bind(&target.chat_id)
                    .bind(thread)
                    .bind(target.chat_kind.as_str())
                    .bind(target.surface.as_str())
                    .bind(now)
                    .fetch_optional(&mut *tx)
                    .await?;
                match created {
                    Some(id) => id,
                    // Another process opened it meanwhile: that one.
                    None => find().fetch_one(&mut *tx).await?,
                }
            }
        };
        tx.commit().await?;
        Ok(id)
    }

    async fn channel_account_register(
        &self,
        name: &str,
        identity: &str,
        platform: &str,
        now: i64,
    ) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO channel_accounts (name, identity, platform, updated_at)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (name) DO UPDATE SET identity = excluded.identity,
                platform = excluded.platform, updated_at = excluded.updated_at",
        )
        .bind(name)
        .bind(identity)
        .bind(platform)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn channel_account(&self, name: &str) -> StoreResult<Option<(String, String)>> {
        let row = sqlx::query("SELECT identity, platform FROM channel_accounts WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).transpose()
    }
}
