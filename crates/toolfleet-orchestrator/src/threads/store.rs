//! The threads and idempotency buckets: opened (made by hand, so
//! nats-server 2.9 serves them, with the configured TTL and sizes), and a
//! record changed by compare-and-set — read it with its revision, change
//! it, write it only if nobody wrote it in between, else read again. That
//! is what holds one job per thread across every orchestrator without a
//! lock service: the server refuses a write whose expected revision is not
//! the key's last one (JetStream's expected-last-subject-sequence).

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use serde::Serialize;
use serde::de::DeserializeOwned;
use toolfleet_protocol::Subjects;

/// How long a thread nobody touched is kept, by default.
pub const DEFAULT_THREAD_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// The most messages a thread keeps, by default (the oldest go first).
pub const DEFAULT_THREAD_MAX_MESSAGES: usize = 200;
/// The most bytes of messages a thread keeps, by default.
pub const DEFAULT_THREAD_MAX_BYTES: usize = 256 * 1024;
/// How long an idempotency key is remembered, by default.
pub const DEFAULT_IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// How threads and idempotency keys are kept (operator settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadSettings {
    /// A thread nobody touched for this long is forgotten (the bucket's
    /// `max_age`).
    pub ttl: Duration,
    /// The most messages a thread keeps.
    pub max_messages: usize,
    /// The most bytes of messages (as JSON) a thread keeps.
    pub max_bytes: usize,
    /// How long an idempotency key is remembered.
    pub idempotency_window: Duration,
}

impl Default for ThreadSettings {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_THREAD_TTL,
            max_messages: DEFAULT_THREAD_MAX_MESSAGES,
            max_bytes: DEFAULT_THREAD_MAX_BYTES,
            idempotency_window: DEFAULT_IDEMPOTENCY_WINDOW,
        }
    }
}

/// The orchestrator's flags for [`ThreadSettings`].
#[derive(clap::Args, Debug, Clone)]
pub struct ThreadArgs {
    /// How long a thread nobody touched is kept, in seconds (the threads
    /// bucket's age).
    #[arg(long, env = "TOOLFLEET_THREAD_TTL_SECS", default_value_t = DEFAULT_THREAD_TTL.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub thread_ttl_secs: u64,
    /// The most messages a thread keeps (the oldest turns go first).
    #[arg(long, env = "TOOLFLEET_THREAD_MAX_MESSAGES", default_value_t = DEFAULT_THREAD_MAX_MESSAGES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub thread_max_messages: usize,
    /// The most bytes of messages (as JSON) a thread keeps (at most 512
    /// KiB: a thread's record, twice that at most, must fit a NATS message).
    #[arg(long, env = "TOOLFLEET_THREAD_MAX_BYTES", default_value_t = DEFAULT_THREAD_MAX_BYTES, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=512 * 1024))]
    pub thread_max_bytes: usize,
    /// How long an idempotency key is remembered, in seconds.
    #[arg(long, env = "TOOLFLEET_IDEMPOTENCY_WINDOW_SECS", default_value_t = DEFAULT_IDEMPOTENCY_WINDOW.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub idempotency_window_secs: u64,
}

impl ThreadArgs {
    /// The settings these flags say.
    pub fn settings(&self) -> ThreadSettings {
        ThreadSettings {
            ttl: Duration::from_secs(self.thread_ttl_secs),
            max_messages: self.thread_max_messages,
            max_bytes: self.thread_max_bytes,
            idempotency_window: Duration::from_secs(self.idempotency_window_secs),
        }
    }
}

/// The fleet's two buckets of this module.
#[derive(Clone)]
pub struct Buckets {
    pub(crate) threads: kv::Store,
    pub(crate) idempotency: kv::Store,
}

/// A bucket could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub(crate) String);

/// How often a write that lost a race is tried again before giving up.
const MAX_CONFLICTS: usize = 64;

