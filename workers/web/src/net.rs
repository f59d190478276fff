//! Outbound HTTP with the SSRF policy enforced at every hop: the URL is
//! checked, its host resolved **once** by the [`Resolve`] in use, every
//! address checked, and the connection made by the [`Dial`] in use to a
//! checked address — the HTTP client never resolves anything itself, so
//! there is no second resolution for a rebinding name to answer
//! differently. Redirects are followed here, each one checked like the
//! first URL. Bodies are read under a byte cap and one deadline for the
//! whole exchange, so a page that trickles cannot hold a call.
//!
//! HTTP/1.1 over hyper's connection API, one connection per request (no
//! pool that could outlive a check); TLS by rustls with the system's roots
//! and an optional extra CA file.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use url::Url;

use crate::policy::{Blocked, NetPolicy, Target, TargetHost};

/// Resolves a host name to addresses. The system's resolver in a worker;
/// a stub in tests, so a test never depends on (or sends) DNS.
pub trait Resolve: Send + Sync {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> BoxFuture<'a, io::Result<Vec<IpAddr>>>;
}

/// The system's resolver (`getaddrinfo`, through tokio).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> BoxFuture<'a, io::Result<Vec<IpAddr>>> {
        async move {
            let addrs = tokio::net::lookup_host((host, port)).await?;
            let mut ips: Vec<IpAddr> = Vec::new();
            for a in addrs {
                if !ips.contains(&a.ip()) {
                    ips.push(a.ip());
                }
            }
            Ok(ips)
        }
        .boxed()
    }
}

/// Opens a TCP connection to an address that passed the policy. A real
/// socket in a worker; in tests, a dialer that records instead, so a
/// regression cannot reach anything.
pub trait Dial: Send + Sync {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<TcpStream>>;
}

/// Dials with a real socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpDialer;

impl Dial for TcpDialer {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<TcpStream>> {
        TcpStream::connect(addr).boxed()
    }
}

/// Why a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// The policy refused a URL or an address (the first, or a redirect's).
    #[error("{0}")]
    Blocked(String),
    /// The exchange did not finish in time.
    #[error("{0}")]
    Timeout(String),
    /// The body is larger than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// The response's content type is not one the caller reads.
    #[error("{0}")]
    Unsupported(String),
    /// Anything else: DNS, connection, TLS, protocol, redirects.
    #[error("{message}")]
    Failed { message: String, retryable: bool },
}

impl From<Blocked> for FetchError {
    fn from(Blocked(reason): Blocked) -> Self {
        FetchError::Blocked(reason)
    }
}

fn failed(message: impl Into<String>, retryable: bool) -> FetchError {
    FetchError::Failed {
        message: message.into(),
        retryable,
    }
}

/// The limits of one fetch.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The most body bytes read.
    pub max_bytes: usize,
    /// The whole exchange, redirects included.
    pub timeout: Duration,
    pub max_redirects: u32,
    /// Media types (`text/html`, …) a successful response may have; any
    /// when empty. Checked before the body is read.
    pub content_types: Vec<String>,
}

/// One request: the URL and extra headers (which may hold a secret: they
/// are never logged or put in a message).
#[derive(Debug, Clone)]
pub struct Request {
    pub url: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Request {
    pub fn get(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            headers: Vec::new(),
        }
    }

    #[must_use]
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }
}

/// A response that was not a redirect.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// The URL that answered (after redirects).
    pub url: Url,
    pub status: u16,
    /// The media type, lower case, without parameters.
    pub content_type: Option<String>,
    /// The `charset` parameter, lower case.
    pub charset: Option<String>,
    /// `Retry-After` in seconds, when the server sent one.
    pub retry_after: Option<u64>,
    pub body: Vec<u8>,
}

