//! The Kubernetes files (`ops/kubernetes/`). `scripts/validate-kubernetes`
//! renders the kustomization and validates every object offline, against
//! the Kubernetes schemas and the CRDs' (`ops/kubernetes/schemas/`), and
//! fails on a misspelt field, an unknown kind or rules that drifted from
//! `ops/prometheus/alerts.yml`. And the objects hang together: every worker
//! binary of the workspace has a Deployment; every Deployment its Service,
//! PodDisruptionBudget, ServiceMonitor (whose `job` the alert rules select
//! on), probes, resources and NATS identity; every pool a ScaledObject with
//! one trigger per JetStream consumer of the tools it serves — computed
//! here from `tool_definitions/` and the worker crates, as the workers
//! decide — and a pool that scales from zero is declared in the
//! orchestrator's configuration.
//!
//! The script renders with `kubectl kustomize` (or `kustomize`) and installs
//! its validator (`kubernetes-validate` from PyPI) on first use. Run on its
//! own with `cargo nextest run --test kubernetes`.

// Tests are exempt from the 100-line limit: a check reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use toolfleet_protocol::Subjects;
use toolfleet_protocol::tools::{Delivery, ToolDefinition};

/// The first run installs the validator from PyPI.
const VALIDATE_WITHIN: Duration = Duration::from_secs(300);

/// The label whose value the ServiceMonitors make the `job` label.
const NAME_LABEL: &str = "app.kubernetes.io/name";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Validated {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs `scripts/validate-kubernetes` on a kustomization directory.
fn validate(dir: &Path, json: bool) -> Validated {
    let out = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (out.path().join("stdout"), out.path().join("stderr"));
    let mut command = Command::new(root().join("scripts/validate-kubernetes"));
    command.arg(dir);
    if json {
        command.arg("--json");
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(File::create(&stdout).unwrap())
        .stderr(File::create(&stderr).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("scripts/validate-kubernetes (needs python3): {e}"));
    let deadline = Instant::now() + VALIDATE_WITHIN;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "scripts/validate-kubernetes did not finish within {VALIDATE_WITHIN:?}:\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Validated {
        ok: status.success(),
        stdout: std::fs::read_to_string(&stdout).unwrap(),
        stderr: std::fs::read_to_string(&stderr).unwrap(),
    }
}

/// The rendered objects of `ops/kubernetes`, validated.
fn rendered() -> Vec<Value> {
    let v = validate(&root().join("ops/kubernetes"), true);
    assert!(v.ok, "ops/kubernetes does not validate:\n{}", v.stderr);
    serde_json::from_str(&v.stdout).unwrap_or_else(|e| panic!("--json output: {e}"))
}

fn of_kind<'a, 'k>(
    objects: &'a [Value],
    kind: &'k str,
) -> impl Iterator<Item = &'a Value> + use<'a, 'k> {
    objects.iter().filter(move |o| o["kind"] == kind)
}

fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    of_kind(objects, kind)
        .find(|o| o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name}"))
}

fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap()
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect()
}

/// Whether a selector's labels all match `labels`.
fn selects(selector: &Value, labels: &BTreeMap<String, String>) -> bool {
    let selector = string_map(selector);
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The fleet container of a Deployment (each has one).
fn container(deployment: &Value) -> &Value {
    let containers = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 1, "{}: one container", name(deployment));
    &containers[0]
}

fn env<'a>(container: &'a Value, var: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == var)
}

fn env_value<'a>(container: &'a Value, var: &str) -> Option<&'a str> {
    env(container, var).and_then(|e| e["value"].as_str())
}

/// A workspace binary and the directory of the package that builds it.
struct Binary {
    name: String,
    package: PathBuf,
}

