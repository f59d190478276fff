//! Webhook delivery: one signed HTTPS POST per routed event, signed as
//! [Standard Webhooks](https://www.standardwebhooks.com/) says, so that
//! any of its verifying libraries (or OpenAI's and Svix's) checks it.
//!
//! The body is the chat event exactly as published on NATS. Headers:
//! `Content-Type: application/json`, `Toolfleet-Tenant` (a convenience,
//! not signed), and Standard Webhooks' three:
//!
//! - `webhook-id`: [`message_id`], `<tenant>:<invocationId>:<seq>:<16 hex
//!   of the body's SHA-256>`. The same for every retry of one event (it is
//!   the receiver's idempotency key), and another for another event: a
//!   crashed run's rerun numbers its events from 0 again, and an event
//!   of the rerun that differs from the first run's at that `seq` gets
//!   its own id instead of being dropped as a duplicate. It holds no `.`
//!   (tenants and invocation ids are `[A-Za-z0-9_-]`), as the spec asks of
//!   an id that is partly the client's. Its tenant is signed: job-named
//!   webhooks of every tenant share one secret, and a receiver checks the
//!   id's tenant is its own.
//! - `webhook-timestamp`: the attempt's unix time in seconds.
//! - `webhook-signature`: [`signature`], `v1,<base64 HMAC-SHA256 of
//!   "<id>.<timestamp>.<body>">`, one per key of the sink's secret,
//!   space-separated (a rotation signs with the new and the old key).
//!
//! The secret ([`SigningKeys`]) is `whsec_` then base64 of 24 to 64
//! random bytes (the prefix may be left out, as the libraries allow);
//! several, separated by whitespace, for a rotation. It is read from the
//! environment at each delivery and never logged: an error names its
//! variable and what is wrong, never the value. HMAC is ring's, the
//! crypto already in the process for TLS.
//!
//! The client resolves names itself ([`CheckedResolver`]): every address
//! of the host must pass the SSRF address gate, or nothing is connected
//! to. No proxy (it would resolve names for us), no redirect followed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use toolfleet_protocol::headers;
use toolfleet_service::netpolicy::{Blocked, NetPolicy};

use super::SinkSettings;

/// Why one delivery attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    /// For the dead letter: `ssrf_blocked`, `sink_secret_missing`,
    /// `sink_secret_invalid`, `sink_http_<status>`, `sink_unreachable`,
    /// `sink_timeout`, `relay_failed`.
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

/// The prefix Standard Webhooks gives a symmetric secret.
pub const SECRET_PREFIX: &str = "whsec_";

/// The shortest and longest key Standard Webhooks allows, in bytes
/// (192 and 512 bits).
const KEY_BYTES: std::ops::RangeInclusive<usize> = 24..=64;

/// Standard base64, with or without its padding: what the reference
/// libraries accept in a `whsec_` secret.
const SECRET_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// The HMAC keys of one sink's secret, the current one first. Its `Debug`
/// shows how many, never a key.
pub struct SigningKeys(Vec<ring::hmac::Key>);

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKeys({} keys)", self.0.len())
    }
}

impl SigningKeys {
    /// Reads a secret: one or more `whsec_<base64>` (the prefix optional),
    /// separated by whitespace. The error says what is wrong and never
    /// holds the secret.
    pub fn parse(secret: &str) -> Result<Self, String> {
        let mut keys = Vec::new();
        for (n, part) in secret.split_whitespace().enumerate() {
            let which = n + 1;
            let encoded = part.strip_prefix(SECRET_PREFIX).unwrap_or(part);
            let bytes = SECRET_BASE64.decode(encoded).map_err(|_| {
                format!("its key {which} is not {SECRET_PREFIX} followed by standard base64")
            })?;
            if !KEY_BYTES.contains(&bytes.len()) {
                return Err(format!(
                    "its key {which} is {} bytes; Standard Webhooks keys are {} to {} random bytes",
                    bytes.len(),
                    KEY_BYTES.start(),
                    KEY_BYTES.end()
                ));
            }
            keys.push(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes));
        }
        if keys.is_empty() {
            return Err("it is empty".into());
        }
        Ok(Self(keys))
    }
}

