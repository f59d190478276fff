//! A deployment's fleet-wide limits: model calls in flight at once and
//! started per minute, shared by every orchestrator and LLM-tool worker on
//! this Redis, and a pause every caller keeps after the provider answered
//! 429 with `Retry-After`.
//!
//! Keys, under the deployment's hash tag `{provider/<deployment>}` (one
//! slot of a cluster per deployment):
//!
//! | key | type | holds | TTL |
//! |---|---|---|---|
//! | `<p>:{provider/<d>}:slots` | sorted set | one member per call in flight (a lease id), scored by when its lease lapses (ms) | twice the lease |
//! | `<p>:{provider/<d>}:rpm:<minute>` | string (INCR) | calls started in that UTC minute | 2 min |
//! | `<p>:{provider/<d>}:paused` | string | until when no call starts (unix ms) | the pause |
//!
//! [`CitationStore::provider_slot`] checks the pause, drops lapsed leases,
//! and takes a slot and a request of the minute in one script, or says how
//! long to wait; it waits (polling, with jitter) until it gets one. A slot
//! is a lease: renewed while its call runs, given back when the
//! [`ProviderSlot`] drops, and lapsing by itself when its process died. A
//! store that cannot be reached lets the call through (the provider's own
//! 429s, retried, are then the limit).

use std::time::Duration;

use tracing::warn;

use crate::CitationStore;

// Lease scores and pauses are on the Redis server's clock (`TIME`), so a
// host whose clock is ahead never lapses another's lease; ARGV[1] is
// unused (the minute's key is named by the caller's clock).
const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local paused = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if paused > now then return paused - now end
local max, rpm = tonumber(ARGV[3]), tonumber(ARGV[4])
if max > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max then return -1 end
end
if rpm > 0 then
  local n = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if n >= rpm then return tonumber(ARGV[6]) end
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], 120000)
end
if max > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[5]))
end
return 0
";

const PAUSE: &str = r"
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local paused = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if until_ms > paused then
  redis.call('SET', KEYS[1], until_ms, 'PX', ARGV[2])
end
return 0
";

use crate::slots::SLOT_LEASE;

/// How often a waiting call asks again when every slot is taken (with
/// jitter: between half and all of it).
const POLL: Duration = Duration::from_millis(50);

/// The longest fleet-wide pause one `Retry-After` sets.
pub const LONGEST_PAUSE: Duration = Duration::from_secs(120);

/// The longest single wait between two asks (a pause or the minute's end
/// may be longer: the call asks again after this, so a lifted pause is
/// seen).
const LONGEST_WAIT: Duration = Duration::from_secs(1);

/// One call's place under its deployment's limits: the slot is given back
/// when this drops (its lease renewed until then).
pub type ProviderSlot = crate::slots::Slot;

use crate::slots::{ms, now_ms};

impl CitationStore {
    fn provider_key(&self, deployment: &str, part: &str) -> String {
        format!("{}:{{provider/{deployment}}}:{part}", self.prefix)
    }

    /// Waits until `deployment`'s limits (`max_concurrency` calls in
    /// flight, `requests_per_minute` started per minute; `None`: no limit)
    /// and any pause let one more call start, and takes its place. A store
    /// that cannot be reached lets the call through holding nothing.
    /// Dropping the future gives up the wait.
    pub async fn provider_slot(
        &self,
        deployment: &str,
        max_concurrency: Option<u32>,
        requests_per_minute: Option<u32>,
    ) -> ProviderSlot {
        let lease = uuid::Uuid::new_v4().simple().to_string();
        let slots = self.provider_key(deployment, "slots");
        loop {
            let now = now_ms();
            let minute = now / 60_000;
            let to_next_minute = (minute + 1) * 60_000 - now;
            let keys = [
                slots.clone(),
                self.provider_key(deployment, &format!("rpm:{minute}")),
                self.provider_key(deployment, "paused"),
            ];
            let args = [
                now,
                0,
                u64::from(max_concurrency.unwrap_or(0)),
                u64::from(requests_per_minute.unwrap_or(0)),
                ms(SLOT_LEASE),
                to_next_minute,
            ];
            let answer = self.acquire(&keys, &lease, &args).await;
            let wait = match answer {
                Ok(0) => {
                    return match max_concurrency {
                        Some(_) => crate::slots::Slot::hold(self, slots, lease),
                        None => crate::slots::Slot::none(),
                    };
                }
                Ok(-1) => POLL.mul_f64(0.5 + rand_unit() / 2.0),
                Ok(ms) => Duration::from_millis(ms.unsigned_abs()).min(LONGEST_WAIT),
                Err(e) => {
                    warn!(deployment, error = %e, "the deployment's fleet-wide limits cannot be read; the model call goes ahead");
                    return crate::slots::Slot::none();
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    async fn acquire(
        &self,
        keys: &[String; 3],
        lease: &str,
        args: &[u64; 6],
    ) -> Result<i64, crate::CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(ACQUIRE));
        let mut invocation = SCRIPT.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        invocation
            .arg(args[0])
            .arg(lease)
            .arg(args[2])
            .arg(args[3])
            .arg(args[4])
            .arg(args[5]);
        let invocation = &invocation;
        self.run("provider_slot", |mut conn| async move {
            invocation.invoke_async(&mut conn).await
        })
        .await
    }

    /// No call of `deployment` starts for `wait` (the provider said so; at
    /// most [`LONGEST_PAUSE`], whatever a provider or a proxy claims),
    /// unless a longer pause is already set.
    pub async fn provider_pause(&self, deployment: &str, wait: Duration) {
        if wait > LONGEST_PAUSE {
            warn!(
                deployment,
                asked_secs = wait.as_secs(),
                "a Retry-After longer than the longest pause: the deployment is paused for {} s",
                LONGEST_PAUSE.as_secs()
            );
        }
        let wait = wait.min(LONGEST_PAUSE);
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(PAUSE));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.provider_key(deployment, "paused"))
            .arg(ms(wait))
            .arg(ms(wait).max(1));
        let invocation = &invocation;
        if let Err(e) = self
            .run("provider_pause", |mut conn| async move {
                invocation.invoke_async::<()>(&mut conn).await
            })
            .await
        {
            warn!(deployment, error = %e, "cannot pause the deployment fleet-wide");
        }
    }
}

/// A random number in `[0, 1)`, for jitter.
fn rand_unit() -> f64 {
    (uuid::Uuid::new_v4().as_u128() >> 75) as f64 / (1u64 << 53) as f64
}
