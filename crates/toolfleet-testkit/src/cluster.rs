//! A JetStream cluster of `nats-server` child processes on free loopback
//! ports, joined by routes: for tests of replicated streams. Each node keeps
//! its data in its own temporary directory and can be killed and started
//! again on the same ports (a crash and a recovery); all are killed on drop.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::servers::{LocalError, Proc, free_port, nats_answers, with_retries};

/// The cluster's name (`--cluster_name`).
pub const CLUSTER_NAME: &str = "toolfleet";

struct Node {
    name: String,
    port: u16,
    cluster_port: u16,
    monitor_port: u16,
    dir: tempfile::TempDir,
    proc: Option<Proc>,
}

/// `nats-server -js` nodes in one cluster.
pub struct NatsCluster {
    nodes: Vec<Node>,
    routes: String,
}

impl NatsCluster {
    /// Starts `size` nodes (3 for R3 streams) and waits until each accepts
    /// clients and the cluster has a JetStream metadata leader. A start
    /// that lost a port race is retried on new ports.
    pub fn start(size: usize) -> Result<Self, LocalError> {
        with_retries(|| Self::try_start(size))
    }

    fn try_start(size: usize) -> Result<Self, LocalError> {
        let io = |e| LocalError::Io("nats-server", e);
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            nodes.push(Node {
                name: format!("node-{i}"),
                port: free_port().map_err(io)?,
                cluster_port: free_port().map_err(io)?,
                monitor_port: free_port().map_err(io)?,
                dir: tempfile::tempdir().map_err(io)?,
                proc: None,
            });
        }
        let routes = nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self { nodes, routes };
        // All first, then wait: a node waits for its peers to elect.
        for i in 0..size {
            let proc = cluster.spawn(i)?;
            cluster.nodes[i].proc = Some(proc);
        }
        for i in 0..size {
            cluster.wait_ready(i)?;
        }
        cluster.wait_for_leader()?;
        Ok(cluster)
    }

    fn spawn(&self, i: usize) -> Result<Proc, LocalError> {
        let node = &self.nodes[i];
        let config = node.dir.path().join("nats.conf");
        std::fs::write(&config, crate::servers::JETSTREAM_LIMITS)
            .map_err(|e| LocalError::Io("nats-server", e))?;
        let mut cmd = Command::new("nats-server");
        cmd.current_dir(node.dir.path())
            .arg("-c")
            .arg(config)
            .args(["-js", "-a", "127.0.0.1", "-p", &node.port.to_string()])
            .args(["-m", &node.monitor_port.to_string()])
            .args(["-n", &node.name, "--cluster_name", CLUSTER_NAME])
            .arg("--cluster")
            .arg(format!("nats://127.0.0.1:{}", node.cluster_port))
            .arg("--routes")
            .arg(&self.routes)
            .arg("-sd")
            .arg(node.dir.path().join("jetstream"));
        // The log is truncated at every start, so readiness is this run's.
        Proc::spawn("nats-server", &mut cmd, &log_path(node.dir.path()))
    }

    fn wait_ready(&mut self, i: usize) -> Result<(), LocalError> {
        let node = &mut self.nodes[i];
        let (log, port) = (log_path(node.dir.path()), node.port);
        let Some(proc) = node.proc.as_mut() else {
            return Ok(());
        };
        proc.wait_ready(|| {
            std::fs::read_to_string(&log)
                .map(|l| l.contains("Server is ready"))
                .unwrap_or(false)
                && nats_answers(port)
        })
    }

    /// Waits until a running node has seen a metadata leader elected.
    fn wait_for_leader(&self) -> Result<(), LocalError> {
        let within = Duration::from_secs(15);
        let start = Instant::now();
        while start.elapsed() < within {
            let elected = self
                .nodes
                .iter()
                .filter(|n| n.proc.is_some())
                .any(|n| self.log_of(n).contains("new metadata leader"));
            if elected {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let logs = self
            .nodes
            .iter()
            .map(|n| self.log_of(n))
            .collect::<Vec<_>>();
        Err(LocalError::NotReady(
            "nats-server cluster",
            within,
            logs.join("\n"),
        ))
    }

    fn log_of(&self, node: &Node) -> String {
        std::fs::read_to_string(log_path(node.dir.path())).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s client URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Every node's client URL, comma-separated (as `--nats-url` takes
    /// them).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills node `i` at once (SIGKILL: a crash); its data stays.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut proc) = self.nodes[i].proc.take() {
            proc.kill();
        }
    }

    /// Starts node `i` again on its ports with its data, and waits until it
    /// accepts clients (it catches up with its peers on its own).
    pub fn restart(&mut self, i: usize) -> Result<(), LocalError> {
        self.kill(i);
        let proc = self.spawn(i)?;
        self.nodes[i].proc = Some(proc);
        self.wait_ready(i)
    }

    /// The node a client named `name` (its `ConnectOptions::name`) is
    /// connected to, from each node's monitoring endpoint (`/connz`).
    pub fn node_of_client(&self, name: &str) -> Option<usize> {
        let wanted = format!("\"name\":\"{name}\"");
        (0..self.nodes.len()).find(|&i| {
            self.nodes[i].proc.is_some()
                && http_get(self.nodes[i].monitor_port, "/connz")
                    .map(|body| body.replace([' ', '\n'], "").contains(&wanted))
                    .unwrap_or(false)
        })
    }

    /// What node `i` has logged since it last started.
    pub fn log(&self, i: usize) -> String {
        self.log_of(&self.nodes[i])
    }
}

/// The body of `GET path` on 127.0.0.1:`port` (HTTP/1.0: the server
/// closes the connection after the answer).
fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(
        &([127, 0, 0, 1], port).into(),
        Duration::from_millis(500),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default())
}

fn log_path(dir: &Path) -> std::path::PathBuf {
    dir.join("nats.log")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_nodes_elect_a_leader_and_a_killed_node_comes_back() {
        let mut cluster = NatsCluster::start(3).unwrap();
        assert_eq!(cluster.urls().split(',').count(), 3);
        for i in 0..3 {
            assert!(nats_answers(cluster.nodes[i].port));
        }
        let body = http_get(cluster.nodes[0].monitor_port, "/connz").unwrap();
        assert!(body.contains("\"connections\""), "{body}");
        assert_eq!(cluster.node_of_client("nobody"), None);
        cluster.kill(1);
        assert!(!nats_answers(cluster.nodes[1].port));
        cluster.restart(1).unwrap();
        assert!(nats_answers(cluster.nodes[1].port));
    }
}
