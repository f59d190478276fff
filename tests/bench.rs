//! The bench's load generator against real servers: the transport floors
//! complete every operation and clean up, and `--mode tool`'s calls go
//! through the fleet's tools stream and come back with their outcome.
//! Behaviour only: speed figures belong in BENCHMARKS.md.

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
