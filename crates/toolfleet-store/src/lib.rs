//! toolfleet-store: citations and the result ledger in Redis.
//!
//! This is the only crate that speaks Redis (rendering for readers is
//! `toolfleet_protocol::references`). Invocation ids are chosen by
//! clients, so they are unique per tenant only: every key of an
//! invocation names its tenant and its id ([`InvocationKey`]), and one
//! tenant's id never blocks, reveals or reaches another's. Per invocation,
//! with one hash tag (`{<tenant>/<inv>}`) so a cluster keeps the keys in
//! one slot:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<t>/<inv>}:seq` | string (INCR) | the shared reference counter: `[doc:N]` never collide |
//! | `<p>:{<t>/<inv>}:refs` | hash | `[doc:N]` → reference JSON |
//! | `<p>:{<t>/<inv>}:call:<call>` | string | the indices a call reserved, so a redelivered job reuses them |
//! | `<p>:{<t>/<inv>}:result:<call>` | string | the result ledger: a redelivered job returns the stored result |
//! | `<p>:{<t>/<inv>}:cancelled` | string | the cancel tombstone of an invocation the store knows (claimed): a run that missed its cancel, or a tool job of it, is not run |
//! | `<p>:{<t>/<inv>}:owner` | string | the stream sequence of the chat job that claimed the invocation (`:finished` appended when its run ended) |
//! | `<p>:{<t>/<inv>}:lease` | string (short TTL) | the run holding the claim, renewed while it runs ([`Lease`]): a redelivery waits while it is live |
//! | `<p>:{<t>/<inv>}:terminal` | string | the run's terminal event as published, for a redelivery to publish again |
//! | `<p>:{<t>/<inv>}:blob:<id>` | hash (`type`, `bytes`) | a tool's binary output ([`Blob`], at most [`MAX_BLOB_BYTES`]), read by its `toolfleet-blob:` URI |
//!
//! Per tenant, with the tenant's hash tag, each with its own TTL:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:tenant:{<t>}:poisons` | string (INCR, TTL the window) | the tenant's unreadable chat jobs in the current window ([`CitationStore::count_poison`]) |
//! | `<p>:tenant:{<t>}:suspended` | string (TTL the cool-off) | present while the tenant is suspended for poison ([`CitationStore::suspended_for`]) |
//! Per tenant (hash tag `{<t>}`):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<t>}:sink:<stream>:<seq>` | string (INCR) | real delivery attempts of a routed event (`sinks`): the relay's attempt cap, apart from deliveries it put back unattempted |
//! | `<p>:{<t>}:cancels` | sorted set (id → ms) | cancels of ids the store does not know (jobs still queued), at most the tenant's `remembered_cancels`, each for [`REMEMBERED_CANCEL_TTL`]: see `cancels` |
//!
//! Every key carries the TTL. References are written by one Lua script, so
//! a reservation is atomic: the counter, the hash and the call's indices move
//! together or not at all.
//!
//! # Layout
//!
//! - this file: [`CitationStore`], its operations, the key layout, the
//!   [`CitationError`] with its [`ErrorKind`], and the retry loop.
//! - [`connection`]: [`RedisOptions`] (one server or a Redis Cluster, auth
//!   in the URL, `rediss://` with a custom CA and client certificate) and
//!   the one connection type every command goes through.
//! - `blob`: [`Blob`]s, the binary outputs of tools
//!   ([`CitationStore::put_blob`], [`CitationStore::get_blob`]), scoped
//!   like references by tenant and invocation, and never larger than
//!   [`MAX_BLOB_BYTES`].
//! - `poison`: a tenant's poison count and suspension ([`PoisonRule`],
//!   [`PoisonCount`]), shared by every orchestrator.
//! - [`quota`]: a tenant's fleet-wide rate limits and budgets (requests and
//!   tokens per minute, spend per day and month): one script admits and
//!   counts a model call; its keys are the tenant's (`{<tenant>}`), not an
//!   invocation's.
//! - `cancels`: cancels written down ([`CitationStore::remember_cancel`],
//!   [`CitationStore::is_cancelled`]) at a bounded cost per tenant.
//! - `sinks`: delivery attempts of routed events
//!   ([`CitationStore::sink_attempt`]).
//! - [`api_keys`]: the gateway's API keys, by their SHA-256
//!   ([`CitationStore::api_key`]), under their own hash tag
//!   (`<p>:{apikeys}:…`, the table in the module).
//! - [`tool_cache`]: the tool-result cache ([`CitationStore::cache_lookup`],
//!   [`CitationStore::cache_store`], [`CitationStore::cache_purge`]), one
//!   hash tag per tool (`<p>:{tc:<ns>:<name>}:…`, the table in the module),
//!   purged by generation counters.
//! - `retry`: which Redis errors are transient, and the backoff between
//!   tries. Every operation retries transient errors within the options'
//!   budget and then fails as [`ErrorKind::Unavailable`]; other errors fail
//!   at once. Every operation is safe to repeat (see each one).

