//! Durable runs of the built-in runtime on PostgreSQL.
//!
//! The same records as the SQLite store. What sharing the database adds:
//! admission and finishing take the conversations' advisory locks (in
//! conversation id order, so two processes cannot deadlock on them) before
//! reading or writing a lane's runs; the run rows a decision depends on are
//! read `FOR UPDATE`, so a concurrent start, stop or finish cannot change
//! them between the read and the write; and keyed inserts (inputs,
//! conversations by key) use `ON CONFLICT`, the loser reporting the
//! winner's row.

use async_trait::async_trait;
use sqlx::{Postgres, Row, Transaction};

use super::outbox::insert_item;
use super::{PgStore, lock_conversations};
use crate::store::rows::{bad_value, run_from_row, thread_from_db, thread_to_db};
use crate::store::{
    Admit, AdmitOutcome, AdmitTarget, InputRow, ItemKind, NewOutboxItem, NewRun, RunEventRow,
    RunFinish, RunMode, RunRow, RunState, RunStore, StopOutcome, StopRequest, StoreError,
    StoreResult,
};
use crate::surface::SurfaceKind;

macro_rules! run_columns {
    () => {
        "id, conversation_id, runtime, account, chat_id, thread_id, surface, reply_to, mode,
         state, priority, end_as, end_notice, prompt, answer, reason, absorbed_by, created_at,
         started_at, finished_at"
    };
}

pub(super) const FIND_INPUT: &str = "SELECT i.run_id, r.state, r.absorbed_by
     FROM run_inputs i JOIN runs r ON r.id = i.run_id WHERE i.idempotency_key = $1";
pub(super) const INSERT_RUN: &str = "INSERT INTO runs (conversation_id, runtime, account, chat_id,
        thread_id, surface, reply_to, mode, state, priority, created_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'queued', $9, $10) RETURNING id";
// A key another process admitted meanwhile is a duplicate: nothing comes
// back, and the caller reads the winner's run.
pub(super) const INSERT_INPUT: &str = "INSERT INTO run_inputs (idempotency_key, run_id,
        conversation_id, inbound_id, input, created_at)
     VALUES ($1, $2, $3, $4, $5, $6)
     ON CONFLICT (idempotency_key) DO NOTHING RETURNING id";
// A run this transaction created for an input that turned out to be a
// duplicate (it has no inputs and no events yet).
const DROP_RUN: &str = "DELETE FROM runs WHERE id = $1";
// A run joined must still be queued when the input joins it: locked, so
// the lane cannot start it meanwhile.
const JOINABLE: &str = concat!(
    "SELECT ",
    run_columns!(),
    " FROM runs WHERE id = $1 FOR UPDATE"
);
// A run the lane is executing may not have its `running` mark committed
// yet, so `queued` is accepted too.
pub(super) const REQUEST_INTERRUPT: &str =
    "UPDATE runs SET state = 'interrupt_requested', end_as = $1,
        end_notice = COALESCE($2, end_notice)
     WHERE id = $3 AND state IN ('queued', 'running')";
pub(super) const START: &str =
    "UPDATE runs SET state = 'running', started_at = $1 WHERE id = $2 AND state = 'queued'";
// The conversations a batch of finishes writes to, locked in this order
// before anything else.
const CONVERSATIONS_OF: &str = "SELECT DISTINCT conversation_id FROM runs WHERE id = ANY($1)
     ORDER BY conversation_id";
pub(super) const FINISH: &str = "UPDATE runs SET state = $1, answer = $2, prompt = $3, reason = $4,
        finished_at = $5
     WHERE id = $6 AND state IN ('queued', 'running', 'interrupt_requested')
     RETURNING conversation_id, account, chat_id, thread_id, surface, reply_to, end_notice";
pub(super) const ABSORB: &str =
    "UPDATE runs SET state = 'absorbed', absorbed_by = $1, finished_at = $2
     WHERE id = $3 AND state = 'queued'";
pub(super) const SETTLE_INPUTS: &str = "UPDATE inbound SET disposition = $1, reason = $2,
        run_id = COALESCE(run_id, $3), settled_at = $4
     WHERE id IN (SELECT inbound_id FROM run_inputs WHERE run_id = $5 AND inbound_id IS NOT NULL)
       AND disposition IN ('pending', 'admitted')";
