//! The LLM tools worker over real HTTP, against the scripted model server
//! (the only stand-in): rendering, variants, resolution, the key check,
//! fallback with its hooks, JSON replies, the output-schema check, the
//! reply cap and the spend reported with the result.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_scripted::{Script, ScriptedServer};
use toolfleet_worker::protocol::tools::{ToolDefinition, load_file};
use toolfleet_worker::protocol::{CallContext, ToolWarning, registry::CompatFile};
use toolfleet_worker::{Hooks, TestCtx, ToolError, Worker};
use toolfleet_worker_llm::{LlmTool, Settings};

const SCRIPT: &str = r#"{
  "rules": [
    {"whenModel": ["broken"], "steps": [{"answer": "-", "fault": {"kind": "status", "status": 503}}]},
    {"whenModel": ["chatty"], "steps": [{"answer": "Sure! Here is your JSON: {\"summary\": 1}"}]},
    {"whenModel": ["rambling"], "steps": [{"answer": "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty"}]},
    {"whenUserContains": ["mismatch"], "steps": [{"answer": "{\"title\": \"no summary here\"}"}]},
    {"whenUserContains": ["summarize"], "steps": [{"answer": "```json\n{\"summary\": \"Lighthouses guided ships.\"}\n```"}]},
    {"whenUserContains": ["translate"], "steps": [{"answer": "Bonjour ({{user}})"}]}
  ]
}"#;

struct Fixture {
    server: ScriptedServer,
    dir: tempfile::TempDir,
}

async fn fixture() -> Fixture {
    let server = ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Script::from_json(SCRIPT).unwrap(),
    )
    .await
    .unwrap();
    Fixture {
        server,
        dir: tempfile::tempdir().unwrap(),
    }
}

impl Fixture {
    /// Deployments `main` and `backup` on the scripted server (no retries,
    /// so a failure moves on at once) and `keyless`, whose key variable is
    /// never set; a price for `gpt-test`.
    fn config(&self) -> ModelConfig {
        let url = self.server.base_url();
        ModelConfig::from_toml(
            &format!(
                r#"
[deployments.main]
base_url = "{url}"
model = "gpt-test"
retry = {{ max_attempts = 1 }}
[deployments.backup]
base_url = "{url}"
model = "gpt-test"
retry = {{ max_attempts = 1 }}
[deployments.keyless]
base_url = "{url}"
model = "gpt-test"
api_key_env = "TOOLFLEET_TEST_KEY_NEVER_SET"
[profiles.default]
deployment = "main"
[prices.gpt-test]
input = 1.0
output = 2.0
"#
            ),
            "test.toml",
        )
        .unwrap()
    }

    fn write(&self, name: &str, definition: &Value) -> std::path::PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, definition.to_string()).unwrap();
        path
    }

    fn worker(&self, settings: &Settings) -> Result<Worker, toolfleet_worker::WorkerError> {
        toolfleet_worker_llm::worker(
            self.dir.path(),
            &self.config(),
            &BTreeMap::<String, String>::new(),
            settings,
        )
    }

    fn tool(&self, settings: &Settings) -> LlmTool {
        toolfleet_worker_llm::llm_tool(
            self.dir.path(),
            &self.config(),
            &BTreeMap::<String, String>::new(),
            settings,
        )
        .unwrap()
        .0
    }

    /// What the server was asked, as `(model, system, user)`.
    fn asked(&self) -> Vec<(String, String, String)> {
        self.server
            .received()
            .iter()
            .map(|r| {
                let messages = r.body["messages"].as_array().cloned().unwrap_or_default();
                let content = |role: &str| {
                    messages
                        .iter()
                        .find(|m| m["role"] == role)
                        .and_then(|m| m["content"].as_str())
                        .unwrap_or_default()
                        .to_owned()
                };
                (
                    r.body["model"].as_str().unwrap_or_default().to_owned(),
                    content("system"),
                    content("user"),
                )
            })
            .collect()
    }
}

fn summarize(preferred: &str, fallbacks: &[&str]) -> Value {
    json!({
        "schemaVersion": 1, "id": "llm:summarize@1.0.0", "implementationKey": "llm.summarize",
        "title": "Summarize", "description": "Summarizes a text.", "category": "text",
        "systemPrompt": "You write faithful summaries.",
        "userTemplate": "Summarize ({{ style }}):\n\n{{ text }}",
        "outputFormat": "json",
        "outputSchema": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]},
        "outputExample": {"summary": "Two sentences."},
        "modelPreference": {"preferredModel": preferred, "fallbackModels": fallbacks, "temperature": 0.2},
        "function": {"name": "summarize", "description": "Summarizes a text.", "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "style": {"type": "string", "default": "neutral"}},
            "required": ["text"]}}
    })
}

