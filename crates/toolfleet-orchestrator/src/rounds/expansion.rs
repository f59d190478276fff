//! `search_tools`: when scoping left tools out, the model may search the
//! permitted tools not offered yet; the matches join the offered ones from
//! the next round on, after them (never sorted among them, so the
//! requests' beginning up to the new tools stays the same), at most
//! `max_expansion_rounds` times and never beyond `max_tool_count` tools;
//! each addition is a `scoping` event with decision `expansion`. A search
//! that found nothing changes no request; one past the caps is answered
//! `expansion_capped` (`search_tools` stays offered, see
//! [`Invocation::tool_specs`]).

use std::time::Instant;
use toolfleet_protocol::ToolErrorCode;

use serde_json::Value;
use toolfleet_llm::ToolCall;
use toolfleet_protocol::tools::ToolId;
use toolfleet_protocol::{ChatEventBody, ToolStatus};

use crate::tools::{blocking, scoring};
use crate::{Events, Fleet, Invocation, ToolOutcome};

/// Runs a `search_tools` call: the matches among the permitted tools not
/// offered yet join the offered ones (within the caps) from the next
/// round on.
pub(super) fn search_tools_call(
    inv: &mut Invocation,
    call: &ToolCall,
    fleet: &Fleet,
    events: &Events,
) -> ToolOutcome {
    let tool = scoring::SEARCH_TOOLS;
    let arguments: Value = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
    events.send(ChatEventBody::ToolCall {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        arguments: arguments.clone(),
    });
    let started = Instant::now();
    let m = fleet.metrics();
    let offered = inv.tools.len();
    let (status, content, error_code) = if !inv.scope.can_expand(offered) {
        m.tool_expansions.with_label_values(&["capped"]).inc();
        (
            ToolStatus::Error,
            format!(
                "Error: no more tools can be added (at most {} search_tools calls and {} tools per conversation). Answer with the tools you have.",
                inv.scope.policy.max_expansion_rounds, inv.scope.policy.max_tool_count
            ),
            Some(ToolErrorCode::ExpansionCapped.to_string()),
        )
    } else {
        let offered_ids: std::collections::HashSet<&ToolId> =
            inv.tools.iter().map(|t| &t.definition.id).collect();
        let pool: Vec<usize> = inv
            .scope
            .permitted
            .tools
            .iter()
            .filter(|t| !offered_ids.contains(&t.definition.id))
            .filter_map(|t| inv.scope.snapshot.position(t))
            .collect();
        let room = inv.scope.policy.max_tool_count.saturating_sub(offered);
        let index = &inv.scope.snapshot.index;
        // Tens of milliseconds over thousands of tools: off the async
        // workers.
        let found = blocking(|| scoring::run_search_tools_in(&arguments, index, &pool, room));
        match found {
            Err(e) => (
                ToolStatus::Error,
                format!("Error: {e}"),
                Some(ToolErrorCode::InvalidArguments.to_string()),
            ),
            Ok(found) => {
                // Every search counts against the rounds, found or not.
                inv.scope.expansions += 1;
                if found.added.is_empty() {
                    m.tool_expansions.with_label_values(&["nothing"]).inc();
                } else {
                    m.tool_expansions.with_label_values(&["added"]).inc();
                    let added: Vec<String> = found
                        .added
                        .iter()
                        .map(|t| t.definition.id.to_string())
                        .collect();
                    // Appended, in the order found: every tool already
                    // offered keeps its place in the requests, and with it
                    // the provider's cached prompt up to the first new one.
                    inv.tools.extend(found.added);
                    events.send(ChatEventBody::Scoping {
                        decision: "expansion".into(),
                        permitted: inv.scope.permitted.tools.len(),
                        tools: inv.tool_ids(),
                        added,
                        note: None,
                    });
                }
                (ToolStatus::Ok, found.text, None)
            }
        }
    };
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        status,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        error_code,
        warnings: Vec::new(),
        cached: false,
    });
    ToolOutcome {
        content,
        status,
        references: Vec::new(),
    }
}
