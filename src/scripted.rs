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
        let raw: RawScript =
            serde_json::from_str(text).map_err(|source| ScriptError::Parse { path: None, source })?;
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
                return Err(format!(
                    "{at} needs exactly one of `toolCalls` or `answer`"
                ));
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
    fn invalid(message: impl Into<String>, param: Option<&str>, code: Option<&'static str>) -> Self {
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
        let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                format!("Invalid value: '{role}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."),
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
                        let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
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
            payloads.push(chunk(
                json!({"role": "assistant", "content": null}),
                None,
            ));
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
        #[allow(clippy::expect_used)]
        Url::parse(&format!("http://{}/v1", self.addr))
            .expect("a socket address always makes a valid http URL")
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
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await.is_err()
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
