//! Configuration parts shared by the binaries, read from flags and
//! environment variables (`ENV_*` names beside `DEFAULT_*` values), parsed
//! into typed values before any work starts. Each binary composes the parts
//! it needs; there is no `Default` for a whole binary's configuration.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use toolfleet_protocol::redact_url;

use crate::nats_context;

pub const ENV_NATS_URL: &str = "TOOLFLEET_NATS_URL";
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
pub const ENV_SUBJECT_PREFIX: &str = "TOOLFLEET_SUBJECT_PREFIX";
pub const ENV_TOOL_DEFINITIONS: &str = "TOOLFLEET_TOOL_DEFINITIONS";
pub const DEFAULT_TOOL_DEFINITIONS: &str = "tool_definitions";
pub const ENV_METRICS_ADDR: &str = "TOOLFLEET_METRICS_ADDR";
pub use crate::telemetry::ENV_LOG;

/// Exit code for a configuration error (EX_USAGE).
pub const EXIT_CONFIG: i32 = 64;

pub const ENV_NATS_USER: &str = "TOOLFLEET_NATS_USER";
pub const ENV_NATS_PASSWORD: &str = "TOOLFLEET_NATS_PASSWORD";
pub const ENV_NATS_TOKEN: &str = "TOOLFLEET_NATS_TOKEN";
/// A file holding the NATS password (so it never sits in the environment).
pub const ENV_NATS_PASSWORD_FILE: &str = "TOOLFLEET_NATS_PASSWORD_FILE";
/// A file holding the NATS token.
pub const ENV_NATS_TOKEN_FILE: &str = "TOOLFLEET_NATS_TOKEN_FILE";
pub const ENV_NATS_NKEY: &str = "TOOLFLEET_NATS_NKEY";
pub const ENV_NATS_CREDS: &str = "TOOLFLEET_NATS_CREDS";
pub const ENV_NATS_TLS_CA: &str = "TOOLFLEET_NATS_TLS_CA";
pub const ENV_NATS_TLS_CERT: &str = "TOOLFLEET_NATS_TLS_CERT";
pub const ENV_NATS_TLS_KEY: &str = "TOOLFLEET_NATS_TLS_KEY";
pub const ENV_NATS_TLS_REQUIRED: &str = "TOOLFLEET_NATS_TLS_REQUIRED";
pub const ENV_NATS_INBOX_PREFIX: &str = "TOOLFLEET_NATS_INBOX_PREFIX";
pub const ENV_STREAM_REPLICAS: &str = "TOOLFLEET_STREAM_REPLICAS";
pub const DEFAULT_STREAM_REPLICAS: usize = 1;

/// A secret setting (a password, a token): its `Debug` never shows it, so
/// neither does a logged configuration.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that hands it to a client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

