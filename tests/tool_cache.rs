//! The tool-result cache (issue 32, part 3) on real servers: a real
//! `nats-server -js` and `redis-server`, the fleet in-process, a worker of
//! the test's own that counts its calls, and the scripted model server
//! standing in for the provider.
//!
//! A miss runs the tool and stores its `ok` result; a call with the same
//! arguments in any key order is answered from the cache (its `tool_result`
//! event says `cached`, its citations renumbered for the new invocation);
//! other arguments miss; an error is never stored; results lapse with their
//! TTL; `user` scope keys each user apart; `toolfleet cache purge` forgets a
//! tool's results for one tenant or all; a Redis that does not answer is
//! passed by. The tenant boundary is attacked on a server running the
//! shipped `ops/nats/auth.conf`: tenant globex, authenticated as itself,
//! never gets tenant acme's cached result.

// One documented exemption, as every test crate: scenario tests read top
// to bottom.
#![allow(clippy::too_many_lines)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::client::ChatOutcome;
use toolfleet_protocol::{ChatEventBody, ChatJob, ToolStatus};
use toolfleet_store::NewReference;
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use support::{Env, Options, WAIT};

/// One call the probe ran: its tenant, user and arguments.
#[derive(Debug, Clone, PartialEq)]
struct Ran {
    tenant: String,
    user: Option<String>,
    arguments: Value,
}

/// A tool that records every call it runs, cites one document named after
/// its `q` argument, and answers with a canary naming the tenant it ran
/// for (and the `greeting` of its settings, when it has one); `fail: true`
/// makes it fail, `warn: true` adds a warning, `stray: true` writes a
/// `[doc:1]` marker it never cited.
#[derive(Clone)]
struct Probe {
    ran: Arc<Mutex<Vec<Ran>>>,
}

impl Tool for Probe {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, args: Value) -> Result<ToolOutput, ToolError> {
        let tenant = ctx.invocation().tenant().to_owned();
        self.ran.lock().unwrap().push(Ran {
            tenant: tenant.clone(),
            user: ctx.invocation().user.clone(),
            arguments: args.clone(),
        });
        if args["fail"] == json!(true) {
            return Err(ToolError::failed("the probe failed, as asked"));
        }
        let q = args["q"].as_str().unwrap_or_default().to_owned();
        if args["warn"] == json!(true) {
            ctx.warning("probe_warning", "the probe warns, as asked");
        }
        if let Some(greeting) = ctx.settings().and_then(|s| s["greeting"].as_str()) {
            return Ok(ToolOutput::text(format!(
                "{q} for {tenant}: greeting={greeting}"
            )));
        }
        if args["stray"] == json!(true) {
            return Ok(ToolOutput::text(format!(
                "{q} for {tenant}: see [doc:1] STRAY-{tenant}"
            )));
        }
        if args["plain"] == json!(true) {
            // Nothing cited: the call needs no Redis.
            return Ok(ToolOutput::text(format!(
                "{q} for {tenant}: CANARY-{tenant}-{q}"
            )));
        }
        let refs = ctx
            .cite(vec![NewReference {
                kind: "document".into(),
                title: format!("probe {q}"),
                source: Some(format!("{q}.md")),
                url: None,
                snippet: None,
            }])
            .await?;
        Ok(ToolOutput::text(format!(
            "{} {q} for {tenant}: CANARY-{tenant}-{q}",
            refs[0].marker()
        )))
    }
}

/// A definition of `namespace:function@1.0.0` with `cache` (idempotent).
fn definition(namespace: &str, function: &str, cache: &Value) -> String {
    json!({
        "schemaVersion": 1,
        "id": format!("{namespace}:{function}@1.0.0"),
        "implementationKey": format!("{namespace}.{function}"),
        "title": "Probe",
        "description": "Answers a question and cites it.",
        "category": "testing",
        "idempotent": true,
        "cache": cache,
        "timeoutMs": 10000,
        "function": {
            "name": function,
            "description": "Answers question q.",
            "parameters": {
                "type": "object",
                "properties": {
                    "q": { "type": "string" },
                    "lang": { "type": "string" },
                    "fail": { "type": "boolean" },
                    "plain": { "type": "boolean" },
                    "warn": { "type": "boolean" },
                    "stray": { "type": "boolean" }
                },
                "required": ["q"]
            }
        }
    })
    .to_string()
}

/// `definition` with a `settingsSchema` (a `greeting`).
fn with_settings(definition: &str) -> String {
    let mut def: Value = serde_json::from_str(definition).unwrap();
    def["settingsSchema"] = json!({
        "type": "object",
        "properties": { "greeting": { "type": "string" } }
    });
    def.to_string()
}

