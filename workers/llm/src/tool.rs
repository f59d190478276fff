//! The declarative LLM tool: renders the definition's prompt for the model
//! at hand, asks it, and checks the answer — for each model of the tool's
//! list in turn until one answers ([`crate::fallback`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use toolfleet_llm::{ChatRequest, LlmClient, Message, Usage};
use toolfleet_worker::protocol::schema::{Validator, describe};
use toolfleet_worker::protocol::tools::{OutputFormat, ToolDefinition, ToolId};
use toolfleet_worker::protocol::{LlmCall, registry::CompatFile};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput};

use crate::fallback::{AttemptError, Attempts, Candidate};
use crate::prompt::Prompts;
use crate::providers::{Providers, split_model};
use crate::{models, reply, variant};

/// Default of [`Settings::max_reply_chars`]: far more than any tool answer
/// the model should read back, far less than what would hurt a worker.
pub const DEFAULT_MAX_REPLY_CHARS: usize = 64 * 1024;

/// The worker-wide settings of LLM tools.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Recommended models per tool (the orchestrator's `--tool-compat`
    /// file), tried first.
    pub compat: Option<Arc<CompatFile>>,
    /// `provider/model` used by tools that name no model at all.
    pub default_model: Option<String>,
    /// A reply longer than this (in characters) is cut with a notice (a
    /// `json` reply that long fails the attempt).
    pub max_reply_chars: usize,
    /// `provider/model` of the image model `content:generate_image` uses
    /// when its definition names none.
    pub image_model: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            compat: None,
            default_model: None,
            max_reply_chars: DEFAULT_MAX_REPLY_CHARS,
            image_model: None,
        }
    }
}

/// What the answer must be.
#[derive(Debug)]
pub(crate) struct OutputCheck {
    pub(crate) validator: Validator,
    /// A mismatch fails the attempt (a chart that does not validate is of
    /// no use) instead of adding an `output_schema_mismatch` warning.
    pub(crate) strict: bool,
    /// The schema as shown to the model.
    pub(crate) schema: Value,
}

/// One declarative definition, compiled for serving.
#[derive(Debug)]
pub(crate) struct Declared {
    pub(crate) definition: ToolDefinition,
    prompts: Prompts,
    output: Option<OutputCheck>,
    /// The models to try, in order (`provider/model`).
    pub(crate) models: Vec<String>,
}

/// A definition the worker cannot serve: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclareError {
    pub field: String,
    pub message: String,
}

impl Declared {
    /// Compiles `definition` against the worker's providers and settings;
    /// `strict_output` replaces the definition's own `outputSchema` (and
    /// makes a mismatch an error).
    pub(crate) fn new(
        definition: &ToolDefinition,
        providers: &Providers,
        settings: &Settings,
        strict_output: Option<&Value>,
    ) -> Result<Self, DeclareError> {
        let prompts = Prompts::compile(definition).map_err(|e| DeclareError {
            field: e.field,
            message: e.message,
        })?;
        let unknown_provider = |field: String, id: &str| {
            let provider = split_model(id).map_or(id, |(p, _)| p);
            (provider != "*" && !providers.knows(provider)).then(|| DeclareError {
                field,
                message: format!(
                    "no deployment named {provider:?} in the configuration (deployments: {})",
                    providers.names()
                ),
            })
        };
        for (name, v) in &definition.variants {
            for (i, pattern) in v.models.iter().enumerate() {
                if let Some(e) = unknown_provider(format!("variants.{name}.models[{i}]"), pattern) {
                    return Err(e);
                }
            }
        }
        let preference = definition.model_preference.as_ref();
        if let Some(p) = preference {
            if let Some(m) = &p.preferred_model
                && let Some(e) = unknown_provider("modelPreference.preferredModel".into(), m)
            {
                return Err(e);
            }
            for (i, m) in p.fallback_models.iter().enumerate() {
                if let Some(e) = unknown_provider(format!("modelPreference.fallbackModels[{i}]"), m)
                {
                    return Err(e);
                }
            }
        }
        let recommended: Vec<String> = settings
            .compat
            .as_ref()
            .and_then(|c| c.models(&definition.id))
            .unwrap_or_default()
            .iter()
            .filter(|m| {
                let known = split_model(m).is_some_and(|(p, _)| providers.knows(p));
                if !known {
                    tracing::warn!(tool = %definition.id, model = %m,
                        "the compat file recommends a model of no configured deployment; skipped");
                }
                known
            })
            .cloned()
            .collect();
        let models = models::resolve(&recommended, preference, settings.default_model.as_deref());
        if models.is_empty() {
            return Err(DeclareError {
                field: "modelPreference".into(),
                message: "no model to run it with: name one in modelPreference, or give the \
                          worker a default model"
                    .into(),
            });
        }
        let output = match (strict_output, &definition.output_schema) {
            (Some(schema), _) => Some((schema, true)),
            (None, Some(schema)) => Some((schema, false)),
            (None, None) => None,
        }
        .map(|(schema, strict)| {
            Validator::compile(schema)
                .map(|validator| OutputCheck {
                    validator,
                    strict,
                    schema: schema.clone(),
                })
                .map_err(|e| DeclareError {
                    field: "outputSchema".into(),
                    message: format!("does not compile: {e}"),
                })
        })
        .transpose()?;
        Ok(Self {
            definition: definition.clone(),
            prompts,
            output,
            models,
        })
    }

