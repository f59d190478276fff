//! toolfleet-store: citations and the result ledger in Redis.
//!
//! This is the only crate that speaks Redis (rendering for readers is
//! `toolfleet_protocol::references`). Per invocation, with one hash
//! tag so a cluster keeps the keys in one slot:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<inv>}:seq` | string (INCR) | the shared reference counter: `[doc:N]` never collide |
//! | `<p>:{<inv>}:refs` | hash | `[doc:N]` → reference JSON |
//! | `<p>:{<inv>}:call:<call>` | string | the indices a call reserved, so a redelivered job reuses them |
//! | `<p>:{<inv>}:result:<call>` | string | the result ledger: a redelivered job returns the stored result |
//! | `<p>:{<inv>}:cancelled` | string | a cancel tombstone: a job that starts after its cancel is not run |
//! | `<p>:{<inv>}:owner` | string | the stream sequence of the chat job that claimed the invocation |
//!
//! Every key carries the TTL. References are written by one Lua script, so
//! a reservation is atomic: the counter, the hash and the call's indices move
//! together or not at all.

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::ConnectionManager;

use toolfleet_protocol::{Reference, ToolResult};

/// Default lifetime of an invocation's keys.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Clone, thiserror::Error)]
#[error("citation store: {0}")]
pub struct CitationError(String);

impl From<redis::RedisError> for CitationError {
    fn from(e: redis::RedisError) -> Self {
        // RedisError's Display can include the server's message but never
        // the URL or password.
        CitationError(e.to_string())
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
    conn: ConnectionManager,
    prefix: String,
    ttl: Duration,
    reserve: redis::Script,
}

impl std::fmt::Debug for CitationStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CitationStore")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// The outcome of [`CitationStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Nobody held the invocation; now this owner does.
    New,
    /// This owner already held it (a redelivery of the same job).
    Again,
    /// Another owner holds it (named).
    Other(String),
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
    /// Connects, with automatic reconnection afterwards.
    pub async fn connect(url: &str, prefix: &str, ttl: Duration) -> Result<Self, CitationError> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(2);
        let conn = client.get_connection_manager_with_config(config).await?;
        Ok(Self {
            conn,
            prefix: prefix.to_string(),
            ttl,
            reserve: redis::Script::new(RESERVE),
        })
    }

    /// The key layout, in one place.
    pub fn key(&self, invocation_id: &str, part: &str) -> String {
        format!("{}:{{{invocation_id}}}:{part}", self.prefix)
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
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
        invocation_id: &str,
        reservation: &str,
        call_id: &str,
        tool_id: &str,
        refs: Vec<NewReference>,
        floor: u64,
    ) -> Result<Vec<Reference>, CitationError> {
        let mut inv = self.reserve.prepare_invoke();
        inv.key(self.key(invocation_id, "seq"))
            .key(self.key(invocation_id, "refs"))
            .key(self.key(invocation_id, &format!("call:{reservation}")))
            .arg(self.ttl.as_secs().max(1))
            .arg(floor);
        let mut stored = Vec::with_capacity(refs.len());
        for r in refs {
            let reference = r.cited(0, tool_id, call_id);
            inv.arg(toolfleet_protocol::encode(&reference).to_vec());
            stored.push(reference);
        }
        let mut conn = self.conn.clone();
        let indices: String = inv.invoke_async(&mut conn).await?;
        let indices = indices
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u64>()
                    .map_err(|_| CitationError(format!("bad index {s:?} from the store")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if indices.len() != stored.len() {
            return Err(CitationError(format!(
                "store returned {} indices for {} references",
                indices.len(),
                stored.len()
            )));
        }
        for (r, i) in stored.iter_mut().zip(indices) {
            r.index = i;
        }
        Ok(stored)
    }

    /// Every reference of the invocation, sorted by index.
    pub async fn references(&self, invocation_id: &str) -> Result<Vec<Reference>, CitationError> {
        let mut conn = self.conn.clone();
        let all: HashMap<String, String> = conn.hgetall(self.key(invocation_id, "refs")).await?;
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

    /// The stored result of an earlier attempt of this call, if any.
    pub async fn ledger_get(
        &self,
        invocation_id: &str,
        call_id: &str,
    ) -> Result<Option<ToolResult>, CitationError> {
        let mut conn = self.conn.clone();
        let v: Option<String> = conn
            .get(self.key(invocation_id, &format!("result:{call_id}")))
            .await?;
        Ok(v.and_then(|s| serde_json::from_str(&s).ok()))
    }

    /// Remembers that the invocation was cancelled (for the store's TTL),
    /// so a job still queued when its cancel arrived is not run later.
    pub async fn mark_cancelled(&self, invocation_id: &str) -> Result<(), CitationError> {
        let mut conn = self.conn.clone();
        let _: () = conn
            .set_ex(
                self.key(invocation_id, "cancelled"),
                "1",
                self.ttl.as_secs().max(1),
            )
            .await?;
        Ok(())
    }

    /// Was the invocation cancelled ([`CitationStore::mark_cancelled`])?
    pub async fn is_cancelled(&self, invocation_id: &str) -> Result<bool, CitationError> {
        let mut conn = self.conn.clone();
        let exists: bool = conn.exists(self.key(invocation_id, "cancelled")).await?;
        Ok(exists)
    }

    pub async fn ledger_put(&self, result: &ToolResult) -> Result<(), CitationError> {
        let mut conn = self.conn.clone();
        let key = self.key(&result.invocation_id, &format!("result:{}", result.call_id));
        let json = serde_json::to_string(result).map_err(|e| CitationError(e.to_string()))?;
        let _: () = conn.set_ex(key, json, self.ttl.as_secs().max(1)).await?;
        Ok(())
    }

    /// Claims the invocation for `owner` (the stream sequence of the chat
    /// job that carries it), once: the first claim wins for the store's
    /// TTL; the same owner claiming again (a redelivery of that message)
    /// continues; any other owner is told who holds it.
    pub async fn claim(&self, invocation_id: &str, owner: &str) -> Result<Claim, CitationError> {
        let mut conn = self.conn.clone();
        let key = self.key(invocation_id, "owner");
        let set: bool = redis::cmd("SET")
            .arg(&key)
            .arg(owner)
            .arg("NX")
            .arg("EX")
            .arg(self.ttl.as_secs().max(1))
            .query_async::<Option<String>>(&mut conn)
            .await?
            .is_some();
        if set {
            return Ok(Claim::New);
        }
        let holder: Option<String> = conn.get(&key).await?;
        Ok(match holder {
            Some(h) if h == owner => Claim::Again,
            Some(h) => Claim::Other(h),
            // Expired between the two commands: the TTL is a day, so this
            // is a claim that lapsed; treat it as ours again.
            None => Claim::Again,
        })
    }

    /// Is the store answering?
    pub async fn ping(&self) -> Result<(), CitationError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}
