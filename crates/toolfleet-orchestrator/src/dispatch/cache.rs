//! The tool-result cache at dispatch (`docs/tool-cache.md`): a call of a
//! tool whose definition has a `cache` is looked up before its job goes
//! out, and answered at once from a stored `ok` result of the same tool
//! version, arguments (in any key order), context, tenant settings of the
//! tool and scope; otherwise its job goes out as any other, and an `ok`
//! result without warnings is stored when it comes back ([`keep`]).
//!
//! The scope's tenant and user are the fleet's: the submit subject's
//! tenant, and the user only when the operator trusts the tenant's users
//! (`Invocation::ctx`), never a field of the job. A `user`-scoped call
//! without one is not cached. Errors, `blocked` and timed-out results are
//! never stored, nor results with warnings (a truncated reply, an output
//! that missed its schema, a fallback: nothing to freeze for a TTL), nor
//! results read back from a ledger (`replayed`), nor calls held for an
//! approval (they never reach dispatch). A cache that does not answer is
//! passed by (and, for a while, not asked: the store's breaker): the call
//! runs, and `toolfleet_tool_cache_total{outcome="bypass"}` counts it.
//!
//! A hit's references get fresh indices from this invocation's counter
//! (one reservation under the call's id, as a worker's would be, so a
//! replayed run reuses them), and the result's `[doc:N]` markers are
//! renumbered to match — a marker that names none of its references is
//! dropped: citations of a cached result work as a fresh one's. Only the
//! references the call itself cited are stored, as a fresh result keeps
//! only those.

use std::time::{Duration, Instant};

use serde_json::Value;
use toolfleet_llm::ToolCall;
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{ChatEventBody, ToolResult, ToolStatus};
use toolfleet_store::InvocationKey;
use toolfleet_store::tool_cache::{CacheKey, CallScope, Generations, Lookup, Stored};
use tracing::{debug, warn};

use crate::{Events, Fleet, Invocation, ToolOutcome};

/// A call that missed: where to store its result, and the generations
/// its lookup read (a purge since then keeps the result out).
#[derive(Debug, Clone)]
pub(super) struct Miss {
    key: CacheKey,
    gens: Generations,
    ttl: Duration,
    /// The tool's id, the metric's label.
    tool: String,
}

/// What the lookup of a call decided: run it (`Ok`), storing its `ok`
/// result when it missed (`Some`), or its answer from the cache (`Err`,
/// as every call answered without a job).
type Looked = Result<Option<Miss>, ToolOutcome>;

/// Looks `call` of `tool` with `arguments` up in the cache, when its
/// definition has one; `settings` are the tenant's settings of the tool
/// that its job would carry (part of the key). A hit publishes its
/// `tool_result` event (`cached`) here and marks the call's `span` ok.
pub(super) async fn look(
    fleet: &Fleet,
    inv: &Invocation,
    (call, tool, arguments, settings): (&ToolCall, &CompiledTool, &Value, Option<&Value>),
    events: &Events,
    span: &tracing::Span,
) -> Looked {
    let def = &tool.definition;
    let Some(cache) = def.cache else {
        return Ok(None);
    };
    let id = def.id.to_string();
    let count = |outcome: &str| {
        fleet
            .metrics
            .tool_cache
            .with_label_values(&[id.as_str(), outcome])
            .inc();
    };
    let scope = CallScope {
        tenant: inv.job.tenant(),
        user: inv.ctx.user.as_deref(),
        data_source_id: inv.ctx.data_source_id.as_deref(),
        attached_documents: &inv.ctx.attached_documents,
        resource: inv.ctx.resource.as_deref(),
        settings,
    };
    let Some(key) = CacheKey::new(&def.id, cache.scope, arguments, &scope) else {
        // Scope `user`, and no user the fleet vouches for.
        count("bypass");
        return Ok(None);
    };
    let started = Instant::now();
    let gens = match fleet.store.cache_lookup(&key).await {
        Ok(Lookup::Miss(gens)) => gens,
        Ok(Lookup::Hit(stored)) => {
            match replay(fleet, inv, call, &id, *stored, started, events).await {
                Some(outcome) => {
                    count("hit");
                    span.record("otel.status_code", "ok");
                    return Err(outcome);
                }
                None => {
                    count("bypass");
                    return Ok(None);
                }
            }
        }
        Err(e) => {
            debug!(tool = %id, error = %e, "the tool-result cache did not answer; the call runs");
            count("bypass");
            return Ok(None);
        }
    };
    count("miss");
    Ok(Some(Miss {
        key,
        gens,
        ttl: cache.ttl(),
        tool: id,
    }))
}

