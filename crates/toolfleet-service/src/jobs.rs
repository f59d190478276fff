//! Bounded pulling from a durable JetStream consumer, shared by the
//! orchestrator (chat jobs) and the worker runtime (tool jobs).
//!
//! Each round asks the server for at most as many messages as this process
//! can start now (free permits), waits up to a few seconds for them, and
//! then asks again. Nothing is prefetched beyond what can run, so an idle
//! copy of the process elsewhere takes the rest, and no pull-request
//! bookkeeping lives across rounds: with a long-lived pull stream and a
//! small batch we saw a job wait two full pull expiries (10 s) before
//! delivery under steady load (`toolfleet bench --concurrency 1`).
//!
//! In-progress acks for the jobs a loop holds come from one [`Heartbeat`]
//! per loop, not from a task and a timer per job; [`PullLoop::in_slots`]
//! holds every job until its handler is done and lets a handler give its
//! permit back early (a worker's result is out, its ledger write and ack
//! are not).
//!
//! A pull request lives on the server, for one connection: when NATS
//! restarts or the connection drops, the request in flight is gone, and
//! the client would wait out its expiry (plus slack) before asking again.
//! [`Reconnects`] tells every pull loop of a process when the connection
//! is back, and each asks again at once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

use crate::poison::Poison;

/// How long one pull request waits for messages before the next is sent.
pub const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// What a pull loop does with poison messages (see [`crate::poison`]):
/// a delivery whose headers the client could not read is handed to
/// `on_poison` (dead-letter it, tell its sender) instead of the loop's
/// handler, then terminated.
#[derive(Clone)]
pub struct Sweeper {
    pub js: jetstream::Context,
    /// The stream the consumer reads (for logs).
    pub stream: String,
    pub on_poison: Arc<dyn Fn(Poison) -> BoxFuture<'static, ()> + Send + Sync>,
    /// How often a poison being handled is kept alive (an in-progress
    /// ack): `on_poison` may wait (for the store that proves the message
    /// may speak for its invocation) longer than the ack wait.
    pub progress_every: Duration,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Sweeper {
    /// Ends `msg`, a poison: `on_poison` (the message kept alive with
    /// in-progress acks meanwhile), then `term`, on `tracker`, holding
    /// `permit` (a trickle of poisons runs no more at once than jobs
    /// would).
    pub fn dispose(
        &self,
        poison: Poison,
        msg: jetstream::Message,
        permit: Option<OwnedSemaphorePermit>,
        tracker: &TaskTracker,
    ) {
        warn!(stream = %self.stream, seq = poison.stream_sequence, subject = %poison.subject,
            reason = %poison.reason, "a job whose headers cannot be read: dead-lettered, not run");
        let handled = (self.on_poison)(poison);
        let every = self.progress_every;
        tracker.spawn(async move {
            let mut handled = handled;
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tokio::select! {
                    () = &mut handled => break,
                    _ = tick.tick() => {
                        let _ = msg.ack_with(jetstream::AckKind::Progress).await;
                    }
                }
            }
            let _ = msg.ack_with(jetstream::AckKind::Term).await;
            drop(permit);
        });
    }
}

/// How often the connection state is looked at.
const CONNECTION_POLL: Duration = Duration::from_millis(50);

/// Counts the times a process's NATS connection came back after it was
/// lost: one watcher per connection, shared by every pull loop.
#[derive(Clone, Debug)]
pub struct Reconnects(watch::Receiver<u64>);

impl Reconnects {
    /// Watches `client`'s connection until `shutdown`.
    pub fn watch(client: async_nats::Client, shutdown: CancellationToken) -> Self {
        let (tx, rx) = watch::channel(0u64);
        // The client counts its connections: a loss and a return between
        // two looks (a restart can take 50 ms) still shows.
        let stats = client.statistics();
        tokio::spawn(async move {
            let connects = || stats.connects.load(std::sync::atomic::Ordering::Relaxed);
            let mut seen = connects();
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(CONNECTION_POLL) => {}
                    _ = tx.closed() => break,
                }
                let now = connects();
                if now != seen {
                    seen = now;
                    tx.send_modify(|n| *n += 1);
                }
            }
        });
        Self(rx)
    }

    /// A watcher of the same connection that counts from now on (a clone
    /// would count every reconnection its source has not looked at).
    #[must_use]
    pub fn from_now(&self) -> Self {
        let mut rx = self.0.clone();
        rx.mark_unchanged();
        Self(rx)
    }

    /// Resolves at the next reconnection after the last one seen.
    pub async fn next(&mut self) {
        if self.0.changed().await.is_err() {
            // The watcher stopped (shutdown): never again.
            std::future::pending::<()>().await;
        }
    }

    /// Whether the connection came back since the last look; marks every
    /// reconnection so far as seen.
    pub fn take_new(&mut self) -> bool {
        let new = self.0.has_changed().unwrap_or(false);
        self.0.borrow_and_update();
        new
    }
}

