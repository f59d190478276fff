//! MCP servers as a tenant boundary (issue 28, items 5(d), 5(e), 6, 7 and
//! 9), against a real stdio MCP server that probes what it can reach
//! (`tests/mcp/probe_server.py`, the standard library only, so it runs as
//! `nobody`). The first test runs on a nats-server with the shipped
//! `ops/nats/auth.conf`: the orchestrator and the MCP worker under their
//! role identities (the MCP pool's role printed by the worker for its
//! configuration), acme and globex each with its own client identity.
//!
//! - the worker as a process, its environment holding a canary secret: a
//!   child finds no canary in its own environment, in the worker's
//!   `/proc/<ppid>/environ` (even as root, which may read it: the worker
//!   empties it at start-up), or (run as `nobody`) in the worker's files;
//!   its stderr is logged scrubbed; a `per_tenant` server gives acme and
//!   globex a child each, with the tenant in `_meta`; a globex-only
//!   server's tools are not acme's; a tool whose description changes
//!   under the same name is refused;
//! - `toolfleet mcp serve` without `--profile` offers neither the default
//!   profile's gated tools nor MCP tools without a read-only hint, nor
//!   another tenant's.

use serde_json::{Value, json};
use toolfleet_local::servers::RedisServer;
use toolfleet_protocol::Subjects;
use toolfleet_scripted::ScriptedServer;

use crate::security::{Proc, Secure, password, spawn};
use crate::support::{self, Env};

/// The model calls `tool` for a question that holds `word`, then quotes it.
fn rule(word: &str, tool: &str) -> Value {
    json!({ "whenUserContains": [word], "steps": [
        { "toolCalls": [ { "name": tool, "arguments": {} } ] },
        { "answer": format!("Said: {{{{tool:{tool}}}}}") }
    ] })
}

/// The fleet under the shipped identities: each tenant's client, the
/// model, and the MCP worker's log.
struct Tenants {
    acme: async_nats::Client,
    globex: async_nats::Client,
    model: ScriptedServer,
    subjects: Subjects,
    log: std::path::PathBuf,
    _procs: Vec<Proc>,
    _servers: (Secure, RedisServer),
}

impl Tenants {
    /// Asks `question` as `tenant`, with the tenant's own identity: the
    /// answer's text.
    async fn ask(&self, tenant: &str, question: &str) -> String {
        let client = match tenant {
            "acme" => &self.acme,
            "globex" => &self.globex,
            other => panic!("no identity for {other}"),
        };
        let mut job = toolfleet_protocol::client::question(question);
        job.tenant = Some(tenant.into());
        match toolfleet_protocol::client::chat(client, &self.subjects, &job, support::WAIT, |_| {})
            .await
        {
            Ok(outcome) => outcome.text,
            Err(e) => format!("error: {e}"),
        }
    }

