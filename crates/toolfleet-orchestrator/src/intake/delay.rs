//! A chat job's `notBefore`: a job that asks to start later is not run
//! yet. Its delivery is given back with a delay until then (a nak with
//! that delay: the job waits in the chat stream, holding no permit and no
//! slot, and comes back once, at its time), after its claim is taken (so
//! its id is its own from submission on) and its lease let go.
//!
//! **How far ahead.** The chat stream deletes a job a day after its
//! submission (`CHAT_MAX_AGE`), taken or not, with no event: a job must
//! run, and have room for a redelivery, within that day. So a `notBefore`
//! more than `--max-not-before-secs` (at most, and by default, 23 h:
//! [`MAX_NOT_BEFORE_CEILING`](crate::settings::MAX_NOT_BEFORE_CEILING))
//! less the job's own timeout after its submission is refused at once
//! with `malformed_job`, as is one that is not RFC 3339.
//!
//! **How many.** A waiting job stays pending on its chat consumer (a nak
//! with a delay is not an ack), and a consumer takes at most its
//! `max_ack_pending` (10 000) unacknowledged jobs: past that it delivers
//! nothing. So a tenant may have at most `--max-delayed-jobs` (1000 by
//! default) jobs waiting at once, counted in the store
//! (`CitationStore::hold_delayed`); more are refused with `queue_full`.
//! With fair dispatch each tenant has consumers of its own; with FIFO
//! dispatch one consumer is shared by every tenant, so the tenants'
//! waiting jobs together must stay below it (keep the cap times the
//! tenants under 10 000, or use fair dispatch).
//!
//! **Clock skew.** A redelivered job (the delayed nak's delivery) that
//! comes back up to [`SKEW_TOLERANCE`] early by this host's clock runs
//! now rather than being naked again (which would spend a delivery).
//!
//! One nak for the whole wait, not one per ack wait: every delivery
//! counts towards the consumer's `max_deliver`, so a job naked again and
//! again would be dropped by the server before it ran. The wait spends one
//! delivery, so a delayed job has two run attempts (not three) should the
//! orchestrators running it die.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::DateTime;
use toolfleet_protocol::{ChatJob, ProtocolError};
use toolfleet_store::InvocationKey;
use tracing::{info, warn};

use super::claim::Delivery;
use super::reject::{self, Refusal, Refused};
use crate::Fleet;

pub use crate::settings::DEFAULT_MAX_NOT_BEFORE;

/// A wait shorter than this is not worth a redelivery: the job runs now.
const RUN_NOW_WITHIN: Duration = Duration::from_millis(250);

/// How early by this host's clock a redelivered job may come back and
/// still run now (the server's timer and this clock may differ a little).
pub(crate) const SKEW_TOLERANCE: Duration = Duration::from_secs(5);

/// When a job may run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Start {
    /// Now (no `notBefore`, or it has passed).
    Now,
    /// After this wait.
    Later(Duration),
    /// Never: the time cannot be read, or is too far ahead (why).
    Refused(String),
}

/// What a delivery's `notBefore` is judged by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Judged {
    /// Now (unix ms).
    pub(crate) now_ms: u64,
    /// When the job was submitted (unix ms; `now_ms` when unknown): the
    /// chat stream's day counts from there.
    pub(crate) published_ms: u64,
    /// The fleet's `--max-not-before-secs`.
    pub(crate) max_ahead: Duration,
    /// The job's run time (its `timeoutMs`, else the default).
    pub(crate) timeout: Duration,
    /// Which delivery this is (1: the first).
    pub(crate) attempt: u32,
}

/// When `job` may run, judged by `by`: no more than `max_ahead`, nor than
/// the chat stream's day less [`NOT_BEFORE_ROOM`] and its timeout, after
/// its submission.
///
/// [`NOT_BEFORE_ROOM`]: crate::settings::NOT_BEFORE_ROOM
pub(crate) fn start_of(job: &ChatJob, by: Judged) -> Start {
    let Some(text) = job.not_before.as_deref() else {
        return Start::Now;
    };
    let Ok(at) = DateTime::parse_from_rfc3339(text) else {
        return Start::Refused(format!(
            "notBefore {text:?} is not an RFC 3339 time (e.g. 2026-12-01T09:00:00+01:00)"
        ));
    };
    let at_ms = u64::try_from(at.timestamp_millis()).unwrap_or(0);
    let ahead = Duration::from_millis(at_ms.saturating_sub(by.published_ms.min(by.now_ms)));
    let stream_room = toolfleet_protocol::streams::CHAT_MAX_AGE
        .saturating_sub(crate::settings::NOT_BEFORE_ROOM)
        .saturating_sub(by.timeout);
    let limit = by.max_ahead.min(stream_room);
    if ahead > limit {
        return Start::Refused(format!(
            "notBefore {text} is {} s after the job's submission, more than the {} s this fleet \
             lets it wait (--max-not-before, less its {} s timeout: the chat stream keeps a job \
             a day); submit it nearer the time, or use a schedule",
            ahead.as_secs(),
            limit.as_secs(),
            by.timeout.as_secs()
        ));
    }
    let wait = Duration::from_millis(at_ms.saturating_sub(by.now_ms));
    let run_now_within = if by.attempt > 1 {
        SKEW_TOLERANCE
    } else {
        RUN_NOW_WITHIN
    };
    if wait < run_now_within {
        Start::Now
    } else {
        Start::Later(wait)
    }
}

