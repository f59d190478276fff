//! The relay: every orchestrator takes routed events off the sinks stream
//! (one durable consumer, shared) and delivers each to its destination.
//!
//! Success acks. A transient failure naks with our own delay (doubling
//! from `--sink-backoff-ms`, never the consumer's `backoff`), until the
//! attempt cap; then, or at once for a refusal (SSRF, a missing secret, a
//! 3xx or 4xx answer), a dead letter on `<p>.deadletter.sink` and `term`.
//! Deliveries run concurrently (up to `--sink-concurrency`), so one slow
//! receiver does not hold the others.

use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::{DeadLetter, DeadLetterKind, headers};
use tracing::{info, warn};

use super::webhook::{DeliveryError, Webhooks};
use super::{Destination, SinkMetrics};
use crate::Fleet;

/// Runs the relay until `shutdown`. Deliveries in flight then are cut
/// short; their events come back to a relay after the ack wait.
pub(crate) async fn run(
    fleet: Arc<Fleet>,
    consumer: jetstream::consumer::PullConsumer,
    shutdown: CancellationToken,
) {
    let settings = fleet.config.sinks.clone();
    let webhooks = match Webhooks::new(&settings) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(error = %e, "the sink relay cannot start; routed events wait in the sinks stream");
            return;
        }
    };
    let permits = Arc::new(Semaphore::new(settings.concurrency.max(1)));
    info!(stream = %fleet.config.subjects.sinks_stream(), "sink relay delivering routed events");
    while !shutdown.is_cancelled() {
        // No more pulled than can be delivered at once: a message waiting
        // for a permit must not outlive its ack wait (it would come back,
        // counted as an attempt that was never made).
        let mut messages = match consumer
            .stream()
            .max_messages_per_batch(settings.concurrency.max(1))
            .messages()
            .await
        {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "the sink relay cannot pull; trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                }
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                m = messages.next() => m,
            };
            let msg = match next {
                Some(Ok(msg)) => msg,
                // Missed heartbeats and the like: the stream goes on.
                Some(Err(e)) => {
                    warn!(error = %e, "the sink relay's pull reported an error");
                    continue;
                }
                None => break,
            };
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let fleet = fleet.clone();
            let webhooks = webhooks.clone();
            tokio::spawn(async move {
                deliver(&fleet, &webhooks, msg).await;
                drop(permit);
            });
        }
    }
}

/// The event's identity, read from its body.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EventId {
    invocation_id: String,
    seq: u64,
}

/// A routed event as read off the sinks stream.
struct Routed {
    destination: Destination,
    id: EventId,
    /// The sinks subject's (`<p>.sink.<tenant>.<inv>`), which only the
    /// invocation's orchestrator publishes.
    tenant: String,
}

/// Reads a sinks-stream message; why it cannot be delivered otherwise.
fn read(fleet: &Fleet, msg: &jetstream::Message) -> Result<Routed, String> {
    let destination = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(headers::SINK))
        .ok_or_else(|| format!("no {} header", headers::SINK))
        .and_then(|v| Destination::decode(v.as_str()))?;
    let id = serde_json::from_slice::<EventId>(&msg.payload)
        .map_err(|e| format!("the body is not a chat event: {e}"))?;
    let tenant = fleet
        .config
        .subjects
        .parse_sink(msg.subject.as_str())
        .map(|(t, _)| t.to_owned())
        .ok_or_else(|| format!("{} is not a sinks subject", msg.subject))?;
    // The destination is checked again as if it were new: the header is
    // only as trustworthy as whoever could publish on the sinks stream.
    trusted(fleet, &destination, &tenant)?;
    Ok(Routed {
        destination,
        id,
        tenant,
    })
}

