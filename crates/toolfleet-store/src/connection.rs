//! How the store reaches Redis: one server or a Redis Cluster, plain or
//! TLS, with credentials in the URL. Whatever the topology, commands go
//! through one `Conn`, so every store operation has one code path.
//!
//! [`RedisOptions`] is also the Redis part of every binary's command line
//! (with the `clap` feature): `--redis-*` flags and `TOOLFLEET_REDIS_*`
//! variables, parsed straight into the options the store connects with.
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
//!
//! Secrets (the password in the URL, the client key) are never printed:
//! [`RedisOptions`]'s `Debug` redacts the URL, and every error is passed
//! through `Secrets::redact` before it leaves the crate.

use std::path::PathBuf;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, TlsCertificates, Value};

use crate::{CitationError, ErrorKind};

pub const ENV_REDIS_URL: &str = "TOOLFLEET_REDIS_URL";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const ENV_REDIS_CLUSTER: &str = "TOOLFLEET_REDIS_CLUSTER";
pub const ENV_REDIS_TLS_CA: &str = "TOOLFLEET_REDIS_TLS_CA";
pub const ENV_REDIS_TLS_CERT: &str = "TOOLFLEET_REDIS_TLS_CERT";
pub const ENV_REDIS_TLS_KEY: &str = "TOOLFLEET_REDIS_TLS_KEY";
pub const ENV_REDIS_RETRY_BUDGET_MS: &str = "TOOLFLEET_REDIS_RETRY_BUDGET_MS";
pub const ENV_CITATION_TTL: &str = "TOOLFLEET_CITATION_TTL";

/// How long transient Redis errors are retried before an operation fails
/// as unavailable.
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(3);

/// How long one connection attempt may take (TCP, TLS handshake, AUTH).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one command may wait for its answer on a live connection.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Redis is, how to talk to it, and how long an invocation's keys
/// live.
///
/// `url` is one `redis://` or `rediss://` URL (`redis://user:pass@host:port/db`),
/// or several comma-separated node URLs of a Redis Cluster; `cluster`
/// forces cluster mode for a single seed node. The TLS files are PEM; the
/// CA replaces the system roots, the certificate and key (both or neither)
/// authenticate the client.
///
/// The field docs are the flags' `--help` (with the `clap` feature).
#[derive(Clone)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct RedisOptions {
    /// Redis URL (the citation store and result ledger): `redis://` or
    /// `rediss://` (TLS), with `user:password@` for auth; several
    /// comma-separated node URLs for a Redis Cluster.
    #[cfg_attr(feature = "clap", arg(id = "redis_url", long = "redis-url", env = ENV_REDIS_URL, default_value = DEFAULT_REDIS_URL, hide_env_values = true))]
    pub url: String,
    /// Treat `--redis-url` as a seed node of a Redis Cluster (implied when
    /// it lists several nodes).
    #[cfg_attr(feature = "clap", arg(
        id = "redis_cluster",
        long = "redis-cluster",
        env = ENV_REDIS_CLUSTER,
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::SetTrue
    ))]
    pub cluster: bool,
    /// PEM file of the CA that signed the Redis server's certificate
    /// (`rediss://` only; replaces the system roots).
    #[cfg_attr(feature = "clap", arg(id = "redis_tls_ca", long = "redis-tls-ca", env = ENV_REDIS_TLS_CA))]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a server that authenticates clients.
    #[cfg_attr(feature = "clap", arg(id = "redis_tls_cert", long = "redis-tls-cert", env = ENV_REDIS_TLS_CERT, requires = "redis_tls_key"))]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--redis-tls-cert`.
    #[cfg_attr(feature = "clap", arg(id = "redis_tls_key", long = "redis-tls-key", env = ENV_REDIS_TLS_KEY, requires = "redis_tls_cert"))]
    pub tls_key: Option<PathBuf>,
    /// How long a store operation retries transient Redis errors before
    /// it fails as unavailable, in milliseconds.
    // The default is `DEFAULT_RETRY_BUDGET` written out (a test holds them
    // equal): clap wants a string.
    #[cfg_attr(feature = "clap", arg(
        id = "redis_retry_budget_ms",
        long = "redis-retry-budget-ms",
        env = ENV_REDIS_RETRY_BUDGET_MS,
        default_value = "3000",
        value_parser = parse_millis
    ))]
    pub retry_budget: Duration,
    /// Lifetime of an invocation's citation keys, in seconds.
    // The default is `DEFAULT_TTL` written out (a test holds them equal);
    // the value name is the one `--help` has always shown.
    #[cfg_attr(feature = "clap", arg(
        id = "ttl_secs",
        value_name = "TTL_SECS",
        long = "citation-ttl",
        env = ENV_CITATION_TTL,
        default_value = "86400",
        value_parser = parse_secs
    ))]
    pub ttl: Duration,
}

