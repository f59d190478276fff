//! The fleet on a 3-node NATS cluster with R3 streams (issue 9, item 8):
//! the orchestrator and a worker, separate processes given all three URLs,
//! take a load of chat jobs; the node leading the chat stream is killed
//! mid-load; every accepted job still ends in exactly one `completed`
//! event. The stall the kill causes is measured and printed (never
//! asserted: timings on a shared machine drift).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use toolfleet_local::cluster::NatsCluster;
use toolfleet_local::servers::{RedisServer, free_port};
use toolfleet_protocol::{ChatEvent, ChatEventBody, Subjects, ToolStatus};
use toolfleet_service::args::NatsArgs;

use crate::security::{spawn, time_script};
use crate::support::WAIT;

/// Chat jobs in the load.
const JOBS: usize = 64;

async fn connect(urls: String) -> async_nats::Client {
    let mut args = NatsArgs::for_url(urls);
    args.connect_wait_secs = 10;
    args.connect("cluster-test").await.expect("connect")
}

/// Waits until the process serving metrics on `port` says it is ready
/// (`/readyz` 200: its NATS connections, Redis and consumers are up), for
/// as long as a loaded machine may take to start a cluster and the fleet.
async fn until_ready(port: u16, what: &str, logs: &std::path::Path) {
    toolfleet_llm::install_crypto_provider();
    let deadline = tokio::time::Instant::now() + WAIT * 4;
    let url = format!("http://127.0.0.1:{port}/readyz");
    loop {
        if let Ok(r) = reqwest::get(&url).await
            && r.status().is_success()
        {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            let log = std::fs::read_to_string(logs.join(format!("{what}.log"))).unwrap_or_default();
            panic!("{what} never became ready\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asks until the fleet answers with its tool (the catalog may not list
/// the worker's tool yet when both processes are ready).
async fn until_answered(client: &async_nats::Client, subjects: &Subjects, logs: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + WAIT * 2;
    loop {
        let job = toolfleet_protocol::client::question("What time is it?");
        let tool_ok =
            match toolfleet_protocol::client::chat(client, subjects, &job, WAIT, |_| {}).await {
                Ok(outcome) => outcome.events.iter().any(|e| {
                    matches!(
                        &e.body,
                        ChatEventBody::ToolResult {
                            status: ToolStatus::Ok,
                            ..
                        }
                    )
                }),
                Err(_) => false,
            };
        if tool_ok {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            let mut text = String::new();
            for name in ["orchestrator.log", "worker-system.log"] {
                let log = std::fs::read_to_string(logs.join(name)).unwrap_or_default();
                text.push_str(&format!("--- {name}\n{log}\n"));
            }
            panic!("the fleet never answered\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the test saw of one invocation.
#[derive(Default)]
struct Seen {
    submitted: Option<Instant>,
    /// When, and `completed#<seq>` / `error#<seq>` (`late#<seq>` after the
    /// load).
    terminals: Vec<(Instant, String)>,
    /// `started` events: more than one means the job ran again.
    starts: usize,
    /// Its terminal event was read from the events stream, not live.
    recovered: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_cluster_r3_streams_lose_no_job_when_a_node_dies_under_load() {
    let mut cluster = NatsCluster::start(3).expect("a 3-node nats-server cluster");
    let redis = RedisServer::start().unwrap();
    let mut script = time_script();
    // Each model call takes a while, so jobs are in flight when the node dies.
    script["firstTokenDelayMs"] = 150.into();
    let script = toolfleet_scripted::Script::from_json(&script.to_string()).unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let ports = [free_port().unwrap(), free_port().unwrap()];
    let env = |port: u16, extra: Vec<(&'static str, String)>| {
        let mut env = vec![
            ("TOOLFLEET_NATS_URL", cluster.urls()),
            ("TOOLFLEET_STREAM_REPLICAS", "3".to_string()),
            ("TOOLFLEET_REDIS_URL", redis.url()),
            ("TOOLFLEET_LOG", "warn".into()),
            ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ];
        env.extend(extra);
        env
    };
    let _procs = [
        spawn(
            "toolfleet-orchestrator",
            &env(
                ports[0],
                vec![
                    ("TOOLFLEET_LLM_BASE_URL", model.base_url().to_string()),
                    ("TOOLFLEET_LLM_MODEL", "toolfleet-scripted".into()),
                    ("TOOLFLEET_LLM_API_KEY", "sk-cluster-test".into()),
                ],
            ),
            logs.path().join("orchestrator.log"),
        ),
        spawn(
            "toolfleet-worker-system",
            &env(ports[1], vec![]),
            logs.path().join("worker-system.log"),
        ),
    ];
    let subjects = Subjects::new("toolfleet").unwrap();
    let probe = connect(cluster.urls()).await;
    until_ready(ports[0], "orchestrator", logs.path()).await;
    until_ready(ports[1], "worker-system", logs.path()).await;
    until_answered(&probe, &subjects, logs.path()).await;

    // The fleet made its streams and bucket with three replicas each.
    let js = async_nats::jetstream::new(probe.clone());
    let mut chat_leader = String::new();
    for name in ["TOOLFLEET_CHAT", "TOOLFLEET_TOOLS", "KV_TOOLFLEET_CATALOG"] {
        let info = js
            .get_stream(name)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        assert_eq!(info.config.num_replicas, 3, "{name}");
        let placement = info.cluster.expect("clustered");
        assert_eq!(placement.replicas.len(), 2, "{name}: {placement:?}");
        if name == "TOOLFLEET_CHAT" {
            chat_leader = placement.leader.expect("a leader");
        }
    }
    // The node the orchestrator is connected to dies (its pulls, acks and
    // events in flight go with it, and it must fail over); the client
    // follows from the other two (core NATS events published while its own
    // server is down would be lost to it, not to the fleet).
    let victim = cluster
        .node_of_client("toolfleet-orchestrator")
        .expect("the orchestrator is connected to a node");
    let leads_chat = chat_leader == format!("node-{victim}");
    let survivors = (0..cluster.len())
        .filter(|&i| i != victim)
        .map(|i| cluster.url(i))
        .collect::<Vec<_>>()
        .join(",");
    let client = connect(survivors).await;
    let mut events = client.subscribe("toolfleet.chat.events.>").await.unwrap();
    client.flush().await.unwrap();

    let mut seen: HashMap<String, Seen> = HashMap::new();
    let load_started = Instant::now();
    for _ in 0..JOBS {
        let job = toolfleet_protocol::client::question("What time is it?");
        seen.entry(job.invocation_id.clone()).or_default().submitted = Some(Instant::now());
        toolfleet_protocol::client::submit(&client, &subjects, &job)
            .await
            .expect("stored by JetStream");
    }

    // Kill the node once a quarter of the jobs have ended. A job is done
    // when the store says its run finished (the orchestrator marks it just
    // before the ack): events are core NATS, and one in flight through
    // the dying node can be lost (the terminal one is published again when
    // the orchestrator sees its connection break or the job come back;
    // what is still lost is counted and printed below).
    let mut store_conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut killed_at = None;
    let mut done = 0;
    let mut finished_at = None;
    let deadline = tokio::time::Instant::now() + WAIT * 4;
    loop {
        let next = tokio::time::timeout(Duration::from_millis(250), events.next()).await;
        if let Ok(Some(msg)) = next
            && let Ok(event) = serde_json::from_slice::<ChatEvent>(&msg.payload)
            && let Some(s) = seen.get_mut(&event.invocation_id)
        {
            if matches!(event.body, ChatEventBody::Started { .. }) {
                s.starts += 1;
            }
            if event.body.is_terminal() {
                let kind = match event.body {
                    ChatEventBody::Completed { .. } => format!("completed#{}", event.seq),
                    _ => format!("error#{}", event.seq),
                };
                if s.terminals.is_empty() {
                    done += 1;
                }
                s.terminals.push((Instant::now(), kind));
            }
        }
        if killed_at.is_none() && done >= JOBS / 4 {
            cluster.kill(victim);
            killed_at = Some(Instant::now());
        }
        if done == JOBS {
            break;
        }
        if killed_at.is_some() {
            let mut finished = 0;
            for id in seen.keys() {
                let owner: Option<String> = redis::cmd("GET")
                    .arg(format!("toolfleet:{{default/{id}}}:owner"))
                    .query_async(&mut store_conn)
                    .await
                    .unwrap();
                finished += usize::from(owner.is_some_and(|o| o.ends_with(":finished")));
            }
            if finished == JOBS {
                // Every run ended: give its last events a moment.
                let at = *finished_at.get_or_insert_with(Instant::now);
                if at.elapsed() > Duration::from_secs(3) {
                    break;
                }
            }
        }
        if tokio::time::Instant::now() > deadline {
            let missing: Vec<&String> = seen
                .iter()
                .filter(|(_, s)| s.terminals.is_empty())
                .map(|(id, _)| id)
                .collect();
            let log =
                std::fs::read_to_string(logs.path().join("orchestrator.log")).unwrap_or_default();
            panic!("{done} of {JOBS} jobs ended; not {missing:?}\n--- orchestrator.log\n{log}");
        }
    }
    let killed_at = killed_at.expect("the node was killed");

    // The node comes back; a new job is answered, and by then no earlier
    // job has ended a second time.
    cluster.restart(victim).unwrap();
    until_answered(&client, &subjects, logs.path()).await;
    while let Some(Some(msg)) = futures::FutureExt::now_or_never(events.next()) {
        if let Ok(event) = serde_json::from_slice::<ChatEvent>(&msg.payload)
            && event.body.is_terminal()
            && let Some(s) = seen.get_mut(&event.invocation_id)
        {
            s.terminals
                .push((Instant::now(), format!("late#{}", event.seq)));
        }
    }
    // A terminal event lost in transit (core NATS through the dying node)
    // is kept by the events stream (R3): every one is read back there, as
    // `client::chat` does after a quiet spell.
    let events_lost = seen.values().filter(|s| s.terminals.is_empty()).count();
    for (id, s) in seen.iter_mut().filter(|(_, s)| s.terminals.is_empty()) {
        let stored = toolfleet_protocol::client::last_event(&client, &subjects, "default", id)
            .await
            .unwrap_or_else(|e| panic!("invocation {id}: the events stream: {e}"))
            .unwrap_or_else(|| panic!("invocation {id}: no terminal event, live or stored"));
        assert!(stored.body.is_terminal(), "invocation {id}: {stored:?}");
        let kind = match stored.body {
            ChatEventBody::Completed { .. } => format!("completed#{}", stored.seq),
            _ => format!("error#{}", stored.seq),
        };
        s.terminals.push((Instant::now(), kind));
        s.recovered = true;
    }
    for (id, s) in seen.iter().filter(|(_, s)| !s.terminals.is_empty()) {
        let kinds: Vec<_> = s.terminals.iter().map(|(_, k)| k.as_str()).collect();
        let mut seqs: Vec<&str> = kinds
            .iter()
            .filter_map(|k| k.split_once('#').map(|(_, seq)| seq))
            .collect();
        seqs.dedup();
        assert!(
            // `started` may be lost with the connection, but never doubled.
            seqs.len() == 1 && kinds[0].starts_with("completed#") && s.starts <= 1,
            "invocation {id} ended {kinds:?}, not once in `completed` (started {} times)",
            s.starts
        );
    }

    // The stall: the longest wait for a job in flight when the node died,
    // and the longest pause between two consecutive job ends after it.
    // Timed from the live ends only (a recovered one was read after the load).
    let ended = || {
        seen.values()
            .filter(|s| !s.terminals.is_empty() && !s.recovered)
    };
    let mut ends: Vec<Instant> = ended().map(|s| s.terminals[0].0).collect();
    ends.sort();
    let gap_after_kill = ends
        .windows(2)
        .filter(|w| w[1] > killed_at)
        .map(|w| w[1] - w[0].max(killed_at))
        .max()
        .unwrap_or_default();
    let gap_before_kill = ends
        .windows(2)
        .filter(|w| w[1] <= killed_at)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let latency = |s: &Seen| s.terminals[0].0 - s.submitted.unwrap();
    let max_latency = ended().map(latency).max().unwrap_or_default();
    println!(
        "nats cluster: {JOBS} jobs; the orchestrator's node (node-{victim}, chat stream leader: \
         {leads_chat}) killed {:.2}s into the load; \
         longest pause between job ends: {:.2}s after the kill ({:.2}s before it); \
         slowest job {:.2}s; whole load {:.2}s; terminal events lost in transit: {events_lost} \
         (each read back from the events stream)",
        (killed_at - load_started).as_secs_f64(),
        gap_after_kill.as_secs_f64(),
        gap_before_kill.as_secs_f64(),
        max_latency.as_secs_f64(),
        (*ends.last().unwrap() - load_started).as_secs_f64(),
    );
}

#[test]
fn nats_cluster_the_shipped_server_configs_are_valid() {
    let dir = crate::support::root().join("ops/nats");
    for file in [
        "nats-server.conf",
        "nats-secure.conf",
        "cluster/nats-1.conf",
        "cluster/nats-2.conf",
        "cluster/nats-3.conf",
    ] {
        // auth.conf reads its passwords from the server's environment.
        let out = std::process::Command::new("nats-server")
            .arg("-t")
            .arg("-c")
            .arg(dir.join(file))
            .envs(crate::security::USERS.map(|(_, var)| (var, "x")))
            .output()
            .expect("nats-server");
        let text = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("is valid"),
            "{file}: {text}"
        );
    }
}
