//! Reading rows into the store's types, once for both backends.
//!
//! The SQLite and PostgreSQL schemas name and type their columns alike, so
//! a row decodes the same way from either; [`Columns`] is the one thing the
//! decoders need from a row (a typed column by name).

use sqlx::postgres::{PgRow, Postgres};
use sqlx::sqlite::{Sqlite, SqliteRow};
use sqlx::{Decode, Row, Type};
use switchboard_channel::{AttachmentRef, ChatKind};

use super::*;
use crate::surface::{InputPolicy, SurfaceKind};

/// A row of either backend: a typed column by name.
pub(super) trait Columns {
    fn get<T>(&self, column: &str) -> Result<T, sqlx::Error>
    where
        T: for<'r> Decode<'r, Sqlite>
            + Type<Sqlite>
            + for<'r> Decode<'r, Postgres>
            + Type<Postgres>;
}

impl Columns for SqliteRow {
    fn get<T>(&self, column: &str) -> Result<T, sqlx::Error>
    where
        T: for<'r> Decode<'r, Sqlite>
            + Type<Sqlite>
            + for<'r> Decode<'r, Postgres>
            + Type<Postgres>,
    {
        self.try_get(column)
    }
}

impl Columns for PgRow {
    fn get<T>(&self, column: &str) -> Result<T, sqlx::Error>
    where
        T: for<'r> Decode<'r, Sqlite>
            + Type<Sqlite>
            + for<'r> Decode<'r, Postgres>
            + Type<Postgres>,
    {
        self.try_get(column)
    }
}

/// `''` in the database is "no thread" (so it can take part in unique keys).
pub(super) fn thread_to_db(thread: &Option<String>) -> &str {
    thread.as_deref().unwrap_or("")
}

pub(super) fn thread_from_db(thread: String) -> Option<String> {
    (!thread.is_empty()).then_some(thread)
}

pub(super) fn bad_value(column: &str, value: &str) -> StoreError {
    StoreError::Other(format!("unexpected value {value:?} in column {column}"))
}

pub(super) fn pairing_from_row(row: &impl Columns) -> StoreResult<PairingRow> {
    let state: String = row.get("state")?;
    Ok(PairingRow {
        account: row.get("account")?,
        user_id: row.get("user_id")?,
        user_name: row.get("user_name")?,
        code: row.get("code")?,
        state: PairingState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        created_at: row.get("created_at")?,
        expires_at: row.get("expires_at")?,
        decided_at: row.get("decided_at")?,
    })
}

pub(super) fn inbound_from_row(row: &impl Columns) -> StoreResult<InboundRow> {
    let chat_kind: String = row.get("chat_kind")?;
    let surface: String = row.get("surface")?;
    let disposition: String = row.get("disposition")?;
    let policy: Option<String> = row.get("input_policy")?;
    Ok(InboundRow {
        id: row.get("id")?,
        account: row.get("account")?,
        update_key: row.get("update_key")?,
        conversation_id: row.get("conversation_id")?,
        chat_id: row.get("chat_id")?,
        chat_kind: ChatKind::parse(&chat_kind).ok_or_else(|| bad_value("chat_kind", &chat_kind))?,
        thread_id: thread_from_db(row.get("thread_id")?),
        space: row.get("space")?,
        surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        sender_id: row.get("sender_id")?,
        sender_name: row.get("sender_name")?,
        message_id: row.get("message_id")?,
        payload: row.get("payload")?,
        disposition: Disposition::parse(&disposition)
            .ok_or_else(|| bad_value("disposition", &disposition))?,
        reason: row.get("reason")?,
        submission_key: row.get("submission_key")?,
        input_policy: policy
            .map(|p| InputPolicy::parse(&p).ok_or_else(|| bad_value("input_policy", &p)))
            .transpose()?,
        addressed: row.get("addressed")?,
        run_id: row.get("run_id")?,
        received_at: row.get("received_at")?,
        settled_at: row.get("settled_at")?,
    })
}

pub(super) fn attachments_to_db(attachments: &[AttachmentRef]) -> StoreResult<Option<String>> {
    if attachments.is_empty() {
        return Ok(None);
    }
    serde_json::to_string(attachments)
        .map(Some)
        .map_err(|e| bad_value("attachments", &e.to_string()))
}

pub(super) fn attachments_from_db(stored: Option<String>) -> StoreResult<Vec<AttachmentRef>> {
    match stored {
        None => Ok(Vec::new()),
        Some(json) => serde_json::from_str(&json).map_err(|_| bad_value("attachments", &json)),
    }
}

pub(super) fn item_from_row(row: &impl Columns) -> StoreResult<OutboxItem> {
    let surface: String = row.get("surface")?;
    let kind: String = row.get("kind")?;
    let state: String = row.get("state")?;
    Ok(OutboxItem {
        id: row.get("id")?,
        item_key: row.get("item_key")?,
        conversation_id: row.get("conversation_id")?,
        ordinal: row.get("ordinal")?,
        account: row.get("account")?,
        chat_id: row.get("chat_id")?,
        thread_id: thread_from_db(row.get("thread_id")?),
        surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        reply_to: row.get("reply_to")?,
        run_id: row.get("run_id")?,
        kind: ItemKind::parse(&kind).ok_or_else(|| bad_value("kind", &kind))?,
        text: row.get("text")?,
        group_key: row.get("group_key")?,
        edits_key: row.get("edits_key")?,
        attachments: attachments_from_db(row.get("attachments")?)?,
        state: DispatchState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        attempts: row.get("attempts")?,
        resends: row.get("resends")?,
        next_attempt_at: row.get("next_attempt_at")?,
        lease_owner: row.get("lease_owner")?,
        lease_expires_at: row.get("lease_expires_at")?,
        fencing_token: row.get("fencing_token")?,
        dispatched_at: row.get("dispatched_at")?,
        receipt: row.get("receipt")?,
        reason: row.get("reason")?,
        created_at: row.get("created_at")?,
        settled_at: row.get("settled_at")?,
    })
}

