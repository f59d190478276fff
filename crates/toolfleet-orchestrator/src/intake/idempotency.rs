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
    /// The first job's invocation id (empty: nobody claimed the key yet).
    #[serde(default)]
    invocation_id: String,
    /// When it claimed the key (Unix ms).
    #[serde(default)]
    claimed_at_ms: u64,
    /// Its terminal event, as published, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    terminal: Option<serde_json::Value>,
}

/// The first job of `job`'s idempotency key when that is another job
/// (`job` then runs nothing); `None` when `job` has no key, or is the
/// key's first job (it claims the key now, or did on an earlier
/// delivery).
///
/// # Errors
///
/// When the bucket cannot say: the job does not run rather than risk
/// running twice.
pub(super) async fn first_of(fleet: &Fleet, job: &ChatJob) -> Result<Option<String>, Failure> {
    let Some(key) = &job.idempotency_key else {
        return Ok(None);
    };
    let id = job.invocation_id.as_str();
    let name = idempotency_key(job.tenant(), key);
    let first = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        if r.invocation_id.is_empty() {
            r.invocation_id = id.to_owned();
            r.claimed_at_ms = toolfleet_protocol::now_ms();
        }
        r.invocation_id.clone()
    })
    .await
    .map_err(|e| {
        Failure::new(
            ChatErrorCode::InternalError,
            format!("the idempotency key cannot be read or claimed: {e}"),
        )
    })?;
    Ok((first != id).then_some(first))
}

/// Answers a repeat of `first`'s idempotency key: `duplicate`, then the
/// first job's terminal event, as this job's own (its `completed`, or its
/// code and message as a failure), once there is one.
pub(super) async fn replay(
    fleet: &Fleet,
    job: &ChatJob,
    first: &str,
    events: &Events,
) -> Result<ChatEventBody, Failure> {
    let key = job.idempotency_key.clone().unwrap_or_default();
    let tenant = job.tenant();
    events.send(ChatEventBody::Duplicate {
        replay_of: first.to_owned(),
        idempotency_key: key.clone(),
    });
    fleet.metrics.threads.replays.inc();
    let name = idempotency_key(tenant, &key);
    loop {
        if let Some(event) = ended(fleet, &name, InvocationKey::new(tenant, first)).await {
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
/// should leaving it in the record have failed).
async fn ended(fleet: &Fleet, name: &str, first: InvocationKey<'_>) -> Option<ChatEvent> {
    let from_record = store::read::<KeyRecord>(&fleet.threads.idempotency, name)
        .await
        .ok()
        .and_then(|(r, _)| r.terminal)
        .and_then(|t| serde_json::from_value::<ChatEvent>(t).ok());
    if from_record.is_some() {
        return from_record;
    }
    let stored = fleet.store.terminal_event(first).await.ok().flatten()?;
    serde_json::from_slice::<ChatEvent>(&stored)
        .ok()
        .filter(|e| e.body.is_terminal())
}

/// Leaves the first job's terminal event (`payload`, as published) in its
/// key's record, for the repeats; a repeat's own end changes nothing.
pub(super) async fn remember(fleet: &Fleet, tenant: &str, key: &str, id: &str, payload: &[u8]) {
    let Ok(terminal) = serde_json::from_slice::<serde_json::Value>(payload) else {
        return;
    };
    let name = idempotency_key(tenant, key);
    let kept = store::change(&fleet.threads.idempotency, &name, |r: &mut KeyRecord| {
        if r.invocation_id == id {
            r.terminal = Some(terminal.clone());
        }
    })
    .await;
    if let Err(e) = kept {
        warn!(invocation_id = id, error = %e, "cannot leave the outcome under the idempotency key; repeats read the stored terminal event instead");
    }
}
