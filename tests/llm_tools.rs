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
