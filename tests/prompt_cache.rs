//! Prompt-cache-friendly requests (issue 32) on real servers: the cached
//! tokens of a usage recorded from OpenAI (`shared/conformance` beside the
//! checkout, read at test time) reach the `completed` event, the token
//! metric and the cost at the cached price (the input price without one);
//! requests carry the tenant's and profile's `prompt_cache_key` only where
//! the deployment accepts it, never another tenant's, whatever a job
//! claims (the shipped `ops/nats/auth.conf` identities); a first
//! request's tools go out sorted by name, an expansion's after them, in
//! the same order after a park for approval, whose resumed run expands
//! no further than its cap; `toolfleet_prompt_prefix_changes_total`
//! counts a turn whose tools changed and no other; the cached tokens of a
//! Chat Completions usage count as the Responses ones do. The scripted
//! model server stands in for the provider and records what it was asked.

// The harness is shared with other targets; its start is over 100 lines.
#[allow(clippy::too_many_lines)]
mod support;

use std::path::PathBuf;

use futures::StreamExt;
use serde_json::{Value, json};
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_orchestrator::rounds::prompt_cache_key;
use toolfleet_protocol::tools::{Origin, ToolDefinition};
use toolfleet_protocol::{ChatEvent, ChatEventBody, ChatJob, Subjects, ToolStatus};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use support::{Env, Options, WAIT};

/// USD per million tokens of `cached-model` (which has a cached price)
/// and `plain-model` (which has none).
const INPUT: f64 = 2.0;
const CACHED_INPUT: f64 = 0.5;
const OUTPUT: f64 = 8.0;

/// Two Responses deployments on the stand-in: `cached` accepts
/// `prompt_cache_key` (said in the file: it is no OpenAI URL), `uncached`
/// is left at the default for its URL (it does not); and `chat`, a Chat
/// Completions one that accepts it. Profiles `capped` (tools beyond the
/// first 20 only through one `search_tools` call), `gated` (the same, and
/// `bravo_task_001` waits for a person's approval) and `steady` (every
/// tool offered) use `cached`; profile `chat` uses `chat`.
const PROFILES: &str = r#"
[deployments.cached]
api = "responses"
base_url = "{base_url}"
model = "cached-model"
prompt_cache_key = true

[deployments.uncached]
api = "responses"
base_url = "{base_url}"
model = "plain-model"

[deployments.chat]
api = "chat_completions"
base_url = "{base_url}"
model = "chat-model"
prompt_cache_key = true

[profiles.default]
deployment = "cached"

[profiles.plain]
deployment = "uncached"

[profiles.steady]
deployment = "cached"

[profiles.capped]
deployment = "cached"
[profiles.capped.scoping]
max_expansion_rounds = 1
max_tool_count = 22
scoping_threshold = 21

[profiles.gated]
deployment = "cached"
require_approval = ["t:bravo_task_001"]
[profiles.gated.scoping]
max_expansion_rounds = 1
max_tool_count = 22
scoping_threshold = 21

[profiles.chat]
deployment = "chat"

[prices."cached-model"]
input = 2.0
cached_input = 0.5
output = 8.0

[prices."plain-model"]
input = 2.0
output = 8.0

[prices."chat-model"]
input = 2.0
cached_input = 0.5
output = 8.0
"#;

/// A recorded OpenAI Responses stream (see `shared/conformance/SOURCES.md`).
fn recorded_stream() -> PathBuf {
    let path = support::root()
        .join("../shared/conformance/openai-responses-events")
        .join("openai-reasoning-encrypted-content.1.chunks.jsonl");
    assert!(
        path.is_file(),
        "the recorded OpenAI streams are expected at {} (shared/conformance beside the checkout)",
        path.display()
    );
    path
}

