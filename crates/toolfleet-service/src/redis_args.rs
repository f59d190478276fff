//! The Redis part of a binary's configuration: where the citation store
//! and result ledger live, how to authenticate and encrypt, and how long
//! transient errors are retried and an invocation's keys last.
//!
//! - One server: `--redis-url redis://host:6379`.
//! - Password or ACL user: in the URL, `redis://:PASSWORD@host:6379` or
//!   `redis://USER:PASSWORD@host:6379` (percent-encode `@`, `:` and `/`
//!   in them). The URL is a secret: it is hidden from `--help` and `Debug`.
//! - TLS: a `rediss://` URL; `--redis-tls-ca` replaces the system roots
//!   with your CA, `--redis-tls-cert` and `--redis-tls-key` (both or
//!   neither) present a client certificate to a server that asks for one
//!   (`tls-auth-clients yes`). Files are PEM.
//! - Redis Cluster: list several seed nodes, comma-separated, in
//!   `--redis-url` (`redis://n1:7000,redis://n2:7000,redis://n3:7000`), or
//!   give one seed node and `--redis-cluster`. The cluster client finds the
//!   other nodes and follows MOVED/ASK; every key of an invocation carries
//!   the same hash tag, so an invocation lives in one slot. Auth and TLS
//!   work the same way (every node URL carries the same credentials).
//! - Outages: every store operation retries transient errors (connection
//!   refused or reset, timeouts, LOADING, TRYAGAIN, CLUSTERDOWN, failover)
//!   with exponential backoff and jitter for `--redis-retry-budget-ms`,
//!   then fails as unavailable.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub const ENV_REDIS_URL: &str = "TOOLFLEET_REDIS_URL";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const ENV_REDIS_CLUSTER: &str = "TOOLFLEET_REDIS_CLUSTER";
pub const ENV_REDIS_TLS_CA: &str = "TOOLFLEET_REDIS_TLS_CA";
pub const ENV_REDIS_TLS_CERT: &str = "TOOLFLEET_REDIS_TLS_CERT";
pub const ENV_REDIS_TLS_KEY: &str = "TOOLFLEET_REDIS_TLS_KEY";
pub const ENV_REDIS_RETRY_BUDGET_MS: &str = "TOOLFLEET_REDIS_RETRY_BUDGET_MS";
pub const DEFAULT_REDIS_RETRY_BUDGET_MS: u64 = 3_000;

/// Where Redis is, how to reach it, and how long invocation keys live.
#[derive(Args, Clone)]
pub struct RedisArgs {
    /// Redis URL (the citation store and result ledger): `redis://` or
    /// `rediss://` (TLS), with `user:password@` for auth; several
    /// comma-separated node URLs for a Redis Cluster.
    #[arg(id = "redis_url", long = "redis-url", env = ENV_REDIS_URL, default_value = DEFAULT_REDIS_URL, hide_env_values = true)]
    pub url: String,
    /// Treat `--redis-url` as a seed node of a Redis Cluster (implied when
    /// it lists several nodes).
    #[arg(
        id = "redis_cluster",
        long = "redis-cluster",
        env = ENV_REDIS_CLUSTER,
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::SetTrue
    )]
    pub cluster: bool,
    /// PEM file of the CA that signed the Redis server's certificate
    /// (`rediss://` only; replaces the system roots).
    #[arg(id = "redis_tls_ca", long = "redis-tls-ca", env = ENV_REDIS_TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a server that authenticates clients.
    #[arg(id = "redis_tls_cert", long = "redis-tls-cert", env = ENV_REDIS_TLS_CERT, requires = "redis_tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--redis-tls-cert`.
    #[arg(id = "redis_tls_key", long = "redis-tls-key", env = ENV_REDIS_TLS_KEY, requires = "redis_tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// How long a store operation retries transient Redis errors before
    /// it fails as unavailable, in milliseconds.
    #[arg(
        id = "redis_retry_budget_ms",
        long = "redis-retry-budget-ms",
        env = ENV_REDIS_RETRY_BUDGET_MS,
        default_value_t = DEFAULT_REDIS_RETRY_BUDGET_MS
    )]
    pub retry_budget_ms: u64,
    /// Lifetime of an invocation's citation keys, in seconds.
    #[arg(
        long = "citation-ttl",
        env = "TOOLFLEET_CITATION_TTL",
        default_value_t = 86_400
    )]
    pub ttl_secs: u64,
}

impl RedisArgs {
    /// How long an invocation's keys live.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }

    /// How long transient Redis errors are retried.
    pub fn retry_budget(&self) -> Duration {
        Duration::from_millis(self.retry_budget_ms)
    }

    /// Checks `--redis-url` (each comma-separated node) without
    /// connecting: a URL with a host, scheme `redis` or `rediss` (or a
    /// `unix`/`redis+unix` socket path).
    ///
    /// # Errors
    ///
    /// [`crate::args::BadConfig`] naming the URL, its password hidden.
    pub fn check_url(&self) -> Result<(), crate::args::BadConfig> {
        for node in self.url.split(',').map(str::trim) {
            let bad = |why: &str| {
                crate::args::BadConfig(format!("bad Redis URL {}: {why}", redact(node)))
            };
            let parsed = url::Url::parse(node).map_err(|e| bad(&e.to_string()))?;
            match parsed.scheme() {
                "redis" | "rediss" if parsed.host_str().is_some_and(|h| !h.is_empty()) => {}
                "redis" | "rediss" => return Err(bad("it names no host")),
                "unix" | "redis+unix" => {}
                other => return Err(bad(&format!("the scheme is {other}, not redis or rediss"))),
            }
        }
        Ok(())
    }

    /// The URL with any password replaced, for logs.
    pub fn redacted_url(&self) -> String {
        self.url
            .split(',')
            .map(|node| redact(node.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            let s = u.to_string();
            s.replacen("://", "://***@", 1)
        }
        Ok(_) => url.to_string(),
        Err(_) => "<unparsable redis url>".to_string(),
    }
}

// By hand: the URL may carry a password.
impl std::fmt::Debug for RedisArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisArgs")
            .field("url", &self.redacted_url())
            .field("cluster", &self.cluster)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("retry_budget_ms", &self.retry_budget_ms)
            .field("ttl_secs", &self.ttl_secs)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        redis: RedisArgs,
    }

    #[test]
    fn flags_parse_and_debug_hides_the_password() {
        let cli = Cli::try_parse_from([
            "x",
            "--redis-url",
            "rediss://app:s3cret@a:7000,rediss://app:s3cret@b:7000",
            "--redis-tls-ca",
            "/etc/ca.pem",
            "--redis-tls-cert",
            "/etc/c.pem",
            "--redis-tls-key",
            "/etc/k.pem",
            "--redis-retry-budget-ms",
            "1500",
        ])
        .unwrap();
        assert_eq!(cli.redis.retry_budget(), Duration::from_millis(1500));
        assert_eq!(cli.redis.tls_ca, Some(PathBuf::from("/etc/ca.pem")));
        assert!(!cli.redis.cluster);
        let debug = format!("{cli:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("rediss://***@a:7000"), "{debug}");
        // A certificate without its key is refused.
        assert!(Cli::try_parse_from(["x", "--redis-tls-cert", "/c.pem"]).is_err());
        let cli = Cli::try_parse_from(["x", "--redis-cluster"]).unwrap();
        assert!(cli.redis.cluster);
        assert_eq!(cli.redis.retry_budget(), Duration::from_secs(3));
    }
}
