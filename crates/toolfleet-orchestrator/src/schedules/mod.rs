//! Scheduled chat jobs: every orchestrator watches the `<P>_SCHEDULES`
//! bucket (the operator's `toolfleet schedule` writes it) and, each second,
//! fires what is due.
//!
//! **Once across the fleet, without a leader.** Firing a due time is a
//! compare-and-set of the schedule's record: the orchestrator whose
//! `update` with the revision it read succeeds (advancing `nextDue`,
//! remembering the run) is the one that submits the run; every other one
//! finds the revision moved and does nothing. The run's invocation id is
//! the due time's with a random nonce the winner chose and stored in the
//! record (`sched-<id>-<due>-<nonce>`): nobody can guess it, so a tenant
//! cannot take a future run's id first (ids are claimed per tenant) nor
//! cancel it in advance (cancels of unknown ids are remembered). No
//! `Nats-Msg-Id`: the chat stream's duplicate window is shared by every
//! tenant (`toolfleet_protocol::client`); the compare-and-set already
//! makes one submission.
//!
//! **Missed due times** (more than [`plan::ON_TIME_GRACE_SECS`] late: the
//! fleet was down, or the schedule paused) follow the schedule's policy:
//! `skip`, or `catch_up_one` (one run for them all). **Concurrency**: a due
//! time that finds `maxConcurrent` of the schedule's runs still in flight
//! is skipped (a run has ended when its terminal event is stored: the
//! events stream, else the store's record of the finished claim; a run
//! older than [`BUSY_HORIZON`] no longer counts; a run the chat stream
//! never acknowledged, [`LOST_GRACE`] after it was recorded with no claim
//! and no event, was lost and no longer counts). The firing orchestrator
//! keeps every run still in flight in the record and drops the others, so
//! a limit above one holds too. **Budget**: each run carries the
//! schedule's ([`RunBudget`](toolfleet_protocol::schedule::RunBudget)),
//! which only tightens the tenant's own per-run caps.
//!
//! A run is submitted as the schedule's tenant, on that tenant's submit
//! subject, and is then a chat job like any other: the tenant's profiles,
//! trust and limits come from the operator's configuration for the
//! subject's tenant. Only the operator (and the orchestrators) may write
//! the bucket (`ops/nats/auth.conf`), so a tenant cannot schedule.
//!
//! The one that wins submits after its compare-and-set, then records the
//! stream's acknowledgement in the record: an orchestrator that dies
//! between the two loses that one run (it is never run twice), and the
//! run counts as lost, not in flight, once [`LOST_GRACE`] has passed.
//! Due schedules are fired concurrently, at most [`FIRING_AT_ONCE`] at a
//! time, so one slow submission does not hold up the others.

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

/// How long a recorded run whose submission the chat stream never
/// acknowledged may go without a claim or an event before it counts as
/// lost (its orchestrator died between the record and the submission, or
/// the publish failed and the record could not be undone), not in flight.
pub const LOST_GRACE: Duration = Duration::from_secs(120);

/// Due schedules an orchestrator fires at once.
pub const FIRING_AT_ONCE: usize = 16;

/// Every outcome of a due time, the `outcome` label of
/// `toolfleet_schedule_runs_total` (`lost` counts runs found lost, each
/// once, when they are dropped from the record).
pub const OUTCOMES: [&str; 6] = [
    "submitted",
    "caught_up",
    "skipped_missed",
    "skipped_busy",
    "failed",
    "lost",
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
                "Due times of schedules this orchestrator won, by outcome: submitted, caught_up (one run for missed due times), skipped_missed, skipped_busy (the schedule's runs in flight at its limit), failed (the run could not be submitted); lost: runs recorded but never acknowledged by the chat stream, found with no claim and no event and no longer counted in flight.",
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
                    let tried = fire_due(&fleet, &bucket, &known, now).await;
                    for key in tried {
                        if let Some(k) = known.get_mut(&key) {
                            k.tried_until = now + RETRY_AFTER_SECS;
                        }
                    }
                }
            }
        }
    }
}

