//! Truthful health, as a probe sees it: a worker binary's `/readyz` turns
//! 503 naming NATS while NATS is down and 200 again once it is back (the
//! same for Redis), `/livez` and `/metrics` keep answering meanwhile, the
//! connection gauges and the reconnect counter follow, and `toolfleet
//! health` turns all that into an exit code for images without curl.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{self, WAIT};

async fn get(url: &str) -> Option<(u16, String)> {
    toolfleet_llm::install_crypto_provider();
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.unwrap_or_default()))
}

/// Polls `url` until `want` holds of its answer.
async fn until(url: &str, what: &str, want: impl Fn(u16, &str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some((status, body)) = get(url).await
            && want(status, &body)
        {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url} never became {what}: {:?}",
            get(url).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn probe(url: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["health", url])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_nats_and_redis_and_the_probe_says_so() {
    let mut nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let mut redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut worker = Command::new(support::sibling_bin("toolfleet-worker-system"))
        .current_dir(support::root())
        .env("TOOLFLEET_NATS_URL", nats.url())
        .env("TOOLFLEET_REDIS_URL", redis.url())
        .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = support::KillOnDrop(&mut worker);
    let base = format!("http://127.0.0.1:{port}");
    let ready = format!("{base}/readyz");
    let body = until(&ready, "ready", |s, _| s == 200).await;
    assert!(
        body.starts_with("ready\n")
            && body.contains("ok   nats")
            && body.contains("ok   redis")
            && body.contains("ok   consumers"),
        "{body}"
    );
    let (code, said) = probe(&ready);
    assert_eq!(code, Some(0), "{said}");
    let metrics = until(&format!("{base}/metrics"), "scraped", |s, b| {
        s == 200 && b.contains("toolfleet_redis_connected 1")
    })
    .await;
    assert!(metrics.contains("toolfleet_nats_connected 1"), "{metrics}");
    // The build's revision and version (tests/versions.rs checks them).
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("toolfleet_build_info{revision=\"")
                && l.ends_with(&format!(",version=\"{}\"}} 1", env!("CARGO_PKG_VERSION")))),
        "{metrics}"
    );
    assert!(
        metrics.contains("process_resident_memory_bytes "),
        "{metrics}"
    );

    // NATS goes away: not ready, saying why; alive and scrapable.
    nats.stop();
    let body = until(&ready, "unready", |s, _| s == 503).await;
    assert!(body.contains("FAIL nats"), "{body}");
    let (code, said) = probe(&ready);
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("503"), "{said}");
    assert_eq!(get(&format!("{base}/livez")).await.map(|r| r.0), Some(200));
    until(&format!("{base}/metrics"), "showing NATS down", |s, b| {
        s == 200 && b.contains("toolfleet_nats_connected 0")
    })
    .await;

    // Back: ready again, the reconnect counted.
    nats.start_again().unwrap();
    until(&ready, "ready again", |s, _| s == 200).await;
    until(
        &format!("{base}/metrics"),
        "counting the reconnect",
        |s, b| {
            s == 200
                && b.contains("toolfleet_nats_connected 1")
                && b.lines().any(|l| {
                    l.strip_prefix("toolfleet_nats_reconnects_total ")
                        .and_then(|v| v.parse::<u64>().ok())
                        .is_some_and(|v| v >= 1)
                })
        },
    )
    .await;

    // Redis too.
    redis.stop();
    let body = until(&ready, "unready without Redis", |s, _| s == 503).await;
    assert!(
        body.contains("FAIL redis") && body.contains("ok   nats"),
        "{body}"
    );
    redis.start_again().unwrap();
    until(&ready, "ready with Redis back", |s, _| s == 200).await;

    // The probe's own errors.
    let (code, said) = probe("ftp://127.0.0.1/readyz");
    assert_eq!(code, Some(64), "{said}");
    let dead = toolfleet_local::servers::free_port().unwrap();
    let (code, said) = probe(&format!("http://127.0.0.1:{dead}/readyz"));
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("no answer"), "{said}");
}

