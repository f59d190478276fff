//! The citation store against real Redis: outages retried within the
//! budget, the reservation floor across a restart that lost the counter,
//! claims, blobs, password and ACL users, `rediss://` with a client
//! certificate, and a 3-master Redis Cluster.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toolfleet_protocol::{ToolResult, ToolStatus};
use toolfleet_store::{
    Blob, CancelNote, CitationStore, Claim, ErrorKind, InvocationKey, MAX_BLOB_BYTES, NewReference,
    RedisOptions,
};
use toolfleet_testkit::redis_cluster::{ClusterOptions, ClusterTls, RedisCluster};
use toolfleet_testkit::servers::{RedisServer, free_port};
use toolfleet_testkit::wait::WAIT;

const TTL: Duration = Duration::from_secs(600);

fn refs(titles: &[&str]) -> Vec<NewReference> {
    titles
        .iter()
        .map(|t| NewReference {
            kind: "document".into(),
            title: t.to_string(),
            source: None,
            url: None,
            snippet: Some(format!("about {t}")),
        })
        .collect()
}

/// Invocation `id` of `tenant`.
fn of<'a>(tenant: &'a str, id: &'a str) -> InvocationKey<'a> {
    InvocationKey::new(tenant, id)
}

/// Invocation `id` of tenant `acme`.
fn acme(id: &str) -> InvocationKey<'_> {
    of("acme", id)
}

fn indices(r: &[toolfleet_protocol::Reference]) -> Vec<u64> {
    r.iter().map(|r| r.index).collect()
}

fn result(inv: &str, call: &str) -> ToolResult {
    ToolResult {
        invocation_id: inv.into(),
        call_id: call.into(),
        tool_id: "system.echo".into(),
        status: ToolStatus::Ok,
        content: format!("answer of {call}"),
        data: None,
        error: None,
        references: Vec::new(),
        attempt: 1,
        duration_ms: 3,
        replayed: false,
        llm_calls: Vec::new(),
        warnings: Vec::new(),
    }
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("the store answered in time")
}

fn options(url: &str, budget: Duration) -> RedisOptions {
    RedisOptions {
        retry_budget: budget,
        ..RedisOptions::new(url)
    }
}

/// A `redis-server` with extra arguments (auth, TLS), killed on drop.
struct CustomRedis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl CustomRedis {
    /// `args(port)` gives the server's arguments; ready when its log says
    /// so (a TLS or password-protected port does not answer a bare PING).
    fn start(args: impl Fn(u16) -> Vec<String>) -> Self {
        for _ in 0..3 {
            let dir = tempfile::tempdir().unwrap();
            let port = free_port().unwrap();
            let log = dir.path().join("redis.log");
            let out = std::fs::File::create(&log).unwrap();
            let mut child = Command::new("redis-server")
                .args(args(port))
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdin(Stdio::null())
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .expect("redis-server on PATH (apt-get install redis-server)");
            let start = Instant::now();
            loop {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("Ready to accept connections") {
                    return Self {
                        child,
                        port,
                        _dir: dir,
                    };
                }
                if child.try_wait().unwrap().is_some() {
                    break; // lost the port race (or bad args): try again
                }
                assert!(start.elapsed() < WAIT, "redis-server not ready:\n{text}");
                std::thread::sleep(Duration::from_millis(25));
            }
        }
        panic!("redis-server did not start in three tries");
    }
}