/// The `usage` of the last `response.completed` event of the recorded
/// stream, as OpenAI sent it.
fn recorded_usage() -> Value {
    let text = std::fs::read_to_string(recorded_stream()).expect("the recorded stream");
    let usage = text
        .lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|event| event["type"] == "response.completed")
        .map(|event| event["response"]["usage"].clone())
        .expect("a response.completed event with a usage");
    assert!(
        usage["input_tokens_details"]["cached_tokens"].is_u64(),
        "the recording reports cached tokens: {usage}"
    );
    usage
}

/// `name`'s value in `registry`, summed over the series whose labels
/// include `labels`.
fn metric(registry: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            labels.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            })
        })
        .map(|m| m.get_counter().get_value())
        .sum()
}

fn job(text: &str, profile: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.profile = Some(profile.into());
    job
}

fn assert_usd(got: Option<f64>, want: f64, what: &str) {
    let got = got.unwrap_or_else(|| panic!("{what}: no cost"));
    assert!((got - want).abs() < 1e-12, "{what}: {got} USD, not {want}");
}

/// The recorded usage as the model's answer: once as recorded (a cache
/// miss: its cached count is what OpenAI sent), once with the cached
/// count a cache hit on its prompt reports (the recordings are all
/// misses), on a model with a cached price and on one without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_cached_tokens_of_a_recorded_usage_reach_events_metrics_and_cost() {
    let recorded = recorded_usage();
    let (input, output) = (
        recorded["input_tokens"].as_u64().expect("input_tokens"),
        recorded["output_tokens"].as_u64().expect("output_tokens"),
    );
    let hit_tokens = 256.min(input);
    let mut hit = recorded.clone();
    hit["input_tokens_details"]["cached_tokens"] = json!(hit_tokens);
    let env = Env::start_with(
        json!({ "rules": [
            { "whenUserContains": ["recorded"], "steps": [ { "answer": "as recorded", "usage": recorded } ] },
            { "whenUserContains": ["cache hit"], "steps": [ { "answer": "a hit", "usage": hit } ] }
        ] }),
        Options {
            workers: vec![],
            profiles_toml: Some(PROFILES.into()),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let recorded_cached = recorded["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_default();
    let miss = env
        .submit(&job("as recorded", "default"))
        .await
        .expect("completed");
    assert_eq!(miss.usage.prompt_tokens, input);
    assert_eq!(miss.usage.cached_tokens, recorded_cached);
    let uncached = input - recorded_cached;
    assert_usd(
        miss.cost_usd,
        (uncached as f64 * INPUT + recorded_cached as f64 * CACHED_INPUT + output as f64 * OUTPUT)
            / 1e6,
        "the recorded usage",
    );

    let out = env
        .submit(&job("a cache hit", "default"))
        .await
        .expect("completed");
    assert_eq!(
        out.usage.cached_tokens, hit_tokens,
        "the completed event's usage"
    );
    assert_eq!(out.llm_calls.len(), 1);
    assert_eq!(
        out.llm_calls[0].usage.cached_tokens, hit_tokens,
        "its model call"
    );
    let at_cached_price = ((input - hit_tokens) as f64 * INPUT
        + hit_tokens as f64 * CACHED_INPUT
        + output as f64 * OUTPUT)
        / 1e6;
    assert_usd(
        out.cost_usd,
        at_cached_price,
        "cached tokens at the cached price",
    );
    assert_usd(
        out.llm_calls[0].cost_usd,
        at_cached_price,
        "the call's cost",
    );
    // What the client's event said is what the event on the wire said.
    let completed = out
        .events
        .iter()
        .find(|e| e.body.name() == "completed")
        .expect("a completed event");
    let wire = serde_json::to_value(completed).expect("the event as JSON");
    assert_eq!(wire["usage"]["cached_tokens"], json!(hit_tokens), "{wire}");
    assert_eq!(
        wire["llmCalls"][0]["usage"]["cached_tokens"],
        json!(hit_tokens)
    );

    let plain = env
        .submit(&job("a cache hit", "plain"))
        .await
        .expect("completed");
    assert_eq!(plain.usage.cached_tokens, hit_tokens);
    assert_usd(
        plain.cost_usd,
        (input as f64 * INPUT + output as f64 * OUTPUT) / 1e6,
        "without a cached price, cached tokens cost the input price",
    );

    assert_metrics(
        &env,
        (recorded_cached + hit_tokens, 2 * input),
        hit_tokens,
        miss.cost_usd.unwrap_or_default() + at_cached_price,
    );
    cache_keys_as_the_deployments_accept_them(&env);
}

/// The token metric of `cached-model` (cached, prompt), the cached tokens
/// of `plain-model`, and the cost metric of `cached-model`.
fn assert_metrics(env: &Env, cached_model: (u64, u64), plain_cached: u64, cost: f64) {
    let tokens = |model: &str, kind: &str| {
        metric(
            &env.metrics,
            "toolfleet_llm_tokens_total",
            &[
                ("model", model),
                ("kind", kind),
                ("purpose", "conversation"),
            ],
        )
    };
    assert_eq!(tokens("cached-model", "cached"), cached_model.0 as f64);
    assert_eq!(tokens("cached-model", "prompt"), cached_model.1 as f64);
    assert_eq!(tokens("plain-model", "cached"), plain_cached as f64);
    let spent = metric(
        &env.metrics,
        "toolfleet_llm_cost_usd_total",
        &[("model", "cached-model")],
    );
    assert_usd(Some(spent), cost, "the cost metric");
}

/// Every request of the default tenant on `cached` carried its
/// `prompt_cache_key` for the profile; none on `uncached`.
fn cache_keys_as_the_deployments_accept_them(env: &Env) {
    let requests = env.model.requests();
    assert_eq!(requests.len(), 3);
    let default_key = prompt_cache_key("toolfleet", "default", "default");
    for body in &requests {
        match body["model"].as_str() {
            Some("cached-model") => assert_eq!(body["prompt_cache_key"], json!(default_key)),
            Some("plain-model") => {
                assert!(body.get("prompt_cache_key").is_none(), "{body}");
            }
            other => panic!("a request for {other:?}"),
        }
    }
}

/// Answers `"<name> ran"`.
struct Echo(String);

impl Tool for Echo {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(format!("{} ran", self.0)))
    }
}

