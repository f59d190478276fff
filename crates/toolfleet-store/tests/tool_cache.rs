//! The tool-result cache's store on real servers: one `redis-server`, and a
//! three-master Redis Cluster (every key of a tool under one hash tag, so a
//! lookup, a store and a purge each touch one slot); a purge is one
//! generation, per tenant or for all; a store that raced a purge keeps
//! nothing; a lost generation key never brings purged entries back; a
//! result over the size cap is not kept; a server that is gone is an
//! `Unavailable` error at once, not after the retry budget, and keeps the
//! cache passed by (the breaker) until the breaker's time is up.

use std::time::Duration;

use serde_json::json;
use toolfleet_protocol::tools::{CacheScope, ToolId};
use toolfleet_protocol::{ToolResult, ToolStatus};
use toolfleet_store::tool_cache::{
    BREAKER_OPEN_FOR, CacheKey, CallScope, LOOKUP_TIMEOUT, Lookup, MAX_ENTRY_BYTES, Stored,
};
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
    let stored = within(store.cache_store(key, gens, &result(content), TTL))
        .await
        .unwrap();
    stored == Stored::Kept
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
    let purged = within(store.cache_purge("units:convert", Some("acme")))
        .await
        .unwrap();
    assert!(purged.known, "acme's generation was set by its store");
    assert!(
        purged.generation > 1 << 32,
        "a fresh generation: {purged:?}"
    );
    let never = within(store.cache_purge("units:never", Some("acme")))
        .await
        .unwrap();
    assert!(!never.known, "nothing was ever stored for units:never");
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
    assert_eq!(
        within(store.cache_store(&globex, gens, &result("stale"), TTL))
            .await
            .unwrap(),
        Stored::Purged
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

/// A connection to `redis` of the test's own.
async fn raw(redis: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_generation_never_brings_purged_results_back() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let k = key("acme", CacheScope::Tenant);
    assert!(put(&store, &k, "before the purge").await);
    within(store.cache_purge("units:convert", Some("acme")))
        .await
        .unwrap();
    assert_eq!(hit(&store, &k).await, None);
    // Redis loses the generations (an evicting Redis, a hand's DEL): the
    // entry from before the purge is still there, and must stay dead.
    let mut c = raw(&redis).await;
    let gens = [
        "tf:{tc:units:convert}:gen",
        "tf:{tc:units:convert}:gen:acme",
    ];
    let deleted: u64 = redis::cmd("DEL")
        .arg(&gens)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(deleted, 2);
    let entries: Vec<String> = redis::cmd("KEYS")
        .arg("tf:{tc:units:convert}:e:*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "the purged entry lives on: {entries:?}");
    assert_eq!(
        hit(&store, &k).await,
        None,
        "a missing generation is unknown"
    );
    // A store starts the generations again from fresh random numbers,
    // never from zero.
    assert!(put(&store, &k, "after").await);
    assert_eq!(hit(&store, &k).await.as_deref(), Some("after"));
    let values: Vec<u64> = redis::cmd("MGET")
        .arg(&gens)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(values.iter().all(|g| *g > 1 << 32), "{values:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_over_the_size_cap_is_not_kept() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let k = key("acme", CacheScope::Tenant);
    let Lookup::Miss(gens) = within(store.cache_lookup(&k)).await.unwrap() else {
        panic!("a hit in an empty Redis");
    };
    let big = "x".repeat(MAX_ENTRY_BYTES);
    assert_eq!(
        within(store.cache_store(&k, gens, &result(&big), TTL))
            .await
            .unwrap(),
        Stored::TooLarge
    );
    assert_eq!(hit(&store, &k).await, None);
    let mut c = raw(&redis).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tf:*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(keys.is_empty(), "nothing written: {keys:?}");
    // Just under the cap: kept.
    let fits = "x".repeat(MAX_ENTRY_BYTES - 1024);
    assert_eq!(
        within(store.cache_store(&k, gens, &result(&fits), TTL))
            .await
            .unwrap(),
        Stored::Kept
    );
    assert_eq!(hit(&store, &k).await.map(|c| c.len()), Some(fits.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_that_is_gone_fails_at_once_and_is_passed_by_for_a_while() {
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
    // One try (bounded by LOOKUP_TIMEOUT, or the refused connection), not
    // the store's retries. The 5 s bound is no figure of speed: a lookup
    // that retried would spend the whole 60 s budget, twelve times the
    // bound, so only a single try passes it, on however slow a machine.
    const { assert!(LOOKUP_TIMEOUT.as_millis() < 1000) };
    let error = tokio::time::timeout(Duration::from_secs(5), store.cache_lookup(&k))
        .await
        .expect("the lookup gave up long before the retry budget")
        .unwrap_err();
    assert!(error.is_unavailable(), "{error}");

    // Redis is back (empty), but the breaker keeps the cache passed by
    // for a while, without asking it: not one command reaches it.
    redis.start_again().unwrap();
    let error = within(store.cache_lookup(&k)).await.unwrap_err();
    assert!(error.is_unavailable(), "{error}");
    assert!(error.to_string().contains("passed by"), "{error}");
    let stored = within(store.cache_store(&k, Default::default(), &result("x"), TTL))
        .await
        .unwrap_err();
    assert!(stored.to_string().contains("passed by"), "{stored}");
    let mut c = raw(&redis).await;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(
        !stats.contains("cmdstat_mget") && !stats.contains("cmdstat_eval"),
        "{stats}"
    );

    // Once its time is up, the cache is asked again: a miss (Redis came
    // back empty).
    let deadline = tokio::time::Instant::now() + BREAKER_OPEN_FOR + WAIT;
    loop {
        match within(store.cache_lookup(&k)).await {
            Ok(Lookup::Miss(_)) => break,
            Ok(Lookup::Hit(r)) => panic!("a hit in an empty Redis: {r:?}"),
            Err(e) => assert!(
                tokio::time::Instant::now() < deadline,
                "the breaker never closed: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
