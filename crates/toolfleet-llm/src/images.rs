//! OpenAI image generation (`POST {base}/images/generations`): the neutral
//! [`ImageRequest`] and [`ImageAnswer`], and the private wire types with
//! `to_wire` / `from_wire`. The HTTP, retries and status handling are
//! [`LlmClient::generate_image`](crate::LlmClient::generate_image)'s, shared
//! with the chat path.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toolfleet_protocol::Usage;

use crate::LlmError;

/// How the provider hands back a generated image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// `"url"`: a link to the image, valid for about an hour (DALL·E).
    Url,
    /// `"b64_json"`: the image itself, base64-encoded in the answer (several
    /// megabytes). The only form `gpt-image` models return.
    B64Json,
}

/// One image to generate (`n` is always 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRequest {
    pub model: String,
    pub prompt: String,
    /// E.g. `"1024x1024"`; `None` leaves it to the provider.
    pub size: Option<String>,
    /// E.g. `"standard"` / `"hd"` (DALL·E 3) or `"low"` … `"high"`
    /// (`gpt-image`); `None` leaves it to the provider.
    pub quality: Option<String>,
    /// `None` leaves it to the provider (URLs for DALL·E). `gpt-image`
    /// models always answer with base64 and reject the parameter, so leave
    /// it `None` for them.
    pub response_format: Option<ImageFormat>,
}

/// What the provider generated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageAnswer {
    /// Never empty: an answer without images is an error.
    pub images: Vec<GeneratedImage>,
    /// Token usage, which `gpt-image` models report and DALL·E does not.
    pub usage: Option<Usage>,
    /// HTTP requests this answer took, retries included (1 when the first
    /// one succeeded). For metrics.
    pub attempts: u32,
}

/// One generated image: a link or the base64 bytes (at least one of the
/// two is always set).
#[derive(Clone, PartialEq, Eq)]
pub struct GeneratedImage {
    pub url: Option<String>,
    /// Standard base64 (with padding) of the image file.
    pub b64_json: Option<String>,
    /// The prompt the provider actually used, when it rewrote it (DALL·E 3).
    pub revised_prompt: Option<String>,
}

impl fmt::Debug for GeneratedImage {
    /// Shows the length of `b64_json`, not megabytes of base64.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeneratedImage")
            .field("url", &self.url)
            .field(
                "b64_json",
                &self
                    .b64_json
                    .as_ref()
                    .map(|b| format!("<{} base64 chars>", b.len())),
            )
            .field("revised_prompt", &self.revised_prompt)
            .finish()
    }
}

// ---------------------------------------------------------------------------
// Request

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    prompt: &'a str,
    n: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    size: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    quality: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<ImageFormat>,
}

fn to_wire(req: &ImageRequest) -> WireRequest<'_> {
    WireRequest {
        model: &req.model,
        prompt: &req.prompt,
        n: 1,
        size: req.size.as_deref(),
        quality: req.quality.as_deref(),
        response_format: req.response_format,
    }
}

/// The request body.
pub(crate) fn encode(req: &ImageRequest) -> Result<Bytes, LlmError> {
    serde_json::to_vec(&to_wire(req))
        .map(Bytes::from)
        .map_err(|e| LlmError::protocol(format!("could not encode the image request: {e}")))
}

// ---------------------------------------------------------------------------
// Response

