//! The Responses API (`POST /v1/responses`): a request's `instructions`
//! and `input` items read into turns (with the real API's checks), and the
//! reply as one response object or as streamed events, each framed as
//! `event: <type>` + `data: <json>`: `response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.output_text.delta`, `response.function_call_arguments.delta` /
//! `.done`, `response.output_item.done`, then `response.completed` or
//! `response.incomplete`. There is no `[DONE]`; usage is always reported in
//! the terminal event.
//!
//! # Request checks of its own
//!
//! Besides the checks in `request`, it answers, with code `null`:
//!
//! - 400 `Encrypted content is not supported with this model.` (`param`
//!   `include`) when `include` lists `reasoning.encrypted_content` and the
//!   script is not a reasoning model (`reasoningModel`): what OpenAI answers
//!   for gpt-4o, gpt-4o-mini and the like;
//! - 404 `Item with id '..' not found. Items are not persisted when
//!   `store` is set to false. ..` (`param` `input`) for a `reasoning` input
//!   item without `encrypted_content` in a `store: false` request: such an
//!   item is a bare reference to state the provider never kept.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::SYSTEM_FINGERPRINT;
use crate::reply::{Reply, estimate_tokens, new_id, reply_chars, unix_now};
use crate::request::{ApiError, Turn, content_text, request_object};
use crate::script::Script;
use crate::sse::{ARGUMENT_FRAGMENT_CHARS, Piece, Tag, answer_pieces, fragments};

/// Reasoning tokens reported for a step with `"reasoning": true`.
const REASONING_TOKENS: u64 = 16;

/// What a `malformedChunk` fault sends: an event whose `data:` is not JSON.
pub(crate) const MALFORMED_EVENT: &str = "event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\", \"delta\": scripted malformed chunk\n\n";

/// What a Responses request lists in `include`.
const ENCRYPTED_REASONING: &str = "reasoning.encrypted_content";

/// Whether a Responses request's `include` lists `what`.
fn includes(request: &Value, what: &str) -> bool {
    request
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|list| list.iter().any(|v| v.as_str() == Some(what)))
}

/// What the real API refuses depending on the model: encrypted reasoning
/// for a model that does not reason.
pub(crate) fn check_model_support(script: &Script, request: &Value) -> Result<(), ApiError> {
    if includes(request, ENCRYPTED_REASONING) && !script.is_reasoning_model() {
        return Err(ApiError::invalid(
            "Encrypted content is not supported with this model.",
            Some("include"),
            None,
        ));
    }
    Ok(())
}

/// Checks a Responses API request the way the real API would and extracts
/// its turns: `instructions` becomes a system turn, message items keep
/// their role, consecutive `function_call` items form one assistant turn
/// with calls (joined to an assistant message right before them), and
/// `function_call_output` items become tool turns. Reasoning items are
/// skipped, once checked to be replayable: in a `store: false` request
/// only with their `encrypted_content`.
pub(crate) fn read_request(body: &Value) -> Result<Vec<Turn>, ApiError> {
    let object = request_object(body)?;
    let mut turns = Vec::new();
    if let Some(instructions) = object.get("instructions").and_then(Value::as_str) {
        turns.push(Turn::text("system", instructions.to_owned()));
    }
    let items = match object.get("input") {
        Some(Value::String(text)) if !text.is_empty() => {
            turns.push(Turn::text("user", text.clone()));
            return Ok(turns);
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_) | Value::String(_)) => {
            return Err(ApiError::invalid(
                "Invalid 'input': empty array. Expected an array with minimum length 1.",
                Some("input"),
                Some("empty_array"),
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'input'.",
                Some("input"),
                Some("missing_required_parameter"),
            ));
        }
    };
    // Omitted, `store` is true: items are kept, and any id would be found.
    let stateless = object.get("store") == Some(&Value::Bool(false));
    for (i, item) in items.iter().enumerate() {
        read_item(&mut turns, i, item, stateless)?;
    }
    check_call_outputs(&turns)?;
    Ok(turns)
}

