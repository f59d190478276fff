//! Reading a request of either API into an [`Ask`]: the profile it names,
//! the conversation as the chat job's messages, and how to answer
//! (streamed or not, usage in the stream). What the fleet cannot honour is
//! refused with a 400 naming the parameter; what it decides itself
//! (sampling, token limits, the end user) is ignored. The table is in
//! docs/gateway.md.

use serde_json::{Map, Value};
use toolfleet_protocol::{ChatMessage, ChatRole};

use super::error::ApiError;

/// The longest message content a chat job takes, in characters
/// (`schemas/chat_job.schema.json`).
const MAX_CONTENT_CHARS: usize = 262_144;

/// The most messages a chat job takes.
const MAX_MESSAGES: usize = 500;

/// A request, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ask {
    /// The profile (OpenAI's `model`).
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub stream: bool,
    /// Chat Completions' `stream_options.include_usage`: a last chunk with
    /// the usage (the Responses API always reports it).
    pub include_usage: bool,
}

/// The body as a JSON object.
///
/// # Errors
///
/// 400 when it is not JSON or not an object.
pub(crate) fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(
            None,
            "The body must be a JSON object.",
        )),
        Err(e) => Err(ApiError::bad_request(
            None,
            format!("The body is not valid JSON: {e}"),
        )),
    }
}

/// A `POST /v1/chat/completions` body.
///
/// # Errors
///
/// 400 for a missing model, no messages, a message that cannot be mapped
/// or a parameter the fleet cannot honour; 413 for a message too long.
pub(crate) fn chat_completions(body: &Map<String, Value>) -> Result<Ask, ApiError> {
    refuse_chat_parameters(body)?;
    let model = model(body)?;
    let Some(Value::Array(items)) = body.get("messages") else {
        return Err(ApiError::bad_request(
            Some("messages"),
            "`messages` must be an array of messages.",
        ));
    };
    let messages = items
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(m, &format!("messages[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let stream = flag(body, "stream")?;
    let include_usage = stream
        && body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    Ok(Ask {
        model,
        messages: checked(messages, "messages")?,
        stream,
        include_usage,
    })
}

/// A `POST /v1/responses` body: `instructions` first as a system message,
/// then `input` (a string, or message items).
///
/// # Errors
///
/// As [`chat_completions`].
pub(crate) fn responses(body: &Map<String, Value>) -> Result<Ask, ApiError> {
    refuse_responses_parameters(body)?;
    let model = model(body)?;
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            messages.push(message(ChatRole::System, s.clone(), "instructions")?)
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                Some("instructions"),
                "`instructions` must be a string.",
            ));
        }
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(message(ChatRole::User, s.clone(), "input")?),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(input_item(item, &format!("input[{i}]"))?);
            }
        }
        _ => {
            return Err(ApiError::bad_request(
                Some("input"),
                "`input` must be a string or an array of message items.",
            ));
        }
    }
    Ok(Ask {
        model,
        messages: checked(messages, "input")?,
        stream: flag(body, "stream")?,
        include_usage: true,
    })
}

fn model(body: &Map<String, Value>) -> Result<String, ApiError> {
    match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok(m.clone()),
        _ => Err(ApiError::bad_request(
            Some("model"),
            "`model` must name a model (a profile of the fleet: GET /v1/models lists them).",
        )),
    }
}

fn flag(body: &Map<String, Value>, name: &str) -> Result<bool, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(
            Some(name),
            format!("`{name}` must be a boolean."),
        )),
    }
}

fn checked(messages: Vec<ChatMessage>, param: &str) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            Some(param),
            format!("`{param}` must hold at least one message."),
        ));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_request(
            Some(param),
            format!("`{param}` may hold at most {MAX_MESSAGES} messages."),
        ));
    }
    Ok(messages)
}

fn message(role: ChatRole, content: String, param: &str) -> Result<ChatMessage, ApiError> {
    if content.chars().count() > MAX_CONTENT_CHARS {
        return Err(ApiError::too_large(format!(
            "`{param}` is longer than the {MAX_CONTENT_CHARS} characters a message may hold."
        )));
    }
    Ok(ChatMessage { role, content })
}

/// A parameter present and not one of the values that ask for nothing.
fn present(body: &Map<String, Value>, name: &str) -> bool {
    match body.get(name) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Bool(b)) => *b,
        Some(_) => true,
    }
}

