//! The real Prometheus server scrapes the fleet, and every query of the
//! shipped Grafana dashboard (`ops/grafana/dashboards/toolfleet.json`)
//! returns data there; the alert rules (`ops/prometheus/alerts.yml`) load,
//! evaluate without error, and read only metrics the fleet exports.
//!
//! Needs `/usr/bin/prometheus` (Debian package `prometheus`;
//! `scripts/ensure-servers` and `.ci/run` install it). Run on its own with
//! `cargo nextest run --test fleet prometheus`.
//!
//! Scrape jobs. The dashboard and the alerts use the job names of
//! `ops/prometheus/prometheus.yml` (`toolfleet-orchestrator`,
//! `toolfleet-worker-system`, `toolfleet-worker-retrieval`). The test fleet
//! runs all three in one process with one metrics address, so the generated
//! config scrapes that one target under each of the three job names: the
//! orchestrator job keeps every series, the two worker jobs drop the
//! `toolfleet_*` samples (`metric_relabel_configs`) and only give their
//! `up{job=...}` series. Sums over the fleet are therefore not tripled.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use toolfleet_protocol::{CallContext, InvocationContext};

use crate::support::{Env, Options, WAIT, next_json, root};

/// Grafana's built-in variables, as Grafana would expand them for a
/// 15-second scrape interval (the compose datasource's `timeInterval`).
const GRAFANA_VARIABLES: &[(&str, &str)] = &[
    ("${__rate_interval}", "1m"),
    ("$__rate_interval", "1m"),
    ("${__interval}", "15s"),
    ("$__interval", "15s"),
    ("${__range}", "1h"),
    ("$__range", "1h"),
];

/// Every dashboard query must return data within this after the traffic.
const DATA_WITHIN: Duration = Duration::from_secs(20);
const READY_WITHIN: Duration = Duration::from_secs(15);

const INSTALL: &str = "install the Debian package: `sudo apt-get install -y prometheus` \
(scripts/ensure-servers and .ci/run do it), or put a Prometheus 2.x/3.x `prometheus` binary on PATH";

/// One chat job per series the dashboard needs; see `traffic`.
fn script() -> Value {
    json!({
        "rules": [
            { "whenUserContains": ["lighthouse"], "steps": [
                { "toolCalls": [
                    { "name": "current_datetime", "arguments": {} },
                    { "name": "search_data_sources", "arguments": { "query": "lighthouse fog signals warn ships", "topK": 3 } }
                ] },
                { "answer": "It is {{tool:current_datetime}}. Lighthouses: {{tool:search_data_sources}}" }
            ] },
            { "whenUserContains": ["bees"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "bees", "topK": 50 } } ] },
                { "answer": "The search failed: {{tool:search_data_sources}}" }
            ] },
            { "whenUserContains": ["rocket"], "steps": [
                { "toolCalls": [ { "name": "launch_rockets", "arguments": { "count": 3 } } ] },
                { "answer": "Could not: {{tool:launch_rockets}}" }
            ] },
            { "whenUserContains": ["flaky"], "steps": [
                { "fault": { "kind": "status", "status": 500, "times": 1 }, "answer": "Second time lucky." }
            ] },
            { "whenUserContains": ["tides"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "tides moon sun sourdough bread yeast lighthouse bees rust", "topK": 10 } } ] },
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "moon" } } ] },
                { "answer": "Tides: {{tool:search_data_sources}}" }
            ] },
            { "whenUserContains": ["sourdough"], "steps": [
                { "fault": { "kind": "length", "times": 1 }, "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "sourdough starter", "topK": 3 } } ] },
                { "answer": "Sourdough: {{tool:search_data_sources}}" }
            ] }
        ]
    })
}

/// A price for the stand-in model (cost series), quick model retries, and a
/// `tight` profile whose limits the `tides` job hits.
const PROFILES: &str = r#"
default_profile = "default"

