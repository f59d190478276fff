//! Running an admitted call: its time budget (the tool's timeout or the
//! invocation's deadline), its registration for cancels, the start and
//! error hooks, the tool under its timeout (a panic is a failed call),
//! and the result it makes — its structured output checked against the
//! definition's `outputSchema` — or a retry for a retryable failure.

use std::time::{Duration, Instant};
use toolfleet_protocol::ToolErrorCode;

use futures::FutureExt;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::{CallContext, ToolResult, ToolStatus};
use tracing::warn;

use super::admit::admit;
use super::cancels::run_key;
use super::outcome::{Failure, Outcome};
use super::results::{scrub, status_result};
use super::shared::{Shared, ToolStats};
use crate::builder::Served;
use crate::ctx::ToolCtx;
use crate::error::ToolError;
use crate::tool::ToolOutput;

/// Admits the job of `call` and, when admitted, runs its tool: what the
/// caller is told, or a retry.
pub(super) async fn process_call(
    call: &CallContext,
    payload: &[u8],
    first_published: Option<std::time::SystemTime>,
    tool: &Served,
    shared: &Shared,
) -> Outcome {
    let job = match admit(call, payload, first_published, tool, shared).await {
        Ok(job) => job,
        Err(outcome) => return outcome,
    };
    let Some(budget) = budget(call, tool) else {
        shared.count(tool.label(), "timeout");
        return Outcome::refused(status_result(
            call,
            call.attempt,
            0,
            ToolStatus::Timeout,
            ToolErrorCode::DeadlineExceeded.as_str(),
            "the invocation's deadline passed before the tool could run",
            Vec::new(),
        ));
    };
    let token = CancellationToken::new();
    let key = run_key(call.invocation.tenant(), &call.invocation.invocation_id);
    let _running = shared
        .running
        .register(key.clone(), &call.call_id, token.clone());
    let ctx = ToolCtx::new(
        call.clone(),
        job.settings,
        shared.sink.clone(),
        shared.hooks.clone(),
        // Not tied to the worker's shutdown: calls in flight finish during
        // the drain (SIGTERM stops pulling, not working). A cancel of the
        // invocation does stop them.
        token,
        Some(tokio::time::Instant::now() + budget),
    );
    let stats = shared.stats(tool);
    let (ran, duration_ms) = timed_run(tool, &ctx, job.arguments, budget, &stats, shared).await;
    let mut result = match ran {
        Ok(output) => answered(tool, &ctx, output, duration_ms, &stats),
        Err(e) => match failed(&ctx, e, duration_ms, shared) {
            Ok(failed) => failed,
            Err(retry) => {
                shared.count(tool.label(), "error");
                return retry;
            }
        },
    };
    // What the tool's model calls spent counts against its tenant's limits
    // here, once (the orchestrator leaves a tool's spend to its worker).
    if let Some(limits) = ctx.shared_limits() {
        limits.count_reported(&result.llm_calls).await;
    }
    scrub(shared.hooks.scrubber(), &mut result);
    // And the tenant's secrets the call read from its settings.
    scrub(
        &crate::settings::Scrubber::new(ctx.resolved_secrets()),
        &mut result,
    );
    finish(shared, &stats, call, tool.label(), result)
}

/// How long the call may run: the tool's timeout, or less when the
/// invocation's deadline is nearer. `None` when the deadline has passed.
fn budget(call: &CallContext, tool: &Served) -> Option<Duration> {
    let timeout = tool.definition().timeout();
    match call.invocation.deadline_ms {
        None => Some(timeout),
        Some(deadline) => {
            let left = deadline.saturating_sub(toolfleet_protocol::now_ms());
            (left > 0).then(|| timeout.min(Duration::from_millis(left)))
        }
    }
}

/// Runs the tool with the start hook and the in-flight and duration
/// metrics around it; returns what it gave and how long it took (ms). The
/// call's cancellation is cancelled once it is over.
async fn timed_run(
    tool: &Served,
    ctx: &ToolCtx,
    arguments: Value,
    budget: Duration,
    stats: &ToolStats,
    shared: &Shared,
) -> (Result<ToolOutput, ToolError>, u64) {
    let call = ctx.call();
    stats.in_flight.inc();
    shared.hooks.on_start(call);
    let started = Instant::now();
    let key = run_key(call.invocation.tenant(), &call.invocation.invocation_id);
    let ran = match run_tool(tool, ctx, arguments, budget).await {
        // This call alone was cancelled (`toolfleet cancel --call`): its
        // caller goes on without it, so not `cancelled`, which ends the
        // invocation.
        Err(ToolError::Cancelled(_)) if shared.running.call_cancelled(&key, &call.call_id) => {
            Err(ToolError::coded(
                ToolErrorCode::CallCancelled.as_str(),
                "an operator cancelled this call; the tool was stopped",
            ))
        }
        ran => ran,
    };
    ctx.cancellation().cancel();
    stats.in_flight.dec();
    let elapsed = started.elapsed();
    stats.duration.observe(elapsed.as_secs_f64());
    (ran, elapsed.as_millis() as u64)
}

/// The `ok` result of the call, with what the tool cited, spent and
/// warned of — and a warning when its structured output misses the
/// definition's `outputSchema` (logged and counted too).
fn answered(
    tool: &Served,
    ctx: &ToolCtx,
    output: ToolOutput,
    duration_ms: u64,
    stats: &ToolStats,
) -> ToolResult {
    if let Some(check) = &tool.output
        && let Some(first) = check.check(ctx, output.data.as_ref())
    {
        stats.output_mismatches.inc();
        // The path only: the violation's message may quote the output,
        // which the log must not hold unscrubbed (the warning is scrubbed).
        warn!(
            tool = %tool.label(),
            path = first.display_path(),
            "the tool's output does not match its definition's outputSchema"
        );
    }
    let call = ctx.call();
    ToolResult {
        invocation_id: call.invocation.invocation_id.clone(),
        call_id: call.call_id.clone(),
        tool_id: call.tool_id.to_string(),
        status: ToolStatus::Ok,
        content: output.content,
        data: output.data,
        error: None,
        references: ctx.take_cited(),
        attempt: call.attempt,
        duration_ms,
        replayed: false,
        llm_calls: ctx.take_llm_calls(),
        warnings: ctx.take_warnings(),
    }
}