#[cfg(feature = "clap")]
fn parse_millis(text: &str) -> Result<Duration, std::num::ParseIntError> {
    text.parse().map(Duration::from_millis)
}

#[cfg(feature = "clap")]
fn parse_secs(text: &str) -> Result<Duration, std::num::ParseIntError> {
    text.parse().map(Duration::from_secs)
}

/// A Redis URL that cannot be one, found before connecting: names the URL,
/// its password hidden.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad Redis URL {url}: {why}")]
pub struct BadUrl {
    /// The node URL, redacted.
    pub url: String,
    pub why: String,
}

impl RedisOptions {
    /// One server (or a cluster, when `url` lists several nodes), no TLS
    /// files, the default retry budget and key lifetime.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            retry_budget: DEFAULT_RETRY_BUDGET,
            ttl: crate::DEFAULT_TTL,
        }
    }

    /// The node URLs, trimmed, empty entries dropped.
    pub fn nodes(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// Cluster mode: asked for, or implied by several nodes.
    pub fn is_cluster(&self) -> bool {
        self.cluster || self.nodes().len() > 1
    }

    /// Checks the URL (each comma-separated node) without connecting: a
    /// URL with a host, scheme `redis` or `rediss` (or a `unix`/`redis+unix`
    /// socket path), so a binary can refuse a bad one at start.
    ///
    /// # Errors
    ///
    /// [`BadUrl`] naming the first bad node, its password hidden.
    pub fn check_url(&self) -> Result<(), BadUrl> {
        for node in self.url.split(',').map(str::trim) {
            let bad = |why: &str| BadUrl {
                url: redact_url(node),
                why: why.to_owned(),
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
        let nodes: Vec<String> = self.nodes().into_iter().map(redact_url).collect();
        nodes.join(",")
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &self.redacted_url())
            .field("cluster", &self.cluster)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("retry_budget", &self.retry_budget)
            .field("ttl", &self.ttl)
            .finish()
    }
}

pub use toolfleet_protocol::redact_url;

/// The secrets of a configuration, to scrub from any text that leaves the
/// crate (Redis and rustls errors should not carry them; this makes sure).
#[derive(Clone, Default)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    fn of(nodes: &[&str]) -> Self {
        let mut out = Vec::new();
        for node in nodes {
            if let Some((_, rest)) = node.split_once("://") {
                let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
                if let Some(at) = rest[..authority_end].rfind('@') {
                    let userinfo = &rest[..at];
                    if let Some((_, pass)) = userinfo.split_once(':') {
                        out.push(pass.to_string());
                    }
                }
            }
            if let Ok(info) = (*node).into_connection_info()
                && let Some(p) = info.redis_settings().password()
            {
                out.push(p.to_string());
            }
        }
        out.retain(|s| !s.is_empty());
        out.sort();
        out.dedup();
        Self(out)
    }

    pub(crate) fn redact(&self, text: &str) -> String {
        let mut text = text.to_string();
        for s in &self.0 {
            text = text.replace(s.as_str(), "***");
        }
        text
    }
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} redacted)", self.0.len())
    }
}

