//! Chat Completions (`POST /v1/chat/completions`): a request's `messages`
//! read into turns (with the real API's checks), and the reply as one
//! `chat.completion` body or as streamed `chat.completion.chunk`s ending in
//! `data: [DONE]`.
//!
//! Streamed tool calls are split the way OpenAI splits them: a first chunk
//! with `index`, `id`, `type` and `function.name` and empty arguments, then
//! argument fragments carrying only `index`. `stream_options.include_usage`
//! adds a trailing usage-only chunk (`choices: []`).

use axum::body::Bytes;
use serde_json::{Map, Value, json};

use crate::SYSTEM_FINGERPRINT;
use crate::reply::{Reply, estimate_tokens, new_id, reply_chars, unix_now};
use crate::request::{ApiError, Turn, content_text, request_object};
use crate::sse::{ARGUMENT_FRAGMENT_CHARS, Piece, Tag, answer_pieces, fragments};

/// What a `malformedChunk` fault sends: a `data:` line that is not JSON.
pub(crate) const MALFORMED_CHUNK: &str =
    "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"scripted malformed chunk\"\n\n";

/// Whether a streamed answer ends with a usage chunk:
/// `stream_options.include_usage`.
pub(crate) fn includes_usage(request: &Value) -> bool {
    request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true)
}

/// Checks a request the way the real API would and extracts its turns.
pub(crate) fn read_request(body: &Value) -> Result<Vec<Turn>, ApiError> {
    let object = request_object(body)?;
    let messages = match object.get("messages") {
        Some(Value::Array(messages)) if messages.is_empty() => {
            return Err(ApiError::invalid(
                "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                Some("messages"),
                Some("empty_array"),
            ));
        }
        Some(Value::Array(messages)) => messages,
        _ => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'messages'.",
                Some("messages"),
                Some("missing_required_parameter"),
            ));
        }
    };
    let mut turns = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                format!(
                    "Invalid value: '{role}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
                ),
                Some(&format!("messages[{i}].role")),
                Some("invalid_value"),
            ));
        }
        let calls = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let text = |v: Option<&Value>| {
                            v.and_then(Value::as_str).unwrap_or_default().to_owned()
                        };
                        (text(c.get("id")), text(c.pointer("/function/name")))
                    })
                    .collect()
            })
            .unwrap_or_default();
        turns.push(Turn {
            role: role.to_owned(),
            text: content_text(message.get("content")),
            calls,
            call_id: message
                .get("tool_call_id")
                .and_then(Value::as_str)
                .map(str::to_owned),
        });
    }
    check_tool_pairing(&turns)?;
    Ok(turns)
}

/// Every tool message must answer a call of the assistant message just
/// before the run of tool messages, and every such call must be answered.
fn check_tool_pairing(turns: &[Turn]) -> Result<(), ApiError> {
    let mut open: Vec<&str> = Vec::new();
    for (i, turn) in turns.iter().enumerate() {
        if turn.role == "tool" {
            let id = turn.call_id.as_deref().unwrap_or_default();
            match open.iter().position(|c| *c == id) {
                Some(p) => {
                    open.remove(p);
                }
                None => {
                    return Err(ApiError::invalid(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.",
                        Some(&format!("messages.[{i}].role")),
                        None,
                    ));
                }
            }
            continue;
        }
        if !open.is_empty() {
            return Err(unanswered(&open));
        }
        open = turn.calls.iter().map(|(id, _)| id.as_str()).collect();
    }
    if open.is_empty() {
        Ok(())
    } else {
        Err(unanswered(&open))
    }
}

fn unanswered(open: &[&str]) -> ApiError {
    ApiError::invalid(
        format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
            open.join(", ")
        ),
        Some("messages"),
        None,
    )
}

pub(crate) struct Envelope<'a> {
    id: String,
    created: u64,
    model: &'a str,
    /// A step's `usage`, sent instead of the estimate.
    usage: Option<Value>,
}