    /// Asks until the answer holds `wanted` (a worker just started, or a
    /// tool set being reloaded, may not be offered yet): the answer.
    async fn ask_until(&self, tenant: &str, question: &str, wanted: &str) -> String {
        let deadline = tokio::time::Instant::now() + support::WAIT;
        loop {
            let text = self.ask(tenant, question).await;
            if text.contains(wanted) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{tenant}: {question}: {text}\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
    }

    /// Asks `question` as `tenant` until the probe answers: its report.
    async fn probe(&self, tenant: &str, question: &str) -> Value {
        self.ask_until(tenant, question, "<untrusted_mcp_content")
            .await;
        report(&last_tool_result(&self.model.requests()))
    }
}

/// The last tool result the model read, whole (the scripted model quotes
/// only the start of one in its answer).
fn last_tool_result(requests: &[Value]) -> String {
    let last = requests.last().expect("the model got requests");
    last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The probe's JSON report inside a fenced answer.
fn report(text: &str) -> Value {
    let start = text
        .find("{\"pid\"")
        .unwrap_or_else(|| panic!("no report: {text}"));
    let end = text.rfind('}').unwrap();
    serde_json::from_str(&text[start..=end]).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// The fleet of the test under `ops/nats/auth.conf`: the orchestrator and
/// the MCP worker (configured by `mcp_config`, its environment holding
/// `env_canary`) as processes under their role identities, the MCP pool's
/// role being what the worker prints for that configuration; acme and
/// globex each with its own client identity.
async fn start_tenants(script: Value, mcp_config: &std::path::Path, env_canary: &str) -> Tenants {
    let role = std::process::Command::new(support::sibling_bin("toolfleet-worker-mcp"))
        .arg("--print-nats-role")
        .env("TOOLFLEET_MCP_CONFIG", mcp_config)
        .env("TOOLFLEET_NATS_URL", "nats://127.0.0.1:9")
        .env("TOOLFLEET_REDIS_URL", "redis://127.0.0.1:9")
        .output()
        .unwrap();
    assert!(
        role.status.success(),
        "{}",
        String::from_utf8_lossy(&role.stderr)
    );
    let secure = Secure::start_with_mcp_role(Some(String::from_utf8(role.stdout).unwrap()));
    let redis = RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(&script.to_string()).unwrap();
    let model = ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dir = mcp_config.parent().unwrap();
    let config = dir.join("toolfleet.toml");
    support::write_scripted_config(&config, &model.base_url());
    let with = |user: &str, extra| secure.process_env(user, &redis.url(), extra);
    let log = dir.join("worker.log");
    let procs = vec![
        spawn(
            "toolfleet-orchestrator",
            &with(
                "orchestrator",
                vec![("TOOLFLEET_CONFIG", config.display().to_string())],
            ),
            dir.join("orchestrator.log"),
        ),
        spawn(
            "toolfleet-worker-mcp",
            &with(
                "worker-mcp",
                vec![
                    ("TOOLFLEET_MCP_CONFIG", mcp_config.display().to_string()),
                    ("PROBE_WORKER_SECRET", env_canary.to_string()),
                ],
            ),
            log.clone(),
        ),
    ];
    Tenants {
        acme: secure.connect("client-acme").await,
        globex: secure.connect("client-globex").await,
        model,
        subjects: Subjects::new("toolfleet").unwrap(),
        log,
        _procs: procs,
        _servers: (secure, redis),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_children_reach_no_credential_and_keep_to_their_tenants() {
    let script = json!({
        "rules": [
            rule("probe", "mcp_probe_whoami"),
            rule("vault", "mcp_vault_whoami"),
            rule("mutate", "mcp_vault_mutate"),
            rule("shifty", "mcp_vault_shifty"),
        ]
    });
    let dir = tempfile::tempdir().unwrap();
    let (env_canary, file_canary, token) = (
        "canary-env-5b1d9e",
        "canary-file-77c0aa",
        "canary-child-token-3f2e",
    );
    // A file only the worker's user may read, and the child's own token.
    let secret_file = dir.path().join("worker-secret");
    std::fs::write(&secret_file, file_canary).unwrap();
    let token_file = dir.path().join("probe-token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    for file in [&secret_file, &token_file] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let root = running_as_root();
    // As root, the children run as nobody; otherwise as the worker's user,
    // behind the worker made non-dumpable.
    let run_as = if root {
        "run_as = { uid = 65534, gid = 65534 }\n"
    } else {
        ""
    };
    let probe = support::root().join("tests/mcp/probe_server.py");
    let command = format!(
        "command = [\"/usr/bin/python3\", \"{}\", \"{env_canary}\", \"{file_canary}\", \"{}\"]\ncwd = \"/\"\n{run_as}",
        probe.display(),
        password("worker-mcp")
    );
    // The vault runs as the worker's user (root, when the test is): it may
    // read the worker's memory, so only an emptied environment keeps it out.
    let vault_command = command.replace(run_as, "");
    let config = dir.path().join("mcp.toml");
    std::fs::write(
        &config,
        format!(
            "[servers.probe]\n{command}per_tenant = true\ntenants = [\"acme\", \"globex\"]\n\
             env = {{ PROBE_FILES = \"{}\" }}\nenv_files = {{ PROBE_TOKEN = \"{}\" }}\n\n\
             [servers.vault]\n{vault_command}tenants = [\"globex\"]\n",
            secret_file.display(),
            token_file.display()
        ),
    )
    .unwrap();
    let fleet = start_tenants(script, &config, env_canary).await;

    // acme's call: its own child, its tenant in `_meta`, no canary.
    let acme = fleet.probe("acme", "probe").await;
    assert_eq!(acme["tenant"], "acme", "{acme}");
    assert_eq!(
        acme["meta"],
        json!({ "toolfleet/tenant": "acme" }),
        "{acme}"
    );
    for key in ["own_env", "own_environ"] {
        assert_eq!(acme[key], json!([]), "{key}: {acme}");
    }
    // The worker's environment: unreadable (another user, or a
    // non-dumpable worker), or read without a canary.
    let parent = &acme["parent_environ"];
    assert!(
        parent == &json!([]) || parent.as_str().is_some_and(|s| s.starts_with("unreadable")),
        "{acme}"
    );
    // Only the explicit few variables (PATH, HOME, LANG, …, its own).
    assert_eq!(acme["extra_env"], json!([]), "{acme}");
    if root {
        assert_eq!(acme["uid"], 65534, "{acme}");
        let file = &acme["files"][secret_file.to_str().unwrap()];
        assert!(
            file.as_str().is_some_and(|s| s.starts_with("unreadable")),
            "{acme}"
        );
    }

    // globex: a child of its own; acme again: the same child as before.
    let globex = fleet.probe("globex", "probe").await;
    assert_eq!(globex["tenant"], "globex", "{globex}");
    assert_eq!(globex["meta"]["toolfleet/tenant"], "globex");
    assert_ne!(globex["pid"], acme["pid"], "one child per tenant");
    let again = fleet.probe("acme", "probe").await;
    assert_eq!(again["pid"], acme["pid"], "acme's child is kept");

    // The globex-only server: globex's, never offered to acme.
    let vault = fleet.probe("globex", "vault").await;
    assert_eq!(vault["meta"]["toolfleet/tenant"], "globex");
    // As root the vault reads the worker's /proc/<pid>/environ: emptied.
    if root {
        assert_eq!(vault["parent_environ"], json!([]), "{vault}");
    }
    let refused = fleet.ask("acme", "vault").await;
    assert!(
        !refused.contains("untrusted_mcp_content"),
        "acme reached globex's server: {refused}"
    );
    assert!(
        refused.contains("there is no tool named \"mcp_vault_whoami\""),
        "{refused}"
    );

    // The child's token, written on its stderr, is scrubbed from the log.
    let logged = std::fs::read_to_string(&fleet.log).unwrap();
    assert!(logged.contains("my token is [redacted]"), "{logged}");
    assert!(!logged.contains(token), "{logged}");

    // A description changed under the same name: refused, logged.
    let shifty = fleet.ask_until("globex", "shifty", "shifty answered").await;
    assert!(shifty.contains("shifty answered"));
    fleet.ask_until("globex", "mutate", "mutated").await;
    fleet
        .ask_until(
            "globex",
            "shifty",
            "there is no tool named \"mcp_vault_shifty\"",
        )
        .await;
    let logged = std::fs::read_to_string(&fleet.log).unwrap();
    assert!(
        logged.contains("changed since it was first listed"),
        "{logged}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_serve_without_a_profile_offers_no_gated_tool() {
    let env = Env::start_only(json!({ "rules": [] }), &["system"]).await;
    let dir = tempfile::tempdir().unwrap();
    let probe = support::root().join("tests/mcp/probe_server.py");
    let config: toolfleet_worker_mcp::McpConfig = toml::from_str(&format!(
        "[servers.probe]\ncommand = [\"python3\", \"{p}\"]\n[servers.vault]\ncommand = [\"python3\", \"{p}\"]\ntenants = [\"globex\"]\n",
        p = probe.display()
    ))
    .unwrap();
    config.check().unwrap();
    let imported = tokio::time::timeout(support::WAIT, toolfleet_worker_mcp::import(&config))
        .await
        .expect("the import ends in time")
        .expect("the probe is imported");
    // Without a read-only hint a tool needs approval; with it, not.
    let approval: std::collections::BTreeMap<String, bool> = imported
        .worker
        .definitions()
        .map(|d| (d.function.name.clone(), d.requires_approval))
        .collect();
    assert!(approval["mcp_probe_eraser"]);
    assert!(!approval["mcp_probe_whoami"]);
    let _worker = env.start_worker(imported.worker).await;
    // The default profile holds the clock for approval.
    let profiles = dir.path().join("toolfleet.toml");
    std::fs::write(
        &profiles,
        format!(
            "default_profile = \"default\"\n[deployments.d]\nbase_url = \"{}\"\nmodel = \"m\"\n\
             [profiles.default]\ndeployment = \"d\"\nrequire_approval = [\"system:current_datetime\"]\n",
            env.model.base_url()
        ),
    )
    .unwrap();
    let out = tokio::task::spawn_blocking({
        let (url, profiles) = (env.nats.url(), profiles.clone());
        move || {
            std::process::Command::new("python3")
                .arg(support::root().join("tests/mcp/fleet_client.py"))
                .args([env!("CARGO_BIN_EXE_toolfleet"), "mcp_probe_whoami", "{}"])
                .env("TOOLFLEET_NATS_URL", url)
                .env("TOOLFLEET_CONFIG", profiles)
                .env("TOOLFLEET_TENANT", "acme")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Not the clock (the default profile's approval), not the eraser (no
    // read-only hint), not globex's vault.
    assert_eq!(
        seen["tools"],
        json!(["mcp_probe_mutate", "mcp_probe_shifty", "mcp_probe_whoami"]),
        "{seen}"
    );
    assert_eq!(seen["isError"], false, "{seen}");
    let text = seen["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("<untrusted_mcp_content boundary="), "{text}");
    assert_eq!(report(text)["meta"]["toolfleet/tenant"], "acme", "{text}");
}

/// `toolfleet mcp serve` picks a profile as the orchestrator does: the
/// tenant's own default, and never a profile its tenant may not use
/// (exit 64 before it connects to anything).
#[test]
fn mcp_serve_refuses_a_profile_its_tenant_may_not_use() {
    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("toolfleet.toml");
    std::fs::write(
        &profiles,
        "default_profile = \"globex-desk\"\n[deployments.d]\nbase_url = \"http://127.0.0.1:9\"\n\
         model = \"m\"\n[profiles.globex-desk]\ndeployment = \"d\"\ntenants = [\"globex\"]\n",
    )
    .unwrap();
    let serve = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(["mcp", "serve", "--tenant", "acme"])
            .args(args)
            .env("TOOLFLEET_CONFIG", &profiles)
            .env("TOOLFLEET_NATS_URL", "nats://127.0.0.1:9")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    for args in [&[][..], &["--profile", "globex-desk"][..]] {
        let out = serve(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains("not for tenant \"acme\""),
            "{args:?}: {stderr}"
        );
    }
}
