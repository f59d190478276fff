//! OAuth 2.1 for HTTP MCP servers, as the MCP authorization specification
//! (2025-11-25) asks of a client without a browser: the client-credentials
//! grant.
//!
//! 1. **Protected-resource metadata** (RFC 9728): from the
//!    `resource_metadata` of the server's `401`'s `WWW-Authenticate:
//!    Bearer …` when it is on the server's own origin, else
//!    `/.well-known/oauth-protected-resource` (with the server's path,
//!    then without). Its `resource` must be the server's URL or a parent
//!    of it: same scheme, host and port, its path a prefix of whole
//!    segments.
//! 2. **The configured authorization server**: the operator names the
//!    `issuer` trusted with the client's secret (or its `token_endpoint`).
//!    A protected resource that names other authorization servers only is
//!    refused: a server cannot send the worker's secret elsewhere. The
//!    issuer's metadata (RFC 8414's `/.well-known/oauth-authorization-server`,
//!    then OpenID Connect's `openid-configuration`) must name that issuer.
//! 3. **A token** from its `token_endpoint`: `grant_type=client_credentials`
//!    with the `resource` parameter — the MCP server's canonical URI
//!    (RFC 8707) — and the scope (the client's, else the `401`'s
//!    `scope`, else the resource's `scopes_supported`), the client
//!    authenticated with HTTP Basic (or in the body, when the server only
//!    takes `client_secret_post`).
//!
//! Tokens are kept per tenant (a tenant may have a client of its own)
//! until a little before they expire; a token the server refuses with
//! `401` is dropped, unless another took its place already. Every URL is
//! https, or http to loopback when the MCP server itself is on loopback.
//! Neither the secret nor a token is ever in an error or a log line:
//! errors name the client id and what the authorization server said.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use crate::config::{OAuthClient, OAuthSpec, is_loopback};

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
    /// The `resource` parameter: the MCP server's canonical URI.
    pub resource: String,
    /// The configured authorization server's token endpoint.
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
    /// The server's URL parsed (`None`: unparsable, every request fails).
    server: Option<url::Url>,
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
            server: url::Url::parse(url).ok(),
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

    /// Forgets `tenant`'s token `refused` (the server refused it), and
    /// what was discovered (it may have moved) — unless the token kept is
    /// another already (a concurrent refusal got a new one, which stays).
    pub async fn refused(&self, tenant: Option<&str>, refused: &str) {
        let key = tenant.map(str::to_string);
        let dropped = {
            let mut tokens = self.tokens_lock();
            let current = tokens.get(&key).is_some_and(|t| t.value == refused);
            if current {
                tokens.remove(&key);
            }
            current
        };
        if dropped {
            *self.discovered.lock().await = None;
        }
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
        let server = self.server()?;
        let (resource, challenge_scope) = self.resource_metadata(server).await?;
        let (token_endpoint, secret_in_body) = match &self.spec.issuer {
            Some(issuer) => {
                let named = &resource.authorization_servers;
                if !named.is_empty() && !named.iter().any(|a| same_issuer(a, issuer)) {
                    return Err(OAuthError(format!(
                        "the protected resource names authorization server {}, not the configured issuer {issuer}: the client's secret goes to the configured issuer only",
                        named.join(", ")
                    )));
                }
                let metadata = self.server_metadata(issuer).await?;
                let endpoint = match (&self.spec.token_endpoint, metadata.token_endpoint) {
                    (Some(configured), _) => configured.clone(),
                    (None, Some(endpoint)) => endpoint,
                    (None, None) => {
                        return Err(OAuthError(format!(
                            "authorization server {issuer} has no token_endpoint"
                        )));
                    }
                };
                let methods = &metadata.token_endpoint_auth_methods_supported;
                let in_body = !methods.is_empty()
                    && !methods.iter().any(|m| m == "client_secret_basic")
                    && methods.iter().any(|m| m == "client_secret_post");
                (endpoint, in_body)
            }
            None => match &self.spec.token_endpoint {
                Some(endpoint) => (endpoint.clone(), false),
                None => return Err(OAuthError("no issuer or token_endpoint configured".into())),
            },
        };
        self.allowed(&token_endpoint)?;
        let d = Discovered {
            resource: canonical(server),
            token_endpoint,
            scopes: challenge_scope.or_else(|| {
                (!resource.scopes_supported.is_empty()).then(|| resource.scopes_supported.join(" "))
            }),
            secret_in_body,
        };
        *discovered = Some(d.clone());
        Ok(d)
    }

    /// The MCP server's URL, parsed.
    fn server(&self) -> Result<&url::Url, OAuthError> {
        self.server
            .as_ref()
            .ok_or_else(|| OAuthError(format!("{:?} is not a URL", self.url)))
    }

    /// https, or http to loopback when the MCP server is on loopback too.
    fn allowed(&self, url: &str) -> Result<(), OAuthError> {
        allowed(url, self.server.as_ref().is_some_and(is_loopback))
    }

    /// RFC 9728: where the `401` says (on the server's own origin), else
    /// the well-known places; and the `401`'s `scope`, if any.
    async fn resource_metadata(
        &self,
        server: &url::Url,
    ) -> Result<(ResourceMetadata, Option<String>), OAuthError> {
        let probe = self
            .http
            .post(&self.url)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(r#"{"jsonrpc":"2.0","id":0,"method":"ping"}"#)
            .send()
            .await
            .map_err(|e| OAuthError(format!("the MCP server cannot be reached: {e}")))?;
        let challenge = (probe.status() == reqwest::StatusCode::UNAUTHORIZED)
            .then(|| {
                probe
                    .headers()
                    .get_all(reqwest::header::WWW_AUTHENTICATE)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .find_map(bearer_params)
            })
            .flatten()
            .unwrap_or_default();
        let mut candidates = Vec::new();
        if let Some(url) = challenge.get("resource_metadata") {
            if same_origin(url, server) {
                candidates.push(url.clone());
            } else {
                tracing::warn!(url = %self.url, metadata = %url, "the MCP server names protected-resource metadata on another origin; using its own well-known place");
            }
        }
        let origin = server.origin().ascii_serialization();
        let path = server.path().trim_end_matches('/');
        if !path.is_empty() {
            candidates.push(format!(
                "{origin}/.well-known/oauth-protected-resource{path}"
            ));
        }
        candidates.push(format!("{origin}/.well-known/oauth-protected-resource"));
        let metadata: ResourceMetadata = self.first_json(&candidates).await?;
        if !resource_covers(&metadata.resource, server) {
            return Err(OAuthError(format!(
                "the protected-resource metadata is for {:?}, not {}",
                metadata.resource,
                canonical(server)
            )));
        }
        Ok((metadata, challenge.get("scope").cloned()))
    }

    /// RFC 8414, then OpenID Connect discovery, for `issuer`.
    async fn server_metadata(&self, issuer: &str) -> Result<ServerMetadata, OAuthError> {
        let parsed = url::Url::parse(issuer).map_err(|e| OAuthError(format!("{issuer:?}: {e}")))?;
        let (origin, path) = (parsed.origin().ascii_serialization(), parsed.path());
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
        if !same_issuer(&metadata.issuer, issuer) {
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
            self.allowed(url)?;
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

/// The parameters of a `WWW-Authenticate` value's `Bearer` challenge
/// (RFC 9110 §11.2: `key=token` or `key="quoted string"`, commas inside
/// quotes kept), by lower-cased key; `None` without a Bearer challenge.
fn bearer_params(header: &str) -> Option<BTreeMap<String, String>> {
    let mut rest = header.trim_start();
    // The challenges before Bearer's (another scheme's) are skipped.
    loop {
        let (scheme, after) = rest.split_at(rest.find([' ', ',']).unwrap_or(rest.len()));
        if scheme.eq_ignore_ascii_case("bearer") {
            rest = after;
            break;
        }
        let next = rest.to_ascii_lowercase().find("bearer")?;
        rest = &rest[next..];
    }
    let mut params = BTreeMap::new();
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        let Some(eq) = rest.find('=') else { break };
        let key = rest[..eq].trim();
        if key.is_empty() || key.contains([' ', ',']) {
            break; // the next challenge
        }
        rest = rest[eq + 1..].trim_start();
        let value = if let Some(quoted) = rest.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            rest = &quoted[end.min(quoted.len())..];
            value
        } else {
            let end = rest.find([',', ' ']).unwrap_or(rest.len());
            let value = rest[..end].to_string();
            rest = &rest[end..];
            value
        };
        params.insert(key.to_ascii_lowercase(), value);
    }
    Some(params)
}

/// The server's canonical URI (the MCP authorization specification's, for
/// RFC 8707's `resource`): scheme and host lower-case, no fragment, no
/// trailing slash.
pub fn canonical(server: &url::Url) -> String {
    let mut url = server.clone();
    url.set_fragment(None);
    let text = url.to_string();
    match text.split_once('?') {
        Some((base, query)) => format!("{}?{query}", base.trim_end_matches('/')),
        None => text.trim_end_matches('/').to_string(),
    }
}

/// Whether protected-resource metadata for `resource` may speak for
/// `server`: same scheme, host and port, and its path the server's or a
/// parent of it on whole segments (`/mcp` covers `/mcp/x`, never
/// `/mcpx`).
pub fn resource_covers(resource: &str, server: &url::Url) -> bool {
    let Ok(resource) = url::Url::parse(resource) else {
        return false;
    };
    let segments = |u: &url::Url| -> Vec<String> {
        u.path()
            .split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    let (theirs, ours) = (segments(&resource), segments(server));
    resource.scheme() == server.scheme()
        && resource.host() == server.host()
        && resource.port_or_known_default() == server.port_or_known_default()
        && resource.fragment().is_none()
        && theirs.len() <= ours.len()
        && theirs.iter().zip(&ours).all(|(a, b)| a == b)
}

/// Whether `url` is on `server`'s origin (scheme, host and port).
fn same_origin(url: &str, server: &url::Url) -> bool {
    url::Url::parse(url).is_ok_and(|u| u.origin() == server.origin())
}

/// Whether two issuer identifiers are the same (a trailing slash aside).
fn same_issuer(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// https; http to loopback only when `loopback_ok` (the MCP server is on
/// loopback itself).
fn allowed(url: &str, loopback_ok: bool) -> Result<(), OAuthError> {
    let parsed = url::Url::parse(url).map_err(|e| OAuthError(format!("{url:?}: {e}")))?;
    match parsed.scheme() {
        "https" => Ok(()),
        "http" if loopback_ok && is_loopback(&parsed) => Ok(()),
        _ => Err(OAuthError(format!(
            "{url} is not https (plain http goes to loopback only, for a loopback MCP server)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_challenge_is_read_from_www_authenticate() {
        let p = bearer_params(
            r#"Bearer error="invalid_token", scope="files:read, files:write", resource_metadata="http://127.0.0.1:9/.well-known/oauth-protected-resource""#,
        )
        .unwrap();
        assert_eq!(
            p["resource_metadata"],
            "http://127.0.0.1:9/.well-known/oauth-protected-resource"
        );
        // A comma inside quotes is the value's.
        assert_eq!(p["scope"], "files:read, files:write");
        assert_eq!(p["error"], "invalid_token");
        let p = bearer_params(r#"Basic realm="a, b", Bearer realm=x, scope="s \"q\"""#).unwrap();
        assert_eq!(p["realm"], "x");
        assert_eq!(p["scope"], "s \"q\"");
        assert_eq!(bearer_params("Basic realm=\"x\""), None);
        assert!(
            !bearer_params("Bearer realm=\"x\"")
                .unwrap()
                .contains_key("resource_metadata")
        );
    }

    #[test]
    fn a_resource_covers_its_server_on_whole_segments_of_the_same_origin() {
        let server = url::Url::parse("https://api.example.com/mcp").unwrap();
        for ok in [
            "https://api.example.com",
            "https://api.example.com/",
            "https://api.example.com/mcp",
            "https://API.example.com:443/mcp/",
        ] {
            assert!(resource_covers(ok, &server), "{ok}");
        }
        for bad in [
            "https://api.example.com.evil.io/mcp",
            "https://api.example.com.evil.io",
            "http://api.example.com/mcp",
            "https://api.example.com:8443/mcp",
            "https://api.example.com/mc",
            "https://api.example.com/mcpx",
            "https://api.example.com/mcp/deeper",
            "https://evil.io/mcp",
            "not a url",
        ] {
            assert!(!resource_covers(bad, &server), "{bad}");
        }
        // The resource sent is the server's canonical URI.
        assert_eq!(canonical(&server), "https://api.example.com/mcp");
        let odd = url::Url::parse("HTTPS://Api.Example.com/mcp/#frag").unwrap();
        assert_eq!(canonical(&odd), "https://api.example.com/mcp");
        let root = url::Url::parse("https://api.example.com").unwrap();
        assert_eq!(canonical(&root), "https://api.example.com");
    }

    #[test]
    fn plain_http_goes_to_loopback_only_for_a_loopback_server() {
        assert!(allowed("https://as.example.com/token", false).is_ok());
        assert!(allowed("http://127.0.0.1:8080/token", true).is_ok());
        assert!(allowed("http://localhost/token", true).is_ok());
        // A remote MCP server cannot point the worker at loopback http.
        assert!(allowed("http://127.0.0.1:8080/token", false).is_err());
        assert!(allowed("http://localhost/token", false).is_err());
        assert!(allowed("http://as.example.com/token", true).is_err());
        assert!(allowed("ftp://127.0.0.1/token", true).is_err());
        // Metadata named by the server's 401 is read on its own origin only.
        let server = url::Url::parse("https://api.example.com/mcp").unwrap();
        assert!(same_origin(
            "https://api.example.com/.well-known/oauth-protected-resource",
            &server
        ));
        for other in [
            "https://169.254.169.254/latest/meta-data",
            "http://api.example.com/.well-known/oauth-protected-resource",
            "https://api.example.com:444/x",
            "https://api.example.com.evil.io/x",
        ] {
            assert!(!same_origin(other, &server), "{other}");
        }
    }

    #[tokio::test]
    async fn a_refused_token_is_dropped_only_while_it_is_the_one_kept() {
        let spec: OAuthSpec = toml::from_str(
            "issuer = \"https://as.example.com\"\nclient_id = \"c\"\nclient_secret_env = \"S\"",
        )
        .unwrap();
        let oauth = OAuth::new(spec, "https://api.example.com/mcp", Duration::from_secs(1));
        let keep = |value: &str| {
            oauth.tokens_lock().insert(
                Some("acme".into()),
                Token {
                    value: value.into(),
                    until: Instant::now() + Duration::from_secs(60),
                },
            );
        };
        let kept = || {
            oauth
                .tokens_lock()
                .get(&Some("acme".into()))
                .map(|t| t.value.clone())
        };
        // Two calls refused with the first token: the first refusal got a
        // new one; the second refusal, of the old token, leaves it.
        keep("new");
        oauth.refused(Some("acme"), "old").await;
        assert_eq!(kept().as_deref(), Some("new"));
        oauth.refused(Some("acme"), "new").await;
        assert_eq!(kept(), None);
    }

    #[test]
    fn a_refusal_never_carries_the_secret() {
        assert_eq!(
            scrub("bad secret s3cr3t given".into(), "s3cr3t"),
            "bad secret [redacted] given"
        );
    }
}
