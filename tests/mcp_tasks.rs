//! MCP tasks (2025-11-25) and `outputSchema` of `toolfleet mcp serve`,
//! driven by the official Python SDK's client (`tests/mcp/task_client.py`,
//! which checks every answer against the SDK's own 2025-11-25 wire
//! models) over stdio and streamable HTTP, on a real fleet (NATS, Redis):
//!
//! - the tasks capability declared, tools listed with `outputSchema` and
//!   `execution.taskSupport`, a typed call's `structuredContent` checked
//!   by the SDK against the schema;
//! - a tool called as a task: polled with `tasks/get` until completed, its
//!   result from `tasks/result` (with the task in `_meta`); another's
//!   `tasks/result` asked for at once, waiting for the end;
//! - a long task, its status message the tool's progress, cancelled with
//!   `tasks/cancel`: the fleet job is cancelled
//!   (its cancel subject, and the worker drops the tool's call), the task
//!   stays cancelled, its result and a second cancel refused;
//! - `tasks/list`, an unknown id and a bad cursor; a cancelled task's
//!   `tasks/result` an internal error, not an unknown id's -32602;
//! - a tool whose data breaks its declared `outputSchema`: a tool error
//!   without `structuredContent` (the SDK raises on content that breaks
//!   the schema), and as a task a failed one;
//! - a task asked with ttl 0 is granted the floor (60 s past the tool's
//!   timeout) and runs to its end;
//! - another session of the same `mcp serve` (HTTP), given the first's
//!   task ids while the first is open, finds none of them (get, result,
//!   cancel) and lists none; the owning session then cancels its task;
//! - a second tenant's `mcp serve`, likewise.

// The harness is shared with other targets; its start is over 100 lines.
#[allow(clippy::too_many_lines)]
mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::StreamExt;
use serde_json::{Value, json};
use support::{Env, KillOnDrop, WAIT};

/// Never answers: says so as progress, then waits until the worker drops
/// it (a cancel), counting the drops.
struct Stall {
    dropped: Arc<AtomicUsize>,
}

/// Counts a drop.
struct Dropped(Arc<AtomicUsize>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl toolfleet_worker::Tool for Stall {
    type Args = Value;
    async fn call(
        &self,
        ctx: &toolfleet_worker::ToolCtx,
        _args: Value,
    ) -> Result<toolfleet_worker::ToolOutput, toolfleet_worker::ToolError> {
        let _dropped = Dropped(self.dropped.clone());
        ctx.progress("stalling until cancelled").await;
        std::future::pending::<()>().await;
        unreachable!("pending never ends")
    }
}

/// Answers data that breaks its declared `outputSchema` (`n` is to be an
/// integer).
struct Mismatch;

impl toolfleet_worker::Tool for Mismatch {
    type Args = Value;
    async fn call(
        &self,
        _ctx: &toolfleet_worker::ToolCtx,
        _args: Value,
    ) -> Result<toolfleet_worker::ToolOutput, toolfleet_worker::ToolError> {
        toolfleet_worker::ToolOutput::text("three").with_data(json!({ "n": "three" }))
    }
}

/// The fleet: the system family (`current_datetime`, with an output
/// schema), a `stall` tool (two minutes' timeout) and a `mismatch` tool.
async fn fleet(dir: &Path) -> (Env, Arc<AtomicUsize>, support::TestWorker) {
    let env = Env::start_only(json!({ "rules": [] }), &["system"]).await;
    let path = support::renamed_definition(dir, "testing", "stall");
    let mut def: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    def["timeoutMs"] = json!(120_000);
    std::fs::write(&path, def.to_string()).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let stall = Stall {
        dropped: dropped.clone(),
    };
    let mismatch = support::renamed_definition(dir, "testing", "mismatch");
    let mut def: Value =
        serde_json::from_str(&std::fs::read_to_string(&mismatch).unwrap()).unwrap();
    def["outputSchema"] = json!({
        "type": "object",
        "properties": { "n": { "type": "integer" } },
        "required": ["n"]
    });
    std::fs::write(&mismatch, def.to_string()).unwrap();
    let worker = toolfleet_worker::Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.stall", stall)
        .definition_file(&mismatch)
        .tool("testing.mismatch", Mismatch)
        .build()
        .unwrap();
    let worker = env.start_worker(worker).await;
    (env, dropped, worker)
}

/// `toolfleet mcp serve --http` for `tenant`, and its URL.
async fn serve_http(env: &Env, tenant: &str) -> (std::process::Child, String) {
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["mcp", "serve", "--http", "127.0.0.1:0", "--tenant", tenant])
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = server.stderr.take().unwrap();
    let url = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stderr).lines();
        let url = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.split_once("listening on ").map(|(_, u)| u.to_string()))
            .expect("the server says where it listens");
        // Keep reading, so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        url
    })
    .await
    .unwrap();
    (server, url)
}