/// Answers `call` with `stored`: its references under fresh indices of
/// this invocation, its markers renumbered, a `tool_result` event marked
/// `cached`. `None` when the references cannot be reserved (the call then
/// runs).
async fn replay(
    fleet: &Fleet,
    inv: &Invocation,
    call: &ToolCall,
    tool: &str,
    stored: ToolResult,
    started: Instant,
    events: &Events,
) -> Option<ToolOutcome> {
    let reserved = fleet
        .store
        .reserve_again(
            InvocationKey::new(inv.job.tenant(), &inv.ctx.invocation_id),
            &call.id,
            tool,
            stored.references,
            inv.citations.floor(),
        )
        .await;
    let (references, renumbered) = match reserved {
        Ok(r) => r,
        Err(e) => {
            warn!(tool, error = %e, "a cached result's references could not be reserved; the call runs");
            return None;
        }
    };
    // Always: a marker the stored result has no reference for would cite
    // whatever this invocation holds under its number.
    let content =
        toolfleet_protocol::references::renumber(&stored.content, |n| renumbered.get(&n).copied());
    fleet
        .metrics
        .tool_calls
        .with_label_values(&[tool, ToolStatus::Ok.as_str()])
        .inc();
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        status: ToolStatus::Ok,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        error_code: None,
        warnings: super::bounded_warnings(&stored.warnings),
        cached: true,
    });
    Some(ToolOutcome {
        content,
        status: ToolStatus::Ok,
        references,
    })
}

/// Why an `ok` `result` is not stored, if it is not: only one without
/// warnings, as its worker first made it, is.
fn unfit(result: &ToolResult) -> Option<&'static str> {
    if !result.warnings.is_empty() {
        Some("it carries warnings")
    } else if result.replayed {
        Some("it was read back from a ledger")
    } else {
        None
    }
}

/// `result` as it is stored: without the model calls the tool spent (a
/// hit spends none) and with only the references its own call cited (as
/// a fresh result's answer keeps only those).
fn to_keep(result: &ToolResult) -> ToolResult {
    let mut kept = result.clone();
    kept.llm_calls.clear();
    kept.references
        .retain(|r| r.call_id.as_deref() == Some(result.call_id.as_str()));
    kept
}

/// Stores `result` for the call that missed (in a task of its own: the
/// call's answer never waits for it), when it is fit ([`unfit`]): an
/// error, a `blocked` or a timed-out result is never kept, nor one with
/// warnings or replayed, nor the model calls a tool spent (a hit spends
/// none), nor references another call cited (as a fresh result's).
pub(super) fn keep(fleet: &Fleet, miss: Miss, result: &ToolResult) {
    let metrics = fleet.metrics.tool_cache.clone();
    let count = move |tool: &str, outcome: &str| metrics.with_label_values(&[tool, outcome]).inc();
    if result.status != ToolStatus::Ok || result.error.is_some() {
        return;
    }
    if let Some(why) = unfit(result) {
        debug!(tool = %miss.tool, why, "a result is not cached");
        count(&miss.tool, "skip");
        return;
    }
    let kept = to_keep(result);
    let store = fleet.store.clone();
    tokio::spawn(async move {
        let outcome = match store
            .cache_store(&miss.key, miss.gens, &kept, miss.ttl)
            .await
        {
            Ok(Stored::Kept) => "store",
            // Purged since the lookup: the result may predate the purge.
            Ok(Stored::Purged) => return,
            Ok(Stored::TooLarge) => {
                debug!(tool = %miss.tool, "a result is too large to cache");
                "skip"
            }
            Err(e) => {
                debug!(tool = %miss.tool, error = %e, "a result could not be cached");
                "bypass"
            }
        };
        count(&miss.tool, outcome);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> ToolResult {
        serde_json::from_value(serde_json::json!({
            "invocationId": "inv-1",
            "callId": "call_1",
            "toolId": "units:convert@1.0.0",
            "status": "ok",
            "content": "1 m is 100 cm",
            "attempt": 1,
            "durationMs": 3
        }))
        .unwrap()
    }

    #[test]
    fn only_the_calls_own_references_are_kept() {
        let reference = |index: u64, call: Option<&str>| toolfleet_protocol::Reference {
            index,
            kind: "document".into(),
            title: format!("doc {index}"),
            source: None,
            url: None,
            snippet: None,
            tool_id: Some("units:convert@1.0.0".into()),
            call_id: call.map(str::to_owned),
        };
        let result = ToolResult {
            references: vec![
                reference(1, Some("call_1")),
                reference(2, Some("call_other")),
                reference(3, None),
                reference(4, Some("call_1")),
            ],
            ..ok()
        };
        let kept: Vec<u64> = to_keep(&result)
            .references
            .iter()
            .map(|r| r.index)
            .collect();
        assert_eq!(kept, vec![1, 4]);
    }

    #[test]
    fn only_a_result_without_warnings_and_not_replayed_is_fit_to_keep() {
        assert_eq!(unfit(&ok()), None);
        let mut warned = ok();
        warned.warnings.push(toolfleet_protocol::ToolWarning {
            code: "reply_truncated".into(),
            message: "cut".into(),
        });
        assert_eq!(unfit(&warned), Some("it carries warnings"));
        let replayed = ToolResult {
            replayed: true,
            ..ok()
        };
        assert_eq!(unfit(&replayed), Some("it was read back from a ledger"));
    }
}
