//! A Redis Cluster of `redis-server` child processes on loopback ports:
//! N masters, no replicas, slots spread by `redis-cli --cluster create`.
//! For tests of the store's cluster mode; killed on drop, data in a
//! temporary directory. Optionally TLS-only (`tls-cluster yes`, clients
//! and the cluster bus both) and password-protected.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::servers::{LocalError, free_port, have};

const READY_WITHIN: Duration = Duration::from_secs(30);

struct Node {
    port: u16,
    /// The cluster bus port, kept so a restart rejoins on the same one.
    bus: u16,
    child: Option<Child>,
}

impl Node {
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// PEM files of a TLS cluster: the nodes' certificate and key (used for
/// clients and the cluster bus) and the CA that signed it.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// How the nodes are set up beyond the defaults (plain TCP, no password).
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// TLS only: the plain port is off.
    pub tls: Option<ClusterTls>,
    /// `requirepass` (and `masterauth`) on every node.
    pub password: Option<String>,
}

impl ClusterOptions {
    /// `redis-cli`'s connection flags for a node.
    fn cli_args(&self, port: u16) -> Vec<String> {
        let mut args = vec![
            "-h".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ];
        args.extend(self.cli_auth_args());
        args
    }

    fn cli_auth_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(tls) = &self.tls {
            args.extend(["--tls".into(), "--cacert".into(), path(&tls.ca)]);
        }
        if let Some(p) = &self.password {
            args.extend(["-a".into(), p.clone(), "--no-auth-warning".into()]);
        }
        args
    }

    /// Plain nodes without a password are probed over raw TCP; others
    /// through `redis-cli`, which speaks TLS and AUTH.
    fn plain(&self) -> bool {
        self.tls.is_none() && self.password.is_none()
    }
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A running cluster; every master answers `cluster_state:ok` once
/// [`RedisCluster::start`] returns.
pub struct RedisCluster {
    nodes: Vec<Node>,
    options: ClusterOptions,
    dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Starts `masters` (at least 3, as Redis requires) nodes and joins
    /// them. A start that loses a port race is retried on new ports.
    pub fn start(masters: usize) -> Result<Self, LocalError> {
        Self::start_with(masters, ClusterOptions::default())
    }

    /// [`RedisCluster::start`] with TLS and/or a password.
    pub fn start_with(masters: usize, options: ClusterOptions) -> Result<Self, LocalError> {
        if !have("redis-server") {
            return Err(LocalError::Missing("redis-server"));
        }
        if !have("redis-cli") {
            return Err(LocalError::Missing("redis-cli"));
        }
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(masters.max(3), &options) {
                Ok(c) => return Ok(c),
                Err(e @ LocalError::Exited(..)) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(LocalError::Missing("redis-server")))
    }

    fn try_start(masters: usize, options: &ClusterOptions) -> Result<Self, LocalError> {
        let io = |e| LocalError::Io("redis-server", e);
        let dir = tempfile::tempdir().map_err(io)?;
        let mut nodes = Vec::with_capacity(masters);
        for _ in 0..masters {
            nodes.push(spawn_node(dir.path(), options)?);
        }
        for node in &mut nodes {
            wait_until(node, dir.path(), |port| answers_ping(port, options))?;
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(options.cli_auth_args())
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| LocalError::Io("redis-cli", e))?;
        if !out.status.success() {
            return Err(LocalError::Exited(
                "redis-cli",
                out.status.to_string(),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            ));
        }
        let mut cluster = Self {
            nodes,
            options: options.clone(),
            dir,
        };
        cluster.wait_all_ok()?;
        Ok(cluster)
    }

    /// Waits until every running node sees the whole cluster, every slot
    /// served.
    fn wait_all_ok(&mut self) -> Result<(), LocalError> {
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
        let options = &self.options;
        for node in self.nodes.iter_mut().filter(|n| n.child.is_some()) {
            wait_until(node, self.dir.path(), |port| {
                cluster_info(port, options)
                    .is_some_and(|i| i.contains("cluster_state:ok") && i.contains(&known))
            })?;
        }
        Ok(())
    }

