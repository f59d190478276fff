//! One version everywhere: every binary the workspace ships answers
//! `--version` with `<binary> <version> (<git revision>)` and exit 0, the
//! version being the workspace's (`[workspace.package] version`, read here,
//! never written down); a running process says the same build in
//! `toolfleet_build_info` and the services API, and exports the
//! `process_*` metrics.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{self, WAIT};

/// `[workspace.package] version` of the root manifest.
fn workspace_version() -> String {
    let text = std::fs::read_to_string(support::root().join("Cargo.toml")).unwrap();
    let doc: toml::Table = text.parse().unwrap();
    doc["workspace"]["package"]["version"]
        .as_str()
        .expect("[workspace.package] version")
        .to_string()
}

/// Every package's version and every binary target, by binary name, from
/// `cargo metadata` (so a new binary is checked without a word here).
fn packages_and_binaries() -> (BTreeMap<String, String>, Vec<String>) {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .current_dir(support::root())
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut versions = BTreeMap::new();
    let mut binaries = Vec::new();
    for package in metadata["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap().to_string();
        versions.insert(name, package["version"].as_str().unwrap().to_string());
        for target in package["targets"].as_array().unwrap() {
            if target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k == "bin")
            {
                binaries.push(target["name"].as_str().unwrap().to_string());
            }
        }
    }
    (versions, binaries)
}

/// Checks a revision as the build should have set it: the
/// `TOOLFLEET_GIT_REVISION` the tests were built with, else, in a git
/// checkout, an abbreviated id of a commit this repository has (not
/// necessarily HEAD's: a commit may have come since the build), else
/// `unknown`.
fn check_revision(revision: &str, what: &str) {
    if let Some(given) = option_env!("TOOLFLEET_GIT_REVISION").filter(|r| !r.is_empty()) {
        assert_eq!(revision, given, "{what}");
        return;
    }
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(support::root())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !git(&["rev-parse", "HEAD"]) {
        assert_eq!(revision, "unknown", "{what}: no git here");
        return;
    }
    assert!(
        revision.len() >= 12 && revision.chars().all(|c| c.is_ascii_hexdigit()),
        "{what}: the revision {revision:?} is not an abbreviated commit id"
    );
    assert!(
        git(&["cat-file", "-e", &format!("{revision}^{{commit}}")]),
        "{what}: {revision} is no commit of this repository"
    );
}

#[test]
fn every_binary_prints_the_one_version() {
    let version = workspace_version();
    let (packages, binaries) = packages_and_binaries();
    let others: Vec<_> = packages.iter().filter(|(_, v)| **v != version).collect();
    assert!(
        others.is_empty(),
        "packages not at the workspace's version {version}: {others:?}"
    );
    // The command, the orchestrator, five families and the example worker.
    assert!(binaries.len() >= 8, "{binaries:?}");
    for binary in &binaries {
        let out = Command::new(support::sibling_bin(binary))
            .arg("--version")
            .env_clear()
            .output()
            .unwrap_or_else(|e| panic!("{binary}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{binary} --version: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .strip_suffix('\n')
            .filter(|l| !l.contains('\n'))
            .unwrap_or_else(|| panic!("{binary} --version: not one line: {stdout:?}"));
        let revision = line
            .strip_prefix(&format!("{binary} {version} ("))
            .and_then(|rest| rest.strip_suffix(')'))
            .unwrap_or_else(|| {
                panic!("{binary} --version: {line:?} is not `{binary} {version} (<revision>)`")
            });
        check_revision(revision, &format!("{binary} --version"));
    }
}

/// The value of the first sample of `family` in a scrape.
fn sample(metrics: &str, family: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(family)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_worker_says_its_build_and_its_resources() {
    toolfleet_llm::install_crypto_provider();
    let version = workspace_version();
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
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

    // /metrics answers once the worker takes work.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let deadline = tokio::time::Instant::now() + WAIT;
    let metrics = loop {
        if let Ok(r) = http.get(&url).send().await
            && let Ok(text) = r.text().await
        {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "no {url}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let info: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("toolfleet_build_info{"))
        .collect();
    let [info] = info[..] else {
        panic!("one toolfleet_build_info series: {metrics}")
    };
    let revision = info
        .strip_prefix("toolfleet_build_info{revision=\"")
        .and_then(|rest| rest.strip_suffix(&format!("\",version=\"{version}\"}} 1")))
        .unwrap_or_else(|| panic!("{info} is not the build of version {version}"));
    check_revision(revision, "toolfleet_build_info");
    for family in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            sample(&metrics, family).is_some_and(|v| v > 0.0),
            "{family}: {metrics}"
        );
    }
    // Counted in clock ticks: a quick start may not have used one yet.
    assert!(
        sample(&metrics, "process_cpu_seconds_total").is_some_and(|v| v >= 0.0),
        "{metrics}"
    );

    // The services API says the same version.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let reply = tokio::time::timeout(
        WAIT,
        client.request(
            format!("$SRV.INFO.{}", subjects.worker_service()),
            "".into(),
        ),
    )
    .await
    .expect("$SRV.INFO timed out")
    .expect("$SRV.INFO");
    let service: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(service["version"], version.as_str(), "{service}");
}
