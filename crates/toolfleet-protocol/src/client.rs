//! Submitting chat jobs and following their events: what `toolfleet chat`
//! and the demo use, and the model for a client in any language
//! (subscribe to the events subject of the job's tenant, then publish the
//! job to that tenant's submit subject).
//!
//! # How big a job may be
//!
//! A chat job is one NATS message, so two limits apply, and [`submit`] and
//! [`chat`] check both before anything is sent, failing with
//! [`ClientError::JobTooLarge`] (code `job_too_large`) rather than with an
//! error from NATS:
//!
//! - the fleet's: the encoded job (its JSON body) may be at most
//!   [`MAX_JOB_BYTES`] (1 MiB); orchestrators refuse anything bigger;
//! - the NATS server's: body and headers together may be at most the
//!   `max_payload` the connected server advertises, 1 MiB unless its
//!   configuration says otherwise. With the default, that is the tighter
//!   limit for a job just under [`MAX_JOB_BYTES`], since the headers count
//!   too.
//!
//! The job schema allows bigger jobs (long conversations, attached
//! documents); a caller that may build one should catch `job_too_large`
//! and send less.
//!
//! # When the queue is full
//!
//! Each tenant may have a capped number of chat jobs in the chat stream at
//! once (waiting or running: the operator's `max_queued_jobs`), and the
//! stream as a whole a capped size. JetStream refuses a job past either on
//! its publish ack, at once, and stores nothing: [`submit`] and [`chat`]
//! fail with [`ClientError::QueueFull`] (code `queue_full`). A client in
//! another language sees the publish ack's error: code 503, error code
//! 10077, description `maximum messages per subject exceeded` (the
//! tenant's cap) or `maximum bytes exceeded` (the stream). A tenant whose
//! cap is below the largest any tenant has is held to it when its job is
//! taken instead: that job ends with an `error` event of code
//! `queue_full`.
//!
//! # No `Nats-Msg-Id` on chat jobs
//!
//! A chat job carries no `Nats-Msg-Id`, and a client in any language must
//! not set one: the chat stream's duplicate window is shared by every
//! tenant, and any client may write any message id, so a job that carries
//! one can be dropped by whoever published that id first. The fleet
//! deduplicates by (tenant, invocation id) itself: a resubmission of an id
//! (a retry after a lost publish ack) is not run twice, and the one run's
//! events, or its terminal event from the events stream ([`last_event`]),
//! answer it.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use crate::usage::Usage;
use crate::{
    ChatEvent, ChatEventBody, ChatJob, Envelope, MAX_JOB_BYTES, Reference, Subjects, encode,
    headers,
};

/// Why [`chat`], [`submit`], [`cancel`] or [`call_tool`] failed.
/// [`ClientError::code`] names the kind as a short string a caller can match or
/// print.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The NATS connection failed, or a reply or stored event could not be
    /// read.
    #[error("NATS: {0}")]
    Nats(String),
    /// The job was not published or JetStream did not store it.
    #[error("the fleet did not accept the job: {0}")]
    Rejected(String),
    /// No terminal event (or tool result) arrived within the given time.
    #[error("no terminal event within {0:?} (is an orchestrator running?)")]
    Timeout(Duration),
    /// The invocation ended with an `error` event.
    #[error("{code}: {message}")]
    Failed {
        /// The event's code ([`ChatErrorCode`](crate::ChatErrorCode) names
        /// the fixed ones).
        code: String,
        /// What went wrong, in words.
        message: String,
    },
    /// The encoded job is bigger than `limit` allows; nothing was sent. See
    /// [the module docs](self#how-big-a-job-may-be).
    #[error(
        "the job is too large: {size} bytes, more than the {limit} bytes {limit_of}; \
         send less (fewer or shorter messages, smaller attached documents)"
    )]
    JobTooLarge {
        /// What the limit counts: the body for [`JobSizeLimit::Fleet`],
        /// body and headers for [`JobSizeLimit::Server`].
        size: usize,
        /// The limit it went over, in bytes.
        limit: usize,
        /// Whose limit that is: the fleet's or the NATS server's.
        limit_of: JobSizeLimit,
    },
    /// JetStream refused the job on its publish ack because the tenant
    /// has its cap of jobs queued (waiting or running), or the chat stream
    /// is full; nothing was stored. See [the module
    /// docs](self#when-the-queue-is-full).
    #[error(
        "the fleet refused the job: {0}; wait for some of the tenant's queued jobs to finish, \
         then submit again"
    )]
    QueueFull(QueueFull),
}

