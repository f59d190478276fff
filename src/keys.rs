//! `toolfleet keys add|ls|revoke`: the API keys of the OpenAI-compatible
//! gateway ([`crate::gateway`]), and what the gateway shares with them:
//! the shape of a key and its hash.
//!
//! A key is `tf_` and 32 random bytes in unpadded base64url. The store
//! keeps only its SHA-256 (`toolfleet_store::api_keys`, in Redis under the
//! fleet's prefix) with its tenant, user, profiles and expiry; `add`
//! prints the key once and nothing prints it again: `ls` shows an id and
//! the key's first characters, `revoke` takes the id.

use anyhow::Context;
use base64::Engine;
use clap::{Args, Subcommand};
use toolfleet_store::CitationStore;
use toolfleet_store::api_keys::{ApiKeyRecord, DEFAULT_API_KEY_LIFETIME};

use crate::common::Output;

/// What every key starts with.
pub const KEY_PREFIX: &str = "tf_";

/// The characters of a key after [`KEY_PREFIX`]: 32 bytes in unpadded
/// base64url.
const KEY_BODY_CHARS: usize = 43;

/// How many characters of a key `ls` shows.
const HINT_CHARS: usize = 7;

/// A new key: `tf_` and 32 random bytes (unpadded base64url).
///
/// # Errors
///
/// When the system's random source fails.
pub fn generate() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| anyhow::anyhow!("the system's random source failed"))?;
    Ok(format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    ))
}

