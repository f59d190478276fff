//! NATS identities and least privilege (issue 9, item 9), on a real
//! `nats-server` running the shipped `ops/nats/auth.conf`: the fleet's
//! binaries answer a chat job under their role identities without one
//! permission violation, and each role is refused what it must not do.
//! Then each way to authenticate (user and password, token, NKey, `.creds`)
//! and TLS (server verified by a CA, client certificates) connects through
//! `NatsArgs`, the settings every command shares.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use toolfleet_local::servers::{NatsConfig, NatsServer, RedisServer, free_port};
use toolfleet_protocol::{ChatEventBody, Subjects, ToolStatus};
use toolfleet_service::args::{NatsArgs, Secret};

use crate::support::{self, WAIT};

pub(crate) use crate::support::identities::{USERS, inbox_prefix, password};

/// A server running the shipped role identities.
pub(crate) struct Secure {
    pub(crate) nats: NatsServer,
}

impl Secure {
    pub(crate) fn start() -> Self {
        Self::start_with_mcp_role(None)
    }

    /// The shipped identities, the MCP pool's role being `mcp_role` (what
    /// `toolfleet-worker-mcp --print-nats-role` printed) instead of the
    /// shipped `mcp-role.conf`.
    pub(crate) fn start_with_mcp_role(mcp_role: Option<String>) -> Self {
        Self {
            nats: crate::support::identities::secure_nats_with_mcp_role(
                mcp_role.map(String::into_bytes),
            ),
        }
    }

    fn args(&self, user: &str) -> NatsArgs {
        let mut a = NatsArgs::for_url(self.nats.url());
        a.user = Some(user.into());
        a.password = Some(Secret::new(password(user)));
        a.inbox_prefix = Some(inbox_prefix(user));
        a.connect_wait_secs = 10;
        a
    }

    /// The environment a binary of `user`'s role runs with.
    pub(crate) fn env(&self, user: &str) -> Vec<(&'static str, String)> {
        vec![
            ("TOOLFLEET_NATS_URL", self.nats.url()),
            ("TOOLFLEET_NATS_USER", user.into()),
            ("TOOLFLEET_NATS_PASSWORD", password(user)),
            ("TOOLFLEET_NATS_INBOX_PREFIX", inbox_prefix(user)),
        ]
    }

    /// The environment a fleet binary of `user`'s role runs with on
    /// `redis_url`: the role's NATS settings, Redis, `info` logs, metrics
    /// on a free port, then `extra`.
    pub(crate) fn process_env(
        &self,
        user: &str,
        redis_url: &str,
        extra: Vec<(&'static str, String)>,
    ) -> Vec<(&'static str, String)> {
        let mut env = self.env(user);
        env.push(("TOOLFLEET_REDIS_URL", redis_url.to_string()));
        env.push(("TOOLFLEET_LOG", "info".into()));
        env.push((
            "TOOLFLEET_METRICS_ADDR",
            format!("127.0.0.1:{}", free_port().unwrap()),
        ));
        env.extend(extra);
        env
    }

    pub(crate) async fn connect(&self, user: &str) -> async_nats::Client {
        self.args(user).connect(user).await.expect("connect")
    }

    /// A connection of `user` that reports the server's errors (the
    /// permission violations) on the returned channel.
    async fn hostile(&self, user: &str) -> Hostile {
        let (tx, errors) = tokio::sync::mpsc::unbounded_channel();
        let client =
            async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
                .custom_inbox_prefix(inbox_prefix(user))
                .event_callback(move |event| {
                    let tx = tx.clone();
                    async move {
                        if let async_nats::Event::ServerError(e) = event {
                            let _ = tx.send(e.to_string());
                        }
                    }
                })
                .connect(self.nats.url())
                .await
                .expect("connect");
        Hostile { client, errors }
    }

    /// Permission violations the server logged.
    fn violations(&self) -> Vec<String> {
        self.nats
            .log()
            .lines()
            .filter(|l| l.contains("Violation"))
            .map(str::to_string)
            .collect()
    }
}

struct Hostile {
    client: async_nats::Client,
    errors: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Hostile {
    /// Waits for the server to refuse `what` (`Publish` or `Subscription`)
    /// on `subject`: it drops the message or the subscription and says so.
    async fn refused(&mut self, what: &str, subject: &str) {
        let wanted = format!("permissions violation for {what} to \"{subject}\"").to_lowercase();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let e = tokio::time::timeout_at(deadline, self.errors.recv())
                .await
                .unwrap_or_else(|_| panic!("{what} to {subject} was not refused"))
                .expect("errors");
            if e.to_lowercase().contains(&wanted) {
                return;
            }
        }
    }