/// Which limit a [`ClientError::QueueFull`] job met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    /// The tenant's queued jobs (the chat stream's per-subject limit,
    /// `maximum messages per subject exceeded`).
    Tenant,
    /// The whole chat stream (`maximum bytes exceeded` or `maximum
    /// messages exceeded`).
    Stream,
}

impl fmt::Display for QueueFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QueueFull::Tenant => "the tenant has as many chat jobs queued as it may (queue_full)",
            QueueFull::Stream => "the chat stream is full (queue_full)",
        })
    }
}

impl QueueFull {
    /// The limit a refused publish met, read from JetStream's answer:
    /// the server says which limit in the error's description (its error
    /// code, 10077, is the same for every store failure).
    pub fn of(error: &async_nats::jetstream::context::PublishError) -> Option<Self> {
        let source = std::error::Error::source(error)?;
        let js = source.downcast_ref::<async_nats::jetstream::Error>()?;
        let said = js.to_string();
        if said.contains("maximum messages per subject exceeded") {
            Some(QueueFull::Tenant)
        } else if said.contains("maximum bytes exceeded")
            || said.contains("maximum messages exceeded")
        {
            Some(QueueFull::Stream)
        } else {
            None
        }
    }
}

/// Whose limit a [`ClientError::JobTooLarge`] job went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobSizeLimit {
    /// [`MAX_JOB_BYTES`], on the encoded body: what orchestrators accept.
    Fleet,
    /// The connected NATS server's `max_payload`, on body and headers.
    Server,
}

impl fmt::Display for JobSizeLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobSizeLimit::Fleet => "the fleet accepts in a job body (MAX_JOB_BYTES)",
            JobSizeLimit::Server => {
                "the NATS server accepts in one message, headers included (its max_payload)"
            }
        })
    }
}

impl ClientError {
    /// The error's kind as a short code: `nats`, `rejected`, `timeout`,
    /// `job_too_large`, `queue_full`, or for [`ClientError::Failed`] the `error` event's own
    /// code.
    pub fn code(&self) -> &str {
        match self {
            ClientError::Nats(_) => "nats",
            ClientError::Rejected(_) => "rejected",
            ClientError::Timeout(_) => "timeout",
            ClientError::Failed { code, .. } => code,
            ClientError::JobTooLarge { .. } => "job_too_large",
            ClientError::QueueFull(_) => "queue_full",
        }
    }
}

/// The answer of a completed invocation.
#[derive(Debug, Clone)]
pub struct ChatOutcome {
    /// The answer, its `[doc:N]` markers renumbered 1..k to match
    /// [`ChatOutcome::references`].
    pub text: String,
    /// Only the references the answer cites, numbered 1..k as in the text.
    pub references: Vec<Reference>,
    /// Tokens of every model call of the invocation, summed.
    pub usage: Usage,
    /// Cost in USD from the configured price table; `None` when a model used
    /// has no price.
    pub cost_usd: Option<f64>,
    /// Each model call: model, purpose, usage, cost, attempts.
    pub llm_calls: Vec<crate::LlmCall>,
    /// Model rounds the answer took (0 for an answer without a model call).
    pub rounds: u32,
    /// Every event received, in order.
    pub events: Vec<ChatEvent>,
}

/// Submits `job` and waits for its terminal event, calling `on_event` for
/// every event on the way.
///
/// # Errors
///
/// As [`submit`] (a job too large fails before anything is subscribed or
/// sent), then [`ClientError::Timeout`] without a terminal event in time,
/// [`ClientError::Failed`] for an `error` event.
pub async fn chat(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
    timeout: Duration,
    on_event: impl FnMut(&ChatEvent),
) -> Result<ChatOutcome, ClientError> {
    chat_with_headers(
        client,
        subjects,
        job,
        async_nats::HeaderMap::new(),
        timeout,
        on_event,
    )
    .await
}

