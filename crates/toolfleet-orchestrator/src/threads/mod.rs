//! Threads: conversations the fleet keeps, one job of each at a time
//! (`docs/threads.md`).
//!
//! A chat job that names a `threadId` gets a [`Seat`] on its tenant's
//! thread (the tenant is the submit subject's, never the job's). Before
//! the context stage the seat is taken ([`Seat::enter`]): the job runs at
//! once when nobody has the thread; otherwise its strategy decides —
//! `reject` ends it (`thread_busy`), `enqueue` waits in line, `interrupt`
//! and `rollback` cancel the running job through the ordinary cancel
//! subject and wait for it to let go. A waiting job stays inside its run,
//! under its lease, deadline and cancel, so an orchestrator that dies
//! while it waits loses nothing: the job is delivered again and finds its
//! place in line. While it waits it gives its dispatcher's in-flight
//! permit back ([`Place`]: other jobs run meanwhile), and takes one again
//! before the compare-and-set that takes the thread, so a job that has
//! the thread never waits for a permit. The context stage puts the thread's conversation before the
//! job's new messages ([`ThreadTap::prepend`]); the run taps the
//! conversation as it goes ([`ThreadTap::tap`]: at the start, after
//! each finished batch of tool calls, at the answer), so a run cut short
//! leaves what it finished. When the run ends the seat is let go
//! ([`Seat::leave`]): the conversation as it ended becomes the thread's —
//! unless a `rollback` cut it — and the next in line takes the thread.
//!
//! The record of a thread is changed only by compare-and-set on the
//! threads bucket ([`store`]), the transitions themselves pure
//! ([`record`]). [`store::Buckets`] also holds the idempotency bucket
//! (`intake::idempotency`).

pub mod metrics;
pub mod place;
pub(crate) mod record;
pub mod store;
pub mod tap;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use toolfleet_protocol::thread::{MultitaskStrategy, ThreadState, thread_key};
use toolfleet_protocol::{ChatEventBody, ChatJob};
use tracing::warn;

use crate::failure::ChatErrorCode;
use crate::{Failure, Fleet};
pub use place::Place;
use record::{Arrival, Arriving, Bounds, Cut, ThreadRecord};
pub use store::{
    Buckets, DEFAULT_IDEMPOTENCY_WINDOW, DEFAULT_THREAD_MAX_BYTES, DEFAULT_THREAD_MAX_MESSAGES,
    DEFAULT_THREAD_TTL, ThreadSettings,
};
pub use tap::ThreadTap;

/// How often a waiting job looks whether it may take the thread (a read
/// of the record; a write only when it may).
const WAIT_POLL: Duration = Duration::from_millis(500);
/// How long past its deadline a job's place on a thread is kept (its run
/// ends by its deadline; the margin covers the end and a lease's lapse).
const SEAT_MARGIN_MS: u64 = 30_000;

/// How a run of a thread's job ended, for [`Seat::leave`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leaving {
    /// It ended (`completed` or `error`, said right after).
    Ended,
    /// It parked for approval until this time (Unix ms): it keeps the
    /// thread.
    Parked(u64),
    /// Another run of the invocation speaks for it: nothing changes.
    Superseded,
}

/// One job's place on its thread.
#[derive(Debug)]
pub struct Seat {
    tenant: String,
    thread_id: String,
    invocation_id: String,
    /// Its chat stream sequence (its place among the enqueued).
    seq: u64,
    /// Unix ms after which it cannot be running any more.
    until_ms: u64,
    /// The conversation, as the run taps it.
    tap: ThreadTap,
    /// It has the thread (its leave lets it go, with its turn).
    holding: AtomicBool,
    /// The dispatcher's in-flight permit the run holds: given back while
    /// the job waits, taken again before it takes the thread.
    place: std::sync::OnceLock<Arc<Place>>,
}

impl Seat {
    /// The seat of `job` (of `tenant`, the decided one) when it names a
    /// thread; `seq` is its chat stream sequence, `deadline_ms` its
    /// deadline.
    pub(crate) fn of(job: &ChatJob, tenant: &str, seq: u64, deadline_ms: u64) -> Option<Arc<Self>> {
        let thread_id = job.thread_id.clone()?;
        Some(Arc::new(Self {
            tenant: tenant.to_owned(),
            thread_id,
            invocation_id: job.invocation_id.clone(),
            seq,
            until_ms: deadline_ms + SEAT_MARGIN_MS,
            tap: ThreadTap::default(),
            holding: AtomicBool::new(false),
            place: std::sync::OnceLock::new(),
        }))
    }

