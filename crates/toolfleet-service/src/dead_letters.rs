//! The one dead-letter publisher: every job the fleet gives up on (chat,
//! tool, sink) is counted and published the same way.

use prometheus::IntCounterVec;
use toolfleet_protocol::{DeadLetter, Subjects, encode};

/// Counts `dead` in `toolfleet_dead_letters_total` (by kind, and by tool
/// for tool jobs: its `toolId`) and publishes it on its kind's dead-letter
/// subject (`<p>.deadletter.<kind>`, kept by the dead-letters stream).
///
/// # Errors
///
/// When the publish fails (the caller logs it; the job is given up on
/// either way).
pub async fn publish(
    client: &async_nats::Client,
    subjects: &Subjects,
    counter: &IntCounterVec,
    dead: &DeadLetter,
) -> Result<(), async_nats::PublishError> {
    counter
        .with_label_values(&[dead.kind.as_str(), dead.tool_id.as_deref().unwrap_or("")])
        .inc();
    client
        .publish(subjects.dead_letter(dead.kind), encode(dead))
        .await
}
