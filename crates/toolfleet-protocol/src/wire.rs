//! The public contract: subject names, header names, the invocation context
//! carried in headers, and the envelopes of chat jobs, chat events, tool jobs,
//! tool replies and dead letters.
//!
//! This is the only module that knows subject and header names. Every
//! envelope has a JSON Schema in `schemas/` (embedded here, so a binary always
//! validates against the contract it was built with); inbound messages are
//! validated against it before they are deserialised.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;

use async_nats::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::schema::{Validator, Violation};
use crate::tools::ToolId;
use crate::usage::Usage;

/// Default subject prefix.
pub const DEFAULT_PREFIX: &str = "toolfleet";

/// Largest accepted chat job or tool job body. Bigger messages are rejected
/// with a clear error before they are parsed.
pub const MAX_JOB_BYTES: usize = 1024 * 1024;

/// Header names. NATS headers are case-sensitive: these are exact.
pub mod headers {
    /// The invocation a tool job belongs to (required on tool jobs).
    pub const INVOCATION_ID: &str = "Toolfleet-Invocation-Id";
    /// The tool call a tool job runs, minted by the orchestrator (required on
    /// tool jobs).
    pub const CALL_ID: &str = "Toolfleet-Call-Id";
    /// The tool a job is for, `ns:name@x.y.z` (required on tool jobs).
    pub const TOOL_ID: &str = "Toolfleet-Tool-Id";
    /// The tenant the invocation runs as (absent: the default tenant).
    pub const TENANT: &str = "Toolfleet-Tenant";
    /// The user who asks, set by the orchestrator only when the operator
    /// trusts the tenant's identity to assert its users (`trust_user`):
    /// when present, a worker may take it as a trusted user id.
    pub const USER: &str = "Toolfleet-User";
    /// The profile the invocation runs under.
    pub const PROFILE: &str = "Toolfleet-Profile";
    /// The provider of the deployment the orchestrator calls (its
    /// `provider`, else its URL's host): decided by the fleet.
    pub const PROVIDER: &str = "Toolfleet-Provider";
    /// The name of the deployment the orchestrator calls: decided by the
    /// fleet.
    pub const CONNECTION: &str = "Toolfleet-Connection";
    /// The chat job's `resource`, passed to tools as it came.
    pub const RESOURCE: &str = "Toolfleet-Resource";
    /// The data source the job (or its profile) names: what the
    /// `data_source_search` tools search.
    pub const DATA_SOURCE_ID: &str = "Toolfleet-Data-Source-Id";
    /// The chat job's attached document ids, as a JSON array of strings
    /// (absent when none): the document-processing tools see only these.
    pub const ATTACHED_DOCUMENTS: &str = "Toolfleet-Attached-Documents";
    /// How much the fleet trusts the deployment the orchestrator calls (its
    /// `confidence`), `0..=1`: a tool with a higher `minProviderConfidence`
    /// refuses the call (`blocked`).
    pub const PROVIDER_CONFIDENCE: &str = "Toolfleet-Provider-Confidence";
    /// The tenant's fleet-wide model-call limits, from the operator's
    /// configuration (a JSON [`TenantLimits`](crate::TenantLimits)): a
    /// worker that calls models checks them before each call, as the
    /// orchestrator does. Absent: no limit.
    pub const TENANT_LIMITS: &str = "Toolfleet-Tenant-Limits";
    /// `batch` on the tool jobs of a batch chat job (absent: interactive):
    /// a worker that calls models may use its deployment's batch tier.
    pub const PRIORITY: &str = "Toolfleet-Priority";
    /// Unix time in ms after which nobody waits for the call's answer (required
    /// on tool jobs).
    pub const DEADLINE: &str = "Toolfleet-Deadline";
    /// The delivery attempt of a tool job; absent when 1.
    pub const ATTEMPT: &str = "Toolfleet-Attempt";
    /// Where the worker publishes the call's progress and result (required on
    /// tool jobs; always under
    /// [`Subjects::replies_all`](crate::Subjects::replies_all)).
    pub const REPLY_TO: &str = "Toolfleet-Reply-To";
    /// The highest `[doc:N]` the invocation had announced when the call
    /// was sent: a worker's new citation indices are always above it.
    pub const CITATION_FLOOR: &str = "Toolfleet-Citation-Floor";
    /// `1` when the publisher minted the call id for this job (no earlier
    /// job carried it, so its first delivery has no stored result to find:
    /// see [`CallContext::new_call`](crate::CallContext::new_call)).
    pub const NEW_CALL: &str = "Toolfleet-New-Call";
    /// On a chat job an agent tool started: the invocation that called the
    /// agent (for linking; the nested job is an ordinary job of its own).
    /// Untrusted: any client that may submit can set it, so nothing may act
    /// on it beyond showing the link.
    pub const PARENT_INVOCATION: &str = "Toolfleet-Parent-Invocation";
    /// On a chat job an agent tool started: how deep it is nested (1 for a
    /// job started by a top-level job's agent call). Absent: 0.
    pub const AGENT_DEPTH: &str = "Toolfleet-Agent-Depth";
    /// On a chat job an agent tool started: the caller's approval rules,
    /// tool refs separated by `,` (`system:current_datetime,web:*`). The
    /// nested job holds these tools too (its own profile's rules widened,
    /// never narrowed: whoever sets it can only make a job stricter).
    pub const REQUIRE_APPROVAL: &str = "Toolfleet-Require-Approval";
    /// W3C trace context, so a worker's spans join the invocation's trace.
    pub const TRACEPARENT: &str = "traceparent";
    /// JetStream's deduplication id: the invocation id on a chat job,
    /// `<invocation>.<call>` on a tool job, `terminal-<invocation>` on a
    /// terminal event.
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// On a message of the sinks stream: where the event it carries goes
    /// (one destination, as JSON; the orchestrator's `sinks` module reads
    /// and writes it).
    pub const SINK: &str = "Toolfleet-Sink";
    /// On a relayed event: `<invocationId>:<seq>`, the same for every
    /// retry of one event (a receiver's idempotency key).
    pub const EVENT_ID: &str = "Toolfleet-Event-Id";
    /// On a webhook POST (Standard Webhooks): the message id,
    /// `<tenant>:<invocationId>:<seq>:<16 hex of the body's SHA-256>`,
    /// the same for every retry of one event (the receiver's idempotency
    /// key) and signed.
    pub const WEBHOOK_ID: &str = "webhook-id";
    /// On a webhook POST (Standard Webhooks): the attempt's unix time in
    /// seconds, signed.
    pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
    /// On a webhook POST (Standard Webhooks): `v1,<base64 HMAC-SHA256 of
    /// "<id>.<timestamp>.<body>">`, one per key of the sink's secret,
    /// separated by spaces (key rotation).
    pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";
}

/// Why a message could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A required header is absent (its name).
    #[error("missing required header {0}")]
    MissingHeader(&'static str),
    /// A header's value cannot be read.
    #[error("malformed header {name}: {reason}")]
    MalformedHeader {
        /// The header.
        name: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// The body is bigger than the reader accepts.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The body's size, in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body is not JSON.
    #[error("message is not valid JSON: {0}")]
    NotJson(String),
    /// The body is JSON but does not match its envelope's schema.
    #[error("message does not match {schema}: {details}")]
    Schema {
        /// The schema's name, e.g. `chat_job.schema.json`.
        schema: &'static str,
        /// Where and how it does not match.
        details: String,
    },
    /// A subject prefix that is not tokens of `[a-z0-9-]` joined by `.`.
    #[error(
        "invalid subject prefix {0:?}: use lowercase letters, digits and '-', in tokens separated by '.' (e.g. acme.tf-prod)"
    )]
    BadPrefix(String),
}

impl ProtocolError {
    /// A short stable code for events, results and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            ProtocolError::MissingHeader(_) | ProtocolError::MalformedHeader { .. } => {
                "bad_headers"
            }
            ProtocolError::TooLarge { .. } => "too_large",
            ProtocolError::NotJson(_) => "malformed_json",
            ProtocolError::Schema { .. } => "schema_violation",
            ProtocolError::BadPrefix(_) => "bad_prefix",
        }
    }
}

