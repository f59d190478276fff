//! The bench's load generator against real servers: the transport floors
//! complete every operation and clean up, `--mode tool`'s calls go
//! through the fleet's tools stream and come back with their outcome, and
//! an LLM tool is measured beside a direct call to the same model that
//! sends the tool's own request. Behaviour only: speed figures belong in
//! BENCHMARKS.md.

use std::time::Duration;

use toolfleet::bench::{Load, ToolCaller, drive};
use toolfleet_local::servers::NatsServer;

use crate::support::{self, Env, Options, WAIT};

fn load(count: usize, concurrency: usize) -> Load {
    Load {
        concurrency,
        count: Some(count),
        duration: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_floors_measure_a_real_server() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = tokio::time::timeout(
        WAIT,
        toolfleet::floor::jetstream_round_trip(&client, &nats.url(), &load(50, 8)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!((js.ops, js.ok, js.errors), (50, 50, 0), "{js:?}");
    assert!(js.ops_per_sec > 0.0 && js.latency_ms.p50 > 0.0, "{js:?}");
    let rr = tokio::time::timeout(
        WAIT,
        toolfleet::floor::request_reply(&client, &nats.url(), &load(50, 8)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!((rr.ops, rr.ok, rr.errors), (50, 50, 0), "{rr:?}");
    let streams: Vec<String> = futures::StreamExt::collect::<Vec<_>>(
        async_nats::jetstream::new(client.clone()).stream_names(),
    )
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    assert!(streams.is_empty(), "{streams:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_mode_calls_go_through_the_tools_stream_with_their_outcome() {
    let env = Env::start_with(
        support::lighthouse_script(),
        Options {
            workers: vec!["system"],
            ..Options::default()
        },
    )
    .await;
    let sleeper = env
        .start_worker(toolfleet::bench_fleet::sleep_worker().unwrap())
        .await;
    let call = |tool: &str, args: serde_json::Value| {
        let (client, subjects, tool) = (env.client.clone(), env.subjects.clone(), tool.to_string());
        async move {
            let caller = ToolCaller::new(
                &client,
                &subjects,
                tool.parse().unwrap(),
                args,
                Duration::from_secs(10),
            )
            .await
            .unwrap();
            tokio::time::timeout(WAIT, drive("test", &load(20, 4), caller.op()))
                .await
                .expect("the calls finish")
        }
    };

    let now = call("system:current_datetime@1.0.0", serde_json::json!({})).await;
    assert_eq!((now.ok, now.errors), (20, 0), "{now:?}");
    let slept = call(
        toolfleet::bench_fleet::SLEEP_TOOL,
        serde_json::json!({"ms": 5}),
    )
    .await;
    assert_eq!((slept.ok, slept.errors), (20, 0), "{slept:?}");
    assert!(
        slept.latency_ms.p50 >= 5.0,
        "the tool's own wait is inside: {slept:?}"
    );
    // A result that is not ok is an error, counted under its code.
    let refused = call(
        toolfleet::bench_fleet::SLEEP_TOOL,
        serde_json::json!({"ms": -1}),
    )
    .await;
    assert_eq!((refused.ok, refused.errors), (0, 20), "{refused:?}");
    assert_eq!(refused.error_codes.values().sum::<usize>(), 20);
    assert!(
        !refused.error_codes.contains_key("timeout"),
        "answered, not timed out: {refused:?}"
    );

    sleeper.stop().await;
    env.shutdown.cancel();
}

/// Runs the whole command, as BENCHMARKS.md does (its own servers, the
/// scripted model of examples/bench-script.json), with `args` and
/// `--floor --json`; its report. The bench waits 10 s for its workers'
/// cancel-hearing margin first.
async fn bench_report(args: &[&str]) -> serde_json::Value {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .current_dir(support::root())
        .env("TOOLFLEET_LOG", "warn")
        .args(["bench", "--isolated"])
        .args(args)
        .args(["--floor", "--json"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), child)
        .await
        .expect("the bench finishes")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_slice(&out.stdout).expect(&stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_tool_is_measured_beside_a_direct_call_to_the_same_model() {
    // The whole command, as BENCHMARKS.md runs it: its own servers, the
    // scripted model of examples/bench-script.json, the LLM tools family.
    let report = bench_report(&[
        "--mode",
        "tool",
        "--tool",
        "llm:summarize@1.0.0",
        "--tool-args",
        r#"{"text":"The keeper lit the lamp at dusk and wound the clockwork every four hours."}"#,
        "--count",
        "8",
        "--concurrency",
        "2",
        "--warmup",
        "2",
    ])
    .await;
    assert_eq!(report["tool"], "llm:summarize@1.0.0");
    assert_eq!(report["model"], "default/toolfleet-scripted");
    assert_eq!(report["fleet"]["ok"], 8, "{report:#}");
    assert_eq!(report["fleet"]["errors"], 0, "{report:#}");
    let floors: Vec<&str> = report["floors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        floors,
        [
            "floor: jetstream work queue",
            "floor: core request-reply",
            "floor: direct model call"
        ]
    );
    let direct = &report["floors"][2];
    assert_eq!(
        (&direct["ok"], &direct["errors"]),
        (&8.into(), &0.into()),
        "{report:#}"
    );
    let ratio = report["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["floor"] == "floor: direct model call")
        .expect("a ratio to the direct model call");
    assert!(ratio["p50"].as_f64().unwrap() > 0.0, "{ratio}");
}

/// Chat jobs beside the direct floor: the same questions answered by one
/// client with the same model calls, the pre-fetch search and the tools'
/// functions in-process. Both sides answer every question, with the same
/// tool calls per job (the floor makes what the fleet makes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_jobs_are_measured_beside_a_direct_floor_that_makes_the_same_calls() {
    let report = bench_report(&[
        "--mode",
        "chat",
        "--count",
        "9",
        "--concurrency",
        "3",
        "--warmup",
        "3",
    ])
    .await;
    assert_eq!(report["fleet"]["ok"], 9, "{report:#}");
    let direct = report["floors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "floor: direct chat")
        .expect("the direct chat floor");
    assert_eq!(
        (&direct["ok"], &direct["errors"]),
        (&9.into(), &0.into()),
        "{report:#}"
    );
    // Each side's operation counts its tool calls: the same questions in
    // the same order make the same calls (and some).
    assert!(direct["tool_calls"].as_u64().unwrap() > 9, "{report:#}");
    assert_eq!(
        report["fleet"]["tool_calls"], direct["tool_calls"],
        "the same tool calls on both sides: {report:#}"
    );
    let ratio = report["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["floor"] == "floor: direct chat")
        .expect("a ratio to the direct chat");
    assert!(ratio["p50"].as_f64().unwrap() > 0.0, "{ratio}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_direct_model_call_sends_the_llm_tools_own_request() {
    let summary =
        serde_json::json!({"summary": "The lamp was lit at dusk.", "keyPoints": ["dusk"]});
    let env = Env::start_with(
        serde_json::json!({
            "rules": [ { "whenUserContains": ["summarize the text below"],
                         "steps": [ { "answer": summary.to_string() } ] } ]
        }),
        Options {
            workers: vec!["llm"],
            ..Options::default()
        },
    )
    .await;
    let arguments =
        serde_json::json!({"text": "The keeper lit the lamp at dusk.", "style": "detailed"});
    let caller = ToolCaller::new(
        &env.client,
        &env.subjects,
        "llm:summarize@1.0.0".parse().unwrap(),
        arguments.clone(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    tokio::time::timeout(WAIT, caller.call())
        .await
        .unwrap()
        .expect("the tool answers");
    let definition = toolfleet_protocol::tools::load_dir(support::root().join("tool_definitions"))
        .unwrap()
        .into_iter()
        .find(|d| d.id.to_string() == "llm:summarize@1.0.0")
        .unwrap();
    let models = toolfleet::bench_fleet::bench_models(
        env.model.base_url(),
        "toolfleet-scripted",
        Duration::from_secs(60),
    );
    // Setting the floor up makes one call.
    let floor = tokio::time::timeout(
        WAIT,
        toolfleet::floor::Floor::direct_model(
            &models,
            &support::root().join("tool_definitions"),
            &definition,
            arguments,
            Duration::from_secs(10),
        ),
    )
    .await
    .unwrap()
    .expect("the direct call answers");
    let bodies: Vec<serde_json::Value> = env.model.received().into_iter().map(|r| r.body).collect();
    assert_eq!(bodies.len(), 2, "{bodies:#?}");
    assert_eq!(
        bodies[0], bodies[1],
        "the worker's request, then the floor's"
    );
    assert!(
        bodies[1]["messages"][1]["content"]
            .as_str()
            .unwrap()
            .contains("in the style \"detailed\""),
        "{bodies:#?}"
    );
    let one = tokio::time::timeout(WAIT, drive("direct", &load(4, 2), floor.op.clone()))
        .await
        .unwrap();
    assert_eq!((one.ok, one.errors), (4, 0), "{one:?}");
    floor.stop().await;
    env.shutdown.cancel();
}
