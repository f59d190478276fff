//! A deployment's fleet-wide limits (issue 29): `max_concurrency` and
//! `requests_per_minute` hold across orchestrators, calls past them queue
//! instead of failing, and a 429 with `Retry-After` holds every caller of
//! the deployment. Real NATS and Redis, the scripted model (which records
//! when each request arrived). Orders and spacings are asserted against
//! the model's own delay, never a wall-clock budget.

use std::time::Duration;

use crate::fair::Bench;

/// The configuration of a deployment `limited` (on the scripted model)
/// with `keys`, which acme's jobs use.
fn limited(bench: &Bench, keys: &str) -> String {
    format!(
        "[deployments.limited]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n{keys}\n\
         [profiles.limited]\ndeployment = \"limited\"\n\
         [tenants.acme]\ndefault_profile = \"limited\"\n",
        bench.model.base_url()
    )
}

/// The most requests the model was answering at once, counting each as
/// running for `took` from its arrival.
fn most_at_once(bench: &Bench, took: Duration) -> usize {
    let arrivals: Vec<_> = bench.model.received().iter().map(|r| r.at).collect();
    crate::support::most_at_once(&arrivals, took)
}

/// Two orchestrators with 8 slots each, a deployment allowing 2 calls at
/// once: 10 jobs all complete (queued, none refused), and the model never
/// answers more than 2 at once. Without the limit all 10 ran together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_concurrency_holds_across_orchestrators_and_calls_queue() {
    let mut bench = Bench::start(400).await;
    let config = limited(&bench, "max_concurrency = 2");
    let mut endings = bench.endings().await;
    bench.orchestrator(8, &config).await;
    bench.orchestrator(8, &config).await;
    bench.queue("acme", 10).await;
    let ended = endings.next(10).await;
    assert_eq!(ended.len(), 10);
    let most = most_at_once(&bench, Duration::from_millis(350));
    assert!(most <= 2, "{most} calls at once");
    bench.stop().await;
}

/// `requests_per_minute = 3`: three calls start, the fourth waits for the
/// next minute instead of failing (it is still waiting when the others
/// have ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_requests_per_minute_hold_and_the_rest_wait() {
    let mut bench = Bench::start(0).await;
    let config = limited(&bench, "requests_per_minute = 3");
    let mut endings = bench.endings().await;
    bench.orchestrator(8, &config).await;
    // Within one minute (a test started in its last seconds sees the
    // minute turn: then all may pass, which proves nothing either way).
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 60;
    if second > 50 {
        tokio::time::sleep(Duration::from_secs(61 - second)).await;
    }
    bench.queue("acme", 4).await;
    assert_eq!(endings.next(3).await.len(), 3);
    // The fourth has not reached the model: it waits for its minute.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(bench.model.received().len(), 3);
    bench.abandon();
}

/// The first call meets a 429 with `Retry-After: 1.5 s`: the deployment is
/// paused fleet-wide, so a job that another orchestrator takes meanwhile
/// reaches the model only after the pause (without the pause it was
/// answered at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_holds_every_caller_of_the_deployment() {
    let mut bench = Bench::with_script(serde_json::json!({
        "default": { "steps": [ {
            "answer": "done",
            "fault": { "kind": "status", "status": 429, "retryAfterMs": 1500, "times": 1 }
        } ] }
    }))
    .await;
    let config = limited(&bench, "max_concurrency = 100");
    let mut endings = bench.endings().await;
    bench.orchestrator(1, &config).await;
    bench.queue("acme", 1).await;
    // The 429 has been answered.
    tokio::time::timeout(crate::support::WAIT, async {
        while bench.model.fault_hits() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the first call met its 429");
    bench.orchestrator(1, &config).await;
    bench.queue("acme", 1).await;
    assert_eq!(endings.next(2).await.len(), 2);
    let received = bench.model.received();
    let first = received[0].at;
    for later in &received[1..] {
        let after = later.at - first;
        assert!(
            after >= Duration::from_millis(1400),
            "a call reached the model {after:?} after the 429"
        );
    }
    bench.stop().await;
}
