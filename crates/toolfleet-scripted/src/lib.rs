//! The scripted model server: a stand-in for an OpenAI-compatible provider,
//! so tests and the offline demo run with no real model. It says so: the
//! start-up log line, the `system_fingerprint` of every response and the
//! `owned_by` of `GET /v1/models` all name it a scripted stand-in.
//!
//! It serves both OpenAI API shapes from the same script:
//!
//! - `POST /v1/chat/completions`: streaming SSE (`data: {..}\n\n` chunks
//!   ending in `data: [DONE]`) or one JSON body;
//! - `POST /v1/responses`: streaming SSE with `event: <type>` lines
//!   (`response.created`, `response.in_progress`,
//!   `response.output_item.added`, `response.output_text.delta`,
//!   `response.function_call_arguments.delta` / `.done`,
//!   `response.output_item.done`, `response.completed` or
//!   `response.incomplete`) or one response object;
//! - `GET /v1/models`.
//!
//! It answers by following a JSON script instead of thinking, can inject
//! faults (error statuses, cut streams, malformed chunks, slow first tokens,
//! truncation) per script step, and records what happened so tests can
//! assert it: every request with its receive time, path, query, headers,
//! body and injected fault ([`ScriptedServer::received`],
//! [`ScriptedServer::requests`], [`ScriptedServer::fault_hits`]), and how
//! every streamed body ended ([`ScriptedServer::stream_stats`]), including
//! streams the client walked away from.
//!
//! # Script format
//!
//! ```json
//! {
//!   "description": "optional free text, ignored",
//!   "model": "toolfleet-scripted",
//!   "reasoningModel": true,
//!   "chunkDelayMs": 0,
//!   "firstTokenDelayMs": 0,
//!   "rules": [
//!     {
//!       "description": "optional free text, ignored",
//!       "whenUserContains": ["time", "tide"],
//!       "steps": [
//!         { "reasoning": true,
//!           "fault": { "kind": "status", "status": 429, "retryAfterMs": 200, "times": 1 },
//!           "toolCalls": [
//!             { "name": "current_datetime", "arguments": {} },
//!             { "name": "search_data_sources", "arguments": { "query": "tides" } } ] },
//!         { "answer": "It is {{tool:current_datetime}}. The documents say: {{tool:search_data_sources}}" }
//!       ]
//!     },
//!     { "whenUserContains": ["weapon"], "steps": [ { "refusal": "I can't help with that." } ] }
//!   ],
//!   "default": { "steps": [ { "answer": "I have no script for that." } ] }
//! }
//! ```
//!
//! Keys are camelCase; unknown keys are an error, so a typo never silently
//! changes behaviour.
//!
//! - `model` (optional, default `toolfleet-scripted`): the model id in every
//!   response and in `GET /v1/models`, whatever the request asked for.
//! - `reasoningModel` (optional): whether the model stands in for a
//!   reasoning model (o-series, gpt-5). Default: `true` when any step has
//!   `"reasoning": true`, else `false`; `false` next to such a step is an
//!   error (only a reasoning model reasons). Like OpenAI, a Responses
//!   request for a model that is not one is refused when it asks for
//!   `include: ["reasoning.encrypted_content"]` (see *Request checks*).
//! - `chunkDelayMs` (optional, default 0): pause before each streamed chunk
//!   or event.
//! - `firstTokenDelayMs` (optional, default 0): a slow model: every
//!   response's headers go out at once and its first chunk or event only
//!   after this pause (non-streaming: the whole response waits), on top of
//!   any `slowFirstToken` fault. `toolfleet scripted-model
//!   --first-token-delay-ms` and `toolfleet bench --model-delay-ms` set it
//!   without editing the script ([`Script::with_first_token_delay`]).
//! - `imageBytes` (optional, default 3 MiB): the size of a `b64_json`
//!   image before encoding.
//! - `rules` (optional): tried in order; the first rule that matches
//!   answers. A rule matches when any `whenUserContains` phrase is inside
//!   the *last* user message (compared case-insensitively as substrings)
//!   and, if it has `whenModel`, the request's `model` is one of those
//!   (a per-model failure: `{"whenModel": ["gpt-broken"], "steps":
//!   [{"answer": "-", "fault": {"kind": "status", "status": 503}}]}`).
//!   Each rule needs a phrase or a model (or both) and at least one step.
//! - `default` (optional): the steps used when no rule matches; without it
//!   the server answers "I have no script for that."
//! - A step has exactly one of:
//!   - `toolCalls`: a non-empty list of `{ "name", "arguments" }`, with
//!     `arguments` a JSON object (default `{}`). All calls go out in one
//!     response, as parallel tool calls, with unique `call_<random>` ids.
//!     Chat Completions: `finish_reason: "tool_calls"`; streamed, each call
//!     is split the way OpenAI splits it: a first chunk with `index`, `id`,
//!     `type` and `function.name` and empty arguments, then argument
//!     fragments carrying only `index`. Responses: one `function_call`
//!     item per call (`id` `fc_..`, `call_id`, `name`, `arguments`), its
//!     arguments streamed as `response.function_call_arguments.delta`
//!     events.
//!   - `answer`: a text template, streamed a few words per chunk, ending
//!     with `finish_reason: "stop"` (Responses: one `message` item with an
//!     `output_text` part). Placeholders:
//!     - `{{tool:NAME}}`: the content of the most recent tool result that
//!       answers a call to function `NAME` (a Chat `tool` message or a
//!       Responses `function_call_output`, matched through the call ids).
//!       Long results are cut to about 400 characters, and every `[doc:N]`
//!       marker of the full result that the cut dropped is appended, so
//!       citations survive. `NAME` must be called by a `toolCalls` step of
//!       the same rule.
//!     - `{{citations}}`: every distinct `[doc:N]` marker in any message of
//!       the request, in order of first appearance, space-separated.
//!     - `{{user}}`: the last user message.
//!   - `refusal`: a fixed refusal text. Chat Completions: `delta.refusal`
//!     chunks (non-streaming: `message.refusal`), content `null`,
//!     `finish_reason: "stop"`. Responses: a `message` item with a
//!     `refusal` content part, streamed as `response.refusal.delta`.
//!
//!   and optionally:
//!   - `reasoning` (default `false`): Responses only: a `reasoning` output
//!     item comes first, at `output_index` 0, and the usage counts reasoning
//!     tokens. The item carries a labelled fake `encrypted_content` only when
//!     the request's `include` asks for `reasoning.encrypted_content`, as
//!     with OpenAI. Chat Completions ignores it.
//!   - `fault`: something to go wrong when this step is played, see below.
//!
//! The step to play is the number of assistant turns with tool calls after
//! the last user message: step 0 on the first call, step 1 after one tool
//! round, and so on. When the steps run out the last one is replayed,
//! except that a last `toolCalls` step is replaced by a plain fallback answer
//! (without its fault) so an agent loop cannot spin forever. A request that
//! says `tool_choice: "none"` never gets tool calls: a `toolCalls` step is
//! answered with the rule's next `answer` step instead, as a real model told
//! to answer would.
//!
//! Streaming Chat Completions honours `stream_options.include_usage` with a
//! trailing usage-only chunk (`choices: []`); Responses always reports usage
//! in its terminal event. Token counts are estimates (characters / 4),
//! plausible rather than exact.
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
//!
//! # Request checks
//!
//! Like OpenAI, it answers 400 with `{"error":{"message","type":
//! "invalid_request_error","param","code"}}` to a body that is not JSON
//! (`invalid_json`), a missing `model` or `messages` / `input`
//! (`missing_required_parameter`), empty `messages` / `input`
//! (`empty_array`), an unknown role or input item type (`invalid_value`),
//! a tool result that answers no preceding tool call, or a tool call left
//! without a result (code `null`). On `POST /v1/responses` it also answers,
//! with code `null`:
//!
//! - 400 `Encrypted content is not supported with this model.` (`param`
//!   `include`) when `include` lists `reasoning.encrypted_content` and the
//!   script is not a reasoning model (`reasoningModel`): what OpenAI answers
//!   for gpt-4o, gpt-4o-mini and the like;
//! - 404 `Item with id '..' not found. Items are not persisted when
//!   `store` is set to false. ..` (`param` `input`) for a `reasoning` input
//!   item without `encrypted_content` in a `store: false` request: such an
//!   item is a bare reference to state the provider never kept.
//!
//! Being as strict as the real API catches conversation bugs in tests
//! rather than in production.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use url::Url;

/// The model id when the script names none.
pub const DEFAULT_MODEL: &str = "toolfleet-scripted";
/// Sent as `system_fingerprint` on every response (Chat Completions and
/// Responses alike): anyone reading a recorded response can tell it did
/// not come from a real model.
pub const SYSTEM_FINGERPRINT: &str = "fp_toolfleet_scripted_stand_in";
/// The answer when no rule matches and the script has no `default`.
const NO_SCRIPT_ANSWER: &str = "I have no script for that.";
/// Replaces a `toolCalls` step replayed past the end of a rule.
const FALLBACK_ANSWER: &str =
    "(scripted stand-in) The script has no further steps for this conversation.";
/// About how much of a tool result `{{tool:NAME}}` quotes.
const EXCERPT_CHARS: usize = 400;
/// Words per streamed answer chunk.
const WORDS_PER_CHUNK: usize = 3;
/// Characters per streamed tool-argument fragment.
const ARGUMENT_FRAGMENT_CHARS: usize = 6;
/// Reasoning tokens reported for a step with `"reasoning": true`.
const REASONING_TOKENS: u64 = 16;
/// Requests kept for [`ScriptedServer::received`]; the oldest go first, so
/// a long-running demo server does not grow without bound.
const MAX_RECORDED_REQUESTS: usize = 1000;
/// Request bodies carry whole conversations with tool results.
const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;
/// Pause before a scripted cut, so the frames before it are flushed to the
/// client first rather than lost with the connection.
const CUT_FLUSH_PAUSE: Duration = Duration::from_millis(20);

// ---------------------------------------------------------------------------
// Script

/// A script could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("cannot read script {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("script{}: {source}", at(path))]
    Parse {
        path: Option<PathBuf>,
        source: serde_json::Error,
    },
    #[error("script{}: {message}", at(path))]
    Invalid {
        path: Option<PathBuf>,
        message: String,
    },
}

