//! The JetStream streams of the contract: one definition each, created by
//! whichever process starts first (orchestrators and workers alike).

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::Subjects;

/// A stream could not be created or looked up.
#[derive(Debug, Clone, thiserror::Error)]
#[error("NATS: {0}")]
pub struct StreamError(String);

/// Creates the chat-job stream if it does not exist.
pub async fn ensure_chat_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    // A job nobody took within a day has no one waiting for it.
    work_queue(
        js,
        subjects.chat_stream(),
        subjects.chat_submit(),
        24 * 3600,
    )
    .await
}

/// Creates the tool-job stream if it does not exist.
pub async fn ensure_tools_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, StreamError> {
    // Past the longest chat deadline (1 h) nobody waits for a result.
    work_queue(js, subjects.tools_stream(), subjects.tools_all(), 2 * 3600).await
}

/// A work-queue stream of jobs: file storage, a 2-minute duplicate window
/// (`Nats-Msg-Id`), room for the largest job plus headers.
///
/// A stream of that name that already exists is used only if it holds
/// exactly `subject`: otherwise another fleet or an older configuration
/// owns the name, and sharing it would mix their jobs with ours.
async fn work_queue(
    js: &jetstream::Context,
    name: String,
    subject: String,
    max_age_secs: u64,
) -> Result<stream::Stream, StreamError> {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            max_message_size: crate::MAX_JOB_BYTES as i32 + 64 * 1024,
            max_age: Duration::from_secs(max_age_secs),
            ..Default::default()
        })
        .await
        .map_err(|e| StreamError(format!("stream {name}: {e}")))?;
    check_subjects(stream.cached_info(), &subject)?;
    Ok(stream)
}

/// The existing stream `info` must hold exactly `subject`.
pub(crate) fn check_subjects(info: &stream::Info, subject: &str) -> Result<(), StreamError> {
    let found = &info.config.subjects;
    if found.len() == 1 && found[0] == subject {
        return Ok(());
    }
    Err(StreamError(format!(
        "stream {} exists over subjects {found:?}, not [{subject:?}]: another fleet or an \
         older configuration owns that name; use another subject prefix, or delete or \
         edit the stream if it is no longer used",
        info.config.name
    )))
}