#[derive(Deserialize)]
struct WireAnswer {
    data: Vec<WireImage>,
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireImage {
    url: Option<String>,
    b64_json: Option<String>,
    revised_prompt: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    total_tokens: Option<u64>,
    input_tokens_details: Option<WireInputDetails>,
}

#[derive(Deserialize)]
struct WireInputDetails {
    #[serde(default)]
    cached_tokens: u64,
}

/// Parses a 200 body of `images/generations`. Anything but
/// `{"data": [{"url" | "b64_json", ..}, ..], "usage"?: ..}` with at least
/// one image is a protocol error; an `error` object in it is the
/// provider's error.
pub(crate) fn from_wire(body: &[u8]) -> Result<ImageAnswer, LlmError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| LlmError::protocol(format!("unparseable image answer: {e}")))?;
    if let Some(error) = value.get("error").filter(|e| !e.is_null()) {
        return Err(crate::chat_wire::provider_error(error));
    }
    let wire: WireAnswer = serde_json::from_value(value)
        .map_err(|e| LlmError::protocol(format!("unexpected image answer: {e}")))?;
    if wire.data.is_empty() {
        return Err(LlmError::protocol("image answer has no images"));
    }
    let images = wire
        .data
        .into_iter()
        .enumerate()
        .map(|(i, image)| {
            let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
            let (url, b64_json) = (nonempty(image.url), nonempty(image.b64_json));
            if url.is_none() && b64_json.is_none() {
                return Err(LlmError::protocol(format!(
                    "image {i} of the answer has neither a url nor b64_json"
                )));
            }
            Ok(GeneratedImage {
                url,
                b64_json,
                revised_prompt: nonempty(image.revised_prompt),
            })
        })
        .collect::<Result<_, _>>()?;
    let usage = wire.usage.map(|u| Usage {
        prompt_tokens: u.input_tokens,
        completion_tokens: u.output_tokens,
        total_tokens: u.total_tokens.unwrap_or(u.input_tokens + u.output_tokens),
        cached_tokens: u.input_tokens_details.map_or(0, |d| d.cached_tokens),
        reasoning_tokens: 0,
    });
    Ok(ImageAnswer {
        images,
        usage,
        attempts: 1,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::LlmErrorKind;

    fn parse(body: Value) -> Result<ImageAnswer, LlmError> {
        from_wire(body.to_string().as_bytes())
    }

    #[test]
    fn the_request_asks_for_one_image_and_only_what_was_set() {
        let mut req = ImageRequest {
            model: "dall-e-3".into(),
            prompt: "a lighthouse at dusk".into(),
            size: None,
            quality: None,
            response_format: None,
        };
        let sent: Value = serde_json::from_slice(&encode(&req).expect("encode")).expect("json");
        assert_eq!(
            sent,
            json!({"model": "dall-e-3", "prompt": "a lighthouse at dusk", "n": 1})
        );
        req.size = Some("1024x1792".into());
        req.quality = Some("hd".into());
        req.response_format = Some(ImageFormat::B64Json);
        let sent: Value = serde_json::from_slice(&encode(&req).expect("encode")).expect("json");
        assert_eq!(sent["size"], json!("1024x1792"));
        assert_eq!(sent["quality"], json!("hd"));
        assert_eq!(sent["response_format"], json!("b64_json"));
        assert_eq!(
            serde_json::to_value(ImageFormat::Url).expect("json"),
            json!("url")
        );
        assert_eq!(
            serde_json::from_value::<ImageFormat>(json!("b64_json")).expect("format"),
            ImageFormat::B64Json
        );
    }

    #[test]
    fn url_answers_keep_the_revised_prompt_and_have_no_usage() {
        let answer = parse(json!({
            "created": 1_700_000_000,
            "data": [{"url": "https://img.example/a.png", "revised_prompt": "A lighthouse, dusk"}]
        }))
        .expect("answer");
        assert_eq!(
            answer,
            ImageAnswer {
                images: vec![GeneratedImage {
                    url: Some("https://img.example/a.png".into()),
                    b64_json: None,
                    revised_prompt: Some("A lighthouse, dusk".into()),
                }],
                usage: None,
                attempts: 1,
            }
        );
    }

    #[test]
    fn base64_answers_map_usage_and_debug_stays_short() {
        let b64 = "iVBORw0KGgo".repeat(100_000);
        let answer = parse(json!({
            "created": 1,
            "data": [{"b64_json": b64}],
            "usage": {"input_tokens": 12, "output_tokens": 4160, "total_tokens": 4172,
                      "input_tokens_details": {"text_tokens": 12, "image_tokens": 0}}
        }))
        .expect("answer");
        assert_eq!(answer.images[0].b64_json.as_deref(), Some(b64.as_str()));
        assert_eq!(answer.images[0].url, None);
        assert_eq!(
            answer.usage,
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 4160,
                total_tokens: 4172,
                cached_tokens: 0,
                reasoning_tokens: 0,
            })
        );
        let debug = format!("{answer:?}");
        assert!(debug.len() < 300, "{debug}");
        assert!(debug.contains("<1100000 base64 chars>"), "{debug}");

        let answer = parse(json!({"data": [{"b64_json": "AA=="}],
            "usage": {"input_tokens": 3, "output_tokens": 5}}))
        .expect("answer");
        assert_eq!(answer.usage.map(|u| u.total_tokens), Some(8), "summed");
    }

    #[test]
    fn answers_of_another_shape_are_protocol_errors() {
        for body in [
            json!({"created": 1, "data": []}),
            json!({"created": 1}),
            json!({"data": null}),
            json!({"data": {"url": "https://img.example/a.png"}}),
            json!({"data": [{"revised_prompt": "no image"}]}),
            json!({"data": [{"url": ""}]}),
            json!({"data": [{"url": 7}]}),
            json!([{"url": "https://img.example/a.png"}]),
        ] {
            let err = parse(body.clone()).expect_err("not an image answer");
            assert_eq!(err.kind(), &LlmErrorKind::Protocol, "{body}");
            assert!(!err.is_retryable(), "{body}");
        }
        let err = from_wire(b"<html>oops</html>").expect_err("not JSON");
        assert_eq!(err.code(), "protocol");
    }

    #[test]
    fn an_error_object_in_a_200_is_the_providers_error() {
        let err = parse(json!({"error": {"message": "busy", "code": "server_error"}}))
            .expect_err("error");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Provider {
                code: Some("server_error".into())
            }
        );
        assert!(err.to_string().contains("busy"), "{err}");
    }
}