/// Whether `text` has a key's shape (checked before any lookup).
pub fn looks_like_key(text: &str) -> bool {
    text.strip_prefix(KEY_PREFIX).is_some_and(|body| {
        body.len() == KEY_BODY_CHARS
            && body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// The key's SHA-256 in lowercase hex: what the store keeps and looks up.
pub fn sha256_hex(key: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A new key id: `key_` and 12 random hex digits.
fn new_id() -> anyhow::Result<String> {
    let mut bytes = [0u8; 6];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| anyhow::anyhow!("the system's random source failed"))?;
    Ok(format!(
        "key_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

/// The store the keys live in: the fleet's Redis under its prefix.
#[derive(Args, Debug)]
pub struct StoreArgs {
    /// The fleet's prefix (the store's keys start with it).
    #[arg(long = "subject-prefix", env = toolfleet_service::args::ENV_SUBJECT_PREFIX, default_value = toolfleet_protocol::DEFAULT_PREFIX)]
    pub prefix: String,
    #[command(flatten)]
    pub redis: toolfleet_store::RedisOptions,
}

impl StoreArgs {
    /// The store, connected (also `toolfleet cache`'s).
    pub(crate) async fn connect(&self) -> anyhow::Result<CitationStore> {
        toolfleet_protocol::Subjects::new(&self.prefix)?;
        CitationStore::connect_with(&self.redis, &self.prefix, self.redis.ttl)
            .await
            .with_context(|| format!("connecting to Redis at {}", self.redis.redacted_url()))
    }
}

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Make a key for the gateway and print it once (it is stored hashed
    /// and cannot be shown again).
    Add {
        /// The tenant every request of the key runs as.
        #[arg(long)]
        tenant: String,
        /// The user its jobs name (tools see it only for a tenant with
        /// `trust_user = true`).
        #[arg(long)]
        user: Option<String>,
        /// The profiles (models) it may use, comma-separated; without it,
        /// every profile its tenant may use.
        #[arg(long, value_delimiter = ',')]
        profiles: Vec<String>,
        /// A label for people (`keys ls` shows it).
        #[arg(long)]
        name: Option<String>,
        /// Days until the key stops working.
        #[arg(long, default_value_t = DEFAULT_API_KEY_LIFETIME.as_secs() / 86_400,
              value_parser = clap::value_parser!(u64).range(1..=3650))]
        expires_days: u64,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List the keys (id, tenant, user, profiles, name, first characters,
    /// expiry), never a key or its hash.
    Ls {
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Revoke a key by its id (from `keys ls`): refused from the gateway's
    /// next request on. Exit 1 when no key has that id.
    Revoke {
        /// The key's id (`key_…`).
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// `toolfleet keys`: exit 0 when done, 1 for an unknown id, 64 for a bad
/// tenant, user or profile name.
pub async fn run(command: KeysCommand) -> anyhow::Result<i32> {
    match command {
        KeysCommand::Add {
            tenant,
            user,
            profiles,
            name,
            expires_days,
            output,
            store,
        } => {
            let Some(record) = new_record(tenant, user, profiles, name, expires_days)? else {
                return Ok(toolfleet_service::args::EXIT_CONFIG);
            };
            add(&store.connect().await?, record, output).await
        }
        KeysCommand::Ls {
            tenant,
            output,
            store,
        } => ls(&store.connect().await?, tenant.as_deref(), output).await,
        KeysCommand::Revoke { id, store } => {
            if store.connect().await?.revoke_api_key(&id).await? {
                eprintln!("toolfleet keys revoke: {id} revoked");
                Ok(0)
            } else {
                eprintln!("toolfleet keys revoke: no key {id}");
                Ok(1)
            }
        }
    }
}

/// The record of a new key (its hint filled in by [`add`]), or `None`
/// after saying on stderr what is wrong with the flags.
fn new_record(
    tenant: String,
    user: Option<String>,
    profiles: Vec<String>,
    name: Option<String>,
    expires_days: u64,
) -> anyhow::Result<Option<ApiKeyRecord>> {
    if !crate::common::tenant_ok("toolfleet keys add", &tenant) {
        return Ok(None);
    }
    let printable = |s: &str| !s.is_empty() && s.len() <= 256 && !s.chars().any(char::is_control);
    if let Some(u) = user.as_deref().filter(|u| !printable(u)) {
        eprintln!("toolfleet keys add: --user {u:?} is not 1-256 printable characters");
        return Ok(None);
    }
    if let Some(p) = profiles.iter().find(|p| !printable(p) || p.contains(',')) {
        eprintln!("toolfleet keys add: --profiles {p:?} is not a profile name");
        return Ok(None);
    }
    let now = toolfleet_protocol::now_ms();
    Ok(Some(ApiKeyRecord {
        id: new_id()?,
        tenant,
        user,
        profiles,
        name: name.map(|n| crate::common::one_line(&n, 120)),
        hint: String::new(),
        created_ms: now,
        expires_ms: now + expires_days * 86_400_000,
    }))
}

async fn add(
    store: &CitationStore,
    mut record: ApiKeyRecord,
    output: Output,
) -> anyhow::Result<i32> {
    let key = generate()?;
    record.hint = key.chars().take(HINT_CHARS).collect();
    store.add_api_key(&sha256_hex(&key), &record).await?;
    match output {
        Output::Json => println!(
            "{}",
            serde_json::json!({ "key": key, "record": json_of(&record) })
        ),
        Output::Text => {
            println!("{key}");
            eprintln!(
                "toolfleet keys add: {} for tenant {}{}; expires {}. The key is shown this once: store it now.",
                record.id,
                record.tenant,
                record
                    .user
                    .as_deref()
                    .map(|u| format!(", user {u}"))
                    .unwrap_or_default(),
                date(record.expires_ms),
            );
        }
    }
    Ok(0)
}

async fn ls(store: &CitationStore, tenant: Option<&str>, output: Output) -> anyhow::Result<i32> {
    let keys: Vec<ApiKeyRecord> = store
        .api_keys()
        .await?
        .into_iter()
        .filter(|r| tenant.is_none_or(|t| r.tenant == t))
        .collect();
    match output {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(keys.iter().map(json_of).collect())
        ),
        Output::Text => {
            println!(
                "{:<16} {:<16} {:<16} {:<24} {:<10} {:<10} NAME",
                "ID", "TENANT", "USER", "PROFILES", "KEY", "EXPIRES"
            );
            for r in &keys {
                println!(
                    "{:<16} {:<16} {:<16} {:<24} {:<10} {:<10} {}",
                    r.id,
                    r.tenant,
                    r.user.as_deref().unwrap_or("-"),
                    if r.profiles.is_empty() {
                        "(all of the tenant's)".to_string()
                    } else {
                        r.profiles.join(",")
                    },
                    format!("{}…", r.hint),
                    date(r.expires_ms),
                    r.name.as_deref().unwrap_or(""),
                );
            }
        }
    }
    Ok(0)
}

/// A record as `-o json` prints it: no key, no hash.
fn json_of(r: &ApiKeyRecord) -> serde_json::Value {
    serde_json::json!({
        "id": r.id,
        "tenant": r.tenant,
        "user": r.user,
        "profiles": r.profiles,
        "name": r.name,
        "hint": r.hint,
        "createdMs": r.created_ms,
        "expiresMs": r.expires_ms,
    })
}

/// Unix ms as a UTC date (`2026-01-31`).
fn date(ms: u64) -> String {
    let secs = i64::try_from(ms / 1000).unwrap_or(i64::MAX);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .map(|t| t.date().to_string())
        .unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_has_its_shape_and_a_stable_hash() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        assert_ne!(a, b);
        assert!(looks_like_key(&a), "{a}");
        assert_eq!(a.len(), KEY_PREFIX.len() + KEY_BODY_CHARS);
        for bad in ["", "tf_", "sk-abc", &a[..a.len() - 1], &format!("{a}x")] {
            assert!(!looks_like_key(bad), "{bad}");
        }
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(sha256_hex(&a), sha256_hex(&a.clone()));
        assert!(new_id().unwrap().starts_with("key_"));
    }
}
