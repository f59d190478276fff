//! `POST /v1/embeddings`: deterministic vectors of hashed words, so
//! retrieval tests can check hybrid search with no model. (Tested over
//! HTTP with the images endpoint, in `images`.)

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::request::ApiError;
use crate::state::ServerState;

/// Dimensions of a scripted embedding when the request names none.
pub const EMBEDDING_DIMENSIONS: usize = 256;

/// `POST /v1/embeddings`: deterministic vectors, so retrieval tests can
/// check hybrid search. Each word of the input (letters and digits,
/// lowercased) is hashed to one dimension and a sign, and the vector is
/// L2-normalised: texts sharing words point the same way, texts sharing
/// none are orthogonal or nearly so. `input` is a string or an array of up
/// to 2048 strings; `dimensions` (1 to 3072) defaults to 256;
/// `encoding_format` `float` or `base64` (little-endian f32, what the
/// OpenAI SDKs ask for). Not a language model's embedding: similarity
/// here is shared vocabulary, nothing more.
pub(crate) async fn embeddings(
    State(state): State<Arc<ServerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    use base64::Engine as _;
    let request = state.record_lenient(&uri, &headers, &body);
    let inputs: Vec<&str> = match &request["input"] {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) if items.iter().all(Value::is_string) => {
            items.iter().filter_map(Value::as_str).collect()
        }
        _ => {
            return ApiError::invalid(
                "'input' must be a string or an array of strings.".to_owned(),
                Some("input"),
                Some("invalid_type"),
            )
            .into_response();
        }
    };
    if inputs.is_empty() || inputs.len() > 2048 || inputs.iter().any(|i| i.is_empty()) {
        return ApiError::invalid(
            "'input' must hold 1 to 2048 non-empty strings.".to_owned(),
            Some("input"),
            Some("invalid_value"),
        )
        .into_response();
    }
    let dimensions = match request.get("dimensions") {
        None | Some(Value::Null) => EMBEDDING_DIMENSIONS,
        Some(d) => match d.as_u64().filter(|d| (1..=3072).contains(d)) {
            Some(d) => d as usize,
            None => {
                return ApiError::invalid(
                    "'dimensions' must be an integer from 1 to 3072.".to_owned(),
                    Some("dimensions"),
                    Some("invalid_value"),
                )
                .into_response();
            }
        },
    };
    let base64 = request["encoding_format"] == "base64";
    let mut tokens = 0;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            tokens += text.len().div_ceil(4);
            let vector = scripted_embedding(text, dimensions);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|f| f.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "index": i, "embedding": embedding })
        })
        .collect();
    axum::Json(json!({
        "object": "list",
        "data": data,
        "model": request["model"].as_str().unwrap_or("text-embedding-3-small"),
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
    }))
    .into_response()
}

/// The scripted embedding of `text` (what `POST /v1/embeddings` answers): hashed words,
/// L2-normalised; all zeros for a text without a word.
pub fn scripted_embedding(text: &str, dimensions: usize) -> Vec<f32> {
    let mut vector = vec![0.0f32; dimensions.max(1)];
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        // FNV-1a: stable across runs and platforms.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in word.to_lowercase().bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        let slot = (hash % vector.len() as u64) as usize;
        vector[slot] += if hash >> 63 == 0 { 1.0 } else { -1.0 };
    }
    let norm = vector.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm > 0.0 {
        for v in &mut vector {
            *v /= norm;
        }
    }
    vector
}