/// The `webhook-id` of an event of an invocation of `tenant`: `event_id`
/// (`<invocationId>:<seq>`) after the tenant, and the first 8 bytes of the
/// body's SHA-256 in hex (see the module's documentation).
pub fn message_id(tenant: &str, event_id: &str, body: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, body);
    format!("{tenant}:{event_id}:{}", hex(&digest.as_ref()[..8]))
}

/// The `webhook-signature` value for `body` sent as message `id` at
/// `timestamp` (unix seconds): `v1,<base64 HMAC-SHA256 of
/// "<id>.<timestamp>.<body>">` for each key, separated by spaces.
pub fn signature(keys: &SigningKeys, id: &str, timestamp: u64, body: &[u8]) -> String {
    let signed = |key: &ring::hmac::Key| {
        let mut ctx = ring::hmac::Context::with_key(key);
        ctx.update(id.as_bytes());
        ctx.update(b".");
        ctx.update(timestamp.to_string().as_bytes());
        ctx.update(b".");
        ctx.update(body);
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(ctx.sign())
        )
    };
    keys.0.iter().map(signed).collect::<Vec<_>>().join(" ")
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

    /// POSTs `body` (an event of an invocation of `tenant`, `event_id`
    /// `<invocationId>:<seq>`) to `url`, signed with the secret in
    /// `secret_env`; `from_job` when a chat job named the webhook.
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
        let keys = signing_keys(secret, secret_env)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let http = if from_job { &self.jobs } else { &self.http };
        let sent = signed_request(http, url, &keys, tenant, event_id, now, body)
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

/// The keys of a webhook's secret, or why it cannot be sent (never
/// unsigned): no secret, or one that is not a Standard Webhooks secret.
fn signing_keys(secret: Option<String>, secret_env: &str) -> Result<SigningKeys, DeliveryError> {
    let Some(secret) = secret.filter(|s| !s.trim().is_empty()) else {
        return Err(DeliveryError::refused(
            "sink_secret_missing",
            format!(
                "the webhook's secret ({secret_env}) is not set in the orchestrator's \
                 environment: not sent unsigned"
            ),
        ));
    };
    SigningKeys::parse(&secret).map_err(|why| {
        DeliveryError::refused(
            "sink_secret_invalid",
            format!(
                "the webhook's secret ({secret_env}) is not a Standard Webhooks secret \
                 ({SECRET_PREFIX}<base64>): {why}; not sent unsigned"
            ),
        )
    })
}

