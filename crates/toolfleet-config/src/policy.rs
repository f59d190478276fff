//! The policies of a profile: the agentic loop's limits ([`LoopPolicy`]),
//! progressive tool scoping ([`ScopingPolicy`]) and preemptive retrieval
//! ([`RagPolicy`]), each its own table under `[profiles.<name>]`.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[profiles.<name>.policy]` | table | the agentic loop's limits: [`LoopPolicy`] |
//! | `policy.max_rounds` | 1..=100, `8` | model calls per invocation |
//! | `policy.max_consecutive_tool_errors` | 1..=100, `3` | rounds in a row whose tool calls all failed before the model is told to answer |
//! | `policy.parallel_tool_calls` | bool, `true` | let the model ask for several tools at once and run them in parallel (tools not marked `parallelSafe` still run one at a time) |
//! | `policy.max_calls_per_turn` | 1..=128, `8` | tool calls run per model turn; calls beyond it get an error result |
//! | `policy.max_tool_result_tokens` | 64..=1000000 or `"off"`, `4000` | cap on one tool result, in the model's tokens ([`toolfleet_llm::budget`]) |
//! | `policy.on_truncated_tool_call` | `"error"` (default) or `"ask_again"` | a tool call cut by the output limit: end with an error, or ask the model again |
//! | `policy.context_budget_tokens` | 1000..=2000000 or `"off"`, `"off"` | before a model call, a conversation over this many tokens (the model's encoding) has its older turns replaced by a summary made with the `llm:summarize` tool, down to about half of it; a `compacted` event says what was saved |
//! | `[profiles.<name>.scoping]` | table | progressive tool scoping: [`ScopingPolicy`] (`initial_tool_count` 20, `scoping_threshold` 30, `planning_threshold` 100, `max_expansion_rounds` 3, `max_tool_count` 30, `planning_history_message_count` 10) |
//! | `[profiles.<name>.rag]` | table | preemptive retrieval: [`RagPolicy`] (`prefetch` `true`, `top_k` 1..=20, `5`, `in_scope_only` `false`) |

use std::fmt;

use serde::{Deserialize, Deserializer};

pub const DEFAULT_MAX_ROUNDS: u32 = 8;
pub const DEFAULT_MAX_CONSECUTIVE_TOOL_ERRORS: u32 = 3;
pub const DEFAULT_MAX_CALLS_PER_TURN: usize = 8;
/// Large enough for a page of search results with their snippets, small
/// enough that a few results cannot crowd the conversation out of a
/// 128k-token context.
pub const DEFAULT_MAX_TOOL_RESULT_TOKENS: usize = 4000;

/// Upper bounds that catch typos (`max_rounds = 800`) rather than limit
/// real use.
const MAX_ROUNDS_LIMIT: u32 = 100;
const MAX_TOOL_ERRORS_LIMIT: u32 = 100;
const MAX_CALLS_PER_TURN_LIMIT: usize = 128;
const MAX_TOOL_RESULT_TOKENS_LIMIT: usize = 1_000_000;
/// The smallest context budget: below it a summary and the latest turn
/// would not fit.
pub const MIN_CONTEXT_BUDGET_TOKENS: usize = 1000;
/// The largest context budget (beyond any model's context window).
pub const MAX_CONTEXT_BUDGET_TOKENS: usize = 2_000_000;

/// Preemptive retrieval: when a chat job has attached documents or a data
/// source, the orchestrator searches them (through the retrieval pool, as
/// tool jobs) with the last user message before the first model call, and
/// puts what it found, with its `[doc:N]` markers, in the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RagPolicy {
    /// Search before the first model call. Default true.
    pub prefetch: bool,
    /// Passages per source (1..=20). Default 5.
    pub top_k: u32,
    /// The profile answers only from its documents: when the search found
    /// nothing, the model is told to try the search tools before saying
    /// there is no answer. Default false.
    pub in_scope_only: bool,
}

impl Default for RagPolicy {
    fn default() -> Self {
        Self {
            prefetch: true,
            top_k: 5,
            in_scope_only: false,
        }
    }
}

impl RagPolicy {
    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if !(1..=20).contains(&self.top_k) {
            return Err((
                format!("{at}.top_k"),
                format!("must be between 1 and 20, not {}", self.top_k),
            ));
        }
        Ok(())
    }
}

