//! A PostgreSQL server as a child process: a fresh cluster (`initdb`) in a
//! temporary directory, on a free loopback port, trust authentication for
//! the superuser `postgres`, stopped on drop. The machine's PostgreSQL, or
//! another installation (pgserver's, which has pgvector). As root, the
//! server runs as the user `postgres`: PostgreSQL refuses to run as root.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::servers::{LocalError, Proc, free_port, with_retries};

/// A `postgres` child process with its own cluster.
pub struct PostgresServer {
    proc: Proc,
    port: u16,
    dir: tempfile::TempDir,
    bindir: PathBuf,
    as_root: bool,
    settings: Vec<String>,
}

impl PostgresServer {
    /// Starts the machine's PostgreSQL: `postgres` and `initdb` on PATH,
    /// else the newest of `/usr/lib/postgresql/<version>/bin` (where
    /// Debian and Ubuntu put them).
    pub fn start() -> Result<Self, LocalError> {
        Self::start_in(&machine_bindir()?)
    }

    /// Starts the `postgres` and `initdb` of `bindir` (an installation's
    /// `bin` directory). Retried on a new port like
    /// [`crate::servers::NatsServer::start`].
    pub fn start_in(bindir: &Path) -> Result<Self, LocalError> {
        Self::start_configured(bindir, &[])
    }

    /// [`PostgresServer::start_in`] with server settings (`name=value`,
    /// each passed as `-c`; say `ssl=on`). Paths in them may name files
    /// the caller puts in place before: the server reads them at start.
    pub fn start_configured(bindir: &Path, settings: &[String]) -> Result<Self, LocalError> {
        if !bindir.join("postgres").is_file() || !bindir.join("initdb").is_file() {
            return Err(LocalError::NoPostgres(bindir.display().to_string()));
        }
        let as_root = running_as_root();
        with_retries(|| {
            let dir = tempfile::tempdir().map_err(|e| LocalError::Io("postgres", e))?;
            if as_root {
                run(
                    "chown",
                    Command::new("chown")
                        .arg("postgres:postgres")
                        .arg(dir.path()),
                )?;
            }
            run(
                "initdb",
                as_owner(bindir.join("initdb"), as_root)
                    .arg("-D")
                    .arg(dir.path().join("data"))
                    .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]),
            )?;
            let port = free_port().map_err(|e| LocalError::Io("postgres", e))?;
            let proc = spawn(bindir, dir.path(), port, as_root, settings)?;
            Ok(Self {
                proc,
                port,
                dir,
                bindir: bindir.to_path_buf(),
                as_root,
                settings: settings.to_vec(),
            })
        })
    }

    /// Stops the server (fast shutdown: clients are disconnected); its
    /// data stays for [`PostgresServer::start_again`].
    pub fn stop(&mut self) {
        self.proc.stop_with("INT", Duration::from_secs(10));
    }

    /// Starts a stopped server again on the same port with the same data.
    pub fn start_again(&mut self) -> Result<(), LocalError> {
        self.stop();
        self.proc = spawn(
            &self.bindir,
            self.dir.path(),
            self.port,
            self.as_root,
            &self.settings,
        )?;
        Ok(())
    }

    /// The directory the cluster lives in (`data/`, the log): a place for
    /// files a test hands the server, such as certificates.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the server runs as the user `postgres` (we are root): files
    /// it must read need that owner.
    pub fn runs_as_postgres(&self) -> bool {
        self.as_root
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The superuser's URL (trust authentication: no password).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

/// Certificates for a TLS test (PostgreSQL's, and the store's Redis
/// ones), made with the `openssl` command: a CA (`ca.pem`), an unrelated
/// second CA (`other-ca.pem`), a server certificate for `127.0.0.1` and
/// `localhost` (`server.pem`, `server.key`; also good for client auth, as a
/// Redis Cluster node's connections to the others need) and a client
/// certificate (`client.pem`, `client.key`), both signed by the first.
/// The server's are readable by PostgreSQL when it runs as `postgres`.
pub struct TestCa {
    dir: tempfile::TempDir,
}

impl TestCa {
    pub fn new() -> Result<Self, LocalError> {
        let dir = tempfile::tempdir().map_err(|e| LocalError::Io("openssl", e))?;
        let openssl = |args: &[&str]| {
            run(
                "openssl",
                Command::new("openssl").args(args).current_dir(dir.path()),
            )
        };
        std::fs::write(
            dir.path().join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .map_err(|e| LocalError::Io("openssl", e))?;
        std::fs::write(
            dir.path().join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
             extendedKeyUsage=clientAuth\n",
        )
        .map_err(|e| LocalError::Io("openssl", e))?;
        for ca in ["ca", "other-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=toolfleet test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ])?;
        }
        for name in ["server", "client"] {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ])?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
                "-out",
                &format!("{name}.pem"),
            ])?;
        }
        // PostgreSQL reads its key only when its own user owns it, mode
        // 0600; as root the server runs as `postgres`.
        run(
            "chmod",
            Command::new("chmod")
                .arg("600")
                .arg(dir.path().join("server.key")),
        )?;
        if running_as_root() {
            run("chmod", Command::new("chmod").arg("755").arg(dir.path()))?;
            run(
                "chown",
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(dir.path().join("server.key"))
                    .arg(dir.path().join("server.pem")),
            )?;
        }
        Ok(Self { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The settings for [`PostgresServer::start_configured`] that turn TLS
    /// on with the server certificate.
    pub fn server_settings(&self) -> Vec<String> {
        vec![
            "ssl=on".into(),
            format!("ssl_cert_file={}", self.path("server.pem").display()),
            format!("ssl_key_file={}", self.path("server.key").display()),
        ]
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // SIGQUIT: the postmaster stops its children and exits at once (a
        // SIGKILL would leave them behind).
        self.proc.stop_with("QUIT", Duration::from_secs(5));
    }
}

/// Starts `postgres` on the cluster in `dir` and waits until it accepts
/// connections on `port`.
fn spawn(
    bindir: &Path,
    dir: &Path,
    port: u16,
    as_root: bool,
    settings: &[String],
) -> Result<Proc, LocalError> {
    let log = dir.join("postgres.log");
    // A restarted server's readiness is read from its own log: the earlier
    // one is kept beside it.
    if log.is_file() {
        let _ = std::fs::rename(&log, dir.join("postgres.before.log"));
    }
    let mut cmd = as_owner(bindir.join("postgres"), as_root);
    cmd.arg("-D")
        .arg(dir.join("data"))
        .arg("-k")
        .arg(dir)
        .args(["-p", &port.to_string()])
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]);
    for setting in settings {
        cmd.args(["-c", setting]);
    }
    let mut proc = Proc::spawn_found("postgres", &mut cmd, &log)?;
    proc.wait_ready(|| {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("ready to accept connections"))
            && TcpStream::connect(("127.0.0.1", port)).is_ok()
    })?;
    Ok(proc)
}

