//! The model endpoint on the command line: a profiles file, or one
//! deployment from `--llm-*` flags (environment `TOOLFLEET_LLM_*`).

use clap::Args;

/// The model endpoint: a profiles file, or one deployment from flags.
#[derive(Args, Debug, Clone)]
pub struct LlmArgs {
    /// Profiles and deployments file (TOML, see
    /// `config/toolfleet.example.toml`). Without it, one profile `default`
    /// is built from the `--llm-*` settings.
    #[arg(long = "config", env = "TOOLFLEET_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// API shape of the endpoint: chat_completions or responses.
    #[arg(long = "llm-api", env = "TOOLFLEET_LLM_API", default_value = "chat_completions", value_parser = parse_api)]
    pub api: crate::ApiShape,
    /// Base URL of an OpenAI-compatible API, including `/v1`.
    #[arg(
        long = "llm-base-url",
        env = "TOOLFLEET_LLM_BASE_URL",
        default_value = "https://api.openai.com/v1"
    )]
    pub base_url: url::Url,
    /// API key (sent as a bearer token; never logged).
    #[arg(
        long = "llm-api-key",
        env = "TOOLFLEET_LLM_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Model name.
    #[arg(
        long = "llm-model",
        env = "TOOLFLEET_LLM_MODEL",
        default_value = "gpt-4o-mini"
    )]
    pub model: String,
    /// The data source of the one profile built from these flags (without
    /// --config): chat jobs that name none search it.
    #[arg(long = "data-source", env = "TOOLFLEET_DATA_SOURCE")]
    pub data_source: Option<String>,
    /// HTTP to the endpoint: http1, or http2 (HTTP/2 only, h2c over plain
    /// http; calls in flight share one connection, capped by the server's
    /// streams per connection).
    #[arg(long = "llm-http", env = "TOOLFLEET_LLM_HTTP", default_value = "http1", value_parser = parse_http)]
    pub http: crate::HttpVersion,
    /// Connect timeout, in milliseconds.
    #[arg(
        long = "llm-connect-timeout-ms",
        env = "TOOLFLEET_LLM_CONNECT_TIMEOUT_MS",
        default_value_t = 5_000
    )]
    pub connect_timeout_ms: u64,
    /// Time allowed until the first streamed chunk, in milliseconds.
    #[arg(
        long = "llm-first-token-timeout-ms",
        env = "TOOLFLEET_LLM_FIRST_TOKEN_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub first_token_timeout_ms: u64,
    /// Longest allowed gap between streamed chunks, in milliseconds.
    #[arg(
        long = "llm-idle-timeout-ms",
        env = "TOOLFLEET_LLM_IDLE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub idle_timeout_ms: u64,
}

fn parse_http(s: &str) -> Result<crate::HttpVersion, String> {
    match s {
        "http1" => Ok(crate::HttpVersion::Http1),
        "http2" => Ok(crate::HttpVersion::Http2),
        other => Err(format!("{other:?} is not http1 or http2")),
    }
}

fn parse_api(s: &str) -> Result<crate::ApiShape, String> {
    match s {
        "chat_completions" => Ok(crate::ApiShape::ChatCompletions),
        "responses" => Ok(crate::ApiShape::Responses),
        other => Err(format!("{other:?} is not chat_completions or responses")),
    }
}

impl LlmArgs {
    /// The profiles: the `--config` file, or one profile from the flags.
    pub fn fleet_config(
        &self,
    ) -> Result<crate::profiles::FleetConfig, crate::profiles::ConfigError> {
        match &self.config {
            Some(path) => crate::profiles::FleetConfig::load(path),
            None => {
                let config = crate::profiles::FleetConfig::single(
                    crate::profiles::Deployment::from_llm_args(self),
                );
                Ok(match &self.data_source {
                    Some(ds) => config.with_data_source(ds),
                    None => config,
                })
            }
        }
    }
}
