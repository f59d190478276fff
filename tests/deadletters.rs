//! Dead letters you can find: a tool job that exhausts its attempts is
//! kept in the dead-letter stream, `toolfleet deadletters ls` lists it,
//! `show` shows it whole (its job's per-tenant settings never kept), and
//! `replay` runs it again after the fix; a job whose tool no longer has a
//! worker is not replayed, and says why.

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
    let (code, shown, err) = deadletters(&env, &["show", &seq]);
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
