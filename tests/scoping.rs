//! The tool catalog of a fleet, end to end: gates, progressive scoping
//! (all, token, planning, planning failure), `search_tools` expansion and
//! its caps, suggestions for unknown tools, first-wins across registry
//! backends, a worker whose tools leave when it stops, and agent tools
//! nested one level with their citations renumbered. Real NATS and Redis;
//! the scripted model server stands in for the provider and records what
//! each request offered.

use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::tools::{Origin, ToolDefinition};
use toolfleet_protocol::{ChatEvent, ChatEventBody, ChatJob, ToolStatus};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{Env, Options, WAIT};

/// Answers `"<name> ran"`.
struct Echo(String);

impl Tool for Echo {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(format!("{} ran", self.0)))
    }
}

/// A definition `t:<name>@1.0.0` (function `<name>`), with `extra` keys
/// merged over the defaults.
fn def(name: &str, extra: Value) -> ToolDefinition {
    let mut v = json!({
        "schemaVersion": 1,
        "id": format!("t:{name}@1.0.0"),
        "implementationKey": format!("t.{name}"),
        "title": name,
        "description": format!("The {name} test tool."),
        "category": "testing",
        "function": {
            "name": name,
            "description": format!("The {name} test tool."),
            "parameters": { "type": "object", "properties": { "q": { "type": "string" } } }
        }
    });
    if let Value::Object(extra) = extra {
        for (k, val) in extra {
            v[k] = val;
        }
    }
    ToolDefinition::from_value(v, Origin::Named(name.into())).expect("test definition")
}

/// A worker serving `defs`, each with [`Echo`].
fn worker(family: &str, defs: Vec<ToolDefinition>) -> Worker {
    let mut b = Worker::builder(family);
    for d in defs {
        let key = d.implementation_key.clone();
        let name = d.function.name.clone();
        b = b.definition(d).tool(key, Echo(name));
    }
    b.build().expect("test worker")
}

const PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

# The same server, trusted more: the fleet decides a job's provider
# confidence by the deployment it calls.
[deployments.trusted]
base_url = "{base_url}"
model = "toolfleet-scripted"
confidence = 0.9

[deployments.wary]
base_url = "{base_url}"
model = "toolfleet-scripted"
confidence = 0.5

[profiles.default]
deployment = "scripted"

[profiles.trusted]
deployment = "trusted"

[profiles.wary]
deployment = "wary"

[profiles.narrow]
deployment = "scripted"
tools = ["t:general_tool", "t:ghost"]

[profiles.capped]
deployment = "scripted"
[profiles.capped.scoping]
max_expansion_rounds = 1
max_tool_count = 21
scoping_threshold = 21
"#;

async fn env_with(script: Value, profiles: &str) -> Env {
    Env::start_with(
        script,
        Options {
            workers: vec![],
            profiles_toml: Some(profiles.to_string()),
            data_source: None,
            ..Default::default()
        },
    )
    .await
}

fn started_tools(events: &[ChatEvent]) -> Vec<String> {
    events
        .iter()
        .find_map(|e| match &e.body {
            ChatEventBody::Started { tools, .. } => Some(tools.clone()),
            _ => None,
        })
        .expect("a started event")
}

/// A `scoping` event: (decision, permitted, tools, added, note).
type Scoping = (String, usize, Vec<String>, Vec<String>, Option<String>);

/// Every `scoping` event.
fn scoping_events(events: &[ChatEvent]) -> Vec<Scoping> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::Scoping {
                decision,
                permitted,
                tools,
                added,
                note,
            } => Some((
                decision.clone(),
                *permitted,
                tools.clone(),
                added.clone(),
                note.clone(),
            )),
            _ => None,
        })
        .collect()
}

