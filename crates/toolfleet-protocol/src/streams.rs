//! The JetStream streams of the contract: one definition each, created by
//! whichever process starts first (orchestrators and workers alike).
//!
//! Replicas: streams (and the catalog bucket) are created with the
//! process's replica count ([`set_default_replicas`], set from
//! `--stream-replicas` when a process connects; 1 unless said), and their
//! consumers inherit it. An existing stream keeps the count it has: a
//! different one is logged, never changed behind the operator's back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::Subjects;
use crate::tools::ToolDefinition;

/// A stream could not be created or looked up.
#[derive(Debug, Clone, thiserror::Error)]
#[error("NATS: {0}")]
pub struct StreamError(String);

impl StreamError {
    /// `message`, with what to do when JetStream could not reserve a
    /// stream's size: every stream here has a byte limit, which the server
    /// reserves against its `max_file_store` (by default 75% of the disk
    /// free when it started).
    fn new(message: String) -> Self {
        if message.contains("10047") || message.contains("insufficient storage") {
            return Self(format!(
                "{message} — the server could not reserve the stream's byte limit: \
                 free disk where its JetStream store lives and restart it, or raise \
                 `max_file_store` in its `jetstream` block (each fleet prefix reserves \
                 about 2 GiB: the chat stream 1 GiB, events, history, parked approvals \
                 and dead letters 256 MiB each)"
            ));
        }
        Self(message)
    }

    /// What went wrong, without the `NATS:` of its display.
    pub fn detail(&self) -> &str {
        &self.0
    }
}

static DEFAULT_REPLICAS: AtomicUsize = AtomicUsize::new(1);

/// Sets the replica count of the streams and buckets this process creates
/// from now on (at least 1; a 3-node cluster takes 3).
pub fn set_default_replicas(replicas: usize) {
    DEFAULT_REPLICAS.store(replicas.max(1), Ordering::Relaxed);
}

/// The replica count of the streams and buckets this process creates.
pub fn default_replicas() -> usize {
    DEFAULT_REPLICAS.load(Ordering::Relaxed)
}

/// Chat jobs a tenant may have in the chat stream at once (waiting or
/// running) when the operator says nothing (`max_queued_jobs`).
pub const DEFAULT_MAX_QUEUED_JOBS: u64 = 10_000;

/// The chat stream's size limit: past it a submit is refused on its
/// publish ack (discard new) rather than the store filling for every
/// stream, or a queued job being dropped.
pub const CHAT_MAX_BYTES: i64 = 1024 * 1024 * 1024;

/// What the chat stream's limits say about the tenants: at most
/// `per_tenant` jobs on one submit subject (refused on the publish ack
/// past it), [`CHAT_MAX_BYTES`] in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatLimits {
    /// The per-subject limit: the largest queued-jobs cap of any tenant.
    pub per_tenant: u64,
}

impl Default for ChatLimits {
    fn default() -> Self {
        Self {
            per_tenant: DEFAULT_MAX_QUEUED_JOBS,
        }
    }
}

impl ChatLimits {
    /// The stream settings these limits set: a submit past either limit
    /// is refused (discard new), never a queued job dropped.
    fn apply(self, config: &mut stream::Config) {
        config.max_messages_per_subject = i64::try_from(self.per_tenant).unwrap_or(i64::MAX);
        config.discard_new_per_subject = true;
        config.discard = stream::DiscardPolicy::New;
        config.max_bytes = CHAT_MAX_BYTES;
    }

    /// Whether `config` already has them.
    fn held_by(self, config: &stream::Config) -> bool {
        let mut wanted = config.clone();
        self.apply(&mut wanted);
        wanted.max_messages_per_subject == config.max_messages_per_subject
            && wanted.discard_new_per_subject == config.discard_new_per_subject
            && wanted.discard == config.discard
            && wanted.max_bytes == config.max_bytes
    }
}

/// Creates the chat-job stream if it does not exist, with the default
/// [`ChatLimits`] (see [`ensure_chat_stream_with`]).
pub async fn ensure_chat_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    ensure_chat_stream_with(js, subjects, ChatLimits::default()).await
}

