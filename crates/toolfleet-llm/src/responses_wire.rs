//! The OpenAI Responses API wire shape (`POST {base}/responses`): private
//! serde types for the request, the response object and stream events,
//! with `to_wire` / `from_wire` conversions to the neutral types of
//! [`super`], and the stream accumulator that turns events back into one
//! [`Completion`].
//!
//! How the neutral conversation maps onto Responses input items:
//!
//! | neutral | Responses |
//! |---|---|
//! | the first message, when `System` | `instructions` |
//! | later `System`, `User` | `{"type":"message","role":..,"content":..}` |
//! | `Assistant.opaque` | replayed verbatim, first (reasoning items) |
//! | `Assistant.content` | `{"type":"message","role":"assistant",..}` |
//! | `Assistant.tool_calls` | `{"type":"function_call",call_id,name,arguments}` |
//! | `Tool` | `{"type":"function_call_output",call_id,output}` |
//!
//! Only the first system message is `instructions`: it is the profile's
//! system prompt, the same for every job of a profile, and the provider
//! builds the prompt from `instructions`, then the tools, then `input`.
//! Per-job system text (a job's own system messages, the fleet's
//! retrieval directive) goes after the tools as `system` input messages,
//! so it does not change the beginning every job of the profile shares.
//! They stay `system` (not `developer`): the same role the model read
//! them with in `instructions`, and one every OpenAI-compatible Responses
//! server knows.
//!
//! Requests are stateless (`store: false`). For a deployment marked as a
//! reasoning model ([`LlmConfig::reasoning`](crate::LlmConfig::reasoning))
//! they also ask for `include: ["reasoning.encrypted_content"]`, so the
//! model's reasoning items come back whole in [`Completion::opaque`] and go
//! out again with the next request of the same tool loop. Other models get
//! no `include`: OpenAI answers it with 400 ("Encrypted content is not
//! supported with this model") for gpt-4o, gpt-4o-mini and the like. A
//! reasoning item without its `encrypted_content` (a reasoning model on a
//! deployment not marked as one) is not replayed: with `store: false` it
//! refers to nothing the provider kept, and the API answers 404 for it.
//!
//! Decoding is lenient like `chat_wire`: unknown events and fields are
//! ignored, and items are found by `item_id` or, failing that,
//! `output_index`, so a reasoning item at index 0 or a server that skips
//! `response.output_item.added` both work.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::chat_wire::{finished_call, provider_error};
use super::{
    ChatRequest, Completion, FinishReason, LlmError, Message, SseEvent, ToolChoice, Usage,
};

// ---------------------------------------------------------------------------
// Request

/// Fields in the order of the prompt a provider builds from them: the
/// instructions, then the tools (in the caller's stable order), then the
/// conversation, so the stable beginning also comes first in the body.
#[derive(Debug, Serialize)]
pub(super) struct WireRequest<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    instructions: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Value>,
    input: Vec<InputItem<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'a str>,
    /// Requests sharing it share the provider's prompt cache (OpenAI);
    /// dropped for deployments that do not accept it
    /// ([`WireRequest::keep_prompt_cache_key`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_key: Option<&'a str>,
    stream: bool,
    /// Nothing is kept at the provider: every request carries the whole
    /// conversation, so any replica can serve the next round.
    store: bool,
    /// `["reasoning.encrypted_content"]` for reasoning models only; absent
    /// otherwise (non-reasoning models refuse it with 400).
    #[serde(skip_serializing_if = "Option::is_none")]
    include: Option<[&'static str; 1]>,
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

/// What a reasoning model is asked to include so its reasoning can be
/// replayed without provider-side state.
const ENCRYPTED_REASONING: &str = "reasoning.encrypted_content";

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum InputItem<'a> {
    Typed(TypedItem<'a>),
    /// An output item of an earlier response, sent back as it came.
    Verbatim(&'a Value),
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum TypedItem<'a> {
    Message {
        role: &'static str,
        content: &'a str,
    },
    FunctionCall {
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
    },
    FunctionCallOutput {
        call_id: &'a str,
        output: &'a str,
    },
}

/// The request body for `POST {base_url}/responses`; `reasoning_model`
/// adds `include: ["reasoning.encrypted_content"]`. The first message,
/// when a system message, is `instructions`; every later one is input
/// (see the module docs). The tools go out in the caller's order, which
/// it keeps stable for the provider's prompt cache.
pub(super) fn to_wire(req: &ChatRequest, stream: bool, reasoning_model: bool) -> WireRequest<'_> {
    let (instructions, rest) = match req.messages.split_first() {
        Some((Message::System { content }, rest)) => (Some(content.clone()), rest),
        _ => (None, req.messages.as_slice()),
    };
    let mut input = Vec::with_capacity(rest.len());
    for message in rest {
        push_input(&mut input, message);
    }
    let has_tools = !req.tools.is_empty();
    WireRequest {
        model: &req.model,
        instructions,
        input,
        tools: req.tools.iter().map(|t| t.to_responses()).collect(),
        tool_choice: req
            .tool_choice
            .as_ref()
            .filter(|_| has_tools)
            .map(tool_choice_to_wire),
        parallel_tool_calls: has_tools.then_some(req.parallel_tool_calls),
        temperature: req.temperature,
        max_output_tokens: req.max_tokens,
        service_tier: req.service_tier.as_deref(),
        prompt_cache_key: req.prompt_cache_key.as_deref(),
        stream,
        store: false,
        include: reasoning_model.then_some([ENCRYPTED_REASONING]),
    }
}

/// Whether an opaque item can go out again in a `store: false` request: a
/// reasoning item only with its `encrypted_content`, since without it the
/// item is a bare id the provider never stored (404).
fn replayable(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) != Some("reasoning")
        || item.get("encrypted_content").is_some_and(Value::is_string)
}

/// Whether `completion` holds reasoning items that cannot be replayed: the
/// sign of a reasoning model on a deployment not marked as one.
pub(super) fn has_unreplayable_reasoning(completion: &Completion) -> bool {
    completion.opaque.iter().any(|item| !replayable(item))
}

fn push_input<'a>(input: &mut Vec<InputItem<'a>>, message: &'a Message) {
    let message_item = |role, content| InputItem::Typed(TypedItem::Message { role, content });
    match message {
        Message::System { content } => input.push(message_item("system", content)),
        Message::User { content } => input.push(message_item("user", content)),
        Message::Assistant {
            content,
            tool_calls,
            opaque,
        } => {
            // Reasoning items come before the output they led to, as the
            // provider produced them.
            let before = input.len();
            input.extend(
                opaque
                    .iter()
                    .filter(|item| replayable(item))
                    .map(InputItem::Verbatim),
            );
            let replayed = input.len() > before;
            match content.as_deref() {
                Some(text) if !text.is_empty() => input.push(message_item("assistant", text)),
                // An assistant turn with nothing at all still marks a turn.
                _ if tool_calls.is_empty() && !replayed => {
                    input.push(message_item("assistant", ""));
                }
                _ => {}
            }
            input.extend(tool_calls.iter().map(|call| {
                InputItem::Typed(TypedItem::FunctionCall {
                    call_id: &call.id,
                    name: &call.name,
                    arguments: &call.arguments,
                })
            }));
        }
        Message::Tool { call_id, content } => {
            input.push(InputItem::Typed(TypedItem::FunctionCallOutput {
                call_id,
                output: content,
            }));
        }
    }
}