/// The function names each model request offered, in request order.
fn offered_per_request(env: &Env) -> Vec<Vec<String>> {
    env.model
        .requests()
        .iter()
        .map(|body| {
            body["tools"]
                .as_array()
                .map(|tools| {
                    tools
                        .iter()
                        .map(|t| {
                            t["function"]["name"]
                                .as_str()
                                .or_else(|| t["name"].as_str())
                                .unwrap_or_default()
                                .to_string()
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect()
}

/// Waits until the orchestrator's catalog serves `id` (a chat job is
/// offered only what a catalog reading has seen).
async fn until_offered(env: &Env, function: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let catalog = toolfleet_protocol::catalog::discover(
            &env.client,
            &env.subjects,
            Duration::from_millis(250),
            &Default::default(),
        )
        .await
        .unwrap();
        if catalog.by_function_name(function).is_some() {
            // One refresh period of the orchestrator (2 s) on top.
            tokio::time::sleep(Duration::from_millis(2_300)).await;
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{function} never advertised"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn job(text: &str) -> ChatJob {
    toolfleet_protocol::client::question(text)
}

/// Purposes, `visibleIn`, provider confidence, system tools, profile
/// tools, a job's picks — each gate decides what `started` offers; a pick
/// that does not exist or is not selectable fails the job naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gate_decides_what_the_model_is_offered() {
    let env = env_with(
        json!({ "default": { "steps": [ { "answer": "ok" } ] } }),
        PROFILES,
    )
    .await;
    let w = env
        .start_worker(worker(
            "gates",
            vec![
                def("general_tool", json!({})),
                def("doc_tool", json!({ "purpose": "document_processing" })),
                def("source_tool", json!({ "purpose": "data_source_search" })),
                def("writer", json!({ "purpose": "content_generation" })),
                def("sys_tool", json!({ "selectable": false })),
                def(
                    "sys_docs",
                    json!({ "selectable": false, "purpose": "document_processing" }),
                ),
                def("chat_only", json!({ "visibleIn": ["chat"] })),
                def("elsewhere", json!({ "visibleIn": ["mobile"] })),
                def("trusted", json!({ "minProviderConfidence": 0.8 })),
                def("picked", json!({})),
            ],
        ))
        .await;
    until_offered(&env, "picked").await;

    let ids = |names: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = names.iter().map(|n| format!("t:{n}@1.0.0")).collect();
        v.sort();
        v
    };

    // A plain chat job: general, content generation, system, chat surface.
    let plain = env.submit(&job("hello")).await.expect("plain");
    assert_eq!(
        started_tools(&plain.events),
        ids(&["chat_only", "general_tool", "picked", "sys_tool", "writer"])
    );
    // Nothing was left out: no scoping event.
    assert!(scoping_events(&plain.events).is_empty());

    // Documents, a data source and a trusted deployment open three gates.
    let mut rich = job("hello");
    rich.attached_documents = vec!["handbook.md".into()];
    rich.data_source_id = Some("handbook".into());
    rich.profile = Some("trusted".into());
    let rich = env.submit(&rich).await.expect("rich");
    assert_eq!(
        started_tools(&rich.events),
        ids(&[
            "chat_only",
            "doc_tool",
            "general_tool",
            "picked",
            "source_tool",
            "sys_docs",
            "sys_tool",
            "trusted",
            "writer"
        ])
    );

    // A confidence below the tool's minimum keeps it out; another surface
    // swaps the visibleIn tools.
    let mut mobile = job("hello");
    mobile.surface = Some("mobile".into());
    mobile.profile = Some("wary".into());
    let mobile = env.submit(&mobile).await.expect("mobile");
    assert_eq!(
        started_tools(&mobile.events),
        ids(&["elsewhere", "general_tool", "picked", "sys_tool", "writer"])
    );

    // A narrow profile: its own tool and the system tool, plus the job's
    // pick; its tool no worker serves is noted, never offered.
    let mut narrow = job("hello");
    narrow.profile = Some("narrow".into());
    narrow.tools = vec!["t:picked".into()];
    let narrow = env.submit(&narrow).await.expect("narrow");
    assert_eq!(
        started_tools(&narrow.events),
        ids(&["general_tool", "picked", "sys_tool"])
    );
    let scoping = scoping_events(&narrow.events);
    assert_eq!(scoping.len(), 1, "{scoping:?}");
    assert_eq!(scoping[0].0, "all");
    assert!(
        scoping[0]
            .4
            .as_deref()
            .unwrap_or_default()
            .contains("t:ghost"),
        "the unserved profile tool is noted: {scoping:?}"
    );

    // Picks that cannot be honoured fail the job, naming the entry.
    for (pick, says) in [("t:sys_tool", "system tool"), ("t:nope", "no tool t:nope")] {
        let mut bad = job("hello");
        bad.tools = vec!["t:general_tool".into(), pick.into()];
        let err = env.submit(&bad).await.expect_err("a bad pick fails");
        assert_eq!(err.code(), "invalid_tool_selection", "{err}");
        let msg = err.to_string();
        assert!(msg.contains("tools[1]") && msg.contains(says), "{msg}");
    }

    // The worker stops: its tools leave the catalog and the offer.
    w.stop().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let out = env.submit(&job("hello")).await.expect("no tools");
        if started_tools(&out.events).is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stopped worker's tools are still offered"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// 40 filler tools plus a few meaningful ones.
fn many(filler: usize) -> Vec<ToolDefinition> {
    const WORDS: [&str; 10] = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    ];
    let mut defs: Vec<ToolDefinition> = (0..filler)
        .map(|i| {
            let w = WORDS[i % WORDS.len()];
            let name = format!("{w}_task_{i:03}");
            def(
                &name,
                json!({
                    "description": format!("Manages {w} records number {i}."),
                    "category": format!("filler_{}", i % 4),
                    "function": {
                        "name": name,
                        "description": format!("Manages {w} records number {i}."),
                        "parameters": { "type": "object", "properties": { "record": { "type": "string" } } }
                    }
                }),
            )
        })
        .collect();
    defs.push(def(
        "get_weather",
        json!({
            "description": "Weather forecast for a city.",
            "category": "weather",
            "tags": ["weather", "forecast"],
            "function": {
                "name": "get_weather",
                "description": "Get the weather forecast for a city.",
                "parameters": { "type": "object", "properties": { "city": { "type": "string" } } }
            }
        }),
    ));
    defs.push(def(
        "convert_currency",
        json!({
            "description": "Convert an amount of money between currencies.",
            "category": "money",
            "tags": ["currency", "money"],
            "function": {
                "name": "convert_currency",
                "description": "Convert an amount of money between currencies.",
                "parameters": { "type": "object", "properties": { "amount": { "type": "number" } } }
            }
        }),
    ));
    defs
}

/// Above the scoping threshold (30) and below planning (100): the most
/// relevant 20 by token overlap, `search_tools` added; the weather tool the
/// question names is in, the call to it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_scoping_offers_the_most_relevant_tools() {
    let env = env_with(
        json!({ "rules": [ { "whenUserContains": ["weather"], "steps": [
            { "toolCalls": [ { "name": "get_weather", "arguments": { "city": "Oslo" } } ] },
            { "answer": "{{tool:get_weather}}" }
        ] } ] }),
        PROFILES,
    )
    .await;
    let _w = env.start_worker(worker("many", many(40))).await;
    until_offered(&env, "get_weather").await;

    let out = env
        .submit(&job("what is the weather forecast for Oslo?"))
        .await
        .expect("completed");
    assert_eq!(out.text, "get_weather ran");
    let scoping = scoping_events(&out.events);
    assert_eq!(scoping.len(), 1, "{scoping:?}");
    let (decision, permitted, tools, _, _) = &scoping[0];
    assert_eq!(decision, "token");
    assert_eq!(*permitted, 42);
    assert!(tools.len() <= 20, "{tools:?}");
    assert!(
        tools.contains(&"t:get_weather@1.0.0".to_string()),
        "{tools:?}"
    );
    assert_eq!(&started_tools(&out.events), tools);
    let offered = offered_per_request(&env);
    assert!(
        offered[0].contains(&"search_tools".to_string()),
        "{:?}",
        offered[0]
    );
    assert_eq!(offered[0].len(), tools.len() + 1);
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains("toolfleet_scoping_decisions_total{decision=\"token\"} 1"),
        "{metrics}"
    );
}

/// Above the planning threshold (100): the utility model's plan names the
/// tools; the planning call is accounted with purpose `planning`. A plan
/// that cannot be parsed falls back to token scoring and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planning_narrows_a_large_catalog_and_falls_back_to_tokens_when_it_fails() {
    let env = env_with(
        json!({ "rules": [
            // Only the planning call of the PLANNED question quotes it
            // after "user: " (any phrase of a rule matches).
            { "whenUserContains": ["user: PLANNED"], "steps": [
                { "answer": "{\"tools\": [\"convert_currency\"], \"categories\": []}" } ] },
            { "whenUserContains": ["user: BROKEN PLAN"], "steps": [
                { "fault": { "kind": "status", "status": 500, "times": 10 },
                  "answer": "never sent" } ] },
            { "whenUserContains": ["[toolfleet:tool-planning]"], "steps": [
                { "answer": "I think you want the weather tool, probably." } ] },
            { "whenUserContains": ["money"], "steps": [
                { "toolCalls": [ { "name": "convert_currency", "arguments": { "amount": 3 } } ] },
                { "answer": "{{tool:convert_currency}}" } ] }
        ] }),
        PROFILES,
    )
    .await;
    let _w = env.start_worker(worker("many", many(110))).await;
    until_offered(&env, "convert_currency").await;

    let planned = env
        .submit(&job("PLANNED: how much money is 3 euros in dollars?"))
        .await
        .expect("planned");
    let scoping = scoping_events(&planned.events);
    assert_eq!(scoping[0].0, "planning", "{scoping:?}");
    assert_eq!(scoping[0].1, 112);
    assert_eq!(scoping[0].2, ["t:convert_currency@1.0.0"]);
    assert_eq!(planned.text, "convert_currency ran");
    let purposes: Vec<&str> = planned
        .llm_calls
        .iter()
        .map(|c| c.purpose.as_str())
        .collect();
    assert_eq!(purposes[0], "planning", "{purposes:?}");
    let planning_request = &env.model.requests()[0];
    let temperature = planning_request["temperature"].as_f64().unwrap();
    assert!((temperature - 0.1).abs() < 1e-6, "{temperature}");
    assert_eq!(planning_request["max_tokens"], json!(300));
    assert!(planning_request.get("tools").is_none());

    let fallback = env
        .submit(&job("how much money is 3 euros in dollars?"))
        .await
        .expect("fell back");
    let scoping = scoping_events(&fallback.events);
    assert_eq!(scoping[0].0, "planning_fallback", "{scoping:?}");
    let note = scoping[0].4.clone().unwrap_or_default();
    assert!(note.contains("planning failed"), "{note}");
    assert!(
        scoping[0]
            .2
            .contains(&"t:convert_currency@1.0.0".to_string()),
        "token scoring still finds the money tool: {:?}",
        scoping[0].2
    );
    assert_eq!(fallback.text, "convert_currency ran");

    // A planning call the provider fails (HTTP 500, every retry) falls
    // back the same way.
    let failing = env
        .submit(&job("BROKEN PLAN: how much money is 3 euros in dollars?"))
        .await
        .expect("fell back");
    let scoping = scoping_events(&failing.events);
    assert_eq!(scoping[0].0, "planning_fallback", "{scoping:?}");
    let note = scoping[0].4.clone().unwrap_or_default();
    assert!(note.contains("planning call failed"), "{note}");
    assert_eq!(failing.text, "convert_currency ran");
}

/// Seed rules of planning: tools imported from MCP servers (served by the
/// `mcp` family) make the orchestrator plan as soon as tools are left out,
/// though there are fewer than the planning threshold; and a configured
/// utility model that fails hands the plan to the conversation's own model
/// before token scoring would take over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tools_call_for_planning_and_a_failing_utility_model_hands_over_to_the_main_one() {
    let profiles = format!(
        "{PROFILES}\n[profiles.utility]\ndeployment = \"scripted\"\nutility_model = \"tiny-planner\"\n\
         [profiles.house_plan]\ndeployment = \"scripted\"\n\
         planning_prompt = \"House planner: name at most {{max_tools}} tools as JSON.\"\n"
    );
    let env = env_with(
        json!({ "rules": [
            { "whenModel": ["tiny-planner"], "steps": [
                { "fault": { "kind": "status", "status": 500, "times": 100 },
                  "answer": "never sent" } ] },
            { "whenUserContains": ["user: PLANNED"], "steps": [
                { "answer": "{\"tools\": [\"convert_currency\"], \"categories\": []}" } ] },
            { "whenUserContains": ["money"], "steps": [
                { "toolCalls": [ { "name": "convert_currency", "arguments": { "amount": 3 } } ] },
                { "answer": "{{tool:convert_currency}}" } ] }
        ] }),
        &profiles,
    )
    .await;
    let _w = env.start_worker(worker("mcp", many(40))).await;
    until_offered(&env, "convert_currency").await;

    let planned = env
        .submit(&job("PLANNED: how much money is 3 euros in dollars?"))
        .await
        .expect("planned");
    let scoping = scoping_events(&planned.events);
    assert_eq!(scoping[0].0, "planning", "{scoping:?}");
    assert_eq!(scoping[0].1, 42, "below the planning threshold");
    assert_eq!(scoping[0].2, ["t:convert_currency@1.0.0"]);
    assert_eq!(planned.text, "convert_currency ran");

    let mut with_utility = job("PLANNED: how much money is 3 euros in dollars?");
    with_utility.profile = Some("utility".into());
    let handed_over = env.submit(&with_utility).await.expect("planned");
    let scoping = scoping_events(&handed_over.events);
    assert_eq!(scoping[0].0, "planning", "{scoping:?}");
    assert_eq!(scoping[0].2, ["t:convert_currency@1.0.0"]);
    let note = scoping[0].4.clone().unwrap_or_default();
    assert!(
        note.contains("the utility model tiny-planner failed"),
        "{note}"
    );
    let planning: Vec<&str> = handed_over
        .llm_calls
        .iter()
        .filter(|c| c.purpose == "planning")
        .map(|c| c.model.as_str())
        .collect();
    assert_eq!(planning, ["toolfleet-scripted"]);
    let asked: Vec<String> = env
        .model
        .requests()
        .iter()
        .filter_map(|r| r["model"].as_str().map(str::to_string))
        .collect();
    assert!(asked.iter().any(|m| m == "tiny-planner"), "{asked:?}");
    assert_eq!(handed_over.text, "convert_currency ran");

    // A profile's planning prompt replaces the built-in instructions.
    let before = env.model.requests().len();
    let mut own_prompt = job("PLANNED: how much money is 3 euros in dollars?");
    own_prompt.profile = Some("house_plan".into());
    let planned = env.submit(&own_prompt).await.expect("planned");
    assert_eq!(scoping_events(&planned.events)[0].0, "planning");
    let planning_request = &env.model.requests()[before];
    assert_eq!(
        planning_request["messages"][0]["content"],
        json!("House planner: name at most 30 tools as JSON.")
    );
}

/// `search_tools` adds left-out tools for the next round (an `expansion`
/// event names them); a profile's caps stop further expansion with a
/// clear error, and the loop goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_tools_expands_the_offer_within_its_caps() {
    let env = env_with(
        json!({ "rules": [
            { "whenUserContains": ["alpha"], "steps": [
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "currency" } } ] },
                { "toolCalls": [ { "name": "convert_currency", "arguments": { "amount": 1 } } ] },
                { "toolCalls": [ { "name": "search_tools", "arguments": { "query": "weather" } } ] },
                { "answer": "{{tool:convert_currency}} / {{tool:search_tools}}" }
            ] }
        ] }),
        PROFILES,
    )
    .await;
    let _w = env.start_worker(worker("many", many(40))).await;
    until_offered(&env, "convert_currency").await;

    let mut j = job("alpha records please");
    j.profile = Some("capped".into());
    let out = env.submit(&j).await.expect("completed");
    let scoping = scoping_events(&out.events);
    assert_eq!(scoping[0].0, "token");
    assert!(
        !scoping[0]
            .2
            .contains(&"t:convert_currency@1.0.0".to_string())
    );
    let expansion = scoping
        .iter()
        .find(|s| s.0 == "expansion")
        .expect("an expansion event");
    assert_eq!(expansion.3, ["t:convert_currency@1.0.0"]);
    assert!(
        expansion
            .2
            .contains(&"t:convert_currency@1.0.0".to_string())
    );
    let offered = offered_per_request(&env);
    assert!(offered[1].contains(&"convert_currency".to_string()));
    // One expansion allowed, and 21 tools at most. search_tools stays
    // offered after it (answering that no more can be added), so the
    // requests' beginning does not change when the cap is reached.
    assert!(
        offered[1].contains(&"search_tools".to_string()),
        "{:?}",
        offered[1]
    );
    assert!(offered[1].iter().filter(|t| *t != "search_tools").count() <= 21);
    assert_eq!(offered[2], offered[1], "{:?}", offered[2]);
    let results = crate::tool_results(&out.events);
    assert_eq!(results[0], ("search_tools".into(), ToolStatus::Ok, None));
    assert_eq!(
        results[1],
        ("t:convert_currency@1.0.0".into(), ToolStatus::Ok, None)
    );
    assert_eq!(
        results[2],
        (
            "search_tools".into(),
            ToolStatus::Error,
            Some("expansion_capped".into())
        )
    );
    assert!(
        out.text
            .starts_with("convert_currency ran / Error: no more tools"),
        "{}",
        out.text
    );
}