/// Adds input item number `i` to `turns`, or says why the real API would
/// refuse it.
fn read_item(
    turns: &mut Vec<Turn>,
    i: usize,
    item: &Value,
    stateless: bool,
) -> Result<(), ApiError> {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
    let kind = item
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| item.get("role").map(|_| "message"))
        .unwrap_or_default();
    let required = |field: &str| {
        text(item.get(field)).ok_or_else(|| {
            ApiError::invalid(
                format!("Missing required parameter: 'input[{i}].{field}'."),
                Some(&format!("input[{i}].{field}")),
                Some("missing_required_parameter"),
            )
        })
    };
    match kind {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
            if !matches!(role, "system" | "developer" | "user" | "assistant") {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid value: '{role}'. Supported values are: 'assistant', 'system', 'developer', and 'user'."
                    ),
                    Some(&format!("input[{i}].role")),
                    Some("invalid_value"),
                ));
            }
            turns.push(Turn::text(role, content_text(item.get("content"))));
        }
        "function_call" => {
            let call = (required("call_id")?, required("name")?);
            required("arguments")?;
            match turns.last_mut() {
                Some(last) if last.role == "assistant" => last.calls.push(call),
                _ => turns.push(Turn {
                    role: "assistant".to_owned(),
                    text: String::new(),
                    calls: vec![call],
                    call_id: None,
                }),
            }
        }
        "function_call_output" => {
            let call_id = required("call_id")?;
            turns.push(Turn {
                role: "tool".to_owned(),
                text: content_text(item.get("output")),
                calls: Vec::new(),
                call_id: Some(call_id),
            });
        }
        "reasoning" => check_reasoning_item(item, stateless)?,
        other => {
            return Err(ApiError::invalid(
                format!(
                    "Invalid value: '{other}'. Supported values are: 'message', 'function_call', 'function_call_output' and 'reasoning'."
                ),
                Some(&format!("input[{i}].type")),
                Some("invalid_value"),
            ));
        }
    }
    Ok(())
}

/// A reasoning item in a stateless request is only replayable with its
/// `encrypted_content`; without it, it names state the provider never kept.
fn check_reasoning_item(item: &Value, stateless: bool) -> Result<(), ApiError> {
    let encrypted = item.get("encrypted_content").is_some_and(Value::is_string);
    if stateless && !encrypted {
        let id = item.get("id").and_then(Value::as_str).unwrap_or_default();
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "Item with id '{id}' not found. Items are not persisted when `store` is set to false. Try again with `store` set to true, or remove this item from your input."
            ),
            param: Some("input".to_owned()),
            code: None,
        });
    }
    Ok(())
}

/// Responses pairing, as the real API words it: every output answers an
/// earlier call, and every call has an output.
fn check_call_outputs(turns: &[Turn]) -> Result<(), ApiError> {
    let mut open: Vec<&str> = Vec::new();
    for turn in turns {
        open.extend(turn.calls.iter().map(|(id, _)| id.as_str()));
        if let Some(id) = turn.call_id.as_deref() {
            match open.iter().position(|c| *c == id) {
                Some(p) => {
                    open.remove(p);
                }
                None => {
                    return Err(ApiError::invalid(
                        format!("No tool call found for function call output with call_id {id}."),
                        Some("input"),
                        None,
                    ));
                }
            }
        }
    }
    match open.first() {
        Some(id) => Err(ApiError::invalid(
            format!("No tool output found for function call {id}."),
            Some("input"),
            None,
        )),
        None => Ok(()),
    }
}

