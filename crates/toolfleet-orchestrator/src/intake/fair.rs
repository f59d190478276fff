//! Fair dispatch: chat jobs are taken from the tenants in weighted turns,
//! so one tenant's backlog delays only that tenant.
//!
//! NATS has no fair queue, so the chat stream (a work queue) has two
//! durable consumers per tenant, one per lane (see `lanes`):
//! `chat-<tenant>` filtered on `<p>.chat.submit.<tenant>` (interactive)
//! and `batch-<tenant>` on `<p>.chat.batch.<tenant>` (the filters do not
//! overlap, so the work queue allows them side by side), shared by every
//! orchestrator. Each orchestrator runs one [`Dispatcher`]: whenever one
//! of its `--max-in-flight` permits is free it takes the permit, picks a
//! lane — interactive while any tenant has interactive work, except that
//! batch work that has waited `--batch-max-wait` since batch last had a
//! turn goes next (aging: batch never starves) — then the lane's next
//! tenant by smooth weighted round robin ([`Turns`], weights from
//! `[tenants.<name>] weight`), and fetches one job from that tenant's
//! consumer without waiting (a no-wait pull: an empty tenant costs one
//! round trip, and no permit is held by an idle pull). Several
//! orchestrators each take their turns, so the fleet as a whole alternates
//! too.
//!
//! Which tenants have work is learned cheaply:
//! - **wake-ups**: core subscriptions on the submit and batch subjects tell of
//!   every new job as it is published (the job itself stays in the stream;
//!   the copy is only read for its subject);
//! - **a rescan** every [`RESCAN_EVERY`]: the stream's per-subject counts
//!   (stream info with a subjects filter, one request) name every tenant
//!   with a job stored — waiting, or delivered and not yet acked, which
//!   is how redeliveries (an ack wait that ran out, a nak with a delay)
//!   are found again; a tenant whose fetch finds nothing leaves the turns
//!   until the next wake-up or rescan.
//!
//! Everything else is the consumers': acks, in-progress acks, redelivery
//! and `max_deliver` are per consumer exactly as they were on the shared
//! one. A job whose headers cannot be read (see
//! [`toolfleet_service::poison`]) is handed to the [`Sweeper`] under the
//! permit it was taken with: dead-lettered, answered, terminated.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_protocol::Priority;
use toolfleet_service::jobs::Sweeper;
use toolfleet_service::poison::Poison;
use toolfleet_store::slots::Slot;
use tracing::warn;

use super::turns::Turns;
use super::{Plugins, tenant_consumer};
use crate::Fleet;

/// How often the stream's per-subject counts are read: the longest a
/// redelivered job (or a job whose wake-up was missed) waits to be seen.
pub(crate) const RESCAN_EVERY: Duration = Duration::from_secs(1);

/// How soon the counts are read again when a wake-up's fetch found
/// nothing: the wake-up can arrive before the stream has stored the job.
const RECHECK_AFTER_WAKEUP: Duration = Duration::from_millis(50);

/// How long one fetch waits at most: the server answers at once when the
/// tenant has nothing (`no_wait`), unless a job of the tenant delivered
/// before may come back — one still running, whose stored message makes a
/// rescan bring the tenant back — then it holds the request up to this
/// long (a permit held that long, at most once a rescan).
const FETCH_EXPIRES: Duration = Duration::from_millis(100);

/// How long the client waits for the server's answer beyond that (the
/// connection broke under it).
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a tenant counts as active after it last had work waiting
/// (longer than a client's pause between two jobs): while two or more
/// are, each is held to its share of this orchestrator's slots, so a
/// quiet tenant finds one free at once.
const ACTIVE_FOR: Duration = Duration::from_secs(2);

/// How long a tenant found at its `max_jobs_in_flight` takes no turn
/// before its count is read again.
const HELD_BACK_FOR: Duration = Duration::from_millis(100);

/// What the dispatcher reads: the chat stream and the wake-ups (core
/// subscriptions on every submit and batch subject, merged).
pub(crate) struct Intake {
    pub(crate) stream: jetstream::stream::Stream,
    pub(crate) wakeups: BoxStream<'static, async_nats::Message>,
}

/// Takes chat jobs in weighted turns and runs each under a permit.
pub(crate) struct Dispatcher {
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) plugins: Arc<Plugins>,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) tracker: TaskTracker,
    pub(crate) shutdown: CancellationToken,
    pub(crate) sweeper: Sweeper,
}

