//! Threads and idempotency keys: what a chat job's `threadId`,
//! `multitaskStrategy` and `idempotencyKey` mean on the wire
//! (`docs/threads.md`).
//!
//! A **thread** is a conversation the fleet keeps for a tenant: a job that
//! names one sends only its new message(s), runs after the thread's
//! earlier turns, and adds its own turn when it ends. One job of a thread
//! runs at a time, fleet-wide; what happens to a job that arrives while
//! another runs is its [`MultitaskStrategy`]. An **idempotency key** makes
//! a repeated submit of the same request (a client's retry after a lost
//! answer, past JetStream's two-minute duplicate window) answer with the
//! first job's outcome instead of running again.
//!
//! Thread ids and idempotency keys are the tenant's: the tenant is the
//! submit subject's (an authenticated identity), never the job's, so
//! another tenant naming the same id gets a thread (or key) of its own.

use serde::{Deserialize, Serialize};

/// The longest thread id or idempotency key, in characters.
pub const MAX_THREAD_ID_LEN: usize = 128;

/// What happens to a job that arrives for a thread while another of its
/// jobs runs ("double texting").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MultitaskStrategy {
    /// The new job ends at once with error `thread_busy` (the default: a
    /// client learns of the collision instead of waiting or cancelling
    /// something without having asked to).
    #[default]
    Reject,
    /// The new job waits and runs after the jobs ahead of it, in the order
    /// they arrived.
    Enqueue,
    /// The running job is cancelled — the tool calls it finished stay in
    /// the thread — and the new job runs next.
    Interrupt,
    /// The running job is cancelled and forgotten: nothing of its turn
    /// stays in the thread; the new job runs next.
    Rollback,
}

impl MultitaskStrategy {
    /// Every strategy, in the schema's order.
    pub const ALL: [MultitaskStrategy; 4] =
        [Self::Reject, Self::Enqueue, Self::Interrupt, Self::Rollback];

    /// The strategy's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Enqueue => "enqueue",
            Self::Interrupt => "interrupt",
            Self::Rollback => "rollback",
        }
    }

    /// Whether the strategy cancels the running job.
    pub fn cancels(self) -> bool {
        matches!(self, Self::Interrupt | Self::Rollback)
    }
}

impl std::fmt::Display for MultitaskStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MultitaskStrategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("{s:?} is not one of reject, enqueue, interrupt, rollback"))
    }
}

/// Is `id` usable as a thread id or an idempotency key: 1 to
/// [`MAX_THREAD_ID_LEN`] of `[A-Za-z0-9_-]` (one subject token, and part
/// of a key-value key).
pub fn valid_thread_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_THREAD_ID_LEN
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The key of `tenant`'s thread `thread_id` in the threads bucket
/// ([`Subjects::threads_bucket`](crate::Subjects::threads_bucket)).
pub fn thread_key(tenant: &str, thread_id: &str) -> String {
    format!("{tenant}.{thread_id}")
}

/// The key of `tenant`'s idempotency key `key` in the idempotency bucket
/// ([`Subjects::idempotency_bucket`](crate::Subjects::idempotency_bucket)).
pub fn idempotency_key(tenant: &str, key: &str) -> String {
    format!("{tenant}.{key}")
}

/// Where a job of a thread stands, as its `thread` event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThreadState {
    /// It waits for the job ahead of it (`enqueue`).
    Queued,
    /// It cancelled the running job and runs once that one has let the
    /// thread go (`interrupt`, `rollback`).
    Interrupting,
    /// It holds the thread and runs now.
    Running,
    /// It does not get the thread — refused (`reject`, or the thread's
    /// line is full), or displaced while it waited by a newer interrupting
    /// job —: its `error` follows (so `toolfleet events --thread` shows
    /// it).
    Refused,
}

impl ThreadState {
    /// The state's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Interrupting => "interrupting",
            Self::Running => "running",
            Self::Refused => "refused",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_round_trip_by_name() {
        for m in MultitaskStrategy::ALL {
            assert_eq!(m.as_str().parse::<MultitaskStrategy>(), Ok(m));
            assert_eq!(
                serde_json::to_value(m).unwrap(),
                serde_json::json!(m.as_str())
            );
        }
        assert!("merge".parse::<MultitaskStrategy>().is_err());
        assert_eq!(MultitaskStrategy::default(), MultitaskStrategy::Reject);
        assert!(MultitaskStrategy::Rollback.cancels());
        assert!(!MultitaskStrategy::Enqueue.cancels());
    }

    #[test]
    fn thread_ids_are_one_bounded_token() {
        assert!(valid_thread_id("support-42_a"));
        assert!(valid_thread_id(&"t".repeat(MAX_THREAD_ID_LEN)));
        for bad in ["", "a.b", "a b", "a*", "a>", "ü", &"t".repeat(129)] {
            assert!(!valid_thread_id(bad), "{bad:?}");
        }
        assert_eq!(thread_key("acme", "t1"), "acme.t1");
        assert_eq!(idempotency_key("acme", "k1"), "acme.k1");
    }
}