/// What a Responses answer is made of, before it is put in wire form.
enum OutItem {
    Reasoning {
        id: String,
        /// The request asked for `reasoning.encrypted_content`.
        encrypted: bool,
    },
    Message {
        id: String,
        text: String,
        refusal: bool,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

impl OutItem {
    /// The output items of `reply`, after a reasoning item when
    /// `reasoning` is `Some(encrypted)`.
    fn list(reply: &Reply, reasoning: Option<bool>) -> Vec<Self> {
        let mut items = Vec::new();
        if let Some(encrypted) = reasoning {
            items.push(Self::Reasoning {
                id: new_id("rs"),
                encrypted,
            });
        }
        match reply {
            Reply::Answer(text) | Reply::Refusal(text) => items.push(Self::Message {
                id: new_id("msg"),
                text: text.clone(),
                refusal: matches!(reply, Reply::Refusal(_)),
            }),
            Reply::ToolCalls(calls) => {
                items.extend(calls.iter().map(|(call_id, name, arguments)| Self::Call {
                    id: new_id("fc"),
                    call_id: call_id.clone(),
                    name: name.clone(),
                    arguments: arguments.clone(),
                }));
            }
        }
        items
    }

    fn id(&self) -> &str {
        match self {
            Self::Reasoning { id, .. } | Self::Message { id, .. } | Self::Call { id, .. } => id,
        }
    }

    fn content_part(text: &str, refusal: bool) -> Value {
        if refusal {
            json!({"type": "refusal", "refusal": text})
        } else {
            json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
        }
    }

    /// The item as `response.output_item.added` shows it: nothing
    /// generated yet.
    fn started(&self) -> Value {
        match self {
            Self::Reasoning { .. } => self.finished("completed"),
            Self::Message { id, .. } => json!({
                "id": id, "type": "message", "status": "in_progress",
                "content": [], "role": "assistant"
            }),
            Self::Call {
                id, call_id, name, ..
            } => json!({
                "id": id, "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call_id, "name": name
            }),
        }
    }

    /// The item as `response.output_item.done` and the final `output`
    /// show it.
    fn finished(&self, status: &str) -> Value {
        match self {
            Self::Reasoning { id, encrypted } => {
                let mut item = json!({"id": id, "type": "reasoning", "summary": []});
                if *encrypted {
                    item["encrypted_content"] =
                        json!(format!("toolfleet-scripted-stand-in-reasoning:{id}"));
                }
                item
            }
            Self::Message { id, text, refusal } => json!({
                "id": id, "type": "message", "status": status,
                "content": [Self::content_part(text, *refusal)], "role": "assistant"
            }),
            Self::Call {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "id": id, "type": "function_call", "status": status,
                "arguments": arguments, "call_id": call_id, "name": name
            }),
        }
    }
}

/// A Responses answer: the response object around the output items.
pub(crate) struct Envelope<'a> {
    id: String,
    created_at: u64,
    model: &'a str,
    /// Echoed back the way the real API echoes request parameters.
    request: &'a Value,
    /// A step's `usage`, sent instead of the estimate.
    usage: Option<Value>,
}

impl<'a> Envelope<'a> {
    pub(crate) fn new(model: &'a str, request: &'a Value) -> Self {
        Self {
            id: new_id("resp"),
            created_at: unix_now(),
            model,
            request,
            usage: None,
        }
    }

    /// The answer reports `usage` (a step's) instead of the estimate.
    pub(crate) fn with_usage(mut self, usage: Option<Value>) -> Self {
        self.usage = usage;
        self
    }

    /// The output items of `reply`, a reasoning item first when the step
    /// reasons (with its encrypted content if the request asked for it).
    fn items(&self, reply: &Reply, reasoning: bool) -> Vec<OutItem> {
        let encrypted = includes(self.request, ENCRYPTED_REASONING);
        OutItem::list(reply, reasoning.then_some(encrypted))
    }

