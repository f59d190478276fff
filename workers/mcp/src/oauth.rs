//! OAuth 2.1 for HTTP MCP servers, as the MCP authorization specification
//! (2025-11-25) asks of a client without a browser: the client-credentials
//! grant.
//!
//! 1. **Protected-resource metadata** (RFC 9728): from the
//!    `resource_metadata` of the server's `401`'s `WWW-Authenticate:
//!    Bearer …`, else `/.well-known/oauth-protected-resource` (with the
//!    server's path, then without). Its `resource` must be the server's
//!    URL (or a prefix of it): it names the token's audience.
//! 2. **Authorization-server metadata**: RFC 8414's
//!    `/.well-known/oauth-authorization-server`, then OpenID Connect's
//!    `openid-configuration`; its `issuer` must be the server named.
//! 3. **A token** from its `token_endpoint`: `grant_type=client_credentials`
//!    with the `resource` parameter (RFC 8707) and the scope, the client
//!    authenticated with HTTP Basic (or in the body, when the server only
//!    takes `client_secret_post`).
//!
//! Tokens are kept per tenant (a tenant may have a client of its own)
//! until a little before they expire, and dropped when the server answers
//! `401` to one. Every URL is https, or http to loopback. Neither the
//! secret nor a token is ever in an error or a log line: errors name the
//! client id and what the authorization server said.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use crate::config::{OAuthClient, OAuthSpec};

/// A token is renewed this long before it expires.
const EARLY: Duration = Duration::from_secs(30);
/// How long a token without `expires_in` is used.
const DEFAULT_LIFETIME: Duration = Duration::from_secs(300);
/// The largest metadata or token answer read.
const MAX_ANSWER: usize = 64 * 1024;

/// What went wrong getting a token: a message for the server's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("OAuth: {0}")]
pub struct OAuthError(pub String);

/// Where tokens come from, learned once per server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    /// The `resource` parameter: the protected resource's identifier.
    pub resource: String,
    pub token_endpoint: String,
    /// The scope the resource says it supports (space-separated), if any.
    pub scopes: Option<String>,
    /// The authorization server takes the secret in the body only.
    pub secret_in_body: bool,
}

/// A token and when it stops being used.
#[derive(Clone)]
struct Token {
    value: String,
    until: Instant,
}

/// The tokens of one HTTP server.
pub struct OAuth {
    spec: OAuthSpec,
    url: String,
    http: reqwest::Client,
    discovered: tokio::sync::Mutex<Option<Discovered>>,
    /// By tenant (`None`: the listing connection's).
    tokens: Mutex<BTreeMap<Option<String>, Token>>,
}

impl std::fmt::Debug for OAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuth").field("url", &self.url).finish()
    }
}

#[derive(Deserialize)]
struct ResourceMetadata {
    resource: String,
    #[serde(default)]
    authorization_servers: Vec<String>,
    #[serde(default)]
    scopes_supported: Vec<String>,
}

#[derive(Deserialize)]
struct ServerMetadata {
    issuer: String,
    token_endpoint: Option<String>,
    #[serde(default)]
    token_endpoint_auth_methods_supported: Vec<String>,
}

#[derive(Deserialize)]
struct TokenAnswer {
    access_token: String,
    token_type: String,
    expires_in: Option<u64>,
}

#[derive(Deserialize)]
struct TokenRefusal {
    error: String,
    error_description: Option<String>,
}