pub mod api_keys;
mod blob;
mod cancels;
pub mod connection;
mod delayed;
mod lease;
mod poison;
pub mod provider;
pub mod quota;
mod retry;
mod sinks;
pub mod slots;
pub mod tool_cache;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;

use toolfleet_protocol::{Reference, ToolResult};

pub use blob::{Blob, MAX_BLOB_BYTES};
pub use cancels::{CancelNote, REMEMBERED_CANCEL_TTL};
use connection::{Conn, Connector, Secrets};
pub use connection::{DEFAULT_RETRY_BUDGET, RedisOptions, redact_url};
pub use lease::{ClaimLease, Lease};
pub use poison::{PoisonCount, PoisonRule};

/// Default lifetime of an invocation's keys.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

/// What went wrong, for callers to decide by type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Redis did not answer (down, restarting, unreachable) within the
    /// retry budget. Worth retrying the job later.
    Unavailable,
    /// The configuration is wrong (URL, TLS files). Retrying will not help.
    Config,
    /// Redis answered with an error (authentication, script, wrong type).
    Rejected,
    /// Redis answered something the store cannot read.
    Corrupt,
    /// The value is larger than the store takes (a blob past
    /// [`MAX_BLOB_BYTES`]); refused before anything is sent. Retrying will
    /// not help.
    TooLarge,
    /// The caller's value cannot be stored as it is (a blob id or content
    /// type the contract refuses); refused before anything is sent.
    Invalid,
}

/// A store error. Its text names the operation and the cause, never the
/// URL's password.
#[derive(Debug, Clone, thiserror::Error)]
#[error("citation store: {message}")]
pub struct CitationError {
    kind: ErrorKind,
    message: String,
}

impl CitationError {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Did Redis stay unreachable for the whole retry budget?
    pub fn is_unavailable(&self) -> bool {
        self.kind == ErrorKind::Unavailable
    }
}

impl From<redis::RedisError> for CitationError {
    fn from(e: redis::RedisError) -> Self {
        // RedisError's Display can include the server's message but never
        // the URL or password.
        let kind = if retry::is_transient(&e) {
            ErrorKind::Unavailable
        } else {
            ErrorKind::Rejected
        };
        CitationError::new(kind, e.to_string())
    }
}

const RESERVE: &str = r#"
local n = #ARGV - 2
local ttl = tonumber(ARGV[1])
local existing = redis.call('GET', KEYS[3])
if existing then
  local count = 0
  if existing ~= '' then
    for _ in string.gmatch(existing, '[^,]+') do count = count + 1 end
  end
  if count == n then
    local i = 1
    for idx in string.gmatch(existing, '[^,]+') do
      redis.call('HSET', KEYS[2], '[doc:' .. idx .. ']', ARGV[i + 2])
      i = i + 1
    end
    return existing
  end
end
local out = {}
if n > 0 then
  -- The floor is the highest index the caller knows was handed out: a
  -- counter lost with a Redis restart never hands out an index again.
  local cur = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
  local floor = tonumber(ARGV[2])
  if cur < floor then cur = floor end
  local last = cur + n
  redis.call('SET', KEYS[1], tostring(last))
  local first = last - n + 1
  for i = 1, n do
    local idx = first + i - 1
    redis.call('HSET', KEYS[2], '[doc:' .. idx .. ']', ARGV[i + 2])
    out[i] = tostring(idx)
  end