/// `<namespace>:<name>@1.0.0`, described by `description`.
fn def(namespace: &str, name: &str, description: &str) -> ToolDefinition {
    let v = json!({
        "schemaVersion": 1,
        "id": format!("{namespace}:{name}@1.0.0"),
        "implementationKey": format!("t.{name}"),
        "title": name,
        "description": description,
        "category": "testing",
        "function": {
            "name": name,
            "description": description,
            "parameters": { "type": "object", "properties": { "q": { "type": "string" } } }
        }
    });
    ToolDefinition::from_value(v, Origin::Named(name.into())).expect("test definition")
}

/// 25 record tools, `convert_currency`, and `a:zebra_count` (first by id,
/// last by name), served by one worker.
fn worker() -> Worker {
    const WORDS: [&str; 5] = ["alpha", "bravo", "charlie", "delta", "echo"];
    let mut defs: Vec<ToolDefinition> = (0..25)
        .map(|i| {
            let w = WORDS[i % WORDS.len()];
            def(
                "t",
                &format!("{w}_task_{i:03}"),
                &format!("Manages {w} records number {i}."),
            )
        })
        .collect();
    defs.push(def(
        "t",
        "convert_currency",
        "Converts an amount between currencies.",
    ));
    defs.push(def("a", "zebra_count", "Counts zebras."));
    let mut b = Worker::builder("many");
    for d in defs {
        let key = d.implementation_key.clone();
        let name = d.function.name.clone();
        b = b.definition(d).tool(key, Echo(name));
    }
    b.build().expect("test worker")
}

