//! Response routing (issue 15, part 4): an invocation's events also go to
//! a signed webhook and a relay subject on another prefix, named by the
//! job or its profile; a failing webhook is retried, then dead-lettered,
//! and never fails the invocation; a sink on a private address or under
//! the fleet's prefix ends the job at once with `invalid_sink`. The
//! receiver is a real HTTP server on 127.0.0.1; the orchestrator is told to
//! accept `http` and 127.0.0.0/8, which its default policy refuses (tested
//! too).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use futures::StreamExt;
use serde_json::{Value, json};
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_protocol::client::ClientError;
use toolfleet_protocol::{ChatJob, SinkEvents, SinkRequest};

use crate::support::{self, Env, Options, WAIT};

/// Standard Webhooks secrets (`whsec_` and base64 of 32 bytes).
const SECRET: &str = "whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IGpvYiBzZWNyZXQ=";
const ACME_SECRET: &str = "whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IGFjbWUgc2Vjci4=";

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: HeaderMap,
    body: bytes::Bytes,
}

/// A webhook receiver on 127.0.0.1: `/hook` answers 204, `/fail` 500,
/// `/hold` 204 once the test calls [`Receiver::release`]; every request is
/// recorded as it arrives.
struct Receiver {
    addr: std::net::SocketAddr,
    got: Arc<Mutex<Vec<Received>>>,
    arrived: Arc<tokio::sync::Notify>,
    release: tokio::sync::watch::Sender<bool>,
}

