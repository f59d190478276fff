//! The tool-result cache: `ok` results of tools whose definition has a
//! `cache` ([`toolfleet_protocol::tools::ToolCache`]), kept for the
//! definition's TTL and given again to a call with the same tool version,
//! the same arguments (in any key order), the same context a tool may read
//! (data source, attached documents, resource) and the same scope.
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
//! kept. The generation keys outlive every entry that names them (each
//! store renews them for longer than any entry lives), so a generation
//! never starts again from zero under a live entry.
//!
//! The digest is SHA-256 of the canonical JSON ([`canonical_json`]: keys
//! sorted at every depth, numbers as `serde_json` prints them) of the tool
//! id with its version, the arguments, the context and, for scope `user`,
//! the user. Tenant and user are the ones the fleet decided, never a
//! job's claim.
//!
//! A lookup is tried once, within [`LOOKUP_TIMEOUT`]: a cache that does
//! not answer is a miss for the caller, never a wait or an error of the
//! call.

use std::sync::LazyLock;
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::ToolResult;
use toolfleet_protocol::tools::{CacheScope, MAX_CACHE_TTL_MS, ToolId};

use crate::{CitationError, CitationStore, ErrorKind};

/// How long a generation key lives after the last store that named it:
/// longer than any entry ([`MAX_CACHE_TTL_MS`]) plus a day.
pub const GENERATION_TTL: Duration = Duration::from_millis(MAX_CACHE_TTL_MS + 86_400_000);

/// How long a lookup or a store may take before the cache is passed by.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_millis(500);

/// Writes an entry only while the generations are the ones the lookup
/// read; renews the generation keys so they outlive the entry.
const STORE: &str = r"
local function num(k) return tonumber(redis.call('GET', k) or '0') or 0 end
if num(KEYS[1]) ~= tonumber(ARGV[1]) or num(KEYS[2]) ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
for i = 1, 2 do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
return 1
";

/// Adds one to a generation and sets its TTL; the new generation.
const PURGE: &str = r"
local g = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return g
";

/// [`STORE`] and [`PURGE`], their digests computed once.
static STORE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(STORE));
static PURGE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(PURGE));

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
}

impl CacheKey {
    /// The key of a call of `tool` with `arguments` in `call`'s scope;
    /// `None` for scope `user` without an authenticated user (such a call
    /// is not cached).
    #[must_use]
    pub fn new(
        tool: &ToolId,
        scope: CacheScope,
        arguments: &Value,
        call: &CallScope<'_>,
    ) -> Option<Self> {
        let user = match scope {
            CacheScope::User => Some(call.user.filter(|u| !u.is_empty())?),
            CacheScope::Tenant | CacheScope::Global => None,
        };
        let canonical = canonical_json(&json!({
            "tool": tool.to_string(),
            "arguments": arguments,
            "user": user,
            "dataSourceId": call.data_source_id,
            "attachedDocuments": call.attached_documents,
            "resource": call.resource,
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

/// The generations a lookup read: a result is stored under them only if
/// they are still current ([`CitationStore::cache_store`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Generations {
    all: u64,
    tenant: u64,
}

/// `value` as canonical JSON: object keys sorted at every depth, no
/// whitespace, strings escaped and numbers printed as `serde_json` does —
/// so `{"b":1,"a":2}` and `{"a":2,"b":1}` are one text.
#[must_use]
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

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
    /// [`LOOKUP_TIMEOUT`].
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Unavailable`] when Redis does not answer in time (the
    /// caller runs the call as if nothing were stored), else as every
    /// operation. An unreadable entry is a miss, not an error.
    pub async fn cache_lookup(&self, key: &CacheKey) -> Result<Lookup, CitationError> {
        let keys = self.cache_keys(key);
        let (all, tenant, entry): (Option<u64>, Option<u64>, Option<String>) = self
            .once("cache_lookup", |mut conn| {
                let keys = &keys;
                async move { redis::cmd("MGET").arg(keys).query_async(&mut conn).await }
            })
            .await?;
        let now = Generations {
            all: all.unwrap_or(0),
            tenant: tenant.unwrap_or(0),
        };
        let stored = entry.and_then(|s| serde_json::from_str::<Value>(&s).ok());
        let hit = stored.and_then(|v| {
            let gens = v.get("gens")?.as_array()?;
            let current =
                gens.first()?.as_u64()? == now.all && gens.get(1)?.as_u64()? == now.tenant;
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
    /// the lookup that read `gens` (then nothing is stored). Whether it
    /// was stored. Tried once within [`LOOKUP_TIMEOUT`].
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
    ) -> Result<bool, CitationError> {
        let value = json!({ "gens": [gens.all, gens.tenant], "result": result }).to_string();
        let mut script = STORE_SCRIPT.prepare_invoke();
        for k in self.cache_keys(key) {
            script.key(k);
        }
        script
            .arg(gens.all)
            .arg(gens.tenant)
            .arg(value)
            .arg(
                u64::try_from(ttl.as_millis())
                    .unwrap_or(MAX_CACHE_TTL_MS)
                    .max(1),
            )
            .arg(u64::try_from(GENERATION_TTL.as_millis()).unwrap_or(u64::MAX));
        let script = &script;
        let stored: i64 = self
            .once("cache_store", |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await?;
        Ok(stored == 1)
    }

    /// Purges `tool`'s cached results (`ns:name`: every version): of
    /// `tenant` only (its tenant- and user-scoped entries; global ones
    /// stay), or of everyone. The new generation. Safe to repeat (a
    /// second purge purges nothing more).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Invalid`] for a tool that is not `ns:name` or a
    /// tenant outside the contract's characters; else as every operation.
    pub async fn cache_purge(
        &self,
        tool: &str,
        tenant: Option<&str>,
    ) -> Result<u64, CitationError> {
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
            .arg(u64::try_from(GENERATION_TTL.as_millis()).unwrap_or(u64::MAX));
        let script = &script;
        self.run("cache_purge", |mut conn| async move {
            script.invoke_async(&mut conn).await
        })
        .await
    }

    /// Runs `op` once, within [`LOOKUP_TIMEOUT`]: the cache is worth no
    /// retries (a miss costs one tool call).
    async fn once<T, F, Fut>(&self, what: &'static str, op: F) -> Result<T, CitationError>
    where
        F: FnOnce(crate::Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match tokio::time::timeout(LOOKUP_TIMEOUT, op(self.conn.clone())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let mut error = CitationError::from(e);
                error.message = format!("{what}: {}", self.secrets.redact(&error.message));
                Err(error)
            }
            Err(_) => Err(CitationError::new(
                ErrorKind::Unavailable,
                format!("{what}: no answer within {LOOKUP_TIMEOUT:?}"),
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