/// Waits until the orchestrator offers `function` (its catalog refreshes
/// every 2 s).
async fn until_offered(env: &Env, function: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let catalog = toolfleet_protocol::catalog::discover(
            &env.client,
            &env.subjects,
            std::time::Duration::from_millis(250),
            &Default::default(),
        )
        .await
        .expect("the catalog");
        if catalog.by_function_name(function).is_some() {
            tokio::time::sleep(std::time::Duration::from_millis(2_300)).await;
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{function} never advertised"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The tool names of each request the stand-in received, in order.
fn tools_per_request(env: &Env) -> Vec<Vec<String>> {
    env.model
        .requests()
        .iter()
        .map(|body| {
            body["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["name"].as_str().map(str::to_owned))
                .collect()
        })
        .collect()
}

/// A `search_tools` expansion changes the tools between two turns of one
/// invocation: counted once, for its profile. An invocation whose tools
/// stay put over two turns counts nothing. A first request sends its
/// tools sorted by name, after the system prompt (`instructions`); the
/// tools an expansion adds go after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_prefix_changes_count_a_changed_tool_set_and_nothing_else() {
    let env = Env::start_with(
        json!({ "rules": [
            { "whenUserContains": ["alpha"], "steps": [
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "currency" } } ] },
                { "answer": "{{tool:search_tools}}" }
            ] },
            { "whenUserContains": ["bravo"], "steps": [
                { "toolCalls": [ { "name": "bravo_task_001", "arguments": {} } ] },
                { "answer": "{{tool:bravo_task_001}}" }
            ] },
            { "whenUserContains": ["delta"], "steps": [
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "unicorn stables" } } ] },
                { "answer": "{{tool:search_tools}}" }
            ] }
        ] }),
        Options {
            workers: vec![],
            profiles_toml: Some(PROFILES.into()),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let _worker = env.start_worker(worker()).await;
    until_offered(&env, "convert_currency").await;
    let changes = |profile: &str| {
        metric(
            &env.metrics,
            "toolfleet_prompt_prefix_changes_total",
            &[("profile", profile)],
        )
    };
    assert_eq!(changes("capped"), 0.0, "zeroed at start for every profile");

    let steady = env
        .submit(&job("bravo records please", "steady"))
        .await
        .expect("completed");
    assert_eq!(steady.rounds, 2);
    assert_eq!(changes("steady"), 0.0, "the same tools in both turns");

    let expanded = env
        .submit(&job("alpha records please", "capped"))
        .await
        .expect("completed");
    assert_eq!(expanded.rounds, 2);
    assert_eq!(
        changes("capped"),
        1.0,
        "the expansion changed the tools once"
    );
    assert_eq!(changes("steady"), 0.0);

    let offered = tools_per_request(&env);
    assert_eq!(offered.len(), 4);
    assert_eq!(offered[0], offered[1], "steady: one prefix");
    // A first request's tools go out sorted by name, `search_tools` among
    // them; not by id: `a:zebra_count` goes last.
    for first in [&offered[0], &offered[2]] {
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(*first, sorted, "sent sorted by name");
    }
    assert_eq!(offered[0].last().map(String::as_str), Some("zebra_count"));
    assert!(offered[2].contains(&"search_tools".to_owned()));
    assert!(!offered[2].contains(&"convert_currency".to_owned()));
    // The expansion's tool goes after them, every tool before it in
    // place, and `search_tools` stays though its one round is used up.
    assert_eq!(
        offered[3],
        [offered[2].clone(), vec!["convert_currency".to_owned()]].concat(),
        "the new tool appended"
    );
    for body in env.model.requests() {
        assert!(
            body["instructions"].is_string(),
            "the system prompt first: {body}"
        );
        assert_eq!(body["input"][0]["role"], "user");
    }

    // A search that finds nothing changes no request.
    let unfound = env
        .submit(&job("delta records please", "capped"))
        .await
        .expect("completed");
    assert_eq!(unfound.rounds, 2);
    let offered = tools_per_request(&env);
    assert_eq!(offered[4], offered[5], "nothing was added");
    assert_eq!(changes("capped"), 1.0, "nothing more counted");
}

