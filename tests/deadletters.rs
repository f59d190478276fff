//! Dead letters you can find: a tool job that exhausts its attempts is
//! kept in the dead-letter stream, `toolfleet deadletters ls` lists it,
//! `show` shows it whole (its job's per-tenant settings never kept), and
//! `replay` runs it again after the fix; a job whose tool no longer has a
//! worker is not replayed, and says why. A sensitive argument is never
//! kept in a dead letter nor shown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{self, Env, WAIT};

struct Flaky {
    fixed: Arc<AtomicBool>,
    answered: Arc<AtomicU32>,
}

impl Tool for Flaky {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        if !self.fixed.load(Ordering::SeqCst) {
            return Err(ToolError::transient("its backend is down"));
        }
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(ToolOutput::text("fine now"))
    }
}

fn deadletters(env: &Env, args: &[&str]) -> (Option<i32>, String, String) {
    let args: Vec<&str> = std::iter::once("deadletters")
        .chain(args.iter().copied())
        .collect();
    support::toolfleet_at(&env.nats.url(), &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_tool_job_is_listed_shown_and_replayed_after_the_fix() {
    let env = Env::start_bare(json!({ "rules": [] })).await;
    // A tool whose backend is down: one attempt, then dead.
    let dir = tempfile::tempdir().unwrap();
    let path = support::renamed_definition(dir.path(), "testing", "flaky");
    let fixed = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU32::new(0));
    let worker = Worker::builder("testing")
        .definition_file(&path)
        .tool(
            "testing.flaky",
            Flaky {
                fixed: fixed.clone(),
                answered: answered.clone(),
            },
        )
        .build()
        .unwrap();
    let mut config = toolfleet_worker::WorkerConfig::new(env.subjects.clone());
    config.max_attempts = 1;
    let running = env.start_worker_with(worker, config).await;

    let id: toolfleet_protocol::tools::ToolId = "testing:flaky@1.0.0".parse().unwrap();
    let call = toolfleet_protocol::CallContext {
        invocation: toolfleet_protocol::InvocationContext::new("inv-dead-1"),
        call_id: "call-dead-1".into(),
        tool_id: id.clone(),
        attempt: 1,
        reply_to: env.subjects.reply_inbox(),
        citation_floor: 0,
        new_call: false,
    };
    let js = async_nats::jetstream::new(env.client.clone());
    js.publish_with_headers(
        env.subjects.tool(&id),
        call.to_headers(),
        json!({ "arguments": { "utcOffset": "+01:00" }, "settings": { "apiKey": "dl-canary-5e1" } })
            .to_string()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    // Listed, newest first, once it is dead.
    let deadline = tokio::time::Instant::now() + WAIT;
    let row = loop {
        let (code, out, err) = deadletters(&env, &["ls", "-o", "json"]);
        assert_eq!(code, Some(0), "{out}{err}");
        let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
        if let Some(row) = rows.into_iter().find(|r| r["callId"] == "call-dead-1") {
            break row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(row["toolId"], "testing:flaky@1.0.0", "{row}");
    assert_eq!(row["code"], "transient_failure", "{row}");
    assert_eq!(row["kind"], "tool", "{row}");
    let seq = row["seq"].as_u64().unwrap().to_string();
    let (code, table, _) = deadletters(&env, &["ls"]);
    assert_eq!(code, Some(0));
    assert!(
        table.starts_with("SEQ") && table.contains("testing:flaky@1.0.0"),
        "{table}"
    );

    // Shown whole: the job's arguments, never its settings.
    let defs = dir.path().to_str().unwrap();
    let (code, shown, err) = deadletters(&env, &["show", &seq, "--tool-definitions", defs]);
    assert_eq!(code, Some(0), "{err}");
    let shown: Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["job"]["arguments"]["utcOffset"], "+01:00", "{shown}");
    assert!(!shown.to_string().contains("dl-canary-5e1"), "{shown}");

    // Fixed, replayed: the tool runs again and answers.
    fixed.store(true, Ordering::SeqCst);
    let (code, out, err) = deadletters(&env, &["replay", &seq]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("replayed to toolfleet.tool.testing.flaky.1_0_0"),
        "{out}"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    while answered.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replayed job never ran"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.stop().await;

    // A dead letter whose tool no worker serves any more.
    let ghost = toolfleet_protocol::DeadLetter {
        kind: toolfleet_protocol::DeadLetterKind::Tool,
        stream: env.subjects.tools_stream(),
        stream_sequence: 1,
        invocation_id: Some("inv-ghost".into()),
        call_id: Some("call-ghost".into()),
        tool_id: Some("ghost:tool@1.0.0".into()),
        attempts: 3,
        code: "transient_failure".into(),
        error: "gone".into(),
        headers: Default::default(),
        raw_headers: None,
        job: Some(json!({ "arguments": {} })),
    };
    env.client
        .publish(
            env.subjects
                .dead_letter(toolfleet_protocol::DeadLetterKind::Tool),
            serde_json::to_vec(&ghost).unwrap().into(),
        )
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    let ghost_seq = loop {
        let (_, out, _) = deadletters(&env, &["ls", "-o", "json"]);
        let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
        if let Some(row) = rows.iter().find(|r| r["callId"] == "call-ghost") {
            break row["seq"].as_u64().unwrap().to_string();
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (code, out, err) = deadletters(&env, &["replay", &ghost_seq]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(err.contains("no worker serves ghost:tool@1.0.0"), "{err}");
    let (code, _, err) = deadletters(&env, &["show", "999999"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no dead letter 999999"), "{err}");
}

/// What a sensitive argument of the test tool carries.
const CANARY: &str = "dl-token-canary-93c";

/// A tool whose backend is down and says so, quoting the token it was given.
struct Secretive;

impl Tool for Secretive {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, args: Value) -> Result<ToolOutput, ToolError> {
        Err(ToolError::transient(format!(
            "the backend refused token {}",
            args["apiToken"].as_str().unwrap_or_default()
        )))
    }
}

/// The definition of `testing:secretive@1.0.0` in `dir`: the clock's,
/// with an `apiToken` argument marked sensitive.
fn secretive_definition(dir: &std::path::Path) -> std::path::PathBuf {
    let path = support::renamed_definition(dir, "testing", "secretive");
    let mut def: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    def["function"]["parameters"]["properties"]["apiToken"] = json!({ "type": "string" });
    def["sensitiveArguments"] = json!(["apiToken"]);
    std::fs::write(&path, def.to_string()).unwrap();
    path
}

/// A dead letter as the stream keeps it, `seq` and all, found by call id.
fn listed(env: &Env, call_id: &str) -> Option<Value> {
    let (code, out, err) = deadletters(env, &["ls", "-o", "json"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        !out.contains(CANARY),
        "ls printed a sensitive argument: {out}"
    );
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    rows.into_iter().find(|r| r["callId"] == call_id)
}

/// Issue 28, item 7: a tool job's sensitive argument never reaches its
/// dead letter (neither its job nor its error text, which quotes it), and
/// `deadletters show` never prints one — not even of a record kept before
/// workers redacted (by the tool's definition; every argument's value
/// when the definition is not known). A redacted job is not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sensitive_argument_is_never_kept_in_a_dead_letter_nor_shown() {
    let env = Env::start_bare(json!({ "rules": [] })).await;
    let dir = tempfile::tempdir().unwrap();
    let path = secretive_definition(dir.path());
    let defs = dir.path().to_str().unwrap();
    let worker = Worker::builder("testing")
        .definition_file(&path)
        .tool("testing.secretive", Secretive)
        .build()
        .unwrap();
    let mut config = toolfleet_worker::WorkerConfig::new(env.subjects.clone());
    config.max_attempts = 1;
    let running = env.start_worker_with(worker, config).await;
    let mut dead_letters = env
        .subscribe(
            env.subjects
                .dead_letter(toolfleet_protocol::DeadLetterKind::Tool),
        )
        .await;

    let id: toolfleet_protocol::tools::ToolId = "testing:secretive@1.0.0".parse().unwrap();
    let call = toolfleet_protocol::CallContext {
        invocation: toolfleet_protocol::InvocationContext::new("inv-secret-1"),
        call_id: "call-secret-1".into(),
        tool_id: id.clone(),
        attempt: 1,
        reply_to: env.subjects.reply_inbox(),
        citation_floor: 0,
        new_call: false,
    };
    async_nats::jetstream::new(env.client.clone())
        .publish_with_headers(
            env.subjects.tool(&id),
            call.to_headers(),
            json!({ "arguments": { "utcOffset": "+01:00", "apiToken": CANARY } })
                .to_string()
                .into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    // The record as published: the token is neither in its job nor in the
    // error text that quoted it.
    let msg = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut dead_letters))
        .await
        .expect("dead-lettered")
        .unwrap();
    let record = String::from_utf8_lossy(&msg.payload).into_owned();
    assert!(
        !record.contains(CANARY),
        "the dead letter keeps it: {record}"
    );
    let record: Value = serde_json::from_str(&record).unwrap();
    assert_eq!(
        record["job"]["arguments"]["apiToken"], "[redacted]",
        "{record}"
    );
    assert_eq!(
        record["job"]["arguments"]["utcOffset"], "+01:00",
        "{record}"
    );
    assert!(
        record["error"]
            .as_str()
            .unwrap()
            .contains("refused token [redacted]"),
        "{record}"
    );
    running.stop().await;

    // Shown: nothing sensitive; replay refused (the job is not whole).
    let deadline = tokio::time::Instant::now() + WAIT;
    let seq = loop {
        if let Some(row) = listed(&env, "call-secret-1") {
            break row["seq"].as_u64().unwrap().to_string();
        }
        assert!(tokio::time::Instant::now() < deadline, "never listed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (code, out, err) = deadletters(&env, &["show", &seq, "--tool-definitions", defs]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains(CANARY) && !err.contains(CANARY), "{out}{err}");
    let (code, out, err) = deadletters(&env, &["replay", &seq]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(err.contains("sensitive arguments"), "{err}");

    // Records kept before workers redacted: redacted on display by the
    // tool's definition (here from the definitions directory: no worker
    // serves the tool any more), or every argument when it is unknown.
    for (call_id, tool) in [
        ("call-old-1", "testing:secretive@1.0.0"),
        ("call-old-2", "ghost:secretive@1.0.0"),
    ] {
        let old = toolfleet_protocol::DeadLetter {
            kind: toolfleet_protocol::DeadLetterKind::Tool,
            stream: env.subjects.tools_stream(),
            stream_sequence: 1,
            invocation_id: Some("inv-old".into()),
            call_id: Some(call_id.into()),
            tool_id: Some(tool.into()),
            attempts: 3,
            code: "transient_failure".into(),
            error: format!("the backend refused token {CANARY}"),
            headers: Default::default(),
            raw_headers: None,
            job: Some(json!({ "arguments": { "utcOffset": "+02:00", "apiToken": CANARY } })),
        };
        env.client
            .publish(
                env.subjects
                    .dead_letter(toolfleet_protocol::DeadLetterKind::Tool),
                serde_json::to_vec(&old).unwrap().into(),
            )
            .await
            .unwrap();
        env.client.flush().await.unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        let seq = loop {
            if let Some(row) = listed(&env, call_id) {
                break row["seq"].as_u64().unwrap().to_string();
            }
            assert!(tokio::time::Instant::now() < deadline, "never listed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (code, out, err) = deadletters(&env, &["show", &seq, "--tool-definitions", defs]);
        assert_eq!(code, Some(0), "{err}");
        assert!(!out.contains(CANARY) && !err.contains(CANARY), "{out}{err}");
        let shown: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            shown["job"]["arguments"]["apiToken"], "[redacted]",
            "{shown}"
        );
        // Only what is sensitive is hidden when the definition says which.
        let offset = &shown["job"]["arguments"]["utcOffset"];
        if tool.starts_with("testing:") {
            assert_eq!(offset, "+02:00", "{shown}");
        } else {
            assert_eq!(offset, "[redacted]", "{shown}");
            assert!(err.contains("every argument's value is hidden"), "{err}");
        }
    }
}
