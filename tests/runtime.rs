//! The worker runtime inside a fleet: a plain JSON client's events, a
//! third-party worker process joining a running fleet, and two fleets on
//! one server. (The runtime's own tests, which need no orchestrator, are
//! in crates/toolfleet-worker/tests/runtime.rs.)

use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_protocol::Subjects;

use crate::support::{self, next_json};

/// What a client in another language does: plain JSON over NATS, no
/// toolfleet types. Every event validates against the published schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_json_client_gets_schema_valid_events() {
    let env = support::Env::start(json!({
        "rules": [{ "whenUserContains": ["honeybee"], "steps": [
            { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "honeybee waggle dance" } } ] },
            { "answer": "Bees dance: {{tool:search_data_sources}}" }
        ] }]
    }))
    .await;
    let mut events = env
        .subscribe("toolfleet.chat.events.default.plain-client-1".into())
        .await;
    let js = async_nats::jetstream::new(env.client.clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "plain-client-1");
    let body = r#"{"invocationId":"plain-client-1","messages":[{"role":"user","content":"How do honeybees navigate?"}]}"#;
    js.publish_with_headers(
        "toolfleet.chat.submit.default",
        headers.clone(),
        body.into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    // A retried submit inside the duplicate window is not run twice.
    let dup = js
        .publish_with_headers("toolfleet.chat.submit.default", headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(dup.duplicate);

    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(support::root().join("schemas/chat_event.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = toolfleet_protocol::schema::Validator::compile(&schema).unwrap();
    let mut seen = Vec::new();
    loop {
        let ev = next_json(&mut events).await;
        validator
            .validate(&ev)
            .unwrap_or_else(|v| panic!("{ev}: {v:?}"));
        let kind = ev["type"].as_str().unwrap().to_string();
        seen.push(kind.clone());
        if kind == "completed" {
            assert!(ev["text"].as_str().unwrap().contains("[doc:1]"));
            assert_eq!(ev["references"][0]["index"], 1);
            break;
        }
        assert_ne!(kind, "error", "{ev}");
    }
    assert_eq!(seen.first().map(String::as_str), Some("started"));
    support::assert_silent(
        &mut events,
        Duration::from_millis(500),
        "one terminal event, once",
    )
    .await;
}

/// The example third-party worker (`examples/units`, written against the
/// worker SDK alone) joins a running fleet as its own process, carrying its
/// own definition: the orchestrator learns its tool from the catalog
/// (no file on the orchestrator's side), the model calls it, and its
/// citation reaches the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_party_worker_answers_a_chat_job_end_to_end() {
    let env = support::Env::start(json!({
        "rules": [{ "whenUserContains": ["miles"], "steps": [
            { "toolCalls": [ { "name": "convert_units", "arguments": { "value": 5, "from": "km", "to": "mi" } } ] },
            { "answer": "That is {{tool:convert_units}}" }
        ] }]
    }))
    .await;
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut worker = std::process::Command::new(support::sibling_bin("units-worker"))
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env("TOOLFLEET_REDIS_URL", env.redis.url())
        .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("units-worker");
    let _kill = support::KillOnDrop(&mut worker);

    // The worker advertises itself; wait until the fleet's catalog has it.
    let deadline = tokio::time::Instant::now() + support::WAIT;
    loop {
        let catalog = toolfleet_protocol::catalog::discover(
            &env.client,
            &env.subjects,
            Duration::from_millis(250),
            &Default::default(),
        )
        .await
        .unwrap();
        if let Some(entry) = catalog.get("units:convert@1.0.0") {
            assert_eq!(entry.families, ["units"]);
            assert_eq!(entry.definition().function.name, "convert_units");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the units worker never appeared in the catalog"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (_, outcome) = env.ask("how many miles is 5 km?").await;
    let outcome = outcome.expect("completed");
    assert!(
        outcome.text.contains("5 km = 3.10686 mi [doc:1]"),
        "{}",
        outcome.text
    );
    let reference = &outcome.references[0];
    assert_eq!(reference.index, 1);
    assert_eq!(reference.tool_id.as_deref(), Some("units:convert@1.0.0"));
    assert_eq!(
        reference.url.as_deref(),
        Some("https://www.nist.gov/pml/special-publication-811")
    );
}

/// One fleet of the two that share a NATS server in
/// `two_fleets_on_one_server_never_see_each_other`.
async fn start_fleet(
    nats: &NatsServer,
    redis: &RedisServer,
    model: &toolfleet_scripted::ScriptedServer,
    prefix: &str,
    family: &'static str,
    index_dir: &std::path::Path,
    rt: &toolfleet_service::Runtime,
) -> Subjects {
    let subjects = Subjects::new(prefix).unwrap();
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(model.base_url(), "toolfleet-scripted"),
    )
    .with_data_source("handbook");
    let workers = toolfleet::families::some(
        &[family],
        &toolfleet::families::Inputs {
            definitions: &support::root().join("tool_definitions"),
            index: &toolfleet::families::IndexArgs::tantivy(
                index_dir.to_path_buf(),
                support::root().join("examples/corpus"),
            ),
            models: Some(&profiles),
        },
    )
    .await
    .unwrap();
    let spec = toolfleet_local::fleet::FleetSpec {
        nats_url: nats.url(),
        redis_url: redis.url(),
        subjects: subjects.clone(),
        citation_ttl: Duration::from_secs(600),
        orchestrator: Some(toolfleet_orchestrator::OrchestratorConfig::new(
            subjects.clone(),
            profiles,
        )),
        workers,
        worker_concurrency: 4,
        nats_connect_wait: Duration::from_secs(5),
        nats: None,
        redis: None,
    };
    tokio::time::timeout(
        support::WAIT,
        toolfleet_local::fleet::start(spec, &rt.metrics, &rt.tracker, rt.shutdown.clone()),
    )
    .await
    .expect("fleet start timed out")
    .expect("fleet start");
    subjects
}

/// Two fleets with different prefixes on one NATS server (and one Redis):
/// each sees only its own workers' tools, streams, consumers and events. A
/// tool only the other fleet serves is answered at once, never waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fleets_on_one_server_never_see_each_other() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let script =
        toolfleet_scripted::Script::from_json(&support::lighthouse_script().to_string()).unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (rt_a, rt_b) = (
        toolfleet_service::Runtime::new(),
        toolfleet_service::Runtime::new(),
    );
    let a = start_fleet(
        &nats,
        &redis,
        &model,
        "fleet-a",
        "system",
        &dir.path().join("a"),
        &rt_a,
    )
    .await;
    let b = start_fleet(
        &nats,
        &redis,
        &model,
        "fleet-b",
        "retrieval",
        &dir.path().join("b"),
        &rt_b,
    )
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();

    // The catalogs.
    let ids = |c: &toolfleet_protocol::catalog::Catalog| -> Vec<String> {
        c.iter().map(|e| e.definition().id.to_string()).collect()
    };
    for (subjects, want) in [
        (&a, "system:current_datetime@1.0.0"),
        (&b, "retrieval:search_data_sources@1.0.0"),
    ] {
        let want = if want.starts_with("retrieval:") {
            support::RETRIEVAL_TOOLS
                .map(|name| format!("retrieval:{name}@1.0.0"))
                .to_vec()
        } else {
            vec![want.to_owned()]
        };
        let catalog = toolfleet_protocol::catalog::discover(
            &client,
            subjects,
            Duration::from_millis(300),
            &Default::default(),
        )
        .await
        .unwrap();
        assert_eq!(ids(&catalog), want, "{}", subjects.prefix());
    }

    // Streams and consumers.
    let js = async_nats::jetstream::new(client.clone());
    let mut names: Vec<String> = futures::StreamExt::collect::<Vec<_>>(js.stream_names())
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "FLEET-A_CHAT",
            "FLEET-A_DEADLETTERS",
            "FLEET-A_DECISIONS",
            "FLEET-A_EVENTS",
            "FLEET-A_HISTORY",
            "FLEET-A_SINKS",
            "FLEET-A_TOOLS",
            "FLEET-B_CHAT",
            "FLEET-B_DEADLETTERS",
            "FLEET-B_DECISIONS",
            "FLEET-B_EVENTS",
            "FLEET-B_HISTORY",
            "FLEET-B_SINKS",
            "FLEET-B_TOOLS",
            "KV_FLEET-A_CATALOG",
            "KV_FLEET-A_IDEMPOTENCY",
            "KV_FLEET-A_PARKED",
            "KV_FLEET-A_SCHEDULES",
            "KV_FLEET-A_SETTINGS",
            "KV_FLEET-A_THREADS",
            "KV_FLEET-B_CATALOG",
            "KV_FLEET-B_IDEMPOTENCY",
            "KV_FLEET-B_PARKED",
            "KV_FLEET-B_SCHEDULES",
            "KV_FLEET-B_SETTINGS",
            "KV_FLEET-B_THREADS",
        ]
    );
    for (stream, want) in [
        ("FLEET-A_TOOLS", "tool_system_current_datetime_1_0_0"),
        ("FLEET-B_TOOLS", "tool_retrieval_search_data_sources_1_0_0"),
    ] {
        let s = js.get_stream(stream).await.unwrap();
        let mut consumers: Vec<String> = futures::StreamExt::collect::<Vec<_>>(s.consumer_names())
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        consumers.sort();
        let want: Vec<String> = if stream == "FLEET-B_TOOLS" {
            support::RETRIEVAL_TOOLS
                .map(|name| format!("tool_retrieval_{name}_1_0_0"))
                .to_vec()
        } else {
            vec![want.to_owned()]
        };
        assert_eq!(consumers, want, "{stream}");
    }

    // A job in fleet A: its own tool runs; the other fleet's tool is
    // answered at once; fleet B hears nothing.
    let mut b_events = client.subscribe("fleet-b.>").await.unwrap();
    client.flush().await.unwrap();
    let job = toolfleet_protocol::client::question("how do lighthouses warn ships?");
    let outcome = toolfleet_protocol::client::chat(&client, &a, &job, support::WAIT, |_| {})
        .await
        .expect("fleet A answers");
    let body = |e: &toolfleet_protocol::ChatEvent| serde_json::to_value(&e.body).unwrap();
    let events: Vec<Value> = outcome.events.iter().map(body).collect();
    let offered = events.iter().find(|e| e["type"] == "started").unwrap();
    assert_eq!(offered["tools"], json!(["system:current_datetime@1.0.0"]));
    let results: Vec<(String, String)> = events
        .iter()
        .filter(|e| e["type"] == "tool_result")
        .map(|e| {
            (
                e["tool"].as_str().unwrap().to_string(),
                e["errorCode"].as_str().unwrap_or("ok").to_string(),
            )
        })
        .collect();
    assert!(
        results.contains(&("system:current_datetime@1.0.0".into(), "ok".into())),
        "{results:?}"
    );
    assert!(
        // Answered at once (`unknown_tool`), not waited out (`timeout`).
        results.contains(&("search_data_sources".into(), "unknown_tool".into())),
        "{results:?}"
    );
    support::assert_silent(
        &mut b_events,
        Duration::from_millis(300),
        "fleet B saw traffic of fleet A",
    )
    .await;

    // And fleet B runs its own.
    let outcome = toolfleet_protocol::client::chat(&client, &b, &job, support::WAIT, |_| {})
        .await
        .expect("fleet B answers");
    assert!(outcome.text.contains("[doc:1]"), "{}", outcome.text);
    for rt in [rt_a, rt_b] {
        assert!(rt.drain(Duration::from_secs(10)).await);
    }
}

