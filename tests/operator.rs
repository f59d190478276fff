//! The operator's commands against a running fleet: `toolfleet status`
//! shows the instances and tools with the jobs they ran — JetStream jobs
//! counted in `$SRV.STATS` too — their backlog and last error, and exits 1
//! for a pool with waiting jobs and no instance; `toolfleet events`
//! replays a finished invocation and follows a running one to its end.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{self, Env, Options, WAIT};

fn toolfleet(env: &Env, args: &[&str]) -> (Option<i32>, String, String) {
    support::toolfleet_at(&env.nats.url(), args)
}

struct Broken;

impl Tool for Broken {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        Err(ToolError::failed("the gauge is broken"))
    }
}

fn clock_script() -> Value {
    json!({
        "rules": [{ "whenUserContains": ["time"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
            { "answer": "The clock says {{tool:current_datetime}}." }
        ] }]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_jetstream_jobs_and_names_pools_nobody_serves() {
    let env = Env::start_only(clock_script(), &["system"]).await;
    let (job, out) = env.ask("What time is it?").await;
    out.unwrap_or_else(|e| panic!("{}: {e}", job.invocation_id));

    // A tool of the test's own that fails, run once through JetStream.
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "gauge");
    let worker = Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.gauge", Broken)
        .build()
        .unwrap();
    let gauge = env.start_worker(worker).await;
    let id: toolfleet_protocol::tools::ToolId = "testing:gauge@1.0.0".parse().unwrap();
    let publish = |call_id: &'static str| {
        let call = toolfleet_protocol::CallContext {
            invocation: toolfleet_protocol::InvocationContext::new("inv-status-1"),
            call_id: call_id.into(),
            tool_id: id.clone(),
            attempt: 1,
            reply_to: env.subjects.reply_inbox(),
            citation_floor: 0,
            new_call: false,
        };
        let js = async_nats::jetstream::new(env.client.clone());
        let subject = env.subjects.tool(&id);
        async move {
            js.publish_with_headers(subject, call.to_headers(), r#"{"arguments":{}}"#.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    publish("call-status-1").await;

    let deadline = tokio::time::Instant::now() + WAIT;
    let status = loop {
        let (code, out, err) = toolfleet(&env, &["status", "-o", "json"]);
        // A worker's answer may come late on a busy machine: ask again.
        if code != Some(0) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{code:?} {out}{err}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let status: Value = serde_json::from_str(&out).unwrap();
        let tool = |id: &str| {
            status["tools"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["tool"] == id)
                .cloned()
                .unwrap_or(Value::Null)
        };
        if tool("testing:gauge@1.0.0")["errors"] == 1
            && tool("system:current_datetime@1.0.0")["jobs"].as_u64() >= Some(1)
        {
            break status;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let tools = status["tools"].as_array().unwrap();
    let clock = tools
        .iter()
        .find(|t| t["tool"] == "system:current_datetime@1.0.0")
        .unwrap();
    assert_eq!(clock["instances"], 1, "{clock}");
    // The model's call came through JetStream, and $SRV.STATS counted it.
    assert!(clock["jetstream"].as_u64() >= Some(1), "{clock}");
    assert_eq!(clock["errors"], 0, "{clock}");
    assert_eq!(clock["backlog"], 0, "{clock}");
    let gauge_row = tools
        .iter()
        .find(|t| t["tool"] == "testing:gauge@1.0.0")
        .unwrap();
    assert_eq!(
        gauge_row["last_error"]["code"], "tool_failed",
        "{gauge_row}"
    );
    assert!(
        gauge_row["last_error"]["message"]
            .as_str()
            .unwrap()
            .contains("the gauge is broken"),
        "{gauge_row}"
    );
    let workers: Vec<&str> = status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["worker"].as_str().unwrap())
        .collect();
    assert!(
        workers.contains(&"system") && workers.contains(&"testing"),
        "{workers:?}"
    );
    // The same, as tables.
    let (code, table, _) = toolfleet(&env, &["status", "-o", "table"]);
    assert_eq!(code, Some(0));
    assert!(table.contains("INSTANCES") && table.contains("system:current_datetime@1.0.0"));
    assert!(table.contains("tool_failed: "), "{table}");

    // The pool goes away; a job waits for it: status says so and fails.
    gauge.stop().await;
    publish("call-status-2").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (code, out, err) = toolfleet(&env, &["status"]);
        if code == Some(3) {
            assert!(err.contains("testing:gauge@1.0.0"), "{err}");
            assert!(out.contains("testing:gauge@1.0.0"), "{out}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{out}{err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_replays_a_finished_invocation_and_follows_a_running_one() {
    let mut script = clock_script();
    script["rules"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "whenUserContains": ["gate"], "steps": [
            { "toolCalls": [ { "name": "gate", "arguments": {} } ] },
            { "answer": "Past the gate: {{tool:gate}}" }
        ] }));
    let env = Env::start_only(script, &["system"]).await;
    // A tool that answers only when the test opens the gate.
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "gate");
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let worker = Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.gate", Gate(gate.clone()))
        .build()
        .unwrap();
    let _gate_worker = env.start_worker(worker).await;
    let (job, out) = env.ask("What time is it?").await;
    out.unwrap();
    let inv = job.invocation_id.as_str();

    let (code, out, err) = toolfleet(&env, &["events", inv, "-o", "json"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let events: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"started"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"completed"), "{kinds:?}");
    assert!(kinds.contains(&"tool_call") && kinds.contains(&"tool_result"));
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] > w[0]), "{seqs:?}");
    assert!(events.iter().all(|e| e["published"].is_string()));

    let (code, text, _) = toolfleet(&env, &["events", inv]);
    assert_eq!(code, Some(0));
    assert!(
        text.contains("completed") && text.contains("tool_result"),
        "{text}"
    );
    // The answer's text is in `completed`; the deltas are not kept.
    assert!(!text.contains(" delta "), "{text}");
    assert!(!kinds.contains(&"delta"), "{kinds:?}");
    assert!(
        events.last().unwrap()["text"]
            .as_str()
            .unwrap()
            .contains("The clock says"),
        "{events:?}"
    );

    let (code, _, err) = toolfleet(&env, &["events", "inv-nobody-ran"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no events of inv-nobody-ran"), "{err}");
    let (code, _, err) = toolfleet(&env, &["events", "not an id"]);
    assert_eq!(code, Some(64), "{err}");

    // A running invocation (its tool waits at the gate): `--no-follow`
    // stops at what is stored, following waits for its end.
    let gated = toolfleet_protocol::client::question("through the gate please");
    let mut live = env.follow_and_submit(&gated).await;
    loop {
        let ev = support::next_json(&mut live).await;
        assert_ne!(ev["type"], "error", "{ev}");
        if ev["type"] == "tool_call" {
            break;
        }
    }
    let gated_id = gated.invocation_id.clone();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        // The history is written just after the live event: retry a moment.
        let (code, out, err) = toolfleet(&env, &["events", &gated_id, "--no-follow"]);
        if code == Some(2) && out.contains("tool_call") {
            assert!(err.contains("still running"), "{err}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{code:?} {out}{err}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut follow = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["events", &gated_id])
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the follower has shown what is stored, open the gate.
    let stdout = follow.stdout.take().unwrap();
    let shown = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let mut shown = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            let at_call = line.contains("tool_call");
            shown.push(line);
            if at_call {
                break;
            }
        }
        (lines, shown)
    })
    .await
    .unwrap();
    gate.add_permits(1);
    let (lines, mut shown) = shown;
    let rest = tokio::task::spawn_blocking(move || {
        let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
        let status = follow.wait().unwrap();
        (rest, status)
    })
    .await
    .unwrap();
    shown.extend(rest.0);
    let text = shown.join("\n");
    assert_eq!(rest.1.code(), Some(0), "{text}");
    assert!(
        text.contains("tool_result")
            && text.contains("Past the gate")
            && text.contains("completed"),
        "{text}"
    );
}

/// A tool that answers once the test opens its gate.
struct Gate(std::sync::Arc<tokio::sync::Semaphore>);

impl Tool for Gate {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        let _permit = self
            .0
            .acquire()
            .await
            .map_err(|_| ToolError::failed("closed"))?;
        Ok(ToolOutput::text("opened"))
    }
}

/// A tool that runs until it is stopped.
struct Stall;

impl Tool for Stall {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        ctx.cancelled().await;
        Err(ToolError::Cancelled("stopped".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_call_stops_one_tool_call_and_the_invocation_goes_on() {
    let env = Env::start_with(
        json!({
            "rules": [{ "whenUserContains": ["stall"], "steps": [
                { "toolCalls": [ { "name": "stall", "arguments": {} } ] },
                { "answer": "Went on after: {{tool:stall}}" }
            ] }]
        }),
        Options {
            workers: vec![],
            ..Options::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "stall");
    let mut def: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    def["timeoutMs"] = json!(3_600_000);
    std::fs::write(&path, def.to_string()).unwrap();
    let worker = Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.stall", Stall)
        .build()
        .unwrap();
    let _stall = env.start_worker(worker).await;

    let job = toolfleet_protocol::client::question("please stall");
    let mut events = env.follow_and_submit(&job).await;
    let call_id = loop {
        let ev = support::next_json(&mut events).await;
        assert_ne!(ev["type"], "error", "{ev}");
        if ev["type"] == "tool_call" {
            break ev["callId"].as_str().unwrap().to_string();
        }
    };
    let inv = job.invocation_id.as_str();
    let (code, _, err) = toolfleet(&env, &["cancel", inv, "--call", "no such call!"]);
    assert_eq!(code, Some(64), "{err}");
    // A call of an invocation that never ran: nothing is cancelled, not
    // even the invocation.
    let (code, out, _) = toolfleet(&env, &["cancel", "inv-never-ran", "--call", &call_id]);
    assert_eq!(code, Some(1));
    assert!(out.contains("nothing cancelled"), "{out}");
    // The worker may not have the job yet: the cancel is remembered for it.
    let (code, out, err) = toolfleet(&env, &["cancel", inv, "--call", &call_id]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("cancelled; the invocation goes on"), "{out}");
    let rest = support::events_until_terminal(&mut events).await;
    let result = rest
        .iter()
        .find(|e| e["type"] == "tool_result")
        .unwrap_or_else(|| panic!("{rest:#?}"));
    assert_eq!(result["errorCode"], "call_cancelled", "{result}");
    let last = rest.last().unwrap();
    assert_eq!(last["type"], "completed", "{last}");
    assert!(
        last["text"]
            .as_str()
            .unwrap()
            .contains("an operator cancelled this call"),
        "the model read why: {last}"
    );
    // Once finished, nothing is left to cancel.
    let (code, out, _) = toolfleet(&env, &["cancel", inv, "--call", &call_id]);
    assert_eq!(code, Some(1));
    assert!(out.contains("already finished"), "{out}");
}

/// Alerts on `increase(...)` see the first error only if its series
/// existed before it: every outcome series is there, at zero, from the
/// start (per tool once the fleet's tools are known).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_series_starts_at_zero() {
    let env = Env::start_only(clock_script(), &["system"]).await;
    let tool = "system:current_datetime@1.0.0";
    let wanted = [
        "toolfleet_chat_jobs_total{outcome=\"error\"} 0".to_string(),
        "toolfleet_chat_jobs_total{outcome=\"malformed\"} 0".to_string(),
        "toolfleet_llm_requests_total{model=\"toolfleet-scripted\",outcome=\"ok\"} 0".to_string(),
        format!("toolfleet_tool_jobs_total{{outcome=\"timeout\",tool=\"{tool}\"}} 0"),
        format!("toolfleet_tool_jobs_total{{outcome=\"error\",tool=\"{tool}\"}} 0"),
        format!("toolfleet_dead_letters_total{{kind=\"tool\",tool=\"{tool}\"}} 0"),
        // From the orchestrator's first reading of the pools.
        format!("toolfleet_tool_calls_total{{status=\"error\",tool=\"{tool}\"}} 0"),
        format!("toolfleet_tool_calls_total{{status=\"timeout\",tool=\"{tool}\"}} 0"),
    ];
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = env.metrics_text().await;
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|w| !text.contains(w.as_str()))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{missing:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
