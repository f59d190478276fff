//! Cancellation: the calls running in this worker by invocation, the
//! cancels heard lately (for calls that start after their cancel), and
//! since when every cancel has been heard (so a new call's first delivery
//! may skip the tombstone read in Redis).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::Subjects;
use tracing::info;

/// How long a worker remembers a cancel for calls that start after it.
pub(super) const REMEMBER_CANCEL: Duration = Duration::from_secs(600);
/// At most this many remembered cancels (a flood of cancels cannot grow
/// the worker without bound).
const MAX_REMEMBERED_CANCELS: usize = 10_000;

/// Calls running in this worker: [`run_key`] → (call serial, token); and
/// the invocations cancelled lately, so a call that registers just after
/// its invocation's cancel arrived (it was being pulled or checked) is
/// cancelled too.
#[derive(Default)]
pub(super) struct Running {
    state: Mutex<RunningState>,
    serial: AtomicU64,
    /// How many cancels are remembered (read without the lock: usually
    /// none).
    remembered: AtomicUsize,
    /// Since when (unix ns, wall clock, to compare with JetStream's
    /// publication times) every cancel has been heard; 0 until the cancel
    /// subscription exists. Cancels published while the connection was
    /// down are lost, so a reconnect starts it again; so does a flood of
    /// cancels that emptied the memory.
    hearing_since: AtomicU64,
    /// The client's connect count when `hearing_since` was set.
    hearing_connects: AtomicU64,
}

#[derive(Default)]
struct RunningState {
    /// By invocation ([`run_key`]): each call's serial, call id and token.
    calls: HashMap<String, Vec<(u64, String, CancellationToken)>>,
    /// Cancels heard lately: of invocations ([`run_key`]) and of single
    /// calls (`<run key>.<call id>`).
    cancelled: HashMap<String, Instant>,
}

impl RunningState {
    /// Whether a cancel of `key` was heard lately.
    fn cancelled_lately(&self, key: &str) -> bool {
        self.cancelled
            .get(key)
            .is_some_and(|at| at.elapsed() < REMEMBER_CANCEL)
    }
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .max(1)
}

impl Running {
    /// Registers a call; the guard deregisters it when dropped. A call of
    /// an invocation cancelled lately, or itself cancelled lately, starts
    /// cancelled.
    pub(super) fn register(
        &self,
        invocation_id: String,
        call_id: &str,
        token: CancellationToken,
    ) -> RunningGuard<'_> {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut state) = self.state.lock() {
            if state.cancelled_lately(&invocation_id)
                || state.cancelled_lately(&call_key(&invocation_id, call_id))
            {
                token.cancel();
            }
            let entry = (serial, call_id.to_string(), token);
            match state.calls.get_mut(&invocation_id) {
                Some(calls) => calls.push(entry),
                None => {
                    state.calls.insert(invocation_id.clone(), vec![entry]);
                }
            }
        }
        RunningGuard {
            running: self,
            invocation_id,
            serial,
        }
    }

    /// Cancels every call of `invocation_id` running here, and remembers
    /// the cancel for calls that start after it.
    pub(super) fn cancel(&self, invocation_id: &str) -> usize {
        self.cancel_matching(invocation_id, invocation_id, |_| true)
    }

    /// Cancels call `call_id` of `invocation_id` (a [`run_key`]) if it runs
    /// here, and remembers the cancel should its job start later.
    pub(super) fn cancel_call(&self, invocation_id: &str, call_id: &str) -> usize {
        let key = call_key(invocation_id, call_id);
        self.cancel_matching(&key, invocation_id, |c| c == call_id)
    }

    /// Whether call `call_id` of `invocation_id` was cancelled on its own
    /// lately (not with its whole invocation).
    pub(super) fn call_cancelled(&self, invocation_id: &str, call_id: &str) -> bool {
        self.remembers_cancel(&call_key(invocation_id, call_id))
    }

    /// Remembers a cancel under `remember` and cancels the calls of
    /// `invocation_id` whose call id passes `which`.
    fn cancel_matching(
        &self,
        remember: &str,
        invocation_id: &str,
        which: impl Fn(&str) -> bool,
    ) -> usize {
        let Ok(mut state) = self.state.lock() else {
            return 0;
        };
        state
            .cancelled
            .retain(|_, at| at.elapsed() < REMEMBER_CANCEL);
        if state.cancelled.len() >= MAX_REMEMBERED_CANCELS {
            state.cancelled.clear();
            // What was forgotten must be read from Redis again.
            if self.hearing_since.load(Ordering::Acquire) != 0 {
                self.hearing_since
                    .store(unix_ns(SystemTime::now()), Ordering::Release);
            }
        }
        state.cancelled.insert(remember.to_string(), Instant::now());
        self.remembered
            .store(state.cancelled.len(), Ordering::Release);
        let tokens = state
            .calls
            .get(invocation_id)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut stopped = 0;
        for (_, call_id, token) in tokens {
            if which(call_id) {
                token.cancel();
                stopped += 1;
            }
        }
        stopped
    }

    /// Starts remembering since when every cancel was heard: called once
    /// the cancel subscription exists, with the client's connect count.
    pub(super) fn start_hearing(&self, connects: u64) {
        self.hearing_connects.store(connects, Ordering::Release);
        self.hearing_since
            .store(unix_ns(SystemTime::now()), Ordering::Release);
    }

    /// Since when every cancel has been heard, given the client's connect
    /// count and state now; `None` while disconnected or before
    /// [`Running::start_hearing`]. A changed count (a reconnect: cancels
    /// published meanwhile were lost) starts it again from now — later
    /// than the reconnect itself, which errs on the side of reading Redis.
    pub(super) fn hearing_since(&self, connects: u64, connected: bool) -> Option<SystemTime> {
        if self.hearing_since.load(Ordering::Acquire) == 0 {
            return None;
        }
        if self.hearing_connects.load(Ordering::Acquire) != connects || !connected {
            // `since` first: whoever sees the new count sees the new time.
            self.hearing_since
                .store(unix_ns(SystemTime::now()), Ordering::Release);
            self.hearing_connects.store(connects, Ordering::Release);
        }
        let since = self.hearing_since.load(Ordering::Acquire);
        connected.then(|| UNIX_EPOCH + Duration::from_nanos(since))
    }

    /// Whether a cancel of `key` ([`run_key`]) was heard lately.
    pub(super) fn remembers_cancel(&self, key: &str) -> bool {
        if self.remembered.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.state
            .lock()
            .is_ok_and(|state| state.cancelled_lately(key))
    }

    /// Stops the running calls of every invocation (or single call) whose
    /// cancel subject is published, until `shutdown` or the end of
    /// `cancels`.
    pub(super) async fn listen(
        &self,
        subjects: &Subjects,
        mut cancels: async_nats::Subscriber,
        shutdown: CancellationToken,
    ) {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => break,
                m = cancels.next() => match m { Some(m) => m, None => break },
            };
            if let Some((tenant, id)) = subjects.parse_cancel(msg.subject.as_str()) {
                let stopped = self.cancel(&run_key(tenant, id));
                if stopped > 0 {
                    info!(
                        invocation_id = id,
                        calls = stopped,
                        "cancel: stopping the invocation's tool calls"
                    );
                }
            } else if let Some((tenant, id, call)) =
                subjects.parse_cancel_call(msg.subject.as_str())
                && self.cancel_call(&run_key(tenant, id), call) > 0
            {
                info!(
                    invocation_id = id,
                    call_id = call,
                    "cancel: stopping one tool call"
                );
            }
        }
        // No longer hearing cancels (shutting down, or the subscription
        // closed): jobs read the tombstone from now on.
        self.hearing_since.store(0, Ordering::Release);
    }
}

