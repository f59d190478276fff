//! Local `nats-server` and `redis-server` child processes on free loopback
//! ports, for the demo and the test harness. Each is killed on drop, keeps
//! its data in its own temporary directory, and can be stopped and started
//! again on the same port (tests use that to simulate an outage).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What to install when a server binary is missing.
pub const INSTALL_HINT: &str = "install it with `sudo apt-get install -y nats-server redis-server` (Debian/Ubuntu), \
`brew install nats-server redis` (macOS), or download nats-server from https://github.com/nats-io/nats-server/releases";

/// What to install when PostgreSQL is missing.
pub const POSTGRES_HINT: &str = "install it with `sudo apt-get install -y postgresql` (Debian/Ubuntu) \
or `brew install postgresql` (macOS)";

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("`{0}` was not found on PATH: {INSTALL_HINT}")]
    Missing(&'static str),
    #[error("PostgreSQL was not found in {0}: {POSTGRES_HINT}")]
    NoPostgres(String),
    #[error("{0} failed: {1}")]
    Failed(&'static str, String),
    #[error("{0} did not become ready within {1:?}; its output:\n{2}")]
    NotReady(&'static str, Duration, String),
    #[error("{0} exited while starting ({1}); its output:\n{2}")]
    Exited(&'static str, String, String),
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
}

/// Is `program` on PATH?
pub fn have(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

const READY_WITHIN: Duration = Duration::from_secs(15);

/// Tries `start` up to three times when the server exited while starting
/// (a lost race for its port); anything else fails at once.
pub(crate) fn with_retries<T>(
    mut start: impl FnMut() -> Result<T, LocalError>,
) -> Result<T, LocalError> {
    let mut last = None;
    for _ in 0..3 {
        match start() {
            Ok(t) => return Ok(t),
            Err(e @ LocalError::Exited(..)) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or(LocalError::Missing("server")))
}

pub(crate) struct Proc {
    name: &'static str,
    child: Option<Child>,
    log: std::path::PathBuf,
}

impl Proc {
    pub(crate) fn spawn(
        name: &'static str,
        cmd: &mut Command,
        log: &Path,
    ) -> Result<Self, LocalError> {
        if !have(name) {
            return Err(LocalError::Missing(name));
        }
        Self::spawn_found(name, cmd, log)
    }

    /// [`Proc::spawn`] of a program the caller has found (not necessarily
    /// on PATH: PostgreSQL's binaries usually are not).
    pub(crate) fn spawn_found(
        name: &'static str,
        cmd: &mut Command,
        log: &Path,
    ) -> Result<Self, LocalError> {
        let out = std::fs::File::create(log).map_err(|e| LocalError::Io(name, e))?;
        let err = out.try_clone().map_err(|e| LocalError::Io(name, e))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| LocalError::Io(name, e))?;
        Ok(Self {
            name,
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    pub(crate) fn wait_ready(&mut self, ready: impl Fn() -> bool) -> Result<(), LocalError> {
        let start = Instant::now();
        while start.elapsed() < READY_WITHIN {
            if ready() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(LocalError::Exited(self.name, status.to_string(), log));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        Err(LocalError::NotReady(self.name, READY_WITHIN, log))
    }

    /// Asks the process to stop with `signal` (a name `kill` knows), waits
    /// up to `within` for it to exit, then kills it if it has not.
    pub(crate) fn stop_with(&mut self, signal: &str, within: Duration) {
        if let Some(c) = self.child.as_mut() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(c.id().to_string())
                .status();
            let start = Instant::now();
            while start.elapsed() < within && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(25));
            }
        }
        self.kill();
    }

    /// Sends `signal` (a name `kill` knows) to the process, if it runs.
    pub(crate) fn signal(&self, signal: &str) {
        if let Some(c) = self.child.as_ref() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(c.id().to_string())
                .status();
        }
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Settings of a [`NatsServer`] beyond the defaults (plain
/// `nats-server -js`, no authentication).
#[derive(Debug, Clone, Default)]
pub struct NatsConfig {
    /// A `max_payload` other than the server's default (1 MiB).
    pub max_payload: Option<usize>,
    /// More configuration, appended to the server's config file (which
    /// lives in the server's directory, the server's working directory:
    /// relative paths and `include`s resolve there).
    pub extra: Option<String>,
    /// Files written into the server's directory before it starts: an
    /// included `auth.conf`, TLS certificates.
    pub files: Vec<(String, Vec<u8>)>,
    /// Environment of the server process (a config's `$NAME`s are read
    /// from it).
    pub env: Vec<(String, String)>,
}

/// The JetStream block of a test server's config: a store limit of its
/// own rather than the server's default (75% of the disk free at its
/// start). Every stream of a fleet reserves its byte limit against it
/// (about 2 GiB per fleet prefix), so on a busy CI disk a test with two
/// fleets on one server was refused for "insufficient storage" while the
/// tests write a few megabytes.
pub(crate) const JETSTREAM_LIMITS: &str = "jetstream {\n  max_file_store: 256GB\n}\n";

/// A `nats-server -js` child process.
pub struct NatsServer {
    proc: Proc,
    port: u16,
    dir: tempfile::TempDir,
    config: NatsConfig,
}

impl NatsServer {
    /// Starts on a free port. Another process may take the port between
    /// our probe and the server's bind, so a failed start is retried on a
    /// new port.
    pub fn start() -> Result<Self, LocalError> {
        Self::start_configured(NatsConfig::default())
    }

    /// [`NatsServer::start`] with the server's `max_payload` set to
    /// `bytes` (it has no flag for it: a config file carries it).
    pub fn start_with_max_payload(bytes: usize) -> Result<Self, LocalError> {
        Self::start_configured(NatsConfig {
            max_payload: Some(bytes),
            ..NatsConfig::default()
        })
    }

    /// [`NatsServer::start`] with `config` (authorization, TLS, …). The
    /// port, the loopback address and the JetStream directory are flags,
    /// which override what the config says.
    pub fn start_configured(config: NatsConfig) -> Result<Self, LocalError> {
        with_retries(|| {
            let dir = tempfile::tempdir().map_err(|e| LocalError::Io("nats-server", e))?;
            for (name, bytes) in &config.files {
                std::fs::write(dir.path().join(name), bytes)
                    .map_err(|e| LocalError::Io("nats-server", e))?;
            }
            let port = free_port().map_err(|e| LocalError::Io("nats-server", e))?;
            let proc = Self::spawn_in(dir.path(), port, &config)?;
            Ok(Self {
                proc,
                port,
                dir,
                config: config.clone(),
            })
        })
    }

    fn spawn_in(dir: &Path, port: u16, config: &NatsConfig) -> Result<Proc, LocalError> {
        // The log is truncated at every start, so readiness is this run's.
        let log = dir.join("nats.log");
        let mut cmd = Command::new("nats-server");
        cmd.current_dir(dir);
        let mut text = String::new();
        if let Some(bytes) = config.max_payload {
            text.push_str(&format!("max_payload: {bytes}\n"));
        }
        if let Some(extra) = &config.extra {
            text.push_str(extra);
            text.push('\n');
        }
        if !text.contains("jetstream") {
            text.push_str(JETSTREAM_LIMITS);
        }
        let file = dir.join("nats.conf");
        std::fs::write(&file, text).map_err(|e| LocalError::Io("nats-server", e))?;
        cmd.arg("-c").arg(file);
        cmd.envs(config.env.iter().map(|(k, v)| (k, v)));
        cmd.args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir.join("jetstream"));
        let mut proc = Proc::spawn("nats-server", &mut cmd, &log)?;
        // Ready when it accepts clients and JetStream is up.
        proc.wait_ready(|| {
            std::fs::read_to_string(&log)
                .map(|l| l.contains("Server is ready"))
                .unwrap_or(false)
                && nats_answers(port)
        })?;
        Ok(proc)
    }

    /// Starts a stopped server again on the same port with the same
    /// JetStream data (clients reconnect on their own).
    pub fn start_again(&mut self) -> Result<(), LocalError> {
        self.proc.kill();
        self.proc = Self::spawn_in(self.dir.path(), self.port, &self.config)?;
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's directory (its config, log and JetStream data).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }

    /// Kills the server (its JetStream data stays in the directory).
    pub fn stop(&mut self) {
        self.proc.kill();
    }
}

pub(crate) fn nats_answers(port: u16) -> bool {
    let Ok(s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).is_ok() && line.starts_with("INFO")
}

/// A `redis-server` child process that keeps nothing on disk.
pub struct RedisServer {
    proc: Proc,
    port: u16,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts on a free port, retried on a new port like
    /// [`NatsServer::start`].
    pub fn start() -> Result<Self, LocalError> {
        with_retries(|| {
            let dir = tempfile::tempdir().map_err(|e| LocalError::Io("redis-server", e))?;
            let port = free_port().map_err(|e| LocalError::Io("redis-server", e))?;
            Self::start_in(dir, port)
        })
    }

    fn start_in(dir: tempfile::TempDir, port: u16) -> Result<Self, LocalError> {
        let proc = Self::spawn_in(dir.path(), port)?;
        Ok(Self { proc, port, dir })
    }

    fn spawn_in(dir: &Path, port: u16) -> Result<Proc, LocalError> {
        let mut proc = Proc::spawn(
            "redis-server",
            Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                ])
                .arg(dir),
            &dir.join("redis.log"),
        )?;
        proc.wait_ready(|| redis_answers(port))?;
        Ok(proc)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        self.proc.kill();
    }

    /// Freezes the server (SIGSTOP): its connections stay open, and no
    /// command is answered until [`RedisServer::resume`] — a Redis that
    /// hangs, not one that is gone.
    pub fn pause(&self) {
        self.proc.signal("STOP");
    }

    /// Thaws a [`RedisServer::pause`]d server (SIGCONT): it answers what
    /// it was sent meanwhile.
    pub fn resume(&self) {
        self.proc.signal("CONT");
    }

    /// Starts a stopped server again on the same port (empty: it keeps
    /// nothing on disk).
    pub fn start_again(&mut self) -> Result<(), LocalError> {
        self.proc.kill();
        self.proc = Self::spawn_in(self.dir.path(), self.port)?;
        Ok(())
    }
}

fn redis_answers(port: u16) -> bool {
    let Ok(mut s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Is something answering NATS at `url`'s host and port?
pub fn nats_reachable(url: &str) -> bool {
    reachable(url, 4222, nats_answers)
}

/// Is something answering Redis at `url`'s host and port?
pub fn redis_reachable(url: &str) -> bool {
    reachable(url, 6379, redis_answers)
}

fn reachable(url: &str, default_port: u16, check: fn(u16) -> bool) -> bool {
    let Ok(u) = url::Url::parse(url) else {
        return false;
    };
    let local = matches!(u.host_str(), Some("127.0.0.1") | Some("localhost"));
    local && check(u.port().unwrap_or(default_port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_port_race_is_retried_and_a_missing_binary_is_not() {
        let mut tries = 0;
        let r = with_retries(|| {
            tries += 1;
            if tries < 3 {
                Err(LocalError::Exited(
                    "nats-server",
                    "exit 1".into(),
                    "address in use".into(),
                ))
            } else {
                Ok(tries)
            }
        });
        assert_eq!(r.unwrap(), 3);
        let mut tries = 0;
        let r: Result<(), _> = with_retries(|| {
            tries += 1;
            Err(LocalError::Missing("nats-server"))
        });
        assert_eq!(tries, 1);
        assert!(r.unwrap_err().to_string().contains("apt-get install"));
    }

    #[test]
    fn servers_start_answer_and_restart_on_the_same_port() {
        let mut nats = NatsServer::start().unwrap();
        assert!(nats_reachable(&nats.url()));
        let port = nats.port();
        nats.stop();
        assert!(!nats_reachable(&nats.url()));
        nats.start_again().unwrap();
        assert_eq!(nats.port(), port);
        assert!(nats_reachable(&nats.url()));
        let mut redis = RedisServer::start().unwrap();
        assert!(redis_reachable(&redis.url()));
        redis.stop();
        assert!(!redis_reachable(&redis.url()));
        redis.start_again().unwrap();
        assert!(redis_reachable(&redis.url()));
    }
}
