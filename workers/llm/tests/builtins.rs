//! The built-in LLM tools shipped in `tool_definitions/`, each called over
//! real HTTP against the scripted model server: the prompt the model gets,
//! and the answer checked against the tool's output schema.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_scripted::{Script, ScriptedServer};
use toolfleet_worker::TestCtx;
use toolfleet_worker::protocol::schema::Validator;
use toolfleet_worker::protocol::tools::{ToolDefinition, load_file};
use toolfleet_worker_llm::{LlmTool, Settings};

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions")
}

fn definition(file: &str) -> ToolDefinition {
    load_file(shipped().join(file)).unwrap()
}

/// A JSON answer as the script's `answer` text.
fn answer(value: &Value) -> Value {
    json!({"answer": value.to_string()})
}

fn chart() -> Value {
    json!({"type": "bar", "data": {"labels": ["2024", "2025"],
        "datasets": [{"label": "Ships", "data": [135, 160]}]},
        "options": {"plugins": {"title": {"display": true, "text": "Ships per year"}}}})
}

fn script() -> String {
    let rules = json!([
        {"whenModel": ["sloppy"], "whenUserContains": ["chart to make"],
         "steps": [answer(&json!({"type": "bar", "data": {"labels": ["a"], "datasets": [{"data": ["lots"]}]}}))]},
        {"whenUserContains": ["summarize the text below"],
         "steps": [answer(&json!({"summary": "The keeper wound the lamp.", "keyPoints": ["Lamp wound"]}))]},
        {"whenUserContains": ["labels: billing, shipping"],
         "steps": [answer(&json!({"labels": [{"label": "billing", "confidence": 0.9}], "rationale": "Charged twice."}))]},
        {"whenUserContains": ["criterion:"],
         "steps": [answer(&json!({"score": 8, "rationale": "Clear and complete."}))]},
        {"whenUserContains": ["fill these fields"],
         "steps": [answer(&json!({"data": {"name": "Ada", "guests": 2}, "missing": ["phone"]}))]},
        {"whenUserContains": ["request:"],
         "steps": [answer(&json!({"needsClarification": true, "questions": ["Which Paris?"], "assumptions": []}))]},
        {"whenUserContains": ["facts"],
         "steps": [answer(&json!({"facts": [{"statement": "It was automated in 1962.", "quote": "automated in 1962"}]}))]},
        {"whenUserContains": ["chart to make"], "steps": [answer(&chart())]}
    ]);
    json!({"rules": rules}).to_string()
}

struct Fixture {
    server: ScriptedServer,
}

impl Fixture {
    async fn start() -> Self {
        let server = ScriptedServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Script::from_json(&script()).unwrap(),
        )
        .await
        .unwrap();
        Self { server }
    }

    fn tool(&self, default_model: &str) -> LlmTool {
        let config = ModelConfig::from_toml(
            &format!(
                "[deployments.main]\nbase_url = \"{}\"\nmodel = \"gpt-test\"\nretry = {{ max_attempts = 1 }}\n\
                 [profiles.default]\ndeployment = \"main\"\n",
                self.server.base_url()
            ),
            "test.toml",
        )
        .unwrap();
        let settings = Settings {
            default_model: Some(default_model.into()),
            ..Settings::default()
        };
        let (tool, served) = toolfleet_worker_llm::llm_tool(
            &shipped(),
            &config,
            &BTreeMap::<String, String>::new(),
            &settings,
        )
        .unwrap();
        let mut ids: Vec<String> = served.iter().map(|d| d.id.to_string()).collect();
        ids.sort();
        assert_eq!(
            ids,
            [
                "content:generate_chart@1.0.0",
                "llm:clarify@1.0.0",
                "llm:classify@1.0.0",
                "llm:fact_extract@1.0.0",
                "llm:score@1.0.0",
                "llm:structure@1.0.0",
                "llm:summarize@1.0.0",
            ],
            "every built-in is served, and nothing of other families"
        );
        tool
    }

    /// The last user message the model got.
    fn last_prompt(&self) -> String {
        let received = self.server.received();
        let body = &received.last().unwrap().body;
        body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .rfind(|m| m["role"] == "user")
            .and_then(|m| m["content"].as_str())
            .unwrap()
            .to_owned()
    }
}

/// Calls `file`'s tool and checks the answer against its output schema.
async fn call(f: &Fixture, tool: &LlmTool, file: &str, args: Value) -> Value {
    let definition = definition(file);
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(&definition, tool, args)
        .await
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    assert!(ctx.warnings().is_empty(), "{file}: {:?}", ctx.warnings());
    let data = out.data.expect("json tools return data");
    let schema = definition
        .output_schema
        .clone()
        .unwrap_or_else(toolfleet_worker_llm::chart_schema);
    Validator::compile(&schema)
        .unwrap()
        .validate(&data)
        .unwrap_or_else(|v| panic!("{file}: {v:?}"));
    assert_eq!(ctx.llm_calls().len(), 1, "{file}");
    let _ = f;
    data
}