/// Progressive tool scoping for one profile: how many of the permitted
/// tools the model is offered, and when a planning call narrows them.
///
/// Up to `scoping_threshold` permitted tools, all are offered; above it,
/// token-overlap relevance picks the top `initial_tool_count` (must-include
/// tools always in); above `planning_threshold`, a planning call to the
/// profile's utility model narrows the set, using the last
/// `planning_history_message_count` messages. When tools were left out the
/// model may call `search_tools` to add some, at most
/// `max_expansion_rounds` times and never beyond `max_tool_count` tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScopingPolicy {
    pub initial_tool_count: usize,
    pub scoping_threshold: usize,
    pub planning_threshold: usize,
    pub max_expansion_rounds: u32,
    pub max_tool_count: usize,
    pub planning_history_message_count: usize,
}

/// Defaults of [`ScopingPolicy`].
pub const DEFAULT_INITIAL_TOOL_COUNT: usize = 20;
pub const DEFAULT_SCOPING_THRESHOLD: usize = 30;
pub const DEFAULT_PLANNING_THRESHOLD: usize = 100;
pub const DEFAULT_MAX_EXPANSION_ROUNDS: u32 = 3;
pub const DEFAULT_MAX_TOOL_COUNT: usize = 30;
pub const DEFAULT_PLANNING_HISTORY_MESSAGE_COUNT: usize = 10;
/// The most tools any request may offer (providers cap tools per request;
/// OpenAI at 128).
pub const MAX_TOOLS_PER_REQUEST: usize = 128;

impl Default for ScopingPolicy {
    fn default() -> Self {
        Self {
            initial_tool_count: DEFAULT_INITIAL_TOOL_COUNT,
            scoping_threshold: DEFAULT_SCOPING_THRESHOLD,
            planning_threshold: DEFAULT_PLANNING_THRESHOLD,
            max_expansion_rounds: DEFAULT_MAX_EXPANSION_ROUNDS,
            max_tool_count: DEFAULT_MAX_TOOL_COUNT,
            planning_history_message_count: DEFAULT_PLANNING_HISTORY_MESSAGE_COUNT,
        }
    }
}

impl ScopingPolicy {
    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let check = |key: &str, low: usize, high: usize, value: usize| {
            if (low..=high).contains(&value) {
                Ok(())
            } else {
                Err((
                    format!("{at}.{key}"),
                    format!("must be between {low} and {high}, not {value}"),
                ))
            }
        };
        check(
            "initial_tool_count",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.initial_tool_count,
        )?;
        check(
            "max_tool_count",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.max_tool_count,
        )?;
        check(
            "scoping_threshold",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.scoping_threshold,
        )?;
        check("planning_threshold", 1, usize::MAX, self.planning_threshold)?;
        check(
            "max_expansion_rounds",
            0,
            100,
            self.max_expansion_rounds as usize,
        )?;
        check(
            "planning_history_message_count",
            1,
            500,
            self.planning_history_message_count,
        )?;
        if self.scoping_threshold > self.max_tool_count {
            return Err((
                format!("{at}.scoping_threshold"),
                format!(
                    "must not exceed max_tool_count ({}): up to the threshold every permitted tool is offered; is {}",
                    self.max_tool_count, self.scoping_threshold
                ),
            ));
        }
        if self.initial_tool_count > self.max_tool_count {
            return Err((
                format!("{at}.initial_tool_count"),
                format!(
                    "must not exceed max_tool_count ({}), is {}",
                    self.max_tool_count, self.initial_tool_count
                ),
            ));
        }
        Ok(())
    }
}

/// What to do with a tool call the model's output limit cut short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncatedPolicy {
    /// Dispatch nothing and end the invocation with a clear error.
    #[default]
    Error,
    /// Dispatch nothing and ask the model again, telling it the call was cut.
    AskAgain,
}

/// The agentic loop's limits for one profile.
///
/// Default: 8 rounds, 3 consecutive tool errors, parallel tool calls on, 8
/// calls per turn, tool results capped at 4000 tokens, truncated tool calls
/// end the invocation with an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoopPolicy {
    /// Model calls per invocation; on the last one the model is told to
    /// answer with what it has.
    pub max_rounds: u32,
    /// Rounds in a row whose tool calls all failed before the model is told
    /// to answer with what it has.
    pub max_consecutive_tool_errors: u32,
    /// Whether the model may ask for several tools in one turn (run in
    /// parallel unless a tool is not `parallelSafe`).
    pub parallel_tool_calls: bool,
    /// Tool calls run per model turn; the rest get an error result.
    pub max_calls_per_turn: usize,
    /// Cap on one tool result in the model's tokens; `None` (`"off"` in the
    /// file): no cap.
    #[serde(deserialize_with = "deserialize_token_cap")]
    pub max_tool_result_tokens: Option<usize>,
    pub on_truncated_tool_call: TruncatedPolicy,
    /// Context compaction: a conversation over this many tokens has its
    /// older turns summarised before the next model call; `None` (`"off"`,
    /// the default): never.
    #[serde(deserialize_with = "deserialize_token_cap")]
    pub context_budget_tokens: Option<usize>,
}

