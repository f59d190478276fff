//! The LLM tools family in the fleet (issue 11): a chat job whose model
//! calls `llm:summarize`, served by the `llm` family on the pool; the
//! tool's first model fails and the next answers; the warning reaches the
//! `tool_result` event and the tool's spend the `completed` event and the
//! metrics.

use serde_json::{Value, json};
use toolfleet_protocol::{ChatEventBody, ToolStatus};

use crate::support::{Env, Options, root};

const PROFILES: &str = r#"
[deployments.main]
base_url = "{base_url}"
model = "toolfleet-scripted"
[deployments.main.retry]
max_attempts = 1
[profiles.default]
deployment = "main"
[prices.toolfleet-scripted]
input = 1.0
output = 2.0
"#;

#[tokio::test]
async fn an_llm_tool_falls_back_across_models_and_its_spend_counts_in_the_job() {
    // llm:summarize as shipped, but preferring a model that fails.
    let dir = tempfile::tempdir().unwrap();
    let mut summarize: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tool_definitions/llm.summarize.json")).unwrap(),
    )
    .unwrap();
    summarize["modelPreference"]["preferredModel"] = json!("main/broken-model");
    summarize["modelPreference"]["fallbackModels"] = json!(["main/toolfleet-scripted"]);
    std::fs::write(dir.path().join("llm.summarize.json"), summarize.to_string()).unwrap();
    let summary = json!({"summary": "Keepers wound the lamp nightly.", "keyPoints": ["nightly"]});
    let env = Env::start_with(
        json!({
            "rules": [
                { "whenModel": ["broken-model"], "steps": [
                    { "answer": "-", "fault": { "kind": "status", "status": 503 } } ] },
                { "whenUserContains": ["summarize the text below"], "steps": [
                    { "answer": format!("```json\n{summary}\n```") } ] },
                { "whenUserContains": ["please digest"], "steps": [
                    { "toolCalls": [ { "name": "summarize",
                        "arguments": { "text": "The keepers wound the lamp every night." } } ] },
                    { "answer": "Digest: {{tool:summarize}}" } ] }
            ]
        }),
        Options {
            workers: vec!["llm"],
            profiles_toml: Some(PROFILES.to_owned()),
            defs_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("please digest the logbook").await;
    let outcome = outcome.expect("completed");
    assert!(
        outcome.text.contains("Keepers wound the lamp nightly."),
        "{}",
        outcome.text
    );
    let result = outcome
        .events
        .iter()
        .find_map(|e| match &e.body {
            ChatEventBody::ToolResult {
                tool,
                status,
                warnings,
                ..
            } => Some((tool.clone(), *status, warnings.clone())),
            _ => None,
        })
        .expect("a tool_result event");
    assert_eq!(result.0, "llm:summarize@1.0.0");
    assert_eq!(result.1, ToolStatus::Ok);
    assert_eq!(result.2.len(), 1, "{:?}", result.2);
    assert_eq!(result.2[0].code, "fallback");
    assert!(
        result.2[0].message.contains("main/broken-model failed"),
        "{:?}",
        result.2
    );
    // The tool's model call is in the job's spend, priced, purpose tool.
    let tool_calls: Vec<_> = outcome
        .llm_calls
        .iter()
        .filter(|c| c.purpose == "tool")
        .collect();
    assert_eq!(tool_calls.len(), 1, "{:?}", outcome.llm_calls);
    assert_eq!(tool_calls[0].model, "toolfleet-scripted");
    let tool_tokens = tool_calls[0].usage.total_tokens;
    assert!(tool_tokens > 0);
    let conversation: u64 = outcome
        .llm_calls
        .iter()
        .filter(|c| c.purpose == "conversation")
        .map(|c| c.usage.total_tokens)
        .sum();
    assert_eq!(outcome.usage.total_tokens, conversation + tool_tokens);
    let tool_cost = tool_calls[0].cost_usd.expect("priced");
    assert!(
        outcome.cost_usd.is_some_and(|c| c > tool_cost),
        "{:?}",
        outcome.cost_usd
    );
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains(
            "toolfleet_llm_tokens_total{kind=\"prompt\",model=\"toolfleet-scripted\",purpose=\"tool\"}"
        ),
        "{metrics}"
    );
    // The worker asked the broken model once (no retries configured), then
    // the next one; the orchestrator's own calls never went to it.
    let asked: Vec<String> = env
        .model
        .received()
        .iter()
        .map(|r| r.body["model"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        asked.iter().filter(|m| *m == "broken-model").count(),
        1,
        "{asked:?}"
    );
}

/// The LLM-tool worker holds the tenant to its rate limit as the
/// orchestrator does, in the same count: with one model call a minute, the
/// orchestrator's first call takes it, the tool's call is refused
/// `rate_limited` (its model never asked), and the orchestrator's next
/// call ends the job `rate_limited`. Without the worker's check the tool's
/// model answered.
#[tokio::test]
async fn an_llm_tools_model_call_is_held_to_the_tenants_rate_limit() {
    let profiles = format!("{PROFILES}\n[tenant_defaults]\nrequests_per_minute = 1\n");
    let env = Env::start_with(
        json!({
            "rules": [
                { "whenUserContains": ["summarize the text below"], "steps": [
                    { "answer": "```json\n{\"summary\": \"s\", \"keyPoints\": []}\n```" } ] },
                { "whenUserContains": ["please digest"], "steps": [
                    { "toolCalls": [ { "name": "summarize",
                        "arguments": { "text": "The keepers wound the lamp every night." } } ] },
                    { "answer": "Digest: {{tool:summarize}}" } ] }
            ]
        }),
        Options {
            workers: vec!["llm"],
            profiles_toml: Some(profiles),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("please digest the logbook").await;
    let error = outcome.expect_err("the job ends at the tenant's limit");
    assert!(error.to_string().contains("rate_limited"), "{error}");
    // The model was asked once: the orchestrator's first call.
    let asked = env.model.requests();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert!(!asked[0].to_string().contains("summarize the text below"));
}

/// A deployment allowing one model call at a time, shared by the
/// orchestrator and the LLM-tool worker: two chat jobs that each call the
/// model, then `llm:summarize` (the worker's call), then the model again,
/// never have two calls at the model at once. Without the worker's gate,
/// its calls overlapped the orchestrator's.
#[tokio::test]
async fn the_orchestrator_and_llm_tool_workers_share_a_deployments_concurrency() {
    let profiles = PROFILES.replace(
        "model = \"toolfleet-scripted\"\n",
        "model = \"toolfleet-scripted\"\nmax_concurrency = 1\n",
    );
    let env = Env::start_with(
        json!({
            "firstTokenDelayMs": 300,
            "rules": [
                { "whenUserContains": ["summarize the text below"], "steps": [
                    { "answer": "```json\n{\"summary\": \"s\", \"keyPoints\": []}\n```" } ] },
                { "whenUserContains": ["please digest"], "steps": [
                    { "toolCalls": [ { "name": "summarize",
                        "arguments": { "text": "The keepers wound the lamp every night." } } ] },
                    { "answer": "Digest: {{tool:summarize}}" } ] }
            ]
        }),
        Options {
            workers: vec!["llm"],
            profiles_toml: Some(profiles),
            ..Default::default()
        },
    )
    .await;
    let (a, b) = tokio::join!(
        env.ask("please digest the logbook"),
        env.ask("please digest the ledger")
    );
    a.1.expect("first job");
    b.1.expect("second job");
    let arrivals: Vec<_> = env.model.received().iter().map(|r| r.at).collect();
    assert_eq!(arrivals.len(), 6, "three model calls per job");
    let window = std::time::Duration::from_millis(250);
    let most = crate::support::most_at_once(&arrivals, window);
    assert_eq!(most, 1, "model calls at once: {arrivals:?}");
}

/// A batch job's tool calls keep its priority (`Toolfleet-Priority`): the
/// LLM tool's model call carries the deployment's batch service tier, as
/// the orchestrator's own calls do; an interactive job's carry none.
#[tokio::test]
async fn a_batch_jobs_llm_tool_calls_use_the_batch_service_tier() {
    let profiles = PROFILES.replace(
        "model = \"toolfleet-scripted\"\n",
        "model = \"toolfleet-scripted\"\nbatch_service_tier = \"flex\"\n",
    );
    let env = Env::start_with(
        json!({
            "rules": [
                { "whenUserContains": ["summarize the text below"], "steps": [
                    { "answer": "```json\n{\"summary\": \"s\", \"keyPoints\": []}\n```" } ] },
                { "whenUserContains": ["please digest"], "steps": [
                    { "toolCalls": [ { "name": "summarize",
                        "arguments": { "text": "The keepers wound the lamp every night." } } ] },
                    { "answer": "Digest: {{tool:summarize}}" } ] }
            ]
        }),
        Options {
            workers: vec!["llm"],
            profiles_toml: Some(profiles),
            ..Default::default()
        },
    )
    .await;
    let mut job = toolfleet_protocol::client::question("please digest the logbook");
    job.priority = Some(toolfleet_protocol::Priority::Batch);
    env.submit(&job).await.expect("the batch job completes");
    let asked = env.model.requests();
    assert_eq!(asked.len(), 3, "two conversation calls and the tool's");
    for request in &asked {
        assert_eq!(request["service_tier"], "flex", "{request}");
    }
    env.ask("please digest the ledger")
        .await
        .1
        .expect("the interactive job completes");
    for request in &env.model.requests()[3..] {
        assert!(request.get("service_tier").is_none(), "{request}");
    }
}