#[tokio::test]
async fn each_builtin_renders_its_prompt_and_returns_what_its_schema_promises() {
    let f = Fixture::start().await;
    let tool = f.tool("main/gpt-test");

    let data = call(
        &f,
        &tool,
        "llm.summarize.json",
        json!({"text": "The keeper wound the lamp every four hours."}),
    )
    .await;
    assert_eq!(data["summary"], "The keeper wound the lamp.");
    let prompt = f.last_prompt();
    assert!(
        prompt.contains("in the style \"brief\", in at most 120 words"),
        "{prompt}"
    );
    assert!(
        prompt.ends_with("The keeper wound the lamp every four hours."),
        "{prompt}"
    );

    let data = call(
        &f,
        &tool,
        "llm.classify.json",
        json!({"text": "I was charged twice", "labels": ["billing", "shipping"]}),
    )
    .await;
    assert_eq!(data["labels"][0]["label"], "billing");
    let prompt = f.last_prompt();
    assert!(prompt.contains("Exactly one label applies"), "{prompt}");
    assert!(
        !prompt.contains("How to decide"),
        "no instructions given: {prompt}"
    );

    let data = call(
        &f,
        &tool,
        "llm.score.json",
        json!({"text": "An answer.", "criterion": "Is it complete?"}),
    )
    .await;
    assert_eq!(data["score"], 8);
    assert!(f.last_prompt().contains("Scale: 1 (worst) to 10 (best)."));

    let data = call(&f, &tool, "llm.structure.json", json!({"text": "Ada, two guests", "fields": [
        {"name": "name"}, {"name": "guests", "type": "integer", "description": "how many"}, {"name": "phone"}]})).await;
    assert_eq!(data["missing"], json!(["phone"]));
    let prompt = f.last_prompt();
    assert!(
        prompt.contains("- name (string)\n- guests (integer): how many\n- phone (string)"),
        "{prompt}"
    );

    let data = call(
        &f,
        &tool,
        "llm.clarify.json",
        json!({"request": "Book me a hotel in Paris"}),
    )
    .await;
    assert_eq!(data["needsClarification"], true);
    assert!(!f.last_prompt().contains("Already known"));

    let data = call(
        &f,
        &tool,
        "llm.fact_extract.json",
        json!({"text": "It was automated in 1962.", "topic": "the lighthouse"}),
    )
    .await;
    assert_eq!(data["facts"][0]["quote"], "automated in 1962");
    assert!(
        f.last_prompt()
            .contains("List at most 10 facts about the lighthouse")
    );

    let data = call(&f, &tool, "content.generate_chart.json", json!({"data": "year,ships\n2024,135\n2025,160", "description": "ships per year", "chartType": "bar"})).await;
    assert_eq!(data, chart());
    // The JSON-only instruction shows the chart schema from schemas/.
    let received = f.server.received();
    let system = received.last().unwrap().body["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        system.contains("polarArea") && system.contains("datasets"),
        "{system}"
    );
}

#[tokio::test]
async fn a_chart_that_does_not_validate_moves_on_to_the_next_model() {
    let f = Fixture::start().await;
    let tool = f.tool("main/sloppy");
    let mut definition = definition("content.generate_chart.json");
    definition.model_preference = Some(toolfleet_worker::protocol::tools::ModelPreference {
        preferred_model: Some("main/sloppy".into()),
        fallback_models: vec!["main/gpt-test".into()],
        ..Default::default()
    });
    // The tool was built from the shipped file (default model only): build
    // one from this definition.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("chart.json"),
        serde_json::to_string(&definition).unwrap(),
    )
    .unwrap();
    let config = ModelConfig::from_toml(
        &format!(
            "[deployments.main]\nbase_url = \"{}\"\nmodel = \"gpt-test\"\nretry = {{ max_attempts = 1 }}\n\
             [profiles.default]\ndeployment = \"main\"\n",
            f.server.base_url()
        ),
        "test.toml",
    )
    .unwrap();
    let (tool2, _) = toolfleet_worker_llm::llm_tool(
        dir.path(),
        &config,
        &BTreeMap::<String, String>::new(),
        &Settings::default(),
    )
    .unwrap();
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(
            &definition,
            &tool2,
            json!({"data": "a,1", "description": "chart to make"}),
        )
        .await
        .unwrap();
    assert_eq!(out.data, Some(chart()));
    let warnings = ctx.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].code, "fallback");
    assert!(
        warnings[0]
            .message
            .contains("does not match the output schema"),
        "{warnings:?}"
    );
    // With only the sloppy model, nothing passes: the call fails.
    let err = TestCtx::new()
        .call_checked(
            &definition,
            &tool,
            json!({"data": "a,1", "description": "x"}),
        )
        .await;
    let err = match err {
        Err(e) => e,
        Ok(out) => panic!("a chart that does not validate was returned: {out:?}"),
    };
    assert_eq!(err.code(), "fallback_exhausted");
}
