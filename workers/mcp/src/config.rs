//! The MCP servers a worker imports, from a TOML file:
//!
//! ```toml
//! [servers.notes]                       # the server's name: [a-z][a-z0-9_]*, ≤ 24
//! command = ["python3", "notes_server.py"]   # a stdio server, started by the worker
//! env = { NOTES_DIR = "/srv/notes" }    # set for the child (literal values)
//! env_files = { NOTES_TOKEN = "/run/secrets/notes_token" }  # set for the child, read from files
//! pass_env = ["NOTES_LANG"]             # copied from the worker's environment (no secrets: use env_files)
//! cwd = "/srv"                          # its working directory
//! run_as = { uid = 65534, gid = 65534 } # the child's user and group (the worker must be root)
//! per_tenant = true                     # one child per tenant, started on its first call
//! max_children = 8                      # per_tenant: children at once (the least recently used idle one is closed)
//! timeout_ms = 30000                    # a call's timeout (the tools' `timeoutMs`)
//! tenants = ["acme"]                    # who may call its tools (absent: ["*"], every tenant)
//! trusted = false                       # true: its tools need no approval whatever their hints
//! max_description_chars = 2000          # a longer tool description: the tool is refused
//! max_schema_bytes = 16384              # a larger input schema (JSON): the tool is refused
//! accept = { lookup = "5f0c…" }         # the digests the operator accepted, per MCP tool name
//!
//! [servers.search]
//! url = "https://mcp.example.com/mcp"   # a streamable HTTP server
//! bearer_token_file = "/run/secrets/search_mcp_token"  # `Authorization: Bearer …` from a file
//! # bearer_token_env = "SEARCH_MCP_TOKEN"              # … or from the environment
//! init_timeout_ms = 10000               # how long `initialize` may take
//!
//! [servers.files]
//! url = "https://files.example.com/mcp"
//! [servers.files.oauth]                 # OAuth 2.1 client credentials (instead of a bearer token)
//! issuer = "https://auth.example.com"   # the only authorization server the secret goes to (or token_endpoint)
//! client_id = "toolfleet"
//! client_secret_file = "/run/secrets/files_client_secret"  # or client_secret_env
//! # scope = "files:read"
//! [servers.files.oauth.tenants.acme]    # acme's own client (its tokens are acme's)
//! client_id = "toolfleet-acme"
//! client_secret_file = "/run/secrets/files_acme_secret"
//! ```
//!
//! A stdio child gets an explicit environment — `PATH`, `HOME`, `LANG`,
//! `LC_ALL`, `TMPDIR`, what `env`, `env_files` and `pass_env` name, and
//! (with `per_tenant`) `TOOLFLEET_TENANT` — never the worker's own: its
//! credentials never reach the child. See `docs/mcp.md` for approvals
//! (`trusted`), digests (`accept`) and tenants.

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
    /// Variables of the child whose values are read from files (at each
    /// start of the child): secrets never sit in the worker's environment.
    #[serde(default)]
    pub env_files: BTreeMap<String, PathBuf>,
    pub cwd: Option<PathBuf>,
    /// The child's uid and gid (the worker must be allowed to switch:
    /// root, or `CAP_SETUID` and `CAP_SETGID`).
    pub run_as: Option<RunAs>,
    /// One child per tenant, each started on its tenant's first call.
    #[serde(default)]
    pub per_tenant: bool,
    /// With `per_tenant`: how many tenants' children run at once.
    #[serde(default = "default_max_children")]
    pub max_children: usize,
    pub url: Option<String>,
    pub bearer_token_env: Option<String>,
    /// A file holding the bearer token (instead of `bearer_token_env`).
    pub bearer_token_file: Option<PathBuf>,
    /// OAuth 2.1 client credentials for an HTTP server (instead of a
    /// bearer token): tokens are obtained per tenant.
    pub oauth: Option<OAuthSpec>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "default_init_timeout_ms")]
    pub init_timeout_ms: u64,
    /// The tenants that may call the server's tools (`"*"`: every tenant).
    #[serde(default = "every_tenant")]
    pub tenants: Vec<String>,
    /// The operator trusts the server: its tools need no approval, whatever
    /// their hints say.
    #[serde(default)]
    pub trusted: bool,
    /// The longest tool description taken, in characters.
    #[serde(default = "default_max_description_chars")]
    pub max_description_chars: usize,
    /// The largest input schema taken, in bytes of JSON.
    #[serde(default = "default_max_schema_bytes")]
    pub max_schema_bytes: usize,
    /// Digests the operator accepted, by MCP tool name (one or several): a
    /// tool listed here is served only while its digest is one of them.
    #[serde(default)]
    pub accept: BTreeMap<String, Accepted>,
}