    /// The seat of a parked job resumed: it kept the thread while it
    /// waited (its conversation comes from its parked record, `parked`).
    /// What it did before it parked is tapped at once, so it stays in the
    /// thread however the run ends — even cancelled (interrupted) before
    /// its frame starts.
    pub(crate) fn resumed(
        job: &ChatJob,
        tenant: &str,
        deadline_ms: u64,
        parked: &[toolfleet_llm::Message],
    ) -> Option<Arc<Self>> {
        let seat = Self::of(job, tenant, 0, deadline_ms)?;
        seat.holding.store(true, Ordering::Release);
        seat.tap.tap_parked(parked);
        Some(seat)
    }

    /// Holds `place` (the run's in-flight permit) for the run.
    pub(crate) fn hold(&self, place: Arc<Place>) {
        let _ = self.place.set(place);
    }

    /// The run's place (none held when the run was given none).
    fn place(&self) -> Arc<Place> {
        self.place.get().cloned().unwrap_or_default()
    }

    fn key(&self) -> String {
        thread_key(&self.tenant, &self.thread_id)
    }

    /// The thread's id.
    pub fn thread_id(&self) -> &str {
        &self.thread_id
    }

    /// What the invocation taps its conversation into.
    pub fn tap(&self) -> ThreadTap {
        self.tap.clone()
    }

    /// Takes the thread for the job, as `strategy` says when another job
    /// has it; `say` sends the job's `thread` events. Returns once the job
    /// has it, or fails it (`thread_busy` for `reject`; the thread store
    /// unavailable).
    pub(crate) async fn enter(
        &self,
        fleet: &Fleet,
        say: &(dyn Fn(ChatEventBody) + Send + Sync),
        strategy: MultitaskStrategy,
    ) -> Result<(), Failure> {
        let bucket = &fleet.threads.threads;
        let key = self.key();
        let arriving = Arriving {
            invocation_id: &self.invocation_id,
            strategy,
            until_ms: self.until_ms,
            seq: self.seq,
        };
        let (arrival, prior) = store::change(bucket, &key, |r: &mut ThreadRecord| {
            let arrival = r.arrive(arriving, toolfleet_protocol::now_ms());
            (arrival, r.messages.clone())
        })
        .await
        .map_err(unavailable)?;
        let (state, ahead) = match arrival {
            Arrival::Run => {
                fleet.metrics.threads.arrived(strategy, "took");
                self.took(prior);
                return Ok(());
            }
            Arrival::Refused { ahead } => {
                fleet.metrics.threads.arrived(strategy, "refused");
                say(self.event(ThreadState::Refused, strategy, Some(ahead.clone())));
                return Err(Failure::new(
                    ChatErrorCode::ThreadBusy,
                    format!(
                        "thread {} has {ahead} running and this job's strategy is reject",
                        self.thread_id
                    ),
                ));
            }
            Arrival::Full => {
                fleet.metrics.threads.arrived(strategy, "refused");
                say(self.event(ThreadState::Refused, strategy, None));
                return Err(Failure::new(
                    ChatErrorCode::ThreadBusy,
                    format!(
                        "thread {} has {} jobs waiting, as many as its line holds; this job did not run",
                        self.thread_id,
                        record::MAX_LINE
                    ),
                ));
            }
            Arrival::Displaced => return Err(self.displaced(say, strategy)),
            Arrival::Wait {
                state,
                ahead,
                cancel,
            } => {
                if let Some(running) = cancel {
                    self.interrupt(fleet, &running).await;
                }
                (state, ahead)
            }
        };
        fleet.metrics.threads.arrived(strategy, "waited");
        say(self.event(state, strategy, ahead.clone()));
        // Waiting runs nothing: the permit goes back for other jobs.
        let place = self.place();
        place.give_back();
        loop {
            tokio::time::sleep(WAIT_POLL).await;
            // Looked at first: the permit is taken again only when the
            // thread is the job's to take, and before it takes it.
            let (mut record, _) = store::read::<ThreadRecord>(bucket, &key)
                .await
                .map_err(unavailable)?;
            let now = toolfleet_protocol::now_ms();
            match record.try_take(&self.invocation_id, self.until_ms, now) {
                Arrival::Run => {}
                Arrival::Displaced => return Err(self.displaced(say, strategy)),
                _ => continue,
            }
            place.take_again().await;
            let (arrival, prior) = store::change(bucket, &key, |r: &mut ThreadRecord| {
                let now = toolfleet_protocol::now_ms();
                let arrival = r.try_take(&self.invocation_id, self.until_ms, now);
                (arrival, r.messages.clone())
            })
            .await
            .map_err(unavailable)?;
            if arrival == Arrival::Run {
                say(self.event(ThreadState::Running, strategy, ahead));
                self.took(prior);
                return Ok(());
            }
            place.give_back();
            if arrival == Arrival::Displaced {
                return Err(self.displaced(say, strategy));
            }
        }
    }

