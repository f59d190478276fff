//! One run of an invocation, from its claim to its ack: the frame
//! ([`super::frame`]: context, then the orchestrator) raced against the
//! deadline, the cancel token and the lease; then what the run came to
//! ([`End`]) — a terminal event, a park, or nothing when another run took
//! the invocation over — and one place for the end of every run
//! ([`Run::end`]: ack, forget, count, log).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::{ChatEventBody, ChatJob};
use toolfleet_service::jobs::Held;
use toolfleet_store::{InvocationKey, Lease};
use tracing::{info, warn};

use super::Plugins;
use super::cancels::cancelled_before_start;
use super::claim::{Delivery, LEASE_TTL, LeaseEnd, Leased, ack, keep_lease, owner};
use super::frame::{self, Finished};
use crate::approvals::store::ParkError;
use crate::approvals::{self, CallState, Parked};
use crate::failure::ChatErrorCode;
use crate::invocation::CancelCheck;
use crate::{Events, Failure, Fleet};

/// Where a run of an invocation starts.
pub(super) enum Leg {
    /// From the chat job (its first delivery, or a redelivery).
    Fresh {
        job: Box<ChatJob>,
        agent_depth: u32,
        /// A nested job's caller's approval rules (`Toolfleet-Require-Approval`).
        inherited_approval: Vec<toolfleet_protocol::tools::ToolRef>,
        /// The dispatcher's in-flight permit the run holds (given back
        /// while the job waits for its thread).
        place: Option<tokio::sync::OwnedSemaphorePermit>,
    },
    /// From its parked record, every held call decided.
    Resume(Box<Parked>),
}

impl Leg {
    fn job(&self) -> &ChatJob {
        match self {
            Leg::Fresh { job, .. } => job,
            Leg::Resume(parked) => &parked.job,
        }
    }
}

/// A message this orchestrator holds: the chat job (or the decision that
/// resumes a parked invocation) a run answers for.
pub(super) struct Taken {
    pub(super) msg: jetstream::Message,
    pub(super) delivery: Delivery,
    /// The run's lease holder.
    pub(super) holder: String,
    pub(super) started: Instant,
    /// The claim, as taken.
    pub(super) leased: Leased,
}

/// When the invocation's time is up.
#[derive(Clone, Copy)]
struct Deadline {
    /// Unix ms.
    at_ms: u64,
    /// The whole timeout, for the message.
    timeout: Duration,
}

/// A run in progress: what its end needs.
struct Run<'a> {
    fleet: &'a Fleet,
    msg: jetstream::Message,
    id: String,
    tenant: String,
    /// The claim owner the run speaks under.
    owner: String,
    /// The run's lease holder.
    holder: String,
    /// The fleet's number of this run (its cancel token's entry).
    number: u64,
    started: Instant,
    /// Its lease was taken no earlier than this.
    leased_at: Instant,
    /// In-progress acks while it runs.
    keep_alive: Held,
    /// The job's place on its thread, when it names one.
    thread: Option<Arc<crate::threads::Seat>>,
    /// The dispatcher's permit, held until the run ends (given back while
    /// the job waits for its thread or replays its idempotency key's first
    /// job).
    place: Option<Arc<crate::threads::Place>>,
    /// The job's idempotency key, when it has one.
    idempotency_key: Option<String>,
}

/// What a run came to.
enum End {
    /// Another run holds the lease: this one stops without a word (and
    /// without an ack: the message is that run's now).
    Superseded,
    /// Parked for approvals: the invocation lives in its record.
    Parked { held: usize, expires_at_ms: u64 },
    /// Its terminal event is out: `completed`, or `error` with its code;
    /// `stored` when the events stream confirmed it (otherwise the chat
    /// job is not acked: its redelivery publishes the event again).
    Terminal { code: Option<String>, stored: bool },
}

