//! `content:generate_image`: an image from a description, through an
//! images endpoint in the OpenAI shape, with fallback across the tool's
//! image models. The model reads a link, never the image: a URL answer is
//! cited as it is; a base64 answer is decoded and stored as a blob of the
//! invocation (`toolfleet-blob:<invocation>/<id>`, read with `toolfleet
//! blob get`), and that reference is cited instead.

use std::sync::Arc;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::json;
use toolfleet_llm::{ImageFormat, ImageRequest, LlmClient, LlmError};
use toolfleet_worker::protocol::LlmCall;
use toolfleet_worker::{NewReference, Tool, ToolCtx, ToolError, ToolOutput};

use crate::fallback::{AttemptError, Attempts, Candidate};
use crate::providers::Providers;

/// The `implementationKey` of `content:generate_image`.
pub const IMAGE_KEY: &str = "content.generate_image";

/// The provider's code for a prompt its safety system refused: the model
/// should rephrase, so no other model is tried.
const CONTENT_POLICY: &str = "content_policy_violation";

/// The arguments of `content:generate_image`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageArgs {
    pub prompt: String,
    /// The definition's default when absent.
    #[serde(default = "default_size")]
    pub size: String,
    pub quality: Option<String>,
}

fn default_size() -> String {
    "1024x1024".into()
}

/// The image tool.
#[derive(Clone)]
pub struct GenerateImage {
    pub(crate) providers: Arc<Providers>,
    /// `provider/model`, in order.
    pub(crate) models: Arc<Vec<String>>,
}

impl Tool for GenerateImage {
    type Args = ImageArgs;

    async fn call(&self, ctx: &ToolCtx, args: ImageArgs) -> Result<ToolOutput, ToolError> {
        let mut attempts = Attempts::plan(&self.providers, &self.models)?;
        let limits = ctx.shared_limits();
        for (index, candidate) in attempts.candidates().iter().enumerate() {
            if let Some(limits) = &limits {
                let token = crate::tool::model_call_token(ctx, candidate.id);
                limits.admit_model_call(&token).await?;
            }
            attempts.started(ctx, candidate);
            match self.attempt(ctx, candidate, &args).await {
                Ok(output) => {
                    attempts.succeeded(ctx, candidate);
                    return Ok(output);
                }
                Err(Stop::Refused(message)) => {
                    ctx.attempt_failed(candidate.id, &message);
                    return Err(ToolError::invalid(format!(
                        "The image provider refused this prompt ({message}). Rephrase it."
                    )));
                }
                Err(Stop::Store(e)) => return Err(e),
                Err(Stop::Failed(error)) => attempts.failed(ctx, index, &error),
            }
        }
        Err(attempts.exhausted())
    }
}

/// How an attempt ended without an image.
enum Stop {
    /// The provider refused the prompt: no other model is tried.
    Refused(String),
    /// The image could not be stored: retried as a job.
    Store(ToolError),
    /// Try the next model.
    Failed(AttemptError),
}

impl GenerateImage {
    async fn attempt(
        &self,
        ctx: &ToolCtx,
        candidate: &Candidate<'_>,
        args: &ImageArgs,
    ) -> Result<ToolOutput, Stop> {
        let Candidate {
            id,
            model,
            client,
            limits,
            ..
        } = *candidate;
        let client = &crate::providers::gated(ctx, client, limits);
        let request = ImageRequest {
            model: model.to_owned(),
            prompt: args.prompt.clone(),
            size: Some(args.size.clone()).filter(|s| s != "auto"),
            quality: args.quality.clone(),
            // gpt-image models always answer base64 and refuse the
            // parameter; the DALL·E ones are asked for a URL.
            response_format: (!model.starts_with("gpt-image")).then_some(ImageFormat::Url),
        };
        let answer = generate(client, &request).await.map_err(|e| {
            if e.code() == CONTENT_POLICY {
                Stop::Refused(e.to_string())
            } else {
                Stop::Failed(AttemptError(format!("{e} ({})", e.code())))
            }
        })?;
        if let Some(usage) = answer.usage {
            let cost_usd = self.providers.prices.cost(model, &usage);
            ctx.record_llm_call(LlmCall {
                model: model.to_owned(),
                purpose: "tool".into(),
                cost_usd,
                usage,
                attempts: answer.attempts,
            });
        }
        let Some(image) = answer.images.into_iter().next() else {
            return Err(Stop::Failed(AttemptError(
                "the answer holds no image".into(),
            )));
        };
        let mut data = json!({ "model": id });
        if let Some(revised) = &image.revised_prompt {
            data["revisedPrompt"] = json!(revised);
        }
        let (link, shown) = match (image.url, image.b64_json) {
            (Some(url), _) => {
                data["url"] = json!(url);
                (url.clone(), url)
            }
            (None, Some(b64)) => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map_err(|e| {
                        Stop::Failed(AttemptError(format!("the image is not valid base64: {e}")))
                    })?;
                let content_type = sniff(&bytes);
                let size = bytes.len();
                let blob = ctx
                    .store_blob(content_type, bytes)
                    .await
                    .map_err(Stop::Store)?;
                data["blob"] = json!(blob.uri);
                data["bytes"] = json!(size);
                data["contentType"] = json!(content_type);
                let shown = format!("{} ({content_type}, {} KiB)", blob.uri, size.div_ceil(1024));
                (blob.uri, shown)
            }
            (None, None) => {
                return Err(Stop::Failed(AttemptError(
                    "the answer holds neither a URL nor image data".into(),
                )));
            }
        };
        let title: String = args.prompt.chars().take(120).collect();
        let cited = ctx
            .cite(vec![NewReference {
                kind: "image".into(),
                title,
                source: Some(id.to_owned()),
                url: Some(link),
                snippet: image.revised_prompt.clone(),
            }])
            .await
            .map_err(Stop::Store)?;
        let marker = cited
            .first()
            .map(|r| format!(" [doc:{}]", r.index))
            .unwrap_or_default();
        ToolOutput::text(format!("Generated the image: {shown}{marker}"))
            .with_data(data)
            .map_err(Stop::Store)
    }
}

async fn generate(
    client: &LlmClient,
    request: &ImageRequest,
) -> Result<toolfleet_llm::ImageAnswer, LlmError> {
    client.generate_image(request).await
}

/// The content type of image bytes, from their signature.
fn sniff(bytes: &[u8]) -> &'static str {
    if bytes.starts_with(b"\x89PNG") {
        "image/png"
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        "image/jpeg"
    } else if bytes.starts_with(b"RIFF") && bytes.get(8..12) == Some(b"WEBP") {
        "image/webp"
    } else {
        "application/octet-stream"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_types_are_told_by_their_signature() {
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n...."), "image/png");
        assert_eq!(sniff(&[0xff, 0xd8, 0xff, 0xe0]), "image/jpeg");
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), "image/webp");
        assert_eq!(sniff(b"GIF89a"), "application/octet-stream");
    }
}
