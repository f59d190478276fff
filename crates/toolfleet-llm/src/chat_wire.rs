//! The Chat Completions wire shape: private serde types for requests,
//! responses, stream chunks and error bodies, with `to_wire` / `from_wire`
//! conversions to the neutral types of [`super`], and the stream
//! accumulator that turns chunks back into one [`Completion`].
//!
//! Deserialisation is lenient on purpose: unknown fields are ignored and
//! almost every field may be missing or `null`, because "OpenAI-compatible"
//! servers differ in what they leave out. What we cannot do without (a tool
//! call's function name, a finish reason in a stream) is checked explicitly
//! so the error says what was missing.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    ChatRequest, Completion, FinishReason, LlmError, Message, ToolCall, ToolChoice, Usage,
};

// ---------------------------------------------------------------------------
// Request

#[derive(Debug, Serialize)]
pub(super) struct WireRequest<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    /// Sent as `max_tokens`, not `max_completion_tokens`: local servers
    /// (llama.cpp forks, older vLLM, Ollama) read only the older name, while
    /// OpenAI still accepts it for non-reasoning models.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'a str>,
    /// Requests sharing it share the provider's prompt cache (OpenAI);
    /// dropped for deployments that do not accept it
    /// ([`WireRequest::keep_prompt_cache_key`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_key: Option<&'a str>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

impl WireRequest<'_> {
    /// The request with its `prompt_cache_key` only when `keep` (the
    /// deployment accepts the field).
    #[must_use]
    pub(super) fn keep_prompt_cache_key(mut self, keep: bool) -> Self {
        if !keep {
            self.prompt_cache_key = None;
        }
        self
    }
}

#[derive(Debug, Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Debug, Serialize)]
#[serde(tag = "role", rename_all = "snake_case")]
enum WireMessage<'a> {
    System {
        content: &'a str,
    },
    User {
        content: &'a str,
    },
    Assistant {
        /// `null` is what OpenAI itself returns next to tool calls; an
        /// assistant message with neither is sent with `""` because the API
        /// rejects one that has nothing.
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<WireToolCallOut<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: &'a str,
    },
}

#[derive(Debug, Serialize)]
struct WireToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunctionOut<'a>,
}

#[derive(Debug, Serialize)]
struct WireFunctionOut<'a> {
    name: &'a str,
    arguments: &'a str,
}

/// The request body for `POST {base_url}/chat/completions`. The tools go
/// out in the order the request gives them: the caller keeps that order
/// stable from round to round (the orchestrator: the first round's tools
/// sorted by name, later additions after them), so the prompt's beginning
/// stays the same and the provider's prompt cache can serve it. Sorting
/// here would put a tool added mid-conversation among the others, and
/// every tool after it would miss the cache.
pub(super) fn to_wire(req: &ChatRequest, stream: bool) -> WireRequest<'_> {
    let has_tools = !req.tools.is_empty();
    WireRequest {
        model: &req.model,
        messages: req.messages.iter().map(message_to_wire).collect(),
        tools: req.tools.iter().map(|t| t.to_chat_completions()).collect(),
        // `tool_choice` and `parallel_tool_calls` are rejected by OpenAI
        // when no tools are sent, so they travel only with tools.
        tool_choice: req
            .tool_choice
            .as_ref()
            .filter(|_| has_tools)
            .map(tool_choice_to_wire),
        parallel_tool_calls: has_tools.then_some(req.parallel_tool_calls),
        temperature: req.temperature,
        max_tokens: req.max_tokens,
        service_tier: req.service_tier.as_deref(),
        prompt_cache_key: req.prompt_cache_key.as_deref(),
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
    }
}

/// `"auto"`, `"none"`, `"required"` or
/// `{"type":"function","function":{"name":..}}`.
fn tool_choice_to_wire(choice: &ToolChoice) -> Value {
    match choice {
        ToolChoice::Auto => Value::from("auto"),
        ToolChoice::None => Value::from("none"),
        ToolChoice::Required => Value::from("required"),
        ToolChoice::Function(name) => {
            serde_json::json!({"type": "function", "function": {"name": name}})
        }
    }
}