/// How long the chat stream keeps a job nobody took (its `max_age`): a
/// day. A job's `notBefore` must leave it room to run within it.
pub const CHAT_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Creates the chat-job stream if it does not exist, and brings an
/// existing one to `limits` (an older fleet's stream had none; an
/// operator's new caps take effect at the next orchestrator start).
pub async fn ensure_chat_stream_with(
    js: &jetstream::Context,
    subjects: &Subjects,
    limits: ChatLimits,
) -> Result<stream::Stream, StreamError> {
    // A job nobody took within a day has no one waiting for it.
    let stream = work_queue(
        js,
        subjects.chat_stream(),
        subjects.chat_submit_all(),
        Some(format!("{}.chat.submit", subjects.prefix())),
        CHAT_MAX_AGE.as_secs(),
        |config| {
            // Interactive and batch jobs (fair dispatch takes a tenant's
            // interactive ones first).
            config.subjects.push(subjects.chat_batch_all());
            limits.apply(config);
        },
    )
    .await?;
    if limits.held_by(&stream.cached_info().config) {
        return Ok(stream);
    }
    let name = subjects.chat_stream();
    let mut config = stream.cached_info().config.clone();
    limits.apply(&mut config);
    js.update_stream(config).await.map_err(|e| {
        StreamError::new(format!("stream {name}: setting its per-tenant limit: {e}"))
    })?;
    tracing::info!(stream = %name, per_tenant = limits.per_tenant, "chat stream limits set");
    js.get_stream(&name)
        .await
        .map_err(|e| StreamError::new(format!("stream {name}: {e}")))
}

/// How long the events stream keeps an invocation's latest event: past
/// the longest chat deadline (1 h), with room for a client that reconnects
/// late.
pub const EVENTS_MAX_AGE: Duration = Duration::from_secs(2 * 3600);

/// The events stream's size limit: past it the oldest invocations' events
/// go first, so it never takes the space the job streams need.
pub const EVENTS_MAX_BYTES: i64 = 256 * 1024 * 1024;

/// Creates the events stream if it does not exist: over every invocation's
/// events subject, keeping only the latest event of each (so the stream
/// stays one message per recent invocation, and that message is the
/// terminal event once the invocation ended), at most
/// [`EVENTS_MAX_BYTES`] (oldest first out), file storage, readable by
/// direct get, a 2-minute duplicate window (a terminal event published
/// again after a failover is stored once).
pub async fn ensure_events_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    let name = subjects.events_stream();
    let subject = subjects.chat_events_all();
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_messages_per_subject: 1,
            max_age: EVENTS_MAX_AGE,
            max_bytes: EVENTS_MAX_BYTES,
            duplicate_window: Duration::from_secs(120),
            allow_direct: true,
            discard: stream::DiscardPolicy::Old,
            num_replicas: default_replicas(),
            ..Default::default()
        })
        .await
        .map_err(|e| StreamError::new(format!("stream {name}: {e}")))?;
    check_subjects(stream.cached_info(), &subject)?;
    check_replicas(stream.cached_info());
    let found = &stream.cached_info().config;
    if !found.allow_direct || found.max_messages_per_subject != 1 {
        tracing::warn!(stream = %name, allow_direct = found.allow_direct,
            max_messages_per_subject = found.max_messages_per_subject,
            "the events stream exists with other settings: clients cannot read a missed answer \
             back unless it allows direct get, and it grows with every event unless it keeps one \
             message per subject (`nats stream edit`)");
    }
    Ok(stream)
}

/// How long the history stream keeps an invocation's events.
pub const HISTORY_MAX_AGE: Duration = EVENTS_MAX_AGE;
/// The history stream's size limit (oldest invocations out first).
pub const HISTORY_MAX_BYTES: i64 = 256 * 1024 * 1024;
/// The most history events kept per invocation (a run with more tool calls
/// loses its oldest; the terminal event, the newest, is always kept).
pub const HISTORY_PER_INVOCATION: i64 = 1_000;

/// Creates the history stream if it does not exist: over every
/// invocation's history subject (`<prefix>.chat.history.<tenant>.<inv>`,
/// where the orchestrator publishes every event but the deltas), keeping
/// each invocation's events in order for [`HISTORY_MAX_AGE`] — what
/// `toolfleet events` replays. Apart from the events stream, so the
/// many deltas of busy fleets never push out the kept answers there, and
/// the history never holds a token stream.
pub async fn ensure_history_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    limits_stream(
        js,
        subjects.history_stream(),
        subjects.chat_history_all(),
        stream::Config {
            max_messages_per_subject: HISTORY_PER_INVOCATION,
            max_age: HISTORY_MAX_AGE,
            max_bytes: HISTORY_MAX_BYTES,
            ..Default::default()
        },
    )
    .await
}

