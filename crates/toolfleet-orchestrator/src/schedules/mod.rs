//! Scheduled chat jobs: every orchestrator watches the `<P>_SCHEDULES`
//! bucket (the operator's `toolfleet schedule` writes it) and, each second,
//! fires what is due.
//!
//! **Once across the fleet, without a leader.** Firing a due time is a
//! compare-and-set of the schedule's record: the orchestrator whose
//! `update` with the revision it read succeeds (advancing `nextDue`,
//! remembering the run) is the one that submits the run; every other one
//! finds the revision moved and does nothing. The run's invocation id is
//! the schedule's and the due time's (`sched-<id>-<due>`), the same on
//! every orchestrator, so even a job submitted twice would run once (ids
//! are claimed per tenant, beyond any duplicate window). No `Nats-Msg-Id`:
//! the chat stream's duplicate window is shared by every tenant, so a
//! guessable message id could let any client drop a schedule's run
//! (`toolfleet_protocol::client`).
//!
//! **Missed due times** (more than [`plan::ON_TIME_GRACE_SECS`] late: the
//! fleet was down, or the schedule paused) follow the schedule's policy:
//! `skip`, or `catch_up_one` (one run for them all). **Concurrency**: a due
//! time that finds `maxConcurrent` of the schedule's runs still in flight
//! is skipped (a run has ended when its terminal event is stored: the
//! events stream, else the store's record of the finished claim; a run
//! older than [`BUSY_HORIZON`] no longer counts). **Budget**: each run
//! carries the schedule's ([`RunBudget`](toolfleet_protocol::schedule::RunBudget)),
//! which only tightens the tenant's own per-run caps.
//!
//! A run is submitted as the schedule's tenant, on that tenant's submit
//! subject, and is then a chat job like any other: the tenant's profiles,
//! trust and limits come from the operator's configuration for the
//! subject's tenant. Only the operator (and the orchestrators) may write
//! the bucket (`ops/nats/auth.conf`), so a tenant cannot schedule.
//!
//! The set that wins submits after its compare-and-set: an orchestrator
//! that dies between the two loses that one run (it is never run twice).

pub mod plan;
pub mod timing;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use prometheus::{IntCounterVec, Opts, Registry};
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::schedule::{Schedule, ScheduledRun, parse_schedule_key, schedules_bucket};
use toolfleet_protocol::{client, now_ms};
use toolfleet_store::InvocationKey;
use tracing::{info, warn};

use crate::Fleet;
use plan::Plan;
pub use timing::{Timing, TimingError};

/// How often each orchestrator looks for due schedules: every second, just
/// after the second turns (so a due time fires within milliseconds of it,
/// and the orchestrators look at the same moment: their compare-and-sets
/// race, and one wins).
pub const TICK: Duration = Duration::from_secs(1);
/// How long after a second turns the orchestrators look.
const TICK_OFFSET_MS: u64 = 20;

/// How long until the next look (see [`TICK`]).
fn until_next_tick() -> Duration {
    let tick = u64::try_from(TICK.as_millis()).unwrap_or(1000).max(1);
    let into = now_ms() % tick;
    Duration::from_millis((tick + TICK_OFFSET_MS - into) % tick).max(Duration::from_millis(1))
}
/// How long a run that left no terminal event counts as in flight (a job
/// waits at most a day in the chat stream; a run lasts an hour at most,
/// unless it is parked for a person longer).
pub const BUSY_HORIZON: Duration = Duration::from_secs(24 * 3600);

/// Every outcome of a due time, the `outcome` label of
/// `toolfleet_schedule_runs_total`.
pub const OUTCOMES: [&str; 5] = [
    "submitted",
    "caught_up",
    "skipped_missed",
    "skipped_busy",
    "failed",
];

/// Metrics of the schedules.
#[derive(Clone)]
pub struct ScheduleMetrics {
    /// `toolfleet_schedule_runs_total{outcome}`: due times this
    /// orchestrator fired (a run submitted, or one for missed due times),
    /// skipped (missed, or busy), or failed to submit.
    pub runs: IntCounterVec,
}