fn at(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

impl ScriptError {
    fn in_file(self, file: &Path) -> Self {
        match self {
            Self::Parse { source, .. } => Self::Parse {
                path: Some(file.to_owned()),
                source,
            },
            Self::Invalid { message, .. } => Self::Invalid {
                path: Some(file.to_owned()),
                message,
            },
            read @ Self::Read { .. } => read,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawScript {
    /// Lets a script explain itself; never read.
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    model: Option<String>,
    reasoning_model: Option<bool>,
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    first_token_delay_ms: u64,
    image_bytes: Option<usize>,
    #[serde(default)]
    rules: Vec<RawRule>,
    default: Option<RawDefault>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawRule {
    /// Lets a rule explain itself; never read.
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    #[serde(default)]
    when_user_contains: Vec<String>,
    #[serde(default)]
    when_model: Vec<String>,
    steps: Vec<RawStep>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawDefault {
    steps: Vec<RawStep>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawStep {
    tool_calls: Option<Vec<RawCall>>,
    answer: Option<String>,
    refusal: Option<String>,
    #[serde(default)]
    reasoning: bool,
    fault: Option<RawFault>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

/// Flat rather than a tagged enum so that a key used with the wrong kind
/// gets a message naming both.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFault {
    kind: String,
    status: Option<u16>,
    retry_after_ms: Option<u64>,
    retry_after: Option<u64>,
    code: Option<String>,
    message: Option<String>,
    delay_ms: Option<u64>,
    times: Option<u32>,
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// A validated script. See the module docs for the format.
#[derive(Clone, Debug)]
pub struct Script {
    model: String,
    /// Stands in for a reasoning model: may be asked for encrypted
    /// reasoning.
    reasoning_model: bool,
    chunk_delay: Duration,
    /// Added to every response's first chunk (a slow model).
    first_token_delay: Duration,
    /// Size of a `b64_json` image before encoding (`imageBytes`).
    image_bytes: usize,
    rules: Vec<Rule>,
    default: Vec<Step>,
}

#[derive(Clone, Debug)]
struct Rule {
    /// Lower-cased once here; requests are lower-cased per call. Empty:
    /// any user message (the rule then names models).
    phrases: Vec<String>,
    /// The request's `model` must be one of these; empty: any model.
    models: Vec<String>,
    steps: Vec<Step>,
}

/// One scripted model turn: what the model says, and what goes wrong.
#[derive(Clone, Debug)]
struct Step {
    action: Action,
    reasoning: bool,
    fault: Option<Fault>,
}

impl Step {
    fn answer(text: &str) -> Self {
        Self {
            action: Action::Answer(Template {
                parts: vec![Part::Text(text.to_owned())],
            }),
            reasoning: false,
            fault: None,
        }
    }
}

#[derive(Clone, Debug)]
enum Action {
    ToolCalls(Vec<ScriptedCall>),
    Answer(Template),
    Refusal(String),
}

#[derive(Clone, Debug)]
struct ScriptedCall {
    name: String,
    /// JSON text, as a model would produce it.
    arguments: String,
}

/// An injected failure and how many requests get it.
#[derive(Clone, Debug, PartialEq)]
struct Fault {
    kind: FaultKind,
    /// `None`: every request.
    times: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
enum FaultKind {
    Status {
        status: StatusCode,
        retry_after_ms: Option<u64>,
        retry_after_secs: Option<u64>,
        code: Option<String>,
        message: Option<String>,
    },
    CutMidToolCall,
    CutMidText,
    MalformedChunk,
    SlowFirstToken(Duration),
    Length,
}

impl FaultKind {
    /// The script's name for the kind, as recorded in [`Received::fault`].
    fn name(&self) -> &'static str {
        match self {
            Self::Status { .. } => "status",
            Self::CutMidToolCall => "cutMidToolCall",
            Self::CutMidText => "cutMidText",
            Self::MalformedChunk => "malformedChunk",
            Self::SlowFirstToken(_) => "slowFirstToken",
            Self::Length => "length",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Template {
    parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Text(String),
    Tool(String),
    Citations,
    User,
}

/// Identifies a step for fault counting: rule index (`None` for
/// `default`) and step index.
type StepKey = (Option<usize>, usize);

impl Script {
    /// Parses and validates a script.
    pub fn from_json(text: &str) -> Result<Self, ScriptError> {
        let raw: RawScript = serde_json::from_str(text)
            .map_err(|source| ScriptError::Parse { path: None, source })?;
        Self::from_raw(raw).map_err(|message| ScriptError::Invalid {
            path: None,
            message,
        })
    }

    /// Reads, parses and validates a script file.
    pub fn load(path: &Path) -> Result<Self, ScriptError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScriptError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json(&text).map_err(|e| e.in_file(path))
    }

    /// The model id the server reports.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The pause before every response's first chunk (`firstTokenDelayMs`).
    pub fn first_token_delay(&self) -> Duration {
        self.first_token_delay
    }

    /// Replaces `firstTokenDelayMs`: every response waits `delay` before
    /// its first chunk (a slow model, for benchmarks and timeout tests).
    pub fn with_first_token_delay(mut self, delay: Duration) -> Self {
        self.first_token_delay = delay;
        self
    }

    /// The pause before each streamed chunk (`chunkDelayMs`).
    pub fn chunk_delay(&self) -> Duration {
        self.chunk_delay
    }

    /// Replaces `chunkDelayMs`.
    pub fn with_chunk_delay(mut self, delay: Duration) -> Self {
        self.chunk_delay = delay;
        self
    }

    /// Whether the script stands in for a reasoning model (`reasoningModel`,
    /// or a step with `"reasoning": true`).
    pub fn is_reasoning_model(&self) -> bool {
        self.reasoning_model
    }

    fn from_raw(raw: RawScript) -> Result<Self, String> {
        let model = match raw.model {
            Some(model) if model.trim().is_empty() => {
                return Err("`model` must not be empty".to_owned());
            }
            Some(model) => model,
            None => DEFAULT_MODEL.to_owned(),
        };
        let mut rules = Vec::with_capacity(raw.rules.len());
        for (i, rule) in raw.rules.into_iter().enumerate() {
            let at = format!("rules[{i}]");
            let phrases: Vec<String> = rule
                .when_user_contains
                .iter()
                .map(|p| p.trim().to_lowercase())
                .collect();
            if phrases.iter().any(String::is_empty) {
                return Err(format!("{at}.whenUserContains must not list empty phrases"));
            }
            if rule.when_model.iter().any(|m| m.trim().is_empty()) {
                return Err(format!("{at}.whenModel must not list empty models"));
            }
            if phrases.is_empty() && rule.when_model.is_empty() {
                return Err(format!(
                    "{at} needs a condition: whenUserContains (at least one phrase), \
                     whenModel, or both"
                ));
            }
            rules.push(Rule {
                phrases,
                models: rule.when_model,
                steps: steps_from_raw(&at, rule.steps)?,
            });
        }
        let default = match raw.default {
            Some(default) => steps_from_raw("default", default.steps)?,
            None => vec![Step::answer(NO_SCRIPT_ANSWER)],
        };
        let reasons = rules
            .iter()
            .flat_map(|rule| &rule.steps)
            .chain(&default)
            .any(|step| step.reasoning);
        let reasoning_model = match raw.reasoning_model {
            Some(false) if reasons => {
                return Err(
                    "`reasoningModel` is false, but a step has `\"reasoning\": true`: \
                     only a reasoning model produces reasoning items"
                        .to_owned(),
                );
            }
            Some(declared) => declared,
            None => reasons,
        };
        Ok(Self {
            model,
            reasoning_model,
            chunk_delay: Duration::from_millis(raw.chunk_delay_ms),
            first_token_delay: Duration::from_millis(raw.first_token_delay_ms),
            image_bytes: raw.image_bytes.unwrap_or(DEFAULT_IMAGE_BYTES),
            rules,
            default,
        })
    }

    /// The rule index (`None` for the default) and steps for a
    /// conversation whose last user message is `user`, asked of `model`.
    fn steps_for(&self, user: &str, model: &str) -> (Option<usize>, &[Step]) {
        let user = user.to_lowercase();
        self.rules
            .iter()
            .enumerate()
            .find(|(_, rule)| {
                (rule.phrases.is_empty() || rule.phrases.iter().any(|p| user.contains(p.as_str())))
                    && (rule.models.is_empty() || rule.models.iter().any(|m| m == model))
            })
            .map_or((None, self.default.as_slice()), |(i, rule)| {
                (Some(i), rule.steps.as_slice())
            })
    }
}

fn steps_from_raw(at: &str, raw: Vec<RawStep>) -> Result<Vec<Step>, String> {
    if raw.is_empty() {
        return Err(format!("{at}.steps must not be empty"));
    }
    let mut steps = Vec::with_capacity(raw.len());
    for (i, step) in raw.into_iter().enumerate() {
        let at = format!("{at}.steps[{i}]");
        let action = match (step.tool_calls, step.answer, step.refusal) {
            (Some(calls), None, None) => {
                if calls.is_empty() {
                    return Err(format!("{at}.toolCalls must not be empty"));
                }
                let mut scripted = Vec::with_capacity(calls.len());
                for (j, call) in calls.into_iter().enumerate() {
                    if call.name.trim().is_empty() {
                        return Err(format!("{at}.toolCalls[{j}].name must not be empty"));
                    }
                    if !call.arguments.is_object() {
                        return Err(format!(
                            "{at}.toolCalls[{j}].arguments must be a JSON object"
                        ));
                    }
                    scripted.push(ScriptedCall {
                        name: call.name,
                        arguments: call.arguments.to_string(),
                    });
                }
                Action::ToolCalls(scripted)
            }
            (None, Some(answer), None) => {
                Action::Answer(parse_template(&answer).map_err(|e| format!("{at}.answer: {e}"))?)
            }
            (None, None, Some(refusal)) => {
                if refusal.trim().is_empty() {
                    return Err(format!("{at}.refusal must not be empty"));
                }
                Action::Refusal(refusal)
            }
            _ => {
                return Err(format!(
                    "{at} needs exactly one of `toolCalls`, `answer` or `refusal`"
                ));
            }
        };
        let fault = match step.fault {
            Some(raw) => Some(fault_from_raw(&format!("{at}.fault"), raw, &action)?),
            None => None,
        };
        steps.push(Step {
            action,
            reasoning: step.reasoning,
            fault,
        });
    }
    // A placeholder for a tool this rule never calls is a typo, and would
    // otherwise only show up as an odd sentence in a demo.
    let called: Vec<&str> = steps
        .iter()
        .filter_map(|s| match &s.action {
            Action::ToolCalls(calls) => Some(calls.iter().map(|c| c.name.as_str())),
            Action::Answer(_) | Action::Refusal(_) => None,
        })
        .flatten()
        .collect();
    for (i, step) in steps.iter().enumerate() {
        if let Action::Answer(template) = &step.action {
            for part in &template.parts {
                if let Part::Tool(name) = part
                    && !called.contains(&name.as_str())
                {
                    return Err(format!(
                        "{at}.steps[{i}].answer uses {{{{tool:{name}}}}} but no step of this rule calls `{name}`"
                    ));
                }
            }
        }
    }
    Ok(steps)
}

const FAULT_KINDS: &str =
    "status, cutMidToolCall, cutMidText, malformedChunk, slowFirstToken, length";

fn fault_from_raw(at: &str, raw: RawFault, action: &Action) -> Result<Fault, String> {
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
    let step_kind = match action {
        Action::ToolCalls(_) => "toolCalls",
        Action::Answer(_) => "answer",
        Action::Refusal(_) => "refusal",
    };
    let needs = |ok: bool, which: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{at}: kind `{}` needs a {which} step, not `{step_kind}`",
                raw.kind
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
            FaultKind::Status {
                status,
                retry_after_ms: raw.retry_after_ms,
                retry_after_secs: raw.retry_after,
                code: raw.code,
                message: raw.message,
            }
        }
        "cutMidToolCall" => {
            needs(matches!(action, Action::ToolCalls(_)), "`toolCalls`")?;
            FaultKind::CutMidToolCall
        }
        "cutMidText" => {
            needs(
                matches!(action, Action::Answer(_) | Action::Refusal(_)),
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
                matches!(action, Action::ToolCalls(_) | Action::Answer(_)),
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

fn parse_template(text: &str) -> Result<Template, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find("{{") {
        if open > 0 {
            parts.push(Part::Text(rest[..open].to_owned()));
        }
        let after = &rest[open + 2..];
        let close = after
            .find("}}")
            .ok_or_else(|| format!("unclosed `{{{{` at {:?}", shorten(&rest[open..], 30)))?;
        let inner = after[..close].trim();
        let part = match inner {
            "citations" => Part::Citations,
            "user" => Part::User,
            _ => match inner.strip_prefix("tool:").map(str::trim) {
                Some(name) if !name.is_empty() => Part::Tool(name.to_owned()),
                _ => {
                    return Err(format!(
                        "unknown placeholder {{{{{inner}}}}}; known ones are {{{{tool:NAME}}}}, {{{{citations}}}} and {{{{user}}}}"
                    ));
                }
            },
        };
        parts.push(part);
        rest = &after[close + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_owned()));
    }
    Ok(Template { parts })
}

fn shorten(text: &str, chars: usize) -> &str {
    text.char_indices()
        .nth(chars)
        .map_or(text, |(cut, _)| &text[..cut])
}

// ---------------------------------------------------------------------------
// Reading a request

/// An OpenAI-shaped error response.
#[derive(Debug, PartialEq)]
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn invalid(
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&'static str>,
    ) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_owned),
            code,
        }
    }
}

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
fn check_model_support(script: &Script, request: &Value) -> Result<(), ApiError> {
    if includes(request, ENCRYPTED_REASONING) && !script.reasoning_model {
        return Err(ApiError::invalid(
            "Encrypted content is not supported with this model.",
            Some("include"),
            None,
        ));
    }
    Ok(())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// One message of a request, reduced to what the script needs.
#[derive(Debug)]
struct Turn {
    role: String,
    text: String,
    /// `(id, function name)` of an assistant message's tool calls.
    calls: Vec<(String, String)>,
    /// A tool message's `tool_call_id`.
    call_id: Option<String>,
}

/// Message content is a string or, in the newer shape, a list of parts.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Checks a request the way the real API would and extracts its turns.
fn read_request(body: &Value) -> Result<Vec<Turn>, ApiError> {
    let Some(object) = body.as_object() else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_json"),
        ));
    };
    if !object.get("model").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(
            "Missing required parameter: 'model'.",
            Some("model"),
            Some("missing_required_parameter"),
        ));
    }
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

/// Checks a Responses API request the way the real API would and extracts
/// its turns: `instructions` becomes a system turn, message items keep
/// their role, consecutive `function_call` items form one assistant turn
/// with calls (joined to an assistant message right before them), and
/// `function_call_output` items become tool turns. Reasoning items are
/// skipped, once checked to be replayable: in a `store: false` request
/// only with their `encrypted_content`.
fn read_responses_request(body: &Value) -> Result<Vec<Turn>, ApiError> {
    let Some(object) = body.as_object() else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_json"),
        ));
    };
    if !object.get("model").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(
            "Missing required parameter: 'model'.",
            Some("model"),
            Some("missing_required_parameter"),
        ));
    }
    let mut turns = Vec::new();
    if let Some(instructions) = object.get("instructions").and_then(Value::as_str) {
        turns.push(Turn {
            role: "system".to_owned(),
            text: instructions.to_owned(),
            calls: Vec::new(),
            call_id: None,
        });
    }
    let items = match object.get("input") {
        Some(Value::String(text)) if !text.is_empty() => {
            turns.push(Turn {
                role: "user".to_owned(),
                text: text.clone(),
                calls: Vec::new(),
                call_id: None,
            });
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
    let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
    // Omitted, `store` is true: items are kept, and any id would be found.
    let stateless = object.get("store") == Some(&Value::Bool(false));
    for (i, item) in items.iter().enumerate() {
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
                turns.push(Turn {
                    role: role.to_owned(),
                    text: content_text(item.get("content")),
                    calls: Vec::new(),
                    call_id: None,
                });
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
            "reasoning" => {
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
            }
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
    }
    check_call_outputs(&turns)?;
    Ok(turns)
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

// ---------------------------------------------------------------------------
// Choosing and rendering the reply

#[derive(Clone, Debug, PartialEq)]
enum Reply {
    /// `(call id, function name, arguments JSON text)`.
    ToolCalls(Vec<(String, String, String)>),
    Answer(String),
    Refusal(String),
}

/// What the script says to a conversation, and what is to go wrong.
#[derive(Debug)]
struct Plan {
    reply: Reply,
    reasoning: bool,
    fault: Option<(StepKey, Fault)>,
}

/// Whether a request lets the model call tools: it does not say
/// `tool_choice: "none"`.
fn offers_tools(request: &Value) -> bool {
    request["tool_choice"] != "none"
}

/// Plays the script against a conversation. When the request says
/// `tool_choice: "none"`, a `toolCalls` step is answered like a real model
/// would: with the rule's next `answer` step, or the fallback answer.
fn plan(script: &Script, turns: &[Turn], model: &str, tools_offered: bool) -> Plan {
    let last_user = turns.iter().rposition(|t| t.role == "user");
    let user = last_user.map_or("", |i| turns[i].text.as_str());
    let (rule, steps) = script.steps_for(user, model);
    let step = turns[last_user.map_or(0, |i| i + 1)..]
        .iter()
        .filter(|t| t.role == "assistant" && !t.calls.is_empty())
        .count();
    tracing::debug!(rule = ?rule, step, "scripted reply");
    let fallback = || Plan {
        reply: Reply::Answer(FALLBACK_ANSWER.to_owned()),
        reasoning: false,
        fault: None,
    };
    let (index, chosen, past_end) = match steps.get(step) {
        Some(chosen) => (step, chosen, false),
        None => match steps.last() {
            Some(last) => (steps.len() - 1, last, true),
            // Validation never lets a rule have no steps.
            None => return fallback(),
        },
    };
    let reply = match &chosen.action {
        // Replaying a tool round past the end of the rule would loop the
        // agent forever; answer instead.
        Action::ToolCalls(_) if past_end => return fallback(),
        Action::ToolCalls(_) if !tools_offered => {
            match steps[index..].iter().find_map(|s| match &s.action {
                Action::Answer(t) => Some(t),
                _ => None,
            }) {
                Some(template) => Reply::Answer(render(template, turns, user)),
                None => return fallback(),
            }
        }
        Action::ToolCalls(calls) => Reply::ToolCalls(
            calls
                .iter()
                .map(|c| (new_call_id(), c.name.clone(), c.arguments.clone()))
                .collect(),
        ),
        Action::Answer(template) => Reply::Answer(render(template, turns, user)),
        Action::Refusal(text) => Reply::Refusal(text.clone()),
    };
    Plan {
        reply,
        reasoning: chosen.reasoning,
        fault: chosen.fault.clone().map(|f| ((rule, index), f)),
    }
}

/// The reply of a model that ran out of tokens: the first call's
/// arguments or the text cut in half, later calls dropped.
fn truncate(reply: Reply) -> Reply {
    let half = |text: &str| {
        let keep = text.chars().count() / 2;
        text.chars().take(keep.max(1)).collect::<String>()
    };
    match reply {
        Reply::ToolCalls(calls) => Reply::ToolCalls(
            calls
                .into_iter()
                .take(1)
                .map(|(id, name, arguments)| {
                    let cut = half(&arguments);
                    (id, name, cut)
                })
                .collect(),
        ),
        Reply::Answer(text) => Reply::Answer(half(&text)),
        refusal @ Reply::Refusal(_) => refusal,
    }
}

fn new_call_id() -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{}", &id[..24])
}

fn render(template: &Template, turns: &[Turn], user: &str) -> String {
    let mut out = String::new();
    for part in &template.parts {
        match part {
            Part::Text(text) => out.push_str(text),
            Part::User => out.push_str(user),
            Part::Citations => {
                let mut markers: Vec<&str> = Vec::new();
                for turn in turns {
                    for marker in doc_markers(&turn.text) {
                        if !markers.contains(&marker) {
                            markers.push(marker);
                        }
                    }
                }
                out.push_str(&markers.join(" "));
            }
            Part::Tool(name) => match tool_result(turns, name) {
                Some(content) => out.push_str(&excerpt(content, EXCERPT_CHARS)),
                None => out.push_str(&format!("(no result from {name})")),
            },
        }
    }
    out
}

/// The content of the most recent tool message answering a call to `name`.
fn tool_result<'a>(turns: &'a [Turn], name: &str) -> Option<&'a str> {
    let names: HashMap<&str, &str> = turns
        .iter()
        .flat_map(|t| t.calls.iter().map(|(id, n)| (id.as_str(), n.as_str())))
        .collect();
    turns
        .iter()
        .rev()
        .filter(|t| t.role == "tool")
        .find(|t| {
            t.call_id
                .as_deref()
                .and_then(|id| names.get(id))
                .is_some_and(|n| *n == name)
        })
        .map(|t| t.text.as_str())
}

