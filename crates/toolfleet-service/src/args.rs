//! Configuration parts shared by the binaries, read from flags and
//! environment variables (`ENV_*` names beside `DEFAULT_*` values), parsed
//! into typed values before any work starts. Each binary composes the parts
//! it needs; there is no `Default` for a whole binary's configuration.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub use crate::redis_args::{DEFAULT_REDIS_URL, ENV_REDIS_URL, RedisArgs};
use toolfleet_protocol::redact_url;

pub const ENV_NATS_URL: &str = "TOOLFLEET_NATS_URL";
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
pub const ENV_SUBJECT_PREFIX: &str = "TOOLFLEET_SUBJECT_PREFIX";
pub const ENV_TOOL_DEFINITIONS: &str = "TOOLFLEET_TOOL_DEFINITIONS";
pub const DEFAULT_TOOL_DEFINITIONS: &str = "tool_definitions";
pub const ENV_METRICS_ADDR: &str = "TOOLFLEET_METRICS_ADDR";
pub const ENV_LOG: &str = "TOOLFLEET_LOG";

/// Exit code for a configuration error (EX_USAGE).
pub const EXIT_CONFIG: i32 = 64;

/// Where NATS is and which subject prefix the fleet uses.
#[derive(Args, Debug, Clone)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(id = "nats_url", long = "nats-url", env = ENV_NATS_URL, default_value = DEFAULT_NATS_URL, hide_env_values = true)]
    pub url: String,
    /// Prefix of every subject (and, upper-cased, of the stream names):
    /// tokens of lowercase letters, digits and `-`, joined by `.`.
    #[arg(long = "subject-prefix", env = ENV_SUBJECT_PREFIX, default_value = toolfleet_protocol::DEFAULT_PREFIX)]
    pub prefix: String,
    /// How long to keep trying the first connection, in seconds.
    #[arg(
        long = "nats-connect-wait",
        env = "TOOLFLEET_NATS_CONNECT_WAIT",
        default_value_t = 30
    )]
    pub connect_wait_secs: u64,
}

impl NatsArgs {
    pub fn subjects(
        &self,
    ) -> Result<toolfleet_protocol::Subjects, toolfleet_protocol::ProtocolError> {
        toolfleet_protocol::Subjects::new(&self.prefix)
    }

    /// Connects, retrying the first connection for `connect_wait_secs`
    /// (processes of a fleet start in any order).
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        connect_nats(&self.url, name, Duration::from_secs(self.connect_wait_secs)).await
    }
}

/// Connects to NATS, retrying the first connection for up to `wait`. (Not
/// `retry_on_initial_connect`: with it `connect` returns at once and every
/// later call waits forever on a server that never comes.)
pub async fn connect_nats(
    url: &str,
    name: &str,
    wait: Duration,
) -> anyhow::Result<async_nats::Client> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let opts = async_nats::ConnectOptions::new()
            .name(name)
            .connection_timeout(Duration::from_secs(2));
        match opts.connect(url).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(anyhow::anyhow!(
                    "cannot connect to NATS at {} (tried for {}s): {e}",
                    redact_url(url),
                    wait.as_secs()
                ));
            }
            Err(e) => {
                tracing::debug!(error = %e, "NATS not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// Where the tool definition files are.
#[derive(Args, Debug, Clone)]
pub struct ToolDefsArgs {
    /// Directory of tool definition files (one JSON file per tool).
    #[arg(long = "tool-definitions", env = ENV_TOOL_DEFINITIONS, default_value = DEFAULT_TOOL_DEFINITIONS)]
    pub dir: PathBuf,
}

/// Parses the command line, exiting with [`EXIT_CONFIG`] on a bad value
/// (0 for `--help` / `--version`).
pub fn parse_or_exit<T: clap::Parser>() -> T {
    T::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() { EXIT_CONFIG } else { 0 })
    })
}

/// The value, or exit with [`EXIT_CONFIG`] naming the configuration error
/// (a bad prefix, a missing profiles file, unreadable tool definitions).
pub fn or_exit<T>(r: anyhow::Result<T>) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("configuration error: {e:#}");
        std::process::exit(EXIT_CONFIG)
    })
}

/// Installs the tracing subscriber (`TOOLFLEET_LOG`, default `info`).
pub fn init_tracing() {
    init_tracing_with("info");
}

/// Installs the tracing subscriber with `default` as the filter when
/// `TOOLFLEET_LOG` is not set (interactive commands use `warn`).
pub fn init_tracing_with(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env(ENV_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://:hunter2@host:6379/0"),
            "redis://:***@host:6379/0"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(
            redact_url("nats://s3cr3t-token@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_url("nats://user:pw@host:4222"),
            "nats://***:***@host:4222"
        );
        assert!(!redact_url("not a url hunter2").contains("hunter2"));
    }
}
