//! Idempotency keys: a repeated submit answered with the first job's
//! outcome instead of a second run (`docs/threads.md`).
//!
//! The first job of a tenant's key claims it in the idempotency bucket by
//! compare-and-set (create-if-absent: across every orchestrator one job
//! gets it), and leaves its terminal event there when it ends
//! ([`remember`]). A later job of the same tenant with the same key,
//! within the bucket's age (the window, 24 h unless configured), runs
//! nothing ([`first_of`], [`replay`]): it says `duplicate` (naming the
//! first job, whose own events a client may follow), then ends with the
//! first job's terminal event as its own — at once when the first has
//! ended, else as soon as it does (or at its own deadline). The key is
//! the submit subject's tenant's: another tenant's job with the same key
//! is unrelated. JetStream's `Nats-Msg-Id` only drops a repeat within the
//! stream's duplicate window (two minutes); this holds for the whole
//! window, and across different invocation ids.
//!
//! The claim carries a SHA-256 of the job's body ([`body_digest`]): a
//! repeat whose body differs ends at once with `idempotency_mismatch`
//! rather than get another question's answer. A first job that ended with
//! a refusal or a transient failure before it dispatched any tool
//! ([`releases`]) gives its key back, so a retry runs instead of being
//! answered with that failure for the whole window; a job parked for
//! approval rewrites its key's record when it parks and resumes
//! ([`touch`]), so the window (the bucket's age, counted from the last
//! write) cannot lapse while it waits.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use toolfleet_protocol::thread::idempotency_key;
use toolfleet_protocol::{ChatEvent, ChatEventBody, ChatJob};
use toolfleet_store::InvocationKey;
use tracing::warn;

use crate::failure::ChatErrorCode;
use crate::threads::store;
use crate::{Events, Failure, Fleet};

/// How often a repeat looks whether the first job has ended.
const REPLAY_POLL: Duration = Duration::from_millis(250);

/// A key's record: the first job, and its terminal event once it ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct KeyRecord {
    /// The first job's invocation id (empty: nobody claimed the key yet,
    /// or its first job gave it back).
    #[serde(default)]
    invocation_id: String,
    /// When it claimed the key (Unix ms).
    #[serde(default)]
    claimed_at_ms: u64,
    /// The SHA-256 of its body ([`body_digest`]; empty in a record of an
    /// older orchestrator: not compared).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    body: String,
    /// When the first job last parked or resumed (Unix ms): the write that
    /// keeps the record within the bucket's age while it waits.
    #[serde(default, skip_serializing_if = "is_zero")]
    touched_at_ms: u64,
    /// Its terminal event, as published, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    terminal: Option<serde_json::Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a job with an idempotency key does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Keyed {
    /// It is the key's first job (it claimed the key now, or did on an
    /// earlier delivery): it runs.
    First,
    /// It is the key's first job, which has ended already (a redelivery
    /// whose ack was lost): its terminal event again, nothing run.
    Ended,
    /// Another job has the key: its outcome, nothing run.
    Repeat(String),
}

/// What `job`'s idempotency key says it does ([`Keyed::First`] when it
/// has no key).
///
/// # Errors
///
/// `idempotency_mismatch` when the key's first job had another body;
/// `internal_error` when the bucket cannot say (the job does not run
/// rather than risk running twice).
pub(super) async fn first_of(fleet: &Fleet, job: &ChatJob) -> Result<Keyed, Failure> {
    let Some(key) = &job.idempotency_key else {
        return Ok(Keyed::First);
    };
    let id = job.invocation_id.as_str();
    let digest = body_digest(job);
    let name = idempotency_key(job.tenant(), key);
    let said = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        claim(r, id, &digest, toolfleet_protocol::now_ms())
    })
    .await
    .map_err(|e| {
        Failure::new(
            ChatErrorCode::InternalError,
            format!("the idempotency key cannot be read or claimed: {e}"),
        )
    })?;
    said.map_err(|first| {
        Failure::new(
            ChatErrorCode::IdempotencyMismatch,
            format!(
                "idempotency key {key} was first used by {first} with another body (messages, profile or tools); a repeat must send the same job, a new request a new key"
            ),
        )
    })
}

/// What a job (`id`, body `digest`) does with the key's record `r`,
/// claiming it when it is free; `Err(first)` when `first` has the key
/// with another body.
fn claim(r: &mut KeyRecord, id: &str, digest: &str, now_ms: u64) -> Result<Keyed, String> {
    if r.invocation_id.is_empty() {
        *r = KeyRecord {
            invocation_id: id.to_owned(),
            claimed_at_ms: now_ms,
            body: digest.to_owned(),
            ..KeyRecord::default()
        };
        return Ok(Keyed::First);
    }
    if r.invocation_id == id {
        return Ok(if r.terminal.is_some() {
            Keyed::Ended
        } else {
            Keyed::First
        });
    }
    if !r.body.is_empty() && r.body != digest {
        return Err(r.invocation_id.clone());
    }
    Ok(Keyed::Repeat(r.invocation_id.clone()))
}