/// An OAuth 2.1 client of an HTTP server: the default one, and others for
/// some tenants.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuthSpec {
    /// The authorization server trusted with the secrets: its metadata
    /// must name this issuer, and the protected resource must name it
    /// among its authorization servers. Required unless `token_endpoint`
    /// is given.
    pub issuer: Option<String>,
    /// The token endpoint, when the operator names it (then no
    /// authorization-server metadata is needed); else the issuer's.
    pub token_endpoint: Option<String>,
    pub client_id: String,
    /// A file holding the client secret (read at each token request).
    pub client_secret_file: Option<PathBuf>,
    /// A variable of the worker's holding the client secret.
    pub client_secret_env: Option<String>,
    /// The scope asked for (space-separated); absent: the protected
    /// resource's `scopes_supported`, when it lists any.
    pub scope: Option<String>,
    /// Tenants with a client of their own.
    #[serde(default)]
    pub tenants: BTreeMap<String, OAuthClient>,
}

/// One OAuth client: its id, where its secret is, the scope it asks for.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuthClient {
    pub client_id: String,
    pub client_secret_file: Option<PathBuf>,
    pub client_secret_env: Option<String>,
    pub scope: Option<String>,
}

impl OAuthSpec {
    /// The client `tenant` uses (the default one for listing, `None`).
    pub fn client_for(&self, tenant: Option<&str>) -> OAuthClient {
        match tenant.and_then(|t| self.tenants.get(t)) {
            Some(client) => client.clone(),
            None => OAuthClient {
                client_id: self.client_id.clone(),
                client_secret_file: self.client_secret_file.clone(),
                client_secret_env: self.client_secret_env.clone(),
                scope: self.scope.clone(),
            },
        }
    }

    /// The authorization server is named (an https URL, or http to
    /// loopback); every client has an id and exactly one place for its
    /// secret.
    fn check(&self) -> Result<(), String> {
        if self.issuer.is_none() && self.token_endpoint.is_none() {
            return Err(
                "oauth: give issuer (the authorization server trusted with the secret) or token_endpoint"
                    .into(),
            );
        }
        for (key, value) in [
            ("issuer", &self.issuer),
            ("token_endpoint", &self.token_endpoint),
        ] {
            if let Some(value) = value {
                let ok = url::Url::parse(value).is_ok_and(|u| {
                    u.scheme() == "https" || (u.scheme() == "http" && is_loopback(&u))
                });
                if !ok {
                    return Err(format!(
                        "oauth.{key} {value:?} is not an https URL (or http to loopback)"
                    ));
                }
            }
        }
        let clients = std::iter::once((String::from("oauth"), self.client_for(None))).chain(
            self.tenants
                .iter()
                .map(|(t, c)| (format!("oauth.tenants.{t}"), c.clone())),
        );
        for (key, c) in clients {
            if c.client_id.is_empty() {
                return Err(format!("{key}: client_id is empty"));
            }
            if c.client_secret_file.is_some() == c.client_secret_env.is_some() {
                return Err(format!(
                    "{key}: give client_secret_file or client_secret_env (one of them)"
                ));
            }
        }
        Ok(())
    }
}

/// Whether `url`'s host is loopback (`localhost`, 127/8, `::1`).
pub fn is_loopback(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// A child's user and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

/// One accepted digest, or several (while an operator rolls a server).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Accepted {
    One(String),
    Many(Vec<String>),
}