/// How long parked invocations and their decisions are kept at most: the
/// longest approval timeout a profile may set (a week), and a day more.
pub const PARKED_MAX_AGE: Duration = Duration::from_secs(8 * 24 * 3600);

/// Creates the decisions stream if it does not exist: a work queue over
/// every tenant's decision subject (approvals, denials, timeouts and
/// cancels of parked invocations, published by orchestrators only), taken
/// by the orchestrators' shared consumer. A 2-minute duplicate window makes
/// the first decision on a call the one that counts.
pub async fn ensure_decisions_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    work_queue(
        js,
        subjects.decisions_stream(),
        subjects.chat_decision_all(),
        None,
        PARKED_MAX_AGE.as_secs(),
        |_| {},
    )
    .await
}

/// The parked bucket's size limit: past it a new record is refused (the
/// bucket discards new), never an older one dropped, and the store is not
/// filled for every stream.
pub const PARKED_MAX_BYTES: i64 = 256 * 1024 * 1024;

/// The bucket of parked invocations (key: `<tenant>.<invocation id>`;
/// value: the orchestrator's record of the conversation and the held
/// calls), created on first use like the catalog bucket (the key-value
/// layout by hand, so nats-server 2.9 serves it), at most
/// [`PARKED_MAX_BYTES`] (a bucket an older fleet made gets the limit).
/// Entries leave when their invocation resumes to its end, or after
/// [`PARKED_MAX_AGE`].
pub async fn parked_bucket(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<jetstream::kv::Store, StreamError> {
    let name = subjects.parked_bucket();
    let store = key_value(
        js,
        &name,
        "toolfleet: invocations parked for approval",
        PARKED_MAX_AGE,
        false,
    )
    .await?;
    let config = &store.stream.cached_info().config;
    if config.max_bytes == PARKED_MAX_BYTES {
        return Ok(store);
    }
    let mut limited = config.clone();
    limited.max_bytes = PARKED_MAX_BYTES;
    js.update_stream(limited)
        .await
        .map_err(|e| StreamError::new(format!("bucket {name}: setting its size limit: {e}")))?;
    js.get_key_value(&name)
        .await
        .map_err(|e| StreamError::new(format!("bucket {name}: {e}")))
}

/// The bucket of per-tenant tool settings (key:
/// [`settings_key`](crate::settings_key); value: the settings object, as
/// JSON, secrets as references only), created on first use like the
/// others; entries never expire. The operator writes it, the
/// orchestrators read it (`ops/nats/auth.conf`).
pub async fn settings_bucket(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<jetstream::kv::Store, StreamError> {
    key_value(
        js,
        &subjects.settings_bucket(),
        "toolfleet: per-tenant tool settings",
        Duration::ZERO,
        false,
    )
    .await
}

/// The key-value bucket `name`, created on first use with the key-value
/// layout by hand (ADR-8: `KV_<name>` over `$KV.<name>.>`, one message per
/// key, rollups, direct get) rather than by `create_key_value`, whose
/// account-info query does not parse on nats-server 2.9, the version
/// Debian ships. A stream of that name over other subjects belongs to
/// someone else and is an error, never shared.
pub async fn key_value(
    js: &jetstream::Context,
    name: &str,
    description: &str,
    max_age: Duration,
    deny_delete: bool,
) -> Result<jetstream::kv::Store, StreamError> {
    let subject = format!("$KV.{name}.>");
    let store = match js.get_key_value(name).await {
        Ok(store) => store,
        Err(_) => {
            let stream = js
                .get_or_create_stream(stream::Config {
                    name: format!("KV_{name}"),
                    description: Some(description.into()),
                    subjects: vec![subject.clone()],
                    max_messages_per_subject: 1,
                    discard: stream::DiscardPolicy::New,
                    allow_rollup: true,
                    deny_delete,
                    allow_direct: true,
                    duplicate_window: Duration::from_secs(120),
                    max_age,
                    storage: stream::StorageType::File,
                    num_replicas: default_replicas(),
                    ..Default::default()
                })
                .await
                .map_err(|e| StreamError::new(format!("bucket {name}: {e}")))?;
            check_subjects(stream.cached_info(), &subject)?;
            js.get_key_value(name)
                .await
                .map_err(|e| StreamError::new(format!("bucket {name}: {e}")))?
        }
    };
    check_subjects(store.stream.cached_info(), &subject)?;
    check_replicas(store.stream.cached_info());
    Ok(store)
}

/// Creates, if it does not exist, the limits stream `name` over `subject`
/// (file storage, oldest out, the process's replicas) with `limits`'s age,
/// size and per-subject caps, and checks what it found.
async fn limits_stream(
    js: &jetstream::Context,
    name: String,
    subject: String,
    limits: stream::Config,
) -> Result<stream::Stream, StreamError> {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::Old,
            num_replicas: default_replicas(),
            ..limits
        })
        .await
        .map_err(|e| StreamError::new(format!("stream {name}: {e}")))?;
    check_subjects(stream.cached_info(), &subject)?;
    check_replicas(stream.cached_info());
    Ok(stream)
}

