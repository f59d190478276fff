//! The scripted model server: a stand-in for an OpenAI-compatible provider,
//! so tests and the offline demo run with no real model. It says so: the
//! start-up log line, the `system_fingerprint` of every response and the
//! `owned_by` of `GET /v1/models` all name it a scripted stand-in.
//!
//! It serves `POST /v1/chat/completions` (streaming SSE, `data: {..}\n\n`
//! chunks ending in `data: [DONE]`, or one JSON body) and `GET /v1/models`,
//! and answers by following a JSON script instead of thinking. It records
//! every request body it receives so tests can assert what the model was
//! sent ([`ScriptedServer::requests`]).
//!
//! # Script format
//!
//! ```json
//! {
//!   "description": "optional free text, ignored",
//!   "model": "toolfleet-scripted",
//!   "chunkDelayMs": 0,
//!   "rules": [
//!     {
//!       "description": "optional free text, ignored",
//!       "whenUserContains": ["time", "tide"],
//!       "steps": [
//!         { "toolCalls": [
//!             { "name": "current_datetime", "arguments": {} },
//!             { "name": "search_documents", "arguments": { "query": "tides" } } ] },
//!         { "answer": "It is {{tool:current_datetime}}. The documents say: {{tool:search_documents}}" }
//!       ]
//!     }
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
//! - `chunkDelayMs` (optional, default 0): pause before each streamed chunk.
//! - `rules` (optional): tried in order; the first rule with any
//!   `whenUserContains` phrase inside the *last* user message (compared
//!   case-insensitively as substrings) answers. Each rule needs at least one
//!   phrase and at least one step.
//! - `default` (optional): the steps used when no rule matches; without it
//!   the server answers "I have no script for that."
//! - A step has exactly one of:
//!   - `toolCalls`: a non-empty list of `{ "name", "arguments" }`, with
//!     `arguments` a JSON object (default `{}`). All calls go out in one
//!     response, as parallel tool calls with `finish_reason: "tool_calls"`
//!     and unique `call_<random>` ids. Streamed, each call is split the way
//!     OpenAI splits it: a first chunk with `index`, `id`, `type` and
//!     `function.name` and empty arguments, then argument fragments carrying
//!     only `index`.
//!   - `answer`: a text template, streamed a few words per chunk, ending
//!     with `finish_reason: "stop"`. Placeholders:
//!     - `{{tool:NAME}}`: the content of the most recent tool message that
//!       answers a call to function `NAME` (found through the ids of the
//!       assistant `tool_calls`). Long results are cut to about 400
//!       characters, and every `[doc:N]` marker of the full result that the
//!       cut dropped is appended, so citations survive. `NAME` must be
//!       called by a `toolCalls` step of the same rule.
//!     - `{{citations}}`: every distinct `[doc:N]` marker in any message of
//!       the request, in order of first appearance, space-separated.
//!     - `{{user}}`: the last user message.
//!
//! The step to play is the number of assistant messages with tool calls
//! after the last user message: step 0 on the first call, step 1 after one
//! tool round, and so on. When the steps run out the last one is replayed,
//! except that a last `toolCalls` step is replaced by a plain fallback answer
//! so an agent loop cannot spin forever.
//!
//! Streaming honours `stream_options.include_usage` with a trailing
//! usage-only chunk (`choices: []`); token counts are estimates (characters
//! / 4), plausible rather than exact.
//!
//! # Request checks
//!
//! Like OpenAI, it answers 400 with `{"error":{"message","type":
//! "invalid_request_error","param","code"}}` to a body that is not JSON
//! (`invalid_json`), a missing `model` or `messages`
//! (`missing_required_parameter`), empty `messages` (`empty_array`), an
//! unknown role (`invalid_value`), a tool message that answers no preceding
//! tool call, or an assistant tool call left without a tool message (code
//! `null`). Being as strict as the real API catches conversation bugs in
//! tests rather than in production.
//!
//! The step type is a struct with one `action`, so later failure modes (a
//! `fault` such as a 429 or a cut stream) can sit beside it.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use url::Url;