/// Every `[doc:ID]` marker in `text`, in order (ids of letters, digits, `_`,
/// `-` or `.`).
fn doc_markers(text: &str) -> Vec<&str> {
    let mut markers = Vec::new();
    let mut from = 0;
    while let Some(start) = text[from..].find("[doc:").map(|i| from + i) {
        let id_start = start + "[doc:".len();
        let id_len = text[id_start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .unwrap_or(text.len() - id_start);
        let end = id_start + id_len;
        if id_len > 0 && id_len <= 64 && text[end..].starts_with(']') {
            markers.push(&text[start..=end]);
            from = end + 1;
        } else {
            from = id_start;
        }
    }
    markers
}

/// The first ~`limit` characters of `content`, cut at a word, never inside
/// a marker, followed by every marker the cut dropped.
fn excerpt(content: &str, limit: usize) -> String {
    let content = content.trim();
    let Some((hard_cut, _)) = content.char_indices().nth(limit) else {
        return content.to_owned();
    };
    let mut cut = content[..hard_cut]
        .rfind(char::is_whitespace)
        .filter(|&i| i >= hard_cut / 2)
        .unwrap_or(hard_cut);
    if let Some(open) = content[..cut].rfind("[doc:")
        && !content[open..cut].contains(']')
    {
        cut = open;
    }
    let kept = content[..cut].trim_end();
    let mut out = format!("{kept}…");
    let mut missing: Vec<&str> = Vec::new();
    for marker in doc_markers(content) {
        if !kept.contains(marker) && !missing.contains(&marker) {
            missing.push(marker);
        }
    }
    if !missing.is_empty() {
        out.push(' ');
        out.push_str(&missing.join(" "));
    }
    out
}

// ---------------------------------------------------------------------------
// Response bodies: shared pieces

fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4).max(1)
}