impl Accepted {
    /// Whether `digest` is accepted.
    pub fn accepts(&self, digest: &str) -> bool {
        match self {
            Self::One(d) => d == digest,
            Self::Many(ds) => ds.iter().any(|d| d == digest),
        }
    }
}

fn default_max_children() -> usize {
    8
}

fn every_tenant() -> Vec<String> {
    vec!["*".into()]
}

fn default_max_description_chars() -> usize {
    2000
}

fn default_max_schema_bytes() -> usize {
    16 * 1024
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

    /// Whether `tenant` may call the server's tools.
    pub fn allows(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == "*" || t == tenant)
    }

    /// The tenants as a tool definition advertises them: empty for every
    /// tenant.
    pub fn advertised_tenants(&self) -> Vec<String> {
        if self.tenants.iter().any(|t| t == "*") {
            Vec::new()
        } else {
            self.tenants.clone()
        }
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
                    let bearer = s.bearer_token_env.is_some()
                        || s.bearer_token_file.is_some()
                        || s.oauth.is_some();
                    if bearer && url.starts_with("http://") && !loopback {
                        return Err(format!(
                            "server {name}: a bearer token (or OAuth) goes over https only (or to loopback)"
                        ));
                    }
                }
                (None, false) => {}
            }
            let bearer = s.bearer_token_env.is_some() || s.bearer_token_file.is_some();
            if let Some(oauth) = &s.oauth {
                if s.url.is_none() || bearer {
                    return Err(format!(
                        "server {name}: oauth applies to an HTTP server without a bearer token"
                    ));
                }
                oauth.check().map_err(|e| format!("server {name}: {e}"))?;
            }
            if bearer && s.url.is_none() {
                return Err(format!(
                    "server {name}: bearer_token_env and bearer_token_file apply to an HTTP server only"
                ));
            }
            if s.bearer_token_env.is_some() && s.bearer_token_file.is_some() {
                return Err(format!(
                    "server {name}: give bearer_token_env or bearer_token_file, not both"
                ));
            }
            check_stdio_only(name, s)?;
            check_tenants(name, &s.tenants)?;
            if s.max_children == 0 || s.max_description_chars == 0 || s.max_schema_bytes == 0 {
                return Err(format!(
                    "server {name}: max_children, max_description_chars and max_schema_bytes must be above 0"
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

/// What applies to a child process only is not given for an HTTP server.
fn check_stdio_only(name: &str, s: &ServerSpec) -> Result<(), String> {
    let stdio_only = [
        ("env_files", !s.env_files.is_empty()),
        ("run_as", s.run_as.is_some()),
        ("per_tenant", s.per_tenant),
    ];
    match stdio_only.iter().find(|(_, given)| *given) {
        Some((key, _)) if s.url.is_some() => Err(format!(
            "server {name}: {key} applies to a stdio server only"
        )),
        _ => Ok(()),
    }
}

/// `tenants` is `["*"]` or tenant names.
fn check_tenants(name: &str, tenants: &[String]) -> Result<(), String> {
    if tenants.is_empty() {
        return Err(format!(
            "server {name}: tenants is empty (no tenant could call it); give [\"*\"] or names"
        ));
    }
    for t in tenants {
        let valid = t == "*"
            || (!t.is_empty()
                && t.len() <= 64
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'));
        if !valid {
            return Err(format!(
                "server {name}: tenant {t:?} is not \"*\" or 1-64 of [A-Za-z0-9_-]"
            ));
        }
    }
    Ok(())
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
        // Every tenant by default; trusted only when the operator says so.
        assert!(c.servers["notes"].allows("globex") && !c.servers["notes"].trusted);
        assert!(c.servers["notes"].advertised_tenants().is_empty());
        let c = parse(
            "[servers.n]\ncommand = [\"x\"]\ntenants = [\"globex\"]\nrun_as = { uid = 65534, gid = 65534 }\n\
             per_tenant = true\naccept = { a = \"d1\", b = [\"d2\", \"d3\"] }\n",
        )
        .unwrap();
        let n = &c.servers["n"];
        assert!(n.allows("globex") && !n.allows("acme"));
        assert_eq!(n.advertised_tenants(), ["globex"]);
        assert_eq!(
            n.run_as,
            Some(RunAs {
                uid: 65534,
                gid: 65534
            })
        );
        assert!(
            n.accept["a"].accepts("d1")
                && n.accept["b"].accepts("d3")
                && !n.accept["b"].accepts("d1")
        );
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
                "[servers.n]\nurl = \"https://a/mcp\"\nper_tenant = true",
                "stdio server only",
            ),
            (
                "[servers.n]\nurl = \"https://a/mcp\"\nbearer_token_env = \"T\"\nbearer_token_file = \"/t\"",
                "not both",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\ntenants = []",
                "tenants is empty",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\ntenants = [\"a.b\"]",
                "tenant \"a.b\"",
            ),
            (
                "[servers.n]\ncommand = [\"x\"]\nmax_children = 0",
                "above 0",
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

    #[test]
    fn the_documented_example_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/mcp.md");
        let text = std::fs::read_to_string(path).unwrap();
        let start = text.find("```toml mcp-config\n").unwrap() + "```toml mcp-config\n".len();
        let end = start + text[start..].find("```").unwrap();
        let c = parse(&text[start..end]).unwrap();
        let oauth = c.servers["files"].oauth.clone().unwrap();
        assert_eq!(oauth.client_for(Some("acme")).client_id, "toolfleet-acme");
        assert_eq!(oauth.client_for(Some("globex")).client_id, "toolfleet");
        assert_eq!(oauth.client_for(None).client_id, "toolfleet");
    }

    #[test]
    fn an_oauth_client_is_for_an_http_server_with_one_secret() {
        let http = "[servers.n]\nurl = \"https://a/mcp\"\n";
        let issued =
            |rest: &str| format!("{http}[servers.n.oauth]\nissuer = \"https://as\"\n{rest}");
        assert!(parse(&issued("client_id = \"c\"\nclient_secret_env = \"S\"")).is_ok());
        assert!(
            parse(&format!(
                "{http}[servers.n.oauth]\ntoken_endpoint = \"https://as/token\"\nclient_id = \"c\"\nclient_secret_env = \"S\""
            ))
            .is_ok()
        );
        for (bad, why) in [
            (
                "[servers.n]\ncommand = [\"x\"]\n[servers.n.oauth]\nissuer = \"https://as\"\nclient_id = \"c\"\nclient_secret_env = \"S\"".to_string(),
                "oauth applies to an HTTP server",
            ),
            (
                "[servers.n]\nurl = \"https://a/mcp\"\nbearer_token_env = \"T\"\n[servers.n.oauth]\nissuer = \"https://as\"\nclient_id = \"c\"\nclient_secret_env = \"S\"".to_string(),
                "without a bearer token",
            ),
            (
                format!("{http}[servers.n.oauth]\nclient_id = \"c\"\nclient_secret_env = \"S\""),
                "give issuer",
            ),
            (
                issued("client_id = \"c\"\nclient_secret_env = \"S\"").replace("https://as", "http://as.example.com"),
                "oauth.issuer",
            ),
            (issued("client_id = \"c\""), "give client_secret_file or client_secret_env"),
            (
                issued("client_id = \"c\"\nclient_secret_env = \"S\"\nclient_secret_file = \"/s\""),
                "give client_secret_file or client_secret_env",
            ),
            (
                issued(
                    "client_id = \"c\"\nclient_secret_env = \"S\"\n[servers.n.oauth.tenants.acme]\nclient_id = \"\"\nclient_secret_env = \"A\"",
                ),
                "oauth.tenants.acme: client_id is empty",
            ),
            (
                "[servers.n]\nurl = \"http://mcp.example.com/mcp\"\n[servers.n.oauth]\nissuer = \"https://as\"\nclient_id = \"c\"\nclient_secret_env = \"S\"".to_string(),
                "https only",
            ),
        ] {
            let e = parse(&bad).expect_err(&bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