/// Subject, stream and consumer names under one prefix.
///
/// A prefix is one or more tokens of `[a-z0-9-]` joined by `.`. The
/// alphabet is what keeps fleets apart: stream, bucket and service names
/// are built by uppercasing the prefix and turning `.` into `_`
/// ([`Subjects::chat_stream`], [`Subjects::worker_service`]), which is
/// one-to-one only because a prefix holds neither `_` nor an uppercase
/// letter. With them, `a.b`, `a_b` and `A.B` would share every stream and
/// the catalog bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    /// The names under `prefix`.
    ///
    /// # Errors
    ///
    /// [`ProtocolError::BadPrefix`] unless `prefix` is tokens of
    /// `[a-z0-9-]` joined by `.`.
    pub fn new(prefix: &str) -> Result<Self, ProtocolError> {
        let ok = !prefix.is_empty()
            && prefix.split('.').all(|t| {
                !t.is_empty()
                    && t.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
        if !ok {
            return Err(ProtocolError::BadPrefix(prefix.to_string()));
        }
        Ok(Self {
            prefix: prefix.to_string(),
        })
    }

    /// The prefix every name is built from, e.g. `toolfleet`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Where a client of `tenant` submits chat jobs
    /// (`<p>.chat.submit.<tenant>`). The tenant in the subject is the one
    /// the job runs as, so a NATS permission on this subject is a
    /// permission to act as that tenant.
    pub fn chat_submit(&self, tenant: &str) -> String {
        format!("{}.chat.submit.{tenant}", self.prefix)
    }

    /// Every tenant's submit subject (interactive jobs; with
    /// [`Subjects::chat_batch_all`], the chat stream's subjects).
    pub fn chat_submit_all(&self) -> String {
        format!("{}.chat.submit.*", self.prefix)
    }

    /// Where a client of `tenant` submits batch chat jobs
    /// (`<p>.chat.batch.<tenant>`): the same job as on
    /// [`Subjects::chat_submit`], taken after the interactive ones (see
    /// [`Priority`]).
    pub fn chat_batch(&self, tenant: &str) -> String {
        format!("{}.chat.batch.{tenant}", self.prefix)
    }

    /// Every tenant's batch subject.
    pub fn chat_batch_all(&self) -> String {
        format!("{}.chat.batch.*", self.prefix)
    }

    /// Where a job of `tenant` with `priority` is submitted.
    pub fn chat_lane(&self, tenant: &str, priority: Priority) -> String {
        match priority {
            Priority::Interactive => self.chat_submit(tenant),
            Priority::Batch => self.chat_batch(tenant),
        }
    }

    /// The tenant and priority a chat job's subject names (submit or
    /// batch), `None` for any other subject or an invalid tenant.
    pub fn lane_tenant<'a>(&self, subject: &'a str) -> Option<(&'a str, Priority)> {
        if let Some(tenant) = self.submit_tenant(subject) {
            return Some((tenant, Priority::Interactive));
        }
        let tenant = self.after(subject, ".chat.batch.")?;
        valid_tenant(tenant).then_some((tenant, Priority::Batch))
    }

    /// The tenant a submit subject names, `None` for a subject that is not
    /// `<p>.chat.submit.<tenant>` with a valid tenant.
    pub fn submit_tenant<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let tenant = self.after(subject, ".chat.submit.")?;
        valid_tenant(tenant).then_some(tenant)
    }

    /// The events of one invocation (`<p>.chat.events.<tenant>.<id>`): a
    /// client allowed `<p>.chat.events.<tenant>.*` reads its own tenant's
    /// invocations only.
    pub fn chat_events(&self, tenant: &str, invocation_id: &str) -> String {
        format!("{}.chat.events.{tenant}.{invocation_id}", self.prefix)
    }

    /// The limits stream that keeps dead letters for inspection and
    /// replay (`TOOLFLEET_DEADLETTERS`).
    pub fn dead_letters_stream(&self) -> String {
        format!("{}_DEADLETTERS", self.stream_stem())
    }

    /// Every dead letter: `<prefix>.deadletter.>`.
    pub fn dead_letters_all(&self) -> String {
        format!("{}.deadletter.>", self.prefix)
    }

    /// An invocation's events without the deltas, for the history stream
    /// (`toolfleet events`). Nobody but the orchestrators publishes here.
    pub fn chat_history(&self, tenant: &str, invocation_id: &str) -> String {
        format!("{}.chat.history.{tenant}.{invocation_id}", self.prefix)
    }

    /// Every invocation's history subject, of every tenant (the history
    /// stream's subjects).
    pub fn chat_history_all(&self) -> String {
        format!("{}.chat.history.>", self.prefix)
    }

    /// An invocation's events bound for its sinks (webhook, relay): only
    /// those of an invocation with a sink, captured by the sinks stream.
    pub fn sink(&self, tenant: &str, invocation_id: &str) -> String {
        format!("{}.sink.{tenant}.{invocation_id}", self.prefix)
    }

    /// The `(tenant, invocation id)` a sinks subject names, when both are
    /// valid.
    pub fn parse_sink<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let (tenant, id) = self.after(subject, ".sink.")?.split_once('.')?;
        (valid_tenant(tenant) && valid_invocation_id(id)).then_some((tenant, id))
    }

    /// Every sink subject, of every tenant (the sinks stream's subjects).
    pub fn sink_all(&self) -> String {
        format!("{}.sink.>", self.prefix)
    }

    /// The work-queue stream of events bound for sinks (`TOOLFLEET_SINKS`).
    pub fn sinks_stream(&self) -> String {
        format!("{}_SINKS", self.stream_stem())
    }

    /// The durable consumer on the sinks stream every orchestrator shares.
    pub fn sinks_consumer(&self) -> String {
        "sinks".to_string()
    }

    /// Whether `subject` is under this fleet's prefix (one of its own).
    pub fn owns(&self, subject: &str) -> bool {
        subject
            .strip_prefix(self.prefix.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    }

    /// Every invocation's events, of every tenant.
    pub fn chat_events_all(&self) -> String {
        format!("{}.chat.events.>", self.prefix)
    }

    /// Every invocation's events of one tenant (what a tenant's cap on
    /// stored events counts and trims).
    pub fn chat_events_of(&self, tenant: &str) -> String {
        format!("{}.chat.events.{tenant}.*", self.prefix)
    }

    /// Every invocation's history subject of one tenant.
    pub fn chat_history_of(&self, tenant: &str) -> String {
        format!("{}.chat.history.{tenant}.*", self.prefix)
    }

    /// Cancels one invocation of `tenant`; a cancel under another tenant
    /// than the invocation's own is ignored.
    pub fn chat_cancel(&self, tenant: &str, invocation_id: &str) -> String {
        format!("{}.chat.cancel.{tenant}.{invocation_id}", self.prefix)
    }

    /// Every invocation's cancel subject, of every tenant (not the cancels of
    /// single calls: see [`Subjects::chat_cancel_any`]).
    pub fn chat_cancel_all(&self) -> String {
        format!("{}.chat.cancel.*.*", self.prefix)
    }

    /// The cancel of one call of an invocation: its tool stops, and the
    /// invocation goes on with the call's `call_cancelled` error.
    pub fn chat_cancel_call(&self, tenant: &str, invocation_id: &str, call_id: &str) -> String {
        format!(
            "{}.chat.cancel.{tenant}.{invocation_id}.{call_id}",
            self.prefix
        )
    }

    /// Every cancel, of invocations and of single calls (what workers
    /// hear).
    pub fn chat_cancel_any(&self) -> String {
        format!("{}.chat.cancel.>", self.prefix)
    }

    /// The `(tenant, invocation id, call id)` a call's cancel subject
    /// names, when all are valid.
    pub fn parse_cancel_call<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        let mut parts = self.after(subject, ".chat.cancel.")?.split('.');
        let (tenant, id, call) = (parts.next()?, parts.next()?, parts.next()?);
        (parts.next().is_none()
            && valid_tenant(tenant)
            && valid_invocation_id(id)
            && valid_invocation_id(call))
        .then_some((tenant, id, call))
    }

    /// The `(tenant, invocation id)` a cancel subject names, when both are
    /// valid.
    pub fn parse_cancel<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let (tenant, id) = self.after(subject, ".chat.cancel.")?.split_once('.')?;
        (valid_tenant(tenant) && valid_invocation_id(id)).then_some((tenant, id))
    }

    /// Where a person's approval or denial of a parked call of an
    /// invocation of `tenant` is sent: a core NATS request with an
    /// [`Approval`](crate::approval::Approval) body, answered with an
    /// [`ApprovalReply`](crate::approval::ApprovalReply). NATS permissions
    /// on it decide who may approve for a tenant.
    pub fn chat_approve(&self, tenant: &str, invocation_id: &str) -> String {
        format!("{}.chat.approve.{tenant}.{invocation_id}", self.prefix)
    }

    /// Every approval subject (what orchestrators answer, as one queue
    /// group).
    pub fn chat_approve_all(&self) -> String {
        format!("{}.chat.approve.*.*", self.prefix)
    }

    /// The `(tenant, invocation id)` an approval subject names, when both
    /// are valid.
    pub fn parse_approve<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let (tenant, id) = self.after(subject, ".chat.approve.")?.split_once('.')?;
        (valid_tenant(tenant) && valid_invocation_id(id)).then_some((tenant, id))
    }

    /// Where orchestrators record decisions on parked invocations of
    /// `tenant` (approvals, denials, timeouts, cancels) in the decisions
    /// stream; the orchestrator that takes the last one resumes the
    /// invocation. Only orchestrators publish here.
    pub fn chat_decision(&self, tenant: &str) -> String {
        format!("{}.chat.decision.{tenant}", self.prefix)
    }

    /// Every tenant's decision subject (the decisions stream's subject).
    pub fn chat_decision_all(&self) -> String {
        format!("{}.chat.decision.*", self.prefix)
    }

    /// The work-queue stream of decisions on parked invocations.
    pub fn decisions_stream(&self) -> String {
        format!("{}_DECISIONS", self.stream_stem())
    }

    /// The key-value bucket of parked invocations (key:
    /// `<tenant>.<invocation id>`).
    pub fn parked_bucket(&self) -> String {
        format!("{}_PARKED", self.stream_stem())
    }

    /// The key-value bucket of per-tenant tool settings, written by the
    /// operator (`toolfleet settings set`), read by the orchestrators (key:
    /// [`settings_key`]).
    pub fn settings_bucket(&self) -> String {
        format!("{}_SETTINGS", self.stream_stem())
    }

    /// The key-value bucket of threads (key: `<tenant>.<thread id>`,
    /// [`thread_key`](crate::thread::thread_key)): each thread's running
    /// job, its queue and its conversation. Only orchestrators use it.
    pub fn threads_bucket(&self) -> String {
        format!("{}_THREADS", self.stream_stem())
    }

    /// The key-value bucket of idempotency keys (key: `<tenant>.<key>`,
    /// [`idempotency_key`](crate::thread::idempotency_key)): the first
    /// invocation of each. Only orchestrators use it.
    pub fn idempotency_bucket(&self) -> String {
        format!("{}_IDEMPOTENCY", self.stream_stem())
    }

    /// What follows `<p><infix>` in `subject`.
    fn after<'a>(&self, subject: &'a str, infix: &str) -> Option<&'a str> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(infix)
    }

    /// Where tool results go: every orchestrator's call inbox is under it
    /// (`<p>.reply.<orchestrator>.<call>`), and a worker refuses a reply
    /// subject outside it.
    pub fn replies_all(&self) -> String {
        format!("{}.reply.>", self.prefix)
    }

    /// A fresh call inbox for one orchestrator (under [`Subjects::replies_all`]).
    pub fn reply_inbox(&self) -> String {
        format!("{}.reply.{}", self.prefix, uuid::Uuid::new_v4().simple())
    }

    /// Is `subject` a reply subject of this fleet (under
    /// [`Subjects::replies_all`], one or more tokens after `reply`, no
    /// wildcards)?
    pub fn is_reply_subject(&self, subject: &str) -> bool {
        subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_prefix(".reply."))
            .is_some_and(|rest| {
                !rest.is_empty()
                    && rest.split('.').all(|t| {
                        !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace)
                    })
            })
    }

    /// The subject a tool's jobs are published to:
    /// `<p>.tool.<ns>.<name>.<major>_<minor>_<patch>` (see
    /// [`ToolId::subject_token`]).
    pub fn tool(&self, id: &ToolId) -> String {
        format!("{}.tool.{}", self.prefix, id.subject_token())
    }

    /// The tool id (`ns:name@x.y.z`) whose jobs go to `subject` (the
    /// inverse of [`tool`](Self::tool)); `None` for any other subject.
    pub fn tool_of_subject(&self, subject: &str) -> Option<String> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".tool.")?;
        let mut parts = rest.split('.');
        let (ns, name, version) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || ns.is_empty() || name.is_empty() {
            return None;
        }
        let version = version.replace('_', ".");
        Some(format!("{ns}:{name}@{version}"))
    }

    /// Every tool's job subject (the tools stream's subjects).
    pub fn tools_all(&self) -> String {
        format!("{}.tool.>", self.prefix)
    }

    /// A tool's services-API endpoint: direct request-reply for tools with
    /// `delivery: direct` (outside `<p>.tool.>`, so the tool stream does not
    /// capture it).
    pub fn tool_direct(&self, id: &ToolId) -> String {
        format!("{}.direct.{}", self.prefix, id.subject_token())
    }

    /// Where dead letters of `kind` are published: `<p>.deadletter.<kind>`.
    pub fn dead_letter(&self, kind: DeadLetterKind) -> String {
        format!("{}.deadletter.{}", self.prefix, kind.as_str())
    }

    /// The JetStream stream that holds chat jobs (`TOOLFLEET_CHAT` for the
    /// default prefix).
    pub fn chat_stream(&self) -> String {
        format!("{}_CHAT", self.stream_stem())
    }

    /// The JetStream stream that keeps each invocation's latest event
    /// (`TOOLFLEET_EVENTS`), so a client that missed the terminal event
    /// live can still read it.
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.stream_stem())
    }

    /// The JetStream stream that keeps each invocation's events but the
    /// deltas (`TOOLFLEET_HISTORY`), what `toolfleet events` replays.
    pub fn history_stream(&self) -> String {
        format!("{}_HISTORY", self.stream_stem())
    }

    /// The JetStream stream that holds tool jobs (`TOOLFLEET_TOOLS`).
    pub fn tools_stream(&self) -> String {
        format!("{}_TOOLS", self.stream_stem())
    }

    /// The durable consumer every orchestrator shares on the decisions
    /// stream, and the queue group of approval requests. (Before fair
    /// dispatch it was also the one chat consumer of every tenant; an
    /// orchestrator removes that one from the chat stream at start.)
    pub fn chat_consumer(&self) -> String {
        "orchestrators".to_string()
    }

    /// The durable chat consumer of one tenant, shared by every
    /// orchestrator (`chat-<tenant>`, filtered on
    /// [`Subjects::chat_submit`]): fair dispatch takes jobs from the
    /// tenants' consumers in turn.
    pub fn chat_tenant_consumer(&self, tenant: &str) -> String {
        format!("chat-{tenant}")
    }

    /// The durable batch consumer of one tenant (`batch-<tenant>`,
    /// filtered on [`Subjects::chat_batch`]).
    pub fn chat_batch_consumer(&self, tenant: &str) -> String {
        format!("batch-{tenant}")
    }

    /// The consumer of `tenant`'s jobs of `priority`.
    pub fn chat_lane_consumer(&self, tenant: &str, priority: Priority) -> String {
        match priority {
            Priority::Interactive => self.chat_tenant_consumer(tenant),
            Priority::Batch => self.chat_batch_consumer(tenant),
        }
    }

    /// The tenant whose interactive chat consumer `consumer` is, if it is
    /// one ([`Subjects::chat_tenant_consumer`]).
    pub fn consumer_tenant<'a>(&self, consumer: &'a str) -> Option<&'a str> {
        consumer
            .strip_prefix("chat-")
            .filter(|tenant| valid_tenant(tenant))
    }

    /// The tenant and lane of a chat consumer (interactive or batch).
    pub fn consumer_lane<'a>(&self, consumer: &'a str) -> Option<(&'a str, Priority)> {
        if let Some(tenant) = self.consumer_tenant(consumer) {
            return Some((tenant, Priority::Interactive));
        }
        consumer
            .strip_prefix("batch-")
            .filter(|tenant| valid_tenant(tenant))
            .map(|tenant| (tenant, Priority::Batch))
    }

    /// The durable consumer shared by every worker of one tool.
    pub fn tool_consumer(&self, id: &ToolId) -> String {
        format!("tool_{}", id.subject_token().replace('.', "_"))
    }

    /// The NATS services API name every worker of this fleet registers
    /// under: scoped to the prefix, so two fleets on one server never see
    /// each other's workers (`toolfleet` → `toolfleet-worker`; dots, which
    /// a service name may not hold, become `_`, which a prefix may not
    /// hold). Discovery also checks the `fleet` metadata.
    pub fn worker_service(&self) -> String {
        format!("{}-worker", self.prefix.replace('.', "_"))
    }

    /// The JetStream key-value bucket where workers advertise the
    /// definitions of the tools they serve.
    pub fn catalog_bucket(&self) -> String {
        format!("{}_CATALOG", self.stream_stem())
    }

    /// The prefix uppercased, `.` as `_` (`acme.tf-prod` → `ACME_TF-PROD`):
    /// a valid stream name, and a different one for every prefix (see
    /// [`Subjects`]).
    fn stream_stem(&self) -> String {
        self.prefix.to_ascii_uppercase().replace('.', "_")
    }
}

