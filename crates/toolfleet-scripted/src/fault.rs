//! Faults a script step can inject: their kinds, and how a step's `fault`
//! is read and checked. What each kind does to an answer happens where the
//! answer is sent: `status` and the body forms in `handler`, the stream
//! cuts and the malformed chunk in `sse`, `length` in `reply::truncate`.
//!
//! # Faults
//!
//! `"fault": {"kind": .., "times": N}` on a step makes the first `N`
//! requests that play that step (counted per step over the server's life,
//! retries included) fail; after that the step behaves normally. Without
//! `times` every request fails. Kinds:
//!
//! | kind | extra keys | effect |
//! |---|---|---|
//! | `status` | `status` (400–599, required), `retryAfterMs`, `retryAfter` (seconds), `code`, `message` | that HTTP status with an OpenAI error body (`code` defaults to `rate_limit_exceeded` for 429, `type` is `requests` for 429, `server_error` for 5xx, else `invalid_request_error`); `retryAfterMs` sends `retry-after-ms` and a rounded-up `retry-after`, `retryAfter` sends `retry-after` |
//! | `cutMidToolCall` | | `toolCalls` steps only: the connection is dropped in the middle of the first call's arguments (after its head and half its argument fragments): no finish reason, no `[DONE]`, no terminal event |
//! | `cutMidText` | | `answer` / `refusal` steps only: the connection is dropped right after the first text (or refusal) delta |
//! | `malformedChunk` | | one `data:` line that is not JSON is sent after the first chunk or event; the rest follows normally |
//! | `slowFirstToken` | `delayMs` (required) | the response headers go out at once, the first chunk or event only after `delayMs` (non-streaming: the whole response waits) |
//! | `length` | | `toolCalls` / `answer` steps only: the model "runs out of tokens": the first call's arguments (or the text) are cut in half, later calls dropped, and the answer ends with `finish_reason: "length"` (Responses: item status `incomplete` and `response.incomplete` with `incomplete_details.reason: "max_output_tokens"`) |
//!
//! Non-streaming requests get the same faults in body form: the cuts drop
//! the connection halfway through the JSON body, `malformedChunk` sends a
//! 200 body that is not JSON.

use std::time::Duration;

use axum::http::StatusCode;
use serde::Deserialize;

/// Flat rather than a tagged enum so that a key used with the wrong kind
/// gets a message naming both.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RawFault {
    kind: String,
    status: Option<u16>,
    retry_after_ms: Option<u64>,
    retry_after: Option<u64>,
    code: Option<String>,
    message: Option<String>,
    delay_ms: Option<u64>,
    times: Option<u32>,
}

/// An injected failure and how many requests get it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Fault {
    pub(crate) kind: FaultKind,
    /// `None`: every request.
    pub(crate) times: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum FaultKind {
    Status(StatusFault),
    CutMidToolCall,
    CutMidText,
    MalformedChunk,
    SlowFirstToken(Duration),
    Length,
}

/// A `status` fault: the error response to send instead of an answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StatusFault {
    pub(crate) status: StatusCode,
    pub(crate) retry_after_ms: Option<u64>,
    pub(crate) retry_after_secs: Option<u64>,
    pub(crate) code: Option<String>,
    pub(crate) message: Option<String>,
}

impl FaultKind {
    /// The script's name for the kind, as recorded in
    /// [`Received::fault`](crate::Received::fault).
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Status(_) => "status",
            Self::CutMidToolCall => "cutMidToolCall",
            Self::CutMidText => "cutMidText",
            Self::MalformedChunk => "malformedChunk",
            Self::SlowFirstToken(_) => "slowFirstToken",
            Self::Length => "length",
        }
    }
}

/// What a step says, as far as faults care: some kinds only fit some
/// steps (a call cannot be cut mid-text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepKind {
    ToolCalls,
    Answer,
    Refusal,
}

impl StepKind {
    /// The step's key in a script.
    fn name(self) -> &'static str {
        match self {
            Self::ToolCalls => "toolCalls",
            Self::Answer => "answer",
            Self::Refusal => "refusal",
        }
    }
}

const FAULT_KINDS: &str =
    "status, cutMidToolCall, cutMidText, malformedChunk, slowFirstToken, length";

/// Checks a step's `fault` (at script path `at`) against its kind and the
/// kind of step it sits on.
pub(crate) fn fault_from_raw(at: &str, raw: RawFault, step: StepKind) -> Result<Fault, String> {
    // Keys that only some kinds take, and which kind they belong to.
    let extras = [
        ("status", raw.status.is_some(), "status"),
        ("retryAfterMs", raw.retry_after_ms.is_some(), "status"),
        ("retryAfter", raw.retry_after.is_some(), "status"),
        ("code", raw.code.is_some(), "status"),
        ("message", raw.message.is_some(), "status"),
        ("delayMs", raw.delay_ms.is_some(), "slowFirstToken"),
    ];
    for (key, present, owner) in extras {
        if present && raw.kind != owner {
            return Err(format!(
                "{at}.{key} only applies to kind `{owner}`, not `{}`",
                raw.kind
            ));
        }
    }
    if raw.times == Some(0) {
        return Err(format!(
            "{at}.times must be at least 1 (leave it out for every request)"
        ));
    }
    let needs = |ok: bool, which: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{at}: kind `{}` needs a {which} step, not `{}`",
                raw.kind,
                step.name()
            ))
        }
    };
    let kind = match raw.kind.as_str() {
        "status" => {
            let status = raw
                .status
                .ok_or_else(|| format!("{at}.status is required for kind `status`"))?;
            let status = StatusCode::from_u16(status)
                .ok()
                .filter(|s| s.is_client_error() || s.is_server_error())
                .ok_or_else(|| format!("{at}.status must be an error status (400-599)"))?;
            FaultKind::Status(StatusFault {
                status,
                retry_after_ms: raw.retry_after_ms,
                retry_after_secs: raw.retry_after,
                code: raw.code,
                message: raw.message,
            })
        }
        "cutMidToolCall" => {
            needs(step == StepKind::ToolCalls, "`toolCalls`")?;
            FaultKind::CutMidToolCall
        }
        "cutMidText" => {
            needs(
                matches!(step, StepKind::Answer | StepKind::Refusal),
                "`answer` or `refusal`",
            )?;
            FaultKind::CutMidText
        }
        "malformedChunk" => FaultKind::MalformedChunk,
        "slowFirstToken" => FaultKind::SlowFirstToken(Duration::from_millis(
            raw.delay_ms
                .ok_or_else(|| format!("{at}.delayMs is required for kind `slowFirstToken`"))?,
        )),
        "length" => {
            needs(
                matches!(step, StepKind::ToolCalls | StepKind::Answer),
                "`toolCalls` or `answer`",
            )?;
            FaultKind::Length
        }
        other => {
            return Err(format!(
                "{at}.kind {other:?} is unknown; known kinds are {FAULT_KINDS}"
            ));
        }
    };
    Ok(Fault {
        kind,
        times: raw.times,
    })
}
