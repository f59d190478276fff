//! Fair dispatch: chat jobs are taken from the tenants in weighted turns,
//! so one tenant's backlog delays only that tenant.
//!
//! NATS has no fair queue, so the chat stream (a work queue) has one
//! durable consumer per tenant (`chat-<tenant>`, filtered on
//! `<p>.chat.submit.<tenant>`; the filters do not overlap, so the work
//! queue allows them side by side), shared by every orchestrator. Each
//! orchestrator runs one [`Dispatcher`]: whenever one of its
//! `--max-in-flight` permits is free it takes the permit, picks the next
//! tenant with work waiting by smooth weighted round robin ([`Turns`],
//! weights from `[tenants.<name>] weight`) and fetches one job from that
//! tenant's consumer without waiting (a no-wait pull: an empty tenant
//! costs one round trip, and no permit is held by an idle pull). Several
//! orchestrators each take their turns, so the fleet as a whole alternates
//! too.
//!
//! Which tenants have work is learned cheaply:
//! - **wake-ups**: a core subscription on the submit subjects tells of
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
//! one, and the poison sweep runs on each tenant consumer when it is first
//! opened here and after every reconnection.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_service::jobs::{Reconnects, Sweeper};
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

/// How long one no-wait fetch may take before it is given up (the
/// connection broke under it, e.g. on a poison message).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// What the dispatcher reads: the chat stream and the wake-ups (a core
/// subscription on every submit subject).
pub(crate) struct Intake {
    pub(crate) stream: jetstream::stream::Stream,
    pub(crate) wakeups: async_nats::Subscriber,
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

/// The dispatcher's view of the tenants.
struct Tenants {
    stream: jetstream::stream::Stream,
    consumers: HashMap<String, PullConsumer>,
    turns: Turns,
    /// Tenants woken since their last fetch.
    woken: HashSet<String>,
    /// Tenants with jobs stored at the last rescan (their queue gauge is
    /// set to zero once they have none).
    stored: HashSet<String>,
    rescan_at: Instant,
}

impl Dispatcher {
    /// Dispatches until shutdown.
    pub(crate) async fn run(self, intake: Intake) {
        let mut wakeups = intake.wakeups;
        let mut reconnects = Reconnects::watch(self.fleet.client.clone(), self.shutdown.clone());
        let mut tenants = Tenants {
            stream: intake.stream,
            consumers: HashMap::new(),
            turns: Turns::default(),
            woken: HashSet::new(),
            stored: HashSet::new(),
            rescan_at: Instant::now(),
        };
        // A reconnection seen while idle, still to be swept for.
        let mut reconnected = false;
        while !self.shutdown.is_cancelled() {
            if reconnects.take_new() | std::mem::take(&mut reconnected) {
                // The pull in flight may have been broken by a poison.
                for consumer in tenants.consumers.values_mut() {
                    self.sweeper.run(consumer, &self.tracker).await;
                }
                tenants.rescan_at = Instant::now();
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
            if Instant::now() >= tenants.rescan_at {
                tenants.rescan(&self.fleet).await;
            }
            while let Some(Some(msg)) = wakeups.next().now_or_never() {
                tenants.wake(&self.fleet, &msg.subject);
            }
            if tenants.turns.is_empty() {
                // Nothing to take: wait holding no permit.
                drop(permit);
                tokio::select! {
                    () = self.shutdown.cancelled() => break,
                    msg = wakeups.next() => match msg {
                        Some(msg) => tenants.wake(&self.fleet, &msg.subject),
                        // The connection is closed for good.
                        None => break,
                    },
                    () = tokio::time::sleep_until(tenants.rescan_at) => {}
                    () = reconnects.next() => reconnected = true,
                }
                continue;
            }
            let Some(tenant) = tenants.turns.next() else {
                continue;
            };
            match tenants.take_one(&self, &tenant).await {
                Some(msg) => {
                    let (fleet, plugins) = (self.fleet.clone(), self.plugins.clone());
                    self.tracker.spawn(async move {
                        super::handle(&fleet, &plugins, msg).await;
                        drop(permit);
                    });
                }
                None => tenants.turns.idle(&tenant),
            }
        }
    }
}

impl Tenants {
    /// A wake-up on `subject`: its tenant has a new job.
    fn wake(&mut self, fleet: &Fleet, subject: &str) {
        if let Some(tenant) = fleet.config.subjects.submit_tenant(subject) {
            self.turns
                .wake(tenant, fleet.config.profiles.weight_of(tenant));
            self.woken.insert(tenant.to_owned());
        }
    }