/// A tenant's lane: whose consumer a job is fetched from.
type Lane = (String, Priority);

/// A fetch the dispatcher hands to a task of its own.
struct Fetch {
    consumer: PullConsumer,
    lane: Lane,
    /// `turn` or `aged` (the dispatch metric's label).
    reason: &'static str,
    /// A wake-up put the lane in the turns.
    woken: bool,
    permit: OwnedSemaphorePermit,
    /// The tenant's place among its jobs in flight, and its count here.
    held: (Option<Slot>, RunningGuard),
    done: mpsc::UnboundedSender<Done>,
}

/// How a fetch went, reported to the dispatcher.
enum Done {
    Job { lane: Lane },
    Empty { lane: Lane, woken: bool },
    Failed { lane: Lane },
}

/// The dispatcher's view of the tenants.
struct Tenants {
    stream: jetstream::stream::Stream,
    consumers: HashMap<Lane, PullConsumer>,
    interactive: Turns,
    batch: Turns,
    /// Since when batch work has waited without a turn (`None`: no batch
    /// work known).
    batch_since: Option<Instant>,
    batch_max_wait: Duration,
    /// Lanes woken since their last fetch.
    woken: HashSet<Lane>,
    /// Tenants with jobs stored at the last rescan (their queue gauge is
    /// set to zero once they have none).
    stored: HashSet<String>,
    rescan_at: Instant,
    /// Tenants found at their `max_jobs_in_flight`, and until when they
    /// take no turn.
    held_back: HashMap<String, Instant>,
    /// Tenants whose jobs wait at their `max_jobs_in_flight` since the last
    /// look (a wait is counted once).
    capped: HashSet<String>,
    /// Jobs running here, by tenant: a free slot goes to the tenant with
    /// the fewest for its weight.
    running: Running,
    /// When each tenant last had work waiting, and its weight.
    active: HashMap<String, (Instant, u32)>,
    /// This orchestrator's slots (`--max-in-flight`).
    slots: usize,
}

/// Jobs running in this orchestrator, by tenant; `ended` is told when
/// one ends (a tenant held to its share may take a turn again).
#[derive(Clone, Default)]
struct Running(
    Arc<std::sync::Mutex<HashMap<String, u32>>>,
    Arc<tokio::sync::Notify>,
);

impl Running {
    fn of(&self, tenant: &str) -> u32 {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(tenant)
            .copied()
            .unwrap_or(0)
    }

    /// Counts one more job of `tenant` until the guard drops.
    fn start(&self, tenant: &str) -> RunningGuard {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(tenant.to_owned())
            .or_default() += 1;
        RunningGuard {
            running: self.clone(),
            tenant: tenant.to_owned(),
        }
    }
}

/// One job counted in [`Running`] until dropped (from before its fetch:
/// a fetch in flight counts as a job of its tenant).
struct RunningGuard {
    running: Running,
    tenant: String,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut map = self
            .running
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.tenant);
            }
        }
        self.running.1.notify_one();
    }
}

