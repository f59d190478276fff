//! Response routing: an invocation's events also go to a webhook and/or a
//! relay subject on another prefix, named by the chat job (`sink`) or its
//! profile (`sink = "<name>"`, `[sinks.<name>]`).
//!
//! Delivery is decoupled from the invocation. When the frame has resolved
//! the profile, [`route_for`] turns the job's or the profile's sink into a
//! [`Route`] (refusing a bad one with `invalid_sink` before any model
//! call) and [`Events::route`](crate::Events::route) hands it to the
//! invocation's publisher; from then on every routed event (the terminal
//! one, or every one but the deltas) is also put on the sinks work queue
//! (`<p>.sink.<tenant>.<inv>`, stream `<P>_SINKS`), one message per
//! destination, the destination in the `Toolfleet-Sink` header and the
//! event, byte for byte as published, in the body. Every orchestrator runs
//! the [`relay`] on that queue's shared durable consumer: it POSTs
//! ([`webhook`]) or publishes, acks on success, naks with our own backoff
//! on a transient failure, and after the cap (or at once for a refusal)
//! publishes a dead letter on `<p>.deadletter.sink` and terminates the
//! message. Nothing a sink does reaches the invocation.
//!
//! # Invariants
//!
//! - A sink never fails, delays or changes an invocation; only an invalid
//!   sink named by the job ends it (`invalid_sink`, before the model is
//!   called, with nothing routed).
//! - A webhook is never sent unsigned: no secret, or one that is not a
//!   Standard Webhooks secret, no delivery (dead letter
//!   `sink_secret_missing`, `sink_secret_invalid`). Secrets are read from
//!   the environment at delivery and never logged, published or put in a
//!   label.
//! - Every URL passes the SSRF policy of the web worker
//!   ([`toolfleet_service::netpolicy`]) when the job starts and again at
//!   each delivery, and every address its host resolves to is checked
//!   before connecting; redirects are not followed.
//! - A relay subject is never under the fleet's own prefix and has no
//!   wildcard; one named by a job must be under a prefix the operator
//!   allows.
//! - Events reach a sink at least once (a webhook's `webhook-id`, a
//!   relay's `Toolfleet-Event-Id`, is the same for every retry) and not
//!   necessarily in order: a retried event may arrive after a later one.

pub mod relay;
pub mod webhook;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use serde::{Deserialize, Serialize};
use toolfleet_config::SinkConfig;
use toolfleet_protocol::{SinkEvents, SinkRequest, Subjects, headers};
use toolfleet_service::netpolicy::NetPolicy;
use tracing::warn;

use crate::Failure;
use crate::failure::ChatErrorCode;

/// The environment variable a job-named webhook's secret is read from.
pub const DEFAULT_SECRET_ENV: &str = "TOOLFLEET_SINK_SECRET";

/// Every `kind` of the sink metrics.
pub const SINK_KINDS: [&str; 2] = ["webhook", "relay"];
/// Every `outcome` of `toolfleet_sink_deliveries_total`.
/// `expired`: not delivered within `--sink-deliver-within-secs` of its
/// event (dead-lettered `sink_expired`, never dropped by the stream's age);
/// `deferred`: put back unattempted because its tenant's share of
/// deliveries (`--sink-tenant-concurrency`) was in use.
pub const SINK_OUTCOMES: [&str; 6] = [
    "ok",
    "retry",
    "dead_lettered",
    "refused",
    "expired",
    "deferred",
];

/// The default of [`SinkSettings::deliver_within`]: 50 minutes, under the
/// sinks stream's hour, so an event is dead-lettered before the stream
/// would drop it.
pub const DEFAULT_DELIVER_WITHIN: Duration = Duration::from_secs(3000);
/// The longest [`SinkSettings::deliver_within`]: the sinks stream's hour
/// less a minute for the relay to act.
pub const MAX_DELIVER_WITHIN: Duration = Duration::from_secs(3540);