/// `"auto"`, `"none"`, `"required"` or `{"type":"function","name":..}`.
fn tool_choice_to_wire(choice: &ToolChoice) -> Value {
    match choice {
        ToolChoice::Auto => Value::from("auto"),
        ToolChoice::None => Value::from("none"),
        ToolChoice::Required => Value::from("required"),
        ToolChoice::Function(name) => json!({"type": "function", "name": name}),
    }
}

// ---------------------------------------------------------------------------
// Response object and stream events

#[derive(Debug, Default, Deserialize)]
struct WireUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    total_tokens: Option<u64>,
    input_tokens_details: Option<WireInputDetails>,
    output_tokens_details: Option<WireOutputDetails>,
}

#[derive(Debug, Default, Deserialize)]
struct WireInputDetails {
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct WireOutputDetails {
    reasoning_tokens: Option<u64>,
}

impl From<WireUsage> for Usage {
    fn from(wire: WireUsage) -> Self {
        let prompt_tokens = wire.input_tokens.unwrap_or(0);
        let completion_tokens = wire.output_tokens.unwrap_or(0);
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: wire
                .total_tokens
                .unwrap_or(prompt_tokens + completion_tokens),
            cached_tokens: wire
                .input_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0),
            reasoning_tokens: wire
                .output_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
        }
    }
}

/// The `response` object: the whole non-streaming body, and the payload of
/// `response.created` / `.completed` / `.incomplete` / `.failed` events.
#[derive(Debug, Default, Deserialize)]
struct WireResponse {
    status: Option<String>,
    output: Option<Vec<Value>>,
    usage: Option<WireUsage>,
    error: Option<Value>,
    incomplete_details: Option<WireIncomplete>,
}

#[derive(Debug, Default, Deserialize)]
struct WireIncomplete {
    reason: Option<String>,
}

/// One stream event. Fields whose type differs between event kinds are
/// kept as raw values and read where their meaning is known.
#[derive(Debug, Deserialize)]
struct WireEvent {
    #[serde(rename = "type")]
    kind: Option<String>,
    response: Option<WireResponse>,
    item: Option<Value>,
    item_id: Option<String>,
    output_index: Option<u64>,
    delta: Option<Value>,
    arguments: Option<Value>,
    text: Option<Value>,
    refusal: Option<Value>,
    error: Option<Value>,
    code: Option<Value>,
    message: Option<Value>,
}

/// An output item, as far as we use it.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireItem {
    Message {
        id: Option<String>,
        #[serde(default)]
        content: Vec<WireContent>,
    },
    FunctionCall {
        id: Option<String>,
        call_id: Option<String>,
        name: Option<String>,
        arguments: Option<String>,
    },
    Reasoning {
        id: Option<String>,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireContent {
    OutputText {
        #[serde(default)]
        text: String,
    },
    Refusal {
        #[serde(default)]
        refusal: String,
    },
    #[serde(other)]
    Other,
}

fn text_of(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str)
}

// ---------------------------------------------------------------------------
// Accumulator

#[derive(Debug)]
struct Item {
    output_index: Option<u64>,
    id: Option<String>,
    body: ItemBody,
}

#[derive(Debug)]
enum ItemBody {
    Message {
        text: String,
        refusal: Option<String>,
    },
    FunctionCall {
        call_id: Option<String>,
        name: Option<String>,
        arguments: String,
    },
    /// Kept whole, to be replayed in the next request.
    Reasoning(Value),
    /// Anything else (built-in tool calls and the like): noted so indices
    /// stay right, otherwise ignored.
    Other,
}

impl ItemBody {
    fn empty_message() -> Self {
        Self::Message {
            text: String::new(),
            refusal: None,
        }
    }

    fn empty_call() -> Self {
        Self::FunctionCall {
            call_id: None,
            name: None,
            arguments: String::new(),
        }
    }