    /// Reads which tenants have jobs stored; each joins the turns, and
    /// the per-tenant queue gauge is set.
    async fn rescan(&mut self, fleet: &Fleet) {
        self.rescan_at = Instant::now() + RESCAN_EVERY;
        let subjects = &fleet.config.subjects;
        let mut counts = match self
            .stream
            .info_with_subjects(subjects.chat_submit_all())
            .await
        {
            Ok(counts) => counts,
            Err(e) => {
                warn!(error = %e, "fair dispatch: cannot read which tenants have chat jobs; retrying");
                return;
            }
        };
        let mut stored = HashSet::new();
        while let Some(next) = counts.next().await {
            match next {
                Ok((subject, n)) if n > 0 => {
                    if let Some(tenant) = subjects.submit_tenant(&subject) {
                        self.turns
                            .wake(tenant, fleet.config.profiles.weight_of(tenant));
                        fleet
                            .metrics
                            .chat_queued
                            .with_label_values(&[tenant])
                            .set(i64::try_from(n).unwrap_or(i64::MAX));
                        stored.insert(tenant.to_owned());
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error = %e, "fair dispatch: cannot read which tenants have chat jobs; retrying");
                    return;
                }
            }
        }
        for gone in self.stored.difference(&stored) {
            fleet.metrics.chat_queued.with_label_values(&[gone]).set(0);
        }
        self.stored = stored;
    }

    /// One job of `tenant`, if it has one deliverable now.
    async fn take_one(&mut self, d: &Dispatcher, tenant: &str) -> Option<jetstream::Message> {
        let woken = self.woken.remove(tenant);
        let consumer = self.consumer(d, tenant).await?;
        let fetched = tokio::time::timeout(FETCH_TIMEOUT, async {
            let mut batch = consumer.fetch().max_messages(1).messages().await?;
            batch.next().await.transpose()
        })
        .await;
        match fetched {
            Ok(Ok(Some(msg))) => {
                // The tenant's queue series exists from its first job on,
                // even if no rescan saw the job stored.
                d.fleet.metrics.chat_queued.with_label_values(&[tenant]);
                Some(msg)
            }
            Ok(Ok(None)) => {
                if woken {
                    self.rescan_at = self.rescan_at.min(Instant::now() + RECHECK_AFTER_WAKEUP);
                }
                None
            }
            Ok(Err(e)) => {
                warn!(tenant, error = %e, "fair dispatch: cannot pull the tenant's chat jobs; trying again later");
                // Opened again next time (it may have been removed).
                self.consumers.remove(tenant);
                None
            }
            Err(_) => {
                warn!(
                    tenant,
                    "fair dispatch: a pull got no answer in time; trying again later"
                );
                self.consumers.remove(tenant);
                None
            }
        }
    }

    /// `tenant`'s consumer, opened (made if need be, and swept for
    /// poison left from before) on first use.
    async fn consumer(&mut self, d: &Dispatcher, tenant: &str) -> Option<&PullConsumer> {
        if !self.consumers.contains_key(tenant) {
            let subjects = &d.fleet.config.subjects;
            let mut consumer = match tenant_consumer(&self.stream, subjects, tenant).await {
                Ok(c) => c,
                Err(e) => {
                    warn!(tenant, error = %e, "fair dispatch: cannot open the tenant's chat consumer; trying again later");
                    return None;
                }
            };
            d.sweeper.run(&mut consumer, &d.tracker).await;
            self.consumers.insert(tenant.to_owned(), consumer);
        }
        self.consumers.get(tenant)
    }
}