/// The result of a call whose tool failed with `e` (after the error
/// hooks), or `Err` with a retry when another attempt may help.
fn failed(
    ctx: &ToolCtx,
    e: ToolError,
    duration_ms: u64,
    shared: &Shared,
) -> Result<ToolResult, Outcome> {
    let call = ctx.call();
    shared.hooks.on_error(call, &e);
    if e.is_retryable() {
        return Err(Outcome::Retry(Failure::new(
            e.code(),
            shared.hooks.scrubber().text(&e.to_string()),
        )));
    }
    let status = match e {
        ToolError::Blocked(_) => ToolStatus::Blocked,
        ToolError::Timeout(_) => ToolStatus::Timeout,
        _ => ToolStatus::Error,
    };
    let mut failed = status_result(
        call,
        call.attempt,
        duration_ms,
        status,
        e.code(),
        &e.to_string(),
        Vec::new(),
    );
    // What the tool spent counts even when it failed.
    failed.llm_calls = ctx.take_llm_calls();
    failed.warnings = ctx.take_warnings();
    Ok(failed)
}

/// Counts the result and runs the completion hooks. The result goes into
/// the ledger once the caller has it ([`super::reply::answer`]).
fn finish(
    shared: &Shared,
    stats: &ToolStats,
    call: &CallContext,
    label: &str,
    result: ToolResult,
) -> Outcome {
    if result.status == ToolStatus::Ok {
        stats.ok.inc();
        shared.hooks.on_complete(call, &result);
    } else {
        shared.count(label, result.status.as_str());
    }
    Outcome::Answer {
        result: Box::new(result),
        ran: true,
    }
}

/// Runs the tool under `budget`. A panicking tool is a failed call, not a
/// stuck job; one out of time is [`ToolError::Timeout`].
async fn run_tool(
    tool: &Served,
    ctx: &ToolCtx,
    arguments: Value,
    budget: Duration,
) -> Result<ToolOutput, ToolError> {
    let cancelled = || {
        Err(ToolError::Cancelled(
            "the invocation was cancelled; the tool was stopped".into(),
        ))
    };
    // A call whose invocation was cancelled before it started never
    // starts its tool.
    if ctx.cancellation().is_cancelled() {
        return cancelled();
    }
    let deadline = tokio::time::Instant::now() + budget;
    let mut call = std::pin::pin!(
        std::panic::AssertUnwindSafe(tool.imp.call_json(ctx, arguments)).catch_unwind()
    );
    // Most tools answer on their first poll: they need no timer (the
    // answer is taken as `timeout` would take it, before its clock).
    let ran = match futures::poll!(call.as_mut()) {
        std::task::Poll::Ready(ran) => Ok(ran),
        std::task::Poll::Pending => tokio::select! {
            biased;
            _ = ctx.cancelled() => return cancelled(),
            ran = tokio::time::timeout_at(deadline, call) => ran,
        },
    };
    match ran {
        Ok(Ok(ran)) => ran,
        Ok(Err(_panic)) => Err(ToolError::failed(
            "the tool failed unexpectedly (it panicked); see the worker's log",
        )),
        Err(_) => Err(ToolError::Timeout(format!(
            "the tool did not finish within {} ms",
            budget.as_millis()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;
    use serde_json::json;

    use super::*;
    use crate::fixtures::{Answers, counted, served};
    use crate::metrics::WorkerMetrics;
    use crate::testing::TestCtx;

    /// What the runtime makes of one `ok` call of `tool`, and the count
    /// of its output schema mismatches after it.
    async fn answer_once(tool: Answers) -> (ToolResult, u64) {
        let metrics = WorkerMetrics::register_all(&Registry::new()).unwrap();
        let served = served(tool, Some(counted()));
        let stats = ToolStats::zeroed(&metrics, served.label(), Default::default());
        let ctx = TestCtx::new().ctx();
        let output = served.imp.call_json(&ctx, json!({})).await.unwrap();
        let result = answered(&served, &ctx, output, 1, &stats);
        let mismatches = metrics
            .tool_output_schema_mismatches
            .with_label_values(&[served.label()])
            .get();
        (result, mismatches)
    }

    #[tokio::test]
    async fn an_output_that_misses_its_schema_is_answered_with_a_warning_and_counted() {
        let (result, mismatches) = answer_once(Answers::data(json!({"count": "three"}))).await;
        assert_eq!(result.status, ToolStatus::Ok);
        assert_eq!(result.data, Some(json!({"count": "three"})));
        let codes: Vec<&str> = result.warnings.iter().map(|w| w.code.as_str()).collect();
        assert_eq!(codes, ["output_schema_mismatch"]);
        assert!(
            result.warnings[0].message.contains("at /count:"),
            "{:?}",
            result.warnings
        );
        assert_eq!(mismatches, 1);
    }

    #[tokio::test]
    async fn an_output_that_matches_its_schema_is_neither_warned_of_nor_counted() {
        let (result, mismatches) = answer_once(Answers::data(json!({"count": 3}))).await;
        assert!(result.warnings.is_empty(), "{:?}", result.warnings);
        assert_eq!(mismatches, 0);
    }
}