/// The operator's sink settings (`--sink-*` flags, [`SinkArgs`]).
#[derive(Debug, Clone)]
pub struct SinkSettings {
    /// Delivery attempts of one event to one destination, the first
    /// included; then it is dead-lettered.
    pub max_attempts: u32,
    /// The delay before the second attempt, doubled for each next one.
    pub backoff_base: Duration,
    /// The longest delay between attempts.
    pub backoff_max: Duration,
    /// One webhook request, connection included.
    pub request_timeout: Duration,
    /// Deliveries in flight at once in this orchestrator.
    pub concurrency: usize,
    /// Deliveries of one tenant in flight at once in this orchestrator
    /// (at most `concurrency`): the tenant's share, so its slow receiver
    /// leaves the rest to the others.
    pub tenant_concurrency: usize,
    /// How long after its event an event may still be delivered: an
    /// older one (waiting behind a slow receiver, or retried this long) is
    /// dead-lettered `sink_expired` with its tenant, never left for the
    /// sinks stream's max age to drop silently.
    pub deliver_within: Duration,
    /// Accept `http://` webhooks (tests, loopback receivers): off in
    /// production.
    pub allow_http: bool,
    /// The address gate's exceptions (allowed hosts and CIDRs); any port.
    pub policy: NetPolicy,
    /// Subject prefixes a chat job's relay may be under (none: jobs may
    /// not name a relay; configured sinks may).
    pub relay_allow: Vec<String>,
    /// Where a job-named webhook's secret is read.
    pub default_secret_env: String,
    /// Whether webhooks a chat job names get the operator's exceptions
    /// too (`allow_http`, allowed hosts and networks). Off: a job's
    /// webhook is `https` on port 443 to a public address, whatever the
    /// configured sinks may reach.
    pub job_exceptions: bool,
}

impl Default for SinkSettings {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            concurrency: 16,
            tenant_concurrency: 4,
            deliver_within: DEFAULT_DELIVER_WITHIN,
            allow_http: false,
            policy: sink_policy(Vec::new(), Vec::new()),
            relay_allow: Vec::new(),
            default_secret_env: DEFAULT_SECRET_ENV.to_owned(),
            job_exceptions: false,
        }
    }
}

/// The SSRF policy of sinks: the web worker's, any port (a receiver's
/// port is its own business; the address gate is what guards the fleet's
/// network), with the operator's allowed hosts and networks.
pub fn sink_policy(allow_hosts: Vec<String>, allow_cidrs: Vec<ipnet::IpNet>) -> NetPolicy {
    NetPolicy {
        allowed_ports: Vec::new(),
        any_port: true,
        allow_hosts,
        allow_cidrs,
        allow_idn: false,
    }
}

