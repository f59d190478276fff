//! The direct floor of `--mode chat` (`toolfleet bench --mode chat
//! --floor`): what one program that needs no fleet does to answer the same
//! questions. The same model calls — the question with the same tools
//! offered, then the tool results — go straight to the same scripted model
//! over one [`LlmClient`] built from the same deployment, and each tool
//! call the model asks for is run by the same tool's function in this
//! process ([`TestCtx::call_in`]), over its own copy of the corpus' index.
//! No NATS, no Redis, no orchestrator, no worker runtime: the fleet's
//! chat-job figures over this floor are the fleet's whole cost per job.
//! Like the fleet, it searches the profile's data source with the question
//! before the first model call when the profile pre-fetches (the same tool,
//! the same `topK`), and gives the model what it found.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use toolfleet_config::FleetConfig;
use toolfleet_llm::deployments::ProcessEnv;
use toolfleet_llm::{ChatRequest, LlmClient, Message, ToolSpec};
use toolfleet_protocol::InvocationContext;
use toolfleet_worker::Worker;
use toolfleet_worker::testing::TestCtx;

use crate::bench::Op;
use crate::families::IndexArgs;

/// The families whose tools the bench's chat questions call.
const FAMILIES: [&str; 2] = ["system", "retrieval"];

/// The search the fleet's pre-fetch runs on a data source.
const PREFETCH_SEARCH: &str = "search_data_sources";

/// The most model turns one question may take (the bench's script takes
/// two).
const MAX_TURNS: usize = 8;

/// One client answering questions with tools, as a program without the
/// fleet would.
pub struct DirectChat {
    client: LlmClient,
    model: String,
    system_prompt: Option<String>,
    /// The profile's pre-fetch: `topK` of the search before the first
    /// model call.
    prefetch: Option<u32>,
    tools: Vec<Arc<ToolSpec>>,
    workers: Vec<Worker>,
    invocation: InvocationContext,
    questions: Vec<String>,
    timeout: Duration,
    _index: tempfile::TempDir,
}

impl DirectChat {
    /// The floor for `questions` on the default profile's deployment of
    /// `models`, the tools of [`FAMILIES`] from `definitions`, retrieval
    /// over `corpus` (indexed here, for this floor alone).
    pub async fn new(
        models: &FleetConfig,
        definitions: &Path,
        corpus: &Path,
        questions: Vec<String>,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let profile = models
            .profiles
            .get(&models.default_profile)
            .ok_or_else(|| anyhow::anyhow!("no default profile"))?;
        let name = profile
            .deployments
            .first()
            .ok_or_else(|| anyhow::anyhow!("the default profile has no deployment"))?;
        let deployment = models
            .deployments
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("no deployment {name}"))?;
        let client = LlmClient::new(deployment.to_llm_config(&ProcessEnv)?)?;
        let index = tempfile::tempdir()?;
        let workers = crate::families::some(
            &FAMILIES,
            &crate::families::Inputs {
                definitions,
                index: &IndexArgs::tantivy(index.path().join("index"), corpus.to_path_buf()),
                models: None,
            },
        )
        .await?;
        let tools = workers
            .iter()
            .flat_map(Worker::definitions)
            .map(|d| Arc::new(d.tool_spec()))
            .collect();
        let invocation = InvocationContext {
            data_source_id: profile.data_source.clone(),
            ..InvocationContext::new("direct-floor")
        };
        Ok(Self {
            client,
            model: deployment.model.clone(),
            system_prompt: profile.system_prompt.clone(),
            prefetch: (profile.rag.prefetch && profile.data_source.is_some())
                .then_some(profile.rag.top_k),
            tools,
            workers,
            invocation,
            questions,
            timeout,
            _index: index,
        })
    }

    /// The floor's operation: question `i` (in turn), answered.
    pub fn op(self) -> Op {
        let direct = Arc::new(self);
        Arc::new(move |i| {
            let direct = direct.clone();
            Box::pin(async move {
                let question = &direct.questions[i % direct.questions.len().max(1)];
                tokio::time::timeout(direct.timeout, direct.ask(question))
                    .await
                    .map_err(|_| "timeout".to_string())?
            })
        })
    }

    /// Asks `question` until the model answers; the tool calls it took.
    async fn ask(&self, question: &str) -> Result<u32, String> {
        let mut messages = Vec::new();
        if let Some(system) = &self.system_prompt {
            messages.push(Message::System {
                content: system.clone(),
            });
        }
        let mut calls = 0;
        if let Some(top_k) = self.prefetch {
            let ctx = TestCtx::new().with_invocation(self.invocation.clone());
            let arguments = serde_json::json!({ "query": question, "topK": top_k }).to_string();
            let found = self.run_tool(&ctx, PREFETCH_SEARCH, &arguments).await;
            calls += 1;
            if !found.starts_with("Error") {
                messages.push(Message::User {
                    content: format!("Passages found for the question:\n{found}"),
                });
            }
        }
        messages.push(Message::User {
            content: question.to_string(),
        });
        for _ in 0..MAX_TURNS {
            let mut request = ChatRequest {
                model: self.model.clone(),
                messages: std::mem::take(&mut messages),
                tools: self.tools.clone(),
                tool_choice: None,
                parallel_tool_calls: true,
                temperature: None,
                max_tokens: None,
                service_tier: None,
                prompt_cache_key: None,
            };
            let completion = self
                .client
                .stream_chat(&request, |_| {})
                .await
                .map_err(|e| e.code().to_string())?;
            messages = std::mem::take(&mut request.messages);
            if completion.tool_calls.is_empty() {
                return if completion.text.is_empty() {
                    Err("empty_reply".into())
                } else {
                    Ok(calls)
                };
            }
            messages.push(completion.assistant_message());
            // The turn's calls together, as the fleet runs them.
            let ctx = TestCtx::new().with_invocation(self.invocation.clone());
            let outputs = futures::future::join_all(
                completion
                    .tool_calls
                    .iter()
                    .map(|call| self.run_tool(&ctx, &call.name, &call.arguments)),
            )
            .await;
            for (call, content) in completion.tool_calls.iter().zip(outputs) {
                calls += 1;
                messages.push(Message::Tool {
                    call_id: call.id.clone(),
                    content,
                });
            }
        }
        Err("too_many_turns".into())
    }

    /// The tool message for one call: its output, or its error as text
    /// (as the fleet tells the model).
    async fn run_tool(&self, ctx: &TestCtx, function: &str, arguments: &str) -> String {
        let args: Value = serde_json::from_str(arguments).unwrap_or_default();
        for worker in &self.workers {
            if worker.definitions().any(|d| d.function.name == function) {
                return match ctx.call_in(worker, function, args).await {
                    Ok(output) => output.content,
                    Err(e) => format!("Error: {e}"),
                };
            }
        }
        format!("Error: no tool {function}")
    }
}