/// How long dead letters are kept.
pub const DEAD_LETTERS_MAX_AGE: Duration = Duration::from_secs(14 * 24 * 3600);
/// The most bytes of dead letters kept (oldest first out).
pub const DEAD_LETTERS_MAX_BYTES: i64 = 256 * 1024 * 1024;

/// Creates the dead-letter stream if it does not exist: a limits stream
/// over `<prefix>.deadletter.>` (workers and orchestrators publish dead
/// letters there on core NATS), kept [`DEAD_LETTERS_MAX_AGE`] and at most
/// [`DEAD_LETTERS_MAX_BYTES`], file storage: what `toolfleet deadletters`
/// lists, shows and replays.
pub async fn ensure_dead_letters_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    limits_stream(
        js,
        subjects.dead_letters_stream(),
        subjects.dead_letters_all(),
        stream::Config {
            max_age: DEAD_LETTERS_MAX_AGE,
            max_bytes: DEAD_LETTERS_MAX_BYTES,
            ..Default::default()
        },
    )
    .await
}

/// Creates the sinks stream if it does not exist: a work queue over
/// `<prefix>.sink.>`, where an orchestrator puts the events of an
/// invocation with a sink (one message per event and destination) and the
/// orchestrators' relay takes them. A delivery is retried for minutes at
/// most: an hour covers it.
pub async fn ensure_sinks_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    let name = subjects.sinks_stream();
    let subject = subjects.sink_all();
    // An event is up to the server's `max_payload` (a terminal event is
    // made to fit it), more than a job: no size cap of the stream's own.
    let stream = js
        .get_or_create_stream(stream::Config {
            max_message_size: -1,
            ..work_queue_config(&name, &subject, 3600)
        })
        .await
        .map_err(|e| StreamError::new(format!("stream {name}: {e}")))?;
    check_subjects(stream.cached_info(), &subject)?;
    check_replicas(stream.cached_info());
    Ok(stream)
}

/// Creates the tool-job stream if it does not exist.
pub async fn ensure_tools_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    // Past the longest chat deadline (1 h) nobody waits for a result.
    work_queue(
        js,
        subjects.tools_stream(),
        subjects.tools_all(),
        None,
        2 * 3600,
        |_| {},
    )
    .await
}

/// Attempts of a tool job before its worker dead-letters it, by default
/// (the worker SDK's `WorkerConfig::max_attempts`).
pub const TOOL_MAX_ATTEMPTS: u32 = 3;
/// The shortest ack wait of a tool's consumer.
pub const TOOL_MIN_ACK_WAIT: Duration = Duration::from_secs(2);
/// The longest ack wait of a tool's consumer, by default (the worker
/// SDK's `WorkerConfig::ack_wait`).
pub const TOOL_MAX_ACK_WAIT: Duration = Duration::from_secs(30);

/// The ack wait of `def`'s consumer: a quarter of the tool's timeout,
/// within [`TOOL_MIN_ACK_WAIT`] and `longest` (see the worker SDK's
/// `WorkerConfig::ack_wait_for` for why).
pub fn tool_ack_wait(def: &ToolDefinition, longest: Duration) -> Duration {
    (def.timeout() / 4).clamp(TOOL_MIN_ACK_WAIT, longest.max(TOOL_MIN_ACK_WAIT))
}