fn message_to_wire(message: &Message) -> WireMessage<'_> {
    match message {
        Message::System { content } => WireMessage::System { content },
        Message::User { content } => WireMessage::User { content },
        // `opaque` items belong to the Responses API; Chat Completions has
        // nowhere to put them.
        Message::Assistant {
            content,
            tool_calls,
            ..
        } => WireMessage::Assistant {
            content: match (content.as_deref(), tool_calls.is_empty()) {
                (None, true) => Some(""),
                (content, _) => content,
            },
            tool_calls: tool_calls
                .iter()
                .map(|call| WireToolCallOut {
                    id: &call.id,
                    kind: "function",
                    function: WireFunctionOut {
                        name: &call.name,
                        arguments: &call.arguments,
                    },
                })
                .collect(),
        },
        Message::Tool { call_id, content } => WireMessage::Tool {
            tool_call_id: call_id,
            content,
        },
    }
}

// ---------------------------------------------------------------------------
// Shared response pieces

#[derive(Debug, Default, Deserialize)]
struct WireUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    total_tokens: Option<u64>,
    prompt_tokens_details: Option<WirePromptDetails>,
    completion_tokens_details: Option<WireCompletionDetails>,
}

#[derive(Debug, Default, Deserialize)]
struct WirePromptDetails {
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct WireCompletionDetails {
    reasoning_tokens: Option<u64>,
}

impl From<WireUsage> for Usage {
    fn from(wire: WireUsage) -> Self {
        let prompt_tokens = wire.prompt_tokens.unwrap_or(0);
        let completion_tokens = wire.completion_tokens.unwrap_or(0);
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: wire
                .total_tokens
                .unwrap_or(prompt_tokens + completion_tokens),
            cached_tokens: wire
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
            reasoning_tokens: wire
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
        }
    }
}

fn finish_reason_from_wire(raw: String) -> FinishReason {
    match raw.as_str() {
        "stop" => FinishReason::Stop,
        "tool_calls" => FinishReason::ToolCalls,
        "length" => FinishReason::Length,
        "content_filter" => FinishReason::ContentFilter,
        _ => FinishReason::Other(raw),
    }
}

/// Longest provider message we carry into an error: enough to read, short
/// enough for a log line.
const MAX_PROVIDER_MESSAGE: usize = 300;

/// `code` and `message` from a provider error value. OpenAI sends
/// `{"message","type","param","code"}`; others send a bare string or a
/// numeric code, so everything is taken from an untyped value.
pub(super) fn error_fields(error: &Value) -> (Option<String>, Option<String>) {
    let text = |v: &Value| match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    match error {
        Value::Object(map) => {
            let code = map
                .get("code")
                .and_then(text)
                .or_else(|| map.get("type").and_then(text));
            let message = map.get("message").and_then(text).map(|m| shorten(&m));
            (code, message)
        }
        Value::String(s) => (None, Some(shorten(s))),
        _ => (None, None),
    }
}

/// `code` and `message` from a whole non-2xx response body, if it is JSON
/// with an `error` member.
pub(super) fn error_body_fields(body: &[u8]) -> (Option<String>, Option<String>) {
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => value.get("error").map(error_fields).unwrap_or_default(),
        Err(_) => (None, None),
    }
}

fn shorten(message: &str) -> String {
    let message = message.trim();
    match message.char_indices().nth(MAX_PROVIDER_MESSAGE) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_owned(),
    }
}

pub(super) fn provider_error(error: &Value) -> LlmError {
    let (code, message) = error_fields(error);
    let message = format!(
        "model provider reported an error{}",
        message.map(|m| format!(": {m}")).unwrap_or_default()
    );
    LlmError::provider(code, message)
}

// ---------------------------------------------------------------------------
// Non-streaming response