/// The tenant of a job that names none.
pub const DEFAULT_TENANT: &str = "default";

/// The settings bucket's key of `tenant`'s settings of tool `ns:name`
/// (every version): `<tenant>.<ns>.<name>`. Tenants are
/// `[A-Za-z0-9_-]`, namespaces and names `[a-z][a-z0-9_]*`, so the key is
/// a valid key-value key whose first token is the tenant.
#[must_use]
pub fn settings_key(tenant: &str, namespace: &str, name: &str) -> String {
    format!("{tenant}.{namespace}.{name}")
}

/// Is `tenant` usable as a tenant (a single subject token of 1-64
/// `[A-Za-z0-9_-]`: it is part of the submit, events and cancel subjects)?
pub fn valid_tenant(tenant: &str) -> bool {
    !tenant.is_empty()
        && tenant.len() <= 64
        && tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Is `id` usable as an invocation id (a single subject token and part of a
/// Redis key)?
pub fn valid_invocation_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The context of one invocation, carried explicitly in NATS headers on every
/// job and result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InvocationContext {
    /// The invocation's id, chosen by the client: unique within its tenant,
    /// 1-128 of `[A-Za-z0-9_-]`.
    pub invocation_id: String,
    /// The tenant it runs as; `None` means [`DEFAULT_TENANT`] (see
    /// [`InvocationContext::tenant`]).
    pub tenant: Option<String>,
    /// The user who asks, only when the fleet trusts it: the orchestrator
    /// sets it from the chat job's `user` when the operator marked the
    /// tenant `trust_user` (its identity asserts its users), else never.
    pub user: Option<String>,
    /// The profile it runs under.
    pub profile: Option<String>,
    /// The provider of the deployment the orchestrator calls (its
    /// `provider`, else its URL's host); decided by the fleet.
    pub provider: Option<String>,
    /// The name of the deployment the orchestrator calls; decided by the
    /// fleet.
    pub connection: Option<String>,
    /// The chat job's `resource`, passed to tools as it came.
    pub resource: Option<String>,
    /// The data source the `data_source_search` tools search (the job's, else
    /// the profile's).
    pub data_source_id: Option<String>,
    /// Document ids the chat job attached (at most
    /// [`MAX_ATTACHED_DOCUMENTS`], each 1-512 characters without line
    /// breaks): the document-processing tools are scoped to them.
    pub attached_documents: Vec<String>,
    /// How much the fleet trusts the deployment the orchestrator calls
    /// (its `confidence`), `0..=1`; a tool with a higher
    /// `minProviderConfidence` is not offered and refuses to run.
    pub provider_confidence: Option<f64>,
    /// Unix time in milliseconds after which nobody waits for the answer.
    pub deadline_ms: Option<u64>,
    /// W3C trace context of the invocation.
    pub traceparent: Option<String>,
    /// The tenant's model-call limits (operator configuration), for the
    /// workers that call models; `None`: none.
    pub tenant_limits: Option<TenantLimits>,
    /// The chat job's priority (only `batch` travels).
    pub priority: Priority,
}

/// A tenant's fleet-wide model-call limits as tool jobs carry them
/// ([`headers::TENANT_LIMITS`]); 0 (or absent) is no limit. Counted in
/// the same Redis windows by every orchestrator and worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantLimits {
    /// Model calls started per minute.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub requests_per_minute: u64,
    /// Tokens of the calls that ended in the minute.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tokens_per_minute: u64,
    /// Spend per UTC day, in millionths of a USD.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spend_per_day_micros: u64,
    /// Spend per UTC month, in millionths of a USD.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spend_per_month_micros: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TenantLimits {
    /// Whether no limit is set.
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }
}

/// The most documents a chat job attaches (as `schemas/chat_job.schema.json`).
pub const MAX_ATTACHED_DOCUMENTS: usize = 100;

/// Is `id` usable as an attached document id (1-512 characters, no line
/// breaks)?
pub fn valid_document_id(id: &str) -> bool {
    !id.is_empty() && id.chars().count() <= 512 && !id.contains(['\r', '\n'])
}

/// The largest citation floor a tool job may carry (2^40: far beyond any
/// invocation, well inside what Redis's Lua numbers hold exactly).
pub const MAX_CITATION_FLOOR: u64 = 1 << 40;

/// The context of one tool call: the invocation plus the call's own headers.
#[derive(Debug, Clone, PartialEq)]
pub struct CallContext {
    /// The invocation the call belongs to.
    pub invocation: InvocationContext,
    /// The call's id, minted by the orchestrator; unique within its invocation.
    pub call_id: String,
    /// The tool the call runs.
    pub tool_id: ToolId,
    /// 1 for the first delivery.
    pub attempt: u32,
    /// Where the worker publishes progress and the result.
    pub reply_to: String,
    /// See [`headers::CITATION_FLOOR`]; 0 when absent.
    pub citation_floor: u64,
    /// The publisher minted `call_id` for this job and will never publish
    /// it again (the orchestrator's call ids are random UUIDs): no result
    /// of this call can be stored yet, so a worker skips the result-ledger
    /// read on the job's first delivery. Absent (false) for a publisher
    /// that may repeat a call id — a client retrying a job under a new
    /// `Nats-Msg-Id` — whose repeat is then answered from the ledger.
    pub new_call: bool,
}

/// The headers this module reads, in the order of [`Known`]'s slots.
const KNOWN: [&str; 20] = [
    headers::INVOCATION_ID,
    headers::CALL_ID,
    headers::TOOL_ID,
    headers::TENANT,
    headers::USER,
    headers::PROFILE,
    headers::PROVIDER,
    headers::CONNECTION,
    headers::RESOURCE,
    headers::DATA_SOURCE_ID,
    headers::ATTACHED_DOCUMENTS,
    headers::PROVIDER_CONFIDENCE,
    headers::TENANT_LIMITS,
    headers::PRIORITY,
    headers::DEADLINE,
    headers::ATTEMPT,
    headers::REPLY_TO,
    headers::CITATION_FLOOR,
    headers::NEW_CALL,
    headers::TRACEPARENT,
];

/// A message's known headers, read in one pass over its map: a
/// `HeaderMap` lookup by name builds (allocates) the name and hashes it
/// each time, and a job is read for a dozen of them. The first value of a
/// header counts, an empty one is absent.
struct Known<'a>([Option<&'a str>; KNOWN.len()]);

impl<'a> Known<'a> {
    fn read(h: &'a HeaderMap) -> Self {
        let mut values = [None; KNOWN.len()];
        for (name, vals) in h.iter() {
            let name: &str = name.as_ref();
            if let Some(i) = KNOWN.iter().position(|k| *k == name) {
                values[i] = vals.first().map(|v| v.as_str()).filter(|v| !v.is_empty());
            }
        }
        Self(values)
    }

    fn get(&self, name: &'static str) -> Option<&'a str> {
        KNOWN
            .iter()
            .position(|k| *k == name)
            .and_then(|i| self.0[i])
    }
}

fn required<'a>(h: &Known<'a>, name: &'static str) -> Result<&'a str, ProtocolError> {
    h.get(name).ok_or(ProtocolError::MissingHeader(name))
}

fn parsed<T: std::str::FromStr>(
    h: &Known<'_>,
    name: &'static str,
) -> Result<Option<T>, ProtocolError>
where
    T::Err: fmt::Display,
{
    h.get(name)
        .map(|v| {
            v.parse::<T>().map_err(|e| ProtocolError::MalformedHeader {
                name,
                reason: format!("{v:?}: {e}"),
            })
        })
        .transpose()
}

/// Header values cannot hold line breaks (the NATS client would panic):
/// such a value is left out. Inbound schemas already refuse them.
fn put(h: &mut HeaderMap, name: &'static str, value: Option<&str>) {
    if let Some(v) = value.filter(|v| !v.contains(['\r', '\n'])) {
        h.insert(name, v);
    }
}

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

impl InvocationContext {
    /// A context with only an invocation id; the rest is empty.
    pub fn new(invocation_id: impl Into<String>) -> Self {
        Self {
            invocation_id: invocation_id.into(),
            ..Self::default()
        }
    }

    /// The tenant the invocation runs as ([`DEFAULT_TENANT`] when none is
    /// named).
    pub fn tenant(&self) -> &str {
        self.tenant.as_deref().unwrap_or(DEFAULT_TENANT)
    }

    /// Writes the context's headers into `h` (an absent field writes none).
    pub fn write_headers(&self, h: &mut HeaderMap) {
        use headers::*;
        h.insert(INVOCATION_ID, self.invocation_id.as_str());
        put(h, TENANT, self.tenant.as_deref());
        put(h, USER, self.user.as_deref());
        put(h, PROFILE, self.profile.as_deref());
        put(h, PROVIDER, self.provider.as_deref());
        put(h, CONNECTION, self.connection.as_deref());
        put(h, RESOURCE, self.resource.as_deref());
        put(h, DATA_SOURCE_ID, self.data_source_id.as_deref());
        if !self.attached_documents.is_empty() {
            // A JSON array of strings never holds a raw line break.
            let ids = serde_json::to_string(&self.attached_documents).unwrap_or_default();
            h.insert(ATTACHED_DOCUMENTS, ids.as_str());
        }
        if let Some(c) = self.provider_confidence {
            h.insert(PROVIDER_CONFIDENCE, c.to_string().as_str());
        }
        if let Some(d) = self.deadline_ms {
            h.insert(DEADLINE, d.to_string().as_str());
        }
        put(h, TRACEPARENT, self.traceparent.as_deref());
        if let Some(limits) = self.tenant_limits.filter(|l| !l.is_none()) {
            let json = serde_json::to_string(&limits).unwrap_or_default();
            h.insert(TENANT_LIMITS, json.as_str());
        }
        if self.priority == Priority::Batch {
            h.insert(PRIORITY, Priority::Batch.as_str());
        }
    }

    /// The context as a fresh header map.
    pub fn to_headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        self.write_headers(&mut h);
        h
    }

