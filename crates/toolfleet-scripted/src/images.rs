//! `POST /v1/images/generations`: scripted images, as URLs that lead
//! nowhere or as a real (tiny, padded) PNG in base64.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::request::ApiError;
use crate::state::ServerState;

/// `POST /v1/images/generations`: one image per request (`n` up to 4), as
/// a URL under `https://images.scripted.invalid/` or, when
/// `response_format` is `b64_json` (or the model is a `gpt-image` one,
/// which always answers so), as base64 of a 1×1 PNG padded to the
/// script's `imageBytes`. A prompt containing `refuse image` is answered
/// 400 `content_policy_violation`, as OpenAI answers a prompt its safety
/// system rejects.
pub(crate) async fn images(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use base64::Engine as _;
    let request = state.record_lenient(&uri, &headers, &body);
    let Some(prompt) = request["prompt"].as_str().filter(|p| !p.trim().is_empty()) else {
        return ApiError::invalid(
            "Missing required parameter: 'prompt'.".to_owned(),
            Some("prompt"),
            Some("missing_required_parameter"),
        )
        .into_response();
    };
    if prompt.to_lowercase().contains("refuse image") {
        return ApiError::invalid(
            "Your request was rejected as a result of our safety system.".to_owned(),
            None,
            Some("content_policy_violation"),
        )
        .into_response();
    }
    let n = request["n"].as_u64().unwrap_or(1).clamp(1, 4);
    let model = request["model"].as_str().unwrap_or("dall-e-2");
    let b64 = request["response_format"] == "b64_json" || model.starts_with("gpt-image");
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let data: Vec<Value> = (0..n)
        .map(|i| {
            if b64 {
                let image = padded_png(state.script.image_bytes());
                json!({ "b64_json": base64::engine::general_purpose::STANDARD.encode(image) })
            } else {
                json!({
                    "url": format!("https://images.scripted.invalid/{created}-{i}.png"),
                    "revised_prompt": prompt,
                })
            }
        })
        .collect();
    axum::Json(json!({
        "created": created,
        "data": data,
        "usage": { "input_tokens": prompt.len().div_ceil(4), "output_tokens": 0, "total_tokens": prompt.len().div_ceil(4) },
    }))
    .into_response()
}

/// A valid 1×1 PNG followed by zero bytes up to `size` (decoders stop at
/// `IEND`; the padding stands in for the pixels of a real image).
fn padded_png(size: usize) -> Vec<u8> {
    const ONE_PIXEL: &[u8] = &[
        0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
        0x52, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f,
        0x15, 0xc4, 0x89, 0x00, 0x00, 0x00, 0x0b, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0x60,
        0x00, 0x02, 0x00, 0x00, 0x05, 0x00, 0x01, 0x7a, 0x5e, 0xab, 0x3f, 0x00, 0x00, 0x00, 0x00,
        0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
    ];
    let mut image = ONE_PIXEL.to_vec();
    image.resize(size.max(ONE_PIXEL.len()), 0);
    image
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::*;

    // Also covers choosing a rule by model and the embeddings endpoint:
    // one server, one script.
    #[tokio::test]
    async fn rules_can_pick_a_model_and_images_come_as_urls_or_base64() {
        let (server, client) = start(
            r#"{"imageBytes": 100000, "rules": [
                {"whenModel": ["gpt-broken"], "steps": [{"answer": "-",
                    "fault": {"kind": "status", "status": 503}}]},
                {"whenModel": ["gpt-terse"], "whenUserContains": ["summar"],
                    "steps": [{"answer": "terse"}]}
               ],
               "default": {"steps": [{"answer": "plain"}]}}"#,
        )
        .await;
        let ask = |model: &str, text: &str| json!({"model": model, "stream": false, "messages": [user(text)]});
        let (status, _, _, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-broken", "hi"),
        )
        .await;
        assert_eq!(status, 503);
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-terse", "summarize"),
        )
        .await;
        assert!(text.contains("terse"), "{text}");
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("gpt-terse", "hello"),
        )
        .await;
        assert!(text.contains("plain"), "both conditions must hold: {text}");
        let (_, _, text, _) = send(
            &client,
            &server,
            "chat/completions",
            &ask("other", "summarize"),
        )
        .await;
        assert!(text.contains("plain"), "{text}");

        let (status, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3", "prompt": "a lighthouse"}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("json");
        assert!(
            answer["data"][0]["url"]
                .as_str()
                .unwrap()
                .starts_with("https://images.scripted.invalid/")
        );
        let (_, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "gpt-image-1", "prompt": "a lighthouse"}),
        )
        .await;
        let answer: Value = serde_json::from_str(&text).expect("json");
        use base64::Engine as _;
        let png = base64::engine::general_purpose::STANDARD
            .decode(answer["data"][0]["b64_json"].as_str().unwrap())
            .unwrap();
        assert_eq!(png.len(), 100_000);
        assert!(png.starts_with(b"\x89PNG"));
        let (status, _, text, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3", "prompt": "please refuse image"}),
        )
        .await;
        assert_eq!(status, 400);
        assert!(text.contains("content_policy_violation"), "{text}");
        let (status, _, _, _) = send(
            &client,
            &server,
            "images/generations",
            &json!({"model": "dall-e-3"}),
        )
        .await;
        assert_eq!(status, 400);

        // Embeddings: deterministic, normalised, similar for shared words.
        let (status, _, text, _) = send(
            &client,
            &server,
            "embeddings",
            &json!({"model": "text-embedding-3-small", "input": ["bees dance", "bees dance", "Bees find nectar", "tax law"], "dimensions": 64}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("json");
        let vectors: Vec<Vec<f32>> = answer["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
            .collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert_eq!(vectors.len(), 4);
        assert_eq!(vectors[0].len(), 64);
        assert!((dot(&vectors[0], &vectors[0]) - 1.0).abs() < 1e-5);
        assert_eq!(vectors[0], vectors[1]);
        assert!(dot(&vectors[0], &vectors[2]) > dot(&vectors[0], &vectors[3]));
        let (_, _, text, _) = send(
            &client,
            &server,
            "embeddings",
            &json!({"model": "m", "input": "bees dance", "encoding_format": "base64", "dimensions": 64}),
        )
        .await;
        let answer: Value = serde_json::from_str(&text).expect("json");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(answer["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(decoded, vectors[0]);
        for bad in [
            json!({"model": "m"}),
            json!({"model": "m", "input": []}),
            json!({"model": "m", "input": "x", "dimensions": 0}),
        ] {
            let (status, _, text, _) = send(&client, &server, "embeddings", &bad).await;
            assert_eq!(status, 400, "{bad}: {text}");
        }
        within(server.shutdown()).await;
    }
}