/// A malformed NATS or Redis URL is a configuration error: exit 64 at
/// once (no connection wait), the password never shown.
#[test]
fn malformed_server_urls_exit_64_at_once_without_the_password() {
    let run = |bin: String, args: &[&str]| {
        let started = std::time::Instant::now();
        let out = Command::new(bin)
            .args(args)
            .env("TOOLFLEET_NATS_CONNECT_WAIT", "60")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), said, started.elapsed())
    };
    for (bin, args, what) in [
        (
            support::sibling_bin("toolfleet-worker-system"),
            vec!["--nats-url", "nats://u:hunter2@[::1"],
            "bad NATS URL",
        ),
        (
            support::sibling_bin("toolfleet-worker-system"),
            vec!["--nats-url", "http://u:hunter2@x:4222"],
            "bad NATS URL",
        ),
        (
            support::sibling_bin("toolfleet-worker-system"),
            vec!["--redis-url", "redis://:hunter2@[bad"],
            "bad Redis URL",
        ),
        (
            support::sibling_bin("toolfleet-orchestrator"),
            vec!["--redis-url", "http://:hunter2@x"],
            "bad Redis URL",
        ),
        (
            support::sibling_bin("toolfleet-orchestrator"),
            vec!["--nats-url", "nats://u:hunter2@[::1"],
            "bad NATS URL",
        ),
        (
            env!("CARGO_BIN_EXE_toolfleet").to_owned(),
            vec!["chat", "hi", "--nats-url", "nats://u:hunter2@[::1"],
            "bad NATS URL",
        ),
    ] {
        let (code, said, took) = run(bin.clone(), &args);
        assert_eq!(code, Some(64), "{bin} {args:?}: {said}");
        assert!(said.contains(what) && !said.contains("hunter2"), "{said}");
        assert!(
            took < Duration::from_secs(30),
            "{bin} {args:?} waited {took:?}"
        );
    }
}