/// The SHA-256 (hex) of what a job asks: its JSON with the fields that
/// may differ between two submits of one request left out — its
/// `invocationId`, `traceparent`, `timeoutMs`, `sink`, `priority` and
/// `notBefore` — as canonical JSON (keys sorted at every depth).
pub(super) fn body_digest(job: &ChatJob) -> String {
    let mut value = serde_json::to_value(job).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        for field in [
            "invocationId",
            "traceparent",
            "timeoutMs",
            "sink",
            "priority",
            "notBefore",
        ] {
            fields.remove(field);
        }
    }
    let text = toolfleet_protocol::canonical::canonical_json(&value);
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Answers a repeat of `first`'s idempotency key: `duplicate` (unless
/// `first` is the job itself, ended already), then the first job's
/// terminal event, as this job's own (its `completed`, or its code and
/// message as a failure), once there is one.
pub(super) async fn replay(
    fleet: &Fleet,
    job: &ChatJob,
    first: &str,
    events: &Events,
) -> Result<ChatEventBody, Failure> {
    let key = job.idempotency_key.clone().unwrap_or_default();
    let tenant = job.tenant();
    if first != job.invocation_id {
        events.send(ChatEventBody::Duplicate {
            replay_of: first.to_owned(),
            idempotency_key: key.clone(),
            thread_id: job.thread_id.clone(),
        });
        fleet.metrics.threads.replays.inc();
    }
    let name = idempotency_key(tenant, &key);
    loop {
        if let Some(event) = ended(fleet, &name, (tenant, first)).await {
            return match event.body {
                ChatEventBody::Error {
                    code,
                    message,
                    retry_after_ms,
                } => Err(Failure {
                    code: ChatErrorCode::parse(&code),
                    message,
                    retry_after_ms,
                }),
                body => Ok(body),
            };
        }
        tokio::time::sleep(REPLAY_POLL).await;
    }
}

/// The first job's terminal event, if it has ended: from the key's record
/// (where it leaves it), else from the store (its stored terminal event,
/// should leaving it in the record have failed, or should it have given
/// the key back).
async fn ended(fleet: &Fleet, name: &str, (tenant, first): (&str, &str)) -> Option<ChatEvent> {
    let from_record = store::read::<KeyRecord>(&fleet.threads.idempotency, name)
        .await
        .ok()
        .filter(|(r, _)| r.invocation_id == first)
        .and_then(|(r, _)| r.terminal)
        .and_then(|t| serde_json::from_value::<ChatEvent>(t).ok());
    if from_record.is_some() {
        return from_record;
    }
    let stored = (fleet.store)
        .terminal_event(InvocationKey::new(tenant, first))
        .await
        .ok()
        .flatten()?;
    serde_json::from_slice::<ChatEvent>(&stored)
        .ok()
        .filter(|e| e.body.is_terminal())
}

/// Whether a first job that ended with `code` gives its key back (a retry
/// then runs): a refusal or a transient failure — `thread_busy`,
/// `rate_limited`, `budget_exhausted`, `queue_full`, `tenant_suspended`,
/// `too_many_parked`, `approval_unavailable`, `too_many_attempts`,
/// `internal_error`, `deadline_exceeded`, `cancelled`, or a provider's
/// transient failure (`llm_connect`, `llm_connection_lost`,
/// `llm_timeout`, `llm_http_429`, `llm_http_5xx`) — when it dispatched no tool (`called_tools`) and
/// was not resumed from a park (its approved calls may have run). Any
/// other end — an answer, a failure that the same job would meet again,
/// or anything after a tool ran — is kept and replayed.
pub(super) fn releases(code: Option<&str>, called_tools: bool, resumed: bool) -> bool {
    let Some(code) = code else {
        return false;
    };
    if called_tools || resumed {
        return false;
    }
    transient_llm(code)
        || [
            ChatErrorCode::ThreadBusy,
            ChatErrorCode::RateLimited,
            ChatErrorCode::BudgetExhausted,
            ChatErrorCode::QueueFull,
            ChatErrorCode::TenantSuspended,
            ChatErrorCode::TooManyParked,
            ChatErrorCode::ApprovalUnavailable,
            ChatErrorCode::TooManyAttempts,
            ChatErrorCode::InternalError,
            ChatErrorCode::DeadlineExceeded,
            ChatErrorCode::Cancelled,
        ]
        .iter()
        .any(|c| c.as_str() == code)
}

