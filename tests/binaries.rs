//! The production binaries, run as `docker-compose.yml` runs them: separate
//! processes configured by environment variables, each serving `/metrics`,
//! draining on SIGTERM. And the CLI's answers to bad input.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::{self, WAIT};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(bin: &str, env: &[(&str, String)]) -> Proc {
    let mut cmd = Command::new(bin);
    cmd.current_dir(support::root())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().unwrap_or_else(|e| panic!("{bin}: {e}")))
}

async fn scrape(port: u16) -> Option<String> {
    toolfleet_llm::install_crypto_provider();
    let r = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?;
    r.text().await.ok()
}

/// Submits `job` and follows it on a task of its own; returns once the
/// job's `started` event has arrived (an orchestrator is running it).
async fn chat_once_started(
    client: &async_nats::Client,
    subjects: &toolfleet_protocol::Subjects,
    job: &toolfleet_protocol::ChatJob,
) -> tokio::task::JoinHandle<
    Result<toolfleet_protocol::client::ChatOutcome, toolfleet_protocol::client::ClientError>,
> {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let mut started_tx = Some(started_tx);
    let chat = {
        let (client, subjects, job) = (client.clone(), subjects.clone(), job.clone());
        tokio::spawn(async move {
            toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, move |e| {
                if matches!(e.body, toolfleet_protocol::ChatEventBody::Started { .. })
                    && let Some(tx) = started_tx.take()
                {
                    let _ = tx.send(());
                }
            })
            .await
        })
    };
    tokio::time::timeout(WAIT, started_rx)
        .await
        .unwrap()
        .unwrap();
    chat
}

async fn wait_for_metrics(port: u16) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(t) = scrape(port).await {
            return t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no /metrics on {port}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn sigterm(p: &Proc) {
    let _ = Command::new("kill")
        .args(["-TERM", &p.0.id().to_string()])
        .status();
}

fn wait_exit(p: &mut Proc) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(status) = p.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binaries_answer_a_chat_job_serve_metrics_and_drain_on_sigterm() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script =
        toolfleet_scripted::Script::load(&support::root().join("examples/demo-script.json"))
            .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let index = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3)
        .map(|_| toolfleet_local::servers::free_port().unwrap())
        .collect();
    let common = vec![
        ("TOOLFLEET_NATS_URL", nats.url()),
        ("TOOLFLEET_REDIS_URL", redis.url()),
        ("TOOLFLEET_LOG", "warn".to_string()),
    ];
    let with = |extra: Vec<(&'static str, String)>| {
        let mut v = common.clone();
        v.extend(extra);
        v
    };
    let mut procs = vec![
        spawn(
            &support::sibling_bin("toolfleet-orchestrator"),
            &with(vec![
                ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{}", ports[0])),
                ("TOOLFLEET_LLM_BASE_URL", model.base_url().to_string()),
                ("TOOLFLEET_LLM_MODEL", "toolfleet-scripted".into()),
                ("TOOLFLEET_LLM_API_KEY", "sk-binary-test-secret".into()),
                ("TOOLFLEET_DATA_SOURCE", "handbook".into()),
            ]),
        ),
        spawn(
            &support::sibling_bin("toolfleet-worker-system"),
            &with(vec![(
                "TOOLFLEET_METRICS_ADDR",
                format!("127.0.0.1:{}", ports[1]),
            )]),
        ),
        spawn(
            &support::sibling_bin("toolfleet-worker-retrieval"),
            &with(vec![
                ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{}", ports[2])),
                (
                    "TOOLFLEET_INDEX_DIR",
                    index.path().join("idx").display().to_string(),
                ),
            ]),
        ),
    ];
    for p in &ports {
        wait_for_metrics(*p).await;
    }

    // The CLI, as a user runs it, against the fleet of processes. Workers
    // may need a catalog refresh to be seen: retry until the answer cites.
    let deadline = std::time::Instant::now() + WAIT;
    let out = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args([
                "chat",
                "What time is it, and how do lighthouses warn ships?",
            ])
            .env("TOOLFLEET_NATS_URL", nats.url())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() && stdout.contains("References:") {
            break stdout;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no cited answer: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        out.contains("[1]") && out.contains("lighthouses.md"),
        "{out}"
    );
    assert!(
        !out.contains("[doc:"),
        "markers are renumbered for the reader: {out}"
    );

    let orchestrator = scrape(ports[0]).await.unwrap();
    assert!(
        orchestrator.contains("toolfleet_chat_jobs_total{outcome=\"completed\"}"),
        "{orchestrator}"
    );
    let system = scrape(ports[1]).await.unwrap();
    let ok_jobs: f64 = system
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "toolfleet_tool_jobs_total{outcome=\"ok\",tool=\"system:current_datetime@1.0.0\"} ",
            )?
            .parse()
            .ok()
        })
        .unwrap_or(0.0);
    assert!(ok_jobs >= 1.0, "{system}");
    let retrieval = scrape(ports[2]).await.unwrap();
    assert!(
        retrieval.contains(
            "toolfleet_citations_written_total{tool=\"retrieval:search_data_sources@1.0.0\"}"
        ),
        "{retrieval}"
    );
    // The family's own metrics, registered by the SDK beside the runtime's.
    assert!(
        retrieval.contains("toolfleet_retrieval_search_duration_seconds_count 2")
            && retrieval.contains("toolfleet_retrieval_passages_returned_total 8"),
        "{retrieval}"
    );
    for text in [&orchestrator, &system, &retrieval] {
        assert!(!text.contains("sk-binary-test-secret"));
    }

    for p in &procs {
        sigterm(p);
    }
    for p in procs.iter_mut() {
        let status = wait_exit(p);
        assert!(status.success(), "{status}");
    }
    let mut stderr = String::new();
    for p in procs.iter_mut() {
        if let Some(mut e) = p.0.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
    }
    assert!(
        !stderr.contains("sk-binary-test-secret"),
        "the key never reaches the logs"
    );
}

