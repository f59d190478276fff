//! Dispatch: [`ToolRunner`] runs one turn's tool calls and answers every
//! one of them.
//!
//! Calls over the per-turn cap are not run. With parallel calls on, the
//! parallel-safe calls go out together as one batch and each unsafe one
//! runs alone after them; with them off, every call runs alone. A call is
//! answered at once, without a job, when the invocation may not use its
//! tool (not offered, not permitted even after a fresh catalog reading:
//! the answer names close matches among the offered tools), its
//! arguments are not JSON, no live worker serves it (after one fresh
//! catalog reading), or its job would not fit the size limits
//! ([`PayloadLimits`](crate::PayloadLimits)). Otherwise its job goes out —
//! to JetStream, or core request-reply for `delivery: direct` tools — with
//! its reply subject under the invocation's inbox (`<inbox>.<call id>`, so
//! even a bare "no responders" names its call).
//!
//! A batch then waits for one closed set of events (`Waited`): a result,
//! a progress message (passed on as a `tool_progress` event), "no
//! responders", a catalog reading, the earliest call deadline, or the end
//! of the reply subscription. A call whose tool is missing from two
//! catalog readings in a row while it waits is answered `no_worker` (one
//! missed `INFO` answer under load is not enough); a call past its deadline
//! (its tool's timeout plus slack, never past the invocation's) is answered
//! `timeout`.
//!
//! A declared pool's tool ([`crate::tools::declared`]) with no live worker
//! is no `no_worker`: its job goes out and queues on the tool's consumer
//! (where the pool's autoscaler sees it), a `tool_progress` event says the
//! call waits for the pool's first worker, and the call waits for it until
//! just before the invocation's deadline ([`POOL_WAIT_MARGIN`]); once a
//! worker is live, the tool's own timeout counts from then on. A call that
//! waited in vain is answered `no_worker` and ends the invocation with
//! `deadline_exceeded`, naming the pool ([`ToolRunner::ended`]): no time is
//! left for the model.
//!
//! Every call's tool is resolved once ([`resolve_tool`]); a call whose tool
//! needs a person's approval under the invocation's rules runs only when
//! it carries that approval ([`Resolved::approved`]), whoever called the
//! runner. A tool with a `settingsSchema` gets the invocation's tenant's
//! settings of it in its job (`settings`), read from the settings bucket
//! (`<P>_SETTINGS`, key `<tenant>.<ns>.<name>`) at dispatch: one read per
//! such call, never a setting of another tenant.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toolfleet_protocol::ToolErrorCode;

use async_nats::jetstream::context::PublishAckFuture;
use serde_json::Value;
use tokio::sync::watch;
use toolfleet_llm::ToolCall;
use toolfleet_protocol::catalog::Catalog;
use toolfleet_protocol::tools::{CompiledTool, Delivery};
use toolfleet_protocol::{
    CallContext, ChatEventBody, Envelope, MAX_PROGRESS_CHARS, ToolJob, ToolReply, ToolResult,
    ToolStatus, encode,
};
use tracing::warn;

pub mod agent;
mod cache;
mod inflight;
mod readback;

use crate::metrics::OrchestratorMetrics;
use crate::replies::RunInbox;
use crate::text::{redact, shorten};
use crate::{Events, Failure, Fleet, Invocation, ToolOutcome};

/// Runs tool calls for one invocation: owns the invocation's reply inbox.
pub struct ToolRunner<'f> {
    fleet: &'f Fleet,
    inbox: RunInbox,
    /// Model calls the tools reported with their results, not yet taken
    /// into the invocation's usage ([`ToolRunner::take_spent`]).
    spent: Vec<toolfleet_protocol::LlmCall>,
    /// The call id and tool of an internal call
    /// ([`ToolRunner::run_internal`]) in flight.
    internal: Option<(String, Arc<CompiledTool>)>,
    /// A worker answered `cancelled`: it heard the invocation's cancel,
    /// which this orchestrator may not have yet ([`ToolRunner::cancelled`]).
    cancelled: bool,
    /// The orchestrator's NATS connection coming back: replies sent while
    /// it was away are lost, so waiting calls are read back
    /// ([`readback`]).
    reconnects: toolfleet_service::jobs::Reconnects,
    /// A call waited for a declared pool's first worker until the
    /// invocation's deadline, in vain ([`ToolRunner::ended`]).
    ended: Option<Failure>,
}

/// How long before the invocation's deadline a call waiting for a declared
/// pool's first worker gives up: time to answer it and end the invocation
/// with an `error` that names the pool, before the deadline ends it
/// without a word on why.
pub const POOL_WAIT_MARGIN: Duration = Duration::from_secs(1);

impl Fleet {
    /// A [`ToolRunner`] with its reply inbox registered with the
    /// orchestrator's reply subscription (before any job is published, so
    /// no reply is missed). The inbox is under the fleet's reply prefix:
    /// workers refuse any other reply subject, and NATS permissions let
    /// only orchestrators read it.
    pub async fn tool_runner(&self) -> Result<ToolRunner<'_>, Failure> {
        Ok(ToolRunner {
            fleet: self,
            inbox: self.replies.register(),
            spent: Vec::new(),
            internal: None,
            cancelled: false,
            reconnects: self.reconnects.from_now(),
            ended: None,
        })
    }
}

/// What a batch waits for: one closed set of events.
#[derive(Debug)]
enum Waited {
    /// A call's final result.
    Result(Box<ToolResult>),
    /// A progress message from the worker running a call.
    Progress { call_id: String, message: String },
    /// Nobody took a direct call's request.
    NoResponders { call_id: String },
    /// A new catalog reading (changed or not).
    Catalog(Arc<Catalog>),
    /// The earliest deadline of the waiting calls passed.
    Deadline,
    /// The NATS connection came back: replies may have been lost.
    Reconnected,
    /// Time to read the ledger for the calls marked to be read back.
    Look,
    /// The reply subscription ended (the connection is gone for good).
    Closed,
}

