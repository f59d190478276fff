//! The handler both model APIs share (`POST /v1/chat/completions` and
//! `POST /v1/responses`): read and record the request, play the script,
//! inject the step's fault, then send the reply in the request's API shape,
//! as one body or as a stream.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::chat;
use crate::fault::{FaultKind, StatusFault};
use crate::reply::{Plan, Reply, estimate_tokens, offers_tools, plan, truncate};
use crate::request::{ApiError, Turn};
use crate::responses;
use crate::script::Script;
use crate::sse::{Piece, apply_stream_fault, feed_body};
use crate::state::{Received, ServerState};

/// The API shape a request comes in, and its answer goes out, in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Responses,
}

impl Api {
    /// Checks a request the way the real API would and extracts its turns.
    fn read(self, script: &Script, request: &Value) -> Result<Vec<Turn>, ApiError> {
        match self {
            Self::Chat => chat::read_request(request),
            Self::Responses => responses::read_request(request)
                .and_then(|turns| responses::check_model_support(script, request).map(|()| turns)),
        }
    }

    /// What a `malformedChunk` fault sends in this shape.
    fn malformed_chunk(self) -> &'static str {
        match self {
            Self::Chat => chat::MALFORMED_CHUNK,
            Self::Responses => responses::MALFORMED_EVENT,
        }
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    respond(state, Api::Chat, uri, headers, body).await
}

/// `POST /v1/responses`.
pub(crate) async fn responses(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    respond(state, Api::Responses, uri, headers, body).await
}

/// Reads, records and answers one request in either API shape.
async fn respond(
    state: Arc<ServerState>,
    api: Api,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut received = Received::new(&uri, &headers, Value::Null);
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            // Recorded as text so a test can still see what was sent.
            received.body = Value::String(String::from_utf8_lossy(&body).into_owned());
            state.record(received);
            return ApiError::invalid(
                format!("We could not parse the JSON body of your request: {e}"),
                None,
                Some("invalid_json"),
            )
            .into_response();
        }
    };
    received.body = request.clone();
    let turns = match api.read(&state.script, &request) {
        Ok(turns) => turns,
        Err(e) => {
            state.record(received);
            return e.into_response();
        }
    };
    let model = request["model"].as_str().unwrap_or_default();
    let plan = plan(&state.script, &turns, model, offers_tools(&request));
    let fault = plan
        .fault
        .as_ref()
        .filter(|(key, fault)| state.take_fault(*key, fault))
        .map(|(_, fault)| fault.kind.clone());
    received.fault = fault.as_ref().map(FaultKind::name);
    state.record(received);
    if let Some(fault) = &fault {
        tracing::debug!(fault = fault.name(), "scripted fault injected");
    }
    if let Some(FaultKind::Status(status)) = &fault {
        return status_response(status);
    }
    let answer = Answer::new(api, &state.script, &request, &turns, plan, fault.as_ref());
    if request.get("stream").and_then(Value::as_bool) == Some(true) {
        answer.stream(&state, fault.as_ref())
    } else {
        plain_answer(&state, answer.body(), fault.as_ref(), answer.slow).await
    }
}

/// A reply ready to go out in the request's API shape.
struct Answer<'a> {
    api: Api,
    script: &'a Script,
    request: &'a Value,
    reply: Reply,
    /// The step reasons (Responses: a reasoning item comes first).
    reasoning: bool,
    /// The step's `usage`, reported instead of the estimate.
    usage: Option<Value>,
    prompt_tokens: u64,
    /// A `length` fault cut the reply short.
    truncated: bool,
    /// The pause before the first chunk (non-streaming: the whole body):
    /// the script's first-token delay plus any `slowFirstToken` fault.
    slow: Duration,
}

impl<'a> Answer<'a> {
    fn new(
        api: Api,
        script: &'a Script,
        request: &'a Value,
        turns: &[Turn],
        plan: Plan,
        fault: Option<&FaultKind>,
    ) -> Self {
        let truncated = fault == Some(&FaultKind::Length);
        let reply = if truncated {
            truncate(plan.reply)
        } else {
            plan.reply
        };
        let slow = script.first_token_delay()
            + match fault {
                Some(FaultKind::SlowFirstToken(delay)) => *delay,
                _ => Duration::ZERO,
            };
        let prompt_chars: usize = turns.iter().map(|t| t.text.chars().count()).sum::<usize>()
            + request.get("tools").map_or(0, |t| t.to_string().len());
        Self {
            api,
            script,
            request,
            reply,
            reasoning: plan.reasoning,
            usage: plan.usage,
            prompt_tokens: estimate_tokens(prompt_chars),
            truncated,
            slow,
        }
    }

