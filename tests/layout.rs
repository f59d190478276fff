//! The workspace's dependency rules (ARCHITECTURE.md), checked on the
//! manifests so a change that breaks one fails here, and the system
//! worker's dependency weight, checked on the resolved tree.

use std::collections::BTreeSet;
use std::process::Command;

use crate::support;

/// The toolfleet crates a manifest names in `[dependencies]`, and in
/// `[dev-dependencies]` when `dev` (the layering holds for both;
/// test-only stand-ins may appear in dev-dependencies).
fn our_deps_of(manifest: &str, dev: bool) -> BTreeSet<String> {
    let text = std::fs::read_to_string(support::root().join(manifest))
        .unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let doc: toml::Table = text.parse().unwrap_or_else(|e| panic!("{manifest}: {e}"));
    let table = if dev {
        "dev-dependencies"
    } else {
        "dependencies"
    };
    // `[dependencies]` and every `[target.'cfg(..)'.dependencies]`.
    let targets = doc
        .get("target")
        .and_then(|t| t.as_table())
        .into_iter()
        .flat_map(|t| t.values())
        .filter_map(|t| t.get(table));
    doc.get(table)
        .into_iter()
        .chain(targets)
        .filter_map(|d| d.as_table())
        .flat_map(|t| t.keys())
        .filter(|k| k.starts_with("toolfleet") || k.ends_with("-worker"))
        .cloned()
        .collect()
}