/// The orchestrator's `--sink-*` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct SinkArgs {
    /// Delivery attempts of one routed event to one sink, then a dead
    /// letter on `<prefix>.deadletter.sink`.
    #[arg(long, env = "TOOLFLEET_SINK_MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub sink_max_attempts: u32,
    /// Delay before a sink's second attempt (ms), doubled per attempt.
    #[arg(long, env = "TOOLFLEET_SINK_BACKOFF_MS", default_value_t = 1000)]
    pub sink_backoff_ms: u64,
    /// Longest delay between two attempts (ms).
    #[arg(long, env = "TOOLFLEET_SINK_BACKOFF_MAX_MS", default_value_t = 60_000)]
    pub sink_backoff_max_ms: u64,
    /// One webhook request, connection included (ms).
    #[arg(long, env = "TOOLFLEET_SINK_TIMEOUT_MS", default_value_t = 10_000)]
    pub sink_timeout_ms: u64,
    /// Sink deliveries in flight at once in this process.
    #[arg(long, env = "TOOLFLEET_SINK_CONCURRENCY", default_value_t = 16)]
    pub sink_concurrency: usize,
    /// Sink deliveries of one tenant in flight at once in this process
    /// (its share; at most `--sink-concurrency`): an event of a tenant
    /// whose share is in use waits back on the stream, so one tenant's
    /// slow receiver delays only that tenant.
    #[arg(long, env = "TOOLFLEET_SINK_TENANT_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub sink_tenant_concurrency: u64,
    /// Seconds after its event within which a routed event may still be
    /// delivered; then it is dead-lettered (`sink_expired`). At most 3540:
    /// the sinks stream keeps events an hour.
    #[arg(long, env = "TOOLFLEET_SINK_DELIVER_WITHIN_SECS", default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=3540))]
    pub sink_deliver_within_secs: u64,
    /// Accept `http://` webhook URLs: for tests and loopback receivers
    /// only.
    #[arg(long, env = "TOOLFLEET_SINK_ALLOW_HTTP")]
    pub sink_allow_http: bool,
    /// A network whose (non-public) addresses webhooks may reach, e.g.
    /// `10.20.0.0/16` (repeatable; comma-separated in the variable).
    #[arg(long, env = "TOOLFLEET_SINK_ALLOW_CIDR", value_delimiter = ',')]
    pub sink_allow_cidr: Vec<ipnet::IpNet>,
    /// A host name whose addresses are not checked (repeatable).
    #[arg(long, env = "TOOLFLEET_SINK_ALLOW_HOST", value_delimiter = ',')]
    pub sink_allow_host: Vec<String>,
    /// A subject prefix chat jobs may name relays under, e.g. `acme.answers`
    /// (repeatable; none: jobs may not name a relay). Never under the
    /// fleet's own prefix.
    #[arg(long, env = "TOOLFLEET_RELAY_ALLOW", value_delimiter = ',')]
    pub relay_allow: Vec<String>,
    /// The variable holding the secret of webhooks chat jobs name.
    #[arg(long, env = "TOOLFLEET_SINK_SECRET_ENV", default_value = DEFAULT_SECRET_ENV)]
    pub sink_secret_env: String,
    /// Give webhooks that chat jobs name the exceptions above too
    /// (`--sink-allow-http`, `--sink-allow-cidr`, `--sink-allow-host`).
    /// Off: a job's webhook is https on port 443 to a public address.
    #[arg(long, env = "TOOLFLEET_SINK_EXCEPTIONS_FOR_JOBS")]
    pub sink_exceptions_for_jobs: bool,
}

impl SinkArgs {
    pub fn settings(&self) -> SinkSettings {
        SinkSettings {
            max_attempts: self.sink_max_attempts,
            backoff_base: Duration::from_millis(self.sink_backoff_ms),
            backoff_max: Duration::from_millis(self.sink_backoff_max_ms.max(self.sink_backoff_ms)),
            request_timeout: Duration::from_millis(self.sink_timeout_ms.max(1)),
            concurrency: self.sink_concurrency.max(1),
            tenant_concurrency: usize::try_from(self.sink_tenant_concurrency)
                .unwrap_or(usize::MAX)
                .min(self.sink_concurrency.max(1)),
            deliver_within: Duration::from_secs(self.sink_deliver_within_secs)
                .min(MAX_DELIVER_WITHIN),
            allow_http: self.sink_allow_http,
            policy: sink_policy(
                self.sink_allow_host
                    .iter()
                    .map(|h| h.to_ascii_lowercase())
                    .collect(),
                self.sink_allow_cidr.clone(),
            ),
            relay_allow: self.relay_allow.clone(),
            default_secret_env: self.sink_secret_env.clone(),
            job_exceptions: self.sink_exceptions_for_jobs,
        }
    }
}

impl SinkSettings {
    /// The delay before attempt `next` (2 for the first retry).
    pub fn backoff(&self, next: u32) -> Duration {
        let doublings = next.saturating_sub(2).min(20);
        self.backoff_base
            .saturating_mul(1 << doublings)
            .min(self.backoff_max)
    }

    /// Gate 1 for a webhook URL: the SSRF policy's URL gate, and `https`
    /// unless the operator allows `http`. The error says why, never echoes
    /// the URL (its path or query may hold a token).
    pub fn check_webhook(&self, raw: &str) -> Result<url::Url, String> {
        self.check_webhook_from(raw, false)
    }

    /// [`check_webhook`](Self::check_webhook) for a webhook a chat job
    /// named (`from_job`): without [`job_exceptions`](Self::job_exceptions),
    /// the strict policy — `https`, port 443, public addresses only.
    pub fn check_webhook_from(&self, raw: &str, from_job: bool) -> Result<url::Url, String> {
        let (policy, allow_http) = self.policy_for(from_job);
        // The address, then the scheme, then the port: the most useful
        // refusal first.
        let any_port = NetPolicy {
            any_port: true,
            ..policy.clone()
        };
        let target = any_port.check_url(raw).map_err(|b| b.0)?;
        if target.url.scheme() != "https" && !allow_http {
            return Err("only https webhooks are allowed".to_owned());
        }
        policy.check_url(raw).map_err(|b| b.0)?;
        Ok(target.url)
    }

