//! The gateway's API keys against real Redis: stored by hash with a TTL,
//! found, listed, revoked at once, expired entries left out of the list.

use std::time::Duration;

use toolfleet_store::CitationStore;
use toolfleet_store::api_keys::ApiKeyRecord;
use toolfleet_testkit::servers::RedisServer;

fn record(id: &str, tenant: &str, expires_in: Duration) -> ApiKeyRecord {
    let now = toolfleet_protocol::now_ms();
    ApiKeyRecord {
        id: id.into(),
        tenant: tenant.into(),
        user: Some("ann".into()),
        profiles: vec!["default".into()],
        name: Some("ci".into()),
        hint: "tf_AbCd".into(),
        created_ms: now,
        expires_ms: now + u64::try_from(expires_in.as_millis()).unwrap(),
    }
}

#[tokio::test]
async fn keys_are_found_by_hash_listed_and_revoked_at_once() {
    let redis = RedisServer::start().expect("redis-server");
    let store = CitationStore::connect(&redis.url(), "toolfleet", Duration::from_secs(60))
        .await
        .unwrap();
    let (h1, h2, h3) = ("1".repeat(64), "2".repeat(64), "3".repeat(64));
    let one = record("key_one", "acme", Duration::from_secs(3600));
    store.add_api_key(&h1, &one).await.unwrap();
    store
        .add_api_key(&h2, &record("key_two", "globex", Duration::from_secs(3600)))
        .await
        .unwrap();
    store
        .add_api_key(
            &h3,
            &record("key_short", "acme", Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(store.api_key(&h1).await.unwrap(), Some(one.clone()));
    assert_eq!(store.api_key(&"9".repeat(64)).await.unwrap(), None);
    assert_eq!(store.api_key("not a hash").await.unwrap(), None);

    // Every key has a TTL: the record's is its expiry.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("toolfleet:{apikeys}:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 4, "{keys:?}");
    for key in &keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(ttl > 0, "{key} has no TTL");
        assert!(!key.contains("tf_"), "no key names a key: {key}");
    }

    // Expired: not found, and left out of the list.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.api_key(&h3).await.unwrap(), None);
    let ids: Vec<String> = store
        .api_keys()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&"key_one".to_string()) && ids.contains(&"key_two".to_string()));

    // Revoked: refused at once; a second revoke finds nothing.
    assert!(store.revoke_api_key("key_one").await.unwrap());
    assert_eq!(store.api_key(&h1).await.unwrap(), None);
    assert!(!store.revoke_api_key("key_one").await.unwrap());
    assert!(!store.revoke_api_key("key_never").await.unwrap());
    assert!(store.api_key(&h2).await.unwrap().is_some());
}