impl Buckets {
    /// Opens (or makes) both buckets with `settings`' TTLs and sizes.
    ///
    /// # Errors
    ///
    /// When a bucket cannot be made or brought to its settings.
    pub async fn open(
        js: &jetstream::Context,
        subjects: &Subjects,
        settings: &ThreadSettings,
    ) -> Result<Self, StoreError> {
        let threads = bucket(
            js,
            &subjects.threads_bucket(),
            "toolfleet: threads (running job, queue, conversation)",
            settings.ttl,
            i32::try_from(settings.max_bytes.saturating_mul(2)).unwrap_or(i32::MAX),
        )
        .await?;
        let idempotency = bucket(
            js,
            &subjects.idempotency_bucket(),
            "toolfleet: idempotency keys (the first invocation of each, and its outcome)",
            settings.idempotency_window,
            -1,
        )
        .await?;
        Ok(Self {
            threads,
            idempotency,
        })
    }
}

/// The bucket `name` with `max_age` and `max_value_size`, made if it does
/// not exist and brought to them if it does (the operator changed them).
async fn bucket(
    js: &jetstream::Context,
    name: &str,
    description: &str,
    max_age: Duration,
    max_value_size: i32,
) -> Result<kv::Store, StoreError> {
    // Made without an age first: the layout's two-minute duplicate window
    // may not outlast a shorter age, so both are set together below.
    let store =
        toolfleet_protocol::streams::key_value(js, name, description, Duration::ZERO, false)
            .await
            .map_err(|e| StoreError(e.to_string()))?;
    let config = &store.stream.cached_info().config;
    if config.max_age == max_age && config.max_message_size == max_value_size {
        return Ok(store);
    }
    let mut wanted = config.clone();
    wanted.max_age = max_age;
    wanted.max_message_size = max_value_size;
    // The duplicate window may not outlast the age.
    wanted.duplicate_window = wanted.duplicate_window.min(max_age);
    js.update_stream(wanted)
        .await
        .map_err(|e| StoreError(format!("bucket {name}: setting its limits: {e}")))?;
    js.get_key_value(name)
        .await
        .map_err(|e| StoreError(format!("bucket {name}: {e}")))
}

/// The value at `key` (its default when absent, deleted or unreadable)
/// and its revision (none when the key never was).
pub(crate) async fn read<T: DeserializeOwned + Default>(
    bucket: &kv::Store,
    key: &str,
) -> Result<(T, Option<u64>), StoreError> {
    let entry = bucket
        .entry(key)
        .await
        .map_err(|e| StoreError(format!("reading {key}: {e}")))?;
    Ok(match entry {
        Some(e) if e.operation == kv::Operation::Put => (
            serde_json::from_slice(&e.value).unwrap_or_default(),
            Some(e.revision),
        ),
        Some(e) => (T::default(), Some(e.revision)),
        None => (T::default(), None),
    })
}

/// Changes the value at `key` with `change` by compare-and-set, read
/// again and retried whenever another writer came first; nothing is
/// written when `change` leaves it as it was. Returns what `change` said
/// on the write that held.
pub(crate) async fn change<T, R>(
    bucket: &kv::Store,
    key: &str,
    mut change: impl FnMut(&mut T) -> R,
) -> Result<R, StoreError>
where
    T: DeserializeOwned + Serialize + Default + PartialEq + Clone,
{
    for _ in 0..MAX_CONFLICTS {
        let (mut value, revision) = read::<T>(bucket, key).await?;
        let before = value.clone();
        let said = change(&mut value);
        if value == before {
            return Ok(said);
        }
        let bytes: bytes::Bytes = serde_json::to_vec(&value)
            .map_err(|e| StoreError(e.to_string()))?
            .into();
        let written = match revision {
            Some(revision) => bucket.update(key, bytes, revision).await.map_err(|e| {
                (
                    e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                    e.to_string(),
                )
            }),
            None => bucket.create(key, bytes).await.map_err(|e| {
                (
                    e.kind() == kv::CreateErrorKind::AlreadyExists,
                    e.to_string(),
                )
            }),
        };
        match written {
            Ok(_) => return Ok(said),
            // Another orchestrator wrote first: read its record and decide again.
            Err((true, _)) => tokio::task::yield_now().await,
            Err((false, e)) => return Err(StoreError(format!("writing {key}: {e}"))),
        }
    }
    Err(StoreError(format!(
        "writing {key}: lost {MAX_CONFLICTS} races in a row"
    )))
}
