//! The model endpoint on the command line: a profiles file, or one
//! deployment from `--llm-*` flags (environment `TOOLFLEET_LLM_*`).

use std::time::Duration;

use clap::Args;

use crate::config_file::ConfigError;
use crate::deployments::Deployment;
use crate::model_config::ModelConfig;

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
    /// How much the fleet trusts this endpoint, 0 to 1: the provider
    /// confidence of every invocation it serves (tools with a higher
    /// `minProviderConfidence` are not offered). The `confidence` of a
    /// deployment in `--config`.
    #[arg(long = "llm-confidence", env = "TOOLFLEET_LLM_CONFIDENCE", default_value_t = 0.0, value_parser = parse_confidence)]
    pub confidence: f64,
    /// The provider label tool jobs carry (default: the base URL's host).
    #[arg(long = "llm-provider", env = "TOOLFLEET_LLM_PROVIDER", value_parser = parse_provider)]
    pub provider: Option<String>,
    /// Send each conversation request's `prompt_cache_key` (true or
    /// false); the default is true for OpenAI's own API and false for any
    /// other URL. The `prompt_cache_key` of a deployment in `--config`.
    #[arg(long = "llm-prompt-cache-key", env = "TOOLFLEET_LLM_PROMPT_CACHE_KEY", value_parser = clap::builder::BoolishValueParser::new())]
    pub prompt_cache_key: Option<bool>,
}

fn parse_provider(s: &str) -> Result<String, String> {
    if s.len() <= 128 && crate::config_file::check_name(s).is_ok() {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a provider name (1-128 of letters, digits, `_`, `-` and `.`)"
        ))
    }
}

fn parse_confidence(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if (0.0..=1.0).contains(&c) => Ok(c),
        _ => Err(format!("{s:?} is not a number from 0 to 1")),
    }
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
    /// The deployment described by the `--llm-*` flags.
    pub fn deployment(&self) -> Deployment {
        let mut deployment = Deployment::new(self.base_url.clone(), self.model.clone());
        deployment.api = self.api;
        deployment.http = self.http;
        deployment.connect_timeout = Duration::from_millis(self.connect_timeout_ms);
        deployment.first_token_timeout = Duration::from_millis(self.first_token_timeout_ms);
        deployment.idle_timeout = Duration::from_millis(self.idle_timeout_ms);
        deployment.confidence = self.confidence;
        deployment.provider = self.provider.clone();
        if let Some(send) = self.prompt_cache_key {
            deployment.prompt_cache_key = send;
        }
        if let Some(key) = &self.api_key {
            deployment = deployment.with_api_key(key.clone());
        }
        deployment
    }

    /// The deployments and prices: the `--config` file's, or the one
    /// deployment from the flags. (The whole file, profiles included, is
    /// the `toolfleet-config` crate's.)
    ///
    /// # Errors
    ///
    /// The `--config` file cannot be read, or its model tables are bad.
    pub fn model_config(&self) -> Result<ModelConfig, ConfigError> {
        match &self.config {
            Some(path) => ModelConfig::load(path),
            None => Ok(ModelConfig::single(self.deployment())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        llm: LlmArgs,
    }

    #[test]
    fn the_flags_set_the_deployments_trust_and_provider() {
        let cli = Cli::try_parse_from(["x", "--llm-confidence", "0.8", "--llm-provider", "azure"])
            .unwrap();
        let d = cli.llm.deployment();
        assert_eq!(
            (d.confidence, d.provider_name()),
            (0.8, "azure".to_string())
        );
        let plain = Cli::try_parse_from(["x"]).unwrap().llm.deployment();
        assert_eq!(plain.confidence, 0.0);
        assert_eq!(plain.provider_name(), "api.openai.com");
        assert!(plain.prompt_cache_key, "on for OpenAI by default");
        let local = ["x", "--llm-base-url", "http://127.0.0.1:8000/v1"];
        let off = Cli::try_parse_from(local).unwrap().llm.deployment();
        assert!(!off.prompt_cache_key, "off elsewhere by default");
        let on = Cli::try_parse_from([&local[..], &["--llm-prompt-cache-key", "true"]].concat())
            .unwrap()
            .llm
            .deployment();
        assert!(on.prompt_cache_key, "the flag turns it on");
        let quiet = Cli::try_parse_from(["x", "--llm-prompt-cache-key", "false"])
            .unwrap()
            .llm
            .deployment();
        assert!(!quiet.prompt_cache_key, "and off");
        for bad in [
            &["x", "--llm-prompt-cache-key", "maybe"][..],
            &["x", "--llm-confidence", "1.5"][..],
            &["x", "--llm-confidence", "high"][..],
            &["x", "--llm-provider", "no spaces"][..],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }
}