impl Fetched {
    /// The body as text (UTF-8, invalid sequences replaced).
    #[must_use]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// The fetcher: the policy, the resolver, the dialer and TLS.
#[derive(Clone)]
pub struct Fetcher {
    policy: Arc<NetPolicy>,
    resolver: Arc<dyn Resolve>,
    dialer: Arc<dyn Dial>,
    tls: tokio_rustls::TlsConnector,
    user_agent: HeaderValue,
}

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// The TLS client configuration: the system's roots plus `extra_ca` (PEM).
///
/// # Errors
///
/// The extra CA file cannot be read or holds no certificate.
pub fn tls_config(extra_ca: Option<&std::path::Path>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = extra_ca {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("extra CA file {}: {e}", path.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("extra CA file {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "extra CA file {} holds no certificate",
                path.display()
            ));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("extra CA file {}: {e}", path.display()))?;
        }
    }
    if roots.is_empty() {
        tracing::warn!("no trusted root certificates (install ca-certificates): https will fail");
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A connection's stream, plain or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

const REDIRECTS: [u16; 5] = [301, 302, 303, 307, 308];

impl Fetcher {
    /// A fetcher under `policy`.
    ///
    /// # Errors
    ///
    /// A user agent that cannot be a header value.
    pub fn new(
        policy: NetPolicy,
        resolver: Arc<dyn Resolve>,
        dialer: Arc<dyn Dial>,
        tls: rustls::ClientConfig,
        user_agent: &str,
    ) -> Result<Self, String> {
        Ok(Self {
            policy: Arc::new(policy),
            resolver,
            dialer,
            tls: tokio_rustls::TlsConnector::from(Arc::new(tls)),
            user_agent: HeaderValue::from_str(user_agent)
                .map_err(|_| format!("user agent {user_agent:?} is not a valid header value"))?,
        })
    }

    /// The policy in force.
    #[must_use]
    pub fn policy(&self) -> &NetPolicy {
        &self.policy
    }

    /// Fetches `request` (GET), following redirects, within `limits`.
    ///
    /// # Errors
    ///
    /// [`FetchError`]: blocked by policy, timed out, too large, an
    /// unsupported content type, or failed.
    pub async fn fetch(&self, request: &Request, limits: &Limits) -> Result<Fetched, FetchError> {
        match tokio::time::timeout(limits.timeout, self.follow(request, limits)).await {
            Ok(result) => result,
            Err(_) => Err(FetchError::Timeout(format!(
                "the page did not arrive within {:.1} s",
                limits.timeout.as_secs_f64()
            ))),
        }
    }

    async fn follow(&self, request: &Request, limits: &Limits) -> Result<Fetched, FetchError> {
        let mut target = self.policy.check_url(&request.url)?;
        let origin = target.url.origin();
        let bare = Request {
            url: request.url.clone(),
            headers: Vec::new(),
        };
        let mut seen: HashSet<String> = HashSet::new();
        let mut redirects = 0u32;
        loop {
            seen.insert(target.url.as_str().to_owned());
            // The caller's headers (an API key) go only to the origin they
            // were meant for, never along a redirect elsewhere.
            let sent = if target.url.origin() == origin {
                request
            } else {
                &bare
            };
            let response = self.exchange(&target, sent, limits).await?;
            let Exchanged::Redirect(location) = response else {
                let Exchanged::Done(fetched) = response else {
                    unreachable!()
                };
                return Ok(fetched);
            };
            let next = target.url.join(&location).map_err(|e| {
                failed(
                    format!("a redirect to {location:?}, which is not a URL: {e}"),
                    false,
                )
            })?;
            // The redirect is checked like the first URL.
            let next = self.policy.check(&next).map_err(|Blocked(reason)| {
                FetchError::Blocked(format!("redirected to {next}: {reason}"))
            })?;
            if seen.contains(next.url.as_str()) {
                return Err(failed(
                    format!("a redirect loop ({} leads back to itself)", next.url),
                    false,
                ));
            }
            redirects += 1;
            if redirects > limits.max_redirects {
                return Err(failed(
                    format!("more than {} redirects", limits.max_redirects),
                    false,
                ));
            }
            target = next;
        }
    }

    /// The checked addresses of `target`: its literal, or every address
    /// its name resolves to — all of which must pass.
    async fn addresses(&self, target: &Target) -> Result<Vec<IpAddr>, FetchError> {
        let ips = match &target.host {
            TargetHost::Ip(ip) => vec![*ip],
            TargetHost::Name(name) => {
                let ips = self
                    .resolver
                    .resolve(name, target.port)
                    .await
                    .map_err(|e| failed(format!("{name} cannot be resolved: {e}"), true))?;
                if ips.is_empty() {
                    return Err(failed(format!("{name} has no address"), true));
                }
                ips
            }
        };
        if !target.host_allowed {
            for ip in &ips {
                // One bad answer refuses the name: a rebinding attacker
                // mixes a public address with a private one.
                self.policy.check_ip(*ip).map_err(|Blocked(reason)| {
                    let host = match &target.host {
                        TargetHost::Name(name) => format!("{name} resolves to {ip}; "),
                        TargetHost::Ip(_) => String::new(),
                    };
                    FetchError::Blocked(format!("{host}{reason}"))
                })?;
            }
        }
        Ok(ips)
    }

    async fn connect(&self, target: &Target) -> Result<Box<dyn Io>, FetchError> {
        let ips = self.addresses(target).await?;
        let mut last = None;
        for ip in ips {
            match self.dialer.dial(SocketAddr::new(ip, target.port)).await {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    if target.url.scheme() == "https" {
                        let name = match &target.host {
                            TargetHost::Ip(ip) => {
                                rustls::pki_types::ServerName::IpAddress((*ip).into())
                            }
                            TargetHost::Name(name) => rustls::pki_types::ServerName::try_from(
                                name.clone(),
                            )
                            .map_err(|e| {
                                failed(format!("{name} cannot be a TLS server name: {e}"), false)
                            })?,
                        };
                        let tls = self.tls.connect(name, stream).await.map_err(|e| {
                            failed(
                                format!(
                                    "TLS with {} failed: {e}",
                                    target.url.host_str().unwrap_or("the host")
                                ),
                                false,
                            )
                        })?;
                        return Ok(Box::new(tls));
                    }
                    return Ok(Box::new(stream));
                }
                Err(e) => last = Some((ip, e)),
            }
        }
        let (ip, e) = last.expect("at least one address was tried");
        Err(failed(
            format!(
                "cannot connect to {} ({ip}:{}): {e}",
                target.url.host_str().unwrap_or("the host"),
                target.port
            ),
            true,
        ))
    }

    async fn exchange(
        &self,
        target: &Target,
        request: &Request,
        limits: &Limits,
    ) -> Result<Exchanged, FetchError> {
        let io = self.connect(target).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io))
                .await
                .map_err(|e| failed(format!("HTTP handshake failed: {e}"), true))?;
        // The connection is driven beside the request and stopped with it.
        let driver = tokio::spawn(connection);
        let _stop = AbortOnDrop(driver);
        let url = &target.url;
        let http_request = self.http_request(url, request)?;
        let response = sender.send_request(http_request).await.map_err(|e| {
            failed(
                format!(
                    "{} did not answer: {e}",
                    url.host_str().unwrap_or("the host")
                ),
                true,
            )
        })?;
        let status = response.status().as_u16();
        if REDIRECTS.contains(&status) {
            let location = response
                .headers()
                .get(hyper::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| failed(format!("a {status} redirect without a Location"), false))?;
            return Ok(Exchanged::Redirect(location.to_owned()));
        }
        let mut fetched = checked_head(url, status, response.headers(), limits)?;
        fetched.body = read_body(url, response.into_body(), limits).await?;
        Ok(Exchanged::Done(fetched))
    }

    /// The GET for `url`: our headers (no compression, no keep-alive), then
    /// the request's own.
    fn http_request(
        &self,
        url: &Url,
        request: &Request,
    ) -> Result<hyper::Request<Empty<Bytes>>, FetchError> {
        let host = match url.port() {
            Some(port) => format!("{}:{port}", url.host_str().unwrap_or_default()),
            None => url.host_str().unwrap_or_default().to_owned(),
        };
        let path = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        };
        let mut builder = hyper::Request::get(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::USER_AGENT, self.user_agent.clone())
            .header(hyper::header::ACCEPT_ENCODING, "identity")
            .header(hyper::header::CONNECTION, "close");
        for (name, value) in &request.headers {
            builder = builder.header(name, value);
        }
        builder
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(format!("the request cannot be built: {e}"), false))
    }
}