    /// The answer format for a variant (its own, else the definition's,
    /// else text).
    fn format(&self, variant: Option<&str>) -> OutputFormat {
        variant
            .and_then(|name| self.definition.variants.get(name))
            .and_then(|v| v.output_format)
            .or(self.definition.output_format)
            .unwrap_or(OutputFormat::Text)
    }

    /// The instruction prepended to the system prompt of a `json` tool.
    fn json_instruction(&self) -> String {
        let mut out = String::from(
            "Answer with one JSON value and nothing else: no prose before or after it, \
             no Markdown code fence.",
        );
        if let Some(check) = &self.output {
            out.push_str(" The value must validate against this JSON Schema:\n");
            out.push_str(&check.schema.to_string());
        }
        if let Some(example) = &self.definition.output_example {
            out.push_str("\nAn example of a valid answer:\n");
            out.push_str(&example.to_string());
        }
        out
    }
}

/// The tool every declarative definition of the worker is served by: it
/// finds the definition of the call by its tool id.
#[derive(Clone)]
pub struct LlmTool {
    pub(crate) providers: Arc<Providers>,
    pub(crate) tools: Arc<HashMap<ToolId, Arc<Declared>>>,
    pub(crate) max_reply_chars: usize,
}

impl Tool for LlmTool {
    type Args = Value;

    async fn call(&self, ctx: &ToolCtx, args: Value) -> Result<ToolOutput, ToolError> {
        let Some(declared) = self.tools.get(&ctx.call().tool_id) else {
            return Err(ToolError::failed(format!(
                "{} is not a declarative LLM tool of this worker",
                ctx.call().tool_id
            )));
        };
        let mut attempts = Attempts::plan(&self.providers, &declared.models)?;
        let limits = ctx.shared_limits();
        for (index, candidate) in attempts.candidates().iter().enumerate() {
            // The tenant's limits hold for a tool's model calls as for the
            // orchestrator's: past one the call ends, no fallback.
            let token = model_call_token(ctx, candidate.id);
            if let Some(limits) = &limits {
                limits.admit_model_call(&token).await?;
            }
            attempts.started(ctx, candidate);
            match self.attempt(ctx, declared, candidate, &args).await {
                Ok(output) => {
                    attempts.succeeded(ctx, candidate);
                    return Ok(output);
                }
                Err(error) => attempts.failed(ctx, index, &error),
            }
        }
        Err(attempts.exhausted())
    }
}

/// Names one model call of a tool call for the tenant's counts: the same
/// call redelivered counts once.
pub(crate) fn model_call_token(ctx: &ToolCtx, model: &str) -> String {
    let call = ctx.call();
    format!(
        "tool/{}/{}/{model}",
        call.invocation.invocation_id, call.call_id
    )
}