fn toolfleet(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .current_dir(support::root())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn tools_commands_list_show_and_validate() {
    let out = toolfleet(&["tools", "list"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("system:current_datetime@1.0.0")
            && text.contains("retrieval:search_data_sources@1.0.0"),
        "{text}"
    );

    let out = toolfleet(&["tools", "show", "search_data_sources"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("Responses shape")
            && text.contains("\"type\": \"function\""),
        "{text}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"schemaVersion": 1, "id": "nope"}"#).unwrap();
    let out = toolfleet(&[
        "tools",
        "validate",
        bad.to_str().unwrap(),
        "tool_definitions",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL") && text.contains("bad.json"), "{text}");
    assert!(
        text.contains(
            "ok   tool_definitions/system.current_datetime.json (system:current_datetime@1.0.0)"
        ),
        "{text}"
    );
    assert!(text.contains("21 file(s), 1 broken"), "{text}");

    // A directory with several broken files: every one is reported in one
    // run, a repeated id included, and the good ones too.
    let defs = tempfile::tempdir().unwrap();
    support::copy_definitions(
        &support::root().join("tool_definitions"),
        defs.path(),
        "system.",
    );
    support::copy_definitions(
        &support::root().join("tool_definitions"),
        defs.path(),
        "web.",
    );
    std::fs::write(defs.path().join("a-bad.json"), "{ not json").unwrap();
    std::fs::write(defs.path().join("b-bad.json"), r#"{"schemaVersion": 1}"#).unwrap();
    std::fs::copy(
        defs.path().join("system.current_datetime.json"),
        defs.path().join("z-again.json"),
    )
    .unwrap();
    let out = toolfleet(&[
        "tools",
        "validate",
        defs.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let broken: Vec<&str> = rows
        .iter()
        .filter(|r| r["ok"] == false)
        .map(|r| r["path"].as_str().unwrap().rsplit('/').next().unwrap())
        .collect();
    assert_eq!(
        broken,
        ["a-bad.json", "b-bad.json", "z-again.json"],
        "{rows:#?}"
    );
    let again = rows
        .iter()
        .find(|r| r["path"].as_str().unwrap().ends_with("z-again.json"))
        .unwrap();
    assert!(
        again["error"]
            .as_str()
            .unwrap()
            .contains("system.current_datetime.json"),
        "the repeat names the first holder: {again}"
    );
    assert_eq!(
        rows.iter().filter(|r| r["ok"] == true).count(),
        3,
        "{rows:#?}"
    );
}

/// `toolfleet tools search` scores and sorts the shipped definitions, as
/// text or JSON, and exits 1 when nothing matches.
#[test]
fn tools_search_ranks_the_definitions() {
    let out = toolfleet(&["tools", "search", "search_data_sources", "-o", "json"]);
    assert!(out.status.success());
    let hits: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        hits[0]["id"], "retrieval:search_data_sources@1.0.0",
        "{hits}"
    );
    assert_eq!(hits[0]["score"], 100, "{hits}");

    // A tag of one, a substring of the other's name: the name ranks first.
    let out = toolfleet(&["tools", "search", "time", "-o", "json"]);
    let hits: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hits[0]["id"], "system:current_datetime@1.0.0", "{hits}");
    assert_eq!(hits[0]["score"], 60, "{hits}");

    let out = toolfleet(&["tools", "search", "citations"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(" 50  retrieval:search_data_sources@1.0.0"),
        "{text}"
    );
    let out = toolfleet(&["tools", "search", "zebra"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
}

/// `toolfleet tools list` reads the definitions directory through the
/// registry: a table with a header, or JSON with each tool's kind,
/// purpose, category and title (and nothing of live workers).
#[test]
fn tools_list_shows_the_definitions_as_text_or_json() {
    let out = toolfleet(&["tools", "list", "-o", "json"]);
    assert!(out.status.success());
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "content:generate_chart@1.0.0",
            "content:generate_image@1.0.0",
            "llm:clarify@1.0.0",
            "llm:classify@1.0.0",
            "llm:fact_extract@1.0.0",
            "llm:score@1.0.0",
            "llm:structure@1.0.0",
            "llm:summarize@1.0.0",
            "retrieval:entity_lookup@1.0.0",
            "retrieval:list_documents@1.0.0",
            "retrieval:read_document@1.0.0",
            "retrieval:read_tabular_data@1.0.0",
            "retrieval:retrieve_event_context@1.0.0",
            "retrieval:retrieve_knowledge_context@1.0.0",
            "retrieval:retrieve_profile_context@1.0.0",
            "retrieval:search_data_sources@1.0.0",
            "retrieval:search_documents@1.0.0",
            "system:current_datetime@1.0.0",
            "web:read_page@1.0.0",
            "web:search@1.0.0"
        ],
        "in id order"
    );
    let datetime = &rows[17];
    assert_eq!(datetime["kind"], "selectable", "{datetime}");
    assert_eq!(datetime["purpose"], "general", "{datetime}");
    assert_eq!(datetime["category"], "utility", "{datetime}");
    assert_eq!(datetime["title"], "Current date and time", "{datetime}");
    assert!(datetime.get("workers").is_none(), "{datetime}");

    // `find` filters: namespace, id prefix, category (each narrows).
    for (flags, want) in [
        (
            &["--namespace", "system"][..],
            vec!["system:current_datetime@1.0.0"],
        ),
        (
            &["--id-prefix", "retrieval:search"][..],
            vec![
                "retrieval:search_data_sources@1.0.0",
                "retrieval:search_documents@1.0.0",
            ],
        ),
        (
            &["--category", "utility"][..],
            vec!["system:current_datetime@1.0.0"],
        ),
        (
            &["--tag", "clock"][..],
            vec!["system:current_datetime@1.0.0"],
        ),
        (&["--namespace", "nothing"][..], vec![]),
    ] {
        let mut args = vec!["tools", "list", "-o", "json"];
        args.extend_from_slice(flags);
        let out = toolfleet(&args);
        assert!(out.status.success(), "{flags:?}");
        let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ids: Vec<&str> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, want, "{flags:?}");
    }

    // A tool that is not selectable is a system tool.
    let dir = tempfile::tempdir().unwrap();
    let mut hidden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            support::root().join("tool_definitions/system.current_datetime.json"),
        )
        .unwrap(),
    )
    .unwrap();
    hidden["selectable"] = false.into();
    hidden.as_object_mut().unwrap().remove("$schema");
    std::fs::write(dir.path().join("hidden.json"), hidden.to_string()).unwrap();
    let out = toolfleet(&[
        "tools",
        "list",
        "--tool-definitions",
        dir.path().to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("KIND") && lines[0].ends_with("TITLE"),
        "{text}"
    );
    let columns: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        columns[..4],
        [
            "system:current_datetime@1.0.0",
            "system",
            "general",
            "utility"
        ],
        "{text}"
    );
    // The live listing's flags need --live.
    let out = toolfleet(&["tools", "list", "--wait-ms", "10"]);
    assert_eq!(out.status.code(), Some(64));
}

/// `toolfleet tools list --live` asks the running fleet which workers serve
/// what (a worker process here), and sees the worker leave; `tools search
/// --live` searches the same live tools; another fleet's prefix sees none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_list_live_shows_what_the_fleets_workers_serve() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut worker = spawn(
        &support::sibling_bin("toolfleet-worker-system"),
        &[
            ("TOOLFLEET_NATS_URL", nats.url()),
            ("TOOLFLEET_REDIS_URL", redis.url()),
            ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}")),
            ("TOOLFLEET_LOG", "warn".into()),
        ],
    );
    wait_for_metrics(port).await;
    let url = nats.url();
    let live = |extra: &[&str]| {
        let mut args = vec![
            "tools",
            "list",
            "--live",
            "--nats-url",
            &url,
            "--nats-connect-wait",
            "5",
        ];
        args.extend_from_slice(extra);
        toolfleet(&args)
    };

    // The worker may still be advertising: ask until it is seen.
    let deadline = std::time::Instant::now() + WAIT;
    let rows = loop {
        let out = live(&["-o", "json"]);
        if out.status.success() {
            let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            break rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's tools never showed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let datetime = &rows[0];
    assert_eq!(
        datetime["id"], "system:current_datetime@1.0.0",
        "{datetime}"
    );
    assert!(datetime["workers"].as_u64().unwrap() >= 1, "{datetime}");
    assert_eq!(
        datetime["families"],
        serde_json::json!(["system"]),
        "{datetime}"
    );
    assert_eq!(datetime["delivery"], "jetstream", "{datetime}");
    assert_eq!(datetime["kind"], "selectable", "{datetime}");
    assert_eq!(datetime["category"], "utility", "{datetime}");

    let out = live(&[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let columns: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        columns,
        [
            "system:current_datetime@1.0.0",
            "1",
            "system",
            "jetstream",
            "selectable"
        ],
        "{text}"
    );

    // Search reads the same live tools (the retrieval tool is defined in
    // the directory, but no worker serves it).
    let search = |query: &str| {
        toolfleet(&[
            "tools",
            "search",
            query,
            "--live",
            "--nats-url",
            &url,
            "-o",
            "json",
        ])
    };
    let out = search("datetime");
    assert!(out.status.success());
    let hits: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hits[0]["id"], "system:current_datetime@1.0.0", "{hits}");
    assert_eq!(hits[0]["workers"], 1, "{hits}");
    assert_eq!(search("search_data_sources").status.code(), Some(1));

    // Another fleet on the same server serves nothing.
    let out = live(&["--subject-prefix", "other"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no live tools"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The worker dies: its tools leave the listing.
    let _ = worker.0.kill();
    let _ = worker.0.wait();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let out = live(&["-o", "json"]);
        if out.status.code() == Some(1) {
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("no live tools"),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(rows, serde_json::json!([]));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the dead worker's tools are still listed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn bad_configuration_exits_64_and_every_binary_documents_its_settings() {
    let out = toolfleet(&["chat"]);
    assert_eq!(out.status.code(), Some(64));
    // A tenant that cannot be a subject token, before any connection.
    let out = toolfleet(&["chat", "hi", "--tenant", "a.b"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tenant \"a.b\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A relay prefix no job may be given, before anything starts.
    let out = toolfleet(&["up", "--relay-allow", "$JS.API"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--relay-allow"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for sub in [
        &["up"][..],
        &["demo"],
        &["bench"],
        &["chat"],
        &["tools", "list"],
        &["ingest"],
        &["index", "search"],
        &["blob", "get"],
        &["scripted-model"],
    ] {
        let mut args = sub.to_vec();
        args.push("--help");
        let out = toolfleet(&args);
        assert!(
            out.status.success(),
            "toolfleet {sub:?} --help: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (bin, must) in [
        (
            &support::sibling_bin("toolfleet-orchestrator"),
            &[
                "TOOLFLEET_NATS_URL",
                "TOOLFLEET_REDIS_URL",
                "TOOLFLEET_LLM_BASE_URL",
                "TOOLFLEET_LLM_API_KEY",
                "TOOLFLEET_METRICS_ADDR",
            ][..],
        ),
        (
            &support::sibling_bin("toolfleet-worker-system"),
            &[
                "TOOLFLEET_NATS_URL",
                "TOOLFLEET_REDIS_URL",
                "TOOLFLEET_CONCURRENCY",
                "TOOLFLEET_TOOL_DEFINITIONS",
                "TOOLFLEET_METRICS_ADDR",
            ][..],
        ),
        (
            &support::sibling_bin("units-worker"),
            &[
                "TOOLFLEET_NATS_URL",
                "TOOLFLEET_REDIS_URL",
                "TOOLFLEET_METRICS_ADDR",
            ][..],
        ),
        (
            &support::sibling_bin("toolfleet-worker-retrieval"),
            &[
                "TOOLFLEET_INDEX_DIR",
                "TOOLFLEET_CORPUS_DIR",
                "TOOLFLEET_METRICS_ADDR",
            ][..],
        ),
    ] {
        let out = Command::new(bin).arg("--help").output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        for m in must {
            assert!(help.contains(m), "{bin} --help lacks {m}");
        }
        let out = Command::new(bin)
            .args(["--metrics-addr", "not-an-address"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{bin}");
        // Errors found after parsing are configuration errors too.
        let out = Command::new(bin)
            .args(["--subject-prefix", "a b"])
            .current_dir(support::root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{bin}: {err}");
        assert!(err.contains("subject prefix"), "{err}");
    }
}

/// `toolfleet blob get` reads back the bytes a tool stored: to a file with
/// `-o`, to stdout when it is a pipe; a blob that is gone exits 1, a
/// malformed URI 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_get_writes_a_stored_blob_to_a_file() {
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let store = tokio::time::timeout(
        WAIT,
        toolfleet_store::CitationStore::connect(&redis.url(), "acme.tf", Duration::from_secs(600)),
    )
    .await
    .unwrap()
    .unwrap();
    let png: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    // Of the default tenant (what `--tenant` defaults to).
    let inv = toolfleet_store::InvocationKey::new("default", "inv-7");
    tokio::time::timeout(WAIT, store.put_blob(inv, "call-3.1", "image/png", &png))
        .await
        .unwrap()
        .unwrap();
    let uri = toolfleet_protocol::blob::BlobUri::new("inv-7", "call-3.1")
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.png");
    let url = redis.url();
    let get = |uri: &str, extra: &[&str]| {
        let mut args = vec![
            "blob",
            "get",
            uri,
            "--redis-url",
            &url,
            "--subject-prefix",
            "acme.tf",
        ];
        args.extend_from_slice(extra);
        toolfleet(&args)
    };

    let out = get(&uri, &["-o", file.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), png);
    assert!(err.contains("70000 bytes of image/png"), "{err}");
    // To stdout, which is a pipe here.
    let out = get(&uri, &[]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, png);

    // Gone (never stored, or expired): 1, and the file is not touched.
    let missing = toolfleet_protocol::blob::BlobUri::new("inv-7", "call-3.2")
        .unwrap()
        .to_string();
    let other = dir.path().join("missing.png");
    let out = get(&missing, &["-o", other.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no blob at") && err.contains("expired"),
        "{err}"
    );
    assert!(!other.exists());
    // Another fleet's prefix sees nothing either.
    let out = toolfleet(&["blob", "get", &uri, "--redis-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    // Nor does another tenant's invocation of the same id.
    let out = get(&uri, &["--tenant", "acme"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());

    // Malformed: 64, before any connection.
    for bad in [
        "inv-7/call-3.1",
        "toolfleet-blob:inv-7",
        "toolfleet-blob:inv 7/c.1",
    ] {
        let out = toolfleet(&["blob", "get", bad, "--redis-url", "redis://127.0.0.1:1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{bad}: {err}");
        assert!(err.contains("malformed blob URI"), "{err}");
    }
}

#[test]
fn chat_against_a_dead_server_fails_clearly() {
    let port = toolfleet_local::servers::free_port().unwrap();
    let out = toolfleet(&[
        "chat",
        "hi",
        "--nats-url",
        &format!("nats://127.0.0.1:{port}"),
        "--nats-connect-wait",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to NATS"), "{err}");
}

/// `toolfleet up` runs the whole fleet in one process from a profiles file
/// (`--config`), as a developer runs it — on a NATS server that wants a
/// user and password, which every part of the fleet logs in with (the
/// NATS flags reach them all, not only the URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn toolfleet_up_serves_chat_jobs_from_a_profiles_file() {
    let nats = toolfleet_local::servers::NatsServer::start_configured(
        toolfleet_local::servers::NatsConfig {
            extra: Some("authorization { user: up, password: up-secret }\n".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let with_identity = nats.url().replacen("nats://", "nats://up:up-secret@", 1);
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script =
        toolfleet_scripted::Script::load(&support::root().join("examples/demo-script.json"))
            .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        format!(
            "default_profile = \"default\"\n[deployments.stand-in]\napi = \"responses\"\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n[profiles.default]\ndeployment = \"stand-in\"\ndata_source = \"handbook\"\n",
            model.base_url()
        ),
    )
    .unwrap();
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolfleet"));
    cmd.arg("up")
        .current_dir(support::root())
        .env("TOOLFLEET_NATS_URL", nats.url())
        .env("TOOLFLEET_NATS_USER", "up")
        .env("TOOLFLEET_NATS_PASSWORD", "up-secret")
        .env("TOOLFLEET_REDIS_URL", redis.url())
        .env("TOOLFLEET_CONFIG", &config)
        .env("TOOLFLEET_INDEX_DIR", dir.path().join("index"))
        .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
        .env("TOOLFLEET_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut up = Proc(cmd.spawn().unwrap());
    wait_for_metrics(port).await;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(["chat", "How do honeybees find their way back to the hive?"])
            .env("TOOLFLEET_NATS_URL", &with_identity)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() && stdout.contains("honeybees.md") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no answer: {stdout}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        model
            .received()
            .iter()
            .all(|r| r.path.ends_with("/responses")),
        "the profile's API shape was used"
    );
    // Ready, and it says what it checked: NATS, Redis, each worker's
    // consumers — the web worker's too (`up` starts every family).
    let ready = reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let said = ready.text().await.unwrap();
    for check in [
        "ok   nats",
        "ok   redis",
        "ok   consumers of system",
        "ok   consumers of retrieval",
        "ok   consumers of web",
    ] {
        assert!(said.contains(check), "{check}: {said}");
    }
    sigterm(&up);
    assert!(wait_exit(&mut up).success());
}

/// SIGTERM with a chat job in flight: the process stops taking work,
/// finishes the job (its client gets `completed`), then exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_job_in_flight() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(
        r#"{"rules": [{"whenUserContains": ["slow"], "steps": [
            {"fault": {"kind": "slowFirstToken", "delayMs": 1500}, "answer": "Worth the wait."}
        ]}]}"#,
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolfleet"));
    cmd.arg("up")
        .current_dir(support::root())
        .env("TOOLFLEET_NATS_URL", nats.url())
        .env("TOOLFLEET_REDIS_URL", redis.url())
        .env("TOOLFLEET_LLM_BASE_URL", model.base_url().as_str())
        .env("TOOLFLEET_LLM_MODEL", "toolfleet-scripted")
        .env("TOOLFLEET_INDEX_DIR", dir.path().join("index"))
        .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
        .env("TOOLFLEET_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut up = Proc(cmd.spawn().unwrap());
    wait_for_metrics(port).await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let job = toolfleet_protocol::client::question("a slow question");
    let chat = chat_once_started(&client, &subjects, &job).await;
    sigterm(&up);
    let outcome = tokio::time::timeout(WAIT, chat)
        .await
        .unwrap()
        .unwrap()
        .expect("the job in flight completes");
    assert_eq!(outcome.text, "Worth the wait.");
    assert!(wait_exit(&mut up).success());
}

/// A worker pool that dies after its tool call was dispatched: the call is
/// answered `no_worker` once the catalog has missed the pool twice, not
/// after the tool's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_dies_mid_call_is_noticed_before_the_timeout() {
    let script = serde_json::json!({
        "rules": [{ "whenUserContains": ["honeybee"], "steps": [
            { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "honeybee waggle dance" } } ] },
            { "answer": "Bees: {{tool:search_data_sources}}" }
        ] }]
    });
    let env = support::Env::start_with(
        script,
        support::Options {
            workers: vec!["system"],
            ..Default::default()
        },
    )
    .await;
    let index = tempfile::tempdir().unwrap();
    let (mut worker, _) = spawn_retrieval(&env, index.path(), &[]).await;
    // Served while the pool lives (the catalog may need a refresh first).
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, outcome) = env.ask("How do honeybees navigate?").await;
        if outcome.is_ok_and(|o| !o.references.is_empty()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the retrieval pool never answered"
        );
    }
    // The pool dies without a goodbye; its tool's timeout is 10 s.
    let _ = worker.0.kill();
    let _ = worker.0.wait();
    let (_, outcome) = env.ask("How do honeybees navigate?").await;
    let outcome = outcome.expect("the loop goes on without the tool");
    let codes: Vec<Option<String>> = outcome
        .events
        .iter()
        .filter_map(|e| match &e.body {
            toolfleet_protocol::ChatEventBody::ToolResult { error_code, .. } => {
                Some(error_code.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(codes, vec![Some("no_worker".to_string())]);
}

/// An orchestrator killed mid-job (SIGKILL: no drain, no ack) loses
/// nothing, and not for long: the job comes back after the chat consumer's
/// short ack wait and another orchestrator finishes it, well inside the
/// client's wait (before the ack wait was shortened, a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_orchestrators_job_is_finished_by_another() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(
        r#"{"rules": [{"whenUserContains": ["slow"], "steps": [
            {"fault": {"kind": "slowFirstToken", "delayMs": 1500}, "answer": "Finished elsewhere."}
        ]}]}"#,
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let orchestrator = |port: u16| {
        spawn(
            &support::sibling_bin("toolfleet-orchestrator"),
            &[
                ("TOOLFLEET_NATS_URL", nats.url()),
                ("TOOLFLEET_REDIS_URL", redis.url()),
                ("TOOLFLEET_LLM_BASE_URL", model.base_url().to_string()),
                ("TOOLFLEET_LLM_MODEL", "toolfleet-scripted".into()),
                ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}")),
                ("TOOLFLEET_LOG", "warn".into()),
            ],
        )
    };
    let first_port = toolfleet_local::servers::free_port().unwrap();
    let mut first = orchestrator(first_port);
    wait_for_metrics(first_port).await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let job = toolfleet_protocol::client::question("a slow question");
    let chat = chat_once_started(&client, &subjects, &job).await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();

    let second_port = toolfleet_local::servers::free_port().unwrap();
    let _second = orchestrator(second_port);
    let outcome = tokio::time::timeout(WAIT, chat)
        .await
        .unwrap()
        .unwrap()
        .expect("another orchestrator finishes the job");
    assert_eq!(outcome.text, "Finished elsewhere.");
}

/// `toolfleet-orchestrator --tool-compat FILE`: a file that does not parse
/// stops the start at once (exit 64), naming the file and the field.
#[test]
fn a_bad_tool_compat_file_stops_the_orchestrator_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("compat.json");
    std::fs::write(&path, r#"{"tools": {"units:convert": ["not a model"]}}"#).unwrap();
    let out = Command::new(support::sibling_bin("toolfleet-orchestrator"))
        .args(["--tool-compat", path.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("compat.json"), "{err}");
    assert!(err.contains("units:convert"), "{err}");
}

/// `toolfleet ingest` as an operator runs it: a directory with good and
/// bad files goes in (the bad ones reported, exit 2), re-ingesting a
/// changed file replaces its chunks, and `toolfleet index search` finds
/// what went in (tantivy; the PostgreSQL backend passes the same store
/// suite in the retrieval crate).
#[test]
fn toolfleet_ingest_reports_bad_files_and_reingests_atomically() {
    let root = tempfile::tempdir().unwrap();
    let docs = root.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(
        docs.join("hives.md"),
        "# Hives\n\nA langstroth hive has frames.\n",
    )
    .unwrap();
    std::fs::write(
        docs.join("page.html"),
        "<title>Smoker</title><p>Use a smoker &amp; veil.</p>",
    )
    .unwrap();
    std::fs::write(docs.join("binary.txt"), b"\0\x01\x02 not text").unwrap();
    std::fs::write(docs.join("ragged.csv"), "a,b\n1\n2,3,4\n").unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.md"), "secret").unwrap();
    let index = root.path().join("index");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .current_dir(root.path())
            .env("TOOLFLEET_INDEX_DIR", &index)
            .args(args)
            .output()
            .unwrap()
    };
    let secret = outside.path().join("secret.md");
    let out = run(&[
        "ingest",
        "docs",
        secret.to_str().unwrap(),
        "--collection",
        "kb",
        "--chunk-tokens",
        "64",
        "--chunk-overlap",
        "8",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with(
            "ingested 3 documents (3 chunks) and 0 context items into \"kb\" (tantivy)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("; 2 skipped"), "{stdout}");
    assert!(
        stderr.contains("binary.txt: binary content (a NUL byte)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("secret.md: outside the allowed roots"),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning") && stderr.contains("ragged.csv"),
        "{stderr}"
    );

    let search = |query: &str| {
        let out = run(&["index", "search", query, "--collection", "kb"]);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    assert!(search("langstroth").contains("kb:hives.md#0"));
    assert!(search("smoker veil").contains("kb:page.html#0"));
    let out = run(&[
        "index",
        "search",
        "langstroth",
        "--collection",
        "kb",
        "-o",
        "json",
    ]);
    assert!(out.status.success());
    let hits: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(hits[0]["id"], "kb:hives.md#0", "{hits:#?}");
    assert_eq!(hits[0]["collection"], "kb");
    assert!(hits[0]["score"].as_f64().unwrap() > 0.0);
    std::fs::write(
        docs.join("hives.md"),
        "# Hives\n\nA top-bar hive has bars.\n",
    )
    .unwrap();
    let out = run(&["ingest", "docs/hives.md", "--collection", "kb"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        search("langstroth").trim().is_empty(),
        "the old chunk is gone"
    );
    assert!(search("top-bar").contains("kb:hives.md#0"));
    assert!(
        stdout.contains("as tenant \"default\""),
        "no --tenant on a store of no other tenant: default; {stdout}"
    );
    // Another tenant's copy of the same file: its own, beside default's.
    std::fs::write(
        docs.join("hives.md"),
        "# Hives\n\nAcme keeps warre hives.\n",
    )
    .unwrap();
    let out = run(&[
        "ingest",
        "docs/hives.md",
        "--collection",
        "kb",
        "--tenant",
        "acme",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("as tenant \"acme\""), "{stdout}");
    // Now the store holds two tenants: --tenant is required, for ingest
    // and search alike.
    for args in [
        &["ingest", "docs/hives.md", "--collection", "kb"][..],
        &["index", "search", "warre", "--collection", "kb"][..],
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}");
        assert!(
            stderr.contains("tenants acme, default") && stderr.contains("--tenant"),
            "{args:?}: {stderr}"
        );
    }
    let as_tenant = |query: &str, tenant: &str| {
        let out = run(&[
            "index",
            "search",
            query,
            "--collection",
            "kb",
            "--tenant",
            tenant,
        ]);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    assert!(as_tenant("warre", "acme").contains("kb:hives.md#0"));
    assert!(as_tenant("warre", "default").trim().is_empty());
    assert!(as_tenant("top-bar", "default").contains("kb:hives.md#0"));
    assert!(as_tenant("top-bar", "acme").trim().is_empty());
    // A bad chunking is refused before anything is read.
    let out = run(&[
        "ingest",
        "docs",
        "--collection",
        "kb",
        "--chunk-tokens",
        "10",
        "--chunk-overlap",
        "10",
    ]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be smaller than the chunk size"));
}

/// A retrieval worker process on `env`'s servers, its index in `index`,
/// with `extra` settings; returns it and its metrics port once it serves.
async fn spawn_retrieval(
    env: &support::Env,
    index: &std::path::Path,
    extra: &[(&str, String)],
) -> (Proc, u16) {
    let port = toolfleet_local::servers::free_port().unwrap();
    let mut settings = vec![
        ("TOOLFLEET_NATS_URL", env.nats.url()),
        ("TOOLFLEET_REDIS_URL", env.redis.url()),
        (
            "TOOLFLEET_INDEX_DIR",
            index.join("idx").display().to_string(),
        ),
        ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("TOOLFLEET_LOG", "warn".into()),
    ];
    settings.extend(extra.iter().cloned());
    let worker = spawn(
        &support::sibling_bin("toolfleet-worker-retrieval"),
        &settings,
    );
    wait_for_metrics(port).await;
    (worker, port)
}

/// The retrieval binary with an embeddings endpoint (the scripted server's
/// `/v1/embeddings`): the corpus it seeds is embedded in batches, each
/// search embeds its query and is answered hybrid, the key goes only in
/// the Authorization header and never into the worker's metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retrieval_binary_embeds_its_corpus_and_queries_when_configured() {
    let script = serde_json::json!({
        "rules": [{ "whenUserContains": ["honeybee"], "steps": [
            { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "honeybee waggle dance" } } ] },
            { "answer": "Bees: {{tool:search_data_sources}}" }
        ] }]
    });
    let env = support::Env::start_with(
        script,
        support::Options {
            workers: vec!["system"],
            ..Default::default()
        },
    )
    .await;
    let index = tempfile::tempdir().unwrap();
    let key = "sk-embeddings-canary-42";
    let embeddings_url = env.model.base_url().join("v1").unwrap().to_string();
    let (mut worker, port) = spawn_retrieval(
        &env,
        index.path(),
        &[
            ("TOOLFLEET_EMBEDDINGS_BASE_URL", embeddings_url),
            ("TOOLFLEET_EMBEDDINGS_MODEL", "scripted-embedding".into()),
            ("TOOLFLEET_EMBEDDINGS_API_KEY", key.into()),
        ],
    )
    .await;
    let deadline = std::time::Instant::now() + WAIT;
    let outcome = loop {
        let (_, outcome) = env.ask("How do honeybees navigate?").await;
        if let Some(o) = outcome.ok().filter(|o| !o.references.is_empty()) {
            break o;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the retrieval pool never answered"
        );
    };
    assert!(outcome.text.contains("[doc:"), "{}", outcome.text);
    let embeddings: Vec<_> = env
        .model
        .received()
        .into_iter()
        .filter(|r| r.path == "/v1/embeddings")
        .collect();
    // The seeded corpus (several chunks per request), then the query.
    let inputs = |r: &toolfleet_scripted::Received| r.body["input"].as_array().map_or(0, Vec::len);
    assert!(
        embeddings.iter().any(|r| inputs(r) > 1),
        "the corpus was not embedded in batches"
    );
    assert!(
        embeddings
            .iter()
            .any(|r| r.body["input"][0] == "honeybee waggle dance"),
        "the query was not embedded"
    );
    for r in &embeddings {
        let auth = r
            .headers
            .iter()
            .find(|(name, _)| name == "authorization")
            .map(|(_, v)| v.as_str());
        assert_eq!(auth, Some(format!("Bearer {key}").as_str()));
        assert_eq!(r.body["model"], "scripted-embedding");
    }
    let metrics = scrape(port).await.unwrap();
    assert!(!metrics.contains(key));
    let _ = worker.0.kill();
    let _ = worker.0.wait();
    let mut log = String::new();
    if let Some(mut stderr) = worker.0.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
    }
    assert!(!log.contains(key), "{log}");
}

/// Every flag a `--help` lists does what it says: the MCP worker's tools
/// are its servers', so it neither lists `--tool-definitions` nor takes it
/// on the command line (exit 64, saying why); the other workers list it.
#[test]
fn the_mcp_worker_offers_no_tool_definitions_flag() {
    let mcp = support::sibling_bin("toolfleet-worker-mcp");
    let help = Command::new(&mcp).arg("--help").output().unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--mcp-config"), "{text}");
    assert!(!text.contains("--tool-definitions"), "{text}");
    let refused = Command::new(&mcp)
        .args(["--tool-definitions", "/tmp", "--mcp-config", "/nonexistent"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(64));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("takes no --tool-definitions"), "{said}");
    let system = Command::new(support::sibling_bin("toolfleet-worker-system"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&system.stdout).contains("--tool-definitions"));
}