/// Where NATS is, who we are to it, and which subject prefix the fleet
/// uses.
///
/// One identity at a time: user and password (or a password file), a
/// token (or a token file), an NKey seed file, or a `.creds` file (user JWT + seed, for servers in operator mode). TLS
/// is independent of the identity: a CA to trust, a client certificate for
/// servers that verify clients, or TLS required even when the server does
/// not ask for it (`tls://` URLs require it too). Secrets are never logged
/// and no error names them.
#[derive(Args, Debug, Clone)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated [default: `$NATS_URL`, else
    /// the `nats` CLI's selected context's, else nats://127.0.0.1:4222].
    #[arg(id = "nats_url", long = "nats-url", env = ENV_NATS_URL, hide_env_values = true)]
    pub url: Option<String>,
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
    /// NATS user name (with `--nats-password` or `--nats-password-file`).
    #[arg(long = "nats-user", env = ENV_NATS_USER, requires = "nats_user_secret",
          conflicts_with_all = ["nats_token", "nats_token_file", "nats_nkey", "nats_creds"])]
    pub user: Option<String>,
    /// NATS password of `--nats-user`.
    #[arg(id = "nats_password", long = "nats-password", env = ENV_NATS_PASSWORD,
          hide_env_values = true, requires = "user", group = "nats_user_secret")]
    pub password: Option<Secret>,
    /// A file holding the NATS password of `--nats-user`, instead of
    /// `--nats-password` (the password then never sits in the environment).
    #[arg(id = "nats_password_file", long = "nats-password-file", env = ENV_NATS_PASSWORD_FILE,
          requires = "user", group = "nats_user_secret")]
    pub password_file: Option<PathBuf>,
    /// NATS authentication token.
    #[arg(id = "nats_token", long = "nats-token", env = ENV_NATS_TOKEN, hide_env_values = true,
          conflicts_with_all = ["nats_token_file", "nats_nkey", "nats_creds"])]
    pub token: Option<Secret>,
    /// A file holding the NATS token, instead of `--nats-token`.
    #[arg(id = "nats_token_file", long = "nats-token-file", env = ENV_NATS_TOKEN_FILE,
          conflicts_with_all = ["nats_nkey", "nats_creds"])]
    pub token_file: Option<PathBuf>,
    /// File holding an NKey user seed (`SU…`): the server knows the public key.
    #[arg(id = "nats_nkey", long = "nats-nkey", env = ENV_NATS_NKEY, conflicts_with = "nats_creds")]
    pub nkey_seed_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and NKey seed), for servers in operator
    /// mode [default, when no other identity is given: `$NATS_CREDS`, else
    /// the `nats` CLI's selected context's identity].
    #[arg(id = "nats_creds", long = "nats-creds", env = ENV_NATS_CREDS)]
    pub creds_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the server's certificate.
    #[arg(long = "nats-tls-ca", env = ENV_NATS_TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with
    /// `--nats-tls-key`).
    #[arg(long = "nats-tls-cert", env = ENV_NATS_TLS_CERT, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--nats-tls-cert`.
    #[arg(long = "nats-tls-key", env = ENV_NATS_TLS_KEY, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    #[arg(long = "nats-tls-required", env = ENV_NATS_TLS_REQUIRED)]
    pub tls_required: bool,
    /// Prefix of this process's own request inboxes (JetStream API answers,
    /// pulled jobs, publish acks) instead of `_INBOX`: with one prefix per
    /// role, a server's permissions keep one role from reading another's
    /// inboxes (see ops/nats/).
    #[arg(long = "nats-inbox-prefix", env = ENV_NATS_INBOX_PREFIX)]
    pub inbox_prefix: Option<String>,
    /// Replicas of the streams and the catalog bucket this process creates
    /// (3 on a 3-node cluster; existing streams keep theirs).
    #[arg(long = "stream-replicas", env = ENV_STREAM_REPLICAS, default_value_t = DEFAULT_STREAM_REPLICAS,
          value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u8).range(1..=5), usize::from))]
    pub stream_replicas: usize,
}