/// Runs a decoded job (or a decided parked invocation) to its terminal
/// event or park, then acks it.
pub(super) async fn run(fleet: &Arc<Fleet>, plugins: &Plugins, taken: Taken, leg: Leg) {
    fleet.metrics.chat_jobs_in_flight.inc();
    let id = leg.job().invocation_id.clone();
    let tenant = leg.job().tenant().to_string();
    let (number, cancel) = fleet.register_run(&id, &tenant);
    let now = toolfleet_protocol::now_ms();
    let (first_seq, owner, deadline, resumed_from) = match &leg {
        Leg::Fresh { job, .. } => {
            let (at_ms, timeout) = invocation_deadline(fleet, job, taken.delivery, now);
            let first = super::delay::first_seq(job, taken.delivery.published_ms);
            (
                first,
                owner(taken.delivery),
                Deadline { at_ms, timeout },
                None,
            )
        }
        // The wait for a person did not count: what was left then.
        Leg::Resume(p) => (
            p.next_seq,
            p.owner.clone(),
            Deadline {
                at_ms: now + p.remaining_ms,
                timeout: Duration::from_millis(p.remaining_ms),
            },
            Some(p.park_id.clone()),
        ),
    };
    let events = Events::start_at(
        fleet.client.clone(),
        &fleet.config.subjects,
        &tenant,
        &id,
        first_seq,
    );
    let mut leg = leg;
    let (thread, place) = match &mut leg {
        Leg::Fresh { job, place, .. } => {
            let seat = crate::threads::Seat::of(
                job,
                &tenant,
                taken.delivery.stream_sequence,
                deadline.at_ms,
            );
            // A thread's job gives its permit back through its seat.
            let place = crate::threads::Place::holding(place.take());
            if let Some(seat) = &seat {
                seat.hold(place.clone());
            }
            (seat, Some(place))
        }
        Leg::Resume(p) => (
            crate::threads::Seat::resumed(&p.job, &tenant, deadline.at_ms, &p.messages),
            None,
        ),
    };
    let idempotency_key = leg.job().idempotency_key.clone();
    let run = Run {
        thread,
        place,
        idempotency_key,
        keep_alive: fleet.heartbeat.hold(&taken.msg),
        fleet,
        msg: taken.msg,
        id,
        tenant,
        owner,
        holder: taken.holder,
        number,
        started: taken.started,
        leased_at: taken.leased.at,
    };
    if resumed_from.is_some() {
        run.touch_key().await;
    }
    let outcome = run.race(plugins, leg, &events, &cancel, deadline).await;
    let outcome = Box::pin(run.leave_thread(outcome)).await;
    // Boxed, as the steps before the run are (`super::handle_holding`): brief,
    // and not to be carried while the run waits.
    let end = match outcome {
        None => {
            Box::pin(events.close()).await;
            End::Superseded
        }
        Some(outcome) => {
            Box::pin(run.speak(outcome, events, deadline.at_ms, &cancel, resumed_from)).await
        }
    };
    Box::pin(run.end(end)).await;
}

