//! The fleet's events folded into what a client of either API sees: text
//! pieces with their citations, the calls held for approval, the usage at
//! the end, or the error. Both wire shapes ([`super::chat`],
//! [`super::responses`]) are written from these [`Output`]s, streamed or
//! not, so they cannot disagree.
//!
//! Citations. The model cites `[doc:N]` (N from the invocation's
//! references, announced by `references` events before the text that cites
//! them). The client sees `[k]` instead, numbered 1, 2, … in order of first
//! citation, and one annotation per marker: its span in the answer (in
//! characters, as Python indexes a string), the reference's URL (its
//! source when it has none) and title. A marker that cites nothing known
//! is dropped, as the fleet's own renderer does. A marker split across two
//! deltas is held back until it is whole.

use std::collections::BTreeMap;

use serde_json::Value;
use toolfleet_protocol::usage::Usage;
use toolfleet_protocol::{ChatEventBody, Reference};

use super::error::ApiError;

/// One citation: the span of its marker in the answer, in characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Citation {
    pub start: usize,
    pub end: usize,
    pub url: String,
    pub title: String,
}

/// A tool call the fleet holds for a person's approval.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Held {
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub expires_at_ms: u64,
}

/// What a client is told, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Output {
    /// The fleet works on it (a tool call or result): nothing to show,
    /// but the answer is under way.
    Progress,
    /// A piece of the answer, with the citations inside it.
    Text {
        text: String,
        citations: Vec<Citation>,
    },
    /// The invocation waits for a person to approve these calls (it is
    /// parked, not ended): the last output.
    Approval(Vec<Held>),
    /// The answer is complete: the last output.
    Done { usage: Usage },
    /// The invocation failed: the last output.
    Failed(ApiError),
}

impl Output {
    /// Whether nothing follows it.
    pub(crate) fn is_last(&self) -> bool {
        matches!(
            self,
            Output::Approval(_) | Output::Done { .. } | Output::Failed(_)
        )
    }
}

/// A whole answer, for the APIs' shapes that are not streamed.
#[derive(Debug, Default)]
pub(crate) struct Collected {
    pub text: String,
    pub citations: Vec<Citation>,
    /// Calls held for approval (the answer waits for them).
    pub held: Vec<Held>,
    /// The invocation's usage, once it completed.
    pub usage: Option<Usage>,
}

impl Collected {
    /// Adds one output.
    ///
    /// # Errors
    ///
    /// The failure, when `out` is one.
    pub(crate) fn add(&mut self, out: Output) -> Result<(), ApiError> {
        match out {
            Output::Progress => {}
            Output::Text { text, citations } => {
                self.text.push_str(&text);
                self.citations.extend(citations);
            }
            Output::Approval(held) => self.held = held,
            Output::Done { usage } => self.usage = Some(usage),
            Output::Failed(e) => return Err(e),
        }
        Ok(())
    }
}

/// `[doc:N]` markers rewritten to `[k]`, with their spans.
#[derive(Debug, Default)]
pub(crate) struct Renderer {
    /// Fleet index → display number.
    numbers: BTreeMap<u64, usize>,
    /// The end of the text so far that may begin a marker.
    carry: String,
    /// Characters written so far.
    written: usize,
}

const MARKER: &str = "[doc:";

impl Renderer {
    /// The next piece of the answer, `refs` the references known so far.
    pub(crate) fn push(
        &mut self,
        delta: &str,
        refs: &BTreeMap<u64, Reference>,
    ) -> (String, Vec<Citation>) {
        let mut text = std::mem::take(&mut self.carry);
        text.push_str(delta);
        if let Some(at) = text.rfind('[')
            && could_begin_marker(&text[at..])
        {
            self.carry = text.split_off(at);
        }
        let mut out = String::with_capacity(text.len());
        let mut citations = Vec::new();
        let mut rest = text.as_str();
        while let Some(start) = rest.find(MARKER) {
            self.emit(&mut out, &rest[..start]);
            let after = &rest[start + MARKER.len()..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 || !after[digits..].starts_with(']') {
                self.emit(&mut out, MARKER);
                rest = after;
                continue;
            }
            let reference = after[..digits].parse().ok().and_then(|n| refs.get(&n));
            if let Some(r) = reference {
                let next = self.numbers.len() + 1;
                let k = *self.numbers.entry(r.index).or_insert(next);
                let begin = self.written;
                self.emit(&mut out, &format!("[{k}]"));
                citations.push(Citation {
                    start: begin,
                    end: self.written,
                    url: r
                        .url
                        .clone()
                        .or_else(|| r.source.clone())
                        .unwrap_or_default(),
                    title: r.title.clone(),
                });
            }
            rest = &after[digits + 1..];
        }
        self.emit(&mut out, rest);
        (out, citations)
    }

    /// What was held back, as plain text: the answer ended inside what
    /// only looked like a marker.
    pub(crate) fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.carry);
        self.written += rest.chars().count();
        rest
    }

    fn emit(&mut self, out: &mut String, s: &str) {
        self.written += s.chars().count();
        out.push_str(s);
    }
}

/// Whether `s` (starting at a `[`) may still become a whole marker.
fn could_begin_marker(s: &str) -> bool {
    if s.len() <= MARKER.len() {
        return MARKER.starts_with(s);
    }
    s.starts_with(MARKER) && s[MARKER.len()..].bytes().all(|b| b.is_ascii_digit())
}

/// The fold of one invocation's events.
#[derive(Debug, Default)]
pub(crate) struct Answer {
    refs: BTreeMap<u64, Reference>,
    renderer: Renderer,
    streamed: bool,
}