impl OAuth {
    /// The tokens of the server at `url`, from `spec`'s clients; each
    /// request bounded by `timeout`.
    pub fn new(spec: OAuthSpec, url: &str, timeout: Duration) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .build()
            .unwrap_or_default();
        Self {
            spec,
            url: url.to_string(),
            http,
            discovered: tokio::sync::Mutex::default(),
            tokens: Mutex::default(),
        }
    }

    /// `tenant`'s token (the one kept, or a new one) and when it stops
    /// being used.
    ///
    /// # Errors
    ///
    /// [`OAuthError`] when discovery fails or the authorization server
    /// refuses the client.
    pub async fn token(&self, tenant: Option<&str>) -> Result<(String, Instant), OAuthError> {
        let key = tenant.map(str::to_string);
        if let Some(t) = self.tokens_lock().get(&key)
            && t.until > Instant::now()
        {
            return Ok((t.value.clone(), t.until));
        }
        let discovered = self.discover().await?;
        let client = self.spec.client_for(tenant);
        let token = self.request(&client, &discovered).await?;
        self.tokens_lock().insert(key, token.clone());
        Ok((token.value, token.until))
    }

    /// Forgets `tenant`'s token (the server refused it), and what was
    /// discovered (it may have moved).
    pub async fn refused(&self, tenant: Option<&str>) {
        self.tokens_lock().remove(&tenant.map(str::to_string));
        *self.discovered.lock().await = None;
    }

    fn tokens_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Option<String>, Token>> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The server's metadata, discovered once.
    async fn discover(&self) -> Result<Discovered, OAuthError> {
        let mut discovered = self.discovered.lock().await;
        if let Some(d) = &*discovered {
            return Ok(d.clone());
        }
        let resource = self.resource_metadata().await?;
        let issuer = resource.authorization_servers.first().ok_or_else(|| {
            OAuthError("the protected-resource metadata names no authorization server".into())
        })?;
        let server = self.server_metadata(issuer).await?;
        let token_endpoint = server.token_endpoint.ok_or_else(|| {
            OAuthError(format!(
                "authorization server {issuer} has no token_endpoint"
            ))
        })?;
        allowed(&token_endpoint)?;
        let methods = &server.token_endpoint_auth_methods_supported;
        let d = Discovered {
            resource: resource.resource,
            token_endpoint,
            scopes: (!resource.scopes_supported.is_empty())
                .then(|| resource.scopes_supported.join(" ")),
            secret_in_body: !methods.is_empty()
                && !methods.iter().any(|m| m == "client_secret_basic")
                && methods.iter().any(|m| m == "client_secret_post"),
        };
        *discovered = Some(d.clone());
        Ok(d)
    }

    /// RFC 9728: where the `401` says, else the well-known places.
    async fn resource_metadata(&self) -> Result<ResourceMetadata, OAuthError> {
        let probe = self
            .http
            .post(&self.url)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(r#"{"jsonrpc":"2.0","id":0,"method":"ping"}"#)
            .send()
            .await
            .map_err(|e| OAuthError(format!("the MCP server cannot be reached: {e}")))?;
        let mut candidates = Vec::new();
        if probe.status() == reqwest::StatusCode::UNAUTHORIZED
            && let Some(url) = probe
                .headers()
                .get_all(reqwest::header::WWW_AUTHENTICATE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .find_map(resource_metadata_param)
        {
            candidates.push(url);
        }
        let (origin, path) = split_url(&self.url)?;
        let path = path.trim_end_matches('/');
        if !path.is_empty() {
            candidates.push(format!(
                "{origin}/.well-known/oauth-protected-resource{path}"
            ));
        }
        candidates.push(format!("{origin}/.well-known/oauth-protected-resource"));
        let metadata: ResourceMetadata = self.first_json(&candidates).await?;
        let canonical = self.url.trim_end_matches('/');
        let resource = metadata.resource.trim_end_matches('/');
        if resource.is_empty() || !canonical.starts_with(resource) {
            return Err(OAuthError(format!(
                "the protected-resource metadata is for {:?}, not {canonical}",
                metadata.resource
            )));
        }
        Ok(metadata)
    }

    /// RFC 8414, then OpenID Connect discovery, for `issuer`.
    async fn server_metadata(&self, issuer: &str) -> Result<ServerMetadata, OAuthError> {
        let (origin, path) = split_url(issuer)?;
        let path = path.trim_end_matches('/');
        let candidates = if path.is_empty() {
            vec![
                format!("{origin}/.well-known/oauth-authorization-server"),
                format!("{origin}/.well-known/openid-configuration"),
            ]
        } else {
            vec![
                format!("{origin}/.well-known/oauth-authorization-server{path}"),
                format!("{origin}/.well-known/openid-configuration{path}"),
                format!("{origin}{path}/.well-known/openid-configuration"),
            ]
        };
        let metadata: ServerMetadata = self.first_json(&candidates).await?;
        if metadata.issuer.trim_end_matches('/') != issuer.trim_end_matches('/') {
            return Err(OAuthError(format!(
                "the authorization server's metadata names issuer {:?}, not {issuer}",
                metadata.issuer
            )));
        }
        Ok(metadata)
    }

    /// The first of `urls` that answers 200 with JSON of type `T`.
    async fn first_json<T: serde::de::DeserializeOwned>(
        &self,
        urls: &[String],
    ) -> Result<T, OAuthError> {
        let mut tried = Vec::new();
        for url in urls {
            allowed(url)?;
            match self.http.get(url).send().await {
                Ok(r) if r.status().is_success() => match read(r).await {
                    Ok(bytes) => match serde_json::from_slice(&bytes) {
                        Ok(v) => return Ok(v),
                        Err(e) => tried.push(format!("{url}: {e}")),
                    },
                    Err(e) => tried.push(format!("{url}: {e}")),
                },
                Ok(r) => tried.push(format!("{url}: {}", r.status())),
                Err(e) => tried.push(format!("{url}: {e}")),
            }
        }
        Err(OAuthError(format!(
            "no metadata found ({})",
            tried.join("; ")
        )))
    }

    /// A token for `client`: the client-credentials grant with the
    /// `resource` parameter.
    async fn request(&self, client: &OAuthClient, d: &Discovered) -> Result<Token, OAuthError> {
        let secret = secret(client)?;
        let scope = client.scope.clone().or_else(|| d.scopes.clone());
        let (body, basic) = {
            let mut form = url::form_urlencoded::Serializer::new(String::new());
            form.append_pair("grant_type", "client_credentials");
            form.append_pair("resource", &d.resource);
            if let Some(scope) = &scope {
                form.append_pair("scope", scope);
            }
            if d.secret_in_body {
                form.append_pair("client_id", &client.client_id);
                form.append_pair("client_secret", &secret);
            }
            (form.finish(), !d.secret_in_body)
        };
        let mut request = self.http.post(&d.token_endpoint);
        if basic {
            // RFC 6749 §2.3.1: each form-encoded, then Basic.
            let enc =
                |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
            request = request.basic_auth(enc(&client.client_id), Some(enc(&secret)));
        }
        let answer = request
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| OAuthError(format!("the token endpoint cannot be reached: {e}")))?;
        let status = answer.status();
        let body = read(answer).await.map_err(OAuthError)?;
        if !status.is_success() {
            let why = serde_json::from_slice::<TokenRefusal>(&body).map_or_else(
                |_| status.to_string(),
                |r| match r.error_description {
                    Some(d) => format!("{} ({})", r.error, clip(&d)),
                    None => r.error,
                },
            );
            return Err(OAuthError(scrub(
                format!(
                    "the authorization server refused client {:?}: {why}",
                    client.client_id
                ),
                &secret,
            )));
        }
        let token: TokenAnswer = serde_json::from_slice(&body)
            .map_err(|e| OAuthError(format!("the token answer cannot be read: {e}")))?;
        if !token.token_type.eq_ignore_ascii_case("bearer") {
            return Err(OAuthError(format!(
                "the token is of type {:?}, not Bearer",
                token.token_type
            )));
        }
        let lifetime = token
            .expires_in
            .map_or(DEFAULT_LIFETIME, Duration::from_secs);
        Ok(Token {
            value: token.access_token,
            until: Instant::now() + lifetime.saturating_sub(EARLY.min(lifetime / 2)),
        })
    }
}