    /// Reads the context from a message's headers. Fails with
    /// [`ProtocolError::MissingHeader`] or [`ProtocolError::MalformedHeader`]
    /// when the invocation id is absent or a value is malformed.
    pub fn from_headers(h: &HeaderMap) -> Result<Self, ProtocolError> {
        Self::from_known(&Known::read(h))
    }

    fn from_known(h: &Known<'_>) -> Result<Self, ProtocolError> {
        use headers::*;
        let invocation_id = required(h, INVOCATION_ID)?;
        if !valid_invocation_id(invocation_id) {
            return Err(ProtocolError::MalformedHeader {
                name: INVOCATION_ID,
                reason: format!("{invocation_id:?} is not 1-128 of [A-Za-z0-9_-]"),
            });
        }
        let provider_confidence: Option<f64> = parsed(h, PROVIDER_CONFIDENCE)?;
        if let Some(c) = provider_confidence
            && !(0.0..=1.0).contains(&c)
        {
            return Err(ProtocolError::MalformedHeader {
                name: PROVIDER_CONFIDENCE,
                reason: format!("{c} is outside 0..=1"),
            });
        }
        if let Some(tenant) = h.get(TENANT)
            && !valid_tenant(tenant)
        {
            return Err(ProtocolError::MalformedHeader {
                name: TENANT,
                reason: format!("{tenant:?} is not 1-64 of [A-Za-z0-9_-]"),
            });
        }
        let attached_documents = match h.get(ATTACHED_DOCUMENTS) {
            None => Vec::new(),
            Some(raw) => {
                let malformed = |reason: String| ProtocolError::MalformedHeader {
                    name: ATTACHED_DOCUMENTS,
                    reason,
                };
                let ids: Vec<String> = serde_json::from_str(raw)
                    .map_err(|e| malformed(format!("not a JSON array of strings: {e}")))?;
                if ids.len() > MAX_ATTACHED_DOCUMENTS {
                    return Err(malformed(format!(
                        "{} documents; at most {MAX_ATTACHED_DOCUMENTS}",
                        ids.len()
                    )));
                }
                if let Some(bad) = ids.iter().find(|id| !valid_document_id(id)) {
                    return Err(malformed(format!(
                        "{bad:?} is not a document id (1-512 characters, no line breaks)"
                    )));
                }
                ids
            }
        };
        let tenant_limits = match h.get(TENANT_LIMITS) {
            None => None,
            Some(raw) => Some(serde_json::from_str::<TenantLimits>(raw).map_err(|e| {
                ProtocolError::MalformedHeader {
                    name: TENANT_LIMITS,
                    reason: format!("not a JSON object of limits: {e}"),
                }
            })?),
        };
        let owned = |name| h.get(name).map(str::to_string);
        Ok(Self {
            invocation_id: invocation_id.to_string(),
            tenant: owned(TENANT),
            user: owned(USER),
            profile: owned(PROFILE),
            provider: owned(PROVIDER),
            connection: owned(CONNECTION),
            resource: owned(RESOURCE),
            data_source_id: owned(DATA_SOURCE_ID),
            attached_documents,
            provider_confidence,
            deadline_ms: parsed(h, DEADLINE)?,
            traceparent: owned(TRACEPARENT),
            tenant_limits,
            // Anything but `batch` is the default: a worker may only lower
            // its own cost with it.
            priority: match h.get(PRIORITY) {
                Some("batch") => Priority::Batch,
                _ => Priority::Interactive,
            },
        })
    }
}

impl CallContext {
    /// `Nats-Msg-Id` for the tool job: JetStream drops a duplicate publish
    /// inside the stream's duplicate window.
    pub fn msg_id(&self) -> String {
        format!("{}.{}", self.invocation.invocation_id, self.call_id)
    }

    /// The call's headers, its invocation's included, with `Nats-Msg-Id` set to
    /// [`CallContext::msg_id`].
    pub fn to_headers(&self) -> HeaderMap {
        use headers::*;
        let mut h = self.invocation.to_headers();
        h.insert(CALL_ID, self.call_id.as_str());
        h.insert(TOOL_ID, self.tool_id.to_string().as_str());
        // 1 is what a reader assumes when it is absent.
        if self.attempt != 1 {
            h.insert(ATTEMPT, self.attempt.to_string().as_str());
        }
        h.insert(REPLY_TO, self.reply_to.as_str());
        if self.citation_floor > 0 {
            h.insert(CITATION_FLOOR, self.citation_floor.to_string().as_str());
        }
        if self.new_call {
            h.insert(NEW_CALL, "1");
        }
        h.insert(NATS_MSG_ID, self.msg_id().as_str());
        h
    }

    /// Reads a tool job's headers. Fails with [`ProtocolError::MissingHeader`]
    /// or [`ProtocolError::MalformedHeader`] when a required header is absent
    /// or a value is malformed.
    pub fn from_headers(h: &HeaderMap) -> Result<Self, ProtocolError> {
        use headers::*;
        let h = &Known::read(h);
        let invocation = InvocationContext::from_known(h)?;
        let tool_id = required(h, TOOL_ID)?;
        let tool_id = tool_id
            .parse::<ToolId>()
            .map_err(|e| ProtocolError::MalformedHeader {
                name: TOOL_ID,
                reason: e.to_string(),
            })?;
        let call_id = required(h, CALL_ID)?;
        if !valid_invocation_id(call_id) {
            return Err(ProtocolError::MalformedHeader {
                name: CALL_ID,
                reason: format!("{call_id:?} is not 1-128 of [A-Za-z0-9_-]"),
            });
        }
        Ok(Self {
            invocation,
            call_id: call_id.to_string(),
            tool_id,
            attempt: parsed(h, ATTEMPT)?.unwrap_or(1),
            reply_to: required(h, REPLY_TO)?.to_string(),
            citation_floor: match parsed::<u64>(h, CITATION_FLOOR)?.unwrap_or(0) {
                // Indices live in Redis as Lua numbers (doubles): a floor
                // past 2^53 could only be forged, and would corrupt them.
                f if f > MAX_CITATION_FLOOR => {
                    return Err(ProtocolError::MalformedHeader {
                        name: CITATION_FLOOR,
                        reason: format!("{f} is above {MAX_CITATION_FLOOR}"),
                    });
                }
                f => f,
            },
            new_call: h.get(NEW_CALL) == Some("1"),
        })
    }
}

// ---------------------------------------------------------------------------
// Envelopes

/// One message of the conversation a client submits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: ChatRole,
    /// The text.
    pub content: String,
}

/// The author of a [`ChatMessage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatRole {
    /// Instructions to the model.
    System,
    /// The person asking.
    User,
    /// The model's earlier answers.
    Assistant,
}

/// A chat job, published by a client to `toolfleet.chat.submit.<tenant>`
/// (`schemas/chat_job.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChatJob {
    /// Chosen by the client, fresh for every job (a UUID): one NATS subject
    /// token and part of Redis keys. Ids are per tenant: an id another job of
    /// the same tenant already claimed is refused (`duplicate_invocation`);
    /// another tenant's invocation of the same id is another invocation.
    pub invocation_id: String,
    /// The conversation so far (1 to 500 messages).
    pub messages: Vec<ChatMessage>,
    /// The profile to run; none runs the tenant's default profile. A
    /// profile that is not configured, or that the tenant may not use,
    /// ends the job (`unknown_profile`, `profile_not_allowed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// The tenant the job runs as; when present it must be the submit subject's
    /// tenant. Absent: the subject's tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The user who asks. Passed to tools (`Toolfleet-User`) only when the
    /// operator trusts the tenant's identity to assert its users
    /// (`trust_user`); otherwise tools get no user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Passed to tools in a header, as it came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// The data source the `data_source_search` tools search (else the
    /// profile's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_source_id: Option<String>,
    /// Ids of ingested documents (`<collection>:<path>`) the user attached: the
    /// document-processing tools see only these, and they are searched before
    /// the first model call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attached_documents: Vec<String>,
    /// How long the client waits for the answer, from submission.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// W3C trace context, when the message's `traceparent` header is not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Selectable tools the job picks, by id (`ns:name@x.y.z`, or
    /// `ns:name` for the highest version), offered on top of the profile's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// Where the answer is shown (`chat` when absent; jobs an agent tool
    /// starts are `agent`): a tool whose `visibleIn` is not empty is offered
    /// only on the surfaces it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surface: Option<String>,
    /// Where the invocation's events also go, besides NATS: a webhook
    /// and/or a relay subject on another prefix (over the profile's sink).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink: Option<SinkRequest>,
    /// `batch` runs the job after its tenant's interactive jobs (and with
    /// the deployment's batch service tier); absent or `interactive`: the
    /// lane it was submitted on, or its profile's priority, decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The tenant's thread this job continues (`docs/threads.md`): its
    /// `messages` are only the new turn; the fleet keeps the earlier ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// What happens when the thread has a job running (else the profile's
    /// `multitask_strategy`, else `reject`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multitask_strategy: Option<crate::thread::MultitaskStrategy>,
    /// A repeated submit with the same key (of the same tenant, within the
    /// fleet's idempotency window) gets the first job's outcome instead of
    /// a second run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Not run before this time (RFC 3339): the job waits in the chat
    /// stream until then (`docs/schedules.md`); a time further ahead than
    /// the fleet allows (23 h after its submission, less its timeout, by
    /// default and at most: the chat stream keeps a job a day) is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<String>,
    /// A per-run budget that tightens the tenant's own per-run caps (a
    /// schedule's runs carry the schedule's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::schedule::RunBudget>,
}

/// When a chat job runs beside others: interactive jobs are taken first;
/// batch jobs when no interactive job waits, and at least one every
/// `--batch-max-wait` per orchestrator (so batch never starves).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Taken first (the default).
    #[default]
    Interactive,
    /// Taken when no interactive job waits, or when batch has waited
    /// `--batch-max-wait`.
    Batch,
}

impl Priority {
    /// The value's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }
}

/// A chat job's own sink (`sink` in `schemas/chat_job.schema.json`): at
/// least one of `webhook` and `relay`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SinkRequest {
    /// An `https://` URL the events are POSTed to, signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<String>,
    /// A NATS subject outside the fleet's prefix the events are published
    /// to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
    /// Which events: only the terminal one (the default) or all but the
    /// deltas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<SinkEvents>,
}

/// Which of an invocation's events a sink receives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SinkEvents {
    /// Only the terminal event (`completed` or `error`).
    #[default]
    Final,
    /// Every event but the deltas, the terminal one included.
    All,
}

impl SinkEvents {
    /// The value's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            SinkEvents::Final => "final",
            SinkEvents::All => "all",
        }
    }
}

/// The surface of a chat job that names none.
pub const DEFAULT_SURFACE: &str = "chat";
/// The surface of a chat job an agent tool started.
pub const AGENT_SURFACE: &str = "agent";

impl ChatJob {
    /// Where a client submits this job: its tenant's batch subject when
    /// it asks for [`Priority::Batch`], else its submit subject.
    pub fn subject(&self, subjects: &Subjects) -> String {
        subjects.chat_lane(self.tenant(), self.priority.unwrap_or_default())
    }

    /// Where the answer is shown ([`DEFAULT_SURFACE`] when the job names
    /// none).
    pub fn surface(&self) -> &str {
        self.surface.as_deref().unwrap_or(DEFAULT_SURFACE)
    }

    /// The tenant the job names ([`DEFAULT_TENANT`] when none): a client
    /// submits it to [`Subjects::chat_submit`] of this tenant (or
    /// [`Subjects::chat_batch`], see [`ChatJob::subject`]).
    pub fn tenant(&self) -> &str {
        self.tenant.as_deref().unwrap_or(DEFAULT_TENANT)
    }
}