    /// The whole answer as one JSON body.
    fn body(&self) -> Value {
        let model = self.script.model();
        match self.api {
            Api::Chat => chat::completion_body(
                &chat::Envelope::new(model).with_usage(self.usage.clone()),
                &self.reply,
                self.prompt_tokens,
                self.truncated,
            ),
            Api::Responses => responses::body(
                &responses::Envelope::new(model, self.request).with_usage(self.usage.clone()),
                &self.reply,
                self.reasoning,
                self.prompt_tokens,
                self.truncated,
            ),
        }
    }

    /// The frames of the answer streamed.
    fn stream_pieces(&self) -> Vec<Piece> {
        let model = self.script.model();
        match self.api {
            Api::Chat => chat::stream_pieces(
                &chat::Envelope::new(model).with_usage(self.usage.clone()),
                &self.reply,
                self.prompt_tokens,
                chat::includes_usage(self.request),
                self.truncated,
            ),
            Api::Responses => responses::stream_pieces(
                &responses::Envelope::new(model, self.request).with_usage(self.usage.clone()),
                &self.reply,
                self.reasoning,
                self.prompt_tokens,
                self.truncated,
            ),
        }
    }

    /// The answer as a server-sent event stream, with its fault.
    fn stream(&self, state: &Arc<ServerState>, fault: Option<&FaultKind>) -> Response {
        let (frames, cut) =
            apply_stream_fault(self.stream_pieces(), fault, self.api.malformed_chunk());
        (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            feed_body(state, frames, cut, self.slow, self.script.chunk_delay()),
        )
            .into_response()
    }
}