    fn response(&self, status: &str, output: Vec<Value>, usage: Option<Value>) -> Value {
        // A step's own usage replaces the estimate where one is reported.
        let usage = usage.map(|estimate| self.usage.clone().unwrap_or(estimate));
        let echo = |key: &str, default: Value| {
            self.request
                .get(key)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(default)
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": if status == "incomplete" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            "instructions": echo("instructions", Value::Null),
            "max_output_tokens": echo("max_output_tokens", Value::Null),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": echo("parallel_tool_calls", json!(true)),
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": echo("store", json!(true)),
            "temperature": echo("temperature", json!(1.0)),
            "text": {"format": {"type": "text"}},
            "tool_choice": echo("tool_choice", json!("auto")),
            "tools": echo("tools", json!([])),
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
            "system_fingerprint": SYSTEM_FINGERPRINT,
        })
    }
}

fn usage(prompt_tokens: u64, reply: &Reply, reasoning: bool) -> Value {
    let reasoning_tokens = if reasoning { REASONING_TOKENS } else { 0 };
    let output_tokens = estimate_tokens(reply_chars(reply)) + reasoning_tokens;
    json!({
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    })
}

/// The whole non-streaming response object.
pub(crate) fn body(
    envelope: &Envelope<'_>,
    reply: &Reply,
    reasoning: bool,
    prompt_tokens: u64,
    truncated: bool,
) -> Value {
    let status = if truncated { "incomplete" } else { "completed" };
    let output = envelope
        .items(reply, reasoning)
        .iter()
        .map(|item| item.finished(status))
        .collect();
    envelope.response(status, output, Some(usage(prompt_tokens, reply, reasoning)))
}

/// The events of a streamed response, each framed as `event: <type>` and
/// `data: <json>` with its `sequence_number`.
pub(crate) fn stream_pieces(
    envelope: &Envelope<'_>,
    reply: &Reply,
    reasoning: bool,
    prompt_tokens: u64,
    truncated: bool,
) -> Vec<Piece> {
    let status = if truncated { "incomplete" } else { "completed" };
    let items = envelope.items(reply, reasoning);
    let mut events = Events::default();
    let opening = envelope.response("in_progress", Vec::new(), None);
    events.push(
        Tag::Other,
        json!({"type": "response.created", "response": opening}),
    );
    events.push(
        Tag::Other,
        json!({"type": "response.in_progress", "response": opening}),
    );
    let mut call_number = 0;
    for (output_index, item) in items.iter().enumerate() {
        let item_id = item.id();
        let head_tag = match item {
            OutItem::Call { .. } => Tag::CallHead(call_number),
            _ => Tag::Other,
        };
        events.push(
            head_tag,
            json!({"type": "response.output_item.added", "output_index": output_index, "item": item.started()}),
        );
        match item {
            OutItem::Reasoning { .. } => {}
            OutItem::Message { text, refusal, .. } => {
                events.message(item_id, output_index, text, *refusal);
            }
            OutItem::Call { arguments, .. } => {
                events.call_arguments(item_id, output_index, arguments, call_number);
                call_number += 1;
            }
        }
        events.push(
            Tag::Other,
            json!({"type": "response.output_item.done", "output_index": output_index,
                "item": item.finished(status)}),
        );
    }
    let output = items.iter().map(|item| item.finished(status)).collect();
    let usage = usage(prompt_tokens, reply, reasoning);
    let terminal = if truncated {
        "response.incomplete"
    } else {
        "response.completed"
    };
    events.push(
        Tag::Other,
        json!({"type": terminal, "response": envelope.response(status, output, Some(usage))}),
    );
    events.framed()
}

/// The events of a streamed response so far, each with where it sits in
/// the answer (so faults can cut at the right place).
#[derive(Default)]
struct Events(Vec<(Tag, Value)>);

impl Events {
    fn push(&mut self, tag: Tag, event: Value) {
        self.0.push((tag, event));
    }