impl Run<'_> {
    /// The invocation's keys in the store: its tenant's, under its id.
    fn inv(&self) -> InvocationKey<'_> {
        InvocationKey::new(&self.tenant, &self.id)
    }

    /// The frame, raced against the deadline, cancels and the lease;
    /// `None` when another run took the invocation over.
    async fn race(
        &self,
        plugins: &Plugins,
        leg: Leg,
        events: &Events,
        cancel: &CancellationToken,
        deadline: Deadline,
    ) -> Option<Result<Finished, Failure>> {
        let fleet = self.fleet;
        let Deadline {
            at_ms: deadline_ms,
            timeout,
        } = deadline;
        let left = Duration::from_millis(deadline_ms.saturating_sub(toolfleet_protocol::now_ms()));
        // A delivery after the first replays the run: its calls may have
        // jobs and results already (see `CancelCheck::for_replay`).
        let cancel_check = if Delivery::of(&self.msg).attempt > 1 {
            CancelCheck::for_replay()
        } else {
            CancelCheck::default()
        };
        let cancelled_early = cancelled_before_start(fleet, self.inv(), &cancel_check).await;
        // Boxed: moved into the select below, it would otherwise take its
        // space twice in this future (once as the local, once in the
        // select), for the whole run.
        let invocation = Box::pin(async {
            match leg {
                Leg::Fresh {
                    job,
                    agent_depth,
                    inherited_approval,
                    ..
                } => {
                    let nesting = frame::Nesting {
                        agent_depth,
                        inherited_approval,
                        thread: self.thread.clone(),
                        place: self.place.clone(),
                    };
                    frame::invoke(
                        fleet,
                        plugins,
                        *job,
                        deadline_ms,
                        nesting,
                        events,
                        &cancel_check,
                    )
                    .await
                }
                // Boxed: rebuilding a parked invocation holds two of
                // them for a moment, which a fresh run should not carry.
                Leg::Resume(parked) => {
                    Box::pin(frame::resume(
                        fleet,
                        plugins,
                        *parked,
                        deadline_ms,
                        events,
                        (&cancel_check, self.thread.as_ref().map(|s| s.tap())),
                    ))
                    .await
                }
            }
        });
        let outcome = tokio::select! {
            biased;
            // Cancelled while it waited in the stream: nothing runs.
            _ = std::future::ready(()), if cancelled_early => Err(Failure::new(ChatErrorCode::Cancelled, "the invocation was cancelled before it started")),
            // Another delivery's run took the invocation over: it speaks for
            // the invocation now; this one stops without a word. (Renewed
            // here, beside the run, rather than on a task of its own.)
            end = keep_lease(fleet, self.inv(), (&self.holder, self.leased_at), &cancel_check) => match end {
                LeaseEnd::TakenOver | LeaseEnd::Lost => return None,
                LeaseEnd::Cancelled => Err(Failure::new(ChatErrorCode::Cancelled, "the invocation was cancelled")),
            },
            // A bug must end the invocation with an error event, not leave it
            // silent.
            r = std::panic::AssertUnwindSafe(invocation).catch_unwind(), if !left.is_zero() && !cancelled_early => {
                r.unwrap_or_else(|_| Err(Failure::new(ChatErrorCode::InternalError, "the orchestrator failed unexpectedly; see its log")))
            }
            _ = tokio::time::sleep(left) => Err(Failure::new(ChatErrorCode::DeadlineExceeded, format!("no answer within {} ms of submission", timeout.as_millis()))),
            _ = cancel.cancelled() => Err(Failure::new(ChatErrorCode::Cancelled, "the invocation was cancelled")),
        };
        // Only the run that holds the lease speaks for the invocation:
        // checked (and renewed, so nobody can take it over for the lease's
        // length) right before the terminal event, so a run that lost it
        // between two renewals adds no second terminal event, finish or ack.
        if let Ok(Lease::Busy { .. }) =
            Box::pin(fleet.store.lease(self.inv(), &self.holder, LEASE_TTL)).await
        {
            warn!(invocation_id = %self.id, "this run's lease was taken over while it ended; it stops without its terminal event");
            return None;
        }
        Some(outcome)
    }

    /// Lets the job's thread go as the run ended (a parked run keeps it),
    /// and says so when a newer job of the thread cut this one short.
    async fn leave_thread(
        &self,
        outcome: Option<Result<Finished, Failure>>,
    ) -> Option<Result<Finished, Failure>> {
        use crate::threads::{Leaving, record::Cut};
        let Some(seat) = &self.thread else {
            return outcome;
        };
        let how = match &outcome {
            None => Leaving::Superseded,
            // Held only once the park is kept ([`Self::speak`]): a park
            // that fails lets the thread go at once.
            Some(Ok(Finished::Parked(_))) => return outcome,
            Some(_) => Leaving::Ended,
        };
        let cut = seat.leave(self.fleet, how).await;
        match (outcome, cut) {
            (Some(Err(f)), Some(cut)) if f.code == ChatErrorCode::Cancelled => {
                let (how, kept) = match cut {
                    Cut::Keep => ("interrupted", "what it finished stays in the thread"),
                    Cut::Drop => ("rolled back", "nothing of its turn stays in the thread"),
                };
                Some(Err(Failure::new(
                    ChatErrorCode::Cancelled,
                    format!(
                        "{how} by a newer job of thread {}: {kept}",
                        seat.thread_id()
                    ),
                )))
            }
            (outcome, _) => outcome,
        }
    }

    /// Keeps the job's thread while it is parked (`Parked`), or lets it
    /// go when the park could not be kept (`Ended`).
    async fn hold_thread(&self, how: crate::threads::Leaving) {
        if let Some(seat) = &self.thread {
            seat.leave(self.fleet, how).await;
        }
    }

    /// Rewrites the job's idempotency key's record (it parked, or
    /// resumed), so its window cannot lapse while the job waits.
    async fn touch_key(&self) {
        if let Some(key) = &self.idempotency_key {
            super::idempotency::touch(self.fleet, (&self.tenant, key, &self.id)).await;
        }
    }

    /// Says how the run ended: the park kept (or, when it cannot be, an
    /// `approval_unavailable` error), or the terminal event.
    async fn speak(
        &self,
        outcome: Result<Finished, Failure>,
        events: Events,
        deadline_ms: u64,
        cancel: &CancellationToken,
        resumed_from: Option<String>,
    ) -> End {
        let resumed = resumed_from.is_some();
        let outcome = match outcome {
            Ok(Finished::Parked(parked)) => {
                let until_ms =
                    parked.expires_at_ms + deadline_ms.saturating_sub(toolfleet_protocol::now_ms());
                match self
                    .park(*parked, events, deadline_ms, cancel, resumed_from)
                    .await
                {
                    Ok(end) => {
                        self.hold_thread(crate::threads::Leaving::Parked(until_ms))
                            .await;
                        self.touch_key().await;
                        return end;
                    }
                    Err((failure, events)) => {
                        self.hold_thread(crate::threads::Leaving::Ended).await;
                        return self.terminal(Err(failure), events, resumed).await;
                    }
                }
            }
            Ok(Finished::Completed(completed)) => Ok(completed),
            Err(f) => Err(f),
        };
        self.terminal(outcome, events, resumed).await
    }

    /// Keeps the parked record, says its requests, and lets the run go:
    /// the id stays claimed for as long as it may wait, and the lease is
    /// given up for the run that resumes it.
    async fn park(
        &self,
        mut parked: Parked,
        events: Events,
        deadline_ms: u64,
        cancel: &CancellationToken,
        resumed_from: Option<String>,
    ) -> Result<End, (Failure, Events)> {
        let fleet = self.fleet;
        let id = &self.id;
        parked.owner = self.owner.clone();
        parked.remaining_ms = deadline_ms.saturating_sub(toolfleet_protocol::now_ms());
        let requests = parked.requests(fleet);
        parked.next_seq = events.next_seq() + requests.len() as u64;
        parked.resumed_from = resumed_from;
        if let Err(e) = fleet.keep_parked(&parked).await {
            let failure = match e {
                ParkError::Full(why) => Failure::new(ChatErrorCode::TooManyParked, why),
                ParkError::Store(e) => Failure::new(
                    ChatErrorCode::ApprovalUnavailable,
                    format!("a call needs approval, but the invocation cannot be parked: {e}"),
                ),
            };
            return Err((failure, events));
        }
        for request in requests {
            events.send(request);
        }
        events.close().await;
        // The id stays claimed for as long as it may wait.
        let wait = parked
            .expires_at_ms
            .saturating_sub(toolfleet_protocol::now_ms())
            + parked.remaining_ms
            + 3_600_000;
        if let Err(e) = fleet
            .store
            .keep_claim(self.inv(), Duration::from_millis(wait))
            .await
        {
            warn!(invocation_id = %id, error = %e, "cannot extend the parked invocation's claim past the store's TTL");
        }
        // A cancel that came while it parked found neither a run nor a
        // record: end it now.
        if cancel.is_cancelled() || fleet.store.is_cancelled(self.inv()).await.unwrap_or(false) {
            approvals::watch::cancel_parked(fleet, id, &self.tenant).await;
        }
        if let Err(e) = fleet.store.release_lease(self.inv(), &self.holder).await {
            warn!(invocation_id = %id, error = %e, "cannot give up the parked run's lease; its resumption waits for it to lapse");
        }
        Ok(End::Parked {
            held: parked
                .calls
                .iter()
                .filter(|c| matches!(c.state, CallState::Held))
                .count(),
            expires_at_ms: parked.expires_at_ms,
        })
    }

    /// Publishes the terminal event and marks the invocation finished, so
    /// a redelivery (its ack lost) does not run it again.
    async fn terminal(
        &self,
        outcome: Result<ChatEventBody, Failure>,
        events: Events,
        resumed: bool,
    ) -> End {
        let code = match outcome {
            Ok(completed) => {
                events.finish(completed);
                None
            }
            Err(f) => {
                warn!(code = %f.code, message = %f.message, "invocation failed");
                let code = f.code.to_string();
                events.finish(ChatEventBody::Error {
                    code: code.clone(),
                    message: f.message,
                    retry_after_ms: f.retry_after_ms,
                });
                Some(code)
            }
        };
        let span = tracing::Span::current();
        span.record(
            "otel.status_code",
            if code.is_none() { "ok" } else { "error" },
        );
        if let Some(code) = &code {
            span.record("error.type", code.as_str());
        }
        let mut stored = true;
        // A refusal or transient failure before any tool ran gives an
        // idempotency key back (`super::idempotency::releases`).
        let release = super::idempotency::releases(code.as_deref(), events.called_tools(), resumed);
        if let Some(terminal) = events.close_terminal().await {
            // The first job of an idempotency key leaves its outcome for
            // the repeats.
            if let Some(key) = &self.idempotency_key {
                super::idempotency::remember(
                    self.fleet,
                    (&self.tenant, key, &self.id),
                    &terminal.payload,
                    release,
                )
                .await;
            }
            if let Err(e) = self
                .fleet
                .store
                .finish(self.inv(), &self.owner, &terminal.payload)
                .await
            {
                warn!(error = %e, "cannot mark the invocation finished; if this job's ack is lost it runs again");
            }
            (self.fleet.tenant_store)
                .event_stored(&self.fleet.js, &self.fleet.config, &self.tenant)
                .await;
            stored = terminal.stored;
        }
        if resumed {
            self.fleet.forget_parked(&self.tenant, &self.id).await;
        }
        End::Terminal { code, stored }
    }

    /// The end of every run: the message acked (last: after its terminal
    /// event or park), the run forgotten, counted and logged.
    async fn end(self, end: End) {
        drop(self.keep_alive);
        if !matches!(end, End::Superseded | End::Terminal { stored: false, .. }) {
            ack(&self.msg).await;
        }
        self.fleet.forget_run(&self.id, &self.tenant, self.number);
        let metrics = &self.fleet.metrics;
        let took = self.started.elapsed();
        let label = match &end {
            End::Superseded => "superseded",
            End::Parked { .. } => "parked",
            End::Terminal { code: None, .. } => "completed",
            End::Terminal { code: Some(_), .. } => "error",
        };
        metrics.chat_jobs.with_label_values(&[label]).inc();
        metrics.chat_jobs_in_flight.dec();
        match end {
            End::Superseded => {}
            End::Parked {
                held,
                expires_at_ms,
            } => info!(
                outcome = label,
                held,
                expires_at_ms,
                duration_ms = took.as_millis() as u64,
                "chat job parked for approval"
            ),
            End::Terminal { code, .. } => {
                metrics.chat_job_duration.observe(took.as_secs_f64());
                // One line per finished job (the span carries its ids).
                info!(
                    outcome = label,
                    code = code.as_deref().unwrap_or(""),
                    duration_ms = took.as_millis() as u64,
                    "chat job finished"
                );
            }
        }
    }
}

