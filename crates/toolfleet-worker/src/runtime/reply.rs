//! Answering a call: the result to the caller's reply subject (cut to a
//! small error when it is too big for the server), then into the ledger
//! when the tool ran for it.

use toolfleet_protocol::ToolErrorCode;
use toolfleet_protocol::{CallContext, ToolErrorBody, ToolResult, ToolStatus};
use tracing::warn;

use super::results::{encode_result, result_reply, tagged_result};
use super::shared::Shared;

/// Answers `call` with `result`; then, when the tool ran for it and is
/// not idempotent (`to_ledger`), writes it to the ledger, so a redelivery
/// or a re-publish of the job returns it without running again. The
/// caller does not wait for the ledger: the job's ack does (it comes after
/// this returns), so a crash between the reply and the write is a crash
/// before the write — the job is delivered again and runs again, reusing
/// its citation indices. Until the write is done this worker answers a
/// repeat of the call from memory ([`super::ledger::Recording`]).
///
/// `answered` runs once the reply is out: the job's permit goes back then,
/// so the next job is pulled while this one's ledger write is on its way.
pub(super) async fn answer(
    shared: &Shared,
    call: &CallContext,
    result: &ToolResult,
    to_ledger: bool,
    answered: impl FnOnce(),
) {
    // Encoded once: the ledger holds these bytes, the reply is them
    // tagged as a result.
    let json = encode_result(result);
    let recording = to_ledger.then(|| shared.recording.start(call, json.clone()));
    publish_reply(shared, call, fit_result(shared, result, Some(&json))).await;
    answered();
    if to_ledger {
        write_ledger(shared, call, &json).await;
    }
    drop(recording);
}

/// Writes an answered call's result (`json`) to the ledger. If it cannot
/// be written the result is out all the same: a later duplicate will run
/// again, reusing its citation indices.
pub(super) async fn write_ledger(shared: &Shared, call: &CallContext, json: &bytes::Bytes) {
    if let Err(e) = shared.ledger.write(call, json.clone()).await {
        shared.hooks.on_warning(
            call,
            &toolfleet_protocol::ToolWarning {
                code: ToolErrorCode::LedgerNotWritten.to_string(),
                message: format!("result ledger not written: {e}"),
            },
        );
        warn!(error = %e, "result ledger not written");
    }
}

/// Publishes an encoded reply to the call's reply subject. No headers:
/// the reply names its invocation and call in its body (which the caller
/// checks against the call), and a caller reads nothing else.
pub(super) async fn publish_reply(shared: &Shared, call: &CallContext, payload: bytes::Bytes) {
    if let Err(e) = shared.client.publish(call.reply_to.clone(), payload).await {
        warn!(error = %e, "cannot publish the tool result");
    }
}

/// The encoded result reply (from `json`, the result already encoded,
/// when given). A result too big for the server would never arrive: the
/// caller gets a small error result instead of waiting out its timeout.
pub(super) fn fit_result(
    shared: &Shared,
    result: &ToolResult,
    json: Option<&[u8]>,
) -> bytes::Bytes {
    let payload = match json.and_then(tagged_result) {
        Some(payload) => payload,
        None => result_reply(result),
    };
    let limit = shared.client.max_payload();
    if limit == 0 || payload.len() <= limit {
        return payload;
    }
    let message = format!(
        "the tool's result is {} bytes; the NATS server takes at most {limit}",
        payload.len()
    );
    warn!(tool = %result.tool_id, "{message}");
    result_reply(&ToolResult {
        status: ToolStatus::Error,
        content: message.clone(),
        data: None,
        error: Some(ToolErrorBody {
            code: ToolErrorCode::ResultTooLarge.to_string(),
            message,
            violations: Vec::new(),
        }),
        references: Vec::new(),
        ..result.clone()
    })
}
