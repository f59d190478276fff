//! `docker-compose.yml` against the binaries it runs and the files it
//! mounts, without Docker: every fleet service's command is a binary and
//! subcommand of the workspace, every `--flag` it passes is one that
//! command's `--help` lists, every `TOOLFLEET_*` / `OTEL_*` variable it sets
//! is one the command reads (`[env: …]` in its `--help`, or one of the few
//! the telemetry module reads itself); every service that logs in to NATS
//! does so as a user of `ops/nats/auth.conf`, with that role's inbox prefix
//! and the password the server is given for it; the NATS server mounts
//! `nats-secure.conf` and everything it includes, has every password
//! `auth.conf` names and loads with them (`nats-server -t`); health checks
//! probe the service's own metrics port; no host port is published twice;
//! every host path mounted exists, every named volume is declared, and
//! every file a command or variable names inside the container is in the
//! image (ops/Dockerfile's `COPY`) or a mount, and in the repository. Mutated copies of the file show that a
//! misspelt flag, variable, user, inbox, path or subcommand is caught.
//!
//! The YAML is read by python3's PyYAML (anchors and merge keys included;
//! installed with pip into the tests' temporary directory when missing);
//! `docker compose config -q` validates the file too where the compose
//! plugin is installed (skipped with a note otherwise). Run on its own with
//! `cargo nextest run --test compose`; it needs the workspace's binaries
//! built (`cargo build --workspace --bins`, as scripts/test does).

// Tests are exempt from the 100-line limit: a check reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// Variables a fleet binary reads without a clap argument: the log filter
/// and the OpenTelemetry SDK's own. Each must appear in the telemetry
/// module's source (checked), so the list cannot outlive the code.
const READ_BY_TELEMETRY: &[&str] = &[
    "TOOLFLEET_LOG",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_SERVICE_NAME",
    "OTEL_SDK_DISABLED",
];

/// The image every fleet service runs (ops/Dockerfile).
const FLEET_IMAGE: &str = "toolfleet:";

/// Installed with pip when python3 has no `yaml` module.
const PYYAML: &str = "PyYAML==6.0.3";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A binary of the workspace, beside `toolfleet` in the target directory.
fn bin(name: &str) -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_toolfleet")).with_file_name(name)
}