/// The span of one run of an invocation (a chat job's, or a resumed
/// parked one's: `resumed` is then recorded).
pub(super) fn chat_job_span(id: &str, tenant: &str, attempt: u32) -> tracing::Span {
    tracing::info_span!(
        "chat_job",
        otel.name = "invoke_agent toolfleet",
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = "toolfleet",
        gen_ai.conversation.id = %id,
        invocation_id = %id,
        tenant = %tenant,
        attempt,
        resumed = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// The invocation's deadline (Unix ms) and its timeout: the job's own, or
/// the orchestrator's default, counted as [`deadline_ms`] does.
pub(super) fn invocation_deadline(
    fleet: &Fleet,
    job: &ChatJob,
    delivery: Delivery,
    now: u64,
) -> (u64, Duration) {
    let timeout = job
        .timeout_ms
        .map(Duration::from_millis)
        .unwrap_or(fleet.config.default_timeout);
    // A delayed job's time counts from its notBefore, not from its wait.
    let published = super::delay::counted_from(job, delivery.published_ms);
    (deadline_ms(published, now, timeout), timeout)
}

/// The invocation's deadline (Unix ms): `timeout` after the job was
/// published — time queued in the stream counts — or after `now` when the
/// publish time is unknown or in the future (clock skew).
fn deadline_ms(published_ms: Option<u64>, now: u64, timeout: Duration) -> u64 {
    published_ms.unwrap_or(now).min(now) + timeout.as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_counts_from_publication_never_from_the_future() {
        let t = Duration::from_secs(10);
        assert_eq!(deadline_ms(Some(1_000), 5_000, t), 11_000);
        assert_eq!(deadline_ms(None, 5_000, t), 15_000);
        // A publish time ahead of our clock is not trusted.
        assert_eq!(deadline_ms(Some(9_000), 5_000, t), 15_000);
    }
}