/// [`chat`], with `extra` headers on the job's message (an agent tool's
/// nested job carries [`headers::PARENT_INVOCATION`] and
/// [`headers::AGENT_DEPTH`]); they count against the server's
/// `max_payload` like the others.
///
/// # Errors
///
/// As [`chat`].
pub async fn chat_with_headers(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
    extra: async_nats::HeaderMap,
    timeout: Duration,
    mut on_event: impl FnMut(&ChatEvent),
) -> Result<ChatOutcome, ClientError> {
    let message = SubmitMessage::with_headers(client, job, extra)?;
    let mut sub = client
        .subscribe(subjects.chat_events(job.tenant(), &job.invocation_id))
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    // The subscription must be registered before the job can produce events.
    client
        .flush()
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    message.publish(client, subjects).await?;

    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut events = Vec::new();
    // After a quiet check that found no answer the next one waits twice as
    // long (a slow model keeps thousands of clients quiet at once).
    let mut quiet = QUIET_CHECK;
    let mut check_at = tokio::time::Instant::now() + quiet;
    let mut warned = false;
    loop {
        let event = match tokio::time::timeout_at(deadline.min(check_at), sub.next()).await {
            Ok(Some(msg)) => match Envelope::ChatEvent.decode::<ChatEvent>(&msg.payload) {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "malformed chat event ignored");
                    continue;
                }
            },
            Ok(None) => return Err(ClientError::Nats("event subscription closed".into())),
            Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(ClientError::Timeout(timeout));
            }
            // Quiet for a while: the terminal event may have been lost on
            // its way (a NATS node died, this connection broke). The events
            // stream keeps it.
            Err(_) => {
                let now = tokio::time::Instant::now();
                quiet = (quiet * 2).min(MAX_QUIET_CHECK);
                check_at = now + quiet;
                let wait = deadline.saturating_duration_since(now).min(LAST_EVENT_WAIT);
                match stored_event(client, subjects, job.tenant(), &job.invocation_id, wait).await {
                    Ok(Some(e)) if e.body.is_terminal() => e,
                    Ok(_) => continue,
                    Err(e) => {
                        if !warned {
                            tracing::warn!(error = %e, "cannot read the invocation's stored events (the events stream, or the permission to read it, is missing); only live events count");
                            warned = true;
                        }
                        continue;
                    }
                }
            }
        };
        quiet = QUIET_CHECK;
        check_at = tokio::time::Instant::now() + quiet;
        // Parked for a person's approval: the wait does not count against
        // the job's time, so the client waits until the approval would
        // time out, and the job's time after that.
        if let ChatEventBody::ApprovalRequested { expires_at_ms, .. } = &event.body {
            let until = Duration::from_millis(expires_at_ms.saturating_sub(crate::now_ms()));
            deadline = deadline.max(tokio::time::Instant::now() + until + timeout);
        }
        on_event(&event);
        let body = event.body.clone();
        events.push(event);
        match body {
            ChatEventBody::Completed {
                text,
                references,
                usage,
                cost_usd,
                llm_calls,
                rounds,
            } => {
                return Ok(ChatOutcome {
                    text,
                    references,
                    usage,
                    cost_usd,
                    llm_calls,
                    rounds,
                    events,
                });
            }
            ChatEventBody::Error { code, message, .. } => {
                return Err(ClientError::Failed { code, message });
            }
            _ => {}
        }
    }
}

/// How long [`chat`] hears nothing before it reads the invocation's latest
/// stored event ([`last_event`]).
const QUIET_CHECK: Duration = Duration::from_secs(3);

/// The longest quiet spell between two such reads.
const MAX_QUIET_CHECK: Duration = Duration::from_secs(30);

/// How long [`last_event`] waits for the server.
const LAST_EVENT_WAIT: Duration = Duration::from_secs(5);

/// The latest event of invocation `invocation_id` of `tenant` that the
/// events stream (`<P>_EVENTS`) keeps: the terminal event once the
/// invocation ended (kept for two hours), so a client that missed it —
/// its connection broke, it subscribed late, it restarted — can still read
/// the answer. `None` when the stream holds no event of that invocation.
/// A direct get (`$JS.API.DIRECT.GET.<P>_EVENTS.<events subject>`): a
/// client allowed that subject for its tenant's events reads nobody
/// else's.
///
/// # Errors
///
/// [`ClientError::Nats`] when the server does not answer (no events
/// stream, no permission) or the stored event cannot be read.
pub async fn last_event(
    client: &async_nats::Client,
    subjects: &Subjects,
    tenant: &str,
    invocation_id: &str,
) -> Result<Option<ChatEvent>, ClientError> {
    stored_event(client, subjects, tenant, invocation_id, LAST_EVENT_WAIT).await
}