/// Delivers one routed event to its destination, and acks, naks or
/// dead-letters it.
async fn deliver(fleet: &Fleet, webhooks: &Webhooks, msg: jetstream::Message) {
    let (attempt, stream_sequence) = match msg.info() {
        Ok(i) => (
            u32::try_from(i.delivered).unwrap_or(u32::MAX),
            i.stream_sequence,
        ),
        Err(_) => (1, 0),
    };
    let routed = match read(fleet, &msg) {
        Ok(routed) => routed,
        Err(error) => {
            warn!(error = %error, "a sinks-stream message cannot be delivered");
            let dead = DeliveryError::failed("bad_sink_message", error, false);
            return dead_letter(fleet, &msg, None, attempt, stream_sequence, &dead).await;
        }
    };
    let kind = routed.destination.kind();
    let event_id = format!("{}:{}", routed.id.invocation_id, routed.id.seq);
    let started = Instant::now();
    let outcome = match &routed.destination {
        Destination::Webhook {
            url,
            secret_env,
            sink,
        } => {
            let secret = fleet.config.env.var(secret_env);
            webhooks
                .post(
                    url,
                    sink.is_none(),
                    secret,
                    secret_env,
                    &routed.tenant,
                    &event_id,
                    msg.payload.clone(),
                )
                .await
        }
        Destination::Relay { subject, .. } => relay(fleet, subject, &event_id, &msg).await,
    };
    let metrics = &fleet.metrics.sinks;
    metrics
        .duration
        .with_label_values(&[kind])
        .observe(started.elapsed().as_secs_f64());
    let Err(e) = outcome else {
        count(metrics, kind, "ok");
        if let Err(e) = msg.ack().await {
            warn!(error = %e, kind, event_id, "a delivered event's ack was lost; it may be delivered again");
        }
        return;
    };
    let settings = &fleet.config.sinks;
    if e.retryable && attempt < settings.max_attempts {
        count(metrics, kind, "retry");
        let delay = settings.backoff(attempt + 1);
        warn!(kind, event_id, attempt, code = %e.code, error = %e.message, retry_in_ms = delay.as_millis() as u64, "sink delivery failed; retrying");
        let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
        return;
    }
    let outcome = if e.refused {
        "refused"
    } else {
        "dead_lettered"
    };
    count(metrics, kind, outcome);
    let destination = routed.destination.describe();
    warn!(kind, event_id, attempt, code = %e.code, error = %e.message, sink = %destination, "sink delivery dead-lettered");
    let mut e = e;
    e.message = format!("{destination}: {}", e.message);
    let invocation_id = Some(routed.id.invocation_id.as_str());
    dead_letter(fleet, &msg, invocation_id, attempt, stream_sequence, &e).await;
}

/// Whether `destination` is one an invocation of `tenant` may have: a
/// webhook's secret variable is its configured sink's (or, for a job's
/// own, the default one), a relay passes the relay rules again.
fn trusted(fleet: &Fleet, destination: &Destination, tenant: &str) -> Result<(), String> {
    let settings = &fleet.config.sinks;
    let configured = |name: &str| fleet.config.profiles.sinks.get(name);
    match destination {
        Destination::Webhook {
            secret_env, sink, ..
        } => {
            let expected = match sink {
                None => Some(settings.default_secret_env.as_str()),
                Some(name) => configured(name).and_then(|s| s.secret_env.as_deref()),
            };
            if expected != Some(secret_env.as_str()) {
                return Err("the webhook names a secret variable that is not its sink's".to_owned());
            }
            Ok(())
        }
        Destination::Relay { subject, sink } => {
            if let Some(name) = sink
                && configured(name).and_then(|s| s.relay.as_deref()) != Some(subject.as_str())
            {
                return Err("the relay is not its configured sink's".to_owned());
            }
            settings.check_relay(
                &fleet.config.subjects,
                subject,
                sink.is_none().then_some(tenant),
            )
        }
    }
}

fn count(metrics: &SinkMetrics, kind: &str, outcome: &str) {
    metrics.deliveries.with_label_values(&[kind, outcome]).inc();
}

/// Publishes the event on the relay subject (core NATS, with its
/// `Toolfleet-Event-Id`; no `Nats-Msg-Id`: a crashed run's rerun numbers
/// its events from 0 again, and a stream deduplicating on the id would
/// drop them) and waits until the server has it.
async fn relay(
    fleet: &Fleet,
    subject: &str,
    event_id: &str,
    msg: &jetstream::Message,
) -> Result<(), DeliveryError> {
    let failed = |e: String| DeliveryError::failed("relay_failed", e, true);
    let mut h = async_nats::HeaderMap::new();
    h.insert(headers::EVENT_ID, event_id);
    fleet
        .client
        .publish_with_headers(subject.to_owned(), h, msg.payload.clone())
        .await
        .map_err(|e| failed(format!("cannot publish: {e}")))?;
    match tokio::time::timeout(fleet.config.sinks.request_timeout, fleet.client.flush()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(failed(format!("cannot flush: {e}"))),
        Err(_) => Err(failed("the NATS server did not take it in time".into())),
    }
}

/// Publishes the sink dead letter (the event in `job`) and terminates the
/// message.
async fn dead_letter(
    fleet: &Fleet,
    msg: &jetstream::Message,
    invocation_id: Option<&str>,
    attempts: u32,
    stream_sequence: u64,
    e: &DeliveryError,
) {
    let dead = DeadLetter {
        kind: DeadLetterKind::Sink,
        stream: fleet.config.subjects.sinks_stream(),
        stream_sequence,
        invocation_id: invocation_id.map(str::to_owned),
        call_id: None,
        tool_id: None,
        attempts,
        code: e.code.clone(),
        error: e.message.clone(),
        // The message's own headers name the webhook's URL, whose path or
        // query may be a credential: none are kept.
        headers: Default::default(),
        raw_headers: None,
        job: toolfleet_protocol::dead_letter_job(&msg.payload),
    };
    let published = toolfleet_service::dead_letters::publish(
        &fleet.client,
        &fleet.config.subjects,
        &fleet.metrics.dead_letters,
        &dead,
    )
    .await;
    if let Err(err) = published {
        warn!(error = %err, "cannot publish a sink dead letter");
    }
    let _ = msg.ack_with(AckKind::Term).await;
}