pub(super) const TERMINAL_EVENT: &str =
    "INSERT INTO run_events (run_id, conversation_id, kind, state,
        payload, created_at)
     VALUES ($1, $2, 'terminal', $3, $4, $5)";
pub(super) const UNFINISHED: &str = concat!(
    "SELECT ",
    run_columns!(),
    " FROM runs WHERE state IN ('queued', 'running', 'interrupt_requested') AND id > $1
      ORDER BY id LIMIT $2"
);
pub(super) const UNFINISHED_IN: &str = concat!(
    "SELECT ",
    run_columns!(),
    " FROM runs WHERE conversation_id = $1 AND state IN ('queued', 'running', 'interrupt_requested')
      ORDER BY id"
);
// Ties in `finished_at` go newest id first, as SQLite's backward scan of
// the index (whose entries end with the rowid) returns them.
pub(super) const HISTORY: &str = concat!(
    "SELECT ",
    run_columns!(),
    " FROM runs WHERE conversation_id = $1 AND state IN ('completed', 'interrupted')
      ORDER BY finished_at DESC, id DESC LIMIT $2"
);
pub(super) const INPUTS: &str = "SELECT id, idempotency_key, run_id, conversation_id, inbound_id,
        input, created_at
     FROM run_inputs WHERE run_id = $1 ORDER BY id";
// Locked: a run that finishes meanwhile drops out (its row is re-checked
// after the lock), so its confirmation is not parked on a finished run.
pub(super) const ACTIVE_OF_CONVERSATION: &str = "SELECT id, state FROM runs
     WHERE conversation_id = $1 AND state IN ('queued', 'running', 'interrupt_requested')
     ORDER BY id FOR UPDATE";
const FIND_KEYED_CONVERSATION: &str = "SELECT id FROM conversations
     WHERE account = $1 AND chat_id = $2 AND thread_id = $3 AND closed_at IS NULL";
const INSERT_KEYED_CONVERSATION: &str = "INSERT INTO conversations (account, chat_id, thread_id,
        chat_kind, surface, created_at)
     VALUES ($1, $2, '', 'private', $3, $4)
     ON CONFLICT (account, chat_id, thread_id) WHERE closed_at IS NULL DO NOTHING
     RETURNING id";

/// A confirmation kept on a run until it ends.
#[derive(serde::Deserialize)]
struct EndNotice {
    item_key: String,
    text: String,
}

async fn insert_run(tx: &mut Transaction<'static, Postgres>, run: &NewRun) -> StoreResult<i64> {
    let priority = i64::from(run.mode == RunMode::Urgent);
    Ok(sqlx::query_scalar(INSERT_RUN)
        .bind(run.conversation_id)
        .bind(&run.runtime)
        .bind(&run.account)
        .bind(&run.chat_id)
        .bind(thread_to_db(&run.thread_id))
        .bind(run.surface.as_str())
        .bind(&run.reply_to)
        .bind(run.mode.as_str())
        .bind(priority)
        .bind(run.created_at)
        .fetch_one(&mut **tx)
        .await?)
}

/// The run that owns an admitted idempotency key, if any.
async fn find_input(
    tx: &mut Transaction<'static, Postgres>,
    idempotency_key: &str,
) -> StoreResult<Option<AdmitOutcome>> {
    let Some(row) = sqlx::query(FIND_INPUT)
        .bind(idempotency_key)
        .fetch_optional(&mut **tx)
        .await?
    else {
        return Ok(None);
    };
    let state: String = row.try_get(1)?;
    Ok(Some(AdmitOutcome {
        run_id: row.try_get(0)?,
        new: false,
        state: RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        absorbed_by: row.try_get(2)?,
    }))
}