#[derive(Debug, Deserialize)]
struct WireCompletion {
    choices: Option<Vec<WireChoice>>,
    usage: Option<WireUsage>,
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireChoice {
    index: Option<u32>,
    message: Option<WireResponseMessage>,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireResponseMessage {
    content: Option<String>,
    refusal: Option<String>,
    tool_calls: Option<Vec<WireToolCallIn>>,
}

#[derive(Debug, Deserialize)]
struct WireToolCallIn {
    id: Option<String>,
    function: Option<WireFunctionIn>,
}

#[derive(Debug, Deserialize)]
struct WireFunctionIn {
    name: Option<String>,
    /// A string per the API; a few servers send the JSON object itself.
    arguments: Option<Value>,
}

/// Parses a non-streaming `chat.completion` body.
pub(super) fn completion_from_wire(body: &[u8]) -> Result<Completion, LlmError> {
    let wire: WireCompletion = serde_json::from_slice(body)
        .map_err(|e| LlmError::protocol(format!("unparseable chat completion: {e}")))?;
    if let Some(error) = &wire.error {
        return Err(provider_error(error));
    }
    let choice = wire
        .choices
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.index.unwrap_or(0) == 0)
        .ok_or_else(|| LlmError::protocol("chat completion has no choices"))?;
    let message = choice
        .message
        .ok_or_else(|| LlmError::protocol("chat completion choice has no message"))?;
    let mut tool_calls = Vec::new();
    for (i, call) in message
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let function = call.function.unwrap_or(WireFunctionIn {
            name: None,
            arguments: None,
        });
        let arguments = match function.arguments {
            Some(Value::String(s)) => s,
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        };
        tool_calls.push(finished_call(i, call.id, function.name, arguments)?);
    }
    let finish_reason = match choice.finish_reason {
        Some(raw) => finish_reason_from_wire(raw),
        // The body is complete, so a missing reason is a server omission,
        // not a cut-off answer: infer it from what came back.
        None if !tool_calls.is_empty() => FinishReason::ToolCalls,
        None => FinishReason::Stop,
    };
    Ok(Completion {
        text: message.content.unwrap_or_default(),
        refusal: message.refusal.filter(|r| !r.is_empty()),
        tool_calls,
        finish_reason,
        usage: wire.usage.map(Usage::from),
        opaque: Vec::new(),
        attempts: 1,
        time_to_first_token: None,
        queued: std::time::Duration::ZERO,
    })
}

/// Checks a reassembled call. A call without an id gets one, since some
/// local servers omit it and the tool result must point at something; a call
/// without a function name cannot be executed at all.
pub(super) fn finished_call(
    position: usize,
    id: Option<String>,
    name: Option<String>,
    arguments: String,
) -> Result<ToolCall, LlmError> {
    let name = name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| LlmError::protocol(format!("tool call {position} has no function name")))?;
    let id = id
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| format!("call_{}", uuid::Uuid::new_v4().simple()));
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

// ---------------------------------------------------------------------------
// Streaming response