/// The request one attempt of `declared` at `id` (`provider/model`, the
/// model part being `model`) sends, and the answer format it expects:
/// the variant for the model, the rendered prompt, the JSON-only
/// instruction for `json` tools, the preference's temperature and token
/// limit.
fn build_request(
    declared: &Declared,
    id: &str,
    model: &str,
    args: &Value,
) -> Result<(ChatRequest, OutputFormat), crate::prompt::PromptError> {
    let variant = variant::choose(&declared.definition, id).map(|(name, _)| name);
    let rendered = declared.prompts.render(variant, args)?;
    let format = declared.format(variant);
    let system = match (format, rendered.system) {
        (OutputFormat::Json, Some(system)) => {
            Some(format!("{}\n\n{system}", declared.json_instruction()))
        }
        (OutputFormat::Json, None) => Some(declared.json_instruction()),
        (_, system) => system,
    };
    let preference = declared.definition.model_preference.as_ref();
    let mut messages = Vec::with_capacity(2);
    if let Some(content) = system {
        messages.push(Message::System { content });
    }
    messages.push(Message::User {
        content: rendered.user,
    });
    let request = ChatRequest {
        model: model.to_owned(),
        messages,
        tools: Vec::new(),
        tool_choice: None,
        parallel_tool_calls: false,
        temperature: preference.and_then(|p| p.temperature).map(|t| t as f32),
        max_tokens: preference.and_then(|p| p.max_tokens),
        service_tier: None,
        prompt_cache_key: None,
    };
    Ok((request, format))
}

impl LlmTool {
    /// The request the first model of `tool`'s list would be sent for
    /// `arguments` (validated), with that model's client: what a benchmark
    /// sends straight to the model to compare with a call through the
    /// fleet.
    ///
    /// # Errors
    ///
    /// In words: the tool is not served here, its first model cannot be
    /// called, or the prompt does not render.
    pub fn first_request(
        &self,
        tool: &ToolId,
        arguments: &Value,
    ) -> Result<(ChatRequest, LlmClient), String> {
        let declared = self
            .tools
            .get(tool)
            .ok_or_else(|| format!("{tool} is not a declarative LLM tool of this worker"))?;
        let attempts =
            Attempts::plan(&self.providers, &declared.models).map_err(|e| e.to_string())?;
        let candidate = attempts
            .candidates()
            .into_iter()
            .next()
            .ok_or_else(|| "no model".to_owned())?;
        let (request, _) = build_request(declared, candidate.id, candidate.model, arguments)
            .map_err(|e| e.to_string())?;
        Ok((request, candidate.client.clone()))
    }
}

/// The reply as it streams in, kept up to a cap.
struct Capped {
    text: String,
    chars: usize,
    cap: usize,
    cut: bool,
}

impl Capped {
    fn new(cap: usize) -> Self {
        Self {
            text: String::new(),
            chars: 0,
            cap,
            cut: false,
        }
    }

    /// Keeps `delta` up to the cap; `true` when this delta reached it.
    fn push(&mut self, delta: &str) -> bool {
        if self.cut {
            return false;
        }
        let room = self.cap.saturating_sub(self.chars);
        match delta.char_indices().nth(room) {
            Some((end, _)) => {
                self.text.push_str(&delta[..end]);
                self.chars = self.cap;
                self.cut = true;
                true
            }
            None => {
                self.text.push_str(delta);
                self.chars += delta.chars().count();
                false
            }
        }
    }
}

/// What one model call gave back.
struct Reply {
    text: String,
    /// Cut at the cap (the model was still talking).
    cut: bool,
    /// The model ran out of tokens.
    truncated: bool,
    refusal: Option<String>,
}

