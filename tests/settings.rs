//! Per-tenant tool settings (issue 28, item 4), on a real `nats-server`
//! running the shipped `ops/nats/auth.conf`: the operator writes each
//! tenant's settings with `toolfleet settings set` (checked against the
//! tool's settingsSchema; a literal secret refused), the orchestrator sends
//! the calling tenant's settings in the tool job, and the worker resolves a
//! secret reference on its own host. Tried as tenant `acme` against tenant
//! `globex`: acme's setting reaches acme's calls only, globex's calls see
//! globex's, the secret's value is never in a job, and neither tenant's
//! client nor a worker may read or write the settings bucket.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_protocol::{ChatEventBody, Subjects, ToolStatus};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::security::{inbox_prefix, password};
use crate::support::WAIT;

/// acme's secret, in a file only the worker's host reads.
const ACME_CANARY: &str = "sk-acme-settings-canary-5e1d";

/// The units family's tool id, served by the test's worker with a
/// settingsSchema of its own (`greeting`, and the secret `apiKey`).
const DEFINITION: &str = r#"{
  "schemaVersion": 1,
  "id": "units:convert@1.0.0",
  "implementationKey": "units.convert",
  "title": "Settings probe",
  "description": "Says which settings it was given.",
  "category": "testing",
  "purpose": "general",
  "selectable": true,
  "tags": [],
  "settingsSchema": {
    "type": "object",
    "additionalProperties": false,
    "properties": {
      "greeting": { "type": "string", "maxLength": 40 },
      "apiKey": { "type": "string", "secret": true }
    }
  },
  "function": {
    "name": "convert",
    "description": "Says which settings it was given.",
    "parameters": { "type": "object", "properties": {}, "additionalProperties": false }
  },
  "timeoutMs": 10000,
  "delivery": "jetstream",
  "parallelSafe": true
}"#;

/// Answers with the tenant, its greeting and whether its secret resolved
/// to the file's contents; keeps every job's settings as received.
#[derive(Clone, Default)]
struct Probe {
    seen: Arc<Mutex<Vec<Value>>>,
}

impl Tool for Probe {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        self.seen
            .lock()
            .unwrap()
            .push(ctx.settings().cloned().unwrap_or(Value::Null));
        let greeting: Option<String> = ctx.setting("greeting")?;
        let secret = match ctx.secret("apiKey")? {
            Some(s) if s.expose() == ACME_CANARY => "resolved",
            Some(_) => "wrong",
            None => "none",
        };
        Ok(ToolOutput::text(format!(
            "tenant={} greeting={} secret={secret}",
            ctx.invocation().tenant(),
            greeting.as_deref().unwrap_or("none")
        )))
    }
}

async fn connect(nats: &NatsServer, user: &str) -> async_nats::Client {
    async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
        .custom_inbox_prefix(inbox_prefix(user))
        .connect(nats.url())
        .await
        .expect("connect")
}

