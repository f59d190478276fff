//! Playing the script against a conversation: which rule and step answer
//! it, the step's text with its placeholders (`{{tool:NAME}}`,
//! `{{citations}}`, `{{user}}`) filled from the turns, and how a `length`
//! fault shortens it. The rules of play are written with the format in
//! `script`. Also what the bodies of both API shapes share: token
//! estimates, ids and timestamps.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::fault::Fault;
use crate::request::Turn;
use crate::script::{Action, Part, Script, StepKey, Template};

/// Replaces a `toolCalls` step replayed past the end of a rule.
const FALLBACK_ANSWER: &str =
    "(scripted stand-in) The script has no further steps for this conversation.";
/// About how much of a tool result `{{tool:NAME}}` quotes.
const EXCERPT_CHARS: usize = 400;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Reply {
    /// `(call id, function name, arguments JSON text)`.
    ToolCalls(Vec<(String, String, String)>),
    Answer(String),
    Refusal(String),
}

/// What the script says to a conversation, and what is to go wrong.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) reply: Reply,
    pub(crate) reasoning: bool,
    pub(crate) fault: Option<(StepKey, Fault)>,
    /// The step's `usage`, reported instead of the estimate.
    pub(crate) usage: Option<Value>,
}

/// Whether a request lets the model call tools: it does not say
/// `tool_choice: "none"`.
pub(crate) fn offers_tools(request: &Value) -> bool {
    request["tool_choice"] != "none"
}

/// Plays the script against a conversation. When the request says
/// `tool_choice: "none"`, a `toolCalls` step is answered like a real model
/// would: with the rule's next `answer` step, or the fallback answer.
pub(crate) fn plan(script: &Script, turns: &[Turn], model: &str, tools_offered: bool) -> Plan {
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
        usage: None,
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
                .map(|c| (new_id("call"), c.name.clone(), c.arguments.clone()))
                .collect(),
        ),
        Action::Answer(template) => Reply::Answer(render(template, turns, user)),
        Action::Refusal(text) => Reply::Refusal(text.clone()),
    };
    Plan {
        reply,
        reasoning: chosen.reasoning,
        fault: chosen.fault.clone().map(|f| ((rule, index), f)),
        usage: chosen.usage.clone(),
    }
}

/// The reply of a model that ran out of tokens: the first call's
/// arguments or the text cut in half, later calls dropped.
pub(crate) fn truncate(reply: Reply) -> Reply {
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
pub(crate) fn doc_markers(text: &str) -> Vec<&str> {
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

/// Tokens for `chars` characters of text: an estimate (characters / 4),
/// plausible rather than exact.
pub(crate) fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4).max(1)
}

pub(crate) fn reply_chars(reply: &Reply) -> usize {
    match reply {
        Reply::Answer(text) | Reply::Refusal(text) => text.chars().count(),
        Reply::ToolCalls(calls) => calls.iter().map(|(_, n, a)| n.len() + a.len()).sum(),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `prefix_` and 24 random hex digits, the shape of OpenAI ids.
pub(crate) fn new_id(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &id[..24])
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::DEFAULT_MODEL;
    use crate::test_support::*;

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
}
