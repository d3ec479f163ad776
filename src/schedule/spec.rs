//! When a schedule fires: parsing specs and computing slots, with explicit
//! time zones and defined DST behaviour.
//!
//! - `at`: an instant, RFC 3339 with an offset (`2026-12-24T18:00:00+01:00`),
//!   or a local time (`2026-12-24 18:00`) in an IANA zone.
//! - `after`: a duration from now (`10m`, `2h30m`, `1d`), stored as the
//!   instant it ends.
//! - `every`: a cron expression (5 fields, or 6 with seconds) in a required
//!   IANA zone, never the host's.
//!
//! DST: a local time that does not exist (spring forward) fires at the
//! first valid instant after the gap; a local time that occurs twice (fall
//! back) fires once, at the first. For cron this is croner's documented
//! behaviour for fixed times; interval patterns (`*/15 * * * *`) follow the
//! wall clock (none in the gap, each repeated match in the overlap).

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, LocalResult, NaiveDateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};

/// A parse or validation problem, in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

fn err(message: impl Into<String>) -> SpecError {
    SpecError(message.into())
}

/// An IANA time zone, parsed once.
pub fn parse_zone(name: &str) -> Result<Tz, SpecError> {
    Tz::from_str(name.trim()).map_err(|_| {
        err(format!(
            "unknown time zone {name:?}; use an IANA name such as Europe/Berlin, America/New_York or UTC"
        ))
    })
}

/// A cron expression, parsed once (5 fields, or 6 with seconds first).
pub fn parse_cron(pattern: &str) -> Result<Cron, SpecError> {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(pattern.trim())
        .map_err(|e| err(format!("invalid cron expression {pattern:?}: {e}; e.g. \"0 9 * * MON-FRI\" is 09:00 on weekdays")))
}

/// A duration such as `10m`, `2h30m`, `90s`, `1d`.
pub fn parse_duration(text: &str) -> Result<Duration, SpecError> {
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        err(format!(
            "invalid duration {text:?} ({e}); use e.g. 30s, 10m, 2h30m, 1d"
        ))
    })?;
    if d.is_zero() {
        return Err(err("a duration of zero is not a reminder; use e.g. 10m"));
    }
    Ok(d)
}

/// Resolve a local time in a zone: a time in a DST gap moves to the first
/// valid instant after the gap; a time that occurs twice is its first.
pub fn resolve_local(local: NaiveDateTime, zone: Tz) -> DateTime<Tz> {
    match zone.from_local_datetime(&local) {
        LocalResult::Single(t) => t,
        LocalResult::Ambiguous(first, _) => first,
        LocalResult::None => {
            // Step to the end of the gap (gaps are whole minutes in every
            // zone in use, and at most a few hours).
            let mut probe = local;
            for _ in 0..(24 * 60) {
                probe += chrono::Duration::minutes(1);
                match zone.from_local_datetime(&probe) {
                    LocalResult::Single(t) => return t,
                    LocalResult::Ambiguous(first, _) => return first,
                    LocalResult::None => {}
                }
            }
            zone.from_utc_datetime(&local)
        }
    }
}

/// Parse an `at` spec: RFC 3339 with an offset, or a local date and time
/// (`2026-12-24 18:00`, `2026-12-24T18:00`, seconds optional) in `zone`.
pub fn parse_at(text: &str, zone: Option<Tz>) -> Result<DateTime<Utc>, SpecError> {
    let text = text.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let local = ["%Y-%m-%d %H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(text, f).ok())
        .ok_or_else(|| {
            err(format!(
                "cannot read the time {text:?}; write \"2026-12-24 18:00\" (in your time zone) or \"2026-12-24T18:00:00+01:00\""
            ))
        })?;
    let zone = zone.ok_or_else(|| {
        err(format!(
            "{text:?} is a local time, but no time zone is set; set one (e.g. /timezone Europe/Berlin) or give an offset"
        ))
    })?;
    Ok(resolve_local(local, zone).with_timezone(&Utc))
}

/// The first slot of a cron schedule strictly after `after`.
pub fn next_cron_slot(
    cron: &Cron,
    zone: Tz,
    after: DateTime<Utc>,
) -> Result<DateTime<Utc>, SpecError> {
    let local = after.with_timezone(&zone);
    cron.find_next_occurrence(&local, false)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| err(format!("the cron expression has no next time: {e}")))
}

/// Milliseconds since the epoch.
pub fn to_ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

