//! End-to-end tests of the fleet against real nats-server and redis-server
//! processes and the scripted model server (a stand-in for the provider).

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

mod approvals;
mod bench;
mod binaries;
mod cancels;
mod caps;
mod chat_cli;
mod clients;
mod compaction;
mod deadletters;
mod delivery;
mod edges;
mod fair;
mod health;
mod in_flight;
mod layout;
mod limits;
mod llm_tools;
mod mcp;
mod modules;
mod nats_cluster;
mod operator;
mod orchestrator;
mod poison;
mod policies;
mod prometheus;
mod provider_limits;
mod rag;
mod retrieval_tenants;
mod runtime;
mod scale_from_zero;
mod scoping;
mod secrets;
mod security;
mod settings;
mod sinks;
mod support;
mod tenant_config;
mod traces;
mod versions;

use std::collections::HashSet;

use futures::StreamExt;
use serde_json::{Value, json};
use support::{Env, Options, WAIT, lighthouse_script, next_json};
use toolfleet_protocol::references::{cited_indices, render};
use toolfleet_protocol::{ChatEventBody, ToolStatus};

fn tool_results(
    events: &[toolfleet_protocol::ChatEvent],
) -> Vec<(String, ToolStatus, Option<String>)> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult {
                tool,
                status,
                error_code,
                ..
            } => Some((tool.clone(), *status, error_code.clone())),
            _ => None,
        })
        .collect()
}

