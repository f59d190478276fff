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

const SECRET: &str = "whsec-test-only-5f1c";
const ACME_SECRET: &str = "whsec-acme-test-only-9d2e";

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
        receiver.url("hook")
    );
    Env::start_with(
        script(),
        Options {
            workers: Vec::new(),
            tweak,
            profiles_toml: Some(profiles),
            env: vec![
                ("TOOLFLEET_SINK_SECRET", SECRET),
                ("TOOLFLEET_SINK_ACME_SECRET", ACME_SECRET),
            ],
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

/// Checks `Toolfleet-Signature` as a receiver would: HMAC-SHA256 with the
/// secret over `<t>.<tenant>.<body>` (the tenant the receiver expects:
/// the jobs here run as `default`), compared in constant time.
fn assert_signed(r: &Received, secret: &str) {
    assert_eq!(r.headers["toolfleet-tenant"], "default");
    let header = r.headers["toolfleet-signature"].to_str().unwrap();
    let (t, v1) = header
        .split_once(',')
        .and_then(|(t, v)| Some((t.strip_prefix("t=")?, v.strip_prefix("v1=")?)))
        .unwrap_or_else(|| panic!("{header}"));
    let t: u64 = t.parse().unwrap();
    let mac: Vec<u8> = (0..v1.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v1[i..i + 2], 16).unwrap())
        .collect();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let mut signed = format!("{t}.default.").into_bytes();
    signed.extend_from_slice(&r.body);
    ring::hmac::verify(&key, &signed, &mac).expect("the signature verifies with the secret");
    // Signed for another tenant, it would not verify.
    let mut other = format!("{t}.globex.").into_bytes();
    other.extend_from_slice(&r.body);
    assert!(ring::hmac::verify(&key, &other, &mac).is_err());
    let wrong = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"another secret");
    assert!(ring::hmac::verify(&wrong, &signed, &mac).is_err());
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

fn event_id(r: &Received) -> String {
    r.headers["toolfleet-event-id"].to_str().unwrap().to_owned()
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