fn reply_chars(reply: &Reply) -> usize {
    match reply {
        Reply::Answer(text) | Reply::Refusal(text) => text.chars().count(),
        Reply::ToolCalls(calls) => calls.iter().map(|(_, n, a)| n.len() + a.len()).sum(),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `prefix_` and 24 random hex digits, the shape of OpenAI ids.
fn new_id(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &id[..24])
}

/// Where a streamed frame sits in the answer, so faults can cut at the
/// right place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    Other,
    /// A text or refusal delta.
    Text,
    /// The first frame of call number `n` (its id and name).
    CallHead(usize),
    /// An argument fragment of call number `call`.
    CallArgs {
        call: usize,
    },
}

/// One frame of a streamed body, already in wire form.
#[derive(Debug)]
struct Piece {
    tag: Tag,
    frame: Bytes,
}

/// A few words at a time, whitespace kept, so the pieces concatenate back
/// to the text.
fn answer_pieces(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_inclusive(char::is_whitespace).collect();
    words
        .chunks(WORDS_PER_CHUNK)
        .map(|group| group.concat())
        .collect()
}

/// `text` in pieces of at most `size` characters.
fn fragments(text: &str, size: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let cut = rest.char_indices().nth(size).map_or(rest.len(), |(i, _)| i);
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    pieces
}

/// Applies a stream fault to the frames of a normal answer. Returns the
/// frames to send and whether to drop the connection after them.
fn apply_stream_fault(
    pieces: Vec<Piece>,
    fault: Option<&FaultKind>,
    malformed: &str,
) -> (Vec<Bytes>, bool) {
    match fault {
        Some(FaultKind::CutMidToolCall) => {
            let fragments = pieces
                .iter()
                .filter(|p| p.tag == Tag::CallArgs { call: 0 })
                .count();
            let keep = fragments / 2;
            let mut sent_args = 0;
            let mut frames = Vec::new();
            for piece in pieces {
                let tag = piece.tag;
                frames.push(piece.frame);
                if tag == (Tag::CallArgs { call: 0 }) {
                    sent_args += 1;
                }
                let past_head = tag == Tag::CallHead(0) || tag == (Tag::CallArgs { call: 0 });
                if past_head && sent_args >= keep {
                    break;
                }
            }
            (frames, true)
        }
        Some(FaultKind::CutMidText) => {
            let mut frames = Vec::new();
            for piece in pieces {
                frames.push(piece.frame);
                if piece.tag == Tag::Text {
                    break;
                }
            }
            (frames, true)
        }
        Some(FaultKind::MalformedChunk) => {
            let mut frames: Vec<Bytes> = pieces.into_iter().map(|p| p.frame).collect();
            let at = frames.len().min(1);
            frames.insert(at, Bytes::from(malformed.to_owned()));
            (frames, false)
        }
        _ => (pieces.into_iter().map(|p| p.frame).collect(), false),
    }
}

// ---------------------------------------------------------------------------
// Chat Completions bodies

struct Envelope<'a> {
    id: String,
    created: u64,
    model: &'a str,
}

impl Envelope<'_> {
    fn new(model: &str) -> Envelope<'_> {
        Envelope {
            id: new_id("chatcmpl").replacen('_', "-", 1),
            created: unix_now(),
            model,
        }
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

fn chat_finish_reason(reply: &Reply, truncated: bool) -> &'static str {
    match reply {
        _ if truncated => "length",
        Reply::ToolCalls(_) => "tool_calls",
        Reply::Answer(_) | Reply::Refusal(_) => "stop",
    }
}

/// The non-streaming `chat.completion` body.
fn completion_body(
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
            "finish_reason": chat_finish_reason(reply, truncated)}]),
    );
    body.insert(
        "usage".into(),
        usage_json(prompt_tokens, estimate_tokens(reply_chars(reply))),
    );
    Value::Object(body)
}

/// The frames of a streamed chat completion, `data: [DONE]` included.
fn chat_stream_pieces(
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
        chunk(json!({}), Some(chat_finish_reason(reply, truncated))),
    ));
    if include_usage {
        let mut body = envelope.base("chat.completion.chunk");
        body.insert("choices".into(), json!([]));
        body.insert(
            "usage".into(),
            usage_json(prompt_tokens, estimate_tokens(reply_chars(reply))),
        );
        pieces.push(piece(Tag::Other, Value::Object(body).to_string()));
    }
    pieces.push(piece(Tag::Other, "[DONE]".to_owned()));
    pieces
}

// ---------------------------------------------------------------------------
// Responses API bodies

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
struct ResponsesEnvelope<'a> {
    id: String,
    created_at: u64,
    model: &'a str,
    /// Echoed back the way the real API echoes request parameters.
    request: &'a Value,
}

impl<'a> ResponsesEnvelope<'a> {
    fn new(model: &'a str, request: &'a Value) -> Self {
        Self {
            id: new_id("resp"),
            created_at: unix_now(),
            model,
            request,
        }
    }

    /// The output items of `reply`, a reasoning item first when the step
    /// reasons (with its encrypted content if the request asked for it).
    fn items(&self, reply: &Reply, reasoning: bool) -> Vec<OutItem> {
        let encrypted = includes(self.request, ENCRYPTED_REASONING);
        OutItem::list(reply, reasoning.then_some(encrypted))
    }

    fn response(&self, status: &str, output: Vec<Value>, usage: Option<Value>) -> Value {
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

fn responses_usage(prompt_tokens: u64, reply: &Reply, reasoning: bool) -> Value {
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
fn responses_body(
    envelope: &ResponsesEnvelope<'_>,
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
    envelope.response(
        status,
        output,
        Some(responses_usage(prompt_tokens, reply, reasoning)),
    )
}

/// The events of a streamed response, each framed as `event: <type>` and
/// `data: <json>` with its `sequence_number`.
fn responses_stream_pieces(
    envelope: &ResponsesEnvelope<'_>,
    reply: &Reply,
    reasoning: bool,
    prompt_tokens: u64,
    truncated: bool,
) -> Vec<Piece> {
    let status = if truncated { "incomplete" } else { "completed" };
    let items = envelope.items(reply, reasoning);
    let mut events: Vec<(Tag, Value)> = Vec::new();
    let opening = envelope.response("in_progress", Vec::new(), None);
    events.push((
        Tag::Other,
        json!({"type": "response.created", "response": opening}),
    ));
    events.push((
        Tag::Other,
        json!({"type": "response.in_progress", "response": opening}),
    ));
    let mut call_number = 0;
    for (output_index, item) in items.iter().enumerate() {
        let item_id = item.id();
        let head_tag = match item {
            OutItem::Call { .. } => Tag::CallHead(call_number),
            _ => Tag::Other,
        };
        events.push((
            head_tag,
            json!({"type": "response.output_item.added", "output_index": output_index, "item": item.started()}),
        ));
        match item {
            OutItem::Reasoning { .. } => {}
            OutItem::Message { text, refusal, .. } => {
                let (delta_type, done_type, done_key) = if *refusal {
                    ("response.refusal.delta", "response.refusal.done", "refusal")
                } else {
                    (
                        "response.output_text.delta",
                        "response.output_text.done",
                        "text",
                    )
                };
                events.push((
                    Tag::Other,
                    json!({"type": "response.content_part.added", "item_id": item_id,
                        "output_index": output_index, "content_index": 0,
                        "part": OutItem::content_part("", *refusal)}),
                ));
                for part in answer_pieces(text) {
                    events.push((
                        Tag::Text,
                        json!({"type": delta_type, "item_id": item_id, "output_index": output_index,
                            "content_index": 0, "delta": part}),
                    ));
                }
                events.push((
                    Tag::Other,
                    json!({"type": done_type, "item_id": item_id, "output_index": output_index,
                        "content_index": 0, done_key: text}),
                ));
                events.push((
                    Tag::Other,
                    json!({"type": "response.content_part.done", "item_id": item_id,
                        "output_index": output_index, "content_index": 0,
                        "part": OutItem::content_part(text, *refusal)}),
                ));
            }
            OutItem::Call { arguments, .. } => {
                for fragment in fragments(arguments, ARGUMENT_FRAGMENT_CHARS) {
                    events.push((
                        Tag::CallArgs { call: call_number },
                        json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                            "output_index": output_index, "delta": fragment}),
                    ));
                }
                events.push((
                    Tag::Other,
                    json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                        "output_index": output_index, "arguments": arguments}),
                ));
                call_number += 1;
            }
        }
        events.push((
            Tag::Other,
            json!({"type": "response.output_item.done", "output_index": output_index,
                "item": item.finished(status)}),
        ));
    }
    let output = items.iter().map(|item| item.finished(status)).collect();
    let usage = responses_usage(prompt_tokens, reply, reasoning);
    let terminal = if truncated {
        "response.incomplete"
    } else {
        "response.completed"
    };
    events.push((
        Tag::Other,
        json!({"type": terminal, "response": envelope.response(status, output, Some(usage))}),
    ));
    events
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