/// Every binary of the workspace's members: `[[bin]]` targets, and the
/// package's own for a `src/main.rs`.
fn workspace_binaries() -> Vec<Binary> {
    let manifest = |dir: &Path| -> toml::Table {
        let path = dir.join("Cargo.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        text.parse()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let workspace = manifest(&root());
    let members = workspace["workspace"]["members"].as_array().unwrap();
    let mut out = Vec::new();
    for member in members {
        let dir = root().join(member.as_str().unwrap());
        let doc = manifest(&dir);
        let package = doc["package"]["name"].as_str().unwrap().to_string();
        let bins = doc.get("bin").and_then(|b| b.as_array());
        let mut names: Vec<String> = bins
            .into_iter()
            .flatten()
            .filter_map(|b| b.get("name").and_then(|n| n.as_str()).map(String::from))
            .collect();
        if dir.join("src/main.rs").is_file() && bins.is_none() {
            names.push(package);
        }
        out.extend(names.into_iter().map(|name| Binary {
            name,
            package: dir.clone(),
        }));
    }
    out
}

/// The worker pools: the workspace's `toolfleet-worker-<pool>` binaries.
fn pools() -> Vec<(String, Binary)> {
    let pools: Vec<(String, Binary)> = workspace_binaries()
        .into_iter()
        .filter_map(|b| Some((b.name.strip_prefix("toolfleet-worker-")?.to_string(), b)))
        .collect();
    assert!(pools.len() >= 5, "the worker binaries: {:?}", pools.len());
    pools
}

/// Every Rust source of a package's `src/`, concatenated.
fn sources(dir: &Path) -> String {
    let mut text = String::new();
    let mut stack = vec![dir.join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                text.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    text
}

/// The pool that serves `definition`, as the worker crates decide: the
/// one whose code registers its `implementationKey` by name (a string
/// literal: `.tool("retrieval.read_document", ..)`, `SEARCH_KEY`,
/// `IMAGE_KEY`), else the LLM tools pool for a declarative definition
/// (it serves every one, `toolfleet_worker_llm::is_declarative`).
fn pool_of(definition: &ToolDefinition, sources: &BTreeMap<String, String>) -> String {
    let literal = format!("\"{}\"", definition.implementation_key);
    let by_name: Vec<&String> = sources
        .iter()
        .filter(|(_, text)| text.contains(&literal))
        .map(|(pool, _)| pool)
        .collect();
    match by_name.as_slice() {
        [pool] => (*pool).clone(),
        [] if toolfleet_worker_llm::is_declarative(definition) => "llm".to_string(),
        _ => panic!(
            "{}: served by {by_name:?}: no worker pool, or several",
            definition.id
        ),
    }
}

/// The JetStream consumers each pool pulls from: one per tool it serves
/// with JetStream delivery (`Subjects::tool_consumer`). The LLM pool serves
/// the image tool only with an image model (`--image-model`, or models in
/// the definition): its consumer exists only then.
fn consumers_by_pool(objects: &[Value], subjects: &Subjects) -> BTreeMap<String, BTreeSet<String>> {
    let sources: BTreeMap<String, String> = pools()
        .into_iter()
        .map(|(pool, binary)| (pool, sources(&binary.package)))
        .collect();
    let definitions = toolfleet_protocol::tools::load_dir(root().join("tool_definitions")).unwrap();
    assert!(!definitions.is_empty());
    let llm = container(named(objects, "Deployment", "toolfleet-worker-llm"));
    let mut out: BTreeMap<String, BTreeSet<String>> = sources
        .keys()
        .map(|p| (p.clone(), BTreeSet::new()))
        .collect();
    for d in &definitions {
        if d.delivery != Delivery::Jetstream {
            continue;
        }
        if d.implementation_key == toolfleet_worker_llm::image::IMAGE_KEY {
            let in_definition = d
                .model_preference
                .as_ref()
                .is_some_and(|p| p.preferred_model.is_some() || !p.fallback_models.is_empty());
            if !in_definition && env(llm, "TOOLFLEET_IMAGE_MODEL").is_none() {
                continue;
            }
        }
        let pool = pool_of(d, &sources);
        out.get_mut(&pool)
            .unwrap()
            .insert(subjects.tool_consumer(&d.id));
    }
    out
}

fn subjects(objects: &[Value]) -> Subjects {
    let env = &named(objects, "ConfigMap", "toolfleet-env")["data"];
    Subjects::new(env["TOOLFLEET_SUBJECT_PREFIX"].as_str().unwrap()).unwrap()
}

#[test]
fn the_kustomization_renders_and_every_object_validates() {
    let objects = rendered();
    let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "ScaledObject",
        "PrometheusRule",
        "ConfigMap",
    ] {
        assert!(kinds.contains(kind), "no {kind} rendered: {kinds:?}");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

/// A manifest with a misspelt field, an unknown kind, or rules that are
/// not alerts.yml's fails validation, naming what is wrong; the same
/// files unchanged pass.
#[test]
fn a_misspelt_field_an_unknown_kind_or_drifted_rules_fail_validation() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&root().join("ops/kubernetes"), dir.path());
    let unchanged = validate(dir.path(), false);
    assert!(
        unchanged.ok,
        "the copy does not validate:\n{}",
        unchanged.stderr
    );
    // (file, text, misspelt, what the validator must say)
    let breaks = [
        // Kubernetes' own schemas: a container, a PodDisruptionBudget.
        (
            "worker-system.yaml",
            "readinessProbe:",
            "readinesProbe:",
            "'readinesProbe' was unexpected",
        ),
        (
            "gateway.yaml",
            "maxUnavailable:",
            "maxUnavaliable:",
            "'maxUnavaliable' was unexpected",
        ),
        // The CRDs' schemas: ServiceMonitor, ScaledObject (its trigger
        // metadata are strings), PrometheusRule, and an object's metadata.
        (
            "orchestrator.yaml",
            "jobLabel:",
            "jobLabels:",
            "'jobLabels' was unexpected",
        ),
        (
            "worker-web.yaml",
            "minReplicaCount:",
            "minReplicaCont:",
            "'minReplicaCont' was unexpected",
        ),
        (
            "worker-web.yaml",
            "lagThreshold: \"8\"",
            "lagThreshold: 8",
            "is not of type 'string'",
        ),
        (
            "prometheusrule.yaml",
            "        for: 5m",
            "        fore: 5m",
            "'fore' was unexpected",
        ),
        (
            "worker-llm.yaml",
            "kind: ScaledObject\nmetadata:\n  name: toolfleet-worker-llm\n  labels:",
            "kind: ScaledObject\nmetadata:\n  name: toolfleet-worker-llm\n  lables:",
            "'lables' was unexpected",
        ),
        // A kind no schema knows.
        (
            "worker-llm.yaml",
            "kind: Deployment",
            "kind: Deploymnet",
            "Couldn't find schema for kind Deploymnet",
        ),
        // Rules that are not alerts.yml's.
        ("prometheusrule.yaml", "> 0.05", "> 0.5", "differs from"),
    ];
    for (file, text, misspelt, says) in breaks {
        let path = dir.path().join(file);
        let original = std::fs::read_to_string(&path).unwrap();
        assert!(original.contains(text), "{file} has no {text:?}");
        std::fs::write(&path, original.replacen(text, misspelt, 1)).unwrap();
        let v = validate(dir.path(), false);
        std::fs::write(&path, &original).unwrap();
        assert!(!v.ok, "{file} with {misspelt:?} validates:\n{}", v.stderr);
        assert!(
            v.stderr.contains(says),
            "{file} with {misspelt:?}: expected {says:?} in:\n{}",
            v.stderr
        );
    }
}

/// The orchestrator, the gateway and one Deployment per worker binary, each
/// running that binary, with the metrics port its metrics address names,
/// probes on `/livez` and `/readyz` there, resources, a non-root user and
/// a grace period longer than the drain; and its Service (whose name and
/// `app.kubernetes.io/name` give the `job` label), PodDisruptionBudget and
/// ServiceMonitor.
#[test]
fn every_binary_has_a_deployment_with_service_pdb_monitor_and_probes() {
    let objects = rendered();
    let mut expected: BTreeMap<String, Vec<String>> = pools()
        .into_iter()
        .map(|(_, b)| (b.name.clone(), vec![b.name]))
        .collect();
    expected.insert(
        "toolfleet-orchestrator".into(),
        vec!["toolfleet-orchestrator".into()],
    );
    expected.insert(
        "toolfleet-gateway".into(),
        vec!["toolfleet".into(), "gateway".into()],
    );
    let deployments: BTreeSet<&str> = of_kind(&objects, "Deployment").map(name).collect();
    assert_eq!(
        deployments,
        expected.keys().map(String::as_str).collect(),
        "one Deployment per fleet process"
    );
    for (deployment_name, command) in &expected {
        let d = named(&objects, "Deployment", deployment_name);
        let c = container(d);
        let at = deployment_name;
        assert_eq!(c["command"], serde_json::json!(command), "{at}: command");
        let pod = string_map(&d["spec"]["template"]["metadata"]["labels"]);
        assert!(
            selects(&d["spec"]["selector"]["matchLabels"], &pod),
            "{at}: selector"
        );
        assert_eq!(
            pod.get(NAME_LABEL),
            Some(deployment_name),
            "{at}: pod labels"
        );

        let port = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "metrics")
            .unwrap_or_else(|| panic!("{at}: no metrics port"))["containerPort"]
            .as_u64()
            .unwrap();
        assert_eq!(
            env_value(c, "TOOLFLEET_METRICS_ADDR"),
            Some(format!("0.0.0.0:{port}").as_str()),
            "{at}: the metrics address is the metrics port"
        );
        for (probe, path) in [
            ("startupProbe", "/livez"),
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/readyz"),
        ] {
            let get = &c[probe]["httpGet"];
            assert_eq!(get["path"], path, "{at}: {probe}");
            assert_eq!(get["port"], "metrics", "{at}: {probe}");
        }
        for (kind, what) in [
            ("requests", "cpu"),
            ("requests", "memory"),
            ("limits", "cpu"),
            ("limits", "memory"),
        ] {
            assert!(
                c["resources"][kind][what].is_string(),
                "{at}: resources.{kind}.{what}"
            );
        }
        let security = &d["spec"]["template"]["spec"]["securityContext"];
        assert_eq!(security["runAsNonRoot"], true, "{at}: runAsNonRoot");
        assert_eq!(security["runAsUser"], 10001, "{at}: the image's user");
        let grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap_or(30);
        assert!(
            Duration::from_secs(grace) > toolfleet_service::GRACE_PERIOD,
            "{at}: terminationGracePeriodSeconds {grace} is not longer than the drain"
        );

        let service = named(&objects, "Service", deployment_name);
        assert!(
            selects(&service["spec"]["selector"], &pod),
            "{at}: Service selector"
        );
        let service_labels = string_map(&service["metadata"]["labels"]);
        assert_eq!(
            service_labels.get(NAME_LABEL),
            Some(deployment_name),
            "{at}: Service label"
        );
        let metrics = service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "metrics")
            .unwrap_or_else(|| panic!("{at}: the Service has no metrics port"));
        assert!(
            metrics["targetPort"] == "metrics" || metrics["targetPort"] == port,
            "{at}: the Service's metrics port targets {}",
            metrics["targetPort"]
        );

        let pdb = of_kind(&objects, "PodDisruptionBudget")
            .find(|p| selects(&p["spec"]["selector"]["matchLabels"], &pod))
            .unwrap_or_else(|| panic!("{at}: no PodDisruptionBudget selects its pods"));
        assert!(
            pdb["spec"]["maxUnavailable"].is_number() || pdb["spec"]["minAvailable"].is_number(),
            "{at}: PodDisruptionBudget"
        );

        let monitor = of_kind(&objects, "ServiceMonitor")
            .find(|m| selects(&m["spec"]["selector"]["matchLabels"], &service_labels))
            .unwrap_or_else(|| panic!("{at}: no ServiceMonitor selects its Service"));
        // The job label is the Service label jobLabel names (else the
        // Service's name): the job names of alerts.yml either way.
        assert_eq!(monitor["spec"]["jobLabel"], NAME_LABEL, "{at}: jobLabel");
        assert!(
            monitor["spec"]["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["port"] == "metrics" && e["path"] == "/metrics"),
            "{at}: the ServiceMonitor scrapes the metrics port"
        );
    }
}

/// Each pool's ScaledObject has one nats-jetstream trigger per JetStream
/// consumer of the tools the pool serves (no more, no fewer), on the tools
/// stream, at the pool's concurrency per replica, read from the monitoring
/// port of the NATS the fleet connects to. A pool that ships no tool (MCP)
/// has none and is paused at zero.
#[test]
fn each_pool_scales_on_one_trigger_per_consumer_of_its_tools() {
    let objects = rendered();
    let subjects = subjects(&objects);
    let expected = consumers_by_pool(&objects, &subjects);
    assert!(
        expected.values().map(BTreeSet::len).sum::<usize>() >= 10,
        "the shipped tools' consumers: {expected:?}"
    );
    let nats_url = named(&objects, "ConfigMap", "toolfleet-env")["data"]["TOOLFLEET_NATS_URL"]
        .as_str()
        .unwrap()
        .to_string();
    let nats_host = url::Url::parse(nats_url.split(',').next().unwrap())
        .unwrap()
        .host_str()
        .unwrap()
        .to_string();
    for (pool, consumers) in &expected {
        let target = format!("toolfleet-worker-{pool}");
        let scaled = named(&objects, "ScaledObject", &target);
        let at = &target;
        assert_eq!(
            scaled["spec"]["scaleTargetRef"]["name"], *target,
            "{at}: target"
        );
        let worker = container(named(&objects, "Deployment", &target));
        let concurrency = env_value(worker, "TOOLFLEET_CONCURRENCY")
            .unwrap_or_else(|| panic!("{at}: no TOOLFLEET_CONCURRENCY"));
        let triggers: Vec<&Value> = scaled["spec"]["triggers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["type"] == "nats-jetstream")
            .collect();
        let listed: Vec<String> = triggers
            .iter()
            .map(|t| t["metadata"]["consumer"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            listed.iter().cloned().collect::<BTreeSet<_>>(),
            *consumers,
            "{at}: one trigger per consumer of the pool's tools"
        );
        assert_eq!(
            listed.len(),
            consumers.len(),
            "{at}: a consumer listed twice"
        );
        let namespace = scaled["metadata"]["namespace"].as_str().unwrap();
        for t in &triggers {
            let m = &t["metadata"];
            assert_eq!(m["stream"], subjects.tools_stream(), "{at}: stream");
            assert_eq!(
                m["account"], "$G",
                "{at}: account (auth.conf's users are in $G)"
            );
            assert_eq!(
                m["lagThreshold"], concurrency,
                "{at}: lagThreshold is the concurrency"
            );
            let endpoint = m["natsServerMonitoringEndpoint"].as_str().unwrap();
            assert!(
                endpoint.starts_with(&format!("{nats_host}.{namespace}.svc"))
                    && endpoint.ends_with(":8222"),
                "{at}: {endpoint} is not the monitoring port of {nats_url} in {namespace}"
            );
        }
        if consumers.is_empty() {
            let paused = &scaled["metadata"]["annotations"]["autoscaling.keda.sh/paused-replicas"];
            assert_eq!(
                *paused, "0",
                "{at}: a pool with no shipped tool ships paused"
            );
        }
    }
}

/// A pool that may scale to zero replicas is declared in the orchestrator's
/// configuration (`pools.<name>.declared`), so its tools are offered while
/// no worker is live and its jobs queue where KEDA sees them; its manifest
/// says so beside `minReplicaCount: 0`.
#[test]
fn pools_that_scale_from_zero_are_declared_in_the_orchestrator_config() {
    let objects = rendered();
    let file = named(&objects, "ConfigMap", "toolfleet-config")["data"]["toolfleet.toml"]
        .as_str()
        .unwrap();
    let config: toml::Table = file.parse().unwrap();
    let orchestrator = named(&objects, "Deployment", "toolfleet-orchestrator");
    let path = env_value(container(orchestrator), "TOOLFLEET_CONFIG").unwrap();
    let mounted = container(orchestrator)["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| {
            let volume = orchestrator["spec"]["template"]["spec"]["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == m["name"]);
            volume.is_some_and(|v| v["configMap"]["name"] == "toolfleet-config")
                && path == format!("{}/toolfleet.toml", m["mountPath"].as_str().unwrap())
        });
    assert!(
        mounted,
        "the orchestrator reads {path} from the ConfigMap toolfleet-config"
    );
    let mut from_zero = 0;
    for (pool, _) in pools() {
        let scaled = named(
            &objects,
            "ScaledObject",
            &format!("toolfleet-worker-{pool}"),
        );
        // KEDA's default minimum is 0.
        if scaled["spec"]["minReplicaCount"].as_u64().unwrap_or(0) > 0 {
            continue;
        }
        from_zero += 1;
        let declared = config
            .get("pools")
            .and_then(|p| p.get(&pool))
            .and_then(|p| p.get("declared"))
            .and_then(toml::Value::as_bool);
        assert_eq!(
            declared,
            Some(true),
            "the {pool} pool scales from zero but is not declared (pools.{pool}.declared)"
        );
        let manifest =
            std::fs::read_to_string(root().join(format!("ops/kubernetes/worker-{pool}.yaml")))
                .unwrap();
        assert!(
            manifest.contains(&format!("pools.{pool}.declared")),
            "worker-{pool}.yaml: say beside minReplicaCount: 0 that the pool is declared"
        );
    }
    assert!(from_zero > 0, "no pool scales from zero");
    // The orchestrator loads the file, and resolves each declared pool's
    // tools from the definitions the image ships: they are the tools whose
    // consumers the pool's triggers scale on (the orchestrator makes those
    // consumers before the pool first runs).
    let fleet = toolfleet_config::FleetConfig::from_toml(file, "toolfleet.toml").unwrap();
    let definitions = toolfleet_protocol::tools::load_dir(root().join("tool_definitions")).unwrap();
    let declared = toolfleet_orchestrator::tools::declared::DeclaredPools::resolve(
        &fleet,
        definitions,
        "tool_definitions",
    )
    .unwrap_or_else(|e| panic!("the orchestrator would not start: {e}"));
    let subjects = subjects(&objects);
    let expected = consumers_by_pool(&objects, &subjects);
    for (pool, tools) in declared.by_pool() {
        let consumers: BTreeSet<String> = tools
            .iter()
            .map(|id| subjects.tool_consumer(&id.parse().unwrap()))
            .collect();
        assert_eq!(
            consumers, expected[pool],
            "pools.{pool}: the declared tools are those its triggers scale on"
        );
    }
}

/// The NATS users of `ops/nats/auth.conf` (and the files it includes).
fn nats_users(auth: &str) -> BTreeSet<String> {
    auth.lines()
        .filter_map(|l| l.trim().strip_prefix("{ user:"))
        .filter_map(|rest| rest.split(',').next())
        .map(|u| u.trim().to_string())
        .collect()
}

/// Each process logs in as the least-privilege user of its role in
/// `ops/nats/auth.conf` (`worker-<pool>`, `orchestrator`, `gateway`), with
/// that role's inbox prefix, its password read from a file of its own
/// Secret (never a variable); the Redis URL comes from a Secret too.
#[test]
fn every_process_logs_in_as_its_own_nats_user_with_secrets_from_secrets() {
    let objects = rendered();
    let auth = ["ops/nats/auth.conf", "ops/nats/mcp-role.conf"]
        .iter()
        .map(|f| std::fs::read_to_string(root().join(f)).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let users = nats_users(&auth);
    assert!(users.contains("orchestrator"), "auth.conf users: {users:?}");
    let mut roles: BTreeMap<String, String> = pools()
        .into_iter()
        .map(|(pool, b)| (b.name, format!("worker-{pool}")))
        .collect();
    roles.insert("toolfleet-orchestrator".into(), "orchestrator".into());
    roles.insert("toolfleet-gateway".into(), "gateway".into());
    for (deployment_name, user) in &roles {
        let d = named(&objects, "Deployment", deployment_name);
        let c = container(d);
        let at = deployment_name;
        assert_eq!(
            env_value(c, "TOOLFLEET_NATS_USER"),
            Some(user.as_str()),
            "{at}: NATS user"
        );
        let inbox = env_value(c, "TOOLFLEET_NATS_INBOX_PREFIX")
            .unwrap_or_else(|| panic!("{at}: no inbox prefix"));
        // The gateway's role is written with the gateway itself (issue 31):
        // until auth.conf has it, only its user and inbox are checked here.
        if user != "gateway" || users.contains("gateway") {
            assert!(users.contains(user), "{at}: {user} is no user of auth.conf");
            assert!(
                auth.contains(&format!("\"{inbox}.>\"")),
                "{at}: the role of {user} may not read the inbox {inbox}"
            );
        } else {
            eprintln!("note: ops/nats/auth.conf has no gateway user yet");
            assert_eq!(inbox, "_INBOX.gateway", "{at}: inbox prefix");
        }
        assert!(
            env(c, "TOOLFLEET_NATS_PASSWORD").is_none(),
            "{at}: the NATS password in a variable"
        );
        let file = env_value(c, "TOOLFLEET_NATS_PASSWORD_FILE")
            .unwrap_or_else(|| panic!("{at}: no TOOLFLEET_NATS_PASSWORD_FILE"));
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
        let from_secret = c["volumeMounts"].as_array().unwrap().iter().any(|m| {
            file.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap()))
                && volumes.iter().any(|v| {
                    v["name"] == m["name"]
                        && v["secret"]["secretName"] == format!("toolfleet-nats-{user}")
                })
        });
        assert!(
            from_secret,
            "{at}: {file} is not in the Secret toolfleet-nats-{user}"
        );
        let redis = env(c, "TOOLFLEET_REDIS_URL").unwrap_or_else(|| panic!("{at}: no Redis URL"));
        assert_eq!(
            redis["valueFrom"]["secretKeyRef"]["name"], "toolfleet-redis",
            "{at}: the Redis URL (it may hold a password) from the Secret toolfleet-redis"
        );
        assert!(
            c["envFrom"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| e["configMapRef"]["name"] == "toolfleet-env"),
            "{at}: the shared settings"
        );
    }
    let distinct: BTreeSet<&String> = roles.values().collect();
    assert_eq!(distinct.len(), roles.len(), "one NATS identity per process");
}

/// Every family (each pool, the orchestrator, the gateway) has an absent
/// alert in alerts.yml on `up{job="<its Service>"}`: the `job` its
/// ServiceMonitor gives it, and compose's scrape job of the same name.
#[test]
fn every_family_has_an_absent_alert_on_its_job() {
    let objects = rendered();
    let alerts = std::fs::read_to_string(root().join("ops/prometheus/alerts.yml")).unwrap();
    let compose = std::fs::read_to_string(root().join("ops/prometheus/prometheus.yml")).unwrap();
    for d in of_kind(&objects, "Deployment") {
        let job = name(d);
        assert!(
            alerts.contains(&format!("absent(up{{job=\"{job}\"}} == 1)")),
            "alerts.yml has no absent rule on job {job}"
        );
        assert!(
            compose.contains(&format!("job_name: {job}\n")),
            "prometheus.yml has no scrape job {job}: the rule would not work under compose"
        );
    }
    assert_eq!(of_kind(&objects, "PrometheusRule").count(), 1);
}