/// A call whose job is out.
struct Pending {
    /// Position in the batch.
    index: usize,
    tool: Arc<CompiledTool>,
    started: Instant,
    deadline: tokio::time::Instant,
    /// Catalog readings in a row without the tool.
    misses: u32,
    /// The call's `execute_tool` span: open from dispatch to its answer
    /// (or expiry), the parent of the worker's.
    span: tracing::Span,
    /// Its tenant's place in the tool's pool, held until it is answered.
    place: Option<inflight::Place>,
    /// The worker keeps its result in the ledger (the tool is not
    /// idempotent): a missed reply can be read back.
    ledger: bool,
    /// An idempotent tool's job, to ask again when its reply may have
    /// been lost.
    again: Option<readback::Again>,
    /// Read its result back from the ledger at the batch's next look.
    look: bool,
    /// The declared pool whose first worker the call waits for (none of
    /// its workers was live when it was sent); `None` once one is.
    waits_for: Option<String>,
    /// The call missed the tool-result cache: its `ok` result is stored
    /// ([`cache`]).
    cache: Option<cache::Miss>,
}

/// One batch of calls sent together, and their answers so far.
struct Batch<'c> {
    calls: Vec<&'c ToolCall>,
    answers: Vec<Option<ToolOutcome>>,
    /// By call id.
    pending: HashMap<String, Pending>,
    /// When the ledger is read next for the calls marked `look`.
    look_at: Option<tokio::time::Instant>,
}

/// A fresh call id for the fleet (`call_<32 hex>`): unique within the
/// invocation, a single subject token, and safe as an idempotency key.
pub fn new_call_id() -> String {
    format!("call_{}", uuid::Uuid::new_v4().simple())
}

/// The fleet's id for the model's call at `position` of round `round` of
/// `invocation` (of `tenant`), naming `function` with `arguments`
/// (`call_<32 hex>`, like [`new_call_id`]): the same call of a replayed
/// run — a redelivery that took the invocation over, or a crash's — gets
/// the same id, so its job is a duplicate JetStream drops and its result
/// is read from the ledger ([`readback`]): a tool that keeps a ledger runs
/// once per call however often the run is replayed. Any difference (a
/// model that asked otherwise the second time) is another call.
pub fn replayable_call_id(
    (tenant, invocation): (&str, &str),
    round: u32,
    position: usize,
    function: &str,
    arguments: &str,
) -> String {
    // Fields separated by NUL, which none of them holds meaningfully.
    let mut name =
        Vec::with_capacity(tenant.len() + invocation.len() + function.len() + arguments.len() + 32);
    for part in [
        tenant.as_bytes(),
        invocation.as_bytes(),
        round.to_string().as_bytes(),
        position.to_string().as_bytes(),
        function.as_bytes(),
        arguments.as_bytes(),
    ] {
        name.extend_from_slice(part);
        name.push(0);
    }
    format!(
        "call_{}",
        uuid::Uuid::new_v5(&CALL_ID_NAMESPACE, &name).simple()
    )
}

/// The namespace of [`replayable_call_id`]'s name-based UUIDs.
const CALL_ID_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x7f3c_2a1e_5b84_4d0e_9c61_0a2f_6e5d_b471);

/// `tenant`'s settings of the tool `def` from the settings bucket (one
/// read, only for a tool whose definition has a `settingsSchema`): the
/// object the operator wrote with `toolfleet settings set`, secrets as
/// references the worker resolves. `None` when there are none.
async fn tenant_settings(
    fleet: &Fleet,
    tenant: &str,
    def: &toolfleet_protocol::tools::ToolDefinition,
) -> Result<Option<Value>, String> {
    if def.settings_schema.is_none() {
        return Ok(None);
    }
    let key = toolfleet_protocol::settings_key(tenant, &def.id.namespace, &def.id.name);
    let Some(bytes) = fleet
        .settings_bucket
        .get(&key)
        .await
        .map_err(|e| e.to_string())?
    else {
        return Ok(None);
    };
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v @ Value::Object(_)) => Ok(Some(v)),
        Ok(_) => Err(format!("the settings under {key} are not an object")),
        Err(e) => Err(format!("the settings under {key} are not JSON: {e}")),
    }
}

/// A call's tool as resolved once for its turn: what its approval is
/// decided on and what dispatch runs.
#[derive(Debug, Clone, Default)]
pub struct Resolved {
    /// The tool, or `None` for a name the invocation may not use.
    pub tool: Option<Arc<CompiledTool>>,
    /// A person approved this call (or it is the orchestrator's own):
    /// it runs even when its tool needs approval.
    pub approved: bool,
}

/// The tool a model's call named `name` runs: an offered one; a permitted
/// one scoping left out; or — after one fresh catalog reading — one whose
/// worker joined since the offer and that passes the gates. `None` for
/// anything else. The one resolution both the approval hold and dispatch
/// use.
pub async fn resolve_tool(
    fleet: &Fleet,
    inv: &Invocation,
    name: &str,
) -> Option<Arc<CompiledTool>> {
    if let Some(tool) = inv.tool_for_call(name) {
        return Some(tool.clone());
    }
    fleet.catalog.by_function_name(name).await?;
    let scope = fleet
        .permitted_tools(&inv.job, &inv.profile, &inv.ctx, inv.agent_depth)
        .ok()?;
    scope.permitted.by_function_name(name).cloned()
}

