//! The scheduler's chat commands, in the core command router so every
//! channel has them:
//!
//! ```text
//! /remind in 10m <text>
//! /remind at 2026-12-24 18:00 <text>          (in the chat's time zone)
//! /remind at 2026-12-24T18:00:00+01:00 <text>
//! /remind every "0 9 * * MON-FRI" <text>      (in the chat's time zone)
//! /schedules
//! /cancel <id>
//! /timezone Europe/Berlin        /timezone   (shows it)
//! ```
//!
//! Until a chat has a zone, relative reminders work and local times ask for
//! one. A reminder is a `message` schedule: its text is delivered to the
//! chat through the outbox.

use super::spec::{self, SpecError, parse_zone};
use super::{CreateError, CreateRequest, When, create, zone_of};
use crate::config::Config;
use crate::store::{
    InboundRow, ScheduleAction, ScheduleFilter, ScheduleKind, ScheduleState, SharedStore,
    StoreError, Target,
};

const USAGE: &str = "Usage: /remind in 10m <text> | /remind at 2026-12-24 18:00 <text> | /remind every \"0 9 * * MON-FRI\" <text>";

/// The chat an inbound row came from, as a schedule target.
pub fn target_of(row: &InboundRow) -> Target {
    Target {
        account: row.account.clone(),
        chat_id: row.chat_id.clone(),
        thread_id: row.thread_id.clone(),
        chat_kind: row.chat_kind,
        surface: row.surface,
    }
}

/// Split `/remind` arguments into when and what.
pub fn parse_remind(args: &str) -> Result<(When, String), SpecError> {
    let args = args.trim();
    let (word, rest) = args.split_once(char::is_whitespace).unwrap_or((args, ""));
    let rest = rest.trim_start();
    let take = |s: &str| -> (String, String) {
        let (first, tail) = s.split_once(char::is_whitespace).unwrap_or((s, ""));
        (first.to_owned(), tail.trim_start().to_owned())
    };
    match word.to_ascii_lowercase().as_str() {
        "in" => {
            let (duration, text) = take(rest);
            if duration.is_empty() {
                return Err(SpecError(format!("say when: {USAGE}")));
            }
            Ok((When::After(duration), text))
        }
        "at" => {
            let (first, tail) = take(rest);
            if spec::parse_at(&first, None).is_ok() || first.contains('T') {
                return Ok((When::At(first), tail));
            }
            // A date and a time, two words.
            let (time, text) = take(&tail);
            Ok((When::At(format!("{first} {time}")), text))
        }
        "every" => {
            if let Some(quoted) = rest.strip_prefix('"') {
                let (pattern, text) = quoted.split_once('"').ok_or_else(|| {
                    SpecError(format!(
                        "the cron expression's closing quote is missing; {USAGE}"
                    ))
                })?;
                Ok((
                    When::Every(pattern.to_owned()),
                    text.trim_start().to_owned(),
                ))
            } else {
                let (pattern, text) = take(rest);
                Ok((When::Every(pattern), text))
            }
        }
        _ => Err(SpecError(USAGE.into())),
    }
}

/// `/remind ...`: the reply to send.
pub async fn remind(
    store: &SharedStore,
    config: &Config,
    now: i64,
    row: &InboundRow,
    args: &str,
) -> Result<String, StoreError> {
    let zone = store.chat_timezone(&row.account, &row.chat_id).await?;
    let (when, text) = match parse_remind(args) {
        Ok(parsed) => parsed,
        Err(e) => return Ok(format!("Could not set the reminder: {e}")),
    };
    let request = CreateRequest {
        target: target_of(row),
        when,
        timezone: zone,
        action: ScheduleAction::Message,
        text,
        missed: None,
        max_attempts: None,
        created_by: format!("chat:{}", row.id),
    };
    match create(store, config, now, &request).await {
        Ok(s) => Ok(format!(
            "Reminder {} set for {}{}.",
            s.id,
            spec::show(s.next_due_at.unwrap_or(now), zone_of(&s)),
            if s.kind == ScheduleKind::Every {
                format!(", repeating \"{}\"", s.spec)
            } else {
                String::new()
            }
        )),
        Err(CreateError::Spec(e)) => Ok(format!("Could not set the reminder: {e}")),
        Err(CreateError::Store(e)) => Err(e),
    }
}