/// The model id when the script names none.
pub const DEFAULT_MODEL: &str = "toolfleet-scripted";
/// Sent as `system_fingerprint` on every response: anyone reading a
/// recorded response can tell it did not come from a real model.
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
/// Requests kept for [`ScriptedServer::requests`]; the oldest go first, so a
/// long-running demo server does not grow without bound.
const MAX_RECORDED_REQUESTS: usize = 1000;
/// Request bodies carry whole conversations with tool results.
const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;

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
    #[serde(default)]
    chunk_delay_ms: u64,
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
    when_user_contains: Vec<String>,
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
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// A validated script. See the module docs for the format.
#[derive(Clone, Debug)]
pub struct Script {
    model: String,
    chunk_delay: Duration,
    rules: Vec<Rule>,
    default: Vec<Step>,
}

#[derive(Clone, Debug)]
struct Rule {
    /// Lower-cased once here; requests are lower-cased per call.
    phrases: Vec<String>,
    steps: Vec<Step>,
}

/// One scripted model turn. A struct rather than a bare enum so failure
/// modes can be added beside the action later.
#[derive(Clone, Debug)]
struct Step {
    action: Action,
}

#[derive(Clone, Debug)]
enum Action {
    ToolCalls(Vec<ScriptedCall>),
    Answer(Template),
}