/// The `testing` worker: `probe` (tenant scope, a minute), `probe_short`
/// (tenant scope, 1 s), `probe_user` (user scope, a minute) and
/// `probe_set` (tenant scope, a minute, with per-tenant settings).
fn testing_worker(ran: &Arc<Mutex<Vec<Ran>>>) -> Worker {
    let mut builder = Worker::builder("testing");
    for (function, cache) in [
        ("probe", json!({ "ttlMs": 60000, "scope": "tenant" })),
        ("probe_short", json!({ "ttlMs": 1000, "scope": "tenant" })),
        ("probe_user", json!({ "ttlMs": 60000, "scope": "user" })),
        ("probe_set", json!({ "ttlMs": 60000, "scope": "tenant" })),
    ] {
        let mut def = definition("testing", function, &cache);
        if function == "probe_set" {
            def = with_settings(&def);
        }
        builder = builder
            .definition_json(&def)
            .tool(format!("testing.{function}"), Probe { ran: ran.clone() });
    }
    builder.build().unwrap()
}

/// A rule: when the question contains `word`, call `function` with each
/// of `calls` (one round each), then answer with the last result.
fn rule(word: &str, function: &str, calls: &[Value]) -> Value {
    let mut steps: Vec<Value> = calls
        .iter()
        .map(|args| json!({ "toolCalls": [ { "name": function, "arguments": args } ] }))
        .collect();
    steps.push(json!({ "answer": format!("Answer: {{{{tool:{function}}}}}") }));
    json!({ "whenUserContains": [word], "steps": steps })
}

fn script() -> Value {
    json!({
        "rules": [
            rule("alpha", "probe", &[json!({ "q": "tides", "lang": "en" })]),
            // Another question first (it cites [doc:1]), then alpha's call
            // with its keys in another order.
            rule("beta", "probe", &[json!({ "q": "moon" }), json!({ "lang": "en", "q": "tides" })]),
            rule("gamma", "probe", &[json!({ "q": "tides", "lang": "fr" })]),
            rule("broken", "probe", &[json!({ "q": "oops", "fail": true })]),
            rule("short", "probe_short", &[json!({ "q": "brief" })]),
            rule("personal", "probe_user", &[json!({ "q": "mine" })]),
            rule("plainly", "probe", &[json!({ "q": "tides", "plain": true })]),
            rule("warned", "probe", &[json!({ "q": "tides", "warn": true })]),
            rule("settled", "probe_set", &[json!({ "q": "hello" })]),
            // A result with a marker it never cited; then, after a call
            // that cites [doc:1] itself, the same call again.
            rule("ghost", "probe", &[json!({ "q": "ghost", "stray": true })]),
            rule("haunted", "probe", &[json!({ "q": "moon" }), json!({ "stray": true, "q": "ghost" })]),
            // Three calls in one round, the model taking its time (the
            // test freezes Redis meanwhile).
            { "whenUserContains": ["frozen"], "steps": [
                { "fault": { "kind": "slowFirstToken", "delayMs": 1500, "times": 1 },
                  "toolCalls": [
                    { "name": "probe", "arguments": { "plain": true, "q": "one" } },
                    { "name": "probe", "arguments": { "plain": true, "q": "two" } },
                    { "name": "probe", "arguments": { "plain": true, "q": "three" } }
                  ] },
                { "answer": "Answer: {{tool:probe}}" }
            ] },
            // The same call, the model taking its time over it (the test
            // takes Redis away meanwhile).
            { "whenUserContains": ["slowly"], "steps": [
                { "fault": { "kind": "slowFirstToken", "delayMs": 1500, "times": 1 },
                  "toolCalls": [ { "name": "probe", "arguments": { "plain": true, "q": "tides" } } ] },
                { "answer": "Answer: {{tool:probe}}" }
            ] },
        ],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}

/// Tenant `default` trusts its users (scope `user` needs one).
const PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[profiles.default]
deployment = "scripted"

[tenants.default]
trust_user = true
"#;

/// A fleet with no family but the test's `testing` worker (running while
/// its handle lives).
async fn start() -> (Env, Arc<Mutex<Vec<Ran>>>, support::TestWorker) {
    let env = Env::start_with(
        script(),
        Options {
            workers: Vec::new(),
            profiles_toml: Some(PROFILES.into()),
            ..Options::default()
        },
    )
    .await;
    let ran = Arc::new(Mutex::new(Vec::new()));
    let worker = env.start_worker(testing_worker(&ran)).await;
    (env, ran, worker)
}

/// Asks `question` as `tenant` (and `user`); the outcome of a completed job.
async fn ask(env: &Env, tenant: &str, user: Option<&str>, question: &str) -> ChatOutcome {
    let mut job: ChatJob = toolfleet_protocol::client::question(question);
    job.tenant = Some(tenant.into());
    job.user = user.map(str::to_string);
    env.submit(&job).await.expect("the job completes")
}

/// Each `tool_result` event's status and `cached` flag, in order.
fn results(outcome: &ChatOutcome) -> Vec<(ToolStatus, bool)> {
    outcome
        .events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult { status, cached, .. } => Some((*status, *cached)),
            _ => None,
        })
        .collect()
}