impl Receiver {
    async fn start() -> Self {
        let got: Arc<Mutex<Vec<Received>>> = Arc::default();
        let arrived = Arc::new(tokio::sync::Notify::new());
        let (release, released) = tokio::sync::watch::channel(false);
        let record = {
            let got = got.clone();
            let arrived = arrived.clone();
            move |path: axum::extract::Path<String>, headers: HeaderMap, body: bytes::Bytes| {
                let got = got.clone();
                let arrived = arrived.clone();
                let mut released = released.clone();
                async move {
                    let hold = path.0 == "hold";
                    let status = if path.0 == "fail" {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::NO_CONTENT
                    };
                    got.lock().unwrap().push(Received {
                        path: path.0,
                        headers,
                        body,
                    });
                    arrived.notify_waiters();
                    if hold {
                        let _ = released.wait_for(|r| *r).await;
                    }
                    status
                }
            }
        };
        let app = axum::Router::new().route("/{path}", axum::routing::post(record));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            addr,
            got,
            arrived,
            release,
        }
    }

    /// Answers every `/hold` request, now and from now on.
    fn release(&self) {
        self.release.send_replace(true);
    }

    /// How many requests to `path` arrived.
    fn count(&self, path: &str) -> usize {
        self.got().iter().filter(|r| r.path == path).count()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}/{path}", self.addr)
    }

    fn got(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }

    /// Waits (bounded) until `done` holds for what arrived.
    async fn wait_until(&self, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        tokio::time::timeout(WAIT, async {
            loop {
                let notified = self.arrived.notified();
                let got = self.got();
                if done(&got) {
                    return got;
                }
                notified.await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the receiver got only {:?}", self.got()))
    }
}

/// What the tests' orchestrator allows: `http` and loopback receivers,
/// relays under `partner.answers.<tenant>`, short retries.
fn loopback(config: &mut OrchestratorConfig) {
    let sinks = &mut config.sinks;
    sinks.allow_http = true;
    sinks.policy = toolfleet_orchestrator::sinks::sink_policy(
        Vec::new(),
        vec!["127.0.0.0/8".parse().unwrap()],
    );
    sinks.relay_allow = vec!["partner.answers".into()];
    // The tests' receivers are on loopback, named by the jobs themselves.
    sinks.job_exceptions = true;
    sinks.max_attempts = 3;
    sinks.backoff_base = Duration::from_millis(50);
    sinks.backoff_max = Duration::from_millis(200);
}

fn script() -> Value {
    json!({ "rules": [], "default": { "steps": [ { "answer": "Routed answer." } ] } })
}

/// A fleet with no workers, the `routed` profile's sink `acme` on
/// `receiver`'s `/hook`.
async fn fleet(receiver: &Receiver, tweak: fn(&mut OrchestratorConfig)) -> Env {
    let env = vec![
        ("TOOLFLEET_SINK_SECRET", SECRET),
        ("TOOLFLEET_SINK_ACME_SECRET", ACME_SECRET),
    ];
    fleet_at(&receiver.url("hook"), env, tweak).await
}

/// A fleet with no workers, the `routed` profile's sink `acme` on
/// `acme_url`, with `env` in the orchestrator's environment.
async fn fleet_at(
    acme_url: &str,
    env: Vec<(&'static str, &'static str)>,
    tweak: fn(&mut OrchestratorConfig),
) -> Env {
    let profiles = format!(
        r#"
default_profile = "default"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
[profiles.routed]
deployment = "scripted"
sink = "acme"
[sinks.acme]
url = "{}"
secret_env = "TOOLFLEET_SINK_ACME_SECRET"
"#,
        acme_url
    );
    Env::start_with(
        script(),
        Options {
            workers: Vec::new(),
            tweak,
            profiles_toml: Some(profiles),
            env,
            data_source: None,
            ..Options::default()
        },
    )
    .await
}

fn with_sink(
    text: &str,
    webhook: Option<String>,
    relay: Option<&str>,
    events: SinkEvents,
) -> ChatJob {
    ChatJob {
        sink: Some(SinkRequest {
            webhook,
            relay: relay.map(str::to_owned),
            events: Some(events),
        }),
        ..toolfleet_protocol::client::question(text)
    }
}

/// Checks the Standard Webhooks signature as a receiver would (the
/// integration with the reference Python library is
/// [`the_standard_webhooks_python_library_verifies_real_deliveries`]):
/// HMAC-SHA256 with the decoded `whsec_` key over
/// `<webhook-id>.<webhook-timestamp>.<body>`, one `v1,<base64>` of the
/// space-separated list matching; the id names the receiver's tenant
/// (`default` here).
fn assert_signed(r: &Received, secret: &str) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    assert_eq!(r.headers["toolfleet-tenant"], "default");
    let id = r.headers["webhook-id"].to_str().unwrap();
    assert!(id.starts_with("default:"), "{id}");
    let t: u64 = r.headers["webhook-timestamp"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(t) < 300, "{t} is the attempt's time");
    let key = b64.decode(secret.strip_prefix("whsec_").unwrap()).unwrap();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    let mut signed = format!("{id}.{t}.").into_bytes();
    signed.extend_from_slice(&r.body);
    let header = r.headers["webhook-signature"].to_str().unwrap();
    let macs: Vec<Vec<u8>> = header
        .split(' ')
        .map(|s| b64.decode(s.strip_prefix("v1,").unwrap()).unwrap())
        .collect();
    assert!(
        macs.iter()
            .any(|m| ring::hmac::verify(&key, &signed, m).is_ok()),
        "a signature verifies with the secret: {header}"
    );
    let wrong = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"another secret");
    assert!(
        macs.iter()
            .all(|m| ring::hmac::verify(&wrong, &signed, m).is_err())
    );
    assert!(r.headers.get("toolfleet-signature").is_none());
    assert_eq!(r.headers["content-type"], "application/json");
}

/// Submits `job` and returns the events its client saw but the deltas:
/// what a sink with `events = "all"` receives.
async fn non_delta_events(env: &Env, job: &ChatJob) -> Vec<Value> {
    let mut events = env.follow_and_submit(job).await;
    support::events_until_terminal(&mut events)
        .await
        .into_iter()
        .filter(|e| e["type"] != "delta")
        .collect()
}

/// A live subscription to the fleet's sink dead letters.
async fn sink_dead_letters(env: &Env) -> async_nats::Subscriber {
    env.subscribe(
        env.subjects
            .dead_letter(toolfleet_protocol::DeadLetterKind::Sink),
    )
    .await
}