/// [`last_event`], waiting at most `wait` for the server.
async fn stored_event(
    client: &async_nats::Client,
    subjects: &Subjects,
    tenant: &str,
    invocation_id: &str,
    wait: Duration,
) -> Result<Option<ChatEvent>, ClientError> {
    let subject = format!(
        "$JS.API.DIRECT.GET.{}.{}",
        subjects.events_stream(),
        subjects.chat_events(tenant, invocation_id)
    );
    let reply = tokio::time::timeout(wait, client.request(subject, Bytes::new()))
        .await
        .map_err(|_| ClientError::Nats("the events stream did not answer".into()))?
        .map_err(|e| ClientError::Nats(format!("reading the events stream: {e}")))?;
    match reply.status {
        Some(async_nats::StatusCode::NOT_FOUND) => Ok(None),
        Some(status) if !status.is_success() => Err(ClientError::Nats(format!(
            "reading the events stream: status {status}{}",
            reply
                .description
                .map(|d| format!(" ({d})"))
                .unwrap_or_default()
        ))),
        _ => Envelope::ChatEvent
            .decode::<ChatEvent>(&reply.payload)
            .map(Some)
            .map_err(|e| ClientError::Nats(format!("a stored event cannot be read: {e}"))),
    }
}

/// Publishes a chat job to the JetStream stream and waits for it to be
/// stored. It sets no `Nats-Msg-Id` ([why](self#no-nats-msg-id-on-chat-jobs)):
/// a retried submit is a second message, which the fleet runs once (by
/// tenant and invocation id) and answers through the one run's events.
///
/// The job's size is checked first (see [the module
/// docs](self#how-big-a-job-may-be)): its encoded body against
/// [`MAX_JOB_BYTES`], then body and headers against the `max_payload` the
/// connected NATS server advertises (1 MiB by default).
///
/// # Errors
///
/// [`ClientError::JobTooLarge`] (code `job_too_large`, naming both sizes)
/// when either limit is exceeded, before anything is sent;
/// [`ClientError::Rejected`] when JetStream does not store the job.
pub async fn submit(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
) -> Result<(), ClientError> {
    SubmitMessage::new(client, job)?
        .publish(client, subjects)
        .await
}

/// Asks the fleet to stop invocation `invocation_id` of `tenant`: a running
/// invocation ends with `error: cancelled`, a queued one is answered so when
/// it starts (the cancel is remembered), and its running tool calls stop.
///
/// # Errors
///
/// [`ClientError::Nats`] when the cancel cannot be sent.
pub async fn cancel(
    client: &async_nats::Client,
    subjects: &Subjects,
    tenant: &str,
    invocation_id: &str,
) -> Result<(), ClientError> {
    publish_flushed(client, subjects.chat_cancel(tenant, invocation_id)).await
}

/// Publishes an empty message to `subject` and waits until the server has
/// it.
async fn publish_flushed(client: &async_nats::Client, subject: String) -> Result<(), ClientError> {
    client
        .publish(subject, Bytes::new())
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    client
        .flush()
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))
}

/// Asks the fleet to stop one tool call `call_id` of invocation
/// `invocation_id` of `tenant`: the worker running it (or about to) stops
/// its tool and answers `call_cancelled`; the invocation goes on, its
/// model told the call was cancelled.
///
/// # Errors
///
/// [`ClientError::Nats`] when the cancel cannot be sent.
pub async fn cancel_call(
    client: &async_nats::Client,
    subjects: &Subjects,
    tenant: &str,
    invocation_id: &str,
    call_id: &str,
) -> Result<(), ClientError> {
    publish_flushed(
        client,
        subjects.chat_cancel_call(tenant, invocation_id, call_id),
    )
    .await
}

/// Calls tool `tool` once, as a client of the fleet rather than a chat job
/// (an MCP client of `toolfleet mcp serve`, a script): a fresh invocation
/// of `tenant`, the job on the tool's subject (through JetStream, or as a
/// request to its direct endpoint), and its result awaited on a reply
/// subject of the fleet until `timeout`; `on_progress` hears the tool's
/// progress messages on the way.
///
/// # Errors
///
/// [`ClientError::Rejected`] when the job cannot be published or stored;
/// [`ClientError::Timeout`] without a result in time; [`ClientError::Nats`]
/// for a reply that cannot be read.
pub async fn call_tool(
    client: &async_nats::Client,
    subjects: &Subjects,
    tool: &crate::tools::ToolDefinition,
    tenant: &str,
    arguments: serde_json::Value,
    timeout: Duration,
    on_progress: impl FnMut(&str),
) -> Result<crate::ToolResult, ClientError> {
    let ids = CallIds::new();
    call_tool_as(
        client,
        subjects,
        tool,
        tenant,
        &ids,
        arguments,
        timeout,
        on_progress,
    )
    .await
}

