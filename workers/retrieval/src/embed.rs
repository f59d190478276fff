//! A client for an OpenAI-shaped embeddings endpoint (`POST
//! <base>/embeddings`): what makes search hybrid. Chunks are embedded at
//! ingestion, queries at search time; BM25 and vector results are then
//! fused by reciprocal rank ([`crate::search::reciprocal_rank_fusion`]).
//!
//! The API key is sent as a bearer token and never appears in errors,
//! logs or `Debug` output.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

/// Inputs per request (the OpenAI API takes up to 2048; smaller batches
/// keep one slow request short).
pub const BATCH: usize = 64;

/// How to reach the endpoint.
#[derive(Clone)]
pub struct EmbedderConfig {
    /// The API base, e.g. `https://api.openai.com/v1`.
    pub base_url: url::Url,
    pub model: String,
    pub api_key: Option<String>,
    /// Ask for vectors of this size (models that support it).
    pub dimensions: Option<u32>,
    pub timeout: Duration,
}

impl fmt::Debug for EmbedderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbedderConfig")
            .field("base_url", &self.base_url.as_str())
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("dimensions", &self.dimensions)
            .finish()
    }
}

/// Why embedding failed.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("the embeddings endpoint is unreachable: {0}")]
    Unreachable(String),
    #[error("the embeddings endpoint answered HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("the embeddings endpoint answered something else than embeddings: {0}")]
    Malformed(String),
}

/// The client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Embedder {
    config: EmbedderConfig,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct Response {
    data: Vec<Datum>,
}

#[derive(Deserialize)]
struct Datum {
    index: usize,
    embedding: Vec<f32>,
}

impl Embedder {
    /// A client for `config`.
    ///
    /// # Errors
    ///
    /// When the HTTP client cannot be built.
    pub fn new(config: EmbedderConfig) -> Result<Self, EmbedError> {
        // reqwest is built without a default TLS provider: the
        // workspace's is ring (installing it twice is harmless).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .build()
            .map_err(|e| EmbedError::Unreachable(e.to_string()))?;
        Ok(Self { config, http })
    }

    /// The model's name, for logs.
    pub fn model(&self) -> &str {
        &self.config.model
    }

    /// One vector per input, in order.
    ///
    /// # Errors
    ///
    /// [`EmbedError`] for a dead endpoint, an error status or an answer
    /// that is not one embedding per input.
    pub async fn embed(&self, inputs: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let mut out = Vec::with_capacity(inputs.len());
        for batch in inputs.chunks(BATCH) {
            out.extend(self.embed_batch(batch).await?);
        }
        Ok(out)
    }

    async fn embed_batch(&self, inputs: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let url = format!(
            "{}/embeddings",
            self.config.base_url.as_str().trim_end_matches('/')
        );
        let mut body =
            json!({ "model": self.config.model, "input": inputs, "encoding_format": "float" });
        if let Some(d) = self.config.dimensions {
            body["dimensions"] = d.into();
        }
        let mut request = self.http.post(url).json(&body);
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key);
        }
        // reqwest's errors name the URL, never the key.
        let response = request
            .send()
            .await
            .map_err(|e| EmbedError::Unreachable(e.without_url().to_string()))?;
        let status = response.status();
        let text = response
            .text()
            .await
            .map_err(|e| EmbedError::Unreachable(e.without_url().to_string()))?;
        if !status.is_success() {
            // A proxy may echo the request, key included: never pass it on.
            let mut message: String = text.chars().take(300).collect();
            if let Some(key) = self.config.api_key.as_deref().filter(|k| !k.is_empty()) {
                message = message.replace(key, "[redacted]");
            }
            return Err(EmbedError::Status {
                status: status.as_u16(),
                message,
            });
        }
        let parsed: Response =
            serde_json::from_str(&text).map_err(|e| EmbedError::Malformed(e.to_string()))?;
        if parsed.data.len() != inputs.len() {
            return Err(EmbedError::Malformed(format!(
                "{} embeddings for {} inputs",
                parsed.data.len(),
                inputs.len()
            )));
        }
        let mut vectors = vec![Vec::new(); inputs.len()];
        for datum in parsed.data {
            let slot = vectors.get_mut(datum.index).ok_or_else(|| {
                EmbedError::Malformed(format!("index {} out of range", datum.index))
            })?;
            *slot = datum.embedding;
        }
        if vectors.iter().any(Vec::is_empty) {
            return Err(EmbedError::Malformed("an input got no embedding".into()));
        }
        if vectors.iter().flatten().any(|x| !x.is_finite()) {
            return Err(EmbedError::Malformed(
                "an embedding holds a non-finite number".into(),
            ));
        }
        Ok(vectors)
    }
}

/// What an item is embedded as: its title and text.
pub fn item_input(title: &str, text: &str) -> String {
    if title.is_empty() {
        text.to_owned()
    } else {
        format!("{title}\n\n{text}")
    }
}