/// The scaling signals: once a pool's last worker is gone, its backlog
/// still shows — jobs queued for the tool with no live worker — from the
/// orchestrator's reading of the tools stream (what `ToolPoolEmpty` fires
/// on); a worker that comes back drains it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_workers_shows_its_backlog() {
    use crate::support::{Env, Options};
    let env = Env::start_with(
        serde_json::json!({ "rules": [] }),
        Options {
            workers: vec![],
            tweak: |c| c.catalog_refresh = Duration::from_millis(300),
            ..Options::default()
        },
    )
    .await;
    let defs = support::root().join("tool_definitions");
    let system = || toolfleet_worker_system::worker(&defs).unwrap();
    let worker = env.start_worker(system()).await;
    let tool = "system:current_datetime@1.0.0";
    let gauge = |text: &str, name: &str| -> i64 {
        let prefix = format!("{name}{{tool=\"{tool}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1)
    };
    // (live workers, jobs queued or held): a worker that stopped may have
    // had a pull outstanding, so a job can sit "held" until its ack wait
    // ends; queued and held together are what waits for a worker.
    let until_gauges = |want: (i64, i64)| {
        let env = &env;
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let text = env.metrics_text().await;
                let backlog = gauge(&text, "toolfleet_tool_backlog");
                let held = gauge(&text, "toolfleet_tool_jobs_pending_ack");
                let seen = (gauge(&text, "toolfleet_tool_live_workers"), backlog + held);
                if backlog >= 0 && held >= 0 && seen == want {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "workers/waiting never became {want:?}: {seen:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    until_gauges((1, 0)).await;
    worker.stop().await;
    // Three jobs for the tool, nobody to take them.
    let js = async_nats::jetstream::new(env.client.clone());
    let id: toolfleet_protocol::tools::ToolId = tool.parse().unwrap();
    for n in 0..3 {
        let call = toolfleet_protocol::CallContext {
            invocation: toolfleet_protocol::InvocationContext::new(format!("inv-pool-{n}")),
            call_id: format!("call-{n}"),
            tool_id: id.clone(),
            attempt: 1,
            reply_to: env.subjects.reply_inbox(),
            citation_floor: 0,
            new_call: false,
        };
        js.publish_with_headers(
            env.subjects.tool(&id),
            call.to_headers(),
            serde_json::json!({ "arguments": {} }).to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    until_gauges((0, 3)).await;
    // A worker comes back and drains the queue.
    let worker = env.start_worker(system()).await;
    until_gauges((1, 0)).await;
    worker.stop().await;
}

/// The retrieval worker on PostgreSQL, as production runs it: `toolfleet
/// index migrate` as the tables' owner, the worker under a role with rows
/// only (no CREATE), refused with a clear message before the migration.
/// Its `/readyz` asks the store (a cheap query through the pool), so it is
/// 503 naming the store while PostgreSQL is down and 200 again once it is
/// back, the same process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_of_a_retrieval_worker_follows_postgresql() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let mut postgres = toolfleet_testkit::postgres::PostgresServer::start()
        .expect("PostgreSQL (scripts/ensure-servers installs it)");
    let migrate = || {
        Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(["index", "migrate", "--store", "postgres"])
            .env("TOOLFLEET_POSTGRES_URL", postgres.url())
            .output()
            .unwrap()
    };
    // The worker's role: rows only, and no CREATE anywhere.
    let (admin, connection) = tokio_postgres::connect(&postgres.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    admin
        .batch_execute(
            "CREATE ROLE worker LOGIN;
             REVOKE CREATE ON SCHEMA public FROM PUBLIC;
             ALTER DEFAULT PRIVILEGES IN SCHEMA public
                GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO worker;",
        )
        .await
        .unwrap();
    let worker_url = format!("postgres://worker@127.0.0.1:{}/postgres", postgres.port());
    let port = toolfleet_local::servers::free_port().unwrap();
    let corpus = tempfile::tempdir().unwrap();
    let worker_command = || {
        let mut c = Command::new(support::sibling_bin("toolfleet-worker-retrieval"));
        c.current_dir(support::root())
            .env("TOOLFLEET_NATS_URL", nats.url())
            .env("TOOLFLEET_REDIS_URL", redis.url())
            .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
            .env("TOOLFLEET_STORE", "postgres")
            .env("TOOLFLEET_POSTGRES_URL", &worker_url)
            .env("TOOLFLEET_CORPUS_DIR", corpus.path());
        c
    };

    // Before the migration the worker refuses to start, saying what to run.
    let refused = worker_command().output().unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("toolfleet index migrate"), "{said}");

    // The owner migrates; a second run changes nothing.
    let first = migrate();
    let printed = String::from_utf8_lossy(&first.stdout);
    assert!(
        first.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(
        printed.contains("applied 1:") && printed.contains("schema version"),
        "{printed}"
    );
    let again = migrate();
    let printed = String::from_utf8_lossy(&again.stdout);
    assert!(
        again.status.success() && !printed.contains("applied"),
        "{printed}"
    );

    let mut worker = worker_command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = support::KillOnDrop(&mut worker);
    let ready = format!("http://127.0.0.1:{port}/readyz");
    let body = until(&ready, "ready", |s, _| s == 200).await;
    assert!(body.contains("ok   store"), "{body}");

    tokio::task::block_in_place(|| postgres.stop());
    let body = until(&ready, "unready without PostgreSQL", |s, _| s == 503).await;
    assert!(
        body.contains("FAIL store") && body.contains("ok   nats"),
        "{body}"
    );

    tokio::task::block_in_place(|| postgres.start_again()).unwrap();
    let body = until(&ready, "ready again", |s, _| s == 200).await;
    assert!(body.contains("ok   store"), "{body}");
}