/// A connection to one server (reconnecting on its own) or to a cluster
/// (following MOVED/ASK and slot changes on its own). Cheap to clone.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A connection not made yet: everything checked and read from disk, so a
/// connection attempt (retried within the budget) only touches the network.
pub(crate) struct Connector {
    target: Target,
    pub(crate) secrets: Secrets,
}

enum Target {
    Single(Box<redis::Client>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

fn config_error(msg: impl Into<String>) -> CitationError {
    CitationError::new(ErrorKind::Config, msg)
}

impl Connector {
    /// Validates the options and reads the TLS files. Fails at once (a
    /// configuration error is not retried).
    pub(crate) fn new(options: &RedisOptions) -> Result<Self, CitationError> {
        let nodes = options.nodes();
        let secrets = Secrets::of(&nodes);
        if nodes.is_empty() {
            return Err(config_error("no Redis URL given"));
        }
        let mut tls = false;
        for node in &nodes {
            match node.split_once("://").map(|(s, _)| s) {
                Some("redis") => {}
                Some("rediss") => tls = true,
                _ => {
                    return Err(config_error(format!(
                        "Redis URL {} must start with redis:// or rediss://",
                        redact_url(node)
                    )));
                }
            }
        }
        if tls && nodes.iter().any(|n| n.starts_with("redis://")) {
            return Err(config_error(
                "Redis cluster nodes mix redis:// and rediss:// URLs",
            ));
        }
        let certs = tls_certificates(options)?;
        if certs.is_some() && !tls {
            return Err(config_error(
                "Redis TLS files are set but the URL is not rediss://",
            ));
        }
        if tls {
            install_crypto_provider();
        }
        let scrub = |e: redis::RedisError| {
            config_error(format!(
                "invalid Redis configuration: {}",
                secrets.redact(&e.to_string())
            ))
        };
        let target = if options.is_cluster() {
            let mut builder = ClusterClientBuilder::new(nodes.iter().copied())
                .connection_timeout(CONNECTION_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                // Redirects and slot refreshes are the cluster client's
                // own; a node that is down is left to the store's budget.
                .retries(3);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            Target::Cluster(Box::new(builder.build().map_err(scrub)?))
        } else {
            let node = nodes[0];
            let client = match certs {
                Some(certs) => redis::Client::build_with_tls(node, certs),
                None => redis::Client::open(node),
            }
            .map_err(scrub)?;
            Target::Single(Box::new(client))
        };
        Ok(Self { target, secrets })
    }

    /// One attempt to connect.
    pub(crate) async fn connect(&self) -> redis::RedisResult<Conn> {
        match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    // One reconnect attempt per failed command: the
                    // store's retry loop paces the next ones.
                    .set_number_of_retries(0);
                Ok(Conn::Single(
                    client.get_connection_manager_with_config(config).await?,
                ))
            }
            Target::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }
}

fn read(path: &std::path::Path, what: &str) -> Result<Vec<u8>, CitationError> {
    std::fs::read(path).map_err(|e| {
        config_error(format!(
            "cannot read the Redis TLS {what} {}: {e}",
            path.display()
        ))
    })
}

fn tls_certificates(options: &RedisOptions) -> Result<Option<TlsCertificates>, CitationError> {
    let root_cert = options
        .tls_ca
        .as_deref()
        .map(|p| read(p, "CA file"))
        .transpose()?;
    let client_tls = match (&options.tls_cert, &options.tls_key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read(cert, "certificate")?,
            client_key: read(key, "key")?,
        }),
        (None, None) => None,
        _ => {
            return Err(config_error(
                "the Redis TLS client certificate and key go together: set both or neither",
            ));
        }
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// rustls needs a process-wide crypto provider; the workspace links
/// `ring`. A provider installed earlier by someone else stays.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted_and_secrets_scrubbed() {
        assert_eq!(
            redact_url("redis://app:s3cr%40t@host:6379/2"),
            "redis://***@host:6379/2"
        );
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
        let options = RedisOptions::new("rediss://:hunter2@a:1, rediss://:hunter2@b:2");
        assert!(options.is_cluster());
        let debug = format!("{options:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        let secrets = Secrets::of(&["redis://u:p%40ss@h:1"]);
        assert_eq!(secrets.redact("x p@ss y p%40ss"), "x *** y ***");
    }

    #[test]
    fn bad_configurations_fail_clearly() {
        let err = |o: RedisOptions| Connector::new(&o).err().unwrap();
        let e = err(RedisOptions::new("http://:pw@h:1"));
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(!e.to_string().contains("pw"), "{e}");
        let mut o = RedisOptions::new("redis://h:1");
        o.tls_ca = Some("/nonexistent/ca.pem".into());
        assert!(err(o).to_string().contains("/nonexistent/ca.pem"));
        let mut o = RedisOptions::new("rediss://h:1");
        o.tls_cert = Some("/tmp/c.pem".into());
        assert!(err(o).to_string().contains("both or neither"));
        let e = err(RedisOptions::new("redis://a:1,rediss://b:2"));
        assert!(e.to_string().contains("mix"), "{e}");
        assert!(
            err(RedisOptions::new(" , "))
                .to_string()
                .contains("no Redis URL")
        );
    }

    #[test]
    fn urls_are_checked_before_connecting_without_the_password() {
        assert!(
            RedisOptions::new("redis://h:1,rediss://u:p@h2:2")
                .check_url()
                .is_ok()
        );
        assert!(
            RedisOptions::new("unix:///run/redis.sock")
                .check_url()
                .is_ok()
        );
        let e = RedisOptions::new("http://:hunter2@x")
            .check_url()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad Redis URL http://***@x: the scheme is http, not redis or rediss"
        );
        let e = RedisOptions::new("redis://:hunter2@[bad")
            .check_url()
            .unwrap_err();
        assert!(e.to_string().starts_with("bad Redis URL"), "{e}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert_eq!(
            RedisOptions::new(" redis://a:p@h:1 , redis://h2:2").redacted_url(),
            "redis://***@h:1,redis://h2:2"
        );
    }

