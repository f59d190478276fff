//! The tool-result cache: `ok` results of tools whose definition has a
//! `cache` ([`toolfleet_protocol::tools::ToolCache`]), kept for the
//! definition's TTL and given again to a call with the same tool version,
//! the same arguments (in any key order), the same context a tool may read
//! (data source, attached documents, resource, the tenant's settings of
//! the tool) and the same scope.
//!
//! Keys, all of one tool under the hash tag `{tc:<ns>:<name>}` (every
//! version of the tool), so a lookup is one `MGET` in one slot of a
//! cluster and a purge needs no `SCAN`:
//!
//! | key | type | holds | TTL |
//! |---|---|---|---|
//! | `<p>:{tc:<tool>}:gen` | string (INCR) | the tool's generation: a purge of every tenant adds one | [`GENERATION_TTL`], renewed by every store |
//! | `<p>:{tc:<tool>}:gen:<t>` | string (INCR) | the tool's generation for tenant `t`: a purge of that tenant adds one | the same |
//! | `<p>:{tc:<tool>}:e:tenant:<t>:<sha256>` | string (JSON) | a result of tenant `t`'s calls | the definition's `ttlMs` |
//! | `<p>:{tc:<tool>}:e:user:<t>:<sha256>` | string (JSON) | a result of one user's calls (the user is in the digest) | the same |
//! | `<p>:{tc:<tool>}:e:global:<sha256>` | string (JSON) | a result shared by every tenant | the same |
//!
//! An entry holds the generations it was stored under; a lookup reads
//! them with the entry and takes it only while they are still current, so
//! a purge is one `INCR` and purged entries simply lapse. A store checks
//! the generations it read before the call ran, in the same script that
//! writes the entry: a result of a call that began before a purge is not
//! kept. A generation key that is missing is *unknown*, never zero: a
//! lookup that finds none is a miss whatever the entry says, and the store
//! that finds none sets it to a fresh random number (a purge of a missing
//! one too, before adding one), so an entry stored under a generation that
//! was lost (evicted, deleted) never matches again. The generation keys
//! outlive every entry that names them (each store renews them for longer
//! than any entry lives). An entry is at most [`MAX_ENTRY_BYTES`]: a
//! bigger result is not stored.
//!
//! The digest is SHA-256 of the canonical JSON ([`canonical_json`]: keys
//! sorted at every depth, numbers as `serde_json` prints them) of the tool
//! id with its version, the arguments, the context, the SHA-256 of the
//! tenant's settings of the tool and, for scope `user`, the user. Tenant
//! and user are the ones the fleet decided, never a job's claim. A
//! `global` call whose context names a data source, attached documents or
//! a resource — names that mean something only inside one tenant — is kept
//! as its tenant's (scope `tenant` for that call).
//!
//! A lookup is tried once, within [`LOOKUP_TIMEOUT`]; one that fails or
//! does not answer in time opens the store's breaker: for
//! [`BREAKER_OPEN_FOR`] every lookup and store is passed by at once
//! without asking Redis. A cache that does not answer is a miss for the
//! caller, never an error of the call, and costs it at most one short
//! wait per breaker period.

use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use toolfleet_protocol::ToolResult;
use toolfleet_protocol::tools::{CacheScope, MAX_CACHE_TTL_MS, ToolId};

use crate::{CitationError, CitationStore, ErrorKind};

/// How long a generation key lives after the last store that named it:
/// longer than any entry ([`MAX_CACHE_TTL_MS`]) plus a day.
pub const GENERATION_TTL: Duration = Duration::from_millis(MAX_CACHE_TTL_MS + 86_400_000);

/// How long a lookup may take before the cache is passed by: a call of a
/// cached tool waits at most this long for Redis. A healthy one on the
/// same network answers in well under a millisecond, but a busy host (a
/// loaded 2-core node, a CI runner) can stall it for tens of
/// milliseconds, and a timeout opens the breaker for every call: so not
/// shorter. A Redis that is really slow costs one call this wait per
/// [`BREAKER_OPEN_FOR`].
pub const LOOKUP_TIMEOUT: Duration = Duration::from_millis(250);