    /// The failure of a job that waited and lost its place in line: a
    /// newer interrupting job took it (or its place lapsed); said first as
    /// its `thread` event (`refused`).
    fn displaced(
        &self,
        say: &(dyn Fn(ChatEventBody) + Send + Sync),
        strategy: MultitaskStrategy,
    ) -> Failure {
        say(self.event(ThreadState::Refused, strategy, None));
        Failure::new(
            ChatErrorCode::Cancelled,
            format!(
                "superseded by a newer interrupting job of thread {} before it ran: it did not run",
                self.thread_id
            ),
        )
    }

    fn took(&self, prior: Vec<toolfleet_llm::Message>) {
        self.tap.set_prior(prior);
        self.holding.store(true, Ordering::Release);
    }

    fn event(
        &self,
        state: ThreadState,
        strategy: MultitaskStrategy,
        ahead: Option<String>,
    ) -> ChatEventBody {
        ChatEventBody::Thread {
            thread_id: self.thread_id.clone(),
            state,
            strategy,
            ahead,
        }
    }

    /// Cancels the running job `running` of the thread, as a client's
    /// cancel would (every orchestrator hears it; the one running it stops
    /// it, and it is written down for a job not started yet).
    async fn interrupt(&self, fleet: &Fleet, running: &str) {
        let subject = fleet.config.subjects.chat_cancel(&self.tenant, running);
        if let Err(e) = fleet.client.publish(subject, bytes::Bytes::new()).await {
            warn!(thread_id = %self.thread_id, running, error = %e, "cannot cancel the thread's running job; waiting for it to end");
        }
    }

    /// Lets the thread go (or the line), as the run ended. Returns how the
    /// job was cut (interrupted or rolled back), if it was.
    pub(crate) async fn leave(&self, fleet: &Fleet, how: Leaving) -> Option<Cut> {
        let bucket = &fleet.threads.threads;
        let key = self.key();
        let id = self.invocation_id.as_str();
        let result = match how {
            Leaving::Superseded => return None,
            Leaving::Parked(until_ms) => {
                store::change(bucket, &key, |r: &mut ThreadRecord| {
                    r.hold_until(id, until_ms + SEAT_MARGIN_MS);
                    None
                })
                .await
            }
            Leaving::Ended => {
                let holding = self.holding.swap(false, Ordering::AcqRel);
                let turn = self.tap.take_turn().filter(|_| holding);
                let settings = &fleet.config.threads;
                let bounds = Bounds {
                    messages: settings.max_messages,
                    bytes: settings.max_bytes,
                };
                store::change(bucket, &key, |r: &mut ThreadRecord| {
                    r.leave(id, turn.clone(), bounds)
                })
                .await
            }
        };
        result.unwrap_or_else(|e| {
            warn!(thread_id = %self.thread_id, error = %e, "cannot let the thread go; the next job takes it once this one's place lapses");
            None
        })
    }
}

/// A failure of the thread store, as the job's.
fn unavailable(e: store::StoreError) -> Failure {
    Failure::new(
        ChatErrorCode::InternalError,
        format!("the thread cannot be read or written: {e}"),
    )
}