    /// The flags as every binary has them (`--help` shows the same).
    #[cfg(feature = "clap")]
    mod flags {
        use clap::Parser;

        use super::*;

        #[derive(Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            redis: RedisOptions,
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
            assert_eq!(cli.redis.retry_budget, Duration::from_millis(1500));
            assert_eq!(cli.redis.tls_ca, Some(PathBuf::from("/etc/ca.pem")));
            assert!(!cli.redis.cluster);
            let debug = format!("{cli:?}");
            assert!(!debug.contains("s3cret"), "{debug}");
            assert!(debug.contains("rediss://***@a:7000"), "{debug}");
            // A certificate without its key is refused.
            assert!(Cli::try_parse_from(["x", "--redis-tls-cert", "/c.pem"]).is_err());
            let cli = Cli::try_parse_from(["x", "--redis-cluster"]).unwrap();
            assert!(cli.redis.cluster);
            assert_eq!(cli.redis.retry_budget, Duration::from_secs(3));
        }

        #[test]
        fn flag_defaults_are_the_store_defaults() {
            let cli = Cli::try_parse_from(["x"]).unwrap();
            assert_eq!(cli.redis.url, DEFAULT_REDIS_URL);
            assert_eq!(cli.redis.retry_budget, DEFAULT_RETRY_BUDGET);
            assert_eq!(cli.redis.ttl, crate::DEFAULT_TTL);
            let cli = Cli::try_parse_from(["x", "--citation-ttl", "60"]).unwrap();
            assert_eq!(cli.redis.ttl, Duration::from_secs(60));
            assert!(Cli::try_parse_from(["x", "--citation-ttl", "soon"]).is_err());
        }
    }
}