/// How long a store may take (it runs in a task of its own: no answer
/// waits for it).
pub const STORE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long the cache is passed by, without asking Redis, after a lookup
/// failed or did not answer in time: a slow Redis costs a batch of calls
/// one [`LOOKUP_TIMEOUT`], not one each.
pub const BREAKER_OPEN_FOR: Duration = Duration::from_secs(5);

/// The largest entry (the result's JSON and its generations) kept: a
/// bigger result is not stored ([`Stored::TooLarge`]), so one tool's
/// answers cannot fill Redis.
pub const MAX_ENTRY_BYTES: usize = 256 * 1024;

/// Writes an entry only while the generations are the ones the lookup
/// read (ARGV 1 and 2; empty: the key was missing, and must still be: it
/// is then set to the fresh number in ARGV 6 or 7); renews the generation
/// keys so they outlive the entry. The entry is JSON:
/// `{"gens":[all,tenant],"result":…}`.
const STORE: &str = r#"
local gens = {}
for i = 1, 2 do
  if i == 2 and KEYS[2] == KEYS[1] then
    gens[2] = gens[1]
  else
    local cur = redis.call('GET', KEYS[i])
    if ARGV[i] == '' then
      if cur then return 0 end
      cur = ARGV[5 + i]
      redis.call('SET', KEYS[i], cur, 'PX', ARGV[5])
    elseif cur ~= ARGV[i] then
      return 0
    end
    gens[i] = cur
  end
end
local entry = '{"gens":[' .. gens[1] .. ',' .. gens[2] .. '],"result":' .. ARGV[3] .. '}'
redis.call('SET', KEYS[3], entry, 'PX', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"#;

/// Adds one to a generation (a missing one first set to the fresh number
/// in ARGV 2) and sets its TTL: the new generation, and whether the key
/// was there (1) or not (0).
const PURGE: &str = r"
local known = redis.call('EXISTS', KEYS[1])
if known == 0 then redis.call('SET', KEYS[1], ARGV[2]) end
local g = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {g, known}
";

/// [`STORE`] and [`PURGE`], their digests computed once.
static STORE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(STORE));
static PURGE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PURGE));

/// A fresh generation for a key that is missing: a random number between
/// 2^32 and 2^52 (exact in any JSON reader, and `INCR` never overflows
/// it), so no entry stored under a lost generation matches the new one.
fn fresh_generation() -> u64 {
    let random = uuid::Uuid::new_v4().as_u128();
    (1 << 32) + u64::try_from(random % ((1 << 52) - (1 << 32))).unwrap_or(0)
}

/// The cache's breaker: open for [`BREAKER_OPEN_FOR`] after a lookup
/// failed. Shared by every clone of a [`CitationStore`].
#[derive(Debug, Default)]
pub(crate) struct Breaker {
    /// Until when the cache is passed by.
    open_until: Mutex<Option<Instant>>,
}

impl Breaker {
    /// Whether the cache is passed by now.
    fn is_open(&self) -> bool {
        let guard = self
            .open_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.is_some_and(|until| Instant::now() < until)
    }

    /// Passes the cache by for [`BREAKER_OPEN_FOR`] from now.
    fn open(&self) {
        *self
            .open_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Instant::now() + BREAKER_OPEN_FOR);
    }
}

/// Where a call's result is cached: its tool, tenant (none for a global
/// entry) and digest. Made by [`CacheKey::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    /// `ns:name`: every version shares the tool's generations.
    tool: String,
    scope: CacheScope,
    /// The tenant whose generation counts (tenant and user scopes).
    tenant: Option<String>,
    /// Hex SHA-256 of the canonical call.
    digest: String,
}

/// What a call is, apart from its arguments, that a tool may read and that
/// must therefore match for a result to be given again.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallScope<'a> {
    /// The tenant the fleet decided for the call.
    pub tenant: &'a str,
    /// The authenticated user, when the fleet trusts one.
    pub user: Option<&'a str>,
    /// The data source the call's job names.
    pub data_source_id: Option<&'a str>,
    /// The documents the chat job attached.
    pub attached_documents: &'a [String],
    /// The chat job's resource.
    pub resource: Option<&'a str>,
    /// The tenant's settings of the tool, as its job carries them (a tool
    /// with a `settingsSchema`): a result made under other settings is
    /// another call's.
    pub settings: Option<&'a Value>,
}