impl Envelope<'_> {
    pub(crate) fn new(model: &str) -> Envelope<'_> {
        Envelope {
            id: new_id("chatcmpl").replacen('_', "-", 1),
            created: unix_now(),
            model,
            usage: None,
        }
    }

    /// The answer reports `usage` (a step's) instead of the estimate.
    pub(crate) fn with_usage(mut self, usage: Option<Value>) -> Self {
        self.usage = usage;
        self
    }

    /// The step's usage, else the estimate.
    fn usage(&self, prompt_tokens: u64, completion_tokens: u64) -> Value {
        self.usage
            .clone()
            .unwrap_or_else(|| usage_json(prompt_tokens, completion_tokens))
    }

    fn base(&self, object: &str) -> Map<String, Value> {
        let mut map = Map::new();
        map.insert("id".into(), json!(self.id));
        map.insert("object".into(), json!(object));
        map.insert("created".into(), json!(self.created));
        map.insert("model".into(), json!(self.model));
        map.insert("system_fingerprint".into(), json!(SYSTEM_FINGERPRINT));
        map
    }
}

fn usage_json(prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

fn tool_calls_json(calls: &[(String, String, String)]) -> Value {
    calls
        .iter()
        .map(|(id, name, arguments)| {
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
        })
        .collect()
}

fn finish_reason(reply: &Reply, truncated: bool) -> &'static str {
    match reply {
        _ if truncated => "length",
        Reply::ToolCalls(_) => "tool_calls",
        Reply::Answer(_) | Reply::Refusal(_) => "stop",
    }
}

/// The non-streaming `chat.completion` body.
pub(crate) fn completion_body(
    envelope: &Envelope<'_>,
    reply: &Reply,
    prompt_tokens: u64,
    truncated: bool,
) -> Value {
    let message = match reply {
        Reply::Answer(text) => json!({"role": "assistant", "content": text, "refusal": null}),
        Reply::Refusal(text) => json!({"role": "assistant", "content": null, "refusal": text}),
        Reply::ToolCalls(calls) => {
            json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": tool_calls_json(calls)})
        }
    };
    let mut body = envelope.base("chat.completion");
    body.insert(
        "choices".into(),
        json!([{"index": 0, "message": message, "logprobs": null,
            "finish_reason": finish_reason(reply, truncated)}]),
    );
    body.insert(
        "usage".into(),
        envelope.usage(prompt_tokens, estimate_tokens(reply_chars(reply))),
    );
    Value::Object(body)
}