/// `/schedules`: this chat's active and paused schedules.
pub async fn list(store: &SharedStore, row: &InboundRow) -> Result<String, StoreError> {
    let schedules = store
        .schedule_list(&ScheduleFilter {
            account: Some(row.account.clone()),
            chat_id: Some(row.chat_id.clone()),
            state: None,
            limit: 50,
        })
        .await?;
    let live: Vec<String> = schedules
        .iter()
        .filter(|s| matches!(s.state, ScheduleState::Active | ScheduleState::Paused))
        .map(|s| {
            let next = s
                .next_due_at
                .map_or("-".to_owned(), |t| spec::show(t, zone_of(s)));
            format!(
                "{}: {} {} — next {}{} — {}",
                s.id,
                s.kind,
                s.spec,
                next,
                if s.state == ScheduleState::Paused {
                    " (paused)"
                } else {
                    ""
                },
                s.text
            )
        })
        .collect();
    Ok(if live.is_empty() {
        "No schedules in this chat.".to_owned()
    } else {
        format!("Schedules in this chat:\n{}", live.join("\n"))
    })
}

/// `/cancel <id>`: only a schedule of this chat.
pub async fn cancel(
    store: &SharedStore,
    now: i64,
    row: &InboundRow,
    args: &str,
) -> Result<String, StoreError> {
    let Ok(id) = args.trim().trim_start_matches('#').parse::<i64>() else {
        return Ok("Usage: /cancel <id> (see /schedules)".to_owned());
    };
    let ours = store
        .schedule_get(id)
        .await?
        .is_some_and(|s| s.target.account == row.account && s.target.chat_id == row.chat_id);
    if !ours {
        return Ok(format!("There is no schedule {id} in this chat."));
    }
    Ok(
        if store
            .schedule_transition(
                id,
                &[ScheduleState::Active, ScheduleState::Paused],
                ScheduleState::Cancelled,
                now,
            )
            .await?
        {
            format!("Schedule {id} cancelled.")
        } else {
            format!("Schedule {id} had already ended.")
        },
    )
}

/// `/timezone [zone]`.
pub async fn timezone(
    store: &SharedStore,
    now: i64,
    row: &InboundRow,
    args: &str,
) -> Result<String, StoreError> {
    let args = args.trim();
    if args.is_empty() {
        return Ok(
            match store.chat_timezone(&row.account, &row.chat_id).await? {
                Some(z) => format!("This chat's time zone is {z}."),
                None => "This chat has no time zone yet; set one with /timezone Europe/Berlin"
                    .to_owned(),
            },
        );
    }
    match parse_zone(args) {
        Ok(zone) => {
            store
                .set_chat_timezone(&row.account, &row.chat_id, zone.name(), now)
                .await?;
            Ok(format!("Time zone set to {}.", zone.name()))
        }
        Err(e) => Ok(format!("Could not set the time zone: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remind_arguments_are_split_into_when_and_what() {
        assert_eq!(
            parse_remind("in 10m hello there").unwrap(),
            (When::After("10m".into()), "hello there".into())
        );
        assert_eq!(
            parse_remind("at 2026-12-24 18:00 presents").unwrap(),
            (When::At("2026-12-24 18:00".into()), "presents".into())
        );
        assert_eq!(
            parse_remind("at 2026-12-24T18:00:00+01:00 presents").unwrap(),
            (
                When::At("2026-12-24T18:00:00+01:00".into()),
                "presents".into()
            )
        );
        assert_eq!(
            parse_remind("every \"0 9 * * MON-FRI\" stand-up").unwrap(),
            (When::Every("0 9 * * MON-FRI".into()), "stand-up".into())
        );
        assert_eq!(
            parse_remind("every @daily water the plants").unwrap().0,
            When::Every("@daily".into())
        );
        assert!(
            parse_remind("tomorrow call mum")
                .unwrap_err()
                .0
                .contains("Usage")
        );
        assert!(
            parse_remind("every \"0 9 * * text")
                .unwrap_err()
                .0
                .contains("closing quote")
        );
    }
}