impl CallScope<'_> {
    /// Whether the call names something that means something only inside
    /// its tenant: a data source, attached documents or a resource.
    fn names_tenant_things(&self) -> bool {
        self.data_source_id.is_some_and(|d| !d.is_empty())
            || !self.attached_documents.is_empty()
            || self.resource.is_some_and(|r| !r.is_empty())
    }
}

impl CacheKey {
    /// The key of a call of `tool` with `arguments` in `call`'s scope;
    /// `None` for scope `user` without an authenticated user (such a call
    /// is not cached). A `global` call that names a data source, attached
    /// documents or a resource is keyed as its tenant's (scope `tenant`):
    /// another tenant naming the same `resource` means another thing by
    /// it, and must not get this tenant's result.
    #[must_use]
    pub fn new(
        tool: &ToolId,
        scope: CacheScope,
        arguments: &Value,
        call: &CallScope<'_>,
    ) -> Option<Self> {
        let scope = match scope {
            CacheScope::Global if call.names_tenant_things() => CacheScope::Tenant,
            other => other,
        };
        let user = match scope {
            CacheScope::User => Some(call.user.filter(|u| !u.is_empty())?),
            CacheScope::Tenant | CacheScope::Global => None,
        };
        let settings = call
            .settings
            .map(|s| sha256_hex(canonical_json(s).as_bytes()));
        let canonical = canonical_json(&json!({
            "tool": tool.to_string(),
            "arguments": arguments,
            "user": user,
            "dataSourceId": call.data_source_id,
            "attachedDocuments": call.attached_documents,
            "resource": call.resource,
            "settings": settings,
        }));
        Some(Self {
            tool: format!("{}:{}", tool.namespace, tool.name),
            scope,
            tenant: (scope != CacheScope::Global).then(|| call.tenant.to_owned()),
            digest: sha256_hex(canonical.as_bytes()),
        })
    }

    /// The hex digest of the call (for logs and tests).
    #[must_use]
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The scope the call is kept under: the definition's, except a
    /// `global` call that names its tenant's things ([`CacheKey::new`]).
    #[must_use]
    pub fn scope(&self) -> CacheScope {
        self.scope
    }
}

/// A cached result found by [`CitationStore::cache_lookup`].
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// A result stored under the current generations.
    Hit(Box<ToolResult>),
    /// None (or a purged one); [`Generations`] to store the call's result
    /// under.
    Miss(Generations),
}

/// The generations a lookup read (`None`: the key was missing): a result
/// is stored under them only if they are still current
/// ([`CitationStore::cache_store`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Generations {
    all: Option<u64>,
    tenant: Option<u64>,
}

/// What [`CitationStore::cache_store`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The result is kept.
    Kept,
    /// A purge (or another store that set a missing generation) came
    /// since the lookup: nothing kept, the result may predate the purge.
    Purged,
    /// The entry would be over [`MAX_ENTRY_BYTES`]: nothing kept.
    TooLarge,
}

/// What [`CitationStore::cache_purge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// The new generation.
    pub generation: u64,
    /// Whether the generation key was there: when not, nothing is known
    /// to be cached under it (no result of the tool — of the tenant, with
    /// one — was stored for longer than any entry lives, or ever).
    pub known: bool,
}

pub use toolfleet_protocol::canonical::canonical_json;

fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest
        .as_ref()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

impl CitationStore {
    /// `<p>:{tc:<tool>}:<part>`: one hash tag per tool.
    fn cache_key(&self, tool: &str, part: &str) -> String {
        format!("{}:{{tc:{tool}}}:{part}", self.prefix)
    }

    /// The generation keys of `key` (all tenants, then its tenant's; a
    /// global entry counts the first twice) and its entry's key.
    fn cache_keys(&self, key: &CacheKey) -> [String; 3] {
        let all = self.cache_key(&key.tool, "gen");
        let (tenant_gen, entry) = match &key.tenant {
            Some(t) => (
                self.cache_key(&key.tool, &format!("gen:{t}")),
                format!("e:{}:{t}:{}", key.scope.as_str(), key.digest),
            ),
            None => (all.clone(), format!("e:global:{}", key.digest)),
        };
        [all, tenant_gen, self.cache_key(&key.tool, &entry)]
    }