/// The frames of a streamed chat completion, `data: [DONE]` included.
pub(crate) fn stream_pieces(
    envelope: &Envelope<'_>,
    reply: &Reply,
    prompt_tokens: u64,
    include_usage: bool,
    truncated: bool,
) -> Vec<Piece> {
    let chunk = |delta: Value, finish_reason: Option<&str>| {
        let mut body = envelope.base("chat.completion.chunk");
        body.insert(
            "choices".into(),
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]),
        );
        // With include_usage OpenAI puts `"usage": null` on every chunk but
        // the last; clients must cope with that.
        if include_usage {
            body.insert("usage".into(), Value::Null);
        }
        Value::Object(body).to_string()
    };
    let piece = |tag: Tag, payload: String| Piece {
        tag,
        frame: Bytes::from(format!("data: {payload}\n\n")),
    };
    let mut pieces = Vec::new();
    match reply {
        Reply::Answer(text) => {
            pieces.push(piece(
                Tag::Other,
                chunk(
                    json!({"role": "assistant", "content": "", "refusal": null}),
                    None,
                ),
            ));
            for part in answer_pieces(text) {
                pieces.push(piece(Tag::Text, chunk(json!({"content": part}), None)));
            }
        }
        Reply::Refusal(text) => {
            pieces.push(piece(
                Tag::Other,
                chunk(
                    json!({"role": "assistant", "content": null, "refusal": ""}),
                    None,
                ),
            ));
            for part in answer_pieces(text) {
                pieces.push(piece(Tag::Text, chunk(json!({"refusal": part}), None)));
            }
        }
        Reply::ToolCalls(calls) => {
            pieces.push(piece(
                Tag::Other,
                chunk(json!({"role": "assistant", "content": null}), None),
            ));
            for (index, (id, name, arguments)) in calls.iter().enumerate() {
                pieces.push(piece(
                    Tag::CallHead(index),
                    chunk(
                        json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}),
                        None,
                    ),
                ));
                for fragment in fragments(arguments, ARGUMENT_FRAGMENT_CHARS) {
                    pieces.push(piece(
                        Tag::CallArgs { call: index },
                        chunk(
                            json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
                            None,
                        ),
                    ));
                }
            }
        }
    }
    pieces.push(piece(
        Tag::Other,
        chunk(json!({}), Some(finish_reason(reply, truncated))),
    ));
    if include_usage {
        let mut body = envelope.base("chat.completion.chunk");
        body.insert("choices".into(), json!([]));
        body.insert(
            "usage".into(),
            envelope.usage(prompt_tokens, estimate_tokens(reply_chars(reply))),
        );
        pieces.push(piece(Tag::Other, Value::Object(body).to_string()));
    }
    pieces.push(piece(Tag::Other, "[DONE]".to_owned()));
    pieces
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;
    use crate::DEFAULT_MODEL;
    use crate::test_support::*;

    #[test]
    fn request_checks_match_the_real_api() {
        let err = |body: Value| read_request(&body).expect_err("must be rejected");
        let e = err(json!([1]));
        assert_eq!(e.code, Some("invalid_json"));
        let e = err(json!({"messages": [user("x")]}));
        assert_eq!(
            (e.code, e.param.as_deref()),
            (Some("missing_required_parameter"), Some("model"))
        );
        let e = err(json!({"model": "m"}));
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err(json!({"model": "m", "messages": []}));
        assert_eq!(e.code, Some("empty_array"));
        let e = err(json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}));
        assert_eq!(
            (e.code, e.param.as_deref()),
            (Some("invalid_value"), Some("messages[0].role"))
        );
        let e = err(json!({"model": "m", "messages": [user("x"), tool("nope", "r")]}));
        assert!(
            e.message
                .contains("must be a response to a preceeding message")
        );
        let e = err(json!({"model": "m", "messages": [
            user("x"), assistant_calls(&[("a", "f"), ("b", "g")]), tool("a", "r"), user("y")
        ]}));
        assert!(
            e.message.contains("did not have response messages: b"),
            "{}",
            e.message
        );
        let e = err(json!({"model": "m", "messages": [user("x"), assistant_calls(&[("a", "f")])]}));
        assert!(e.message.contains(": a"), "{}", e.message);
        assert!(e.status == StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn streams_parallel_tool_calls_the_way_openai_does() {
        let (server, client) = start(TWO_ROUNDS).await;
        let body = json!({
            "model": "whatever", "stream": true, "stream_options": {"include_usage": true},
            "messages": [user("loop")],
        });
        let script = r#"{"rules": [{"whenUserContains": ["both"], "steps": [{"toolCalls": [
            {"name": "current_datetime", "arguments": {}},
            {"name": "search_data_sources", "arguments": {"query": "how lighthouses warn ships", "topK": 3}}
        ]}]}]}"#;
        let (parallel, _) = start(script).await;
        let mut body2 = body.clone();
        body2["messages"] = json!([user("use both")]);
        let (status, content_type, text) = post(&client, &parallel, body2.to_string()).await;
        assert_eq!(status, 200);
        assert_eq!(content_type, "text/event-stream");
        let chunks: Vec<Value> = payloads(&text)
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str(p).expect("chunk JSON"))
            .collect();
        for chunk in &chunks {
            assert_eq!(chunk["object"], json!("chat.completion.chunk"));
            assert_eq!(chunk["model"], json!(DEFAULT_MODEL));
            assert_eq!(chunk["system_fingerprint"], json!(SYSTEM_FINGERPRINT));
            assert_eq!(chunk["id"], chunks[0]["id"], "one id per completion");
        }
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], json!("assistant"));
        let mut per_call: Vec<Vec<&Value>> = vec![Vec::new(), Vec::new()];
        for chunk in &chunks[1..chunks.len() - 2] {
            let call = &chunk["choices"][0]["delta"]["tool_calls"][0];
            let index = call["index"].as_u64().expect("index") as usize;
            per_call[index].push(call);
        }
        let mut ids = Vec::new();
        for (calls, (name, args)) in per_call.iter().zip([
            ("current_datetime", json!({})),
            (
                "search_data_sources",
                json!({"query": "how lighthouses warn ships", "topK": 3}),
            ),
        ]) {
            let head = calls[0];
            assert_eq!(head["type"], json!("function"));
            assert_eq!(head["function"]["name"], json!(name));
            assert_eq!(head["function"]["arguments"], json!(""));
            let id = head["id"].as_str().expect("id");
            assert!(id.starts_with("call_") && id.len() == 29, "{id}");
            ids.push(id.to_owned());
            let mut arguments = String::new();
            for fragment in &calls[1..] {
                let keys: Vec<&String> = fragment.as_object().expect("object").keys().collect();
                assert_eq!(keys, ["function", "index"], "fragments carry only index");
                assert_eq!(fragment["function"].as_object().map(|f| f.len()), Some(1));
                arguments.push_str(fragment["function"]["arguments"].as_str().expect("text"));
            }
            let parsed: Value = serde_json::from_str(&arguments).expect("arguments JSON");
            assert_eq!(parsed, args);
        }
        assert!(
            per_call[1].len() > 3,
            "long arguments are split over chunks"
        );
        assert_ne!(ids[0], ids[1]);
        let finish = &chunks[chunks.len() - 2];
        assert_eq!(finish["choices"][0]["finish_reason"], json!("tool_calls"));
        assert_eq!(finish["usage"], Value::Null);
        let usage = &chunks[chunks.len() - 1];
        assert_eq!(usage["choices"], json!([]));
        let usage = &usage["usage"];
        assert!(usage["prompt_tokens"].as_u64().is_some_and(|n| n > 0));
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(
                usage["prompt_tokens"].as_u64().unwrap_or(0)
                    + usage["completion_tokens"].as_u64().unwrap_or(0)
            )
        );

        // Without include_usage there is no usage chunk; `loop` on the other
        // server gets tool calls for `f` with `{}`.
        let mut no_usage = body.clone();
        no_usage
            .as_object_mut()
            .expect("object")
            .remove("stream_options");
        let (_, _, text) = post(&client, &server, no_usage.to_string()).await;
        let frames = payloads(&text);
        let last: Value = serde_json::from_str(&frames[frames.len() - 2]).expect("json");
        assert_eq!(last["choices"][0]["finish_reason"], json!("tool_calls"));
        assert!(last.get("usage").is_none());

        within(server.shutdown()).await;
        within(parallel.shutdown()).await;
    }

    #[tokio::test]
    async fn answers_stream_in_small_pieces_and_as_one_body() {
        let (server, client) = start(TWO_ROUNDS).await;
        let messages = json!([
            user("two please"),
            assistant_calls(&[("a", "f")]),
            tool("a", "one"),
            assistant_calls(&[("b", "g")]),
            tool("b", "two"),
        ]);
        let body = json!({"model": "m", "stream": true, "messages": messages});
        let (_, _, text) = post(&client, &server, body.to_string()).await;
        let pieces: Vec<String> = payloads(&text)
            .iter()
            .filter(|p| *p != "[DONE]")
            .filter_map(|p| {
                let chunk: Value = serde_json::from_str(p).expect("json");
                chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        // The first chunk opens the message; then a few words per chunk.
        assert_eq!(pieces, ["", "f said one, ", "g said two"]);

        let body = json!({"model": "m", "messages": messages});
        let (status, content_type, text) = post(&client, &server, body.to_string()).await;
        assert_eq!((status, content_type.as_str()), (200, "application/json"));
        let completion: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(completion["object"], json!("chat.completion"));
        assert_eq!(completion["system_fingerprint"], json!(SYSTEM_FINGERPRINT));
        assert_eq!(
            completion["choices"][0]["message"]["content"],
            json!("f said one, g said two")
        );
        assert_eq!(completion["choices"][0]["finish_reason"], json!("stop"));
        assert!(
            completion["usage"]["completion_tokens"]
                .as_u64()
                .is_some_and(|n| n > 0)
        );

        let body = json!({"model": "m", "messages": [user("two")]});
        let (_, _, text) = post(&client, &server, body.to_string()).await;
        let completion: Value = serde_json::from_str(&text).expect("json");
        let message = &completion["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            json!("{\"n\":1}")
        );
        assert_eq!(
            completion["choices"][0]["finish_reason"],
            json!("tool_calls")
        );
        assert_eq!(server.requests().len(), 3);
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn chat_refusals_stream_as_refusal_deltas() {
        let (server, client) = start(RESPONSES).await;
        let body = json!({"model": "m", "stream": true, "messages": [user("refuse please")]});
        let (_, _, text, _) = send(&client, &server, "chat/completions", &body).await;
        let chunks: Vec<Value> = payloads(&text)
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str(p).expect("chunk"))
            .collect();
        let refusal: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["refusal"].as_str())
            .collect();
        assert_eq!(refusal, "I can't help with that.");
        assert!(chunks.iter().all(|c| {
            c["choices"][0]["delta"]
                .get("content")
                .is_none_or(Value::is_null)
        }));
        assert_eq!(
            chunks.last().expect("chunks")["choices"][0]["finish_reason"],
            json!("stop")
        );
        within(server.shutdown()).await;
    }
}
