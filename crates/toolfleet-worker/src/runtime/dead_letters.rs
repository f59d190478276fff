//! Dead letters of tool jobs: the one place that counts and publishes
//! them, and the end of a job whose headers cannot even be read (taken
//! aside by the pull loop).

use std::sync::Arc;
use toolfleet_protocol::ToolErrorCode;

use toolfleet_protocol::headers::{CALL_ID, INVOCATION_ID, REPLY_TO};
use toolfleet_protocol::{CallContext, DeadLetter, DeadLetterKind, InvocationContext};
use toolfleet_service::poison::Poison;

use super::reply::{fit_result, publish_reply};
use super::results::error_result;
use super::shared::Shared;
use crate::builder::Served;

/// Counts `dead` and publishes it on the fleet's tool dead-letter subject
/// (the fleet's one dead-letter publisher).
pub(super) async fn publish(shared: &Shared, dead: DeadLetter) {
    let _ = toolfleet_service::dead_letters::publish(
        &shared.client,
        &shared.config.subjects,
        &shared.metrics.dead_letters,
        &dead,
    )
    .await;
}

/// Ends a tool job whose headers the NATS client cannot read (taken aside
/// by the pull loop, which terminates it after this): an error result
/// to its caller when the call can be read from it — invocation, call id
/// and a reply subject of this fleet — and a dead letter with the headers
/// as received.
pub(super) async fn poison(tool: Arc<Served>, shared: Arc<Shared>, poison: Poison) {
    let label = tool.label().to_string();
    let valid = |name| {
        poison
            .header(name)
            .filter(|v| toolfleet_protocol::valid_invocation_id(v))
            .map(str::to_string)
    };
    let invocation_id = valid(INVOCATION_ID);
    let call_id = valid(CALL_ID);
    let message = format!(
        "the tool job's headers cannot be read ({}); it was not run",
        poison.reason
    );
    shared.count(&label, "error");
    if let (Some(inv), Some(call_id), Some(reply_to)) = (
        &invocation_id,
        &call_id,
        poison
            .header(REPLY_TO)
            .filter(|r| shared.config.subjects.is_reply_subject(r)),
    ) {
        let call = CallContext {
            invocation: InvocationContext::new(inv.clone()),
            call_id: call_id.clone(),
            tool_id: tool.definition().id.clone(),
            attempt: 1,
            reply_to: reply_to.to_string(),
            citation_floor: 0,
            new_call: false,
        };
        let result = error_result(
            &call,
            1,
            0,
            ToolErrorCode::UnreadableHeaders.as_str(),
            &message,
        );
        publish_reply(&shared, &call, fit_result(&shared, &result, None)).await;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Tool,
        stream: shared.config.subjects.tools_stream(),
        stream_sequence: poison.stream_sequence,
        invocation_id,
        call_id,
        tool_id: Some(label.clone()),
        attempts: 1,
        code: ToolErrorCode::UnreadableHeaders.to_string(),
        error: message,
        job: None,
        headers: Default::default(),
        raw_headers: Some(poison.raw_headers),
    };
    publish(&shared, dead).await;
}