    /// The stored result of `key`'s call, if one under the current
    /// generations is there; one `MGET`, tried once within
    /// [`LOOKUP_TIMEOUT`]. A lookup that fails opens the breaker.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Unavailable`] when Redis does not answer in time or
    /// the breaker is open (the caller runs the call as if nothing were
    /// stored), else as every operation. An unreadable entry is a miss,
    /// not an error.
    pub async fn cache_lookup(&self, key: &CacheKey) -> Result<Lookup, CitationError> {
        self.breaker_closed("cache_lookup")?;
        let keys = self.cache_keys(key);
        let looked = self
            .once("cache_lookup", LOOKUP_TIMEOUT, |mut conn| {
                let keys = &keys;
                async move { redis::cmd("MGET").arg(keys).query_async(&mut conn).await }
            })
            .await;
        if looked.is_err() {
            self.cache_breaker.open();
        }
        let (all, tenant, entry): (Option<u64>, Option<u64>, Option<String>) = looked?;
        let now = Generations { all, tenant };
        let stored = entry.and_then(|s| serde_json::from_str::<Value>(&s).ok());
        let hit = stored.and_then(|v| {
            let gens = v.get("gens")?.as_array()?;
            // A missing generation is unknown: nothing matches it.
            let current = now.all.is_some()
                && now.tenant.is_some()
                && gens.first()?.as_u64() == now.all
                && gens.get(1)?.as_u64() == now.tenant;
            current
                .then(|| serde_json::from_value::<ToolResult>(v.get("result")?.clone()).ok())
                .flatten()
        });
        Ok(match hit {
            Some(result) => Lookup::Hit(Box::new(result)),
            None => Lookup::Miss(now),
        })
    }

