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
//! - `tasks/list`, an unknown id and a bad cursor;
//! - a second tenant's `mcp serve`, given the first's task ids, finds none
//!   of them (get, result, cancel) and lists none, and the first's task
//!   runs on untouched.

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

/// The fleet: the system family (`current_datetime`, with an output
/// schema) and a `stall` tool (two minutes' timeout).
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
    let worker = toolfleet_worker::Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.stall", stall)
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
    assert!(
        seen["cancelledResult"]
            .as_str()
            .unwrap()
            .contains("was cancelled"),
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_mcp_client_runs_tools_as_tasks_over_stdio_and_http() {
    let dir = tempfile::tempdir().unwrap();
    let (env, dropped, _worker) = fleet(dir.path()).await;
    let mut cancels = env.subscribe("toolfleet.chat.cancel.>".into()).await;
    let binary = env!("CARGO_BIN_EXE_toolfleet");
    let args = ["owner", "current_datetime", "stall"];

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

    // Over streamable HTTP.
    let (mut server, url) = serve_http(&env, "acme").await;
    let _server = KillOnDrop(&mut server);
    let seen = client(&url, &env, "acme", &args).await;
    check_owner_saw(&seen);
    until_count(&dropped, 3, "the worker did not drop the cancelled call").await;
    let kept = seen["kept"].as_str().unwrap();
    let done = client(&url, &env, "acme", &["finish", kept]).await;
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
    let args = ["owner", "current_datetime", "stall"];
    let seen = client(&acme_url, &env, "acme", &args).await;
    check_owner_saw(&seen);
    let ids: Vec<String> = ["task", "cancelled"]
        .iter()
        .map(|k| seen[k]["taskId"].as_str().unwrap().to_string())
        .chain([seen["kept"].as_str().unwrap().to_string()])
        .collect();

    let mut args = vec!["intruder"];
    args.extend(ids.iter().map(String::as_str));
    let tried = client(&globex_url, &env, "globex", &args).await;
    for id in &ids {
        for method in ["tasks/get", "tasks/result", "tasks/cancel"] {
            let answer = tried["tries"][id][method].as_str().unwrap();
            assert!(
                answer.contains(&format!("no task {id}")),
                "{method} {id}: {answer}"
            );
        }
    }
    assert_eq!(tried["listed"], json!([]), "{tried}");

    // acme's task runs on, untouched, until acme cancels it.
    let kept = &ids[2];
    let done = client(&acme_url, &env, "acme", &["finish", kept]).await;
    assert_eq!(done["before"]["status"], "working", "{done}");
    assert_eq!(done["after"]["status"], "cancelled", "{done}");
    until_count(
        &dropped,
        2,
        "the worker did not drop acme's cancelled calls",
    )
    .await;
}