impl Dispatcher {
    /// Dispatches until shutdown.
    pub(crate) async fn run(self, intake: Intake) {
        let mut wakeups = intake.wakeups;
        let mut reconnects = self.fleet.reconnects.from_now();
        let mut tenants = Tenants {
            stream: intake.stream,
            consumers: HashMap::new(),
            interactive: Turns::default(),
            batch: Turns::default(),
            batch_since: None,
            batch_max_wait: self.fleet.config.batch_max_wait,
            woken: HashSet::new(),
            stored: HashSet::new(),
            rescan_at: Instant::now(),
            held_back: HashMap::new(),
            capped: HashSet::new(),
            running: Running::default(),
            active: HashMap::new(),
            slots: self.fleet.config.max_in_flight.max(1),
        };
        let (done_tx, mut done) = mpsc::unbounded_channel::<Done>();
        let ended = tenants.running.1.clone();
        while !self.shutdown.is_cancelled() {
            if reconnects.take_new() {
                tenants.reconnected();
            }
            // The permit first: who has work is read after it, so a turn
            // goes by what is waiting now, not when the last slot freed.
            let permit = tokio::select! {
                () = self.shutdown.cancelled() => break,
                p = self.permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            // What the fetches out reported meanwhile.
            while let Ok(d) = done.try_recv() {
                tenants.settle(d);
            }
            if Instant::now() >= tenants.rescan_at {
                tenants.rescan(&self.fleet).await;
            }
            while let Some(Some(msg)) = wakeups.next().now_or_never() {
                tenants.wake(&self.fleet, &msg.subject);
            }
            let Some((lane, reason)) = tenants.next(&self.fleet) else {
                // Nothing to take: wait holding no permit.
                drop(permit);
                tokio::select! {
                    () = self.shutdown.cancelled() => break,
                    msg = wakeups.next() => match msg {
                        Some(msg) => tenants.wake(&self.fleet, &msg.subject),
                        // The connection is closed for good.
                        None => break,
                    },
                    Some(d) = done.recv() => tenants.settle(d),
                    () = ended.notified() => {}
                    () = tokio::time::sleep_until(tenants.rescan_at) => {}
                    () = reconnects.next() => tenants.reconnected(),
                }
                continue;
            };
            let Ok(slot) = self.job_slot(&lane.0).await else {
                // At its cap of jobs in flight: its jobs wait in the stream
                // (counted once per wait, not per look).
                if tenants.capped.insert(lane.0.clone()) {
                    self.fleet
                        .metrics
                        .in_flight_waits
                        .with_label_values(&[lane.0.as_str(), "jobs"])
                        .inc();
                }
                tenants.hold_back(&lane);
                continue;
            };
            tenants.capped.remove(&lane.0);
            let Some(consumer) = tenants.consumer(&self, &lane).await.cloned() else {
                tenants.idle(&lane);
                continue;
            };
            // The lane takes no turn while its fetch is out; the fetch
            // counts as a job of its tenant.
            let woken = tenants.woken.remove(&lane);
            tenants.pause(&lane);
            let running = tenants.running.start(&lane.0);
            self.spawn_fetch(Fetch {
                consumer,
                lane,
                reason,
                woken,
                permit,
                held: (slot, running),
                done: done_tx.clone(),
            });
        }
    }

    /// Fetches one job of the lane without waiting (the server answers at
    /// once when there is none, or after [`FETCH_EXPIRES`] when a job of
    /// the lane delivered before may come back), reports how it went, and
    /// runs the job under the fetch's permit. Out of the dispatcher's
    /// loop: a slow answer delays only this lane.
    fn spawn_fetch(&self, f: Fetch) {
        let (fleet, plugins) = (self.fleet.clone(), self.plugins.clone());
        let (sweeper, tracker) = (self.sweeper.clone(), self.tracker.clone());
        self.tracker.spawn(async move {
            let Fetch {
                consumer,
                lane,
                reason,
                woken,
                permit,
                held,
                done,
            } = f;
            let fetched = tokio::time::timeout(FETCH_EXPIRES + FETCH_TIMEOUT, async {
                let mut batch = consumer
                    .fetch()
                    .max_messages(1)
                    .expires(FETCH_EXPIRES)
                    .messages()
                    .await?;
                batch.next().await.transpose()
            })
            .await;
            let (tenant, priority) = (lane.0.as_str(), lane.1.as_str());
            let msg = match fetched {
                Ok(Ok(Some(msg))) => msg,
                Ok(Ok(None)) => {
                    let _ = done.send(Done::Empty { lane, woken });
                    return;
                }
                Ok(Err(e)) => {
                    warn!(tenant, priority, error = %e, "fair dispatch: cannot pull the tenant's chat jobs; trying again later");
                    let _ = done.send(Done::Failed { lane });
                    return;
                }
                Err(_) => {
                    warn!(tenant, priority, "fair dispatch: a pull got no answer in time; trying again later");
                    let _ = done.send(Done::Failed { lane });
                    return;
                }
            };
            // The tenant's queue series exists from its first job on, even
            // if no rescan saw the job stored.
            fleet.metrics.chat_queued.with_label_values(&[tenant]);
            fleet
                .metrics
                .chat_dispatched
                .with_label_values(&[priority, reason])
                .inc();
            let _ = done.send(Done::Job { lane: lane.clone() });
            if let Some(poison) = Poison::of(&msg) {
                drop(held);
                sweeper.dispose(poison, msg, Some(permit), &tracker);
                return;
            }
            // The permit goes with the job: a job waiting for its thread
            // gives it back while it waits (`threads::Seat`).
            super::handle_holding(&fleet, &plugins, msg, Some(permit)).await;
            drop(held);
        });
    }

    /// A place among `tenant`'s jobs in flight fleet-wide, when it has a
    /// `max_jobs_in_flight`: `Err` when all are held. A store that cannot
    /// be reached lets the job run.
    async fn job_slot(&self, tenant: &str) -> Result<Option<Slot>, ()> {
        let fleet = &self.fleet;
        let Some(cap) = fleet.config.profiles.caps_of(tenant).max_jobs_in_flight else {
            return Ok(None);
        };
        let key = fleet.store.inflight_key(tenant, "jobs");
        match fleet.store.take_slot(&key, cap).await {
            Ok(Some(slot)) => Ok(Some(slot)),
            Ok(None) => Err(()),
            Err(e) => {
                warn!(tenant, error = %e, "the tenant's jobs in flight cannot be counted; the job runs");
                Ok(None)
            }
        }
    }
}

/// Each active tenant's share of `slots` (by weight, rounded up) while
/// two or more are active; none (no cap) for a tenant alone. Forgets the
/// tenants inactive for [`ACTIVE_FOR`].
fn shares(active: &mut HashMap<String, (Instant, u32)>, slots: usize) -> HashMap<String, u32> {
    active.retain(|_, (at, _)| at.elapsed() < ACTIVE_FOR);
    if active.len() < 2 {
        return HashMap::new();
    }
    let total: u64 = active.values().map(|(_, w)| u64::from(*w)).sum();
    active
        .iter()
        .map(|(t, (_, w))| {
            let share = (slots as u64 * u64::from(*w)).div_ceil(total.max(1));
            (t.clone(), u32::try_from(share.max(1)).unwrap_or(u32::MAX))
        })
        .collect()
}

impl Tenants {
    /// The lane whose turn it is, and why (`turn` or `aged`); `None` when
    /// no tenant has work waiting.
    fn next(&mut self, fleet: &Fleet) -> Option<(Lane, &'static str)> {
        let aged = self
            .batch_since
            .is_some_and(|since| since.elapsed() >= self.batch_max_wait);
        // The lane whose turn it is, then the other: a lane whose tenants
        // are all at their share leaves the slot to the other lane's.
        let order = if self.batch.is_empty() || (!aged && !self.interactive.is_empty()) {
            [(Priority::Interactive, "turn"), (Priority::Batch, "turn")]
        } else if aged {
            [(Priority::Batch, "aged"), (Priority::Interactive, "turn")]
        } else {
            [(Priority::Batch, "turn"), (Priority::Interactive, "turn")]
        };
        let shares = shares(&mut self.active, self.slots);
        let running = self.running.clone();
        // An invocation waiting for its agent tool's nested job does not
        // hold its tenant's share (the nested job needs a slot).
        let busy = |t: &str| running.of(t).saturating_sub(fleet.agent_waits.of(t));
        for (priority, reason) in order {
            let Some(tenant) = self.turns_of(priority).next_by_load(
                |t| running.of(t),
                |t| shares.get(t).is_none_or(|share| busy(t) < *share),
            ) else {
                continue;
            };
            if priority == Priority::Batch {
                // Batch had its turn: its wait starts again.
                self.batch_since = Some(Instant::now());
            }
            return Some(((tenant, priority), reason));
        }
        None
    }

