//! Rate limits, budgets and per-run caps per tenant (issue 29, item 6 —
//! the tenant part), on real nats-server and redis-server with the
//! scripted model server standing in for the provider: a tenant over its
//! limit is refused before the model is called, with `rate_limited` /
//! `budget_exhausted` and a `retryAfterMs`; another tenant is served; two
//! orchestrators share one count (in Redis, nothing in-process).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use toolfleet_protocol::ChatJob;

use crate::support::{Env, Options, WAIT, events_until_terminal, kinds};

fn script() -> Value {
    json!({ "default": { "steps": [ { "answer": "Here is an answer." } ] } })
}

/// The scripted deployment, with `extra` tables after it.
fn profiles(extra: &str) -> String {
    format!(
        r#"
default_profile = "default"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
{extra}
"#
    )
}

fn job(tenant: &str, text: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.tenant = Some(tenant.to_owned());
    job
}

/// Every event of `job`, submitted now, until its terminal one.
async fn run(env: &Env, job: &ChatJob) -> Vec<Value> {
    let mut events = env.follow_and_submit(job).await;
    tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("the job ends in time")
}

fn terminal(events: &[Value]) -> &Value {
    events.last().expect("a terminal event")
}

/// The model requests the scripted server received so far.
fn model_calls(env: &Env) -> usize {
    env.model
        .received()
        .iter()
        .filter(|r| r.path.ends_with("/chat/completions") || r.path.ends_with("/responses"))
        .count()
}