pub fn from_ms(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

/// Show an instant in a zone, for users.
pub fn show(ms: i64, zone: Option<Tz>) -> String {
    let t = from_ms(ms);
    match zone {
        Some(z) => t.with_timezone(&z).format("%Y-%m-%d %H:%M %Z").to_string(),
        None => t.format("%Y-%m-%d %H:%M UTC").to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn slots(pattern: &str, zone: &str, from: &str, n: usize) -> Vec<String> {
        let cron = parse_cron(pattern).unwrap();
        let zone = parse_zone(zone).unwrap();
        let mut t = utc(from);
        let mut out = Vec::new();
        for _ in 0..n {
            t = next_cron_slot(&cron, zone, t).unwrap();
            out.push(t.to_rfc3339());
        }
        out
    }

    #[test]
    fn berlin_spring_forward_moves_a_missing_time_to_the_end_of_the_gap() {
        // 2026-03-29: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist.
        assert_eq!(
            slots("30 2 * * *", "Europe/Berlin", "2026-03-27T12:00:00Z", 3),
            [
                "2026-03-28T01:30:00+00:00",
                "2026-03-29T01:00:00+00:00",
                "2026-03-30T00:30:00+00:00"
            ],
            "02:30 CET, then 03:00 CEST (the first valid instant), then 02:30 CEST"
        );
        let at = parse_at(
            "2026-03-29 02:30",
            Some(parse_zone("Europe/Berlin").unwrap()),
        )
        .unwrap();
        assert_eq!(at.to_rfc3339(), "2026-03-29T01:00:00+00:00");
    }

    #[test]
    fn berlin_fall_back_fires_a_repeated_time_once_at_the_first() {
        // 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 occurs twice.
        assert_eq!(
            slots("30 2 * * *", "Europe/Berlin", "2026-10-24T12:00:00Z", 3),
            [
                "2026-10-25T00:30:00+00:00",
                "2026-10-26T01:30:00+00:00",
                "2026-10-27T01:30:00+00:00"
            ],
            "02:30 CEST only (not again at 02:30 CET)"
        );
        let at = parse_at(
            "2026-10-25 02:30",
            Some(parse_zone("Europe/Berlin").unwrap()),
        )
        .unwrap();
        assert_eq!(at.to_rfc3339(), "2026-10-25T00:30:00+00:00");
    }

    #[test]
    fn new_york_follows_its_own_rules() {
        // 2026-03-08: 02:00 EST jumps to 03:00 EDT.
        assert_eq!(
            slots("15 2 * * *", "America/New_York", "2026-03-07T00:00:00Z", 2),
            ["2026-03-07T07:15:00+00:00", "2026-03-08T07:00:00+00:00"],
            "02:15 EST, then 03:00 EDT"
        );
        // 2026-11-01: 02:00 EDT falls back to 01:00 EST; 01:30 occurs twice.
        assert_eq!(
            slots("30 1 * * *", "America/New_York", "2026-10-31T12:00:00Z", 2),
            ["2026-11-01T05:30:00+00:00", "2026-11-02T06:30:00+00:00"],
            "01:30 EDT once, then 01:30 EST the next day"
        );
        // A weekday pattern keeps local 09:00 across the change.
        assert_eq!(
            slots(
                "0 9 * * MON-FRI",
                "America/New_York",
                "2026-03-06T15:00:00Z",
                2
            ),
            ["2026-03-09T13:00:00+00:00", "2026-03-10T13:00:00+00:00"]
        );
    }

    #[test]
    fn zones_are_explicit_and_bad_specs_say_what_is_wrong() {
        assert!(parse_zone("Mars/Olympus").unwrap_err().0.contains("IANA"));
        assert!(
            parse_cron("61 * * * *")
                .unwrap_err()
                .0
                .contains("invalid cron")
        );
        assert!(
            parse_duration("ten minutes")
                .unwrap_err()
                .0
                .contains("e.g. 30s")
        );
        assert_eq!(parse_duration("2h30m").unwrap(), Duration::from_secs(9000));
        assert!(
            parse_at("2026-12-24 18:00", None)
                .unwrap_err()
                .0
                .contains("no time zone")
        );
        assert_eq!(
            parse_at("2026-12-24T18:00:00+01:00", None)
                .unwrap()
                .to_rfc3339(),
            "2026-12-24T17:00:00+00:00"
        );
        assert!(
            parse_at("tomorrow", None)
                .unwrap_err()
                .0
                .contains("cannot read")
        );
    }
}
