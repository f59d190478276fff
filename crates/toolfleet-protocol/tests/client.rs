//! `client::submit` and `client::chat` against a real `nats-server` (JetStream
//! on) whose `max_payload` is set in its config: a job too large for the
//! server or for the fleet fails with `job_too_large` before anything is
//! sent, and a job exactly at either limit goes through.

use std::future::Future;
use std::time::Duration;

use toolfleet_protocol::client::{self, ClientError, JobSizeLimit};
use toolfleet_protocol::streams::ensure_chat_stream;
use toolfleet_protocol::{ChatJob, DEFAULT_PREFIX, MAX_JOB_BYTES, Subjects, encode};

const STEP: Duration = Duration::from_secs(20);

/// Every await in these tests is bounded.
async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(STEP, future)
        .await
        .expect("test step timed out")
}

/// The harness's `nats-server` (JetStream on, free port, killed on drop).
type Nats = toolfleet_testkit::servers::NatsServer;

/// A connected client, the chat stream created, and a way to count what
/// it holds.
struct Fleet {
    client: async_nats::Client,
    subjects: Subjects,
    stream: async_nats::jetstream::stream::Stream,
}

impl Fleet {
    async fn start(nats: &Nats) -> Self {
        let client = within(async_nats::connect(nats.url()))
            .await
            .expect("connect");
        let subjects = Subjects::new(DEFAULT_PREFIX).expect("subjects");
        let js = async_nats::jetstream::new(client.clone());
        let stream = within(ensure_chat_stream(&js, &subjects))
            .await
            .expect("chat stream");
        Self {
            client,
            subjects,
            stream,
        }
    }

    async fn stored(&self) -> u64 {
        within(self.stream.get_info())
            .await
            .expect("stream info")
            .state
            .messages
    }

    async fn submit(&self, job: &ChatJob) -> Result<(), ClientError> {
        within(client::submit(&self.client, &self.subjects, job)).await
    }
}

/// A one-question job whose encoded body is exactly `bytes` long.
fn job_of(bytes: usize) -> ChatJob {
    let mut job = client::question("");
    let empty = encode(&job).len();
    assert!(
        bytes >= empty,
        "{bytes} is less than an empty job ({empty})"
    );
    // ASCII letters encode as themselves: one byte each.
    job.messages[0].content = "a".repeat(bytes - empty);
    assert_eq!(encode(&job).len(), bytes);
    job
}

/// The header block `submit` sends, as NATS counts it: written out here
/// rather than taken from the client, so a miscount there shows.
fn headers_len(job: &ChatJob) -> usize {
    let id = &job.invocation_id;
    format!("NATS/1.0\r\nToolfleet-Invocation-Id: {id}\r\n\r\n").len()
}

fn assert_too_large(err: ClientError, size: usize, limit: usize, limit_of: JobSizeLimit) {
    assert_eq!(err.code(), "job_too_large", "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("{size} bytes")) && text.contains(&format!("{limit} bytes")),
        "both sizes are named: {text}"
    );
    match err {
        ClientError::JobTooLarge {
            size: s,
            limit: l,
            limit_of: of,
        } => assert_eq!((s, l, of), (size, limit, limit_of)),
        other => panic!("expected job_too_large, got {other:?}"),
    }
}