end
local s = table.concat(out, ',')
redis.call('SET', KEYS[3], s, 'EX', ttl)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return s
"#;

/// A handle on the citation store; cheap to clone.
#[derive(Clone)]
pub struct CitationStore {
    conn: Conn,
    prefix: String,
    ttl: Duration,
    reserve: redis::Script,
    retry_budget: Duration,
    secrets: Arc<Secrets>,
    /// The tool-result cache's breaker, shared by every clone: a lookup
    /// that failed keeps the cache passed by for a while.
    cache_breaker: Arc<tool_cache::Breaker>,
}

impl std::fmt::Debug for CitationStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CitationStore")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .field("retry_budget", &self.retry_budget)
            .finish_non_exhaustive()
    }
}

/// What an owner's claim becomes when its run ends.
const FINISHED: &str = ":finished";

/// The outcome of [`CitationStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Nobody held the invocation; now this owner does.
    New,
    /// This owner already held it (a redelivery of the same job).
    Again,
    /// This owner held it and its run ended ([`CitationStore::finish`]): a
    /// redelivery whose ack was lost; nothing is to be run again.
    Finished,
    /// Another owner holds it (named).
    Other(String),
}

/// Whose invocation a key belongs to: its tenant and its id. Invocation
/// ids are the client's choice and unique within a tenant only, so every
/// key of an invocation names both — the same id under two tenants is two
/// invocations with nothing in common.
///
/// Both parts are 1-64 (tenant) and 1-128 (id) of `[A-Za-z0-9_-]` as the
/// contract has them ([`toolfleet_protocol::valid_tenant`],
/// [`toolfleet_protocol::valid_invocation_id`]), so the hash tag
/// `{<tenant>/<id>}` is unambiguous. The tenant is the one the fleet
/// decided (the submit subject's, or a tool job's `Toolfleet-Tenant`
/// header), never one a job body names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InvocationKey<'a> {
    tenant: &'a str,
    invocation_id: &'a str,
}

impl<'a> InvocationKey<'a> {
    /// The invocation `invocation_id` of `tenant`.
    pub fn new(tenant: &'a str, invocation_id: &'a str) -> Self {
        Self {
            tenant,
            invocation_id,
        }
    }

    /// The key of the invocation a tool call belongs to (its tenant from
    /// the job's `Toolfleet-Tenant` header).
    pub fn of_call(call: &'a toolfleet_protocol::CallContext) -> Self {
        Self::new(call.invocation.tenant(), &call.invocation.invocation_id)
    }

    pub fn tenant(&self) -> &'a str {
        self.tenant
    }

    pub fn invocation_id(&self) -> &'a str {
        self.invocation_id
    }
}

impl std::fmt::Display for InvocationKey<'_> {
    /// `<tenant>/<invocation id>`, as in the keys' hash tag.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.tenant, self.invocation_id)
    }
}

/// A reference before it has an index.
#[derive(Debug, Clone, PartialEq)]
pub struct NewReference {
    pub kind: String,
    pub title: String,
    pub source: Option<String>,
    pub url: Option<String>,
    pub snippet: Option<String>,
}

impl NewReference {
    /// The reference as stored: under `index`, naming the tool and call
    /// that cited it.
    pub fn cited(self, index: u64, tool_id: &str, call_id: &str) -> Reference {
        Reference {
            index,
            kind: self.kind,
            title: self.title,
            source: self.source,
            url: self.url,
            snippet: self.snippet,
            tool_id: Some(tool_id.to_string()),
            call_id: Some(call_id.to_string()),
        }
    }
}

impl CitationStore {
    /// Connects to one server at `url` (or a cluster, when `url` lists
    /// several comma-separated nodes) with the default retry budget.
    /// Same as [`CitationStore::connect_with`] with [`RedisOptions::new`].
    pub async fn connect(url: &str, prefix: &str, ttl: Duration) -> Result<Self, CitationError> {
        Self::connect_with(&RedisOptions::new(url), prefix, ttl).await
    }