/// `toolfleet settings …` as the operator.
fn settings_cmd(nats: &NatsServer, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .arg("settings")
        .args(args)
        .env("TOOLFLEET_NATS_URL", nats.url())
        .env("TOOLFLEET_NATS_USER", "operator")
        .env("TOOLFLEET_NATS_PASSWORD", password("operator"))
        .env("TOOLFLEET_NATS_INBOX_PREFIX", inbox_prefix("operator"))
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A tenant's client asks until the probe answers (the orchestrator learns
/// the tool from the worker's advertisement); the probe's answer.
async fn ask_probe(client: &async_nats::Client, tenant: &str) -> (String, Vec<String>) {
    let subjects = Subjects::new("toolfleet").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut job = toolfleet_protocol::client::question("probe the settings please");
        job.tenant = Some(tenant.into());
        let outcome = toolfleet_protocol::client::chat(client, &subjects, &job, WAIT, |_| {}).await;
        if let Ok(outcome) = &outcome
            && outcome.events.iter().any(|e| {
                matches!(&e.body, ChatEventBody::ToolResult { tool, status: ToolStatus::Ok, .. }
                    if tool == "units:convert@1.0.0")
            })
        {
            let events = outcome
                .events
                .iter()
                .map(|e| serde_json::to_string(e).unwrap())
                .collect();
            return (outcome.text.clone(), events);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe never answered {tenant}: {outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the server refuses `user`'s `what` on `subject`.
async fn refused(
    errors: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    what: &str,
    subject: &str,
) {
    let wanted = format!("permissions violation for {what} to \"{subject}\"").to_lowercase();
    loop {
        let e = tokio::time::timeout(WAIT, errors.recv())
            .await
            .unwrap_or_else(|_| panic!("{what} to {subject} was not refused"))
            .expect("errors");
        if e.to_lowercase().contains(&wanted) {
            return;
        }
    }
}

/// `user` tries to read and to write the settings bucket: both refused.
async fn bucket_closed_to(nats: &NatsServer, user: &str) {
    let (tx, mut errors) = tokio::sync::mpsc::unbounded_channel();
    let client = async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
        .custom_inbox_prefix(inbox_prefix(user))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    let _ = tx.send(e.to_string());
                }
            }
        })
        .connect(nats.url())
        .await
        .unwrap();
    let read =
        "$JS.API.DIRECT.GET.KV_TOOLFLEET_SETTINGS.$KV.TOOLFLEET_SETTINGS.globex.units.convert";
    let write = "$KV.TOOLFLEET_SETTINGS.acme.units.convert";
    for subject in [read, write] {
        client
            .publish(subject.to_string(), "{}".into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        refused(&mut errors, "Publish", subject).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_settings_reach_its_own_calls_only_and_secrets_stay_references() {
    let nats = crate::security::Secure::start().nats;
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let defs = dir.path().join("defs");
    std::fs::create_dir(&defs).unwrap();
    std::fs::write(defs.join("units.convert.json"), DEFINITION).unwrap();
    let key_file = dir.path().join("acme-units-key");
    std::fs::write(&key_file, format!("{ACME_CANARY}\n")).unwrap();
    let defs_arg = defs.display().to_string();

    // The operator: refused first (a literal secret, a value the schema
    // refuses, an unknown setting), then acme's and globex's settings.
    let literal = format!("apiKey={ACME_CANARY}");
    for (bad, says) in [
        (literal.as_str(), "/apiKey: is secret"),
        (
            "greeting=\"this greeting is much longer than forty characters\"",
            "/greeting",
        ),
        ("colour=blue", "/colour: unknown setting"),
    ] {
        let (code, _, err) = settings_cmd(
            &nats,
            &[
                "set",
                "--tenant",
                "acme",
                "--tool",
                "units:convert",
                "--tool-definitions",
                &defs_arg,
                bad,
            ],
        );
        assert_eq!(code, Some(64), "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(!err.contains(ACME_CANARY), "{err}");
    }
    let reference = format!("apiKey={{\"file\":\"{}\"}}", key_file.display());
    let (code, out, err) = settings_cmd(
        &nats,
        &[
            "set",
            "--tenant",
            "acme",
            "--tool",
            "units:convert",
            "--tool-definitions",
            &defs_arg,
            "greeting=hello-acme",
            &reference,
        ],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, _, err) = settings_cmd(
        &nats,
        &[
            "set",
            "--tenant",
            "globex",
            "--tool",
            "units:convert@1.0.0",
            "--tool-definitions",
            &defs_arg,
            "greeting=hello-globex",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let (code, out, _) = settings_cmd(&nats, &["ls", "--tenant", "acme"]);
    assert_eq!((code, out.trim()), (Some(0), "units:convert"));
    let (code, out, _) = settings_cmd(
        &nats,
        &["get", "--tenant", "acme", "--tool", "units:convert"],
    );
    assert_eq!(code, Some(0));
    let kept: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        kept["apiKey"],
        json!({ "file": key_file.display().to_string() })
    );

    // The orchestrator and the worker, each under its own identity.
    let model_script = json!({
        "rules": [{ "whenUserContains": ["probe the settings"], "steps": [
            { "toolCalls": [ { "name": "convert", "arguments": {} } ] },
            { "answer": "{{tool:convert}}" } ] }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&model_script.to_string()).unwrap(),
    )
    .await
    .unwrap();
    let subjects = Subjects::new("toolfleet").unwrap();
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(model.base_url(), "toolfleet-scripted"),
    );
    let config = toolfleet_orchestrator::OrchestratorConfig::new(subjects.clone(), profiles);
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let redis_url = redis.url();
    let store = || {
        let url = redis_url.clone();
        async move {
            toolfleet_store::CitationStore::connect(&url, "toolfleet", Duration::from_secs(60))
                .await
                .unwrap()
        }
    };
    let orchestrator = tokio::time::timeout(
        WAIT,
        toolfleet_orchestrator::Ready::open(
            connect(&nats, "orchestrator").await,
            store().await,
            config,
            metrics,
            shutdown.clone(),
        ),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::spawn(orchestrator.run());
    let probe = Probe::default();
    let worker = Worker::builder("units")
        .definition_json(DEFINITION)
        .tool("units.convert", probe.clone())
        .build()
        .unwrap();
    let _worker = tokio::time::timeout(
        WAIT,
        worker.start(
            connect(&nats, "worker-units").await,
            store().await,
            toolfleet_worker::WorkerConfig::new(subjects.clone()),
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap(),
            shutdown.clone(),
        ),
    )
    .await
    .unwrap()
    .unwrap();

    // Each tenant, with its own identity.
    let acme = connect(&nats, "client-acme").await;
    let globex = connect(&nats, "client-globex").await;
    let (acme_text, acme_events) = ask_probe(&acme, "acme").await;
    assert_eq!(acme_text, "tenant=acme greeting=hello-acme secret=resolved");
    let (globex_text, globex_events) = ask_probe(&globex, "globex").await;
    assert_eq!(
        globex_text,
        "tenant=globex greeting=hello-globex secret=none"
    );
    for line in acme_events.iter().chain(&globex_events) {
        assert!(!line.contains(ACME_CANARY), "{line}");
    }
    for line in &globex_events {
        assert!(!line.contains("hello-acme"), "{line}");
    }
    // What the jobs carried: the reference, never the secret.
    let seen = probe.seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|s| s["greeting"] == "hello-acme"),
        "{seen:?}"
    );
    for settings in &seen {
        assert!(!settings.to_string().contains(ACME_CANARY), "{settings}");
        if settings["greeting"] == "hello-globex" {
            assert!(settings.get("apiKey").is_none(), "{settings}");
        }
    }

    // Neither tenant nor a worker reads or writes the bucket.
    for user in ["client-acme", "client-globex", "worker-units"] {
        bucket_closed_to(&nats, user).await;
    }
}
