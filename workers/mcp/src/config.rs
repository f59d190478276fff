//! The MCP servers a worker imports, from a TOML file:
//!
//! ```toml
//! [servers.notes]                       # the server's name: [a-z][a-z0-9_]*, ≤ 24
//! command = ["python3", "notes_server.py"]   # a stdio server, started by the worker
//! env = { NOTES_DIR = "/srv/notes" }    # set for the child (literal values)
//! pass_env = ["NOTES_TOKEN"]            # copied from the worker's environment
//! cwd = "/srv"                          # its working directory
//! timeout_ms = 30000                    # a call's timeout (the tools' `timeoutMs`)
//!
//! [servers.search]
//! url = "https://mcp.example.com/mcp"   # a streamable HTTP server
//! bearer_token_env = "SEARCH_MCP_TOKEN" # `Authorization: Bearer …` from the environment
//! init_timeout_ms = 10000               # how long `initialize` may take
//! ```
//!
//! A stdio child gets a clean environment (`PATH`, `HOME`, `LANG` and what
//! `env` and `pass_env` name): the worker's own credentials never reach it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The longest server name (the tool namespace is `mcp_<name>`).
pub const MAX_SERVER_NAME: usize = 24;

/// Why a configuration file was refused.
#[derive(Debug, thiserror::Error)]
#[error("MCP configuration {path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

/// Every server, by name.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    #[serde(default)]
    pub servers: BTreeMap<String, ServerSpec>,
}

/// One MCP server: a command (stdio) or a URL (streamable HTTP).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub pass_env: Vec<String>,
    pub cwd: Option<PathBuf>,
    pub url: Option<String>,
    pub bearer_token_env: Option<String>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "default_init_timeout_ms")]
    pub init_timeout_ms: u64,
}

fn default_timeout_ms() -> u64 {
    30_000
}

fn default_init_timeout_ms() -> u64 {
    10_000
}

/// How the worker reaches a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Stdio { program: String, args: Vec<String> },
    Http { url: String },
}

impl ServerSpec {
    /// Its transport (checked by [`McpConfig::check`]).
    pub fn transport(&self) -> Transport {
        match (&self.url, self.command.split_first()) {
            (Some(url), _) => Transport::Http { url: url.clone() },
            (None, Some((program, args))) => Transport::Stdio {
                program: program.clone(),
                args: args.to_vec(),
            },
            (None, None) => Transport::Stdio {
                program: String::new(),
                args: Vec::new(),
            },
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    pub fn init_timeout(&self) -> Duration {
        Duration::from_millis(self.init_timeout_ms)
    }
}

impl McpConfig {
    /// Reads and checks `path`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file and the first problem.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let err = |message: String| ConfigError {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let config: McpConfig = toml::from_str(&text).map_err(|e| err(e.to_string()))?;
        config.check().map_err(err)?;
        Ok(config)
    }

    /// Every server has a valid name and exactly one transport, with sane
    /// timeouts.
    ///
    /// # Errors
    ///
    /// What is wrong, naming the server.
    pub fn check(&self) -> Result<(), String> {
        if self.servers.is_empty() {
            return Err("no [servers.<name>] table".into());
        }
        for (name, s) in &self.servers {
            let valid = name.len() <= MAX_SERVER_NAME
                && name.starts_with(|c: char| c.is_ascii_lowercase())
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !valid {
                return Err(format!(
                    "server name {name:?} is not [a-z][a-z0-9_]* of at most {MAX_SERVER_NAME} characters"
                ));
            }
            match (&s.url, s.command.is_empty()) {
                (Some(_), false) => {
                    return Err(format!(
                        "server {name}: give `command` (stdio) or `url` (HTTP), not both"
                    ));
                }
                (None, true) => {
                    return Err(format!(
                        "server {name}: give `command` (stdio) or `url` (HTTP)"
                    ));
                }
                (Some(url), true) => {
                    let Some(rest) = url
                        .strip_prefix("https://")
                        .or_else(|| url.strip_prefix("http://"))
                    else {
                        return Err(format!("server {name}: url must be http(s)"));
                    };
                    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
                    if authority.contains('@') {
                        return Err(format!(
                            "server {name}: the url carries credentials; use bearer_token_env"
                        ));
                    }
                    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
                    let loopback = matches!(host, "localhost" | "127.0.0.1" | "[::1]");
                    if s.bearer_token_env.is_some() && url.starts_with("http://") && !loopback {
                        return Err(format!(
                            "server {name}: a bearer token goes over https only (or to loopback)"
                        ));
                    }
                }
                (None, false) => {}
            }
            if s.bearer_token_env.is_some() && s.url.is_none() {
                return Err(format!(
                    "server {name}: bearer_token_env applies to an HTTP server only"
                ));
            }
            if !(100..=3_600_000).contains(&s.timeout_ms)
                || !(100..=600_000).contains(&s.init_timeout_ms)
            {
                return Err(format!(
                    "server {name}: timeout_ms must be 100..=3600000 and init_timeout_ms 100..=600000"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<McpConfig, String> {
        let c: McpConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.check()?;
        Ok(c)
    }

    #[test]
    fn the_shipped_example_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/mcp.example.toml");
        let c = McpConfig::load(&path).unwrap();
        assert!(c.servers.contains_key("search"), "{c:?}");
    }

    #[test]
    fn servers_are_stdio_or_http_with_valid_names() {
        let c = parse(
            r#"
[servers.notes]
command = ["python3", "notes.py"]
pass_env = ["NOTES_TOKEN"]
[servers.search]
url = "https://mcp.example.com/mcp"
bearer_token_env = "T"
"#,
        )
        .unwrap();
        assert_eq!(
            c.servers["notes"].transport(),
            Transport::Stdio {
                program: "python3".into(),
                args: vec!["notes.py".into()]
            }
        );
        assert_eq!(c.servers["search"].timeout(), Duration::from_secs(30));
        for (bad, why) in [
            ("[servers.Notes]\ncommand = [\"x\"]", "server name"),
            ("[servers.n]\n", "give `command`"),
            (
                "[servers.n]\ncommand = [\"x\"]\nurl = \"http://a\"",
                "not both",
            ),
            ("[servers.n]\nurl = \"ftp://a\"", "http(s)"),
            ("[servers.n]\nurl = \"https://u:p@a/mcp\"", "credentials"),
            (
                "[servers.n]\nurl = \"http://mcp.example.com/mcp\"\nbearer_token_env = \"T\"",
                "https only",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\nbearer_token_env = \"T\"",
                "HTTP server only",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\ntimeout_ms = 1",
                "timeout_ms",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\nshell = true",
                "unknown field",
            ),
            ("", "no [servers"),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