impl Answer {
    /// What `event` shows the client (approval requests are gathered by
    /// the caller: see [`super::job::Follow`]).
    pub(crate) fn on_event(&mut self, event: ChatEventBody) -> Vec<Output> {
        match event {
            ChatEventBody::References { references } => {
                self.refs
                    .extend(references.into_iter().map(|r| (r.index, r)));
                vec![Output::Progress]
            }
            ChatEventBody::ToolCall { .. }
            | ChatEventBody::ToolResult { .. }
            | ChatEventBody::ToolProgress { .. } => vec![Output::Progress],
            ChatEventBody::Delta { text } => {
                self.streamed = true;
                let (text, citations) = self.renderer.push(&text, &self.refs);
                text_output(text, citations).into_iter().collect()
            }
            ChatEventBody::Completed {
                text,
                references,
                usage,
                ..
            } => {
                let mut out = Vec::new();
                // The answer came without deltas (no streamed model call):
                // the completed text, with its own (renumbered) references.
                if !self.streamed {
                    let refs = references.into_iter().map(|r| (r.index, r)).collect();
                    let (text, citations) = self.renderer.push(&text, &refs);
                    out.extend(text_output(text, citations));
                }
                out.extend(text_output(self.renderer.finish(), Vec::new()));
                out.push(Output::Done { usage });
                out
            }
            ChatEventBody::Error {
                code,
                message,
                retry_after_ms,
            } => vec![Output::Failed(ApiError::from_fleet(
                &code,
                &message,
                retry_after_ms,
            ))],
            ChatEventBody::ApprovalRequested {
                call_id,
                tool,
                arguments,
                expires_at_ms,
                ..
            } => vec![Output::Approval(vec![Held {
                call_id,
                tool,
                arguments,
                expires_at_ms,
            }])],
            _ => Vec::new(),
        }
    }
}

fn text_output(text: String, citations: Vec<Citation>) -> Option<Output> {
    (!text.is_empty()).then_some(Output::Text { text, citations })
}

/// The text a client is shown for calls held for approval (Chat
/// Completions has no item for it).
pub(crate) fn approval_text(held: &[Held], invocation_id: &str) -> String {
    let calls: Vec<String> = held
        .iter()
        .map(|h| format!("{} (call {})", h.tool, h.call_id))
        .collect();
    format!(
        "This request waits for approval of {}. It goes on once an approver decides \
         (`toolfleet approve --tenant <tenant> {invocation_id} <call id>`); the answer can then be \
         read as response resp_{invocation_id}.",
        calls.join(", ")
    )
}

/// The usage in Chat Completions' shape.
pub(crate) fn chat_usage(u: &Usage) -> Value {
    serde_json::json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
        "completion_tokens_details": { "reasoning_tokens": u.reasoning_tokens },
    })
}

/// The usage in the Responses API's shape.
pub(crate) fn responses_usage(u: &Usage) -> Value {
    serde_json::json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": { "cached_tokens": u.cached_tokens },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": { "reasoning_tokens": u.reasoning_tokens },
        "total_tokens": u.total_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(index: u64, url: Option<&str>) -> Reference {
        Reference {
            index,
            kind: "document".into(),
            title: format!("Doc {index}"),
            source: Some(format!("handbook/{index}.md")),
            url: url.map(str::to_string),
            snippet: None,
            tool_id: None,
            call_id: None,
        }
    }

    #[test]
    fn markers_become_numbers_in_order_of_citation_with_their_spans() {
        let refs: BTreeMap<u64, Reference> = [
            (3, reference(3, Some("https://x/3"))),
            (7, reference(7, None)),
        ]
        .into_iter()
        .collect();
        let mut r = Renderer::default();
        let mut text = String::new();
        let mut cites = Vec::new();
        // Split inside markers, across pieces, with a non-ASCII character.
        for piece in [
            "Fog é[d",
            "oc:7] and [doc:",
            "3][doc:9] again [doc:7",
            "]. [not [doc:x",
        ] {
            let (t, c) = r.push(piece, &refs);
            text.push_str(&t);
            cites.extend(c);
        }
        text.push_str(&r.finish());
        assert_eq!(text, "Fog é[1] and [2] again [1]. [not [doc:x");
        let chars: Vec<char> = text.chars().collect();
        let span = |c: &Citation| chars[c.start..c.end].iter().collect::<String>();
        assert_eq!(cites.len(), 3);
        assert_eq!(span(&cites[0]), "[1]");
        assert_eq!(cites[0].url, "handbook/7.md");
        assert_eq!(span(&cites[1]), "[2]");
        assert_eq!(cites[1].url, "https://x/3");
        assert_eq!(cites[1].title, "Doc 3");
        assert_eq!(span(&cites[2]), "[1]");
    }

    #[test]
    fn a_completed_answer_without_deltas_is_shown_whole() {
        let mut a = Answer::default();
        let out = a.on_event(ChatEventBody::Completed {
            text: "It is so [doc:1].".into(),
            references: vec![reference(1, Some("https://x/1"))],
            usage: Usage {
                total_tokens: 5,
                ..Usage::default()
            },
            cost_usd: None,
            llm_calls: Vec::new(),
            rounds: 1,
        });
        assert_eq!(out.len(), 2);
        let Output::Text { text, citations } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(text, "It is so [1].");
        assert_eq!((citations[0].start, citations[0].end), (9, 12));
        assert!(matches!(out[1], Output::Done { usage } if usage.total_tokens == 5));
    }
}
