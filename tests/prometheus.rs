//! The real Prometheus server scrapes the fleet, and every query of the
//! shipped Grafana dashboards (`ops/grafana/dashboards/*.json`) returns data
//! there, their `label_values` variables list values; the alert rules
//! (`ops/prometheus/alerts.yml`) load, evaluate without error, and read only
//! metrics the fleet exports.
//!
//! Without a server: every alert links its runbook (`runbook_url`, a heading
//! of `ops/README.md`), every dashboard picks its Prometheus through the
//! `datasource` variable and filters its per-tool and per-model panels by
//! the `tool` and `model` variables, and `ops/Dockerfile` runs as a numeric
//! user on base images pinned to exact tags.
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
# Fleet-wide limits it never reaches: the wait series exists.
max_concurrency = 1000

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

# The traffic's one unreadable chat job suspends the default tenant (its
# poison series, a suspension, then a refused job).
[tenants.default]
poison_limit = 1

[prices."toolfleet-scripted"]
input = 0.15
cached_input = 0.075
output = 0.60

# A millionth of a dollar a day: thrifty's first job spends it (a warning,
# the used ratio), its second is refused (budget_exhausted).
[tenants.thrifty]
spend_per_day_usd = 0.000001
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

/// Every `ops/grafana/dashboards/*.json`, by file name.
fn dashboards() -> Vec<(String, Value)> {
    let dir = root().join("ops/grafana/dashboards");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&p).unwrap();
            let dashboard =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
            (name, dashboard)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!out.is_empty(), "no dashboards in {}", dir.display());
    out
}

/// Every panel of a dashboard, the nested panels of collapsed rows included.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(panels: &'a Value, out: &mut Vec<&'a Value>) {
        for p in panels.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

fn title(panel: &Value) -> &str {
    panel["title"].as_str().unwrap_or("(untitled)")
}

/// The dashboard's template variables.
fn variables(dashboard: &Value) -> &[Value] {
    dashboard["templating"]["list"]
        .as_array()
        .map_or(&[], Vec::as_slice)
}

/// `expr` with Grafana's variables replaced: the built-in ones by
/// `GRAFANA_VARIABLES`, the dashboard's template variables (`$tool`,
/// `${model}`, `[[datasource]]`) by `.*` (they are used in `=~` matchers).
fn expand(dashboard: &Value, expr: &str) -> String {
    let mut vars: Vec<&str> = variables(dashboard)
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    // Longest first, so `$tool` does not eat the start of `$tools`.
    vars.sort_by_key(|v| std::cmp::Reverse(v.len()));
    let mut e = expr.to_string();
    for (from, to) in GRAFANA_VARIABLES {
        e = e.replace(from, to);
    }
    for v in vars {
        for form in [format!("${{{v}}}"), format!("[[{v}]]"), format!("${v}")] {
            e = e.replace(&form, ".*");
        }
    }
    e
}

/// One query of a dashboard panel, with Grafana's variables expanded.
struct PanelQuery {
    panel: String,
    expr: String,
}

/// Every `expr` of every panel, expanded (`expand`).
fn dashboard_queries(dashboard: &Value) -> Vec<PanelQuery> {
    let mut out = Vec::new();
    for p in all_panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str().filter(|e| !e.trim().is_empty()) {
                out.push(PanelQuery {
                    panel: format!("{} [{}]", title(p), t["refId"].as_str().unwrap_or("?")),
                    expr: expand(dashboard, expr),
                });
            }
        }
    }
    out
}