/// A non-streaming answer, with its fault in body form.
async fn plain_answer(
    state: &Arc<ServerState>,
    body: Value,
    fault: Option<&FaultKind>,
    slow: Duration,
) -> Response {
    if !slow.is_zero() {
        tokio::time::sleep(slow).await;
    }
    let text = body.to_string();
    let half = || Bytes::copy_from_slice(&text.as_bytes()[..text.len() / 2]);
    let body = match fault {
        Some(FaultKind::CutMidToolCall | FaultKind::CutMidText) => {
            feed_body(state, vec![half()], true, Duration::ZERO, Duration::ZERO)
        }
        Some(FaultKind::MalformedChunk) => Body::from(half()),
        _ => Body::from(text.clone()),
    };
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The error response of a `status` fault, shaped like OpenAI's.
fn status_response(fault: &StatusFault) -> Response {
    let StatusFault {
        status,
        retry_after_ms,
        retry_after_secs,
        code,
        message,
    } = fault;
    let (kind, default_code, default_message) = match status.as_u16() {
        429 => (
            "requests",
            Some("rate_limit_exceeded"),
            "Rate limit reached (scripted stand-in fault).",
        ),
        500..=599 => (
            "server_error",
            None,
            "The server had an error while processing your request (scripted stand-in fault).",
        ),
        _ => (
            "invalid_request_error",
            None,
            "The request was rejected (scripted stand-in fault).",
        ),
    };
    let body = json!({"error": {
        "message": message.as_deref().unwrap_or(default_message),
        "type": kind,
        "param": null,
        "code": code.as_deref().or(default_code),
    }});
    let mut response = (*status, axum::Json(body)).into_response();
    let headers = response.headers_mut();
    if let Some(ms) = *retry_after_ms {
        headers.insert("retry-after-ms", ms.into());
        headers.insert("retry-after", ms.div_ceil(1000).into());
    }
    if let Some(secs) = *retry_after_secs {
        headers.insert(header::RETRY_AFTER, secs.into());
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;

    #[tokio::test]
    async fn status_faults_hit_as_many_requests_as_scripted() {
        let (server, client) = start(
            r#"{"default": {"steps": [{"answer": "fine now",
                "fault": {"kind": "status", "status": 429, "retryAfterMs": 1500, "times": 2}}]}}"#,
        )
        .await;
        let body = json!({"model": "m", "messages": [user("hi")]});
        for _ in 0..2 {
            let (status, headers, text, _) =
                send(&client, &server, "chat/completions", &body).await;
            assert_eq!(status, 429);
            assert_eq!(headers["retry-after-ms"], "1500");
            assert_eq!(headers["retry-after"], "2", "rounded up to whole seconds");
            let error: Value = serde_json::from_str(&text).expect("json");
            assert_eq!(error["error"]["code"], json!("rate_limit_exceeded"));
            assert_eq!(error["error"]["type"], json!("requests"));
        }
        let (status, _, text, _) = send(&client, &server, "chat/completions", &body).await;
        assert_eq!(status, 200);
        assert!(text.contains("fine now"));
        let faults: Vec<Option<&str>> = server.received().iter().map(|r| r.fault).collect();
        assert_eq!(faults, [Some("status"), Some("status"), None]);
        assert_eq!(server.fault_hits(), 2);
        assert_eq!(server.received()[0].path, "/v1/chat/completions");
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn stream_faults_cut_corrupt_and_truncate_the_body() {
        let (server, client) = start(
            r#"{"rules": [
                {"whenUserContains": ["cut call"], "steps": [{"toolCalls": [
                    {"name": "f", "arguments": {"query": "a long enough query", "n": 1}},
                    {"name": "g"}], "fault": {"kind": "cutMidToolCall"}}]},
                {"whenUserContains": ["cut text"], "steps": [{"answer": "one two three four five six",
                    "fault": {"kind": "cutMidText"}}]},
                {"whenUserContains": ["garbage"], "steps": [{"answer": "fine",
                    "fault": {"kind": "malformedChunk"}}]},
                {"whenUserContains": ["long"], "steps": [{"toolCalls": [
                    {"name": "f", "arguments": {"query": "abcdefgh"}}, {"name": "g"}],
                    "fault": {"kind": "length"}}]}
            ]}"#,
        )
        .await;
        let chat = |prompt: &str| json!({"model": "m", "stream": true, "messages": [user(prompt)]});
        let responses = |prompt: &str| json!({"model": "m", "stream": true, "input": prompt});

        // A cut mid tool call: the call's head and part of its arguments,
        // then the connection drops: no finish reason, no [DONE].
        let (_, _, text, broken) =
            send(&client, &server, "chat/completions", &chat("cut call")).await;
        assert!(broken, "the body breaks off");
        assert!(text.contains(r#""name":"f""#), "{text}");
        assert!(!text.contains(r#""name":"g""#), "{text}");
        assert!(
            !text.contains("finish_reason\":\"") && !text.contains("[DONE]"),
            "{text}"
        );
        let (_, _, text, broken) =
            send(&client, &server, "responses", &responses("cut call")).await;
        assert!(broken);
        let events = response_events(&text);
        assert!(!of_type(&events, "response.function_call_arguments.delta").is_empty());
        assert!(of_type(&events, "response.function_call_arguments.done").is_empty());
        assert!(of_type(&events, "response.completed").is_empty());

        // A cut after the first text delta.
        let (_, _, text, broken) =
            send(&client, &server, "chat/completions", &chat("cut text")).await;
        assert!(broken);
        assert!(
            text.contains("one two three ") && !text.contains("four"),
            "{text}"
        );

        // One `data:` line that is not JSON; the rest still follows.
        let (_, _, text, broken) =
            send(&client, &server, "chat/completions", &chat("garbage")).await;
        assert!(!broken);
        let bad: Vec<String> = payloads(&text)
            .into_iter()
            .filter(|p| p != "[DONE]" && serde_json::from_str::<Value>(p).is_err())
            .collect();
        assert_eq!(bad.len(), 1, "{text}");
        let (_, _, text, _) = send(&client, &server, "responses", &responses("garbage")).await;
        assert_eq!(
            text.split("\n\n")
                .filter(|f| f.contains("scripted malformed chunk"))
                .count(),
            1
        );

        // Out of tokens: the first call's arguments cut, the rest dropped.
        let (_, _, text, _) = send(&client, &server, "chat/completions", &chat("long")).await;
        let chunks: Vec<Value> = payloads(&text)
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str(p).expect("chunk"))
            .collect();
        assert_eq!(
            chunks.last().expect("chunk")["choices"][0]["finish_reason"],
            json!("length")
        );
        let arguments: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
            })
            .collect();
        assert_eq!(arguments, r#"{"query":""#, "half of the arguments");
        assert!(!text.contains(r#""name":"g""#));
        let (_, _, text, _) = send(&client, &server, "responses", &responses("long")).await;
        let events = response_events(&text);
        let last = events.last().expect("events");
        assert_eq!(last["type"], json!("response.incomplete"));
        assert_eq!(
            last["response"]["incomplete_details"]["reason"],
            json!("max_output_tokens")
        );
        assert_eq!(last["response"]["output"][0]["status"], json!("incomplete"));
        assert_eq!(last["response"]["output"].as_array().map(Vec::len), Some(1));

        // The same faults in non-streaming form.
        let plain = json!({"model": "m", "messages": [user("cut call")]});
        let (_, _, _, broken) = send(&client, &server, "chat/completions", &plain).await;
        assert!(broken);
        let plain = json!({"model": "m", "messages": [user("garbage")]});
        let (status, _, text, _) = send(&client, &server, "chat/completions", &plain).await;
        assert_eq!(status, 200);
        assert!(serde_json::from_str::<Value>(&text).is_err());

        let stats = server.stream_stats();
        assert_eq!((stats.cut, stats.dropped), (4, 0), "{stats:?}");
        assert_eq!(server.fault_hits(), 9);
        within(server.shutdown()).await;
    }
}