/// A reference a tool or retrieval step produced; `index` is the `N` of the
/// `[doc:N]` marker that cites it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Reference {
    /// The `N` of the `[doc:N]` marker (from 1).
    pub index: u64,
    /// What was cited, e.g. `document`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A title a reader can show.
    pub title: String,
    /// Where it came from, e.g. a document's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// A link for the reader, where one applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A short passage of the cited text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snippet: Option<String>,
    /// The tool that produced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_id: Option<String>,
    /// The call that produced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
}

impl Reference {
    /// The marker a model cites this reference with.
    pub fn marker(&self) -> String {
        format!("[doc:{}]", self.index)
    }
}

/// Outcome of a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    /// The tool answered.
    Ok,
    /// The tool failed; the result's `error` says why.
    Error,
    /// The call was refused before it ran (a policy, a hook, an approval that
    /// cannot be had).
    Blocked,
    /// The call did not finish in time.
    Timeout,
}

impl ToolStatus {
    /// The status's name on the wire and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolStatus::Ok => "ok",
            ToolStatus::Error => "error",
            ToolStatus::Blocked => "blocked",
            ToolStatus::Timeout => "timeout",
        }
    }
}

/// Token usage totals of an invocation.
pub type UsageTotals = Usage;

/// An event of one invocation, published to `toolfleet.chat.events.<id>`.
// No `deny_unknown_fields` here: serde does not support it with `flatten`;
// the schema closes the object instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChatEvent {
    /// The invocation the event belongs to.
    pub invocation_id: String,
    /// 0, 1, 2, … per invocation, so a client can detect gaps.
    pub seq: u64,
    /// What happened (the `type` and its fields).
    #[serde(flatten)]
    pub body: ChatEventBody,
}

/// The kinds of chat event, tagged by `type` on the wire
/// (`schemas/chat_event.schema.json`). Every invocation ends with one terminal
/// event, `completed` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ChatEventBody {
    /// The invocation started: the first event (again after a redelivery).
    Started {
        /// The model the profile's conversation uses.
        model: String,
        /// The profile the job runs under (after falling back to the
        /// default when it named none or an unknown one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        profile: Option<String>,
        /// The ids of the tools offered to the model.
        tools: Vec<String>,
        /// The thread the job continues, when it names one.
        #[serde(rename = "threadId", default, skip_serializing_if = "Option::is_none")]
        thread_id: Option<String>,
    },
    /// Where a job of a thread stands (`docs/threads.md`): sent before
    /// `started` when it has to wait (`queued`, `interrupting`), and when
    /// it takes the thread (`running`).
    #[serde(rename_all = "camelCase")]
    Thread {
        /// The thread (the tenant's).
        thread_id: String,
        /// `queued`, `interrupting` or `running`.
        state: crate::thread::ThreadState,
        /// The strategy the job arrived with.
        strategy: crate::thread::MultitaskStrategy,
        /// The job running on the thread when this one arrived, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ahead: Option<String>,
    },
    /// The job repeats an idempotency key of an earlier job of its tenant
    /// (within the window): it does not run; its terminal event is the
    /// earlier job's, replayed, once that one has ended.
    #[serde(rename_all = "camelCase")]
    Duplicate {
        /// The earlier job's invocation id (its events are on its own
        /// subject).
        replay_of: String,
        /// The key both jobs carry.
        idempotency_key: String,
        /// The repeat's thread, when it names one (so `toolfleet events
        /// --thread` shows it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        thread_id: Option<String>,
    },
    /// The job asked to start later (its `notBefore`,
    /// `docs/schedules.md`): it waits in the chat stream, and `started`
    /// follows at its time. Always `seq` 0; the run's events go on from 1.
    #[serde(rename_all = "camelCase")]
    Scheduled {
        /// When it starts, as the job gave it (RFC 3339).
        not_before: String,
    },
    /// A piece of the answer as the model streams it, `[doc:N]` markers as
    /// written.
    Delta {
        /// The text, appended to what came before.
        text: String,
    },
    /// The model called a tool.
    #[serde(rename_all = "camelCase")]
    ToolCall {
        /// The call's id, shared by its later events.
        call_id: String,
        /// The tool's id.
        tool: String,
        /// Arguments as the model sent them, with `sensitiveArguments`
        /// replaced by `"[redacted]"`.
        arguments: Value,
    },
    /// A tool call ended.
    #[serde(rename_all = "camelCase")]
    ToolResult {
        /// The call's id.
        call_id: String,
        /// The tool's id.
        tool: String,
        /// How the call ended.
        status: ToolStatus,
        /// How long the call took, in ms.
        duration_ms: u64,
        /// The error's code when the call failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_code: Option<String>,
        /// What the tool reported that did not fail the call.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        warnings: Vec<ToolWarning>,
        /// Answered from the tool-result cache, without running the tool
        /// (absent on the wire when not).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cached: bool,
    },
    /// A progress message a tool sent while working on a call (its
    /// worker's `progress` reply), passed on as it came, shortened to
    /// [`MAX_PROGRESS_CHARS`].
    #[serde(rename_all = "camelCase")]
    ToolProgress {
        /// The call's id.
        call_id: String,
        /// The tool's id.
        tool: String,
        /// As the tool sent it, cut to [`MAX_PROGRESS_CHARS`] plus an ellipsis.
        message: String,
    },
    /// New references the answer may cite, from a turn's tool calls.
    References {
        /// The new references, each with its `[doc:N]` index.
        references: Vec<Reference>,
    },
    /// How the tools offered to the model were chosen, or changed (a
    /// `search_tools` call added some).
    #[serde(rename_all = "camelCase")]
    Scoping {
        /// `all`, `token`, `planning`, `planning_fallback` or `expansion`.
        decision: String,
        /// Tools the invocation may use (after every gate).
        permitted: usize,
        /// The tool ids offered from now on.
        tools: Vec<String>,
        /// Ids added by this step (`expansion`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        added: Vec<String>,
        /// Why, in words: a planning failure, tools a job named that are
        /// not served, ….
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
    /// The profile's deployment failed before anything had streamed
    /// (connection, timeout, 429 or 5xx after its retries): the same model
    /// call goes to the profile's next deployment.
    #[serde(rename_all = "camelCase")]
    Fallback {
        /// The deployment that failed, and its model.
        from: String,
        /// The failed deployment's model.
        from_model: String,
        /// The deployment tried now, and its model.
        to: String,
        /// The next deployment's model.
        to_model: String,
        /// The failure's code, e.g. `http_503`, `connect`.
        code: String,
    },
    /// The conversation was over the profile's context budget: its older
    /// turns were replaced by a summary (made by `llm:summarize`) before
    /// the next model call.
    #[serde(rename_all = "camelCase")]
    Compacted {
        /// The conversation's tokens before and after (the model's
        /// encoding).
        tokens_before: u64,
        /// The conversation's tokens after.
        tokens_after: u64,
        /// `tokens_before - tokens_after`.
        saved: u64,
        /// Messages the summary replaced.
        messages: u64,
    },
    /// The model called a tool that needs a person's approval: the
    /// invocation is parked until every such call of the turn is decided
    /// on `subject`, or `expires_at_ms` passes.
    #[serde(rename_all = "camelCase")]
    ApprovalRequested {
        /// The held call's id: what an [`Approval`](crate::Approval) names.
        call_id: String,
        /// The tool's id.
        tool: String,
        /// As in `tool_call`: `sensitiveArguments` redacted.
        arguments: Value,
        /// Unix ms after which the invocation ends with `approval_timeout`.
        expires_at_ms: u64,
        /// Where the decision is sent (a core NATS request with an
        /// [`Approval`](crate::Approval) body).
        subject: String,
    },
    /// A parked call was decided.
    #[serde(rename_all = "camelCase")]
    ApprovalResolved {
        /// The call's id.
        call_id: String,
        /// The tool's id.
        tool: String,
        /// Approved (the call runs now), denied (the model is told, with the
        /// reason) or timeout (the invocation ends with `approval_timeout`).
        decision: crate::approval::ApprovalOutcome,
        /// Why, as the person said.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// Who decided, as the sender said.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approver: Option<String>,
        /// How long the call waited for the decision, in ms.
        waited_ms: u64,
    },
    /// The invocation answered (terminal).
    #[serde(rename_all = "camelCase")]
    Completed {
        /// The answer, its `[doc:N]` markers renumbered 1..k to match
        /// `references` (markers citing nothing are removed).
        text: String,
        /// Only the references the answer cites, with index 1..k in order of
        /// their original index.
        references: Vec<Reference>,
        /// Tokens of every model call of the invocation, summed.
        usage: Usage,
        /// Cost in USD from the configured price table, when every model
        /// used has a price (absent otherwise).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_usd: Option<f64>,
        /// Each model call: model, purpose, usage, cost, attempts.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        llm_calls: Vec<LlmCall>,
        /// Model rounds the answer took.
        rounds: u32,
    },
    /// The invocation ended without an answer (terminal).
    Error {
        /// Why: a [`ChatErrorCode`](crate::ChatErrorCode) as a string.
        code: String,
        /// What went wrong, in words.
        message: String,
        /// For `rate_limited` and `budget_exhausted`: how long until a
        /// model call of the tenant would be admitted again, in ms.
        #[serde(
            rename = "retryAfterMs",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        retry_after_ms: Option<u64>,
    },
    /// The tenant has used `soft_limit_ratio` (or more) of one of its
    /// limits: a warning, sent at most once per limit per invocation; the
    /// invocation goes on.
    #[serde(rename_all = "camelCase")]
    LimitWarning {
        /// The limit, as the configuration names it: `spend_per_day_usd`,
        /// `spend_per_month_usd`, `tokens_per_minute`, `requests_per_minute`.
        limit: String,
        /// What the tenant has used of it in the current window (USD for
        /// spend, tokens, requests).
        used: f64,
        /// The limit itself, in the same unit.
        cap: f64,
    },
}

/// The longest progress message a `tool_progress` event carries, in
/// characters; a longer one is cut and ends with `…`.
pub const MAX_PROGRESS_CHARS: usize = 1000;

impl ChatEventBody {
    /// The event's `type` as it appears on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            ChatEventBody::Started { .. } => "started",
            ChatEventBody::Thread { .. } => "thread",
            ChatEventBody::Duplicate { .. } => "duplicate",
            ChatEventBody::Scheduled { .. } => "scheduled",
            ChatEventBody::Delta { .. } => "delta",
            ChatEventBody::ToolCall { .. } => "tool_call",
            ChatEventBody::ToolResult { .. } => "tool_result",
            ChatEventBody::ToolProgress { .. } => "tool_progress",
            ChatEventBody::References { .. } => "references",
            ChatEventBody::Scoping { .. } => "scoping",
            ChatEventBody::Fallback { .. } => "fallback",
            ChatEventBody::Compacted { .. } => "compacted",
            ChatEventBody::ApprovalRequested { .. } => "approval_requested",
            ChatEventBody::ApprovalResolved { .. } => "approval_resolved",
            ChatEventBody::Completed { .. } => "completed",
            ChatEventBody::Error { .. } => "error",
            ChatEventBody::LimitWarning { .. } => "limit_warning",
        }
    }

    /// Whether the event ends the invocation (`completed` or `error`).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            ChatEventBody::Completed { .. } | ChatEventBody::Error { .. }
        )
    }
}

/// One model call of an invocation, for usage and cost accounting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LlmCall {
    /// The model called.
    pub model: String,
    /// `conversation`, `planning` or `tool`.
    pub purpose: String,
    /// Its tokens.
    pub usage: Usage,
    /// Its cost in USD from the price table; absent when the model has no
    /// price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// HTTP attempts, retries included.
    pub attempts: u32,
}

/// The body of a tool job; the context travels in headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolJob {
    /// The tool's arguments, validated by the worker against the tool's
    /// `function.parameters` schema.
    pub arguments: Value,
    /// Per-tenant tool settings (may hold secrets: never echoed anywhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<Value>,
}

/// A model-readable error of a failed tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolErrorBody {
    /// A `snake_case` code, e.g. `invalid_arguments`.
    pub code: String,
    /// What went wrong, in words.
    pub message: String,
    /// For invalid arguments: each place they break the tool's parameters
    /// schema.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
}