/// A call to a tool that does not exist is answered with close names, and
/// the model answers in the next round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_tool_call_gets_close_names_and_the_loop_goes_on() {
    let env = env_with(
        json!({ "rules": [ { "whenUserContains": ["weather"], "steps": [
            { "toolCalls": [ { "name": "get_wether", "arguments": {} } ] },
            { "answer": "{{tool:get_wether}}" }
        ] } ] }),
        PROFILES,
    )
    .await;
    let _w = env
        .start_worker(worker(
            "few",
            vec![
                def("get_weather", json!({})),
                def("general_tool", json!({})),
            ],
        ))
        .await;
    until_offered(&env, "get_weather").await;
    let out = env.submit(&job("weather?")).await.expect("completed");
    assert!(
        out.text.contains("Did you mean: get_weather?"),
        "{}",
        out.text
    );
    assert!(
        !out.text.contains("Did you mean: get_weather, general_tool"),
        "{}",
        out.text
    );
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains("toolfleet_unknown_tool_calls_total 1"),
        "{metrics}"
    );
}

const AGENT_PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[profiles.default]
deployment = "scripted"

[profiles.researcher]
deployment = "scripted"
agent = { name = "research", description = "Researches a question in the documents and answers with citations." }

[profiles.editor]
deployment = "scripted"
agent = { name = "edit", description = "Edits a text." }
"#;