/// Pulls messages from `consumer` until `shutdown`, running `handle` for
/// each on `tracker` while holding one of `permits`.
///
/// A round holds one permit while it waits (so consumers sharing `permits`
/// — a worker's tools and its direct endpoint — cannot starve each other)
/// and asks for as many messages as there are permits free. A message that
/// arrives before a permit frees up waits in its own task, and the loop's
/// [`Heartbeat`] sends in-progress acks for it every `progress_every`
/// meanwhile, so its ack wait never runs out and no other copy runs it too.
/// When the connection comes back after a loss (`reconnects`), the pull in
/// flight is abandoned and a new one sent at once.
// The loop's parts are each its caller's, handed over once: a struct
// would only rename them.
#[allow(clippy::too_many_arguments)]
pub async fn pull_bounded<F, Fut>(
    consumer: jetstream::consumer::Consumer<pull::Config>,
    reconnects: Reconnects,
    sweeper: Sweeper,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    what: String,
    progress_every: Duration,
    handle: F,
) where
    F: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let pull = PullLoop {
        consumer,
        reconnects,
        sweeper,
        permits,
        tracker,
        shutdown,
        what,
        progress_every,
        hold_permit_while_waiting: true,
    };
    let heartbeat = Heartbeat::start(pull.sweeper.js.client(), pull.progress_every);
    let (spawn_on, free) = (pull.tracker.clone(), pull.permits.clone());
    pull.rounds(|msg, permit| match permit {
        Some(permit) => {
            let job = handle(msg);
            spawn_on.spawn(async move {
                job.await;
                drop(permit);
            });
        }
        None => {
            let waiting = heartbeat.hold(&msg);
            let job = handle(msg);
            let free = free.clone();
            spawn_on.spawn(async move {
                let Ok(permit) = free.acquire_owned().await else {
                    return;
                };
                drop(waiting);
                job.await;
                drop(permit);
            });
        }
    })
    .await;
}

/// A pull loop: its consumer and what it shares with the rest of its
/// process (see [`pull_bounded`] for how it pulls).
pub struct PullLoop {
    pub consumer: jetstream::consumer::Consumer<pull::Config>,
    pub reconnects: Reconnects,
    pub sweeper: Sweeper,
    /// Jobs run at once, shared with the process's other loops.
    pub permits: Arc<Semaphore>,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
    /// The loop's name in logs.
    pub what: String,
    /// How often in-progress acks go out for the jobs the loop holds.
    pub progress_every: Duration,
    /// Whether a round holds a permit while it waits for messages. True
    /// when the loops sharing `permits` are no more than the permits (a
    /// round then asks for every free permit's worth, and loops cannot
    /// starve each other). False when there are more loops than permits
    /// (a worker serving many tools): idle rounds would hold every permit
    /// and keep the other tools' jobs waiting for a whole pull expiry, so a
    /// round holds nothing while it waits and asks for one message; a
    /// message that finds no permit free waits in its own task, so at most
    /// one job per loop waits beyond the permits.
    pub hold_permit_while_waiting: bool,
}

/// What a job pulled by [`PullLoop::in_slots`] holds: one of the loop's
/// permits, and its place in the loop's [`Heartbeat`] (in-progress acks).
pub struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    _held: Held,
}

impl Slot {
    /// Gives the permit back while the job finishes its bookkeeping (a
    /// result out, the ledger and the ack to go): the loop may pull the
    /// next job now. The job stays alive (in-progress acks) until the slot
    /// is dropped.
    pub fn free(&mut self) {
        self.permit = None;
    }

    /// Takes the permit, for a job that gives it back and takes one again
    /// itself while it waits (a chat job waiting for its thread); the job
    /// stays alive until the slot is dropped.
    pub fn take_permit(&mut self) -> Option<OwnedSemaphorePermit> {
        self.permit.take()
    }
}

