//! Webhook delivery: one signed HTTPS POST per routed event.
//!
//! The body is the chat event exactly as published on NATS. Headers:
//! `Content-Type: application/json`, `Toolfleet-Tenant`,
//! `Toolfleet-Event-Id: <invocationId>:<seq>` (the same on every retry)
//! and `Toolfleet-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
//! "<t>.<tenant>.<body>">` with the sink's secret (ring's HMAC, the crypto
//! already in the process for TLS). A receiver recomputes the HMAC over
//! the timestamp, its own tenant and the raw body, compares in constant
//! time, and refuses a timestamp too far from its clock (a replay).
//!
//! The client resolves names itself ([`CheckedResolver`]): every address
//! of the host must pass the SSRF address gate, or nothing is connected
//! to. No proxy (it would resolve names for us), no redirect followed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use toolfleet_protocol::headers;
use toolfleet_service::netpolicy::{Blocked, NetPolicy};

use super::SinkSettings;

/// Why one delivery attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    /// For the dead letter: `ssrf_blocked`, `sink_secret_missing`,
    /// `sink_http_<status>`, `sink_unreachable`, `sink_timeout`,
    /// `relay_failed`.
    pub code: String,
    /// For people: never a secret, never a URL's path or query.
    pub message: String,
    /// Worth another attempt (a 5xx, 408, 429, a connection or timeout).
    pub retryable: bool,
    /// Refused by policy rather than failed (counted `refused`).
    pub refused: bool,
}

impl DeliveryError {
    pub(crate) fn refused(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: false,
            refused: true,
        }
    }

    pub(crate) fn failed(
        code: impl Into<String>,
        message: impl Into<String>,
        retryable: bool,
    ) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable,
            refused: false,
        }
    }
}