impl ScheduleMetrics {
    /// Registers the metrics on `r`, every outcome at zero.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let runs = IntCounterVec::new(
            Opts::new(
                "toolfleet_schedule_runs_total",
                "Due times of schedules this orchestrator won, by outcome: submitted, caught_up (one run for missed due times), skipped_missed, skipped_busy (the schedule's runs in flight at its limit), failed (the run could not be submitted).",
            ),
            &["outcome"],
        )?;
        r.register(Box::new(runs.clone()))?;
        for outcome in OUTCOMES {
            runs.with_label_values(&[outcome]);
        }
        Ok(Self { runs })
    }
}

/// A schedule as the watch last saw it.
struct Known {
    schedule: Schedule,
    timing: Timing,
    revision: u64,
    /// An update was tried at this revision: until then (unix seconds),
    /// wait for the watch to bring the next one rather than try again
    /// with a stale revision (after it, a failed update is tried again).
    tried_until: i64,
}

/// Watches the schedules bucket and fires due schedules until `shutdown`.
pub(crate) async fn run(fleet: Arc<Fleet>, shutdown: CancellationToken) {
    let bucket = loop {
        match schedules_bucket(&fleet.js, &fleet.config.subjects).await {
            Ok(b) => break b,
            Err(e) => {
                warn!(error = %e, "cannot open the schedules bucket; trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        }
    };
    let mut known: HashMap<String, Known> = HashMap::new();
    while !shutdown.is_cancelled() {
        let mut watch = match bucket.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                warn!(error = %e, "cannot watch the schedules; trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                }
            }
        };
        known.clear();
        let tick = tokio::time::sleep(until_next_tick());
        tokio::pin!(tick);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => seen(&mut known, entry),
                    Some(Err(e)) => {
                        warn!(error = %e, "the watch on the schedules broke; starting it again");
                        break;
                    }
                    None => break,
                },
                () = &mut tick => {
                    tick.as_mut().reset(tokio::time::Instant::now() + until_next_tick());
                    let now = i64::try_from(now_ms() / 1000).unwrap_or(i64::MAX);
                    for (key, k) in known.iter_mut().filter(|(_, k)| k.tried_until <= now) {
                        if step(&fleet, &bucket, key, k, now).await {
                            k.tried_until = now + RETRY_AFTER_SECS;
                        }
                    }
                }
            }
        }
    }
}

/// Takes a watched entry into `known`: a schedule put, or one removed.
fn seen(known: &mut HashMap<String, Known>, entry: kv::Entry) {
    if entry.operation != kv::Operation::Put {
        known.remove(&entry.key);
        return;
    }
    let parsed = serde_json::from_slice::<Schedule>(&entry.value)
        .map_err(|e| e.to_string())
        .and_then(|s| {
            // The key says whose it is: a record naming another tenant
            // (or id) than its key is not fired.
            if parse_schedule_key(&entry.key) == Some((s.tenant.as_str(), s.id.as_str())) {
                Ok(s)
            } else {
                Err(format!(
                    "its key does not name its tenant {:?} and id {:?}",
                    s.tenant, s.id
                ))
            }
        })
        .and_then(|s| {
            Timing::parse(&s.cron, &s.tz)
                .map(|t| (s, t))
                .map_err(|e| e.to_string())
        });
    match parsed {
        Ok((schedule, timing)) => {
            known.insert(
                entry.key,
                Known {
                    schedule,
                    timing,
                    revision: entry.revision,
                    tried_until: 0,
                },
            );
        }
        Err(e) => {
            warn!(key = %entry.key, error = %e, "a schedule cannot be read; it is not fired");
            known.remove(&entry.key);
        }
    }
}

/// How long an orchestrator that tried to update a schedule's record
/// waits for the watch before it tries again.
const RETRY_AFTER_SECS: i64 = 5;