impl NatsArgs {
    /// Settings for `url` with the defaults of everything else (no
    /// identity, no TLS, the default prefix): for tests and local fleets.
    pub fn for_url(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            prefix: toolfleet_protocol::DEFAULT_PREFIX.to_string(),
            connect_wait_secs: 30,
            user: None,
            password: None,
            password_file: None,
            token: None,
            token_file: None,
            nkey_seed_file: None,
            creds_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            inbox_prefix: None,
            stream_replicas: DEFAULT_STREAM_REPLICAS,
        }
    }

    /// The server URL(s): `--nats-url` (or `TOOLFLEET_NATS_URL`), else
    /// the default; [`NatsArgs::with_fallbacks`] fills it from the
    /// standard settings first.
    pub fn url(&self) -> &str {
        self.url.as_deref().unwrap_or(DEFAULT_NATS_URL)
    }

    /// These settings with what the flags and `TOOLFLEET_NATS_*` left
    /// unset taken from the standard ones ([`crate::nats_context`]): the
    /// URL from `NATS_URL`, else the `nats` CLI's selected context; when
    /// no identity is given at all (no user, password, token, NKey,
    /// `.creds` nor one in the URL), `NATS_CREDS`, else the context's
    /// identity; the context's TLS files when none are given, its inbox
    /// prefix when none is. `vars` is the environment (the process's in
    /// binaries, a map in tests).
    ///
    /// # Errors
    ///
    /// [`BadConfig`] when the context that would be used cannot be read.
    pub fn with_fallbacks(&self, vars: &dyn nats_context::Vars) -> Result<Self, BadConfig> {
        use nats_context::ContextIdentity as Id;
        let mut out = self.clone();
        // Read only when something is left to take from it.
        let mut context: Option<Option<nats_context::NatsContext>> = None;
        let mut context = || -> Result<Option<nats_context::NatsContext>, BadConfig> {
            if context.is_none() {
                context = Some(nats_context::selected(vars)?);
            }
            Ok(context.clone().flatten())
        };
        if out.url.is_none() {
            out.url = match nats_context::set(vars, nats_context::ENV_NATS_URL) {
                Some(url) => Some(url),
                None => context()?.and_then(|c| c.url().map(str::to_owned)),
            };
        }
        if !out.has_identity() {
            if let Some(creds) = nats_context::set(vars, nats_context::ENV_NATS_CREDS) {
                out.creds_file = Some(creds.into());
            } else if let Some(c) = context()? {
                match c.identity(vars)? {
                    Some(Id::UserPassword(user, password)) => {
                        out.user = Some(user);
                        out.password = Some(Secret(password));
                    }
                    Some(Id::Creds(path)) => out.creds_file = Some(path),
                    Some(Id::NKeySeedFile(path)) => out.nkey_seed_file = Some(path),
                    Some(Id::Token(token)) => out.token = Some(Secret(token)),
                    None => {}
                }
            }
        }
        if out.tls_ca.is_none()
            && out.tls_cert.is_none()
            && let Some(c) = context()?
        {
            let (ca, cert) = c.tls(vars);
            out.tls_ca = ca;
            (out.tls_cert, out.tls_key) = cert.unzip();
        }
        if out.inbox_prefix.is_none()
            && let Some(c) = context()?
        {
            out.inbox_prefix = c.inbox_prefix().map(str::to_owned);
        }
        Ok(out)
    }

    /// Whether any identity is given: a flag or `TOOLFLEET_NATS_*`
    /// variable, or credentials in the URL.
    fn has_identity(&self) -> bool {
        self.user.is_some()
            || self.password.is_some()
            || self.password_file.is_some()
            || self.token.is_some()
            || self.token_file.is_some()
            || self.nkey_seed_file.is_some()
            || self.creds_file.is_some()
            || self.url.as_deref().and_then(url_identity).is_some()
    }

    pub fn subjects(
        &self,
    ) -> Result<toolfleet_protocol::Subjects, toolfleet_protocol::ProtocolError> {
        toolfleet_protocol::Subjects::new(&self.prefix)
    }

    /// Connects with this identity and TLS, retrying the first connection
    /// for `connect_wait_secs` (processes of a fleet start in any order).
    /// Also makes `--stream-replicas` the replica count of the streams this
    /// process creates.
    ///
    /// # Errors
    ///
    /// An unreadable seed, credentials or TLS file, credentials the server
    /// refuses (at once: they will not get better), or no server within
    /// the wait.
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        self.connect_inner(name, self.inbox_prefix.as_deref()).await
    }

    /// [`NatsArgs::connect`] with request inboxes under `prefix` (whatever
    /// `--nats-inbox-prefix` says).
    pub async fn connect_with_inbox(
        &self,
        name: &str,
        prefix: &str,
    ) -> anyhow::Result<async_nats::Client> {
        self.connect_inner(name, Some(prefix)).await
    }

    async fn connect_inner(
        &self,
        name: &str,
        inbox_prefix: Option<&str>,
    ) -> anyhow::Result<async_nats::Client> {
        let resolved = self.with_fallbacks(&nats_context::ProcessVars)?;
        let inbox_prefix = inbox_prefix.or(resolved.inbox_prefix.as_deref());
        resolved.connect_resolved(name, inbox_prefix).await
    }

    async fn connect_resolved(
        &self,
        name: &str,
        inbox_prefix: Option<&str>,
    ) -> anyhow::Result<async_nats::Client> {
        toolfleet_protocol::streams::set_default_replicas(self.stream_replicas);
        if let Some(prefix) = inbox_prefix
            && !valid_inbox_prefix(prefix)
        {
            anyhow::bail!(
                "NATS inbox prefix {prefix:?}: tokens joined by `.`, without wildcards or spaces"
            );
        }
        let identity = Identity::load(self).await?;
        let tls = Tls {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone().zip(self.tls_key.clone()),
            required: self.tls_required,
        };
        tls.check()?;
        connect_with(
            self.url(),
            Duration::from_secs(self.connect_wait_secs),
            || {
                let mut opts = identity.apply(async_nats::ConnectOptions::new().name(name));
                opts = tls.apply(opts);
                if let Some(prefix) = inbox_prefix {
                    opts = opts.custom_inbox_prefix(prefix);
                }
                opts
            },
        )
        .await
    }
}

