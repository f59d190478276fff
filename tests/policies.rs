//! Issue 3 behaviour end to end: profiles and deployments, both API shapes,
//! loop policies, resilience, usage and cost — against the real fleet and
//! the scripted model server's real HTTP streams.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::{ChatEventBody, ToolStatus};

use crate::support::{self, Env, Options, WAIT, lighthouse_script, next_json};

fn kinds(events: &[toolfleet_protocol::ChatEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolCall { tool, .. } => Some(format!("call {tool}")),
            ChatEventBody::ToolResult { tool, .. } => Some(format!("result {tool}")),
            _ => None,
        })
        .collect()
}

fn started_profile(events: &[toolfleet_protocol::ChatEvent]) -> Option<String> {
    events.iter().find_map(|e| match &e.body {
        ChatEventBody::Started { profile, .. } => profile.clone(),
        _ => None,
    })
}

const TWO_PROFILES: &str = r#"
default_profile = "default"

[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[deployments.keyed]
base_url = "{base_url}"
model = "toolfleet-scripted"
api_key_env = "TOOLFLEET_TEST_MISSING_KEY"

[profiles.default]
deployment = "scripted"

[profiles.locked]
deployments = ["keyed"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_resolvable_deployment_ends_the_job_at_once_naming_the_profile() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(TWO_PROFILES.into()),
            ..Default::default()
        },
    )
    .await;
    let mut job = toolfleet_protocol::client::question("how do lighthouses work?");
    job.profile = Some("locked".into());
    let err = env.submit(&job).await.expect_err("no deployment");
    assert_eq!(err.code(), "no_deployment");
    let msg = err.to_string();
    assert!(
        msg.contains("locked") && msg.contains("TOOLFLEET_TEST_MISSING_KEY"),
        "{msg}"
    );
    assert!(
        env.model.requests().is_empty(),
        "the model was never called"
    );

    // An unknown profile is refused, never run on the default one.
    let mut job = toolfleet_protocol::client::question("how do lighthouses work?");
    job.profile = Some("no-such-profile".into());
    let err = env.submit(&job).await.expect_err("an unknown profile");
    assert_eq!(err.code(), "unknown_profile");
    assert!(err.to_string().contains("no-such-profile"), "{err}");
    assert!(
        env.model.requests().is_empty(),
        "the model was never called"
    );
    // No name: the default one.
    let job = toolfleet_protocol::client::question("how do lighthouses work?");
    let outcome = env.submit(&job).await.expect("the default profile");
    assert_eq!(started_profile(&outcome.events).as_deref(), Some("default"));
}

