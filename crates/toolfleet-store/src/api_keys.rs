//! The API keys of the OpenAI-compatible gateway (`toolfleet gateway`):
//! who a bearer key is (its tenant, optionally its user and the profiles
//! it may use), stored by the key's SHA-256 and never the key itself.
//!
//! Keys, all under one hash tag (`{apikeys}`), so a cluster keeps them in
//! one slot and a key and its index entry move together:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{apikeys}:hash:<sha256 hex>` | hash, TTL the key's expiry | the key's [`ApiKeyRecord`] |
//! | `<p>:{apikeys}:index` | hash (id → the record's key), TTL the longest key's | every key by id, for listing and revoking |
//!
//! The gateway looks a key up by its hash on every request ([`CitationStore::api_key`]):
//! a revoked key ([`CitationStore::revoke_api_key`] deletes its hash) is
//! refused from the next request on, with no cache in between. The caller
//! hashes the key; nothing here sees a key, so no error or log can show
//! one.

use std::collections::HashMap;
use std::time::Duration;

use crate::{CitationError, CitationStore, ErrorKind};

/// What a gateway API key stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyRecord {
    /// The key's public id (`key_<hex>`): what `toolfleet keys ls` shows
    /// and `toolfleet keys revoke` takes.
    pub id: String,
    /// The tenant every request of the key runs as.
    pub tenant: String,
    /// The user its jobs name, when the key is a user's.
    pub user: Option<String>,
    /// The profiles (models) it may use; empty: every profile its tenant
    /// may use.
    pub profiles: Vec<String>,
    /// A label for people.
    pub name: Option<String>,
    /// The key's first characters (`tf_AbCd`), so a person can tell keys
    /// apart; never enough to use.
    pub hint: String,
    /// When it was made, unix ms.
    pub created_ms: u64,
    /// When it stops working, unix ms (the hash key's TTL ends then too).
    pub expires_ms: u64,
}

impl ApiKeyRecord {
    fn to_fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("id", self.id.clone()),
            ("tenant", self.tenant.clone()),
            ("user", self.user.clone().unwrap_or_default()),
            ("profiles", self.profiles.join(",")),
            ("name", self.name.clone().unwrap_or_default()),
            ("hint", self.hint.clone()),
            ("created_ms", self.created_ms.to_string()),
            ("expires_ms", self.expires_ms.to_string()),
        ]
    }

    fn from_fields(mut f: HashMap<String, String>) -> Option<Self> {
        let mut take = |name: &str| f.remove(name).unwrap_or_default();
        let some = |s: String| (!s.is_empty()).then_some(s);
        let record = Self {
            id: take("id"),
            tenant: take("tenant"),
            user: some(take("user")),
            profiles: take("profiles")
                .split(',')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect(),
            name: some(take("name")),
            hint: take("hint"),
            created_ms: take("created_ms").parse().ok()?,
            expires_ms: take("expires_ms").parse().ok()?,
        };
        (!record.id.is_empty() && !record.tenant.is_empty()).then_some(record)
    }
}