// ---------------------------------------------------------------------------
// The server

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// When the handler started on it: gaps between these show how long a
    /// client waited before retrying.
    pub at: Instant,
    /// `/v1/chat/completions` or `/v1/responses`.
    pub path: String,
    /// The raw query string, if any (e.g. `api-version=..`).
    pub query: Option<String>,
    /// Every request header, names lower-case.
    pub headers: Vec<(String, String)>,
    /// The body; one that was not JSON appears as a JSON string.
    pub body: Value,
    /// The fault injected into the answer (`status`, `cutMidToolCall`,
    /// `cutMidText`, `malformedChunk`, `slowFirstToken`, `length`).
    pub fault: Option<&'static str>,
}

impl Received {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How the response bodies the server streamed have ended so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bodies that began.
    pub started: u64,
    /// Bodies sent to the end.
    pub completed: u64,
    /// Bodies cut on purpose by a `cutMidToolCall` / `cutMidText` fault.
    pub cut: u64,
    /// Bodies abandoned before their end because the client went away (or
    /// the server shut down): the way a cancelled client shows up here.
    pub dropped: u64,
}

struct ServerState {
    script: Script,
    received: Mutex<VecDeque<Received>>,
    /// Fault hits per step, for `times`.
    fault_counts: Mutex<HashMap<StepKey, u32>>,
    fault_hits: AtomicU64,
    streams: watch::Sender<StreamStats>,
    /// TCP connections accepted.
    connections: AtomicU64,
}

impl ServerState {
    fn new(script: Script) -> Self {
        Self {
            script,
            received: Mutex::new(VecDeque::new()),
            fault_counts: Mutex::new(HashMap::new()),
            fault_hits: AtomicU64::new(0),
            streams: watch::Sender::new(StreamStats::default()),
            connections: AtomicU64::new(0),
        }
    }

    fn record(&self, received: Received) {
        // A panic elsewhere while holding the lock leaves a usable log.
        let mut log = self.received.lock().unwrap_or_else(PoisonError::into_inner);
        if log.len() == MAX_RECORDED_REQUESTS {
            log.pop_front();
        }
        log.push_back(received);
    }

    /// Whether this request gets the step's fault, counting it if so.
    fn take_fault(&self, key: StepKey, fault: &Fault) -> bool {
        let mut counts = self
            .fault_counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let hits = counts.entry(key).or_insert(0);
        if fault.times.is_some_and(|times| *hits >= times) {
            return false;
        }
        *hits += 1;
        self.fault_hits.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Counts a streamed body in [`StreamStats`]; a body dropped before it
/// ended counts as `dropped`.
struct StreamGuard {
    state: Arc<ServerState>,
    ended: bool,
}

impl StreamGuard {
    fn new(state: Arc<ServerState>) -> Self {
        state.streams.send_modify(|s| s.started += 1);
        Self {
            state,
            ended: false,
        }
    }

    fn end(&mut self, cut: bool) {
        if !self.ended {
            self.ended = true;
            self.state.streams.send_modify(|s| {
                if cut {
                    s.cut += 1;
                } else {
                    s.completed += 1;
                }
            });
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.state.streams.send_modify(|s| s.dropped += 1);
        }
    }
}

/// What a streamed body still has to send.
struct Feed {
    frames: VecDeque<Bytes>,
    cut: bool,
    first_delay: Duration,
    delay: Duration,
    sent: usize,
    guard: StreamGuard,
}

/// A body that sends `frames` (pausing `delay` before each, and
/// `first_delay` more before the first), then ends, or with `cut` drops the
/// connection mid-body the way a crashed upstream does.
fn feed_body(
    state: &Arc<ServerState>,
    frames: Vec<Bytes>,
    cut: bool,
    first_delay: Duration,
    delay: Duration,
) -> Body {
    let feed = Feed {
        frames: frames.into(),
        cut,
        first_delay,
        delay,
        sent: 0,
        guard: StreamGuard::new(state.clone()),
    };
    let stream = futures::stream::unfold(feed, |mut feed| async move {
        if let Some(frame) = feed.frames.pop_front() {
            let pause = if feed.sent == 0 {
                feed.first_delay + feed.delay
            } else {
                feed.delay
            };
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            feed.sent += 1;
            return Some((Ok(frame), feed));
        }
        if feed.cut && !feed.guard.ended {
            tokio::time::sleep(CUT_FLUSH_PAUSE).await;
            feed.guard.end(true);
            // An error from the body makes hyper drop the connection
            // without the final empty chunk: the client sees a body that
            // broke off, not one that ended.
            let cut = std::io::Error::other("scripted fault: the stream is cut here");
            return Some((Err(cut), feed));
        }
        feed.guard.end(false);
        None
    });
    Body::from_stream(stream)
}

fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/v1/images/generations", post(images))
        .route("/v1/embeddings", post(embeddings))
        .fallback(unknown_url)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Responses,
}

async fn chat_completions(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    respond(state, Api::Chat, uri, headers, body).await
}

async fn responses(
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
    let mut received = Received {
        at: Instant::now(),
        path: uri.path().to_owned(),
        query: uri.query().map(str::to_owned),
        headers: headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: Value::Null,
        fault: None,
    };
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
    let turns = match api {
        Api::Chat => read_request(&request),
        Api::Responses => read_responses_request(&request)
            .and_then(|turns| check_model_support(&state.script, &request).map(|()| turns)),
    };
    let turns = match turns {
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
    if let Some(FaultKind::Status {
        status,
        retry_after_ms,
        retry_after_secs,
        code,
        message,
    }) = &fault
    {
        return status_fault(
            *status,
            *retry_after_ms,
            *retry_after_secs,
            code.as_deref(),
            message.as_deref(),
        );
    }
    let truncated = fault == Some(FaultKind::Length);
    let reply = if truncated {
        truncate(plan.reply)
    } else {
        plan.reply
    };
    let slow = state.script.first_token_delay
        + match fault {
            Some(FaultKind::SlowFirstToken(delay)) => delay,
            _ => Duration::ZERO,
        };
    let prompt_chars: usize = turns.iter().map(|t| t.text.chars().count()).sum::<usize>()
        + request.get("tools").map_or(0, |t| t.to_string().len());
    let prompt_tokens = estimate_tokens(prompt_chars);
    let script = &state.script;
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    if !stream {
        let body = match api {
            Api::Chat => completion_body(
                &Envelope::new(&script.model),
                &reply,
                prompt_tokens,
                truncated,
            ),
            Api::Responses => responses_body(
                &ResponsesEnvelope::new(&script.model, &request),
                &reply,
                plan.reasoning,
                prompt_tokens,
                truncated,
            ),
        };
        return plain_answer(&state, body, fault.as_ref(), slow).await;
    }
    let (pieces, malformed) = match api {
        Api::Chat => {
            let include_usage = request
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                == Some(true);
            (
                chat_stream_pieces(
                    &Envelope::new(&script.model),
                    &reply,
                    prompt_tokens,
                    include_usage,
                    truncated,
                ),
                "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"scripted malformed chunk\"\n\n",
            )
        }
        Api::Responses => (
            responses_stream_pieces(
                &ResponsesEnvelope::new(&script.model, &request),
                &reply,
                plan.reasoning,
                prompt_tokens,
                truncated,
            ),
            "event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\", \"delta\": scripted malformed chunk\n\n",
        ),
    };
    let (frames, cut) = apply_stream_fault(pieces, fault.as_ref(), malformed);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        feed_body(&state, frames, cut, slow, script.chunk_delay),
    )
        .into_response()
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
fn status_fault(
    status: StatusCode,
    retry_after_ms: Option<u64>,
    retry_after_secs: Option<u64>,
    code: Option<&str>,
    message: Option<&str>,
) -> Response {
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
        "message": message.unwrap_or(default_message),
        "type": kind,
        "param": null,
        "code": code.or(default_code),
    }});
    let mut response = (status, axum::Json(body)).into_response();
    let headers = response.headers_mut();
    if let Some(ms) = retry_after_ms {
        headers.insert("retry-after-ms", ms.into());
        headers.insert("retry-after", ms.div_ceil(1000).into());
    }
    if let Some(secs) = retry_after_secs {
        headers.insert(header::RETRY_AFTER, secs.into());
    }
    response
}

async fn models(State(state): State<Arc<ServerState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.script.model,
            "object": "model",
            "created": 0,
            "owned_by": "toolfleet (scripted stand-in, not a real model)",
        }],
    }))
    .into_response()
}

/// `POST /v1/images/generations`: one image per request (`n` up to 4), as
/// a URL under `https://images.scripted.invalid/` or, when
/// `response_format` is `b64_json` (or the model is a `gpt-image` one,
/// which always answers so), as base64 of a 1×1 PNG padded to the
/// script's `imageBytes`. A prompt containing `refuse image` is answered
/// 400 `content_policy_violation`, as OpenAI answers a prompt its safety
/// system rejects.
async fn images(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use base64::Engine as _;
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state.record(Received {
        at: Instant::now(),
        path: uri.path().to_owned(),
        query: uri.query().map(str::to_owned),
        headers: headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: request.clone(),
        fault: None,
    });
    let Some(prompt) = request["prompt"].as_str().filter(|p| !p.trim().is_empty()) else {
        return ApiError::invalid(
            "Missing required parameter: 'prompt'.".to_owned(),
            Some("prompt"),
            Some("missing_required_parameter"),
        )
        .into_response();
    };
    if prompt.to_lowercase().contains("refuse image") {
        return ApiError::invalid(
            "Your request was rejected as a result of our safety system.".to_owned(),
            None,
            Some("content_policy_violation"),
        )
        .into_response();
    }
    let n = request["n"].as_u64().unwrap_or(1).clamp(1, 4);
    let model = request["model"].as_str().unwrap_or("dall-e-2");
    let b64 = request["response_format"] == "b64_json" || model.starts_with("gpt-image");
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let data: Vec<Value> = (0..n)
        .map(|i| {
            if b64 {
                let image = padded_png(state.script.image_bytes);
                json!({ "b64_json": base64::engine::general_purpose::STANDARD.encode(image) })
            } else {
                json!({
                    "url": format!("https://images.scripted.invalid/{created}-{i}.png"),
                    "revised_prompt": prompt,
                })
            }
        })
        .collect();
    axum::Json(json!({
        "created": created,
        "data": data,
        "usage": { "input_tokens": prompt.len().div_ceil(4), "output_tokens": 0, "total_tokens": prompt.len().div_ceil(4) },
    }))
    .into_response()
}