/// The model's tool messages of its last request.
fn tool_messages(env: &Env) -> Vec<String> {
    let requests = env.model.requests();
    let last = requests.last().expect("the model got requests");
    last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_tools_in_one_round_answer_with_citations() {
    let env = Env::start(lighthouse_script()).await;
    let (job, outcome) = env
        .ask("What time is it, and how do lighthouses warn ships?")
        .await;
    let outcome = outcome.expect("completed");

    // Both calls went out before either result came back: one parallel round.
    let kinds: Vec<&str> = outcome.events.iter().map(|e| e.body.name()).collect();
    assert_eq!(kinds[0], "started");
    assert_eq!(&kinds[1..3], ["tool_call", "tool_call"], "{kinds:?}");
    assert_eq!(&kinds[3..5], ["tool_result", "tool_result"], "{kinds:?}");
    assert!(kinds.contains(&"references"));
    assert_eq!(*kinds.last().unwrap(), "completed");
    let seqs: Vec<u64> = outcome.events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "events are numbered without gaps"
    );
    let results = tool_results(&outcome.events);
    assert!(
        results.iter().all(|(_, s, _)| *s == ToolStatus::Ok),
        "{results:?}"
    );
    assert_eq!(outcome.rounds, 2);

    // The answer cites [doc:N] markers that all resolve to references.
    let cited = cited_indices(&outcome.text);
    assert!(!cited.is_empty(), "{}", outcome.text);
    let known: HashSet<u64> = outcome.references.iter().map(|r| r.index).collect();
    assert!(
        cited.iter().all(|n| known.contains(n)),
        "{cited:?} vs {known:?}"
    );
    assert!(
        outcome
            .references
            .iter()
            .any(|r| r.source.as_deref() == Some("lighthouses.md"))
    );
    let rendered = render(&outcome.text, &outcome.references);
    assert!(
        rendered.text.contains("[1]") && !rendered.text.contains("[doc:"),
        "{}",
        rendered.text
    );
    assert!(rendered.to_markdown().contains("\n[1] "));

    // The model was sent both results as tool messages.
    let tools = tool_messages(&env);
    assert_eq!(tools.len(), 2);
    assert!(tools.iter().any(|t| t.contains("[doc:1]")), "{tools:?}");
    // Nothing secret reached the model or the events.
    let all_events = serde_json::to_string(
        &outcome
            .events
            .iter()
            .map(|e| serde_json::to_value(e).unwrap())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert!(!all_events.contains("sk-test-secret"));

    // Redis keys follow the layout and carry a TTL.
    let keys = env.keys(&job.invocation_id).await;
    let id = &job.invocation_id;
    assert!(
        keys.contains(&format!("toolfleet:{{default/{id}}}:seq")),
        "{keys:?}"
    );
    assert!(
        keys.contains(&format!("toolfleet:{{default/{id}}}:refs")),
        "{keys:?}"
    );
    assert!(
        keys.iter()
            .any(|k| k.starts_with(&format!("toolfleet:{{default/{id}}}:result:"))),
        "{keys:?}"
    );
    for k in &keys {
        let ttl = env.ttl(k).await;
        assert!(ttl > 0 && ttl <= 600, "{k} has TTL {ttl}");
    }

    // Every process serves toolfleet_* metrics. The chat job is counted
    // once it is acked, just after its client has the answer: read again
    // until it is.
    let wanted = [
        "toolfleet_chat_jobs_total{outcome=\"completed\"} 1",
        "toolfleet_tool_calls_total{status=\"ok\",tool=\"retrieval:search_data_sources@1.0.0\"} 1",
        "toolfleet_tool_jobs_total{outcome=\"ok\",tool=\"system:current_datetime@1.0.0\"} 1",
        "toolfleet_llm_requests_total{model=\"toolfleet-scripted\",outcome=\"ok\"} 2",
    ];
    let deadline = tokio::time::Instant::now() + WAIT;
    let text = loop {
        let text = env.metrics_text().await;
        let missing: Vec<&str> = wanted.into_iter().filter(|w| !text.contains(w)).collect();
        if missing.is_empty() {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "missing {missing:?}\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(text.contains("toolfleet_citations_written_total"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_arguments_reach_the_model_and_write_nothing() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["bees"],
            "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "bees", "topK": 50 } } ] },
                { "answer": "The search failed: {{tool:search_data_sources}}" }
            ]
        }]
    });
    let env = Env::start(script).await;
    let (job, outcome) = env.ask("How do bees navigate?").await;
    let outcome = outcome.expect("the loop goes on to an answer");
    let results = tool_results(&outcome.events);
    assert_eq!(
        results,
        vec![(
            "retrieval:search_data_sources@1.0.0".into(),
            ToolStatus::Error,
            Some("invalid_arguments".into())
        )]
    );
    let tools = tool_messages(&env);
    assert_eq!(tools.len(), 1);
    assert!(
        tools[0].contains("Invalid arguments") && tools[0].contains("/topK"),
        "{}",
        tools[0]
    );
    assert!(outcome.text.contains("/topK"), "{}", outcome.text);
    assert!(
        env.tool_keys(&job.invocation_id).await.is_empty(),
        "nothing written to Redis"
    );
    let text = env.metrics_text().await;
    assert!(text.contains("toolfleet_tool_jobs_total{outcome=\"invalid_arguments\",tool=\"retrieval:search_data_sources@1.0.0\"} 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tool_and_bad_json_arguments_are_answered_at_once() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["rocket"],
            "steps": [
                { "toolCalls": [ { "name": "launch_rockets", "arguments": { "count": 3 } } ] },
                { "answer": "Could not: {{tool:launch_rockets}}" }
            ]
        }]
    });
    let env = Env::start(script).await;
    let (_, outcome) = env.ask("Launch a rocket").await;
    let outcome = outcome.expect("completed");
    assert_eq!(
        tool_results(&outcome.events),
        vec![(
            "launch_rockets".into(),
            ToolStatus::Error,
            Some("unknown_tool".into())
        )]
    );
    let tools = tool_messages(&env);
    assert!(
        tools[0].contains("no tool named \"launch_rockets\"")
            && tools[0].contains("search_data_sources"),
        "{}",
        tools[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_without_a_live_worker_is_answered_without_waiting_for_its_timeout() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["tides"],
            "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "tides" } } ] },
                { "answer": "Sorry: {{tool:search_data_sources}}" }
            ]
        }]
    });
    // Only the system worker runs: nobody in this fleet serves (or ever
    // advertised) search_data_sources, so the orchestrator does not know it.
    let env = Env::start_with(
        script,
        Options {
            workers: vec!["system"],
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("What causes tides?").await;
    let outcome = outcome.expect("completed");
    let started = outcome.events.iter().find_map(|e| match &e.body {
        ChatEventBody::Started { tools, .. } => Some(tools.clone()),
        _ => None,
    });
    assert_eq!(
        started,
        Some(vec!["system:current_datetime@1.0.0".to_string()]),
        "only live tools are offered"
    );
    // Answered at once (not waited out as a timeout), naming only the tools
    // a live worker serves.
    assert_eq!(
        tool_results(&outcome.events),
        vec![(
            "search_data_sources".into(),
            ToolStatus::Error,
            Some("unknown_tool".into())
        )]
    );
    let message = &tool_messages(&env)[0];
    assert!(
        message.contains("no tool named \"search_data_sources\"")
            && message.contains("Available tools: current_datetime."),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_chat_jobs_end_in_an_error_event_or_a_dead_letter_and_the_fleet_goes_on() {
    let env = Env::start(lighthouse_script()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;

    // Schema violation with a salvageable invocation id → error event.
    let mut events = env
        .subscribe("toolfleet.chat.events.default.bad-1".into())
        .await;
    js.publish(
        "toolfleet.chat.submit.default",
        r#"{"invocationId":"bad-1","messages":[{"role":"wizard","content":"hi"}]}"#.into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error");
    assert_eq!(ev["code"], "malformed_job");
    assert!(ev["message"].as_str().unwrap().contains("role"), "{ev}");
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "schema_violation");
    assert_eq!(d["invocationId"], "bad-1");

    // Not JSON at all → dead letter.
    js.publish("toolfleet.chat.submit.default", "\u{1}garbage".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "malformed_json");
    assert_eq!(d["kind"], "chat");

    // Oversized → rejected with a clear error (by the stream or by us).
    let big = format!(
        r#"{{"invocationId":"big-1","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    let stored = match js
        .publish("toolfleet.chat.submit.default", big.into())
        .await
    {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    assert!(!stored, "an oversized job is refused");

    // The orchestrator still answers good jobs.
    let (_, outcome) = env
        .ask("how do lighthouses warn ships? what time is it")
        .await;
    outcome.expect("a good job after bad ones completes");
    let text = env.metrics_text().await;
    assert!(
        text.contains("toolfleet_dead_letters_total{kind=\"chat\",tool=\"\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("toolfleet_chat_jobs_total{outcome=\"malformed\"} 2"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_invocations_never_mix_citations() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            tweak: |c| c.max_in_flight = 50,
            ..Default::default()
        },
    )
    .await;
    let asks = (0..50).map(|i| {
        let env = &env;
        async move {
            let job = toolfleet_protocol::client::question(&format!(
                "Question {i}: what time is it, and how do lighthouses warn ships?"
            ));
            let out = env.submit(&job).await;
            (job, out)
        }
    });
    let outcomes = futures::future::join_all(asks).await;
    for (job, outcome) in outcomes {
        let outcome = outcome.unwrap_or_else(|e| panic!("{}: {e}", job.invocation_id));
        let my_calls: HashSet<String> = outcome
            .events
            .iter()
            .filter_map(|e| match &e.body {
                ChatEventBody::ToolCall { call_id, .. } => Some(call_id.clone()),
                _ => None,
            })
            .collect();
        assert!(!outcome.references.is_empty());
        // Every reference of this invocation came from this invocation's calls,
        // and the shared counter started at 1 for it.
        for r in &outcome.references {
            assert!(
                my_calls.contains(r.call_id.as_deref().unwrap_or_default()),
                "{} got {:?}",
                job.invocation_id,
                r
            );
        }
        let mut indices: Vec<u64> = outcome.references.iter().map(|r| r.index).collect();
        indices.sort();
        assert_eq!(indices, (1..=indices.len() as u64).collect::<Vec<_>>());
        let known: HashSet<u64> = indices.into_iter().collect();
        assert!(
            cited_indices(&outcome.text)
                .iter()
                .all(|n| known.contains(n))
        );
    }
}

/// A job delivered twice (a redelivery beyond the duplicate window) returns
/// the stored result and writes no second set of citations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_tool_job_is_answered_from_the_ledger() {
    let env = Env::start(lighthouse_script()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let inbox = env.subjects.reply_inbox();
    let mut replies = env.subscribe(inbox.clone()).await;
    let call = toolfleet_protocol::CallContext {
        invocation: toolfleet_protocol::InvocationContext {
            data_source_id: Some("handbook".into()),
            ..toolfleet_protocol::InvocationContext::new("ledger-1")
        },
        call_id: "call_1".into(),
        tool_id: "retrieval:search_data_sources@1.0.0".parse().unwrap(),
        attempt: 1,
        reply_to: inbox,
        citation_floor: 0,
        new_call: false,
    };
    let body = json!({ "arguments": { "query": "honeybee waggle dance", "topK": 2 } }).to_string();
    let mut first_refs = None;
    for round in 0..2 {
        let mut h = call.to_headers();
        // A different message id: JetStream's de-duplication does not catch it.
        h.insert("Nats-Msg-Id", format!("ledger-1.call_1.{round}").as_str());
        js.publish_with_headers(env.subjects.tool(&call.tool_id), h, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
        let reply = next_json(&mut replies).await;
        assert_eq!(reply["type"], "result");
        assert_eq!(reply["status"], "ok");
        assert_eq!(
            reply["replayed"].as_bool().unwrap_or(false),
            round == 1,
            "{reply}"
        );
        match &first_refs {
            None => first_refs = Some(reply["references"].clone()),
            Some(r) => assert_eq!(&reply["references"], r),
        }
    }
    let mut c = env.redis_conn.clone();
    let seq: u64 = redis::cmd("GET")
        .arg("toolfleet:{default/ledger-1}:seq")
        .query_async(&mut c)
        .await
        .unwrap();
    let refs = first_refs.unwrap().as_array().unwrap().len() as u64;
    assert!(refs > 0);
    assert_eq!(seq, refs, "each reference written once");
}

/// With Redis gone, a tool job is retried with our delay up to the attempt
/// cap, then terminated and dead-lettered — and the caller still gets an
/// error result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_store_ends_in_a_dead_letter_and_an_error_result() {
    let mut env = Env::start(lighthouse_script()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let inbox = env.subjects.reply_inbox();
    let mut replies = env.subscribe(inbox.clone()).await;
    let mut dead = env.subscribe("toolfleet.deadletter.tool".into()).await;
    env.redis.stop();
    let call = toolfleet_protocol::CallContext {
        invocation: toolfleet_protocol::InvocationContext::new("dead-1"),
        call_id: "call_9".into(),
        tool_id: "retrieval:search_data_sources@1.0.0".parse().unwrap(),
        attempt: 1,
        reply_to: inbox,
        citation_floor: 0,
        new_call: false,
    };
    js.publish_with_headers(
        env.subjects.tool(&call.tool_id),
        call.to_headers(),
        json!({ "arguments": { "query": "sourdough" } })
            .to_string()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let d = next_json(&mut dead).await;
    assert_eq!(d["invocationId"], "dead-1");
    assert_eq!(d["callId"], "call_9");
    assert_eq!(d["attempts"], 3);
    assert!(d["streamSequence"].as_u64().unwrap() > 0);
    let reply = next_json(&mut replies).await;
    assert_eq!(reply["status"], "error");
    assert_eq!(reply["attempt"], 3);
    let text = env.metrics_text().await;
    assert!(
        text.contains(
            "toolfleet_tool_job_retries_total{tool=\"retrieval:search_data_sources@1.0.0\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "toolfleet_dead_letters_total{kind=\"tool\",tool=\"retrieval:search_data_sources@1.0.0\"} 1"
        ),
        "{text}"
    );
}

/// A tool job without its required headers is dead-lettered, not retried and
/// not a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_job_with_bad_headers_is_dead_lettered() {
    let env = Env::start(lighthouse_script()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let mut dead = env.subscribe("toolfleet.deadletter.tool".into()).await;
    let mut h = async_nats::HeaderMap::new();
    h.insert("Toolfleet-Invocation-Id", "hdr-1");
    js.publish_with_headers(
        "toolfleet.tool.system.current_datetime.1_0_0",
        h,
        r#"{"arguments":{}}"#.into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "bad_headers");
    assert!(d["error"].as_str().unwrap().contains("Toolfleet-"), "{d}");
    assert_eq!(d["attempts"], 1);
}

/// Workers register with the NATS services API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_answer_the_services_api() {
    let env = Env::start(lighthouse_script()).await;
    let dir = support::root().join("../shared/conformance/nats-micro-schemas");
    assert!(
        dir.is_dir(),
        "conformance schemas expected at {}",
        dir.display()
    );
    let mut tools_seen = HashSet::new();
    for verb in ["PING", "INFO", "STATS"] {
        // The schemas nats.rs validates its own replies against.
        let schema: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{}_response.json", verb.to_lowercase())))
                .unwrap(),
        )
        .unwrap();
        let validator = toolfleet_protocol::schema::Validator::compile(&schema).unwrap();
        let inbox = env.client.new_inbox();
        let mut sub = env.subscribe(inbox.clone()).await;
        env.client
            .publish_with_reply(format!("$SRV.{verb}.toolfleet-worker"), inbox, "".into())
            .await
            .unwrap();
        let mut ids = HashSet::new();
        for _ in 0..2 {
            let msg = tokio::time::timeout(WAIT, sub.next())
                .await
                .unwrap()
                .unwrap();
            let v: Value = serde_json::from_slice(&msg.payload).unwrap();
            validator.validate(&v).unwrap_or_else(|e| {
                panic!("$SRV.{verb} reply does not match the schema: {e:?}\n{v}")
            });
            assert_eq!(v["name"], "toolfleet-worker");
            ids.insert(v["id"].as_str().unwrap().to_string());
            if verb == "INFO" {
                for e in v["endpoints"].as_array().unwrap() {
                    tools_seen.insert(e["metadata"]["toolId"].as_str().unwrap().to_string());
                }
            }
        }
        assert_eq!(ids.len(), 2, "one service instance per worker");
    }
    let mut expected: HashSet<String> = support::RETRIEVAL_TOOLS
        .iter()
        .map(|name| format!("retrieval:{name}@1.0.0"))
        .collect();
    expected.insert("system:current_datetime@1.0.0".into());
    assert_eq!(tools_seen, expected, "the catalog names every served tool");
}

/// NATS goes away and comes back: the fleet reconnects, and chat jobs are
/// answered again without restarting anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_recovers_when_nats_restarts() {
    let mut env = Env::start(lighthouse_script()).await;
    let (_, outcome) = env
        .ask("how do lighthouses warn ships? what time is it")
        .await;
    outcome.expect("before the restart");
    env.nats.stop();
    env.nats.start_again().expect("nats-server restarts");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let job =
            toolfleet_protocol::client::question("how do lighthouses warn ships? what time is it");
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            toolfleet_protocol::client::chat(
                &env.client,
                &env.subjects,
                &job,
                std::time::Duration::from_secs(5),
                |_| {},
            ),
        )
        .await;
        if let Ok(Ok(outcome)) = r {
            assert!(!outcome.references.is_empty());
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer after the restart: {r:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
