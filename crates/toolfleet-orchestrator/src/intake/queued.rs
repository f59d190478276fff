//! A tenant's queued-jobs cap, where the chat stream cannot hold it.
//!
//! The stream's per-subject limit (discard new) refuses a submit past
//! the largest cap any tenant has, on its publish ack. A tenant whose cap
//! is lower is held to it here, when its job is taken: a job with as many
//! of its tenant's jobs ahead of it in the stream (waiting or running) as
//! the cap allows is refused with `queue_full`. Jobs ahead that finished
//! since the submit free their places, as they would have on the stream.
//!
//! The count reads the stream: one stream info (the tenant's subject
//! count) per job of such a tenant, and only when that count is over the
//! cap, a message lookup per job ahead (at most the cap). A stream that
//! cannot be read lets the job run (the stream's own limit still holds).

use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use futures::TryStreamExt;
use tracing::warn;

use super::reject::Refusal;
use crate::Fleet;

/// The refusal of a job of `tenant` at stream sequence `sequence`, when it
/// has its cap of jobs ahead of it and that cap is below the stream's.
pub(super) async fn over_cap(
    fleet: &Fleet,
    tenant: &str,
    subject: &str,
    sequence: u64,
) -> Option<Refusal> {
    let profiles = &fleet.config.profiles;
    let cap = profiles.caps_of(tenant).max_queued_jobs;
    if cap >= profiles.largest_queued_cap() {
        // The stream's limit is this tenant's: it refused any job past it.
        return None;
    }
    match ahead(fleet, subject, sequence, cap).await {
        Ok(ahead) if ahead >= cap => Some(Refusal::QueueFull {
            tenant: tenant.to_string(),
            cap,
        }),
        Ok(_) => None,
        Err(e) => {
            warn!(tenant, error = %e, "cannot count the tenant's queued jobs; the job runs");
            None
        }
    }
}

/// How many jobs of the lane `subject` (a tenant's interactive or batch
/// jobs) are in the chat stream before `sequence`, counting up to `cap`.
async fn ahead(fleet: &Fleet, subject: &str, sequence: u64, cap: u64) -> Result<u64, String> {
    let subjects = &fleet.config.subjects;
    let stream = fleet
        .js
        .get_stream_no_info(subjects.chat_stream())
        .await
        .map_err(|e| e.to_string())?;
    if stored(&stream, subject).await? <= cap {
        // This job among them: at most cap - 1 ahead.
        return Ok(0);
    }
    let mut ahead = 0;
    let mut from = 1;
    while ahead < cap {
        match stream.get_first_raw_message_by_subject(subject, from).await {
            Ok(message) if message.sequence < sequence => {
                ahead += 1;
                from = message.sequence + 1;
            }
            Ok(_) => break,
            Err(e) if matches!(e.kind(), RawMessageErrorKind::NoMessageFound) => break,
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(ahead)
}

/// The messages on `subject` in `stream`.
async fn stored(stream: &Stream<()>, subject: &str) -> Result<u64, String> {
    let mut counts = stream
        .info_with_subjects(subject)
        .await
        .map_err(|e| e.to_string())?;
    let mut total = 0;
    while let Some((_, count)) = counts.try_next().await.map_err(|e| e.to_string())? {
        total += count as u64;
    }
    Ok(total)
}
