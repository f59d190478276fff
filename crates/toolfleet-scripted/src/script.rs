//! The script the server follows instead of thinking: its format, how a
//! file is read and checked, and which rule and step answer a
//! conversation. Step faults are read in `fault`; playing a step against a
//! conversation is `reply`.
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
//!   `include: ["reasoning.encrypted_content"]` (see the request checks
//!   in `responses`).
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
//!   - `fault`: something to go wrong when this step is played, see `fault`.
//!   - `usage` (a JSON object): the usage the answer reports, sent as it
//!     is instead of the estimate (Chat Completions: the usage chunk's or
//!     body's `usage`; Responses: the final response's `usage`), e.g. one
//!     taken from a recorded provider stream with its
//!     `prompt_tokens_details.cached_tokens` /
//!     `input_tokens_details.cached_tokens`. Use the request's API shape.
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

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::fault::{Fault, RawFault, StepKind, fault_from_raw};

/// The model id when the script names none.
pub const DEFAULT_MODEL: &str = "toolfleet-scripted";
/// The answer when no rule matches and the script has no `default`.
const NO_SCRIPT_ANSWER: &str = "I have no script for that.";
/// Default of the script's `imageBytes`: a few megabytes, the size real
/// generated images have, so a test sees what a tool does with one.
const DEFAULT_IMAGE_BYTES: usize = 3 * 1024 * 1024;

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
    usage: Option<Value>,
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
pub(crate) struct Rule {
    /// Lower-cased once here; requests are lower-cased per call. Empty:
    /// any user message (the rule then names models).
    phrases: Vec<String>,
    /// The request's `model` must be one of these; empty: any model.
    models: Vec<String>,
    steps: Vec<Step>,
}

/// One scripted model turn: what the model says, and what goes wrong.
#[derive(Clone, Debug)]
pub(crate) struct Step {
    pub(crate) action: Action,
    pub(crate) reasoning: bool,
    pub(crate) fault: Option<Fault>,
    /// The usage to report instead of the estimate (`usage`).
    pub(crate) usage: Option<Value>,
}

impl Step {
    fn answer(text: &str) -> Self {
        Self {
            action: Action::Answer(Template {
                parts: vec![Part::Text(text.to_owned())],
            }),
            reasoning: false,
            fault: None,
            usage: None,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Action {
    ToolCalls(Vec<ScriptedCall>),
    Answer(Template),
    Refusal(String),
}

#[derive(Clone, Debug)]
pub(crate) struct ScriptedCall {
    pub(crate) name: String,
    /// JSON text, as a model would produce it.
    pub(crate) arguments: String,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Template {
    pub(crate) parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Part {
    Text(String),
    Tool(String),
    Citations,
    User,
}

/// Identifies a step for fault counting: rule index (`None` for
/// `default`) and step index.
pub(crate) type StepKey = (Option<usize>, usize);

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

    /// The size of a `b64_json` image before encoding (`imageBytes`).
    pub(crate) fn image_bytes(&self) -> usize {
        self.image_bytes
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
    pub(crate) fn steps_for(&self, user: &str, model: &str) -> (Option<usize>, &[Step]) {
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

impl Action {
    /// What the step says, as far as its fault cares.
    fn kind(&self) -> StepKind {
        match self {
            Self::ToolCalls(_) => StepKind::ToolCalls,
            Self::Answer(_) => StepKind::Answer,
            Self::Refusal(_) => StepKind::Refusal,
        }
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
            Some(raw) => Some(fault_from_raw(&format!("{at}.fault"), raw, action.kind())?),
            None => None,
        };
        if step.usage.as_ref().is_some_and(|u| !u.is_object()) {
            return Err(format!("{at}.usage must be a JSON object"));
        }
        steps.push(Step {
            action,
            reasoning: step.reasoning,
            fault,
            usage: step.usage,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;

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