    /// Kills node `i` (a master: its slots are unserved until it is back).
    pub fn stop(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on its ports with its cluster config (its
    /// data is gone: nothing is persisted), and waits until the cluster is
    /// whole again.
    pub fn start_again(&mut self, i: usize) -> Result<(), LocalError> {
        let node = &mut self.nodes[i];
        node.kill();
        node.child = Some(spawn_at(
            self.dir.path(),
            node.port,
            node.bus,
            &self.options,
        )?);
        let options = &self.options;
        wait_until(node, self.dir.path(), |port| answers_ping(port, options))?;
        self.wait_all_ok()
    }

    /// The nodes' ports.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Every node's URL, comma-separated: what `--redis-url` takes for a
    /// cluster (`rediss://` when TLS, with the password when set).
    pub fn url(&self) -> String {
        let scheme = if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let auth = match &self.options.password {
            Some(p) => format!(":{p}@"),
            None => String::new(),
        };
        self.ports()
            .iter()
            .map(|p| format!("{scheme}://{auth}127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Where the nodes keep their files (logs, `nodes-<port>.conf`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn spawn_node(dir: &Path, options: &ClusterOptions) -> Result<Node, LocalError> {
    let io = |e| LocalError::Io("redis-server", e);
    let port = free_port().map_err(io)?;
    // The cluster bus gets a free port of its own rather than the default
    // port + 10000, which may be taken or out of range.
    let bus = free_port().map_err(io)?;
    let child = spawn_at(dir, port, bus, options)?;
    Ok(Node {
        port,
        bus,
        child: Some(child),
    })
}

fn spawn_at(
    dir: &Path,
    port: u16,
    bus: u16,
    options: &ClusterOptions,
) -> Result<Child, LocalError> {
    let io = |e| LocalError::Io("redis-server", e);
    let node_dir = dir.join(port.to_string());
    std::fs::create_dir_all(&node_dir).map_err(io)?;
    let log = std::fs::File::create(node_dir.join("redis.log")).map_err(io)?;
    let err = log.try_clone().map_err(io)?;
    let mut extra: Vec<String> = Vec::new();
    match &options.tls {
        Some(tls) => extra.extend([
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cluster".into(),
            "yes".into(),
            "--tls-cert-file".into(),
            path(&tls.cert),
            "--tls-key-file".into(),
            path(&tls.key),
            "--tls-ca-cert-file".into(),
            path(&tls.ca),
            "--tls-auth-clients".into(),
            "no".into(),
        ]),
        None => extra.extend(["--port".into(), port.to_string()]),
    }
    if let Some(p) = &options.password {
        extra.extend([
            "--requirepass".into(),
            p.clone(),
            "--masterauth".into(),
            p.clone(),
        ]);
    }
    Command::new("redis-server")
        .args(&extra)
        .args(["--bind", "127.0.0.1"])
        .args([
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            &bus.to_string(),
        ])
        .arg("--cluster-config-file")
        .arg(node_dir.join(format!("nodes-{port}.conf")))
        .args(["--cluster-node-timeout", "5000"])
        .args(["--save", "", "--appendonly", "no", "--dir"])
        .arg(&node_dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(io)
}

fn wait_until(node: &mut Node, dir: &Path, ready: impl Fn(u16) -> bool) -> Result<(), LocalError> {
    let log = || {
        std::fs::read_to_string(dir.join(node.port.to_string()).join("redis.log"))
            .unwrap_or_default()
    };
    let start = Instant::now();
    while start.elapsed() < READY_WITHIN {
        if ready(node.port) {
            return Ok(());
        }
        if let Some(Ok(Some(status))) = node.child.as_mut().map(Child::try_wait) {
            return Err(LocalError::Exited(
                "redis-server",
                status.to_string(),
                log(),
            ));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Err(LocalError::NotReady("redis-server", READY_WITHIN, log()))
}

fn connect(port: u16) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
        .ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    Some(s)
}

/// Runs `redis-cli` against the node; its output when it succeeded.
fn cli(port: u16, options: &ClusterOptions, command: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(options.cli_args(port))
        .args(command)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn answers_ping(port: u16, options: &ClusterOptions) -> bool {
    if !options.plain() {
        return cli(port, options, &["PING"]).is_some_and(|o| o.trim() == "PONG");
    }
    let Some(mut s) = connect(port) else {
        return false;
    };
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// The node's `CLUSTER INFO` text.
fn cluster_info(port: u16, options: &ClusterOptions) -> Option<String> {
    if !options.plain() {
        return cli(port, options, &["CLUSTER", "INFO"]);
    }
    let mut s = connect(port)?;
    s.write_all(b"CLUSTER INFO\r\n").ok()?;
    // A bulk string: `$<len>\r\n<text>\r\n`; read until all of it is in.
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n") {
            let len: usize = head.strip_prefix('$')?.parse().ok()?;
            if body.len() >= len {
                return Some(body[..len].to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_three_master_cluster_starts_and_covers_every_slot() {
        let cluster = RedisCluster::start(3).unwrap();
        assert_eq!(cluster.ports().len(), 3);
        for port in cluster.ports() {
            let info = cluster_info(port, &ClusterOptions::default()).unwrap();
            assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
            assert!(info.contains("cluster_known_nodes:3"), "{info}");
        }
        assert_eq!(cluster.url().split(',').count(), 3);
    }
}