/// Give the journal rows of a run's inputs a final disposition (cancelled,
/// absorbed), unless they already have one.
async fn settle_inputs(
    tx: &mut Transaction<'static, Postgres>,
    run_id: i64,
    disposition: &str,
    reason: &str,
    now: i64,
) -> StoreResult<()> {
    sqlx::query(SETTLE_INPUTS)
        .bind(disposition)
        .bind(reason)
        .bind(run_id.to_string())
        .bind(now)
        .bind(run_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[async_trait]
impl RunStore for PgStore {
    async fn runs_admit(&self, batch: &[Admit]) -> StoreResult<Vec<AdmitOutcome>> {
        let mut tx = self.begin().await?;
        // Every lane the batch admits to, before reading any of its runs:
        // another process admitting to the same lane waits, and then sees
        // this batch's runs and keys.
        lock_conversations(&mut tx, batch.iter().map(|a| a.conversation_id)).await?;
        let mut out: Vec<AdmitOutcome> = Vec::with_capacity(batch.len());
        for admit in batch {
            if let Some(found) = find_input(&mut tx, &admit.idempotency_key).await? {
                out.push(found);
                continue;
            }
            let target = match &admit.target {
                AdmitTarget::JoinBatch { index } => match out.get(*index) {
                    Some(earlier) => AdmitTarget::Join {
                        run_id: earlier.run_id,
                    },
                    None => {
                        return Err(StoreError::Other(format!(
                            "admission refers to batch item {index}, which comes later"
                        )));
                    }
                },
                other => other.clone(),
            };
            // Whether the run was created for this input (and is dropped
            // again should the input be a duplicate after all).
            let (run_id, created) = match &target {
                AdmitTarget::NewRun(run) => (insert_run(&mut tx, run).await?, true),
                AdmitTarget::JoinBatch { .. } => unreachable!("resolved above"),
                AdmitTarget::Join { run_id } => {
                    let joinable = sqlx::query(JOINABLE)
                        .bind(run_id)
                        .fetch_optional(&mut *tx)
                        .await?
                        .as_ref()
                        .map(run_from_row)
                        .transpose()?;
                    match joinable {
                        Some(r) if r.state == RunState::Queued && r.mode == RunMode::Ordinary => {
                            (*run_id, false)
                        }
                        // The run started meanwhile: the input gets its own.
                        Some(r) => {
                            let id = insert_run(
                                &mut tx,
                                &NewRun {
                                    conversation_id: r.conversation_id,
                                    runtime: r.runtime,
                                    account: r.account,
                                    chat_id: r.chat_id,
                                    thread_id: r.thread_id,
                                    surface: r.surface,
                                    reply_to: r.reply_to,
                                    mode: RunMode::Ordinary,
                                    created_at: admit.created_at,
                                },
                            )
                            .await?;
                            (id, true)
                        }
                        None => {
                            return Err(StoreError::Other(format!(
                                "cannot join run {run_id}: no such run"
                            )));
                        }
                    }
                }
            };
            let inserted: Option<i64> = sqlx::query_scalar(INSERT_INPUT)
                .bind(&admit.idempotency_key)
                .bind(run_id)
                .bind(admit.conversation_id)
                .bind(admit.inbound_id)
                .bind(&admit.input)
                .bind(admit.created_at)
                .fetch_optional(&mut *tx)
                .await?;
            if inserted.is_none() {
                // Another transaction admitted the key meanwhile (under
                // another conversation's lock): its run owns the input.
                if created {
                    sqlx::query(DROP_RUN).bind(run_id).execute(&mut *tx).await?;
                }
                let found = find_input(&mut tx, &admit.idempotency_key)
                    .await?
                    .ok_or_else(|| {
                        StoreError::Other(format!(
                            "input {:?} conflicted but is not found",
                            admit.idempotency_key
                        ))
                    })?;
                out.push(found);
                continue;
            }
            if let Some((running, end_as)) = admit.interrupt {
                sqlx::query(REQUEST_INTERRUPT)
                    .bind(end_as.as_str())
                    .bind(None::<String>)
                    .bind(running)
                    .execute(&mut *tx)
                    .await?;
            }
            out.push(AdmitOutcome {
                run_id,
                new: true,
                state: RunState::Queued,
                absorbed_by: None,
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn runs_start(&self, run_ids: &[i64], now: i64) -> StoreResult<()> {
        if run_ids.is_empty() {
            return Ok(());
        }
        // Rows are locked in id order, as a stop locks a lane's runs.
        let mut ids = run_ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let mut tx = self.begin().await?;
        for id in ids {
            sqlx::query(START)
                .bind(now)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn runs_finish(&self, batch: &[RunFinish]) -> StoreResult<Vec<bool>> {
        let mut tx = self.begin().await?;
        // The lanes the batch writes reply items to (and whose absorbed
        // runs it settles), locked up front in id order; inserting items
        // takes them again, which an advisory lock allows.
        let touched: Vec<i64> = batch
            .iter()
            .flat_map(|f| std::iter::once(f.run_id).chain(f.absorb.iter().copied()))
            .collect();
        let conversations: Vec<i64> = sqlx::query_scalar(CONVERSATIONS_OF)
            .bind(&touched)
            .fetch_all(&mut *tx)
            .await?;
        lock_conversations(&mut tx, conversations).await?;
        let mut out = Vec::with_capacity(batch.len());
        for finish in batch {
            let routed = sqlx::query(FINISH)
                .bind(finish.state.as_str())
                .bind(&finish.answer)
                .bind(&finish.prompt)
                .bind(&finish.reason)
                .bind(finish.now)
                .bind(finish.run_id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(route) = routed else {
                out.push(false);
                continue;
            };
            let conversation_id: i64 = route.try_get("conversation_id")?;
            let surface: String = route.try_get("surface")?;
            let surface =
                SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?;
            for reply in &finish.replies {
                let item = NewOutboxItem {
                    item_key: reply.item_key.clone(),
                    conversation_id,
                    account: route.try_get("account")?,
                    chat_id: route.try_get("chat_id")?,
                    thread_id: thread_from_db(route.try_get("thread_id")?),
                    surface,
                    reply_to: route.try_get("reply_to")?,
                    run_id: Some(finish.run_id.to_string()),
                    kind: reply.kind,
                    text: reply.text.clone(),
                    group_key: reply.group_key.clone(),
                    edits_key: reply.edits_key.clone(),
                    attachments: reply.attachments.clone(),
                    created_at: finish.now,
                };
                insert_item(&mut tx, &item).await?;
            }
            let end_notice: Option<String> = route.try_get("end_notice")?;
            if let Some(notice) =
                end_notice.and_then(|n| serde_json::from_str::<EndNotice>(&n).ok())
            {
                let item = NewOutboxItem {
                    item_key: notice.item_key,
                    conversation_id,
                    account: route.try_get("account")?,
                    chat_id: route.try_get("chat_id")?,
                    thread_id: thread_from_db(route.try_get("thread_id")?),
                    surface,
                    reply_to: None,
                    run_id: Some(finish.run_id.to_string()),
                    kind: ItemKind::Notice,
                    text: notice.text,
                    group_key: None,
                    edits_key: None,
                    attachments: Vec::new(),
                    created_at: finish.now,
                };
                insert_item(&mut tx, &item).await?;
            }
            if finish.state == RunState::Completed {
                for absorbed in &finish.absorb {
                    let done = sqlx::query(ABSORB)
                        .bind(finish.run_id)
                        .bind(finish.now)
                        .bind(absorbed)
                        .execute(&mut *tx)
                        .await?;
                    if done.rows_affected() == 1 {
                        settle_inputs(
                            &mut tx,
                            *absorbed,
                            "absorbed",
                            &format!("answered by run {}", finish.run_id),
                            finish.now,
                        )
                        .await?;
                        // Every run has its terminal event, an absorbed
                        // one too (naming the run that answered it).
                        sqlx::query(TERMINAL_EVENT)
                            .bind(*absorbed)
                            .bind(conversation_id)
                            .bind("absorbed")
                            .bind(
                                serde_json::json!({"state": "absorbed", "answered_by": finish.run_id})
                                    .to_string(),
                            )
                            .bind(finish.now)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
            }
            if matches!(finish.state, RunState::Cancelled) {
                let reason = finish.reason.as_deref().unwrap_or("cancelled");
                settle_inputs(&mut tx, finish.run_id, "cancelled", reason, finish.now).await?;
            }
            let payload = serde_json::json!({
                "state": finish.state.as_str(),
                "answer": finish.answer,
                "reason": finish.reason,
                "absorbed": finish.absorb,
            });
            sqlx::query(TERMINAL_EVENT)
                .bind(finish.run_id)
                .bind(conversation_id)
                .bind(finish.state.as_str())
                .bind(payload.to_string())
                .bind(finish.now)
                .execute(&mut *tx)
                .await?;
            out.push(true);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn runs_stop(&self, request: &StopRequest) -> StoreResult<StopOutcome> {
        let mut tx = self.begin().await?;
        let mut lanes = vec![request.conversation_id];
        lanes.extend(request.notice.as_ref().map(|n| n.conversation_id));
        lock_conversations(&mut tx, lanes).await?;
        let active = sqlx::query(ACTIVE_OF_CONVERSATION)
            .bind(request.conversation_id)
            .fetch_all(&mut *tx)
            .await?;
        let mut outcome = StopOutcome::default();
        for row in active {
            let id: i64 = row.try_get(0)?;
            let state: String = row.try_get(1)?;
            match RunState::parse(&state) {
                Some(RunState::Queued) => {
                    sqlx::query(
                        "UPDATE runs SET state = 'cancelled', reason = $1, finished_at = $2
                         WHERE id = $3",
                    )
                    .bind(&request.reason)
                    .bind(request.now)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                    settle_inputs(&mut tx, id, "cancelled", &request.reason, request.now).await?;
                    sqlx::query(TERMINAL_EVENT)
                        .bind(id)
                        .bind(request.conversation_id)
                        .bind("cancelled")
                        .bind(
                            serde_json::json!({"state": "cancelled", "reason": request.reason})
                                .to_string(),
                        )
                        .bind(request.now)
                        .execute(&mut *tx)
                        .await?;
                    outcome.cancelled.push(id);
                }
                Some(RunState::Running) | Some(RunState::InterruptRequested) => {
                    // The confirmation is sent after the run's last words,
                    // by whoever ends it (this process, or recovery).
                    let notice = request.notice.as_ref().map(|n| {
                        serde_json::json!({"item_key": n.item_key, "text": n.text}).to_string()
                    });
                    sqlx::query(
                        "UPDATE runs SET state = 'interrupt_requested',
                            end_as = COALESCE(end_as, 'interrupted'), end_notice = $1
                         WHERE id = $2",
                    )
                    .bind(notice)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                    outcome.interrupted = Some(id);
                }
                _ => {}
            }
        }
        if outcome.interrupted.is_none()
            && let Some(notice) = &request.notice
        {
            insert_item(&mut tx, notice).await?;
        }
        tx.commit().await?;
        Ok(outcome)
    }

    async fn runs_unfinished(&self, after_id: i64, limit: usize) -> StoreResult<Vec<RunRow>> {
        let rows = sqlx::query(UNFINISHED)
            .bind(after_id)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn runs_unfinished_in(&self, conversation_id: i64) -> StoreResult<Vec<RunRow>> {
        let rows = sqlx::query(UNFINISHED_IN)
            .bind(conversation_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn run_inputs(&self, run_id: i64) -> StoreResult<Vec<InputRow>> {
        let rows = sqlx::query(INPUTS)
            .bind(run_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(InputRow {
                    id: row.try_get("id")?,
                    idempotency_key: row.try_get("idempotency_key")?,
                    run_id: row.try_get("run_id")?,
                    conversation_id: row.try_get("conversation_id")?,
                    inbound_id: row.try_get("inbound_id")?,
                    input: row.try_get("input")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect()
    }

    async fn runs_history(&self, conversation_id: i64, limit: usize) -> StoreResult<Vec<RunRow>> {
        let rows = sqlx::query(HISTORY)
            .bind(conversation_id)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn runs_list(
        &self,
        conversation_id: Option<i64>,
        state: Option<RunState>,
        limit: usize,
    ) -> StoreResult<Vec<RunRow>> {
        let rows =
            match conversation_id {
                Some(c) => {
                    sqlx::query(concat!(
                        "SELECT ",
                        run_columns!(),
                        " FROM runs WHERE conversation_id = $1 AND ($2::text IS NULL OR state = $2)
                      ORDER BY id DESC LIMIT $3"
                    ))
                    .bind(c)
                    .bind(state.map(|s| s.as_str()))
                    .bind(limit as i64)
                    .fetch_all(&self.pool)
                    .await?
                }
                None => sqlx::query(concat!(
                    "SELECT ",
                    run_columns!(),
                    " FROM runs WHERE ($1::text IS NULL OR state = $1) ORDER BY id DESC LIMIT $2"
                ))
                .bind(state.map(|s| s.as_str()))
                .bind(limit as i64)
                .fetch_all(&self.pool)
                .await?,
            };
        rows.iter().map(run_from_row).collect()
    }

    async fn run_get(&self, run_id: i64) -> StoreResult<Option<RunRow>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM runs WHERE id = $1"
        ))
        .bind(run_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn runs_interrupt(
        &self,
        run_id: i64,
        end_as: RunState,
        reason: &str,
        now: i64,
    ) -> StoreResult<Option<RunState>> {
        let mut tx = self.begin().await?;
        // Locked: the run cannot start, finish or be stopped between this
        // read and the write that depends on it.
        let row = sqlx::query("SELECT state, conversation_id FROM runs WHERE id = $1 FOR UPDATE")
            .bind(run_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let state: String = row.try_get(0)?;
        let conversation_id: i64 = row.try_get(1)?;
        let state = RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?;
        let after = match state {
            RunState::Queued => {
                sqlx::query(
                    "UPDATE runs SET state = 'cancelled', reason = $1, finished_at = $2
                     WHERE id = $3",
                )
                .bind(reason)
                .bind(now)
                .bind(run_id)
                .execute(&mut *tx)
                .await?;
                settle_inputs(&mut tx, run_id, "cancelled", reason, now).await?;
                sqlx::query(TERMINAL_EVENT)
                    .bind(run_id)
                    .bind(conversation_id)
                    .bind("cancelled")
                    .bind(serde_json::json!({"state": "cancelled", "reason": reason}).to_string())
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                RunState::Cancelled
            }
            RunState::Running => {
                sqlx::query(REQUEST_INTERRUPT)
                    .bind(end_as.as_str())
                    .bind(None::<String>)
                    .bind(run_id)
                    .execute(&mut *tx)
                    .await?;
                RunState::InterruptRequested
            }
            other => other,
        };
        tx.commit().await?;
        Ok(Some(after))
    }

    async fn run_events_after(&self, after: i64, limit: usize) -> StoreResult<Vec<RunEventRow>> {
        let rows = sqlx::query(
            "SELECT id, run_id, conversation_id, state, payload, created_at FROM run_events
             WHERE id > $1 ORDER BY id LIMIT $2",
        )
        .bind(after)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let state: String = row.try_get("state")?;
                Ok(RunEventRow {
                    id: row.try_get("id")?,
                    run_id: row.try_get("run_id")?,
                    conversation_id: row.try_get("conversation_id")?,
                    state: RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
                    payload: row.try_get("payload")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect()
    }

    async fn run_terminal_event(&self, run_id: i64) -> StoreResult<Option<i64>> {
        Ok(sqlx::query_scalar(
            "SELECT id FROM run_events WHERE run_id = $1 ORDER BY id DESC LIMIT 1",
        )
        .bind(run_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn conversation_for_key(
        &self,
        account: &str,
        key: &str,
        surface: SurfaceKind,
        now: i64,
    ) -> StoreResult<i64> {
        // Find, else create; a process that creates it meanwhile wins the
        // unique key and this one finds its row on the next round (each
        // statement sees what committed before it began). Only a
        // conversation closed again between two rounds needs a third.
        for _ in 0..3 {
            let found: Option<i64> = sqlx::query_scalar(FIND_KEYED_CONVERSATION)
                .bind(account)
                .bind(key)
                .bind("")
                .fetch_optional(&self.pool)
                .await?;
            if let Some(id) = found {
                return Ok(id);
            }
            let created: Option<i64> = sqlx::query_scalar(INSERT_KEYED_CONVERSATION)
                .bind(account)
                .bind(key)
                .bind(surface.as_str())
                .bind(now)
                .fetch_optional(&self.pool)
                .await?;
            if let Some(id) = created {
                return Ok(id);
            }
        }
        Err(StoreError::Other(format!(
            "conversation {account}/{key} is created and closed faster than it can be found"
        )))
    }

    async fn conversation_key(&self, conversation_id: i64) -> StoreResult<Option<String>> {
        Ok(
            sqlx::query_scalar("SELECT chat_id FROM conversations WHERE id = $1")
                .bind(conversation_id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }
}