    fn same_kind(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

#[derive(Debug)]
enum End {
    Completed,
    Incomplete(Option<String>),
}

/// Reassembles one streamed Responses API response from its events.
///
/// Pure and synchronous: feed it each event in order
/// ([`push_event`](Self::push_event), or [`push`](Self::push) with the
/// `data:` JSON alone, which names its own `type`), then call
/// [`finish`](Self::finish). Output items are keyed by `item_id` and
/// `output_index`; text comes back from `push` as it streams. One
/// accumulator takes one response: a second `response.created` is an
/// error. `error` and `response.failed` events become `Provider` errors
/// carrying the provider's code.
#[derive(Debug, Default)]
pub struct ResponsesStreamAccumulator {
    started: bool,
    items: Vec<Item>,
    end: Option<End>,
    usage: Option<Usage>,
}

impl ResponsesStreamAccumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one event's `data:` JSON and returns the content text it
    /// added, if any.
    pub fn push(&mut self, data: &str) -> Result<Option<String>, LlmError> {
        self.push_named(None, data)
    }

    /// Takes one decoded SSE event; its `event:` name is used when the JSON
    /// does not carry a `type`.
    pub fn push_event(&mut self, event: &SseEvent) -> Result<Option<String>, LlmError> {
        self.push_named(event.event.as_deref(), &event.data)
    }

    fn push_named(&mut self, name: Option<&str>, data: &str) -> Result<Option<String>, LlmError> {
        let event: WireEvent = serde_json::from_str(data)
            .map_err(|e| LlmError::protocol(format!("unparseable stream event: {e}")))?;
        let kind = event.kind.as_deref().or(name).unwrap_or_default();
        match kind {
            "response.created" => {
                if self.started {
                    return Err(LlmError::protocol(
                        "a second response began in the same stream",
                    ));
                }
                self.started = true;
            }
            "response.queued" | "response.in_progress" => self.started = true,
            "response.output_item.added" | "response.output_item.done" => {
                let item = event
                    .item
                    .ok_or_else(|| LlmError::protocol(format!("{kind} event without an item")))?;
                return self.upsert(
                    event.output_index,
                    item,
                    kind == "response.output_item.done",
                );
            }
            "response.completed" | "response.incomplete" => {
                let response = event.response.unwrap_or_default();
                let end = if kind == "response.completed" {
                    End::Completed
                } else {
                    End::Incomplete(
                        response
                            .incomplete_details
                            .as_ref()
                            .and_then(|d| d.reason.clone()),
                    )
                };
                return self.end_with(end, response);
            }
            "response.failed" | "response.cancelled" => {
                let response = event.response.unwrap_or_default();
                return Err(failed(&response, kind));
            }
            "error" => {
                // OpenAI documents `{type:"error", code, message, param}`;
                // recorded streams also nest it under `error`.
                let error = match event.error {
                    Some(error) => error,
                    None => json!({"code": event.code, "message": event.message}),
                };
                return Err(provider_error(&error));
            }
            _ => return Ok(self.push_content(kind, &event)),
        }
        Ok(None)
    }

    /// The events that stream an output item's content (call arguments,
    /// text, refusals); returns the content text it added, if any.
    fn push_content(&mut self, kind: &str, event: &WireEvent) -> Option<String> {
        let index = event.output_index;
        let item_id = event.item_id.as_deref();
        match kind {
            "response.function_call_arguments.delta" => {
                let delta = text_of(event.delta.as_ref()).unwrap_or_default();
                if let ItemBody::FunctionCall { arguments, .. } =
                    &mut self.slot(item_id, index, ItemBody::empty_call).body
                {
                    arguments.push_str(delta);
                }
            }
            "response.function_call_arguments.done" => {
                if let Some(done) = text_of(event.arguments.as_ref())
                    && let ItemBody::FunctionCall { arguments, .. } =
                        &mut self.slot(item_id, index, ItemBody::empty_call).body
                {
                    // The final text is authoritative over the deltas.
                    done.clone_into(arguments);
                }
            }
            "response.output_text.delta" => {
                let delta = text_of(event.delta.as_ref()).unwrap_or_default();
                if let ItemBody::Message { text, .. } =
                    &mut self.slot(item_id, index, ItemBody::empty_message).body
                    && !delta.is_empty()
                {
                    text.push_str(delta);
                    return Some(delta.to_owned());
                }
            }
            "response.output_text.done" => {
                // Only fills in text that never streamed as deltas.
                if let Some(done) = text_of(event.text.as_ref())
                    && let ItemBody::Message { text, .. } =
                        &mut self.slot(item_id, index, ItemBody::empty_message).body
                    && text.is_empty()
                    && !done.is_empty()
                {
                    done.clone_into(text);
                    return Some(done.to_owned());
                }
            }
            "response.refusal.delta" => {
                let delta = text_of(event.delta.as_ref()).unwrap_or_default();
                if let ItemBody::Message { refusal, .. } =
                    &mut self.slot(item_id, index, ItemBody::empty_message).body
                {
                    refusal.get_or_insert_default().push_str(delta);
                }
            }
            "response.refusal.done" => {
                if let Some(done) = text_of(event.refusal.as_ref())
                    && let ItemBody::Message { refusal, .. } =
                        &mut self.slot(item_id, index, ItemBody::empty_message).body
                {
                    *refusal = Some(done.to_owned());
                }
            }
            // Reasoning summaries, content parts, annotations, built-in
            // tools: nothing the completion needs.
            _ => {}
        }
        None
    }

    /// Records the end of the response and reconciles its final `output`
    /// with what streamed, returning any text that never arrived as deltas.
    fn end_with(&mut self, end: End, response: WireResponse) -> Result<Option<String>, LlmError> {
        let mut text: Option<String> = None;
        for (i, item) in response.output.unwrap_or_default().into_iter().enumerate() {
            if let Some(added) = self.upsert(Some(i as u64), item, true)? {
                text.get_or_insert_default().push_str(&added);
            }
        }
        if let Some(usage) = response.usage {
            self.usage = Some(usage.into());
        }
        self.end = Some(end);
        Ok(text)
    }

    /// Adds or updates an item from an `output_item.added` / `.done` event
    /// or a final `output` list. A finished item (`done`) overrides what
    /// streamed for call metadata, arguments and reasoning; message text
    /// that streamed is kept, and text that did not is returned.
    fn upsert(
        &mut self,
        output_index: Option<u64>,
        raw: Value,
        done: bool,
    ) -> Result<Option<String>, LlmError> {
        let wire: WireItem = serde_json::from_value(raw.clone())
            .map_err(|e| LlmError::protocol(format!("unparseable output item: {e}")))?;
        match wire {
            WireItem::Message { id, content } => {
                let slot = self.slot(id.as_deref(), output_index, ItemBody::empty_message);
                let ItemBody::Message { text, refusal } = &mut slot.body else {
                    return Ok(None);
                };
                let mut full = String::new();
                let mut full_refusal: Option<String> = None;
                for part in content {
                    match part {
                        WireContent::OutputText { text } => full.push_str(&text),
                        WireContent::Refusal { refusal } => {
                            full_refusal.get_or_insert_default().push_str(&refusal);
                        }
                        WireContent::Other => {}
                    }
                }
                if refusal.is_none() {
                    *refusal = full_refusal;
                }
                if text.is_empty() && !full.is_empty() {
                    text.clone_from(&full);
                    return Ok(Some(full));
                }
            }
            WireItem::FunctionCall {
                id,
                call_id,
                name,
                arguments,
            } => {
                let slot = self.slot(id.as_deref(), output_index, ItemBody::empty_call);
                if let ItemBody::FunctionCall {
                    call_id: have_id,
                    name: have_name,
                    arguments: have_arguments,
                } = &mut slot.body
                {
                    if let Some(call_id) = call_id.filter(|c| !c.is_empty()) {
                        *have_id = Some(call_id);
                    }
                    if let Some(name) = name.filter(|n| !n.is_empty()) {
                        *have_name = Some(name);
                    }
                    if let Some(arguments) = arguments.filter(|a| !a.is_empty())
                        && (done || have_arguments.is_empty())
                    {
                        *have_arguments = arguments;
                    }
                }
            }
            WireItem::Reasoning { id } => {
                self.slot(id.as_deref(), output_index, || ItemBody::Other)
                    .body = ItemBody::Reasoning(raw);
            }
            WireItem::Other => {
                let id = raw.get("id").and_then(Value::as_str);
                self.slot(id, output_index, || ItemBody::Other);
            }
        }
        Ok(None)
    }

    /// The item with this id, else at this output index, else a new one
    /// made by `make`. An existing item of another kind is replaced: the
    /// later event knows better what the item is.
    fn slot(
        &mut self,
        id: Option<&str>,
        output_index: Option<u64>,
        make: impl FnOnce() -> ItemBody,
    ) -> &mut Item {
        let by_id = id.and_then(|id| {
            self.items
                .iter()
                .position(|item| item.id.as_deref() == Some(id))
        });
        let found = by_id.or_else(|| {
            output_index.and_then(|index| {
                self.items.iter().position(|item| {
                    item.output_index == Some(index)
                        && (id.is_none() || item.id.is_none() || item.id.as_deref() == id)
                })
            })
        });
        let position = match found {
            Some(position) => {
                let fresh = make();
                let item = &mut self.items[position];
                if !item.body.same_kind(&fresh) && !matches!(fresh, ItemBody::Other) {
                    item.body = fresh;
                }
                if item.id.is_none() {
                    item.id = id.map(str::to_owned);
                }
                if item.output_index.is_none() {
                    item.output_index = output_index;
                }
                position
            }
            None => {
                self.items.push(Item {
                    output_index,
                    id: id.map(str::to_owned),
                    body: make(),
                });
                self.items.len() - 1
            }
        };
        &mut self.items[position]
    }

    /// Whether the terminal event (`response.completed` or
    /// `response.incomplete`) has arrived.
    pub fn is_finished(&self) -> bool {
        self.end.is_some()
    }

    /// Whether any of the answer has arrived: text, a refusal or the start
    /// of a function call (a reasoning item alone does not count: the
    /// caller has seen nothing yet).
    pub fn has_output(&self) -> bool {
        self.items.iter().any(|item| match &item.body {
            ItemBody::Message { text, refusal } => !text.is_empty() || refusal.is_some(),
            ItemBody::FunctionCall { .. } => true,
            ItemBody::Reasoning(_) | ItemBody::Other => false,
        })
    }

    /// The completion, with output in `output_index` order. Fails with
    /// `Protocol` when no terminal event arrived or a function call has no
    /// name. `response.incomplete` gives [`FinishReason::Length`] (or
    /// `ContentFilter`), with calls kept as far as they got.
    pub fn finish(self) -> Result<Completion, LlmError> {
        let end = self
            .end
            .ok_or_else(|| LlmError::protocol("stream ended before response.completed"))?;
        let finish_reason = match &end {
            End::Completed => None,
            End::Incomplete(reason) if reason.as_deref() == Some("content_filter") => {
                Some(FinishReason::ContentFilter)
            }
            End::Incomplete(_) => Some(FinishReason::Length),
        };
        let mut items = self.items;
        // Stable, so items without an index keep their arrival order.
        items.sort_by_key(|item| item.output_index.unwrap_or(u64::MAX));
        let mut text = String::new();
        let mut refusal: Option<String> = None;
        let mut tool_calls = Vec::new();
        let mut opaque = Vec::new();
        for item in items {
            match item.body {
                ItemBody::Message {
                    text: part,
                    refusal: declined,
                } => {
                    text.push_str(&part);
                    if let Some(declined) = declined {
                        refusal.get_or_insert_default().push_str(&declined);
                    }
                }
                ItemBody::FunctionCall {
                    call_id,
                    name,
                    arguments,
                } => {
                    if finish_reason.is_some() && name.is_none() {
                        continue;
                    }
                    tool_calls.push(finished_call(tool_calls.len(), call_id, name, arguments)?);
                }
                ItemBody::Reasoning(raw) => opaque.push(raw),
                ItemBody::Other => {}
            }
        }
        let finish_reason = finish_reason.unwrap_or(if tool_calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        });
        Ok(Completion {
            text,
            refusal: refusal.filter(|r| !r.is_empty()),
            tool_calls,
            finish_reason,
            usage: self.usage,
            opaque,
            attempts: 1,
            time_to_first_token: None,
            queued: std::time::Duration::ZERO,
        })
    }
}

