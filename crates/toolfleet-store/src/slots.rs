//! Places under a fleet-wide cap: a sorted set of leases per cap, each
//! scored by when it lapses. Taking a place drops the lapsed leases and
//! adds one when fewer than the cap are held, in one script; a held
//! [`Slot`] renews its lease until it drops, then gives it back. A process
//! that dies frees its places within [`SLOT_LEASE`].
//!
//! Used for a deployment's concurrency ([`crate::provider`]) and a
//! tenant's jobs and tool calls in flight ([`CitationStore::take_slot`]:
//! `<p>:{<tenant>}:inflight:<what>`, under the tenant's hash tag).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::task::JoinHandle;
use tracing::warn;

use crate::{CitationError, CitationStore};

/// How long a place's lease runs before its holder renews it.
pub const SLOT_LEASE: Duration = Duration::from_secs(30);

// Scores are on the Redis server's clock (`TIME`): a host whose clock is
// ahead never lapses another's lease.
const TAKE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[4]))
return 1
";

/// Renews one lease (only if it is still held) and the set's own expiry,
/// so a set whose places are all held for long never expires under them.
const RENEW: &str = r"
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
";

/// A place under a cap: given back when this drops (its lease renewed
/// until then). A slot may hold nothing (no cap applied).
pub struct Slot {
    held: Option<Held>,
}

struct Held {
    store: CitationStore,
    key: String,
    lease: String,
    renew: JoinHandle<()>,
}

impl Slot {
    /// A slot that holds nothing.
    pub fn none() -> Self {
        Self { held: None }
    }

    /// Whether this slot holds a place.
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// Holds `lease` in `key`, renewing it every third of
    /// [`SLOT_LEASE`] while held.
    pub(crate) fn hold(store: &CitationStore, key: String, lease: String) -> Self {
        let renewer = store.clone();
        let (k, id) = (key.clone(), lease.clone());
        let renew = tokio::spawn(async move {
            loop {
                tokio::time::sleep(SLOT_LEASE / 3).await;
                static SCRIPT: std::sync::LazyLock<redis::Script> =
                    std::sync::LazyLock::new(|| redis::Script::new(RENEW));
                let mut invocation = SCRIPT.prepare_invoke();
                invocation
                    .key(&k)
                    .arg(ms(SLOT_LEASE))
                    .arg(&id)
                    .arg(2 * ms(SLOT_LEASE));
                let invocation = &invocation;
                let renewed = renewer
                    .run("slot_renew", |mut conn| async move {
                        invocation.invoke_async::<()>(&mut conn).await
                    })
                    .await;
                if let Err(e) = renewed {
                    warn!(error = %e, "cannot renew a held place's lease; it may lapse");
                }
            }
        });
        Self {
            held: Some(Held {
                store: store.clone(),
                key,
                lease,
                renew,
            }),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        held.renew.abort();
        // Given back at once where a runtime is running; otherwise the
        // lease lapses by itself.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let (key, lease) = (held.key, held.lease);
                let _ = held
                    .store
                    .run("slot_release", |mut conn| {
                        let (key, lease) = (key.clone(), lease.clone());
                        async move {
                            redis::cmd("ZREM")
                                .arg(key)
                                .arg(lease)
                                .query_async::<()>(&mut conn)
                                .await
                        }
                    })
                    .await;
            });
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("held", &self.held.is_some())
            .finish()
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl CitationStore {
    /// The key of a tenant's in-flight cap `what` (`jobs`, or
    /// `tool:<pool>`), under the tenant's hash tag.
    pub fn inflight_key(&self, tenant: &str, what: &str) -> String {
        format!("{}:{{{tenant}}}:inflight:{what}", self.prefix)
    }

    /// Takes one of `max` places of `key` (see the module docs): `None`
    /// when all are held.
    pub async fn take_slot(&self, key: &str, max: u64) -> Result<Option<Slot>, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(TAKE));
        let lease = uuid::Uuid::new_v4().simple().to_string();
        let mut invocation = SCRIPT.prepare_invoke();
        // ARGV[1] unused: the script reads the server's clock.
        invocation
            .key(key)
            .arg(0)
            .arg(&lease)
            .arg(max)
            .arg(ms(SLOT_LEASE));
        let invocation = &invocation;
        let taken: u8 = self
            .run("take_slot", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok((taken == 1).then(|| Slot::hold(self, key.to_owned(), lease)))
    }
}
