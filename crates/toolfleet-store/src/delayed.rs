//! A tenant's delayed chat jobs (waiting for their `notBefore`), counted
//! so that a cap holds: a delayed job's message stays pending on the chat
//! consumer until its time (a nak with a delay), and too many of them
//! would fill the consumer's `max_ack_pending` and stop its dispatch.
//!
//! `<p>:{<t>}:delayed` is a sorted set of invocation ids scored by their
//! `notBefore` (unix ms); entries whose time has passed leave at the next
//! hold, and the key expires after the latest of them.

use crate::{CitationError, CitationStore, InvocationKey};

/// Drops the entries of `KEYS[1]` scored before `ARGV[1]` (now, ms); then
/// holds `ARGV[2]` scored `ARGV[3]` when it is there already or the set
/// has fewer than `ARGV[4]` entries, and keeps the key until its latest
/// entry. 1 when held, 0 when the set is full.
const HOLD: &str = r"
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
local latest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], math.max(tonumber(latest[2]), now) + 60000)
return 1
";

impl CitationStore {
    /// The tenant's delayed jobs.
    fn delayed(&self, tenant: &str) -> String {
        format!("{}:{{{tenant}}}:delayed", self.prefix)
    }

    /// Counts `inv` among its tenant's delayed jobs until `until_ms` (its
    /// `notBefore`), unless the tenant already has `cap` others waiting:
    /// whether it is counted. Safe to repeat (the same job counts once).
    pub async fn hold_delayed(
        &self,
        inv: InvocationKey<'_>,
        now_ms: u64,
        until_ms: u64,
        cap: u64,
    ) -> Result<bool, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(HOLD));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.delayed(inv.tenant()))
            .arg(now_ms)
            .arg(inv.invocation_id())
            .arg(until_ms)
            .arg(cap);
        let invocation = &invocation;
        let held: i64 = self
            .run("hold_delayed", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(held == 1)
    }
}
