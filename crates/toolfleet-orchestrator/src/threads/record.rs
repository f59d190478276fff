//! A thread's record in the threads bucket, and every change to it as a
//! pure function (the bucket applies them by compare-and-set: [`super::store`]).
//!
//! The record holds the job that has the thread (`active`), the jobs
//! waiting for it (`queue`, in the order they run) and the conversation
//! (`messages`: every earlier turn, tool calls and results included, the
//! profile's system prompt left out). A job takes the thread only when
//! none has it and it heads the queue, so one job of a thread runs at a
//! time however many orchestrators race for it. Every entry carries until
//! when its job can still be running (its deadline and a margin): an
//! entry past it is a job whose orchestrator died and was never run again,
//! and is swept away by whoever reads the record next.

use serde::{Deserialize, Serialize};
use toolfleet_llm::Message;
use toolfleet_protocol::thread::{MultitaskStrategy, ThreadState};

/// The most jobs that may wait for one thread: one more is refused
/// (`thread_busy`, the line full), so a thread's record — read by every
/// waiting job — stays small.
pub(crate) const MAX_LINE: usize = 32;

/// A thread as the bucket keeps it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ThreadRecord {
    /// The job that has the thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) active: Option<Active>,
    /// The jobs waiting for it, in the order they take it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) queue: Vec<Waiting>,
    /// The conversation so far (without the profile's system prompt).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) messages: Vec<Message>,
    /// Turns the thread has had (kept or not), for reading.
    #[serde(default)]
    pub(crate) turns: u64,
}

/// The job that has a thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Active {
    pub(crate) invocation_id: String,
    /// Unix ms after which it cannot be running any more.
    pub(crate) until_ms: u64,
    /// Set when a newer job interrupted it: what becomes of its turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cut: Option<Cut>,
}

/// What becomes of an interrupted job's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Cut {
    /// `interrupt`: what it finished stays in the thread.
    Keep,
    /// `rollback`: nothing of its turn stays.
    Drop,
}

/// A job waiting for a thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Waiting {
    pub(crate) invocation_id: String,
    /// Unix ms after which it cannot be waiting any more.
    pub(crate) until_ms: u64,
    /// Its chat stream sequence: enqueued jobs waiting for a busy thread
    /// take it in the order they were submitted, whichever orchestrator
    /// saw them first (a free thread goes to whichever job reaches it
    /// first).
    pub(crate) seq: u64,
    /// It interrupted the job before it (it runs before the enqueued ones).
    #[serde(default)]
    pub(crate) first: bool,
}

/// A job of the thread, as it arrives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arriving<'a> {
    pub(crate) invocation_id: &'a str,
    pub(crate) strategy: MultitaskStrategy,
    pub(crate) until_ms: u64,
    pub(crate) seq: u64,
}

/// What an arriving job does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// It has the thread: it runs now.
    Run,
    /// It is refused (`reject`): `ahead` has the thread (or waits for it).
    Refused { ahead: String },
    /// It is refused: [`MAX_LINE`] jobs wait for the thread already.
    Full,
    /// It waited, and a newer interrupting job took its place (or its
    /// place lapsed): it does not run.
    Displaced,
    /// It waits (`queued` or `interrupting`); `cancel` names the job it
    /// interrupts, for the caller to cancel.
    Wait {
        state: ThreadState,
        ahead: Option<String>,
        cancel: Option<String>,
    },
}

impl ThreadRecord {
    /// Drops the entries of jobs that cannot be running or waiting any
    /// more (their orchestrator died, and they were never run again).
    pub(crate) fn sweep(&mut self, now_ms: u64) {
        if self.active.as_ref().is_some_and(|a| a.until_ms < now_ms) {
            self.active = None;
        }
        self.queue.retain(|w| w.until_ms >= now_ms);
    }

