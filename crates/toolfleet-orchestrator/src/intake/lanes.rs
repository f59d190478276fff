//! Priorities: a chat job is interactive or batch.
//!
//! The lane is the subject a job is stored on: `<p>.chat.submit.<tenant>`
//! (interactive) or `<p>.chat.batch.<tenant>` (batch), each with its own
//! consumer per tenant, so fair dispatch can take interactive jobs first
//! without reading any job (see `fair`). A job the client marks batch
//! (`priority`), or whose profile is batch, but that arrived on the
//! interactive lane is moved to the batch lane before it runs
//! ([`moved_to_batch`]): published again there, then acked here. A job on
//! the batch lane runs as batch whatever it says (a client may always
//! lower its own priority, never raise its profile's).

use async_nats::HeaderMap;
use async_nats::jetstream;
use toolfleet_protocol::{ChatJob, Priority, headers};
use tracing::{debug, warn};

use crate::Fleet;

/// `h` without its `Nats-Msg-Id` (a job published again under another
/// subject would otherwise be dropped by the duplicate window).
pub(super) fn without_msg_id(h: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, values) in h.iter() {
        if AsRef::<str>::as_ref(name) == headers::NATS_MSG_ID {
            continue;
        }
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// The priority `job` runs with, taken from `lane`: batch when the lane,
/// the job or its profile says so.
pub(super) fn priority_of(fleet: &Fleet, job: &ChatJob, tenant: &str, lane: Priority) -> Priority {
    let profiles = &fleet.config.profiles;
    let profile = job
        .profile
        .as_deref()
        .unwrap_or_else(|| profiles.default_profile_of(tenant));
    let profile_batch = profiles
        .profiles
        .get(profile)
        .is_some_and(|p| p.priority == Priority::Batch);
    if lane == Priority::Batch || job.priority == Some(Priority::Batch) || profile_batch {
        Priority::Batch
    } else {
        Priority::Interactive
    }
}

/// Moves `msg`, a batch job taken from `tenant`'s interactive lane, to its
/// batch lane: true when it is stored there and acked here (it then runs
/// in the batch lane's turn). When the batch lane refuses it (its queue is
/// full, or the stream cannot be reached) it runs here as it is: false.
pub(super) async fn moved_to_batch(fleet: &Fleet, msg: &jetstream::Message, tenant: &str) -> bool {
    // A message id of its own, the same for every delivery of this job:
    // a move repeated (the ack here lost, a crash before it) is dropped by
    // the stream's duplicate window instead of queueing a second copy.
    let mut kept = msg.headers.as_ref().map(without_msg_id).unwrap_or_default();
    let sequence = msg.info().map_or(0, |i| i.stream_sequence);
    kept.insert(
        headers::NATS_MSG_ID,
        format!("batch-move.{tenant}.{sequence}").as_str(),
    );
    let subject = fleet.config.subjects.chat_batch(tenant);
    let stored = match fleet
        .js
        .publish_with_headers(subject, kept, msg.payload.clone())
        .await
    {
        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match stored {
        Ok(()) => {
            if let Err(e) = msg.double_ack().await {
                // The copy on the batch lane runs; this one, delivered
                // again, is moved again and dropped as a duplicate (within
                // the stream's two minutes; later, its claim answers it).
                warn!(tenant, error = %e, "a batch job moved to its lane could not be acked on the interactive lane");
            }
            debug!(tenant, "batch job moved to the batch lane");
            fleet
                .metrics
                .chat_moved_to_batch
                .with_label_values(&[tenant])
                .inc();
            true
        }
        Err(e) => {
            warn!(tenant, error = %e, "cannot move a batch job to its tenant's batch lane; it runs now");
            false
        }
    }
}