const RESPONSES: &str = r#"
default_profile = "default"
[deployments.responses]
api = "responses"
base_url = "{base_url}"
model = "toolfleet-scripted"
api_key_env = "TEST_KEY"
[profiles.default]
deployment = "responses"
[prices."toolfleet-scripted"]
input = 2.5
cached_input = 1.25
output = 10.0
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responses_api_runs_the_same_loop_with_citations_usage_and_cost() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(RESPONSES.into()),
            env: vec![("TEST_KEY", "sk-responses-secret")],
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("completed");
    assert!(!outcome.references.is_empty());
    let known: HashSet<u64> = outcome.references.iter().map(|r| r.index).collect();
    let cited = toolfleet_protocol::references::cited_indices(&outcome.text);
    assert!(
        !cited.is_empty() && cited.iter().all(|n| known.contains(n)),
        "{}",
        outcome.text
    );

    // The second request carried the results as function_call_output items
    // correlated by call_id with the function_call items.
    let received = env.model.received();
    assert!(received.iter().all(|r| r.path.ends_with("/responses")));
    assert_eq!(
        received[0].header("authorization"),
        Some("Bearer sk-responses-secret")
    );
    let input = received[1].body["input"].as_array().unwrap();
    let calls: HashSet<&str> = input
        .iter()
        .filter(|i| i["type"] == "function_call")
        .map(|i| i["call_id"].as_str().unwrap())
        .collect();
    let outputs: HashSet<&str> = input
        .iter()
        .filter(|i| i["type"] == "function_call_output")
        .map(|i| i["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls, outputs);

    // Usage per call and per invocation, and cost from the price table.
    assert_eq!(outcome.llm_calls.len(), 2);
    assert!(
        outcome
            .llm_calls
            .iter()
            .all(|c| c.purpose == "conversation" && c.model == "toolfleet-scripted")
    );
    let total: u64 = outcome
        .llm_calls
        .iter()
        .map(|c| c.usage.prompt_tokens)
        .sum();
    assert_eq!(outcome.usage.prompt_tokens, total);
    let cost = outcome.cost_usd.expect("priced");
    let expected: f64 = outcome.llm_calls.iter().map(|c| c.cost_usd.unwrap()).sum();
    assert!(
        cost > 0.0 && (cost - expected).abs() < 1e-12,
        "{cost} vs {expected}"
    );
    let text = env.metrics_text().await;
    assert!(
        text.contains(
            "toolfleet_llm_cost_usd_total{model=\"toolfleet-scripted\",purpose=\"conversation\"}"
        ),
        "{text}"
    );
    assert!(text.contains("toolfleet_llm_tokens_total{kind=\"prompt\",model=\"toolfleet-scripted\",purpose=\"conversation\"}"), "{text}");
    // The key never reaches events or metrics.
    assert!(!format!("{:?}", outcome.events).contains("sk-responses-secret"));
    assert!(!text.contains("sk-responses-secret"));
}

fn policy_profile(policy: &str) -> String {
    format!(
        r#"
default_profile = "default"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
[profiles.default.policy]
{policy}
"#
    )
}

/// The last request the model got, and whether it forbade tools.
fn last_request(env: &Env) -> Value {
    env.model.requests().last().cloned().expect("a request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_over_the_per_turn_cap_are_not_run_and_the_model_is_told_to_answer() {
    let toml = policy_profile("max_calls_per_turn = 1");
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("completed");
    let results = crate::support::result_codes(&outcome.events);
    assert_eq!(results.len(), 2);
    assert!(
        results.contains(&(ToolStatus::Error, Some("calls_per_turn".into()))),
        "{results:?}"
    );
    assert!(results.iter().any(|r| r.0 == ToolStatus::Ok));
    let last = last_request(&env);
    assert_eq!(last["tool_choice"], "none");
    let note = last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "system")
        .unwrap();
    assert!(
        note["content"]
            .as_str()
            .unwrap()
            .contains("answer now with what you have"),
        "{note}"
    );
    assert!(
        env.metrics_text()
            .await
            .contains("toolfleet_loop_limits_total{limit=\"calls_per_turn\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_tool_errors_stop_the_tools() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["bees"],
            "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "bees", "topK": 99 } } ] },
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "bees", "topK": 98 } } ] },
                { "answer": "I could not search: {{tool:search_data_sources}}" }
            ]
        }]
    });
    let toml = policy_profile("max_consecutive_tool_errors = 1");
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How do bees navigate?").await;
    let outcome = outcome.expect("answers with what it has");
    assert_eq!(kinds(&outcome.events).len(), 2, "only one tool round ran");
    assert_eq!(outcome.rounds, 2);
    assert_eq!(last_request(&env)["tool_choice"], "none");
    assert!(
        env.metrics_text()
            .await
            .contains("toolfleet_loop_limits_total{limit=\"consecutive_tool_errors\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_round_forbids_tools_so_the_model_answers() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["tides"],
            "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "tides" } } ] },
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "moon" } } ] },
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "sun" } } ] },
                { "answer": "Tides: {{tool:search_data_sources}}" }
            ]
        }]
    });
    let toml = policy_profile("max_rounds = 2");
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("What causes tides?").await;
    let outcome = outcome.expect("answers on the last round");
    assert_eq!(outcome.rounds, 2);
    assert_eq!(env.model.requests().len(), 2);
    assert_eq!(last_request(&env)["tool_choice"], "none");
    assert!(
        env.metrics_text()
            .await
            .contains("toolfleet_loop_limits_total{limit=\"rounds\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_off_runs_calls_one_at_a_time_and_says_so_to_the_model() {
    let toml = policy_profile("parallel_tool_calls = false");
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("completed");
    assert_eq!(
        kinds(&outcome.events),
        vec![
            "call system:current_datetime@1.0.0",
            "result system:current_datetime@1.0.0",
            "call retrieval:search_data_sources@1.0.0",
            "result retrieval:search_data_sources@1.0.0",
        ]
    );
    assert_eq!(env.model.requests()[0]["parallel_tool_calls"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_is_not_parallel_safe_runs_alone_after_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let root = crate::support::root().join("tool_definitions");
    let mut datetime: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("system.current_datetime.json")).unwrap(),
    )
    .unwrap();
    datetime["parallelSafe"] = json!(false);
    std::fs::write(
        dir.path().join("system.current_datetime.json"),
        datetime.to_string(),
    )
    .unwrap();
    crate::support::copy_definitions(&root, dir.path(), "retrieval.");
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            defs_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("completed");
    // The model listed current_datetime first; it still runs after the safe batch.
    assert_eq!(
        kinds(&outcome.events),
        vec![
            "call retrieval:search_data_sources@1.0.0",
            "result retrieval:search_data_sources@1.0.0",
            "call system:current_datetime@1.0.0",
            "result system:current_datetime@1.0.0",
        ]
    );
    // The model still gets the results in its own call order.
    let tools: Vec<String> = env.model.requests()[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap().to_string())
        .collect();
    assert!(
        tools[0].contains('(') && tools[1].contains("[doc:"),
        "{tools:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_tool_results_are_cut_to_the_token_cap_with_a_notice() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["bread"],
            "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "sourdough bread yeast bacteria starter flour water lighthouse bees tides rust", "topK": 10 } } ] },
                { "answer": "Done." }
            ]
        }]
    });
    let toml = policy_profile("max_tool_result_tokens = 80");
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("Tell me about bread").await;
    outcome.expect("completed");
    let tool = env.model.requests()[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(tool.contains("tokens cut"), "{tool}");
    let budget = toolfleet_llm::budget::TokenBudget::for_model("toolfleet-scripted");
    assert!(budget.count(&tool) <= 80, "{} tokens", budget.count(&tool));
    assert!(
        env.metrics_text()
            .await
            .contains("toolfleet_tool_results_truncated_total{function=\"search_data_sources\"} 1")
    );
}