/// Reads `sub` until `pick` returns something (every event on the way is
/// kept in `seen`).
async fn until<T>(
    sub: &mut async_nats::Subscriber,
    seen: &mut Vec<ChatEvent>,
    mut pick: impl FnMut(&ChatEvent) -> Option<T>,
) -> T {
    loop {
        let msg = tokio::time::timeout(WAIT, sub.next())
            .await
            .expect("an event in time")
            .expect("the subscription is open");
        let event: ChatEvent = serde_json::from_slice(&msg.payload).expect("an event");
        let found = pick(&event);
        seen.push(event);
        if let Some(found) = found {
            return found;
        }
    }
}

/// Approves `call` of `job` as a person would, and checks it was taken.
async fn approve(env: &Env, job: &ChatJob, call: &str) {
    let subject = env.subjects.chat_approve("default", &job.invocation_id);
    let body = json!({ "callId": call, "decision": "approve" }).to_string();
    let reply = tokio::time::timeout(WAIT, env.client.request(subject, body.into()))
        .await
        .expect("an answer in time")
        .expect("an orchestrator answers");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(reply, json!({ "ok": true }));
}

/// A run resumed after a park for approval goes on where the run before
/// it stood: its one `search_tools` round is spent, so a second search
/// is answered `expansion_capped` and adds nothing (before, the resumed
/// run counted from 0 and expanded past the cap); and its requests offer
/// the same tools in the same order as the last one before the park
/// (the expansion's tool after the first offer, `search_tools` still
/// among them), so the prefix changed once, at the expansion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_a_resumed_run_keeps_its_offer_and_its_spent_expansions() {
    let env = Env::start_with(
        json!({ "rules": [
            { "whenUserContains": ["charlie"], "steps": [
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "currency" } } ] },
                { "toolCalls": [ { "name": "bravo_task_001", "arguments": {} } ] },
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "zebras" } } ] },
                { "answer": "{{tool:search_tools}}" }
            ] }
        ] }),
        Options {
            workers: vec![],
            profiles_toml: Some(PROFILES.into()),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let _worker = env.start_worker(worker()).await;
    until_offered(&env, "convert_currency").await;
    let job = job("charlie records please", "gated");
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let call = until(&mut sub, &mut seen, |e| match &e.body {
        ChatEventBody::ApprovalRequested { call_id, .. } => Some(call_id.clone()),
        _ => None,
    })
    .await;
    assert_eq!(env.model.requests().len(), 2, "parked after two turns");
    approve(&env, &job, &call).await;
    let end = until(&mut sub, &mut seen, |e| {
        e.body.is_terminal().then(|| e.body.clone())
    })
    .await;
    let ChatEventBody::Completed { text, .. } = &end else {
        panic!("{end:?}");
    };
    assert!(text.contains("no more tools can be added"), "{text}");
    let searches: Vec<(ToolStatus, Option<String>)> = seen
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult {
                tool,
                status,
                error_code,
                ..
            } if tool == "search_tools" => Some((*status, error_code.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        searches,
        [
            (ToolStatus::Ok, None),
            (ToolStatus::Error, Some("expansion_capped".to_owned()))
        ],
        "the resumed run's search is past the cap"
    );
    let expansions = seen
        .iter()
        .filter(|e| matches!(&e.body, ChatEventBody::Scoping { decision, .. } if decision == "expansion"))
        .count();
    assert_eq!(expansions, 1, "{seen:?}");

    let offered = tools_per_request(&env);
    assert_eq!(offered.len(), 4);
    assert!(offered[0].contains(&"search_tools".to_owned()));
    assert_eq!(
        offered[1],
        [offered[0].clone(), vec!["convert_currency".to_owned()]].concat()
    );
    assert_eq!(offered[2], offered[1], "the resumed run's offer");
    assert_eq!(offered[3], offered[1]);
    let changes = metric(
        &env.metrics,
        "toolfleet_prompt_prefix_changes_total",
        &[("profile", "gated")],
    );
    assert_eq!(changes, 1.0, "the expansion's turn only");
}

/// The cached tokens of a Chat Completions usage (OpenAI's documented
/// shape, `usage.prompt_tokens_details.cached_tokens`: the recorded Chat
/// streams predate it) reach the `completed` event, its model call, the
/// token metric and the cost at the cached price; the request carried
/// the profile's `prompt_cache_key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_cached_tokens_through_chat_completions_reach_events_metrics_and_cost() {
    let usage = json!({
        "prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
        "prompt_tokens_details": { "cached_tokens": 1920, "audio_tokens": 0 },
        "completion_tokens_details": { "reasoning_tokens": 0 }
    });
    let env = Env::start_with(
        json!({ "default": { "steps": [ { "answer": "a hit", "usage": usage } ] } }),
        Options {
            workers: vec![],
            profiles_toml: Some(PROFILES.into()),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let out = env
        .submit(&job("a cache hit", "chat"))
        .await
        .expect("completed");
    assert_eq!(out.usage.prompt_tokens, 2006);
    assert_eq!(out.usage.cached_tokens, 1920, "the completed event's usage");
    assert_eq!(out.llm_calls.len(), 1);
    assert_eq!(out.llm_calls[0].usage.cached_tokens, 1920, "its model call");
    let cost = (86.0 * INPUT + 1920.0 * CACHED_INPUT + 300.0 * OUTPUT) / 1e6;
    assert_usd(out.cost_usd, cost, "cached tokens at the cached price");
    let tokens = |kind: &str| {
        metric(
            &env.metrics,
            "toolfleet_llm_tokens_total",
            &[("model", "chat-model"), ("kind", kind)],
        )
    };
    assert_eq!(tokens("cached"), 1920.0);
    assert_eq!(tokens("prompt"), 2006.0);
    let requests = env.model.requests();
    assert_eq!(requests.len(), 1);
    assert!(
        requests[0]["messages"].is_array(),
        "a Chat Completions request"
    );
    assert_eq!(
        requests[0]["prompt_cache_key"],
        json!(prompt_cache_key("toolfleet", "default", "chat"))
    );
}

/// A job's own system message goes after the tools, as a `system` input
/// message: `instructions` hold the profile's system prompt alone, the
/// beginning every job of the profile shares (before, the job's text was
/// joined into it, and each such job began differently). The model reads
/// the same text, with the same role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_a_jobs_own_system_message_comes_after_the_profiles_prompt() {
    let env = Env::start_with(
        json!({ "default": { "steps": [ { "answer": "ok" } ] } }),
        Options {
            workers: vec![],
            profiles_toml: Some(PROFILES.into()),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    for own in ["Answer in French.", "Answer in German."] {
        let mut job = job("hello", "default");
        job.messages.insert(
            0,
            toolfleet_protocol::ChatMessage {
                role: toolfleet_protocol::ChatRole::System,
                content: own.into(),
            },
        );
        env.submit(&job).await.expect("completed");
    }
    let requests = env.model.requests();
    assert_eq!(requests.len(), 2);
    for (body, own) in requests
        .iter()
        .zip(["Answer in French.", "Answer in German."])
    {
        assert_eq!(
            body["instructions"],
            json!(toolfleet_orchestrator::DEFAULT_SYSTEM_PROMPT),
            "the profile's prompt alone: {body}"
        );
        assert_eq!(
            body["input"][0],
            json!({ "type": "message", "role": "system", "content": own })
        );
        assert_eq!(body["input"][1]["role"], "user");
    }
}

use support::identities::{connect_as as connect, secure_nats as secured_nats};

/// The orchestrator under its own identity, on `profiles`.
async fn start_orchestrator(
    nats: &NatsServer,
    redis: &RedisServer,
    base_url: &str,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let subjects = Subjects::new("toolfleet").unwrap();
    let profiles = toolfleet_config::FleetConfig::from_toml(
        &PROFILES.replace("{base_url}", base_url),
        "prompt cache profiles",
    )
    .expect("test profiles");
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let store = toolfleet_store::CitationStore::connect(
        &redis.url(),
        subjects.prefix(),
        std::time::Duration::from_secs(60),
    )
    .await
    .unwrap();
    let orchestrator = tokio::time::timeout(
        WAIT,
        toolfleet_orchestrator::Ready::open(
            connect(nats, "orchestrator").await,
            store,
            toolfleet_orchestrator::OrchestratorConfig::new(subjects, profiles),
            metrics,
            shutdown,
        ),
    )
    .await
    .expect("the orchestrator starts in time")
    .expect("the orchestrator starts");
    tokio::spawn(async move {
        if let Err(e) = orchestrator.run().await {
            panic!("the orchestrator stopped: {e}");
        }
    });
}

/// Publishes `body` as a chat job on `tenant`'s submit subject with
/// `client`, and returns its terminal event.
async fn raw_chat(client: &async_nats::Client, tenant: &str, body: &Value) -> Value {
    let subjects = Subjects::new("toolfleet").unwrap();
    let id = body["invocationId"].as_str().expect("an invocation id");
    let mut events = client
        .subscribe(subjects.chat_events(tenant, id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let ack = async_nats::jetstream::new(client.clone())
        .publish(
            subjects.chat_submit(tenant),
            serde_json::to_vec(body).unwrap().into(),
        )
        .await
        .expect("published");
    tokio::time::timeout(WAIT, ack)
        .await
        .expect("acked in time")
        .expect("acked");
    loop {
        let msg = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("a terminal event in time")
            .expect("events");
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        if matches!(event["type"].as_str(), Some("completed" | "error")) {
            return event;
        }
    }
}

/// Tenant globex, under its own identity, submits a job that claims to be
/// acme's: it is refused before any model call. Its own job reaches the
/// provider with globex's cache key, never acme's — so globex cannot
/// steer its requests to where acme's are routed (the key routes; it
/// does not isolate: the provider's cache is per organization and found
/// by prefix, see docs/prompt-caching.md) — and neither key holds a
/// tenant's name as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_cache_a_tenant_gets_its_own_key_whatever_its_job_claims() {
    let nats = secured_nats();
    let redis = RedisServer::start().expect("redis-server");
    let script = toolfleet_scripted::Script::from_json(
        &json!({ "default": { "steps": [ { "answer": "ok" } ] } }).to_string(),
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    start_orchestrator(&nats, &redis, model.base_url().as_str(), shutdown).await;

    let acme = connect(&nats, "client-acme").await;
    let globex = connect(&nats, "client-globex").await;
    let mut own = toolfleet_protocol::client::question("hello");
    own.tenant = Some("acme".into());
    let own = serde_json::to_value(own).unwrap();
    assert_eq!(raw_chat(&acme, "acme", &own).await["type"], "completed");
    // globex's job names acme as its tenant: a claim, on globex's
    // subject. It is refused before any model call.
    let mut claim = toolfleet_protocol::client::question("hello");
    claim.tenant = Some("acme".into());
    let claim = serde_json::to_value(claim).unwrap();
    let end = raw_chat(&globex, "globex", &claim).await;
    assert_eq!(end["code"], "tenant_mismatch", "{end}");
    assert_eq!(model.requests().len(), 1, "no model call for the claim");
    let mut globex_own = toolfleet_protocol::client::question("hello");
    globex_own.tenant = Some("globex".into());
    let globex_own = serde_json::to_value(globex_own).unwrap();
    assert_eq!(
        raw_chat(&globex, "globex", &globex_own).await["type"],
        "completed"
    );

    let keys: Vec<String> = model
        .requests()
        .iter()
        .map(|body| body["prompt_cache_key"].as_str().expect("a key").to_owned())
        .collect();
    let (acme_key, globex_key) = (
        prompt_cache_key("toolfleet", "acme", "default"),
        prompt_cache_key("toolfleet", "globex", "default"),
    );
    assert_ne!(acme_key, globex_key);
    assert_eq!(
        keys,
        [acme_key, globex_key],
        "each tenant's own key, in order"
    );
    for key in &keys {
        assert!(!key.contains("acme") && !key.contains("globex"), "{key}");
    }
}