impl ToolRunner<'_> {
    /// Runs one turn's `calls` under the invocation's loop policy; returns
    /// an outcome per call, in call order. Each call's id must be one of
    /// ours ([`replayable_call_id`], or [`new_call_id`] for the
    /// orchestrator's own calls), never the model's: it names the call's
    /// job, reply subject, events and citations.
    ///
    /// Each call's tool is resolved here ([`resolve_tool`]) and none is
    /// approved: a call whose tool needs a person's approval under the
    /// invocation's rules is answered `blocked` (`approval_missing`), never
    /// run. An orchestrator that parks for approvals resolves the tools
    /// itself, decides the holds on that resolution, and runs the rest
    /// through [`ToolRunner::run_resolved`].
    pub async fn run(
        &mut self,
        inv: &Invocation,
        calls: &[ToolCall],
        events: &Events,
    ) -> Vec<ToolOutcome> {
        let mut resolved = Vec::with_capacity(calls.len());
        for call in calls {
            resolved.push(Resolved {
                tool: resolve_tool(self.fleet, inv, &call.name).await,
                approved: false,
            });
        }
        self.run_resolved(inv, calls, &resolved, events).await
    }

    /// [`ToolRunner::run`] with each call's tool already resolved
    /// (`resolved[i]` is `calls[i]`'s): the tool the caller decided the
    /// call's approval on is the one that runs, never one looked up again.
    pub async fn run_resolved(
        &mut self,
        inv: &Invocation,
        calls: &[ToolCall],
        resolved: &[Resolved],
        events: &Events,
    ) -> Vec<ToolOutcome> {
        let policy = &inv.profile.profile.policy;
        let mut out: Vec<Option<ToolOutcome>> = vec![None; calls.len()];
        let run = calls
            .len()
            .min(policy.max_calls_per_turn)
            .min(resolved.len());
        for (i, call) in calls.iter().enumerate().skip(run) {
            out[i] = Some(over_the_turn_cap(self.fleet, inv, call, events));
        }
        let parallel_safe = |i: usize| {
            resolved[i]
                .tool
                .as_ref()
                .is_none_or(|t| t.definition.parallel_safe)
        };
        for batch in batches(run, policy.parallel_tool_calls, parallel_safe) {
            let subset: Vec<(&ToolCall, &Resolved)> =
                batch.iter().map(|&i| (&calls[i], &resolved[i])).collect();
            let outcomes = self.run_batch(inv, subset, events).await;
            for (i, outcome) in batch.into_iter().zip(outcomes) {
                out[i] = Some(outcome);
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(ToolOutcome::no_result))
            .collect()
    }

    /// Runs one call of `tool` for the orchestrator's own use (the summary
    /// of a compaction): the tool need not be offered to the model or
    /// permitted by the job's gates; otherwise it is a call like any other
    /// — a job on the pool, `tool_call` / `tool_result` events, metrics,
    /// and its model spend in [`ToolRunner::take_spent`].
    pub async fn run_internal(
        &mut self,
        inv: &Invocation,
        tool: Arc<CompiledTool>,
        call: &ToolCall,
        events: &Events,
    ) -> ToolOutcome {
        self.internal = Some((call.id.clone(), tool.clone()));
        // The orchestrator's own call: no person decides it.
        let resolved = Resolved {
            tool: Some(tool),
            approved: true,
        };
        let out = self
            .run_resolved(
                inv,
                std::slice::from_ref(call),
                std::slice::from_ref(&resolved),
                events,
            )
            .await;
        self.internal = None;
        out.into_iter()
            .next()
            .unwrap_or_else(ToolOutcome::no_result)
    }

    /// Dispatches a batch of calls together and awaits their answers.
    async fn run_batch(
        &mut self,
        inv: &Invocation,
        calls: Vec<(&ToolCall, &Resolved)>,
        events: &Events,
    ) -> Vec<ToolOutcome> {
        // Before any job goes out: every reading after this one counts,
        // and so does every reconnection (one before cannot have lost a
        // reply of this batch).
        let mut readings = self.fleet.catalog.subscribe();
        self.reconnects.take_new();
        let (calls, resolved): (Vec<&ToolCall>, Vec<&Resolved>) = calls.into_iter().unzip();
        let mut batch = Batch {
            answers: vec![None; calls.len()],
            calls,
            pending: HashMap::new(),
            look_at: None,
        };
        let mut acks = Vec::new();
        for (index, (call, resolved)) in batch.calls.iter().zip(resolved).enumerate() {
            let held: HashSet<String> = batch
                .pending
                .values()
                .filter_map(|p| p.place.as_ref().map(|place| place.key.clone()))
                .collect();
            match self
                .dispatch(inv, call, (resolved, &held), index, events)
                .await
            {
                Ok((pending, ack)) => {
                    if let Some(ack) = ack {
                        acks.push((call.id.clone(), ack));
                    }
                    batch.pending.insert(call.id.clone(), pending);
                }
                Err(outcome) => batch.answers[index] = Some(outcome),
            }
        }
        self.confirm_stored(acks, &mut batch, events).await;
        self.await_answers(inv, &mut batch, &mut readings, events)
            .await;
        batch
            .answers
            .into_iter()
            .map(|a| a.unwrap_or_else(ToolOutcome::no_result))
            .collect()
    }

    /// The context a call's job carries: the invocation's, traced under
    /// the call's span, with our call id — unique within the invocation,
    /// and the same for the same call of a replayed run, so safe as an
    /// idempotency key.
    fn call_context(
        &self,
        inv: &Invocation,
        call: &ToolCall,
        def: &toolfleet_protocol::tools::ToolDefinition,
        span: &tracing::Span,
    ) -> CallContext {
        let mut invocation = inv.ctx.clone();
        invocation.traceparent =
            toolfleet_service::telemetry::traceparent(span, invocation.traceparent.as_deref());
        CallContext {
            invocation,
            call_id: call.id.clone(),
            tool_id: def.id.clone(),
            attempt: 1,
            reply_to: format!("{}.{}", self.inbox.inbox, call.id),
            citation_floor: inv.citations.floor(),
            // Marked only in a first run (a replay's ids may have results
            // already) while its tombstone read is fresh (see
            // `CancelCheck`).
            new_call: inv.cancel_check.fresh(),
        }
    }

    /// Sends one call's job, or answers it at once.
    async fn dispatch(
        &self,
        inv: &Invocation,
        call: &ToolCall,
        (resolved, held): (&Resolved, &HashSet<String>),
        index: usize,
        events: &Events,
    ) -> Result<(Pending, Option<PublishAckFuture>), ToolOutcome> {
        let span = call_span(call);
        let (tool, arguments, waits_for) = match self.accept(inv, call, resolved, events).await {
            Ok(accepted) => accepted,
            Err(outcome) => {
                failed(&span, ToolErrorCode::ToolCallRefused.as_str());
                return Err(outcome);
            }
        };
        let metrics = &self.fleet.metrics;
        let def = &tool.definition;
        let id = def.id.to_string();
        span.record("gen_ai.tool.name", id.as_str());
        // The settings first: they are part of the cache's key.
        let settings = self.settings_for(inv, call, def, &span, events).await?;
        let cached = cache::look(
            self.fleet,
            inv,
            (call, &tool, &arguments, settings.as_ref()),
            events,
            &span,
        )
        .await?;
        let call_ctx = self.call_context(inv, call, def, &span);
        let headers = call_ctx.to_headers();
        let body = encode(&ToolJob {
            arguments,
            settings,
        });
        self.fits(call, &id, (&headers, body.len()), events, &span)?;
        let deadline = self.answer_deadline(inv, def, waits_for.is_some());
        let place = inflight::take(self.fleet, inv, def, held, deadline)
            .await
            .map_err(|inflight::NoPlace::Deadline| {
                failed(&span, ToolErrorCode::Timeout.as_str());
                inflight::no_place(metrics, events, call, &id)
            })?;
        let again_body = def.idempotent.then(|| body.clone());
        // No job goes out while the run's lease is in doubt (see
        // `intake::claim::keep_lease`): if it lapses, the run that takes
        // the invocation over starts this call, not both.
        inv.cancel_check.lease_held().await;
        let ack = match self.publish(def.delivery, &call_ctx, headers, body).await {
            Ok(ack) => ack,
            Err(e) => {
                failed(&span, ToolErrorCode::DispatchFailed.as_str());
                return Err(immediate(
                    metrics,
                    events,
                    call,
                    &id,
                    ToolErrorCode::DispatchFailed.as_str(),
                    format!("Error: the tool job could not be queued: {e}"),
                ));
            }
        };
        if let Some(pool) = &waits_for {
            events.send(ChatEventBody::ToolProgress {
                call_id: call.id.clone(),
                tool: id.clone(),
                message: format!(
                    "No worker of the pool {pool} is running yet: the call waits for one to start."
                ),
            });
        }
        Ok((
            Pending {
                index,
                started: Instant::now(),
                deadline,
                misses: 0,
                span,
                place,
                ledger: !def.idempotent,
                again: again_body.map(|body| readback::Again::new(def.delivery, call_ctx, body)),
                look: false,
                tool,
                waits_for,
                cache: cached,
            },
            ack,
        ))
    }

    /// Whether a call's job (its `headers` and a body of `body_len` bytes)
    /// fits the server's payload limit; answered at once (`too_large`)
    /// when it does not.
    fn fits(
        &self,
        call: &ToolCall,
        id: &str,
        (headers, body_len): (&async_nats::HeaderMap, usize),
        events: &Events,
        span: &tracing::Span,
    ) -> Result<(), ToolOutcome> {
        let Err(e) = self.fleet.limits().check_job(headers, body_len) else {
            return Ok(());
        };
        failed(span, ToolErrorCode::TooLarge.as_str());
        Err(immediate(
            &self.fleet.metrics,
            events,
            call,
            id,
            ToolErrorCode::TooLarge.as_str(),
            format!(
                "Error: the job for {} is {} bytes, and at most {} fit. Send shorter arguments.",
                call.name, e.body, e.limit
            ),
        ))
    }

    /// When a call of `inv` to `def` is given up: the tool's timeout and
    /// slack, or the invocation's deadline when nearer; a call that waits
    /// for a declared pool's first worker (`for_pool`), [`POOL_WAIT_MARGIN`]
    /// before the invocation's deadline (a pool may take that long to
    /// start).
    fn answer_deadline(
        &self,
        inv: &Invocation,
        def: &toolfleet_protocol::tools::ToolDefinition,
        for_pool: bool,
    ) -> tokio::time::Instant {
        let left =
            Duration::from_millis(inv.deadline_ms.saturating_sub(toolfleet_protocol::now_ms()));
        let wait = if for_pool {
            left.saturating_sub(POOL_WAIT_MARGIN)
        } else {
            (def.timeout() + self.fleet.config.tool_wait_slack).min(left)
        };
        tokio::time::Instant::now() + wait
    }

    /// The invocation's tenant's settings of `def` for `call`'s job
    /// ([`tenant_settings`]); a call whose settings cannot be read is
    /// answered `dispatch_failed` at once, never run without them.
    async fn settings_for(
        &self,
        inv: &Invocation,
        call: &ToolCall,
        def: &toolfleet_protocol::tools::ToolDefinition,
        span: &tracing::Span,
        events: &Events,
    ) -> Result<Option<Value>, ToolOutcome> {
        tenant_settings(self.fleet, inv.job.tenant(), def)
            .await
            .map_err(|e| {
                failed(span, ToolErrorCode::DispatchFailed.as_str());
                warn!(tool = %def.id, error = %e, "cannot read the tenant's settings of a tool");
                immediate(
                    &self.fleet.metrics,
                    events,
                    call,
                    &def.id.to_string(),
                    ToolErrorCode::DispatchFailed.as_str(),
                    format!(
                        "Error: the settings of {} cannot be read just now.",
                        call.name
                    ),
                )
            })
    }

    /// Takes a call's resolved tool and its arguments and publishes its
    /// `tool_call` event; answers at once a call to an unknown tool, to a
    /// tool that needs an approval the call does not have, with arguments
    /// that are not JSON, or to a tool no live worker serves — unless its
    /// pool is declared: then the pool whose first worker it waits for.
    async fn accept(
        &self,
        inv: &Invocation,
        call: &ToolCall,
        resolved: &Resolved,
        events: &Events,
    ) -> Result<(Arc<CompiledTool>, Value, Option<String>), ToolOutcome> {
        let metrics = &self.fleet.metrics;
        let internal = self
            .internal
            .as_ref()
            .filter(|(id, _)| *id == call.id)
            .map(|(_, tool)| tool.clone());
        let is_internal = internal.is_some();
        let tool = internal.or_else(|| resolved.tool.clone());
        let Some(tool) = tool else {
            events.send(ChatEventBody::ToolCall {
                call_id: call.id.clone(),
                tool: call.name.clone(),
                arguments: Value::String("[unknown tool]".into()),
            });
            metrics.unknown_tool_calls.inc();
            return Err(immediate(
                metrics,
                events,
                call,
                &call.name,
                ToolErrorCode::UnknownTool.as_str(),
                inv.unknown_tool_message(&call.name),
            ));
        };
        let def = &tool.definition;
        let id = def.id.to_string();
        if !is_internal && !resolved.approved && inv.profile.profile.requires_approval(def) {
            // Decided on this very resolution: a tool that needs a person
            // never runs without one, however it was reached.
            events.send(ChatEventBody::ToolCall {
                call_id: call.id.clone(),
                tool: id.clone(),
                arguments: Value::String("[not run]".into()),
            });
            return Err(immediate_with(
                metrics,
                events,
                call,
                &id,
                ToolStatus::Blocked,
                ToolErrorCode::ApprovalMissing.as_str(),
                format!(
                    "Not run: {} needs a person's approval, and this call has none.",
                    call.name
                ),
            ));
        }
        let arguments = match parse_arguments(&call.arguments) {
            Ok(v) => v,
            Err(e) => {
                events.send(ChatEventBody::ToolCall {
                    call_id: call.id.clone(),
                    tool: id.clone(),
                    arguments: Value::String("[not JSON]".into()),
                });
                return Err(immediate(
                    metrics,
                    events,
                    call,
                    &id,
                    ToolErrorCode::InvalidArguments.as_str(),
                    format!(
                        "Error: the arguments for {} are not valid JSON ({e}). Send a JSON object.",
                        call.name
                    ),
                ));
            }
        };
        events.send(ChatEventBody::ToolCall {
            call_id: call.id.clone(),
            tool: id.clone(),
            arguments: if is_internal {
                // The orchestrator's own call (a compaction's transcript):
                // the event says how long its text is, not the text again.
                shorten_strings(&redact(&arguments, &def.sensitive_arguments))
            } else {
                redact(&arguments, &def.sensitive_arguments)
            },
        });
        if self.fleet.catalog.is_live(&id).await {
            return Ok((tool, arguments, None));
        }
        match self.fleet.config.declared.pool_of(&id) {
            Some(pool) => Ok((tool, arguments, Some(pool.to_owned()))),
            None => Err(no_worker(
                metrics,
                events,
                call,
                &id,
                "no live worker serves it",
            )),
        }
    }

    /// Publishes a job: to the tool's stream (the ack comes later), or as a
    /// core request to its pool's queue group, where no worker means "no
    /// responders" at once.
    async fn publish(
        &self,
        delivery: Delivery,
        call: &CallContext,
        headers: async_nats::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<Option<PublishAckFuture>, String> {
        let subjects = &self.fleet.config.subjects;
        match delivery {
            Delivery::Direct => self
                .fleet
                .client
                .publish_with_reply_and_headers(
                    subjects.tool_direct(&call.tool_id),
                    call.reply_to.clone(),
                    headers,
                    body,
                )
                .await
                .map(|()| None)
                .map_err(|e| e.to_string()),
            Delivery::Jetstream => self
                .fleet
                .js
                .publish_with_headers(subjects.tool(&call.tool_id), headers, body)
                .await
                .map(Some)
                .map_err(|e| e.to_string()),
        }
    }

    /// JetStream must have stored every job; a job it refused is answered
    /// at once. A duplicate means JetStream already holds a job of this
    /// very call (call ids are the same when a run of the invocation is
    /// replayed, [`crate::rounds`]): the call is not run again but adopted
    /// — its result read back from the ledger, or, for an idempotent
    /// tool, asked again under a fresh message id ([`readback`]).
    async fn confirm_stored(
        &self,
        acks: Vec<(String, PublishAckFuture)>,
        batch: &mut Batch<'_>,
        events: &Events,
    ) {
        for (call_id, ack) in acks {
            let failed = match ack.await {
                Ok(a) if a.duplicate => {
                    self.adopt_stored(&call_id, batch).await;
                    None
                }
                Ok(_) => None,
                // The confirmation was lost, not necessarily the job (a
                // reconnect, a stream leader's election): a call that must
                // not run twice is adopted — answered from the ledger if
                // its job runs, else `timeout` — never failed while its
                // job may still run.
                Err(e) if batch.pending.get(&call_id).is_some_and(|p| p.ledger) => {
                    warn!(call_id = %call_id, error = %e, "a tool job's storage was not confirmed; its result is looked for in the ledger");
                    self.adopt_stored(&call_id, batch).await;
                    None
                }
                Err(e) => Some(e.to_string()),
            };
            if let Some(e) = failed
                && let Some(p) = batch.pending.remove(&call_id)
            {
                self::failed(&p.span, ToolErrorCode::DispatchFailed.as_str());
                batch.answers[p.index] = Some(immediate(
                    &self.fleet.metrics,
                    events,
                    batch.calls[p.index],
                    &p.tool.definition.id.to_string(),
                    ToolErrorCode::DispatchFailed.as_str(),
                    format!("Error: the tool job was not stored: {e}"),
                ));
            }
        }
    }

    /// Adopts the pending call `call_id`, whose job may be out already
    /// ([`readback`]).
    async fn adopt_stored(&self, call_id: &str, batch: &mut Batch<'_>) {
        if let Some(p) = batch.pending.get_mut(call_id) {
            if let Some(ack) = self.adopt(p).await
                && let Err(e) = ack.await
            {
                warn!(call_id = %call_id, error = %e, "a call asked again was not stored");
            }
            if p.look {
                batch.look_at = Some(tokio::time::Instant::now());
            }
        }
    }

    /// Waits until every pending call of the batch is answered: by its
    /// reply, or — when the reply may have been lost — read back.
    async fn await_answers(
        &mut self,
        inv: &Invocation,
        batch: &mut Batch<'_>,
        readings: &mut watch::Receiver<Arc<Catalog>>,
        events: &Events,
    ) {
        let mut readings_open = true;
        while let Some(deadline) = batch.pending.values().map(|p| p.deadline).min() {
            let waited = self
                .next(readings, &mut readings_open, deadline, batch.look_at)
                .await;
            let metrics = &self.fleet.metrics;
            match waited {
                Waited::Result(result) => {
                    self.take_result(&inv.ctx.invocation_id, batch, *result, events);
                }
                Waited::Progress { call_id, message } => {
                    if let Some(p) = batch.pending.get(&call_id) {
                        events.send(ChatEventBody::ToolProgress {
                            call_id,
                            tool: p.tool.definition.id.to_string(),
                            message: shorten(&message, MAX_PROGRESS_CHARS),
                        });
                    }
                }
                Waited::NoResponders { call_id } => {
                    if let Some(p) = batch.pending.remove(&call_id) {
                        failed(&p.span, ToolErrorCode::NoWorker.as_str());
                        batch.answers[p.index] = Some(no_worker(
                            metrics,
                            events,
                            batch.calls[p.index],
                            &p.tool.definition.id.to_string(),
                            "no live worker serves it",
                        ));
                    }
                }
                Waited::Catalog(catalog) => {
                    batch.note_reading(&catalog, &self.fleet.config, metrics, events);
                }
                Waited::Deadline => {
                    // A reply lost on its way is no timeout: the ledger
                    // is read once more before the call is given up.
                    let now = tokio::time::Instant::now();
                    self.read_back(inv, batch, events, |p| p.ledger && p.deadline <= now)
                        .await;
                    if let Some(failure) = batch.give_up_waiting(now, metrics, events) {
                        self.ended.get_or_insert(failure);
                    }
                    batch.expire(now, &self.fleet.metrics, events);
                }
                Waited::Reconnected => self.after_reconnect(batch).await,
                Waited::Look => {
                    self.read_back(inv, batch, events, |p| p.look).await;
                    batch.look_at = batch
                        .pending
                        .values()
                        .any(|p| p.look)
                        .then(|| tokio::time::Instant::now() + readback::LOOK_EVERY);
                }
                Waited::Closed => break,
            }
        }
    }

    /// Takes `result` as its call's answer when it is one: same
    /// invocation, a pending call, same tool (the reply subject alone is
    /// not proof where permissions are loose). Whether it was.
    fn take_result(
        &mut self,
        invocation_id: &str,
        batch: &mut Batch<'_>,
        result: ToolResult,
        events: &Events,
    ) -> bool {
        let ours = batch.pending.get(&result.call_id).is_some_and(|p| {
            result.invocation_id == invocation_id
                && result.tool_id == p.tool.definition.id.to_string()
        });
        if !ours {
            if batch.pending.contains_key(&result.call_id) {
                warn!(call_id = %result.call_id, tool = %result.tool_id, "a result that does not match its call was ignored");
            }
            return false;
        }
        let Some(mut p) = batch.pending.remove(&result.call_id) else {
            return false;
        };
        if let Some(miss) = p.cache.take() {
            cache::keep(self.fleet, miss, &result);
        }
        if result
            .error
            .as_ref()
            .is_some_and(|e| e.code == ToolErrorCode::Cancelled.as_str())
        {
            self.cancelled = true;
        }
        match &result.error {
            None => {
                p.span.record("otel.status_code", "ok");
            }
            Some(e) => failed(&p.span, &e.code),
        }
        let outcome = record(
            &self.fleet.metrics,
            events,
            batch.calls[p.index],
            &p,
            &result,
        );
        batch.answers[p.index] = Some(outcome);
        self.spent.extend(result.llm_calls);
        true
    }

    /// Adds model calls spent on the invocation's behalf outside a worker
    /// (an agent tool's nested job).
    pub(crate) fn add_spent(&mut self, calls: Vec<toolfleet_protocol::LlmCall>) {
        self.spent.extend(calls);
    }

    /// A call that waited for a declared pool's first worker until the
    /// invocation's deadline, in vain: the invocation ends with this
    /// `deadline_exceeded` failure, naming the pool, rather than calling
    /// the model with no time left.
    #[must_use]
    pub fn ended(&self) -> Option<Failure> {
        self.ended.clone()
    }

    /// Whether a worker answered one of this runner's calls `cancelled`:
    /// workers answer so only once they heard the invocation's cancel, so
    /// the invocation is over even if this orchestrator's own copy of the
    /// cancel is still on its way (the model is not called again).
    #[must_use]
    pub fn cancelled(&self) -> bool {
        self.cancelled
    }

    /// The model calls the tools reported since the last take (each
    /// result's `llmCalls`), for the invocation's usage.
    pub fn take_spent(&mut self) -> Vec<toolfleet_protocol::LlmCall> {
        std::mem::take(&mut self.spent)
    }

    /// The next event for a batch whose earliest deadline is `deadline`
    /// and whose next ledger look is at `look_at`.
    async fn next(
        &mut self,
        readings: &mut watch::Receiver<Arc<Catalog>>,
        readings_open: &mut bool,
        deadline: tokio::time::Instant,
        look_at: Option<tokio::time::Instant>,
    ) -> Waited {
        loop {
            tokio::select! {
                msg = self.inbox.next() => match msg {
                    None => return Waited::Closed,
                    Some(msg) => if let Some(waited) = classify(*msg) {
                        return waited;
                    },
                },
                changed = readings.changed(), if *readings_open => match changed {
                    Ok(()) => return Waited::Catalog(readings.borrow_and_update().clone()),
                    // The catalog task ended (shutdown): deadlines still hold.
                    Err(_) => *readings_open = false,
                },
                () = self.reconnects.next() => return Waited::Reconnected,
                () = tokio::time::sleep_until(look_at.unwrap_or(deadline)), if look_at.is_some_and(|at| at < deadline) => return Waited::Look,
                () = tokio::time::sleep_until(deadline) => return Waited::Deadline,
            }
        }
    }
}

impl Batch<'_> {
    /// Counts a catalog reading against each pending call: two readings in
    /// a row without its tool answer it `no_worker`, unless its pool is
    /// declared (its job waits for the next worker). A call that waited
    /// for a declared pool's first worker gets its tool's own time from the
    /// reading that shows one live.
    fn note_reading(
        &mut self,
        catalog: &Catalog,
        settings: &crate::Settings,
        metrics: &OrchestratorMetrics,
        events: &Events,
    ) {
        let now = tokio::time::Instant::now();
        let mut gone = Vec::new();
        for (call_id, p) in &mut self.pending {
            let def = &p.tool.definition;
            let id = def.id.to_string();
            if catalog.is_live(&id) {
                p.misses = 0;
                if p.waits_for.take().is_some() {
                    p.deadline = p
                        .deadline
                        .min(now + def.timeout() + settings.tool_wait_slack);
                }
            } else if settings.declared.pool_of(&id).is_none() {
                p.misses += 1;
                if p.misses >= 2 {
                    gone.push(call_id.clone());
                }
            }
        }
        for call_id in gone {
            if let Some(p) = self.pending.remove(&call_id) {
                failed(&p.span, ToolErrorCode::NoWorker.as_str());
                self.answers[p.index] = Some(no_worker(
                    metrics,
                    events,
                    self.calls[p.index],
                    &p.tool.definition.id.to_string(),
                    "its last live worker went away during this call",
                ));
            }
        }
    }

    /// Answers `no_worker` to every pending call that waited for a declared
    /// pool's first worker until its deadline (`now` or earlier); the
    /// invocation's failure for the first of them, if any.
    fn give_up_waiting(
        &mut self,
        now: tokio::time::Instant,
        metrics: &OrchestratorMetrics,
        events: &Events,
    ) -> Option<Failure> {
        let expired: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.waits_for.is_some() && p.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect();
        let mut failure = None;
        for call_id in expired {
            let Some(p) = self.pending.remove(&call_id) else {
                continue;
            };
            let pool = p.waits_for.clone().unwrap_or_default();
            let tool = p.tool.definition.id.to_string();
            failed(&p.span, ToolErrorCode::NoWorker.as_str());
            self.answers[p.index] = Some(no_worker(
                metrics,
                events,
                self.calls[p.index],
                &tool,
                &format!("no worker of the pool {pool} started in time"),
            ));
            failure.get_or_insert_with(|| {
                Failure::new(
                    crate::failure::ChatErrorCode::DeadlineExceeded,
                    format!(
                        "no worker of the declared pool {pool} started before the job's deadline: \
                         the call to {tool} waited {:.1} s in its queue (a pool that scales from \
                         zero must start a worker within the job's timeout)",
                        p.started.elapsed().as_secs_f64()
                    ),
                )
            });
        }
        failure
    }

    /// Answers `timeout` to every pending call whose deadline is `now` or
    /// earlier.
    fn expire(
        &mut self,
        now: tokio::time::Instant,
        metrics: &OrchestratorMetrics,
        events: &Events,
    ) {
        let expired: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for call_id in expired {
            let Some(p) = self.pending.remove(&call_id) else {
                continue;
            };
            failed(&p.span, ToolErrorCode::Timeout.as_str());
            let call = self.calls[p.index];
            let tool = p.tool.definition.id.to_string();
            metrics
                .tool_calls
                .with_label_values(&[tool.as_str(), "timeout"])
                .inc();
            events.send(ChatEventBody::ToolResult {
                call_id: call.id.clone(),
                tool,
                status: ToolStatus::Timeout,
                duration_ms: p.started.elapsed().as_millis() as u64,
                error_code: Some(ToolErrorCode::Timeout.to_string()),
                warnings: Vec::new(),
                cached: false,
            });
            self.answers[p.index] = Some(ToolOutcome {
                content: format!(
                    "Error: {} did not answer in time. Answer with what you have.",
                    call.name
                ),
                status: ToolStatus::Timeout,
                references: Vec::new(),
            });
        }
    }
}

