//! The [`ToolResult`]s the runtime makes itself (errors, refusals) and how
//! a result is encoded once for both the ledger and the reply, and
//! scrubbed of the worker's secrets before anyone sees it.

use toolfleet_protocol::schema::Violation;
use toolfleet_protocol::{CallContext, ToolErrorBody, ToolReply, ToolResult, ToolStatus};

use crate::settings::Scrubber;

/// An `error` result of `call` with `code` and `message`.
pub(super) fn error_result(
    call: &CallContext,
    attempt: u32,
    duration_ms: u64,
    code: &str,
    message: &str,
) -> ToolResult {
    status_result(
        call,
        attempt,
        duration_ms,
        ToolStatus::Error,
        code,
        message,
        Vec::new(),
    )
}

/// A result of `call` that is not `ok`: `status`, with `code`, `message`
/// (also the content the model reads) and the argument `violations`.
pub(super) fn status_result(
    call: &CallContext,
    attempt: u32,
    duration_ms: u64,
    status: ToolStatus,
    code: &str,
    message: &str,
    violations: Vec<Violation>,
) -> ToolResult {
    ToolResult {
        invocation_id: call.invocation.invocation_id.clone(),
        call_id: call.call_id.clone(),
        tool_id: call.tool_id.to_string(),
        status,
        content: message.to_string(),
        data: None,
        error: Some(ToolErrorBody {
            code: code.to_string(),
            message: message.to_string(),
            violations,
        }),
        references: Vec::new(),
        attempt,
        duration_ms,
        replayed: false,
        llm_calls: Vec::new(),
        warnings: Vec::new(),
    }
}

/// A result as the ledger stores it.
pub(super) fn encode_result(result: &ToolResult) -> bytes::Bytes {
    serde_json::to_vec(result)
        .map(bytes::Bytes::from)
        .unwrap_or_default()
}

/// `ToolReply::Result` as serde encodes it (the tag first, then the
/// result's fields), from the result's own encoding: `{"type":"result",`
/// and the object's fields. `None` for anything but a non-empty object.
pub(super) fn tagged_result(json: &[u8]) -> Option<bytes::Bytes> {
    const TAG: &[u8] = b"{\"type\":\"result\",";
    let fields = json.strip_prefix(b"{")?;
    if !fields.starts_with(b"\"") {
        return None;
    }
    let mut out = Vec::with_capacity(TAG.len() + fields.len());
    out.extend_from_slice(TAG);
    out.extend_from_slice(fields);
    Some(out.into())
}

/// The reply that carries `result`, encoded.
pub(super) fn result_reply(result: &ToolResult) -> bytes::Bytes {
    toolfleet_protocol::encode(&ToolReply::Result(Box::new(result.clone())))
}

/// Takes the worker's secrets out of a result before anyone sees it.
pub(super) fn scrub(scrubber: &Scrubber, result: &mut ToolResult) {
    if scrubber.is_empty() {
        return;
    }
    scrubber.in_place(&mut result.content);
    if let Some(data) = result.data.as_mut() {
        scrubber.value(data);
    }
    if let Some(error) = result.error.as_mut() {
        scrubber.in_place(&mut error.message);
    }
    for r in &mut result.references {
        scrubber.in_place(&mut r.title);
        for field in [&mut r.source, &mut r.url, &mut r.snippet]
            .into_iter()
            .flatten()
        {
            scrubber.in_place(field);
        }
    }
    for w in &mut result.warnings {
        scrubber.in_place(&mut w.message);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use toolfleet_protocol::{Reference, encode};

    use super::*;

    /// A call of `inv` with id `call_id`, for tests of the runtime.
    pub(in crate::runtime) fn call(inv: &str, call_id: &str) -> CallContext {
        CallContext {
            invocation: toolfleet_protocol::InvocationContext::new(inv),
            call_id: call_id.into(),
            tool_id: "system:current_datetime@1.0.0".parse().unwrap(),
            attempt: 1,
            reply_to: "toolfleet.reply.x".into(),
            citation_floor: 0,
            new_call: false,
        }
    }

    #[test]
    fn a_result_encoded_once_makes_the_same_reply_as_serde() {
        let plain = status_result(
            &call("inv-1", "c1"),
            2,
            7,
            ToolStatus::Error,
            "tool_failed",
            "it \"broke\"",
            Vec::new(),
        );
        let mut rich = ToolResult {
            status: ToolStatus::Ok,
            content: "fine".into(),
            data: Some(serde_json::json!({ "a": [1, 2], "b": null })),
            error: None,
            replayed: true,
            ..plain.clone()
        };
        rich.references.push(Reference {
            index: 3,
            kind: "document".into(),
            title: "t".into(),
            source: None,
            url: Some("https://example.com/".into()),
            snippet: None,
            tool_id: None,
            call_id: Some("c1".into()),
        });
        for result in [plain, rich] {
            let json = encode_result(&result);
            assert_eq!(
                tagged_result(&json).unwrap(),
                encode(&ToolReply::Result(Box::new(result.clone())))
            );
            // The ledger holds the result itself.
            let stored: ToolResult = serde_json::from_slice(&json).unwrap();
            assert_eq!(stored, result);
        }
        assert_eq!(tagged_result(b"{}"), None);
        assert_eq!(tagged_result(b"[1]"), None);
    }
}
