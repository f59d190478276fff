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

/// [`CitationStore::claim`] and [`LEASE`] in one script (the invocation's claim, lease
/// and tombstone share its hash tag): claims `KEYS[1]` for owner
/// `ARGV[1]` (TTL `ARGV[2]` s; `ARGV[5]` marks a finished owner) and, when
/// the claim is this owner's, takes the lease `KEYS[2]` for holder
/// `ARGV[3]` (TTL `ARGV[4]` ms) and reads the tombstone `KEYS[3]`.
/// Returns `{claim, held, holder, left_ms, cancelled}`.
const CLAIM_AND_LEASE: &str = r"
local claim = 'new'
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  local owner = redis.call('GET', KEYS[1])
  if owner == false or owner == ARGV[1] then
    claim = 'again'
  elseif owner == ARGV[1] .. ARGV[5] then
    return {'finished', 0, '', 0, 0}
  else
    return {'other', 0, owner, 0, 0}
  end
end
local cancelled = redis.call('EXISTS', KEYS[3])
local current = redis.call('GET', KEYS[2])
if current == false or current == ARGV[3] then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
  return {claim, 1, ARGV[3], tonumber(ARGV[4]), cancelled}
end
return {claim, 0, current, redis.call('PTTL', KEYS[2]), cancelled}
";

/// What [`CitationStore::claim_and_lease`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimLease {
    pub claim: crate::Claim,
    /// The lease, when the claim is the caller's (`New` or `Again`).
    pub lease: Option<Lease>,
    /// The invocation's cancel tombstone is there (read when the claim is
    /// the caller's).
    pub tombstone: bool,
}

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

    /// [`CitationStore::claim`], then — when the claim is `owner`'s —
    /// [`CitationStore::lease`] for `holder` and whether the cancel
    /// tombstone is there, atomically and in one round trip. Safe to
    /// repeat, as both are.
    pub async fn claim_and_lease(
        &self,
        inv: InvocationKey<'_>,
        owner: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<ClaimLease, CitationError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(CLAIM_AND_LEASE));
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(self.key(inv, "owner"))
            .key(self.key(inv, "lease"))
            .key(self.tombstone(inv))
            .arg(owner)
            .arg(self.ttl.as_secs().max(1))
            .arg(holder)
            .arg(ttl.as_millis().max(1) as u64)
            .arg(crate::FINISHED);
        let invocation = &invocation;
        let (claim, held, current, left_ms, cancelled): (String, i64, String, i64, i64) = self
            .run("claim_and_lease", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        let lease = || {
            Some(if held == 1 {
                Lease::Held
            } else {
                Lease::Busy {
                    holder: current.clone(),
                    left: Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)),
                }
            })
        };
        let (claim, lease) = match claim.as_str() {
            "new" => (crate::Claim::New, lease()),
            "again" => (crate::Claim::Again, lease()),
            "finished" => (crate::Claim::Finished, None),
            "other" => (crate::Claim::Other(current.clone()), None),
            other => {
                return Err(CitationError::new(
                    crate::ErrorKind::Corrupt,
                    format!("the claim script answered {other:?}"),
                ));
            }
        };
        Ok(ClaimLease {
            claim,
            lease,
            tombstone: cancelled == 1,
        })
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
