//! The relay: every orchestrator takes routed events off the sinks stream
//! (one durable consumer, shared) and delivers each to its destination.
//!
//! Success acks. A transient failure naks with our own delay (doubling
//! from `--sink-backoff-ms`, never the consumer's `backoff`), until the
//! attempt cap; then, or at once for a refusal (SSRF, a missing secret, a
//! 3xx or 4xx answer), a dead letter on `<p>.deadletter.sink` and `term`.
//! Deliveries run concurrently (up to `--sink-concurrency`), and each
//! tenant has a share of them (up to `--sink-tenant-concurrency` at once,
//! less than the whole): an event whose tenant's share is in use is put
//! back on the stream for a moment (`nak` with [`DEFER`], counted
//! `deferred`, no attempt spent) and the relay takes the next, so one
//! tenant's slow receiver delays only that tenant's events. The share is
//! per orchestrator: with several, a tenant holds at most its share in
//! each, and the others keep the rest of each. Attempts are counted in
//! the store ([`toolfleet_store::CitationStore::sink_attempt`]), since
//! NATS counts a deferral as a delivery. An event older than
//! `--sink-deliver-within-secs` when its turn comes, or whose next retry
//! would be, is dead-lettered `sink_expired` (with its tenant in the dead
//! letter's headers) instead of being left for the sinks stream's max age
//! to drop without a word.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// How long an event whose tenant's share is in use stays back on the
/// stream before a relay takes it again.
pub const DEFER: Duration = Duration::from_secs(1);

/// Deliveries in flight here, by tenant.
#[derive(Default)]
struct Shares(std::sync::Mutex<std::collections::HashMap<String, usize>>);

impl Shares {
    /// Takes one of `tenant`'s `cap` deliveries, if one is free.
    fn take(self: &Arc<Self>, tenant: &str, cap: usize) -> Option<Share> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(tenant.to_owned()).or_default();
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(Share {
            shares: self.clone(),
            tenant: tenant.to_owned(),
        })
    }
}

/// One delivery of a tenant's share, given back when dropped.
struct Share {
    shares: Arc<Shares>,
    tenant: String,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut map = self.shares.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.tenant);
            }
        }
    }
}

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
    let shares = Arc::new(Shares::default());
    let share_cap = settings
        .tenant_concurrency
        .clamp(1, settings.concurrency.max(1));
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
            // A message without a tenant is dead-lettered at once by
            // `deliver`: it takes no share.
            let tenant = fleet.config.subjects.parse_sink(msg.subject.as_str());
            let share = match tenant.map(|(t, _)| (t, shares.take(t, share_cap))) {
                Some((tenant, None)) => {
                    count(&fleet.metrics.sinks, kind_of(&msg), "deferred");
                    tracing::debug!(
                        tenant,
                        "the tenant's share of sink deliveries is in use; deferred"
                    );
                    let _ = msg.ack_with(AckKind::Nak(Some(DEFER))).await;
                    continue;
                }
                Some((_, share)) => share,
                None => None,
            };
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            let fleet = fleet.clone();
            let webhooks = webhooks.clone();
            tokio::spawn(async move {
                deliver(&fleet, &webhooks, msg).await;
                drop(permit);
                drop(share);
            });
        }
    }
}

/// The `kind` label of a sinks-stream message, from its destination
/// header (a relay, or else a webhook).
fn kind_of(msg: &jetstream::Message) -> &'static str {
    msg.headers
        .as_ref()
        .and_then(|h| h.get(headers::SINK))
        .and_then(|v| Destination::decode(v.as_str()).ok())
        .map_or("webhook", |d| d.kind())
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
    let (delivered, stream_sequence, age) = match msg.info() {
        Ok(i) => (
            u32::try_from(i.delivered).unwrap_or(u32::MAX),
            i.stream_sequence,
            age_of(i.published.unix_timestamp_nanos()),
        ),
        Err(_) => (1, 0, Duration::ZERO),
    };
    let mut dead = Dead {
        attempts: delivered,
        stream_sequence,
        invocation_id: None,
        tenant: None,
    };
    let routed = match read(fleet, &msg) {
        Ok(routed) => routed,
        Err(error) => {
            warn!(error = %error, "a sinks-stream message cannot be delivered");
            let e = DeliveryError::failed("bad_sink_message", error, false);
            return dead_letter(fleet, &msg, &dead, &e).await;
        }
    };
    dead.invocation_id = Some(routed.id.invocation_id.clone());
    dead.tenant = Some(routed.tenant.clone());
    let kind = routed.destination.kind();
    let event_id = format!("{}:{}", routed.id.invocation_id, routed.id.seq);
    let within = fleet.config.sinks.deliver_within;
    if age >= within {
        count(&fleet.metrics.sinks, kind, "expired");
        dead.attempts = attempts_so_far(fleet, &routed.tenant, stream_sequence, delivered).await;
        let e = expired(within, age, "it waited for its turn");
        warn!(kind, event_id, tenant = %routed.tenant, age_s = age.as_secs(), "routed event expired before delivery; dead-lettered");
        return dead_letter(fleet, &msg, &dead, &e).await;
    }
    let attempt = attempt(fleet, &routed.tenant, stream_sequence, delivered).await;
    dead.attempts = attempt;
    let Err(e) = send(fleet, webhooks, &routed, &event_id, &msg).await else {
        count(&fleet.metrics.sinks, kind, "ok");
        if let Err(e) = msg.ack().await {
            warn!(error = %e, kind, event_id, "a delivered event's ack was lost; it may be delivered again");
        }
        return;
    };
    failed(fleet, &msg, &routed, &dead, e, age, &event_id).await;
}

