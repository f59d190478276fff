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
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

use crate::poison::Poison;

/// How long one pull request waits for messages before the next is sent.
pub const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// What a pull loop does with poison messages (see [`crate::poison`]):
/// it sweeps its consumer at start and after every reconnection, and
/// hands each poison found to `on_poison` (dead-letter it, tell its
/// sender).
#[derive(Clone)]
pub struct Sweeper {
    pub js: jetstream::Context,
    /// The stream the consumer reads.
    pub stream: String,
    pub on_poison: Arc<dyn Fn(Poison) -> BoxFuture<'static, ()> + Send + Sync>,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Sweeper {
    async fn run(
        &self,
        consumer: &mut jetstream::consumer::Consumer<pull::Config>,
        tracker: &TaskTracker,
    ) {
        for poison in crate::poison::sweep(&self.js, &self.stream, consumer).await {
            tracker.spawn((self.on_poison)(poison));
        }
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

    /// Resolves at the next reconnection after the last one seen.
    async fn next(&mut self) {
        if self.0.changed().await.is_err() {
            // The watcher stopped (shutdown): never again.
            std::future::pending::<()>().await;
        }
    }

    /// Whether the connection came back since the last look; marks every
    /// reconnection so far as seen.
    fn take_new(&mut self) -> bool {
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
/// arrives before a permit frees up waits in its own task and sends
/// in-progress acks every `progress_every` meanwhile, so its ack wait never
/// runs out and no other copy runs it too. When the connection comes back
/// after a loss (`reconnects`), the pull in flight is abandoned and a new
/// one sent at once.
#[allow(clippy::too_many_arguments)]
pub async fn pull_bounded<F, Fut>(
    mut consumer: jetstream::consumer::Consumer<pull::Config>,
    mut reconnects: Reconnects,
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
    let mut sweep = true;
    'outer: while !shutdown.is_cancelled() {
        if reconnects.take_new() | std::mem::take(&mut sweep) {
            sweeper.run(&mut consumer, &tracker).await;
        }
        // Ask only when something can run.
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let want = 1 + permits.available_permits();
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
        let mut first = Some(first);
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => break 'outer,
                // The server forgot our request with the old connection
                // (which a poison message may have broken: sweep).
                _ = reconnects.next() => {
                    sweep = true;
                    break;
                }
                n = batch.next() => n,
            };
            match next {
                Some(Ok(msg)) => match first.take() {
                    Some(permit) => {
                        let job = handle(msg);
                        tracker.spawn(async move {
                            job.await;
                            drop(permit);
                        });
                    }
                    None => {
                        let waiting = keep_alive(&msg, progress_every);
                        let job = handle(msg);
                        let permits = permits.clone();
                        tracker.spawn(async move {
                            let Ok(permit) = permits.acquire_owned().await else {
                                return;
                            };
                            drop(waiting);
                            job.await;
                            drop(permit);
                        });
                    }
                },
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

/// Sends in-progress acks for `msg` every `every` until the returned guard
/// is dropped — however the work ends, a panic included — so a long job is
/// not redelivered while it runs, and a dead one is.
pub fn keep_alive(msg: &jetstream::Message, every: Duration) -> tokio_util::sync::DropGuard {
    let stop = CancellationToken::new();
    let acker = msg.clone();
    let token = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = token.cancelled() => break,
                _ = tokio::time::sleep(every) => {
                    let _ = acker.ack_with(jetstream::AckKind::Progress).await;
                }
            }
        }
    });
    stop.drop_guard()
}