    /// A job arrives for the thread (or comes again: a redelivery keeps
    /// its place).
    pub(crate) fn arrive(&mut self, job: Arriving<'_>, now_ms: u64) -> Arrival {
        self.sweep(now_ms);
        let id = job.invocation_id;
        if self.active.as_ref().is_some_and(|a| a.invocation_id == id) {
            return Arrival::Run;
        }
        if self.queue.iter().any(|w| w.invocation_id == id) {
            return self.try_take(id, job.until_ms, now_ms);
        }
        let ahead = self
            .active
            .as_ref()
            .map(|a| a.invocation_id.clone())
            .or_else(|| self.queue.first().map(|w| w.invocation_id.clone()));
        let Some(ahead) = ahead else {
            self.take(id, job.until_ms);
            return Arrival::Run;
        };
        let waiting = Waiting {
            invocation_id: id.to_owned(),
            until_ms: job.until_ms,
            seq: job.seq,
            first: job.strategy.cancels(),
        };
        if job.strategy != MultitaskStrategy::Reject && self.queue.len() >= MAX_LINE {
            return Arrival::Full;
        }
        match job.strategy {
            MultitaskStrategy::Reject => Arrival::Refused { ahead },
            MultitaskStrategy::Enqueue => {
                self.enqueue(waiting);
                Arrival::Wait {
                    state: ThreadState::Queued,
                    ahead: Some(ahead),
                    cancel: None,
                }
            }
            MultitaskStrategy::Interrupt | MultitaskStrategy::Rollback => {
                let cut = if job.strategy == MultitaskStrategy::Rollback {
                    Cut::Drop
                } else {
                    Cut::Keep
                };
                // Ahead of every job waiting; the newest interrupter takes
                // the place of an earlier one still waiting (displaced: it
                // ends without running), and its strategy decides what
                // becomes of the running job's turn.
                self.queue.retain(|w| !w.first);
                self.queue.insert(0, waiting);
                let cancel = self.active.as_mut().and_then(|active| {
                    let first_cut = active.cut.is_none();
                    active.cut = Some(cut);
                    first_cut.then(|| active.invocation_id.clone())
                });
                if self.active.is_none() {
                    return self.try_take(id, job.until_ms, now_ms);
                }
                Arrival::Wait {
                    state: ThreadState::Interrupting,
                    ahead: Some(ahead),
                    cancel,
                }
            }
        }
    }

    /// A waiting job takes the thread if nobody has it and it is first in
    /// line; [`Arrival::Displaced`] when it is no longer in line.
    pub(crate) fn try_take(&mut self, id: &str, until_ms: u64, now_ms: u64) -> Arrival {
        self.sweep(now_ms);
        if self.active.is_none() && self.queue.first().is_some_and(|w| w.invocation_id == id) {
            self.queue.remove(0);
            self.take(id, until_ms);
            return Arrival::Run;
        }
        if !self.queue.iter().any(|w| w.invocation_id == id) {
            return Arrival::Displaced;
        }
        let ahead = self
            .active
            .as_ref()
            .map(|a| a.invocation_id.clone())
            .or_else(|| self.queue.first().map(|w| w.invocation_id.clone()));
        Arrival::Wait {
            state: ThreadState::Queued,
            ahead,
            cancel: None,
        }
    }

    fn take(&mut self, id: &str, until_ms: u64) {
        self.active = Some(Active {
            invocation_id: id.to_owned(),
            until_ms,
            cut: None,
        });
    }

    /// Puts an enqueued job in line: after the interrupters, in the order
    /// of submission among the enqueued.
    fn enqueue(&mut self, waiting: Waiting) {
        let at = self
            .queue
            .iter()
            .position(|w| !w.first && w.seq > waiting.seq)
            .unwrap_or(self.queue.len());
        self.queue.insert(at, waiting);
    }

    /// The active job's deadline moved (it parked for approval).
    pub(crate) fn hold_until(&mut self, id: &str, until_ms: u64) {
        if let Some(active) = self.active.as_mut().filter(|a| a.invocation_id == id) {
            active.until_ms = active.until_ms.max(until_ms);
        }
    }

    /// A job of the thread ended. The one that had the thread lets it go,
    /// its conversation (`turn`: the whole of it, as it ended) kept unless
    /// it was rolled back; a waiting one leaves the line. Returns how it
    /// was cut, if it was.
    pub(crate) fn leave(
        &mut self,
        id: &str,
        turn: Option<Vec<Message>>,
        bounds: Bounds,
    ) -> Option<Cut> {
        self.queue.retain(|w| w.invocation_id != id);
        let active = self.active.take_if(|a| a.invocation_id == id)?;
        self.turns += 1;
        if active.cut != Some(Cut::Drop)
            && let Some(turn) = turn
        {
            self.messages = bounds.trim(turn);
        }
        active.cut
    }
}

