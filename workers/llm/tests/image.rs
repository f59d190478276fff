//! `content:generate_image` over real HTTP against the scripted model
//! server's images endpoint: a URL is cited as it is; base64 is stored as
//! a blob and only its reference reaches the model; a refused prompt is
//! the model's to rephrase.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_scripted::{Script, ScriptedServer};
use toolfleet_worker::protocol::tools::load_file;
use toolfleet_worker::{TestCtx, ToolError};
use toolfleet_worker_llm::{Providers, Settings, image::GenerateImage};

const IMAGE_BYTES: usize = 2 * 1024 * 1024;

async fn server() -> ScriptedServer {
    ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Script::from_json(&json!({"imageBytes": IMAGE_BYTES}).to_string()).unwrap(),
    )
    .await
    .unwrap()
}

fn config(server: &ScriptedServer) -> ModelConfig {
    ModelConfig::from_toml(
        &format!(
            "[deployments.main]\nbase_url = \"{}\"\nmodel = \"gpt-test\"\nretry = {{ max_attempts = 1 }}\n\
             [profiles.default]\ndeployment = \"main\"\n",
            server.base_url()
        ),
        "test.toml",
    )
    .unwrap()
}

fn shipped() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions")
}

fn image_tool(server: &ScriptedServer, model: Option<&str>) -> Option<GenerateImage> {
    let providers =
        Arc::new(Providers::new(&config(server), &BTreeMap::<String, String>::new()).unwrap());
    let settings = Settings {
        image_model: model.map(str::to_owned),
        ..Settings::default()
    };
    toolfleet_worker_llm::image_tool(&shipped(), &providers, &settings)
        .unwrap()
        .map(|(tool, _)| tool)
}

#[tokio::test]
async fn base64_images_become_blobs_and_only_their_reference_reaches_the_model() {
    let server = server().await;
    let tool = image_tool(&server, Some("main/gpt-image-1")).expect("served");
    let definition = load_file(shipped().join("content.generate_image.json")).unwrap();
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(
            &definition,
            &tool,
            json!({"prompt": "a lighthouse at dusk"}),
        )
        .await
        .unwrap();
    assert!(
        out.content.len() < 300,
        "no image bytes in the content: {}",
        out.content.len()
    );
    assert!(
        out.content
            .starts_with("Generated the image: toolfleet-blob:test-invocation/call-1.1"),
        "{}",
        out.content
    );
    assert!(
        out.content.contains("image/png") && out.content.ends_with("[doc:1]"),
        "{}",
        out.content
    );
    let data = out.data.unwrap();
    assert_eq!(data["blob"], "toolfleet-blob:test-invocation/call-1.1");
    assert_eq!(data["bytes"], IMAGE_BYTES);
    assert_eq!(data["model"], "main/gpt-image-1");
    let blobs = ctx.blobs();
    let blob = &blobs["toolfleet-blob:test-invocation/call-1.1"];
    assert_eq!(blob.bytes.len(), IMAGE_BYTES);
    assert_eq!(blob.content_type, "image/png");
    assert!(blob.bytes.starts_with(b"\x89PNG"));
    let refs = ctx.references();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].kind, "image");
    assert_eq!(
        refs[0].url.as_deref(),
        Some("toolfleet-blob:test-invocation/call-1.1")
    );
    // gpt-image models are not sent response_format (they refuse it).
    let body = &server.received()[0].body;
    assert_eq!(body["model"], "gpt-image-1");
    assert!(body.get("response_format").is_none(), "{body}");
    assert_eq!(body["size"], "1024x1024", "the schema's default");
    // The spend (the endpoint's token usage) travels with the result.
    assert_eq!(ctx.llm_calls().len(), 1);
}

#[tokio::test]
async fn url_images_are_cited_as_they_are() {
    let server = server().await;
    let tool = image_tool(&server, Some("main/dall-e-3")).expect("served");
    let definition = load_file(shipped().join("content.generate_image.json")).unwrap();
    let ctx = TestCtx::new();
    let out = ctx
        .call_checked(
            &definition,
            &tool,
            json!({"prompt": "a lighthouse", "size": "1536x1024"}),
        )
        .await
        .unwrap();
    let url = out.data.as_ref().unwrap()["url"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(url.starts_with("https://images.scripted.invalid/"), "{url}");
    assert!(out.content.contains(&url), "{}", out.content);
    assert!(ctx.blobs().is_empty());
    assert_eq!(ctx.references()[0].url.as_deref(), Some(url.as_str()));
    assert_eq!(server.received()[0].body["response_format"], "url");
}

#[tokio::test]
async fn a_refused_prompt_is_for_the_model_to_rephrase() {
    let server = server().await;
    let tool = image_tool(&server, Some("main/dall-e-3")).expect("served");
    let definition = load_file(shipped().join("content.generate_image.json")).unwrap();
    let err = TestCtx::new()
        .call_checked(&definition, &tool, json!({"prompt": "please refuse image"}))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::InvalidInput(_)), "{err:?}");
    assert!(err.to_string().contains("Rephrase"), "{err}");
}

#[tokio::test]
async fn without_an_image_model_the_tool_is_not_served() {
    let server = server().await;
    assert!(image_tool(&server, None).is_none());
    let worker = toolfleet_worker_llm::worker(
        &shipped(),
        &config(&server),
        &BTreeMap::<String, String>::new(),
        &Settings {
            default_model: Some("main/gpt-test".into()),
            ..Settings::default()
        },
    )
    .unwrap();
    assert!(
        !worker
            .definitions()
            .any(|d| d.id.to_string() == "content:generate_image@1.0.0")
    );
    let worker = toolfleet_worker_llm::worker(
        &shipped(),
        &config(&server),
        &BTreeMap::<String, String>::new(),
        &Settings {
            default_model: Some("main/gpt-test".into()),
            image_model: Some("main/gpt-image-1".into()),
            ..Settings::default()
        },
    )
    .unwrap();
    assert!(
        worker
            .definitions()
            .any(|d| d.id.to_string() == "content:generate_image@1.0.0")
    );
}