/// Writes a key's record (`ARGV[1]` its TTL in ms, then field, value
/// pairs, the first being `id`) and its index entry (the id → the
/// record's key); the index lives as long as its longest-lived key.
const ADD: &str = r"
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], KEYS[1])
local ttl = redis.call('PTTL', KEYS[2])
if ttl < tonumber(ARGV[1]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
";

/// Deletes a key's record and its index entry, if the index still names
/// that record.
const REVOKE: &str = r"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= KEYS[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
";

impl CitationStore {
    /// The key layout of API keys: `<p>:{apikeys}:<part>`.
    fn api_key_key(&self, part: &str) -> String {
        format!("{}:{{apikeys}}:{part}", self.prefix)
    }

    /// Stores `record` under `key_sha256` (the key's SHA-256, lowercase
    /// hex) until its `expires_ms`. Safe to repeat.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Invalid`] for a hash that is not 64 hex digits or a
    /// record already expired; otherwise as every store operation.
    pub async fn add_api_key(
        &self,
        key_sha256: &str,
        record: &ApiKeyRecord,
    ) -> Result<(), CitationError> {
        check_hash(key_sha256)?;
        let ttl = record
            .expires_ms
            .saturating_sub(toolfleet_protocol::now_ms());
        if ttl == 0 {
            return Err(CitationError::new(
                ErrorKind::Invalid,
                "the API key would be expired already",
            ));
        }
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(ADD));
        let mut add = SCRIPT.prepare_invoke();
        add.key(self.api_key_key(&format!("hash:{key_sha256}")))
            .key(self.api_key_key("index"))
            .arg(ttl);
        for (field, value) in record.to_fields() {
            add.arg(field).arg(value);
        }
        let add = &add;
        self.run("add_api_key", |mut conn| async move {
            add.invoke_async::<i64>(&mut conn).await
        })
        .await
        .map(drop)
    }

    /// The record of the key whose SHA-256 is `key_sha256`; `None` when no
    /// such key is stored (never made, revoked or expired).
    ///
    /// # Errors
    ///
    /// As every store operation (a hash of the wrong shape is simply not
    /// found).
    pub async fn api_key(&self, key_sha256: &str) -> Result<Option<ApiKeyRecord>, CitationError> {
        if check_hash(key_sha256).is_err() {
            return Ok(None);
        }
        let key = &self.api_key_key(&format!("hash:{key_sha256}"));
        let fields: HashMap<String, String> = self
            .run("api_key", |mut conn| async move {
                redis::cmd("HGETALL").arg(key).query_async(&mut conn).await
            })
            .await?;
        Ok(ApiKeyRecord::from_fields(fields)
            .filter(|r| r.expires_ms > toolfleet_protocol::now_ms()))
    }

    /// Every stored key, by id; expired entries are left out (and dropped
    /// from the index).
    ///
    /// # Errors
    ///
    /// As every store operation.
    pub async fn api_keys(&self) -> Result<Vec<ApiKeyRecord>, CitationError> {
        let index = &self.api_key_key("index");
        let ids: HashMap<String, String> = self
            .run("api_keys", |mut conn| async move {
                redis::cmd("HGETALL")
                    .arg(index)
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        let mut out = Vec::new();
        for (id, hash_key) in ids {
            let key = &hash_key;
            let fields: HashMap<String, String> = self
                .run("api_keys", |mut conn| async move {
                    redis::cmd("HGETALL").arg(key).query_async(&mut conn).await
                })
                .await?;
            match ApiKeyRecord::from_fields(fields) {
                Some(r) => out.push(r),
                None => {
                    let id = &id;
                    self.run("api_keys", |mut conn| async move {
                        redis::cmd("HDEL")
                            .arg(index)
                            .arg(id)
                            .query_async::<i64>(&mut conn)
                            .await
                    })
                    .await?;
                }
            }
        }
        out.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        Ok(out)
    }

    /// Revokes the key `id`: it is refused from the next request on.
    /// `false` when no key has that id. Safe to repeat.
    ///
    /// # Errors
    ///
    /// As every store operation.
    pub async fn revoke_api_key(&self, id: &str) -> Result<bool, CitationError> {
        let index = &self.api_key_key("index");
        let hash_key: Option<String> = self
            .run("revoke_api_key", |mut conn| async move {
                redis::cmd("HGET")
                    .arg(index)
                    .arg(id)
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        let Some(hash_key) = hash_key else {
            return Ok(false);
        };
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(REVOKE));
        let mut revoke = SCRIPT.prepare_invoke();
        revoke.key(&hash_key).key(index).arg(id);
        let revoke = &revoke;
        let done: i64 = self
            .run("revoke_api_key", |mut conn| async move {
                revoke.invoke_async(&mut conn).await
            })
            .await?;
        Ok(done == 1)
    }
}

/// A key hash is 64 lowercase hex digits: anything else would let a
/// caller's text shape a Redis key.
fn check_hash(h: &str) -> Result<(), CitationError> {
    if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(CitationError::new(
            ErrorKind::Invalid,
            "an API key hash is 64 lowercase hex digits",
        ))
    }
}

/// How long a key lives when its maker says nothing: a year.
pub const DEFAULT_API_KEY_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_its_fields() {
        let r = ApiKeyRecord {
            id: "key_0123".into(),
            tenant: "acme".into(),
            user: Some("ann".into()),
            profiles: vec!["a".into(), "b".into()],
            name: None,
            hint: "tf_AbCd".into(),
            created_ms: 1,
            expires_ms: 2,
        };
        let fields = r
            .to_fields()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(ApiKeyRecord::from_fields(fields), Some(r));
        assert_eq!(ApiKeyRecord::from_fields(HashMap::new()), None);
    }

    #[test]
    fn only_a_sha256_in_hex_is_a_key_hash() {
        assert!(check_hash(&"a".repeat(64)).is_ok());
        for bad in ["", "A".repeat(64).as_str(), "a".repeat(63).as_str(), "x:*"] {
            assert!(check_hash(bad).is_err(), "{bad}");
        }
    }
}