    /// Connects as `options` say (cluster, TLS, retry budget), retrying a
    /// Redis that is not up yet within the budget; reconnects on its own
    /// afterwards. A configuration error fails at once.
    pub async fn connect_with(
        options: &RedisOptions,
        prefix: &str,
        ttl: Duration,
    ) -> Result<Self, CitationError> {
        let connector = Connector::new(options)?;
        let secrets = Arc::new(connector.secrets.clone());
        let conn = with_retries(options.retry_budget, &secrets, "connect", || {
            connector.connect()
        })
        .await?;
        Ok(Self {
            conn,
            prefix: prefix.to_string(),
            ttl,
            reserve: redis::Script::new(RESERVE),
            retry_budget: options.retry_budget,
            secrets,
            cache_breaker: Arc::default(),
        })
    }

    /// How long transient errors are retried before an operation fails.
    pub fn retry_budget(&self) -> Duration {
        self.retry_budget
    }

    /// Runs `op` (named `what` in errors) on a fresh handle of the
    /// connection until it succeeds, fails for good, or the budget is spent.
    async fn run<T, F, Fut>(&self, what: &'static str, mut op: F) -> Result<T, CitationError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        with_retries(self.retry_budget, &self.secrets, what, || {
            op(self.conn.clone())
        })
        .await
    }

    /// The key layout, in one place: `<p>:{<tenant>/<id>}:<part>`, one
    /// hash tag per invocation of a tenant.
    pub fn key(&self, inv: InvocationKey<'_>, part: &str) -> String {
        format!("{}:{{{inv}}}:{part}", self.prefix)
    }

    /// The invocation's cancel tombstone.
    fn tombstone(&self, inv: InvocationKey<'_>) -> String {
        self.key(inv, "cancelled")
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// References another answer holds (a nested job's, a cached result's)
    /// given indices of `inv` under `call_id` ([`CitationStore::reserve`]),
    /// with the map from each one's old index to its new one — what the
    /// answer's `[doc:N]` markers are renumbered by.
    pub async fn reserve_again(
        &self,
        inv: InvocationKey<'_>,
        call_id: &str,
        tool_id: &str,
        refs: Vec<Reference>,
        floor: u64,
    ) -> Result<(Vec<Reference>, std::collections::HashMap<u64, u64>), CitationError> {
        if refs.is_empty() {
            return Ok((Vec::new(), std::collections::HashMap::new()));
        }
        let old: Vec<u64> = refs.iter().map(|r| r.index).collect();
        let fresh = refs
            .into_iter()
            .map(|r| NewReference {
                kind: r.kind,
                title: r.title,
                source: r.source,
                url: r.url,
                snippet: r.snippet,
            })
            .collect();
        let stored = self
            .reserve(inv, call_id, call_id, tool_id, fresh, floor)
            .await?;
        let map = old
            .into_iter()
            .zip(stored.iter().map(|r| r.index))
            .collect();
        Ok((stored, map))
    }

    /// Atomically takes indices from the invocation's counter and stores the
    /// references under them. A second call for the same `call_id` with the
    /// same number of references reuses the first call's indices.
    ///
    /// `reservation` names this reservation (the call id, or the call id
    /// and a counter when one call cites more than once); `call_id` goes
    /// into the references.
    ///
    /// `floor` is the highest index the invocation is known to have handed
    /// out (the orchestrator sends it with each tool job): new indices are
    /// always above it, even when Redis lost the counter.
    pub async fn reserve(
        &self,
        inv: InvocationKey<'_>,
        reservation: &str,
        call_id: &str,
        tool_id: &str,
        refs: Vec<NewReference>,
        floor: u64,
    ) -> Result<Vec<Reference>, CitationError> {
        let mut script = self.reserve.prepare_invoke();
        script
            .key(self.key(inv, "seq"))
            .key(self.key(inv, "refs"))
            .key(self.key(inv, &format!("call:{reservation}")))
            .arg(self.ttl.as_secs().max(1))
            .arg(floor);
        let mut stored = Vec::with_capacity(refs.len());
        for r in refs {
            let reference = r.cited(0, tool_id, call_id);
            script.arg(toolfleet_protocol::encode(&reference).to_vec());
            stored.push(reference);
        }
        // Safe to repeat: the reservation key makes a second run return
        // the first run's indices.
        let script = &script;
        let indices: String = self
            .run("reserve", |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await?;
        let indices = indices
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u64>().map_err(|_| {
                    CitationError::new(
                        ErrorKind::Corrupt,
                        format!("bad index {s:?} from the store"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if indices.len() != stored.len() {
            return Err(CitationError::new(
                ErrorKind::Corrupt,
                format!(
                    "store returned {} indices for {} references",
                    indices.len(),
                    stored.len()
                ),
            ));
        }
        for (r, i) in stored.iter_mut().zip(indices) {
            r.index = i;
        }
        Ok(stored)
    }

    /// Every reference of the invocation, sorted by index.
    pub async fn references(
        &self,
        inv: InvocationKey<'_>,
    ) -> Result<Vec<Reference>, CitationError> {
        let key = &self.key(inv, "refs");
        let all: HashMap<String, String> = self
            .run(
                "references",
                |mut conn| async move { conn.hgetall(key).await },
            )
            .await?;
        let mut out = Vec::with_capacity(all.len());
        for (field, json) in all {
            let Some(index) = field
                .strip_prefix("[doc:")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            // A foreign value in the hash is skipped, not fatal: the reader
            // still gets every reference it can use.
            if let Ok(mut r) = serde_json::from_str::<Reference>(&json) {
                r.index = index;
                out.push(r);
            }
        }
        out.sort_by_key(|r| r.index);
        Ok(out)
    }

    /// Before a tool call runs, in one round trip: the stored result of an
    /// earlier attempt of this call, if any, and whether the invocation
    /// was cancelled (both keys share the invocation's hash tag, so this
    /// works on a cluster too).
    pub async fn ledger_and_cancel(
        &self,
        inv: InvocationKey<'_>,
        call_id: &str,
    ) -> Result<(Option<ToolResult>, bool), CitationError> {
        let keys = &[
            self.key(inv, &format!("result:{call_id}")),
            self.tombstone(inv),
        ];
        let (result, cancelled): (Option<String>, Option<String>) = self
            .run("ledger_and_cancel", |mut conn| async move {
                redis::cmd("MGET").arg(keys).query_async(&mut conn).await
            })
            .await?;
        Ok((
            result.and_then(|s| serde_json::from_str(&s).ok()),
            cancelled.is_some(),
        ))
    }

    /// The stored results of `call_ids` of the invocation, in their order
    /// (`None` where the ledger holds none, or an unreadable one), in one
    /// round trip (the keys share the invocation's hash tag): what a
    /// caller that may have missed the replies reads back.
    pub async fn ledger_get_many(
        &self,
        inv: InvocationKey<'_>,
        call_ids: &[&str],
    ) -> Result<Vec<Option<ToolResult>>, CitationError> {
        if call_ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys = &call_ids
            .iter()
            .map(|id| self.key(inv, &format!("result:{id}")))
            .collect::<Vec<_>>();
        let stored: Vec<Option<String>> = self
            .run("ledger_get_many", |mut conn| async move {
                redis::cmd("MGET").arg(keys).query_async(&mut conn).await
            })
            .await?;
        Ok(stored
            .into_iter()
            .map(|s| s.and_then(|s| serde_json::from_str(&s).ok()))
            .collect())
    }

    /// Writes the invocation's cancel tombstone (for the store's TTL)
    /// whether or not the store knows it: a run or a tool job of it is
    /// then not run. The same id under another tenant is another
    /// invocation: its cancel stops nothing here. The cancel listener
    /// writes down cancels with [`CitationStore::remember_cancel`]
    /// instead, which leaves no key for an id the store does not know.
    pub async fn mark_cancelled(&self, inv: InvocationKey<'_>) -> Result<(), CitationError> {
        let key = &self.tombstone(inv);
        let ttl = self.ttl.as_secs().max(1);
        self.run("mark_cancelled", |mut conn| async move {
            conn.set_ex::<_, _, ()>(key, "1", ttl).await
        })
        .await
    }

    /// Stores `result` (of an invocation of `tenant`) in the ledger: a
    /// later delivery of its call returns it
    /// ([`CitationStore::ledger_and_cancel`]).
    pub async fn ledger_put(&self, tenant: &str, result: &ToolResult) -> Result<(), CitationError> {
        let json = serde_json::to_vec(result)
            .map_err(|e| CitationError::new(ErrorKind::Corrupt, e.to_string()))?;
        let inv = InvocationKey::new(tenant, &result.invocation_id);
        self.ledger_put_json(inv, &result.call_id, &json).await
    }

    /// [`CitationStore::ledger_put`] of a result already encoded as JSON
    /// (a worker encodes it once, for the ledger and for its reply).
    pub async fn ledger_put_json(
        &self,
        inv: InvocationKey<'_>,
        call_id: &str,
        json: &[u8],
    ) -> Result<(), CitationError> {
        let key = &self.key(inv, &format!("result:{call_id}"));
        let ttl = self.ttl.as_secs().max(1);
        // Safe to repeat: the same value under the same key.
        self.run("ledger_put", |mut conn| async move {
            conn.set_ex::<_, _, ()>(key, json, ttl).await
        })
        .await
    }

    /// Stores many encoded results at once (`(invocation, call id, JSON)`):
    /// one pipeline on a single server; on a cluster, where each
    /// invocation's keys live in their own slot, one write per result, all
    /// at once. All or nothing as far as the caller knows: an error means
    /// some may be stored, and repeating them is safe.
    pub async fn ledger_put_many(
        &self,
        results: &[(InvocationKey<'_>, &str, &[u8])],
    ) -> Result<(), CitationError> {
        match results {
            [] => return Ok(()),
            [(inv, call, json)] => return self.ledger_put_json(*inv, call, json).await,
            _ => {}
        }
        let ttl = self.ttl.as_secs().max(1);
        if matches!(self.conn, Conn::Cluster(_)) {
            let writes = results
                .iter()
                .map(|(inv, call, json)| self.ledger_put_json(*inv, call, json));
            for outcome in futures::future::join_all(writes).await {
                outcome?;
            }
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (inv, call, json) in results {
            pipe.set_ex(self.key(*inv, &format!("result:{call}")), *json, ttl)
                .ignore();
        }
        let pipe = &pipe;
        // Safe to repeat: the same values under the same keys.
        self.run("ledger_put", |mut conn| async move {
            pipe.query_async::<()>(&mut conn).await
        })
        .await
    }

    /// Claims the invocation for `owner` (the stream sequence of the chat
    /// job that carries it), once: the first claim wins for the store's
    /// TTL; the same owner claiming again (a redelivery of that message)
    /// continues; any other owner is told who holds it.
    ///
    /// The claim is the tenant's: another tenant's invocation of the same
    /// id is claimed apart and never learns of this one.
    pub async fn claim(&self, inv: InvocationKey<'_>, owner: &str) -> Result<Claim, CitationError> {
        let key = &self.key(inv, "owner");
        let ttl = self.ttl.as_secs().max(1);
        // Safe to repeat: a SET NX that ran before the connection broke is
        // found on the next try as "held by this owner", i.e. `Again`.
        self.run("claim", |mut conn| async move {
            let set = redis::cmd("SET")
                .arg(key)
                .arg(owner)
                .arg("NX")
                .arg("EX")
                .arg(ttl)
                .query_async::<Option<String>>(&mut conn)
                .await?
                .is_some();
            if set {
                return Ok(Claim::New);
            }
            let holder: Option<String> = conn.get(key).await?;
            Ok(match holder {
                Some(h) if h == owner => Claim::Again,
                Some(h) if h.strip_suffix(FINISHED).is_some_and(|o| o == owner) => Claim::Finished,
                Some(h) => Claim::Other(h),
                // Expired between the two commands: the TTL is a day, so
                // this is a claim that lapsed; treat it as ours again.
                None => Claim::Again,
            })
        })
        .await
    }

    /// Marks the run of `owner` ended (its terminal event is out), so a
    /// redelivery of its job — the ack was lost — claims
    /// [`Claim::Finished`] and is not run again.
    ///
    /// `terminal_event` is the run's terminal event as published: a
    /// redelivery publishes it again ([`CitationStore::terminal_event`]),
    /// in case it was lost with the connection that lost the ack.
    pub async fn finish(
        &self,
        inv: InvocationKey<'_>,
        owner: &str,
        terminal_event: &[u8],
    ) -> Result<(), CitationError> {
        let key = &self.key(inv, "owner");
        let event_key = &self.key(inv, "terminal");
        let ttl = self.ttl.as_secs().max(1);
        let value = &format!("{owner}{FINISHED}");
        // The event first: a finished claim always has its event.
        self.run("finish", |mut conn| async move {
            conn.set_ex::<_, _, ()>(event_key, terminal_event, ttl)
                .await?;
            conn.set_ex::<_, _, ()>(key, value, ttl).await
        })
        .await
    }

    /// The terminal event stored by [`CitationStore::finish`].
    pub async fn terminal_event(
        &self,
        inv: InvocationKey<'_>,
    ) -> Result<Option<Vec<u8>>, CitationError> {
        let key = &self.key(inv, "terminal");
        self.run(
            "terminal_event",
            |mut conn| async move { conn.get(key).await },
        )
        .await
    }

    /// Is the invocation claimed (a job of its id taken by an
    /// orchestrator, running or finished)? Reads only: claims nothing.
    pub async fn is_claimed(&self, inv: InvocationKey<'_>) -> Result<bool, CitationError> {
        let key = &self.key(inv, "owner");
        self.run("is_claimed", |mut conn| async move {
            conn.exists::<_, bool>(key).await
        })
        .await
    }

    /// Keeps the invocation's claim for at least `at_least` (and never
    /// less than the store's TTL): a parked invocation may wait longer
    /// than the TTL for a person, and its id must stay claimed meanwhile.
    pub async fn keep_claim(
        &self,
        inv: InvocationKey<'_>,
        at_least: Duration,
    ) -> Result<(), CitationError> {
        let key = &self.key(inv, "owner");
        let secs =
            i64::try_from(at_least.as_secs().max(self.ttl.as_secs()).max(1)).unwrap_or(i64::MAX);
        self.run("keep_claim", |mut conn| async move {
            conn.expire::<_, ()>(key, secs).await
        })
        .await
    }

    /// Is the store answering?
    pub async fn ping(&self) -> Result<(), CitationError> {
        self.run("ping", |mut conn| async move {
            redis::cmd("PING").query_async::<String>(&mut conn).await
        })
        .await
        .map(drop)
    }
}

/// The retry loop: `attempt` until it succeeds, fails with an error that
/// is not transient, or `budget` is spent (then one last try at the
/// deadline, so the whole budget is used).
async fn with_retries<T, F, Fut>(
    budget: Duration,
    secrets: &Secrets,
    what: &'static str,
    mut attempt: F,
) -> Result<T, CitationError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = redis::RedisResult<T>>,
{
    let start = Instant::now();
    let mut tries: u32 = 0;
    loop {
        let left = budget.saturating_sub(start.elapsed());
        let outcome = tokio::time::timeout(retry::attempt_limit(left), attempt()).await;
        tries += 1;
        let last = match outcome {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if !retry::is_transient(&e) => {
                return Err(CitationError::new(
                    ErrorKind::Rejected,
                    format!("Redis refused {what}: {}", secrets.redact(&e.to_string())),
                ));
            }
            Ok(Err(e)) => secrets.redact(&e.to_string()),
            Err(_) => "no answer in time".to_string(),
        };
        let left = budget.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(CitationError::new(
                ErrorKind::Unavailable,
                format!(
                    "unavailable: Redis did not answer {what} within the {budget:?} retry budget \
                     ({tries} tries, last error: {last})"
                ),
            ));
        }
        tracing::debug!(op = what, tries, error = %last, "redis: transient error, retrying");
        tokio::time::sleep(retry::backoff(tries - 1).min(left)).await;
    }
}