#[tokio::test]
async fn a_job_over_the_servers_max_payload_is_refused_before_it_is_sent() {
    const MAX_PAYLOAD: usize = 4096;
    let nats = Nats::start_with_max_payload(MAX_PAYLOAD).expect("nats-server");
    let fleet = Fleet::start(&nats).await;
    assert_eq!(fleet.client.server_info().max_payload, MAX_PAYLOAD);

    // Body and headers exactly at the limit: the server takes it.
    let probe = job_of(100);
    let fits = job_of(MAX_PAYLOAD - headers_len(&probe));
    assert_eq!(encode(&fits).len() + headers_len(&fits), MAX_PAYLOAD);
    fleet
        .submit(&fits)
        .await
        .expect("a job at the limit is stored");
    assert_eq!(fleet.stored().await, 1);

    // One byte more, though the body alone would fit: refused, with both
    // sizes, and nothing reaches the stream.
    let over = job_of(MAX_PAYLOAD - headers_len(&probe) + 1);
    assert!(encode(&over).len() < MAX_PAYLOAD);
    let err = fleet.submit(&over).await.expect_err("one byte too many");
    assert_too_large(err, MAX_PAYLOAD + 1, MAX_PAYLOAD, JobSizeLimit::Server);

    // `chat` says the same at once, instead of waiting for events that
    // cannot come: its own wait (60 s) is longer than `within`'s step, so
    // a chat that waited would fail the step.
    let err = within(client::chat(
        &fleet.client,
        &fleet.subjects,
        &over,
        Duration::from_secs(60),
        |_| {},
    ))
    .await
    .expect_err("too large to chat");
    assert_too_large(err, MAX_PAYLOAD + 1, MAX_PAYLOAD, JobSizeLimit::Server);
    assert_eq!(fleet.stored().await, 1, "nothing more was stored");

    // The connection is still good.
    fleet
        .submit(&job_of(200))
        .await
        .expect("a small job still goes through");
    assert_eq!(fleet.stored().await, 2);
}

#[tokio::test]
async fn a_job_over_max_job_bytes_is_refused_whatever_the_server_allows() {
    // A server that would take twice as much as the fleet accepts.
    let nats = Nats::start_with_max_payload(2 * MAX_JOB_BYTES).expect("nats-server");
    let fleet = Fleet::start(&nats).await;
    assert_eq!(fleet.client.server_info().max_payload, 2 * MAX_JOB_BYTES);

    fleet
        .submit(&job_of(MAX_JOB_BYTES))
        .await
        .expect("a job body at MAX_JOB_BYTES is stored");
    assert_eq!(fleet.stored().await, 1);

    let err = fleet
        .submit(&job_of(MAX_JOB_BYTES + 1))
        .await
        .expect_err("over MAX_JOB_BYTES");
    assert_too_large(err, MAX_JOB_BYTES + 1, MAX_JOB_BYTES, JobSizeLimit::Fleet);
    assert_eq!(fleet.stored().await, 1);
}

/// Issue 29: a tenant at its cap of queued jobs is refused on the publish
/// ack at once (`queue_full`), nothing is stored, and another tenant still
/// submits; an older fleet's chat stream, made without limits, gets them.
#[tokio::test]
async fn a_tenant_over_its_queued_cap_is_refused_on_the_publish_ack_while_another_submits() {
    use toolfleet_protocol::client::QueueFull;
    use toolfleet_protocol::streams::{ChatLimits, ensure_chat_stream_with};

    let nats = Nats::start().expect("nats-server");
    // The stream as a fleet before issue 29 made it: no per-subject limit.
    let fleet = Fleet::start(&nats).await;
    let js = async_nats::jetstream::new(fleet.client.clone());
    let stream = within(ensure_chat_stream_with(
        &js,
        &fleet.subjects,
        ChatLimits { per_tenant: 2 },
    ))
    .await
    .expect("the stream gets the limits");
    let config = &stream.cached_info().config;
    assert_eq!(config.max_messages_per_subject, 2);
    assert!(config.discard_new_per_subject);

    let of = |tenant: &str| {
        let mut job = client::question("queued");
        job.tenant = Some(tenant.into());
        job
    };
    for _ in 0..2 {
        fleet.submit(&of("acme")).await.expect("within acme's cap");
    }
    let err = fleet
        .submit(&of("acme"))
        .await
        .expect_err("acme's third queued job is refused");
    assert!(
        matches!(err, ClientError::QueueFull(QueueFull::Tenant)),
        "{err:?}"
    );
    assert_eq!(err.code(), "queue_full");
    assert!(err.to_string().contains("queued"), "{err}");
    assert_eq!(fleet.stored().await, 2, "nothing of the refused job stored");
    fleet
        .submit(&of("globex"))
        .await
        .expect("globex still submits");
    assert_eq!(fleet.stored().await, 3);
}