impl PullLoop {
    /// Pulls as [`pull_bounded`] does, for handlers that keep their job
    /// alive with the loop: every job is held by the loop's one
    /// [`Heartbeat`] from its pull until its [`Slot`] is dropped (no task,
    /// timer or token per job), and a handler may give its permit back
    /// before it is done ([`Slot::free`]).
    pub async fn in_slots<F, Fut>(self, handle: F)
    where
        F: Fn(jetstream::Message, Slot) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let heartbeat = Heartbeat::start(self.sweeper.js.client(), self.progress_every);
        let handle = Arc::new(handle);
        let (spawn_on, free) = (self.tracker.clone(), self.permits.clone());
        self.rounds(|msg, permit| {
            let held = heartbeat.hold(&msg);
            match permit {
                Some(permit) => {
                    let slot = Slot {
                        permit: Some(permit),
                        _held: held,
                    };
                    spawn_on.spawn(handle(msg, slot));
                }
                None => {
                    let (handle, free) = (handle.clone(), free.clone());
                    spawn_on.spawn(async move {
                        let Ok(permit) = free.acquire_owned().await else {
                            return;
                        };
                        let slot = Slot {
                            permit: Some(permit),
                            _held: held,
                        };
                        handle(msg, slot).await;
                    });
                }
            }
        })
        .await;
    }

    /// The rounds of pulls: `dispatch` gets each message, with a permit
    /// when one is free now (there usually is: a round asks for no more
    /// messages than were free), else `None` (the job must wait for one).
    async fn rounds(
        self,
        mut dispatch: impl FnMut(jetstream::Message, Option<OwnedSemaphorePermit>),
    ) {
        let PullLoop {
            consumer,
            mut reconnects,
            sweeper,
            permits,
            tracker,
            shutdown,
            what,
            hold_permit_while_waiting,
            ..
        } = self;
        'outer: while !shutdown.is_cancelled() {
            // A pull sent now replaces any the server forgot.
            reconnects.take_new();
            // Ask only when something can run (see
            // `hold_permit_while_waiting`).
            let first = if hold_permit_while_waiting {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    p = permits.clone().acquire_owned() => match p { Ok(p) => Some(p), Err(_) => break },
                }
            } else {
                None
            };
            let want = if first.is_some() {
                1 + permits.available_permits()
            } else {
                1
            };
            let mut batch = match consumer
                .batch()
                .max_messages(want)
                .expires(PULL_EXPIRES)
                .messages()
                .await
            {
                Ok(b) => b,
                Err(e) => {
                    warn!(consumer = %what, error = %e, "cannot pull; retrying");
                    drop(first);
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            let mut first = first;
            loop {
                let next = tokio::select! {
                    _ = shutdown.cancelled() => break 'outer,
                    // The server forgot our request with the old connection.
                    _ = reconnects.next() => break,
                    n = batch.next() => n,
                };
                match next {
                    Some(Ok(msg)) => {
                        let permit = first
                            .take()
                            .or_else(|| permits.clone().try_acquire_owned().ok());
                        match Poison::of(&msg) {
                            Some(poison) => sweeper.dispose(poison, msg, permit, &tracker),
                            None => dispatch(msg, permit),
                        }
                    }
                    Some(Err(e)) => {
                        warn!(consumer = %what, error = %e, "pull error; asking again");
                        // A lasting error (consumer deleted, too many waiting
                        // pulls) must not become a busy loop.
                        tokio::select! {
                            _ = shutdown.cancelled() => break 'outer,
                            _ = tokio::time::sleep(Duration::from_millis(500)) => break,
                        }
                    }
                    // The request was filled or expired: ask again.
                    None => break,
                }
            }
        }
    }
}

/// In-progress acks for every message a pull loop holds, sent by one
/// ticker task (instead of a task, a timer and a token per message). A
/// message held at `t` gets its first ack between `t + every` and
/// `t + every × 5/4`, then one about every `every`, until its [`Held`]
/// guard is dropped — however the work ends, a panic included. The ticker
/// stops when the last handle on the heartbeat is gone.
#[derive(Clone)]
pub struct Heartbeat {
    inner: Arc<HeartbeatInner>,
}

struct HeartbeatInner {
    every: Duration,
    held: std::sync::Mutex<HeldSet>,
}

