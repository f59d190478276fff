//! Places under a fleet-wide cap (`toolfleet_store::slots`) and a
//! deployment's pause (`toolfleet_store::provider`), on a real
//! redis-server and a real three-master Redis Cluster.

use std::time::{Duration, Instant};

use toolfleet_store::CitationStore;
use toolfleet_testkit::redis_cluster::RedisCluster;
use toolfleet_testkit::servers::RedisServer;
use toolfleet_testkit::wait::WAIT;

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("the store answered in time")
}

/// Two places of a cap of two are taken, the third refused; a place given
/// back (its slot dropped) is free again; the set keeps its expiry while
/// its places are held.
async fn places_hold(store: &CitationStore) {
    let key = store.inflight_key("acme", "jobs");
    let first = within(store.take_slot(&key, 2))
        .await
        .unwrap()
        .expect("first");
    let second = within(store.take_slot(&key, 2))
        .await
        .unwrap()
        .expect("second");
    assert!(first.is_held() && second.is_held());
    assert!(within(store.take_slot(&key, 2)).await.unwrap().is_none());
    drop(first);
    // The release is sent from a task: wait for it.
    let freed = within(async {
        loop {
            if let Some(slot) = store.take_slot(&key, 2).await.unwrap() {
                return slot;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(within(store.take_slot(&key, 2)).await.unwrap().is_none());
    drop((second, freed));
    // Another tenant's cap is its own.
    let other = store.inflight_key("globex", "jobs");
    assert!(within(store.take_slot(&other, 1)).await.unwrap().is_some());
}

/// A pause holds every caller of the deployment until it ends, and a
/// deployment with a concurrency of one gives its place to the next
/// caller only when the first drops it.
async fn deployment_gate_holds(store: &CitationStore) {
    let first = within(store.provider_slot("openai", Some(1), None)).await;
    assert!(first.is_held());
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let slot = store.provider_slot("openai", Some(1), None).await;
            (started.elapsed(), slot.is_held())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the second caller waits for the place"
    );
    drop(first);
    let (_, held) = within(waiting).await.unwrap();
    assert!(held, "the second caller has the place");
    within(store.provider_pause("azure", Duration::from_millis(400))).await;
    let started = Instant::now();
    let slot = within(store.provider_slot("azure", None, Some(1000))).await;
    assert!(started.elapsed() >= Duration::from_millis(250), "paused");
    assert!(!slot.is_held(), "no concurrency cap: nothing to hold");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn places_and_the_deployment_gate_hold_on_one_server() {
    let redis = RedisServer::start().unwrap();
    let store = CitationStore::connect(&redis.url(), "tf", Duration::from_secs(600))
        .await
        .unwrap();
    places_hold(&store).await;
    deployment_gate_holds(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn places_and_the_deployment_gate_hold_on_a_redis_cluster() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3).unwrap())
        .await
        .unwrap();
    let store = CitationStore::connect(&cluster.url(), "tf", Duration::from_secs(600))
        .await
        .unwrap();
    places_hold(&store).await;
    deployment_gate_holds(&store).await;
}