/// A reply message as a [`Waited`] event; `None` for one to ignore.
fn classify(msg: async_nats::Message) -> Option<Waited> {
    if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
        let call_id = msg.subject.as_str().rsplit('.').next().unwrap_or_default();
        return Some(Waited::NoResponders {
            call_id: call_id.to_string(),
        });
    }
    match Envelope::ToolReply.decode::<ToolReply>(&msg.payload) {
        Ok(ToolReply::Result(result)) => Some(Waited::Result(result)),
        Ok(ToolReply::Progress {
            call_id, message, ..
        }) => Some(Waited::Progress { call_id, message }),
        Err(e) => {
            warn!(error = %e, "malformed tool reply ignored");
            None
        }
    }
}

/// Splits the calls to run into batches of indices: with parallel calls
/// on, the parallel-safe ones together, then each unsafe one alone; with
/// them off, each call alone. Empty batches are left out.
fn batches(calls: usize, parallel: bool, parallel_safe: impl Fn(usize) -> bool) -> Vec<Vec<usize>> {
    let mut batches: Vec<Vec<usize>> = Vec::new();
    if parallel {
        batches.push((0..calls).filter(|&i| parallel_safe(i)).collect());
        batches.extend((0..calls).filter(|&i| !parallel_safe(i)).map(|i| vec![i]));
    } else {
        batches.extend((0..calls).map(|i| vec![i]));
    }
    batches.retain(|b| !b.is_empty());
    batches
}