[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
retry = { base_delay_ms = 20, max_delay_ms = 100 }

[profiles.default]
deployment = "scripted"

# Nothing listens on port 9 (discard) of loopback: connection refused,
# and the `failover` profile falls back to the scripted model.
[deployments.dead]
base_url = "http://127.0.0.1:9/v1"
model = "toolfleet-scripted"
retry = { max_attempts = 1 }

[profiles.failover]
deployments = ["dead", "scripted"]

[profiles.tight]
deployment = "scripted"
[profiles.tight.policy]
max_rounds = 2
max_tool_result_tokens = 64

[prices."toolfleet-scripted"]
input = 0.15
cached_input = 0.075
output = 0.60
"#;

/// A `prometheus` child process on a free loopback port, killed on drop.
struct Prometheus {
    child: Option<Child>,
    base: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn prometheus_binary() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("prometheus"))
                .find(|p| p.is_file())
        })
        .or_else(|| Some(PathBuf::from("/usr/bin/prometheus")).filter(|p| p.is_file()))
        .unwrap_or_else(|| panic!("`prometheus` was not found on PATH or at /usr/bin: {INSTALL}"))
}

impl Prometheus {
    /// Scrapes `target` every second under the three fleet job names and
    /// evaluates `alerts` every second.
    fn start(target: SocketAddr, alerts: &Path) -> Prometheus {
        let binary = prometheus_binary();
        let dir = tempfile::tempdir().unwrap();
        let port = toolfleet_local::servers::free_port().unwrap();
        // JSON strings are YAML strings: any path quotes safely.
        let alerts = serde_json::to_string(&alerts.display().to_string()).unwrap();
        let target = serde_json::to_string(&target.to_string()).unwrap();
        let worker_job = |name: &str| {
            format!(
                "  - job_name: {name}\n    static_configs:\n      - targets: [{target}]\n    \
                 metric_relabel_configs:\n      - source_labels: [__name__]\n        \
                 regex: \"toolfleet_.*\"\n        action: drop\n"
            )
        };
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {alerts}\n\
             scrape_configs:\n  - job_name: toolfleet-orchestrator\n    static_configs:\n      - targets: [{target}]\n{}{}",
            worker_job("toolfleet-worker-system"),
            worker_job("toolfleet-worker-retrieval"),
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = dir.path().join("prometheus.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(&binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}; {INSTALL}", binary.display()));
        Prometheus {
            child: Some(child),
            base: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Polls `GET /-/ready` until it answers 200, the process exits, or the
    /// deadline passes.
    async fn wait_ready(&mut self, http: &reqwest::Client) {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("prometheus exited with {status}:\n{}", self.log());
            }
            if let Ok(r) = http.get(format!("{}/-/ready", self.base)).send().await
                && r.status().is_success()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus was not ready within {READY_WITHIN:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `GET /api/v1/...` → the `data` of a successful answer, or the
    /// server's error.
    async fn api(
        &self,
        http: &reqwest::Client,
        path: &str,
        params: &[(&str, &str)],
    ) -> Result<Value, String> {
        let url = url::Url::parse_with_params(&format!("{}/api/v1/{path}", self.base), params)
            .map_err(|e| e.to_string())?;
        let body: Value = http
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        if body["status"] == "success" {
            Ok(body["data"].clone())
        } else {
            Err(format!("{}: {}", body["errorType"], body["error"]))
        }
    }

    /// An instant query: does it return any data?
    async fn has_data(&self, http: &reqwest::Client, expr: &str) -> Result<bool, String> {
        let data = self.api(http, "query", &[("query", expr)]).await?;
        Ok(match data["resultType"].as_str() {
            Some("vector" | "matrix") => data["result"].as_array().is_some_and(|r| !r.is_empty()),
            // A scalar or string always has a value.
            _ => true,
        })
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One query of a dashboard panel, with Grafana's variables expanded.
struct PanelQuery {
    panel: String,
    expr: String,
}

/// Every `expr` of every panel (nested panels of collapsed rows included),
/// with Grafana's variables replaced: the built-in ones by `GRAFANA_VARIABLES`,
/// the dashboard's template variables by `.*` (they are used in `=~`
/// matchers).
fn dashboard_queries(dashboard: &Value) -> Vec<PanelQuery> {
    let mut vars: Vec<String> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(str::to_string))
        .collect();
    // Longest first, so `$tool` does not eat the start of `$tools`.
    vars.sort_by_key(|v| std::cmp::Reverse(v.len()));
    let expand = |expr: &str| {
        let mut e = expr.to_string();
        for (from, to) in GRAFANA_VARIABLES {
            e = e.replace(from, to);
        }
        for v in &vars {
            for form in [format!("${{{v}}}"), format!("[[{v}]]"), format!("${v}")] {
                e = e.replace(&form, ".*");
            }
        }
        e
    };
    fn walk(panels: &Value, expand: &dyn Fn(&str) -> String, out: &mut Vec<PanelQuery>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("(untitled)");
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str().filter(|e| !e.trim().is_empty()) {
                    out.push(PanelQuery {
                        panel: format!("{title} [{}]", t["refId"].as_str().unwrap_or("?")),
                        expr: expand(expr),
                    });
                }
            }
            walk(&p["panels"], expand, out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &expand, &mut out);
    out
}

/// Top-level panels fit the 24-column grid, do not overlap, and have
/// unique ids.
fn check_layout(dashboard: &Value) {
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(&str, [u64; 4])> = Vec::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("(untitled)");
        let id = p["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("panel {title} has no id"));
        assert!(ids.insert(id), "panel id {id} is used twice ({title})");
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| {
            g[k].as_u64()
                .unwrap_or_else(|| panic!("panel {title}: gridPos.{k}"))
        });
        assert!(
            w > 0 && h > 0 && x + w <= 24,
            "panel {title} does not fit the grid: {g}"
        );
        for (other, [ox, oy, ow, oh]) in &boxes {
            let apart = x + w <= *ox || *ox + ow <= x || y + h <= *oy || *oy + oh <= y;
            assert!(apart, "panels {other:?} and {title:?} overlap");
        }
        boxes.push((title, [x, y, w, h]));
    }
}

/// `toolfleet_*` names in a PromQL expression, histogram series
/// (`_bucket`, `_sum`, `_count`) folded into their family.
fn metric_families(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("toolfleet_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(family(&tail[..end]).to_string());
        rest = &tail[end..];
    }
    out
}

fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// Group and alert names of a rules file, read line by line (`- name:` and
/// `- alert:` / `- record:` items): enough for the shipped file, and the
/// server parses it for real.
fn rule_names(yaml: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut groups: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current = None;
    for line in yaml.lines() {
        let t = line.trim_start();
        let value = |v: &str| v.trim().trim_matches('"').trim_matches('\'').to_string();
        if let Some(name) = t.strip_prefix("- name:") {
            let name = value(name);
            groups.entry(name.clone()).or_default();
            current = Some(name);
        } else if let Some(rule) = t
            .strip_prefix("- alert:")
            .or_else(|| t.strip_prefix("- record:"))
        {
            let group = current.clone().expect("a rule before any group");
            groups.entry(group).or_default().insert(value(rule));
        }
    }
    groups
}

/// Chat jobs and tool jobs that make every series the dashboard and the
/// alerts read exist.
async fn traffic(env: &mut Env) {
    // Completed with both tools (calls, jobs, citations, cost, tokens); an
    // invalid-arguments call; an unknown tool; a model call retried after a
    // 500; the round limit and a truncated tool result (`tight`); a tool
    // call cut by the output limit (loop limit, chat outcome "error").
    let jobs: [(&str, Option<&str>, Result<(), &str>); 7] = [
        ("Launch a rocket, again", Some("failover"), Ok(())),
        (
            "What time is it, and how do lighthouses warn ships?",
            None,
            Ok(()),
        ),
        ("How do bees navigate?", None, Ok(())),
        ("Launch a rocket", None, Ok(())),
        ("A flaky provider", None, Ok(())),
        ("What causes tides?", Some("tight"), Ok(())),
        ("How does sourdough rise?", None, Err("truncated_tool_call")),
    ];
    let runs = jobs.iter().map(|(question, profile, expected)| {
        let env = &*env;
        async move {
            let mut job = toolfleet_protocol::client::question(question);
            job.profile = profile.map(str::to_string);
            let got = env
                .submit(&job)
                .await
                .map(|_| ())
                .map_err(|e| e.code().to_string());
            assert_eq!(got, (*expected).map_err(str::to_string), "{question}");
        }
    });
    futures::future::join_all(runs).await;

    // A chat job that is not JSON: outcome "malformed", a chat dead letter.
    let js = async_nats::jetstream::new(env.client.clone());
    let mut dead_chat = env.subscribe("toolfleet.deadletter.chat".into()).await;
    js.publish(
        env.subjects.chat_submit(toolfleet_protocol::DEFAULT_TENANT),
        "\u{1}garbage".into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    assert_eq!(next_json(&mut dead_chat).await["kind"], "chat");

    // Last, with Redis gone: a tool job is retried up to the attempt cap and
    // dead-lettered (tool job retries, a tool dead letter).
    let mut dead_tool = env.subscribe("toolfleet.deadletter.tool".into()).await;
    env.redis.stop();
    let call = CallContext {
        invocation: InvocationContext::new("prom-dead-1"),
        call_id: "call_1".into(),
        tool_id: "retrieval:search_data_sources@1.0.0".parse().unwrap(),
        attempt: 1,
        reply_to: env.subjects.reply_inbox(),
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
    assert_eq!(
        next_json(&mut dead_tool).await["invocationId"],
        "prom-dead-1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_and_alert_rule_works_against_a_real_prometheus() {
    toolfleet_llm::install_crypto_provider();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("ops/grafana/dashboards/toolfleet.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    check_layout(&dashboard);
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() > 20, "{} dashboard queries", queries.len());
    for q in &queries {
        assert!(
            !q.expr.contains('$'),
            "panel {}: a Grafana variable the test does not know: {}",
            q.panel,
            q.expr
        );
    }
    let alerts_path = root().join("ops/prometheus/alerts.yml");
    let expected_rules = rule_names(&std::fs::read_to_string(&alerts_path).unwrap());
    assert!(!expected_rules.is_empty());

    let mut env = Env::start_with(
        script(),
        Options {
            profiles_toml: Some(PROFILES.into()),
            ..Default::default()
        },
    )
    .await;
    // Prometheus starts while the traffic runs; counters keep their totals.
    let mut prom = Prometheus::start(env.metrics_addr, &alerts_path);
    tokio::time::timeout(WAIT, traffic(&mut env))
        .await
        .expect("traffic timed out");
    prom.wait_ready(&http).await;

    // Every dashboard query returns data (scrapes run every second; a rate
    // needs two of them).
    let deadline = Instant::now() + DATA_WITHIN;
    let mut pending: Vec<&PanelQuery> = queries.iter().collect();
    while !pending.is_empty() {
        let mut empty = Vec::new();
        for q in pending {
            match prom.has_data(&http, &q.expr).await {
                Ok(true) => {}
                Ok(false) => empty.push(q),
                Err(e) => panic!("panel {}: Prometheus rejects `{}`: {e}", q.panel, q.expr),
            }
        }
        pending = empty;
        if pending.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "these dashboard queries returned no data within {DATA_WITHIN:?}:\n{}\nprometheus log:\n{}",
            pending
                .iter()
                .map(|q| format!("  {}: {}", q.panel, q.expr))
                .collect::<Vec<_>>()
                .join("\n"),
            prom.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The rule groups of alerts.yml are loaded, every rule has been evaluated
    // without error, and every expression is accepted as a query.
    let groups = loop {
        let data = prom
            .api(&http, "rules", &[])
            .await
            .expect("GET /api/v1/rules");
        let groups = data["groups"].as_array().cloned().unwrap_or_default();
        let evaluated = groups
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .all(|r| r["health"] != "unknown");
        if evaluated && !groups.is_empty() {
            break groups;
        }
        assert!(
            Instant::now() < deadline,
            "the rules were not evaluated in time: {data}\n{}",
            prom.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let loaded: BTreeMap<String, BTreeSet<String>> = groups
        .iter()
        .map(|g| {
            let rules = g["rules"].as_array().into_iter().flatten();
            (
                g["name"].as_str().unwrap_or_default().to_string(),
                rules
                    .map(|r| r["name"].as_str().unwrap_or_default().to_string())
                    .collect(),
            )
        })
        .collect();
    assert_eq!(loaded, expected_rules, "rule groups loaded from alerts.yml");
    let exported: BTreeSet<String> = prom
        .api(&http, "label/__name__/values", &[])
        .await
        .expect("metric names")
        .as_array()
        .expect("a list of names")
        .iter()
        .filter_map(Value::as_str)
        .filter(|n| n.starts_with("toolfleet_"))
        .map(|n| family(n).to_string())
        .collect();
    for rule in groups
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
    {
        let name = rule["name"].as_str().unwrap_or_default();
        assert_eq!(rule["health"], "ok", "rule {name}: {rule}");
        assert!(
            rule["lastError"].as_str().unwrap_or_default().is_empty(),
            "rule {name}: {rule}"
        );
        let expr = rule["query"].as_str().expect("a rule query");
        if let Err(e) = prom.has_data(&http, expr).await {
            panic!("rule {name}: Prometheus rejects `{expr}`: {e}");
        }
        let unknown: Vec<String> = metric_families(expr)
            .difference(&exported)
            .cloned()
            .collect();
        assert!(
            unknown.is_empty(),
            "rule {name} reads metrics the fleet does not export: {unknown:?}"
        );
    }

    // Every metric family the fleet exports is on the dashboard and in the
    // metrics table of ops/README.md.
    let on_dashboard: BTreeSet<String> = queries
        .iter()
        .flat_map(|q| metric_families(&q.expr))
        .collect();
    let missing: Vec<&String> = exported.difference(&on_dashboard).collect();
    assert!(
        missing.is_empty(),
        "metrics no dashboard panel shows: {missing:?}"
    );
    let readme = std::fs::read_to_string(root().join("ops/README.md")).unwrap();
    let undocumented: Vec<&String> = exported
        .iter()
        .filter(|m| !readme.contains(&format!("`{m}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "metrics missing from the table in ops/README.md: {undocumented:?}"
    );
}

/// `promtool check rules` passes on the shipped rules and every
/// `ops/prometheus/*_test.yml` passes `promtool test rules`: the alerts
/// fire when they should (ToolPoolEmpty, ToolBacklogHigh, the first dead
/// letter of a zero-initialised series, an absent orchestrator) and not
/// before. `promtool` comes with the `prometheus` package.
#[test]
fn promtool_checks_and_unit_tests_the_alert_rules() {
    let promtool = prometheus_binary().with_file_name("promtool");
    assert!(
        promtool.is_file(),
        "promtool is missing beside prometheus: {INSTALL}"
    );
    let dir = root().join("ops/prometheus");
    let run = |args: &[&str]| {
        let out = Command::new(&promtool)
            .current_dir(&dir)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["check", "rules", "alerts.yml"]);
    let mut tests: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with("_test.yml"))
        .collect();
    tests.sort();
    assert!(!tests.is_empty(), "no rule tests in ops/prometheus");
    for t in &tests {
        run(&["test", "rules", t]);
    }
}