/// How much of a conversation a thread keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    /// At most this many messages.
    pub(crate) messages: usize,
    /// At most this many bytes of them (as JSON).
    pub(crate) bytes: usize,
}

impl Bounds {
    /// The newest messages within the bounds: the oldest go first, and
    /// the kept part never starts with a tool result whose call was cut.
    pub(crate) fn trim(self, mut messages: Vec<Message>) -> Vec<Message> {
        let size = |m: &Message| serde_json::to_vec(m).map_or(0, |v| v.len());
        let mut bytes: usize = messages.iter().map(size).sum();
        let mut drop = 0;
        while drop < messages.len()
            && (messages.len() - drop > self.messages
                || bytes > self.bytes
                || matches!(messages[drop], Message::Tool { .. }))
        {
            bytes -= size(&messages[drop]);
            drop += 1;
        }
        messages.drain(..drop);
        messages
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000;

    fn job(id: &str, strategy: MultitaskStrategy, seq: u64) -> Arriving<'_> {
        Arriving {
            invocation_id: id,
            strategy,
            until_ms: NOW + 10_000,
            seq,
        }
    }

    fn user(text: &str) -> Message {
        Message::User {
            content: text.into(),
        }
    }

    const WIDE: Bounds = Bounds {
        messages: 100,
        bytes: 1 << 20,
    };