    /// The policy (and whether `http` is allowed) for a webhook of a job
    /// or of the configuration.
    pub fn policy_for(&self, from_job: bool) -> (NetPolicy, bool) {
        if from_job && !self.job_exceptions {
            let strict = NetPolicy {
                allowed_ports: vec![443],
                ..NetPolicy::default()
            };
            (strict, false)
        } else {
            (self.policy.clone(), self.allow_http)
        }
    }

    /// Whether `subject` may be a relay: a plain subject (no wildcard, no
    /// empty token, not a `$` or `_INBOX` subject), not under the fleet's
    /// prefix, and — when a job of `tenant` names it (`job_tenant`) —
    /// under a prefix the operator allows followed by the job's tenant
    /// (`<allowed prefix>.<tenant>[.…]`), so a tenant never publishes
    /// where another's relays go.
    pub fn check_relay(
        &self,
        subjects: &Subjects,
        subject: &str,
        job_tenant: Option<&str>,
    ) -> Result<(), String> {
        let plain = !subject.is_empty()
            && subject.len() <= 256
            && subject.split('.').all(|t| {
                !t.is_empty()
                    && t != "*"
                    && t != ">"
                    && !t.chars().any(|c| c.is_whitespace() || c.is_control())
            });
        if !plain {
            return Err(format!(
                "relay {subject:?} is not a NATS subject without wildcards"
            ));
        }
        if reserved_subject(subject) {
            return Err(format!(
                "relay {subject:?} is a NATS system or inbox subject"
            ));
        }
        if subjects.owns(subject) {
            return Err(format!(
                "relay {subject:?} is under the fleet's own prefix {:?}",
                subjects.prefix()
            ));
        }
        if let Some(tenant) = job_tenant
            && !self.relay_allow.iter().any(|p| {
                subject
                    .strip_prefix(p.as_str())
                    .and_then(|r| r.strip_prefix('.'))
                    .is_some_and(|r| r == tenant || r.starts_with(&format!("{tenant}.")))
            })
        {
            return Err(if self.relay_allow.is_empty() {
                "this fleet takes no relay subjects from chat jobs".to_owned()
            } else {
                format!(
                    "relay {subject:?} is not under <allowed prefix>.{tenant} for any allowed prefix ({})",
                    self.relay_allow.join(", ")
                )
            });
        }
        Ok(())
    }

