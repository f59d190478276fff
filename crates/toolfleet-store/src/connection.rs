//! How the store reaches Redis: one server or a Redis Cluster, plain or
//! TLS, with credentials in the URL. Whatever the topology, commands go
//! through one `Conn`, so every store operation has one code path.
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

/// How long transient Redis errors are retried before an operation fails
/// as unavailable.
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(3);

/// How long one connection attempt may take (TCP, TLS handshake, AUTH).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one command may wait for its answer on a live connection.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Redis is and how to talk to it.
///
/// `url` is one `redis://` or `rediss://` URL (`redis://user:pass@host:port/db`),
/// or several comma-separated node URLs of a Redis Cluster; `cluster`
/// forces cluster mode for a single seed node. The TLS files are PEM; the
/// CA replaces the system roots, the certificate and key (both or neither)
/// authenticate the client.
#[derive(Clone)]
pub struct RedisOptions {
    pub url: String,
    pub cluster: bool,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Transient errors are retried, with backoff, for this long.
    pub retry_budget: Duration,
}

impl RedisOptions {
    /// One server (or a cluster, when `url` lists several nodes), no TLS
    /// files, the default retry budget.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            retry_budget: DEFAULT_RETRY_BUDGET,
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
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<String> = self.nodes().into_iter().map(redact_url).collect();
        f.debug_struct("RedisOptions")
            .field("url", &nodes.join(","))
            .field("cluster", &self.cluster)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("retry_budget", &self.retry_budget)
            .finish()
    }
}

/// A URL with its password (and user) replaced, for logs and `Debug`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable redis url>".to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

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
}