/// The client's secret, from its file or variable.
fn secret(client: &OAuthClient) -> Result<String, OAuthError> {
    if let Some(path) = &client.client_secret_file {
        return crate::child::read_secret(path)
            .map_err(|e| OAuthError(format!("client_secret_file: {e}")));
    }
    match &client.client_secret_env {
        Some(var) => std::env::var(var).map_err(|_| OAuthError(format!("{var} is not set"))),
        None => Err(OAuthError("the client has no secret".into())),
    }
}

async fn read(response: reqwest::Response) -> Result<Vec<u8>, String> {
    let bytes = response.bytes().await.map_err(|e| e.to_string())?;
    if bytes.len() > MAX_ANSWER {
        return Err(format!("an answer of {} bytes is too large", bytes.len()));
    }
    Ok(bytes.to_vec())
}

fn clip(text: &str) -> String {
    text.chars().take(200).collect()
}

fn scrub(text: String, secret: &str) -> String {
    if secret.is_empty() {
        text
    } else {
        text.replace(secret, "[redacted]")
    }
}

/// `resource_metadata="…"` of a `WWW-Authenticate: Bearer …` value.
fn resource_metadata_param(header: &str) -> Option<String> {
    let (scheme, params) = header.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    params.split(',').find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        (k.trim().eq_ignore_ascii_case("resource_metadata"))
            .then(|| v.trim().trim_matches('"').to_string())
    })
}

/// `(scheme://authority, path)` of a URL.
fn split_url(url: &str) -> Result<(String, String), OAuthError> {
    let parsed = url::Url::parse(url).map_err(|e| OAuthError(format!("{url:?}: {e}")))?;
    let origin = parsed.origin().ascii_serialization();
    Ok((origin, parsed.path().to_string()))
}

/// https, or http to loopback.
fn allowed(url: &str) -> Result<(), OAuthError> {
    let parsed = url::Url::parse(url).map_err(|e| OAuthError(format!("{url:?}: {e}")))?;
    let loopback = match parsed.host() {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    match parsed.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        _ => Err(OAuthError(format!(
            "{url} is neither https nor loopback http"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_metadata_is_read_from_www_authenticate() {
        assert_eq!(
            resource_metadata_param(
                r#"Bearer error="invalid_token", resource_metadata="http://127.0.0.1:9/.well-known/oauth-protected-resource""#
            )
            .as_deref(),
            Some("http://127.0.0.1:9/.well-known/oauth-protected-resource")
        );
        assert_eq!(resource_metadata_param("Basic realm=\"x\""), None);
        assert_eq!(resource_metadata_param("Bearer realm=\"x\""), None);
    }

    #[test]
    fn only_https_or_loopback_http_is_spoken_to() {
        assert!(allowed("https://as.example.com/token").is_ok());
        assert!(allowed("http://127.0.0.1:8080/token").is_ok());
        assert!(allowed("http://localhost/token").is_ok());
        assert!(allowed("http://as.example.com/token").is_err());
        assert!(allowed("ftp://127.0.0.1/token").is_err());
    }

    #[test]
    fn a_refusal_never_carries_the_secret() {
        assert_eq!(
            scrub("bad secret s3cr3t given".into(), "s3cr3t"),
            "bad secret [redacted] given"
        );
    }
}