/// This attempt's number: counted in the store (deferrals are not
/// attempts); NATS's delivery count when the store cannot answer.
async fn attempt(fleet: &Fleet, tenant: &str, stream_sequence: u64, delivered: u32) -> u32 {
    let stream = fleet.config.subjects.sinks_stream();
    match fleet
        .store
        .sink_attempt(tenant, &stream, stream_sequence, SINKS_MAX_AGE)
        .await
    {
        Ok(n) => u32::try_from(n).unwrap_or(u32::MAX),
        Err(e) => {
            warn!(error = %e, "cannot count the sink attempt in the store; using NATS's delivery count");
            delivered
        }
    }
}

/// The attempts made before now, for the dead letter of an event that
/// expired waiting (no attempt is made for it).
async fn attempts_so_far(fleet: &Fleet, tenant: &str, stream_sequence: u64, delivered: u32) -> u32 {
    attempt(fleet, tenant, stream_sequence, delivered)
        .await
        .saturating_sub(1)
}

/// The sinks stream's max age: how long an attempt count is kept.
const SINKS_MAX_AGE: Duration = Duration::from_secs(3600);

/// One delivery attempt to the event's destination, timed.
async fn send(
    fleet: &Fleet,
    webhooks: &Webhooks,
    routed: &Routed,
    event_id: &str,
    msg: &jetstream::Message,
) -> Result<(), DeliveryError> {
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
                    event_id,
                    msg.payload.clone(),
                )
                .await
        }
        Destination::Relay { subject, .. } => relay(fleet, subject, event_id, msg).await,
    };
    fleet
        .metrics
        .sinks
        .duration
        .with_label_values(&[routed.destination.kind()])
        .observe(started.elapsed().as_secs_f64());
    outcome
}

/// After a failed attempt: a retry (our own delay), or a dead letter —
/// at the attempt cap, for a refusal, or when the retry would come after
/// `--sink-deliver-within-secs`.
async fn failed(
    fleet: &Fleet,
    msg: &jetstream::Message,
    routed: &Routed,
    dead: &Dead,
    e: DeliveryError,
    age: Duration,
    event_id: &str,
) {
    let (metrics, settings) = (&fleet.metrics.sinks, &fleet.config.sinks);
    let kind = routed.destination.kind();
    let attempt = dead.attempts;
    let within = settings.deliver_within;
    let delay = settings.backoff(attempt + 1);
    if e.retryable && attempt < settings.max_attempts && age + delay >= within {
        // Its next attempt would come too late: dead now, saying why.
        count(metrics, kind, "expired");
        let last = format!(
            "its next attempt would be too late; the last failed: {}",
            e.message
        );
        warn!(kind, event_id, tenant = %routed.tenant, attempt, code = %e.code, "routed event expires before its next attempt; dead-lettered");
        return dead_letter(fleet, msg, dead, &expired(within, age, &last)).await;
    }
    if e.retryable && attempt < settings.max_attempts {
        count(metrics, kind, "retry");
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
    dead_letter(fleet, msg, dead, &e).await;
}

/// How long ago `published_ns` (unix nanoseconds) was; zero if ahead.
fn age_of(published_ns: i128) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let now = i128::try_from(now).unwrap_or(i128::MAX);
    Duration::from_nanos(u64::try_from(now - published_ns).unwrap_or(0))
}

/// The dead letter of an event not delivered within `within` (`age` old).
fn expired(within: Duration, age: Duration, why: &str) -> DeliveryError {
    DeliveryError::failed(
        "sink_expired",
        format!(
            "not delivered within {} s of its event ({} s old): {why}",
            within.as_secs(),
            age.as_secs()
        ),
        false,
    )
}

/// What a sink dead letter says of its message besides the error.
struct Dead {
    attempts: u32,
    stream_sequence: u64,
    invocation_id: Option<String>,
    /// The sinks subject's tenant, when the message could be read.
    tenant: Option<String>,
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
async fn dead_letter(fleet: &Fleet, msg: &jetstream::Message, what: &Dead, e: &DeliveryError) {
    let dead = DeadLetter {
        kind: DeadLetterKind::Sink,
        stream: fleet.config.subjects.sinks_stream(),
        stream_sequence: what.stream_sequence,
        invocation_id: what.invocation_id.clone(),
        call_id: None,
        tool_id: None,
        attempts: what.attempts,
        code: e.code.clone(),
        error: e.message.clone(),
        // The message's own headers name the webhook's URL, whose path or
        // query may be a credential: none are kept. Its tenant (from the
        // sinks subject) is.
        headers: what
            .tenant
            .iter()
            .map(|t| (headers::TENANT.to_owned(), t.clone()))
            .collect(),
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