/// The final answer of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolResult {
    /// The invocation of the call.
    pub invocation_id: String,
    /// The call it answers.
    pub call_id: String,
    /// The tool that ran, `ns:name@x.y.z`.
    pub tool_id: String,
    /// How the call ended.
    pub status: ToolStatus,
    /// What the model reads.
    pub content: String,
    /// Structured output, matching the tool's `outputSchema` when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Why the call failed (absent when it did not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolErrorBody>,
    /// What the content cites, each with its `[doc:N]` index.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<Reference>,
    /// The delivery attempt that produced the result (from 1).
    pub attempt: u32,
    /// How long the call took, in ms.
    pub duration_ms: u64,
    /// Set when this result was answered from the ledger of an earlier
    /// attempt.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
    /// The model calls the tool made for this result (LLM-backed tools),
    /// so the invocation's usage and cost include them. Purpose `tool`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub llm_calls: Vec<LlmCall>,
    /// Things worth a look that did not fail the call (at most
    /// [`MAX_WARNINGS`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<ToolWarning>,
}

/// The most warnings one tool result carries (the contract's limit).
pub const MAX_WARNINGS: usize = 16;
/// The longest warning message, in characters (cut with `…` beyond).
pub const MAX_WARNING_CHARS: usize = 1000;

/// Something a tool reports that did not fail the call: another model
/// answered (`fallback`), the answer does not match the output schema
/// (`output_schema_mismatch`), the reply was cut (`reply_truncated`), ….
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolWarning {
    /// `snake_case`.
    pub code: String,
    /// What happened, in words (at most [`MAX_WARNING_CHARS`]).
    pub message: String,
}

/// What a worker publishes to a job's `Toolfleet-Reply-To`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolReply {
    /// A progress message; any number may come before the result.
    #[serde(rename_all = "camelCase")]
    Progress {
        /// The invocation of the call.
        invocation_id: String,
        /// The call being worked on.
        call_id: String,
        /// What the tool is doing, in words.
        message: String,
    },
    /// The call's one result, which ends the call.
    Result(Box<ToolResult>),
}

/// What kind of message died; each kind has its own dead-letter subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterKind {
    /// A tool job.
    Tool,
    /// A chat job.
    Chat,
    /// An event a webhook or relay sink could not take.
    Sink,
}

impl DeadLetterKind {
    /// The kind's name on the wire and in the dead-letter subject.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterKind::Tool => "tool",
            DeadLetterKind::Chat => "chat",
            DeadLetterKind::Sink => "sink",
        }
    }
}

/// A job that will not be tried again, published to
/// `toolfleet.deadletter.<kind>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeadLetter {
    /// What kind of message died.
    pub kind: DeadLetterKind,
    /// The stream the message was in.
    pub stream: String,
    /// Its sequence number in that stream.
    pub stream_sequence: u64,
    /// The invocation, when it could be told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
    /// The tool call, for a tool job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// The tool, for a tool job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_id: Option<String>,
    /// How many times it was delivered.
    pub attempts: u32,
    /// Why it died, e.g. `too_many_attempts`, `malformed_job`, or for a sink
    /// `sink_http_<status>`.
    pub code: String,
    /// What went wrong, in words.
    pub error: String,
    /// Headers of the dead message, secrets excluded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The header block exactly as stored, base64 (standard alphabet), for
    /// a message whose headers could not be read (`unreadable_headers`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_headers: Option<String>,
    /// The dead job's body, for `toolfleet deadletters replay`: a JSON
    /// object, a tool job's `settings` removed (they may hold secrets) and
    /// its sensitive arguments redacted ([`DeadLetter::redact_arguments`]).
    /// Absent when the body was not a JSON object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<Value>,
}

impl DeadLetter {
    /// Hides a dead tool job's sensitive arguments (`sensitive`: its tool
    /// definition's `sensitiveArguments`) as events do: their values in
    /// `job.arguments` become [`REDACTED`](crate::redact::REDACTED), and
    /// wherever the error text quotes one, it is replaced too. Safe to
    /// repeat (a worker redacts before publishing, `toolfleet deadletters
    /// show` again for records kept before it did).
    pub fn redact_arguments(&mut self, sensitive: &[String]) {
        let Some(arguments) = self.job.as_mut().and_then(|j| j.get_mut("arguments")) else {
            return;
        };
        self.error = crate::redact::redact_argument_values(&self.error, arguments, sensitive);
        *arguments = crate::redact::redact_arguments(arguments, sensitive);
    }
}

/// The body of a dead job as a dead letter keeps it ([`DeadLetter::job`]):
/// the JSON object without `settings`, or `None` when it is not one.
#[must_use]
pub fn dead_letter_job(body: &[u8]) -> Option<Value> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut job)) => {
            job.remove("settings");
            // A webhook URL may hold a token in its path or query; a
            // replayed job answers on NATS only.
            job.remove("sink");
            Some(Value::Object(job))
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Schemas

/// The envelope schemas, embedded at build time.
pub mod schema_text {
    /// `schemas/chat_job.schema.json`.
    pub const CHAT_JOB: &str = include_str!("../../../schemas/chat_job.schema.json");
    /// `schemas/chat_event.schema.json`.
    pub const CHAT_EVENT: &str = include_str!("../../../schemas/chat_event.schema.json");
    /// `schemas/tool_job.schema.json`.
    pub const TOOL_JOB: &str = include_str!("../../../schemas/tool_job.schema.json");
    /// `schemas/tool_reply.schema.json`.
    pub const TOOL_REPLY: &str = include_str!("../../../schemas/tool_reply.schema.json");
    /// `schemas/dead_letter.schema.json`.
    pub const DEAD_LETTER: &str = include_str!("../../../schemas/dead_letter.schema.json");
}

/// Chat job fields a client may not send: trust is the fleet's to decide
/// (the deployment the orchestrator calls), never a client's claim. A job
/// with one is refused with a message that says so, rather than the
/// schema's bare "additional property".
pub const FLEET_DECIDED: [&str; 3] = ["providerConfidence", "provider", "connection"];

/// An envelope kind with its schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Envelope {
    /// A [`ChatJob`].
    ChatJob,
    /// A [`ChatEvent`].
    ChatEvent,
    /// A [`ToolJob`].
    ToolJob,
    /// A [`ToolReply`].
    ToolReply,
    /// A [`DeadLetter`].
    DeadLetter,
}

impl Envelope {
    /// Every envelope kind.
    pub const ALL: [Envelope; 5] = [
        Envelope::ChatJob,
        Envelope::ChatEvent,
        Envelope::ToolJob,
        Envelope::ToolReply,
        Envelope::DeadLetter,
    ];

    /// The schema's file name, e.g. `chat_job.schema.json`.
    pub fn name(self) -> &'static str {
        match self {
            Envelope::ChatJob => "chat_job.schema.json",
            Envelope::ChatEvent => "chat_event.schema.json",
            Envelope::ToolJob => "tool_job.schema.json",
            Envelope::ToolReply => "tool_reply.schema.json",
            Envelope::DeadLetter => "dead_letter.schema.json",
        }
    }

    /// The embedded schema's text.
    pub fn schema_text(self) -> &'static str {
        match self {
            Envelope::ChatJob => schema_text::CHAT_JOB,
            Envelope::ChatEvent => schema_text::CHAT_EVENT,
            Envelope::ToolJob => schema_text::TOOL_JOB,
            Envelope::ToolReply => schema_text::TOOL_REPLY,
            Envelope::DeadLetter => schema_text::DEAD_LETTER,
        }
    }

    /// The schema, compiled once on first use.
    pub fn validator(self) -> &'static Validator {
        static COMPILED: LazyLock<Vec<Validator>> = LazyLock::new(|| {
            Envelope::ALL
                .iter()
                .map(|e| {
                    // Start-up invariant: the embedded schemas are tested to
                    // compile (`protocol::tests::schemas_compile`).
                    let schema: Value = serde_json::from_str(e.schema_text())
                        .expect("embedded envelope schema is JSON");
                    Validator::compile(&schema).expect("embedded envelope schema compiles")
                })
                .collect()
        });
        let i = Envelope::ALL
            .iter()
            .position(|e| *e == self)
            .unwrap_or_default();
        &COMPILED[i]
    }

    /// Size check, JSON parse, schema validation, then deserialisation.
    pub fn decode<T: serde::de::DeserializeOwned>(
        self,
        payload: &[u8],
    ) -> Result<T, ProtocolError> {
        self.decode_within(payload, MAX_JOB_BYTES)
    }

    /// [`decode`](Self::decode) with a size limit of the reader's: the
    /// smaller of [`MAX_JOB_BYTES`] and `limit` (a reader passes its NATS
    /// server's `max_payload`, which may be the smaller).
    pub fn decode_within<T: serde::de::DeserializeOwned>(
        self,
        payload: &[u8],
        limit: usize,
    ) -> Result<T, ProtocolError> {
        let limit = limit.min(MAX_JOB_BYTES);
        if payload.len() > limit {
            return Err(ProtocolError::TooLarge {
                size: payload.len(),
                limit,
            });
        }
        let value: Value =
            serde_json::from_slice(payload).map_err(|e| ProtocolError::NotJson(e.to_string()))?;
        if self == Envelope::ChatJob
            && let Some(field) = FLEET_DECIDED.iter().find(|f| value.get(**f).is_some())
        {
            return Err(ProtocolError::Schema {
                schema: self.name(),
                details: format!(
                    "/{field}: a chat job may not claim providerConfidence, provider or \
                     connection: the fleet decides them from the deployment it calls \
                     (its operator's configuration)"
                ),
            });
        }
        if let Err(violations) = self.validator().validate(&value) {
            return Err(ProtocolError::Schema {
                schema: self.name(),
                details: crate::schema::describe(&violations),
            });
        }
        serde_json::from_value(value).map_err(|e| ProtocolError::Schema {
            schema: self.name(),
            details: e.to_string(),
        })
    }
}

