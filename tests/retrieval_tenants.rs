//! Tenant-scoped retrieval end to end (issue 28, item 1), as an attacker
//! would try it: a real nats-server running the shipped
//! `ops/nats/auth.conf`, the orchestrator and the retrieval worker as
//! processes under their role identities, Redis, and both index backends.
//! Tenant globex holds canary documents (its data source `globex-kb`, an
//! attached upload, its user bob's private upload and knowledge). Tenant
//! acme, with its own client identity, asks with a chat job that names
//! globex's data source, attaches globex's document ids and claims to be
//! bob: nothing acme can read — any event of its invocation (preemptive
//! RAG's `tool_result`s and `references` included) — nor anything written
//! to Redis for it holds globex's canary. globex's own identical job finds
//! the canary by the same paths, so the check can fail.

use std::time::Duration;

use serde_json::json;
use toolfleet_local::servers::RedisServer;
use toolfleet_protocol::client::{ChatOutcome, ClientError};
use toolfleet_protocol::{ChatEventBody, ChatJob, Subjects, ToolStatus};
use toolfleet_worker_retrieval::model::{Item, ItemKind, Owner};
use toolfleet_worker_retrieval::store::{DocumentRecord, Store};

use crate::security::{Proc, Secure, spawn};
use crate::support::{self, WAIT};

const CANARY: &str = "zebracanary";