/// The error of a failed or cancelled response.
fn failed(response: &WireResponse, kind: &str) -> LlmError {
    match &response.error {
        Some(error) => provider_error(error),
        None => LlmError::provider(
            None,
            format!("the model provider ended the response with {kind}"),
        ),
    }
}

/// Parses a non-streaming response object.
pub(super) fn completion_from_wire(body: &[u8]) -> Result<Completion, LlmError> {
    let response: WireResponse = serde_json::from_slice(body)
        .map_err(|e| LlmError::protocol(format!("unparseable response object: {e}")))?;
    if let Some(error) = &response.error {
        return Err(provider_error(error));
    }
    let end = match response.status.as_deref() {
        Some("completed") | None => End::Completed,
        Some("incomplete") => End::Incomplete(
            response
                .incomplete_details
                .as_ref()
                .and_then(|d| d.reason.clone()),
        ),
        Some(status @ ("failed" | "cancelled")) => {
            return Err(failed(&response, &format!("status {status}")));
        }
        Some(other) => {
            return Err(LlmError::protocol(format!(
                "the response is not finished (status {other:?})"
            )));
        }
    };
    let mut acc = ResponsesStreamAccumulator::new();
    acc.started = true;
    acc.end_with(end, response)?;
    acc.finish()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::{LlmErrorKind, SseDecoder, ToolCall, ToolSpec};
    use toolfleet_protocol::schema::Validator;

    fn user(text: &str) -> Message {
        Message::User {
            content: text.into(),
        }
    }

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn request(messages: Vec<Message>, tools: Vec<ToolSpec>) -> ChatRequest {
        ChatRequest {
            model: "m".into(),
            messages,
            tools: tools.into_iter().map(std::sync::Arc::new).collect(),
            tool_choice: None,
            parallel_tool_calls: true,
            temperature: None,
            max_tokens: None,
            service_tier: None,
            prompt_cache_key: None,
        }
    }

    #[test]
    fn request_body_has_the_responses_shape() {
        let reasoning =
            json!({"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "gAAA"});
        let mut req = request(
            vec![
                Message::System {
                    content: "be brief".into(),
                },
                Message::System {
                    content: "cite sources".into(),
                },
                user("weather?"),
                Message::Assistant {
                    content: Some("Checking.".into()),
                    tool_calls: vec![call("call_1", "f", "{\"a\":1}"), call("call_2", "g", "{}")],
                    opaque: vec![reasoning.clone()],
                },
                Message::Tool {
                    call_id: "call_1".into(),
                    content: "sunny".into(),
                },
                Message::Tool {
                    call_id: "call_2".into(),
                    content: "warm".into(),
                },
                Message::Assistant {
                    content: Some("Sunny and warm.".into()),
                    tool_calls: vec![],
                    opaque: vec![],
                },
                Message::System {
                    content: "late note".into(),
                },
                user("thanks"),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                    opaque: vec![],
                },
            ],
            vec![ToolSpec {
                name: "f".into(),
                description: "does f".into(),
                parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}),
                strict: true,
            }],
        );
        req.tool_choice = Some(ToolChoice::Function("f".into()));
        req.temperature = Some(0.5);
        req.max_tokens = Some(64);
        let body = serde_json::to_value(to_wire(&req, true, true)).expect("serialise");
        assert_eq!(
            body,
            json!({
                "model": "m",
                "instructions": "be brief",
                "input": [
                    // A second system message is the job's own: after the
                    // tools, not in the profile's stable instructions.
                    {"type": "message", "role": "system", "content": "cite sources"},
                    {"type": "message", "role": "user", "content": "weather?"},
                    reasoning,
                    {"type": "message", "role": "assistant", "content": "Checking."},
                    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}"},
                    {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"type": "function_call_output", "call_id": "call_2", "output": "warm"},
                    {"type": "message", "role": "assistant", "content": "Sunny and warm."},
                    {"type": "message", "role": "system", "content": "late note"},
                    {"type": "message", "role": "user", "content": "thanks"},
                    {"type": "message", "role": "assistant", "content": ""},
                ],
                "tools": [{"type": "function", "name": "f", "description": "does f",
                    "parameters": {"type": "object", "properties": {}, "additionalProperties": false},
                    "strict": true}],
                "tool_choice": {"type": "function", "name": "f"},
                "parallel_tool_calls": true,
                "temperature": 0.5,
                "max_output_tokens": 64,
                "stream": true,
                "store": false,
                "include": ["reasoning.encrypted_content"],
            })
        );
    }

    #[test]
    fn tool_fields_travel_only_with_tools() {
        let mut req = request(vec![user("hi")], vec![]);
        req.tool_choice = Some(ToolChoice::Required);
        let body = serde_json::to_value(to_wire(&req, false, false)).expect("serialise");
        assert_eq!(
            body,
            json!({
                "model": "m",
                "input": [{"type": "message", "role": "user", "content": "hi"}],
                "stream": false,
                "store": false,
            })
        );
        for (choice, want) in [
            (ToolChoice::Auto, json!("auto")),
            (ToolChoice::None, json!("none")),
            (ToolChoice::Required, json!("required")),
        ] {
            assert_eq!(tool_choice_to_wire(&choice), want);
        }
    }

    #[test]
    fn only_a_reasoning_model_is_asked_for_encrypted_reasoning() {
        let req = request(vec![user("hi")], vec![]);
        for stream in [false, true] {
            // OpenAI answers 400 to `include` for gpt-4o-mini and the like.
            let plain = serde_json::to_value(to_wire(&req, stream, false)).expect("serialise");
            assert!(plain.get("include").is_none(), "{plain}");
            let reasoning = serde_json::to_value(to_wire(&req, stream, true)).expect("serialise");
            assert_eq!(reasoning["include"], json!(["reasoning.encrypted_content"]));
            assert_eq!(reasoning["store"], json!(false));
        }
    }

    #[test]
    fn reasoning_items_without_encrypted_content_are_not_replayed() {
        // What a reasoning model sends back when `include` did not ask for
        // its encrypted content: with `store: false`, a dangling id.
        let bare = json!({"id": "rs_1", "type": "reasoning", "summary": []});
        let whole = json!({"id": "rs_2", "type": "reasoning", "summary": [],
            "encrypted_content": "gAAA"});
        let req = request(
            vec![
                user("weather?"),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![call("call_1", "f", "{}")],
                    opaque: vec![bare.clone()],
                },
                Message::Tool {
                    call_id: "call_1".into(),
                    content: "sunny".into(),
                },
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                    opaque: vec![bare.clone()],
                },
                user("and tomorrow?"),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                    opaque: vec![whole.clone()],
                },
            ],
            vec![],
        );
        for reasoning_model in [false, true] {
            let body =
                serde_json::to_value(to_wire(&req, false, reasoning_model)).expect("serialise");
            assert_eq!(
                body["input"],
                json!([
                    {"type": "message", "role": "user", "content": "weather?"},
                    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    // The turn stays, as an empty message.
                    {"type": "message", "role": "assistant", "content": ""},
                    {"type": "message", "role": "user", "content": "and tomorrow?"},
                    whole,
                ])
            );
        }
        let completion = |opaque: Vec<Value>| Completion {
            text: String::new(),
            refusal: None,
            tool_calls: vec![],
            finish_reason: FinishReason::Stop,
            usage: None,
            opaque,
            attempts: 1,
            time_to_first_token: None,
            queued: std::time::Duration::ZERO,
        };
        assert!(has_unreplayable_reasoning(&completion(vec![bare])));
        assert!(!has_unreplayable_reasoning(&completion(vec![whole])));
        assert!(!has_unreplayable_reasoning(&completion(vec![])));
    }

    #[test]
    fn non_streaming_body_becomes_a_completion() {
        let body = json!({
            "id": "resp_1", "object": "response", "status": "completed", "error": null,
            "output": [
                {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "enc"},
                {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
                {"id": "fc_1", "type": "function_call", "status": "completed",
                 "call_id": "call_1", "name": "f", "arguments": "{\"q\":1}"},
                {"id": "ws_1", "type": "web_search_call", "status": "completed"}
            ],
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                      "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
                      "total_tokens": 17}
        });
        let completion = completion_from_wire(body.to_string().as_bytes()).expect("parse");
        assert_eq!(completion.text, "Let me check.");
        assert_eq!(completion.tool_calls, [call("call_1", "f", "{\"q\":1}")]);
        assert_eq!(completion.finish_reason, FinishReason::ToolCalls);
        assert_eq!(completion.opaque, [body["output"][0].clone()]);
        assert_eq!(
            completion.usage,
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 7,
                total_tokens: 17,
                cached_tokens: 4,
                reasoning_tokens: 3
            })
        );
        assert_eq!(
            completion.assistant_message(),
            Message::Assistant {
                content: Some("Let me check.".into()),
                tool_calls: completion.tool_calls.clone(),
                opaque: completion.opaque.clone(),
            }
        );

        let refused = json!({"status": "completed", "output": [{"type": "message", "id": "m",
            "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]});
        let completion = completion_from_wire(refused.to_string().as_bytes()).expect("parse");
        assert_eq!(
            completion.refusal.as_deref(),
            Some("I can't help with that.")
        );
        assert_eq!(
            (completion.text.as_str(), completion.finish_reason),
            ("", FinishReason::Stop)
        );

        let cut = json!({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{\"q\""}]});
        let completion = completion_from_wire(cut.to_string().as_bytes()).expect("parse");
        assert_eq!(completion.finish_reason, FinishReason::Length);
        assert!(completion.is_truncated());
        assert_eq!(
            completion.tool_calls,
            [call("c", "f", "{\"q\"")],
            "kept, marked by finish_reason"
        );

        let failed =
            json!({"status": "failed", "error": {"code": "server_error", "message": "boom"}});
        let err = completion_from_wire(failed.to_string().as_bytes()).expect_err("failed");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Provider {
                code: Some("server_error".into())
            }
        );
        let err = completion_from_wire(br#"{"status": "in_progress"}"#).expect_err("unfinished");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
        let err = completion_from_wire(b"<html>").expect_err("not json");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
    }

    fn push_all(acc: &mut ResponsesStreamAccumulator, events: &[Value]) -> Vec<String> {
        let mut deltas = Vec::new();
        for event in events {
            if let Some(text) = acc.push(&event.to_string()).expect("event") {
                deltas.push(text);
            }
        }
        deltas
    }

    #[test]
    fn interleaved_items_are_kept_apart_by_item_id() {
        let mut acc = ResponsesStreamAccumulator::new();
        let deltas = push_all(
            &mut acc,
            &[
                json!({"type": "response.created", "response": {"status": "in_progress", "output": []}}),
                json!({"type": "response.output_item.added", "output_index": 1,
                    "item": {"type": "function_call", "id": "fc_b", "call_id": "call_b", "name": "g", "arguments": ""}}),
                json!({"type": "response.output_item.added", "output_index": 0,
                    "item": {"type": "function_call", "id": "fc_a", "call_id": "call_a", "name": "f", "arguments": ""}}),
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc_a", "output_index": 0, "delta": "{\"x\""}),
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc_b", "output_index": 1, "delta": "{}"}),
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc_a", "output_index": 0, "delta": ":1}"}),
                json!({"type": "response.output_item.added", "output_index": 2,
                    "item": {"type": "message", "id": "msg", "role": "assistant", "content": []}}),
                json!({"type": "response.output_text.delta", "item_id": "msg", "output_index": 2, "delta": "Hi "}),
                json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "delta": "ignored"}),
                json!({"type": "response.output_text.delta", "item_id": "msg", "output_index": 2, "delta": "there"}),
                json!({"type": "response.completed", "response": {"status": "completed",
                    "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}}}),
            ],
        );
        assert!(acc.is_finished() && acc.has_output());
        let completion = acc.finish().expect("finish");
        assert_eq!(deltas, ["Hi ", "there"]);
        assert_eq!(completion.text, "Hi there");
        assert_eq!(
            completion.tool_calls,
            [call("call_a", "f", "{\"x\":1}"), call("call_b", "g", "{}")],
            "in output_index order, not arrival order"
        );
        assert_eq!(completion.finish_reason, FinishReason::ToolCalls);
        assert_eq!(completion.usage.map(|u| u.total_tokens), Some(7));
    }

    #[test]
    fn final_events_fill_in_what_did_not_stream() {
        // A server that sends only whole items, and one that sends only
        // the final response.
        let mut acc = ResponsesStreamAccumulator::new();
        let deltas = push_all(
            &mut acc,
            &[
                json!({"type": "response.output_item.done", "output_index": 0,
                    "item": {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "whole"}]}}),
                json!({"type": "response.output_item.done", "output_index": 1,
                    "item": {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{}"}}),
                json!({"type": "response.completed", "response": {"output": [
                    {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "whole"}]},
                    {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{}"}]}}),
            ],
        );
        assert_eq!(deltas, ["whole"], "text is delivered once");
        let completion = acc.finish().expect("finish");
        assert_eq!(completion.text, "whole");
        assert_eq!(completion.tool_calls, [call("c", "f", "{}")]);

        let mut acc = ResponsesStreamAccumulator::new();
        let deltas = push_all(
            &mut acc,
            &[
                json!({"type": "response.completed", "response": {"output": [
                {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "late"}]}]}}),
            ],
        );
        assert_eq!(deltas, ["late"]);
        assert_eq!(acc.finish().expect("finish").text, "late");

        // `arguments.done` wins over the deltas; a refusal streams apart
        // from the text.
        let mut acc = ResponsesStreamAccumulator::new();
        push_all(
            &mut acc,
            &[
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "output_index": 0, "delta": "{\"a\""}),
                json!({"type": "response.function_call_arguments.done", "item_id": "fc", "output_index": 0, "arguments": "{\"a\":2}"}),
                json!({"type": "response.output_item.done", "output_index": 0,
                    "item": {"type": "function_call", "id": "fc", "call_id": "c", "name": "f"}}),
                json!({"type": "response.refusal.delta", "item_id": "m", "output_index": 1, "delta": "No"}),
                json!({"type": "response.refusal.delta", "item_id": "m", "output_index": 1, "delta": "pe"}),
                json!({"type": "response.completed", "response": {}}),
            ],
        );
        let completion = acc.finish().expect("finish");
        assert_eq!(completion.tool_calls, [call("c", "f", "{\"a\":2}")]);
        assert_eq!(completion.refusal.as_deref(), Some("Nope"));
    }

    #[test]
    fn incomplete_failed_and_broken_streams() {
        let mut acc = ResponsesStreamAccumulator::new();
        push_all(
            &mut acc,
            &[
                json!({"type": "response.output_item.added", "output_index": 0,
                    "item": {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": ""}}),
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "output_index": 0, "delta": "{\"q\":"}),
                json!({"type": "response.function_call_arguments.delta", "item_id": "fc2", "output_index": 1, "delta": "{"}),
                json!({"type": "response.incomplete", "response": {"status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"}}}),
            ],
        );
        let completion = acc.finish().expect("finish");
        assert_eq!(completion.finish_reason, FinishReason::Length);
        assert_eq!(
            completion.tool_calls,
            [call("c", "f", "{\"q\":")],
            "the nameless partial call is dropped, the named one kept"
        );

        let mut acc = ResponsesStreamAccumulator::new();
        let err = acc
            .push(r#"{"type":"error","code":"server_error","message":"The server had an error","param":null}"#)
            .expect_err("error event");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Provider {
                code: Some("server_error".into())
            }
        );
        assert!(err.is_retryable());
        assert!(err.to_string().contains("The server had an error"), "{err}");

        let mut acc = ResponsesStreamAccumulator::new();
        let err = acc
            .push(r#"{"type":"response.failed","response":{"status":"failed","error":null}}"#)
            .expect_err("failed");
        assert_eq!(err.kind(), &LlmErrorKind::Provider { code: None });

        let mut acc = ResponsesStreamAccumulator::new();
        acc.push(r#"{"type":"response.created","response":{}}"#)
            .expect("created");
        let err = acc
            .push(r#"{"type":"response.created","response":{}}"#)
            .expect_err("two responses");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);

        let mut acc = ResponsesStreamAccumulator::new();
        assert_eq!(
            acc.push("{oops").expect_err("garbage").kind(),
            &LlmErrorKind::Protocol
        );
        acc.push(
            r#"{"type":"response.output_text.delta","item_id":"m","output_index":0,"delta":"x"}"#,
        )
        .expect("delta");
        assert!(!acc.is_finished());
        assert_eq!(
            acc.finish().expect_err("no terminal").kind(),
            &LlmErrorKind::Protocol
        );

        // The event name stands in for a missing `type`.
        let mut acc = ResponsesStreamAccumulator::new();
        let event = SseEvent {
            event: Some("response.output_text.delta".into()),
            data: r#"{"item_id":"m","output_index":0,"delta":"named"}"#.into(),
            id: None,
        };
        assert_eq!(
            acc.push_event(&event).expect("event").as_deref(),
            Some("named")
        );
    }

    // -----------------------------------------------------------------------
    // Conformance: recorded api.openai.com streams (see
    // shared/conformance/SOURCES.md for provenance and the oracle table).

    const CONFORMANCE_DIR: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/conformance/openai-responses-events"
    );

    /// The HTTP body the provider sent: each recorded event line re-framed
    /// as `event: <type>\ndata: <line>\n\n`.
    fn reframe(jsonl: &str) -> Vec<u8> {
        let mut body = String::new();
        for line in jsonl.lines().filter(|l| !l.trim().is_empty()) {
            let event: Value = serde_json::from_str(line).expect("recorded event is JSON");
            let kind = event["type"].as_str().expect("recorded event has a type");
            body.push_str(&format!("event: {kind}\ndata: {line}\n\n"));
        }
        body.into_bytes()
    }

    /// One response of a replayed stream.
    struct Replayed {
        /// The `response` object of its `response.created`.
        created: Value,
        /// Its events, in order (from `response.created` on).
        events: Vec<Value>,
        /// Events that followed an error before the next response.
        after: Vec<Value>,
        result: Result<Completion, LlmError>,
        deltas: Vec<String>,
        had_output: bool,
    }

    struct Open {
        acc: ResponsesStreamAccumulator,
        created: Value,
        events: Vec<Value>,
        deltas: Vec<String>,
    }

    /// Decodes `bytes` in `chunk_size` pieces and reassembles each response
    /// separately: a stream may hold several (an agent loop recorded in one
    /// file), split at each `response.created` and terminal event.
    fn replay(bytes: &[u8], chunk_size: usize) -> Vec<Replayed> {
        let mut decoder = SseDecoder::new();
        let mut events = Vec::new();
        for chunk in bytes.chunks(chunk_size) {
            events.extend(decoder.push(chunk).expect("sse"));
        }
        events.extend(decoder.finish());
        let mut done: Vec<Replayed> = Vec::new();
        let mut open: Option<Open> = None;
        for event in events {
            let value: Value = serde_json::from_str(&event.data).expect("event JSON");
            assert_eq!(event.event.as_deref(), value["type"].as_str());
            if event.event.as_deref() == Some("response.created") {
                assert!(open.is_none(), "a response began before the last one ended");
                open = Some(Open {
                    acc: ResponsesStreamAccumulator::new(),
                    created: value["response"].clone(),
                    events: Vec::new(),
                    deltas: Vec::new(),
                });
            }
            let Some(current) = open.as_mut() else {
                done.last_mut()
                    .expect("an event before any response")
                    .after
                    .push(value);
                continue;
            };
            current.events.push(value);
            let pushed = current.acc.push_event(&event);
            let had_output = current.acc.has_output();
            match pushed {
                Ok(text) => {
                    current.deltas.extend(text);
                    if !current.acc.is_finished() {
                        continue;
                    }
                }
                Err(e) => {
                    let current = open.take().expect("open");
                    done.push(Replayed {
                        created: current.created,
                        events: current.events,
                        after: Vec::new(),
                        result: Err(e),
                        deltas: current.deltas,
                        had_output,
                    });
                    continue;
                }
            }
            let current = open.take().expect("open");
            done.push(Replayed {
                created: current.created,
                events: current.events,
                after: Vec::new(),
                result: current.acc.finish(),
                deltas: current.deltas,
                had_output,
            });
        }
        assert!(open.is_none(), "the stream ended inside a response");
        done
    }

    fn events_of<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
        events.iter().filter(|e| e["type"] == kind).collect()
    }

    /// Validates every reassembled call against the JSON Schema the request
    /// declared for it (echoed in `response.created`).
    fn assert_arguments_match_schemas(replayed: &Replayed, completion: &Completion, ctx: &str) {
        for call in &completion.tool_calls {
            let tools = replayed.created["tools"].as_array().expect("tools echoed");
            let declared = tools
                .iter()
                .find(|t| t["type"] == "function" && t["name"] == call.name.as_str())
                .unwrap_or_else(|| panic!("{ctx}: {} was not declared", call.name));
            let validator = Validator::compile(&declared["parameters"]).expect("schema compiles");
            let arguments: Value = serde_json::from_str(&call.arguments).expect("arguments JSON");
            validator
                .validate(&arguments)
                .unwrap_or_else(|v| panic!("{ctx}: {} arguments invalid: {v:?}", call.name));
        }
    }

    /// The one function call of a response: its id, name, arguments, the
    /// output index it streamed at and how many argument deltas it took.
    fn check_single_call(
        replayed: &Replayed,
        completion: &Completion,
        want: (&str, &str, &str, u64, Option<usize>),
        ctx: &str,
    ) {
        let (call_id, name, arguments, output_index, delta_count) = want;
        if !call_id.is_empty() {
            assert_eq!(completion.tool_calls[0].id, call_id, "{ctx}");
        }
        assert_eq!(completion.tool_calls.len(), 1, "{ctx}");
        assert_eq!(completion.tool_calls[0].name, name, "{ctx}");
        assert_eq!(completion.tool_calls[0].arguments, arguments, "{ctx}");
        assert_eq!(completion.finish_reason, FinishReason::ToolCalls, "{ctx}");
        let added = events_of(&replayed.events, "response.output_item.added");
        let head = added
            .iter()
            .find(|e| e["item"]["type"] == "function_call")
            .expect("function_call added");
        assert_eq!(head["output_index"], json!(output_index), "{ctx}");
        let deltas = events_of(&replayed.events, "response.function_call_arguments.delta");
        if let Some(count) = delta_count {
            assert_eq!(deltas.len(), count, "{ctx}");
        }
        let joined: String = deltas.iter().filter_map(|d| d["delta"].as_str()).collect();
        assert_eq!(joined, arguments, "{ctx}: the deltas add up");
        let done = events_of(&replayed.events, "response.function_call_arguments.done");
        assert_eq!(done[0]["arguments"], json!(arguments), "{ctx}");
        assert_arguments_match_schemas(replayed, completion, ctx);
    }

    fn check_file(file: &str, replayed: &[Replayed], ctx: &str) {
        let completion = |i: usize| -> &Completion {
            replayed[i]
                .result
                .as_ref()
                .unwrap_or_else(|e| panic!("{ctx}: response {i} failed: {e}"))
        };
        let total = |i: usize| completion(i).usage.expect("usage").total_tokens;
        match file {
            "openai-client-tool-search.2.chunks.jsonl" => {
                assert_eq!(replayed.len(), 1, "{ctx}");
                check_single_call(
                    &replayed[0],
                    completion(0),
                    (
                        "call_Q7pq6EfVGRnauPLWSSYBGJ1l",
                        "get_weather",
                        r#"{"location":"San Francisco, CA","unit":"fahrenheit"}"#,
                        0,
                        Some(13),
                    ),
                    ctx,
                );
                assert_eq!(total(0), 493, "{ctx}");
                assert_eq!(completion(0).text, "", "{ctx}");
                assert!(completion(0).opaque.is_empty(), "{ctx}");
            }
            "openai-reasoning-encrypted-content.1.chunks.jsonl" => {
                assert_eq!(replayed.len(), 4, "{ctx}: four responses of one agent loop");
                let first = completion(0);
                check_single_call(
                    &replayed[0],
                    first,
                    ("", "calculator", r#"{"a":12,"b":7,"op":"add"}"#, 1, None),
                    ctx,
                );
                let added = events_of(&replayed[0].events, "response.output_item.added");
                assert_eq!(added[0]["item"]["type"], json!("reasoning"), "{ctx}");
                assert_eq!(added[0]["output_index"], json!(0), "{ctx}");
                // The reasoning item comes back whole, as the final
                // response listed it, ready to be replayed.
                assert_eq!(first.opaque.len(), 1, "{ctx}");
                let completed = events_of(&replayed[0].events, "response.completed");
                assert_eq!(
                    first.opaque[0], completed[0]["response"]["output"][0],
                    "{ctx}"
                );
                assert!(first.opaque[0]["encrypted_content"].is_string(), "{ctx}");
                let Message::Assistant { opaque, .. } = first.assistant_message() else {
                    unreachable!()
                };
                assert_eq!(opaque, first.opaque, "{ctx}");
                for (i, arguments) in [
                    (1, r#"{"a":19,"b":3,"op":"multiply"}"#),
                    (2, r#"{"a":57,"b":10,"op":"multiply"}"#),
                ] {
                    check_single_call(
                        &replayed[i],
                        completion(i),
                        ("", "calculator", arguments, 0, None),
                        ctx,
                    );
                    assert!(completion(i).opaque.is_empty(), "{ctx}");
                }
                let last = completion(3);
                assert_eq!(last.text, "The final result is **570**.", "{ctx}");
                assert_eq!(replayed[3].deltas.concat(), last.text, "{ctx}");
                assert_eq!(last.finish_reason, FinishReason::Stop, "{ctx}");
                assert!(last.tool_calls.is_empty(), "{ctx}");
                let totals: Vec<u64> = (0..4).map(total).collect();
                assert_eq!(totals, [162, 247, 286, 311], "{ctx}");
            }
            "openai-error.1.chunks.jsonl" => {
                assert_eq!(replayed.len(), 1, "{ctx}");
                let err = replayed[0].result.as_ref().expect_err("an error stream");
                assert_eq!(
                    err.kind(),
                    &LlmErrorKind::Provider {
                        code: Some("insufficient_quota".into())
                    },
                    "{ctx}"
                );
                assert_eq!(err.code(), "insufficient_quota", "{ctx}");
                assert!(!err.is_retryable(), "{ctx}");
                assert!(!replayed[0].had_output, "{ctx}: no output items");
                assert!(replayed[0].deltas.is_empty(), "{ctx}");
                assert!(
                    events_of(&replayed[0].events, "response.output_item.added").is_empty(),
                    "{ctx}"
                );
                let failed = events_of(&replayed[0].after, "response.failed");
                assert_eq!(failed[0]["response"]["status"], json!("failed"), "{ctx}");
                // `response.failed` on its own says the same.
                let mut acc = ResponsesStreamAccumulator::new();
                let err = acc
                    .push(&failed[0].to_string())
                    .expect_err("response.failed");
                assert_eq!(err.code(), "insufficient_quota", "{ctx}");
            }
            other => panic!("{other}: new fixture without an expectation here"),
        }
    }

    #[test]
    fn conformance_streams_reassemble_exactly() {
        let dir = Path::new(CONFORMANCE_DIR);
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| {
            panic!(
                "conformance fixtures are expected in {} (shared/conformance/openai-responses-events \
                 next to the crate; see shared/conformance/SOURCES.md): {e}",
                dir.display()
            )
        });
        let mut seen = Vec::new();
        for entry in entries {
            let path = entry.expect("dir entry").path();
            let file = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("utf-8 name")
                .to_owned();
            if !file.ends_with(".jsonl") {
                continue;
            }
            let bytes = reframe(&std::fs::read_to_string(&path).expect("read fixture"));
            for chunk_size in [1, 7, 64, 1024, bytes.len()] {
                let ctx = format!("{file} in {chunk_size}-byte chunks");
                check_file(&file, &replay(&bytes, chunk_size), &ctx);
            }
            seen.push(file);
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                "openai-client-tool-search.2.chunks.jsonl",
                "openai-error.1.chunks.jsonl",
                "openai-reasoning-encrypted-content.1.chunks.jsonl",
            ],
            "every fixture listed in SOURCES.md must be replayed"
        );
    }

    /// What the stand-in received over the Responses API: the profile's
    /// system prompt as `instructions`, then the tools in the request's
    /// order, then the input, with a job's own system message in it, after
    /// the tools (in that order in the body too); `prompt_cache_key` only
    /// from a deployment that accepts it.
    #[tokio::test]
    async fn the_stand_in_gets_a_stable_beginning_and_the_cache_key_only_where_accepted() {
        use crate::chat_wire::tests::{spec, stand_in, stand_in_client};
        let server = stand_in().await;
        let mut req = request(
            vec![
                Message::System {
                    content: "sys".into(),
                },
                Message::System {
                    content: "the job's own".into(),
                },
                user("hi"),
            ],
            vec![
                spec("alpha", false),
                spec("mid", true),
                spec("added", false),
            ],
        );
        req.prompt_cache_key = Some("tf-0123456789abcdef".into());
        let text = serde_json::to_string(&to_wire(&req, true, false)).expect("serialise");
        let at = |key: &str| text.find(&format!("\"{key}\":")).expect(key);
        assert!(
            at("instructions") < at("tools") && at("tools") < at("input"),
            "{text}"
        );
        for send_key in [true, false] {
            let client = stand_in_client(&server, crate::ApiShape::Responses, send_key);
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
                .filter_map(|t| t["name"].as_str())
                .collect();
            assert_eq!(names, ["alpha", "mid", "added"]);
            assert_eq!(body["instructions"], "sys");
            assert_eq!(
                body["input"][0],
                json!({"type": "message", "role": "system", "content": "the job's own"})
            );
            assert_eq!(body["input"][1]["role"], "user");
        }
        assert_eq!(bodies[0]["prompt_cache_key"], "tf-0123456789abcdef");
        assert!(bodies[1].get("prompt_cache_key").is_none(), "{}", bodies[1]);
    }
}