/// The ids a call of [`call_tool_as`] runs under, chosen by its caller
/// (who may then name the call, or cancel it with [`cancel_call`], while
/// it runs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallIds {
    /// The fresh invocation the call is the one tool job of.
    pub invocation_id: String,
    /// The call's id within it.
    pub call_id: String,
}

impl CallIds {
    /// Fresh ids: a new invocation, a new call.
    pub fn new() -> Self {
        Self {
            invocation_id: new_invocation_id(),
            call_id: format!("call_{}", uuid::Uuid::new_v4().simple()),
        }
    }
}

impl Default for CallIds {
    fn default() -> Self {
        Self::new()
    }
}

/// [`call_tool`] under ids the caller chose.
///
/// # Errors
///
/// As [`call_tool`].
#[allow(clippy::too_many_arguments)]
pub async fn call_tool_as(
    client: &async_nats::Client,
    subjects: &Subjects,
    tool: &crate::tools::ToolDefinition,
    tenant: &str,
    ids: &CallIds,
    arguments: serde_json::Value,
    timeout: Duration,
    mut on_progress: impl FnMut(&str),
) -> Result<crate::ToolResult, ClientError> {
    let call_id = ids.call_id.clone();
    let reply_to = format!("{}.{call_id}", subjects.reply_inbox());
    let mut invocation = crate::InvocationContext::new(ids.invocation_id.clone());
    invocation.tenant = Some(tenant.to_string());
    invocation.deadline_ms = Some(crate::now_ms() + timeout.as_millis() as u64);
    let call = crate::CallContext {
        invocation,
        call_id,
        tool_id: tool.id.clone(),
        attempt: 1,
        reply_to: reply_to.clone(),
        citation_floor: 0,
        new_call: true,
    };
    let body = encode(&crate::ToolJob {
        arguments,
        settings: None,
    });
    let mut replies = client
        .subscribe(reply_to)
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    client
        .flush()
        .await
        .map_err(|e| ClientError::Nats(e.to_string()))?;
    match tool.delivery {
        crate::tools::Delivery::Jetstream => {
            async_nats::jetstream::new(client.clone())
                .publish_with_headers(subjects.tool(&tool.id), call.to_headers(), body)
                .await
                .map_err(|e| ClientError::Rejected(e.to_string()))?
                .await
                .map_err(|e| ClientError::Rejected(e.to_string()))?;
        }
        crate::tools::Delivery::Direct => {
            client
                .publish_with_reply_and_headers(
                    subjects.tool_direct(&tool.id),
                    call.reply_to.clone(),
                    call.to_headers(),
                    body,
                )
                .await
                .map_err(|e| ClientError::Rejected(e.to_string()))?;
        }
    }
    // Until the result is in, giving up on it (a timeout, the caller's
    // future dropped) cancels the call in the fleet: its tool stops.
    let mut pending = CancelOnDrop {
        client: client.clone(),
        subject: Some(subjects.chat_cancel_call(
            tenant,
            &call.invocation.invocation_id,
            &call.call_id,
        )),
    };
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let msg = match tokio::time::timeout_at(deadline, replies.next()).await {
            Ok(Some(msg)) => msg,
            Ok(None) => return Err(ClientError::Nats("the reply subscription closed".into())),
            Err(_) => return Err(ClientError::Timeout(timeout)),
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(ClientError::Rejected(format!(
                "no worker serves {}",
                tool.id
            )));
        }
        match Envelope::ToolReply.decode::<crate::ToolReply>(&msg.payload) {
            Ok(crate::ToolReply::Progress { message, .. }) => on_progress(&message),
            Ok(crate::ToolReply::Result(result)) => {
                pending.subject = None;
                return Ok(*result);
            }
            Err(e) => return Err(ClientError::Nats(format!("a reply cannot be read: {e}"))),
        }
    }
}

/// Publishes a call's cancel when dropped, unless its result came.
struct CancelOnDrop {
    client: async_nats::Client,
    subject: Option<String>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(subject) = self.subject.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let client = self.client.clone();
            rt.spawn(async move {
                let _ = client.publish(subject, Bytes::new()).await;
                let _ = client.flush().await;
            });
        }
    }
}

