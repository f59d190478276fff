//! Deployments: one model behind one OpenAI-compatible endpoint, as the
//! `[deployments.<name>]` tables of the fleet's configuration file describe
//! it (validated at load), and where its API key is read from
//! ([`EnvSource`]).
//!
//! # The tables
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[deployments.<name>]` | table | one model endpoint; names are `[A-Za-z0-9_.-]+` |
//! | `api` | `"chat_completions"` (default) or `"responses"` | which OpenAI API shape to speak |
//! | `reasoning` | bool, `false` | the model is a reasoning model (OpenAI o-series, gpt-5): with `api = "responses"`, requests ask for `"include": ["reasoning.encrypted_content"]` so reasoning is carried between tool rounds. Only for reasoning models: others (gpt-4o, gpt-4o-mini, …) answer that request with 400. Chat Completions ignores it |
//! | `base_url` | http(s) URL, required | the API root including `/v1` (or Azure's `/openai/deployments/<name>`); no user or password in it |
//! | `model` | string, required | model name sent to the provider (for Azure's classic form, the deployment's model, for prices and token counting) |
//! | `api_key_env` | env var name, none | the environment variable holding the key; no key is sent when absent. The key itself never appears in the file: an `api_key` key is refused |
//! | `auth` | `"bearer"` (default) or `{ header = "<name>" }` | `Authorization: Bearer <key>`, or the key as is in the named header (Azure: `{ header = "api-key" }`) |
//! | `query` | table of strings, `{}` | extra query parameters on every request, e.g. `{ "api-version" = "2024-10-21" }`; credential-like names (`key`, `api-key`, `token`, …) are refused |
//! | `stream` | bool, `true` | stream responses (server-sent events) or wait for whole answers |
//! | `http` | `"http1"` (default) or `"http2"` | `http1`: HTTP/1.1, a connection per call in flight; `http2`: HTTP/2 only (over TLS, or h2c over plain `http://`), for servers known to speak it — calls in flight share four connections, taken in turn, a broken one replaced (far less memory per waiting call), but the server's streams per connection (often 100–250 for public APIs) then cap the calls in flight |
//! | `connect_timeout_ms` | ms > 0, [`DEFAULT_CONNECT_TIMEOUT`](crate::DEFAULT_CONNECT_TIMEOUT) | TCP and TLS connect |
//! | `first_token_timeout_ms` | ms > 0, [`DEFAULT_FIRST_TOKEN_TIMEOUT`](crate::DEFAULT_FIRST_TOKEN_TIMEOUT) | request sent to first streamed event (or whole answer when not streaming) |
//! | `idle_timeout_ms` | ms > 0, [`DEFAULT_IDLE_TIMEOUT`](crate::DEFAULT_IDLE_TIMEOUT) | longest gap between streamed chunks |
//! | `[deployments.<name>.retry]` | table | retries of 429 and 5xx before any output was streamed |
//! | `retry.max_attempts` | 1..=10, `3` | attempts in all, the first included |
//! | `retry.max_elapsed_ms` | ms > 0, `30000` | no new attempt after this long since the first |
//! | `retry.base_delay_ms` | ms, `250` | first backoff delay, doubled per attempt (a `Retry-After` wins) |
//! | `retry.max_delay_ms` | ms ≥ `base_delay_ms`, `5000` | longest backoff delay |
//! | `confidence` | 0.0..=1.0, `0` | how much the fleet trusts this deployment: the provider confidence of every invocation whose model calls go to it (tools with a higher `minProviderConfidence` are not offered, and workers refuse them). Decided here, never by a chat job |
//! | `provider` | name, the `base_url`'s host | the provider label tool jobs carry (`Toolfleet-Provider`), e.g. `"openai"`, `"azure"`; `[A-Za-z0-9_.-]+`. The connection they carry (`Toolfleet-Connection`) is the deployment's name |
//! | `prompt_cache_key` | bool, `true` for `https://api.openai.com` and its regional hosts (`https://eu.api.openai.com`, …), else `false` | send each conversation request's `prompt_cache_key` (an opaque hash of the fleet, tenant and profile), so requests sharing a prompt's beginning reach the same prompt cache. Only for providers that accept the field (OpenAI does; a strict compatible server may refuse an unknown field with 400) |
//! | `batch_service_tier` | string, none | the `service_tier` sent with the model calls of batch jobs (`priority = "batch"`), e.g. OpenAI's `"flex"`; interactive jobs send none. Only for deployments whose provider accepts it |
//! | `max_concurrency` | 1..=100000, none | model calls to this deployment in flight at once, fleet-wide (every orchestrator and LLM-tool worker on the same Redis): a call past it waits for a slot instead of meeting the provider's 429 |
//! | `requests_per_minute` | 1..=10000000, none | model calls started per minute, fleet-wide; past it a call waits for the next minute. A 429 with `Retry-After` from the provider pauses every caller of the deployment that long |
//!
//! # Invariants
//!
//! - **No key is read from, or written to, the file or a message.** Keys
//!   come from the environment through [`EnvSource`] when a deployment is
//!   used; `Debug` of [`Deployment`] redacts a key given in code; errors
//!   about `api_key_env` never echo its value (it might be a pasted key).
//! - **Keys are never read from the process environment directly**, only
//!   through the [`EnvSource`] passed in, so this is testable without
//!   `set_var`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::BuildHasher;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use url::Url;