/// Fires what is due among `known` at `now`, at most [`FIRING_AT_ONCE`]
/// at a time; the keys whose record an update was tried for.
async fn fire_due(
    fleet: &Fleet,
    bucket: &kv::Store,
    known: &HashMap<String, Known>,
    now: i64,
) -> Vec<String> {
    let mut steps = Vec::new();
    for (key, k) in known {
        if k.tried_until <= now {
            steps.push(async move { step(fleet, bucket, key, k, now).await.then(|| key.clone()) });
        }
    }
    let tried: Vec<Option<String>> = futures::stream::iter(steps)
        .buffer_unordered(FIRING_AT_ONCE)
        .collect()
        .await;
    tried.into_iter().flatten().collect()
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
    let mut lost = 0u64;
    let mut fired = None;
    let outcome = match plan {
        Plan::Wait => return false,
        Plan::SkipMissed { next_due } => {
            next.next_due = next_due;
            "skipped_missed"
        }
        Plan::Fire {
            due,
            next_due,
            catch_up,
        } => {
            next.next_due = next_due;
            let runs = in_flight(fleet, &k.schedule).await;
            lost = runs.lost;
            next.runs = runs.live;
            if runs.busy {
                "skipped_busy"
            } else {
                let run = ScheduledRun::new(&k.schedule, due, now_ms());
                fired = Some(run.clone());
                next.remember(run);
                if catch_up { "caught_up" } else { "submitted" }
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
    if lost > 0 {
        warn!(
            key,
            lost, "runs of a schedule were recorded but never submitted: not counted in flight"
        );
        fleet
            .metrics
            .schedules
            .runs
            .with_label_values(&["lost"])
            .inc_by(lost);
    }
    let Some(run) = fired else {
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
    let outcome = submit(fleet, bucket, key, &next, &run, revision)
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

/// Submits `run` (after this orchestrator won its due time) and records
/// the stream's acknowledgement; on failure, takes the run out of the
/// record again (so it does not count as in flight), when nobody changed
/// the record since (`revision`; otherwise it counts as lost after
/// [`LOST_GRACE`]).
async fn submit(
    fleet: &Fleet,
    bucket: &kv::Store,
    key: &str,
    schedule: &Schedule,
    run: &ScheduledRun,
    revision: u64,
) -> Result<(), ()> {
    let job = schedule.job_for(run);
    let due = run.due;
    let subjects = &fleet.config.subjects;
    let mut last = None;
    for attempt in 0..3u64 {
        match client::submit(&fleet.client, subjects, &job).await {
            Ok(()) => {
                info!(key, invocation_id = %job.invocation_id, due, "schedule fired: run submitted");
                accepted(bucket, key, &job.invocation_id).await;
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

/// Records in `key`'s record that the chat stream acknowledged run
/// `invocation_id` (a compare-and-set, read again when another
/// orchestrator or the operator wrote in between; given up after a few
/// tries: the run then counts in flight while it has a claim or events).
async fn accepted(bucket: &kv::Store, key: &str, invocation_id: &str) {
    for _ in 0..5 {
        let Ok(Some(entry)) = bucket.entry(key).await else {
            return;
        };
        if entry.operation != kv::Operation::Put {
            return;
        }
        let Ok(mut schedule) = serde_json::from_slice::<Schedule>(&entry.value) else {
            return;
        };
        let Some(run) = schedule
            .runs
            .iter_mut()
            .find(|r| r.invocation_id == invocation_id)
        else {
            return;
        };
        run.accepted_ms = Some(now_ms());
        let Ok(value) = serde_json::to_vec(&schedule) else {
            return;
        };
        if bucket
            .update(key, value.into(), entry.revision)
            .await
            .is_ok()
        {
            return;
        }
    }
    warn!(
        key,
        invocation_id, "the acknowledgement of a scheduled run could not be recorded"
    );
}

/// The recorded runs of a schedule, looked at.
struct InFlight {
    /// The runs still in flight (kept in the record), oldest first.
    live: Vec<ScheduledRun>,
    /// Runs found lost (recorded, never acknowledged, no claim or event
    /// after [`LOST_GRACE`]).
    lost: u64,
    /// Whether `live` is at the schedule's limit.
    busy: bool,
}

/// What a recorded run is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    /// Its terminal event is stored, or it is past [`BUSY_HORIZON`].
    Over,
    /// Recorded, never acknowledged, and nothing of it seen after
    /// [`LOST_GRACE`].
    Lost,
    /// Still running or waiting (or it cannot be checked).
    InFlight,
}

/// `schedule`'s runs still in flight: every one is kept (a limit counts
/// all of them), the ended, expired and lost ones dropped. A schedule
/// without a limit is never busy and its runs are not looked at.
async fn in_flight(fleet: &Fleet, schedule: &Schedule) -> InFlight {
    let limit = schedule.max_concurrent;
    if limit == 0 {
        return InFlight {
            live: schedule.runs.clone(),
            lost: 0,
            busy: false,
        };
    }
    let now = now_ms();
    let mut live = Vec::new();
    let mut lost = 0;
    for run in &schedule.runs {
        match state_of(fleet, &schedule.tenant, run, now).await {
            RunState::Over => {}
            RunState::Lost => lost += 1,
            RunState::InFlight => live.push(run.clone()),
        }
    }
    let busy = live.len() >= usize::try_from(limit).unwrap_or(usize::MAX);
    InFlight { live, lost, busy }
}

/// What `run` of `tenant` is at `now` (unix ms). One that cannot be
/// checked counts as in flight.
async fn state_of(fleet: &Fleet, tenant: &str, run: &ScheduledRun, now: u64) -> RunState {
    let horizon = u64::try_from(BUSY_HORIZON.as_millis()).unwrap_or(u64::MAX);
    if run.submitted_ms.saturating_add(horizon) < now {
        return RunState::Over;
    }
    let id = run.invocation_id.as_str();
    let subjects = &fleet.config.subjects;
    let last = client::last_event(&fleet.client, subjects, tenant, id).await;
    if let Ok(Some(event)) = &last
        && event.body.is_terminal()
    {
        return RunState::Over;
    }
    let inv = InvocationKey::new(tenant, id);
    if matches!(fleet.store.terminal_event(inv).await, Ok(Some(_))) {
        return RunState::Over;
    }
    let grace = u64::try_from(LOST_GRACE.as_millis()).unwrap_or(u64::MAX);
    let unseen = matches!(last, Ok(None)) && matches!(fleet.store.is_claimed(inv).await, Ok(false));
    if run.accepted_ms.is_none() && run.submitted_ms.saturating_add(grace) < now && unseen {
        return RunState::Lost;
    }
    RunState::InFlight
}
