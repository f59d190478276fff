//! Cancel floods (issue 29, item 4), attacked as tenant `acme` would
//! attack tenant `globex`: a real `nats-server` running the shipped
//! `ops/nats/auth.conf`, the orchestrator under its own identity, each
//! tenant's client under its own, real Redis. The scripted model server
//! stands in for the provider.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::ChatJob;

use crate::support::{WAIT, next_json};
use crate::tenant_config::Secured;

const FLOOD: u64 = 20_000;
/// acme's bound on remembered cancels in this test's configuration.
const ACME_REMEMBERED: u64 = 500;

const PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[profiles.default]
deployment = "scripted"

[tenants.acme]
remembered_cancels = 500
"#;

fn script() -> Value {
    json!({
        "rules": [{ "whenUserContains": ["slow"], "steps": [
            { "fault": { "kind": "slowFirstToken", "delayMs": 60000 }, "answer": "too late" } ] }],
        "default": { "steps": [ { "answer": "ran" } ] }
    })
}

fn job_of(tenant: &str, text: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.tenant = Some(tenant.into());
    job
}

/// Follows `job`'s events, then submits it as `client`.
async fn follow_and_submit(
    fleet: &Secured,
    client: &async_nats::Client,
    job: &ChatJob,
) -> async_nats::Subscriber {
    let body = serde_json::to_vec(job).unwrap();
    fleet
        .follow_and_publish(client, job.tenant(), &job.invocation_id, body)
        .await
}

/// The terminal event among `events`.
async fn terminal(events: &mut async_nats::Subscriber) -> Value {
    loop {
        let ev = next_json(events).await;
        if ev["type"] == "completed" || ev["type"] == "error" {
            return ev;
        }
    }
}

/// `toolfleet_cancels_total` of `tenant`, by outcome.
fn cancels_of(registry: &prometheus::Registry, tenant: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for family in registry.gather() {
        if family.name() != "toolfleet_cancels_total" {
            continue;
        }
        for m in family.get_metric() {
            let label = |name: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == name)
                    .map(|l| l.value().to_owned())
            };
            if label("tenant").as_deref() == Some(tenant) {
                let outcome = label("outcome").unwrap_or_default();
                out.insert(outcome, m.get_counter().get_value() as u64);
            }
        }
    }
    out
}

async fn redis_keys(fleet: &Secured, pattern: &str) -> Vec<String> {
    let mut conn = redis::Client::open(fleet.redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// acme floods 20,000 cancels for ids that exist nowhere while globex's
/// job runs: globex's cancel still ends its job `cancelled`, globex's
/// cancel of a job not started yet is still honoured, and Redis holds one
/// key for acme's whole flood, with at most acme's `remembered_cancels`
/// ids in it (before: a 24 h tombstone key per cancel, 20,000 keys). The
/// cancels over acme's rate are counted, never written down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_a_flood_of_unknown_ids_stays_bounded_and_globex_still_cancels() {
    let fleet = Secured::start(script(), PROFILES).await;
    let acme = fleet.connect("client-acme").await;
    let globex = fleet.connect("client-globex").await;

    let running = job_of("globex", "a slow question");
    let mut events = follow_and_submit(&fleet, &globex, &running).await;
    assert_eq!(next_json(&mut events).await["type"], "started");
    tokio::time::timeout(WAIT, fleet.model.wait_for_streams(|s| s.started >= 1))
        .await
        .expect("globex's model stream began");

    for n in 0..FLOOD {
        acme.publish(
            fleet.subjects.chat_cancel("acme", &format!("flood-{n}")),
            "".into(),
        )
        .await
        .unwrap();
    }
    acme.flush().await.unwrap();
    globex
        .publish(
            fleet.subjects.chat_cancel("globex", &running.invocation_id),
            "".into(),
        )
        .await
        .unwrap();
    globex.flush().await.unwrap();
    let end = terminal(&mut events).await;
    assert_eq!(end["type"], "error", "{end}");
    assert_eq!(end["code"], "cancelled", "{end}");

    // Every one of acme's cancels was heard and handled (a cancel written
    // down is counted once written).
    let deadline = tokio::time::Instant::now() + WAIT;
    let counts = loop {
        let counts = cancels_of(&fleet.metrics, "acme");
        if counts.values().sum::<u64>() >= FLOOD {
            break counts;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "acme's cancels not all heard: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(counts.values().sum::<u64>(), FLOOD, "{counts:?}");
    assert!(
        counts.get("rate_limited").copied().unwrap_or(0) > 0,
        "{counts:?}"
    );
    assert_eq!(
        counts.get("tombstone").copied().unwrap_or(0),
        0,
        "{counts:?}"
    );
    let admitted = counts.get("remembered").copied().unwrap_or(0);
    assert!(admitted > 0, "{counts:?}");

    let acme_keys = redis_keys(&fleet, "toolfleet:{acme*").await;
    assert_eq!(
        acme_keys,
        ["toolfleet:{acme}:cancels"],
        "one key for the flood"
    );
    let remembered = fleet
        .store()
        .await
        .remembered_cancel_count("acme")
        .await
        .unwrap();
    assert!(
        remembered <= ACME_REMEMBERED,
        "{remembered} remembered; the bound is {ACME_REMEMBERED}"
    );
    let all = redis_keys(&fleet, "*").await;
    assert!(all.len() < 20, "Redis keys after the flood: {all:?}");

    // globex's cancel of a job it has not submitted yet is remembered, and
    // the job ends `cancelled` without the model being asked.
    let queued = job_of("globex", "a queued question");
    globex
        .publish(
            fleet.subjects.chat_cancel("globex", &queued.invocation_id),
            "".into(),
        )
        .await
        .unwrap();
    globex.flush().await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while cancels_of(&fleet.metrics, "globex")
        .get("remembered")
        .copied()
        .unwrap_or(0)
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "globex's cancel not written down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked_before = fleet.model.requests().len();
    let mut events = follow_and_submit(&fleet, &globex, &queued).await;
    let end = terminal(&mut events).await;
    assert_eq!(end["code"], "cancelled", "{end}");
    assert_eq!(
        fleet.model.requests().len(),
        asked_before,
        "the model was asked"
    );
}
