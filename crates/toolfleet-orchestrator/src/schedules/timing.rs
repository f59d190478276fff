//! When a schedule is due: its cron expression read in its IANA time zone
//! (croner, POSIX/Vixie semantics, 5 fields or 6 with seconds first;
//! chrono-tz, whose database is compiled in, so a host without
//! `/usr/share/zoneinfo` reads the same zones).

use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;

/// A cron expression or time zone that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// The cron expression does not parse.
    #[error(
        "cron expression {expression:?}: {reason} (5 fields: minute hour day-of-month month day-of-week, or 6 with seconds first, e.g. \"0 9 * * 1-5\")"
    )]
    Cron {
        /// The expression as given.
        expression: String,
        /// What the parser said.
        reason: String,
    },
    /// The time zone is not an IANA name.
    #[error("time zone {0:?} is not an IANA time zone name (e.g. \"Europe/Paris\", \"UTC\")")]
    Zone(String),
    /// The expression never matches again (e.g. 30 February).
    #[error("cron expression {0:?} has no due time after now")]
    Never(String),
}

/// A schedule's timing: its cron expression in its time zone.
#[derive(Debug, Clone)]
pub struct Timing {
    cron: Cron,
    tz: Tz,
    expression: String,
}

impl Timing {
    /// Parses `cron` and `tz`, with errors that say what is wrong.
    pub fn parse(cron: &str, tz: &str) -> Result<Self, TimingError> {
        let tz = Tz::from_str(tz.trim()).map_err(|_| TimingError::Zone(tz.to_string()))?;
        // croner reads an optional 7th field, a year; the fleet keeps to 5
        // or 6 fields (what its docs and the CLI describe).
        if cron.split_whitespace().count() > 6 {
            return Err(TimingError::Cron {
                expression: cron.to_string(),
                reason: "a 7th field (a year) is not supported".into(),
            });
        }
        let parsed = Cron::from_str(cron).map_err(|e| TimingError::Cron {
            expression: cron.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            cron: parsed,
            tz,
            expression: cron.to_string(),
        })
    }

    /// The first due time strictly after `after` (unix seconds).
    pub fn next_after(&self, after: i64) -> Result<i64, TimingError> {
        let at = self.at(after)?;
        self.cron
            .find_next_occurrence(&at, false)
            .map(|t| t.timestamp())
            .map_err(|_| TimingError::Never(self.expression.clone()))
    }

    /// The latest due time at or before `at` (unix seconds), if any.
    pub fn latest_at_or_before(&self, at: i64) -> Option<i64> {
        let at = self.at(at).ok()?;
        self.cron
            .find_previous_occurrence(&at, true)
            .ok()
            .map(|t| t.timestamp())
    }

    /// `secs` in the schedule's time zone.
    fn at(&self, secs: i64) -> Result<DateTime<Tz>, TimingError> {
        DateTime::<Utc>::from_timestamp(secs, 0)
            .map(|t| self.tz.from_utc_datetime(&t.naive_utc()))
            .ok_or_else(|| TimingError::Never(self.expression.clone()))
    }
}

/// `secs` (unix seconds) as an RFC 3339 UTC time, for people.
pub fn utc(secs: i64) -> String {
    DateTime::<Utc>::from_timestamp(secs, 0).map_or_else(
        || secs.to_string(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(rfc3339: &str) -> i64 {
        DateTime::parse_from_rfc3339(rfc3339).unwrap().timestamp()
    }

    #[test]
    fn weekdays_at_nine_in_paris_follow_the_zone_and_its_summer_time() {
        let t = Timing::parse("0 9 * * 1-5", "Europe/Paris").unwrap();
        // Friday 2026-01-09 10:00 Paris (09:00 UTC): next is Monday 09:00
        // Paris, 08:00 UTC in winter.
        assert_eq!(
            t.next_after(secs("2026-01-09T09:00:00Z")).unwrap(),
            secs("2026-01-12T08:00:00Z")
        );
        // In summer 09:00 Paris is 07:00 UTC.
        assert_eq!(
            t.next_after(secs("2026-07-06T06:00:00Z")).unwrap(),
            secs("2026-07-06T07:00:00Z")
        );
        assert_eq!(
            t.latest_at_or_before(secs("2026-01-12T08:00:00Z")),
            Some(secs("2026-01-12T08:00:00Z"))
        );
    }

    #[test]
    fn six_fields_have_seconds() {
        let t = Timing::parse("*/5 * * * * *", "UTC").unwrap();
        assert_eq!(t.next_after(10).unwrap(), 15);
        assert_eq!(t.next_after(11).unwrap(), 15);
    }

    #[test]
    fn bad_expressions_and_zones_are_refused_with_what_is_wrong() {
        let e = Timing::parse("61 * * * *", "UTC").unwrap_err();
        assert!(matches!(e, TimingError::Cron { .. }), "{e}");
        assert!(e.to_string().contains("61 * * * *"), "{e}");
        assert!(Timing::parse("every day", "UTC").is_err());
        let year = Timing::parse("0 0 9 * * * 2027", "UTC").unwrap_err();
        assert!(year.to_string().contains("year"), "{year}");
        assert!(Timing::parse("@daily", "UTC").is_ok());
        let e = Timing::parse("0 9 * * *", "Mars/Olympus").unwrap_err();
        assert_eq!(e, TimingError::Zone("Mars/Olympus".into()));
        assert!(e.to_string().contains("IANA"), "{e}");
    }
}