impl LlmTool {
    /// One attempt at `candidate`.
    async fn attempt(
        &self,
        ctx: &ToolCtx,
        declared: &Declared,
        candidate: &Candidate<'_>,
        args: &Value,
    ) -> Result<ToolOutput, AttemptError> {
        let Candidate {
            id,
            model,
            client,
            limits,
            batch_tier,
        } = *candidate;
        let (mut request, format) =
            build_request(declared, id, model, args).map_err(|e| AttemptError(e.to_string()))?;
        // A batch job's tool calls use the deployment's batch tier too.
        if ctx.invocation().priority == toolfleet_worker::protocol::Priority::Batch {
            request.service_tier = batch_tier.map(str::to_owned);
        }
        let started = Instant::now();
        let client = crate::providers::gated(ctx, client, limits);
        let (reply, usage, attempts) = self.ask(&client, &request).await?;
        let cost_usd = self.providers.prices.cost(model, &usage);
        ctx.record_llm_call(LlmCall {
            model: model.to_owned(),
            purpose: "tool".into(),
            cost_usd,
            usage,
            attempts,
        });
        tracing::debug!(
            model = id,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "model answered"
        );
        if let Some(refusal) = reply.refusal.filter(|r| !r.trim().is_empty()) {
            return Err(AttemptError(format!("the model refused: {refusal}")));
        }
        if reply.text.trim().is_empty() {
            return Err(AttemptError("the model's reply is empty".into()));
        }
        match format {
            OutputFormat::Json => {
                if reply.cut {
                    return Err(AttemptError(format!(
                        "the model's reply is longer than {} characters",
                        self.max_reply_chars
                    )));
                }
                let value =
                    reply::parse_json(&reply.text).map_err(|e| AttemptError(e.to_string()))?;
                if let Some(check) = &declared.output
                    && let Err(violations) = check.validator.validate(&value)
                {
                    let message = format!(
                        "the answer does not match the output schema: {}",
                        describe(&violations)
                    );
                    if check.strict {
                        return Err(AttemptError(message));
                    }
                    ctx.warning("output_schema_mismatch", &message);
                }
                ToolOutput::text(value.to_string())
                    .with_data(value)
                    .map_err(|e| AttemptError(e.to_string()))
            }
            OutputFormat::Text | OutputFormat::Markdown => {
                let mut text = reply.text;
                if reply.cut {
                    ctx.warning(
                        "reply_truncated",
                        &format!("the reply was cut at {} characters", self.max_reply_chars),
                    );
                    text.push_str(&format!(
                        "\n\n[The reply was cut at {} characters.]",
                        self.max_reply_chars
                    ));
                } else if reply.truncated {
                    ctx.warning(
                        "reply_truncated",
                        "the model ran out of tokens: the reply may end mid-sentence",
                    );
                }
                Ok(ToolOutput::text(text))
            }
        }
    }

    /// Asks the model, keeping at most `max_reply_chars` of its reply: past
    /// that the call is dropped (closing its connection), so a runaway
    /// answer is never buffered without bound.
    async fn ask(
        &self,
        client: &LlmClient,
        request: &ChatRequest,
    ) -> Result<(Reply, Usage, u32), AttemptError> {
        let mut kept = Capped::new(self.max_reply_chars);
        let full = tokio::sync::Notify::new();
        let answered = {
            let call = client.stream_chat(request, |delta| {
                if kept.push(delta) {
                    full.notify_one();
                }
            });
            tokio::pin!(call);
            tokio::select! {
                answered = &mut call => Some(answered),
                () = full.notified() => None,
            }
        };
        let Capped {
            text: kept_text,
            cut,
            ..
        } = kept;
        match answered {
            Some(Ok(completion)) => {
                let truncated = completion.is_truncated();
                let (text, cut) = if cut {
                    (kept_text, true)
                } else {
                    // Streamed or not, the completion holds the whole text.
                    (completion.text, false)
                };
                Ok((
                    Reply {
                        text,
                        cut,
                        truncated,
                        refusal: completion.refusal,
                    },
                    completion.usage.unwrap_or_default(),
                    completion.attempts,
                ))
            }
            Some(Err(e)) => Err(AttemptError(format!("{} ({})", e, e.code()))),
            // Cut mid-stream: the provider's usage never arrived; count what
            // was seen (about four characters a token), so the spend is not
            // lost.
            None => {
                let prompt: usize = request
                    .messages
                    .iter()
                    .map(|m| match m {
                        Message::System { content } | Message::User { content } => content.len(),
                        _ => 0,
                    })
                    .sum();
                let usage = Usage {
                    prompt_tokens: (prompt / 4) as u64,
                    completion_tokens: (kept_text.len() / 4) as u64,
                    total_tokens: ((prompt + kept_text.len()) / 4) as u64,
                    ..Usage::default()
                };
                Ok((
                    Reply {
                        text: kept_text,
                        cut: true,
                        truncated: false,
                        refusal: None,
                    },
                    usage,
                    1,
                ))
            }
        }
    }
}