/// The durable pull consumer of one JetStream tool, shared by every copy
/// of its pool: named [`Subjects::tool_consumer`], filtered on the tool's
/// subject, explicit acks, and `max_deliver` two past the worker's own
/// `max_attempts` (the worker terminates first; this is the backstop for a
/// job that kills its worker every time). Workers make it as they start;
/// an orchestrator makes the consumers of a declared pool's tools before
/// any worker of the pool has started (scale from zero), with the worker
/// defaults ([`TOOL_MAX_ACK_WAIT`], [`TOOL_MAX_ATTEMPTS`]), so either may
/// come first.
pub fn tool_consumer_config(
    subjects: &Subjects,
    def: &ToolDefinition,
    ack_wait: Duration,
    max_attempts: u32,
) -> jetstream::consumer::pull::Config {
    jetstream::consumer::pull::Config {
        durable_name: Some(subjects.tool_consumer(&def.id)),
        filter_subject: subjects.tool(&def.id),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait,
        max_deliver: i64::from(max_attempts) + 2,
        max_ack_pending: 10_000,
        ..Default::default()
    }
}

/// A work-queue stream of jobs: file storage, a 2-minute duplicate window
/// (`Nats-Msg-Id`), room for the largest job plus headers.
///
/// A stream of that name that already exists is used only if it holds
/// exactly `subject`: otherwise another fleet or an older configuration
/// owns the name, and sharing it would mix their jobs with ours. The one
/// exception is a stream this fleet made before over exactly `legacy` (the
/// chat stream before submit subjects named a tenant): it is moved to
/// `subject` in place, keeping the jobs it holds.
async fn work_queue(
    js: &jetstream::Context,
    name: String,
    subject: String,
    legacy: Option<String>,
    max_age_secs: u64,
    tweak: impl FnOnce(&mut stream::Config),
) -> Result<stream::Stream, StreamError> {
    let mut config = work_queue_config(&name, &subject, max_age_secs);
    tweak(&mut config);
    let wanted = config.subjects.clone();
    let mut stream = js
        .get_or_create_stream(config)
        .await
        .map_err(|e| StreamError::new(format!("stream {name}: {e}")))?;
    let found = stream.cached_info().config.subjects.clone();
    // An earlier release's stream: over the legacy subject, or over some
    // of today's subjects only (the chat stream before batch jobs).
    let older = legacy.as_ref().is_some_and(|l| found == [l.clone()])
        || (found.len() < wanted.len() && found.iter().all(|f| wanted.contains(f)));
    if older {
        let mut moved = stream.cached_info().config.clone();
        moved.subjects = wanted.clone();
        js.update_stream(moved).await.map_err(|e| {
            StreamError::new(format!("stream {name}: moving it off {found:?}: {e}"))
        })?;
        tracing::info!(stream = %name, from = ?found, to = ?wanted, "stream moved to the new subjects");
        stream = js
            .get_stream(&name)
            .await
            .map_err(|e| StreamError::new(format!("stream {name}: {e}")))?;
    }
    check_subject_set(stream.cached_info(), &wanted)?;
    check_replicas(stream.cached_info());
    Ok(stream)
}

/// The settings of a work-queue stream of jobs over `subject` (see
/// [`ensure_tools_stream`]); the bench's JetStream floor uses them too, so
/// it measures the same kind of stream.
pub fn work_queue_config(name: &str, subject: &str, max_age_secs: u64) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: vec![subject.to_string()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_message_size: crate::MAX_JOB_BYTES as i32 + 64 * 1024,
        max_age: Duration::from_secs(max_age_secs),
        num_replicas: default_replicas(),
        ..Default::default()
    }
}

/// Logs an existing stream whose replica count is not this process's.
pub(crate) fn check_replicas(info: &stream::Info) {
    let wanted = default_replicas();
    if info.config.num_replicas != wanted {
        tracing::warn!(stream = %info.config.name, replicas = info.config.num_replicas, wanted,
            "the stream exists with another replica count; it keeps its own (change it with \
             `nats stream edit --replicas`)");
    }
}

/// The existing stream `info` must hold exactly `subject`.
pub(crate) fn check_subjects(info: &stream::Info, subject: &str) -> Result<(), StreamError> {
    check_subject_set(info, &[subject.to_owned()])
}

/// The existing stream `info` must hold exactly `subjects` (any order).
fn check_subject_set(info: &stream::Info, subjects: &[String]) -> Result<(), StreamError> {
    let found = &info.config.subjects;
    if found.len() == subjects.len() && subjects.iter().all(|s| found.contains(s)) {
        return Ok(());
    }
    Err(StreamError::new(format!(
        "stream {} exists over subjects {found:?}, not {subjects:?}: another fleet or an \
         older configuration owns that name; use another subject prefix, or delete or \
         edit the stream if it is no longer used",
        info.config.name
    )))
}