    /// Stores `result` as `key`'s for `ttl`, unless a purge came after
    /// the lookup that read `gens` ([`Stored::Purged`]) or it is too large
    /// ([`Stored::TooLarge`]). Tried once within [`STORE_TIMEOUT`].
    ///
    /// # Errors
    ///
    /// As [`CitationStore::cache_lookup`].
    pub async fn cache_store(
        &self,
        key: &CacheKey,
        gens: Generations,
        result: &ToolResult,
        ttl: Duration,
    ) -> Result<Stored, CitationError> {
        self.breaker_closed("cache_store")?;
        let result = serde_json::to_string(result)
            .map_err(|e| CitationError::new(ErrorKind::Invalid, format!("cache_store: {e}")))?;
        // The generations and the JSON around the result: at most 64
        // bytes.
        if result.len() + 64 > MAX_ENTRY_BYTES {
            return Ok(Stored::TooLarge);
        }
        let generation = |g: Option<u64>| g.map(|g| g.to_string()).unwrap_or_default();
        let mut script = STORE_SCRIPT.prepare_invoke();
        for k in self.cache_keys(key) {
            script.key(k);
        }
        script
            .arg(generation(gens.all))
            .arg(generation(gens.tenant))
            .arg(result)
            .arg(
                u64::try_from(ttl.as_millis())
                    .unwrap_or(MAX_CACHE_TTL_MS)
                    .max(1),
            )
            .arg(u64::try_from(GENERATION_TTL.as_millis()).unwrap_or(u64::MAX))
            .arg(fresh_generation())
            .arg(fresh_generation());
        let script = &script;
        let stored: i64 = self
            .once("cache_store", STORE_TIMEOUT, |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await?;
        Ok(if stored == 1 {
            Stored::Kept
        } else {
            Stored::Purged
        })
    }

    /// Purges `tool`'s cached results (`ns:name`: every version): of
    /// `tenant` only (its tenant- and user-scoped entries; global ones
    /// stay), or of everyone. Safe to repeat (a second purge purges
    /// nothing more).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Invalid`] for a tool that is not `ns:name` or a
    /// tenant outside the contract's characters; else as every operation.
    pub async fn cache_purge(
        &self,
        tool: &str,
        tenant: Option<&str>,
    ) -> Result<Purged, CitationError> {
        let Some((ns, name)) = tool.split_once(':') else {
            return Err(CitationError::new(
                ErrorKind::Invalid,
                format!("tool {tool:?} is not namespace:name"),
            ));
        };
        ToolId::new(ns, name, (0, 0, 0))
            .map_err(|e| CitationError::new(ErrorKind::Invalid, format!("tool {tool:?}: {e}")))?;
        let key = match tenant {
            Some(t) if toolfleet_protocol::valid_tenant(t) => {
                self.cache_key(tool, &format!("gen:{t}"))
            }
            Some(t) => {
                return Err(CitationError::new(
                    ErrorKind::Invalid,
                    format!("tenant {t:?} is not 1-64 of [A-Za-z0-9_-]"),
                ));
            }
            None => self.cache_key(tool, "gen"),
        };
        let mut script = PURGE_SCRIPT.prepare_invoke();
        script
            .key(key)
            .arg(u64::try_from(GENERATION_TTL.as_millis()).unwrap_or(u64::MAX))
            .arg(fresh_generation());
        let script = &script;
        let (generation, known): (u64, i64) = self
            .run("cache_purge", |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await?;
        Ok(Purged {
            generation,
            known: known == 1,
        })
    }

    /// An [`ErrorKind::Unavailable`] error, without asking Redis, while
    /// the breaker is open.
    fn breaker_closed(&self, what: &str) -> Result<(), CitationError> {
        if self.cache_breaker.is_open() {
            return Err(CitationError::new(
                ErrorKind::Unavailable,
                format!("{what}: passed by (a lookup failed within the last {BREAKER_OPEN_FOR:?})"),
            ));
        }
        Ok(())
    }

    /// Runs `op` once, within `limit`: the cache is worth no retries (a
    /// miss costs one tool call).
    async fn once<T, F, Fut>(
        &self,
        what: &'static str,
        limit: Duration,
        op: F,
    ) -> Result<T, CitationError>
    where
        F: FnOnce(crate::Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match tokio::time::timeout(limit, op(self.conn.clone())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let mut error = CitationError::from(e);
                error.message = format!("{what}: {}", self.secrets.redact(&error.message));
                Err(error)
            }
            Err(_) => Err(CitationError::new(
                ErrorKind::Unavailable,
                format!("{what}: no answer within {limit:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> ToolId {
        text.parse().unwrap()
    }

    fn acme() -> CallScope<'static> {
        CallScope {
            tenant: "acme",
            ..CallScope::default()
        }
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a = json!({"b": 1, "a": {"z": [3, {"y": true, "x": null}], "c": "é\""}, "n": 1.5});
        let b: Value =
            serde_json::from_str(r#"{"n":1.5,"a":{"c":"é\"","z":[3,{"x":null,"y":true}]},"b":1}"#)
                .unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":"é\"","z":[3,{"x":null,"y":true}]},"b":1,"n":1.5}"#
        );
        // Array order is meaning: kept.
        assert_ne!(
            canonical_json(&json!([1, 2])),
            canonical_json(&json!([2, 1]))
        );
        // Numbers as serde_json prints them: 1 and 1.0 are two calls.
        assert_ne!(canonical_json(&json!(1)), canonical_json(&json!(1.0)));
    }

    #[test]
    fn keys_follow_tool_version_arguments_and_scope() {
        let tool = id("units:convert@1.0.0");
        let key = |tool: &ToolId, scope, args: Value, call: &CallScope<'_>| {
            CacheKey::new(tool, scope, &args, call).unwrap()
        };
        let base = key(&tool, CacheScope::Tenant, json!({"a": 1, "b": 2}), &acme());
        assert_eq!(base.digest().len(), 64);
        assert_eq!(
            base,
            key(&tool, CacheScope::Tenant, json!({"b": 2, "a": 1}), &acme()),
            "key order does not matter"
        );
        assert_ne!(
            base,
            key(&tool, CacheScope::Tenant, json!({"a": 1, "b": 3}), &acme())
        );
        assert_ne!(
            base,
            key(
                &id("units:convert@1.0.1"),
                CacheScope::Tenant,
                json!({"a": 1, "b": 2}),
                &acme()
            ),
            "another version is another call"
        );
        let globex = CallScope {
            tenant: "globex",
            ..CallScope::default()
        };
        assert_ne!(
            base,
            key(&tool, CacheScope::Tenant, json!({"a": 1, "b": 2}), &globex)
        );
        let sourced = CallScope {
            data_source_id: Some("handbook"),
            ..acme()
        };
        assert_ne!(
            base,
            key(&tool, CacheScope::Tenant, json!({"a": 1, "b": 2}), &sourced)
        );
        // Global: one entry for every tenant.
        assert_eq!(
            key(&tool, CacheScope::Global, json!({"a": 1}), &acme()),
            key(&tool, CacheScope::Global, json!({"a": 1}), &globex)
        );
    }

    #[test]
    fn a_global_call_naming_its_tenants_things_is_the_tenants() {
        let tool = id("units:convert@1.0.0");
        let args = json!({"a": 1});
        let docs = ["d1".to_owned()];
        for (tenant, named) in [
            (
                "acme",
                CallScope {
                    resource: Some("page-7"),
                    ..acme()
                },
            ),
            (
                "acme",
                CallScope {
                    data_source_id: Some("hr"),
                    ..acme()
                },
            ),
            (
                "acme",
                CallScope {
                    attached_documents: &docs,
                    ..acme()
                },
            ),
            (
                "globex",
                CallScope {
                    tenant: "globex",
                    resource: Some("page-7"),
                    ..acme()
                },
            ),
        ] {
            let key = CacheKey::new(&tool, CacheScope::Global, &args, &named).unwrap();
            assert_eq!(key.scope(), CacheScope::Tenant, "{named:?}");
            assert_eq!(key.tenant.as_deref(), Some(tenant));
        }
        let acme_page = CallScope {
            resource: Some("page-7"),
            ..acme()
        };
        let globex_page = CallScope {
            tenant: "globex",
            ..acme_page
        };
        assert_ne!(
            CacheKey::new(&tool, CacheScope::Global, &args, &acme_page),
            CacheKey::new(&tool, CacheScope::Global, &args, &globex_page),
            "the same resource of two tenants is two calls"
        );
        // Empty names name nothing: still global.
        let empty = CallScope {
            resource: Some(""),
            data_source_id: Some(""),
            ..acme()
        };
        let key = CacheKey::new(&tool, CacheScope::Global, &args, &empty).unwrap();
        assert_eq!(key.scope(), CacheScope::Global);
        assert_eq!(key.tenant, None);
    }

    #[test]
    fn other_settings_are_another_call() {
        let tool = id("units:convert@1.0.0");
        let args = json!({"a": 1});
        let old = json!({"units": "metric", "region": "eu"});
        let reordered = json!({"region": "eu", "units": "metric"});
        let new = json!({"units": "imperial", "region": "eu"});
        let with = |settings| CallScope { settings, ..acme() };
        let key = |settings| CacheKey::new(&tool, CacheScope::Tenant, &args, &with(settings));
        assert_eq!(
            key(Some(&old)),
            key(Some(&reordered)),
            "key order does not matter"
        );
        assert_ne!(key(Some(&old)), key(Some(&new)));
        assert_ne!(key(Some(&old)), key(None));
    }

    #[test]
    fn user_scope_needs_a_user_and_keys_each_apart() {
        let tool = id("units:convert@1.0.0");
        let args = json!({"a": 1});
        assert_eq!(CacheKey::new(&tool, CacheScope::User, &args, &acme()), None);
        let user = |u| CallScope {
            user: Some(u),
            ..acme()
        };
        assert_eq!(
            CacheKey::new(&tool, CacheScope::User, &args, &user("")),
            None
        );
        let ann = CacheKey::new(&tool, CacheScope::User, &args, &user("ann")).unwrap();
        let bob = CacheKey::new(&tool, CacheScope::User, &args, &user("bob")).unwrap();
        assert_ne!(ann, bob);
        // A tenant-scoped call ignores the user.
        assert_eq!(
            CacheKey::new(&tool, CacheScope::Tenant, &args, &user("ann")),
            CacheKey::new(&tool, CacheScope::Tenant, &args, &user("bob"))
        );
    }
}