/// When `job`'s deadline starts counting (unix ms): its publication
/// (`published_ms`), or its `notBefore` when that is later — a delayed
/// job's `timeoutMs` is its run's, not spent waiting.
pub(super) fn counted_from(job: &ChatJob, published_ms: Option<u64>) -> Option<u64> {
    match (published_ms, not_before_ms(job)) {
        (Some(p), Some(n)) => Some(p.max(n)),
        (p, n) => p.or(n),
    }
}

/// The job's `notBefore` in unix ms, when it has one that can be read.
fn not_before_ms(job: &ChatJob) -> Option<u64> {
    job.not_before
        .as_deref()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .and_then(|t| u64::try_from(t.timestamp_millis()).ok())
}

/// Was `job` submitted to wait (published before its `notBefore`)? Its
/// first event is then `scheduled` (seq 0), and its run's go on from 1.
fn scheduled(job: &ChatJob, published_ms: Option<u64>) -> bool {
    let wait = u64::try_from(RUN_NOW_WITHIN.as_millis()).unwrap_or(u64::MAX);
    matches!((published_ms, not_before_ms(job)), (Some(p), Some(n)) if p.saturating_add(wait) < n)
}

/// The `seq` of a fresh run's first event: 1 after a `scheduled` event,
/// else 0.
pub(super) fn first_seq(job: &ChatJob, published_ms: Option<u64>) -> u64 {
    u64::from(scheduled(job, published_ms))
}

/// Tells the job's followers it is scheduled: its `scheduled` event, seq
/// 0 (sent again, the same, by a repeated delivery).
async fn announce(fleet: &Fleet, job: &ChatJob, tenant: &str) {
    let Some(not_before) = job.not_before.clone() else {
        return;
    };
    let events = crate::Events::start(
        fleet.client.clone(),
        &fleet.config.subjects,
        tenant,
        &job.invocation_id,
    );
    events.send(toolfleet_protocol::ChatEventBody::Scheduled { not_before });
    events.close().await;
}