/// The model searches every way a job may point at documents, then
/// answers with what the tools said.
fn script() -> serde_json::Value {
    json!({
        "rules": [{
            "whenUserContains": ["vault code"],
            "steps": [
                { "toolCalls": [
                    { "name": "search_data_sources", "arguments": { "query": "vault code", "topK": 5 } },
                    { "name": "search_documents", "arguments": { "query": "vault code", "topK": 5 } },
                    { "name": "list_documents", "arguments": {} },
                    { "name": "read_document", "arguments": { "documentId": "uploads:plan.md" } },
                    { "name": "retrieve_knowledge_context", "arguments": { "query": "vault code" } }
                ] },
                { "answer": "Sources: {{tool:search_data_sources}} | {{tool:search_documents}} | {{tool:list_documents}} | {{tool:read_document}} | {{tool:retrieve_knowledge_context}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}

fn chunked(tenant_word: &str, id: &str, owner: Option<&str>) -> (DocumentRecord, Vec<Item>) {
    let (collection, path) = id.split_once(':').unwrap();
    let text = format!("The vault code is {tenant_word}.");
    let owner = Owner {
        user: owner.map(Into::into),
        ..Owner::default()
    };
    let chunk = Item {
        id: format!("{id}#0"),
        kind: ItemKind::Document,
        collection: collection.into(),
        document_id: Some(id.into()),
        chunk: Some(0),
        title: format!("Vault {path}"),
        text: text.clone(),
        source: Some(path.into()),
        owner: owner.clone(),
        timestamp_ms: 1_000,
        ingested_ms: 1_000,
        entities: vec![],
        level: None,
        child_ids: vec![],
        aliases: vec![],
        relations: vec![],
        embedding: None,
    };
    let record = DocumentRecord {
        id: id.into(),
        collection: collection.into(),
        title: format!("Vault {path}"),
        source: path.into(),
        format: "markdown".into(),
        owner,
        text,
        raw: None,
        timestamp_ms: 1_000,
        ingested_ms: 1_000,
        chunks: 1,
        tokens: 8,
    };
    (record, vec![chunk])
}

/// globex's canaries; acme's own data under other ids.
async fn seed(store: &dyn Store) {
    let globex = vec![
        chunked(CANARY, "globex-kb:secret.md", None),
        chunked(CANARY, "uploads:plan.md", None),
        chunked(CANARY, "uploads:bob-private.md", Some("bob")),
    ];
    store.replace_documents("globex", globex).await.unwrap();
    let mut knowledge = chunked(CANARY, "globex-kb:bob-note.md", Some("bob"))
        .1
        .remove(0);
    knowledge.id = "bob-note".into();
    knowledge.kind = ItemKind::Knowledge;
    knowledge.document_id = None;
    knowledge.chunk = None;
    store.upsert_items("globex", vec![knowledge]).await.unwrap();
    let acme = vec![chunked("acmeplain", "acme-kb:open.md", None)];
    store.replace_documents("acme", acme).await.unwrap();
}

/// A job of `tenant` naming globex's data source and documents, as bob.
fn job(tenant: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question("What is the vault code?");
    job.tenant = Some(tenant.into());
    job.user = Some("bob".into());
    job.data_source_id = Some("globex-kb".into());
    job.attached_documents = vec!["uploads:plan.md".into(), "uploads:bob-private.md".into()];
    job
}

/// Everything a client reads of its job: every event as it came (JSON),
/// and the outcome.
async fn ask(
    client: &async_nats::Client,
    subjects: &Subjects,
    job: &ChatJob,
) -> Result<(String, ChatOutcome), ClientError> {
    let mut seen = Vec::new();
    let outcome = tokio::time::timeout(
        WAIT,
        toolfleet_protocol::client::chat(client, subjects, job, WAIT, |e| {
            seen.push(serde_json::to_value(e).unwrap());
        }),
    )
    .await
    .expect("chat timed out")?;
    Ok((serde_json::to_string(&seen).unwrap(), outcome))
}

/// The `references` events' JSON.
fn references(outcome: &ChatOutcome) -> String {
    let refs: Vec<&ChatEventBody> = outcome
        .events
        .iter()
        .map(|e| &e.body)
        .filter(|b| matches!(b, ChatEventBody::References { .. }))
        .collect();
    serde_json::to_string(&refs).unwrap()
}

/// Every value Redis holds under a key naming `invocation_id`.
async fn redis_values(redis: &RedisServer, invocation_id: &str) -> String {
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{invocation_id}*"))
        .query_async(&mut c)
        .await
        .unwrap();
    let mut out = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut c)
            .await
            .unwrap();
        let value: Vec<String> = match kind.as_str() {
            "hash" => redis::cmd("HGETALL")
                .arg(&key)
                .query_async(&mut c)
                .await
                .unwrap(),
            "string" => {
                let v: Vec<u8> = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                vec![String::from_utf8_lossy(&v).into_owned()]
            }
            "list" => redis::cmd("LRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .unwrap(),
            "set" => redis::cmd("SMEMBERS")
                .arg(&key)
                .query_async(&mut c)
                .await
                .unwrap(),
            "zset" => redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .unwrap(),
            other => vec![format!("{key}: a {other}")],
        };
        out.push(format!("{key}: {}", value.join(" ")));
    }
    out.join("\n")
}

/// The worker processes of the scenario, killed on drop.
struct Fleet {
    procs: Vec<Proc>,
}

impl Fleet {
    fn logs(&self) -> String {
        self.procs
            .iter()
            .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n----\n")
    }
}

/// The attack against a retrieval worker whose store `store_env` names
/// (already seeded).
async fn attack(secure: &Secure, store_env: Vec<(&'static str, String)>) {
    let redis = RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(&script().to_string()).unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let config = logs.path().join("toolfleet.toml");
    support::write_scripted_config(&config, &model.base_url());
    let with = |user: &str, extra| secure.process_env(user, &redis.url(), extra);
    let fleet = Fleet {
        procs: vec![
            spawn(
                "toolfleet-orchestrator",
                &with(
                    "orchestrator",
                    vec![("TOOLFLEET_CONFIG", config.display().to_string())],
                ),
                logs.path().join("orchestrator.log"),
            ),
            spawn(
                "toolfleet-worker-retrieval",
                &with("worker-retrieval", store_env),
                logs.path().join("worker-retrieval.log"),
            ),
        ],
    };
    let subjects = Subjects::new("toolfleet").unwrap();

    // globex, its own identity: until the workers serve, then it finds its
    // canary by every path (the positive control).
    let globex = secure.connect("client-globex").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok((_, outcome)) = ask(&globex, &subjects, &job("globex")).await {
            // Preemptive RAG's passages and the tools' answers.
            if references(&outcome).contains(CANARY) && outcome.text.contains(CANARY) {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "globex never found its own canary\n{}",
            fleet.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // acme, its own identity, naming globex's data source and documents as
    // bob: not one event it can read holds the canary.
    let acme = secure.connect("client-acme").await;
    let attack = job("acme");
    let (seen, outcome) = ask(&acme, &subjects, &attack)
        .await
        .unwrap_or_else(|e| panic!("acme's job is answered: {e}\n{}", fleet.logs()));
    assert!(!seen.contains(CANARY), "acme read globex's canary: {seen}");
    // The attack really ran: preemptive RAG and the model's calls reached
    // the retrieval worker and answered (with nothing of globex's).
    let results: Vec<(&str, ToolStatus)> = outcome
        .events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult { tool, status, .. } => Some((tool.as_str(), *status)),
            _ => None,
        })
        .collect();
    assert!(results.len() >= 7, "{results:?}\n{seen}");
    assert!(
        results
            .iter()
            .any(|(tool, s)| tool.contains("search_data_sources") && *s == ToolStatus::Ok),
        "{results:?}"
    );
    assert!(
        outcome.text.contains("Nothing in the data source matched"),
        "{}",
        outcome.text
    );
    // Nor anything written to Redis for acme's invocation.
    let stored = redis_values(&redis, &attack.invocation_id).await;
    assert!(!stored.is_empty(), "the invocation wrote its state");
    assert!(!stored.contains(CANARY), "Redis holds the canary: {stored}");
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrieval_acme_reads_nothing_of_globex_tantivy() {
    let secure = Secure::start();
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("index");
    {
        let store = toolfleet_worker_retrieval::tantivy_store::TantivyStore::open(&index).unwrap();
        seed(&store).await;
    }
    let env = vec![
        ("TOOLFLEET_INDEX_DIR", index.display().to_string()),
        (
            "TOOLFLEET_CORPUS_DIR",
            support::root()
                .join("examples/corpus")
                .display()
                .to_string(),
        ),
    ];
    attack(&secure, env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrieval_acme_reads_nothing_of_globex_postgres() {
    let secure = Secure::start();
    let postgres = toolfleet_testkit::postgres::PostgresServer::start().expect("PostgreSQL");
    toolfleet_worker_retrieval::postgres_store::PostgresStore::migrate(
        &postgres.url(),
        "toolfleet",
        None,
    )
    .await
    .unwrap();
    let store = toolfleet_worker_retrieval::postgres_store::PostgresStore::connect(
        &postgres.url(),
        "toolfleet",
    )
    .await
    .unwrap();
    seed(&store).await;
    let env = vec![
        ("TOOLFLEET_STORE", "postgres".to_string()),
        ("TOOLFLEET_POSTGRES_URL", postgres.url()),
        (
            "TOOLFLEET_CORPUS_DIR",
            support::root()
                .join("examples/corpus")
                .display()
                .to_string(),
        ),
    ];
    attack(&secure, env).await;
}