/// Where the machine's PostgreSQL binaries are (for
/// [`PostgresServer::start_configured`]).
pub fn machine_bindir() -> Result<PathBuf, LocalError> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .find(|d| d.join("postgres").is_file() && d.join("initdb").is_file())
    });
    if let Some(dir) = on_path {
        return Ok(dir);
    }
    let debian = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(debian)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin)| bin.join("postgres").is_file())
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| LocalError::NoPostgres(format!("PATH and {}", debian.display())))
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// `program` run as the user that owns the data directory: `postgres`
/// when we are root.
fn as_owner(program: PathBuf, as_root: bool) -> Command {
    if !as_root {
        return Command::new(program);
    }
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=postgres",
        "--regid=postgres",
        "--init-groups",
        "--",
    ]);
    c.arg(program);
    c
}

/// Runs a set-up step to its end; its output is the error when it fails.
fn run(name: &'static str, cmd: &mut Command) -> Result<(), LocalError> {
    let out = cmd.output().map_err(|e| LocalError::Io(name, e))?;
    if out.status.success() {
        return Ok(());
    }
    Err(LocalError::Failed(
        name,
        format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_starts_answers_and_is_gone_after_drop() {
        let server = PostgresServer::start().unwrap();
        let port = server.port();
        assert!(server.url().ends_with(&format!(":{port}/postgres")));
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(server.log().contains("ready to accept connections"));
        drop(server);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    }

    #[test]
    fn a_missing_installation_says_what_to_install() {
        let err = PostgresServer::start_in(Path::new("/nonexistent/bin"))
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("apt-get install -y postgresql"),
            "{err}"
        );
    }
}