/// Dimensions of a scripted embedding when the request names none.
pub const EMBEDDING_DIMENSIONS: usize = 256;

/// `POST /v1/embeddings`: deterministic vectors, so retrieval tests can
/// check hybrid search. Each word of the input (letters and digits,
/// lowercased) is hashed to one dimension and a sign, and the vector is
/// L2-normalised: texts sharing words point the same way, texts sharing
/// none are orthogonal or nearly so. `input` is a string or an array of up
/// to 2048 strings; `dimensions` (1 to 3072) defaults to 256;
/// `encoding_format` `float` or `base64` (little-endian f32, what the
/// OpenAI SDKs ask for). Not a language model's embedding: similarity
/// here is shared vocabulary, nothing more.
async fn embeddings(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use base64::Engine as _;
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state.record(Received {
        at: Instant::now(),
        path: uri.path().to_owned(),
        query: uri.query().map(str::to_owned),
        headers: headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: request.clone(),
        fault: None,
    });
    let inputs: Vec<&str> = match &request["input"] {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) if items.iter().all(Value::is_string) => {
            items.iter().filter_map(Value::as_str).collect()
        }
        _ => {
            return ApiError::invalid(
                "'input' must be a string or an array of strings.".to_owned(),
                Some("input"),
                Some("invalid_type"),
            )
            .into_response();
        }
    };
    if inputs.is_empty() || inputs.len() > 2048 || inputs.iter().any(|i| i.is_empty()) {
        return ApiError::invalid(
            "'input' must hold 1 to 2048 non-empty strings.".to_owned(),
            Some("input"),
            Some("invalid_value"),
        )
        .into_response();
    }
    let dimensions = match request.get("dimensions") {
        None | Some(Value::Null) => EMBEDDING_DIMENSIONS,
        Some(d) => match d.as_u64().filter(|d| (1..=3072).contains(d)) {
            Some(d) => d as usize,
            None => {
                return ApiError::invalid(
                    "'dimensions' must be an integer from 1 to 3072.".to_owned(),
                    Some("dimensions"),
                    Some("invalid_value"),
                )
                .into_response();
            }
        },
    };
    let base64 = request["encoding_format"] == "base64";
    let mut tokens = 0;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            tokens += text.len().div_ceil(4);
            let vector = scripted_embedding(text, dimensions);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|f| f.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "index": i, "embedding": embedding })
        })
        .collect();
    axum::Json(json!({
        "object": "list",
        "data": data,
        "model": request["model"].as_str().unwrap_or("text-embedding-3-small"),
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
    }))
    .into_response()
}

/// The scripted embedding of `text` (see [`embeddings`]): hashed words,
/// L2-normalised; all zeros for a text without a word.
pub fn scripted_embedding(text: &str, dimensions: usize) -> Vec<f32> {
    let mut vector = vec![0.0f32; dimensions.max(1)];
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        // FNV-1a: stable across runs and platforms.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in word.to_lowercase().bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        let slot = (hash % vector.len() as u64) as usize;
        vector[slot] += if hash >> 63 == 0 { 1.0 } else { -1.0 };
    }
    let norm = vector.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm > 0.0 {
        for v in &mut vector {
            *v /= norm;
        }
    }
    vector
}

/// Default of the script's `imageBytes`: a few megabytes, the size real
/// generated images have, so a test sees what a tool does with one.
const DEFAULT_IMAGE_BYTES: usize = 3 * 1024 * 1024;

/// A valid 1×1 PNG followed by zero bytes up to `size` (decoders stop at
/// `IEND`; the padding stands in for the pixels of a real image).
fn padded_png(size: usize) -> Vec<u8> {
    const ONE_PIXEL: &[u8] = &[
        0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
        0x52, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f,
        0x15, 0xc4, 0x89, 0x00, 0x00, 0x00, 0x0b, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0x60,
        0x00, 0x02, 0x00, 0x00, 0x05, 0x00, 0x01, 0x7a, 0x5e, 0xab, 0x3f, 0x00, 0x00, 0x00, 0x00,
        0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
    ];
    let mut image = ONE_PIXEL.to_vec();
    image.resize(size.max(ONE_PIXEL.len()), 0);
    image
}

async fn unknown_url(method: Method, uri: Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "Unknown request URL: {method} {}. The scripted stand-in serves POST /v1/chat/completions, POST /v1/responses, POST /v1/images/generations, POST /v1/embeddings and GET /v1/models.",
            uri.path()
        ),
        param: None,
        code: Some("unknown_url"),
    }
    .into_response()
}

async fn serve_state(
    listener: TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        model = %state.script.model,
        "scripted model server (a stand-in for an OpenAI-compatible provider) listening on {addr}"
    );
    // HTTP/1.1 and HTTP/2 (h2c by prior knowledge) on one port, as
    // providers serve both; HTTP/2 without hyper's default cap of 200
    // streams per connection, so a client multiplexing thousands of
    // waiting calls is not throttled by the stand-in.
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(MAX_HTTP2_STREAMS)
        // A client's cancels (a cancelled invocation drops its stream) are
        // not an attack here.
        .max_pending_accept_reset_streams(None)
        .max_local_error_reset_streams(None);
    let app = router(state.clone());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Every SSE chunk is a small write: without TCP_NODELAY, Nagle's
        // algorithm meets the client's delayed ACK and each round trip
        // gains ~40 ms that no real provider adds.
        let _ = tcp.set_nodelay(true);
        state.connections.fetch_add(1, Ordering::Relaxed);
        let service = {
            use tower::ServiceExt;
            hyper_util::service::TowerToHyperService::new(app.clone().map_request(
                |req: axum::http::Request<hyper::body::Incoming>| req.map(axum::body::Body::new),
            ))
        };
        let conn = builder
            .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(tcp), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    // Open responses finish (the caller bounds how long it waits).
    graceful.shutdown().await;
    Ok(())
}

/// HTTP/2 streams the stand-in allows on one connection.
const MAX_HTTP2_STREAMS: u32 = 100_000;

/// Serves `script` on `listener` until `shutdown` completes. The CLI's
/// `toolfleet scripted-model --listen ADDR --script FILE` runs this.
pub async fn serve(
    listener: TcpListener,
    script: Script,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_state(listener, Arc::new(ServerState::new(script)), shutdown).await
}