/// An agent tool runs a nested chat job (its own invocation, linked to the
/// parent), streams its progress into the parent's events, and returns its
/// answer with its references renumbered above the parent's. The nested
/// job is offered no agent tool (depth 1 is the default cap), and a worker
/// advertising the agent's id loses to the configuration (first backend
/// wins, counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_tool_runs_a_nested_job_and_its_citations_are_renumbered() {
    let env = Env::start_with(
        json!({ "rules": [
            // The nested job's task.
            { "whenUserContains": ["FOG SIGNALS"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "fog signals" } } ] },
                { "answer": "Fog horns sound {{citations}}" } ] },
            { "whenUserContains": ["lighthouse"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "lighthouse lamps" } } ] },
                { "toolCalls": [ { "name": "research", "arguments": { "task": "FOG SIGNALS of lighthouses" } } ] },
                { "answer": "Lamps {{citations}} and: {{tool:research}}" } ] }
        ] }),
        Options {
            workers: vec!["retrieval"],
            profiles_toml: Some(AGENT_PROFILES.to_string()),
            ..Default::default()
        },
    )
    .await;
    // A worker that claims the agent's id: the agents backend comes first.
    let impostor = def(
        "research",
        json!({ "id": "agent:research@1.0.0", "implementationKey": "t.research" }),
    );
    let _w = env.start_worker(worker("impostor", vec![impostor])).await;
    until_offered(&env, "research").await;

    let mut events = env
        .subscribe(env.subjects.chat_events("default", "*"))
        .await;
    let out = env
        .submit(&job("how does a lighthouse warn ships?"))
        .await
        .expect("completed");
    let parent_refs: Vec<u64> = out.references.iter().map(|r| r.index).collect();
    assert!(parent_refs.len() >= 2, "{parent_refs:?}");
    let from_agent: Vec<&toolfleet_protocol::Reference> = out
        .references
        .iter()
        .filter(|r| r.tool_id.as_deref() == Some("agent:research@1.0.0"))
        .collect();
    assert!(!from_agent.is_empty(), "{:?}", out.references);
    let own_max = out
        .references
        .iter()
        .filter(|r| r.tool_id.as_deref() != Some("agent:research@1.0.0"))
        .map(|r| r.index)
        .max()
        .expect("the parent's own citations");
    for r in &from_agent {
        assert!(
            r.index > own_max,
            "renumbered above the parent's: {:?}",
            out.references
        );
        assert!(
            out.text.contains(&r.marker()),
            "the agent's answer cites its renumbered marker {}: {}",
            r.marker(),
            out.text
        );
    }
    assert!(out.text.contains("and: Fog horns sound"), "{}", out.text);
    // The nested job's model calls are the agent call's spend.
    let spent = out.llm_calls.iter().filter(|c| c.purpose == "tool").count();
    assert_eq!(
        spent, 2,
        "the nested job's two model calls: {:?}",
        out.llm_calls
    );
    // The impostor worker's Echo answers "research ran": never called.
    assert!(!out.text.contains("research ran"), "{}", out.text);
    // Progress of the nested job reached the parent's call.
    let progress: Vec<&str> = out
        .events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolProgress { tool, message, .. } if tool == "agent:research@1.0.0" => {
                Some(message.as_str())
            }
            _ => None,
        })
        .collect();
    assert!(
        progress
            .iter()
            .any(|m| m.contains("calling retrieval:search_data_sources")),
        "{progress:?}"
    );
    // The nested job ran under its own invocation id, with the profile,
    // and was not offered the agent tool again.
    let mut nested_started = None;
    while let Ok(Some(msg)) = tokio::time::timeout(
        Duration::from_millis(200),
        futures::StreamExt::next(&mut events),
    )
    .await
    {
        let e: Value = serde_json::from_slice(&msg.payload).unwrap();
        if e["type"] == "started" && e["profile"] == "researcher" {
            nested_started = Some(e);
        }
    }
    let nested = nested_started.expect("the nested job's started event");
    assert_ne!(nested["invocationId"], json!(out.events[0].invocation_id));
    let nested_tools: Vec<&str> = nested["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    // The top-level job was offered both agents; the nested one (depth 1,
    // the cap) neither — not even the other profile's.
    let top = started_tools(&out.events);
    assert!(top.contains(&"agent:edit@1.0.0".to_string()), "{top:?}");
    assert!(top.contains(&"agent:research@1.0.0".to_string()), "{top:?}");
    assert!(
        !nested_tools.iter().any(|t| t.starts_with("agent:")),
        "{nested_tools:?}"
    );
    assert!(nested_tools.contains(&"retrieval:search_data_sources@1.0.0"));
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains("toolfleet_registry_duplicate_tools 1"),
        "the impostor is counted as a duplicate: {metrics}"
    );
}

