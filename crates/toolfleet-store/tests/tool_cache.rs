//! The tool-result cache's store on real servers: one `redis-server`, and a
//! three-master Redis Cluster (every key of a tool under one hash tag, so a
//! lookup, a store and a purge each touch one slot); a purge is one
//! generation, per tenant or for all; a store that raced a purge keeps
//! nothing; a server that is gone is an `Unavailable` error at once, not
//! after the retry budget.

use std::time::Duration;

use serde_json::json;
use toolfleet_protocol::tools::{CacheScope, ToolId};
use toolfleet_protocol::{ToolResult, ToolStatus};
use toolfleet_store::tool_cache::{CacheKey, CallScope, LOOKUP_TIMEOUT, Lookup};
use toolfleet_store::{CitationStore, RedisOptions};
use toolfleet_testkit::redis_cluster::RedisCluster;
use toolfleet_testkit::servers::RedisServer;

const WAIT: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("the store answered in time")
}

fn result(content: &str) -> ToolResult {
    let result: ToolResult = serde_json::from_value(json!({
        "invocationId": "inv-1",
        "callId": "call_1",
        "toolId": "units:convert@1.0.0",
        "status": "ok",
        "content": content,
        "attempt": 1,
        "durationMs": 3
    }))
    .unwrap();
    assert_eq!(result.status, ToolStatus::Ok);
    result
}

fn key(tenant: &str, scope: CacheScope) -> CacheKey {
    let tool: ToolId = "units:convert@1.0.0".parse().unwrap();
    CacheKey::new(
        &tool,
        scope,
        &json!({ "value": 1, "from": "m", "to": "cm" }),
        &CallScope {
            tenant,
            ..CallScope::default()
        },
    )
    .unwrap()
}

/// Looks `key` up: the stored content on a hit, `None` on a miss.
async fn hit(store: &CitationStore, key: &CacheKey) -> Option<String> {
    match within(store.cache_lookup(key)).await.unwrap() {
        Lookup::Hit(r) => Some(r.content),
        Lookup::Miss(_) => None,
    }
}

async fn put(store: &CitationStore, key: &CacheKey, content: &str) -> bool {
    let Lookup::Miss(gens) = within(store.cache_lookup(key)).await.unwrap() else {
        panic!("a hit where a miss was expected");
    };
    within(store.cache_store(key, gens, &result(content), TTL))
        .await
        .unwrap()
}

/// Stores, hits, purges one tenant, then every tenant; a global entry
/// outlives a tenant's purge.
async fn purges_by_generation(store: &CitationStore) {
    let (acme, globex) = (
        key("acme", CacheScope::Tenant),
        key("globex", CacheScope::Tenant),
    );
    let global = key("acme", CacheScope::Global);
    for (k, content) in [(&acme, "acme"), (&globex, "globex"), (&global, "global")] {
        assert_eq!(hit(store, k).await, None);
        assert!(put(store, k, content).await);
        assert_eq!(hit(store, k).await.as_deref(), Some(content));
    }
    assert_eq!(
        within(store.cache_purge("units:convert", Some("acme")))
            .await
            .unwrap(),
        1
    );
    assert_eq!(hit(store, &acme).await, None, "acme's purged");
    assert_eq!(hit(store, &globex).await.as_deref(), Some("globex"));
    assert_eq!(hit(store, &global).await.as_deref(), Some("global"));

    within(store.cache_purge("units:convert", None))
        .await
        .unwrap();
    for k in [&globex, &global] {
        assert_eq!(hit(store, k).await, None, "everyone's purged");
    }
    // Stored again under the new generations, given again.
    assert!(put(store, &acme, "acme again").await);
    assert_eq!(hit(store, &acme).await.as_deref(), Some("acme again"));

    // A store whose lookup came before a purge keeps nothing.
    let Lookup::Miss(gens) = within(store.cache_lookup(&globex)).await.unwrap() else {
        panic!("globex was purged");
    };
    within(store.cache_purge("units:convert", Some("globex")))
        .await
        .unwrap();
    assert!(
        !within(store.cache_store(&globex, gens, &result("stale"), TTL))
            .await
            .unwrap()
    );
    assert_eq!(hit(store, &globex).await, None);

    for bad in ["units", "Units:convert", "units:con vert"] {
        assert!(within(store.cache_purge(bad, None)).await.is_err(), "{bad}");
    }
    assert!(
        within(store.cache_purge("units:convert", Some("a b")))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_is_one_generation_per_tenant_or_for_all() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    purges_by_generation(&store).await;
    // Every key has a TTL, the generations' outliving any entry's.
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tf:{tc:units:convert}:*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(keys.iter().any(|k| k.ends_with(":gen")), "{keys:?}");
    for k in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(k).query_async(&mut c).await.unwrap();
        let most = if k.contains(":gen") {
            8 * 86_400_000
        } else {
            60_000
        };
        assert!(ttl > 0 && ttl <= most, "{k}: {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_works_on_a_three_master_cluster() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3).unwrap())
        .await
        .unwrap();
    let store = within(CitationStore::connect(&cluster.url(), "tf", TTL))
        .await
        .unwrap();
    purges_by_generation(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_that_is_gone_fails_at_once_as_unavailable() {
    let mut redis = RedisServer::start().unwrap();
    // A retry budget far longer than the lookup's one try: the lookup
    // must not spend it.
    let options = RedisOptions {
        retry_budget: Duration::from_secs(60),
        ..RedisOptions::new(redis.url())
    };
    let store = within(CitationStore::connect_with(&options, "tf", TTL))
        .await
        .unwrap();
    let k = key("acme", CacheScope::Tenant);
    assert!(put(&store, &k, "kept").await);
    redis.stop();
    // One try (bounded by LOOKUP_TIMEOUT), not the store's retries: the
    // caller runs the call instead of waiting for Redis.
    const { assert!(LOOKUP_TIMEOUT.as_millis() < 1000) };
    let error = tokio::time::timeout(Duration::from_secs(20), store.cache_lookup(&k))
        .await
        .expect("the lookup gave up long before the retry budget")
        .unwrap_err();
    assert!(error.is_unavailable(), "{error}");
}