/// `tools` and `tool_choice` as both APIs take them: the fleet runs its
/// own tools, so a client's are refused.
fn refuse_client_tools(body: &Map<String, Value>) -> Result<(), ApiError> {
    for name in ["tools", "functions"] {
        if present(body, name) {
            return Err(ApiError::unsupported(
                name,
                format!(
                    "`{name}` is not supported: the fleet runs its own tools (those of the model's \
                     profile) and returns their answer; client-side tools cannot be mapped."
                ),
            ));
        }
    }
    for name in ["tool_choice", "function_call"] {
        match body.get(name) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "auto" || s == "none" => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    name,
                    format!(
                        "`{name}` may only be \"auto\" or \"none\": the fleet chooses its tools."
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn refuse_chat_parameters(body: &Map<String, Value>) -> Result<(), ApiError> {
    refuse_client_tools(body)?;
    if body
        .get("n")
        .is_some_and(|n| !n.is_null() && n.as_u64() != Some(1))
    {
        return Err(ApiError::unsupported(
            "n",
            "`n` must be 1: the fleet gives one answer.",
        ));
    }
    if let Some(kind) = body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .filter(|t| *t != "text")
    {
        return Err(ApiError::unsupported(
            "response_format",
            format!("`response_format` {kind:?} is not supported: answers are text."),
        ));
    }
    for name in ["logprobs", "audio", "prediction"] {
        if present(body, name) {
            return Err(ApiError::unsupported(
                name,
                format!("`{name}` is not supported by the fleet."),
            ));
        }
    }
    if body
        .get("modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|x| x != "text"))
    {
        return Err(ApiError::unsupported(
            "modalities",
            "Only the `text` modality is supported.",
        ));
    }
    Ok(())
}

fn refuse_responses_parameters(body: &Map<String, Value>) -> Result<(), ApiError> {
    refuse_client_tools(body)?;
    for (name, why) in [
        (
            "previous_response_id",
            "the gateway keeps no conversations: send the whole conversation in `input`",
        ),
        (
            "conversation",
            "the gateway keeps no conversations: send the whole conversation in `input`",
        ),
        ("background", "background responses are not supported"),
        ("prompt", "stored prompts are not supported"),
    ] {
        if present(body, name) {
            return Err(ApiError::unsupported(name, format!("`{name}`: {why}.")));
        }
    }
    if let Some(kind) = body
        .get("text")
        .and_then(|t| t.get("format"))
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .filter(|t| *t != "text")
    {
        return Err(ApiError::unsupported(
            "text.format",
            format!("`text.format` {kind:?} is not supported: answers are text."),
        ));
    }
    Ok(())
}

/// A Chat Completions message: `system` and `developer` become system
/// messages; `user`, `assistant` theirs; tool results and assistant tool
/// calls cannot be mapped (the fleet's tools run in the fleet).
fn chat_message(m: &Value, param: &str) -> Result<ChatMessage, ApiError> {
    let role = match m.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => ChatRole::System,
        Some("user") => ChatRole::User,
        Some("assistant") => {
            if m.get("tool_calls")
                .is_some_and(|c| !c.is_null() && c != &Value::Array(vec![]))
                || m.get("function_call").is_some_and(|c| !c.is_null())
            {
                return Err(ApiError::bad_request(
                    Some(&format!("{param}.tool_calls")),
                    "Assistant messages with tool calls cannot be mapped: the fleet runs its own \
                     tools. Send the conversation's text only.",
                ));
            }
            ChatRole::Assistant
        }
        Some(role @ ("tool" | "function")) => {
            return Err(ApiError::bad_request(
                Some(&format!("{param}.role")),
                format!(
                    "Messages of role {role:?} cannot be mapped: the fleet runs its own tools. \
                     Send the conversation's text only."
                ),
            ));
        }
        other => {
            return Err(ApiError::bad_request(
                Some(&format!("{param}.role")),
                format!("Unknown message role {other:?}."),
            ));
        }
    };
    let content = match m.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(c) => text_of(c, &format!("{param}.content"), &["text"])?,
    };
    message(role, content, param)
}

/// A Responses input item: a message (`type` absent or `message`), its
/// content a string or `input_text` / `output_text` parts.
fn input_item(item: &Value, param: &str) -> Result<ChatMessage, ApiError> {
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {}
        Some("mcp_approval_response") => {
            return Err(ApiError::unsupported(
                param,
                "`mcp_approval_response` items are not taken: a held tool call is decided by the \
                 fleet's approvers (`toolfleet approve`); GET /v1/responses/{id} reads the answer \
                 once it is decided.",
            ));
        }
        Some(kind) => {
            return Err(ApiError::bad_request(
                Some(param),
                format!(
                    "Input items of type {kind:?} cannot be mapped: only messages are taken (the \
                     fleet runs its own tools)."
                ),
            ));
        }
    }
    let role = match item.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => ChatRole::System,
        Some("user") => ChatRole::User,
        Some("assistant") => ChatRole::Assistant,
        other => {
            return Err(ApiError::bad_request(
                Some(&format!("{param}.role")),
                format!("Unknown message role {other:?}."),
            ));
        }
    };
    let content = match item.get("content") {
        Some(c) => text_of(
            c,
            &format!("{param}.content"),
            &["input_text", "output_text", "text"],
        )?,
        None => {
            return Err(ApiError::bad_request(
                Some(&format!("{param}.content")),
                "A message item needs `content`.",
            ));
        }
    };
    message(role, content, param)
}