fn our_deps(manifest: &str) -> BTreeSet<String> {
    our_deps_of(manifest, false)
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn crates_depend_only_where_the_rules_allow() {
    // The contract depends on no crate of ours; scripted is stand-alone.
    for m in [
        "crates/toolfleet-protocol/Cargo.toml",
        "crates/toolfleet-scripted/Cargo.toml",
    ] {
        assert_eq!(our_deps(m), set(&[]), "{m}");
    }
    // Store and service: only the contract (the service also the revision
    // macro, which depends on nothing).
    assert_eq!(
        our_deps("crates/toolfleet-store/Cargo.toml"),
        set(&["toolfleet-protocol"])
    );
    assert_eq!(
        our_deps("crates/toolfleet-service/Cargo.toml"),
        set(&["toolfleet-build", "toolfleet-protocol"])
    );
    // The SDK: never the LLM client or the orchestrator.
    assert_eq!(
        our_deps("crates/toolfleet-worker/Cargo.toml"),
        set(&["toolfleet-protocol", "toolfleet-service", "toolfleet-store"])
    );
    // The orchestrator: never the SDK or a family (nor the test stand-ins).
    assert_eq!(
        our_deps("crates/toolfleet-orchestrator/Cargo.toml"),
        set(&[
            "toolfleet-config",
            "toolfleet-llm",
            "toolfleet-protocol",
            "toolfleet-service",
            "toolfleet-store"
        ])
    );
    assert_eq!(
        our_deps("crates/toolfleet-llm/Cargo.toml"),
        set(&["toolfleet-protocol"])
    );
    // The configuration file's crate: the contract and the LLM client (for
    // deployments and prices), never the orchestrator, the service
    // plumbing, the store or the SDK — nor for its tests.
    for dev in [false, true] {
        assert!(
            our_deps_of("crates/toolfleet-config/Cargo.toml", dev)
                .is_subset(&set(&["toolfleet-llm", "toolfleet-protocol"])),
            "toolfleet-config (dev: {dev})"
        );
    }
    assert_eq!(
        our_deps("crates/toolfleet-config/Cargo.toml"),
        set(&["toolfleet-llm", "toolfleet-protocol"])
    );
    // Families and the third-party example: the SDK only, never each other
    // (not even for tests).
    for m in [
        "workers/system/Cargo.toml",
        "workers/retrieval/Cargo.toml",
        "workers/web/Cargo.toml",
        "workers/mcp/Cargo.toml",
        "examples/units/Cargo.toml",
    ] {
        assert_eq!(our_deps(m), set(&["toolfleet-worker"]), "{m}");
    }
    for m in [
        "workers/system/Cargo.toml",
        "workers/web/Cargo.toml",
        "workers/mcp/Cargo.toml",
        "examples/units/Cargo.toml",
    ] {
        assert!(our_deps_of(m, true).is_empty(), "{m}: dev-dependencies");
    }
    // Retrieval tests hybrid search against the scripted server's
    // embeddings, the one stand-in, and its PostgreSQL store against a
    // real server of the testkit's.
    assert_eq!(
        our_deps_of("workers/retrieval/Cargo.toml", true),
        set(&["toolfleet-scripted", "toolfleet-testkit"])
    );
    // The LLM tools family also speaks to models, through the LLM client
    // crate (never the orchestrator), and tests against the scripted model
    // server, the one stand-in.
    assert_eq!(
        our_deps("workers/llm/Cargo.toml"),
        set(&["toolfleet-llm", "toolfleet-worker"])
    );
    assert_eq!(
        our_deps_of("workers/llm/Cargo.toml", true),
        set(&["toolfleet-scripted"])
    );
    // The real-server harness depends on no crate of ours (not even for
    // its tests), so testing a crate against real servers compiles no
    // fleet; the contract's and the store's tests use it and nothing else
    // of ours (never the in-process fleet of toolfleet-local, which brings
    // the orchestrator).
    for dev in [false, true] {
        assert_eq!(
            our_deps_of("crates/toolfleet-testkit/Cargo.toml", dev),
            set(&[]),
            "toolfleet-testkit (dev: {dev})"
        );
    }
    for m in [
        "crates/toolfleet-protocol/Cargo.toml",
        "crates/toolfleet-store/Cargo.toml",
    ] {
        assert_eq!(our_deps_of(m, true), set(&["toolfleet-testkit"]), "{m}");
    }
    // The SDK's and the orchestrator's tests stay on their side too.
    assert!(
        !our_deps_of("crates/toolfleet-worker/Cargo.toml", true)
            .iter()
            .any(|d| d == "toolfleet-llm"
                || d == "toolfleet-orchestrator"
                || d == "toolfleet-local")
    );
    assert!(
        !our_deps_of("crates/toolfleet-orchestrator/Cargo.toml", true)
            .iter()
            .any(|d| d == "toolfleet-worker" || d.starts_with("toolfleet-worker-"))
    );
}

/// The revision macro is a procedural macro with no dependency and no
/// build script: what it reads (git's files, `TOOLFLEET_GIT_REVISION`)
/// then recompiles only the `main.rs` that expands it, never a library
/// (a build script's output is an input of every crate above it).
#[test]
fn the_revision_macro_has_no_dependency_and_no_build_script() {
    let dir = support::root().join("crates/toolfleet-build");
    let text = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    let doc: toml::Table = text.parse().unwrap();
    assert_eq!(doc["lib"]["proc-macro"].as_bool(), Some(true));
    for table in ["dependencies", "build-dependencies", "target"] {
        assert!(!doc.contains_key(table), "toolfleet-build: [{table}]");
    }
    assert!(doc["package"].get("build").is_none());
    assert!(!dir.join("build.rs").exists());
}

/// The lightest family stays light: no search engine, no tokenizer, no
/// model client. (It does link an HTTP client since every process can
/// export traces over OTLP/HTTP — one reqwest, shared with nothing else.)
#[test]
fn the_system_worker_links_no_search_engine_tokenizer_or_model_client() {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "-p",
            "toolfleet-worker-system",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(support::root())
        .output()
        .expect("cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let names: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(names.contains("toolfleet-worker"), "{tree}");
    for heavy in [
        "tantivy",
        "tiktoken-rs",
        "toolfleet-llm",
        "scraper",
        "tokio-postgres",
    ] {
        assert!(!names.contains(heavy), "the system worker links {heavy}");
    }
}