fn runs(ran: &Arc<Mutex<Vec<Ran>>>) -> usize {
    ran.lock().unwrap().len()
}

/// `toolfleet_tool_cache_total` of `tool` and `outcome` as the fleet's
/// `/metrics` shows it (0 when absent).
async fn cache_count(env: &Env, tool: &str, outcome: &str) -> u64 {
    let (tool, outcome) = (format!("tool=\"{tool}\""), format!("outcome=\"{outcome}\""));
    env.metrics_text()
        .await
        .lines()
        .filter(|l| l.starts_with("toolfleet_tool_cache_total{"))
        .filter(|l| l.contains(&tool) && l.contains(&outcome))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Waits until `toolfleet_tool_cache_total{outcome="store"}` of `tool`
/// reaches `n` (a result is stored in a task of its own).
async fn stored(env: &Env, tool: &str, n: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while cache_count(env, tool, "store").await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{tool}: {n} results never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const PROBE: &str = "testing:probe@1.0.0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_arguments_in_any_key_order_hit_and_other_arguments_miss() {
    let (env, ran, _worker) = start().await;

    let first = ask(&env, "default", None, "alpha").await;
    assert_eq!(results(&first), vec![(ToolStatus::Ok, false)]);
    assert!(
        first.text.contains("CANARY-default-tides"),
        "{}",
        first.text
    );
    assert_eq!(runs(&ran), 1);
    stored(&env, PROBE, 1).await;

    // Round 1 asks something else (a miss that cites [doc:1]); round 2
    // asks alpha's question with its keys the other way round: a hit,
    // the worker is not called, and the cached result's citation takes
    // this invocation's next index.
    let second = ask(&env, "default", None, "beta").await;
    assert_eq!(
        results(&second),
        vec![(ToolStatus::Ok, false), (ToolStatus::Ok, true)]
    );
    // The cached flag is in the published contract.
    for event in &second.events {
        let v = serde_json::to_value(event).unwrap();
        toolfleet_protocol::Envelope::ChatEvent
            .validator()
            .validate(&v)
            .unwrap_or_else(|e| panic!("{v}: {e:?}"));
    }
    assert!(
        second
            .events
            .iter()
            .any(|e| serde_json::to_value(e).unwrap()["cached"] == json!(true)),
        "{:?}",
        second.events
    );
    assert_eq!(runs(&ran), 2, "only the new question ran");
    assert_eq!(ran.lock().unwrap()[1].arguments, json!({ "q": "moon" }));
    let cited: Vec<(u64, String)> = second
        .events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::References { references } => Some(references.clone()),
            _ => None,
        })
        .flatten()
        .map(|r| (r.index, r.title))
        .collect();
    assert_eq!(
        cited,
        vec![
            (1, "probe moon".to_string()),
            (2, "probe tides".to_string())
        ],
        "a cached result's reference takes a fresh index"
    );
    // What the model read of the cached result cites that index.
    let last_request = env.model.requests().last().cloned().unwrap().to_string();
    assert!(
        last_request.contains("[doc:2] tides for default"),
        "{last_request}"
    );
    assert!(
        !last_request.contains("[doc:1] tides"),
        "the stored index is not reused: {last_request}"
    );

    // Another value of one argument is another call.
    let third = ask(&env, "default", None, "gamma").await;
    assert_eq!(results(&third), vec![(ToolStatus::Ok, false)]);
    assert_eq!(runs(&ran), 3);

    assert_eq!(cache_count(&env, PROBE, "hit").await, 1);
    assert_eq!(cache_count(&env, PROBE, "miss").await, 3);
    stored(&env, PROBE, 3).await;
    assert_eq!(cache_count(&env, PROBE, "bypass").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_is_never_cached() {
    let (env, ran, _worker) = start().await;
    for attempt in 1..=2 {
        let outcome = ask(&env, "default", None, "broken").await;
        assert_eq!(results(&outcome), vec![(ToolStatus::Error, false)]);
        assert_eq!(
            runs(&ran),
            attempt,
            "the failing call reached the worker again"
        );
    }
    assert_eq!(cache_count(&env, PROBE, "miss").await, 2);
    assert_eq!(cache_count(&env, PROBE, "hit").await, 0);
    assert_eq!(cache_count(&env, PROBE, "store").await, 0);
    // Nothing was written for the tool at all (only the generations a
    // purge would make, and no purge ran).
    let mut redis = env.redis_conn.clone();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("toolfleet:{tc:testing:probe}:*")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_result_lapses_with_its_ttl() {
    let (env, ran, _worker) = start().await;
    let tool = "testing:probe_short@1.0.0";
    ask(&env, "default", None, "short").await;
    stored(&env, tool, 1).await;
    let mut redis = env.redis_conn.clone();
    let entries: Vec<String> = redis::cmd("KEYS")
        .arg("toolfleet:{tc:testing:probe_short}:e:*")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert!(entry.contains(":e:tenant:default:"), "{entry}");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(entry)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 1000, "the definition's ttlMs: {pttl}");

    // Once Redis has let it lapse, the call runs again.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg(entry)
            .query_async(&mut redis)
            .await
            .unwrap();
        if !exists {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never lapsed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let again = ask(&env, "default", None, "short").await;
    assert_eq!(results(&again), vec![(ToolStatus::Ok, false)]);
    assert_eq!(runs(&ran), 2);
    assert_eq!(cache_count(&env, tool, "hit").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_scope_keys_each_user_apart_and_caches_no_call_without_one() {
    let (env, ran, _worker) = start().await;
    let tool = "testing:probe_user@1.0.0";

    ask(&env, "default", Some("ann"), "personal").await;
    stored(&env, tool, 1).await;
    let again = ask(&env, "default", Some("ann"), "personal").await;
    assert_eq!(results(&again), vec![(ToolStatus::Ok, true)]);
    assert_eq!(runs(&ran), 1);

    // Bob asks the same: his own call.
    let bob = ask(&env, "default", Some("bob"), "personal").await;
    assert_eq!(results(&bob), vec![(ToolStatus::Ok, false)]);
    assert_eq!(runs(&ran), 2);
    assert_eq!(ran.lock().unwrap()[1].user.as_deref(), Some("bob"));

    // No user: not cached at all, run every time.
    for n in 3..=4 {
        let anonymous = ask(&env, "default", None, "personal").await;
        assert_eq!(results(&anonymous), vec![(ToolStatus::Ok, false)]);
        assert_eq!(runs(&ran), n);
    }
    assert_eq!(cache_count(&env, tool, "bypass").await, 2);
    assert_eq!(cache_count(&env, tool, "hit").await, 1);
    assert_eq!(cache_count(&env, tool, "miss").await, 2);
}

/// Runs `toolfleet cache purge ARGS` against the fleet's Redis.
fn purge(env: &Env, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["cache", "purge"];
    all.extend_from_slice(args);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(&all)
        .env("TOOLFLEET_REDIS_URL", env.redis.url())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_forgets_one_tenants_results_or_everyones() {
    let (env, ran, _worker) = start().await;
    let cached = |outcome: &ChatOutcome| results(outcome)[0].1;

    for (n, tenant) in [(1, "default"), (2, "globex")] {
        let outcome = ask(&env, tenant, None, "alpha").await;
        assert!(!cached(&outcome));
        assert!(
            outcome.text.contains(&format!("CANARY-{tenant}-")),
            "{}",
            outcome.text
        );
        stored(&env, PROBE, n).await;
    }
    for tenant in ["default", "globex"] {
        let outcome = ask(&env, tenant, None, "alpha").await;
        assert!(cached(&outcome), "{tenant}");
        // Each tenant its own result, never the other's.
        assert!(
            outcome.text.contains(&format!("CANARY-{tenant}-")),
            "{}",
            outcome.text
        );
    }
    assert_eq!(runs(&ran), 2);

    // Bad input is refused before anything is touched.
    for bad in [
        vec!["Testing:probe"],
        vec!["testing"],
        vec!["testing:probe", "--tenant", "glo bex"],
    ] {
        let (code, _, stderr) = purge(&env, &bad);
        assert_eq!(code, Some(64), "{bad:?}: {stderr}");
        assert!(stderr.contains("toolfleet cache purge"), "{stderr}");
    }
    assert!(cached(&ask(&env, "globex", None, "alpha").await));

    // One tenant: globex runs again, default still hits.
    let (code, stdout, stderr) = purge(&env, &["testing:probe", "--tenant", "globex"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains(
            "purged the cached results of testing:probe (every version) for tenant globex"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("note:"), "{stdout}");
    assert!(!cached(&ask(&env, "globex", None, "alpha").await));
    assert_eq!(runs(&ran), 3);

    // A name nothing was ever stored under (a typo): purged all the same,
    // and the output says nothing was known under it.
    let (code, stdout, stderr) = purge(&env, &["testing:prboe"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("note: nothing was known to be cached under testing:prboe"),
        "{stdout}"
    );
    let (code, stdout, _) = purge(&env, &["testing:prboe", "-o", "json"]);
    assert_eq!(code, Some(0));
    let printed: Value = serde_json::from_str(&stdout).unwrap();
    // Known now: the first purge made its generation.
    assert_eq!(printed["known"], json!(true), "{printed}");
    assert!(cached(&ask(&env, "default", None, "alpha").await));

    // Everyone (a whole id names its tool): default runs again too.
    let (code, stdout, stderr) = purge(&env, &["testing:probe@1.0.0", "-o", "json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let printed: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(printed["tool"], "testing:probe");
    assert_eq!(printed["tenant"], Value::Null);
    assert!(!cached(&ask(&env, "default", None, "alpha").await));
    assert_eq!(runs(&ran), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_answered_uncached_while_redis_is_down() {
    let (mut env, ran, _worker) = start().await;
    ask(&env, "default", None, "plainly").await;
    stored(&env, PROBE, 1).await;

    // The model takes its time over the next job's tool call; Redis goes
    // away meanwhile, and comes back (empty: it keeps nothing on disk) once
    // the orchestrator has passed the cache by — before the run's lease,
    // which Redis also keeps, would lapse.
    let job = toolfleet_protocol::client::question("the same, slowly");
    let mut events = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    while !seen.contains(&"started".to_string()) {
        let event = support::next_json(&mut events).await;
        seen.push(event["type"].as_str().unwrap_or_default().to_owned());
    }
    env.redis.stop();
    let deadline = tokio::time::Instant::now() + WAIT;
    while cache_count(&env, PROBE, "bypass").await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache was never passed by"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.redis.start_again().unwrap();

    let end = support::events_until_terminal(&mut events).await;
    assert_eq!(end.last().unwrap()["type"], "completed", "{end:#?}");
    let result = end.iter().find(|e| e["type"] == "tool_result").unwrap();
    assert_eq!(result["status"], "ok", "{result}");
    assert_eq!(result.get("cached"), None, "{result}");
    assert_eq!(runs(&ran), 2, "the call ran: the cache did not answer");
    assert_eq!(cache_count(&env, PROBE, "hit").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_with_warnings_is_never_cached() {
    let (env, ran, _worker) = start().await;
    for attempt in 1..=2 {
        let outcome = ask(&env, "default", None, "warned").await;
        assert_eq!(results(&outcome), vec![(ToolStatus::Ok, false)]);
        assert_eq!(runs(&ran), attempt, "the warned call ran again");
    }
    // Each result was judged and not kept (counted `skip`).
    let deadline = tokio::time::Instant::now() + WAIT;
    while cache_count(&env, PROBE, "skip").await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "never skipped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cache_count(&env, PROBE, "miss").await, 2);
    assert_eq!(cache_count(&env, PROBE, "store").await, 0);
    assert_eq!(cache_count(&env, PROBE, "hit").await, 0);
    let mut redis = env.redis_conn.clone();
    let entries: Vec<String> = redis::cmd("KEYS")
        .arg("toolfleet:{tc:testing:probe}:e:*")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(entries.is_empty(), "{entries:?}");
}

/// Writes `greeting` as tenant `default`'s settings of `testing:probe_set`,
/// as `toolfleet settings set` does (a put into the settings bucket,
/// nothing else).
async fn set_greeting(env: &Env, greeting: &str) {
    let kv = async_nats::jetstream::new(env.client.clone())
        .get_key_value("TOOLFLEET_SETTINGS")
        .await
        .expect("the orchestrator made the settings bucket");
    let key = toolfleet_protocol::settings_key("default", "testing", "probe_set");
    kv.put(key, json!({ "greeting": greeting }).to_string().into())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_new_settings_miss_the_results_of_its_old_ones() {
    let (env, ran, _worker) = start().await;
    let tool = "testing:probe_set@1.0.0";
    set_greeting(&env, "hello-old").await;
    let first = ask(&env, "default", None, "settled").await;
    assert_eq!(results(&first), vec![(ToolStatus::Ok, false)]);
    assert!(first.text.contains("greeting=hello-old"), "{}", first.text);
    stored(&env, tool, 1).await;
    let again = ask(&env, "default", None, "settled").await;
    assert_eq!(results(&again), vec![(ToolStatus::Ok, true)]);
    assert_eq!(runs(&ran), 1);

    // The operator changes the settings: the next call runs under them,
    // never answered from the result made under the old ones.
    set_greeting(&env, "hello-new").await;
    let changed = ask(&env, "default", None, "settled").await;
    assert_eq!(results(&changed), vec![(ToolStatus::Ok, false)]);
    assert!(
        changed.text.contains("greeting=hello-new"),
        "{}",
        changed.text
    );
    assert!(!changed.text.contains("hello-old"), "{}", changed.text);
    assert_eq!(runs(&ran), 2);
    stored(&env, tool, 2).await;
    // And back: the old settings' result is still theirs.
    set_greeting(&env, "hello-old").await;
    let back = ask(&env, "default", None, "settled").await;
    assert_eq!(results(&back), vec![(ToolStatus::Ok, true)]);
    assert!(back.text.contains("greeting=hello-old"), "{}", back.text);
    assert_eq!(runs(&ran), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_never_keeps_a_marker_it_has_no_reference_for() {
    let (env, ran, _worker) = start().await;
    let first = ask(&env, "default", None, "ghost").await;
    assert_eq!(results(&first), vec![(ToolStatus::Ok, false)]);
    stored(&env, PROBE, 1).await;

    // Round 1 cites [doc:1] (probe moon); round 2 is the stored result
    // that names [doc:1] without a reference of its own: given again, the
    // marker must not point at the moon.
    let second = ask(&env, "default", None, "haunted").await;
    assert_eq!(
        results(&second),
        vec![(ToolStatus::Ok, false), (ToolStatus::Ok, true)]
    );
    assert_eq!(runs(&ran), 2);
    let last_request = env.model.requests().last().cloned().unwrap().to_string();
    assert!(last_request.contains("STRAY-default"), "{last_request}");
    assert!(
        !last_request.contains("see [doc:1] STRAY"),
        "a stray marker survived the hit: {last_request}"
    );
    assert!(
        last_request.contains("[doc:1] moon for default"),
        "{last_request}"
    );
}

/// How many `MGET`s of `tool`'s cache keys Redis has run since its slow
/// log was last reset (the test logs every command).
async fn cache_lookups(redis: &mut redis::aio::MultiplexedConnection, tool: &str) -> usize {
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(100_000)
        .query_async(redis)
        .await
        .unwrap();
    let tag = format!("{{tc:{tool}}}");
    log.iter()
        .filter(|entry| {
            let text = format!("{entry:?}");
            text.contains("MGET") && text.contains(&tag)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_is_asked_once_and_then_passed_by() {
    let (env, ran, _worker) = start().await;
    let mut redis = env.redis_conn.clone();
    for (name, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "100000"),
    ] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    let () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(&mut redis)
        .await
        .unwrap();

    // The model takes its time over three calls of a cached tool; Redis
    // freezes meanwhile (SIGSTOP: connections open, nothing answered).
    let job = toolfleet_protocol::client::question("three at once, frozen");
    let mut events = env.follow_and_submit(&job).await;
    loop {
        let event = support::next_json(&mut events).await;
        if event["type"] == "started" {
            break;
        }
    }
    env.redis.pause();
    let deadline = tokio::time::Instant::now() + WAIT;
    while cache_count(&env, PROBE, "bypass").await == 0 {
        if tokio::time::Instant::now() >= deadline {
            env.redis.resume();
            panic!("the cache was never passed by");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.redis.resume();

    let end = support::events_until_terminal(&mut events).await;
    assert_eq!(end.last().unwrap()["type"], "completed", "{end:#?}");
    let answered: Vec<&Value> = end.iter().filter(|e| e["type"] == "tool_result").collect();
    assert_eq!(answered.len(), 3, "{end:#?}");
    for result in answered {
        assert_eq!(result["status"], "ok", "{result}");
        assert_eq!(result.get("cached"), None, "{result}");
    }
    assert_eq!(runs(&ran), 3, "every call ran: the cache did not answer");
    assert_eq!(cache_count(&env, PROBE, "bypass").await, 3);
    assert_eq!(cache_count(&env, PROBE, "miss").await, 0);
    assert_eq!(cache_count(&env, PROBE, "hit").await, 0);
    // The first lookup reached the frozen Redis (which ran it once thawed);
    // the breaker kept the other two from asking at all.
    assert_eq!(cache_lookups(&mut redis, "testing:probe").await, 1);
}

use support::identities::connect_as as connect;

/// acme's and globex's identities ask the same question of a tenant-scoped
/// tool (`units:convert`, served under the `units` role): each gets its own
/// result, never the other's canary, cached or not; a job on globex's
/// subject whose body claims acme is refused (`tenant_mismatch`). Of a
/// `global` tool (`system:current_datetime`, served under the `system`
/// role), a call naming a `resource` is
/// its tenant's: globex naming acme's resource runs its own call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_never_gets_a_tenants_cached_result() {
    use toolfleet_local::servers::RedisServer;
    let nats = support::identities::secure_nats();
    let redis = RedisServer::start().expect("redis-server");
    let rule = |word: &str, function: &str| rule(word, function, &[json!({ "q": "the secret" })]);
    let script = json!({ "rules": [
        rule("convert", "convert"),
        rule("claim", "convert"),
        rule("page", "current_datetime"),
    ] });
    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&script.to_string()).unwrap(),
    )
    .await
    .unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let redis_url = &redis.url();
    let store =
        || toolfleet_store::CitationStore::connect(redis_url, "toolfleet", Duration::from_secs(60));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let profiles = toolfleet_config::FleetConfig::from_toml(
        &PROFILES.replace("{base_url}", model.base_url().as_str()),
        "cache test profiles",
    )
    .unwrap();
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let orchestrator = tokio::time::timeout(
        WAIT,
        toolfleet_orchestrator::Ready::open(
            connect(&nats, "orchestrator").await,
            store().await.unwrap(),
            toolfleet_orchestrator::OrchestratorConfig::new(subjects.clone(), profiles),
            metrics,
            shutdown.clone(),
        ),
    )
    .await
    .expect("the orchestrator starts in time")
    .expect("the orchestrator starts");
    tokio::spawn(orchestrator.run());
    let ran = Arc::new(Mutex::new(Vec::new()));
    let worker = Worker::builder("units")
        .definition_json(&definition(
            "units",
            "convert",
            &json!({ "ttlMs": 60000, "scope": "tenant" }),
        ))
        .tool("units.convert", Probe { ran: ran.clone() })
        .build()
        .unwrap();
    tokio::time::timeout(
        WAIT,
        worker.start(
            connect(&nats, "worker-units").await,
            store().await.unwrap(),
            toolfleet_worker::WorkerConfig::new(subjects.clone()),
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap(),
            shutdown.clone(),
        ),
    )
    .await
    .expect("the worker starts in time")
    .expect("the worker starts");
    // The system role's one tool, as a global-scoped probe.
    let system = Worker::builder("system")
        .definition_json(&definition(
            "system",
            "current_datetime",
            &json!({ "ttlMs": 60000, "scope": "global" }),
        ))
        .tool("system.current_datetime", Probe { ran: ran.clone() })
        .build()
        .unwrap();
    tokio::time::timeout(
        WAIT,
        system.start(
            connect(&nats, "worker-system").await,
            store().await.unwrap(),
            toolfleet_worker::WorkerConfig::new(subjects.clone()),
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap(),
            shutdown.clone(),
        ),
    )
    .await
    .expect("the system worker starts in time")
    .expect("the system worker starts");

    let acme = connect(&nats, "client-acme").await;
    let globex = connect(&nats, "client-globex").await;
    let ask_about =
        |client: &async_nats::Client, tenant: &str, question: &str, resource: Option<&str>| {
            let mut job = toolfleet_protocol::client::question(question);
            job.tenant = Some(tenant.into());
            job.resource = resource.map(str::to_owned);
            let (client, subjects) = (client.clone(), subjects.clone());
            async move {
                tokio::time::timeout(
                    WAIT,
                    toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {}),
                )
                .await
                .expect("in time")
                .expect("completes")
            }
        };
    let ask = |client: &async_nats::Client, tenant: &str, question: &str| {
        ask_about(client, tenant, question, None)
    };
    // Until the orchestrator's catalog has read the worker.
    let deadline = tokio::time::Instant::now() + WAIT;
    let first = loop {
        let outcome = ask(&acme, "acme", "convert please").await;
        if results(&outcome) == vec![(ToolStatus::Ok, false)] {
            break outcome;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            outcome.events
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(first.text.contains("CANARY-acme-"), "{}", first.text);
    let stored_for = |n: usize| {
        let ran = ran.clone();
        async move {
            // Stored in a task of its own: wait for the entry.
            let deadline = tokio::time::Instant::now() + WAIT;
            let mut c = redis::Client::open(redis_url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            loop {
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg("toolfleet:{tc:units:convert}:e:*")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                if keys.len() >= n {
                    return (keys, ran.lock().unwrap().len());
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{n} entries never stored"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    stored_for(1).await;

    // globex, authenticated as itself, asks the very same: its own call.
    let theirs = ask(&globex, "globex", "convert please").await;
    assert_eq!(results(&theirs), vec![(ToolStatus::Ok, false)]);
    assert!(theirs.text.contains("CANARY-globex-"), "{}", theirs.text);
    assert!(!theirs.text.contains("CANARY-acme"), "{}", theirs.text);
    let (keys, runs) = stored_for(2).await;
    assert_eq!(runs, 2);
    assert!(
        keys.iter().any(|k| k.contains(":e:tenant:acme:")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.contains(":e:tenant:globex:")),
        "{keys:?}"
    );

    // Each hits its own from now on.
    for (client, tenant) in [(&acme, "acme"), (&globex, "globex")] {
        let again = ask(client, tenant, "convert please").await;
        assert_eq!(results(&again), vec![(ToolStatus::Ok, true)], "{tenant}");
        assert!(
            again.text.contains(&format!("CANARY-{tenant}-")),
            "{}",
            again.text
        );
    }

    // A body claiming acme, on globex's own subject: the subject decides.
    let mut job = toolfleet_protocol::client::question("claim please");
    job.tenant = Some("globex".into());
    let mut body = serde_json::to_value(&job).unwrap();
    body["tenant"] = json!("acme");
    let mut events = globex
        .subscribe(subjects.chat_events("globex", &job.invocation_id))
        .await
        .unwrap();
    globex.flush().await.unwrap();
    async_nats::jetstream::new(globex.clone())
        .publish(
            subjects.chat_submit("globex"),
            serde_json::to_vec(&body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let end = loop {
        let event = support::next_json(&mut events).await;
        if matches!(event["type"].as_str(), Some("completed" | "error")) {
            break event;
        }
    };
    assert_eq!(end["type"], "error", "{end}");
    assert_eq!(end["code"], "tenant_mismatch", "{end}");
    assert!(!end.to_string().contains("CANARY-acme"), "{end}");
    assert_eq!(
        ran.lock()
            .unwrap()
            .iter()
            .filter(|r| r.tenant == "acme")
            .count(),
        1
    );

    // A global tool, a call naming a resource: acme's is acme's.
    let page = |client, tenant| ask_about(client, tenant, "page please", Some("page-7"));
    let theirs = page(&acme, "acme").await;
    assert_eq!(results(&theirs), vec![(ToolStatus::Ok, false)]);
    assert!(theirs.text.contains("CANARY-acme-"), "{}", theirs.text);
    let entries = |n| {
        let redis_url = redis_url.clone();
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            let mut c = redis::Client::open(redis_url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            loop {
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg("toolfleet:{tc:system:current_datetime}:e:*")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                if keys.len() >= n {
                    return keys;
                }
                assert!(tokio::time::Instant::now() < deadline, "{n} never stored");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let keys = entries(1).await;
    assert!(keys[0].contains(":e:tenant:acme:"), "{keys:?}");
    // globex names the very same resource: its own call, its own canary.
    let before = ran.lock().unwrap().len();
    let attack = page(&globex, "globex").await;
    assert_eq!(
        results(&attack),
        vec![(ToolStatus::Ok, false)],
        "{}",
        attack.text
    );
    assert!(attack.text.contains("CANARY-globex-"), "{}", attack.text);
    assert!(!attack.text.contains("CANARY-acme"), "{}", attack.text);
    assert_eq!(ran.lock().unwrap().len(), before + 1);
    entries(2).await;
    let again = page(&acme, "acme").await;
    assert_eq!(results(&again), vec![(ToolStatus::Ok, true)]);
    assert!(again.text.contains("CANARY-acme-"), "{}", again.text);

    // Without a resource the call is global, as its definition says:
    // stored once, given to every tenant.
    let plain = ask(&acme, "acme", "page please").await;
    assert_eq!(results(&plain), vec![(ToolStatus::Ok, false)]);
    let keys = entries(3).await;
    assert!(keys.iter().any(|k| k.contains(":e:global:")), "{keys:?}");
    let shared = ask(&globex, "globex", "page please").await;
    assert_eq!(results(&shared), vec![(ToolStatus::Ok, true)]);
}