    /// A message item's one content part: added, streamed a few words at
    /// a time, done.
    fn message(&mut self, item_id: &str, output_index: usize, text: &str, refusal: bool) {
        let (delta_type, done_type, done_key) = if refusal {
            ("response.refusal.delta", "response.refusal.done", "refusal")
        } else {
            (
                "response.output_text.delta",
                "response.output_text.done",
                "text",
            )
        };
        self.push(
            Tag::Other,
            json!({"type": "response.content_part.added", "item_id": item_id,
                "output_index": output_index, "content_index": 0,
                "part": OutItem::content_part("", refusal)}),
        );
        for part in answer_pieces(text) {
            self.push(
                Tag::Text,
                json!({"type": delta_type, "item_id": item_id, "output_index": output_index,
                    "content_index": 0, "delta": part}),
            );
        }
        self.push(
            Tag::Other,
            json!({"type": done_type, "item_id": item_id, "output_index": output_index,
                "content_index": 0, done_key: text}),
        );
        self.push(
            Tag::Other,
            json!({"type": "response.content_part.done", "item_id": item_id,
                "output_index": output_index, "content_index": 0,
                "part": OutItem::content_part(text, refusal)}),
        );
    }

    /// The arguments of call number `call`, streamed in fragments.
    fn call_arguments(&mut self, item_id: &str, output_index: usize, arguments: &str, call: usize) {
        for fragment in fragments(arguments, ARGUMENT_FRAGMENT_CHARS) {
            self.push(
                Tag::CallArgs { call },
                json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                    "output_index": output_index, "delta": fragment}),
            );
        }
        self.push(
            Tag::Other,
            json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                "output_index": output_index, "arguments": arguments}),
        );
    }

    /// Every event in wire form, numbered by its `sequence_number`.
    fn framed(self) -> Vec<Piece> {
        self.0
            .into_iter()
            .enumerate()
            .map(|(sequence, (tag, mut event))| {
                let kind = event["type"].as_str().unwrap_or_default().to_owned();
                event["sequence_number"] = json!(sequence);
                Piece {
                    tag,
                    frame: Bytes::from(format!("event: {kind}\ndata: {event}\n\n")),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;

    #[tokio::test]
    async fn responses_stream_events_the_way_openai_does() {
        let (server, client) = start(RESPONSES).await;
        let body = json!({"model": "m", "stream": true, "instructions": "be brief",
            "include": ["reasoning.encrypted_content"],
            "input": [{"role": "user", "content": "weather in Paris?"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {}}]});
        let (status, headers, text, broken) = send(&client, &server, "responses", &body).await;
        assert_eq!(status, 200);
        assert!(!broken);
        assert_eq!(headers["content-type"], "text/event-stream");
        assert!(!text.contains("[DONE]"), "the Responses API has no [DONE]");
        let events = response_events(&text);
        let sequence: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().expect("sequence_number"))
            .collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
        assert_eq!(events[0]["type"], json!("response.created"));
        assert_eq!(events[0]["response"]["status"], json!("in_progress"));
        assert_eq!(events[0]["response"]["instructions"], json!("be brief"));
        assert_eq!(events[0]["response"]["tools"], body["tools"], "echoed");
        assert_eq!(events[1]["type"], json!("response.in_progress"));

        let added = of_type(&events, "response.output_item.added");
        let kinds: Vec<(&Value, &Value)> = added
            .iter()
            .map(|e| (&e["output_index"], &e["item"]["type"]))
            .collect();
        assert_eq!(
            kinds,
            [
                (&json!(0), &json!("reasoning")),
                (&json!(1), &json!("function_call")),
                (&json!(2), &json!("function_call"))
            ],
            "the reasoning item comes first"
        );
        for (call, (name, arguments)) in added[1..].iter().zip([
            ("get_weather", r#"{"city":"Paris","units":"metric"}"#),
            ("lookup", "{}"),
        ]) {
            let item = &call["item"];
            assert_eq!(item["name"], json!(name));
            assert_eq!(item["arguments"], json!(""));
            assert_eq!(item["status"], json!("in_progress"));
            let id = item["id"].as_str().expect("item id");
            assert!(id.starts_with("fc_"), "{id}");
            assert!(
                item["call_id"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("call_"))
            );
            let deltas: String = of_type(&events, "response.function_call_arguments.delta")
                .iter()
                .filter(|d| d["item_id"] == id)
                .map(|d| d["delta"].as_str().expect("delta"))
                .collect();
            assert_eq!(deltas, arguments);
            let done = of_type(&events, "response.function_call_arguments.done");
            assert!(
                done.iter()
                    .any(|d| d["item_id"] == id && d["arguments"] == arguments)
            );
        }
        let last = events.last().expect("events");
        assert_eq!(last["type"], json!("response.completed"));
        let response = &last["response"];
        assert_eq!(response["status"], json!("completed"));
        assert_eq!(response["system_fingerprint"], json!(SYSTEM_FINGERPRINT));
        assert_eq!(response["output"].as_array().map(Vec::len), Some(3));
        assert!(
            response["output"][0]["encrypted_content"]
                .as_str()
                .is_some_and(|c| c.contains("stand-in"))
        );
        assert_eq!(response["output"][1]["status"], json!("completed"));
        let usage = &response["usage"];
        assert_eq!(
            usage["output_tokens_details"]["reasoning_tokens"],
            json!(REASONING_TOKENS)
        );
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(
                usage["input_tokens"].as_u64().unwrap_or(0)
                    + usage["output_tokens"].as_u64().unwrap_or(0)
            )
        );

        // The second round, with the reasoning item replayed and the
        // outputs correlated by call_id, gets the answer.
        let calls: Vec<&Value> = response["output"].as_array().expect("output")[1..]
            .iter()
            .collect();
        let round_two = json!({"model": "m", "stream": true, "input": [
            {"role": "user", "content": "weather in Paris?"},
            response["output"][0],
            {"type": "function_call", "call_id": calls[0]["call_id"], "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": calls[1]["call_id"], "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny"},
            {"type": "function_call_output", "call_id": calls[1]["call_id"], "output": [{"type": "input_text", "text": "dry"}]},
        ]});
        let (_, _, text, _) = send(&client, &server, "responses", &round_two).await;
        let events = response_events(&text);
        let deltas: String = of_type(&events, "response.output_text.delta")
            .iter()
            .map(|d| d["delta"].as_str().expect("delta"))
            .collect();
        assert_eq!(deltas, "It is sunny (dry)");
        assert!(of_type(&events, "response.output_text.delta").len() > 1);
        let done = of_type(&events, "response.output_item.done");
        assert_eq!(
            done[0]["item"]["content"][0]["text"],
            json!("It is sunny (dry)")
        );
        assert_eq!(of_type(&events, "response.content_part.added").len(), 1);
        within(server.shutdown()).await;
    }

    /// OpenAI's rule: only a reasoning model may be asked for its encrypted
    /// reasoning, and with `store: false` a reasoning item is only worth
    /// replaying with it.
    #[tokio::test]
    async fn encrypted_reasoning_is_for_reasoning_models_only() {
        let ask = |include: bool, store: Option<bool>| {
            let mut body = json!({"model": "m", "input": "weather?"});
            if include {
                body["include"] = json!(["reasoning.encrypted_content"]);
            }
            if let Some(store) = store {
                body["store"] = json!(store);
            }
            body
        };

        // Not a reasoning model: refused with the real API's error, and
        // recorded like every request.
        let (server, client) = start(r#"{"default": {"steps": [{"answer": "hi"}]}}"#).await;
        for stream in [false, true] {
            let mut body = ask(true, Some(false));
            body["stream"] = json!(stream);
            let (status, _, text, _) = send(&client, &server, "responses", &body).await;
            assert_eq!(status, 400, "{text}");
            let error: Value = serde_json::from_str(&text).expect("json");
            assert_eq!(
                error,
                json!({"error": {
                    "message": "Encrypted content is not supported with this model.",
                    "type": "invalid_request_error",
                    "param": "include",
                    "code": null,
                }})
            );
        }
        let (status, _, _, _) = send(&client, &server, "responses", &ask(false, Some(false))).await;
        assert_eq!(status, 200, "the same request without `include`");
        let received = server.received();
        assert_eq!(received.len(), 3);
        assert_eq!(
            received[0].body["include"],
            json!(["reasoning.encrypted_content"])
        );
        within(server.shutdown()).await;

        // A reasoning model: the reasoning item carries its encrypted
        // content only when asked for it.
        let (server, client) = start(RESPONSES).await;
        let output = |text: &str| -> Vec<Value> {
            let response: Value = serde_json::from_str(text).expect("json");
            response["output"].as_array().expect("output").clone()
        };
        let (status, _, text, _) =
            send(&client, &server, "responses", &ask(true, Some(false))).await;
        assert_eq!(status, 200, "{text}");
        let whole = output(&text);
        assert_eq!(whole[0]["type"], json!("reasoning"));
        assert!(
            whole[0]["encrypted_content"]
                .as_str()
                .is_some_and(|c| c.contains("stand-in"))
        );
        let (status, _, text, _) =
            send(&client, &server, "responses", &ask(false, Some(false))).await;
        assert_eq!(status, 200, "{text}");
        let bare = output(&text);
        assert_eq!(bare[0]["type"], json!("reasoning"));
        assert!(bare[0].get("encrypted_content").is_none(), "{}", bare[0]);

        // Replaying the round: a bare reasoning item is refused in a
        // stateless request, the whole one is not.
        let round_two = |calls: &[Value], store: Option<bool>| {
            let mut input = vec![
                json!({"role": "user", "content": "weather?"}),
                calls[0].clone(),
            ];
            for call in &calls[1..] {
                input.push(call.clone());
            }
            for call in &calls[1..] {
                input.push(json!({"type": "function_call_output",
                    "call_id": call["call_id"], "output": "sunny"}));
            }
            let mut body = json!({"model": "m", "input": input});
            if let Some(store) = store {
                body["store"] = json!(store);
            }
            body
        };
        let (status, _, text, _) = send(
            &client,
            &server,
            "responses",
            &round_two(&bare, Some(false)),
        )
        .await;
        assert_eq!(status, 404, "{text}");
        let error: Value = serde_json::from_str(&text).expect("json");
        let id = bare[0]["id"].as_str().expect("id");
        assert_eq!(error["error"]["param"], json!("input"));
        assert_eq!(error["error"]["code"], json!(null));
        assert_eq!(
            error["error"]["message"],
            json!(format!(
                "Item with id '{id}' not found. Items are not persisted when `store` is set to false. Try again with `store` set to true, or remove this item from your input."
            ))
        );
        for (calls, store) in [(&whole, Some(false)), (&bare, None), (&whole, None)] {
            let (status, _, text, _) =
                send(&client, &server, "responses", &round_two(calls, store)).await;
            assert_eq!(status, 200, "{store:?}: {text}");
            assert!(text.contains("It is sunny"), "{text}");
        }
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn responses_answer_without_streaming_and_check_requests() {
        let (server, client) = start(RESPONSES).await;
        let body = json!({"model": "m", "input": "weather?"});
        let (status, headers, text, _) = send(&client, &server, "responses", &body).await;
        assert_eq!(status, 200);
        assert_eq!(headers["content-type"], "application/json");
        let response: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(response["object"], json!("response"));
        assert_eq!(response["status"], json!("completed"));
        let types: Vec<&Value> = response["output"]
            .as_array()
            .expect("output")
            .iter()
            .map(|i| &i["type"])
            .collect();
        assert_eq!(
            types,
            [
                &json!("reasoning"),
                &json!("function_call"),
                &json!("function_call")
            ]
        );

        let (_, _, text, _) = send(
            &client,
            &server,
            "responses",
            &json!({"model": "m", "input": "please refuse"}),
        )
        .await;
        let response: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(
            response["output"][0]["content"][0],
            json!({"type": "refusal", "refusal": "I can't help with that."})
        );

        for (body, param, message) in [
            (
                json!({"model": "m"}),
                "input",
                "Missing required parameter: 'input'.",
            ),
            (json!({"model": "m", "input": []}), "input", "empty array"),
            (
                json!({"input": "x"}),
                "model",
                "Missing required parameter: 'model'.",
            ),
            (
                json!({"model": "m", "input": [{"type": "magic"}]}),
                "input[0].type",
                "Invalid value: 'magic'",
            ),
            (
                json!({"model": "m", "input": [{"role": "wizard", "content": "x"}]}),
                "input[0].role",
                "Invalid value: 'wizard'",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
                "Missing required parameter",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "nope", "output": "r"}]}),
                "input",
                "No tool call found for function call output with call_id nope.",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}),
                "input",
                "No tool output found for function call c1.",
            ),
        ] {
            let (status, _, text, _) = send(&client, &server, "responses", &body).await;
            assert_eq!(status, 400, "{body}");
            let error: Value = serde_json::from_str(&text).expect("json");
            assert_eq!(error["error"]["param"], json!(param), "{body}");
            assert!(
                error["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(message)),
                "{body}: {error}"
            );
        }
        within(server.shutdown()).await;
    }

    /// A step's `usage` goes out as it is, in both API shapes, streamed
    /// or not; other steps keep the estimate; one that is not an object
    /// is refused when the script is read.
    #[tokio::test]
    async fn a_step_reports_its_own_usage_instead_of_the_estimate() {
        let responses_usage = json!({"input_tokens": 2006, "input_tokens_details": {"cached_tokens": 1920},
            "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2036});
        let chat_usage = json!({"prompt_tokens": 2006, "completion_tokens": 30, "total_tokens": 2036,
            "prompt_tokens_details": {"cached_tokens": 1920}});
        let script = json!({"rules": [
            {"whenUserContains": ["responses"], "steps": [{"answer": "hi", "usage": responses_usage}]},
            {"whenUserContains": ["chat"], "steps": [{"answer": "hi", "usage": chat_usage}]}
        ]});
        let (server, client) = start(&script.to_string()).await;
        for stream in [true, false] {
            let body = json!({"model": "m", "stream": stream,
                "input": [{"role": "user", "content": "responses please"}]});
            let (status, _, text, _) = send(&client, &server, "responses", &body).await;
            assert_eq!(status, 200);
            let done = if stream {
                response_events(&text).pop().expect("events")["response"].clone()
            } else {
                serde_json::from_str(&text).expect("body")
            };
            assert_eq!(done["usage"], responses_usage, "stream: {stream}");
            let body = json!({"model": "m", "stream": stream, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "chat please"}]});
            let (status, _, text, _) = send(&client, &server, "chat/completions", &body).await;
            assert_eq!(status, 200);
            let usage = if stream {
                let last = payloads(&text)
                    .into_iter()
                    .rev()
                    .nth(1)
                    .expect("usage chunk");
                serde_json::from_str::<Value>(&last).expect("chunk")["usage"].clone()
            } else {
                serde_json::from_str::<Value>(&text).expect("body")["usage"].clone()
            };
            assert_eq!(usage, chat_usage, "stream: {stream}");
        }
        let body = json!({"model": "m", "input": [{"role": "user", "content": "other"}]});
        let (_, _, text, _) = send(&client, &server, "responses", &body).await;
        let estimate: Value = serde_json::from_str(&text).expect("body");
        assert_eq!(
            estimate["usage"]["input_tokens_details"]["cached_tokens"],
            0
        );
        let bad = json!({"rules": [{"whenUserContains": ["x"], "steps": [{"answer": "hi", "usage": 12}]}]});
        let e = Script::from_json(&bad.to_string()).expect_err("not an object");
        assert!(e.to_string().contains("usage must be a JSON object"), "{e}");
        within(server.shutdown()).await;
    }
}
