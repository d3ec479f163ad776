//! Schedules for operators and programs: the CLI (`switchboard schedule
//! ...`) and the admin API (`/v1/schedules`, so a remote agent runtime can
//! give its agents reminder tools) share these.

use serde::{Deserialize, Serialize};
use switchboard_channel::{ChatKind, Platform};

use super::spec;
use super::{CreateError, CreateRequest, When, create, zone_of};
use crate::config::Config;
use crate::store::{
    MissedPolicy, OccurrenceRow, ScheduleAction, ScheduleRow, ScheduleState, SharedStore,
    StoreError, Target,
};
use crate::surface::SurfaceKind;

/// A schedule to add, as the CLI and the API take it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddSchedule {
    /// The channel account's configured name.
    pub account: String,
    pub chat_id: String,
    #[serde(default)]
    pub thread_id: Option<String>,
    /// `private` (default) or `group`.
    #[serde(default)]
    pub chat_kind: Option<String>,
    /// Exactly one of `at`, `after`, `every`.
    #[serde(default)]
    pub at: Option<String>,
    #[serde(default)]
    pub after: Option<String>,
    #[serde(default)]
    pub every: Option<String>,
    /// IANA zone: required for `every` and for local `at` times.
    #[serde(default)]
    pub timezone: Option<String>,
    /// Exactly one of `message` (deliver this text) and `prompt` (submit it
    /// to the runtime).
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    /// `skip`, `fire-once` or `fire-all`.
    #[serde(default)]
    pub missed: Option<String>,
    #[serde(default)]
    pub max_attempts: Option<i64>,
}

/// A schedule and its recent occurrences, for `show`.
#[derive(Debug, Serialize)]
pub struct ScheduleDetail {
    pub schedule: ScheduleRow,
    pub occurrences: Vec<OccurrenceRow>,
}

/// Why an operation on schedules did not happen.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// The request is wrong; the message says how.
    #[error("{0}")]
    Invalid(String),
    #[error("no schedule {0}")]
    NotFound(i64),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<CreateError> for OpError {
    fn from(e: CreateError) -> Self {
        match e {
            CreateError::Spec(e) => OpError::Invalid(e.0),
            CreateError::Store(e) => OpError::Store(e),
        }
    }
}

/// Add a schedule.
pub async fn add(
    store: &SharedStore,
    config: &Config,
    now: i64,
    add: &AddSchedule,
    created_by: &str,
) -> Result<ScheduleRow, OpError> {
    let (identity, platform) = store.channel_account(&add.account).await?.ok_or_else(|| {
        OpError::Invalid(format!(
            "no channel account named {:?} has run on this store; use a name from [channels.NAME] of a daemon that has started",
            add.account
        ))
    })?;
    let platform = match platform.as_str() {
        "telegram" => Platform::Telegram,
        "discord" => Platform::Discord,
        _ => Platform::Webhook,
    };
    let chat_kind = match add.chat_kind.as_deref() {
        None => ChatKind::Private,
        Some(k) => ChatKind::parse(k)
            .ok_or_else(|| OpError::Invalid(format!("chat_kind {k:?} is not private or group")))?,
    };
    let when = match (&add.at, &add.after, &add.every) {
        (Some(at), None, None) => When::At(at.clone()),
        (None, Some(after), None) => When::After(after.clone()),
        (None, None, Some(every)) => When::Every(every.clone()),
        _ => {
            return Err(OpError::Invalid(
                "give exactly one of at, after, every".into(),
            ));
        }
    };
    let (action, text) = match (&add.message, &add.prompt) {
        (Some(m), None) => (ScheduleAction::Message, m.clone()),
        (None, Some(p)) => (ScheduleAction::Prompt, p.clone()),
        _ => {
            return Err(OpError::Invalid(
                "give exactly one of message, prompt".into(),
            ));
        }
    };
    let missed = add
        .missed
        .as_deref()
        .map(|m| {
            MissedPolicy::parse(m).ok_or_else(|| {
                OpError::Invalid(format!(
                    "missed policy {m:?} is not skip, fire-once or fire-all"
                ))
            })
        })
        .transpose()?;
    let request = CreateRequest {
        target: Target {
            account: identity,
            chat_id: add.chat_id.clone(),
            thread_id: add.thread_id.clone().filter(|t| !t.is_empty()),
            chat_kind,
            surface: SurfaceKind::of(platform, chat_kind),
        },
        when,
        timezone: add.timezone.clone(),
        action,
        text,
        missed,
        max_attempts: add.max_attempts,
        created_by: created_by.to_owned(),
    };
    Ok(create(store, config, now, &request).await?)
}

/// A schedule and its recent occurrences.
pub async fn show(store: &SharedStore, id: i64) -> Result<ScheduleDetail, OpError> {
    let schedule = store.schedule_get(id).await?.ok_or(OpError::NotFound(id))?;
    let occurrences = store.occurrences_list(id, 20).await?;
    Ok(ScheduleDetail {
        schedule,
        occurrences,
    })
}

/// Pause, resume or cancel.
pub async fn transition(
    store: &SharedStore,
    now: i64,
    id: i64,
    verb: &str,
) -> Result<ScheduleRow, OpError> {
    let (from, to): (&[ScheduleState], ScheduleState) = match verb {
        "pause" => (&[ScheduleState::Active], ScheduleState::Paused),
        "resume" => (&[ScheduleState::Paused], ScheduleState::Active),
        "cancel" => (
            &[ScheduleState::Active, ScheduleState::Paused],
            ScheduleState::Cancelled,
        ),
        other => {
            return Err(OpError::Invalid(format!(
                "{other:?} is not pause, resume or cancel"
            )));
        }
    };
    let current = store.schedule_get(id).await?.ok_or(OpError::NotFound(id))?;
    if !store.schedule_transition(id, from, to, now).await? {
        return Err(OpError::Invalid(format!(
            "schedule {id} is {}; {verb} applies to {} schedules",
            current.state,
            from.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" or ")
        )));
    }
    store.schedule_get(id).await?.ok_or(OpError::NotFound(id))
}

/// One line per schedule, for people.
pub fn describe(s: &ScheduleRow) -> String {
    let next = s
        .next_due_at
        .map_or("-".to_owned(), |t| spec::show(t, zone_of(s)));
    format!(
        "{:>5}  {:<9}  {:<6}  {:<7}  next {:<24}  fired {} failed {} skipped {}  {} {} in chat {}: {}",
        s.id,
        s.state,
        s.kind,
        s.action,
        next,
        s.fired,
        s.failed,
        s.skipped,
        s.spec,
        s.timezone.as_deref().unwrap_or(""),
        s.target.chat_id,
        crate::cli::cell(&s.text, 40)
    )
}