/// A caller cancelled while its agent's nested job runs: the nested job is
/// cancelled too (it ends with `error: cancelled` instead of running on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_caller_cancels_its_agents_nested_job() {
    let env = Env::start_with(
        json!({ "rules": [
            { "whenUserContains": ["SLOW TASK"], "steps": [
                { "fault": { "kind": "slowFirstToken", "delayMs": 20000 },
                  "answer": "too late" } ] },
            { "whenUserContains": ["delegate"], "steps": [
                { "toolCalls": [ { "name": "research", "arguments": { "task": "SLOW TASK" } } ] },
                { "answer": "{{tool:research}}" } ] }
        ] }),
        Options {
            workers: vec![],
            profiles_toml: Some(AGENT_PROFILES.to_string()),
            ..Default::default()
        },
    )
    .await;
    let mut all = env
        .subscribe(env.subjects.chat_events("default", "*"))
        .await;
    let parent = job("please delegate this");
    let mut parent_events = env.follow_and_submit(&parent).await;
    // The nested job starts (its own `started`, profile researcher).
    let deadline = tokio::time::Instant::now() + WAIT;
    let nested_id = loop {
        let msg = tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut all))
            .await
            .expect("the nested job starts")
            .unwrap();
        let e: Value = serde_json::from_slice(&msg.payload).unwrap();
        if e["type"] == "started" && e["profile"] == "researcher" {
            break e["invocationId"].as_str().unwrap().to_string();
        }
    };
    toolfleet_protocol::client::cancel(
        &env.client,
        &env.subjects,
        "default",
        &parent.invocation_id,
    )
    .await
    .unwrap();
    let parent_end = crate::support::events_until_terminal(&mut parent_events).await;
    assert_eq!(parent_end.last().unwrap()["code"], "cancelled");
    // The nested job's own terminal event: cancelled, long before the
    // model's 20 s answer.
    let nested_end = loop {
        let msg = tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut all))
            .await
            .expect("the nested job ends")
            .unwrap();
        let e: Value = serde_json::from_slice(&msg.payload).unwrap();
        if e["invocationId"] == nested_id.as_str()
            && (e["type"] == "error" || e["type"] == "completed")
        {
            break e;
        }
    };
    assert_eq!(nested_end["type"], "error", "{nested_end}");
    assert_eq!(nested_end["code"], "cancelled", "{nested_end}");
}

/// A worker process killed (SIGKILL, no goodbye): its tools leave the
/// catalog, and chat jobs are no longer offered them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_tools_leave_the_offer() {
    let env = env_with(
        json!({ "default": { "steps": [ { "answer": "ok" } ] } }),
        PROFILES,
    )
    .await;
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut worker =
        std::process::Command::new(crate::support::sibling_bin("toolfleet-worker-system"))
            .env("TOOLFLEET_NATS_URL", env.nats.url())
            .env("TOOLFLEET_REDIS_URL", env.redis.url())
            .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
            .env("TOOLFLEET_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("the system worker starts");
    let offered = |out: &toolfleet_protocol::client::ChatOutcome| {
        started_tools(&out.events).contains(&"system:current_datetime@1.0.0".to_string())
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let out = env.submit(&job("hello")).await.expect("answered");
        if offered(&out) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never offered");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    worker.kill().unwrap();
    worker.wait().unwrap();
    loop {
        let out = env.submit(&job("hello")).await.expect("answered");
        if !offered(&out) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the killed worker's tool is still offered"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
