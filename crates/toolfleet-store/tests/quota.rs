//! A tenant's fleet-wide limits in Redis (`toolfleet_store::quota`), on a
//! real redis-server and a real three-master Redis Cluster.

use std::time::{Duration, SystemTime};

use toolfleet_store::CitationStore;
use toolfleet_store::quota::{Admission, QuotaLimit, QuotaLimits, QuotaWindows};
use toolfleet_testkit::redis_cluster::RedisCluster;
use toolfleet_testkit::servers::RedisServer;
use toolfleet_testkit::wait::WAIT;

const TTL: Duration = Duration::from_secs(600);

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("the store answered in time")
}

fn refused(a: &Admission) -> Option<QuotaLimit> {
    match a {
        Admission::Admitted(_) => None,
        Admission::Refused { limit, .. } => Some(*limit),
    }
}

/// The checks every deployment shape must pass, at one fixed moment (so
/// no window turns over mid-test).
async fn limits_hold(store: &CitationStore) {
    let windows = QuotaWindows::at(SystemTime::now());
    let rpm = QuotaLimits {
        requests_per_minute: 2,
        ..QuotaLimits::default()
    };
    // Two admitted, the third refused until the minute ends; a repeated
    // token (a retry after a lost answer) is not counted again.
    let a = within(store.admit_model_call("acme", &rpm, &windows, "t1"))
        .await
        .unwrap();
    assert_eq!(refused(&a), None);
    let again = within(store.admit_model_call("acme", &rpm, &windows, "t1"))
        .await
        .unwrap();
    assert_eq!(refused(&again), None);
    let b = within(store.admit_model_call("acme", &rpm, &windows, "t2"))
        .await
        .unwrap();
    let Admission::Admitted(usage) = b else {
        panic!("{b:?}")
    };
    assert_eq!(usage.requests, 2);
    let c = within(store.admit_model_call("acme", &rpm, &windows, "t3"))
        .await
        .unwrap();
    let Admission::Refused {
        limit,
        usage,
        retry_after,
    } = c
    else {
        panic!("{c:?}")
    };
    assert_eq!(limit, QuotaLimit::RequestsPerMinute);
    assert_eq!(usage.requests, 2, "a refused call is not counted");
    assert_eq!(retry_after, windows.minute_left);
    // Another tenant's count is its own.
    let g = within(store.admit_model_call("globex", &rpm, &windows, "t3"))
        .await
        .unwrap();
    assert_eq!(refused(&g), None);

    // Tokens and spend are added after a call; a repeated token adds
    // nothing; once a budget is used the next call is refused.
    let budget = QuotaLimits {
        tokens_per_minute: 1_000,
        spend_per_day_micros: 5_000_000,
        spend_per_month_micros: 50_000_000,
        ..QuotaLimits::default()
    };
    let used = within(store.record_model_usage("initech", &windows, 400, 3_000_000, "u1"))
        .await
        .unwrap();
    assert_eq!(
        (used.tokens, used.spend_day_micros, used.spend_month_micros),
        (400, 3_000_000, 3_000_000)
    );
    let same = within(store.record_model_usage("initech", &windows, 400, 3_000_000, "u1"))
        .await
        .unwrap();
    assert_eq!(same, used, "the same call is counted once");
    let ok = within(store.admit_model_call("initech", &budget, &windows, "t4"))
        .await
        .unwrap();
    assert_eq!(refused(&ok), None);
    within(store.record_model_usage("initech", &windows, 700, 2_000_000, "u2"))
        .await
        .unwrap();
    let over = within(store.admit_model_call("initech", &budget, &windows, "t5"))
        .await
        .unwrap();
    let Admission::Refused {
        limit, retry_after, ..
    } = over
    else {
        panic!("{over:?}")
    };
    assert_eq!(limit, QuotaLimit::SpendPerDay, "a budget before a rate");
    assert_eq!(retry_after, windows.day_left);
    let rates_only = QuotaLimits {
        tokens_per_minute: 1_000,
        ..QuotaLimits::default()
    };
    let over = within(store.admit_model_call("initech", &rates_only, &windows, "t6"))
        .await
        .unwrap();
    assert_eq!(refused(&over), Some(QuotaLimit::TokensPerMinute));
    let month = QuotaLimits {
        spend_per_month_micros: 5_000_000,
        ..QuotaLimits::default()
    };
    let over = within(store.admit_model_call("initech", &month, &windows, "t7"))
        .await
        .unwrap();
    assert_eq!(refused(&over), Some(QuotaLimit::SpendPerMonth));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_counts_admit_refuse_and_count_once() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    limits_hold(&store).await;
    // Every key has a TTL.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tf:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(!keys.is_empty());
    for key in keys {
        assert!(key.contains(":quota:"), "{key}");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(ttl > 0, "{key} has no TTL");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_works_on_a_three_master_cluster() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3).unwrap())
        .await
        .unwrap();
    let store = within(CitationStore::connect(&cluster.url(), "tf", TTL))
        .await
        .unwrap();
    // A script touching keys of two slots would fail with CROSSSLOT here.
    limits_hold(&store).await;
}