    #[test]
    fn the_first_job_runs_and_a_second_is_refused_by_default() {
        let mut r = ThreadRecord::default();
        assert_eq!(
            r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW),
            Arrival::Run
        );
        assert_eq!(
            r.arrive(job("b", MultitaskStrategy::Reject, 2), NOW),
            Arrival::Refused { ahead: "a".into() }
        );
        // A redelivery of the running job runs again.
        assert_eq!(
            r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW),
            Arrival::Run
        );
        assert!(r.queue.is_empty());
    }

    #[test]
    fn enqueued_jobs_run_in_submission_order() {
        let mut r = ThreadRecord::default();
        r.arrive(job("a", MultitaskStrategy::Enqueue, 1), NOW);
        // Seen in another order than submitted (two orchestrators).
        assert!(matches!(
            r.arrive(job("c", MultitaskStrategy::Enqueue, 3), NOW),
            Arrival::Wait {
                state: ThreadState::Queued,
                ..
            }
        ));
        r.arrive(job("b", MultitaskStrategy::Enqueue, 2), NOW);
        assert!(matches!(
            r.try_take("b", NOW + 10_000, NOW),
            Arrival::Wait { .. }
        ));
        r.leave("a", Some(vec![user("one")]), WIDE);
        // c cannot jump the line.
        assert!(matches!(
            r.try_take("c", NOW + 10_000, NOW),
            Arrival::Wait { .. }
        ));
        assert_eq!(r.try_take("b", NOW + 10_000, NOW), Arrival::Run);
        r.leave("b", Some(vec![user("one"), user("two")]), WIDE);
        assert_eq!(r.try_take("c", NOW + 10_000, NOW), Arrival::Run);
        assert_eq!(r.turns, 2);
        assert_eq!(r.messages.len(), 2);
    }

    #[test]
    fn interrupt_keeps_the_cut_turn_and_rollback_drops_it() {
        for (strategy, kept) in [
            (MultitaskStrategy::Interrupt, 2),
            (MultitaskStrategy::Rollback, 1),
        ] {
            let mut r = ThreadRecord {
                messages: vec![user("before")],
                ..ThreadRecord::default()
            };
            r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW);
            assert_eq!(
                r.arrive(job("b", strategy, 2), NOW),
                Arrival::Wait {
                    state: ThreadState::Interrupting,
                    ahead: Some("a".into()),
                    cancel: Some("a".into()),
                }
            );
            assert!(r.active.as_ref().is_some_and(|a| a.cut.is_some()));
            let cut = r.leave("a", Some(vec![user("before"), user("a's turn")]), WIDE);
            assert!(cut.is_some());
            assert_eq!(r.messages.len(), kept, "{strategy}");
            assert_eq!(r.try_take("b", NOW + 10_000, NOW), Arrival::Run);
        }
    }

    #[test]
    fn an_interrupter_goes_before_the_enqueued() {
        let mut r = ThreadRecord::default();
        r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW);
        r.arrive(job("q", MultitaskStrategy::Enqueue, 2), NOW);
        r.arrive(job("i", MultitaskStrategy::Interrupt, 3), NOW);
        let order: Vec<_> = r.queue.iter().map(|w| w.invocation_id.as_str()).collect();
        assert_eq!(order, ["i", "q"]);
    }

    #[test]
    fn the_newest_interrupter_displaces_a_waiting_one_and_decides_the_cut() {
        let mut r = ThreadRecord::default();
        r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW);
        r.arrive(job("q", MultitaskStrategy::Enqueue, 2), NOW);
        assert!(matches!(
            r.arrive(job("i1", MultitaskStrategy::Interrupt, 3), NOW),
            Arrival::Wait {
                cancel: Some(_),
                ..
            }
        ));
        assert_eq!(r.active.as_ref().unwrap().cut, Some(Cut::Keep));
        // A second interrupter (a rollback): it goes first, i1 leaves the
        // line, and the running job's turn is now dropped; it is cancelled
        // already (no second cancel).
        assert!(matches!(
            r.arrive(job("i2", MultitaskStrategy::Rollback, 4), NOW),
            Arrival::Wait { cancel: None, .. }
        ));
        assert_eq!(r.active.as_ref().unwrap().cut, Some(Cut::Drop));
        let order: Vec<_> = r.queue.iter().map(|w| w.invocation_id.as_str()).collect();
        assert_eq!(order, ["i2", "q"]);
        assert_eq!(r.try_take("i1", NOW + 10_000, NOW), Arrival::Displaced);
        assert_eq!(
            r.leave("a", Some(vec![user("a's turn")]), WIDE),
            Some(Cut::Drop)
        );
        assert!(r.messages.is_empty());
        assert_eq!(r.try_take("i2", NOW + 10_000, NOW), Arrival::Run);
    }

    #[test]
    fn a_full_line_refuses_one_more() {
        let mut r = ThreadRecord::default();
        r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW);
        for n in 0..MAX_LINE {
            let id = format!("q{n}");
            assert!(matches!(
                r.arrive(job(&id, MultitaskStrategy::Enqueue, 2 + n as u64), NOW),
                Arrival::Wait { .. }
            ));
        }
        for strategy in [MultitaskStrategy::Enqueue, MultitaskStrategy::Interrupt] {
            assert_eq!(r.arrive(job("late", strategy, 999), NOW), Arrival::Full);
        }
        assert_eq!(r.queue.len(), MAX_LINE);
        // A redelivery of a job in line keeps its place.
        assert!(matches!(
            r.arrive(job("q3", MultitaskStrategy::Enqueue, 5), NOW),
            Arrival::Wait { .. }
        ));
    }

    #[test]
    fn a_dead_jobs_entries_lapse() {
        let mut r = ThreadRecord::default();
        r.arrive(job("a", MultitaskStrategy::Reject, 1), NOW);
        r.arrive(job("q", MultitaskStrategy::Enqueue, 2), NOW);
        // Long after both deadlines, a new job finds the thread free.
        assert_eq!(
            r.arrive(
                Arriving {
                    until_ms: NOW + 100_000,
                    ..job("b", MultitaskStrategy::Reject, 3)
                },
                NOW + 50_000
            ),
            Arrival::Run
        );
        assert!(r.queue.is_empty());
    }

    #[test]
    fn trimming_drops_the_oldest_and_never_starts_with_a_tool_result() {
        let convo = vec![
            user("q1"),
            Message::Assistant {
                content: None,
                tool_calls: vec![toolfleet_llm::ToolCall {
                    id: "c1".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }],
                opaque: Vec::new(),
            },
            Message::Tool {
                call_id: "c1".into(),
                content: "r".into(),
            },
            user("q2"),
        ];
        let kept = Bounds {
            messages: 2,
            bytes: 1 << 20,
        }
        .trim(convo.clone());
        assert_eq!(kept, vec![user("q2")]);
        let kept = Bounds {
            messages: 3,
            bytes: 1 << 20,
        }
        .trim(convo.clone());
        assert_eq!(kept.len(), 3);
        let tiny = Bounds {
            messages: 100,
            bytes: 30,
        }
        .trim(convo);
        assert_eq!(tiny, vec![user("q2")]);
    }
}
