//! Cancels written down, so that a job whose cancel came before it ran is
//! not run — at a cost bounded per tenant, whatever a tenant sends.
//!
//! A cancel of an invocation the store knows (it has a claim: it runs, is
//! parked or ended) leaves its tombstone `<p>:{<t>/<inv>}:cancelled` with
//! the store's TTL, which the run's lease renewals and the workers' ledger
//! read. A cancel of an id the store does not know — a job still queued,
//! or one never submitted — leaves no key of its own: it joins the
//! tenant's remembered cancels `<p>:{<t>}:cancels`, a sorted set of
//! invocation ids scored by the time of the cancel, at most `remembered`
//! entries (the oldest leave first) and none older than
//! [`REMEMBERED_CANCEL_TTL`]. So a flood of cancels for unknown ids costs
//! one key per tenant, at most `remembered` × (id ≤ 128 bytes + the set's
//! overhead) bytes, and every entry goes within the hour.
//!
//! The set entry is written before the claim is looked up, and a run
//! claims before it reads both ([`CitationStore::is_cancelled`]): either
//! the cancel saw the claim (tombstone) or the run sees the entry, so a
//! cancel is never lost between the two (on a cluster too: each step is
//! one key's slot).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::AsyncCommands;

use crate::{CitationError, CitationStore, InvocationKey};

/// How long a cancel of a job not started yet is remembered: a job still
/// queued after this long is run despite it.
pub const REMEMBERED_CANCEL_TTL: Duration = Duration::from_secs(3600);

/// Adds `ARGV[2]` (scored `ARGV[1]`, now in ms) to the set `KEYS[1]`,
/// then drops entries older than `ARGV[3]` ms and the oldest beyond
/// `ARGV[4]`, and sets the key's TTL.
const REMEMBER: &str = r"
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ttl))
local extra = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[4])
if extra > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, extra - 1)
end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
";

/// Writes the tombstone `KEYS[2]` (TTL `ARGV[1]` s) when the claim
/// `KEYS[1]` exists; 1 when it did.
const TOMBSTONE_IF_CLAIMED: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
  return 1
end
return 0
";

/// What [`CitationStore::remember_cancel`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelNote {
    /// The invocation has a claim: its tombstone is written.
    Tombstone,
    /// The store does not know it: only the tenant's remembered cancels
    /// hold it.
    Remembered,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl CitationStore {
    /// The tenant's remembered cancels (see the module).
    fn remembered_cancels(&self, tenant: &str) -> String {
        format!("{}:{{{tenant}}}:cancels", self.prefix)
    }

    /// Writes a cancel down: a tombstone if the store knows the invocation,
    /// otherwise an entry among the tenant's `remembered` latest cancels
    /// (see the module). Safe to repeat.
    pub async fn remember_cancel(
        &self,
        inv: InvocationKey<'_>,
        remembered: u32,
    ) -> Result<CancelNote, CitationError> {
        static REMEMBER_SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(REMEMBER));
        static TOMBSTONE_SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(TOMBSTONE_IF_CLAIMED));
        let mut remember = REMEMBER_SCRIPT.prepare_invoke();
        remember
            .key(self.remembered_cancels(inv.tenant()))
            .arg(now_ms())
            .arg(inv.invocation_id())
            .arg(REMEMBERED_CANCEL_TTL.as_millis() as u64)
            .arg(remembered.max(1));
        let remember = &remember;
        let _: i64 = self
            .run("remember_cancel", |mut conn| async move {
                remember.invoke_async(&mut conn).await
            })
            .await?;
        let mut tombstone = TOMBSTONE_SCRIPT.prepare_invoke();
        tombstone
            .key(self.key(inv, "owner"))
            .key(self.tombstone(inv))
            .arg(self.ttl.as_secs().max(1));
        let tombstone = &tombstone;
        let claimed: i64 = self
            .run("tombstone_if_claimed", |mut conn| async move {
                tombstone.invoke_async(&mut conn).await
            })
            .await?;
        Ok(if claimed == 1 {
            CancelNote::Tombstone
        } else {
            CancelNote::Remembered
        })
    }

    /// Was the invocation cancelled: its tombstone
    /// ([`CitationStore::mark_cancelled`]), or a remembered cancel
    /// ([`CitationStore::remember_cancel`]) younger than
    /// [`REMEMBERED_CANCEL_TTL`]?
    pub async fn is_cancelled(&self, inv: InvocationKey<'_>) -> Result<bool, CitationError> {
        let key = &self.tombstone(inv);
        let tombstone: bool = self
            .run(
                "is_cancelled",
                |mut conn| async move { conn.exists(key).await },
            )
            .await?;
        if tombstone {
            return Ok(true);
        }
        self.cancel_remembered(inv).await
    }

    /// Whether a cancel of the invocation is among its tenant's remembered
    /// ones ([`CitationStore::remember_cancel`]) and younger than
    /// [`REMEMBERED_CANCEL_TTL`]: the half of [`CitationStore::is_cancelled`]
    /// that [`CitationStore::claim_and_lease`] cannot read (the tenant's
    /// set lives under another hash tag than the invocation's keys).
    pub async fn cancel_remembered(&self, inv: InvocationKey<'_>) -> Result<bool, CitationError> {
        let set = &self.remembered_cancels(inv.tenant());
        let id = inv.invocation_id();
        let at: Option<f64> = self
            .run("is_cancelled", |mut conn| async move {
                conn.zscore(set, id).await
            })
            .await?;
        let oldest = now_ms().saturating_sub(REMEMBERED_CANCEL_TTL.as_millis() as u64);
        Ok(at.is_some_and(|ms| ms >= oldest as f64))
    }

    /// How many cancels of `tenant` are remembered now (operators, tests).
    pub async fn remembered_cancel_count(&self, tenant: &str) -> Result<u64, CitationError> {
        let set = &self.remembered_cancels(tenant);
        self.run("remembered_cancel_count", |mut conn| async move {
            conn.zcard(set).await
        })
        .await
    }
}