    async fn publish(&mut self, subject: &str) {
        self.client
            .publish(subject.to_string(), "forged".into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
        self.refused("Publish", subject).await;
    }

    async fn subscribe(&mut self, subject: &str) -> async_nats::Subscriber {
        let sub = self.client.subscribe(subject.to_string()).await.unwrap();
        self.client.flush().await.unwrap();
        self.refused("Subscription", subject).await;
        sub
    }
}

/// `publisher` sends a job on `subject`, then a marker on `marker_subject`
/// (which the refused side may read on `seen`), until a marker arrives: a
/// flush is not a round trip, so the first rounds may come before the
/// subscription is registered. Then nothing is waiting on `refused`: the
/// server delivers one publisher's messages to one connection in order.
async fn nothing_before_marker(
    publisher: &async_nats::Client,
    subject: &str,
    marker_subject: &str,
    refused: &mut async_nats::Subscriber,
    seen: &mut async_nats::Subscriber,
) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        publisher
            .publish(subject.to_string(), "job".into())
            .await
            .unwrap();
        publisher
            .publish(marker_subject.to_string(), "marker".into())
            .await
            .unwrap();
        publisher.flush().await.unwrap();
        if let Ok(marker) = tokio::time::timeout(Duration::from_secs(1), seen.next()).await {
            assert_eq!(&marker.unwrap().payload[..], b"marker");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no marker");
    }
    assert!(
        futures::FutureExt::now_or_never(refused.next()).is_none(),
        "a refused subscription received a message"
    );
}

/// A family's block of `text` (`<NAME> = {` to the closing `}` at the
/// start of a line), its comments and blank space left out.
fn role_block(text: &str, name: &str) -> String {
    let start = text
        .find(&format!("\n{name} = {{"))
        .unwrap_or_else(|| panic!("no block {name}"));
    let end = start + text[start..].find("\n}").expect("the block ends");
    text[start..end + 2]
        .lines()
        .map(|l| l.split(" #").next().unwrap_or(l).trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every family block in `ops/nats/auth.conf` is what the family's binary
/// prints with `--print-nats-role`: the rule operators use for their MCP
/// pool (whose printed role the MCP tenancy test runs under) is the one
/// the shipped roles follow, and no tool of a family lacks its lines.
#[test]
fn security_the_shipped_family_roles_are_what_the_workers_print() {
    let dir = tempfile::tempdir().unwrap();
    let nats_dir = support::root().join("ops/nats");
    let auth = std::fs::read_to_string(nats_dir.join("auth.conf")).unwrap();
    // (binary, block, the environment it needs to serve all its tools)
    type Family<'a> = (&'a str, &'a str, Vec<(&'a str, String)>);
    let families: [Family; 5] = [
        ("toolfleet-worker-system", "TOOLFLEET_SYSTEM", vec![]),
        (
            "toolfleet-worker-retrieval",
            "TOOLFLEET_RETRIEVAL",
            vec![(
                "TOOLFLEET_INDEX_DIR",
                dir.path().join("index").display().to_string(),
            )],
        ),
        (
            "toolfleet-worker-llm",
            "TOOLFLEET_LLM",
            // With an image model it serves content:generate_image too.
            vec![("TOOLFLEET_IMAGE_MODEL", "default/gpt-image-1".into())],
        ),
        ("toolfleet-worker-web", "TOOLFLEET_WEB", vec![]),
        ("units-worker", "TOOLFLEET_UNITS", vec![]),
    ];
    for (bin, name, env) in families {
        let out = Command::new(support::sibling_bin(bin))
            .current_dir(support::root())
            .arg("--print-nats-role")
            .env("TOOLFLEET_NATS_URL", "nats://127.0.0.1:9")
            .env("TOOLFLEET_REDIS_URL", "redis://127.0.0.1:9")
            .envs(env)
            .output()
            .unwrap();
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{bin}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            role_block(&auth, name),
            role_block(&format!("\n{printed}"), name),
            "{bin}'s role"
        );
    }
}