/// Marks a call's span failed with `code` (its `error.type`).
fn failed(span: &tracing::Span, code: &str) {
    span.record("otel.status_code", "error");
    span.record("error.type", code);
}

fn parse_arguments(arguments: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(if arguments.trim().is_empty() {
        "{}"
    } else {
        arguments
    })
}

/// Answers a call whose tool has no live worker, saying why.
fn no_worker(
    metrics: &OrchestratorMetrics,
    events: &Events,
    call: &ToolCall,
    tool: &str,
    why: &str,
) -> ToolOutcome {
    immediate(
        metrics,
        events,
        call,
        tool,
        ToolErrorCode::NoWorker.as_str(),
        format!(
            "Error: the tool {} is not available right now ({why}). Answer without it.",
            call.name
        ),
    )
}

/// Answers a call with an error without a result from a worker.
/// A call beyond the profile's `max_calls_per_turn`: answered, not run.
pub(crate) fn over_the_turn_cap(
    fleet: &Fleet,
    inv: &Invocation,
    call: &ToolCall,
    events: &Events,
) -> ToolOutcome {
    let tool = inv
        .tool(&call.name)
        .map_or_else(|| call.name.clone(), |t| t.definition.id.to_string());
    immediate(
        &fleet.metrics,
        events,
        call,
        &tool,
        ToolErrorCode::CallsPerTurn.as_str(),
        format!(
            "Error: not run: at most {} tool calls per turn.",
            inv.profile.profile.policy.max_calls_per_turn
        ),
    )
}