/// Whether `code` is a provider's failure that may not happen again.
fn transient_llm(code: &str) -> bool {
    let Some(kind) = code.strip_prefix(ChatErrorCode::LLM_PREFIX) else {
        return false;
    };
    matches!(kind, "connect" | "connection_lost" | "timeout" | "http_429")
        || kind
            .strip_prefix("http_5")
            .is_some_and(|rest| rest.len() == 2 && rest.bytes().all(|b| b.is_ascii_digit()))
}

/// Leaves the first job's terminal event (`payload`, as published) in its
/// key's record, for the repeats — or, when `release`, gives the key back
/// (the record emptied by compare-and-set: the next job with the key
/// claims it and runs). A repeat's own end changes nothing.
pub(super) async fn remember(
    fleet: &Fleet,
    (tenant, key, id): (&str, &str, &str),
    payload: &[u8],
    release: bool,
) {
    let Ok(terminal) = serde_json::from_slice::<serde_json::Value>(payload) else {
        return;
    };
    let name = idempotency_key(tenant, key);
    let kept = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        if r.invocation_id != id {
            return;
        }
        if release {
            *r = KeyRecord::default();
        } else {
            r.terminal = Some(terminal.clone());
        }
    })
    .await;
    if let Err(e) = kept {
        warn!(invocation_id = id, error = %e, "cannot leave the outcome under the idempotency key; repeats read the stored terminal event instead");
    }
}

/// Gives the key back when its first job `id` is refused before it runs
/// (after its claim: out of deliveries — `too_many_attempts` —, its
/// tenant suspended, its queue full): a retry claims the key and runs.
pub(super) async fn release(fleet: &Fleet, (tenant, key, id): (&str, &str, &str)) {
    let name = idempotency_key(tenant, key);
    let released = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        if r.invocation_id == id && r.terminal.is_none() {
            *r = KeyRecord::default();
        }
    })
    .await;
    if let Err(e) = released {
        warn!(invocation_id = id, error = %e, "cannot give the idempotency key of a refused job back; it is held for the window");
    }
}

/// Rewrites the key's record of its first job `id` (parked, or resumed),
/// so the bucket's age, counted from the last write, starts again.
pub(super) async fn touch(fleet: &Fleet, (tenant, key, id): (&str, &str, &str)) {
    let name = idempotency_key(tenant, key);
    let now = toolfleet_protocol::now_ms();
    let touched = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        if r.invocation_id == id {
            r.touched_at_ms = now;
        }
    })
    .await;
    if let Err(e) = touched {
        warn!(invocation_id = id, error = %e, "cannot rewrite the idempotency key of a parked job; its window counts from its claim");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(text: &str) -> ChatJob {
        toolfleet_protocol::client::question(text)
    }

    #[test]
    fn a_repeat_with_another_body_is_refused_and_the_same_body_replayed() {
        let mut r = KeyRecord::default();
        let first = job("refund 4711");
        let digest = body_digest(&first);
        assert_eq!(claim(&mut r, "a", &digest, 1), Ok(Keyed::First));
        assert_eq!(claim(&mut r, "a", &digest, 2), Ok(Keyed::First));
        // Another invocation, trace and timeout: the same request.
        let mut again = first.clone();
        again.invocation_id = "other".into();
        again.timeout_ms = Some(5_000);
        again.traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        assert_eq!(body_digest(&again), digest);
        assert_eq!(
            claim(&mut r, "b", &body_digest(&again), 3),
            Ok(Keyed::Repeat("a".into()))
        );
        // Another question under the same key.
        let other = job("refund 4712");
        assert_ne!(body_digest(&other), digest);
        assert_eq!(claim(&mut r, "c", &body_digest(&other), 4), Err("a".into()));
        // The first, redelivered after it ended, replays its end.
        r.terminal = Some(serde_json::json!({}));
        assert_eq!(claim(&mut r, "a", &digest, 5), Ok(Keyed::Ended));
        // A released key is claimed afresh.
        let mut released = KeyRecord::default();
        assert_eq!(claim(&mut released, "d", &digest, 6), Ok(Keyed::First));
        assert_eq!(released.invocation_id, "d");
    }

    #[test]
    fn refusals_and_transient_failures_before_any_tool_give_the_key_back() {
        for code in [
            "thread_busy",
            "rate_limited",
            "internal_error",
            "deadline_exceeded",
            "cancelled",
            "llm_http_503",
            "llm_timeout",
            "too_many_attempts",
        ] {
            assert!(releases(Some(code), false, false), "{code}");
            assert!(
                !releases(Some(code), true, false),
                "{code} after a tool ran"
            );
            assert!(!releases(Some(code), false, true), "{code} resumed");
        }
        for code in [
            "round_limit",
            "unknown_profile",
            "answer_too_large",
            "idempotency_mismatch",
            "llm_http_400",
            "llm_insufficient_quota",
        ] {
            assert!(!releases(Some(code), false, false), "{code}");
        }
        assert!(!releases(None, false, false), "an answer is kept");
    }
}
