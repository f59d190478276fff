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

    /// The conversation as the run left it, if it got that far.
    pub(crate) fn take_turn(&self) -> Option<Vec<Message>> {
        self.lock().turn.take()
    }
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
}