pub(super) fn remote_from_row(row: &impl Columns) -> StoreResult<RemoteRun> {
    let surface: String = row.get("surface")?;
    let state: String = row.get("state")?;
    Ok(RemoteRun {
        runtime: row.get("runtime")?,
        run_id: row.get("run_id")?,
        conversation_id: row.get("conversation_id")?,
        account: row.get("account")?,
        chat_id: row.get("chat_id")?,
        thread_id: thread_from_db(row.get("thread_id")?),
        surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        reply_to: row.get("reply_to")?,
        end_notice: row.get("end_notice")?,
        awaited: state == "awaited",
        event_id: row.get("event_id")?,
        created_at: row.get("created_at")?,
    })
}

pub(super) fn run_from_row(row: &impl Columns) -> StoreResult<RunRow> {
    let surface: String = row.get("surface")?;
    let state: String = row.get("state")?;
    let mode: String = row.get("mode")?;
    let end_as: Option<String> = row.get("end_as")?;
    Ok(RunRow {
        id: row.get("id")?,
        conversation_id: row.get("conversation_id")?,
        runtime: row.get("runtime")?,
        account: row.get("account")?,
        chat_id: row.get("chat_id")?,
        thread_id: thread_from_db(row.get("thread_id")?),
        surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        reply_to: row.get("reply_to")?,
        mode: RunMode::parse(&mode).ok_or_else(|| bad_value("mode", &mode))?,
        state: RunState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        priority: row.get("priority")?,
        end_as: end_as
            .map(|e| RunState::parse(&e).ok_or_else(|| bad_value("end_as", &e)))
            .transpose()?,
        end_notice: row.get("end_notice")?,
        prompt: row.get("prompt")?,
        answer: row.get("answer")?,
        reason: row.get("reason")?,
        absorbed_by: row.get("absorbed_by")?,
        created_at: row.get("created_at")?,
        started_at: row.get("started_at")?,
        finished_at: row.get("finished_at")?,
    })
}

pub(super) fn schedule_from_row(row: &impl Columns) -> StoreResult<ScheduleRow> {
    let parse = |col: &str| -> StoreResult<String> { Ok(row.get::<String>(col)?) };
    let kind = parse("kind")?;
    let action = parse("action")?;
    let state = parse("state")?;
    let missed = parse("missed_policy")?;
    let chat_kind = parse("chat_kind")?;
    let surface = parse("surface")?;
    Ok(ScheduleRow {
        id: row.get("id")?,
        kind: ScheduleKind::parse(&kind).ok_or_else(|| bad_value("kind", &kind))?,
        spec: row.get("spec")?,
        cron: row.get("cron")?,
        timezone: row.get("timezone")?,
        action: ScheduleAction::parse(&action).ok_or_else(|| bad_value("action", &action))?,
        text: row.get("text")?,
        target: Target {
            account: row.get("account")?,
            chat_id: row.get("chat_id")?,
            thread_id: thread_from_db(row.get("thread_id")?),
            chat_kind: ChatKind::parse(&chat_kind)
                .ok_or_else(|| bad_value("chat_kind", &chat_kind))?,
            surface: SurfaceKind::parse(&surface).ok_or_else(|| bad_value("surface", &surface))?,
        },
        state: ScheduleState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        next_due_at: row.get("next_due_at")?,
        missed: MissedPolicy::parse(&missed).ok_or_else(|| bad_value("missed_policy", &missed))?,
        max_attempts: row.get("max_attempts")?,
        fired: row.get("fired")?,
        failed: row.get("failed")?,
        skipped: row.get("skipped")?,
        created_by: row.get("created_by")?,
        created_at: row.get("created_at")?,
        updated_at: row.get("updated_at")?,
    })
}

pub(super) fn occurrence_from_row(row: &impl Columns) -> StoreResult<OccurrenceRow> {
    let state: String = row.get("state")?;
    Ok(OccurrenceRow {
        id: row.get("id")?,
        schedule_id: row.get("schedule_id")?,
        slot_at: row.get("slot_at")?,
        key: row.get("occurrence_key")?,
        state: OccurrenceState::parse(&state).ok_or_else(|| bad_value("state", &state))?,
        attempts: row.get("attempts")?,
        next_attempt_at: row.get("next_attempt_at")?,
        lease_owner: row.get("lease_owner")?,
        lease_expires_at: row.get("lease_expires_at")?,
        fencing_token: row.get("fencing_token")?,
        reason: row.get("reason")?,
        run_id: row.get("run_id")?,
        fired_at: row.get("fired_at")?,
        created_at: row.get("created_at")?,
    })
}