/// The POST of `body` with its headers, signed at `timestamp`.
fn signed_request(
    http: &reqwest::Client,
    url: url::Url,
    keys: &SigningKeys,
    tenant: &str,
    event_id: &str,
    timestamp: u64,
    body: bytes::Bytes,
) -> reqwest::RequestBuilder {
    let id = message_id(tenant, event_id, &body);
    let signed = signature(keys, &id, timestamp, &body);
    http.post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(headers::TENANT, tenant)
        .header(headers::WEBHOOK_ID, id)
        .header(headers::WEBHOOK_TIMESTAMP, timestamp.to_string())
        .header(headers::WEBHOOK_SIGNATURE, signed)
        .body(body)
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

    /// The Standard Webhooks reference libraries' own vector (their
    /// `test_sign_function`: Python, JavaScript, Go).
    #[test]
    fn the_signature_is_the_reference_libraries_vector() {
        let keys = SigningKeys::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let sig = signature(
            &keys,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        // The prefix is optional, as in the libraries; padding too.
        let bare = SigningKeys::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            signature(
                &bare,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            sig
        );
        // Another id, timestamp or body: another signature.
        for (id, t, body) in [
            ("msg_other", 1_614_265_330, &br#"{"test": 2432232314}"#[..]),
            (
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_331,
                br#"{"test": 2432232314}"#,
            ),
            (
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test":2432232314}"#,
            ),
        ] {
            assert_ne!(signature(&keys, id, t, body), sig, "{id} {t}");
        }
    }

    #[test]
    fn a_rotation_signs_with_every_key_current_first() {
        let new = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let old = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let both = SigningKeys::parse(&format!("{new}\n  {old} ")).unwrap();
        let one = |s: &str| signature(&SigningKeys::parse(s).unwrap(), "a:b:0:00", 7, b"{}");
        assert_eq!(
            signature(&both, "a:b:0:00", 7, b"{}"),
            format!("{} {}", one(new), one(old))
        );
    }

    #[test]
    fn a_secret_that_is_not_a_standard_webhooks_secret_is_refused_without_echoing_it() {
        let long = format!("whsec_{}", "A".repeat(88));
        for (secret, says) in [
            ("", "empty"),
            ("  ", "empty"),
            ("whsec_not-base64!", "key 1 is not whsec_"),
            ("whsec_c2hvcnQ=", "key 1 is 5 bytes"),
            (long.as_str(), "key 1 is 66 bytes"),
            (
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw bench-webhook-secret",
                "key 2 is not",
            ),
        ] {
            let e = SigningKeys::parse(secret).unwrap_err();
            assert!(e.contains(says), "{secret:?}: {e}");
            for part in secret.split_whitespace() {
                assert!(!e.contains(part.trim_start_matches(SECRET_PREFIX)), "{e}");
            }
        }
        let e = signing_keys(Some("whsec_c2hvcnQ=".into()), "ACME_SECRET").unwrap_err();
        assert_eq!((e.code.as_str(), e.refused), ("sink_secret_invalid", true));
        assert!(
            e.message.contains("ACME_SECRET") && !e.message.contains("c2hvcnQ"),
            "{e:?}"
        );
        let e = signing_keys(None, "ACME_SECRET").unwrap_err();
        assert_eq!(e.code, "sink_secret_missing");
        let keys = SigningKeys::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(format!("{keys:?}"), "SigningKeys(1 keys)");
    }

    #[test]
    fn the_message_id_is_stable_for_an_event_and_changes_with_its_body() {
        let id = message_id("acme", "inv-1:3", br#"{"seq":3,"type":"completed"}"#);
        assert_eq!(
            id,
            message_id("acme", "inv-1:3", br#"{"seq":3,"type":"completed"}"#)
        );
        let (head, digest) = id.rsplit_once(':').unwrap();
        assert_eq!(head, "acme:inv-1:3");
        assert_eq!(digest.len(), 16);
        assert!(!id.contains('.'), "{id}");
        // A rerun's different event at the same seq; another tenant.
        assert_ne!(
            id,
            message_id("acme", "inv-1:3", br#"{"seq":3,"type":"tool_call"}"#)
        );
        assert_ne!(
            id,
            message_id("globex", "inv-1:3", br#"{"seq":3,"type":"completed"}"#)
        );
    }

    /// The request as sent: Standard Webhooks' three headers under their
    /// names, and a signature over the id and timestamp it carries.
    #[test]
    fn the_request_carries_the_standard_webhooks_headers() {
        let keys = SigningKeys::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = bytes::Bytes::from_static(br#"{"invocationId":"inv-1","seq":0}"#);
        toolfleet_llm::install_crypto_provider();
        let request = signed_request(
            &reqwest::Client::new(),
            "https://hooks.example.com/x".parse().unwrap(),
            &keys,
            "acme",
            "inv-1:0",
            1_700_000_000,
            body.clone(),
        )
        .build()
        .unwrap();
        let h = request.headers();
        let id = h["webhook-id"].to_str().unwrap();
        assert_eq!(id, message_id("acme", "inv-1:0", &body));
        assert_eq!(h["webhook-timestamp"], "1700000000");
        assert_eq!(
            h["webhook-signature"].to_str().unwrap(),
            signature(&keys, id, 1_700_000_000, &body)
        );
        assert_eq!(h["toolfleet-tenant"], "acme");
        assert_eq!(h["content-type"], "application/json");
        assert!(h.get("toolfleet-signature").is_none());
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