    /// Checks the configured sinks at start: their webhooks pass gate 1,
    /// their relays are not the fleet's. Warns about a secret that is not
    /// set (deliveries would be dead-lettered until it is).
    pub fn check_config(
        &self,
        subjects: &Subjects,
        sinks: &BTreeMap<String, SinkConfig>,
        env: &dyn toolfleet_llm::deployments::EnvSource,
    ) -> Result<(), String> {
        for prefix in &self.relay_allow {
            if reserved_subject(prefix) || subjects.owns(prefix) || prefix.contains(['*', '>']) {
                return Err(format!(
                    "--relay-allow {prefix:?}: a relay prefix is a plain subject outside the fleet's prefix, not a $ or _INBOX subject"
                ));
            }
        }
        if let Some(h) = self.policy.allow_hosts.iter().find(|h| h.contains(':')) {
            return Err(format!(
                "--sink-allow-host {h:?}: a host name without a port (webhooks may use any port)"
            ));
        }
        for (name, sink) in sinks {
            if let Some(url) = &sink.url {
                self.check_webhook(url)
                    .map_err(|e| format!("sinks.{name}.url: {e}"))?;
            }
            if let Some(relay) = &sink.relay {
                self.check_relay(subjects, relay, None)
                    .map_err(|e| format!("sinks.{name}.relay: {e}"))?;
            }
            if let Some(var) = &sink.secret_env {
                match env.var(var).filter(|v| !v.trim().is_empty()) {
                    None => {
                        warn!(sink = %name, secret_env = %var, "the sink's secret is not set: its webhook deliveries are dead-lettered until it is");
                    }
                    // What is wrong, never the value.
                    Some(secret) => {
                        if let Err(why) = webhook::SigningKeys::parse(&secret) {
                            warn!(sink = %name, secret_env = %var, problem = %why, "the sink's secret is not a Standard Webhooks secret (whsec_<base64>): its webhook deliveries are dead-lettered until it is");
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// NATS's own subjects (`$JS`, `$SRV`, `$SYS`, …) and inboxes: never a
/// relay.
fn reserved_subject(subject: &str) -> bool {
    subject.starts_with('$') || subject == "_INBOX" || subject.starts_with("_INBOX.")
}

/// One destination of a routed event: what the `Toolfleet-Sink` header of
/// a sinks-stream message holds. Never holds a secret, only where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Destination {
    Webhook {
        url: String,
        #[serde(rename = "secretEnv")]
        secret_env: String,
        /// The configured sink's name; none for a job's own.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sink: Option<String>,
    },
    Relay {
        subject: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sink: Option<String>,
    },
}

impl Destination {
    /// `webhook` or `relay`: the metrics' `kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            Destination::Webhook { .. } => "webhook",
            Destination::Relay { .. } => "relay",
        }
    }

    /// For logs and dead letters: the kind, the sink's name and the
    /// webhook's host (never its path or query).
    pub fn describe(&self) -> String {
        let (what, sink) = match self {
            Destination::Webhook { url, sink, .. } => (
                format!(
                    "webhook at {}",
                    url::Url::parse(url)
                        .ok()
                        .and_then(|u| u.host_str().map(str::to_owned))
                        .unwrap_or_else(|| "?".into())
                ),
                sink,
            ),
            Destination::Relay { subject, sink } => (format!("relay to {subject}"), sink),
        };
        match sink {
            Some(name) => format!("{what} (sink {name})"),
            None => what,
        }
    }

    /// The header value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(value: &str) -> Result<Self, String> {
        serde_json::from_str(value).map_err(|e| format!("unreadable {}: {e}", headers::SINK))
    }
}

/// Where one invocation's events go besides NATS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub events: SinkEvents,
    pub destinations: Vec<Destination>,
}

impl Route {
    /// Whether an event (not a delta) goes out on this route.
    pub fn takes(&self, terminal: bool) -> bool {
        terminal || self.events == SinkEvents::All
    }
}

/// [`route_for`] over its parts; a refusal names the kind of sink refused
/// (for the metrics) when there is one.
pub fn resolve(
    settings: &SinkSettings,
    subjects: &Subjects,
    configured: &BTreeMap<String, SinkConfig>,
    job: Option<&SinkRequest>,
    profile_sink: Option<&str>,
    tenant: &str,
) -> Result<Option<Route>, (Option<&'static str>, Failure)> {
    let invalid =
        |kind: Option<&'static str>, m: String| (kind, Failure::new(ChatErrorCode::InvalidSink, m));
    if let Some(request) = job {
        let mut destinations = Vec::new();
        if let Some(raw) = &request.webhook {
            settings
                .check_webhook_from(raw, true)
                .map_err(|e| invalid(Some("webhook"), format!("webhook refused: {e}")))?;
            destinations.push(Destination::Webhook {
                url: raw.trim().to_owned(),
                secret_env: settings.default_secret_env.clone(),
                sink: None,
            });
        }
        if let Some(subject) = &request.relay {
            settings
                .check_relay(subjects, subject, Some(tenant))
                .map_err(|e| invalid(Some("relay"), format!("relay refused: {e}")))?;
            destinations.push(Destination::Relay {
                subject: subject.clone(),
                sink: None,
            });
        }
        if destinations.is_empty() {
            return Err(invalid(
                None,
                "the job's sink names neither a webhook nor a relay".into(),
            ));
        }
        return Ok(Some(Route {
            events: request.events.unwrap_or_default(),
            destinations,
        }));
    }
    let Some(name) = profile_sink else {
        return Ok(None);
    };
    // Loaded configs name only sinks they define (checked at load).
    let Some(sink) = configured.get(name) else {
        return Err(invalid(
            None,
            format!("the profile's sink {name:?} is not configured"),
        ));
    };
    let mut destinations = Vec::new();
    if let (Some(url), Some(secret_env)) = (&sink.url, &sink.secret_env) {
        destinations.push(Destination::Webhook {
            url: url.clone(),
            secret_env: secret_env.clone(),
            sink: Some(name.to_owned()),
        });
    }
    if let Some(subject) = &sink.relay {
        destinations.push(Destination::Relay {
            subject: subject.clone(),
            sink: Some(name.to_owned()),
        });
    }
    Ok(Some(Route {
        events: sink.events,
        destinations,
    }))
}

/// Puts one routed event on the sinks queue, once per destination: called
/// by the invocation's event publisher, in publish order. The publish is
/// sent at once; its confirmation is awaited aside, so the invocation's
/// events are not held up by it.
pub(crate) async fn enqueue(
    client: &async_nats::Client,
    subject: &str,
    route: &Route,
    invocation_id: &str,
    seq: u64,
    payload: &bytes::Bytes,
) {
    let js = jetstream::new(client.clone());
    for destination in &route.destinations {
        // No `Nats-Msg-Id`: nothing publishes a routed event twice, and
        // the rerun of a crashed invocation numbers its events from 0
        // again, so an id made of the seq would drop its events.
        let mut h = async_nats::HeaderMap::new();
        h.insert(headers::SINK, destination.encode().as_str());
        match js
            .publish_with_headers(subject.to_owned(), h, payload.clone())
            .await
        {
            Ok(ack) => {
                let kind = destination.kind();
                let invocation_id = invocation_id.to_owned();
                tokio::spawn(async move {
                    if let Err(e) = ack.await {
                        warn!(error = %e, kind, invocation_id, seq, "the sinks stream did not confirm a routed event; its sink may miss it");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, kind = destination.kind(), invocation_id, seq, "cannot queue a routed event for its sink");
            }
        }
    }
}

/// The stream and the durable consumer every orchestrator's relay shares.
pub(crate) async fn consumer(
    js: &jetstream::Context,
    subjects: &Subjects,
    settings: &SinkSettings,
) -> Result<jetstream::consumer::PullConsumer, crate::OrchestratorError> {
    let nats = |e: String| crate::OrchestratorError::Nats(e);
    let stream = toolfleet_protocol::streams::ensure_sinks_stream(js, subjects)
        .await
        .map_err(|e| nats(e.to_string()))?;
    stream
        .get_or_create_consumer(
            &subjects.sinks_consumer(),
            jetstream::consumer::pull::Config {
                durable_name: Some(subjects.sinks_consumer()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                // A delivery's request is bounded by the timeout; the
                // rest is room for the relay's own queueing.
                ack_wait: settings.request_timeout + Duration::from_secs(20),
                max_ack_pending: 1_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| nats(format!("sinks consumer: {e}")))
}

/// Metrics of sink deliveries.
#[derive(Clone)]
pub struct SinkMetrics {
    /// `kind`: webhook | relay; `outcome`: ok | retry | dead_lettered |
    /// refused (a URL or relay the policy refused, at the job's start or at
    /// delivery, or a missing secret).
    pub deliveries: prometheus::IntCounterVec,
    /// One delivery attempt, by `kind`.
    pub duration: prometheus::HistogramVec,
}

impl SinkMetrics {
    pub fn register(r: &prometheus::Registry) -> prometheus::Result<Self> {
        let deliveries = toolfleet_service::metrics::counter(
            r,
            "toolfleet_sink_deliveries_total",
            "Delivery attempts of routed events to webhooks and relays, by kind and outcome.",
            &["kind", "outcome"],
        )?;
        let duration = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "toolfleet_sink_delivery_duration_seconds",
                "Time of one delivery attempt to a webhook or relay, by kind.",
            )
            .buckets(toolfleet_service::metrics::LATENCY_BUCKETS.to_vec()),
            &["kind"],
        )?;
        r.register(Box::new(duration.clone()))?;
        for kind in SINK_KINDS {
            duration.with_label_values(&[kind]);
            for outcome in SINK_OUTCOMES {
                deliveries.with_label_values(&[kind, outcome]);
            }
        }
        Ok(Self {
            deliveries,
            duration,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subjects() -> Subjects {
        Subjects::new("toolfleet").unwrap()
    }

    fn loopback_settings() -> SinkSettings {
        SinkSettings {
            allow_http: true,
            policy: sink_policy(Vec::new(), vec!["127.0.0.0/8".parse().unwrap()]),
            relay_allow: vec!["acme.answers".into()],
            ..SinkSettings::default()
        }
    }

    fn job(webhook: Option<&str>, relay: Option<&str>) -> SinkRequest {
        SinkRequest {
            webhook: webhook.map(str::to_owned),
            relay: relay.map(str::to_owned),
            events: None,
        }
    }

    #[test]
    fn webhooks_pass_gate_one_or_are_refused_with_a_reason() {
        let strict = SinkSettings::default();
        assert!(
            strict
                .check_webhook("https://hooks.example.com/x?t=1")
                .is_ok()
        );
        assert!(
            strict
                .check_webhook("https://hooks.example.com:8443/x")
                .is_ok(),
            "any port"
        );
        for (bad, says) in [
            ("https://10.1.2.3/hook", "private"),
            ("https://127.0.0.1/hook", "loopback"),
            ("https://[::1]/hook", "loopback"),
            ("https://0x7f000001/hook", "loopback"),
            ("https://169.254.169.254/latest", "link-local"),
            ("http://hooks.example.com/x", "https"),
            ("https://u:p@hooks.example.com/x", "credentials"),
            ("ftp://hooks.example.com/x", "http"),
            ("not a url", "URL"),
        ] {
            let e = strict.check_webhook(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
            assert!(
                !e.contains("/hook") && !e.contains("/x"),
                "no path echoed: {e}"
            );
        }
        let loopback = loopback_settings();
        assert!(loopback.check_webhook("http://127.0.0.1:9/hook").is_ok());
        assert!(loopback.check_webhook("https://10.1.2.3/hook").is_err());
        // A job's webhook gets none of the operator's exceptions unless
        // the operator says so: https, port 443, public.
        for bad in [
            "http://127.0.0.1:9/hook",
            "https://127.0.0.1/hook",
            "https://hooks.example.com:8443/x",
        ] {
            assert!(loopback.check_webhook_from(bad, true).is_err(), "{bad}");
        }
        assert!(
            loopback
                .check_webhook_from("https://hooks.example.com/x", true)
                .is_ok()
        );
        let open = SinkSettings {
            job_exceptions: true,
            ..loopback_settings()
        };
        assert!(
            open.check_webhook_from("http://127.0.0.1:9/hook", true)
                .is_ok()
        );
    }

    #[test]
    fn relays_stay_off_the_fleet_prefix_and_within_the_allowed_ones() {
        let s = loopback_settings();
        let fleet = subjects();
        let acme = Some("acme");
        assert!(s.check_relay(&fleet, "acme.answers.acme", acme).is_ok());
        assert!(s.check_relay(&fleet, "acme.answers.acme.eu", acme).is_ok());
        for (bad, says) in [
            ("toolfleet.chat.events.x.y", "own prefix"),
            ("acme.answers.*", "wildcards"),
            ("acme.>", "wildcards"),
            ("acme..x", "wildcards"),
            ("acme.answers", "not under"),
            ("acme.answersx.acme", "not under"),
            // Another tenant's relays are not this tenant's to publish to.
            ("acme.answers.globex", "not under"),
            ("acme.answers.acmex", "not under"),
            ("globex.answers.acme", "not under"),
            ("$JS.API.STREAM.DELETE.X", "system or inbox"),
            ("_INBOX.abc", "system or inbox"),
        ] {
            let e = s.check_relay(&fleet, bad, acme).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        // A configured sink is trusted with any other prefix, never ours
        // nor NATS's own.
        assert!(s.check_relay(&fleet, "globex.answers", None).is_ok());
        assert!(s.check_relay(&fleet, "toolfleet.x", None).is_err());
        assert!(s.check_relay(&fleet, "$SYS.x", None).is_err());
        let none = SinkSettings::default();
        let e = none
            .check_relay(&fleet, "acme.answers.acme", acme)
            .unwrap_err();
        assert!(e.contains("no relay subjects from chat jobs"), "{e}");
        // Nor may the operator allow such prefixes.
        for bad in ["$JS", "_INBOX.x", "toolfleet.x", "a.*"] {
            let s = SinkSettings {
                relay_allow: vec![bad.into()],
                ..SinkSettings::default()
            };
            let env: std::collections::HashMap<String, String> = Default::default();
            assert!(
                s.check_config(&fleet, &BTreeMap::new(), &env).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_job_sink_wins_over_the_profile_and_bad_ones_are_invalid_sink() {
        let s = SinkSettings {
            job_exceptions: true,
            ..loopback_settings()
        };
        let configured = BTreeMap::from([(
            "acme".to_owned(),
            SinkConfig {
                url: Some("https://hooks.acme.example/x".into()),
                secret_env: Some("ACME_SECRET".into()),
                events: SinkEvents::All,
                relay: Some("acme.bus".into()),
                tenants: Default::default(),
            },
        )]);
        let none = resolve(&s, &subjects(), &configured, None, None, "acme").unwrap();
        assert_eq!(none, None);
        let profile = resolve(&s, &subjects(), &configured, None, Some("acme"), "acme")
            .unwrap()
            .unwrap();
        assert_eq!(profile.events, SinkEvents::All);
        assert_eq!(
            profile.destinations,
            [
                Destination::Webhook {
                    url: "https://hooks.acme.example/x".into(),
                    secret_env: "ACME_SECRET".into(),
                    sink: Some("acme".into())
                },
                Destination::Relay {
                    subject: "acme.bus".into(),
                    sink: Some("acme".into())
                }
            ]
        );
        let own = job(Some("http://127.0.0.1:8080/h"), None);
        let r = resolve(
            &s,
            &subjects(),
            &configured,
            Some(&own),
            Some("acme"),
            "acme",
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.events, SinkEvents::Final, "the job's default");
        assert_eq!(
            r.destinations,
            [Destination::Webhook {
                url: "http://127.0.0.1:8080/h".into(),
                secret_env: DEFAULT_SECRET_ENV.into(),
                sink: None
            }]
        );
        for bad in [
            job(Some("https://10.1.2.3/hook"), None),
            job(None, Some("toolfleet.chat.events.default.x")),
            job(Some("http://127.0.0.1:8080/h"), Some("globex.x")),
            job(None, None),
        ] {
            let (_, f) =
                resolve(&s, &subjects(), &configured, Some(&bad), None, "acme").unwrap_err();
            assert_eq!(f.code, "invalid_sink", "{bad:?}");
        }
    }

    #[test]
    fn destinations_round_trip_through_their_header_and_describe_no_secret() {
        for d in [
            Destination::Webhook {
                url: "https://hooks.example.com/p?token=abc".into(),
                secret_env: "S".into(),
                sink: Some("acme".into()),
            },
            Destination::Relay {
                subject: "acme.answers.acme".into(),
                sink: None,
            },
        ] {
            assert_eq!(Destination::decode(&d.encode()).unwrap(), d);
            assert!(!d.describe().contains("token"), "{}", d.describe());
        }
        assert!(Destination::decode("{\"kind\":\"smtp\"}").is_err());
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let s = SinkSettings {
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_millis(350),
            ..SinkSettings::default()
        };
        assert_eq!(s.backoff(2), Duration::from_millis(100));
        assert_eq!(s.backoff(3), Duration::from_millis(200));
        assert_eq!(s.backoff(4), Duration::from_millis(350));
        assert_eq!(s.backoff(40), Duration::from_millis(350));
    }

    #[test]
    fn a_route_takes_the_terminal_event_or_all() {
        let final_only = Route {
            events: SinkEvents::Final,
            destinations: Vec::new(),
        };
        assert!(final_only.takes(true) && !final_only.takes(false));
        let all = Route {
            events: SinkEvents::All,
            ..final_only
        };
        assert!(all.takes(true) && all.takes(false));
    }
}