/// `(variable, selector, label)` of every `label_values(selector, label)`
/// query variable, the selector expanded (`expand`).
fn label_values_variables(dashboard: &Value) -> Vec<(String, String, String)> {
    variables(dashboard)
        .iter()
        .filter(|v| v["type"] == "query")
        .filter_map(|v| {
            // A string, or (Grafana 10+) an object with the string in `query`.
            let query = v["query"].as_str().or(v["query"]["query"].as_str())?;
            let args = query
                .trim()
                .strip_prefix("label_values(")?
                .strip_suffix(')')?;
            let (selector, label) = args.rsplit_once(',')?;
            Some((
                v["name"].as_str().unwrap_or_default().to_string(),
                expand(dashboard, selector.trim()),
                label.trim().to_string(),
            ))
        })
        .collect()
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

    // Tenant limits: a budget spent, then a refusal (the job's first model
    // call, its planning step or its answer, may spend it already).
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let mut job = toolfleet_protocol::client::question("How do bees navigate?");
        job.tenant = Some("thrifty".into());
        let got = env
            .submit(&job)
            .await
            .map(|_| ())
            .map_err(|e| e.code().to_string());
        let refused = got.as_ref().err().is_some_and(|c| c == "budget_exhausted");
        outcomes.push(got);
        if refused {
            break;
        }
    }
    assert!(
        outcomes
            .last()
            .is_some_and(|o| o.as_ref().err().is_some_and(|c| c == "budget_exhausted")),
        "thrifty: {outcomes:?}"
    );

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
    // It was the tenant's first poison, and its limit is 1: the tenant is
    // suspended, and its next job refused.
    let refused = env
        .submit(&toolfleet_protocol::client::question(
            "How do bees navigate?",
        ))
        .await
        .map_err(|e| e.code().to_string());
    assert_eq!(refused.err().as_deref(), Some("tenant_suspended"));

    // A cancel of an id never submitted: written down in the tenant's
    // remembered cancels (`toolfleet_cancels_total`).
    env.client
        .publish(
            env.subjects
                .chat_cancel(toolfleet_protocol::DEFAULT_TENANT, "prom-never-submitted"),
            "".into(),
        )
        .await
        .unwrap();
    env.client.flush().await.unwrap();

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
    let mut queries = Vec::new();
    let mut variable_queries = Vec::new();
    for (name, dashboard) in dashboards() {
        check_layout(&dashboard);
        queries.extend(
            dashboard_queries(&dashboard)
                .into_iter()
                .map(|q| PanelQuery {
                    panel: format!("{name}: {}", q.panel),
                    ..q
                }),
        );
        variable_queries.extend(
            label_values_variables(&dashboard)
                .into_iter()
                .map(|(var, selector, label)| (format!("{name}: ${var}"), selector, label)),
        );
    }
    assert!(queries.len() > 20, "{} dashboard queries", queries.len());
    assert!(
        variable_queries.len() >= 2,
        "the `tool` and `model` variables: {variable_queries:?}"
    );
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

    // Every `label_values` variable lists values (the same series the panel
    // queries above found, so no waiting).
    for (var, selector, label) in &variable_queries {
        let values = prom
            .api(
                &http,
                &format!("label/{label}/values"),
                &[("match[]", selector.as_str())],
            )
            .await
            .unwrap_or_else(|e| panic!("{var}: Prometheus rejects `{selector}`: {e}"));
        assert!(
            values.as_array().is_some_and(|v| !v.is_empty()),
            "{var}: label_values({selector}, {label}) lists nothing: {values}"
        );
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
    // The runbook links, as the server parsed them.
    let anchors = github_anchors(&std::fs::read_to_string(root().join("ops/README.md")).unwrap());
    for rule in groups
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
    {
        let name = rule["name"].as_str().unwrap_or_default();
        if rule["type"] == "alerting"
            && let Some(problem) =
                runbook_problem(name, rule["annotations"]["runbook_url"].as_str(), &anchors)
        {
            panic!("{problem}");
        }
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

/// Where every alert's `runbook_url` points: a section of ops/README.md.
const RUNBOOK_BASE: &str = "https://github.com/toolfleet/toolfleet/blob/main/ops/README.md#";

/// The anchors GitHub gives the headings of a Markdown file: the text
/// lower-cased, spaces to `-`, punctuation other than `-` and `_` dropped;
/// a repeated heading gets `-1`, `-2`, …. Lines in fenced code blocks are
/// not headings.
fn github_anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fence: Option<&str> = None;
    for line in markdown.lines() {
        let t = line.trim_start();
        if let Some(f) = ["```", "~~~"].into_iter().find(|f| t.starts_with(f)) {
            match fence {
                Some(open) if open == f => fence = None,
                None => fence = Some(f),
                Some(_) => {}
            }
            continue;
        }
        let hashes = t.len() - t.trim_start_matches('#').len();
        let rest = &t[hashes..];
        if fence.is_some()
            || line.len() - t.len() > 3
            || !(1..=6).contains(&hashes)
            || !(rest.is_empty() || rest.starts_with(' '))
        {
            continue;
        }
        let text = rest.trim().trim_end_matches('#').trim_end();
        let slug: String = text
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .flat_map(char::to_lowercase)
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        out.insert(if *n == 0 { slug } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// The `runbook_url` annotation of every alert of a rules file, read line
/// by line like `rule_names` (`None`: the alert has none). The live test
/// checks the same annotations as the server parsed them.
fn runbook_urls(yaml: &str) -> BTreeMap<String, Option<String>> {
    let value = |v: &str| v.trim().trim_matches('"').trim_matches('\'').to_string();
    let mut out = BTreeMap::new();
    let mut alert = None;
    for line in yaml.lines() {
        let t = line.trim_start();
        if let Some(name) = t.strip_prefix("- alert:") {
            let name = value(name);
            out.insert(name.clone(), None);
            alert = Some(name);
        } else if t.starts_with("- record:") || t.starts_with("- name:") {
            alert = None;
        } else if let (Some(name), Some(url)) = (&alert, t.strip_prefix("runbook_url:")) {
            out.insert(name.clone(), Some(value(url)));
        }
    }
    out
}

/// What is wrong with an alert's runbook link, if anything: missing, not
/// a section of ops/README.md, or an anchor no heading there has.
fn runbook_problem(alert: &str, url: Option<&str>, anchors: &BTreeSet<String>) -> Option<String> {
    let Some(url) = url else {
        return Some(format!("alert {alert} has no runbook_url annotation"));
    };
    let Some(anchor) = url.strip_prefix(RUNBOOK_BASE) else {
        return Some(format!(
            "alert {alert}: runbook_url {url} is not a section of ops/README.md ({RUNBOOK_BASE}<anchor>)"
        ));
    };
    (!anchors.contains(anchor)).then(|| {
        format!("alert {alert}: runbook_url anchor #{anchor} is no heading of ops/README.md")
    })
}

fn runbook_problems(alerts_yaml: &str, readme: &str) -> Vec<String> {
    let anchors = github_anchors(readme);
    runbook_urls(alerts_yaml)
        .iter()
        .filter_map(|(alert, url)| runbook_problem(alert, url.as_deref(), &anchors))
        .collect()
}

#[test]
fn every_alert_links_a_runbook_section_of_ops_readme() {
    let alerts = std::fs::read_to_string(root().join("ops/prometheus/alerts.yml")).unwrap();
    let readme = std::fs::read_to_string(root().join("ops/README.md")).unwrap();
    let urls = runbook_urls(&alerts);
    let rules: BTreeSet<String> = rule_names(&alerts).into_values().flatten().collect();
    assert_eq!(
        urls.keys().cloned().collect::<BTreeSet<_>>(),
        rules,
        "every rule of alerts.yml is an alert"
    );
    let problems = runbook_problems(&alerts, &readme);
    assert!(problems.is_empty(), "{problems:#?}");

    // The checks bite: GitHub's anchors, an alert without a link, a link
    // elsewhere, an anchor with no heading.
    let markdown = "# Operating it\n```sh\n# not a heading\n```\n## Runbooks\n\
                    ### ToolPoolEmpty\n### `Foo`: bar (baz) #\n### Foo: bar baz\n#nope\n";
    let expected = [
        "operating-it",
        "runbooks",
        "toolpoolempty",
        "foo-bar-baz",
        "foo-bar-baz-1",
    ];
    assert_eq!(github_anchors(markdown), expected.map(String::from).into());
    let yaml = format!(
        "groups:\n  - name: g\n    rules:\n      - alert: Linked\n        annotations:\n          \
         runbook_url: \"{RUNBOOK_BASE}toolpoolempty\"\n      - alert: Bare\n        \
         annotations:\n          summary: s\n      - alert: Elsewhere\n        annotations:\n          \
         runbook_url: https://example.com/x#toolpoolempty\n      - alert: Dangling\n        \
         annotations:\n          runbook_url: '{RUNBOOK_BASE}toolpoolfull'\n"
    );
    let problems = runbook_problems(&yaml, markdown);
    let alerts: Vec<&str> = problems
        .iter()
        .map(|p| p.split_whitespace().nth(1).unwrap().trim_end_matches(':'))
        .collect();
    assert_eq!(alerts, ["Bare", "Dangling", "Elsewhere"], "{problems:#?}");
}

/// The datasource every panel, query and query variable names: the
/// dashboard's `datasource` variable.
fn datasource_variable() -> Value {
    json!({ "type": "prometheus", "uid": "${datasource}" })
}

/// Where a dashboard names a datasource other than its `datasource`
/// variable, or lacks that variable.
fn datasource_problems(dashboard: &Value) -> Vec<String> {
    let want = datasource_variable();
    let mut problems = Vec::new();
    match variables(dashboard)
        .iter()
        .find(|v| v["name"] == "datasource")
    {
        Some(v) if v["type"] == "datasource" && v["query"] == "prometheus" => {}
        Some(v) => problems.push(format!(
            "the `datasource` variable is not of type datasource, query prometheus: {v}"
        )),
        None => {
            problems.push("no `datasource` variable (type datasource, query prometheus)".into())
        }
    }
    for v in variables(dashboard).iter().filter(|v| v["type"] == "query") {
        if v["datasource"] != want {
            problems.push(format!(
                "variable {}: datasource {}",
                v["name"], v["datasource"]
            ));
        }
    }
    for p in all_panels(dashboard) {
        let targets = p["targets"].as_array().map_or(&[][..], Vec::as_slice);
        if (!targets.is_empty() || p.get("datasource").is_some()) && p["datasource"] != want {
            problems.push(format!(
                "panel {}: datasource {}",
                title(p),
                p["datasource"]
            ));
        }
        for t in targets.iter().filter(|t| t["datasource"] != want) {
            problems.push(format!(
                "panel {} [{}]: datasource {}",
                title(p),
                t["refId"].as_str().unwrap_or("?"),
                t["datasource"]
            ));
        }
    }
    problems
}

/// The labels of every `by (...)` clause of a PromQL expression.
fn grouping_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("by") {
        let word_start = rest[..at]
            .chars()
            .last()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        let after = rest[at + 2..].trim_start();
        if word_start
            && let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            out.extend(
                inner[..end]
                    .split(',')
                    .map(|l| l.trim().to_string())
                    .filter(|l| !l.is_empty()),
            );
        }
        rest = &rest[at + 2..];
    }
    out
}

/// Panels that show a series per `tool` or per `model` (`by (tool)`)
/// filter by the dashboard's variable of that name (`tool=~"$tool"`), and
/// that variable lists the label's values (`label_values(<metric>, tool)`),
/// takes several values, and has "All" as `.*`.
fn filter_problems(dashboard: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    for label in ["tool", "model"] {
        let matcher = format!("{label}=~\"${label}\"");
        let mut per_label = 0;
        for p in all_panels(dashboard) {
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"].as_str().unwrap_or_default();
                if grouping_labels(expr).contains(label) {
                    per_label += 1;
                    if !expr.contains(&matcher) {
                        problems.push(format!("panel {}: no {matcher} in {expr}", title(p)));
                    }
                }
            }
        }
        if per_label == 0 {
            continue;
        }
        let Some(v) = variables(dashboard).iter().find(|v| v["name"] == label) else {
            problems.push(format!(
                "no `{label}` variable for {per_label} per-{label} queries"
            ));
            continue;
        };
        let lists = label_values_variables(dashboard)
            .iter()
            .any(|(name, _, l)| name == label && l == label);
        if v["type"] != "query" || !lists {
            problems.push(format!(
                "variable {label}: not a label_values(<metric>, {label}) query: {v}"
            ));
        }
        if v["multi"] != true || v["includeAll"] != true || v["allValue"] != ".*" {
            problems.push(format!(
                "variable {label}: multi, includeAll and allValue `.*` wanted: {v}"
            ));
        }
    }
    problems
}

#[test]
fn every_dashboard_picks_prometheus_through_its_variables() {
    for (name, dashboard) in dashboards() {
        let problems: Vec<String> = datasource_problems(&dashboard)
            .into_iter()
            .chain(filter_problems(&dashboard))
            .collect();
        assert!(problems.is_empty(), "{name}: {problems:#?}");
    }

    // The checks bite: a fixed datasource, a missing variable, a per-tool
    // panel that ignores `$tool`.
    let ds = datasource_variable();
    let dashboard = json!({
        "templating": { "list": [
            { "name": "tool", "type": "query", "datasource": ds,
              "query": "label_values(toolfleet_tool_jobs_total, tool)",
              "multi": true, "includeAll": true, "allValue": ".*" }
        ] },
        "panels": [
            { "type": "row", "title": "Row", "panels": [
                { "title": "Fixed", "datasource": { "type": "prometheus", "uid": "prometheus" },
                  "targets": [ { "refId": "A", "datasource": ds, "expr": "sum(up)" } ] }
            ] },
            { "title": "Per tool", "datasource": ds, "targets": [
                { "refId": "A", "expr": "sum by (tool) (toolfleet_tool_jobs_in_flight)" },
                { "refId": "B", "datasource": ds, "expr": "sum by (model) (rate(toolfleet_llm_requests_total{model=~\"$model\"}[1m]))" }
            ] }
        ]
    });
    let problems = datasource_problems(&dashboard);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(
        problems[0].starts_with("no `datasource` variable"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("panel Fixed: datasource"),
        "{problems:#?}"
    );
    assert!(
        problems[2].starts_with("panel Per tool [A]: datasource null"),
        "{problems:#?}"
    );
    let problems = filter_problems(&dashboard);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(
        problems[0].starts_with("panel Per tool: no tool=~"),
        "{problems:#?}"
    );
    assert!(
        problems[1].starts_with("no `model` variable"),
        "{problems:#?}"
    );
}

/// Is `tag` exact: does one of its `-`/`_` parts read `x.y.z` (a version)
/// or `YYYYMMDD` (a dated build)? `1-bookworm` and `bookworm-slim` float.
fn exact_tag(tag: &str) -> bool {
    tag.split(['-', '_']).any(|part| {
        let numbers: Vec<&str> = part.trim_start_matches('v').split('.').collect();
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        (numbers.len() == 3 && numbers.iter().all(|n| digits(n)))
            || (part.len() == 8 && digits(part) && part.starts_with("20"))
    })
}

/// What is wrong with a Dockerfile: a `FROM` without an exact tag (stages
/// named by an earlier `AS` aside; a digest is welcome but not enough), a
/// `USER` that is missing, named, root, or not created with that uid/gid.
fn dockerfile_problems(dockerfile: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut stages = BTreeSet::new();
    let mut user = None;
    for line in dockerfile.lines() {
        let mut words = line.split_whitespace();
        let Some(instruction) = words.next() else {
            continue;
        };
        if instruction.eq_ignore_ascii_case("FROM") {
            let args: Vec<&str> = words.filter(|w| !w.starts_with("--")).collect();
            let image = args.first().copied().unwrap_or_default();
            if image.contains('$') {
                problems.push(format!(
                    "FROM {image}: pin the image in FROM, not in an ARG"
                ));
            } else if !stages.contains(&image.to_lowercase()) {
                let reference = image.split('@').next().unwrap_or(image);
                // After the last '/': a registry's `host:port/` is no tag.
                let last = reference.rsplit('/').next().unwrap_or(reference);
                match last.split_once(':') {
                    None => problems.push(format!("FROM {image}: no tag, which is `latest`")),
                    Some((_, tag)) if !exact_tag(tag) => problems.push(format!(
                        "FROM {image}: `{tag}` is not an exact tag (x.y.z or a YYYYMMDD build)"
                    )),
                    Some(_) => {}
                }
            }
            if let [_, keyword, stage] = args[..]
                && keyword.eq_ignore_ascii_case("AS")
            {
                stages.insert(stage.to_lowercase());
            }
        } else if instruction.eq_ignore_ascii_case("USER") {
            user = words.next();
        }
    }
    let Some(user) = user else {
        problems.push("no USER: the image runs as root".into());
        return problems;
    };
    let ids: Vec<&str> = user.split(':').collect();
    if ids.len() > 2
        || !ids
            .iter()
            .all(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
    {
        problems.push(format!("USER {user}: not numeric (uid or uid:gid)"));
    } else if ids.iter().any(|id| id.parse::<u32>() == Ok(0)) {
        problems.push(format!("USER {user}: root"));
    } else {
        for (flag, id) in ["--uid", "--gid"].iter().zip(&ids) {
            if !dockerfile.contains(&format!("{flag} {id}")) {
                problems.push(format!(
                    "USER {user}: nothing creates it with `{flag} {id}`"
                ));
            }
        }
    }
    problems
}

#[test]
fn the_image_runs_as_a_numeric_user_on_pinned_base_images() {
    let dockerfile = std::fs::read_to_string(root().join("ops/Dockerfile")).unwrap();
    let problems = dockerfile_problems(&dockerfile);
    assert!(problems.is_empty(), "ops/Dockerfile: {problems:#?}");
    assert!(
        dockerfile
            .lines()
            .filter(|l| l.starts_with("FROM "))
            .count()
            >= 2
    );

    // The checks bite.
    let good = "FROM rust:1.95.0-bookworm@sha256:0123 AS builder\nFROM builder AS test\n\
                FROM --platform=linux/amd64 registry:5000/debian:bookworm-20251117-slim\n\
                RUN groupadd --gid 10001 t && useradd --uid 10001 --gid 10001 t\nUSER 10001:10001\n";
    assert_eq!(dockerfile_problems(good), Vec::<String>::new());
    for (bad, problem) in [
        (
            "FROM rust:1-bookworm\nUSER 1:1 --uid 1 --gid 1",
            "not an exact tag",
        ),
        (
            "FROM debian:bookworm-slim\nUSER 1 --uid 1",
            "not an exact tag",
        ),
        ("FROM debian:latest\nUSER 1 --uid 1", "not an exact tag"),
        ("FROM registry:5000/debian\nUSER 1 --uid 1", "no tag"),
        ("ARG B=debian:12.8.0\nFROM ${B}\nUSER 1 --uid 1", "ARG"),
        ("FROM debian:12.8.0", "no USER"),
        ("FROM debian:12.8.0\nUSER toolfleet", "not numeric"),
        ("FROM debian:12.8.0\nUSER 0:0", "root"),
        (
            "FROM debian:12.8.0\nRUN useradd --uid 10001 t\nUSER 10001:10001",
            "`--gid 10001`",
        ),
    ] {
        let problems = dockerfile_problems(bad);
        assert!(
            problems.len() == 1 && problems[0].contains(problem),
            "{bad:?}: {problems:?}"
        );
    }
}