/// A call's span, from its dispatch to its answer; every way it ends
/// marks it (a call answered at once too).
fn call_span(call: &ToolCall) -> tracing::Span {
    tracing::info_span!(
        "tool_call",
        otel.name = format!("execute_tool {}", call.name),
        otel.kind = "producer",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        gen_ai.tool.type = "function",
        error.type = tracing::field::Empty,
    )
}

pub(crate) fn immediate(
    metrics: &OrchestratorMetrics,
    events: &Events,
    call: &ToolCall,
    tool: &str,
    code: &str,
    content: String,
) -> ToolOutcome {
    immediate_with(
        metrics,
        events,
        call,
        tool,
        ToolStatus::Error,
        code,
        content,
    )
}

/// [`immediate`] with another status (a denied approval is `blocked`).
pub(crate) fn immediate_with(
    metrics: &OrchestratorMetrics,
    events: &Events,
    call: &ToolCall,
    tool: &str,
    status: ToolStatus,
    code: &str,
    content: String,
) -> ToolOutcome {
    // Bounded label: a tool name the model made up is "unknown" (only
    // catalog tools are named by their id here).
    let known = tool.parse::<toolfleet_protocol::tools::ToolId>().is_ok();
    metrics
        .tool_calls
        .with_label_values(&[if known { tool } else { "unknown" }, status.as_str()])
        .inc();
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        status,
        duration_ms: 0,
        error_code: Some(code.to_string()),
        warnings: Vec::new(),
        cached: false,
    });
    ToolOutcome {
        content,
        status,
        references: Vec::new(),
    }
}

