//! Cost of the tool-result token cap (`cargo bench --bench budget`): the
//! byte-length fast path against tokenizing, on a 10 KiB tool result. No
//! framework: median of repeated timed batches, printed as a table.

use std::hint::black_box;
use std::time::{Duration, Instant};

use toolfleet_llm::budget::TokenBudget;

fn median_per_call(mut f: impl FnMut(), calls: u32) -> Duration {
    f(); // warm-up
    let mut samples: Vec<Duration> = (0..9)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                f();
            }
            t.elapsed() / calls
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; test runners (`cargo test
    // --all-targets`, nextest's `--list`) must not run the measurements.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let started = Instant::now();
    let budget = TokenBudget::for_model("gpt-4o-mini");
    let first = started.elapsed();
    let unit = r#"{"title": "Lighthouses", "snippet": "A ship that sees white is in safe water, while red or green warns that it has strayed.", "score": 3.14}, "#;
    let ten_kib: String = unit.repeat(10 * 1024 / unit.len() + 1)[..10 * 1024].to_string();
    let one_kib = &ten_kib[..1024];
    println!("encoder build (once per process): {first:?}");
    println!("{:<52} {:>12}", "case", "per call");
    let rows: Vec<(&str, Duration)> = vec![
        (
            "cap, 1 KiB, cap 2000 (fast path)",
            median_per_call(
                || {
                    black_box(budget.cap(black_box(one_kib), 2000));
                },
                100_000,
            ),
        ),
        (
            "cap, 10 KiB, cap 10240 (fast path)",
            median_per_call(
                || {
                    black_box(budget.cap(black_box(&ten_kib), 10_240));
                },
                100_000,
            ),
        ),
        (
            "count, 10 KiB",
            median_per_call(
                || {
                    black_box(budget.count(black_box(&ten_kib)));
                },
                200,
            ),
        ),
        (
            "cap, 10 KiB, cap 4000 (tokenized, fits)",
            median_per_call(
                || {
                    black_box(budget.cap(black_box(&ten_kib), 4000));
                },
                200,
            ),
        ),
        (
            "cap, 10 KiB, cap 1000 (tokenized, cut)",
            median_per_call(
                || {
                    black_box(budget.cap(black_box(&ten_kib), 1000));
                },
                200,
            ),
        ),
    ];
    for (name, d) in rows {
        println!("{name:<52} {d:>12.2?}");
    }
    match nats_round_trip() {
        Some(d) => println!(
            "{:<52} {d:>12.2?}",
            "NATS request-reply round trip, loopback (median)"
        ),
        None => println!("(nats-server not on PATH: no round-trip figure)"),
    }
}

/// The yardstick: one core-NATS request-reply on loopback, against a
/// private `nats-server`.
fn nats_round_trip() -> Option<Duration> {
    use futures::StreamExt;
    let server = toolfleet_local::servers::NatsServer::start().ok()?;
    let rt = tokio::runtime::Runtime::new().ok()?;
    rt.block_on(async {
        let client = async_nats::connect(server.url()).await.ok()?;
        let mut sub = client.subscribe("bench.echo").await.ok()?;
        let responder = client.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(reply) = m.reply {
                    let _ = responder.publish(reply, m.payload).await;
                }
            }
        });
        client.flush().await.ok()?;
        let mut samples = Vec::with_capacity(2000);
        for _ in 0..2000 {
            let t = Instant::now();
            client.request("bench.echo", "x".into()).await.ok()?;
            samples.push(t.elapsed());
        }
        samples.sort();
        Some(samples[samples.len() / 2])
    })
}