/// Settles a delivery whose job may not run yet: given back with a delay
/// until its `notBefore` (its lease let go, its claim kept), or refused.
/// Whether it was settled here (`false`: the job runs now).
pub(super) async fn held_back(
    fleet: &Fleet,
    msg: &jetstream::Message,
    job: &ChatJob,
    tenant: &str,
    holder: &str,
    delivery: Delivery,
) -> bool {
    let now_ms = toolfleet_protocol::now_ms();
    let start = start_of(
        job,
        Judged {
            now_ms,
            published_ms: delivery.published_ms.unwrap_or(now_ms),
            max_ahead: fleet.config.max_not_before,
            timeout: job
                .timeout_ms
                .map_or(fleet.config.default_timeout, Duration::from_millis),
            attempt: delivery.attempt,
        },
    );
    match start {
        Start::Now => {
            // Submitted to wait, but first taken after its time: said all
            // the same, so its run's events follow a `scheduled` one.
            if delivery.attempt == 1 && scheduled(job, delivery.published_ms) {
                announce(fleet, job, tenant).await;
            }
            false
        }
        Start::Later(wait) => {
            let inv = InvocationKey::new(tenant, &job.invocation_id);
            let until = now_ms.saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
            let cap = fleet.config.max_delayed_jobs;
            match fleet.store.hold_delayed(inv, now_ms, until, cap).await {
                Ok(true) => {}
                Ok(false) => {
                    let refused = Refused {
                        invocation_id: Some(job.invocation_id.clone()),
                        tenant: tenant.to_string(),
                        tell_sender: true,
                        refusal: Refusal::TooManyDelayed {
                            tenant: tenant.to_string(),
                            cap,
                        },
                    };
                    reject::reject(fleet, msg, delivery, refused).await;
                    return true;
                }
                // Not counted, but not refused for the store's trouble.
                Err(e) => warn!(invocation_id = %job.invocation_id, tenant, error = %e,
                    "a delayed job could not be counted against --max-delayed-jobs"),
            }
            if scheduled(job, delivery.published_ms) {
                announce(fleet, job, tenant).await;
            }
            let _ = fleet.store.release_lease(inv, holder).await;
            info!(invocation_id = %job.invocation_id, tenant, wait_secs = wait.as_secs(),
                not_before = ?job.not_before, "chat job scheduled: it waits for its notBefore");
            let _ = msg.ack_with(AckKind::Nak(Some(wait))).await;
            true
        }
        Start::Refused(why) => {
            let refused = Refused {
                invocation_id: Some(job.invocation_id.clone()),
                tenant: tenant.to_string(),
                tell_sender: true,
                refusal: Refusal::Malformed(ProtocolError::Schema {
                    schema: "chat_job.schema.json",
                    details: why,
                }),
            };
            reject::reject(fleet, msg, delivery, refused).await;
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(not_before: Option<&str>) -> ChatJob {
        let mut job = toolfleet_protocol::client::question("hi");
        job.not_before = not_before.map(str::to_string);
        job
    }

    /// Judged at 2026-01-01T00:00:00Z, submitted then, on a first
    /// delivery, with the default limit and a two-minute timeout.
    fn first(now: u64) -> Judged {
        Judged {
            now_ms: now,
            published_ms: now,
            max_ahead: DEFAULT_MAX_NOT_BEFORE,
            timeout: Duration::from_secs(120),
            attempt: 1,
        }
    }

    #[test]
    fn a_job_waits_for_its_time_and_no_longer_than_allowed() {
        // 2026-01-01T00:00:00Z
        let now = 1_767_225_600_000;
        let by = first(now);
        assert_eq!(start_of(&job(None), by), Start::Now);
        assert_eq!(start_of(&job(Some("2025-12-31T23:00:00Z")), by), Start::Now);
        assert_eq!(
            start_of(&job(Some("2026-01-01T01:00:00+01:00")), by),
            Start::Now
        );
        assert_eq!(
            start_of(&job(Some("2026-01-01T00:00:30Z")), by),
            Start::Later(Duration::from_secs(30))
        );
        // 23 h less the timeout is the most; a minute more is refused.
        assert_eq!(
            start_of(&job(Some("2026-01-01T22:58:00Z")), by),
            Start::Later(Duration::from_secs(22 * 3600 + 58 * 60))
        );
        let far = start_of(&job(Some("2026-01-01T22:59:00Z")), by);
        assert!(
            matches!(&far, Start::Refused(why) if why.contains("--max-not-before")),
            "{far:?}"
        );
        // A longer timeout leaves less room; a smaller limit is kept.
        let hour = Judged {
            timeout: Duration::from_secs(3600),
            ..by
        };
        assert!(matches!(
            start_of(&job(Some("2026-01-01T22:30:00Z")), hour),
            Start::Refused(_)
        ));
        let small = Judged {
            max_ahead: Duration::from_secs(60),
            ..by
        };
        assert!(matches!(
            start_of(&job(Some("2026-01-01T00:02:00Z")), small),
            Start::Refused(_)
        ));
        // The day counts from the submission, not from this delivery.
        let late = Judged {
            now_ms: now + 3 * 3600 * 1000,
            ..by
        };
        assert!(matches!(
            start_of(&job(Some("2026-01-01T23:30:00Z")), late),
            Start::Refused(_)
        ));
        // The deadline counts from the later of publication and notBefore.
        let waited = job(Some("2026-01-01T00:00:30Z"));
        assert_eq!(counted_from(&waited, Some(now)), Some(now + 30_000));
        assert_eq!(counted_from(&job(None), Some(now)), Some(now));
        let bad = start_of(&job(Some("tomorrow")), by);
        assert!(
            matches!(&bad, Start::Refused(why) if why.contains("RFC 3339")),
            "{bad:?}"
        );
    }

    #[test]
    fn a_redelivery_a_little_early_runs_now() {
        let now = 1_767_225_600_000;
        let soon = job(Some("2026-01-01T00:00:03Z"));
        assert_eq!(
            start_of(&soon, first(now)),
            Start::Later(Duration::from_secs(3))
        );
        let again = Judged {
            attempt: 2,
            ..first(now)
        };
        assert_eq!(start_of(&soon, again), Start::Now);
        assert_eq!(
            start_of(&job(Some("2026-01-01T00:01:00Z")), again),
            Start::Later(Duration::from_secs(60))
        );
    }
}