#[derive(Debug, Deserialize)]
struct WireChunk {
    choices: Option<Vec<WireChunkChoice>>,
    usage: Option<WireUsage>,
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireChunkChoice {
    index: Option<u32>,
    delta: Option<WireDelta>,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireDelta {
    content: Option<String>,
    refusal: Option<String>,
    tool_calls: Option<Vec<WireToolCallDelta>>,
}

#[derive(Debug, Deserialize)]
struct WireToolCallDelta {
    index: Option<u32>,
    id: Option<String>,
    function: Option<WireFunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct WireFunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Debug)]
struct PartialCall {
    index: Option<u32>,
    id: String,
    name: String,
    arguments: String,
}

/// Reassembles a streamed chat completion from its `data:` payloads.
///
/// Pure and synchronous: feed it each payload (without the `data: ` prefix,
/// and not the `[DONE]` marker) in order, then call
/// [`finish`](Self::finish). Parallel tool calls are put back together by
/// their `index`, with arguments concatenated across as many chunks as the
/// provider split them into.
#[derive(Debug, Default)]
pub struct ChatStreamAccumulator {
    text: String,
    refusal: Option<String>,
    calls: Vec<PartialCall>,
    finish_reason: Option<FinishReason>,
    usage: Option<Usage>,
}

impl ChatStreamAccumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one chunk's JSON text and returns the content text it added,
    /// if any. An `{"error":{..}}` chunk becomes a `Provider` error; text
    /// that is not a chunk becomes a `Protocol` error.
    pub fn push(&mut self, data: &str) -> Result<Option<String>, LlmError> {
        let chunk: WireChunk = serde_json::from_str(data)
            .map_err(|e| LlmError::protocol(format!("unparseable stream chunk: {e}")))?;
        if let Some(error) = &chunk.error {
            return Err(provider_error(error));
        }
        // Usage normally rides alone on the last chunk (`choices: []`);
        // some servers repeat a running total on every chunk, so the last
        // one seen wins.
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage.into());
        }
        let mut text: Option<String> = None;
        // We never ask for `n > 1`, so only choice 0 is ours.
        for choice in chunk
            .choices
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.index.unwrap_or(0) == 0)
        {
            if let Some(delta) = choice.delta {
                if let Some(content) = delta.content.filter(|c| !c.is_empty()) {
                    self.text.push_str(&content);
                    match &mut text {
                        Some(text) => text.push_str(&content),
                        None => text = Some(content),
                    }
                }
                if let Some(refusal) = delta.refusal {
                    self.refusal.get_or_insert_default().push_str(&refusal);
                }
                for call in delta.tool_calls.unwrap_or_default() {
                    self.push_call(call);
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish_reason = Some(finish_reason_from_wire(reason));
            }
        }
        Ok(text)
    }

    fn push_call(&mut self, delta: WireToolCallDelta) {
        let id = delta.id.filter(|id| !id.is_empty());
        let slot = self.slot(delta.index, id.as_deref());
        // OpenAI sends id and name once, on the first chunk of a call; some
        // compatible servers repeat them on every chunk, so the first wins.
        if let Some(id) = id
            && slot.id.is_empty()
        {
            slot.id = id;
        }
        if let Some(function) = delta.function {
            if let Some(name) = function.name.filter(|n| !n.is_empty())
                && slot.name.is_empty()
            {
                slot.name = name;
            }
            if let Some(arguments) = function.arguments {
                slot.arguments.push_str(&arguments);
            }
        }
    }

    /// The call a delta belongs to. With an `index` that is exact. Without
    /// one (a few servers send each call whole and unindexed) a new id
    /// starts a new call and anything else continues the last one.
    fn slot(&mut self, index: Option<u32>, id: Option<&str>) -> &mut PartialCall {
        let position = match index {
            Some(index) => self.calls.iter().position(|c| c.index == Some(index)),
            None => match (self.calls.last(), id) {
                (Some(last), Some(id)) if !last.id.is_empty() && last.id != id => None,
                (Some(_), _) => Some(self.calls.len() - 1),
                (None, _) => None,
            },
        };
        let position = position.unwrap_or_else(|| {
            self.calls.push(PartialCall {
                index,
                id: String::new(),
                name: String::new(),
                arguments: String::new(),
            });
            self.calls.len() - 1
        });
        &mut self.calls[position]
    }

    /// Whether a finish reason has arrived, i.e. the model finished its
    /// answer (a usage chunk may still follow).
    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Whether any of the answer has arrived: text, a refusal or the start
    /// of a tool call. Once it has, repeating the request could produce a
    /// different answer the caller cannot reconcile with this one.
    pub fn has_output(&self) -> bool {
        !self.text.is_empty() || self.refusal.is_some() || !self.calls.is_empty()
    }

    /// The completion. Fails with `Protocol` if no finish reason ever
    /// arrived or a tool call never got a function name. With
    /// `finish_reason: length` the calls are kept as far as they got (a call
    /// cut off before its name is dropped): see [`Completion::is_truncated`].
    pub fn finish(self) -> Result<Completion, LlmError> {
        let finish_reason = self
            .finish_reason
            .ok_or_else(|| LlmError::protocol("stream ended without a finish_reason"))?;
        let mut calls = self.calls;
        if finish_reason == FinishReason::Length {
            calls.retain(|c| !c.name.is_empty());
        }
        // Stable, so unindexed calls keep their arrival order.
        calls.sort_by_key(|c| c.index.unwrap_or(u32::MAX));
        let tool_calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| finished_call(i, Some(c.id), Some(c.name), c.arguments))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Completion {
            text: self.text,
            refusal: self.refusal.filter(|r| !r.is_empty()),
            tool_calls,
            finish_reason,
            usage: self.usage,
            opaque: Vec::new(),
            attempts: 1,
            time_to_first_token: None,
            queued: std::time::Duration::ZERO,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;
    use crate::{LlmErrorKind, SseDecoder, ToolSpec};

    pub(crate) fn spec(name: &str, strict: bool) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: format!("does {name}"),
            parameters: json!({"type": "object"}),
            strict,
        }
    }

    fn request(messages: Vec<Message>, tools: Vec<ToolSpec>) -> ChatRequest {
        ChatRequest {
            model: "m".into(),
            messages,
            tools: tools.into_iter().map(std::sync::Arc::new).collect(),
            tool_choice: Some(ToolChoice::Auto),
            parallel_tool_calls: true,
            temperature: Some(0.25),
            max_tokens: Some(100),
            service_tier: None,
            prompt_cache_key: None,
        }
    }

    #[test]
    fn request_body_has_the_chat_completions_shape() {
        let req = request(
            vec![
                Message::System {
                    content: "sys".into(),
                },
                Message::User {
                    content: "hi".into(),
                },
                Message::Assistant {
                    content: None,
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        name: "f".into(),
                        arguments: "{\"a\":1}".into(),
                    }],
                    opaque: vec![json!({"type": "reasoning", "id": "rs_1"})],
                },
                Message::Tool {
                    call_id: "call_1".into(),
                    content: "result".into(),
                },
                Message::Assistant {
                    content: Some("done".into()),
                    tool_calls: vec![],
                    opaque: vec![],
                },
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                    opaque: vec![],
                },
            ],
            vec![spec("f", true)],
        );
        let body = serde_json::to_value(to_wire(&req, true)).expect("serialise");
        assert_eq!(
            body,
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}
                    ]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "result"},
                    {"role": "assistant", "content": "done"},
                    {"role": "assistant", "content": ""},
                ],
                "tools": [{"type": "function", "function": {
                    "name": "f", "description": "does f",
                    "parameters": {"type": "object"}, "strict": true}}],
                "tool_choice": "auto",
                "parallel_tool_calls": true,
                "temperature": 0.25,
                "max_tokens": 100,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
        );
    }

    #[test]
    fn tool_fields_and_stream_options_only_when_relevant() {
        let mut req = request(
            vec![Message::User {
                content: "hi".into(),
            }],
            vec![],
        );
        req.temperature = None;
        req.max_tokens = None;
        let body = serde_json::to_value(to_wire(&req, false)).expect("serialise");
        assert_eq!(
            body,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false})
        );
    }

    #[test]
    fn usage_reads_the_detail_counters() {
        let usage: WireUsage = serde_json::from_value(json!({
            "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 2}
        }))
        .expect("usage");
        assert_eq!(
            Usage::from(usage),
            Usage {
                prompt_tokens: 10,
                completion_tokens: 5,
                total_tokens: 15,
                cached_tokens: 4,
                reasoning_tokens: 2
            }
        );
        let usage: WireUsage = serde_json::from_value(json!({
            "prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": null
        }))
        .expect("usage");
        assert_eq!(Usage::from(usage).total_tokens, 7);
    }

    #[test]
    fn non_streaming_body_becomes_a_completion() {
        let body = json!({
            "id": "x", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null, "refusal": null,
                "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"q\":1}"}},
                    {"type": "function", "function": {"name": "g", "arguments": {"x": true}}}
                ]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        });
        let completion = completion_from_wire(body.to_string().as_bytes()).expect("parse");
        assert_eq!(completion.finish_reason, FinishReason::ToolCalls);
        assert_eq!(completion.text, "");
        assert_eq!(completion.refusal, None);
        assert_eq!(completion.tool_calls[0].id, "call_a");
        assert_eq!(completion.tool_calls[0].arguments, "{\"q\":1}");
        assert!(
            completion.tool_calls[1].id.starts_with("call_"),
            "missing ids are filled in"
        );
        assert_eq!(completion.tool_calls[1].arguments, "{\"x\":true}");
        assert_eq!(completion.usage.map(|u| u.total_tokens), Some(3));

        let error =
            json!({"error": {"message": "quota", "type": "insufficient_quota", "code": null}});
        let err = completion_from_wire(error.to_string().as_bytes()).expect_err("error body");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Provider {
                code: Some("insufficient_quota".into())
            }
        );
        let err = completion_from_wire(b"<html>").expect_err("not json");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
        let err = completion_from_wire(b"{\"choices\": []}").expect_err("no choice");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
    }

    #[test]
    fn error_fields_accept_the_shapes_seen_in_the_wild() {
        assert_eq!(
            error_body_fields(br#"{"error":{"message":"m","type":"t","code":"c"}}"#),
            (Some("c".into()), Some("m".into()))
        );
        assert_eq!(
            error_body_fields(br#"{"error":{"message":"m","type":"t","code":null}}"#),
            (Some("t".into()), Some("m".into()))
        );
        assert_eq!(
            error_body_fields(br#"{"error":{"message":"m","code":429}}"#),
            (Some("429".into()), Some("m".into()))
        );
        assert_eq!(
            error_body_fields(br#"{"error":"model not found"}"#),
            (None, Some("model not found".into()))
        );
        assert_eq!(error_body_fields(b"Bad Gateway"), (None, None));
        let (_, message) = error_body_fields(
            json!({"error": {"message": "x".repeat(1000)}})
                .to_string()
                .as_bytes(),
        );
        assert!(message.expect("message").chars().count() <= MAX_PROVIDER_MESSAGE + 1);
    }

    #[test]
    fn error_inside_the_stream_is_a_provider_error() {
        let mut acc = ChatStreamAccumulator::new();
        acc.push(r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}]}"#)
            .expect("chunk");
        let err = acc
            .push(r#"{"error":{"message":"The server had an error","type":"server_error","code":null}}"#)
            .expect_err("error chunk");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Provider {
                code: Some("server_error".into())
            }
        );
        assert!(err.is_retryable());
        assert!(err.to_string().contains("The server had an error"));
    }

    #[test]
    fn garbage_and_unfinished_streams_are_protocol_errors() {
        let mut acc = ChatStreamAccumulator::new();
        let err = acc.push("{not json").expect_err("garbage");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
        acc.push(r#"{"choices":[{"index":0,"delta":{"content":"x"}}]}"#)
            .expect("chunk");
        assert!(!acc.is_finished());
        assert_eq!(
            acc.finish().expect_err("no finish").kind(),
            &LlmErrorKind::Protocol
        );

        let mut acc = ChatStreamAccumulator::new();
        acc.push(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#)
            .expect("chunk");
        let err = acc.finish().expect_err("nameless call");
        assert!(err.to_string().contains("no function name"));
    }

    #[test]
    fn unindexed_calls_and_repeated_names_are_reassembled() {
        let mut acc = ChatStreamAccumulator::new();
        for data in [
            r#"{"choices":[{"delta":{"tool_calls":[{"id":"a","function":{"name":"f","arguments":"{\"x\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"id":"a","function":{"name":"f","arguments":":1}"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}],"usage":null}"#,
        ] {
            acc.push(data).expect("chunk");
        }
        let completion = acc.finish().expect("finish");
        let calls: Vec<_> = completion
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("a", "f", "{\"x\":1}"), ("b", "g", "{}")]);
        assert_eq!(completion.usage, None);
    }

    #[test]
    fn tool_choice_shapes_and_strict_tools() {
        assert_eq!(tool_choice_to_wire(&ToolChoice::Auto), json!("auto"));
        assert_eq!(tool_choice_to_wire(&ToolChoice::None), json!("none"));
        assert_eq!(
            tool_choice_to_wire(&ToolChoice::Required),
            json!("required")
        );
        assert_eq!(
            tool_choice_to_wire(&ToolChoice::Function("f".into())),
            json!({"type": "function", "function": {"name": "f"}})
        );
        let mut req = request(
            vec![Message::User {
                content: "hi".into(),
            }],
            vec![spec("f", false)],
        );
        req.tool_choice = None;
        req.parallel_tool_calls = false;
        let body = serde_json::to_value(to_wire(&req, false)).expect("serialise");
        assert!(body.get("tool_choice").is_none(), "left to the provider");
        assert_eq!(body["parallel_tool_calls"], json!(false));
        assert_eq!(body["tools"][0]["function"]["strict"], json!(false));
    }

    #[test]
    fn length_keeps_the_named_partial_calls() {
        let mut acc = ChatStreamAccumulator::new();
        assert!(!acc.has_output());
        for data in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"q\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
        ] {
            acc.push(data).expect("chunk");
        }
        assert!(acc.has_output(), "a tool call has begun");
        let completion = acc.finish().expect("finish");
        assert!(completion.is_truncated());
        assert_eq!(
            completion.tool_calls,
            [ToolCall {
                id: "c1".into(),
                name: "f".into(),
                arguments: "{\"q\":".into()
            }],
            "kept as far as it got; the nameless one is dropped"
        );

        let mut acc = ChatStreamAccumulator::new();
        acc.push(r#"{"choices":[{"index":0,"delta":{"refusal":"no"}}]}"#)
            .expect("chunk");
        assert!(acc.has_output(), "a refusal counts");
    }

    // -----------------------------------------------------------------------
    // Conformance: recorded api.openai.com streams (see
    // shared/conformance/SOURCES.md for provenance and the oracle table).

    const CONFORMANCE_DIR: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/conformance/openai-chat-sse"
    );

    struct Expected {
        finish_reason: FinishReason,
        calls: &'static [(&'static str, &'static str, &'static str)],
        usage: (u64, u64, u64),
    }

    fn expected(file: &str) -> Option<Expected> {
        let (finish_reason, calls, usage): (_, &'static [_], _) = match file {
            "parallel_tool_calls.sse" => (
                FinishReason::ToolCalls,
                &[
                    (
                        "call_JMW1whyEaYG438VE1OIflxA2",
                        "GetWeatherArgs",
                        r#"{"city": "Edinburgh", "country": "GB", "units": "c"}"#,
                    ),
                    (
                        "call_DNYTawLBoN8fj3KN6qU9N1Ou",
                        "get_stock_price",
                        r#"{"ticker": "AAPL", "exchange": "NASDAQ"}"#,
                    ),
                ],
                (149, 60, 209),
            ),
            "single_tool_call.sse" => (
                FinishReason::ToolCalls,
                &[(
                    "call_c91SqDXlYFuETYv8mUHzz6pp",
                    "GetWeatherArgs",
                    r#"{"city":"Edinburgh","country":"UK","units":"c"}"#,
                )],
                (76, 24, 100),
            ),
            "strict_tool_call.sse" => (
                FinishReason::ToolCalls,
                &[(
                    "call_CTf1nWJLqSeRgDqaCG27xZ74",
                    "get_weather",
                    r#"{"city":"San Francisco","state":"CA"}"#,
                )],
                (48, 19, 67),
            ),
            "non_strict_tool_call.sse" => (
                FinishReason::ToolCalls,
                &[(
                    "call_4XzlGBLtUe9dy3GVNV4jhq7h",
                    "get_weather",
                    r#"{"city":"New York City"}"#,
                )],
                (44, 16, 60),
            ),
            "max_tokens_length.sse" => (FinishReason::Length, &[], (79, 1, 80)),
            "refusal.sse" => (FinishReason::Stop, &[], (79, 11, 90)),
            "plain_content.sse" => (FinishReason::Stop, &[], (14, 30, 44)),
            _ => return None,
        };
        Some(Expected {
            finish_reason,
            calls,
            usage,
        })
    }

    /// What the client does with a body: decode SSE, stop at `[DONE]`, feed
    /// the accumulator. Returns the completion and the text deltas.
    fn replay(bytes: &[u8], chunk_size: usize) -> (Completion, Vec<String>, bool) {
        let mut decoder = SseDecoder::new();
        let mut acc = ChatStreamAccumulator::new();
        let mut deltas = Vec::new();
        let mut done = false;
        let mut events = Vec::new();
        for chunk in bytes.chunks(chunk_size) {
            events.extend(decoder.push(chunk).expect("sse"));
        }
        events.extend(decoder.finish());
        for event in events {
            assert!(!done, "nothing may follow [DONE]");
            if event.is_done() {
                done = true;
                continue;
            }
            if let Some(text) = acc.push(&event.data).expect("chunk") {
                deltas.push(text);
            }
        }
        (acc.finish().expect("finish"), deltas, done)
    }

    #[test]
    fn conformance_streams_reassemble_exactly() {
        let dir = std::path::Path::new(CONFORMANCE_DIR);
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| {
            panic!(
                "conformance fixtures are expected in {} (shared/conformance/openai-chat-sse \
                 next to the crate; see shared/conformance/SOURCES.md): {e}",
                dir.display()
            )
        });
        let mut seen = Vec::new();
        for entry in entries {
            let path = entry.expect("dir entry").path();
            if path.extension().and_then(|e| e.to_str()) != Some("sse") {
                continue;
            }
            let file = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("utf-8 name")
                .to_owned();
            let want = expected(&file)
                .unwrap_or_else(|| panic!("{file}: new fixture without an expectation here"));
            let bytes = std::fs::read(&path).expect("read fixture");
            for chunk_size in [1, 7, 64, bytes.len()] {
                let (got, deltas, done) = replay(&bytes, chunk_size);
                let ctx = format!("{file} in {chunk_size}-byte chunks");
                assert!(done, "{ctx}: [DONE] not seen");
                assert_eq!(got.finish_reason, want.finish_reason, "{ctx}");
                let calls: Vec<_> = got
                    .tool_calls
                    .iter()
                    .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
                    .collect();
                assert_eq!(calls, want.calls, "{ctx}");
                let usage = got.usage.expect("usage chunk");
                assert_eq!(
                    (
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        usage.total_tokens
                    ),
                    want.usage,
                    "{ctx}"
                );
                assert_eq!(usage.cached_tokens, 0, "{ctx}");
                assert_eq!(usage.reasoning_tokens, 0, "{ctx}");
                assert_eq!(
                    deltas.concat(),
                    got.text,
                    "{ctx}: deltas add up to the text"
                );
                match file.as_str() {
                    "max_tokens_length.sse" => assert_eq!(got.text, "{\"", "{ctx}"),
                    "refusal.sse" => {
                        assert_eq!(
                            got.refusal.as_deref(),
                            Some("I'm sorry, I can't assist with that request."),
                            "{ctx}"
                        );
                        assert_eq!(got.text, "", "{ctx}");
                    }
                    "plain_content.sse" => {
                        assert_eq!(got.text.chars().count(), 159, "{ctx}");
                        assert!(
                            got.text
                                .starts_with("I'm unable to provide real-time weather")
                        );
                        assert!(got.text.ends_with("a weather app."));
                    }
                    _ => assert_eq!(got.text, "", "{ctx}"),
                }
                if file != "refusal.sse" {
                    assert_eq!(got.refusal, None, "{ctx}");
                }
            }
            seen.push(file);
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                "max_tokens_length.sse",
                "non_strict_tool_call.sse",
                "parallel_tool_calls.sse",
                "plain_content.sse",
                "refusal.sse",
                "single_tool_call.sse",
                "strict_tool_call.sse",
            ],
            "every fixture listed in SOURCES.md must be replayed"
        );
    }

    /// A client of the scripted stand-in speaking Chat Completions, with
    /// or without `prompt_cache_key` accepted by its deployment.
    pub(crate) fn stand_in_client(
        server: &toolfleet_scripted::ScriptedServer,
        api: crate::ApiShape,
        send_key: bool,
    ) -> crate::LlmClient {
        crate::LlmClient::new(crate::LlmConfig {
            api,
            prompt_cache_key: send_key,
            retry: crate::RetryPolicy::never(),
            ..crate::LlmConfig::new(server.base_url())
        })
        .expect("client")
    }

    /// The scripted stand-in, answering "ok" to everything.
    pub(crate) async fn stand_in() -> toolfleet_scripted::ScriptedServer {
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            toolfleet_scripted::ScriptedServer::start(
                "127.0.0.1:0".parse().expect("addr"),
                toolfleet_scripted::Script::from_json(
                    r#"{"default": {"steps": [{"answer": "ok"}]}}"#,
                )
                .expect("script"),
            ),
        )
        .await
        .expect("in time")
        .expect("start")
    }

    /// What the stand-in received: the system prompt first, the tools in
    /// the order the request gave them (not re-sorted: a caller that
    /// appends a tool keeps every tool before it in place), then the
    /// history; `prompt_cache_key` only from a deployment that accepts
    /// it.
    #[tokio::test]
    async fn the_stand_in_gets_the_tools_in_order_and_the_cache_key_only_where_accepted() {
        let server = stand_in().await;
        let mut req = request(
            vec![
                Message::System {
                    content: "sys".into(),
                },
                Message::User {
                    content: "hi".into(),
                },
            ],
            vec![
                spec("alpha", false),
                spec("mid", true),
                spec("added", false),
            ],
        );
        req.prompt_cache_key = Some("tf-0123456789abcdef".into());
        for send_key in [true, false] {
            let client = stand_in_client(&server, crate::ApiShape::ChatCompletions, send_key);
            let done = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                client.stream_chat(&req, |_| {}),
            )
            .await
            .expect("in time")
            .expect("answered");
            assert_eq!(done.text, "ok");
        }
        let bodies = server.requests();
        assert_eq!(bodies.len(), 2);
        for body in &bodies {
            let names: Vec<&str> = body["tools"]
                .as_array()
                .expect("tools")
                .iter()
                .filter_map(|t| t["function"]["name"].as_str())
                .collect();
            assert_eq!(names, ["alpha", "mid", "added"]);
            assert_eq!(
                body["messages"][0],
                json!({"role": "system", "content": "sys"})
            );
            assert_eq!(body["messages"][1]["role"], "user");
        }
        assert_eq!(bodies[0]["prompt_cache_key"], "tf-0123456789abcdef");
        assert!(bodies[1].get("prompt_cache_key").is_none(), "{}", bodies[1]);
    }
}