/// Longest string argument an internal call's `tool_call` event shows.
const INTERNAL_ARGUMENT_CHARS: usize = 200;

/// `arguments` with every string longer than
/// [`INTERNAL_ARGUMENT_CHARS`] replaced by `[N characters]`.
fn shorten_strings(arguments: &Value) -> Value {
    match arguments {
        Value::String(s) if s.chars().count() > INTERNAL_ARGUMENT_CHARS => {
            Value::String(format!("[{} characters]", s.chars().count()))
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), shorten_strings(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(shorten_strings).collect()),
        other => other.clone(),
    }
}

/// A worker's warnings as the `tool_result` event passes them on: at most
/// the contract's number, each message cut to its length (a worker is
/// trusted with the contract, not with the event's size).
fn bounded_warnings(
    warnings: &[toolfleet_protocol::ToolWarning],
) -> Vec<toolfleet_protocol::ToolWarning> {
    warnings
        .iter()
        .take(toolfleet_protocol::MAX_WARNINGS)
        .map(|w| toolfleet_protocol::ToolWarning {
            code: w.code.chars().take(64).collect(),
            message: match w
                .message
                .char_indices()
                .nth(toolfleet_protocol::MAX_WARNING_CHARS)
            {
                Some((cut, _)) => format!("{}…", &w.message[..cut]),
                None => w.message.clone(),
            },
        })
        .collect()
}

