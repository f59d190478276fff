//! The floors the fleet's figures are measured against (`toolfleet bench
//! --floor`): on the same NATS server, in the same run, at the same
//! concurrency, the bare transport a chat job rides on. On a shared machine
//! absolute numbers drift; the ratio of the fleet to these floors is the
//! result.
//!
//! - **JetStream work queue**: publish a job to a work-queue stream with
//!   file storage (the fleet's stream settings), await the publish ack, a
//!   pulling responder takes it, answers on core NATS to the reply subject
//!   named in a header, and acks it — one tool call's transport, with no
//!   validation, store or model.
//! - **Core NATS request-reply**: a request to a queue-group responder.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// What one floor measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FloorReport {
    pub name: &'static str,
    pub ops: usize,
    pub concurrency: usize,
    pub failed: usize,
    pub ops_per_sec: f64,
    pub latency_ms_p50: f64,
    pub latency_ms_p99: f64,
}

impl std::fmt::Display for FloorReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "floor {}: {} ops (concurrency {}), {} failed: {:.1} ops/s, p50 {:.2} ms, p99 {:.2} ms",
            self.name,
            self.ops,
            self.concurrency,
            self.failed,
            self.ops_per_sec,
            self.latency_ms_p50,
            self.latency_ms_p99
        )
    }
}

/// Runs `ops` operations `op(i)` at `concurrency`, timing each.
async fn measure<F, Fut>(name: &'static str, ops: usize, concurrency: usize, op: F) -> FloorReport
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    let results: Vec<Option<f64>> = futures::stream::iter(0..ops)
        .map(|i| {
            let fut = op(i);
            async move {
                let t = Instant::now();
                fut.await.then(|| t.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies: Vec<f64> = results.iter().flatten().copied().collect();
    latencies.sort_by(f64::total_cmp);
    FloorReport {
        name,
        ops,
        concurrency,
        failed: ops - latencies.len(),
        ops_per_sec: latencies.len() as f64 / elapsed.max(f64::EPSILON),
        latency_ms_p50: crate::bench::percentile(&latencies, 50.0),
        latency_ms_p99: crate::bench::percentile(&latencies, 99.0),
    }
}

const REPLY_TO: &str = "Floor-Reply-To";

/// The JetStream work-queue round trip (see the module docs). Creates and
/// deletes its own stream.
pub async fn jetstream_round_trip(
    client: &async_nats::Client,
    ops: usize,
    concurrency: usize,
) -> anyhow::Result<FloorReport> {
    let js = jetstream::new(client.clone());
    let id = uuid_token();
    let name = format!("FLOOR_{id}");
    let subject = format!("floor.{id}.jobs");
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    let consumer = stream
        .get_or_create_consumer(
            "floor",
            pull::Config {
                durable_name: Some("floor".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await?;
    let stop = CancellationToken::new();
    let responder = {
        let (client, stop) = (client.clone(), stop.clone());
        let mut messages = consumer.messages().await?;
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = stop.cancelled() => break,
                    m = messages.next() => match m { Some(Ok(m)) => m, _ => break },
                };
                if let Some(reply) = msg.headers.as_ref().and_then(|h| h.get(REPLY_TO)) {
                    let _ = client.publish(reply.to_string(), msg.payload.clone()).await;
                }
                let _ = msg.ack().await;
            }
        })
    };
    let inbox = client.new_inbox();
    let report = measure("jetstream work queue", ops, concurrency, |i| {
        let (client, js, subject) = (client.clone(), js.clone(), subject.clone());
        let reply = format!("{inbox}.{i}");
        async move {
            let Ok(mut sub) = client.subscribe(reply.clone()).await else {
                return false;
            };
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(REPLY_TO, reply.as_str());
            let body = bytes::Bytes::from_static(b"{\"arguments\":{}}");
            let Ok(ack) = js.publish_with_headers(subject, headers, body).await else {
                return false;
            };
            if ack.await.is_err() {
                return false;
            }
            matches!(
                tokio::time::timeout(Duration::from_secs(10), sub.next()).await,
                Ok(Some(_))
            )
        }
    })
    .await;
    stop.cancel();
    let _ = responder.await;
    let _ = js.delete_stream(&name).await;
    Ok(report)
}

/// The core NATS request-reply round trip to a queue-group responder.
pub async fn request_reply(
    client: &async_nats::Client,
    ops: usize,
    concurrency: usize,
) -> anyhow::Result<FloorReport> {
    let subject = format!("floor.{}.rr", uuid_token());
    let mut sub = client
        .queue_subscribe(subject.clone(), "floor".into())
        .await?;
    let responder = {
        let client = client.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(reply) = msg.reply {
                    let _ = client.publish(reply, msg.payload).await;
                }
            }
        })
    };
    client.flush().await?;
    let report = measure("core request-reply", ops, concurrency, |_| {
        let (client, subject) = (client.clone(), subject.clone());
        async move {
            client
                .request(subject, bytes::Bytes::from_static(b"{}"))
                .await
                .is_ok()
        }
    })
    .await;
    responder.abort();
    Ok(report)
}

/// A per-run token for the floor's subjects and stream.
fn uuid_token() -> String {
    toolfleet_protocol::client::new_invocation_id().replace('-', "_")
}