/// Best effort: the invocation id of a payload that failed validation, so the
/// client still hears about it on its events subject and its dead letter
/// names it.
///
/// The first of these that is a valid invocation id
/// ([`valid_invocation_id`]) wins:
///
/// 1. the body's `invocationId`, when the body parses as JSON — it is what
///    the client's events subject is named after;
/// 2. the `Toolfleet-Invocation-Id` header;
/// 3. the `Nats-Msg-Id` header: older clients set it to the invocation
///    id (clients no longer set it on chat jobs), so a body that is not
///    JSON at all can still be answered on the right subject.
pub fn salvage_invocation_id(payload: &[u8], h: Option<&HeaderMap>) -> Option<String> {
    let from_body = serde_json::from_slice::<Value>(payload)
        .ok()
        .and_then(|v| v.get("invocationId")?.as_str().map(str::to_string));
    let header = |name: &str| {
        h.and_then(|h| h.get(name))
            .map(|v| v.as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    };
    [
        from_body,
        header(headers::INVOCATION_ID),
        header(headers::NATS_MSG_ID),
    ]
    .into_iter()
    .flatten()
    .find(|id| valid_invocation_id(id))
}

/// The headers of a dead message worth keeping in its [`DeadLetter`]: the
/// `Toolfleet-*` context, `traceparent` and `Nats-Msg-Id` — nothing else,
/// so a header a client added (credentials included) never travels on.
/// Settings travel in job bodies, never in headers, so none are kept.
pub fn dead_letter_headers(h: Option<&HeaderMap>) -> BTreeMap<String, String> {
    let Some(h) = h else {
        return BTreeMap::new();
    };
    h.iter()
        .filter(|(k, _)| {
            let k = k.to_string();
            k.starts_with("Toolfleet-") || k == headers::TRACEPARENT || k == headers::NATS_MSG_ID
        })
        .filter_map(|(k, v)| v.first().map(|v| (k.to_string(), v.to_string())))
        .collect()
}

/// A message body: `value` as JSON.
pub fn encode<T: Serialize>(value: &T) -> bytes::Bytes {
    // Serialising our own envelopes (strings, numbers, maps with string keys)
    // cannot fail.
    serde_json::to_vec(value)
        .map(bytes::Bytes::from)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> ToolId {
        "retrieval:search_documents@1.0.0".parse().unwrap()
    }

    #[test]
    fn subjects_follow_the_contract() {
        let s = Subjects::new("toolfleet").unwrap();
        assert_eq!(s.chat_submit("acme"), "toolfleet.chat.submit.acme");
        assert_eq!(s.chat_submit_all(), "toolfleet.chat.submit.*");
        assert_eq!(
            s.chat_events("acme", "abc"),
            "toolfleet.chat.events.acme.abc"
        );
        assert_eq!(
            s.chat_cancel("acme", "abc"),
            "toolfleet.chat.cancel.acme.abc"
        );
        assert_eq!(s.chat_cancel_all(), "toolfleet.chat.cancel.*.*");
        assert_eq!(
            s.tool(&id()),
            "toolfleet.tool.retrieval.search_documents.1_0_0"
        );
        assert_eq!(s.chat_stream(), "TOOLFLEET_CHAT");
        assert_eq!(s.chat_tenant_consumer("acme"), "chat-acme");
        assert_eq!(s.consumer_tenant("chat-acme"), Some("acme"));
        assert_eq!(s.consumer_tenant("orchestrators"), None);
        assert_eq!(s.consumer_tenant("chat-"), None);
        assert_eq!(s.chat_batch("acme"), "toolfleet.chat.batch.acme");
        assert_eq!(s.chat_batch_consumer("acme"), "batch-acme");
        assert_eq!(
            s.consumer_lane("batch-acme"),
            Some(("acme", Priority::Batch))
        );
        assert_eq!(
            s.consumer_lane("chat-acme"),
            Some(("acme", Priority::Interactive))
        );
        assert_eq!(
            s.lane_tenant("toolfleet.chat.batch.acme"),
            Some(("acme", Priority::Batch))
        );
        assert_eq!(
            s.lane_tenant("toolfleet.chat.submit.acme"),
            Some(("acme", Priority::Interactive))
        );
        assert_eq!(s.lane_tenant("toolfleet.chat.batch.a.b"), None);
        assert_eq!(s.tools_stream(), "TOOLFLEET_TOOLS");
        assert_eq!(s.events_stream(), "TOOLFLEET_EVENTS");
        assert_eq!(
            s.tool_consumer(&id()),
            "tool_retrieval_search_documents_1_0_0"
        );
        assert_eq!(
            s.dead_letter(DeadLetterKind::Tool),
            "toolfleet.deadletter.tool"
        );
        assert_eq!(s.catalog_bucket(), "TOOLFLEET_CATALOG");
        assert_eq!(s.worker_service(), "toolfleet-worker");
        let t = Subjects::new("acme.tf-prod").unwrap();
        assert_eq!(t.chat_stream(), "ACME_TF-PROD_CHAT");
        assert_eq!(t.catalog_bucket(), "ACME_TF-PROD_CATALOG");
        assert_eq!(t.worker_service(), "acme_tf-prod-worker");
        for bad in [
            "", "a..b", ".a", "a.", "a b", "a.*", "a.>", "a_b", "A", "a.B", "a/b", "é",
        ] {
            assert_eq!(
                Subjects::new(bad),
                Err(ProtocolError::BadPrefix(bad.into())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn sink_subjects_and_ownership() {
        let s = Subjects::new("toolfleet").unwrap();
        assert_eq!(s.sink("acme", "inv-1"), "toolfleet.sink.acme.inv-1");
        assert_eq!(s.sink_all(), "toolfleet.sink.>");
        assert_eq!(s.sinks_stream(), "TOOLFLEET_SINKS");
        assert_eq!(
            s.dead_letter(DeadLetterKind::Sink),
            "toolfleet.deadletter.sink"
        );
        assert!(s.owns("toolfleet.chat.events.a.b"));
        assert!(s.owns("toolfleet"));
        assert!(!s.owns("toolfleetx.chat"));
        assert!(!s.owns("other.toolfleet.x"));
    }

    #[test]
    fn a_chat_job_sink_round_trips_and_is_checked_by_the_schema() {
        let job = serde_json::json!({
            "invocationId": "inv-1",
            "messages": [{ "role": "user", "content": "hi" }],
            "sink": { "webhook": "https://hooks.example.com/x", "events": "all" }
        });
        let parsed: ChatJob = Envelope::ChatJob
            .decode(job.to_string().as_bytes())
            .unwrap();
        let sink = parsed.sink.clone().unwrap();
        assert_eq!(sink.webhook.as_deref(), Some("https://hooks.example.com/x"));
        assert_eq!(sink.events, Some(SinkEvents::All));
        assert_eq!(serde_json::to_value(&parsed).unwrap(), job);
        for bad in [
            serde_json::json!({}),
            serde_json::json!({ "events": "final" }),
            serde_json::json!({ "relay": "other.*" }),
            serde_json::json!({ "webhook": "https://x", "events": "some" }),
            serde_json::json!({ "webhook": "https://x", "secret": "s" }),
        ] {
            let mut job = job.clone();
            job["sink"] = bad.clone();
            assert!(
                Envelope::ChatJob
                    .decode::<ChatJob>(job.to_string().as_bytes())
                    .is_err(),
                "{bad}"
            );
        }
    }

    /// The tenant is read back only from the fleet's own subjects, and only
    /// when it is one valid token.
    #[test]
    fn tenants_are_read_back_from_subjects() {
        let s = Subjects::new("toolfleet").unwrap();
        assert_eq!(
            s.submit_tenant(&s.chat_submit("acme-1_x")),
            Some("acme-1_x")
        );
        assert_eq!(
            s.parse_cancel(&s.chat_cancel("acme", "inv-1")),
            Some(("acme", "inv-1"))
        );
        for bad in [
            "toolfleet.chat.submit",
            "toolfleet.chat.submit.",
            "toolfleet.chat.submit.a.b",
            "other.chat.submit.acme",
            "toolfleet.chat.submitx.acme",
        ] {
            assert_eq!(s.submit_tenant(bad), None, "{bad:?}");
        }
        for bad in [
            "toolfleet.chat.cancel.inv-1",
            "toolfleet.chat.cancel.acme.",
            "toolfleet.chat.cancel.acme.inv.1",
            "toolfleet.chat.cancel..inv-1",
            "other.chat.cancel.acme.inv-1",
        ] {
            assert_eq!(s.parse_cancel(bad), None, "{bad:?}");
        }
        assert!(valid_tenant(DEFAULT_TENANT));
        assert!(valid_tenant(&"a".repeat(64)));
        for bad in ["", "a b", "a.b", "*", ">", "é", &"a".repeat(65)] {
            assert!(!valid_tenant(bad), "{bad:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(headers::INVOCATION_ID, "inv-1");
        h.insert(headers::TENANT, "two words");
        assert!(matches!(
            InvocationContext::from_headers(&h),
            Err(ProtocolError::MalformedHeader {
                name: headers::TENANT,
                ..
            })
        ));
    }

    /// Different prefixes never share a stream, bucket or service name:
    /// the prefixes that used to collide (`a.b`, `a_b`, `a-b`, `A.B`) and
    /// their neighbours, pairwise.
    #[test]
    fn distinct_prefixes_get_distinct_names() {
        let prefixes = [
            "a.b",
            "a_b",
            "a-b",
            "A.B",
            "ab",
            "a",
            "b",
            "a.b.c",
            "a-b.c",
            "a.b-c",
            "a--b",
            "a.chat",
            "a.tools",
            "a.catalog",
            "kv.a",
            "a-worker",
            "toolfleet",
        ];
        let valid: Vec<Subjects> = prefixes
            .iter()
            .filter_map(|p| Subjects::new(p).ok())
            .collect();
        let mut owner: std::collections::HashMap<String, &str> = Default::default();
        for s in &valid {
            // Stream names (the bucket by its stream) and service names.
            let names = [
                s.chat_stream(),
                s.tools_stream(),
                format!("KV_{}", s.catalog_bucket()),
                s.worker_service(),
            ];
            for name in names {
                assert!(
                    !name.is_empty() && !name.contains(['.', '*', '>', ' ']),
                    "{name:?} is not a valid stream or service name"
                );
                if let Some(other) = owner.insert(name.clone(), s.prefix()) {
                    panic!("{other:?} and {:?} both map to {name:?}", s.prefix());
                }
            }
        }
        assert_eq!(
            valid.iter().map(Subjects::prefix).collect::<Vec<_>>(),
            prefixes
                .iter()
                .copied()
                .filter(|p| !p.contains('_') && !p.contains(|c: char| c.is_ascii_uppercase()))
                .collect::<Vec<_>>()
        );
    }

    fn full_call() -> CallContext {
        CallContext {
            invocation: InvocationContext {
                invocation_id: "inv-1".into(),
                tenant: Some("acme".into()),
                user: Some("u-7".into()),
                profile: Some("default".into()),
                provider: Some("openai".into()),
                connection: Some("conn-1".into()),
                resource: Some("res-9".into()),
                data_source_id: Some("ds-3".into()),
                attached_documents: vec!["uploads:a.md".into(), "uploads:\"odd\" é.csv".into()],
                provider_confidence: Some(0.75),
                deadline_ms: Some(1_900_000_000_000),
                traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
                tenant_limits: Some(TenantLimits {
                    requests_per_minute: 60,
                    spend_per_day_micros: 5_000_000,
                    ..TenantLimits::default()
                }),
                priority: Priority::Batch,
            },
            call_id: "call_1".into(),
            tool_id: id(),
            attempt: 3,
            reply_to: "toolfleet.reply.abc.call_1".into(),
            citation_floor: 7,
            new_call: true,
        }
    }

    #[test]
    fn a_forged_citation_floor_past_the_cap_is_refused() {
        let mut h = full_call().to_headers();
        h.insert(
            headers::CITATION_FLOOR,
            (MAX_CITATION_FLOOR + 1).to_string().as_str(),
        );
        let e = CallContext::from_headers(&h).unwrap_err();
        assert_eq!(e.code(), "bad_headers");
        h.insert(
            headers::CITATION_FLOOR,
            MAX_CITATION_FLOOR.to_string().as_str(),
        );
        assert_eq!(
            CallContext::from_headers(&h).unwrap().citation_floor,
            MAX_CITATION_FLOOR
        );
    }

    #[test]
    fn call_context_round_trips_through_headers() {
        let c = full_call();
        let h = c.to_headers();
        assert_eq!(CallContext::from_headers(&h).unwrap(), c);
        assert_eq!(
            h.get(headers::NATS_MSG_ID).unwrap().as_str(),
            "inv-1.call_1"
        );
    }

    /// Every header, one at a time: written under its exact name and read
    /// back.
    #[test]
    fn each_header_round_trips() {
        use headers::*;
        let c = full_call();
        let h = c.to_headers();
        let expected = [
            (INVOCATION_ID, "inv-1"),
            (CALL_ID, "call_1"),
            (TOOL_ID, "retrieval:search_documents@1.0.0"),
            (TENANT, "acme"),
            (USER, "u-7"),
            (PROFILE, "default"),
            (PROVIDER, "openai"),
            (CONNECTION, "conn-1"),
            (RESOURCE, "res-9"),
            (DATA_SOURCE_ID, "ds-3"),
            (
                ATTACHED_DOCUMENTS,
                r#"["uploads:a.md","uploads:\"odd\" é.csv"]"#,
            ),
            (PROVIDER_CONFIDENCE, "0.75"),
            (DEADLINE, "1900000000000"),
            (ATTEMPT, "3"),
            (REPLY_TO, "toolfleet.reply.abc.call_1"),
            (CITATION_FLOOR, "7"),
            (NEW_CALL, "1"),
            (
                TRACEPARENT,
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            (NATS_MSG_ID, "inv-1.call_1"),
        ];
        for (name, value) in expected {
            assert_eq!(h.get(name).map(|v| v.as_str()), Some(value), "{name}");
            // Case matters: a lower-cased name is a different header.
            if name != TRACEPARENT {
                assert!(h.get(name.to_lowercase().as_str()).is_none(), "{name}");
            }
        }
    }

    #[test]
    fn forged_attached_documents_are_refused_naming_the_header() {
        let too_many: Vec<String> = (0..=MAX_ATTACHED_DOCUMENTS)
            .map(|i| format!("d{i}"))
            .collect();
        for bad in [
            "uploads:a.md".to_owned(),
            r#"{"a":1}"#.to_owned(),
            r#"["ok", 3]"#.to_owned(),
            r#"[""]"#.to_owned(),
            r#"["line\nbreak"]"#.to_owned(),
            serde_json::to_string(&too_many).unwrap(),
        ] {
            let mut h = full_call().to_headers();
            h.insert(headers::ATTACHED_DOCUMENTS, bad.as_str());
            let e = CallContext::from_headers(&h).unwrap_err();
            assert!(
                e.to_string().contains(headers::ATTACHED_DOCUMENTS),
                "{bad}: {e}"
            );
        }
        // None attached: no header, and an empty list back.
        let mut c = full_call();
        c.invocation.attached_documents.clear();
        let h = c.to_headers();
        assert!(h.get(headers::ATTACHED_DOCUMENTS).is_none());
        assert_eq!(CallContext::from_headers(&h).unwrap(), c);
    }

    #[test]
    fn missing_and_malformed_headers_are_clear_errors() {
        let c = full_call();
        for name in [
            headers::INVOCATION_ID,
            headers::CALL_ID,
            headers::TOOL_ID,
            headers::REPLY_TO,
        ] {
            let mut h = HeaderMap::new();
            for (k, v) in c.to_headers().iter() {
                if k.to_string() != name {
                    for v in v {
                        h.append(k.to_string().as_str(), v.as_str());
                    }
                }
            }
            assert_eq!(
                CallContext::from_headers(&h),
                Err(ProtocolError::MissingHeader(name))
            );
        }
        for (name, bad) in [
            (headers::TOOL_ID, "search_documents"),
            (headers::DEADLINE, "tomorrow"),
            (headers::ATTEMPT, "-1"),
            (headers::PROVIDER_CONFIDENCE, "1.5"),
            (headers::INVOCATION_ID, "a.b"),
        ] {
            let mut h = c.to_headers();
            h.insert(name, bad);
            match CallContext::from_headers(&h) {
                Err(ProtocolError::MalformedHeader { name: n, reason }) => {
                    assert_eq!(n, name);
                    assert!(!reason.is_empty());
                }
                other => panic!("{name}={bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn schemas_compile() {
        for e in Envelope::ALL {
            let _ = e.validator();
        }
    }

    fn examples(e: Envelope) -> Vec<Value> {
        let schema: Value = serde_json::from_str(e.schema_text()).unwrap();
        let ex = schema["examples"].as_array().cloned().unwrap_or_default();
        assert!(!ex.is_empty(), "{} has no examples", e.name());
        ex
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(e: Envelope) {
        for ex in examples(e) {
            let bytes = serde_json::to_vec(&ex).unwrap();
            let typed: T = e
                .decode(&bytes)
                .unwrap_or_else(|err| panic!("{}: {err}\n{ex}", e.name()));
            assert_eq!(serde_json::to_value(&typed).unwrap(), ex, "{}", e.name());
        }
    }

    /// The serde types and the schemas agree: every example validates,
    /// deserialises and serialises back to the same JSON.
    #[test]
    fn schema_examples_round_trip_through_the_types() {
        round_trip::<ChatJob>(Envelope::ChatJob);
        round_trip::<ChatEvent>(Envelope::ChatEvent);
        round_trip::<ToolJob>(Envelope::ToolJob);
        round_trip::<ToolReply>(Envelope::ToolReply);
        round_trip::<DeadLetter>(Envelope::DeadLetter);
    }

    /// And the other way: what the types produce validates.
    #[test]
    fn typed_values_validate() {
        let ev = ChatEvent {
            invocation_id: "inv-1".into(),
            seq: 4,
            body: ChatEventBody::Completed {
                text: "Hi [doc:1]".into(),
                references: vec![Reference {
                    index: 1,
                    kind: "document".into(),
                    title: "T".into(),
                    source: None,
                    url: None,
                    snippet: None,
                    tool_id: None,
                    call_id: None,
                }],
                usage: Usage::default(),
                cost_usd: Some(0.00042),
                llm_calls: vec![LlmCall {
                    model: "gpt-4o-mini".into(),
                    purpose: "conversation".into(),
                    usage: Usage::default(),
                    cost_usd: Some(0.00042),
                    attempts: 1,
                }],
                rounds: 2,
            },
        };
        let v = serde_json::to_value(&ev).unwrap();
        Envelope::ChatEvent.validator().validate(&v).unwrap();
    }

    #[test]
    fn decode_rejects_bad_input_clearly() {
        let e = Envelope::ChatJob;
        assert_eq!(
            e.decode::<ChatJob>(b"{not json").unwrap_err().code(),
            "malformed_json"
        );
        let err = e
            .decode::<ChatJob>(br#"{"invocationId":"a.b","messages":[]}"#)
            .unwrap_err();
        assert_eq!(err.code(), "schema_violation");
        let big = vec![b' '; MAX_JOB_BYTES + 1];
        assert_eq!(e.decode::<ChatJob>(&big).unwrap_err().code(), "too_large");
    }

    /// Trust is the fleet's: a job claiming it is refused, saying why.
    #[test]
    fn a_chat_job_may_not_claim_its_trust() {
        for (field, value) in [
            ("providerConfidence", serde_json::json!(1.0)),
            ("provider", serde_json::json!("openai")),
            ("connection", serde_json::json!("conn-1")),
        ] {
            let mut job = serde_json::json!({
                "invocationId": "inv-1",
                "messages": [{ "role": "user", "content": "hi" }],
            });
            job[field] = value;
            let err = Envelope::ChatJob
                .decode::<ChatJob>(job.to_string().as_bytes())
                .unwrap_err();
            assert_eq!(err.code(), "schema_violation");
            let said = err.to_string();
            assert!(
                said.contains(&format!("/{field}")) && said.contains("the fleet decides them"),
                "{said}"
            );
            // The schema alone refuses it too.
            assert!(Envelope::ChatJob.validator().validate(&job).is_err());
        }
    }

    #[test]
    fn salvage_finds_the_invocation_id() {
        assert_eq!(
            salvage_invocation_id(br#"{"invocationId":"abc","messages":7}"#, None),
            Some("abc".into())
        );
        assert_eq!(
            salvage_invocation_id(br#"{"invocationId":"a b"}"#, None),
            None
        );
        assert_eq!(salvage_invocation_id(b"garbage", None), None);
    }

    #[test]
    fn salvage_prefers_the_body_then_the_invocation_header_then_the_message_id() {
        let mut h = HeaderMap::new();
        h.insert(headers::NATS_MSG_ID, "from-msg-id");
        assert_eq!(
            salvage_invocation_id(b"{not json", Some(&h)).as_deref(),
            Some("from-msg-id")
        );
        h.insert(headers::INVOCATION_ID, "from-header");
        assert_eq!(
            salvage_invocation_id(b"{not json", Some(&h)).as_deref(),
            Some("from-header")
        );
        assert_eq!(
            salvage_invocation_id(br#"{"invocationId":"from-body"}"#, Some(&h)).as_deref(),
            Some("from-body")
        );
        // An invalid id anywhere is skipped, not used.
        assert_eq!(
            salvage_invocation_id(br#"{"invocationId":"a b"}"#, Some(&h)).as_deref(),
            Some("from-header")
        );
        let mut bad = HeaderMap::new();
        bad.insert(headers::NATS_MSG_ID, "inv-1.call_1");
        assert_eq!(salvage_invocation_id(b"{not json", Some(&bad)), None);
    }

    #[test]
    fn call_cancels_are_told_from_invocation_cancels() {
        let s = Subjects::new("toolfleet").unwrap();
        let call = s.chat_cancel_call("acme", "inv-1", "call_2");
        assert_eq!(
            s.parse_cancel_call(&call),
            Some(("acme", "inv-1", "call_2"))
        );
        assert_eq!(s.parse_cancel(&call), None);
        let whole = s.chat_cancel("acme", "inv-1");
        assert_eq!(s.parse_cancel(&whole), Some(("acme", "inv-1")));
        assert_eq!(s.parse_cancel_call(&whole), None);
        assert_eq!(
            s.parse_cancel_call("toolfleet.chat.cancel.acme.inv-1.c.d"),
            None
        );
        assert_eq!(
            s.parse_cancel_call("toolfleet.chat.cancel.acme.inv-1.*"),
            None
        );
    }

    #[test]
    fn tool_subjects_name_their_tool() {
        let s = Subjects::new("toolfleet").unwrap();
        assert_eq!(
            s.tool_of_subject("toolfleet.tool.system.current_datetime.1_0_0")
                .as_deref(),
            Some("system:current_datetime@1.0.0")
        );
        let id: ToolId = "system:current_datetime@1.0.0".parse().unwrap();
        assert_eq!(
            s.tool_of_subject(&s.tool(&id)).as_deref(),
            Some("system:current_datetime@1.0.0")
        );
        assert_eq!(s.tool_of_subject("other.tool.a.b.1_0_0"), None);
        assert_eq!(s.tool_of_subject("toolfleet.tool.a.b"), None);
        assert_eq!(s.tool_of_subject("toolfleet.tool.a.b.1_0_0.x"), None);
    }

    #[test]
    fn dead_letters_keep_only_the_context_headers() {
        let mut h = full_call().to_headers();
        h.insert("Authorization", "Bearer sk-secret");
        h.insert("X-Tenant-Settings", "{\"apiKey\":\"sk-secret\"}");
        let kept = dead_letter_headers(Some(&h));
        assert_eq!(
            kept.get(headers::INVOCATION_ID).map(String::as_str),
            Some("inv-1")
        );
        assert_eq!(
            kept.get(headers::NATS_MSG_ID).map(String::as_str),
            Some("inv-1.call_1")
        );
        assert!(kept.contains_key(headers::TRACEPARENT));
        assert!(kept.keys().all(|k| k.starts_with("Toolfleet-")
            || k == headers::TRACEPARENT
            || k == headers::NATS_MSG_ID));
        assert!(!format!("{kept:?}").contains("sk-secret"));
        assert!(dead_letter_headers(None).is_empty());
    }

    #[test]
    fn decode_within_takes_the_smaller_limit() {
        let job = br#"{"invocationId":"a","messages":[]}"#;
        let e = Envelope::ChatJob
            .decode_within::<ChatJob>(job, 10)
            .unwrap_err();
        assert_eq!(
            e,
            ProtocolError::TooLarge {
                size: job.len(),
                limit: 10
            }
        );
        let big = vec![b' '; MAX_JOB_BYTES + 1];
        assert_eq!(
            Envelope::ChatJob
                .decode_within::<ChatJob>(&big, usize::MAX)
                .unwrap_err(),
            ProtocolError::TooLarge {
                size: big.len(),
                limit: MAX_JOB_BYTES
            }
        );
    }

    #[test]
    fn event_names_are_the_wire_types() {
        let body = ChatEventBody::ToolProgress {
            call_id: "call_1".into(),
            tool: "system:current_datetime@1.0.0".into(),
            message: "halfway".into(),
        };
        let v = serde_json::to_value(ChatEvent {
            invocation_id: "inv-1".into(),
            seq: 3,
            body: body.clone(),
        })
        .unwrap();
        assert_eq!(v["type"], body.name());
        assert_eq!(v["callId"], "call_1");
        Envelope::ChatEvent.validator().validate(&v).unwrap();
    }
}