/// Runs the task client against `target` as `tenant` (for stdio).
async fn client(target: &str, env: &Env, tenant: &str, args: &[&str]) -> Value {
    let mut command = std::process::Command::new("python3");
    command
        .arg(support::root().join("tests/mcp/task_client.py"))
        .arg(target)
        .args(args)
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env("TOOLFLEET_TENANT", tenant);
    let out = tokio::time::timeout(
        WAIT * 4,
        tokio::task::spawn_blocking(move || command.output()),
    )
    .await
    .expect("the client ends")
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"))
}

/// Waits until `count` reaches `n`.
async fn until_count(count: &AtomicUsize, n: usize, what: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while count.load(Ordering::SeqCst) < n {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// What the owner's client must have seen.
fn check_owner_saw(seen: &Value) {
    assert_eq!(
        seen["capabilities"]["tasks"],
        json!({ "list": {}, "cancel": {}, "requests": { "tools": { "call": {} } } }),
        "{seen}"
    );
    assert_eq!(seen["outputSchema"]["type"], "object", "{seen}");
    assert!(seen["outputSchema"]["properties"]["utcOffset"].is_object());
    assert_eq!(seen["execution"]["taskSupport"], "optional");
    assert_eq!(seen["typedStructured"]["utcOffset"], "+01:00", "{seen}");

    let task = &seen["task"];
    let id = task["taskId"].as_str().unwrap();
    assert!(
        id.starts_with("inv-"),
        "the task is the fleet invocation: {id}"
    );
    assert_eq!(task["ttl"], 600_000);
    assert!(task["pollInterval"].as_u64().unwrap() > 0);
    assert_eq!(
        seen["statuses"].as_array().unwrap().last().unwrap(),
        "completed"
    );
    let result = &seen["result"];
    assert_eq!(result["isError"], false, "{seen}");
    assert_eq!(result["structuredContent"]["utcOffset"], "+01:00", "{seen}");
    assert_eq!(
        result["_meta"]["io.modelcontextprotocol/related-task"]["taskId"],
        id
    );

    // tasks/result of a working task waited for its end.
    assert_eq!(
        seen["waitedResult"]["structuredContent"]["utcOffset"], "-03:00",
        "{seen}"
    );
    // A working task's status message is the tool's latest progress.
    assert_eq!(seen["slowWorking"]["status"], "working", "{seen}");
    assert_eq!(
        seen["slowWorking"]["statusMessage"], "stalling until cancelled",
        "{seen}"
    );
    assert_eq!(seen["cancelled"]["status"], "cancelled", "{seen}");
    assert_eq!(seen["cancelledAfter"]["status"], "cancelled", "{seen}");
    // What the cancelled call itself answers: an internal error, not
    // the -32602 of an unknown id.
    let cancelled_result = seen["cancelledResult"].as_str().unwrap();
    assert!(
        cancelled_result.starts_with("[-32603] ") && cancelled_result.contains("was cancelled"),
        "{seen}"
    );
    assert!(
        seen["unknown"].as_str().unwrap().starts_with("[-32602] "),
        "{seen}"
    );
    assert!(
        seen["cancelAgain"]
            .as_str()
            .unwrap()
            .contains("cannot be cancelled"),
        "{seen}"
    );
    assert!(
        seen["unknown"]
            .as_str()
            .unwrap()
            .contains("no task inv-nonexistent")
    );
    assert!(
        seen["badCursor"].as_str().unwrap().contains("cursor"),
        "{seen}"
    );
    let listed = seen["listed"].as_array().unwrap();
    for key in ["task", "cancelled"] {
        assert!(listed.contains(&seen[key]["taskId"]), "{key}: {seen}");
    }
    assert!(listed.contains(&seen["kept"]), "{seen}");
    check_mismatch_and_ttl(seen);
}

/// The tool whose data breaks its schema, and the task asked with ttl 0.
fn check_mismatch_and_ttl(seen: &Value) {
    let mismatch = &seen["mismatch"];
    for result in [&mismatch["typed"], &mismatch["result"]] {
        assert_eq!(result["isError"], true, "{seen}");
        assert!(result.get("structuredContent").is_none(), "{seen}");
        let text = result["content"][0]["text"].as_str().unwrap();
        assert!(
            text.starts_with("output_schema_mismatch: its data does not match"),
            "{text}"
        );
    }
    assert_eq!(
        mismatch["statuses"].as_array().unwrap().last().unwrap(),
        "failed",
        "{seen}"
    );
    // ttl 0 asked: the floor granted (60 s past the tool's timeout and
    // the call's margin), and the task ran to its end.
    let tiny = &seen["tinyTtl"];
    assert!(tiny["ttl"].as_u64().unwrap() >= 60_000, "{seen}");
    assert_eq!(
        tiny["statuses"].as_array().unwrap().last().unwrap(),
        "completed",
        "{seen}"
    );
    assert_eq!(tiny["result"]["structuredContent"]["utcOffset"], "+02:00");
}

/// The task client's `owner … hold` as it runs: what it saw first, and a
/// way to let it finish (cancel the task it left running, in its own
/// session) for what it saw then.
struct Holding {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Holding {
    /// Starts it against `url` and waits for its first report.
    async fn start(url: &str, env: &Env, tenant: &str) -> (Self, Value) {
        let mut child = std::process::Command::new("python3")
            .arg(support::root().join("tests/mcp/task_client.py"))
            .args([
                url,
                "owner",
                "current_datetime",
                "stall",
                "mismatch",
                "hold",
            ])
            .env("TOOLFLEET_NATS_URL", env.nats.url())
            .env("TOOLFLEET_TENANT", tenant)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut holding = Self {
            child,
            lines: std::io::BufRead::lines(std::io::BufReader::new(stdout)),
        };
        let seen = holding.next().await;
        (holding, seen)
    }

    async fn next(&mut self) -> Value {
        let line = tokio::task::block_in_place(|| self.lines.next());
        let line = line.expect("the client reports").unwrap();
        serde_json::from_str(&line).unwrap()
    }

    /// Lets it cancel its kept task: what it saw of it before and after.
    async fn finish(mut self) -> Value {
        use std::io::Write;
        let mut stdin = self.child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        drop(stdin);
        let done = tokio::time::timeout(WAIT, self.next())
            .await
            .expect("it finishes");
        let status = tokio::task::block_in_place(|| self.child.wait()).unwrap();
        assert!(status.success());
        done
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The ids of the owner's tasks: the quick one, the cancelled one, the
/// one kept running.
fn task_ids(seen: &Value) -> Vec<String> {
    ["task", "cancelled"]
        .iter()
        .map(|k| seen[k]["taskId"].as_str().unwrap().to_string())
        .chain([seen["kept"].as_str().unwrap().to_string()])
        .collect()
}

/// An intruder at `url` tried `ids`: none found, none listed.
async fn check_intruder_finds_none(url: &str, env: &Env, tenant: &str, ids: &[String]) {
    let mut args = vec!["intruder"];
    args.extend(ids.iter().map(String::as_str));
    let tried = client(url, env, tenant, &args).await;
    for id in ids {
        for method in ["tasks/get", "tasks/result", "tasks/cancel"] {
            let answer = tried["tries"][id][method].as_str().unwrap();
            assert!(
                answer.contains(&format!("[-32602] no task {id}")),
                "{method} {id}: {answer}"
            );
        }
    }
    assert_eq!(tried["listed"], json!([]), "{tried}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_mcp_client_runs_tools_as_tasks_over_stdio_and_http() {
    let dir = tempfile::tempdir().unwrap();
    let (env, dropped, _worker) = fleet(dir.path()).await;
    let mut cancels = env.subscribe("toolfleet.chat.cancel.>".into()).await;
    let binary = env!("CARGO_BIN_EXE_toolfleet");
    let args = ["owner", "current_datetime", "stall", "mismatch"];

    // Over stdio: the kept task ends with the server (the client closes it).
    let seen = client(binary, &env, "acme", &args).await;
    check_owner_saw(&seen);
    // The fleet job was cancelled: its cancel went out, and the worker
    // dropped the tool's call.
    let cancelled = seen["cancelled"]["taskId"].as_str().unwrap().to_string();
    let subject = tokio::time::timeout(WAIT, cancels.next())
        .await
        .expect("a cancel")
        .unwrap()
        .subject;
    assert!(subject.contains(&cancelled), "{subject}");
    // The kept task ended with its server (the client closed it): its
    // fleet job was cancelled too.
    until_count(&dropped, 2, "the worker did not drop the cancelled calls").await;

    // Over streamable HTTP, the owner's session kept open.
    let (mut server, url) = serve_http(&env, "acme").await;
    let _server = KillOnDrop(&mut server);
    let (owner, seen) = Holding::start(&url, &env, "acme").await;
    check_owner_saw(&seen);
    until_count(&dropped, 3, "the worker did not drop the cancelled call").await;
    // Another session of the same process, same tenant: none of the
    // owner's tasks is there for it.
    check_intruder_finds_none(&url, &env, "acme", &task_ids(&seen)).await;
    // The owning session then cancels its task, still running.
    let done = owner.finish().await;
    assert_eq!(done["before"]["status"], "working", "{done}");
    assert_eq!(done["after"]["status"], "cancelled", "{done}");
    until_count(&dropped, 4, "the worker did not drop the finished call").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_neither_sees_nor_cancels_a_task() {
    let dir = tempfile::tempdir().unwrap();
    let (env, dropped, _worker) = fleet(dir.path()).await;
    let (mut acme, acme_url) = serve_http(&env, "acme").await;
    let _acme = KillOnDrop(&mut acme);
    let (mut globex, globex_url) = serve_http(&env, "globex").await;
    let _globex = KillOnDrop(&mut globex);
    let (owner, seen) = Holding::start(&acme_url, &env, "acme").await;
    check_owner_saw(&seen);
    check_intruder_finds_none(&globex_url, &env, "globex", &task_ids(&seen)).await;

    // acme's task runs on, untouched, until acme cancels it.
    let done = owner.finish().await;
    assert_eq!(done["before"]["status"], "working", "{done}");
    assert_eq!(done["after"]["status"], "cancelled", "{done}");
    until_count(
        &dropped,
        2,
        "the worker did not drop acme's cancelled calls",
    )
    .await;
}
