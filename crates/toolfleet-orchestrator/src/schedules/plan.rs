//! What a schedule does at a tick, decided from its record and the clock
//! alone (no I/O): wait, fire a due time, or move past missed ones.

use toolfleet_protocol::schedule::{MissedPolicy, Schedule};

use super::timing::{Timing, TimingError};

/// How late a due time may be fired and still count as on time: past it,
/// the due time was missed (the fleet was down, or the schedule paused),
/// and the schedule's [`MissedPolicy`] decides.
pub const ON_TIME_GRACE_SECS: i64 = 30;

/// What a schedule does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Nothing: paused, or not due yet.
    Wait,
    /// Submit the run of `due` (unless the schedule is busy), then wait
    /// for `next_due`.
    Fire {
        /// The due time the run is for (its invocation id names it).
        due: i64,
        /// The schedule's next due time.
        next_due: i64,
        /// Whether the run makes up for missed due times.
        catch_up: bool,
    },
    /// Submit nothing: the due times up to now were missed and are
    /// skipped; wait for `next_due`.
    SkipMissed {
        /// The schedule's next due time (after now).
        next_due: i64,
    },
}

/// What `schedule` does at `now` (unix seconds).
///
/// On time (at most [`ON_TIME_GRACE_SECS`] late), one run is fired, for
/// the latest due time passed (several pass together only when a look
/// came late, e.g. a second-by-second schedule after a stall: they are
/// one run, so the schedule never falls behind), and the next due time is
/// the first after now. Late, `skip` moves to the first due time after
/// now, and `catch_up_one` fires one run, for the latest missed due time,
/// then does the same.
pub fn plan(schedule: &Schedule, timing: &Timing, now: i64) -> Result<Plan, TimingError> {
    if schedule.paused || now < schedule.next_due {
        return Ok(Plan::Wait);
    }
    let next_due = timing.next_after(now)?;
    let latest = timing
        .latest_at_or_before(now)
        .unwrap_or(schedule.next_due)
        .max(schedule.next_due);
    if now - schedule.next_due <= ON_TIME_GRACE_SECS {
        return Ok(Plan::Fire {
            due: latest,
            next_due,
            catch_up: false,
        });
    }
    Ok(match schedule.missed {
        MissedPolicy::Skip => Plan::SkipMissed { next_due },
        MissedPolicy::CatchUpOne => Plan::Fire {
            due: latest,
            next_due,
            catch_up: true,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(next_due: i64, missed: MissedPolicy) -> Schedule {
        Schedule {
            tenant: "acme".into(),
            id: "s".into(),
            cron: "0 * * * * *".into(),
            tz: "UTC".into(),
            job: serde_json::from_value(serde_json::json!({
                "invocationId": "t",
                "messages": [{"role": "user", "content": "hi"}]
            }))
            .unwrap(),
            missed,
            max_concurrent: 1,
            budget: None,
            paused: false,
            next_due,
            runs: Vec::new(),
            created_ms: 0,
        }
    }

    #[test]
    fn an_on_time_due_fires_once_and_moves_to_the_next() {
        let timing = Timing::parse("0 * * * * *", "UTC").unwrap();
        let s = schedule(600, MissedPolicy::Skip);
        assert_eq!(plan(&s, &timing, 599).unwrap(), Plan::Wait);
        assert_eq!(
            plan(&s, &timing, 601).unwrap(),
            Plan::Fire {
                due: 600,
                next_due: 660,
                catch_up: false
            }
        );
        // A late look (three due times of a five-second schedule passed):
        // one run, for the latest, and the schedule is not behind after.
        let quick = Timing::parse("*/5 * * * * *", "UTC").unwrap();
        assert_eq!(
            plan(&schedule(600, MissedPolicy::Skip), &quick, 611).unwrap(),
            Plan::Fire {
                due: 610,
                next_due: 615,
                catch_up: false
            }
        );
        let mut paused = s.clone();
        paused.paused = true;
        assert_eq!(plan(&paused, &timing, 601).unwrap(), Plan::Wait);
    }

    #[test]
    fn missed_dues_are_skipped_or_caught_up_once() {
        let timing = Timing::parse("0 * * * * *", "UTC").unwrap();
        // Down from 600 to 3630: 51 due times missed.
        let skip = schedule(600, MissedPolicy::Skip);
        assert_eq!(
            plan(&skip, &timing, 3630).unwrap(),
            Plan::SkipMissed { next_due: 3660 }
        );
        let catch_up = schedule(600, MissedPolicy::CatchUpOne);
        assert_eq!(
            plan(&catch_up, &timing, 3630).unwrap(),
            Plan::Fire {
                due: 3600,
                next_due: 3660,
                catch_up: true
            }
        );
    }
}