fn translate(variants: Value) -> Value {
    json!({
        "schemaVersion": 1, "id": "llm:translate@1.0.0", "implementationKey": "llm.translate",
        "title": "Translate", "description": "Translates.", "category": "text",
        "systemPrompt": "You translate.",
        "userTemplate": "Translate to {{ language }}{% if tone %} ({{ tone }}){% endif %}: {{ text }}",
        "modelPreference": {"preferredModel": "main/gpt-test"},
        "variants": variants,
        "function": {"name": "translate", "description": "Translates.", "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "language": {"type": "string"}, "tone": {"type": "string"}},
            "required": ["text", "language"]}}
    })
}

fn definition(path: &Path) -> ToolDefinition {
    load_file(path).unwrap()
}

/// Every hook call, in order, as text.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn push(&self, event: String) {
        self.0.lock().unwrap().push(event);
    }
    fn events(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

impl Hooks for Recorder {
    fn on_attempt_start(&self, _: &CallContext, backend: &str) {
        self.push(format!("start {backend}"));
    }
    fn on_attempt_complete(&self, _: &CallContext, backend: &str) {
        self.push(format!("complete {backend}"));
    }
    fn on_attempt_error(&self, _: &CallContext, backend: &str, _: &str) {
        self.push(format!("error {backend}"));
    }
    fn on_fallback(&self, _: &CallContext, from: &str, to: &str, _: &str) {
        self.push(format!("fallback {from} -> {to}"));
    }
    fn on_warning(&self, _: &CallContext, warning: &ToolWarning) {
        self.push(format!("warning {}", warning.code));
    }
}

#[tokio::test]
async fn a_json_tool_renders_its_prompt_and_parses_a_fenced_reply() {
    let f = fixture().await;
    let path = f.write("summarize.json", &summarize("main/gpt-test", &[]));
    let tool = f.tool(&Settings::default());
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(&definition(&path), &tool, json!({"text": "Lighthouses."}))
        .await
        .unwrap();
    assert_eq!(
        out.data,
        Some(json!({"summary": "Lighthouses guided ships."}))
    );
    assert_eq!(out.content, r#"{"summary":"Lighthouses guided ships."}"#);
    let asked = f.asked();
    assert_eq!(asked.len(), 1);
    let (model, system, user) = &asked[0];
    assert_eq!(model, "gpt-test", "the model part of main/gpt-test is sent");
    assert_eq!(
        user, "Summarize (neutral):\n\nLighthouses.",
        "defaults filled in"
    );
    assert!(system.starts_with("Answer with one JSON value"), "{system}");
    assert!(
        system.contains(r#""required":["summary"]"#),
        "the schema: {system}"
    );
    assert!(
        system.contains(r#"{"summary":"Two sentences."}"#),
        "the example: {system}"
    );
    assert!(
        system.ends_with("You write faithful summaries."),
        "{system}"
    );
    let body = &f.server.received()[0].body;
    assert_eq!(body["temperature"], json!(0.2));
    // The spend travels with the result, priced.
    let calls = ctx.llm_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].model, "gpt-test");
    assert_eq!(calls[0].purpose, "tool");
    assert!(calls[0].usage.total_tokens > 0);
    assert!(calls[0].cost_usd.is_some_and(|c| c > 0.0), "{calls:?}");
    assert!(ctx.warnings().is_empty());
}

#[tokio::test]
async fn a_failing_model_falls_back_with_hooks_and_a_warning() {
    let f = fixture().await;
    let path = f.write(
        "summarize.json",
        &summarize("main/broken", &["backup/chatty", "backup/gpt-test"]),
    );
    let tool = f.tool(&Settings::default());
    let recorder = Arc::new(Recorder::default());
    let ctx = TestCtx::new().with_hooks(recorder.clone());
    let out = ctx
        .call_checked(&definition(&path), &tool, json!({"text": "x"}))
        .await
        .unwrap();
    assert_eq!(
        out.data,
        Some(json!({"summary": "Lighthouses guided ships."}))
    );
    assert_eq!(
        recorder.events(),
        [
            "start main/broken",
            "error main/broken",
            "fallback main/broken -> backup/chatty",
            "warning fallback",
            "start backup/chatty",
            "error backup/chatty",
            "fallback backup/chatty -> backup/gpt-test",
            "warning fallback",
            "start backup/gpt-test",
            "complete backup/gpt-test",
        ]
    );
    let warnings = ctx.warnings();
    assert_eq!(warnings.len(), 2);
    assert!(
        warnings[0].message.contains("main/broken failed"),
        "{warnings:?}"
    );
    assert!(warnings[0].message.contains("503"), "{warnings:?}");
    assert!(
        warnings[1].message.contains("not JSON") && warnings[1].message.contains("Sure! Here is"),
        "an unparseable reply quotes what came back: {warnings:?}"
    );
    // The chatty attempt's tokens were spent and are counted.
    let models: Vec<String> = ctx.llm_calls().iter().map(|c| c.model.clone()).collect();
    assert_eq!(models, ["chatty", "gpt-test"]);
}

#[tokio::test]
async fn when_every_model_fails_the_error_lists_each() {
    let f = fixture().await;
    let path = f.write(
        "summarize.json",
        &summarize("main/broken", &["backup/chatty", "keyless/gpt-test"]),
    );
    let tool = f.tool(&Settings::default());
    let err = TestCtx::new()
        .call_checked(&definition(&path), &tool, json!({"text": "x"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "fallback_exhausted");
    let message = err.to_string();
    assert!(
        message.contains("main/broken: ") && message.contains("503"),
        "{message}"
    );
    assert!(
        message.contains("backup/chatty: ") && message.contains("not JSON"),
        "{message}"
    );
    assert!(
        message.contains("keyless/gpt-test: no API key")
            && message.contains("TOOLFLEET_TEST_KEY_NEVER_SET"),
        "{message}"
    );
    assert!(!err.is_retryable());
}

#[tokio::test]
async fn no_key_for_any_model_fails_at_once_naming_them() {
    let f = fixture().await;
    let path = f.write("summarize.json", &summarize("keyless/gpt-test", &[]));
    let tool = f.tool(&Settings::default());
    let recorder = Arc::new(Recorder::default());
    let err = TestCtx::new()
        .with_hooks(recorder.clone())
        .call_checked(&definition(&path), &tool, json!({"text": "x"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "no_model_available");
    assert!(
        err.to_string().contains("keyless/gpt-test: no API key")
            && err
                .to_string()
                .contains("TOOLFLEET_TEST_KEY_NEVER_SET is not set"),
        "{err}"
    );
    assert!(f.server.received().is_empty(), "nothing was asked");
    assert!(recorder.events().is_empty(), "no attempt was made");
}

#[tokio::test]
async fn an_answer_that_misses_the_output_schema_is_returned_with_a_warning() {
    let f = fixture().await;
    let path = f.write("summarize.json", &summarize("main/gpt-test", &[]));
    let tool = f.tool(&Settings::default());
    let ctx = TestCtx::new();
    // "mismatch" in the text: the script answers JSON without `summary`.
    let out = ctx
        .call_checked(&definition(&path), &tool, json!({"text": "mismatch"}))
        .await
        .unwrap();
    assert_eq!(out.data, Some(json!({"title": "no summary here"})));
    let warnings = ctx.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].code, "output_schema_mismatch");
    assert!(warnings[0].message.contains("summary"), "{warnings:?}");
}

#[tokio::test]
async fn variants_are_chosen_by_model_and_optional_variables_may_be_absent() {
    let f = fixture().await;
    let path = f.write(
        "translate.json",
        &translate(json!({
            "backup": {"models": ["backup/*"], "systemPrompt": "You translate for the backup."},
            "plain": {"default": true, "userTemplate": "Into {{ language }}: {{ text }}"}
        })),
    );
    let tool = f.tool(&Settings::default());
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(
            &definition(&path),
            &tool,
            json!({"text": "translate me", "language": "French"}),
        )
        .await
        .unwrap();
    assert_eq!(out.content, "Bonjour (Into French: translate me)");
    assert!(out.data.is_none(), "a text tool has no data");
    let (_, system, user) = &f.asked()[0];
    assert_eq!(
        system, "You translate.",
        "the default variant keeps the tool's system prompt"
    );
    assert_eq!(user, "Into French: translate me");
}

#[tokio::test]
async fn the_compat_file_is_tried_first_and_clients_are_pooled() {
    let f = fixture().await;
    let path = f.write(
        "translate.json",
        &translate(json!({
            "backup": {"models": ["backup/*"], "systemPrompt": "You translate for the backup."}
        })),
    );
    let compat = CompatFile::from_json(
        r#"{"tools": {"llm:translate": ["backup/gpt-test", "main/gpt-test"]}}"#,
        "compat.json",
    )
    .unwrap();
    let settings = Settings {
        compat: Some(Arc::new(compat)),
        ..Settings::default()
    };
    let tool = f.tool(&settings);
    let ctx = TestCtx::new();
    for _ in 0..3 {
        ctx.call_checked(
            &definition(&path),
            &tool,
            json!({"text": "translate me", "language": "French", "tone": "formal"}),
        )
        .await
        .unwrap();
    }
    let asked = f.asked();
    assert_eq!(asked.len(), 3);
    let (_, system, user) = &asked[0];
    assert_eq!(
        system, "You translate for the backup.",
        "backup/* matched first"
    );
    assert_eq!(user, "Translate to French (formal): translate me");
    assert_eq!(
        f.server.connections(),
        1,
        "one pooled connection served every call"
    );
}

#[tokio::test]
async fn a_reply_over_the_cap_is_cut_with_a_notice() {
    let f = fixture().await;
    let mut def = translate(json!({}));
    def["modelPreference"] = json!({"preferredModel": "main/rambling"});
    let path = f.write("translate.json", &def);
    let settings = Settings {
        max_reply_chars: 20,
        ..Settings::default()
    };
    let tool = f.tool(&settings);
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(
            &definition(&path),
            &tool,
            json!({"text": "x", "language": "y"}),
        )
        .await
        .unwrap();
    assert!(
        out.content.starts_with("one two three four f"),
        "{}",
        out.content
    );
    assert!(
        out.content
            .ends_with("[The reply was cut at 20 characters.]"),
        "{}",
        out.content
    );
    assert_eq!(ctx.warnings()[0].code, "reply_truncated");
    // A json tool cannot use a cut reply: the attempt fails.
    let mut def = summarize("main/rambling", &[]);
    def["id"] = json!("llm:summarize@1.0.0");
    let path = f.write("summarize.json", &def);
    let tool = f.tool(&settings);
    let err = TestCtx::new()
        .call_checked(&definition(&path), &tool, json!({"text": "x"}))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("longer than 20 characters"),
        "{err}"
    );
}

#[tokio::test]
async fn definitions_that_cannot_be_served_are_refused_at_start_with_file_and_field() {
    let f = fixture().await;
    let mut bad = summarize("main/gpt-test", &[]);
    bad["userTemplate"] = json!("{{ text }} in {{ language }}");
    let path = f.write("summarize.json", &bad);
    let err = f.worker(&Settings::default()).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(
        err.contains("userTemplate") && err.contains("language"),
        "{err}"
    );

    let mut bad = summarize("main/gpt-test", &[]);
    bad["outputSchema"] = json!({"type": 12});
    bad.as_object_mut().unwrap().remove("outputExample");
    let path = f.write("summarize.json", &bad);
    let err = f.worker(&Settings::default()).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("/outputSchema"), "{err}");

    f.write("summarize.json", &summarize("nowhere/gpt-test", &[]));
    let err = f.worker(&Settings::default()).unwrap_err().to_string();
    assert!(err.contains("modelPreference.preferredModel"), "{err}");
    assert!(err.contains("\"nowhere\""), "{err}");

    f.write(
        "summarize.json",
        &translate(json!({"v": {"models": ["azure/*"]}})),
    );
    let err = f.worker(&Settings::default()).unwrap_err().to_string();
    assert!(err.contains("variants.v.models[0]"), "{err}");

    let mut none = translate(json!({}));
    none.as_object_mut().unwrap().remove("modelPreference");
    f.write("summarize.json", &none);
    let err = f.worker(&Settings::default()).unwrap_err().to_string();
    assert!(err.contains("no model to run it with"), "{err}");
    // The worker's default model serves a tool that names none.
    let settings = Settings {
        default_model: Some("main/gpt-test".into()),
        ..Settings::default()
    };
    let worker = f.worker(&settings).unwrap();
    let ids: Vec<String> = worker.definitions().map(|d| d.id.to_string()).collect();
    assert_eq!(ids, ["llm:translate@1.0.0"]);
    let settings = Settings {
        default_model: Some("gpt-test".into()),
        ..Settings::default()
    };
    assert!(
        f.worker(&settings)
            .unwrap_err()
            .to_string()
            .contains("default model")
    );
}

#[tokio::test]
async fn invalid_arguments_never_reach_the_model() {
    let f = fixture().await;
    let path = f.write("summarize.json", &summarize("main/gpt-test", &[]));
    let tool = f.tool(&Settings::default());
    let err = TestCtx::new()
        .call_checked(&definition(&path), &tool, json!({"style": "terse"}))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::InvalidInput(_)), "{err:?}");
    assert!(f.server.received().is_empty());
}

#[tokio::test]
async fn the_first_request_is_what_a_call_sends_first() {
    let f = fixture().await;
    let path = f.write(
        "summarize.json",
        &summarize("main/gpt-test", &["backup/gpt-test"]),
    );
    let tool = f.tool(&Settings::default());
    let args = json!({"text": "Lighthouses.", "style": "neutral"});
    let (request, client) = tool.first_request(&definition(&path).id, &args).unwrap();
    assert_eq!(request.model, "gpt-test");
    // Sent straight to the model, it is the request a call sends.
    client.stream_chat(&request, |_| {}).await.unwrap();
    TestCtx::new()
        .call_checked(&definition(&path), &tool, args)
        .await
        .unwrap();
    let asked = f.asked();
    assert_eq!(asked[0], asked[1]);
    assert!(
        tool.first_request(&"llm:nothing@1.0.0".parse().unwrap(), &json!({}))
            .is_err()
    );
}