impl Default for LoopPolicy {
    fn default() -> Self {
        Self {
            max_rounds: DEFAULT_MAX_ROUNDS,
            max_consecutive_tool_errors: DEFAULT_MAX_CONSECUTIVE_TOOL_ERRORS,
            parallel_tool_calls: true,
            max_calls_per_turn: DEFAULT_MAX_CALLS_PER_TURN,
            max_tool_result_tokens: Some(DEFAULT_MAX_TOOL_RESULT_TOKENS),
            on_truncated_tool_call: TruncatedPolicy::default(),
            context_budget_tokens: None,
        }
    }
}

impl LoopPolicy {
    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let out_of_range = |key: &str, low: usize, high: usize, value: usize| {
            (!(low..=high).contains(&value)).then(|| {
                (
                    format!("{at}.{key}"),
                    format!("must be between {low} and {high}, not {value}"),
                )
            })
        };
        let checks = [
            out_of_range(
                "max_rounds",
                1,
                MAX_ROUNDS_LIMIT as usize,
                self.max_rounds as usize,
            ),
            out_of_range(
                "max_consecutive_tool_errors",
                1,
                MAX_TOOL_ERRORS_LIMIT as usize,
                self.max_consecutive_tool_errors as usize,
            ),
            out_of_range(
                "max_calls_per_turn",
                1,
                MAX_CALLS_PER_TURN_LIMIT,
                self.max_calls_per_turn,
            ),
            self.max_tool_result_tokens.and_then(|cap| {
                out_of_range(
                    "max_tool_result_tokens",
                    toolfleet_llm::budget::MIN_CAP_TOKENS,
                    MAX_TOOL_RESULT_TOKENS_LIMIT,
                    cap,
                )
            }),
            self.context_budget_tokens.and_then(|budget| {
                out_of_range(
                    "context_budget_tokens",
                    MIN_CONTEXT_BUDGET_TOKENS,
                    MAX_CONTEXT_BUDGET_TOKENS,
                    budget,
                )
            }),
        ];
        match checks.into_iter().flatten().next() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// A token count, or `"off"` for no cap (TOML has no null).
fn deserialize_token_cap<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    struct CapVisitor;

    impl serde::de::Visitor<'_> for CapVisitor {
        type Value = Option<usize>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a number of tokens or \"off\"")
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            usize::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{v} is not a number of tokens")))
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            usize::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{v} is too large")))
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if v == "off" {
                Ok(None)
            } else {
                Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
            }
        }
    }

    d.deserialize_any(CapVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{EXAMPLE, MINIMAL, parse, parse_err};

    #[test]
    fn rag_policy_and_link_templates_load_and_are_checked() {
        let config = parse(EXAMPLE).expect("loads");
        let default = &config.profiles["default"];
        assert_eq!(default.rag, RagPolicy::default());
        assert!(default.rag.prefetch && default.rag.top_k == 5 && !default.rag.in_scope_only);
        assert_eq!(
            config.links["data_source"],
            "https://wiki.example.com/handbook/{source}"
        );
        let with = |extra: &str| format!("{MINIMAL}\n{extra}");
        let ok = parse(&with(
            "[profiles.default.rag]\nprefetch = false\ntop_k = 20\nin_scope_only = true",
        ))
        .unwrap();
        assert!(!ok.profiles["default"].rag.prefetch);
        for (extra, key, says) in [
            (
                "[profiles.default.rag]\ntop_k = 0",
                "profiles.default.rag.top_k",
                "between 1 and 20",
            ),
            (
                "[profiles.default.rag]\ntop_k = 21",
                "profiles.default.rag.top_k",
                "between 1 and 20",
            ),
            (
                "[links]\ndocument = \"https://x/{source}\"",
                "links.document",
                "uploaded documents have no link",
            ),
            (
                "[links]\nweb = \"ftp://x/{source}\"",
                "links.web",
                "not an http(s) URL template",
            ),
            (
                "[links]\nweb = \"https://x/fixed\"",
                "links.web",
                "not an http(s) URL template",
            ),
        ] {
            let e = parse_err(&with(extra));
            assert_eq!(e.key.as_deref(), Some(key), "{extra}: {e}");
            assert!(e.to_string().contains(says), "{extra}: {e}");
        }
        let e = parse_err(&with("[profiles.default.rag]\nprefech = true"));
        assert!(e.to_string().contains("prefech"), "{e}");
    }
}