#[derive(Default)]
struct HeldSet {
    next: u64,
    /// Key → (ack subject, when its next in-progress ack is due).
    messages: std::collections::HashMap<u64, (async_nats::Subject, std::time::Instant)>,
}

/// How many times per `every` the ticker looks for acks that are due.
const HEARTBEAT_LOOKS: u32 = 4;

impl Heartbeat {
    /// Starts the ticker; in-progress acks go out on `client`.
    pub fn start(client: async_nats::Client, every: Duration) -> Self {
        let inner = Arc::new(HeartbeatInner {
            every,
            held: std::sync::Mutex::default(),
        });
        let weak = Arc::downgrade(&inner);
        let look = (every / HEARTBEAT_LOOKS).max(Duration::from_millis(1));
        tokio::spawn(async move {
            let mut due = Vec::new();
            loop {
                tokio::time::sleep(look).await;
                let Some(inner) = weak.upgrade() else { break };
                inner.take_due(std::time::Instant::now(), &mut due);
                drop(inner);
                for subject in due.drain(..) {
                    let _ = client
                        .publish(subject, bytes::Bytes::from_static(b"+WPI"))
                        .await;
                }
            }
        });
        Self { inner }
    }

    /// Keeps `msg` alive until the returned guard is dropped. A message
    /// with no reply subject (not from JetStream) needs nothing.
    pub fn hold(&self, msg: &jetstream::Message) -> Held {
        let key = msg.reply.as_ref().and_then(|reply| {
            let mut held = self.inner.held.lock().ok()?;
            let key = held.next;
            held.next += 1;
            held.messages.insert(
                key,
                (reply.clone(), std::time::Instant::now() + self.inner.every),
            );
            Some(key)
        });
        Held {
            heartbeat: self.inner.clone(),
            key,
        }
    }

    /// How many messages are held now.
    pub fn held(&self) -> usize {
        self.inner.held.lock().map_or(0, |h| h.messages.len())
    }
}

impl HeartbeatInner {
    /// The ack subjects whose in-progress ack is due at `now`, into `due`;
    /// their next one is due `every` later.
    fn take_due(&self, now: std::time::Instant, due: &mut Vec<async_nats::Subject>) {
        let Ok(mut held) = self.held.lock() else {
            return;
        };
        for (subject, next) in held.messages.values_mut() {
            if *next <= now {
                due.push(subject.clone());
                *next = now + self.every;
            }
        }
    }
}

/// A message held by a [`Heartbeat`]; dropping it stops its acks.
pub struct Held {
    heartbeat: Arc<HeartbeatInner>,
    key: Option<u64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(key) = self.key
            && let Ok(mut held) = self.heartbeat.held.lock()
        {
            held.messages.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat(every: Duration) -> Heartbeat {
        Heartbeat {
            inner: Arc::new(HeartbeatInner {
                every,
                held: std::sync::Mutex::default(),
            }),
        }
    }

    fn hold(hb: &Heartbeat, subject: &str, since: std::time::Instant) -> Held {
        let mut held = hb.inner.held.lock().unwrap();
        let key = held.next;
        held.next += 1;
        held.messages
            .insert(key, (subject.into(), since + hb.inner.every));
        Held {
            heartbeat: hb.inner.clone(),
            key: Some(key),
        }
    }

    #[test]
    fn a_held_message_is_acked_every_period_until_released() {
        let every = Duration::from_secs(3);
        let hb = heartbeat(every);
        let t0 = std::time::Instant::now();
        let a = hold(&hb, "ack.a", t0);
        let b = hold(&hb, "ack.b", t0 + Duration::from_secs(2));
        let mut due = Vec::new();
        // Nothing is due before its first period is over.
        hb.inner.take_due(t0 + Duration::from_secs(1), &mut due);
        assert!(due.is_empty());
        hb.inner.take_due(t0 + every, &mut due);
        assert_eq!(due, vec![async_nats::Subject::from("ack.a")]);
        due.clear();
        // `a` was just acked; `b` is due now.
        hb.inner.take_due(t0 + Duration::from_secs(5), &mut due);
        assert_eq!(due, vec![async_nats::Subject::from("ack.b")]);
        due.clear();
        // Released: never acked again.
        drop(a);
        assert_eq!(hb.held(), 1);
        hb.inner.take_due(t0 + Duration::from_secs(60), &mut due);
        assert_eq!(due, vec![async_nats::Subject::from("ack.b")]);
        drop(b);
        assert_eq!(hb.held(), 0);
    }
}