/// A server whose JetStream store cannot hold a fleet's byte limits (they
/// are reserved at creation, against `max_file_store`): the orchestrator
/// refuses to start with the server's own words and what to do, instead of
/// a bare failure (what a busy CI disk once showed as "channel closed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_too_small_for_the_fleets_streams_is_a_clear_start_error() {
    let nats = NatsServer::start_configured(toolfleet_local::servers::NatsConfig {
        extra: Some("jetstream {\n  max_file_store: 512MB\n}".into()),
        ..Default::default()
    })
    .unwrap();
    let redis = RedisServer::start().unwrap();
    let subjects = Subjects::new("small-disk").unwrap();
    let profiles = toolfleet_config::FleetConfig::from_toml(
        "[deployments.scripted]\nbase_url = \"http://127.0.0.1:9\"\nmodel = \"m\"\n\
         [profiles.default]\ndeployment = \"scripted\"\n",
        "small store test",
    )
    .unwrap();
    let config = toolfleet_orchestrator::OrchestratorConfig::new(subjects.clone(), profiles);
    let store = toolfleet_store::CitationStore::connect(
        &redis.url(),
        subjects.prefix(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let opened = tokio::time::timeout(
        support::WAIT,
        toolfleet_orchestrator::Ready::open(
            async_nats::connect(nats.url()).await.unwrap(),
            store,
            config,
            metrics,
            tokio_util::sync::CancellationToken::new(),
        ),
    )
    .await
    .expect("the start answers");
    let Err(error) = opened else {
        panic!("an orchestrator started on a store smaller than its streams' limits");
    };
    let error = error.to_string();
    assert!(error.contains("SMALL-DISK_CHAT"), "{error}");
    assert!(error.contains("insufficient storage"), "{error}");
    assert!(error.contains("max_file_store"), "{error}");
    assert!(!error.starts_with("NATS: NATS:"), "{error}");
}