impl Drop for CustomRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_during_a_short_outage_succeeds_once_redis_is_back() {
    let mut redis = RedisServer::start().unwrap();
    // A generous budget: the restart below waits for the server to be
    // ready, which on a loaded machine can take a while.
    let store = within(CitationStore::connect_with(
        &options(&redis.url(), Duration::from_secs(25)),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    let first = within(store.reserve(acme("inv-o"), "c1", "c1", "t", refs(&["a"]), 0))
        .await
        .unwrap();
    assert_eq!(indices(&first), [1]);

    redis.stop();
    // Issued while Redis is down: each retries until it is back. The
    // reservation also finds the script cache empty and loads it again.
    let s = store.clone();
    let reserve = tokio::spawn(async move {
        s.reserve(acme("inv-o"), "c2", "c2", "t", refs(&["b"]), 1)
            .await
    });
    let s = store.clone();
    let cancel = tokio::spawn(async move { s.mark_cancelled(of("acme", "inv-o")).await });
    let s = store.clone();
    let put = tokio::spawn(async move { s.ledger_put("acme", &result("inv-o", "c2")).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reserve.is_finished() && !cancel.is_finished() && !put.is_finished(),
        "operations wait for Redis instead of failing"
    );
    // Keep the server: dropping it would kill it again.
    let _redis = tokio::task::spawn_blocking(move || {
        redis.start_again().unwrap();
        redis
    })
    .await
    .unwrap();

    let second = within(reserve).await.unwrap().unwrap();
    // The counter was lost with the restart; the floor keeps [doc:1] from
    // being handed out again.
    assert_eq!(indices(&second), [2]);
    within(cancel).await.unwrap().unwrap();
    within(put).await.unwrap().unwrap();
    assert!(
        within(store.is_cancelled(of("acme", "inv-o")))
            .await
            .unwrap()
    );
    let stored = within(store.ledger_and_cancel(of("acme", "inv-o"), "c2"))
        .await
        .unwrap()
        .0
        .unwrap();
    assert_eq!(stored.content, "answer of c2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_gone_past_the_budget_fails_as_unavailable_without_the_password() {
    let password = "canary-Pa55word";
    let redis = CustomRedis::start(|port| {
        vec![
            "--port".into(),
            port.to_string(),
            "--requirepass".into(),
            password.into(),
        ]
    });
    let url = format!("redis://:{password}@127.0.0.1:{}", redis.port);
    let budget = Duration::from_millis(800);
    let store = within(CitationStore::connect_with(
        &options(&url, budget),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    within(store.ping()).await.unwrap();
    drop(redis);

    let started = Instant::now();
    let err = within(store.claim(acme("inv-gone"), "seq-1"))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_unavailable());
    let text = err.to_string();
    assert!(text.contains("unavailable"), "{text}");
    assert!(text.contains("claim"), "{text}");
    assert!(!text.contains(password), "{text}");
    assert!(!format!("{err:?}{store:?}").contains(password));
    // It did retry for the whole budget rather than fail at the first
    // refused connection.
    assert!(elapsed >= budget, "gave up after {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_that_is_not_transient_fails_at_once() {
    let redis = RedisServer::start().unwrap();
    // A budget longer than the test's wait: a retried error would time
    // the test out.
    let store = within(CitationStore::connect_with(
        &options(&redis.url(), WAIT * 4),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    // Something else wrote a string where the references hash belongs.
    let _: () = redis::cmd("SET")
        .arg(store.key(acme("inv-w"), "refs"))
        .arg("not a hash")
        .query_async(&mut raw)
        .await
        .unwrap();
    let err = within(store.references(acme("inv-w"))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected, "{err}");
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    let err = within(store.reserve(acme("inv-w"), "c", "c", "t", refs(&["x"]), 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_stay_above_the_floor_after_a_restart_lost_the_counter() {
    let mut redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let a = within(store.reserve(acme("inv-f"), "a", "a", "t", refs(&["1", "2", "3"]), 0))
        .await
        .unwrap();
    assert_eq!(indices(&a), [1, 2, 3]);
    // A redelivery of the same reservation reuses its indices.
    let again = within(store.reserve(acme("inv-f"), "a", "a", "t", refs(&["1", "2", "3"]), 0))
        .await
        .unwrap();
    assert_eq!(indices(&again), [1, 2, 3]);

    // No persistence: the restart loses the counter and the references.
    redis.stop();
    let mut redis = tokio::task::spawn_blocking(move || {
        redis.start_again().unwrap();
        redis
    })
    .await
    .unwrap();
    let b = within(store.reserve(acme("inv-f"), "b", "b", "t", refs(&["4", "5"]), 3))
        .await
        .unwrap();
    assert_eq!(indices(&b), [4, 5], "never an index at or below the floor");
    // A floor below the counter does not pull it back.
    let c = within(store.reserve(acme("inv-f"), "c", "c", "t", refs(&["6"]), 1))
        .await
        .unwrap();
    assert_eq!(indices(&c), [6]);
    let all = within(store.references(acme("inv-f"))).await.unwrap();
    assert_eq!(indices(&all), [4, 5, 6]);
    assert_eq!(all[0].title, "4");
    assert_eq!(all[0].call_id.as_deref(), Some("b"));

    // Without the floor the lost counter would start at 1 again: the
    // floor is what keeps [doc:1] unique.
    redis.stop();
    let _redis = tokio::task::spawn_blocking(move || {
        redis.start_again().unwrap();
        redis
    })
    .await
    .unwrap();
    let d = within(store.reserve(acme("inv-f"), "d", "d", "t", refs(&["7"]), 6))
        .await
        .unwrap();
    assert_eq!(indices(&d), [7]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocation_is_claimed_once() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    assert_eq!(
        within(store.claim(acme("inv-c"), "17")).await.unwrap(),
        Claim::New
    );
    assert_eq!(
        within(store.claim(acme("inv-c"), "17")).await.unwrap(),
        Claim::Again
    );
    assert_eq!(
        within(store.claim(acme("inv-c"), "18")).await.unwrap(),
        Claim::Other("17".into())
    );
    assert_eq!(
        within(store.claim(acme("inv-d"), "18")).await.unwrap(),
        Claim::New
    );
    // The run of 17 ended: its redelivery is told so; others still not.
    within(store.finish(acme("inv-c"), "17", b"{\"seq\":3}"))
        .await
        .unwrap();
    assert_eq!(
        within(store.terminal_event(acme("inv-c")))
            .await
            .unwrap()
            .as_deref(),
        Some(&b"{\"seq\":3}"[..])
    );
    assert_eq!(
        within(store.claim(acme("inv-c"), "17")).await.unwrap(),
        Claim::Finished
    );
    assert!(matches!(
        within(store.claim(acme("inv-c"), "18")).await.unwrap(),
        Claim::Other(_)
    ));
}

/// Ids are per tenant: the same invocation id under two tenants is two
/// invocations. Each claims it, runs under its own lease, counts its own
/// citations, keeps its own ledger, terminal event, tombstone and blobs;
/// nothing one writes is read by the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_under_two_tenants_shares_nothing() {
    use toolfleet_store::Lease;
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let (acme, globex) = (of("acme", "inv-same"), of("globex", "inv-same"));
    // The attacker claims first; the victim's claim is its own.
    assert_eq!(within(store.claim(acme, "7")).await.unwrap(), Claim::New);
    assert_eq!(within(store.claim(globex, "9")).await.unwrap(), Claim::New);
    let long = Duration::from_secs(30);
    assert_eq!(
        within(store.lease(acme, "a", long)).await.unwrap(),
        Lease::Held
    );
    assert_eq!(
        within(store.lease(globex, "g", long)).await.unwrap(),
        Lease::Held
    );
    // Citations: each from [doc:1], each its own hash.
    let a = within(store.reserve(acme, "c1", "c1", "t", refs(&["acme-doc"]), 0))
        .await
        .unwrap();
    let g = within(store.reserve(globex, "c1", "c1", "t", refs(&["globex-canary"]), 0))
        .await
        .unwrap();
    assert_eq!((indices(&a), indices(&g)), (vec![1], vec![1]));
    let acme_refs = within(store.references(acme)).await.unwrap();
    assert_eq!(acme_refs.len(), 1);
    assert_eq!(acme_refs[0].title, "acme-doc");
    assert_eq!(
        within(store.references(globex)).await.unwrap()[0].title,
        "globex-canary"
    );
    // The ledger: globex's stored result is not acme's replay.
    within(store.ledger_put("globex", &result("inv-same", "c1")))
        .await
        .unwrap();
    assert_eq!(
        within(store.ledger_and_cancel(acme, "c1")).await.unwrap(),
        (None, false)
    );
    assert!(
        within(store.ledger_and_cancel(globex, "c1"))
            .await
            .unwrap()
            .0
            .is_some()
    );
    // A cancel, a finished run and a blob stay with their tenant.
    within(store.mark_cancelled(acme)).await.unwrap();
    assert!(!within(store.is_cancelled(globex)).await.unwrap());
    within(store.finish(acme, "7", b"acme's end"))
        .await
        .unwrap();
    assert_eq!(within(store.terminal_event(globex)).await.unwrap(), None);
    assert_eq!(
        within(store.claim(globex, "9")).await.unwrap(),
        Claim::Again
    );
    within(store.put_blob(globex, "c1.1", "text/plain", b"globex canary"))
        .await
        .unwrap();
    assert_eq!(within(store.get_blob(acme, "c1.1")).await.unwrap(), None);
    // One hash tag per tenant's invocation.
    assert_eq!(store.key(globex, "refs"), "tf:{globex/inv-same}:refs");
}

/// Many results go to the ledger in one write (a pipeline), each under
/// its own invocation and call, as a worker's batch of finished jobs does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_results_are_written_to_the_ledger_at_once() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let encoded: Vec<(String, String, Vec<u8>)> = (0..20)
        .map(|n| {
            let r = result(&format!("inv-{}", n % 4), &format!("call-{n}"));
            let json = serde_json::to_vec(&r).unwrap();
            (r.invocation_id, r.call_id, json)
        })
        .collect();
    let batch: Vec<(InvocationKey<'_>, &str, &[u8])> = encoded
        .iter()
        .map(|(i, c, j)| (acme(i), c.as_str(), j.as_slice()))
        .collect();
    within(store.ledger_put_many(&batch)).await.unwrap();
    within(store.ledger_put_many(&[])).await.unwrap();
    for (inv, call, _) in &encoded {
        let got = within(store.ledger_and_cancel(of("acme", inv), call))
            .await
            .unwrap()
            .0
            .expect("stored");
        assert_eq!((&got.invocation_id, &got.call_id), (inv, call));
        assert_eq!(got.content, format!("answer of {call}"));
    }
    // Each with the store's TTL.
    let ttl: i64 = redis::cmd("TTL")
        .arg("tf:{acme/inv-1}:result:call-5")
        .query_async(
            &mut redis::Client::open(redis.url())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= TTL.as_secs() as i64, "{ttl}");
}

/// A blob is stored with the invocation's TTL, read back whole, replaced
/// by a second write of its id, seen only under its invocation and fleet,
/// and refused past the size cap before anything reaches Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_round_trips_with_the_ttl_and_stays_in_its_invocation() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    // Every byte value, and a NUL-heavy run: binary, not text.
    let png: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    within(store.put_blob(acme("inv-b"), "call-1.1", "image/png", &png))
        .await
        .unwrap();
    let got = within(store.get_blob(acme("inv-b"), "call-1.1"))
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(
        got,
        Blob {
            content_type: "image/png".into(),
            bytes: png.clone()
        }
    );
    assert!(format!("{got:?}").contains("<300000 bytes>"), "{got:?}");

    // One hash under the invocation's hash tag, with the store's TTL.
    let mut raw = within(
        redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection(),
    )
    .await
    .unwrap();
    let key = "tf:{acme/inv-b}:blob:call-1.1";
    let ttl: i64 = redis::cmd("TTL")
        .arg(key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= TTL.as_secs() as i64, "{ttl}");
    let kind: String = redis::cmd("HGET")
        .arg(key)
        .arg("type")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(kind, "image/png");

    // The same id again (a redelivered job) replaces the blob whole.
    within(store.put_blob(acme("inv-b"), "call-1.1", "image/jpeg", b"jpeg"))
        .await
        .unwrap();
    let again = within(store.get_blob(acme("inv-b"), "call-1.1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (again.content_type.as_str(), &again.bytes[..]),
        ("image/jpeg", &b"jpeg"[..])
    );

    // Scoped: another blob id, another invocation, another fleet's prefix.
    let other_fleet = within(CitationStore::connect(&redis.url(), "tf.other", TTL))
        .await
        .unwrap();
    assert_eq!(
        within(store.get_blob(acme("inv-b"), "call-1.2"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        within(store.get_blob(acme("inv-c"), "call-1.1"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        within(other_fleet.get_blob(acme("inv-b"), "call-1.1"))
            .await
            .unwrap(),
        None
    );
    within(other_fleet.put_blob(acme("inv-b"), "call-1.1", "text/plain", b"theirs"))
        .await
        .unwrap();
    assert_eq!(
        within(store.get_blob(acme("inv-b"), "call-1.1"))
            .await
            .unwrap()
            .unwrap()
            .bytes,
        b"jpeg"
    );

    // Refused before anything is sent: past the cap, a bad id or type.
    let big = vec![7u8; MAX_BLOB_BYTES + 1];
    let err = within(store.put_blob(acme("inv-b"), "call-2.1", "image/png", &big))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.to_string().contains("32 MiB"), "{err}");
    let err = within(store.put_blob(acme("inv-b"), "a:b", "image/png", b"x"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    let err = within(store.put_blob(acme("inv-b"), "call-2.1", "png", b"x"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tf:{acme/inv-b}:blob:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(keys, [key]);
    // Exactly at the cap is fine.
    let cap = vec![1u8; MAX_BLOB_BYTES];
    within(store.put_blob(acme("inv-b"), "call-3.1", "application/octet-stream", &cap))
        .await
        .unwrap();
    let got = within(store.get_blob(acme("inv-b"), "call-3.1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.bytes.len(), MAX_BLOB_BYTES);

    // A key that is not a whole blob is reported, not taken for one.
    let _: () = redis::cmd("HSET")
        .arg("tf:{acme/inv-b}:blob:half")
        .arg("type")
        .arg("image/png")
        .query_async(&mut raw)
        .await
        .unwrap();
    let err = within(store.get_blob(acme("inv-b"), "half"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
}

/// The run lease: taken when free, renewed by its holder, refused to
/// another holder (saying how long it has left) until it lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_lease_is_held_renewed_and_lapses() {
    use toolfleet_store::Lease;
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let long = Duration::from_secs(30);
    assert_eq!(
        within(store.lease(acme("inv-l"), "a", long)).await.unwrap(),
        Lease::Held
    );
    assert_eq!(
        within(store.lease(acme("inv-l"), "a", long)).await.unwrap(),
        Lease::Held
    );
    match within(store.lease(acme("inv-l"), "b", long)).await.unwrap() {
        Lease::Busy { holder, left } => {
            assert_eq!(holder, "a");
            assert!(left > Duration::from_secs(20) && left <= long, "{left:?}");
        }
        other => panic!("{other:?}"),
    }
    // Another invocation's lease is its own.
    assert_eq!(
        within(store.lease(acme("inv-m"), "b", long)).await.unwrap(),
        Lease::Held
    );
    // Not renewed, it lapses, and the next holder takes it.
    let short = Duration::from_millis(200);
    assert_eq!(
        within(store.lease(acme("inv-n"), "a", short))
            .await
            .unwrap(),
        Lease::Held
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        within(store.lease(acme("inv-n"), "b", long)).await.unwrap(),
        Lease::Held
    );
    assert!(matches!(
        within(store.lease(acme("inv-n"), "a", long)).await.unwrap(),
        Lease::Busy { .. }
    ));

    // A renewal also tells whether the invocation's tenant cancelled it
    // (another tenant's tombstone is not its own).
    assert_eq!(
        within(store.renew_lease(of("acme", "inv-l"), "a", long))
            .await
            .unwrap(),
        (Lease::Held, false)
    );
    within(store.mark_cancelled(of("globex", "inv-l")))
        .await
        .unwrap();
    assert_eq!(
        within(store.renew_lease(of("acme", "inv-l"), "a", long))
            .await
            .unwrap(),
        (Lease::Held, false)
    );
    within(store.mark_cancelled(of("acme", "inv-l")))
        .await
        .unwrap();
    assert_eq!(
        within(store.renew_lease(of("acme", "inv-l"), "a", long))
            .await
            .unwrap(),
        (Lease::Held, true)
    );
    assert!(matches!(
        within(store.renew_lease(of("acme", "inv-l"), "b", long))
            .await
            .unwrap(),
        (Lease::Busy { .. }, true)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_and_an_acl_user_authenticate() {
    let redis = CustomRedis::start(|port| {
        vec![
            "--port".into(),
            port.to_string(),
            "--requirepass".into(),
            "default-secret".into(),
            // An ACL user that may touch only the fleet's keys.
            "--user".into(),
            "fleet".into(),
            "on".into(),
            ">fleet-secret".into(),
            "~tf:*".into(),
            "+@all".into(),
        ]
    });
    let port = redis.port;
    for url in [
        format!("redis://:default-secret@127.0.0.1:{port}"),
        format!("redis://fleet:fleet-secret@127.0.0.1:{port}/0"),
    ] {
        let store = within(CitationStore::connect(&url, "tf", TTL))
            .await
            .unwrap();
        let inv = format!("inv-{}", url.len());
        let r = within(store.reserve(acme(&inv), "c", "c", "t", refs(&["a", "b"]), 0))
            .await
            .unwrap();
        assert_eq!(indices(&r), [1, 2]);
        assert_eq!(
            within(store.claim(acme(&inv), "1")).await.unwrap(),
            Claim::New,
            "{}",
            toolfleet_store::redact_url(&url)
        );
    }
    // The ACL user is held to its key pattern.
    let outside = within(CitationStore::connect(
        &format!("redis://fleet:fleet-secret@127.0.0.1:{port}"),
        "other",
        TTL,
    ))
    .await
    .unwrap();
    let err = within(outside.claim(acme("inv"), "1")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected, "{err}");

    // A wrong password fails at once, as a rejection, and is not echoed.
    let wrong = format!("redis://fleet:not-the-Secret@127.0.0.1:{port}");
    let err = match within(CitationStore::connect_with(
        &options(&wrong, WAIT * 4),
        "tf",
        TTL,
    ))
    .await
    {
        Ok(store) => within(store.ping()).await.unwrap_err(),
        Err(e) => e,
    };
    assert_ne!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(!err.to_string().contains("not-the-Secret"), "{err}");
    assert!(!format!("{err:?}").contains("not-the-Secret"), "{err:?}");
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate
/// (the testkit's, as the PostgreSQL TLS tests use).
type Pki = toolfleet_testkit::postgres::TestCa;

fn tls_options(url: &str, pki: &Pki, ca: &str, client: bool, budget: Duration) -> RedisOptions {
    RedisOptions {
        tls_ca: Some(pki.path(ca)),
        tls_cert: client.then(|| pki.path("client.pem")),
        tls_key: client.then(|| pki.path("client.key")),
        ..options(url, budget)
    }
}

fn path_str(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_custom_ca_a_client_certificate_and_a_password() {
    let pki = Pki::new().expect("openssl on PATH (apt-get install openssl)");
    let redis = CustomRedis::start(|port| {
        vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            path_str(&pki.path("server.pem")),
            "--tls-key-file".into(),
            path_str(&pki.path("server.key")),
            "--tls-ca-cert-file".into(),
            path_str(&pki.path("ca.pem")),
            "--tls-auth-clients".into(),
            "yes".into(),
            "--requirepass".into(),
            "tls-secret".into(),
        ]
    });
    let url = format!("rediss://:tls-secret@127.0.0.1:{}", redis.port);

    let store = within(CitationStore::connect_with(
        &tls_options(&url, &pki, "ca.pem", true, Duration::from_secs(5)),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    let r = within(store.reserve(acme("inv-t"), "c", "c", "t", refs(&["a", "b"]), 4))
        .await
        .unwrap();
    assert_eq!(indices(&r), [5, 6]);
    let all = within(store.references(acme("inv-t"))).await.unwrap();
    assert_eq!(indices(&all), [5, 6]);
    within(store.ledger_put("acme", &result("inv-t", "c")))
        .await
        .unwrap();
    assert!(
        within(store.ledger_and_cancel(of("acme", "inv-t"), "c"))
            .await
            .unwrap()
            .0
            .is_some()
    );

    // A server certificate from a CA we were not told to trust is refused
    // at once (not retried as an outage).
    let err = within(CitationStore::connect_with(
        &tls_options(&url, &pki, "other-ca.pem", true, WAIT * 4),
        "tf",
        TTL,
    ))
    .await
    .unwrap_err();
    assert_ne!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(!err.to_string().contains("tls-secret"), "{err}");

    // Without a client certificate the server refuses us.
    let refused = async {
        let store = CitationStore::connect_with(
            &tls_options(&url, &pki, "ca.pem", false, Duration::from_millis(500)),
            "tf",
            TTL,
        )
        .await?;
        store.ping().await
    };
    let err = within(refused).await.unwrap_err();
    assert!(!err.to_string().contains("tls-secret"), "{err}");

    // A plain redis:// URL with TLS files is a configuration error.
    let plain = format!("redis://127.0.0.1:{}", redis.port);
    let err =
        CitationStore::connect_with(&tls_options(&plain, &pki, "ca.pem", true, WAIT), "tf", TTL)
            .await
            .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_works_on_a_three_master_cluster() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3).unwrap())
        .await
        .unwrap();
    // Every node listed: cluster mode is implied.
    let store = within(CitationStore::connect(&cluster.url(), "tf", TTL))
        .await
        .unwrap();
    // One seed node and the flag: the client finds the rest.
    let seed = format!("redis://127.0.0.1:{}", cluster.ports()[0]);
    let seeded = within(CitationStore::connect_with(
        &RedisOptions {
            cluster: true,
            ..RedisOptions::new(&seed)
        },
        "tf",
        TTL,
    ))
    .await
    .unwrap();

    // Many invocations: their hash tags spread them over every master.
    for n in 0..48 {
        let inv = format!("inv-{n}");
        let s = if n % 2 == 0 { &store } else { &seeded };
        let a = within(s.reserve(acme(&inv), "a", "a", "t", refs(&["x", "y"]), 0))
            .await
            .unwrap();
        assert_eq!(indices(&a), [1, 2], "{inv}");
        let again = within(s.reserve(acme(&inv), "a", "a", "t", refs(&["x", "y"]), 0))
            .await
            .unwrap();
        assert_eq!(indices(&again), [1, 2], "{inv}");
        let b = within(s.reserve(acme(&inv), "b", "b", "t", refs(&["z"]), 5))
            .await
            .unwrap();
        assert_eq!(indices(&b), [6], "{inv}");
        let all = within(store.references(acme(&inv))).await.unwrap();
        assert_eq!(indices(&all), [1, 2, 6], "{inv}");
        within(s.ledger_put("acme", &result(&inv, "a")))
            .await
            .unwrap();
        let got = within(seeded.ledger_and_cancel(of("acme", &inv), "a"))
            .await
            .unwrap()
            .0
            .unwrap();
        assert_eq!(got.content, "answer of a");
        assert_eq!(within(s.claim(acme(&inv), "1")).await.unwrap(), Claim::New);
        assert_eq!(
            within(store.claim(acme(&inv), "1")).await.unwrap(),
            Claim::Again
        );
        assert_eq!(
            within(seeded.claim(acme(&inv), "2")).await.unwrap(),
            Claim::Other("1".into())
        );
        assert!(!within(store.is_cancelled(of("acme", &inv))).await.unwrap());
        // A cancel of an id the store does not know is remembered in the
        // tenant's set (another slot), and read from there.
        let queued = format!("{inv}-queued");
        assert_eq!(
            within(s.remember_cancel(acme(&queued), 10)).await.unwrap(),
            CancelNote::Remembered
        );
        assert!(within(seeded.is_cancelled(acme(&queued))).await.unwrap());
        within(s.mark_cancelled(of("acme", &inv))).await.unwrap();
        assert!(within(seeded.is_cancelled(of("acme", &inv))).await.unwrap());
        // Another tenant's cancel of the same id is kept apart.
        assert!(
            !within(seeded.is_cancelled(of("globex", &inv)))
                .await
                .unwrap()
        );
        let (_, cancelled) = within(seeded.ledger_and_cancel(of("globex", &inv), "a"))
            .await
            .unwrap();
        assert!(!cancelled);
        // A blob, on whichever master holds the invocation's slot.
        within(s.put_blob(acme(&inv), "a.1", "image/png", inv.as_bytes()))
            .await
            .unwrap();
        let blob = within(seeded.get_blob(acme(&inv), "a.1"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(blob.bytes, inv.as_bytes());
    }
    // Many results of many invocations (every master) in one write.
    let many: Vec<ToolResult> = (0..48)
        .map(|n| result(&format!("batch-{n}"), "c"))
        .collect();
    let encoded: Vec<(String, String, Vec<u8>)> = many
        .iter()
        .map(|r| {
            let json = serde_json::to_vec(r).unwrap();
            (r.invocation_id.clone(), r.call_id.clone(), json)
        })
        .collect();
    let batch: Vec<(InvocationKey<'_>, &str, &[u8])> = encoded
        .iter()
        .map(|(i, c, j)| (acme(i), c.as_str(), j.as_slice()))
        .collect();
    within(store.ledger_put_many(&batch)).await.unwrap();
    for n in 0..48 {
        let inv = format!("batch-{n}");
        let got = within(seeded.ledger_and_cancel(of("acme", &inv), "c"))
            .await
            .unwrap()
            .0
            .expect("stored by the batch");
        assert_eq!(got.invocation_id, inv);
    }
    within(store.ping()).await.unwrap();

    // Every master holds some of those keys.
    for port in cluster.ports() {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        let mut conn = within(client.get_multiplexed_async_connection())
            .await
            .unwrap();
        let keys: i64 = within(redis::cmd("DBSIZE").query_async(&mut conn))
            .await
            .unwrap();
        assert!(keys > 0, "node {port} holds no keys");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_restarted_mid_operation_is_waited_for() {
    let mut cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3).unwrap())
        .await
        .unwrap();
    let store = within(CitationStore::connect_with(
        &options(&cluster.url(), Duration::from_secs(25)),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    // An invocation whose slot the first master serves: that node answers
    // for its key (any other would answer MOVED).
    let first = redis::Client::open(format!("redis://127.0.0.1:{}", cluster.ports()[0])).unwrap();
    let mut first = within(first.get_multiplexed_async_connection())
        .await
        .unwrap();
    let mut inv = None;
    for n in 0..200 {
        let candidate = format!("inv-r{n}");
        let r = within(store.reserve(acme(&candidate), "a", "a", "t", refs(&["x"]), 0))
            .await
            .unwrap();
        assert_eq!(indices(&r), [1]);
        let here: redis::RedisResult<i64> = redis::cmd("EXISTS")
            .arg(store.key(acme(&candidate), "refs"))
            .query_async(&mut first)
            .await;
        if here == Ok(1) {
            inv = Some(candidate);
            break;
        }
    }
    let inv = inv.expect("some invocation lands on the first master");

    cluster.stop(0);
    let s = store.clone();
    let i = inv.clone();
    let reserve =
        tokio::spawn(async move { s.reserve(acme(&i), "b", "b", "t", refs(&["y"]), 1).await });
    let s = store.clone();
    let i = inv.clone();
    let claim = tokio::spawn(async move { s.claim(acme(&i), "7").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reserve.is_finished() && !claim.is_finished(),
        "operations on the stopped master's slots wait for it"
    );
    let _cluster = tokio::task::spawn_blocking(move || {
        cluster.start_again(0).unwrap();
        cluster
    })
    .await
    .unwrap();

    // The master came back empty; the floor keeps [doc:1] unique.
    let b = within(reserve).await.unwrap().unwrap();
    assert_eq!(indices(&b), [2]);
    assert_eq!(within(claim).await.unwrap().unwrap(), Claim::New);
    let all = within(store.references(acme(&inv))).await.unwrap();
    assert_eq!(indices(&all), [2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_fails_as_unavailable_after_the_budget_and_recovers() {
    let redis = CustomRedis::start(|port| vec!["--port".into(), port.to_string()]);
    let budget = Duration::from_millis(700);
    let store = within(CitationStore::connect_with(
        &options(&format!("redis://127.0.0.1:{}", redis.port), budget),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    within(store.mark_cancelled(of("acme", "inv-z")))
        .await
        .unwrap();
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &redis.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    // Frozen, not gone: the connection stays open and nothing answers, so
    // only the budget ends the wait.
    signal("-STOP");
    let started = Instant::now();
    let err = within(store.is_cancelled(of("acme", "inv-z")))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    signal("-CONT");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("is_cancelled"), "{err}");
    assert!(elapsed >= budget, "gave up after {elapsed:?}");
    // Thawed, the same store answers again.
    assert!(
        within(store.is_cancelled(of("acme", "inv-z")))
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_works_on_a_tls_cluster_with_a_password() {
    let pki = Pki::new().expect("openssl on PATH (apt-get install openssl)");
    let options = ClusterOptions {
        tls: Some(ClusterTls {
            cert: pki.path("server.pem"),
            key: pki.path("server.key"),
            ca: pki.path("ca.pem"),
        }),
        password: Some("cluster-secret".into()),
    };
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start_with(3, options).unwrap())
        .await
        .unwrap();
    let url = cluster.url();
    assert!(url.starts_with("rediss://"), "{url}");
    let store = within(CitationStore::connect_with(
        &tls_options(&url, &pki, "ca.pem", false, Duration::from_secs(5)),
        "tf",
        TTL,
    ))
    .await
    .unwrap();
    for n in 0..24 {
        let inv = format!("inv-s{n}");
        let a = within(store.reserve(acme(&inv), "a", "a", "t", refs(&["x", "y"]), 2))
            .await
            .unwrap();
        assert_eq!(indices(&a), [3, 4], "{inv}");
        assert_eq!(
            indices(&within(store.references(acme(&inv))).await.unwrap()),
            [3, 4]
        );
        assert_eq!(
            within(store.claim(acme(&inv), "1")).await.unwrap(),
            Claim::New
        );
        assert_eq!(
            within(store.claim(acme(&inv), "1")).await.unwrap(),
            Claim::Again
        );
    }
    // The cluster client needs the CA like the single-server one.
    let err = within(CitationStore::connect_with(
        &tls_options(&url, &pki, "other-ca.pem", false, WAIT * 4),
        "tf",
        TTL,
    ))
    .await
    .unwrap_err();
    assert_ne!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(!err.to_string().contains("cluster-secret"), "{err}");
}

/// A flood of cancels for ids the store does not know leaves one key per
/// tenant, holding at most the tenant's `remembered` latest ids (the
/// oldest forgotten first); a cancel of a claimed invocation leaves its
/// tombstone; each tenant's cancels stay its own. (Before: a 24 h
/// tombstone key per cancel.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_of_unknown_ids_cost_one_bounded_key_per_tenant() {
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    for n in 0..500 {
        let id = format!("unknown-{n}");
        let note = within(store.remember_cancel(acme(&id), 100)).await.unwrap();
        assert_eq!(note, CancelNote::Remembered);
    }
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys, ["tf:{acme}:cancels"], "one key for the flood");
    assert_eq!(
        within(store.remembered_cancel_count("acme")).await.unwrap(),
        100
    );
    let ttl: i64 = redis::cmd("TTL")
        .arg("tf:{acme}:cancels")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= 3600, "{ttl}");
    // The latest are remembered, the oldest forgotten.
    assert!(
        within(store.is_cancelled(acme("unknown-499")))
            .await
            .unwrap()
    );
    assert!(!within(store.is_cancelled(acme("unknown-0"))).await.unwrap());
    // Another tenant's same id is not cancelled.
    assert!(
        !within(store.is_cancelled(of("globex", "unknown-499")))
            .await
            .unwrap()
    );
    // A claimed invocation gets its tombstone, which the workers' ledger
    // check reads.
    assert_eq!(
        within(store.claim(acme("running"), "7")).await.unwrap(),
        Claim::New
    );
    assert_eq!(
        within(store.remember_cancel(acme("running"), 100))
            .await
            .unwrap(),
        CancelNote::Tombstone
    );
    let (_, cancelled) = within(store.ledger_and_cancel(acme("running"), "c1"))
        .await
        .unwrap();
    assert!(cancelled);
}

/// The claim, the lease and the tombstone in one round trip answer as the
/// three calls do one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_and_its_lease_are_taken_in_one_round_trip() {
    use toolfleet_store::{Claim, ClaimLease, Lease};
    let redis = RedisServer::start().unwrap();
    let store = within(CitationStore::connect(&redis.url(), "tf", TTL))
        .await
        .unwrap();
    let long = Duration::from_secs(30);
    let first = within(store.claim_and_lease(acme("inv-c"), "seq-1", "run-a", long))
        .await
        .unwrap();
    assert_eq!(
        first,
        ClaimLease {
            claim: Claim::New,
            lease: Some(Lease::Held),
            tombstone: false,
        }
    );
    // The same message again while its run lives: claimed again, the
    // lease busy (and whose, for how long).
    let again = within(store.claim_and_lease(acme("inv-c"), "seq-1", "run-b", long))
        .await
        .unwrap();
    assert_eq!(again.claim, Claim::Again);
    match again.lease {
        Some(Lease::Busy { holder, left }) => {
            assert_eq!(holder, "run-a");
            assert!(left > Duration::from_secs(20) && left <= long, "{left:?}");
        }
        other => panic!("{other:?}"),
    }
    // Another message with the same id: refused, named, no lease taken.
    let other = within(store.claim_and_lease(acme("inv-c"), "seq-2", "run-c", long))
        .await
        .unwrap();
    assert_eq!(other.claim, Claim::Other("seq-1".into()));
    assert_eq!(other.lease, None);
    assert!(
        matches!(
            within(store.lease(acme("inv-c"), "run-c", long)).await.unwrap(),
            Lease::Busy { holder, .. } if holder == "run-a"
        ),
        "the refused claim took the lease"
    );
    // A cancel tombstone is read with the lease (its own tenant's only).
    within(store.mark_cancelled(of("globex", "inv-c")))
        .await
        .unwrap();
    let run_a = within(store.claim_and_lease(acme("inv-c"), "seq-1", "run-a", long))
        .await
        .unwrap();
    assert_eq!((run_a.lease, run_a.tombstone), (Some(Lease::Held), false));
    within(store.mark_cancelled(acme("inv-c"))).await.unwrap();
    let run_a = within(store.claim_and_lease(acme("inv-c"), "seq-1", "run-a", long))
        .await
        .unwrap();
    assert!(run_a.tombstone);
    // Finished: answered from the store, nothing leased.
    within(store.finish(acme("inv-c"), "seq-1", b"{}"))
        .await
        .unwrap();
    let done = within(store.claim_and_lease(acme("inv-c"), "seq-1", "run-d", long))
        .await
        .unwrap();
    assert_eq!((done.claim, done.lease), (Claim::Finished, None));
    // The same calls one by one agree.
    assert_eq!(
        within(store.claim(acme("inv-c"), "seq-1")).await.unwrap(),
        Claim::Finished
    );
}