/// A subject to put request inboxes under: non-empty tokens joined by `.`,
/// no wildcard, no whitespace.
fn valid_inbox_prefix(prefix: &str) -> bool {
    prefix
        .split('.')
        .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.chars().any(char::is_whitespace))
}

/// Who a process is to NATS, read once from the files named.
enum Identity {
    Anonymous,
    UserPassword(String, Secret),
    Token(Secret),
    NKey(Secret),
    /// The contents of a `.creds` file.
    Creds(Secret),
}

impl Identity {
    async fn load(args: &NatsArgs) -> anyhow::Result<Self> {
        if let Some(path) = &args.creds_file {
            let text = read_secret_file(path, "NATS credentials").await?;
            // Checked here so a bad file is a configuration error that names
            // the file, never its contents.
            if async_nats::ConnectOptions::with_credentials(&text).is_err() {
                anyhow::bail!(
                    "NATS credentials file {} holds no user JWT and NKey seed",
                    path.display()
                );
            }
            return Ok(Self::Creds(Secret(text)));
        }
        if let Some(path) = &args.nkey_seed_file {
            let seed = read_secret_file(path, "NATS NKey seed").await?;
            let seed = seed.trim().to_string();
            if nkeys::KeyPair::from_seed(&seed).is_err() {
                anyhow::bail!("NATS NKey seed file {} holds no valid seed", path.display());
            }
            return Ok(Self::NKey(Secret(seed)));
        }
        if let Some(token) = &args.token {
            return Ok(Self::Token(token.clone()));
        }
        if let Some(path) = &args.token_file {
            let token = read_secret_file(path, "NATS token").await?;
            return Ok(Self::Token(Secret(
                token.trim_end_matches(['\n', '\r']).to_string(),
            )));
        }
        if let (Some(user), Some(password)) = (&args.user, &args.password) {
            return Ok(Self::UserPassword(user.clone(), password.clone()));
        }
        if args.user.is_none()
            && let Some(identity) = url_identity(args.url())
        {
            return Ok(identity);
        }
        if let (Some(user), Some(path)) = (&args.user, &args.password_file) {
            let password = read_secret_file(path, "NATS password").await?;
            let password = Secret(password.trim_end_matches(['\n', '\r']).to_string());
            return Ok(Self::UserPassword(user.clone(), password));
        }
        Ok(Self::Anonymous)
    }

    fn apply(&self, opts: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        match self {
            Self::Anonymous => opts,
            Self::UserPassword(user, password) => {
                opts.user_and_password(user.clone(), password.expose().to_string())
            }
            Self::Token(token) => opts.token(token.expose().to_string()),
            Self::NKey(seed) => opts.nkey(seed.expose().to_string()),
            // Parsed once in `load`; parsing the same text cannot fail.
            Self::Creds(text) => match opts.credentials(text.expose()) {
                Ok(opts) => opts,
                Err(_) => async_nats::ConnectOptions::new(),
            },
        }
    }
}

async fn read_secret_file(path: &std::path::Path, what: &str) -> anyhow::Result<String> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|e| anyhow::anyhow!("cannot read the {what} file {}: {e}", path.display()))
}

/// TLS towards NATS.
struct Tls {
    ca: Option<PathBuf>,
    /// Client certificate and key.
    cert: Option<(PathBuf, PathBuf)>,
    required: bool,
}

impl Tls {
    /// The files must exist (the client reads them only when it connects,
    /// and would report a missing one as a connection failure).
    fn check(&self) -> anyhow::Result<()> {
        let files = self
            .ca
            .iter()
            .chain(self.cert.iter().flat_map(|(c, k)| [c, k]));
        for f in files {
            if !f.is_file() {
                anyhow::bail!("NATS TLS file {} does not exist", f.display());
            }
        }
        Ok(())
    }