/// How long [`ScriptedServer::shutdown`] lets open streams finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A scripted server running in a background task, for tests.
pub struct ScriptedServer {
    addr: SocketAddr,
    base_url: Url,
    state: Arc<ServerState>,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl ScriptedServer {
    /// Binds `listen` (use `127.0.0.1:0` in tests) and serves in the
    /// background until [`shutdown`](Self::shutdown) or drop.
    pub async fn start(listen: SocketAddr, script: Script) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let base_url = Url::parse(&format!("http://{addr}/v1"))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let state = Arc::new(ServerState::new(script));
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve_state(
            listener,
            state.clone(),
            stop.clone().cancelled_owned(),
        ));
        Ok(Self {
            addr,
            base_url,
            state,
            stop,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/v1`, the base URL for an OpenAI client.
    pub fn base_url(&self) -> Url {
        self.base_url.clone()
    }

    /// The script being played.
    pub fn script(&self) -> &Script {
        &self.state.script
    }

    /// Every request body received so far, oldest first (the last 1000).
    /// A body that was not JSON appears as a JSON string.
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|r| r.body.clone())
            .collect()
    }

    /// Every request received so far with its time, path, query, headers
    /// and injected fault, oldest first (the last 1000).
    pub fn received(&self) -> Vec<Received> {
        self.state
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// How many TCP connections the server accepted, over its life (with
    /// HTTP/2, calls in flight share connections; with HTTP/1.1 each holds
    /// one).
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// How many requests got a scripted fault, over the server's life.
    pub fn fault_hits(&self) -> u64 {
        self.state.fault_hits.load(Ordering::Relaxed)
    }

    /// How the streamed bodies have ended so far.
    pub fn stream_stats(&self) -> StreamStats {
        *self.state.streams.borrow()
    }

    /// Waits until the stream counts satisfy `ready` and returns them.
    /// Unbounded: wrap it in a timeout.
    pub async fn wait_for_streams(
        &self,
        mut ready: impl FnMut(&StreamStats) -> bool,
    ) -> StreamStats {
        let mut changes = self.state.streams.subscribe();
        // The sender lives in `self.state`, so the channel cannot close
        // while we hold `self`.
        match changes.wait_for(|s| ready(s)).await {
            Ok(stats) => *stats,
            Err(_) => self.stream_stats(),
        }
    }

    /// Stops accepting, lets open responses finish for a few seconds, then
    /// stops.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
        {
            task.abort();
        }
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    const STEP: Duration = Duration::from_secs(20);

    /// Every await in these tests is bounded.
    async fn within<F: Future>(future: F) -> F::Output {
        tokio::time::timeout(STEP, future)
            .await
            .expect("test step timed out")
    }

    fn demo_script() -> Script {
        Script::load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/demo-script.json"
        )))
        .expect("the demo script is valid")
    }

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    fn assistant_calls(calls: &[(&str, &str)]) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": calls.iter().map(|(id, name)| json!({
            "id": id, "type": "function", "function": {"name": name, "arguments": "{}"}
        })).collect::<Vec<_>>()})
    }

    fn tool(id: &str, content: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": content})
    }

    fn turns(messages: Vec<Value>) -> Vec<Turn> {
        read_request(&json!({"model": "m", "messages": messages})).expect("valid request")
    }

    fn reply(script: &Script, turns: &[Turn]) -> Reply {
        plan(script, turns, "", true).reply
    }

    fn call_names(reply: &Reply) -> Vec<&str> {
        match reply {
            Reply::ToolCalls(calls) => calls.iter().map(|(_, n, _)| n.as_str()).collect(),
            other => panic!("expected tool calls, got {other:?}"),
        }
    }

    fn answer(reply: Reply) -> String {
        match reply {
            Reply::Answer(text) => text,
            other => panic!("expected an answer, got {other:?}"),
        }
    }

    #[test]
    fn bad_scripts_fail_with_a_pointed_message() {
        let cases = [
            ("{", "EOF"),
            (r#"{"rulez": []}"#, "unknown field `rulez`"),
            (
                r#"{"rules": [{"whenUserContain": ["a"], "steps": []}]}"#,
                "unknown field `whenUserContain`",
            ),
            (
                r#"{"rules": [{"whenUserContains": [], "steps": [{"answer": "x"}]}]}"#,
                "rules[0] needs a condition",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": []}]}"#,
                "rules[0].steps must not be empty",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": [{}]}]}"#,
                "rules[0].steps[0] needs exactly one of `toolCalls`, `answer` or `refusal`",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": [{"answer": "x", "toolCalls": [{"name": "f"}]}]}]}"#,
                "needs exactly one of",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": [{"toolCalls": [{"name": "f", "arguments": [1]}]}]}]}"#,
                "rules[0].steps[0].toolCalls[0].arguments must be a JSON object",
            ),
            (
                r#"{"default": {"steps": [{"answer": "hi {{usr}}"}]}}"#,
                "default.steps[0].answer: unknown placeholder {{usr}}",
            ),
            (
                r#"{"default": {"steps": [{"answer": "hi {{user"}]}}"#,
                "unclosed `{{`",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": [{"toolCalls": [{"name": "f"}]}, {"answer": "{{tool:g}}"}]}]}"#,
                "uses {{tool:g}} but no step of this rule calls `g`",
            ),
            (r#"{"model": " "}"#, "`model` must not be empty"),
            (
                r#"{"reasoningModel": false, "default": {"steps": [{"reasoning": true, "answer": "x"}]}}"#,
                "`reasoningModel` is false, but a step has `\"reasoning\": true`",
            ),
            (r#"{"chunkDelayMs": -1}"#, "invalid value"),
            (
                r#"{"default": {"steps": [{"answer": "x", "refusal": "no"}]}}"#,
                "needs exactly one of",
            ),
            (
                r#"{"default": {"steps": [{"refusal": " "}]}}"#,
                "default.steps[0].refusal must not be empty",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "explode"}}]}}"#,
                "default.steps[0].fault.kind \"explode\" is unknown; known kinds are status,",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "status"}}]}}"#,
                "default.steps[0].fault.status is required for kind `status`",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "status", "status": 200}}]}}"#,
                "must be an error status (400-599)",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "status", "status": 500, "delayMs": 5}}]}}"#,
                "fault.delayMs only applies to kind `slowFirstToken`, not `status`",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "slowFirstToken", "retryAfterMs": 5}}]}}"#,
                "fault.retryAfterMs only applies to kind `status`",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "slowFirstToken"}}]}}"#,
                "fault.delayMs is required for kind `slowFirstToken`",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "cutMidToolCall"}}]}}"#,
                "kind `cutMidToolCall` needs a `toolCalls` step, not `answer`",
            ),
            (
                r#"{"default": {"steps": [{"toolCalls": [{"name": "f"}], "fault": {"kind": "cutMidText"}}]}}"#,
                "kind `cutMidText` needs a `answer` or `refusal` step",
            ),
            (
                r#"{"default": {"steps": [{"refusal": "no", "fault": {"kind": "length"}}]}}"#,
                "kind `length` needs a `toolCalls` or `answer` step, not `refusal`",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "length", "times": 0}}]}}"#,
                "fault.times must be at least 1",
            ),
            (
                r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "length", "time": 1}}]}}"#,
                "unknown field `time`",
            ),
        ];
        for (text, want) in cases {
            let err = Script::from_json(text).expect_err(text).to_string();
            assert!(err.contains(want), "{text}: got {err:?}, want {want:?}");
        }
    }

    #[test]
    fn a_reasoning_model_is_declared_or_follows_from_the_steps() {
        let declared = |text: &str| {
            Script::from_json(text)
                .expect("script")
                .is_reasoning_model()
        };
        assert!(!declared("{}"));
        assert!(!demo_script().is_reasoning_model());
        assert!(declared(r#"{"reasoningModel": true}"#));
        assert!(declared(
            r#"{"default": {"steps": [{"toolCalls": [{"name": "f"}]}, {"reasoning": true, "answer": "x"}]}}"#
        ));
        assert!(declared(RESPONSES));
        assert!(!declared(r#"{"reasoningModel": false}"#));
    }

    #[test]
    fn delays_come_from_the_script_or_its_builder() {
        let script =
            Script::from_json(r#"{"chunkDelayMs": 5, "firstTokenDelayMs": 250}"#).expect("script");
        assert_eq!(script.chunk_delay(), Duration::from_millis(5));
        assert_eq!(script.first_token_delay(), Duration::from_millis(250));
        let script = script
            .with_first_token_delay(Duration::from_secs(20))
            .with_chunk_delay(Duration::ZERO);
        assert_eq!(script.first_token_delay(), Duration::from_secs(20));
        assert_eq!(script.chunk_delay(), Duration::ZERO);
        assert_eq!(
            Script::from_json("{}").expect("script").first_token_delay(),
            Duration::ZERO
        );
        assert!(Script::from_json(r#"{"firstTokenDelayMs": -1}"#).is_err());
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.json");
        let err = Script::load(&missing).expect_err("missing");
        assert!(matches!(err, ScriptError::Read { .. }));
        assert!(err.to_string().contains("missing.json"), "{err}");
        let bad = dir.path().join("bad.json");
        std::fs::write(
            &bad,
            r#"{"rules": [{"whenUserContains": ["a"], "steps": []}]}"#,
        )
        .expect("write");
        let err = Script::load(&bad).expect_err("invalid");
        assert!(err.to_string().contains("bad.json"), "{err}");
        assert!(err.to_string().contains("steps must not be empty"), "{err}");
    }

    #[test]
    fn minimal_script_uses_the_built_in_defaults() {
        let script = Script::from_json("{}").expect("empty script");
        assert_eq!(script.model(), DEFAULT_MODEL);
        assert_eq!(
            answer(reply(&script, &turns(vec![user("anything")]))),
            NO_SCRIPT_ANSWER
        );
    }

    #[test]
    fn demo_script_plays_every_rule() {
        let script = demo_script();
        assert_eq!(script.model(), DEFAULT_MODEL);

        // Rule 1: both tools at once, then an answer quoting both.
        let question = "What time is it, and how do lighthouses warn ships?";
        let first = reply(&script, &turns(vec![user(question)]));
        assert_eq!(
            call_names(&first),
            ["current_datetime", "search_data_sources"]
        );
        let Reply::ToolCalls(calls) = &first else {
            unreachable!()
        };
        let search: Value = serde_json::from_str(&calls[1].2).expect("arguments are JSON");
        assert_eq!(search["topK"], json!(3));
        assert!(
            search["query"]
                .as_str()
                .is_some_and(|q| q.contains("lighthouse"))
        );
        let text = answer(reply(
            &script,
            &turns(vec![
                user(question),
                assistant_calls(&[("c1", "current_datetime"), ("c2", "search_data_sources")]),
                tool("c1", "2026-11-21T22:50:00Z (Saturday)"),
                tool(
                    "c2",
                    "[doc:1] Lighthouses › Fog signals: horns and bells [doc:2] Lighthouses: lights",
                ),
            ]),
        ));
        assert!(text.contains("2026-11-21T22:50:00Z (Saturday)"), "{text}");
        assert!(
            text.contains("[doc:1]") && text.contains("[doc:2]"),
            "{text}"
        );

        // Rules 2 and 3: retrieval only.
        for (question, topic) in [
            ("How do honeybees find their way home?", "honeybees"),
            ("Why does sourdough bread rise?", "sourdough"),
        ] {
            let first = reply(&script, &turns(vec![user(question)]));
            assert_eq!(call_names(&first), ["search_data_sources"], "{question}");
            let text = answer(reply(
                &script,
                &turns(vec![
                    user(question),
                    assistant_calls(&[("c1", "search_data_sources")]),
                    tool("c1", &format!("[doc:1] about {topic}")),
                ]),
            ));
            assert!(text.contains(&format!("[doc:1] about {topic}")), "{text}");
        }

        // Default: says what it is and echoes the question.
        let text = answer(reply(&script, &turns(vec![user("Tell me a joke")])));
        assert!(
            text.contains("stand-in") && text.contains("Tell me a joke"),
            "{text}"
        );
    }

    const TWO_ROUNDS: &str = r#"{
        "rules": [
            {"whenUserContains": ["LOOP"], "steps": [{"toolCalls": [{"name": "f"}]}]},
            {"whenUserContains": ["two"], "steps": [
                {"toolCalls": [{"name": "f", "arguments": {"n": 1}}]},
                {"toolCalls": [{"name": "g", "arguments": {"n": 2}}]},
                {"answer": "f said {{tool:f}}, g said {{tool:g}}"}
            ]}
        ]
    }"#;

    #[test]
    fn steps_advance_per_tool_round_and_end_in_an_answer() {
        let script = Script::from_json(TWO_ROUNDS).expect("script");
        let mut history = vec![user("do TWO things")];
        assert_eq!(call_names(&reply(&script, &turns(history.clone()))), ["f"]);
        history.push(assistant_calls(&[("a", "f")]));
        history.push(tool("a", "one"));
        assert_eq!(call_names(&reply(&script, &turns(history.clone()))), ["g"]);
        history.push(assistant_calls(&[("b", "g")]));
        history.push(tool("b", "two"));
        let done = answer(reply(&script, &turns(history.clone())));
        assert_eq!(done, "f said one, g said two");

        // Past the end the last step (an answer) is replayed.
        history.push(assistant_calls(&[("c", "f")]));
        history.push(tool("c", "three"));
        assert_eq!(
            answer(reply(&script, &turns(history.clone()))),
            "f said three, g said two",
            "the most recent result for a name wins"
        );

        // A new user message starts again at step 0.
        history.push(json!({"role": "assistant", "content": "ok"}));
        history.push(user("and two more"));
        assert_eq!(call_names(&reply(&script, &turns(history))), ["f"]);

        // A rule that only calls tools ends with the fallback, not a loop.
        let looping = vec![user("loop"), assistant_calls(&[("x", "f")]), tool("x", "r")];
        assert_eq!(answer(reply(&script, &turns(looping))), FALLBACK_ANSWER);
    }

    #[test]
    fn tool_placeholder_keeps_every_marker_of_a_long_result() {
        let filler = "word ".repeat(100);
        let content = format!("[doc:1] start {filler}[doc:2] middle {filler} end [doc:3] [doc:1]");
        let quoted = excerpt(&content, EXCERPT_CHARS);
        assert!(quoted.chars().count() < EXCERPT_CHARS + 30, "{quoted}");
        assert!(quoted.starts_with("[doc:1] start word"));
        for marker in ["[doc:1]", "[doc:2]", "[doc:3]"] {
            assert!(quoted.contains(marker), "{marker} missing from {quoted}");
        }
        assert_eq!(quoted.matches("[doc:1]").count(), 1, "{quoted}");

        // A cut that would fall inside a marker moves before it.
        let content = format!("{}[doc:42] tail", "x".repeat(EXCERPT_CHARS - 3));
        let quoted = excerpt(&content, EXCERPT_CHARS);
        assert!(quoted.ends_with("… [doc:42]"), "{quoted}");
        assert!(!quoted.contains("[doc:4…"), "{quoted}");

        assert_eq!(excerpt("  short [doc:1] ", EXCERPT_CHARS), "short [doc:1]");
    }

    #[test]
    fn citations_and_user_placeholders() {
        let script = Script::from_json(
            r#"{"default": {"steps": [{"answer": "You said: {{user}} | sources: {{citations}}"}]}}"#,
        )
        .expect("script");
        let history = vec![
            json!({"role": "system", "content": "Known: [doc:7]"}),
            user("first [doc:x-1]"),
            assistant_calls(&[("a", "f")]),
            tool("a", "[doc:1] one [doc:2] two [doc:1] again [doc:] [doc:3"),
            json!({"role": "user", "content": [{"type": "text", "text": "last question"}]}),
        ];
        assert_eq!(
            answer(reply(&script, &turns(history))),
            "You said: last question | sources: [doc:7] [doc:x-1] [doc:1] [doc:2]"
        );
    }

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

    #[test]
    fn markers_and_fragments() {
        assert_eq!(
            doc_markers("a [doc:1] b [doc:12][doc:x_y] [doc:] [doc:3 [doc:[doc:4]"),
            ["[doc:1]", "[doc:12]", "[doc:x_y]", "[doc:4]"]
        );
        assert_eq!(fragments("{\"q\":\"é🐝\"}", 4), ["{\"q\"", ":\"é🐝", "\"}"]);
        assert_eq!(answer_pieces("a b  c d\ne").concat(), "a b  c d\ne");
        assert_eq!(
            answer_pieces("one two three four"),
            ["one two three ", "four"]
        );
    }

    // -----------------------------------------------------------------------
    // Over HTTP

    fn install_crypto_provider() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }

    async fn start(script: &str) -> (ScriptedServer, reqwest::Client) {
        install_crypto_provider();
        let server = within(ScriptedServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            Script::from_json(script).expect("script"),
        ))
        .await
        .expect("start");
        (server, reqwest::Client::new())
    }

    async fn post(
        client: &reqwest::Client,
        server: &ScriptedServer,
        body: String,
    ) -> (u16, String, String) {
        let response = within(
            client
                .post(format!("{}/chat/completions", server.base_url()))
                .header("content-type", "application/json")
                .body(body)
                .send(),
        )
        .await
        .expect("send");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (
            status,
            content_type,
            within(response.text()).await.expect("body"),
        )
    }

    /// The `data:` payloads of an SSE body, checking the framing on the way.
    fn payloads(body: &str) -> Vec<String> {
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        body.split("\n\n")
            .filter(|frame| !frame.is_empty())
            .map(|frame| {
                frame
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("bad frame {frame:?}"))
                    .to_owned()
            })
            .collect()
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
    async fn bad_requests_get_openai_errors_and_are_recorded() {
        let (server, client) = start("{}").await;
        let (status, _, text) = post(&client, &server, "{not json".to_owned()).await;
        assert_eq!(status, 400);
        let error: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(error["error"]["type"], json!("invalid_request_error"));
        assert_eq!(error["error"]["code"], json!("invalid_json"));
        assert!(error["error"]["message"].is_string());

        let (status, _, text) = post(&client, &server, json!({"model": "m"}).to_string()).await;
        assert_eq!(status, 400);
        let error: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(error["error"]["param"], json!("messages"));

        assert_eq!(
            server.requests(),
            [json!("{not json"), json!({"model": "m"})],
            "every body is recorded, even rejected ones"
        );

        let models = within(client.get(format!("{}/models", server.base_url())).send())
            .await
            .expect("models");
        let models: Value = within(models.json()).await.expect("json");
        assert_eq!(models["data"][0]["id"], json!(DEFAULT_MODEL));
        assert!(
            models["data"][0]["owned_by"]
                .as_str()
                .is_some_and(|o| o.contains("stand-in"))
        );

        let missing = within(
            client
                .get(format!("http://{}/v1/nope", server.addr()))
                .send(),
        )
        .await
        .expect("404");
        assert_eq!(missing.status().as_u16(), 404);
        let error: Value = within(missing.json()).await.expect("json");
        assert_eq!(error["error"]["code"], json!("unknown_url"));
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn serve_runs_until_its_shutdown_future_completes() {
        install_crypto_provider();
        let listener = within(TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            Script::from_json(r#"{"model": "custom-stand-in"}"#).expect("script"),
            async {
                let _ = stopped.await;
            },
        ));
        let response = within(
            reqwest::Client::new()
                .get(format!("http://{addr}/v1/models"))
                .send(),
        )
        .await
        .expect("models");
        let models: Value = within(response.json()).await.expect("json");
        assert_eq!(models["data"][0]["id"], json!("custom-stand-in"));
        stop.send(()).expect("server still running");
        within(task).await.expect("join").expect("serve returns Ok");
    }

    // -----------------------------------------------------------------------
    // The Responses API, refusals and faults over HTTP

    /// Posts `body` to `path` (under `/v1`) and reads the whole response,
    /// noting whether the body broke off instead of ending.
    async fn send(
        client: &reqwest::Client,
        server: &ScriptedServer,
        path: &str,
        body: &Value,
    ) -> (reqwest::StatusCode, HeaderMap, String, bool) {
        let mut response = within(
            client
                .post(format!("{}/{path}", server.base_url()))
                .json(body)
                .send(),
        )
        .await
        .expect("send");
        let status = response.status();
        let headers = response.headers().clone();
        let mut bytes = Vec::new();
        let mut broken = false;
        loop {
            match within(response.chunk()).await {
                Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        let text = String::from_utf8(bytes).expect("utf-8 body");
        (status, headers, text, broken)
    }

    /// The events of a Responses SSE body, checking that every frame is
    /// `event: <type>` + `data: <json with that type>`.
    fn response_events(body: &str) -> Vec<Value> {
        body.split("\n\n")
            .filter(|frame| !frame.is_empty())
            .map(|frame| {
                let (event, data) = frame.split_once('\n').expect("two lines");
                let kind = event.strip_prefix("event: ").expect("event line");
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").expect("data line"))
                        .expect("data JSON");
                assert_eq!(data["type"], json!(kind));
                data
            })
            .collect()
    }

    fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
        events.iter().filter(|e| e["type"] == kind).collect()
    }

    const RESPONSES: &str = r#"{
        "rules": [
            {"whenUserContains": ["weather"], "steps": [
                {"reasoning": true, "toolCalls": [
                    {"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}},
                    {"name": "lookup", "arguments": {}}]},
                {"answer": "It is {{tool:get_weather}} ({{tool:lookup}})"}]},
            {"whenUserContains": ["refuse"], "steps": [{"refusal": "I can't help with that."}]}
        ]
    }"#;

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
    async fn rules_can_pick_a_model_and_images_come_as_urls_or_base64() {
        let (server, client) = start(
            r#"{"imageBytes": 100000, "rules": [
                {"whenModel": ["gpt-broken"], "steps": [{"answer": "-",
                    "fault": {"kind": "status", "status": 503}}]},
                {"whenModel": ["gpt-terse"], "whenUserContains": ["summar"],
                    "steps": [{"answer": "terse"}]}
               ],
               "default": {"steps": [{"answer": "plain"}]}}"#,
        )
        .await;
        let ask = |model: &str, text: &str| json!({"model": model, "stream": false, "messages": [user(text)]});
        let (status, _, _, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-broken", "hi"),
        )
        .await;
        assert_eq!(status, 503);
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-terse", "summarize"),
        )
        .await;
        assert!(text.contains("terse"), "{text}");
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-terse", "hello"),
        )
        .await;
        assert!(text.contains("plain"), "both conditions must hold: {text}");
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("other", "summarize"),
        )
        .await;
        assert!(text.contains("plain"), "{text}");

        let (status, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3", "prompt": "a lighthouse"}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("json");
        assert!(
            answer["data"][0]["url"]
                .as_str()
                .unwrap()
                .starts_with("https://images.scripted.invalid/")
        );
        let (_, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "gpt-image-1", "prompt": "a lighthouse"}),
        )
        .await;
        let answer: Value = serde_json::from_str(&text).expect("json");
        use base64::Engine as _;
        let png = base64::engine::general_purpose::STANDARD
            .decode(answer["data"][0]["b64_json"].as_str().unwrap())
            .unwrap();
        assert_eq!(png.len(), 100_000);
        assert!(png.starts_with(b"\x89PNG"));
        let (status, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3", "prompt": "please refuse image"}),
        )
        .await;
        assert_eq!(status, 400);
        assert!(text.contains("content_policy_violation"), "{text}");
        let (status, _, _, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3"}),
        )
        .await;
        assert_eq!(status, 400);

        // Embeddings: deterministic, normalised, similar for shared words.
        let (status, _, text, _) = send(
            &client,
            &server,
            "embeddings",
            &json!({"model": "text-embedding-3-small", "input": ["bees dance", "bees dance", "Bees find nectar", "tax law"], "dimensions": 64}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("json");
        let vectors: Vec<Vec<f32>> = answer["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
            .collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert_eq!(vectors.len(), 4);
        assert_eq!(vectors[0].len(), 64);
        assert!((dot(&vectors[0], &vectors[0]) - 1.0).abs() < 1e-5);
        assert_eq!(vectors[0], vectors[1]);
        assert!(dot(&vectors[0], &vectors[2]) > dot(&vectors[0], &vectors[3]));
        let (_, _, text, _) = send(
            &client,
            &server,
            "embeddings",
            &json!({"model": "m", "input": "bees dance", "encoding_format": "base64", "dimensions": 64}),
        )
        .await;
        let answer: Value = serde_json::from_str(&text).expect("json");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(answer["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(decoded, vectors[0]);
        for bad in [
            json!({"model": "m"}),
            json!({"model": "m", "input": []}),
            json!({"model": "m", "input": "x", "dimensions": 0}),
        ] {
            let (status, _, text, _) = send(&client, &server, "embeddings", &bad).await;
            assert_eq!(status, 400, "{bad}: {text}");
        }
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

    #[test]
    fn every_example_script_is_valid() {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples"));
        let mut loaded = 0;
        for entry in std::fs::read_dir(dir).expect("examples dir") {
            let path = entry.expect("entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if name.ends_with("-script.json") {
                Script::load(&path).unwrap_or_else(|e| panic!("{e}"));
                loaded += 1;
            }
        }
        assert!(loaded >= 2, "the demo and the faults example");
    }
}
