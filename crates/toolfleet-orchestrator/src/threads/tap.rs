//! [`ThreadTap`]: the conversation a run of a thread's job leaves behind,
//! recorded as it goes, so a run cut short (interrupted, cancelled, out of
//! time) leaves what it finished. It imports nothing of the crate: the
//! [`Invocation`](crate::Invocation) carries it.

use std::sync::{Arc, Mutex};

use toolfleet_llm::Message;

/// A thread's conversation on its way through one run: the thread's
/// earlier turns to put before the job's messages, then the conversation
/// as the run last left it (the profile's system prompt dropped).
#[derive(Debug, Clone, Default)]
pub struct ThreadTap(Arc<Mutex<Tapped>>);

#[derive(Debug, Default)]
struct Tapped {
    prior: Vec<Message>,
    turn: Option<Vec<Message>>,
}

/// Where a conversation starts after its leading system prompt.
fn after_system(messages: &[Message]) -> usize {
    usize::from(matches!(messages.first(), Some(Message::System { .. })))
}

impl ThreadTap {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tapped> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The thread's conversation when the job took it.
    pub(crate) fn set_prior(&self, prior: Vec<Message>) {
        self.lock().prior = prior;
    }

    /// Puts the thread's earlier turns before the job's own messages
    /// (after the profile's system prompt), and taps the result.
    pub fn prepend(&self, messages: &mut Vec<Message>) {
        let prior = std::mem::take(&mut self.lock().prior);
        let at = after_system(messages);
        messages.splice(at..at, prior);
        self.tap(messages);
    }

    /// Records the conversation as the run has it now: what stays in the
    /// thread if the run is cut short here.
    pub fn tap(&self, messages: &[Message]) {
        let at = after_system(messages);
        self.lock().turn = Some(messages[at..].to_vec());
    }

    /// Records a parked conversation (`messages`, as its record keeps it)
    /// up to, not including, the assistant message whose calls were held:
    /// what stays in the thread if the invocation ends without going on
    /// (cancelled or interrupted while it waited, or its approval timed
    /// out), so a call that never ran leaves no call without a result.
    pub fn tap_parked(&self, messages: &[Message]) {
        let held = messages
            .iter()
            .rposition(
                |m| matches!(m, Message::Assistant { tool_calls, .. } if !tool_calls.is_empty()),
            )
            .unwrap_or(messages.len());
        self.tap(&messages[..held]);
    }

    /// Records the finished conversation: `messages`, then the answer.
    pub fn answered(&self, messages: &[Message], answer: &str) {
        self.tap(messages);
        if let Some(turn) = self.lock().turn.as_mut() {
            turn.push(Message::Assistant {
                content: Some(answer.to_owned()),
                tool_calls: Vec::new(),
                opaque: Vec::new(),
            });
        }
    }

    /// The conversation as the run left it, if it got that far, its
    /// citation markers dropped ([`uncited`]).
    pub(crate) fn take_turn(&self) -> Option<Vec<Message>> {
        self.lock().turn.take().map(uncited)
    }
}

/// `messages` with every `[doc:N]` marker dropped from the tool results
/// and the answers. A marker's number is its invocation's (references are
/// numbered 1.. per job): a later job of the thread numbers its own
/// references from 1 again, so an old marker the model read or repeated
/// would be dropped or, worse, name another source. The passages stay;
/// a later turn that wants to cite one calls its tool again.
pub(crate) fn uncited(mut messages: Vec<Message>) -> Vec<Message> {
    let strip = |text: &mut String| {
        if text.contains("[doc:") {
            *text = toolfleet_protocol::references::cited_only(text, &[]).text;
        }
    };
    for message in &mut messages {
        match message {
            Message::Tool { content, .. } => strip(content),
            Message::Assistant {
                content: Some(content),
                ..
            } => strip(content),
            _ => {}
        }
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prior_goes_after_the_system_prompt_and_the_answer_last() {
        let tap = ThreadTap::default();
        tap.set_prior(vec![Message::User {
            content: "earlier".into(),
        }]);
        let mut messages = vec![
            Message::System {
                content: "be brief".into(),
            },
            Message::User {
                content: "now".into(),
            },
        ];
        tap.prepend(&mut messages);
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[1],
            Message::User {
                content: "earlier".into()
            }
        );
        tap.answered(&messages, "done");
        let turn = tap.take_turn().unwrap();
        assert_eq!(turn.len(), 3, "{turn:?}");
        assert!(matches!(&turn[2], Message::Assistant { content: Some(c), .. } if c == "done"));
        assert!(tap.take_turn().is_none());
    }

    #[test]
    fn a_parked_turn_is_kept_up_to_its_held_calls() {
        let tap = ThreadTap::default();
        let call = |id: &str| Message::Assistant {
            content: None,
            tool_calls: vec![toolfleet_llm::ToolCall {
                id: id.into(),
                name: "f".into(),
                arguments: "{}".into(),
            }],
            opaque: Vec::new(),
        };
        let parked = vec![
            Message::System {
                content: "be brief".into(),
            },
            Message::User {
                content: "now".into(),
            },
            call("c1"),
            Message::Tool {
                call_id: "c1".into(),
                content: "ran".into(),
            },
            call("c2"),
        ];
        tap.tap_parked(&parked);
        assert_eq!(tap.take_turn().unwrap(), parked[1..4].to_vec());
    }

    #[test]
    fn a_turn_keeps_its_passages_but_not_their_citation_numbers() {
        let tap = ThreadTap::default();
        let messages = vec![
            Message::User {
                content: "about [doc:1] as typed".into(),
            },
            Message::Tool {
                call_id: "c1".into(),
                content: "[doc:1] Fog signals warn ships. [doc:2] Lenses.".into(),
            },
        ];
        tap.answered(&messages, "Fog signals [doc:1].");
        let turn = tap.take_turn().unwrap();
        assert!(matches!(&turn[0], Message::User { content } if content.contains("[doc:1]")));
        assert!(
            matches!(&turn[1], Message::Tool { content, .. } if content.contains("Fog signals warn ships") && !content.contains("[doc:")),
            "{turn:?}"
        );
        assert!(
            matches!(&turn[2], Message::Assistant { content: Some(c), .. } if c == "Fog signals."),
            "{turn:?}"
        );
    }
}