    fn apply(&self, mut opts: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        if let Some(ca) = &self.ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.cert {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.required {
            opts = opts.require_tls(true);
        }
        opts
    }
}

/// Connects to NATS with no identity and no TLS, retrying the first
/// connection for up to `wait` (see [`NatsArgs::connect`] for the rest).
pub async fn connect_nats(
    url: &str,
    name: &str,
    wait: Duration,
) -> anyhow::Result<async_nats::Client> {
    let identity = url_identity(url).unwrap_or(Identity::Anonymous);
    connect_with(url, wait, || {
        identity.apply(async_nats::ConnectOptions::new().name(name))
    })
    .await
}

/// The identity a NATS URL carries, as other NATS clients read it:
/// `nats://user:pass@host` a user and password, `nats://token@host` a
/// token (percent-decoded); the first of a comma-separated list counts.
/// The client library itself ignores both.
fn url_identity(urls: &str) -> Option<Identity> {
    let first = urls.split(',').next()?.trim();
    let parsed = url::Url::parse(first).ok()?;
    if parsed.username().is_empty() {
        return None;
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let user = decode(parsed.username());
    Some(match parsed.password() {
        Some(password) => Identity::UserPassword(user, Secret(decode(password))),
        None => Identity::Token(Secret(user)),
    })
}

/// Connects with the options `options` builds, retrying the first
/// connection for up to `wait`. (Not `retry_on_initial_connect`: with it
/// `connect` returns at once and every later call waits forever on a server
/// that never comes.) A refusal of the credentials or a TLS failure ends the
/// wait at once.
async fn connect_with(
    url: &str,
    wait: Duration,
    options: impl Fn() -> async_nats::ConnectOptions,
) -> anyhow::Result<async_nats::Client> {
    use async_nats::ConnectErrorKind as Kind;
    let shown = url
        .split(',')
        .map(|u| redact_url(u.trim()))
        .collect::<Vec<_>>()
        .join(",");
    // `nats://a:4222,nats://b:4222`: a cluster's nodes, any one will do.
    let servers = url
        .split(',')
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| BadConfig(format!("bad NATS URL {shown}: {e}")))?;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let opts = options().connection_timeout(Duration::from_secs(2));
        match opts.connect(servers.clone()).await {
            Ok(c) => return Ok(c),
            Err(e)
                if matches!(
                    e.kind(),
                    Kind::Authentication | Kind::AuthorizationViolation
                ) =>
            {
                return Err(anyhow::anyhow!(
                    "NATS at {shown} refused this process's credentials ({})",
                    e.kind()
                ));
            }
            Err(e) if matches!(e.kind(), Kind::Tls | Kind::ServerParse) => {
                return Err(anyhow::anyhow!("cannot connect to NATS at {shown}: {e}"));
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(anyhow::anyhow!(
                    "cannot connect to NATS at {shown} (tried for {}s): {e}",
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

/// `T`'s command line, its `--version` printing `<name> <version>
/// (<revision>)` of `build`, which becomes this process's build
/// ([`crate::build::set`]).
pub fn command_of<T: clap::CommandFactory>(build: crate::build::BuildInfo) -> clap::Command {
    crate::build::set(build);
    T::command().version(crate::build::version_line())
}

/// Parses the command line into `T` ([`command_of`]); the error is
/// clap's, `--help` and `--version` included.
///
/// # Errors
///
/// A bad value, or `--help` / `--version` (printed by the caller).
pub fn try_parse<T: clap::Parser>(build: crate::build::BuildInfo) -> Result<T, clap::Error> {
    try_parse_from(build, std::env::args_os())
}

fn try_parse_from<T: clap::Parser>(
    build: crate::build::BuildInfo,
    args: impl IntoIterator<Item = impl Into<std::ffi::OsString> + Clone>,
) -> Result<T, clap::Error> {
    let mut command = command_of::<T>(build);
    let mut matches = command.try_get_matches_from_mut(args)?;
    T::from_arg_matches_mut(&mut matches).map_err(|e| e.format(&mut command))
}

/// Parses the command line ([`try_parse`]), exiting with [`EXIT_CONFIG`]
/// on a bad value (0 for `--help` / `--version`). A binary's `main` calls
/// it with `toolfleet_service::build_info!()`.
pub fn parse_or_exit<T: clap::Parser>(build: crate::build::BuildInfo) -> T {
    try_parse(build).unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() { EXIT_CONFIG } else { 0 })
    })
}

pub use crate::bad_config::BadConfig;

/// The exit code for a command's error: [`EXIT_CONFIG`] when it is a
/// [`BadConfig`] anywhere in its chain, else 1.
#[must_use]
pub fn exit_code_of(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.downcast_ref::<BadConfig>().is_some()) {
        EXIT_CONFIG
    } else {
        1
    }
}

impl NatsArgs {
    /// Checks `--nats-url` (each of its comma-separated servers) without
    /// connecting.
    ///
    /// # Errors
    ///
    /// [`BadConfig`] naming the URL, its password hidden.
    pub fn check_url(&self) -> Result<(), BadConfig> {
        let resolved = self.with_fallbacks(&nats_context::ProcessVars)?;
        for u in resolved.url().split(',') {
            if let Err(e) = u.trim().parse::<async_nats::ServerAddr>() {
                return Err(BadConfig(format!(
                    "bad NATS URL {}: {e}",
                    redact_url(u.trim())
                )));
            }
        }
        Ok(())
    }
}

/// The value, or exit with [`EXIT_CONFIG`] naming the configuration error
/// (a bad prefix, a missing profiles file, unreadable tool definitions).
pub fn or_exit<T>(r: anyhow::Result<T>) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("configuration error: {e:#}");
        std::process::exit(EXIT_CONFIG)
    })
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
    use clap::Parser;

    #[test]
    fn version_prints_the_name_the_version_and_the_revision() {
        #[derive(Parser, Debug)]
        #[command(name = "toolfleet-x")]
        struct Cli {
            #[arg(long)]
            wait: Option<u64>,
        }
        let build = crate::build_info!();
        let e = try_parse_from::<Cli>(build, ["toolfleet-x", "--version"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
        assert!(!e.use_stderr());
        // The build in force: this one, unless another test set one first.
        let line = crate::build::version_line();
        assert_eq!(e.to_string(), format!("toolfleet-x {line}\n"));
        assert!(line.starts_with(env!("CARGO_PKG_VERSION")), "{line}");
        assert!(
            try_parse_from::<Cli>(build, ["toolfleet-x", "--wait", "soon"])
                .unwrap_err()
                .use_stderr()
        );
        let parsed = try_parse_from::<Cli>(build, ["toolfleet-x", "--wait", "3"]).unwrap();
        assert_eq!(parsed.wait, Some(3));
    }

    #[test]
    fn a_urls_user_and_password_or_token_are_read_decoded() {
        let read = |url: &str| match url_identity(url) {
            Some(Identity::UserPassword(user, password)) => {
                Some(format!("user {user} {}", password.expose()))
            }
            Some(Identity::Token(token)) => Some(format!("token {}", token.expose())),
            Some(_) => Some("other".into()),
            None => None,
        };
        assert_eq!(
            read("nats://acme:p%40ss+word@127.0.0.1:4222,nats://other:x@h:1").as_deref(),
            Some("user acme p@ss+word")
        );
        assert_eq!(read("nats://127.0.0.1:4222"), None);
        assert_eq!(read("tls://s3cr%2Ft@h:1").as_deref(), Some("token s3cr/t"));
    }

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        nats: NatsArgs,
    }

    fn parse(args: &[&str]) -> Result<NatsArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.nats)
    }

    #[test]
    fn identities_and_tls_parse_and_secrets_stay_out_of_debug() {
        let a = parse(&["--nats-user", "orch", "--nats-password", "hunter2"]).unwrap();
        assert_eq!(a.user.as_deref(), Some("orch"));
        assert_eq!(a.password.as_ref().unwrap().expose(), "hunter2");
        assert!(!format!("{a:?}").contains("hunter2"), "{a:?}");
        let a = parse(&["--nats-token", "s3cr3t", "--stream-replicas", "3"]).unwrap();
        assert!(!format!("{a:?}").contains("s3cr3t"));
        assert_eq!(a.stream_replicas, 3);
        let a = parse(&[
            "--nats-tls-ca",
            "ca.pem",
            "--nats-tls-cert",
            "c.pem",
            "--nats-tls-key",
            "k.pem",
            "--nats-tls-required",
            "--nats-inbox-prefix",
            "_INBOX.client",
        ])
        .unwrap();
        assert!(a.tls_required && a.tls_key.is_some());
        assert_eq!(a.inbox_prefix.as_deref(), Some("_INBOX.client"));
        assert_eq!(parse(&[]).unwrap().stream_replicas, 1);
    }

    /// A `nats` CLI context in a temporary config directory, selected.
    fn cli_context(json: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("nats/context")).unwrap();
        std::fs::write(dir.path().join("nats/context.txt"), "ops").unwrap();
        std::fs::write(dir.path().join("nats/context/ops.json"), json).unwrap();
        dir
    }

    fn env(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Flags and `TOOLFLEET_NATS_*` (clap reads both into the same
    /// fields), then `NATS_URL` / `NATS_CREDS`, then the selected context,
    /// then the default: each setting on its own.
    #[test]
    fn nats_settings_fall_back_on_nats_url_nats_creds_then_the_cli_context() {
        let ctx = cli_context(
            r#"{"url":"nats://ctx:4222","creds":"/ctx/u.creds","ca":"/ctx/ca.pem","cert":"/ctx/c.pem","key":"/ctx/k.pem"}"#,
        );
        let xdg = ctx.path().to_str().unwrap();
        let resolved = |args: &[&str], vars: &[(&str, &str)]| {
            let mut all = vec![("XDG_CONFIG_HOME", xdg)];
            all.extend_from_slice(vars);
            parse(args).unwrap().with_fallbacks(&env(&all)).unwrap()
        };
        // Nothing given: the context's URL, identity and TLS.
        let a = resolved(&[], &[]);
        assert_eq!(a.url(), "nats://ctx:4222");
        assert_eq!(a.creds_file, Some("/ctx/u.creds".into()));
        assert_eq!(a.tls_ca, Some("/ctx/ca.pem".into()));
        assert_eq!(a.tls_key, Some("/ctx/k.pem".into()));
        // NATS_URL and NATS_CREDS before the context.
        let a = resolved(
            &[],
            &[("NATS_URL", "nats://std:1"), ("NATS_CREDS", "/std.creds")],
        );
        assert_eq!(a.url(), "nats://std:1");
        assert_eq!(a.creds_file, Some("/std.creds".into()));
        // Flags before both; an explicit identity of another kind keeps
        // the fallbacks' out entirely (no conflict made up).
        let a = resolved(
            &["--nats-url", "nats://flag:2", "--nats-token", "t0k"],
            &[("NATS_URL", "nats://std:1"), ("NATS_CREDS", "/std.creds")],
        );
        assert_eq!(a.url(), "nats://flag:2");
        assert_eq!((a.creds_file, a.token.unwrap().expose()), (None, "t0k"));
        let a = resolved(
            &["--nats-creds", "/flag.creds", "--nats-tls-ca", "/mine.pem"],
            &[],
        );
        assert_eq!(a.creds_file, Some("/flag.creds".into()));
        assert_eq!((a.tls_ca, a.tls_cert), (Some("/mine.pem".into()), None));
        // Credentials in the URL are an identity given.
        let a = resolved(
            &["--nats-url", "nats://u:p@h:1"],
            &[("NATS_CREDS", "/std.creds")],
        );
        assert_eq!(a.creds_file, None);
        // No context, nothing set: the default.
        let none = parse(&[]).unwrap().with_fallbacks(&env(&[])).unwrap();
        assert_eq!(none.url(), DEFAULT_NATS_URL);
        assert!(!none.has_identity() && none.tls_ca.is_none());
        // Blank variables are unset.
        let a = resolved(&[], &[("NATS_URL", " "), ("NATS_CREDS", "")]);
        assert_eq!(a.url(), "nats://ctx:4222");
    }

    #[test]
    fn a_contexts_user_token_or_nkey_becomes_the_identity_and_stays_out_of_debug() {
        for (json, check) in [
            (
                r#"{"user":"ops","password":"hunter2","token":"ignored"}"#,
                (|a: &NatsArgs| {
                    a.user.as_deref() == Some("ops")
                        && a.password.as_ref().map(Secret::expose) == Some("hunter2")
                        && a.token.is_none()
                }) as fn(&NatsArgs) -> bool,
            ),
            (r#"{"token":"hunter2"}"#, |a| {
                a.token.as_ref().map(Secret::expose) == Some("hunter2")
            }),
            (r#"{"nkey":"/k/u.nk"}"#, |a| {
                a.nkey_seed_file == Some("/k/u.nk".into())
            }),
        ] {
            let ctx = cli_context(json);
            let vars = env(&[("XDG_CONFIG_HOME", ctx.path().to_str().unwrap())]);
            let a = parse(&[]).unwrap().with_fallbacks(&vars).unwrap();
            assert!(check(&a), "{json}: {a:?}");
            assert!(!format!("{a:?}").contains("hunter2"), "{a:?}");
            assert_eq!(a.url(), DEFAULT_NATS_URL, "a context without url");
        }
    }

    /// A broken selected context stops the start (exit 64), naming it;
    /// with every setting given it is never read.
    #[test]
    fn a_broken_selected_context_is_a_configuration_error() {
        let ctx = cli_context("{ not json");
        let vars = env(&[("XDG_CONFIG_HOME", ctx.path().to_str().unwrap())]);
        let e = parse(&[]).unwrap().with_fallbacks(&vars).unwrap_err();
        assert!(e.0.contains("ops.json"), "{e}");
        let given = parse(&[
            "--nats-url",
            "nats://h:1",
            "--nats-token",
            "t",
            "--nats-tls-ca",
            "/ca.pem",
            "--nats-inbox-prefix",
            "_I",
        ])
        .unwrap();
        assert!(given.with_fallbacks(&vars).is_ok());
    }

    #[test]
    fn contradictory_identities_are_configuration_errors() {
        for bad in [
            &["--nats-user", "u"][..],
            &["--nats-password", "p"],
            &["--nats-token", "t", "--nats-creds", "x.creds"],
            &[
                "--nats-user",
                "u",
                "--nats-password",
                "p",
                "--nats-nkey",
                "seed",
            ],
            &["--nats-tls-cert", "c.pem"],
            &["--stream-replicas", "0"],
            &["--stream-replicas", "7"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_bad_url_among_several_is_a_configuration_error_at_once() {
        let mut a = NatsArgs::for_url("nats://127.0.0.1:1, nats://user:pw-secret@127.0.0.1:99999");
        a.connect_wait_secs = 60;
        let e = a.connect("t").await.unwrap_err().to_string();
        assert!(
            e.contains("bad NATS URL") && !e.contains("pw-secret"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn unreadable_or_invalid_key_files_fail_without_showing_them() {
        let dir = tempfile::tempdir().unwrap();
        let seed = dir.path().join("seed");
        std::fs::write(&seed, "SUnot-a-seed-but-secret").unwrap();
        let mut a = NatsArgs::for_url("nats://127.0.0.1:1");
        a.nkey_seed_file = Some(seed);
        let e = a.connect("t").await.unwrap_err().to_string();
        assert!(e.contains("no valid seed") && !e.contains("secret"), "{e}");
        let creds = dir.path().join("u.creds");
        std::fs::write(&creds, "secret garbage").unwrap();
        a.nkey_seed_file = None;
        a.creds_file = Some(creds);
        let e = a.connect("t").await.unwrap_err().to_string();
        assert!(e.contains("no user JWT") && !e.contains("secret"), "{e}");
        a.creds_file = Some(dir.path().join("missing.creds"));
        assert!(a.connect("t").await.is_err());
        a.creds_file = None;
        a.tls_ca = Some(dir.path().join("missing-ca.pem"));
        let e = a.connect("t").await.unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://:hunter2@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(
            redact_url("nats://s3cr3t-token@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_url("nats://user:pw@host:4222"),
            "nats://***@host:4222"
        );
        assert!(!redact_url("not a url hunter2").contains("hunter2"));
    }
}