/// A chat job encoded for publishing, already checked against both size
/// limits.
struct SubmitMessage {
    subject_tenant: String,
    priority: crate::Priority,
    headers: async_nats::HeaderMap,
    body: Bytes,
}

impl SubmitMessage {
    fn new(client: &async_nats::Client, job: &ChatJob) -> Result<Self, ClientError> {
        Self::with_headers(client, job, async_nats::HeaderMap::new())
    }

    fn with_headers(
        client: &async_nats::Client,
        job: &ChatJob,
        mut h: async_nats::HeaderMap,
    ) -> Result<Self, ClientError> {
        if !crate::valid_tenant(job.tenant()) {
            return Err(ClientError::Rejected(format!(
                "tenant {:?} is not 1-64 of [A-Za-z0-9_-]",
                job.tenant()
            )));
        }
        if !crate::valid_invocation_id(&job.invocation_id) {
            return Err(ClientError::Rejected(format!(
                "invocation id {:?} is not 1-128 of [A-Za-z0-9_-]",
                job.invocation_id
            )));
        }
        let body = encode(job);
        if body.len() > MAX_JOB_BYTES {
            return Err(ClientError::JobTooLarge {
                size: body.len(),
                limit: MAX_JOB_BYTES,
                limit_of: JobSizeLimit::Fleet,
            });
        }
        // No `Nats-Msg-Id`: the stream's duplicate window is shared by every
        // tenant, so a message id another client wrote first would drop
        // this job (see the module docs).
        h.insert(headers::INVOCATION_ID, job.invocation_id.as_str());
        // The trace context rides where every tracing library looks.
        if let Some(tp) = job.traceparent.as_deref() {
            h.insert(headers::TRACEPARENT, tp);
        }
        // What the connected server advertised in its INFO (async-nats
        // keeps it current across reconnects; before the first INFO, the
        // NATS default).
        let max_payload = client.max_payload();
        let size = header_wire_len(&h) + body.len();
        if size > max_payload {
            return Err(ClientError::JobTooLarge {
                size,
                limit: max_payload,
                limit_of: JobSizeLimit::Server,
            });
        }
        Ok(Self {
            subject_tenant: job.tenant().to_string(),
            priority: job.priority.unwrap_or_default(),
            headers: h,
            body,
        })
    }

    async fn publish(
        self,
        client: &async_nats::Client,
        subjects: &Subjects,
    ) -> Result<(), ClientError> {
        let js = async_nats::jetstream::new(client.clone());
        js.publish_with_headers(
            subjects.chat_lane(&self.subject_tenant, self.priority),
            self.headers,
            self.body,
        )
        .await
        .map_err(|e| ClientError::Rejected(e.to_string()))?
        .await
        .map_err(|e| match QueueFull::of(&e) {
            Some(full) => ClientError::QueueFull(full),
            None => ClientError::Rejected(e.to_string()),
        })?;
        Ok(())
    }
}

/// The size of a header block on the wire, as the server counts it against
/// `max_payload` (`HPUB`'s header bytes): `NATS/1.0\r\n`, then
/// `Name: value\r\n` per value, then `\r\n`.
fn header_wire_len(h: &async_nats::HeaderMap) -> usize {
    const VERSION_LINE: usize = "NATS/1.0\r\n".len();
    const END: usize = "\r\n".len();
    let fields: usize = h
        .iter()
        .flat_map(|(name, values)| {
            values.iter().map(move |value| {
                AsRef::<[u8]>::as_ref(name).len() + ": ".len() + value.as_str().len() + END
            })
        })
        .sum();
    VERSION_LINE + fields + END
}

/// A new invocation id.
pub fn new_invocation_id() -> String {
    format!("inv-{}", uuid::Uuid::new_v4().simple())
}

/// A chat job with one user message.
pub fn question(text: &str) -> ChatJob {
    ChatJob {
        invocation_id: new_invocation_id(),
        messages: vec![crate::ChatMessage {
            role: crate::ChatRole::User,
            content: text.to_string(),
        }],
        profile: None,
        tenant: None,
        user: None,
        resource: None,
        data_source_id: None,
        attached_documents: Vec::new(),
        timeout_ms: None,
        traceparent: None,
        tools: Vec::new(),
        surface: None,
        sink: None,
        priority: None,
        thread_id: None,
        multitask_strategy: None,
        idempotency_key: None,
        not_before: None,
        budget: None,
    }
}