use crate::config_file::{check_name, is_env_var_name, key_segment};
use crate::{ApiShape, Auth, LlmConfig, RetryPolicy};

const MAX_RETRY_ATTEMPTS_LIMIT: u32 = 10;

/// Query parameter names that carry credentials: refused in `query`, where
/// they would put a key in the file.
const CREDENTIAL_QUERY_NAMES: &[&str] = &[
    "key",
    "api-key",
    "api_key",
    "apikey",
    "access_token",
    "token",
];

/// Why a deployment's key is not available. Never holds the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyUnavailable {
    #[error("environment variable {0} is not set")]
    NotSet(String),
    #[error("environment variable {0} is empty")]
    Empty(String),
}

/// Where API keys are read from: the process environment in binaries, a map
/// in tests (no `set_var`).
pub trait EnvSource {
    /// The variable's value; `None` when unset or not Unicode.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<S: BuildHasher> EnvSource for HashMap<String, String, S> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// `[deployments.<name>.retry]` as written, in milliseconds.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawRetry {
    max_attempts: u32,
    max_elapsed_ms: u64,
    base_delay_ms: u64,
    max_delay_ms: u64,
}

impl Default for RawRetry {
    fn default() -> Self {
        let policy = RetryPolicy::default();
        Self {
            max_attempts: policy.max_attempts,
            max_elapsed_ms: millis(policy.max_elapsed),
            base_delay_ms: millis(policy.base_delay),
            max_delay_ms: millis(policy.max_delay),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl From<RawRetry> for RetryPolicy {
    fn from(raw: RawRetry) -> Self {
        Self {
            max_attempts: raw.max_attempts,
            max_elapsed: Duration::from_millis(raw.max_elapsed_ms),
            base_delay: Duration::from_millis(raw.base_delay_ms),
            max_delay: Duration::from_millis(raw.max_delay_ms),
        }
    }
}

/// Retries: a few attempts, a time budget, delays in order.
fn validate_retry(retry: &RetryPolicy, at: &str) -> Result<(), (String, String)> {
    if !(1..=MAX_RETRY_ATTEMPTS_LIMIT).contains(&retry.max_attempts) {
        return Err((
            format!("{at}.max_attempts"),
            format!(
                "must be between 1 and {MAX_RETRY_ATTEMPTS_LIMIT}, not {}",
                retry.max_attempts
            ),
        ));
    }
    if retry.max_elapsed.is_zero() {
        return Err((
            format!("{at}.max_elapsed_ms"),
            "must be more than 0".to_owned(),
        ));
    }
    if retry.base_delay > retry.max_delay {
        return Err((
            format!("{at}.base_delay_ms"),
            format!(
                "{} is more than max_delay_ms ({})",
                millis(retry.base_delay),
                millis(retry.max_delay)
            ),
        ));
    }
    Ok(())
}

/// One model behind one OpenAI-compatible endpoint.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawDeployment")]
pub struct Deployment {
    /// Which OpenAI API shape to speak.
    pub api: ApiShape,
    /// A reasoning model: Responses requests ask for its encrypted
    /// reasoning ([`LlmConfig::reasoning`]). Never assumed.
    pub reasoning: bool,
    /// The provider accepts `prompt_cache_key`
    /// ([`LlmConfig::prompt_cache_key`]): by default only OpenAI's own
    /// API ([`accepts_prompt_cache_key`]).
    pub prompt_cache_key: bool,
    /// The API root including `/v1`; a query string in it is kept.
    pub base_url: Url,
    /// Model name sent to the provider, priced and token-counted.
    pub model: String,
    /// The environment variable holding the key; `None`: no key is sent.
    pub api_key_env: Option<String>,
    pub auth: Auth,
    /// Extra query parameters on every request (Azure: `api-version`).
    pub query: BTreeMap<String, String>,
    pub stream: bool,
    /// HTTP/1.1 or HTTP/2 ([`crate::HttpVersion`]).
    pub http: crate::HttpVersion,
    pub connect_timeout: Duration,
    pub first_token_timeout: Duration,
    pub idle_timeout: Duration,
    /// Retries of 429 and 5xx answers before any output was streamed.
    pub retry: RetryPolicy,
    /// How much the fleet trusts this deployment, `0..=1` (0 unless the
    /// file says more): the provider confidence of the invocations it
    /// serves.
    pub confidence: f64,
    /// The provider label tool jobs carry; `None`: the `base_url`'s host
    /// ([`Deployment::provider_name`]).
    pub provider: Option<String>,
    /// The `service_tier` sent with the model calls of batch jobs (e.g.
    /// OpenAI's `"flex"`: cheaper, slower); `None`: none sent.
    pub batch_service_tier: Option<String>,
    /// The deployment's fleet-wide limits: model calls in flight at once,
    /// and started per minute, across every orchestrator and LLM-tool
    /// worker sharing the store; calls past them wait their turn.
    pub max_concurrency: Option<u32>,
    pub requests_per_minute: Option<u32>,
    /// A key given on the command line ([`Deployment::with_api_key`]); never
    /// read from a file. Wins over `api_key_env`.
    inline_api_key: Option<String>,
}

impl fmt::Debug for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deployment")
            .field("api", &self.api)
            .field("reasoning", &self.reasoning)
            .field("prompt_cache_key", &self.prompt_cache_key)
            .field(
                "base_url",
                &toolfleet_protocol::redact_url(self.base_url.as_str()),
            )
            .field("model", &self.model)
            .field("api_key_env", &self.api_key_env)
            .field("auth", &self.auth)
            .field("query", &self.query)
            .field("stream", &self.stream)
            .field("http", &self.http)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_token_timeout", &self.first_token_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("retry", &self.retry)
            .field("confidence", &self.confidence)
            .field("provider", &self.provider)
            .field("batch_service_tier", &self.batch_service_tier)
            .field("max_concurrency", &self.max_concurrency)
            .field("requests_per_minute", &self.requests_per_minute)
            .field(
                "inline_api_key",
                &self.inline_api_key.as_ref().map(|_| "[redacted]"),
            )
            .finish()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeployment {
    #[serde(default)]
    api: ApiShape,
    #[serde(default)]
    reasoning: bool,
    /// `None`: [`accepts_prompt_cache_key`] of the `base_url`.
    #[serde(default)]
    prompt_cache_key: Option<bool>,
    // Parsed here rather than through `url`'s serde feature, which this
    // crate does not enable itself.
    #[serde(deserialize_with = "deserialize_url")]
    base_url: Url,
    model: String,
    #[serde(default)]
    api_key_env: Option<String>,
    /// Present only to refuse it with a useful message.
    #[serde(default)]
    api_key: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    auth: Auth,
    #[serde(default)]
    query: BTreeMap<String, String>,
    #[serde(default = "yes")]
    stream: bool,
    #[serde(default)]
    http: crate::HttpVersion,
    #[serde(default = "default_connect_timeout_ms")]
    connect_timeout_ms: u64,
    #[serde(default = "default_first_token_timeout_ms")]
    first_token_timeout_ms: u64,
    #[serde(default = "default_idle_timeout_ms")]
    idle_timeout_ms: u64,
    #[serde(default)]
    retry: RawRetry,
    #[serde(default)]
    confidence: f64,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    batch_service_tier: Option<String>,
    #[serde(default)]
    max_concurrency: Option<u32>,
    #[serde(default)]
    requests_per_minute: Option<u32>,
}

/// Whether the API at `base_url` is known to accept `prompt_cache_key`:
/// OpenAI's own, `https://api.openai.com` and its data-residency hosts
/// (`eu.api.openai.com`, `us.api.openai.com`, … — every name under
/// `api.openai.com` is OpenAI's). Other OpenAI-compatible servers differ
/// (some refuse a field they do not know; Azure OpenAI documents it for
/// recent models and API versions only), so the file says so for them
/// (`prompt_cache_key = true`).
pub fn accepts_prompt_cache_key(base_url: &Url) -> bool {
    base_url.scheme() == "https"
        && base_url
            .host_str()
            .is_some_and(|host| host == "api.openai.com" || host.ends_with(".api.openai.com"))
}

fn deserialize_url<'de, D: Deserializer<'de>>(d: D) -> Result<Url, D::Error> {
    let text = String::deserialize(d)?;
    Url::parse(&text).map_err(|e| serde::de::Error::custom(format!("not a URL: {e}")))
}

fn yes() -> bool {
    true
}
fn default_connect_timeout_ms() -> u64 {
    millis(crate::DEFAULT_CONNECT_TIMEOUT)
}
fn default_first_token_timeout_ms() -> u64 {
    millis(crate::DEFAULT_FIRST_TOKEN_TIMEOUT)
}
fn default_idle_timeout_ms() -> u64 {
    millis(crate::DEFAULT_IDLE_TIMEOUT)
}

impl TryFrom<RawDeployment> for Deployment {
    type Error = String;

    fn try_from(raw: RawDeployment) -> Result<Self, Self::Error> {
        if raw.api_key.is_some() {
            return Err(
                "`api_key` is not allowed in the file: put the key in an environment \
                        variable and name it with `api_key_env`"
                    .to_owned(),
            );
        }
        Ok(Self {
            api: raw.api,
            reasoning: raw.reasoning,
            prompt_cache_key: raw
                .prompt_cache_key
                .unwrap_or_else(|| accepts_prompt_cache_key(&raw.base_url)),
            base_url: raw.base_url,
            model: raw.model,
            api_key_env: raw.api_key_env,
            auth: raw.auth,
            query: raw.query,
            stream: raw.stream,
            http: raw.http,
            connect_timeout: Duration::from_millis(raw.connect_timeout_ms),
            first_token_timeout: Duration::from_millis(raw.first_token_timeout_ms),
            idle_timeout: Duration::from_millis(raw.idle_timeout_ms),
            retry: raw.retry.into(),
            confidence: raw.confidence,
            provider: raw.provider,
            batch_service_tier: raw.batch_service_tier,
            max_concurrency: raw.max_concurrency,
            requests_per_minute: raw.requests_per_minute,
            inline_api_key: None,
        })
    }
}

impl Deployment {
    /// A Chat Completions deployment of a model that is not a reasoning
    /// model, with the `DEFAULT_*` timeouts and retries, streaming, and no
    /// key.
    pub fn new(base_url: Url, model: impl Into<String>) -> Self {
        Self {
            api: ApiShape::default(),
            reasoning: false,
            prompt_cache_key: accepts_prompt_cache_key(&base_url),
            base_url,
            model: model.into(),
            api_key_env: None,
            auth: Auth::default(),
            query: BTreeMap::new(),
            stream: true,
            http: crate::HttpVersion::Http1,
            connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
            first_token_timeout: crate::DEFAULT_FIRST_TOKEN_TIMEOUT,
            idle_timeout: crate::DEFAULT_IDLE_TIMEOUT,
            retry: RetryPolicy::default(),
            confidence: 0.0,
            provider: None,
            batch_service_tier: None,
            max_concurrency: None,
            requests_per_minute: None,
            inline_api_key: None,
        }
    }

    /// This deployment with `confidence` (`0..=1`) as its provider
    /// confidence.
    #[must_use]
    pub fn with_confidence(mut self, confidence: f64) -> Self {
        self.confidence = confidence;
        self
    }

    /// The provider label tool jobs carry: the `provider` key, else the
    /// `base_url`'s host.
    pub fn provider_name(&self) -> String {
        match &self.provider {
            Some(p) => p.clone(),
            None => self.base_url.host_str().unwrap_or_default().to_owned(),
        }
    }

    /// Uses `key` instead of reading `api_key_env` (a key from the command
    /// line). An empty key means none.
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        let key = key.into();
        self.inline_api_key = (!key.trim().is_empty()).then_some(key);
        self
    }

    /// The key to send: the one given in code, else `api_key_env`'s value
    /// in `env` (trimmed), else none when no variable is named.
    ///
    /// # Errors
    ///
    /// [`KeyUnavailable`] when the named variable is unset or empty.
    pub fn api_key(&self, env: &dyn EnvSource) -> Result<Option<String>, KeyUnavailable> {
        if let Some(key) = &self.inline_api_key {
            return Ok(Some(key.clone()));
        }
        let Some(var) = &self.api_key_env else {
            return Ok(None);
        };
        match env.var(var) {
            None => Err(KeyUnavailable::NotSet(var.clone())),
            // Keys pasted into env files often carry a trailing newline.
            Some(value) if value.trim().is_empty() => Err(KeyUnavailable::Empty(var.clone())),
            Some(value) => Ok(Some(value.trim().to_owned())),
        }
    }

    /// The client config for this deployment, with its key read from `env`.
    ///
    /// # Errors
    ///
    /// [`KeyUnavailable`] when the named key variable is unset or empty.
    pub fn to_llm_config(&self, env: &dyn EnvSource) -> Result<LlmConfig, KeyUnavailable> {
        Ok(self.llm_config_with_key(self.api_key(env)?))
    }

    /// The client config for this deployment with `api_key` (already
    /// resolved) as its key.
    pub fn llm_config_with_key(&self, api_key: Option<String>) -> LlmConfig {
        LlmConfig {
            base_url: self.base_url.clone(),
            api_key,
            api: self.api,
            reasoning: self.reasoning,
            prompt_cache_key: self.prompt_cache_key,
            auth: self.auth.clone(),
            extra_query: self
                .query
                .iter()
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
            stream: self.stream,
            retry: self.retry.clone(),
            connect_timeout: self.connect_timeout,
            first_token_timeout: self.first_token_timeout,
            idle_timeout: self.idle_timeout,
            http: self.http,
            gate: None,
        }
    }

    /// Whether calls to this deployment wait for fleet-wide limits.
    pub fn has_fleet_limits(&self) -> bool {
        self.max_concurrency.is_some() || self.requests_per_minute.is_some()
    }

    /// This deployment's fleet-wide limits under `name` (its key in the
    /// file), when it has any.
    pub fn limits(&self, name: &str) -> Option<crate::gate::DeploymentLimits> {
        self.has_fleet_limits()
            .then(|| crate::gate::DeploymentLimits {
                deployment: name.to_owned(),
                max_concurrency: self.max_concurrency,
                requests_per_minute: self.requests_per_minute,
            })
    }

    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let url = &self.base_url;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err((
                format!("{at}.base_url"),
                format!("must be an http or https URL, not a {} URL", url.scheme()),
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err((
                format!("{at}.base_url"),
                "must not carry a user or password: put the key in an environment variable \
                 and name it with `api_key_env`"
                    .to_owned(),
            ));
        }
        if self.model.trim().is_empty() {
            return Err((format!("{at}.model"), "must not be empty".to_owned()));
        }
        if let Some(var) = &self.api_key_env {
            // The value is never echoed: a key pasted here by mistake must
            // not end up in a log.
            if !is_env_var_name(var) {
                return Err((
                    format!("{at}.api_key_env"),
                    "must be the name of an environment variable (letters, digits and `_`, \
                     not starting with a digit), not the key itself"
                        .to_owned(),
                ));
            }
        }
        if let Auth::Header(header) = &self.auth
            && reqwest::header::HeaderName::from_bytes(header.as_bytes()).is_err()
        {
            return Err((
                format!("{at}.auth.header"),
                format!("{header:?} is not a valid HTTP header name"),
            ));
        }
        for name in self.query.keys() {
            if name.is_empty() {
                return Err((
                    format!("{at}.query"),
                    "a parameter name is empty".to_owned(),
                ));
            }
            if CREDENTIAL_QUERY_NAMES.contains(&name.to_ascii_lowercase().as_str()) {
                return Err((
                    format!("{at}.query.{}", key_segment(name)),
                    "looks like a credential; keys belong in the environment: name the \
                     variable with `api_key_env` and use `auth = { header = \"...\" }`"
                        .to_owned(),
                ));
            }
        }
        self.validate_trust(at)?;
        self.validate_limits(at)?;
        for (key, value) in [
            ("connect_timeout_ms", self.connect_timeout),
            ("first_token_timeout_ms", self.first_token_timeout),
            ("idle_timeout_ms", self.idle_timeout),
        ] {
            if value.is_zero() {
                return Err((format!("{at}.{key}"), "must be more than 0".to_owned()));
            }
        }
        validate_retry(&self.retry, &format!("{at}.retry"))
    }
}

impl Deployment {
    /// The fleet-wide limits in range; the batch tier a short name.
    fn validate_limits(&self, at: &str) -> Result<(), (String, String)> {
        for (key, value, max) in [
            ("max_concurrency", self.max_concurrency, 100_000),
            ("requests_per_minute", self.requests_per_minute, 10_000_000),
        ] {
            if let Some(v) = value
                && !(1..=max).contains(&v)
            {
                return Err((format!("{at}.{key}"), format!("must be 1..={max}, not {v}")));
            }
        }
        if let Some(tier) = &self.batch_service_tier
            && (tier.len() > 64 || check_name(tier).is_err())
        {
            return Err((
                format!("{at}.batch_service_tier"),
                format!(
                    "{tier:?} is not a service tier (1-64 of letters, digits, `_`, `-` and `.`), e.g. \"flex\""
                ),
            ));
        }
        Ok(())
    }

    /// `confidence` is a number in `0..=1`; `provider` a short name.
    fn validate_trust(&self, at: &str) -> Result<(), (String, String)> {
        if !(0.0..=1.0).contains(&self.confidence) {
            return Err((
                format!("{at}.confidence"),
                format!("must be between 0.0 and 1.0, not {}", self.confidence),
            ));
        }
        if let Some(provider) = &self.provider
            && (provider.len() > 128 || check_name(provider).is_err())
        {
            return Err((
                format!("{at}.provider"),
                format!(
                    "{provider:?} is not a provider name (1-128 of letters, digits, `_`, `-` and `.`)"
                ),
            ));
        }
        Ok(())
    }
}

/// Checks every deployment of a file and its name; the error is `(key
/// path, message)` of the first problem.
///
/// # Errors
///
/// A bad name, or a value out of range or of the wrong form.
pub fn validate_all(deployments: &BTreeMap<String, Deployment>) -> Result<(), (String, String)> {
    for (name, deployment) in deployments {
        let at = format!("deployments.{}", key_segment(name));
        check_name(name).map_err(|m| (at.clone(), m))?;
        deployment.validate(&at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::model_config::ModelConfig;

    const PRIMARY: &str = r#"
        [deployments.primary]
        base_url = "https://api.openai.com/v1"
        model = "gpt-4o-mini"
        api_key_env = "PRIMARY_KEY"
    "#;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn to_llm_config_reads_the_key_from_env() {
        let config = ModelConfig::from_toml(PRIMARY, "test.toml").expect("loads");
        let d = &config.deployments["primary"];
        let llm = d
            .to_llm_config(&env(&[("PRIMARY_KEY", "k1")]))
            .expect("llm config");
        assert_eq!(llm.api_key.as_deref(), Some("k1"));
        let e = d.to_llm_config(&HashMap::new()).expect_err("no key");
        assert!(e.to_string().contains("PRIMARY_KEY is not set"), "{e}");
    }

    #[test]
    fn a_key_given_in_code_never_shows_in_debug_output() {
        let d = Deployment::new(
            Url::parse("https://api.openai.com/v1").expect("url"),
            "gpt-4o",
        )
        .with_api_key("sk-very-secret");
        assert!(!format!("{d:?}").contains("sk-very-secret"));
        assert_eq!(
            d.api_key(&HashMap::new()).expect("a key").as_deref(),
            Some("sk-very-secret")
        );
    }

    #[test]
    fn prompt_cache_key_is_on_for_openai_and_off_elsewhere_unless_the_file_says() {
        let config = ModelConfig::from_toml(
            r#"
            [deployments.openai]
            base_url = "https://api.openai.com/v1"
            model = "gpt-4o-mini"

            [deployments.local]
            base_url = "http://127.0.0.1:8000/v1"
            model = "qwen"

            [deployments.vllm]
            base_url = "http://127.0.0.1:8000/v1"
            model = "qwen"
            prompt_cache_key = true

            [deployments.quiet]
            base_url = "https://api.openai.com/v1"
            model = "gpt-4o-mini"
            prompt_cache_key = false
            "#,
            "test.toml",
        )
        .expect("loads");
        let sends = |name: &str| {
            config.deployments[name]
                .to_llm_config(&HashMap::new())
                .expect("llm config")
                .prompt_cache_key
        };
        assert!(sends("openai"));
        assert!(!sends("local"));
        for (url, on) in [
            ("https://eu.api.openai.com/v1", true),
            ("https://us.api.openai.com/v1", true),
            ("http://api.openai.com/v1", false),
            ("https://api.openai.com.example.net/v1", false),
            ("https://notapi.openai.com/v1", false),
            ("https://my-resource.openai.azure.com/openai/v1", false),
        ] {
            let url = Url::parse(url).expect("url");
            assert_eq!(accepts_prompt_cache_key(&url), on, "{url}");
        }
        assert!(sends("vllm"));
        assert!(!sends("quiet"));
        let e = ModelConfig::from_toml(
            r#"
            [deployments.bad]
            base_url = "https://api.openai.com/v1"
            model = "gpt-4o-mini"
            prompt_cache_key = "yes"
            "#,
            "test.toml",
        )
        .expect_err("not a bool");
        assert!(e.to_string().contains("prompt_cache_key"), "{e}");
    }
}