/// The `Toolfleet-Signature` value for `body` of an invocation of
/// `tenant` at `timestamp` (unix seconds): HMAC-SHA256 over
/// `<timestamp>.<tenant>.<body>`. The tenant is signed (and sent in
/// `Toolfleet-Tenant`) so that a delivery signed for one tenant's webhook
/// cannot be replayed to another's receiver as theirs: job-named webhooks
/// of every tenant share one secret.
pub fn signature(secret: &[u8], timestamp: u64, tenant: &str, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(timestamp.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(tenant.as_bytes());
    ctx.update(b".");
    ctx.update(body);
    format!("t={timestamp},v1={}", hex(ctx.sign().as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// Resolves a webhook's host and refuses it when any of its addresses
/// fails the address gate (a name that resolves to a private address as
/// well as a public one is refused whole: DNS rebinding).
#[derive(Debug, Clone)]
pub struct CheckedResolver {
    policy: Arc<NetPolicy>,
}

impl CheckedResolver {
    pub fn new(policy: NetPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }

    /// The addresses of `host`, every one checked.
    pub async fn resolve_checked(
        policy: &NetPolicy,
        host: &str,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
            .await
            .map_err(|e| ResolveError::Lookup(format!("cannot resolve {host}: {e}")))?
            .collect();
        if addrs.is_empty() {
            return Err(ResolveError::Lookup(format!("{host} has no address")));
        }
        if !policy.allow_hosts.contains(&host) {
            for a in &addrs {
                policy.check_ip(a.ip()).map_err(ResolveError::Blocked)?;
            }
        }
        Ok(addrs)
    }
}

/// A name that could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    #[error("{0}")]
    Blocked(Blocked),
    #[error("{0}")]
    Lookup(String),
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = Self::resolve_checked(&policy, &host).await?;
            let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

/// The webhook client of one orchestrator.
#[derive(Clone)]
pub struct Webhooks {
    /// For configured sinks: the operator's policy.
    http: reqwest::Client,
    /// For webhooks chat jobs name: the strict policy, unless the
    /// operator extends the exceptions to them.
    jobs: reqwest::Client,
    settings: SinkSettings,
}

impl Webhooks {
    pub fn new(settings: &SinkSettings) -> Result<Self, String> {
        toolfleet_llm::install_crypto_provider();
        let client = |policy: NetPolicy| {
            reqwest::Client::builder()
                .dns_resolver(CheckedResolver::new(policy))
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .timeout(settings.request_timeout)
                .connect_timeout(settings.request_timeout.min(Duration::from_secs(5)))
                .user_agent(concat!("toolfleet-sink/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|e| format!("the webhook client cannot be built: {e}"))
        };
        Ok(Self {
            http: client(settings.policy_for(false).0)?,
            jobs: client(settings.policy_for(true).0)?,
            settings: settings.clone(),
        })
    }

    /// POSTs `body` (an event of an invocation of `tenant`) to `url`,
    /// signed with the secret in `secret_env`; `from_job` when a chat job
    /// named the webhook.
    // Each argument is one fact of the delivery, read once; a struct
    // would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub async fn post(
        &self,
        url: &str,
        from_job: bool,
        secret: Option<String>,
        secret_env: &str,
        tenant: &str,
        event_id: &str,
        body: bytes::Bytes,
    ) -> Result<(), DeliveryError> {
        // Gate 1 again: this orchestrator's policy may be stricter than
        // the one that took the job, and a literal address is never
        // resolved (so never seen by the resolver).
        let url = self
            .settings
            .check_webhook_from(url, from_job)
            .map_err(|e| DeliveryError::refused("ssrf_blocked", e))?;
        let host = url.host_str().unwrap_or("?").to_owned();
        let Some(secret) = secret.filter(|s| !s.is_empty()) else {
            return Err(DeliveryError::refused(
                "sink_secret_missing",
                format!(
                    "the webhook's secret ({secret_env}) is not set in the orchestrator's \
                     environment: not sent unsigned"
                ),
            ));
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let signed = signature(secret.as_bytes(), now, tenant, &body);
        let http = if from_job { &self.jobs } else { &self.http };
        let sent = http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(headers::TENANT, tenant)
            .header(headers::EVENT_ID, event_id)
            .header(headers::SIGNATURE, signed)
            .body(body)
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => Ok(()),
            Ok(response) => {
                let status = response.status();
                let code = status.as_u16();
                let retryable = status.is_server_error() || code == 408 || code == 429;
                Err(DeliveryError::failed(
                    format!("sink_http_{code}"),
                    format!("the webhook at {host} answered {status}"),
                    retryable,
                ))
            }
            Err(e) => Err(classify(&e, &host)),
        }
    }
}

/// A transport error: a refused address, a timeout, or unreachable.
fn classify(e: &reqwest::Error, host: &str) -> DeliveryError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(ResolveError::Blocked(b)) = err.downcast_ref::<ResolveError>() {
            return DeliveryError::refused(
                "ssrf_blocked",
                format!("the webhook host {host} is refused: {b}"),
            );
        }
        source = err.source();
    }
    if e.is_timeout() {
        return DeliveryError::failed(
            "sink_timeout",
            format!("the webhook at {host} did not answer in time"),
            true,
        );
    }
    // The error's own text names the URL: only its innermost cause.
    let mut cause = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        cause = err.to_string();
        source = err.source();
    }
    DeliveryError::failed(
        "sink_unreachable",
        format!("the webhook at {host} cannot be reached: {cause}"),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_the_tenant_and_the_body() {
        // Computed independently with Python's hmac module:
        // hmac.new(b"Jefe", b"1.acme.hat do ya want for nothing?", sha256).
        let sig = signature(b"Jefe", 1, "acme", b"hat do ya want for nothing?");
        assert_eq!(
            sig,
            "t=1,v1=287d9a8b0f48410c3f833ec255510c56cdef3d4966f85f4c4b0d3ad1bb30d938"
        );
        // Another tenant, another signature.
        assert_ne!(
            signature(b"Jefe", 1, "globex", b"hat do ya want for nothing?"),
            sig
        );
    }

    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
    }

    #[tokio::test]
    async fn a_name_resolving_to_a_private_address_is_refused_unless_allowed() {
        let strict = super::super::sink_policy(Vec::new(), Vec::new());
        match CheckedResolver::resolve_checked(&strict, "localhost").await {
            Err(ResolveError::Blocked(b)) => assert!(b.0.contains("loopback"), "{b}"),
            other => panic!("{other:?}"),
        }
        let by_cidr = super::super::sink_policy(
            Vec::new(),
            vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()],
        );
        assert!(
            CheckedResolver::resolve_checked(&by_cidr, "localhost")
                .await
                .is_ok()
        );
        let by_host = super::super::sink_policy(vec!["localhost".into()], Vec::new());
        assert!(
            CheckedResolver::resolve_checked(&by_host, "LOCALHOST.")
                .await
                .is_ok()
        );
    }
}