/// A content value as text: a string, or text parts (of `kinds`) joined
/// by newlines; any other part (images, audio, files, refusals) is refused.
fn text_of(content: &Value, param: &str, kinds: &[&str]) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match part.get("text").and_then(Value::as_str) {
                    Some(t) if kinds.contains(&kind) => texts.push(t),
                    _ => {
                        return Err(ApiError::bad_request(
                            Some(&format!("{param}[{i}]")),
                            format!(
                                "Content parts of type {kind:?} cannot be mapped: only text ({}) is \
                                 taken.",
                                kinds.join(", ")
                            ),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::bad_request(
            Some(param),
            "Content must be a string or an array of text parts.",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<Ask, ApiError> {
        chat_completions(v.as_object().unwrap())
    }

    fn resp(v: Value) -> Result<Ask, ApiError> {
        responses(v.as_object().unwrap())
    }

    #[test]
    fn chat_messages_map_to_the_jobs_roles() {
        let ask = chat(json!({
            "model": "default", "stream": true, "stream_options": {"include_usage": true},
            "temperature": 0.2, "user": "someone-else", "max_tokens": 9,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "tool_calls": []},
                {"role": "user", "content": "again"}
            ]
        }))
        .unwrap();
        assert_eq!(ask.model, "default");
        assert!(ask.stream && ask.include_usage);
        let roles: Vec<ChatRole> = ask.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                ChatRole::System,
                ChatRole::User,
                ChatRole::Assistant,
                ChatRole::User
            ]
        );
        assert_eq!(ask.messages[1].content, "a\nb");
    }

    #[test]
    fn what_cannot_be_mapped_is_refused_naming_the_parameter() {
        let m = json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (json!({"messages": m}), "model"),
            (json!({"model": "d", "messages": []}), "messages"),
            (json!({"model": "d"}), "messages"),
            (
                json!({"model": "d", "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "d", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"model": "d", "messages": m, "tools": [{"type": "function"}]}),
                "tools",
            ),
            (
                json!({"model": "d", "messages": m, "tool_choice": "required"}),
                "tool_choice",
            ),
            (json!({"model": "d", "messages": m, "n": 2}), "n"),
            (
                json!({"model": "d", "messages": m, "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"model": "d", "messages": m, "stream": "yes"}),
                "stream",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        let long = "x".repeat(MAX_CONTENT_CHARS + 1);
        let e = chat(json!({"model": "d", "messages": [{"role": "user", "content": long}]}))
            .unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn responses_input_and_instructions_map_to_messages() {
        let ask = resp(json!({"model": "d", "input": "hello", "instructions": "be kind"})).unwrap();
        assert_eq!(ask.messages.len(), 2);
        assert_eq!(ask.messages[0].role, ChatRole::System);
        assert!(!ask.stream && ask.include_usage);
        let ask = resp(json!({"model": "d", "stream": true, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            {"role": "developer", "content": "rule"}
        ]}))
        .unwrap();
        assert!(ask.stream);
        assert_eq!(ask.messages[1].content, "a");
        assert_eq!(ask.messages[2].role, ChatRole::System);
        for (body, param) in [
            (
                json!({"model": "d", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}),
                "input[0]",
            ),
            (
                json!({"model": "d", "input": [{"type": "mcp_approval_response", "approve": true, "approval_request_id": "r"}]}),
                "input[0]",
            ),
            (
                json!({"model": "d", "input": "q", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (
                json!({"model": "d", "input": "q", "text": {"format": {"type": "json_schema"}}}),
                "text.format",
            ),
            (json!({"model": "d", "input": 3}), "input"),
            (json!({"model": "d", "input": []}), "input"),
        ] {
            let e = resp(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn a_body_must_be_a_json_object() {
        assert!(object(b"{\"a\":1}").is_ok());
        assert_eq!(
            object(b"[1]").unwrap_err().status,
            axum::http::StatusCode::BAD_REQUEST
        );
        assert_eq!(
            object(b"{oops").unwrap_err().status,
            axum::http::StatusCode::BAD_REQUEST
        );
    }
}