/// Waits for the start of the next UTC minute when less than `room` of
/// the current one is left, so a scenario counting against a
/// requests-per-minute limit runs inside one window (the window is the
/// clock's; this is not a timed assertion).
async fn room_in_this_minute(room: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let into = Duration::from_millis(u64::try_from(now.as_millis() % 60_000).unwrap());
    let left = Duration::from_secs(60) - into;
    if left < room {
        tokio::time::sleep(left + Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_acme_over_its_requests_per_minute_is_rate_limited_while_globex_is_served() {
    let env = Env::start_with(
        script(),
        Options {
            profiles_toml: Some(profiles("[tenants.acme]\nrequests_per_minute = 2\n")),
            ..Options::default()
        },
    )
    .await;
    room_in_this_minute(Duration::from_secs(40)).await;
    let mut served = Vec::new();
    for n in 0..2 {
        let events = run(&env, &job("acme", "hello")).await;
        assert_eq!(
            terminal(&events)["type"],
            "completed",
            "acme's call {n}: {events:?}"
        );
        served.push(events);
    }
    // The second call used 2 of 2 (past the soft 0.8): a warning first.
    let warning = served[1]
        .iter()
        .find(|e| e["type"] == "limit_warning")
        .unwrap_or_else(|| panic!("a limit_warning on the second call: {:?}", served[1]));
    assert_eq!(warning["limit"], "requests_per_minute", "{warning}");
    assert_eq!(
        (warning["used"].as_f64(), warning["cap"].as_f64()),
        (Some(2.0), Some(2.0))
    );
    assert!(
        !served[0].iter().any(|e| e["type"] == "limit_warning"),
        "1 of 2 is under the soft limit: {:?}",
        served[0]
    );
    let calls_before = model_calls(&env);
    let refused = run(&env, &job("acme", "hello again")).await;
    let end = terminal(&refused);
    assert_eq!(end["type"], "error", "{refused:?}");
    assert_eq!(end["code"], "rate_limited", "{end}");
    let retry_after = end["retryAfterMs"].as_u64().expect("retryAfterMs");
    assert!(
        retry_after > 0 && retry_after <= 60_000,
        "retry after the minute: {end}"
    );
    assert!(
        end["message"]
            .as_str()
            .unwrap()
            .contains("requests_per_minute"),
        "{end}"
    );
    assert_eq!(
        model_calls(&env),
        calls_before,
        "a refused call never reaches the model"
    );
    // globex has no limit of its own and is served at once.
    let globex = run(&env, &job("globex", "hello")).await;
    assert_eq!(terminal(&globex)["type"], "completed", "{globex:?}");
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains(
            r#"toolfleet_tenant_limit_refusals_total{limit="requests_per_minute",tenant="acme"} 1"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_a_spent_budget_ends_acmes_next_job_after_a_soft_limit_warning() {
    // A dollar a token: acme's first call spends far more than its day's
    // budget, which it may (the call was admitted with nothing spent —
    // the documented overshoot); its next job is refused.
    let env = Env::start_with(
        script(),
        Options {
            profiles_toml: Some(profiles(
                r#"[prices."toolfleet-scripted"]
input = 1000000.0
output = 1000000.0
[tenants.acme]
spend_per_day_usd = 5.0
[tenants.globex]
spend_per_day_usd = 100000.0
"#,
            )),
            ..Options::default()
        },
    )
    .await;
    let first = run(&env, &job("acme", "hello")).await;
    assert_eq!(terminal(&first)["type"], "completed", "{first:?}");
    let warning = first
        .iter()
        .find(|e| e["type"] == "limit_warning")
        .unwrap_or_else(|| panic!("a limit_warning before the budget is spent: {first:?}"));
    assert_eq!(warning["limit"], "spend_per_day_usd", "{warning}");
    assert_eq!(warning["cap"], 5.0, "{warning}");
    assert!(warning["used"].as_f64().unwrap() >= 4.0, "{warning}");
    let at = kinds(&first);
    assert!(
        at.iter().position(|k| *k == "limit_warning") < at.iter().position(|k| *k == "completed"),
        "{at:?}"
    );
    let calls_before = model_calls(&env);
    let second = run(&env, &job("acme", "hello again")).await;
    let end = terminal(&second);
    assert_eq!(end["code"], "budget_exhausted", "{second:?}");
    assert!(end["retryAfterMs"].as_u64().expect("retryAfterMs") <= 86_400_000);
    assert!(
        end["message"]
            .as_str()
            .unwrap()
            .contains("spend_per_day_usd"),
        "{end}"
    );
    assert_eq!(
        model_calls(&env),
        calls_before,
        "no model call once it is spent"
    );
    // globex's budget is its own.
    let globex = run(&env, &job("globex", "hello")).await;
    assert_eq!(terminal(&globex)["type"], "completed", "{globex:?}");
    assert!(
        !globex.iter().any(|e| e["type"] == "limit_warning"),
        "{globex:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_a_run_over_max_run_tokens_ends_with_run_limit_exceeded() {
    // Two rounds: a tool call, then the answer; the first round's tokens
    // are over acme's cap, so the second model call is not made.
    let script = json!({
        "rules": [{
            "whenUserContains": ["time"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "It is {{tool:current_datetime}}." }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let env = Env::start_with(
        script,
        Options {
            profiles_toml: Some(profiles("[tenants.acme]\nmax_run_tokens = 1\n")),
            workers: vec!["system"],
            ..Options::default()
        },
    )
    .await;
    let events = run(&env, &job("acme", "what time is it")).await;
    let end = terminal(&events);
    assert_eq!(end["code"], "run_limit_exceeded", "{events:?}");
    assert!(
        end["message"].as_str().unwrap().contains("max_run_tokens"),
        "{end}"
    );
    assert_eq!(model_calls(&env), 1, "the second round is never asked for");
    // Another tenant's run goes on to its answer.
    let globex = run(&env, &job("globex", "what time is it")).await;
    assert_eq!(terminal(&globex)["type"], "completed", "{globex:?}");
}

/// An orchestrator of its own, as another process would be: its own NATS
/// and Redis connections, its own metrics; only Redis is shared.
async fn second_orchestrator(env: &Env, limits: &str) -> toolfleet_service::Runtime {
    let profiles = toolfleet_config::FleetConfig::from_toml(
        &profiles(limits).replace("{base_url}", env.model.base_url().as_str()),
        "second orchestrator",
    )
    .unwrap();
    let config = toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    crate::support::start_orchestrator(env.nats.url(), env.redis.url(), config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_two_orchestrators_share_one_requests_per_minute() {
    let limits = "[tenants.acme]\nrequests_per_minute = 3\n";
    // Orchestrator A alone (the harness's), then B alone: B knows of A's
    // calls only through Redis.
    let env = Env::start_with(
        script(),
        Options {
            profiles_toml: Some(profiles(limits)),
            ..Options::default()
        },
    )
    .await;
    room_in_this_minute(Duration::from_secs(40)).await;
    for _ in 0..2 {
        let events = run(&env, &job("acme", "hello")).await;
        assert_eq!(terminal(&events)["type"], "completed", "{events:?}");
    }
    env.shutdown.cancel();
    env.tracker.close();
    tokio::time::timeout(WAIT, env.tracker.wait())
        .await
        .expect("orchestrator A stops");
    let b = second_orchestrator(&env, limits).await;
    let third = run(&env, &job("acme", "hello")).await;
    assert_eq!(terminal(&third)["type"], "completed", "{third:?}");
    let fourth = run(&env, &job("acme", "hello")).await;
    assert_eq!(terminal(&fourth)["code"], "rate_limited", "{fourth:?}");
    assert_eq!(model_calls(&env), 3, "A's two calls and B's one: the limit");
    // Both at once: a burst through B and a third orchestrator C, still
    // within the same minute, gets no call past the limit (a request is
    // counted in the same step as its check: no overshoot).
    let c = second_orchestrator(&env, limits).await;
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let job = job("acme", "hello");
            let env = &env;
            async move { run(env, &job).await }
        })
        .collect();
    for events in futures::future::join_all(burst).await {
        assert_eq!(terminal(&events)["code"], "rate_limited", "{events:?}");
    }
    assert_eq!(model_calls(&env), 3);
    b.shutdown.cancel();
    c.shutdown.cancel();
}
