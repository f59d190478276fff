//! Agent tools' calls: a call of an agent tool runs as a nested chat job
//! ([`crate::agents::run_agent_call`]), with the same events and metrics
//! a worker tool's call has.

use std::sync::Arc;
use std::time::Instant;
use toolfleet_protocol::ToolErrorCode;

use serde_json::Value;
use toolfleet_llm::ToolCall;
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{ChatEventBody, ToolStatus};

use crate::text::redact;
use crate::{Events, Fleet, Invocation, ToolOutcome};

/// Runs an agent tool's call with its events and metrics, as dispatch does
/// for worker tools.
pub async fn agent_call(
    inv: &Invocation,
    tool: &Arc<CompiledTool>,
    call: &ToolCall,
    fleet: &Fleet,
    events: &Events,
    spent: &std::sync::Mutex<Vec<toolfleet_protocol::LlmCall>>,
) -> ToolOutcome {
    let id = tool.definition.id.to_string();
    let arguments: Result<Value, _> = serde_json::from_str(&call.arguments);
    events.send(ChatEventBody::ToolCall {
        call_id: call.id.clone(),
        tool: id.clone(),
        arguments: match &arguments {
            Ok(v) => redact(v, &tool.definition.sensitive_arguments),
            Err(_) => Value::String("[not JSON]".into()),
        },
    });
    let started = Instant::now();
    let (outcome, error_code) = match arguments {
        Err(e) => (
            ToolOutcome {
                content: format!(
                    "Error: the arguments for {} are not valid JSON ({e}). Send a JSON object.",
                    call.name
                ),
                status: ToolStatus::Error,
                references: Vec::new(),
            },
            Some(ToolErrorCode::InvalidArguments.to_string()),
        ),
        Ok(arguments) => match tool.validate_arguments(&arguments) {
            Err(violations) => (
                ToolOutcome {
                    content: format!(
                        "Error: invalid arguments for {}: {}",
                        call.name,
                        violations
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                    status: ToolStatus::Error,
                    references: Vec::new(),
                },
                Some(ToolErrorCode::InvalidArguments.to_string()),
            ),
            Ok(()) => {
                // While it waits for its nested job, the invocation does not
                // count against its tenant's share of the slots: the nested
                // job needs one (see `intake::fair`).
                let _waiting = fleet.agent_waits.wait(inv.job.tenant());
                let outcome = crate::agents::run_agent_call(
                    fleet, inv, tool, call, &arguments, events, spent,
                )
                .await;
                let code =
                    (outcome.status != ToolStatus::Ok).then(|| outcome.status.as_str().to_string());
                (outcome, code)
            }
        },
    };
    let elapsed = started.elapsed();
    let m = fleet.metrics();
    m.tool_calls
        .with_label_values(&[id.as_str(), outcome.status.as_str()])
        .inc();
    m.tool_call_duration
        .with_label_values(&[id.as_str()])
        .observe(elapsed.as_secs_f64());
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: id,
        status: outcome.status,
        duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        error_code,
        warnings: Vec::new(),
        cached: false,
    });
    outcome
}
