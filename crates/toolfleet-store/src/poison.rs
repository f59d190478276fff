//! A tenant's poison count and suspension, shared by every orchestrator.
//!
//! Each chat job of a tenant that cannot be read (headers the client
//! cannot parse, a body that does not decode) is counted in a window
//! (`<p>:tenant:{<t>}:poisons`, INCR, its TTL the window, set by the first
//! count). When the count reaches the limit, the tenant is suspended
//! (`<p>:tenant:{<t>}:suspended`, its TTL the cool-off) and the count
//! starts again. One script, so counting and suspending are atomic across
//! orchestrators; both keys carry the tenant's hash tag (one cluster
//! slot). Both keys expire on their own: nothing lasts past a window or a
//! cool-off.

use std::time::Duration;

use crate::{CitationError, CitationStore};

/// KEYS: the count, the suspension. ARGV: the window (ms), the limit (0:
/// never suspend), the cool-off (ms). Returns the count and 1 when this
/// count suspended the tenant.
const COUNT: &str = r"
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
local limit = tonumber(ARGV[2])
if limit > 0 and n >= limit then
  if redis.call('SET', KEYS[2], '1', 'PX', ARGV[3], 'NX') then
    redis.call('DEL', KEYS[1])
    return {n, 1}
  end
end
return {n, 0}
";

/// How a tenant's poisons are judged (from the operator's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoisonRule {
    /// Poisons within `window` that suspend the tenant; 0: never.
    pub limit: u32,
    pub window: Duration,
    /// How long a suspension lasts.
    pub cooloff: Duration,
}

/// What counting one poison did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoisonCount {
    /// The tenant's poisons in the current window, this one included.
    pub count: u64,
    /// This one reached the limit: the tenant is suspended from now for
    /// the cool-off.
    pub suspended: bool,
}

impl CitationStore {
    /// A tenant-wide key: `<p>:tenant:{<tenant>}:<part>`.
    fn tenant_key(&self, tenant: &str, part: &str) -> String {
        format!("{}:tenant:{{{tenant}}}:{part}", self.prefix)
    }

    /// Counts one poison of `tenant` under `rule`, suspending it when the
    /// count reaches the limit. Not idempotent: a retried call after a
    /// lost reply may count one poison twice (the count only decides when
    /// a suspension starts).
    pub async fn count_poison(
        &self,
        tenant: &str,
        rule: PoisonRule,
    ) -> Result<PoisonCount, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(COUNT));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.tenant_key(tenant, "poisons"))
            .key(self.tenant_key(tenant, "suspended"))
            .arg(rule.window.as_millis().max(1) as u64)
            .arg(rule.limit)
            .arg(rule.cooloff.as_millis().max(1) as u64);
        let invocation = &invocation;
        let (count, suspended): (u64, i64) = self
            .run("count_poison", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(PoisonCount {
            count,
            suspended: suspended == 1,
        })
    }

    /// How long `tenant` stays suspended, `None` when it is not.
    pub async fn suspended_for(&self, tenant: &str) -> Result<Option<Duration>, CitationError> {
        let key = &self.tenant_key(tenant, "suspended");
        let left_ms: i64 = self
            .run("suspended_for", |mut conn| async move {
                redis::cmd("PTTL").arg(key).query_async(&mut conn).await
            })
            .await?;
        // -2: no key; -1 (no TTL) cannot happen: the key is set with one.
        Ok(u64::try_from(left_ms)
            .ok()
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis))
    }
}