/// A response that is not a redirect, from its headers: refused before its
/// body is read when of a type not read or declared too large; otherwise
/// the [`Fetched`] its body goes into.
fn checked_head(
    url: &Url,
    status: u16,
    headers: &hyper::HeaderMap,
    limits: &Limits,
) -> Result<Fetched, FetchError> {
    let (content_type, charset) = headers
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map_or((None, None), media_type);
    let retry_after = headers
        .get(hyper::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    if (200..300).contains(&status) && !limits.content_types.is_empty() {
        let allowed = content_type
            .as_deref()
            .is_some_and(|t| limits.content_types.iter().any(|a| a == t));
        if !allowed {
            return Err(FetchError::Unsupported(format!(
                "{url} is {}, not one of the types read ({})",
                content_type.as_deref().unwrap_or("of no declared type"),
                limits.content_types.join(", ")
            )));
        }
    }
    if let Some(length) = headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && length > limits.max_bytes as u64
    {
        return Err(too_large(url, limits));
    }
    Ok(Fetched {
        url: url.clone(),
        status,
        content_type,
        charset,
        retry_after,
        body: Vec::new(),
    })
}

/// Reads a body under the byte cap (a server may send more than it
/// declared, or declare nothing).
async fn read_body(
    url: &Url,
    mut body: hyper::body::Incoming,
    limits: &Limits,
) -> Result<Vec<u8>, FetchError> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| failed(format!("reading {url} failed: {e}"), true))?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > limits.max_bytes {
                return Err(too_large(url, limits));
            }
            bytes.extend_from_slice(&data);
        }
    }
    Ok(bytes)
}

fn too_large(url: &Url, limits: &Limits) -> FetchError {
    FetchError::TooLarge(format!(
        "{url} is larger than the {} byte limit",
        limits.max_bytes
    ))
}

enum Exchanged {
    Redirect(String),
    Done(Fetched),
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `text/html; charset=UTF-8` → (`text/html`, `utf-8`).
fn media_type(value: &str) -> (Option<String>, Option<String>) {
    let mut parts = value.split(';');
    let media = parts
        .next()
        .map(|m| m.trim().to_ascii_lowercase())
        .filter(|m| !m.is_empty());
    let charset = parts.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        (k.trim().eq_ignore_ascii_case("charset"))
            .then(|| v.trim().trim_matches('"').to_ascii_lowercase())
    });
    (media, charset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_types_are_parsed() {
        assert_eq!(
            media_type("text/HTML; charset=\"UTF-8\""),
            (Some("text/html".into()), Some("utf-8".into()))
        );
        assert_eq!(
            media_type("application/json"),
            (Some("application/json".into()), None)
        );
        assert_eq!(media_type(""), (None, None));
    }
}