#[derive(Clone, Debug)]
struct ScriptedCall {
    name: String,
    /// JSON text, as a model would produce it.
    arguments: String,
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
            if phrases.is_empty() || phrases.iter().any(String::is_empty) {
                return Err(format!(
                    "{at}.whenUserContains must list at least one phrase, and no empty ones"
                ));
            }
            rules.push(Rule {
                phrases,
                steps: steps_from_raw(&at, rule.steps)?,
            });
        }
        let default = match raw.default {
            Some(default) => steps_from_raw("default", default.steps)?,
            None => vec![Step {
                action: Action::Answer(Template {
                    parts: vec![Part::Text(NO_SCRIPT_ANSWER.to_owned())],
                }),
            }],
        };
        Ok(Self {
            model,
            chunk_delay: Duration::from_millis(raw.chunk_delay_ms),
            rules,
            default,
        })
    }

    /// The steps for a conversation whose last user message is `user`.
    fn steps_for(&self, user: &str) -> (Option<usize>, &[Step]) {
        let user = user.to_lowercase();
        self.rules
            .iter()
            .enumerate()
            .find(|(_, rule)| rule.phrases.iter().any(|p| user.contains(p.as_str())))
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
        let action = match (step.tool_calls, step.answer) {
            (Some(calls), None) => {
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
            (None, Some(answer)) => {
                Action::Answer(parse_template(&answer).map_err(|e| format!("{at}.answer: {e}"))?)
            }
            _ => {
                return Err(format!("{at} needs exactly one of `toolCalls` or `answer`"));
            }
        };
        steps.push(Step { action });
    }
    // A placeholder for a tool this rule never calls is a typo, and would
    // otherwise only show up as an odd sentence in a demo.
    let called: Vec<&str> = steps
        .iter()
        .filter_map(|s| match &s.action {
            Action::ToolCalls(calls) => Some(calls.iter().map(|c| c.name.as_str())),
            Action::Answer(_) => None,
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

// ---------------------------------------------------------------------------
// Choosing and rendering the reply

#[derive(Debug, PartialEq)]
enum Reply {
    ToolCalls(Vec<(String, String, String)>),
    Answer(String),
}

/// What the script says to a conversation.
fn reply(script: &Script, turns: &[Turn]) -> Reply {
    let last_user = turns.iter().rposition(|t| t.role == "user");
    let user = last_user.map_or("", |i| turns[i].text.as_str());
    let (rule, steps) = script.steps_for(user);
    let step = turns[last_user.map_or(0, |i| i + 1)..]
        .iter()
        .filter(|t| t.role == "assistant" && !t.calls.is_empty())
        .count();
    tracing::debug!(rule = ?rule, step, "scripted reply");
    let (chosen, past_end) = match steps.get(step) {
        Some(chosen) => (chosen, false),
        None => match steps.last() {
            Some(last) => (last, true),
            // Validation never lets a rule have no steps.
            None => return Reply::Answer(FALLBACK_ANSWER.to_owned()),
        },
    };
    match &chosen.action {
        // Replaying a tool round past the end of the rule would loop the
        // agent forever; answer instead.
        Action::ToolCalls(_) if past_end => Reply::Answer(FALLBACK_ANSWER.to_owned()),
        Action::ToolCalls(calls) => Reply::ToolCalls(
            calls
                .iter()
                .map(|c| (new_call_id(), c.name.clone(), c.arguments.clone()))
                .collect(),
        ),
        Action::Answer(template) => Reply::Answer(render(template, turns, user)),
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
// Response bodies

fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4).max(1)
}

struct Envelope<'a> {
    id: String,
    created: u64,
    model: &'a str,
}

impl Envelope<'_> {
    fn new(model: &str) -> Envelope<'_> {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let id = uuid::Uuid::new_v4().simple().to_string();
        Envelope {
            id: format!("chatcmpl-{}", &id[..24]),
            created,
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

fn reply_chars(reply: &Reply) -> usize {
    match reply {
        Reply::Answer(text) => text.chars().count(),
        Reply::ToolCalls(calls) => calls.iter().map(|(_, n, a)| n.len() + a.len()).sum(),
    }
}

/// The non-streaming `chat.completion` body.
fn completion_body(envelope: &Envelope<'_>, reply: &Reply, prompt_tokens: u64) -> Value {
    let (message, finish_reason) = match reply {
        Reply::Answer(text) => (
            json!({"role": "assistant", "content": text, "refusal": null}),
            "stop",
        ),
        Reply::ToolCalls(calls) => (
            json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": tool_calls_json(calls)}),
            "tool_calls",
        ),
    };
    let mut body = envelope.base("chat.completion");
    body.insert(
        "choices".into(),
        json!([{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason}]),
    );
    body.insert(
        "usage".into(),
        usage_json(prompt_tokens, estimate_tokens(reply_chars(reply))),
    );
    Value::Object(body)
}

/// The `data:` payloads of a streamed reply, `[DONE]` included.
fn stream_payloads(
    envelope: &Envelope<'_>,
    reply: &Reply,
    prompt_tokens: u64,
    include_usage: bool,
) -> Vec<String> {
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
    let mut payloads = Vec::new();
    match reply {
        Reply::Answer(text) => {
            payloads.push(chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                None,
            ));
            for piece in answer_pieces(text) {
                payloads.push(chunk(json!({"content": piece}), None));
            }
            payloads.push(chunk(json!({}), Some("stop")));
        }
        Reply::ToolCalls(calls) => {
            payloads.push(chunk(json!({"role": "assistant", "content": null}), None));
            for (index, (id, name, arguments)) in calls.iter().enumerate() {
                payloads.push(chunk(
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    None,
                ));
                for fragment in fragments(arguments, ARGUMENT_FRAGMENT_CHARS) {
                    payloads.push(chunk(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
                        None,
                    ));
                }
            }
            payloads.push(chunk(json!({}), Some("tool_calls")));
        }
    }
    if include_usage {
        let mut body = envelope.base("chat.completion.chunk");
        body.insert("choices".into(), json!([]));
        body.insert(
            "usage".into(),
            usage_json(prompt_tokens, estimate_tokens(reply_chars(reply))),
        );
        payloads.push(Value::Object(body).to_string());
    }
    payloads.push("[DONE]".to_owned());
    payloads
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

// ---------------------------------------------------------------------------
// The server

struct ServerState {
    script: Script,
    requests: Mutex<VecDeque<Value>>,
}

impl ServerState {
    fn record(&self, body: Value) {
        // A panic elsewhere while holding the lock leaves a usable log.
        let mut requests = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        if requests.len() == MAX_RECORDED_REQUESTS {
            requests.pop_front();
        }
        requests.push_back(body);
    }
}

fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .fallback(unknown_url)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
}

async fn chat_completions(State(state): State<Arc<ServerState>>, body: Bytes) -> Response {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            // Recorded as text so a test can still see what was sent.
            state.record(Value::String(String::from_utf8_lossy(&body).into_owned()));
            return ApiError::invalid(
                format!("We could not parse the JSON body of your request: {e}"),
                None,
                Some("invalid_json"),
            )
            .into_response();
        }
    };
    state.record(request.clone());
    let turns = match read_request(&request) {
        Ok(turns) => turns,
        Err(e) => return e.into_response(),
    };
    let script = &state.script;
    let reply = reply(script, &turns);
    let prompt_chars: usize = turns.iter().map(|t| t.text.chars().count()).sum::<usize>()
        + request.get("tools").map_or(0, |t| t.to_string().len());
    let prompt_tokens = estimate_tokens(prompt_chars);
    let envelope = Envelope::new(&script.model);
    if request.get("stream").and_then(Value::as_bool) != Some(true) {
        return axum::Json(completion_body(&envelope, &reply, prompt_tokens)).into_response();
    }
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let frames: Vec<Bytes> = stream_payloads(&envelope, &reply, prompt_tokens, include_usage)
        .into_iter()
        .map(|payload| Bytes::from(format!("data: {payload}\n\n")))
        .collect();
    let delay = script.chunk_delay;
    let stream = futures::stream::iter(frames).then(move |frame| async move {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Ok::<_, Infallible>(frame)
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
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

async fn unknown_url(method: Method, uri: Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "Unknown request URL: {method} {}. The scripted stand-in serves POST /v1/chat/completions and GET /v1/models.",
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
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Serves `script` on `listener` until `shutdown` completes. The CLI's
/// `toolfleet scripted-model --listen ADDR --script FILE` runs this.
pub async fn serve(
    listener: TcpListener,
    script: Script,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(ServerState {
        script,
        requests: Mutex::new(VecDeque::new()),
    });
    serve_state(listener, state, shutdown).await
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
        let state = Arc::new(ServerState {
            script,
            requests: Mutex::new(VecDeque::new()),
        });
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

    /// Every request body received so far, oldest first (the last 1000).
    /// A body that was not JSON appears as a JSON string.
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
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
            "/examples/demo-script.json"
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

    fn call_names(reply: &Reply) -> Vec<&str> {
        match reply {
            Reply::ToolCalls(calls) => calls.iter().map(|(_, n, _)| n.as_str()).collect(),
            Reply::Answer(text) => panic!("expected tool calls, got answer {text:?}"),
        }
    }

    fn answer(reply: Reply) -> String {
        match reply {
            Reply::Answer(text) => text,
            Reply::ToolCalls(calls) => panic!("expected an answer, got calls {calls:?}"),
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
                "rules[0].whenUserContains must list at least one phrase",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": []}]}"#,
                "rules[0].steps must not be empty",
            ),
            (
                r#"{"rules": [{"whenUserContains": ["a"], "steps": [{}]}]}"#,
                "rules[0].steps[0] needs exactly one of `toolCalls` or `answer`",
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
            (r#"{"chunkDelayMs": -1}"#, "invalid value"),
        ];
        for (text, want) in cases {
            let err = Script::from_json(text).expect_err(text).to_string();
            assert!(err.contains(want), "{text}: got {err:?}, want {want:?}");
        }
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
        assert_eq!(call_names(&first), ["current_datetime", "search_documents"]);
        let Reply::ToolCalls(calls) = &first else {
            unreachable!()
        };
        let search: Value = serde_json::from_str(&calls[1].2).expect("arguments are JSON");
        assert_eq!(search["limit"], json!(3));
        assert!(
            search["query"]
                .as_str()
                .is_some_and(|q| q.contains("lighthouse"))
        );
        let text = answer(reply(
            &script,
            &turns(vec![
                user(question),
                assistant_calls(&[("c1", "current_datetime"), ("c2", "search_documents")]),
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
            assert_eq!(call_names(&first), ["search_documents"], "{question}");
            let text = answer(reply(
                &script,
                &turns(vec![
                    user(question),
                    assistant_calls(&[("c1", "search_documents")]),
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

    async fn start(script: &str) -> (ScriptedServer, reqwest::Client) {
        crate::llm::install_crypto_provider();
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
            {"name": "search_documents", "arguments": {"query": "how lighthouses warn ships", "limit": 3}}
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
                "search_documents",
                json!({"query": "how lighthouses warn ships", "limit": 3}),
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
        crate::llm::install_crypto_provider();
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
}
