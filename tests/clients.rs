//! Clients in other languages, written only from the README and
//! `schemas/`, against a real fleet: what a platform team's backend does.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{self, Env};

/// Runs `tests/clients/<script>` (nats-py) against `env` as tenant `acme`;
/// the one JSON line it prints.
async fn python(env: &Env, script: &str) -> Value {
    let child = tokio::process::Command::new("python3")
        .arg(support::root().join("tests/clients").join(script))
        .arg(env.nats.url())
        .arg("acme")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), child)
        .await
        .unwrap_or_else(|_| panic!("{script} finished"))
        .expect("python3 runs (nats-py installed: scripts/ensure-servers)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stderr}");
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

/// `tests/clients/python_client.py` (nats-py): asks as tenant `acme`,
/// follows the events to a cited answer, checks a retried submit is not
/// run again, reads the answer back from the events stream (and a 404 for
/// an unknown invocation), and cancels a slow question.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_written_from_the_readme_asks_follows_and_cancels() {
    let acme_corpus = support::Options {
        corpus_tenant: Some("acme"),
        ..Default::default()
    };
    let env = Env::start_with(json!({
        "rules": [
            { "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 30000 }, "answer": "too late" } ] },
            { "whenUserContains": ["lighthouse"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "lighthouse fog signals warn ships", "topK": 2 } } ] },
                { "answer": "Lighthouses: {{tool:search_data_sources}}" }
            ] }
        ]
    }), acme_corpus)
    .await;
    let seen = python(&env, "python_client.py").await;
    let types: Vec<&str> = seen["answer"]["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    for kind in [
        "started",
        "tool_call",
        "tool_result",
        "references",
        "completed",
    ] {
        assert!(types.contains(&kind), "{kind} missing from {types:?}");
    }
    assert!(
        !seen["answer"]["references"].as_array().unwrap().is_empty(),
        "{seen}"
    );
    assert_eq!(seen["stored"], "completed");
    assert_eq!(seen["cancelled"], "cancelled");
}

/// `tests/clients/python_approver.py` (nats-py), written from the README's
/// approvals section and the schemas: a call parks, a bad decision is
/// refused with its code, a denial is recorded, and the model reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_approver_written_from_the_readme_denies_a_held_call() {
    let env = Env::start_with(
        json!({
            "rules": [{ "whenUserContains": ["one clock"], "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The model read: {{tool:current_datetime}}" }
            ] }]
        }),
        support::Options {
            workers: vec!["system"],
            profiles_toml: Some(
                "default_profile = \"default\"\n[deployments.scripted]\nbase_url = \"{base_url}\"\n\
                 model = \"toolfleet-scripted\"\n[profiles.default]\ndeployment = \"scripted\"\n\
                 require_approval = [\"system:current_datetime\"]\n"
                    .into(),
            ),
            ..Default::default()
        },
    )
    .await;
    let seen = python(&env, "python_approver.py").await;
    assert_eq!(seen["tool"], "system:current_datetime@1.0.0", "{seen}");
    assert_eq!(seen["refused"], "malformed_approval", "{seen}");
    assert_eq!(seen["resolved"], json!(["denied"]), "{seen}");
    assert_eq!(
        seen["results"],
        json!([["blocked", "approval_denied"]]),
        "{seen}"
    );
    assert!(
        seen["text"]
            .as_str()
            .is_some_and(|t| t.contains("clocks are off limits")),
        "{seen}"
    );
}