/// Where PyYAML is, when python3 does not have it: installed once with pip
/// into the tests' temporary directory (as scripts/validate-kubernetes
/// installs its validator).
fn pyyaml_path() -> Option<PathBuf> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| {
        let has_yaml = Command::new("python3")
            .args(["-c", "import yaml"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("python3 is needed to read YAML: {e}"))
            .success();
        if has_yaml {
            return None;
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyyaml");
        if !dir.join("yaml").exists() {
            let out = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
                .arg("--target")
                .arg(&dir)
                .arg(PYYAML)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "PyYAML is missing and pip cannot install it ({}): apt-get install python3-yaml\n{}",
                PYYAML,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Some(dir)
    })
    .clone()
}

/// The compose file as JSON: PyYAML resolves anchors, aliases and `<<`
/// merge keys as compose does.
fn parse(yaml: &str) -> Value {
    let script = "import json, sys, yaml\njson.dump(yaml.safe_load(sys.stdin), sys.stdout)";
    let mut command = Command::new("python3");
    if let Some(dir) = pyyaml_path() {
        command.env("PYTHONPATH", dir);
    }
    let mut child = command
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("python3 is needed to read YAML: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the YAML does not parse:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `--help` of a command line (binary and subcommands), run once each.
#[derive(Default)]
struct Helps(HashMap<Vec<String>, Result<String, String>>);

impl Helps {
    fn get(&mut self, path: &[String]) -> Result<String, String> {
        self.0
            .entry(path.to_vec())
            .or_insert_with(|| {
                let exe = bin(&path[0]);
                if !exe.exists() {
                    return Err(format!(
                        "{} is not a binary of the workspace (or not built: \
                         cargo build --workspace --bins)",
                        path[0]
                    ));
                }
                let out = Command::new(&exe)
                    .args(&path[1..])
                    .arg("--help")
                    .env_clear()
                    .stdin(Stdio::null())
                    .output()
                    .unwrap();
                if out.status.success() {
                    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
                } else {
                    Err(format!(
                        "`{} --help` fails: {}",
                        path.join(" "),
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))
                }
            })
            .clone()
    }
}

/// The subcommands a help text lists under `Commands:`.
fn subcommands(help: &str) -> BTreeSet<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// The long options a help text lists (`--name` at the start of a line).
fn long_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| {
            l.split_whitespace()
                .take_while(|t| !t.starts_with('<'))
                .map(|t| t.trim_end_matches(',').to_string())
                .filter(|t| t.starts_with("--"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The variables a help text lists as `[env: NAME…]`.
fn env_names(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.iter().map(scalar).collect(),
        Value::String(s) => s.split_whitespace().map(str::to_string).collect(),
        _ => Vec::new(),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A service's `environment`, as a map or a list of `NAME=value`.
fn environment(service: &Value) -> BTreeMap<String, String> {
    match &service["environment"] {
        Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), scalar(v))).collect(),
        Value::Array(items) => items
            .iter()
            .map(|i| {
                let s = scalar(i);
                match s.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (s, String::new()),
                }
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// A value as compose gives it with none of its variables set:
/// `${NAME:-default}` and `${NAME-default}` become the default, `${NAME}`
/// and `$NAME` nothing, `$$` a `$`.
fn interpolate_defaults(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at + 1..];
        if let Some(r) = rest.strip_prefix('$') {
            out.push('$');
            rest = r;
        } else if let Some(r) = rest.strip_prefix('{') {
            let end = r.find('}').expect("an unclosed ${");
            let inner = &r[..end];
            if let Some((_, default)) = inner.split_once(":-").or_else(|| inner.split_once('-')) {
                out.push_str(default);
            }
            rest = &r[end + 1..];
        } else {
            let name_len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            rest = &rest[name_len..];
        }
    }
    out.push_str(rest);
    out
}

/// `ops/nats/auth.conf` (with the files it includes): its users, each with
/// its password variable and its permissions block's text.
struct Auth {
    /// user -> (password variable, permissions variable)
    users: BTreeMap<String, (String, String)>,
    /// permissions variable -> its block
    blocks: BTreeMap<String, String>,
    /// files `include`d by the server configuration, relative to it
    includes: BTreeSet<String>,
}

fn includes(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("include "))
        .map(|f| f.trim().trim_matches('"').to_string())
        .collect()
}

impl Auth {
    fn read(dir: &Path, config: &str) -> Self {
        let mut includes_seen = BTreeSet::new();
        let mut text = String::new();
        let mut queue = vec![config.to_string()];
        while let Some(file) = queue.pop() {
            let body = std::fs::read_to_string(dir.join(&file))
                .unwrap_or_else(|e| panic!("{}: {e}", dir.join(&file).display()));
            for inc in includes(&body) {
                if includes_seen.insert(inc.clone()) {
                    queue.push(inc);
                }
            }
            text.push_str(&body);
            text.push('\n');
        }
        let field = |line: &str, name: &str| -> Option<String> {
            let (_, rest) = line.split_once(&format!("{name}:"))?;
            let value = rest.trim().split([',', ' ', '}']).next()?;
            Some(value.trim_start_matches('$').to_string())
        };
        let users = text
            .lines()
            .filter(|l| l.trim_start().starts_with("{ user:"))
            .filter_map(|l| {
                Some((
                    field(l, "user")?,
                    (field(l, "password")?, field(l, "permissions")?),
                ))
            })
            .collect();
        let mut blocks = BTreeMap::new();
        let mut current: Option<(String, String)> = None;
        for line in text.lines() {
            let top = !line.starts_with([' ', '\t', '}', '#']) && !line.is_empty();
            if top {
                if let Some((name, body)) = current.take() {
                    blocks.insert(name, body);
                }
                if let Some(name) = line.strip_suffix(" = {") {
                    current = Some((name.trim().to_string(), String::new()));
                }
            } else if let Some((_, body)) = current.as_mut() {
                body.push_str(line);
                body.push('\n');
            }
        }
        if let Some((name, body)) = current {
            blocks.insert(name, body);
        }
        Auth {
            users,
            blocks,
            includes: includes_seen,
        }
    }
}

/// The image's working directory (the last `WORKDIR` of ops/Dockerfile)
/// and what its `COPY` lines put where: container path -> repository path.
fn image_files() -> (String, Vec<(String, PathBuf)>) {
    let dockerfile = std::fs::read_to_string(root().join("ops/Dockerfile")).unwrap();
    let mut workdir = String::from("/");
    let mut copies = Vec::new();
    for line in dockerfile.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["WORKDIR", dir] => workdir = (*dir).to_string(),
            ["COPY", src, dst] => {
                let dst = dst.trim_end_matches('/');
                let dst = if dst.starts_with('/') {
                    dst.to_string()
                } else {
                    format!("{}/{dst}", workdir.trim_end_matches('/'))
                };
                copies.push((dst, root().join(src.trim_end_matches('/'))));
            }
            _ => {}
        }
    }
    (workdir, copies)
}

/// A path a service names inside its container, checked against what the
/// image holds and what the service mounts: `None` when it is there (or is
/// outside both, such as a volume's), else the problem. A file the
/// operator writes from a shipped example (`config/mcp.toml` from
/// `config/mcp.example.toml`) counts as there.
fn missing_path(value: &str, workdir: &str, files: &[(String, PathBuf)]) -> Option<String> {
    let looks_like_path = value.contains('/') && !value.contains(':') && !value.contains(' ');
    if !looks_like_path {
        return None;
    }
    let absolute = if value.starts_with('/') {
        value.to_string()
    } else {
        format!("{}/{value}", workdir.trim_end_matches('/'))
    };
    let best = files
        .iter()
        .filter(|(inside, _)| absolute == *inside || absolute.starts_with(&format!("{inside}/")))
        .max_by_key(|(inside, _)| inside.len());
    let Some((inside, repo)) = best else {
        return (absolute.starts_with(&format!("{}/", workdir.trim_end_matches('/'))))
            .then(|| format!("{value} is neither in the image nor mounted"));
    };
    let path = repo.join(absolute[inside.len()..].trim_start_matches('/'));
    let example = path.file_stem().zip(path.extension()).map(|(stem, ext)| {
        path.with_file_name(format!(
            "{}.example.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        ))
    });
    (!path.exists() && !example.is_some_and(|e| e.exists())).then(|| {
        format!(
            "{value} is {}, which does not exist",
            path.strip_prefix(root()).unwrap_or(&path).display()
        )
    })
}

/// Everything wrong with a compose file, one line each.
fn problems(compose: &Value, helps: &mut Helps) -> Vec<String> {
    let mut problems = Vec::new();
    let services = compose["services"]
        .as_object()
        .expect("a compose file has services");
    let declared_volumes: BTreeSet<&String> = compose["volumes"]
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    let nats_dir = root().join("ops/nats");
    let (workdir, image_copies) = image_files();
    let auth = Auth::read(&nats_dir, "nats-secure.conf");

    // The NATS server: the secure configuration, every file it includes
    // beside it, every password auth.conf names.
    let nats = &services["nats"];
    let nats_env = environment(nats);
    let mounts: BTreeMap<String, String> = strings(&nats["volumes"])
        .iter()
        .filter_map(|v| {
            let mut parts = v.split(':');
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    let command = strings(&nats["command"]);
    let config = command
        .iter()
        .position(|a| a == "--config" || a == "-c")
        .and_then(|i| command.get(i + 1))
        .cloned()
        .unwrap_or_default();
    match mounts.get("./ops/nats/nats-secure.conf") {
        Some(target) if *target == config => {
            let dir = Path::new(target).parent().unwrap();
            for inc in &auth.includes {
                let want = dir.join(inc).to_string_lossy().into_owned();
                if mounts.get(&format!("./ops/nats/{inc}")) != Some(&want) {
                    problems.push(format!(
                        "nats: ops/nats/{inc}, included by its configuration, is not mounted at {want}"
                    ));
                }
            }
        }
        _ => problems.push(format!(
            "nats: its --config {config:?} is not ./ops/nats/nats-secure.conf (auth.conf's identities)"
        )),
    }
    for (user, (password, _)) in &auth.users {
        if !nats_env.contains_key(password) {
            problems.push(format!(
                "nats: no {password} in its environment (auth.conf's password of {user}): the server refuses to start"
            ));
        }
    }

    // No two services publish the same host port (profiles may run
    // together).
    let mut published: BTreeMap<String, &String> = BTreeMap::new();
    for (name, service) in services {
        for port in strings(&service["ports"]) {
            let parts: Vec<&str> = port.split(':').collect();
            if parts.len() < 2 {
                continue;
            }
            let host = parts[..parts.len() - 1].join(":");
            if let Some(other) = published.insert(host.clone(), name) {
                problems.push(format!(
                    "{name}: host port {host} is published by {other} too"
                ));
            }
        }
    }

    for (name, service) in services {
        // Paths and volumes, every service.
        for volume in strings(&service["volumes"]) {
            let source = volume.split(':').next().unwrap_or_default();
            if let Some(path) = source.strip_prefix("./") {
                if !root().join(path).exists() {
                    problems.push(format!("{name}: mounts {source}, which does not exist"));
                }
            } else if !source.starts_with('/') && !declared_volumes.contains(&source.to_string()) {
                problems.push(format!("{name}: volume {source} is not declared"));
            }
        }
        let depends: Vec<String> = match &service["depends_on"] {
            Value::Object(m) => m.keys().cloned().collect(),
            other => strings(other),
        };
        for dep in depends {
            if !services.contains_key(&dep) {
                problems.push(format!("{name}: depends on {dep}, which is no service"));
            }
        }

        let image = service["image"].as_str().unwrap_or_default();
        if !image.starts_with(FLEET_IMAGE) {
            continue;
        }
        // The command: a binary, its subcommands, then flags and values.
        let argv = strings(&service["command"]);
        let Some(binary) = argv.first() else {
            problems.push(format!("{name}: a fleet service without a command"));
            continue;
        };
        let mut path = vec![binary.clone()];
        let mut help = match helps.get(&path) {
            Ok(h) => h,
            Err(e) => {
                problems.push(format!("{name}: {e}"));
                continue;
            }
        };
        let mut rest = &argv[1..];
        while let Some(word) = rest.first() {
            let commands = subcommands(&help);
            if commands.is_empty() || word.starts_with('-') {
                break;
            }
            if !commands.contains(word) {
                problems.push(format!(
                    "{name}: `{word}` is not a command of `{}` ({})",
                    path.join(" "),
                    commands.into_iter().collect::<Vec<_>>().join(", ")
                ));
                break;
            }
            path.push(word.clone());
            rest = &rest[1..];
            help = match helps.get(&path) {
                Ok(h) => h,
                Err(e) => {
                    problems.push(format!("{name}: {e}"));
                    break;
                }
            };
        }
        let flags = long_flags(&help);
        let command = path.join(" ");
        for arg in rest.iter().filter(|a| a.starts_with("--")) {
            let flag = arg.split('=').next().unwrap_or_default();
            if !flags.contains(flag) {
                problems.push(format!("{name}: `{command}` has no flag {flag}"));
            }
        }
        let env = environment(service);
        let reads = env_names(&help);
        for var in env.keys() {
            let ours = var.starts_with("TOOLFLEET_") || var.starts_with("OTEL_");
            if ours && !reads.contains(var) && !READ_BY_TELEMETRY.contains(&var.as_str()) {
                problems.push(format!("{name}: `{command}` does not read {var}"));
            }
        }

        // The files it names: in the image or mounted, and in the repository.
        let mut files = image_copies.clone();
        for volume in strings(&service["volumes"]) {
            let mut parts = volume.split(':');
            if let (Some(source), Some(target)) = (parts.next(), parts.next())
                && let Some(path) = source.strip_prefix("./")
            {
                files.push((target.trim_end_matches('/').to_string(), root().join(path)));
            }
        }
        let values = rest
            .iter()
            .filter(|a| !a.starts_with('-'))
            .cloned()
            .chain(env.values().map(|v| interpolate_defaults(v)));
        for value in values {
            if let Some(problem) = missing_path(&value, &workdir, &files) {
                problems.push(format!("{name}: {problem}"));
            }
        }

        // Its health check probes its own metrics address.
        let probe = strings(&service["healthcheck"]["test"]);
        if let Some(url) = probe.iter().find(|a| a.starts_with("http://")) {
            let port = url
                .trim_start_matches("http://")
                .split('/')
                .next()
                .and_then(|hp| hp.rsplit(':').next())
                .unwrap_or_default();
            let addr = env
                .get("TOOLFLEET_METRICS_ADDR")
                .cloned()
                .unwrap_or_default();
            if !addr.ends_with(&format!(":{port}")) {
                problems.push(format!(
                    "{name}: its health check probes {url}, but its metrics address is {addr:?}"
                ));
            }
        }

        // Its NATS identity: a user of auth.conf, the role's inbox, the
        // password the server has for that user.
        if !flags.contains("--nats-user") {
            continue;
        }
        let (Some(user), Some(inbox), Some(password)) = (
            env.get("TOOLFLEET_NATS_USER"),
            env.get("TOOLFLEET_NATS_INBOX_PREFIX"),
            env.get("TOOLFLEET_NATS_PASSWORD"),
        ) else {
            problems.push(format!(
                "{name}: logs in to NATS without TOOLFLEET_NATS_USER, _PASSWORD and _INBOX_PREFIX \
                 (auth.conf admits no anonymous client)"
            ));
            continue;
        };
        let Some((password_var, permissions)) = auth.users.get(user) else {
            problems.push(format!(
                "{name}: NATS user {user} is not in ops/nats/auth.conf"
            ));
            continue;
        };
        let block = auth.blocks.get(permissions).cloned().unwrap_or_default();
        if !block.contains(&format!("\"{inbox}.>\"")) {
            problems.push(format!(
                "{name}: inbox prefix {inbox} is not the one auth.conf's {permissions} lets {user} read"
            ));
        }
        if nats_env.get(password_var) != Some(password) {
            problems.push(format!(
                "{name}: its NATS password {password:?} is not the server's {password_var} ({:?})",
                nats_env.get(password_var)
            ));
        }
    }
    problems
}

fn compose_text() -> String {
    std::fs::read_to_string(root().join("docker-compose.yml")).unwrap()
}

#[test]
fn every_service_matches_the_binaries_and_files_it_names() {
    for var in READ_BY_TELEMETRY {
        let source =
            std::fs::read_to_string(root().join("crates/toolfleet-service/src/telemetry.rs"))
                .unwrap();
        assert!(source.contains(var), "telemetry.rs no longer reads {var}");
    }
    let compose = parse(&compose_text());
    let mut helps = Helps::default();
    let problems = problems(&compose, &mut helps);
    assert!(
        problems.is_empty(),
        "docker-compose.yml:\n{}",
        problems.join("\n")
    );
    // The checks reached what they check.
    let services = compose["services"].as_object().unwrap();
    for name in [
        "orchestrator",
        "gateway",
        "worker-system",
        "worker-retrieval",
        "worker-llm",
        "worker-web",
    ] {
        assert!(services.contains_key(name), "no {name} in compose");
        assert!(
            services[name]["profiles"].is_null(),
            "{name} must start by default"
        );
    }
    for (profile, service) in [
        ("postgres", "postgres"),
        ("postgres", "worker-retrieval-postgres"),
        ("otel", "jaeger"),
    ] {
        assert!(
            strings(&services[service]["profiles"]).contains(&profile.to_string()),
            "{service} is not in profile {profile}"
        );
    }
    let pg = environment(&services["worker-retrieval-postgres"]);
    assert_eq!(pg["TOOLFLEET_STORE"], "postgres");
    assert!(pg["TOOLFLEET_POSTGRES_URL"].contains("@postgres:5432/"));
    // Workers alter no schema: the migration runs first, on the same store.
    let migrate = &services["postgres-migrate"];
    assert_eq!(
        strings(&migrate["command"]),
        ["toolfleet", "index", "migrate"]
    );
    assert_eq!(
        environment(migrate)["TOOLFLEET_POSTGRES_URL"],
        pg["TOOLFLEET_POSTGRES_URL"]
    );
    assert_eq!(
        services["worker-retrieval-postgres"]["depends_on"]["postgres-migrate"]["condition"],
        "service_completed_successfully"
    );
    for (name, service) in services {
        if service["image"]
            .as_str()
            .is_some_and(|i| i.starts_with(FLEET_IMAGE))
            && environment(service).contains_key("TOOLFLEET_NATS_URL")
            && !["client-acme", "operator"].contains(&name.as_str())
        {
            assert_eq!(
                environment(service)["OTEL_EXPORTER_OTLP_ENDPOINT"],
                "${OTEL_EXPORTER_OTLP_ENDPOINT:-}",
                "{name}: traces go where OTEL_EXPORTER_OTLP_ENDPOINT says (otel profile)"
            );
        }
    }
}

/// Each mutation of the real file, and the problem it must raise.
#[test]
fn a_misspelt_flag_variable_user_inbox_or_path_is_caught() {
    let text = compose_text();
    let original = parse(&text);
    let mut helps = Helps::default();
    let cases = [
        (
            "\"--listen\", \"0.0.0.0:8080\"]",
            "\"--lisen\", \"0.0.0.0:8080\"]",
            "has no flag --lisen",
        ),
        (
            "TOOLFLEET_CONCURRENCY: ${TOOLFLEET_WEB_CONCURRENCY",
            "TOOLFLEET_CONCURENCY: ${TOOLFLEET_WEB_CONCURRENCY",
            "does not read TOOLFLEET_CONCURENCY",
        ),
        (
            "TOOLFLEET_METRICS_ADDR: 0.0.0.0:9470",
            "TOOLFLEET_METRIC_ADDR: 0.0.0.0:9470",
            "does not read TOOLFLEET_METRIC_ADDR",
        ),
        (
            "      - ingest\n",
            "      - ingst\n",
            "`ingst` is not a command of `toolfleet`",
        ),
        (
            "command: [\"toolfleet-worker-system\"]",
            "command: [\"toolfleet-worker-sytem\"]",
            "toolfleet-worker-sytem is not a binary",
        ),
        (
            "TOOLFLEET_NATS_USER: worker-web",
            "TOOLFLEET_NATS_USER: worker-wbe",
            "NATS user worker-wbe is not in ops/nats/auth.conf",
        ),
        (
            "TOOLFLEET_NATS_INBOX_PREFIX: _INBOX.worker.web",
            "TOOLFLEET_NATS_INBOX_PREFIX: _INBOX.worker.system",
            "inbox prefix _INBOX.worker.system is not",
        ),
        (
            "TOOLFLEET_NATS_PASSWORD: ${TOOLFLEET_NATS_WEB_PASSWORD",
            "TOOLFLEET_NATS_PASSWORD: ${TOOLFLEET_NATS_LLM_PASSWORD",
            "is not the server's TOOLFLEET_NATS_WEB_PASSWORD",
        ),
        (
            "  TOOLFLEET_NATS_GATEWAY_PASSWORD: ${TOOLFLEET_NATS_GATEWAY_PASSWORD:-dev-only-gateway}\n",
            "",
            "nats: no TOOLFLEET_NATS_GATEWAY_PASSWORD",
        ),
        (
            "./ops/nats/auth.conf:",
            "./ops/nats/auth.cnf:",
            "mounts ./ops/nats/auth.cnf, which does not exist",
        ),
        (
            "      - ./ops/nats/mcp-role.conf:/etc/nats/mcp-role.conf:ro\n",
            "",
            "ops/nats/mcp-role.conf, included by its configuration, is not mounted",
        ),
        (
            "./ops/nats/nats-secure.conf:",
            "./ops/nats/nats-server.conf:",
            "is not ./ops/nats/nats-secure.conf",
        ),
        (
            "      - examples/demo-script.json\n",
            "      - examples/demo-scrpt.json\n",
            "examples/demo-scrpt.json is examples/demo-scrpt.json, which does not exist",
        ),
        (
            "      - /app/examples/corpus\n",
            "      - /app/example/corpus\n",
            "/app/example/corpus is neither in the image nor mounted",
        ),
        (
            "TOOLFLEET_MCP_CONFIG: /app/config/mcp.toml",
            "TOOLFLEET_MCP_CONFIG: /app/config/mpc.toml",
            "/app/config/mpc.toml is config/mpc.toml, which does not exist",
        ),
        (
            "\"127.0.0.1:9470:9470\"",
            "\"127.0.0.1:9468:9470\"",
            "host port 127.0.0.1:9468 is published by",
        ),
        (
            "http://127.0.0.1:9470/readyz",
            "http://127.0.0.1:9471/readyz",
            "probes http://127.0.0.1:9471/readyz",
        ),
        (
            "      - index-data:/var/lib/toolfleet:ro\n",
            "      - index-dta:/var/lib/toolfleet:ro\n",
            "volume index-dta is not declared",
        ),
    ];
    for (from, to, expected) in cases {
        assert!(text.contains(from), "the mutation's text {from:?} is gone");
        let mutated = parse(&text.replacen(from, to, 1));
        assert_ne!(mutated, original, "{from:?} is only in a comment");
        let found = problems(&mutated, &mut helps);
        assert!(
            found.iter().any(|p| p.contains(expected)),
            "{from:?} -> {to:?}: expected a problem with {expected:?}, got:\n{}",
            found.join("\n")
        );
    }
}

/// The server starts with `auth.conf` and the environment compose gives
/// it (the defaults), and refuses to without one of the passwords.
#[test]
fn the_nats_server_loads_auth_conf_with_the_compose_environment() {
    let compose = parse(&compose_text());
    let env: BTreeMap<String, String> = environment(&compose["services"]["nats"])
        .into_iter()
        .map(|(k, v)| (k, interpolate_defaults(&v)))
        .collect();
    let check = |env: &BTreeMap<String, String>| {
        let out = Command::new("nats-server")
            .args(["-t", "-c"])
            .arg(root().join("ops/nats/nats-secure.conf"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("nats-server (apt-get install nats-server): {e}"));
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (ok, output) = check(&env);
    assert!(ok, "nats-server -t with compose's environment:\n{output}");
    assert!(
        env.values().all(|v| v.starts_with("dev-only-")),
        "every default password says it is for development: {env:?}"
    );
    let mut missing = env.clone();
    missing.remove("TOOLFLEET_NATS_GATEWAY_PASSWORD");
    let (ok, output) = check(&missing);
    assert!(!ok, "the server loaded without a password:\n{output}");
}

/// `docker compose config -q` over every profile, where the compose plugin
/// is installed (it needs no network for `config`).
#[test]
fn docker_compose_validates_the_file() {
    let plugin = Command::new("docker")
        .args(["compose", "version"])
        .stdin(Stdio::null())
        .output();
    if !plugin.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "note: `docker compose` is not installed here; skipped only its `config -q` \
             validation (the other compose checks ran)"
        );
        return;
    }
    let compose = parse(&compose_text());
    let profiles: BTreeSet<String> = compose["services"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|s| strings(&s["profiles"]))
        .collect();
    let mut command = Command::new("docker");
    command
        .arg("compose")
        .arg("-f")
        .arg(root().join("docker-compose.yml"));
    for profile in &profiles {
        command.args(["--profile", profile]);
    }
    let out = command
        .args(["config", "-q"])
        .current_dir(root())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "docker compose config -q:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn defaults_are_interpolated_as_compose_does() {
    assert_eq!(interpolate_defaults("${A:-x}"), "x");
    assert_eq!(interpolate_defaults("a${B-y}b"), "ayb");
    assert_eq!(interpolate_defaults("${C}$D/$$"), "/$");
    assert_eq!(
        interpolate_defaults("postgres://t:${P:-dev}@h:5432/d"),
        "postgres://t:dev@h:5432/d"
    );
}