/// A binary of the fleet, killed on drop; its stderr goes to `log`.
pub(crate) struct Proc {
    child: Child,
    pub(crate) log: std::path::PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn spawn(bin: &str, env: &[(&'static str, String)], log: std::path::PathBuf) -> Proc {
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(support::sibling_bin(bin))
        .current_dir(support::root())
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e}"));
    Proc { child, log }
}

/// The model asks for the time, then answers with it.
pub(crate) fn time_script() -> serde_json::Value {
    serde_json::json!({
        "rules": [{
            "whenUserContains": ["time"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "It is {{tool:current_datetime}}." }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_the_fleet_answers_under_least_privilege_role_identities() {
    let secure = Secure::start();
    let redis = RedisServer::start().unwrap();
    // The lighthouse script, and an agent tool's nested job (which the
    // orchestrator submits and follows under its own identity).
    let mut script = support::lighthouse_script();
    script["rules"]
        .as_array_mut()
        .unwrap()
        .extend(serde_json::json!([
            { "whenUserContains": ["AGENT TASK"], "steps": [ { "answer": "the helper agrees" } ] },
            { "whenUserContains": ["summarize the text below"], "steps": [
                { "answer": "{\"summary\": \"Keepers wound the lamp.\", \"keyPoints\": []}" } ] },
            { "whenUserContains": ["digest the logbook"], "steps": [
                { "toolCalls": [ { "name": "summarize", "arguments": { "text": "The keepers wound the lamp." } } ] },
                { "answer": "Digest: {{tool:summarize}}" } ] },
            { "whenUserContains": ["ask the helper"], "steps": [
                { "toolCalls": [ { "name": "helper", "arguments": { "task": "AGENT TASK: agree" } } ] },
                { "answer": "Helper: {{tool:helper}}" } ] }
        ]).as_array().unwrap().clone());
    let script = toolfleet_scripted::Script::from_json(&script.to_string()).unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let config = logs.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[deployments.scripted]
base_url = "{}"
model = "toolfleet-scripted"
api_key_env = "TOOLFLEET_SECURITY_TEST_KEY"
[profiles.default]
deployment = "scripted"
data_source = "handbook"
[profiles.helper]
deployment = "scripted"
agent = {{ name = "helper", description = "Agrees." }}
[profiles.guarded]
deployment = "scripted"
data_source = "handbook"
require_approval = ["system:current_datetime"]
# Declared, with no worker: the orchestrator makes its consumers under
# its own role at start (scale from zero).
[pools.web]
declared = true
"#,
            model.base_url()
        ),
    )
    .unwrap();
    let index = logs.path().join("index");
    let with = |user: &str, extra| secure.process_env(user, &redis.url(), extra);
    let procs = [
        spawn(
            "toolfleet-orchestrator",
            &with(
                "orchestrator",
                vec![
                    ("TOOLFLEET_CONFIG", config.display().to_string()),
                    ("TOOLFLEET_SECURITY_TEST_KEY", "sk-security-test".into()),
                    (
                        "TOOLFLEET_TOOL_DEFINITIONS",
                        support::root()
                            .join("tool_definitions")
                            .display()
                            .to_string(),
                    ),
                ],
            ),
            logs.path().join("orchestrator.log"),
        ),
        spawn(
            "toolfleet-worker-system",
            &with("worker-system", vec![]),
            logs.path().join("worker-system.log"),
        ),
        spawn(
            "toolfleet-worker-retrieval",
            &with(
                "worker-retrieval",
                vec![
                    ("TOOLFLEET_INDEX_DIR", index.display().to_string()),
                    // The shipped corpus is the data of the tenant that asks.
                    ("TOOLFLEET_CORPUS_TENANT", "acme".into()),
                ],
            ),
            logs.path().join("worker-retrieval.log"),
        ),
        spawn(
            "toolfleet-worker-llm",
            &with(
                "worker-llm",
                vec![
                    ("TOOLFLEET_CONFIG", config.display().to_string()),
                    ("TOOLFLEET_SECURITY_TEST_KEY", "sk-security-test".into()),
                ],
            ),
            logs.path().join("worker-llm.log"),
        ),
    ];

    // The client (tenant acme) asks until the live catalog offers both
    // families' tools (workers advertise on start; the orchestrator reads
    // the catalog).
    let client = secure.connect("client-acme").await;
    let subjects = Subjects::new("toolfleet").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    let outcome = loop {
        let mut job = toolfleet_protocol::client::question(
            "What time is it, and how do lighthouses warn ships?",
        );
        job.tenant = Some("acme".into());
        // The chat stream is there once the orchestrator has started (a
        // client may not create it).
        let outcome =
            match toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {}).await {
                Ok(outcome) => outcome,
                Err(toolfleet_protocol::client::ClientError::Rejected(e))
                    if tokio::time::Instant::now() < deadline =>
                {
                    tracing::debug!(error = %e, "not yet");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => panic!(
                    "the job is answered: {e}\n{}",
                    std::fs::read_to_string(&procs[0].log).unwrap_or_default()
                ),
            };
        let ok = |name: &str| {
            outcome.events.iter().any(|e| {
                matches!(&e.body, ChatEventBody::ToolResult { tool, status: ToolStatus::Ok, .. }
                    if tool.contains(name))
            })
        };
        let tool_ok = ok("current_datetime") && ok("search_data_sources");
        if tool_ok {
            break outcome;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tool never answered: {:?}\n{}",
            outcome.events,
            std::fs::read_to_string(&procs[0].log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(outcome.text.starts_with("It is "), "{}", outcome.text);
    assert!(!outcome.text.contains("{{tool"), "{}", outcome.text);
    assert!(
        !outcome.references.is_empty(),
        "retrieval cited its passages"
    );

    // An agent tool: the orchestrator submits the nested job as the
    // caller's tenant, follows its events and answers with it.
    let mut ask = toolfleet_protocol::client::question("please ask the helper");
    ask.tenant = Some("acme".into());
    let agent = toolfleet_protocol::client::chat(&client, &subjects, &ask, WAIT, |_| {})
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the agent job is answered: {e}\n{}",
                std::fs::read_to_string(&procs[0].log).unwrap_or_default()
            )
        });
    assert_eq!(agent.text, "Helper: the helper agrees");

    // An LLM tool on its own pool, under the LLM family's role (asked
    // until the catalog offers it: the worker may still be starting).
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut digest = toolfleet_protocol::client::question("please digest the logbook");
        digest.tenant = Some("acme".into());
        let outcome = toolfleet_protocol::client::chat(&client, &subjects, &digest, WAIT, |_| {})
            .await
            .expect("the digest job is answered");
        if outcome.text.contains("Keepers wound the lamp.") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the LLM tool never answered: {}\n{}",
            outcome.text,
            std::fs::read_to_string(&procs[3].log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A chat job whose header the NATS client cannot read is answered
    // with an `error` event under the orchestrator's role's permissions
    // (no stream reads or deletes by sequence).
    let mut poison = toolfleet_protocol::client::question("poison");
    poison.tenant = Some("acme".into());
    let mut events = client
        .subscribe(subjects.chat_events(poison.tenant(), &poison.invocation_id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let headers = format!(
        "NATS/1.0\r\nNats-Msg-Id: {id}\r\nToolfleet-Invocation-Id: {id}\r\nToolfleet-Tenant: ",
        id = poison.invocation_id
    );
    let mut block = headers.into_bytes();
    block.extend_from_slice(b"\xff\xfe\r\n\r\n");
    support::publish_raw(
        &secure.nats.url(),
        Some(("client-acme", &password("client-acme"))),
        "toolfleet.chat.submit.acme",
        &block,
        &serde_json::to_vec(&poison).unwrap(),
    )
    .await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("an error event for the poison job")
            .unwrap();
        let event: toolfleet_protocol::ChatEvent = serde_json::from_slice(&msg.payload).unwrap();
        if event.body.is_terminal() {
            assert!(
                matches!(event.body, ChatEventBody::Error { .. }),
                "{event:?}"
            );
            break;
        }
    }

    // The operator's commands, under the operator's role.
    let operator = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(args)
            .envs(secure.env("operator"))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = operator(&["status", "-o", "json"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let workers: Vec<&str> = status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["worker"].as_str())
        .collect();
    assert!(
        workers.contains(&"system") && workers.contains(&"retrieval"),
        "{status}"
    );
    let (code, out, err) = operator(&["events", &ask.invocation_id, "--tenant", "acme"]);
    assert_eq!(code, Some(0), "{out}{err}{:?}", secure.violations());
    assert!(out.contains("Helper: the helper agrees"), "{out}");
    let (code, out, err) = operator(&["deadletters", "ls"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, err) = operator(&["cancel", &ask.invocation_id, "--tenant", "acme"]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains("already finished"), "{out}{err}");

    // A call that needs approval parks its invocation; the operator's
    // approval resumes it (the orchestrator reads and writes the parked
    // bucket and the decisions stream under its role).
    let mut guarded =
        toolfleet_protocol::client::question("What time is it, and how do lighthouses warn ships?");
    guarded.tenant = Some("acme".into());
    guarded.profile = Some("guarded".into());
    let mut events = client
        .subscribe(subjects.chat_events("acme", &guarded.invocation_id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    toolfleet_protocol::client::submit(&client, &subjects, &guarded)
        .await
        .unwrap();
    let mut approved = false;
    let end = loop {
        let msg = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("the guarded job's events")
            .unwrap();
        let event: toolfleet_protocol::ChatEvent = serde_json::from_slice(&msg.payload).unwrap();
        if let ChatEventBody::ApprovalRequested { call_id, .. } = &event.body {
            let (code, out, err) = operator(&[
                "approve",
                &guarded.invocation_id,
                call_id,
                "--tenant",
                "acme",
            ]);
            assert_eq!(code, Some(0), "{out}{err}");
            approved = true;
        }
        if event.body.is_terminal() {
            break event.body;
        }
    };
    assert!(approved);
    assert!(
        matches!(&end, ChatEventBody::Completed { text, .. } if text.starts_with("It is ")),
        "{end:?}\n{}",
        std::fs::read_to_string(&procs[0].log).unwrap_or_default()
    );

    // The declared web pool's consumers, made by the orchestrator (read
    // under its role, which may read the tool consumers it makes).
    let tools = async_nats::jetstream::new(secure.connect("orchestrator").await)
        .get_stream("TOOLFLEET_TOOLS")
        .await
        .unwrap();
    for consumer in ["tool_web_search_1_0_0", "tool_web_read_page_1_0_0"] {
        let info = tools.consumer_info(consumer).await;
        assert!(info.is_ok(), "{consumer}: {:?}", info.err());
    }

    // Not one permission was missing on the way, and no secret was logged.
    assert_eq!(secure.violations(), Vec::<String>::new());
    drop(procs);
    for name in [
        "orchestrator.log",
        "worker-system.log",
        "worker-retrieval.log",
        "worker-llm.log",
    ] {
        let log = std::fs::read_to_string(logs.path().join(name)).unwrap();
        assert!(!log.contains("canary"), "{name} shows a password:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_client_cannot_read_tool_jobs_or_results_nor_forge_them() {
    let secure = Secure::start();
    let orchestrator = secure.connect("orchestrator").await;
    let js = async_nats::jetstream::new(orchestrator.clone());
    let subjects = Subjects::new("toolfleet").unwrap();
    let tools = toolfleet_protocol::streams::ensure_tools_stream(&js, &subjects)
        .await
        .unwrap();
    let mut client = secure.hostile("client-acme").await;

    // Tool jobs carry their reply subject in a header: no client sees them.
    let mut jobs = client.subscribe("toolfleet.tool.>").await;
    let mut jobs_of_one = client
        .subscribe("toolfleet.tool.system.current_datetime.1_0_0")
        .await;
    let mut events = client
        .client
        .subscribe("toolfleet.chat.events.acme.marker")
        .await
        .unwrap();
    client.client.flush().await.unwrap();
    nothing_before_marker(
        &orchestrator,
        "toolfleet.tool.system.current_datetime.1_0_0",
        "toolfleet.chat.events.acme.marker",
        &mut jobs,
        &mut events,
    )
    .await;
    assert!(futures::FutureExt::now_or_never(jobs_of_one.next()).is_none());

    // Nor results, nor anyone's inboxes.
    client.subscribe("toolfleet.reply.>").await;
    client.subscribe("toolfleet.reply.*.*").await;
    client.subscribe("_INBOX.>").await;
    client.subscribe("_INBOX.orchestrator.>").await;

    // A forged result never reaches the orchestrator's call inbox: the
    // orchestrator sees the real worker's result first.
    let inbox = subjects.reply_inbox();
    let mut results = orchestrator.subscribe(format!("{inbox}.*")).await.unwrap();
    orchestrator.flush().await.unwrap();
    client.publish(&format!("{inbox}.call-1")).await;
    let worker = secure.connect("worker-system").await;
    worker
        .publish(format!("{inbox}.call-1"), "marker".into())
        .await
        .unwrap();
    worker.flush().await.unwrap();
    let first = tokio::time::timeout(WAIT, results.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&first.payload[..], b"marker", "the forged result arrived");

    // Nor tool jobs, dead letters or events of its own making: between two
    // jobs the orchestrator stores (each acked), the stream gains nothing.
    // (An acked publish also means every earlier one of that connection is
    // stored.)
    let stored = || {
        let (js, tools) = (js.clone(), tools.clone());
        async move {
            js.publish("toolfleet.tool.system.current_datetime.1_0_0", "job".into())
                .await
                .unwrap()
                .await
                .unwrap();
            tools.clone().info().await.unwrap().state.messages
        }
    };
    let before = stored().await;
    client
        .publish("toolfleet.tool.system.current_datetime.1_0_0")
        .await;
    client
        .publish("toolfleet.chat.events.acme.someone-else")
        .await;
    client.publish("toolfleet.deadletter.tool").await;
    client
        .publish("$JS.API.STREAM.DELETE.TOOLFLEET_TOOLS")
        .await;
    assert_eq!(stored().await, before + 1, "a forged job was stored");
}

/// A client acts as its own tenant only: it submits, cancels and follows
/// under its tenant's subjects, and the server refuses it every other
/// tenant's (and the untenanted) subjects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_client_keeps_to_its_own_tenant() {
    let secure = Secure::start();
    let orchestrator = secure.connect("orchestrator").await;
    let js = async_nats::jetstream::new(orchestrator.clone());
    let subjects = Subjects::new("toolfleet").unwrap();
    let chat = toolfleet_protocol::streams::ensure_chat_stream(&js, &subjects)
        .await
        .unwrap();
    let mut acme = secure.hostile("client-acme").await;

    // Its own tenant's events reach it; nobody else's can be subscribed.
    let mut others = acme.subscribe("toolfleet.chat.events.globex.*").await;
    let mut all = acme.subscribe("toolfleet.chat.events.>").await;
    let mut any_tenant = acme.subscribe("toolfleet.chat.events.*.*").await;
    acme.subscribe("toolfleet.chat.cancel.>").await;
    // Nor may it approve the calls its own model asked for: only the
    // operator's role (or an approver's) may.
    acme.publish("toolfleet.chat.approve.acme.inv-1").await;
    acme.subscribe("toolfleet.chat.approve.*.*").await;
    let mut own = acme
        .client
        .subscribe("toolfleet.chat.events.acme.*")
        .await
        .unwrap();
    acme.client.flush().await.unwrap();
    for refused in [&mut others, &mut all, &mut any_tenant] {
        nothing_before_marker(
            &orchestrator,
            "toolfleet.chat.events.globex.inv-1",
            "toolfleet.chat.events.acme.marker",
            refused,
            &mut own,
        )
        .await;
    }

    // It submits as its own tenant only: a job on another tenant's submit
    // subject (or the untenanted one) is never stored, and it cannot cancel
    // another tenant's invocations.
    let stored = || {
        let chat = chat.clone();
        async move { chat.clone().info().await.unwrap().state.messages }
    };
    let mut cancels = orchestrator
        .subscribe("toolfleet.chat.cancel.*.*")
        .await
        .unwrap();
    orchestrator.flush().await.unwrap();
    acme.publish("toolfleet.chat.submit.globex").await;
    acme.publish("toolfleet.chat.submit").await;
    acme.publish("toolfleet.chat.cancel.globex.inv-1").await;
    assert_eq!(stored().await, 0, "a job of another tenant was stored");
    let mut job = toolfleet_protocol::client::question("hello");
    job.tenant = Some("acme".into());
    toolfleet_protocol::client::submit(&acme.client, &subjects, &job)
        .await
        .expect("its own tenant's job is stored");
    assert_eq!(stored().await, 1);
    // The client library submits a job naming another tenant to that
    // tenant's subject, which the server refuses: the job is not stored.
    job.tenant = Some("globex".into());
    job.invocation_id = toolfleet_protocol::client::new_invocation_id();
    let refused = toolfleet_protocol::client::submit(&acme.client, &subjects, &job).await;
    assert!(refused.is_err(), "submitted as another tenant");
    assert_eq!(stored().await, 1);
    // The cancel it may send names its own tenant: it is the first the
    // orchestrator hears (the refused one never arrived).
    acme.client
        .publish("toolfleet.chat.cancel.acme.inv-1", "".into())
        .await
        .unwrap();
    acme.client.flush().await.unwrap();
    let heard = tokio::time::timeout(WAIT, cancels.next())
        .await
        .expect("its own tenant's cancel arrives")
        .unwrap();
    assert_eq!(heard.subject.as_str(), "toolfleet.chat.cancel.acme.inv-1");
    // So with one call's cancel: its own tenant's arrives, another's never.
    let worker = secure.connect("worker-system").await;
    let mut call_cancels = worker
        .subscribe("toolfleet.chat.cancel.*.*.*")
        .await
        .unwrap();
    worker.flush().await.unwrap();
    acme.publish("toolfleet.chat.cancel.globex.inv-1.call-1")
        .await;
    toolfleet_protocol::client::cancel_call(&acme.client, &subjects, "acme", "inv-1", "call-1")
        .await
        .unwrap();
    let heard = tokio::time::timeout(WAIT, call_cancels.next())
        .await
        .expect("its own tenant's call cancel arrives")
        .unwrap();
    assert_eq!(
        heard.subject.as_str(),
        "toolfleet.chat.cancel.acme.inv-1.call-1"
    );

    // It reads its own tenant's stored events, and nobody else's.
    toolfleet_protocol::streams::ensure_events_stream(&js, &subjects)
        .await
        .unwrap();
    for (tenant, id) in [("acme", "inv-a"), ("globex", "inv-g")] {
        let event = toolfleet_protocol::ChatEvent {
            invocation_id: id.into(),
            seq: 0,
            body: ChatEventBody::Error {
                code: "cancelled".into(),
                message: "stored".into(),
                retry_after_ms: None,
            },
        };
        js.publish(
            subjects.chat_events(tenant, id),
            serde_json::to_vec(&event).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let own = toolfleet_protocol::client::last_event(&acme.client, &subjects, "acme", "inv-a")
        .await
        .expect("its own stored event")
        .expect("stored");
    assert_eq!(own.invocation_id, "inv-a");
    let direct_get = "$JS.API.DIRECT.GET.TOOLFLEET_EVENTS.toolfleet.chat.events.globex.inv-g";
    acme.publish(direct_get).await;
    let stolen =
        toolfleet_protocol::client::last_event(&acme.client, &subjects, "globex", "inv-g").await;
    assert!(stolen.is_err(), "read another tenant's event: {stolen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_worker_family_keeps_to_its_own_tools() {
    let secure = Secure::start();
    let orchestrator = secure.connect("orchestrator").await;
    let js = async_nats::jetstream::new(orchestrator.clone());
    let subjects = Subjects::new("toolfleet").unwrap();
    let chat = toolfleet_protocol::streams::ensure_chat_stream(&js, &subjects)
        .await
        .unwrap();
    let tools = toolfleet_protocol::streams::ensure_tools_stream(&js, &subjects)
        .await
        .unwrap();
    let mut system = secure.hostile("worker-system").await;

    // It cannot start chat jobs or speak for the orchestrator.
    system.publish("toolfleet.chat.submit.acme").await;
    system
        .publish("toolfleet.chat.events.acme.someone-else")
        .await;
    system.publish("toolfleet.deadletter.chat").await;
    assert_eq!(chat.clone().info().await.unwrap().state.messages, 0);

    // Nor publish, read or pull another family's tool jobs.
    system
        .publish("toolfleet.tool.retrieval.search_data_sources.1_0_0")
        .await;
    system
        .publish("toolfleet.tool.system.current_datetime.1_0_0")
        .await;
    assert_eq!(tools.clone().info().await.unwrap().state.messages, 0);
    let mut others = system
        .subscribe("toolfleet.tool.retrieval.search_data_sources.1_0_0")
        .await;
    system.subscribe("toolfleet.tool.>").await;
    system.subscribe("toolfleet.direct.retrieval.>").await;
    system.subscribe("toolfleet.reply.>").await;
    system.subscribe("_INBOX.worker.retrieval.>").await;
    system
        .publish(
            "$JS.API.CONSUMER.MSG.NEXT.TOOLFLEET_TOOLS.tool_retrieval_search_data_sources_1_0_0",
        )
        .await;
    // Its own consumer's create is pinned to its own tool's subject.
    system
        .publish(
            "$JS.API.CONSUMER.CREATE.TOOLFLEET_TOOLS.tool_system_current_datetime_1_0_0.toolfleet.tool.retrieval.search_data_sources.1_0_0",
        )
        .await;
    system
        .publish("$KV.TOOLFLEET_CATALOG.retrieval.search_data_sources.1_0_0.abc")
        .await;
    let mut marker = system
        .client
        .subscribe("toolfleet.direct.system.marker")
        .await
        .unwrap();
    system.client.flush().await.unwrap();
    nothing_before_marker(
        &orchestrator,
        "toolfleet.tool.retrieval.search_data_sources.1_0_0",
        "toolfleet.direct.system.marker",
        &mut others,
        &mut marker,
    )
    .await;

    // What it may do, it can: its own consumer, pinned to its own subject.
    let worker = secure.connect("worker-system").await;
    let own = async_nats::jetstream::new(worker)
        .get_stream("TOOLFLEET_TOOLS")
        .await
        .unwrap()
        .get_or_create_consumer(
            "tool_system_current_datetime_1_0_0",
            async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("tool_system_current_datetime_1_0_0".into()),
                filter_subject: "toolfleet.tool.system.current_datetime.1_0_0".into(),
                ..Default::default()
            },
        )
        .await;
    assert!(own.is_ok(), "{:?}", own.err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_a_wrong_password_is_refused_at_once_without_showing_it() {
    let secure = Secure::start();
    let mut args = secure.args("orchestrator");
    args.password = Some(Secret::new("wrong-canary-secret"));
    args.connect_wait_secs = 60;
    let started = std::time::Instant::now();
    let e = args.connect("t").await.unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(30), "retried: {e}");
    assert!(e.contains("refused"), "{e}");
    assert!(!e.contains("canary"), "{e}");
}

/// A server with `authorization` set to `block`, and the env it reads.
fn server_with(block: &str, env: Vec<(String, String)>) -> NatsServer {
    NatsServer::start_configured(NatsConfig {
        extra: Some(block.to_string()),
        env,
        ..NatsConfig::default()
    })
    .unwrap()
}

/// `args` connects and a message round-trips.
async fn round_trip(args: &NatsArgs) {
    let client = args.connect("t").await.expect("connects");
    let mut sub = client.subscribe("ping").await.unwrap();
    client.flush().await.unwrap();
    client.publish("ping", "pong".into()).await.unwrap();
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&msg.payload[..], b"pong");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_token_authentication_connects() {
    let nats = server_with(
        "authorization { token: $TOKEN }",
        vec![("TOKEN".into(), "tok-canary-1".into())],
    );
    let mut args = NatsArgs::for_url(nats.url());
    args.token = Some(Secret::new("tok-canary-1"));
    round_trip(&args).await;
    args.token = Some(Secret::new("tok-canary-2"));
    let e = args.connect("t").await.unwrap_err().to_string();
    assert!(e.contains("refused") && !e.contains("canary"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_nkey_authentication_connects() {
    let user = nkeys::KeyPair::new_user();
    let nats = server_with(
        &format!(
            "authorization {{ users = [ {{ nkey: {} }} ] }}",
            user.public_key()
        ),
        vec![],
    );
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("user.nk");
    std::fs::write(&seed, format!("{}\n", user.seed().unwrap())).unwrap();
    let mut args = NatsArgs::for_url(nats.url());
    args.nkey_seed_file = Some(seed.clone());
    round_trip(&args).await;
    // Another key is refused.
    std::fs::write(&seed, nkeys::KeyPair::new_user().seed().unwrap()).unwrap();
    let e = args.connect("t").await.unwrap_err().to_string();
    assert!(e.contains("refused") && !e.contains("SU"), "{e}");
}

/// JWTs as `nsc` writes them: header, claims and an ed25519 signature by
/// the issuer's NKey, each base64url without padding.
fn jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let claims = serde_json::json!({
        "jti": format!("{:X}", now.as_nanos()),
        "iat": now.as_secs(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let claims = b64(claims.to_string().as_bytes());
    let signed = format!("{header}.{claims}");
    let sig = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64(&sig))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_creds_file_authentication_connects() {
    // An operator, an account and a user, as `nsc` would make them; the
    // server trusts the operator and preloads the account.
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let unlimited = serde_json::json!({ "subs": -1, "data": -1, "payload": -1 });
    let op_jwt = jwt(
        &operator,
        &operator.public_key(),
        "op",
        serde_json::json!({ "type": "operator", "version": 2 }),
    );
    let acc_jwt = jwt(
        &operator,
        &account.public_key(),
        "acc",
        serde_json::json!({
            "type": "account", "version": 2,
            "limits": { "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                        "wildcards": true, "conn": -1, "leaf": -1 },
        }),
    );
    let mut user_claims = unlimited.clone();
    user_claims["type"] = "user".into();
    user_claims["version"] = 2.into();
    let user_jwt = jwt(&account, &user.public_key(), "u", user_claims.clone());
    // JetStream (every test server runs it) needs a system account.
    let system = nkeys::KeyPair::new_account();
    let sys_jwt = jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({ "type": "account", "version": 2 }),
    );
    let nats = server_with(
        &format!(
            "operator: {op_jwt}\nsystem_account: {sys}\nresolver: MEMORY\n\
             resolver_preload: {{ {acc}: {acc_jwt}, {sys}: {sys_jwt} }}\n",
            acc = account.public_key(),
            sys = system.public_key(),
        ),
        vec![],
    );
    let creds = |jwt: &str, seed: &str| {
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("user.creds");
    std::fs::write(&file, creds(&user_jwt, &user.seed().unwrap())).unwrap();
    let mut args = NatsArgs::for_url(nats.url());
    args.creds_file = Some(file.clone());
    round_trip(&args).await;
    // A user signed by an account the server does not know is refused.
    let stranger = nkeys::KeyPair::new_account();
    let other = jwt(&stranger, &user.public_key(), "u", user_claims);
    std::fs::write(&file, creds(&other, &user.seed().unwrap())).unwrap();
    let e = args.connect("t").await.unwrap_err().to_string();
    assert!(e.contains("refused") && !e.contains("SU"), "{e}");
}

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl: install it with `apt-get install -y openssl`");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, in
/// `dir` (ECDSA P-256, valid for a day).
fn certificates(dir: &std::path::Path) {
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(key);
    ca.extend([
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=toolfleet test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    ]);
    openssl(dir, &ca);
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        let (k, csr, pem, extfile) = (
            format!("{name}-key.pem"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&extfile), ext).unwrap();
        let mut req = vec!["req"];
        req.extend(key);
        req.extend(["-keyout", &k, "-out", &csr, "-subj"]);
        let subj = format!("/CN=toolfleet test {name}");
        req.push(&subj);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "1",
                "-extfile",
                &extfile,
            ],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_tls_with_a_ca_and_client_certificates() {
    let certs = tempfile::tempdir().unwrap();
    certificates(certs.path());
    let file = |name: &str| certs.path().join(name);
    let files = ["ca.pem", "server.pem", "server-key.pem"]
        .map(|n| (n.to_string(), std::fs::read(file(n)).unwrap()))
        .to_vec();
    let nats = NatsServer::start_configured(NatsConfig {
        extra: Some(
            "tls { cert_file: \"server.pem\", key_file: \"server-key.pem\", ca_file: \"ca.pem\", verify: true }"
                .into(),
        ),
        files,
        ..NatsConfig::default()
    })
    .unwrap();
    let mut args = NatsArgs::for_url(nats.url());
    args.connect_wait_secs = 3;
    args.tls_ca = Some(file("ca.pem"));
    args.tls_cert = Some(file("client.pem"));
    args.tls_key = Some(file("client-key.pem"));
    args.tls_required = true;
    round_trip(&args).await;

    // Without its certificate the server refuses the client…
    args.connect_wait_secs = 1;
    let mut anonymous = args.clone();
    anonymous.tls_cert = None;
    anonymous.tls_key = None;
    assert!(anonymous.connect("t").await.is_err());
    // …and without the CA the client does not trust the server.
    let mut untrusting = args.clone();
    untrusting.tls_ca = None;
    assert!(untrusting.connect("t").await.is_err());

    // TLS required of a server without it fails.
    let plain = NatsServer::start().unwrap();
    let mut required = NatsArgs::for_url(plain.url());
    required.connect_wait_secs = 1;
    required.tls_required = true;
    assert!(required.connect("t").await.is_err());
}