/// Deregisters a call from [`Running`] when dropped.
pub(super) struct RunningGuard<'a> {
    running: &'a Running,
    invocation_id: String,
    serial: u64,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.running.state.lock()
            && let Some(list) = state.calls.get_mut(&self.invocation_id)
        {
            list.retain(|(s, _, _)| *s != self.serial);
            if list.is_empty() {
                state.calls.remove(&self.invocation_id);
            }
        }
    }
}

/// How [`Running`] names an invocation: its tenant and id (both single
/// subject tokens, so the pair is unambiguous). A cancel published under
/// another tenant than the invocation's own finds nothing.
pub(super) fn run_key(tenant: &str, invocation_id: &str) -> String {
    format!("{tenant}.{invocation_id}")
}

/// How [`Running`] remembers a cancel of one call: its invocation's
/// [`run_key`] and the call id (no token holds a dot).
fn call_key(run_key: &str, call_id: &str) -> String {
    format!("{run_key}.{call_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_reaches_running_calls_and_calls_that_register_after_it() {
        let running = Running::default();
        let before = CancellationToken::new();
        let guard = running.register(run_key("acme", "inv-1"), "c1", before.clone());
        let other = CancellationToken::new();
        let _other = running.register(run_key("acme", "inv-2"), "c1", other.clone());
        let elsewhere = CancellationToken::new();
        let _elsewhere = running.register(run_key("globex", "inv-1"), "c1", elsewhere.clone());
        assert_eq!(running.cancel(&run_key("acme", "inv-1")), 1);
        assert!(before.is_cancelled());
        assert!(!other.is_cancelled());
        // The same invocation id under another tenant is another invocation.
        assert!(!elsewhere.is_cancelled());
        drop(guard);
        // Registered after the cancel: starts cancelled.
        let after = CancellationToken::new();
        let _after = running.register(run_key("acme", "inv-1"), "c2", after.clone());
        assert!(after.is_cancelled());
    }

    #[test]
    fn a_call_cancel_stops_that_call_only_and_is_remembered_for_its_job() {
        let running = Running::default();
        let key = run_key("acme", "inv-1");
        let first = CancellationToken::new();
        let _first = running.register(key.clone(), "c1", first.clone());
        let second = CancellationToken::new();
        let _second = running.register(key.clone(), "c2", second.clone());
        assert_eq!(running.cancel_call(&key, "c1"), 1);
        assert!(first.is_cancelled());
        assert!(!second.is_cancelled(), "the invocation goes on");
        assert!(running.call_cancelled(&key, "c1"));
        assert!(!running.call_cancelled(&key, "c2"));
        assert!(!running.call_cancelled(&run_key("globex", "inv-1"), "c1"));
        // Its job, delivered again or late, starts cancelled; another
        // call of the invocation does not.
        let again = CancellationToken::new();
        let _again = running.register(key.clone(), "c1", again.clone());
        assert!(again.is_cancelled());
        let third = CancellationToken::new();
        let _third = running.register(key, "c3", third.clone());
        assert!(!third.is_cancelled());
    }
}