/// A worker's result: metrics, the `tool_result` event, and what the model
/// reads.
fn record(
    metrics: &OrchestratorMetrics,
    events: &Events,
    call: &ToolCall,
    pending: &Pending,
    result: &ToolResult,
) -> ToolOutcome {
    let tool = pending.tool.definition.id.to_string();
    let elapsed = pending.started.elapsed();
    metrics
        .tool_calls
        .with_label_values(&[tool.as_str(), result.status.as_str()])
        .inc();
    metrics
        .tool_call_duration
        .with_label_values(&[tool.as_str()])
        .observe(elapsed.as_secs_f64());
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool,
        status: result.status,
        duration_ms: elapsed.as_millis() as u64,
        error_code: result.error.as_ref().map(|e| e.code.clone()),
        warnings: bounded_warnings(&result.warnings),
        cached: false,
    });
    let content = match result.status {
        ToolStatus::Ok => result.content.clone(),
        ToolStatus::Blocked => format!("Blocked: {}", result.content),
        ToolStatus::Error | ToolStatus::Timeout => format!("Error: {}", result.content),
    };
    ToolOutcome {
        content,
        status: result.status,
        references: result
            .references
            .iter()
            .filter(|r| r.call_id.as_deref() == Some(result.call_id.as_str()))
            .cloned()
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str) -> ToolCall {
        ToolCall {
            id: format!("call_{name}"),
            name: name.into(),
            arguments: "{}".into(),
        }
    }

    #[test]
    fn parallel_safe_calls_share_a_batch_and_unsafe_ones_run_alone() {
        let calls = [call("a"), call("unsafe1"), call("b"), call("unsafe2")];
        let safe = |i: usize| !calls[i].name.starts_with("unsafe");
        assert_eq!(batches(4, true, safe), vec![vec![0, 2], vec![1], vec![3]]);
        assert_eq!(
            batches(4, false, safe),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        let all_unsafe = |_: usize| false;
        assert_eq!(batches(2, true, all_unsafe), vec![vec![0], vec![1]]);
        assert!(batches(0, true, safe).is_empty());
    }

    #[test]
    fn empty_arguments_are_an_empty_object() {
        assert_eq!(parse_arguments("  ").unwrap(), serde_json::json!({}));
        assert!(parse_arguments("{not json").is_err());
    }
}
