//! MCP import: a real stdio MCP server (a small Python one on the official
//! SDK, `tests/mcp/notes_server.py`) whose tools answer chat jobs through
//! the fleet — text and a resource link that becomes a reference; a server
//! that dies mid-call is started again and the call retried; a server that
//! cannot start, hangs on `initialize` or answers garbage is left out with
//! its reason while the others are served. A streamable HTTP server on the same SDK
//! (`tests/mcp/http_server.py`) is served the same way, and again once it
//! is back after dying.

mod tenancy;

use serde_json::json;

use crate::support::{self, Env, Options};

fn config(crash_marker: &std::path::Path) -> toolfleet_worker_mcp::McpConfig {
    let server = support::root().join("tests/mcp/notes_server.py");
    let text = format!(
        r#"
[servers.notes]
command = ["python3", "{}"]
env = {{ NOTES_CRASH_ONCE = "{}" }}
timeout_ms = 20000
# Its tools give no read-only hints: trusted, so no call waits for a person.
trusted = true

[servers.gone]
command = ["/nonexistent/mcp-server"]

[servers.hung]
command = ["sleep", "60"]
init_timeout_ms = 500

[servers.garbage]
command = ["sh", "-c", "while true; do echo 'this is not JSON-RPC'; sleep 0.05; done"]
init_timeout_ms = 1000
"#,
        server.display(),
        crash_marker.display()
    );
    let config: toolfleet_worker_mcp::McpConfig = toml::from_str(&text).unwrap();
    config.check().unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_servers_tools_answer_chat_jobs_through_the_fleet() {
    let env = Env::start_with(
        json!({
            "rules": [
                { "whenUserContains": ["lamp"], "steps": [
                    { "toolCalls": [ { "name": "mcp_notes_lookup", "arguments": { "term": "lamp" } } ] },
                    { "answer": "Notes: {{tool:mcp_notes_lookup}}" }
                ] },
                { "whenUserContains": ["write"], "steps": [
                    { "toolCalls": [ { "name": "mcp_notes_write_and_die", "arguments": { "text": "x" } } ] },
                    { "answer": "After the write: {{tool:mcp_notes_write_and_die}}" }
                ] },
                { "whenUserContains": ["crash"], "steps": [
                    { "toolCalls": [ { "name": "mcp_notes_crash", "arguments": {} } ] },
                    { "answer": "After the crash: {{tool:mcp_notes_crash}}" }
                ] }
            ]
        }),
        Options {
            workers: vec![],
            ..Options::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let imported = toolfleet_worker_mcp::import(&config(&dir.path().join("crashed")))
        .await
        .expect("the notes server is imported");
    // The servers that cannot serve are left out, each saying why.
    let skipped = imported.skipped.join("\n");
    assert!(skipped.contains("server garbage left out"), "{skipped}");
    assert!(
        skipped.contains("server gone left out") && skipped.contains("cannot start"),
        "{skipped}"
    );
    assert!(
        skipped.contains("server hung left out") && skipped.contains("did not answer within"),
        "{skipped}"
    );
    let mut ids: Vec<String> = imported
        .worker
        .definitions()
        .map(|d| d.id.to_string())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            "mcp_notes:crash@1.0.0",
            "mcp_notes:learn@1.0.0",
            "mcp_notes:lookup@1.0.0",
            "mcp_notes:write_and_die@1.0.0"
        ]
    );
    let mut config = toolfleet_worker::WorkerConfig::new(env.subjects.clone());
    config.retry_delay = std::time::Duration::from_millis(200);
    let metrics = imported.metrics.clone();
    let _worker = env.start_worker_with(imported.worker, config).await;

    // Text and a resource link: the answer, and a reference.
    let outcome = ask_when_offered(&env, "what do the notes say about the lamp?").await;
    assert!(
        outcome
            .text
            .contains("lamp: keepers wound the lamp every four hours"),
        "{}",
        outcome.text
    );
    let events = serde_json::to_string(&outcome.events).unwrap();
    assert!(
        events.contains("The lamp log") && events.contains("https://example.com/notes/lamp"),
        "{events}"
    );

    // The server dies in the middle of a call: the call is retried on a
    // server started again.
    let (job, outcome) = env.ask("crash the notes server").await;
    let outcome = outcome.unwrap_or_else(|e| panic!("{}: {e}", job.invocation_id));
    assert!(dir.path().join("crashed").exists(), "the server did crash");
    assert!(
        outcome.text.contains("After the crash: ") && outcome.text.contains("survived"),
        "{}",
        outcome.text
    );

    // A tool that may have written before its server died is not run
    // again: the model reads why.
    let (job, outcome) = env.ask("write a note").await;
    let outcome = outcome.unwrap_or_else(|e| panic!("{}: {e}", job.invocation_id));
    assert!(
        outcome
            .text
            .contains("After the write: Error: MCP server notes is unavailable"),
        "{}",
        outcome.text
    );

    // Counted by server and outcome: the lookup and the retried crash
    // answered; the crash's first attempt and the write found it gone.
    let calls = |outcome: &str| metrics.calls("notes", outcome);
    assert_eq!(calls("ok"), 2);
    assert_eq!(calls("unavailable"), 2);
    assert_eq!(calls("timeout"), 0, "zero-initialised");
    assert_eq!(metrics.tools("notes"), 4);
    assert_eq!(metrics.tools("gone"), 0);
    assert_eq!(metrics.tools("garbage"), 0);
}

/// A streamable HTTP MCP server on the official Python SDK
/// (`tests/mcp/http_server.py`) on a port of the test's, killed on drop.
struct HttpServer {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl HttpServer {
    /// Starts it on `port` as `name` (its log and its `hold` tool's marker
    /// in `dir`) and waits until the port answers.
    async fn start(port: u16, dir: &std::path::Path, name: &str) -> Self {
        let log = dir.join("http_server.log");
        let child = std::process::Command::new("python3")
            .arg(support::root().join("tests/mcp/http_server.py"))
            .arg(port.to_string())
            .arg(dir.join("held"))
            .arg(name)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .spawn()
            .expect("python3");
        let mut server = Self { child, log };
        let deadline = tokio::time::Instant::now() + support::WAIT;
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!(
                    "the HTTP MCP server exited ({status}; scripts/ensure-servers installs `mcp`):\n{}",
                    server.log()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the HTTP MCP server does not listen on port {port}:\n{}",
                server.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The outcome of an asked question that was answered.
fn answered(
    (job, outcome): (
        toolfleet_protocol::ChatJob,
        Result<toolfleet_protocol::client::ChatOutcome, toolfleet_protocol::client::ClientError>,
    ),
) -> toolfleet_protocol::client::ChatOutcome {
    outcome.unwrap_or_else(|e| panic!("{}: {e}", job.invocation_id))
}

/// The outcome of `question` once the orchestrator offers the tool its
/// script calls: a worker just started may be missing from a catalog
/// reading (under load, its `INFO` answer can come after the reading ends),
/// and the model then reads that there is no such tool.
async fn ask_when_offered(env: &Env, question: &str) -> toolfleet_protocol::client::ChatOutcome {
    let deadline = tokio::time::Instant::now() + support::WAIT;
    loop {
        let outcome = answered(env.ask(question).await);
        if !outcome.text.contains("there is no tool named") {
            return outcome;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{question}: {}",
            outcome.text
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A loopback port free now (the test's HTTP server takes it, and takes it
/// again when started again).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A streamable HTTP server's tools answer chat jobs like a stdio
/// server's; the server dying fails the call in flight and the calls while
/// it is down `mcp_unavailable`, and once it is back on its port the next
/// call is answered by the new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamable_http_servers_tools_answer_chat_jobs_across_its_restart() {
    use toolfleet_protocol::ToolStatus;

    let env = Env::start_with(
        json!({
            "rules": [
                { "whenUserContains": ["tide"], "steps": [
                    { "toolCalls": [ { "name": "mcp_tides_tide", "arguments": { "harbour": "Brest" } } ] },
                    { "answer": "Tide: {{tool:mcp_tides_tide}}" }
                ] },
                { "whenUserContains": ["hold"], "steps": [
                    { "toolCalls": [ { "name": "mcp_tides_hold", "arguments": {} } ] },
                    { "answer": "After the hold: {{tool:mcp_tides_hold}}" }
                ] }
            ]
        }),
        Options {
            workers: vec![],
            ..Options::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = HttpServer::start(port, dir.path(), "first").await;
    let config: toolfleet_worker_mcp::McpConfig = toml::from_str(&format!(
        "[servers.tides]\nurl = \"http://127.0.0.1:{port}/mcp\"\ntimeout_ms = 20000\ntrusted = true\n"
    ))
    .unwrap();
    config.check().unwrap();
    let imported = tokio::time::timeout(support::WAIT, toolfleet_worker_mcp::import(&config))
        .await
        .expect("the import ends in time")
        .unwrap_or_else(|e| panic!("the tides server is imported: {e}\n{}", server.log()));
    assert!(imported.skipped.is_empty(), "{:?}", imported.skipped);
    let mut ids: Vec<String> = imported
        .worker
        .definitions()
        .map(|d| d.id.to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["mcp_tides:hold@1.0.0", "mcp_tides:tide@1.0.0"]);
    let metrics = imported.metrics.clone();
    let _worker = env.start_worker(imported.worker).await;

    // Over HTTP, by the server's process.
    let outcome = ask_when_offered(&env, "what is the tide at Brest?").await;
    assert!(
        outcome
            .text
            .contains("\nBrest: high water at 06:12 (the first server)\n</untrusted_mcp_content"),
        "{}",
        outcome.text
    );

    // The server dies with a call in flight: the call fails (not run
    // again: the tool does not say it is safe to repeat) and the model
    // reads why.
    let held = dir.path().join("held");
    let (asked, ()) = tokio::join!(env.ask("hold the line"), async {
        let deadline = tokio::time::Instant::now() + support::WAIT;
        while !held.exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the hold call never reached the server"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        server.kill();
    });
    let outcome = answered(asked);
    assert!(
        outcome
            .text
            .contains("After the hold: Error: MCP server tides is unavailable"),
        "{}",
        outcome.text
    );
    assert_eq!(
        support::result_codes(&outcome.events),
        [(ToolStatus::Error, Some("mcp_unavailable".into()))]
    );

    // While it is down, a call finds it gone.
    let outcome = answered(env.ask("what is the tide now?").await);
    assert!(
        outcome
            .text
            .contains("Tide: Error: MCP server tides is unavailable"),
        "{}",
        outcome.text
    );
    assert_eq!(
        support::result_codes(&outcome.events),
        [(ToolStatus::Error, Some("mcp_unavailable".into()))]
    );

    // Back on its port: the next call is answered, by the new process.
    server = HttpServer::start(port, dir.path(), "second").await;
    let outcome = answered(env.ask("and the tide at Brest now?").await);
    assert!(
        outcome
            .text
            .contains("\nBrest: high water at 06:12 (the second server)\n</untrusted_mcp_content"),
        "{}\n{}",
        outcome.text,
        server.log()
    );

    let calls = |outcome: &str| metrics.calls("tides", outcome);
    assert_eq!(calls("ok"), 2);
    assert_eq!(calls("unavailable"), 2);
    assert_eq!(calls("timeout") + calls("refused"), 0);
}

/// `toolfleet mcp serve`, as a real MCP client (the official Python SDK)
/// sees it: the fleet's live tools listed with their schemas, one called as
/// a real tool job, an unknown one refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_mcp_client_lists_and_calls_the_fleets_tools() {
    let env = Env::start_only(json!({ "rules": [] }), &["system"]).await;
    // Over stdio (the client starts `toolfleet mcp serve`), then over
    // streamable HTTP (a `toolfleet mcp serve --http` already running).
    check_client_saw(client(env!("CARGO_BIN_EXE_toolfleet"), &env.nats.url()).await);
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["mcp", "serve", "--http", "127.0.0.1:0"])
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = server.stderr.take().unwrap();
    let kill = support::KillOnDrop(&mut server);
    let url = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| {
                l.split_once("listening on ")
                    .map(|(_, url)| url.to_string())
            })
            .expect("the server says where it listens")
    })
    .await
    .unwrap();
    check_client_saw(client(&url, &env.nats.url()).await);
    // SIGTERM stops it at once.
    let pid = kill.0.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let deadline = std::time::Instant::now() + support::WAIT;
    let status = loop {
        if let Some(status) = kill.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "mcp serve --http did not stop"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}

/// Runs the Python SDK's client against `target` (the binary, or a URL).
async fn client(target: &str, nats_url: &str) -> serde_json::Value {
    let (target, nats_url) = (target.to_string(), nats_url.to_string());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(support::root().join("tests/mcp/fleet_client.py"))
            .args([
                target.as_str(),
                "current_datetime",
                r#"{"utcOffset": "+02:00"}"#,
            ])
            .env("TOOLFLEET_NATS_URL", nats_url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What the client must have seen: the one live tool with its schema, its
/// call's text and structured content, and the unknown tool refused.
fn check_client_saw(seen: serde_json::Value) {
    assert_eq!(seen["tools"], json!(["current_datetime"]), "{seen}");
    assert_eq!(
        seen["schemas"]["current_datetime"]["properties"]["utcOffset"]["type"],
        "string"
    );
    assert_eq!(seen["isError"], false, "{seen}");
    let text = seen["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("+02:00"), "{seen}");
    assert_eq!(seen["structured"]["utcOffset"], "+02:00", "{seen}");
    assert!(
        seen["missing"]
            .as_str()
            .unwrap()
            .contains("no live tool of the fleet is named no_such_tool"),
        "{seen}"
    );
}

/// A client that gives up on a call (its timeout, or an MCP client's
/// cancel) cancels it in the fleet: the call's cancel goes out, so a
/// worker stops the tool or refuses its job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_given_up_on_is_cancelled_in_the_fleet() {
    let env = Env::start_bare(json!({ "rules": [] })).await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "nobody");
    let tool = toolfleet_protocol::tools::load_file(&path).unwrap();
    let mut cancels = env.subscribe("toolfleet.chat.cancel.>".into()).await;
    let given_up = toolfleet_protocol::client::call_tool(
        &env.client,
        &env.subjects,
        &tool,
        "acme",
        json!({}),
        std::time::Duration::from_millis(300),
        |_| {},
    )
    .await;
    assert!(
        matches!(
            given_up,
            Err(toolfleet_protocol::client::ClientError::Timeout(_))
        ),
        "{given_up:?}"
    );
    let cancel = tokio::time::timeout(support::WAIT, futures::StreamExt::next(&mut cancels))
        .await
        .expect("the call's cancel")
        .unwrap();
    let (tenant, _, call) = env
        .subjects
        .parse_cancel_call(cancel.subject.as_str())
        .unwrap_or_else(|| panic!("not a call's cancel: {}", cancel.subject));
    assert_eq!(tenant, "acme");
    assert!(call.starts_with("call_"), "{call}");
}

/// The worker as a process: when its server adds a tool and says its list
/// changed, the new tool is listed, advertised and answers chat jobs,
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_tool_list_is_served_without_a_restart() {
    let env = Env::start_bare(json!({
        "rules": [
            { "whenUserContains": ["learn"], "steps": [
                { "toolCalls": [ { "name": "mcp_notes_learn", "arguments": { "word": "beacon" } } ] },
                { "answer": "Taught: {{tool:mcp_notes_learn}}" }
            ] },
            { "whenUserContains": ["recall"], "steps": [
                { "toolCalls": [ { "name": "mcp_notes_recall", "arguments": {} } ] },
                { "answer": "Recalled: {{tool:mcp_notes_recall}}" }
            ] }
        ]
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mcp.toml");
    std::fs::write(
        &config,
        format!(
            "[servers.notes]\ncommand = [\"python3\", \"{}\"]\ntrusted = true\n",
            support::root().join("tests/mcp/notes_server.py").display()
        ),
    )
    .unwrap();
    let child = std::process::Command::new(support::sibling_bin("toolfleet-worker-mcp"))
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env("TOOLFLEET_REDIS_URL", env.redis.url())
        .env("TOOLFLEET_MCP_CONFIG", &config)
        .env("TOOLFLEET_METRICS_ADDR", "127.0.0.1:0")
        .env("TOOLFLEET_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("worker.log")).unwrap())
        .spawn()
        .unwrap();
    let log = dir.path().join("worker.log");
    let mut child = child;
    let _kill = support::KillOnDrop(&mut child);
    // Once the pool is live, teach the server its new tool.
    let asked = |question: &'static str, wanted: &'static str| {
        let (env, log) = (&env, &log);
        async move {
            let deadline = tokio::time::Instant::now() + support::WAIT;
            loop {
                let (_, outcome) = env.ask(question).await;
                let text = outcome.map(|o| o.text).unwrap_or_else(|e| e.to_string());
                if text.contains(wanted) {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{question}: {text}\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
        }
    };
    asked("please learn a word", "\nlearned\n</untrusted_mcp_content").await;
    // The new tool answers once the worker has served the new list.
    asked(
        "now recall it",
        "\nlearned: beacon\n</untrusted_mcp_content",
    )
    .await;
}

/// Cites what it found, after telling how far it got.
struct Tidings;

impl toolfleet_worker::Tool for Tidings {
    type Args = serde_json::Value;
    async fn call(
        &self,
        ctx: &toolfleet_worker::ToolCtx,
        _args: serde_json::Value,
    ) -> Result<toolfleet_worker::ToolOutput, toolfleet_worker::ToolError> {
        ctx.progress("halfway through the tidings").await;
        let cited = ctx
            .cite(vec![toolfleet_worker::NewReference {
                kind: "web".into(),
                title: "Tidings page".into(),
                source: None,
                url: Some("https://example.com/tidings".into()),
                snippet: Some("all is well".into()),
            }])
            .await?;
        Ok(toolfleet_worker::ToolOutput::text(format!(
            "all is well [doc:{}]",
            cited[0].index
        )))
    }
}

/// Through `toolfleet mcp serve --profile`: only the profile's tools are
/// listed, a tool's progress reaches the MCP client as progress
/// notifications, and its references as resource links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_serve_passes_progress_and_references_and_keeps_to_the_profile() {
    let env = Env::start_only(json!({ "rules": [] }), &["system"]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "tidings");
    let worker = toolfleet_worker::Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.tidings", Tidings)
        .build()
        .unwrap();
    let _tidings = env.start_worker(worker).await;
    let profiles = dir.path().join("toolfleet.toml");
    std::fs::write(
        &profiles,
        format!(
            "default_profile = \"default\"\n[deployments.d]\nbase_url = \"{}\"\nmodel = \"m\"\n\
             [profiles.default]\ndeployment = \"d\"\n\
             [profiles.news]\ndeployment = \"d\"\ntools = [\"testing:tidings\"]\n",
            env.model.base_url()
        ),
    )
    .unwrap();
    let out = tokio::task::spawn_blocking({
        let (url, profiles) = (env.nats.url(), profiles.clone());
        move || {
            std::process::Command::new("python3")
                .arg(support::root().join("tests/mcp/fleet_client.py"))
                .args([env!("CARGO_BIN_EXE_toolfleet"), "tidings", "{}"])
                .env("TOOLFLEET_NATS_URL", url)
                .env("TOOLFLEET_CONFIG", profiles)
                .env("TOOLFLEET_MCP_PROFILE", "news")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The profile's one tool, not the system worker's.
    assert_eq!(seen["tools"], json!(["tidings"]), "{seen}");
    assert_eq!(seen["isError"], false, "{seen}");
    assert_eq!(
        seen["progress"],
        json!(["halfway through the tidings"]),
        "{seen}"
    );
    let content = seen["content"].as_array().unwrap();
    assert!(
        content[0]["text"]
            .as_str()
            .unwrap()
            .starts_with("all is well"),
        "{seen}"
    );
    let link = content
        .iter()
        .find(|c| c["type"] == "resource_link")
        .unwrap_or_else(|| panic!("no resource link: {seen}"));
    assert_eq!(link["uri"], "https://example.com/tidings");
    assert_eq!(link["title"], "Tidings page");
}