/// `<invocationId>:<seq>` of the `webhook-id`
/// (`<tenant>:<invocationId>:<seq>:<16 hex of the body's SHA-256>`).
fn event_id(r: &Received) -> String {
    let id = r.headers["webhook-id"].to_str().unwrap();
    let (rest, digest) = id.rsplit_once(':').unwrap();
    assert_eq!(digest.len(), 16, "{id}");
    let digest_of_body = ring::digest::digest(&ring::digest::SHA256, &r.body);
    let hex: String = digest_of_body.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(digest, hex, "{id}");
    rest.split_once(':').unwrap().1.to_owned()
}

fn body(r: &Received) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

fn metric(text: &str, kind: &str, outcome: &str) -> u64 {
    let name = format!("toolfleet_sink_deliveries_total{{kind=\"{kind}\",outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(name.as_str()))
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
        .trim()
        .parse()
        .unwrap()
}

/// Reads the metrics until `kind`/`outcome` is `want` (a delivery is
/// counted just after its receiver has it), then returns them.
async fn metrics_once(env: &Env, kind: &str, outcome: &str, want: u64) -> String {
    tokio::time::timeout(WAIT, async {
        loop {
            let text = env.metrics_text().await;
            if metric(&text, kind, outcome) == want {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{kind}/{outcome} never reached {want}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_webhook_gets_the_final_event_or_every_event() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback).await;

    // The profile's sink: the final event only, signed with its secret.
    let job = ChatJob {
        profile: Some("routed".into()),
        ..toolfleet_protocol::client::question("Route this, please.")
    };
    let mut events = env.follow_and_submit(&job).await;
    let seen = support::events_until_terminal(&mut events).await;
    let terminal = seen.last().unwrap().clone();
    assert_eq!(terminal["type"], "completed", "{terminal}");
    let got = receiver.wait_until(|g| !g.is_empty()).await;
    let r = &got[0];
    assert_eq!(r.path, "hook");
    assert_signed(r, ACME_SECRET);
    assert_eq!(
        body(r),
        terminal,
        "the body is the terminal event as published"
    );
    assert_eq!(
        event_id(r),
        format!("{}:{}", job.invocation_id, terminal["seq"])
    );

    // The job's own sink, every event: each non-delta event once, signed
    // with the default secret; in seq order once sorted.
    let job = with_sink(
        "Route everything.",
        Some(receiver.url("hook")),
        None,
        SinkEvents::All,
    );
    let seen = non_delta_events(&env, &job).await;
    assert!(seen.len() >= 2, "{seen:?}");
    let got = receiver.wait_until(|g| g.len() > seen.len()).await;
    let mut mine: Vec<&Received> = got
        .iter()
        .filter(|r| event_id(r).starts_with(&format!("{}:", job.invocation_id)))
        .collect();
    mine.sort_by_key(|r| body(r)["seq"].as_u64());
    for r in &mine {
        assert_signed(r, SECRET);
        assert_eq!(
            event_id(r),
            format!("{}:{}", job.invocation_id, body(r)["seq"])
        );
    }
    let bodies: Vec<Value> = mine.iter().map(|r| body(r)).collect();
    assert_eq!(bodies, seen, "every non-delta event, once");

    let text = metrics_once(&env, "webhook", "ok", 1 + seen.len() as u64).await;
    assert_eq!(metric(&text, "webhook", "dead_lettered"), 0);
    assert_eq!(metric(&text, "relay", "ok"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_webhook_is_retried_then_dead_lettered_and_the_answer_stands() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback).await;
    let mut dead = sink_dead_letters(&env).await;
    let job = with_sink(
        "Route to a broken receiver.",
        Some(receiver.url("fail")),
        None,
        SinkEvents::Final,
    );
    let outcome = env.submit(&job).await.expect("the invocation completes");
    assert_eq!(outcome.text, "Routed answer.");

    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["kind"], "sink", "{letter}");
    assert_eq!(letter["code"], "sink_http_500", "{letter}");
    assert_eq!(letter["attempts"], 3, "{letter}");
    assert_eq!(letter["stream"], "TOOLFLEET_SINKS", "{letter}");
    assert_eq!(letter["invocationId"], job.invocation_id.as_str());
    let error = letter["error"].as_str().unwrap();
    assert!(
        error.contains("webhook at 127.0.0.1") && error.contains("500"),
        "{error}"
    );
    assert_eq!(
        letter["job"]["type"], "completed",
        "the event is kept: {letter}"
    );
    // Of the headers, only the tenant is kept (a webhook URL may hold a
    // token).
    assert_eq!(
        letter["headers"],
        json!({ "Toolfleet-Tenant": "default" }),
        "{letter}"
    );
    // Three attempts of one event, all signed alike.
    let got = receiver.got();
    assert_eq!(got.len(), 3, "{got:?}");
    let ids: std::collections::BTreeSet<String> = got.iter().map(event_id).collect();
    assert_eq!(ids.len(), 1, "one event: {ids:?}");
    for r in &got {
        assert_signed(r, SECRET);
    }

    let text = env.metrics_text().await;
    assert_eq!(metric(&text, "webhook", "retry"), 2);
    assert_eq!(metric(&text, "webhook", "dead_lettered"), 1);
    assert_eq!(metric(&text, "webhook", "ok"), 0);
    assert!(
        text.contains("toolfleet_dead_letters_total{kind=\"sink\",tool=\"\"} 1"),
        "{text}"
    );
    assert!(text.contains("toolfleet_sink_delivery_duration_seconds_count{kind=\"webhook\"} 3"));
}

/// [`loopback`], with 4 deliveries at once, 2 of them per tenant, and
/// requests that may wait two minutes.
fn loopback_with_shares(config: &mut OrchestratorConfig) {
    loopback(config);
    config.sinks.concurrency = 4;
    config.sinks.tenant_concurrency = 2;
    config.sinks.request_timeout = Duration::from_secs(120);
}

/// acme's webhook holds every request until the test releases it;
/// globex's answers at once. acme holds only its share of the relay's
/// deliveries, and every one of globex's routed answers arrives while
/// acme's are held (before: acme's held requests took every delivery, and
/// globex's waited behind them). Once released, acme's arrive too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_slow_webhook_delays_only_that_tenant() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback_with_shares).await;
    let routed = |tenant: &str, path: &str, n: usize| {
        let mut job = with_sink(
            &format!("{tenant} asks {n}"),
            Some(receiver.url(path)),
            None,
            SinkEvents::Final,
        );
        job.tenant = Some(tenant.into());
        job
    };
    for n in 0..6 {
        let job = routed("acme", "hold", n);
        env.submit(&job).await.expect("acme's invocation completes");
    }
    receiver.wait_until(|got| got.len() >= 2).await;
    for n in 0..5 {
        let job = routed("globex", "hook", n);
        env.submit(&job)
            .await
            .expect("globex's invocation completes");
    }
    let got = receiver
        .wait_until(|got| got.iter().filter(|r| r.path == "hook").count() == 5)
        .await;
    for r in got.iter().filter(|r| r.path == "hook") {
        assert_eq!(r.headers["toolfleet-tenant"], "globex");
    }
    assert_eq!(
        receiver.count("hold"),
        2,
        "acme holds its share of the deliveries, no more"
    );
    let text = env.metrics_text().await;
    assert!(metric(&text, "webhook", "deferred") > 0, "{text}");

    receiver.release();
    receiver
        .wait_until(|got| got.iter().filter(|r| r.path == "hold").count() == 6)
        .await;
    metrics_once(&env, "webhook", "ok", 11).await;
}

/// [`loopback`], with as many attempts as wanted but one second to
/// deliver an event in.
fn loopback_within_a_second(config: &mut OrchestratorConfig) {
    loopback(config);
    config.sinks.max_attempts = 100;
    config.sinks.deliver_within = Duration::from_secs(1);
}

/// An event that cannot be delivered within `--sink-deliver-within-secs`
/// is dead-lettered `sink_expired`, with its tenant and the last error,
/// instead of being retried until the sinks stream's age drops it
/// without a word (before: retried to the attempt cap, whatever its age).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_event_not_delivered_in_time_is_dead_lettered_expired() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback_within_a_second).await;
    let mut dead = sink_dead_letters(&env).await;
    let job = with_sink(
        "Route to a broken receiver.",
        Some(receiver.url("fail")),
        None,
        SinkEvents::Final,
    );
    env.submit(&job).await.expect("the invocation completes");
    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["code"], "sink_expired", "{letter}");
    assert_eq!(letter["invocationId"], job.invocation_id.as_str());
    assert_eq!(
        letter["headers"],
        json!({ "Toolfleet-Tenant": "default" }),
        "{letter}"
    );
    let error = letter["error"].as_str().unwrap();
    assert!(
        error.contains("not delivered within 1 s") && error.contains("500"),
        "{error}"
    );
    assert_eq!(letter["job"]["type"], "completed", "{letter}");
    let attempts = letter["attempts"].as_u64().unwrap();
    assert!(attempts < 100, "dead before the attempt cap: {attempts}");
    assert_eq!(receiver.got().len() as u64, attempts);
    metrics_once(&env, "webhook", "expired", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_another_prefix_receives_the_events() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback).await;
    let mut relayed = env.subscribe("partner.answers.>".to_string()).await;
    let job = with_sink(
        "Relay this.",
        None,
        Some("partner.answers.default.eu"),
        SinkEvents::All,
    );
    let seen = non_delta_events(&env, &job).await;
    let mut got = Vec::new();
    while got.len() < seen.len() {
        let msg = tokio::time::timeout(WAIT, relayed.next())
            .await
            .expect("a relayed event in time")
            .unwrap();
        assert_eq!(msg.subject.as_str(), "partner.answers.default.eu");
        let ev: Value = serde_json::from_slice(&msg.payload).unwrap();
        let id = msg
            .headers
            .as_ref()
            .unwrap()
            .get("Toolfleet-Event-Id")
            .unwrap();
        assert_eq!(id.as_str(), format!("{}:{}", job.invocation_id, ev["seq"]));
        got.push(ev);
    }
    got.sort_by_key(|e| e["seq"].as_u64());
    assert_eq!(got, seen);
    assert!(receiver.got().is_empty(), "no webhook was named");
    metrics_once(&env, "relay", "ok", seen.len() as u64).await;
}

/// The default policy: no `http`, no loopback, no relays from jobs.
fn strict(_: &mut OrchestratorConfig) {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_on_a_private_address_or_the_fleet_prefix_ends_the_job_at_once() {
    let receiver = Receiver::start().await;
    // The profile's sink is refused at start under the strict policy, so
    // this fleet has none.
    let env = Env::start_with(
        script(),
        Options {
            workers: Vec::new(),
            tweak: strict,
            env: vec![("TOOLFLEET_SINK_SECRET", SECRET)],
            data_source: None,
            ..Options::default()
        },
    )
    .await;
    let mut dead = env.subscribe("toolfleet.deadletter.>".to_string()).await;
    let https_loopback = format!("https://127.0.0.1:{}/hook", receiver.addr.port());
    for (webhook, relay, says) in [
        (Some(receiver.url("hook")), None, "loopback"),
        (
            Some("http://hooks.example.com/x".to_string()),
            None,
            "only https",
        ),
        (Some(https_loopback), None, "loopback"),
        (Some("https://10.1.2.3/hook".to_string()), None, "private"),
        (
            Some("https://user:pw@hooks.example.com/x".to_string()),
            None,
            "credentials",
        ),
        (None, Some("toolfleet.chat.events.default.x"), "own prefix"),
        (
            None,
            Some("partner.answers.default.eu"),
            "no relay subjects",
        ),
    ] {
        let job = with_sink("Route this.", webhook.clone(), relay, SinkEvents::All);
        match env.submit(&job).await {
            Err(ClientError::Failed { code, message }) => {
                assert_eq!(code, "invalid_sink", "{webhook:?} {relay:?}: {message}");
                assert!(message.contains(says), "{webhook:?} {relay:?}: {message}");
            }
            other => panic!("{webhook:?} {relay:?}: {other:?}"),
        }
    }
    assert!(env.model.requests().is_empty(), "no model call was made");
    assert!(receiver.got().is_empty(), "nothing was delivered");
    support::assert_silent(
        &mut dead,
        Duration::from_millis(500),
        "a refused sink is not a dead letter",
    )
    .await;
    let text = env.metrics_text().await;
    assert_eq!(metric(&text, "webhook", "refused"), 5);
    assert_eq!(metric(&text, "relay", "refused"), 2);
    assert_eq!(metric(&text, "webhook", "ok"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_sink_the_policy_refuses_stops_the_orchestrator_start() {
    let receiver = Receiver::start().await;
    let nats = toolfleet_local::servers::NatsServer::start().expect("nats-server");
    let redis = toolfleet_local::servers::RedisServer::start().expect("redis-server");
    let profiles = toolfleet_config::FleetConfig::from_toml(
        &format!(
            "[deployments.d]\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\n\
             [profiles.default]\ndeployment = \"d\"\nsink = \"acme\"\n\
             [sinks.acme]\nurl = \"{}\"\nsecret_env = \"S\"\n",
            receiver.url("hook")
        ),
        "test",
    )
    .unwrap();
    let config = OrchestratorConfig::new(
        toolfleet_protocol::Subjects::new("toolfleet").unwrap(),
        profiles,
    );
    let client = async_nats::connect(nats.url()).await.unwrap();
    let store =
        toolfleet_store::CitationStore::connect(&redis.url(), "toolfleet", Duration::from_secs(60))
            .await
            .unwrap();
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let ran = tokio::time::timeout(
        WAIT,
        toolfleet_orchestrator::run(client, store, config, metrics, shutdown),
    )
    .await
    .expect("the start fails in time");
    match ran {
        Err(toolfleet_orchestrator::OrchestratorError::Config(e)) => {
            assert!(
                e.contains("sinks.acme.url") && e.contains("loopback"),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sinks_stream_message_without_its_destination_is_dead_lettered_not_retried() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback).await;
    let mut dead = sink_dead_letters(&env).await;
    let js = async_nats::jetstream::new(env.client.clone());
    js.publish(
        env.subjects.sink("default", "inv-forged"),
        json!({ "invocationId": "inv-forged", "seq": 0, "type": "completed" })
            .to_string()
            .into(),
    )
    .await
    .unwrap()
    .await
    .expect("the sinks stream stores it");
    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["code"], "bad_sink_message", "{letter}");
    assert_eq!(letter["attempts"], 1, "{letter}");
    assert!(
        letter["error"].as_str().unwrap().contains("Toolfleet-Sink"),
        "{letter}"
    );
    assert!(receiver.got().is_empty());
}

/// [`loopback`], with jobs' webhooks kept to the strict policy.
fn loopback_for_configured_sinks_only(config: &mut OrchestratorConfig) {
    loopback(config);
    config.sinks.job_exceptions = false;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_webhook_whose_name_resolves_to_a_private_address_is_dead_lettered_unsent() {
    let receiver = Receiver::start().await;
    let env = fleet(&receiver, loopback_for_configured_sinks_only).await;
    let mut dead = sink_dead_letters(&env).await;
    // Gate 1 passes (https, a name, port 443); the name resolves to
    // loopback, which jobs' webhooks may not reach although configured
    // sinks here may.
    let job = with_sink(
        "Route to a name on loopback.",
        Some("https://localhost/hook".to_string()),
        None,
        SinkEvents::Final,
    );
    let outcome = env.submit(&job).await.expect("the invocation completes");
    assert_eq!(outcome.text, "Routed answer.");
    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["kind"], "sink", "{letter}");
    assert_eq!(letter["code"], "ssrf_blocked", "{letter}");
    assert_eq!(letter["attempts"], 1, "not retried: {letter}");
    assert!(
        !letter.to_string().contains("/hook"),
        "no path in the dead letter: {letter}"
    );
    assert!(receiver.got().is_empty());
    metrics_once(&env, "webhook", "refused", 1).await;
}

/// A secret being rotated: the new key first, the old one after it
/// (`webhook-signature` then carries a signature of each).
const ROTATING_SECRET: &str = "whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IGpvYiBzZWNyZXQ= \
                               whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IG9sZCBzZWNyZXQ=";
const OLD_SECRET: &str = "whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IG9sZCBzZWNyZXQ=";
const WRONG_SECRET: &str = "whsec_dG9vbGZsZWV0IHNpbmtzIHRlc3Q6IHdyb25nIGtleSE=";

/// `tests/clients/standard_webhooks_receiver.py`: deliveries verified by
/// the official `standardwebhooks` Python package, one JSON line each.
struct PythonReceiver {
    port: u16,
    lines: tokio::sync::Mutex<tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>>,
    got: Mutex<Vec<Value>>,
    _child: tokio::process::Child,
}

impl PythonReceiver {
    /// Starts the receiver with `secrets` (path name → `whsec_` secret).
    async fn start(secrets: Value) -> Self {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new("python3")
            .arg(support::root().join("tests/clients/standard_webhooks_receiver.py"))
            .arg(secrets.to_string())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("the receiver starts in time")
            .unwrap()
            .unwrap_or_else(|| {
                panic!(
                    "the receiver exited: is the standardwebhooks package installed? \
                     (scripts/ensure-servers installs it: pip install standardwebhooks)"
                )
            });
        let port = serde_json::from_str::<Value>(&first).unwrap()["port"]
            .as_u64()
            .unwrap();
        Self {
            port: u16::try_from(port).unwrap(),
            lines: tokio::sync::Mutex::new(lines),
            got: Mutex::default(),
            _child: child,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }

    /// Reads deliveries (bounded) until `done` holds for all of them.
    async fn wait_until(&self, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let mut lines = self.lines.lock().await;
        tokio::time::timeout(WAIT, async {
            loop {
                let got = self.got.lock().unwrap().clone();
                if done(&got) {
                    return got;
                }
                let line = lines.next_line().await.unwrap().expect("the receiver runs");
                self.got
                    .lock()
                    .unwrap()
                    .push(serde_json::from_str(&line).unwrap());
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the receiver got only {:?}", self.got.lock().unwrap()))
    }
}

/// Real deliveries from a fleet on real servers, checked by the reference
/// Standard Webhooks library (Python) as the receiver: a configured
/// sink's secret; a job's webhook under a secret being rotated, verified
/// by a receiver that knows only the old key; a delivery refused once
/// (503) and retried under the same `webhook-id`; and a receiver with
/// another key, which the library refuses (401: dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standard_webhooks_python_library_verifies_real_deliveries() {
    let receiver = PythonReceiver::start(json!({
        "acme": ACME_SECRET,
        "new": SECRET,
        "old": OLD_SECRET,
        "wrong": WRONG_SECRET,
    }))
    .await;
    let env = fleet_at(
        &receiver.url("acme"),
        vec![
            ("TOOLFLEET_SINK_SECRET", ROTATING_SECRET),
            ("TOOLFLEET_SINK_ACME_SECRET", ACME_SECRET),
        ],
        loopback,
    )
    .await;
    let mut dead = sink_dead_letters(&env).await;

    // The profile's configured sink.
    let configured = ChatJob {
        profile: Some("routed".into()),
        ..toolfleet_protocol::client::question("Route this, please.")
    };
    let outcome = env.submit(&configured).await.expect("it completes");
    assert_eq!(outcome.text, "Routed answer.");
    // The job's own webhooks: every event to a receiver of the old key,
    // the final one to a flaky receiver of the new key, and to one with
    // another key.
    let old = with_sink(
        "Route everything.",
        Some(receiver.url("old")),
        None,
        SinkEvents::All,
    );
    let seen = non_delta_events(&env, &old).await;
    let flaky = with_sink(
        "Route once.",
        Some(receiver.url("flaky-new")),
        None,
        SinkEvents::Final,
    );
    env.submit(&flaky).await.expect("it completes");
    let wrong = with_sink(
        "Route astray.",
        Some(receiver.url("wrong")),
        None,
        SinkEvents::Final,
    );
    env.submit(&wrong)
        .await
        .expect("a refused webhook never fails the job");

    let of = |got: &[Value], path: &str| -> Vec<Value> {
        got.iter().filter(|l| l["path"] == path).cloned().collect()
    };
    let got = receiver
        .wait_until(|got| {
            of(got, "acme").len() == 1
                && of(got, "old").len() == seen.len()
                && of(got, "flaky-new").len() == 2
                && !of(got, "wrong").is_empty()
        })
        .await;

    let acme = &of(&got, "acme")[0];
    assert_eq!(acme["verified"], true, "{acme}");
    assert_eq!(acme["event"]["type"], "completed", "{acme}");
    assert_eq!(acme["tenant"], "default");
    let id = acme["id"].as_str().unwrap();
    let prefix = format!(
        "default:{}:{}:",
        configured.invocation_id, acme["event"]["seq"]
    );
    assert!(
        id.starts_with(&prefix) && id.len() == prefix.len() + 16,
        "{id}"
    );

    let mut old_got = of(&got, "old");
    for l in &old_got {
        assert_eq!(
            l["verified"], true,
            "the old key verifies during a rotation: {l}"
        );
        assert_eq!(
            l["signature"].as_str().unwrap().matches("v1,").count(),
            2,
            "{l}"
        );
    }
    old_got.sort_by_key(|l| l["event"]["seq"].as_u64());
    let events: Vec<Value> = old_got.iter().map(|l| l["event"].clone()).collect();
    assert_eq!(events, seen, "every non-delta event, verified, once");
    let ids: std::collections::BTreeSet<&str> =
        old_got.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), seen.len(), "one id per event: {ids:?}");

    let flaky_got = of(&got, "flaky-new");
    assert_eq!(flaky_got[0]["error"], "flaky: 503 to the first delivery");
    assert_eq!(flaky_got[1]["verified"], true, "{}", flaky_got[1]);
    assert_eq!(
        flaky_got[0]["id"], flaky_got[1]["id"],
        "a retry keeps its webhook-id (the idempotency key)"
    );

    let wrong_got = &of(&got, "wrong")[0];
    assert_eq!(wrong_got["verified"], false, "{wrong_got}");
    assert!(
        wrong_got["error"]
            .as_str()
            .unwrap()
            .contains("No matching signature"),
        "{wrong_got}"
    );
    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["code"], "sink_http_401", "{letter}");
    assert_eq!(letter["invocationId"], wrong.invocation_id.as_str());
}

/// A secret that is not a Standard Webhooks secret sends nothing
/// unsigned: the delivery is dead-lettered `sink_secret_invalid`, saying
/// which variable, never its value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_that_is_not_whsec_base64_is_dead_lettered_unsent() {
    let receiver = Receiver::start().await;
    let env = fleet_at(
        &receiver.url("hook"),
        vec![("TOOLFLEET_SINK_SECRET", "hunter2-not-base64!")],
        loopback,
    )
    .await;
    let mut dead = sink_dead_letters(&env).await;
    let job = with_sink(
        "Route this.",
        Some(receiver.url("hook")),
        None,
        SinkEvents::Final,
    );
    env.submit(&job).await.expect("the invocation completes");
    let letter = support::next_json(&mut dead).await;
    assert_eq!(letter["code"], "sink_secret_invalid", "{letter}");
    assert_eq!(letter["attempts"], 1, "not retried: {letter}");
    let error = letter["error"].as_str().unwrap();
    assert!(error.contains("TOOLFLEET_SINK_SECRET"), "{error}");
    assert!(!letter.to_string().contains("hunter2"), "{letter}");
    assert!(receiver.got().is_empty(), "nothing was sent");
    metrics_once(&env, "webhook", "refused", 1).await;
}
