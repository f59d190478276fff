//! The run lease of a claimed invocation.
//!
//! A claim ([`CitationStore::claim`]) names the chat job's message, so a
//! redelivery of that message continues its run — which is right when the
//! orchestrator that ran it died, and wrong when it is alive but cut off
//! from NATS longer than the ack wait (its in-progress acks do not arrive,
//! so NATS hands the job to another orchestrator). The lease tells the two
//! apart: the run that holds the claim also holds `<p>:{<t>/<inv>}:lease`
//! (its holder id, with a short TTL) and renews it while it runs. A
//! redelivery finds the lease live and waits; once the holder stops
//! renewing (it died, or lost Redis too) the lease lapses and the next
//! delivery takes over. A run that finds its lease taken stops without a
//! word (the new holder speaks for the invocation).

use std::time::Duration;

use crate::{CitationError, CitationStore, InvocationKey};

/// Takes the lease when it is free or already `holder`'s, for `ttl`;
/// otherwise answers who holds it and for how long yet. One script, so
/// taking and renewing are atomic.
/// With a second key (the invocation's cancel tombstone), also answers
/// whether it exists: 1 or 0 as a fourth element.
const LEASE: &str = r"
local cancelled = 0
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  cancelled = 1
end
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1], tonumber(ARGV[2]), cancelled}
end
return {0, current, redis.call('PTTL', KEYS[1]), cancelled}
";

/// What [`CitationStore::lease`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lease {
    /// The caller holds the lease (taken now or renewed).
    Held,
    /// Another run holds it, for `left` yet unless it is renewed.
    Busy { holder: String, left: Duration },
}

impl CitationStore {
    /// Takes or renews the run lease of the invocation for `holder` (a
    /// run's unique id) for `ttl`. Safe to repeat: a renewal that ran
    /// before the connection broke is found held by the same holder.
    pub async fn lease(
        &self,
        inv: InvocationKey<'_>,
        holder: &str,
        ttl: Duration,
    ) -> Result<Lease, CitationError> {
        Ok(self.lease_script(inv, holder, ttl, false).await?.0)
    }

    /// [`CitationStore::lease`], and in the same round trip whether the
    /// invocation was cancelled ([`CitationStore::mark_cancelled`]): a run
    /// renewing its lease also learns of a cancel whose message it missed
    /// (it was disconnected when the cancel was published, and another
    /// orchestrator wrote the tombstone).
    pub async fn renew_lease(
        &self,
        inv: InvocationKey<'_>,
        holder: &str,
        ttl: Duration,
    ) -> Result<(Lease, bool), CitationError> {
        self.lease_script(inv, holder, ttl, true).await
    }

    /// Gives the lease up if `holder` holds it (a run that parked its
    /// invocation: whoever resumes it may take it at once). Safe to
    /// repeat.
    pub async fn release_lease(
        &self,
        inv: InvocationKey<'_>,
        holder: &str,
    ) -> Result<(), CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            )
        });
        let mut invocation = SCRIPT.prepare_invoke();
        invocation.key(self.key(inv, "lease")).arg(holder);
        let invocation = &invocation;
        self.run("release_lease", |mut conn| async move {
            invocation.invoke_async::<i64>(&mut conn).await
        })
        .await
        .map(drop)
    }

    async fn lease_script(
        &self,
        inv: InvocationKey<'_>,
        holder: &str,
        ttl: Duration,
        read_tombstone: bool,
    ) -> Result<(Lease, bool), CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(LEASE));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation.key(self.key(inv, "lease"));
        if read_tombstone {
            invocation.key(self.tombstone(inv));
        }
        invocation.arg(holder).arg(ttl.as_millis().max(1) as u64);
        let invocation = &invocation;
        let (held, current, left_ms, cancelled): (i64, String, i64, i64) = self
            .run("lease", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        let lease = if held == 1 {
            Lease::Held
        } else {
            Lease::Busy {
                holder: current,
                left: Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)),
            }
        };
        Ok((lease, cancelled == 1))
    }
}