    /// `lane` has nothing deliverable: it takes no turn until woken.
    fn idle(&mut self, (tenant, priority): &Lane) {
        match priority {
            Priority::Interactive => self.interactive.idle(tenant),
            Priority::Batch => {
                self.batch.idle(tenant);
                if self.batch.is_empty() {
                    self.batch_since = None;
                }
            }
        }
    }

    /// `lane`'s tenant is at its cap of jobs in flight: none of its lanes
    /// takes a turn for a while.
    fn hold_back(&mut self, lane: &Lane) {
        self.held_back
            .insert(lane.0.clone(), Instant::now() + HELD_BACK_FOR);
        self.active.remove(&lane.0);
        self.idle(&(lane.0.clone(), Priority::Interactive));
        self.idle(&(lane.0.clone(), Priority::Batch));
        // Its jobs are found again by the rescan after the hold.
        self.rescan_at = self.rescan_at.min(Instant::now() + HELD_BACK_FOR);
    }

    /// `tenant`'s `priority` lane has work.
    fn join(&mut self, fleet: &Fleet, tenant: &str, priority: Priority) {
        if let Some(until) = self.held_back.get(tenant) {
            if Instant::now() < *until {
                // At its cap of jobs in flight: no share of the slots either.
                return;
            }
            self.held_back.remove(tenant);
        }
        self.active.insert(
            tenant.to_owned(),
            (Instant::now(), fleet.config.profiles.weight_of(tenant)),
        );
        let weight = fleet.config.profiles.weight_of(tenant);
        match priority {
            Priority::Interactive => self.interactive.wake(tenant, weight),
            Priority::Batch => {
                self.batch.wake(tenant, weight);
                self.batch_since.get_or_insert_with(Instant::now);
            }
        }
    }