fn truncating_script() -> Value {
    json!({
        "rules": [{
            "whenUserContains": ["sourdough"],
            "steps": [
                { "fault": { "kind": "length", "times": 1 }, "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "sourdough starter", "topK": 3 } } ] },
                { "answer": "Sourdough: {{tool:search_data_sources}}" }
            ]
        }]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_tool_call_is_never_run_and_ends_or_is_asked_again_by_policy() {
    let env = Env::start(truncating_script()).await;
    let (job, outcome) = env.ask("How does sourdough rise?").await;
    let err = outcome.expect_err("error policy");
    assert_eq!(err.code(), "truncated_tool_call");
    assert!(
        env.tool_keys(&job.invocation_id).await.is_empty(),
        "the cut call never ran"
    );

    let toml = policy_profile(r#"on_truncated_tool_call = "ask_again""#);
    let env = Env::start_with(
        truncating_script(),
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How does sourdough rise?").await;
    let outcome = outcome.expect("asked again, then answered");
    assert_eq!(kinds(&outcome.events).len(), 2, "one full tool call ran");
    let second = &env.model.requests()[1];
    assert!(
        second["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["role"] == "system" && m["content"].as_str().unwrap().contains("cut off"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_errors_reach_the_client_with_the_providers_code_and_retries_are_counted() {
    let script = json!({
        "rules": [
            { "whenUserContains": ["quota"], "steps": [ { "fault": { "kind": "status", "status": 429, "code": "insufficient_quota" }, "answer": "never" } ] },
            { "whenUserContains": ["flaky"], "steps": [ { "fault": { "kind": "status", "status": 500, "times": 1 }, "answer": "Second time lucky." } ] }
        ]
    });
    let env = Env::start(script).await;
    let (_, outcome) = env.ask("Am I over quota?").await;
    let err = outcome.expect_err("provider error");
    assert_eq!(err.code(), "llm_insufficient_quota");
    assert!(!err.to_string().contains("sk-test-secret"));

    let (_, outcome) = env.ask("A flaky provider").await;
    let outcome = outcome.expect("retried");
    assert_eq!(outcome.text, "Second time lucky.");
    assert_eq!(outcome.llm_calls[0].attempts, 2);
    let text = env.metrics_text().await;
    assert!(
        text.contains("toolfleet_llm_retries_total{model=\"toolfleet-scripted\"} 1"),
        "{text}"
    );
    assert!(text.contains("toolfleet_llm_requests_total{model=\"toolfleet-scripted\",outcome=\"insufficient_quota\"} 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_an_invocation_stops_the_model_stream_at_once() {
    let script = json!({
        "rules": [{ "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 20000 }, "answer": "too late" } ] }]
    });
    let env = Env::start(script).await;
    let job = toolfleet_protocol::client::question("a slow question");
    let mut events = env.follow_and_submit(&job).await;
    let started = next_json(&mut events).await;
    assert_eq!(started["type"], "started");
    // The model has the request before we cancel.
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.started >= 1))
        .await
        .expect("stream began");
    env.client
        .publish(
            env.subjects.chat_cancel(job.tenant(), &job.invocation_id),
            "".into(),
        )
        .await
        .unwrap();
    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error");
    assert_eq!(ev["code"], "cancelled");
    let stats = tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.dropped >= 1))
        .await
        .expect("the HTTP stream was dropped");
    assert_eq!(stats.completed, 0);
    support::assert_silent(
        &mut events,
        Duration::from_millis(300),
        "more arrived for this invocation",
    )
    .await;
}

/// A cancel this orchestrator did not hear — it was cut off from NATS when
/// the cancel was published, and another orchestrator remembered it in the
/// store — still stops the run, at its next lease renewal (every 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_the_orchestrator_missed_stops_the_run_at_its_next_lease_renewal() {
    let script = json!({
        "rules": [{ "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 20000 }, "answer": "too late" } ] }]
    });
    let env = Env::start(script).await;
    let job = toolfleet_protocol::client::question("a slow question");
    let mut events = env.follow_and_submit(&job).await;
    assert_eq!(next_json(&mut events).await["type"], "started");
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.started >= 1))
        .await
        .expect("stream began");
    // The tombstone as an orchestrator that heard the cancel writes it;
    // no cancel message reaches this one.
    toolfleet_store::CitationStore::connect(
        &env.redis.url(),
        env.subjects.prefix(),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .mark_cancelled(toolfleet_store::InvocationKey::new(
        job.tenant(),
        &job.invocation_id,
    ))
    .await
    .unwrap();
    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "cancelled", "{ev}");
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.dropped >= 1))
        .await
        .expect("the HTTP stream was dropped");
}

/// A cancel is a tenant's: one published under another tenant than the
/// invocation's — before the job starts or while it runs — stops nothing,
/// and a job that names another tenant than its submit subject's is
/// refused with an `error` event on the subject's tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_under_another_tenant_stops_nothing() {
    let script = json!({
        "rules": [{ "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 1000 }, "answer": "on time" } ] }]
    });
    let env = Env::start(script).await;
    let mut job = toolfleet_protocol::client::question("a slow question");
    job.tenant = Some("acme".into());
    let cancel_as_globex = env.subjects.chat_cancel("globex", &job.invocation_id);
    // Queued: globex's tombstone is kept apart from acme's job.
    env.client
        .publish(cancel_as_globex.clone(), "".into())
        .await
        .unwrap();
    env.wait_for_cancel_written("globex", &job.invocation_id)
        .await;
    let mut events = env.follow_and_submit(&job).await;
    assert_eq!(next_json(&mut events).await["type"], "started");
    // Running: globex's cancel does not reach it either.
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.started >= 1))
        .await
        .expect("stream began");
    env.client
        .publish(cancel_as_globex, "".into())
        .await
        .unwrap();
    let terminal = loop {
        let ev = next_json(&mut events).await;
        if ev["type"] == "completed" || ev["type"] == "error" {
            break ev;
        }
    };
    assert_eq!(terminal["type"], "completed", "{terminal}");
    assert_eq!(terminal["text"], "on time");

    // A job naming globex, submitted as acme: refused on acme's subject.
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let mut forged = toolfleet_protocol::client::question("a slow question");
    forged.tenant = Some("globex".into());
    let mut events = env
        .subscribe(env.subjects.chat_events("acme", &forged.invocation_id))
        .await;
    let js = async_nats::jetstream::new(env.client.clone());
    js.publish(
        env.subjects.chat_submit("acme"),
        serde_json::to_vec(&forged).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "tenant_mismatch", "{ev}");
    let letter = next_json(&mut dead).await;
    assert_eq!(letter["code"], "tenant_mismatch", "{letter}");
    assert_eq!(letter["invocationId"], forged.invocation_id.as_str());
    assert_eq!(
        env.model.stream_stats().started,
        1,
        "the refused job reached the model"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_non_streaming_deployments_complete() {
    let script = json!({
        "rules": [
            { "whenUserContains": ["weapon"], "steps": [ { "refusal": "I can't help with that." } ] },
            { "whenUserContains": ["lighthouse"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "lighthouse" } } ] },
                { "answer": "Lighthouses: {{tool:search_data_sources}}" }
            ] }
        ]
    });
    const NO_STREAM: &str = r#"
default_profile = "default"
[deployments.plain]
base_url = "{base_url}"
model = "toolfleet-scripted"
stream = false
[profiles.default]
deployment = "plain"
"#;
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(NO_STREAM.into()),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How do I build a weapon?").await;
    assert_eq!(
        outcome.expect("a refusal is an answer").text,
        "I can't help with that."
    );
    let (_, outcome) = env.ask("How do lighthouses work?").await;
    let outcome = outcome.expect("completed without streaming");
    assert!(outcome.text.contains("[doc:1]"), "{}", outcome.text);
    let deltas = outcome
        .events
        .iter()
        .filter(|e| matches!(e.body, ChatEventBody::Delta { .. }))
        .count();
    assert_eq!(deltas, 1, "the whole text arrives once");
    assert!(env.model.requests().iter().all(|r| r["stream"] != true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_deadline_ends_with_an_error_event() {
    let script = json!({
        "rules": [{ "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 20000 }, "answer": "too late" } ] }]
    });
    let env = Env::start(script).await;
    let mut job = toolfleet_protocol::client::question("a slow question");
    job.timeout_ms = Some(1000);
    let err = env.submit(&job).await.expect_err("deadline");
    assert_eq!(err.code(), "deadline_exceeded");
    // The outcome is counted once the job is acked, just after its
    // terminal event reached the client.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = env.metrics_text().await;
        if text.contains("toolfleet_chat_jobs_total{outcome=\"error\"} 1") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_round_the_model_answers_without_tools() {
    let toml = policy_profile("max_rounds = 1");
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(toml),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("answers in its one round");
    assert_eq!(outcome.rounds, 1);
    assert!(kinds(&outcome.events).is_empty(), "no tool ran");
    assert_eq!(last_request(&env)["tool_choice"], "none");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_field_that_cannot_travel_in_a_header_is_refused_clearly() {
    let env = Env::start(lighthouse_script()).await;
    let mut job =
        toolfleet_protocol::client::question("how do lighthouses warn ships? what time is it");
    job.user = Some("u-1\ninjected: header".into());
    let err = env.submit(&job).await.expect_err("refused");
    assert_eq!(err.code(), "malformed_job");
    assert!(err.to_string().contains("user"), "{err}");
    // A tenant is part of the subjects: the client refuses one that is not
    // a single token before sending anything.
    job.user = None;
    job.tenant = Some("acme\ninjected: header".into());
    let err = env.submit(&job).await.expect_err("refused");
    assert_eq!(err.code(), "rejected");
    assert!(err.to_string().contains("tenant"), "{err}");
    // And the fleet goes on.
    let (_, outcome) = env
        .ask("how do lighthouses warn ships? what time is it")
        .await;
    outcome.expect("completed");
}

/// A tool marked `delivery: direct` goes by core request-reply to its pool's
/// services endpoint, never through the tool stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_delivery_uses_request_reply_not_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let root = crate::support::root().join("tool_definitions");
    let mut datetime: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("system.current_datetime.json")).unwrap(),
    )
    .unwrap();
    datetime["delivery"] = json!("direct");
    std::fs::write(
        dir.path().join("system.current_datetime.json"),
        datetime.to_string(),
    )
    .unwrap();
    crate::support::copy_definitions(&root, dir.path(), "retrieval.");
    let script = json!({
        "rules": [{ "whenUserContains": ["time"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": { "utcOffset": "+01:00" } } ] },
            { "answer": "It is {{tool:current_datetime}}." }
        ] }]
    });
    let env = Env::start_with(
        script,
        Options {
            defs_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("What time is it?").await;
    let outcome = outcome.expect("completed");
    assert!(outcome.text.contains("+01:00"), "{}", outcome.text);
    let js = async_nats::jetstream::new(env.client.clone());
    let mut stream = js.get_stream("TOOLFLEET_TOOLS").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.last_sequence,
        0,
        "nothing went through the tool stream"
    );
    let text = env.metrics_text().await;
    assert!(
        text.contains(
            "toolfleet_tool_jobs_total{outcome=\"ok\",tool=\"system:current_datetime@1.0.0\"} 1"
        ),
        "{text}"
    );
}

/// A cancel that arrives while the job still waits in the stream (behind a
/// busy orchestrator) is remembered: when the job's turn comes it ends with
/// `error: cancelled` at once and the model is never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_while_queued_never_runs() {
    let script = json!({
        "rules": [
            { "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 1500 }, "answer": "done slowly" } ] },
            { "whenUserContains": ["queued"], "steps": [ { "answer": "should not run" } ] }
        ]
    });
    let env = Env::start_with(
        script,
        Options {
            tweak: |o| o.max_in_flight = 1,
            ..Default::default()
        },
    )
    .await;
    // The one slot is busy with a slow job.
    let slow = toolfleet_protocol::client::question("a slow question");
    let mut slow_events = env.follow_and_submit(&slow).await;
    assert_eq!(next_json(&mut slow_events).await["type"], "started");

    // The second job waits in the stream; cancel it there.
    let queued = toolfleet_protocol::client::question("a queued question");
    let mut events = env.follow_and_submit(&queued).await;
    env.client
        .publish(
            env.subjects
                .chat_cancel(queued.tenant(), &queued.invocation_id),
            "".into(),
        )
        .await
        .unwrap();
    env.client.flush().await.unwrap();

    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "cancelled", "{ev}");
    assert_eq!(ev["seq"], 0, "nothing ran before the error: {ev}");
    // The slow job finished normally, and the model only ever saw it.
    loop {
        let ev = next_json(&mut slow_events).await;
        if ev["type"] == "completed" {
            break;
        }
        assert_ne!(ev["type"], "error", "{ev}");
    }
    let asked: Vec<String> = env.model.requests().iter().map(|r| r.to_string()).collect();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert!(asked[0].contains("slow question"), "{asked:?}");
}

/// A profile's first deployment fails before any output (HTTP 503 on
/// every attempt): the call goes to its next deployment, a `fallback`
/// event says so, and the answer comes from there. Once text has
/// streamed, a failure is not moved (the client has seen part of an
/// answer): the job ends with the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_that_fails_before_any_output_falls_back_to_the_next() {
    let broken = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(
            &json!({
                "model": "broken-model",
                "rules": [ { "whenUserContains": ["halfway"], "steps": [
                    { "fault": { "kind": "cutMidText" }, "answer": "I started to say" } ] } ],
                "default": { "steps": [
                    { "fault": { "kind": "status", "status": 503 }, "answer": "never" } ] }
            })
            .to_string(),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let profiles = format!(
        r#"
[deployments.broken]
base_url = "{}"
model = "broken-model"
[deployments.broken.retry]
max_attempts = 2
base_delay_ms = 10
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployments = ["broken", "scripted"]
"#,
        broken.base_url()
    );
    let env = Env::start_with(
        json!({ "default": { "steps": [ { "answer": "the backup answers" } ] } }),
        Options {
            profiles_toml: Some(profiles),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("hello there").await;
    let outcome = outcome.expect("the next deployment answers");
    assert_eq!(outcome.text, "the backup answers");
    let fallback: Vec<Value> = outcome
        .events
        .iter()
        .filter(|e| matches!(e.body, ChatEventBody::Fallback { .. }))
        .map(|e| serde_json::to_value(e).unwrap())
        .collect();
    assert_eq!(fallback.len(), 1, "{:?}", outcome.events);
    assert_eq!(fallback[0]["from"], "broken");
    assert_eq!(fallback[0]["fromModel"], "broken-model");
    assert_eq!(fallback[0]["to"], "scripted");
    assert_eq!(fallback[0]["toModel"], "toolfleet-scripted");
    assert_eq!(
        fallback[0]["code"], "server_error",
        "the provider's error code"
    );
    assert_eq!(
        broken.received().len(),
        2,
        "both attempts went to the broken one"
    );
    assert_eq!(outcome.llm_calls.len(), 1, "{:?}", outcome.llm_calls);
    assert_eq!(outcome.llm_calls[0].model, "toolfleet-scripted");
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains("toolfleet_llm_fallbacks_total{from=\"broken\",to=\"scripted\"} 1"),
        "{metrics}"
    );

    // Text streamed, then the connection dropped: no fallback.
    let (_, outcome) = env.ask("stop halfway please").await;
    let err = outcome.expect_err("the cut is the job's end");
    assert!(err.code().starts_with("llm_"), "{err}");
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains("toolfleet_llm_fallbacks_total{from=\"broken\",to=\"scripted\"} 1"),
        "still one: {metrics}"
    );
}