/// What `k`'s schedule does at `now`; whether an update of its record was
/// tried (successful or not: the watch brings what follows).
async fn step(fleet: &Fleet, bucket: &kv::Store, key: &str, k: &Known, now: i64) -> bool {
    let plan = match plan::plan(&k.schedule, &k.timing, now) {
        Ok(plan) => plan,
        Err(e) => {
            warn!(key, error = %e, "a schedule cannot be fired");
            // Said again only every few seconds, not at every look.
            return true;
        }
    };
    let mut next = k.schedule.clone();
    let (due, outcome) = match plan {
        Plan::Wait => return false,
        Plan::SkipMissed { next_due } => {
            next.next_due = next_due;
            (None, "skipped_missed")
        }
        Plan::Fire {
            due,
            next_due,
            catch_up,
        } => {
            next.next_due = next_due;
            if busy(fleet, &k.schedule).await {
                (None, "skipped_busy")
            } else {
                next.remember(ScheduledRun {
                    invocation_id: k.schedule.run_id(due),
                    due,
                    submitted_ms: now_ms(),
                });
                (Some(due), if catch_up { "caught_up" } else { "submitted" })
            }
        }
    };
    let Ok(value) = serde_json::to_vec(&next) else {
        return false;
    };
    let Ok(revision) = bucket.update(key, value.into(), k.revision).await else {
        // Another orchestrator fired it (or the operator changed it).
        return true;
    };
    let Some(due) = due else {
        info!(
            key,
            outcome,
            next_due = next.next_due,
            "schedule due time passed without a run"
        );
        fleet
            .metrics
            .schedules
            .runs
            .with_label_values(&[outcome])
            .inc();
        return true;
    };
    let outcome = submit(fleet, bucket, key, &next, due, revision)
        .await
        .map_or("failed", |()| outcome);
    fleet
        .metrics
        .schedules
        .runs
        .with_label_values(&[outcome])
        .inc();
    true
}

/// Submits the run of `due` (after this orchestrator won it); on failure,
/// takes the run out of the record again (so it does not count as in
/// flight), when nobody changed the record since (`revision`).
async fn submit(
    fleet: &Fleet,
    bucket: &kv::Store,
    key: &str,
    schedule: &Schedule,
    due: i64,
    revision: u64,
) -> Result<(), ()> {
    let job = schedule.job_for(due);
    let subjects = &fleet.config.subjects;
    let mut last = None;
    for attempt in 0..3u64 {
        match client::submit(&fleet.client, subjects, &job).await {
            Ok(()) => {
                info!(key, invocation_id = %job.invocation_id, due, "schedule fired: run submitted");
                return Ok(());
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(200 * (attempt + 1))).await;
    }
    warn!(key, invocation_id = %job.invocation_id, error = ?last.map(|e| e.to_string()),
        "schedule fired, but its run could not be submitted; it is lost");
    let mut undone = schedule.clone();
    undone.runs.retain(|r| r.invocation_id != job.invocation_id);
    if let Ok(value) = serde_json::to_vec(&undone) {
        let _ = bucket.update(key, value.into(), revision).await;
    }
    Err(())
}

/// Has `schedule` its limit of runs in flight? A run is in flight until
/// its terminal event is stored (or [`BUSY_HORIZON`] after it was
/// submitted); one that cannot be checked counts as in flight.
async fn busy(fleet: &Fleet, schedule: &Schedule) -> bool {
    let limit = schedule.max_concurrent;
    if limit == 0 {
        return false;
    }
    let horizon = u64::try_from(BUSY_HORIZON.as_millis()).unwrap_or(u64::MAX);
    let now = now_ms();
    let mut in_flight = 0u32;
    for run in schedule.runs.iter().rev() {
        if run.submitted_ms.saturating_add(horizon) < now {
            continue;
        }
        if !ended(fleet, &schedule.tenant, &run.invocation_id).await {
            in_flight += 1;
            if in_flight >= limit {
                return true;
            }
        }
    }
    false
}

/// Has invocation `id` of `tenant` ended (its terminal event stored)?
async fn ended(fleet: &Fleet, tenant: &str, id: &str) -> bool {
    let subjects = &fleet.config.subjects;
    if let Ok(Some(event)) = client::last_event(&fleet.client, subjects, tenant, id).await
        && event.body.is_terminal()
    {
        return true;
    }
    matches!(
        fleet
            .store
            .terminal_event(InvocationKey::new(tenant, id))
            .await,
        Ok(Some(_))
    )
}