    /// A wake-up on `subject`: its tenant has a new job in that lane.
    fn wake(&mut self, fleet: &Fleet, subject: &str) {
        if let Some((tenant, priority)) = fleet.config.subjects.lane_tenant(subject) {
            self.join(fleet, tenant, priority);
            self.woken.insert((tenant.to_owned(), priority));
        }
    }

    /// Reads which lanes have jobs stored; each joins its turns, and the
    /// per-tenant queue gauge is set (both lanes together).
    async fn rescan(&mut self, fleet: &Fleet) {
        self.rescan_at = Instant::now() + RESCAN_EVERY;
        let subjects = &fleet.config.subjects;
        let mut queued: HashMap<String, u64> = HashMap::new();
        for filter in [subjects.chat_submit_all(), subjects.chat_batch_all()] {
            let mut counts = match self.stream.info_with_subjects(filter).await {
                Ok(counts) => counts,
                Err(e) => {
                    warn!(error = %e, "fair dispatch: cannot read which tenants have chat jobs; retrying");
                    return;
                }
            };
            while let Some(next) = counts.next().await {
                match next {
                    Ok((subject, n)) if n > 0 => {
                        if let Some((tenant, priority)) = subjects.lane_tenant(&subject) {
                            self.join(fleet, tenant, priority);
                            *queued.entry(tenant.to_owned()).or_default() += n as u64;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "fair dispatch: cannot read which tenants have chat jobs; retrying");
                        return;
                    }
                }
            }
        }
        for (tenant, n) in &queued {
            fleet
                .metrics
                .chat_queued
                .with_label_values(&[tenant])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let stored: HashSet<String> = queued.into_keys().collect();
        for gone in self.stored.difference(&stored) {
            fleet.metrics.chat_queued.with_label_values(&[gone]).set(0);
        }
        self.stored = stored;
    }

    /// What a fetch reported: a lane that gave a job may have more (it
    /// takes turns again); an empty one waits for a wake-up or a rescan
    /// (soon, when a wake-up sent it: the job may not be stored yet); a
    /// failed one has its consumer opened again.
    fn settle(&mut self, done: Done) {
        match done {
            Done::Job { lane } => self.turns_of(lane.1).resume(&lane.0),
            Done::Empty { lane, woken } => {
                if self.woken.contains(&lane) {
                    // Woken again while the fetch was out.
                    self.turns_of(lane.1).resume(&lane.0);
                } else {
                    self.idle(&lane);
                }
                if woken {
                    self.rescan_at = self.rescan_at.min(Instant::now() + RECHECK_AFTER_WAKEUP);
                }
            }
            Done::Failed { lane } => {
                self.idle(&lane);
                self.consumers.remove(&lane);
            }
        }
    }

    /// The connection came back: wake-ups published while it was down are
    /// lost (read what is stored now), and the fetches out were likely
    /// lost with it (their lanes take turns again).
    fn reconnected(&mut self) {
        self.rescan_at = Instant::now();
        self.interactive.resume_all();
        self.batch.resume_all();
    }

    fn turns_of(&mut self, priority: Priority) -> &mut Turns {
        match priority {
            Priority::Interactive => &mut self.interactive,
            Priority::Batch => &mut self.batch,
        }
    }

    /// `lane` takes no turn while its fetch is out.
    fn pause(&mut self, (tenant, priority): &Lane) {
        self.turns_of(*priority).pause(tenant);
    }

    /// `lane`'s consumer, opened (made if need be) on first use.
    async fn consumer(&mut self, d: &Dispatcher, lane: &Lane) -> Option<&PullConsumer> {
        if !self.consumers.contains_key(lane) {
            let subjects = &d.fleet.config.subjects;
            let consumer = match tenant_consumer(&self.stream, subjects, &lane.0, lane.1).await {
                Ok(c) => c,
                Err(e) => {
                    warn!(tenant = %lane.0, priority = lane.1.as_str(), error = %e, "fair dispatch: cannot open the tenant's chat consumer; trying again later");
                    return None;
                }
            };
            self.consumers.insert(lane.clone(), consumer);
        }
        self.consumers.get(lane)
    }
}
