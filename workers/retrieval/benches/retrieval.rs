//! The retrieval benchmarks of BENCHMARKS.md (no framework, as the
//! workspace's other benches):
//!
//! 1. chunking alone — normalised text into chunks of at most 500 tokens,
//!    overlapping by at most 50, cut at sentence boundaries — beside
//!    Python tiktoken's `o200k_base` on the same text, measured in the same
//!    run (the floor: `scripts/bench_tiktoken.py`);
//! 2. ingestion throughput (MB of Markdown per second: normalise, chunk,
//!    index) into each backend;
//! 3. search latency (p50/p99 of BM25 queries, with and without a filter)
//!    over 100,000 chunks in each backend;
//! 4. vector search latency (p50/p99, with and without a filter) over
//!    `TOOLFLEET_BENCH_VECTORS` (default 20000) 256-dimensional vectors in
//!    each backend — PostgreSQL with the vectors scored by the worker and,
//!    when `TOOLFLEET_BENCH_PGVECTOR_URL` names a server with the `vector`
//!    extension, in the database — against the floor of scoring the same
//!    vectors in memory.
//!
//! `cargo bench -p toolfleet-worker-retrieval --bench retrieval`
//! (`TOOLFLEET_BENCH_MB`, default 8: the Markdown corpus size;
//! `TOOLFLEET_BENCH_CHUNKS`, default 100000; PostgreSQL from
//! `TOOLFLEET_TEST_POSTGRES_URL`, default the machine's on 127.0.0.1:5432,
//! in a fresh database dropped at the end; skipped when unreachable).

// Benchmarks are exempt from the 100-line limit: a measured scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use toolfleet_worker_retrieval::chunk::{ChunkConfig, chunk, encoding};
use toolfleet_worker_retrieval::ingest::{IngestOptions, ingest};
use toolfleet_worker_retrieval::model::{Item, ItemKind, Owner};
use toolfleet_worker_retrieval::normalize::{Format, normalize};
use toolfleet_worker_retrieval::postgres_store::PostgresStore;
use toolfleet_worker_retrieval::search::Query;
use toolfleet_worker_retrieval::store::Store;
use toolfleet_worker_retrieval::tantivy_store::TantivyStore;

/// Words in the synthetic vocabulary.
const VOCABULARY: usize = 20_000;
const SYLLABLES: &[&str] = &[
    "ba", "ke", "lo", "mi", "nu", "ra", "se", "ti", "vo", "za", "chi", "dra", "fen", "gor", "hul",
    "jin", "kor", "lam", "mes", "nor", "pil", "qua", "ros", "sul", "tam", "ver",
];

/// The vocabulary: `VOCABULARY` distinct words of two to four syllables.
fn vocabulary() -> &'static [String] {
    static WORDS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    WORDS.get_or_init(|| {
        let mut seen = std::collections::HashSet::new();
        let mut words = Vec::with_capacity(VOCABULARY);
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        while words.len() < VOCABULARY {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 2 + (x % 3) as usize;
            let word: String = (0..n)
                .map(|i| SYLLABLES[((x >> (8 * i + 3)) % SYLLABLES.len() as u64) as usize])
                .collect();
            if seen.insert(word.clone()) {
                words.push(word);
            }
        }
        words
    })
}

/// A deterministic word stream with a Zipf-like distribution (rank r
/// drawn with probability about 1/r), as words are in real text.
struct Words(u64);

impl Words {
    fn next(&mut self) -> &'static str {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let u = (self.0 >> 11) as f64 / (1u64 << 53) as f64;
        let rank = ((VOCABULARY as f64).powf(u) as usize).saturating_sub(1);
        &vocabulary()[rank.min(VOCABULARY - 1)]
    }

    fn sentence(&mut self, n: usize) -> String {
        let mut s: Vec<&str> = (0..n).map(|_| self.next()).collect();
        let first = s[0];
        let mut out = first[..1].to_uppercase() + &first[1..];
        s.remove(0);
        for w in s {
            out.push(' ');
            out.push_str(w);
        }
        out.push('.');
        out
    }
}

/// One Markdown document of about `bytes` bytes: headings, paragraphs,
/// lists, emphasis, a link, a table.
fn markdown(words: &mut Words, bytes: usize) -> String {
    let mut md = format!("# {}\n\n", words.sentence(4));
    while md.len() < bytes {
        md.push_str(&format!("## {}\n\n", words.sentence(3)));
        for _ in 0..3 {
            let para: Vec<String> = (0..5).map(|_| words.sentence(14)).collect();
            md.push_str(&format!(
                "{} **{}** [{}](https://example.com/{}).\n\n",
                para.join(" "),
                words.next(),
                words.next(),
                words.next()
            ));
        }
        for _ in 0..4 {
            md.push_str(&format!("- {}\n", words.sentence(8)));
        }
        md.push_str(&format!(
            "\n| {} | {} |\n|---|---|\n| {} | {} |\n\n",
            words.next(),
            words.next(),
            words.next(),
            words.next()
        ));
    }
    md
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `o200k_base` file Python tiktoken loads, rebuilt from tiktoken-rs's
/// ranks (there is no network to fetch it from); Python checks its hash.
fn write_tiktoken_cache(dir: &Path) {
    let bpe = encoding();
    let mut out = String::new();
    let engine = base64::engine::general_purpose::STANDARD;
    for rank in 0..199_998u32 {
        let Ok(bytes) = bpe.decode_bytes(&[rank]) else {
            break;
        };
        out.push_str(&engine.encode(bytes));
        out.push(' ');
        out.push_str(&rank.to_string());
        out.push('\n');
    }
    // tiktoken names the cached file by the SHA-1 of its URL.
    std::fs::write(dir.join("fb374d419588a4632f3f557e76b4b70aebbca790"), out).unwrap();
}

async fn fresh_postgres() -> Option<(String, String, String)> {
    let admin = std::env::var("TOOLFLEET_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(connection);
    let name = format!("toolfleet_bench_{}", std::process::id());
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .ok()?;
    let url = match admin.rfind('/') {
        Some(at) => format!("{}/{name}", &admin[..at]),
        None => return None,
    };
    Some((admin, url, name))
}

async fn drop_postgres(admin: &str, name: &str) {
    if let Ok((client, connection)) = tokio_postgres::connect(admin, tokio_postgres::NoTls).await {
        tokio::spawn(connection);
        let _ = client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
}

async fn bench_ingest(store: &dyn Store, corpus: &Path, mb: f64) -> f64 {
    let options = IngestOptions {
        tenant: "bench".into(),
        collection: "bench".into(),
        owner: Owner::default(),
        chunking: ChunkConfig::default(),
        max_file_bytes: 64 * 1024 * 1024,
        allowed_roots: vec![corpus.to_path_buf()],
        embedder: None,
    };
    let started = Instant::now();
    let report = ingest(store, &[corpus.to_path_buf()], &options, &mut |_| {}).await;
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(report.skipped(), 0, "{report:?}");
    mb / secs
}

async fn fill(store: &dyn Store, n: usize) -> Duration {
    let mut words = Words(0x9e37_79b9_7f4a_7c15);
    let started = Instant::now();
    let mut batch = Vec::with_capacity(5000);
    for i in 0..n {
        batch.push(Item {
            id: format!("k{i}"),
            kind: ItemKind::Knowledge,
            collection: if i % 10 == 0 {
                "small".into()
            } else {
                "big".into()
            },
            document_id: None,
            chunk: None,
            title: words.sentence(4),
            text: (0..6)
                .map(|_| words.sentence(14))
                .collect::<Vec<_>>()
                .join(" "),
            source: None,
            owner: Owner::default(),
            timestamp_ms: 1_790_000_000_000 + i as i64 * 60_000,
            ingested_ms: 0,
            entities: Vec::new(),
            level: None,
            child_ids: Vec::new(),
            aliases: Vec::new(),
            relations: Vec::new(),
            embedding: None,
        });
        if batch.len() == 5000 {
            store
                .upsert_items("bench", std::mem::take(&mut batch))
                .await
                .unwrap();
        }
    }
    if !batch.is_empty() {
        store.upsert_items("bench", batch).await.unwrap();
    }
    started.elapsed()
}

async fn bench_search(store: &dyn Store, queries: usize, filtered: bool) -> (Duration, Duration) {
    let mut words = Words(42);
    let mut times = Vec::with_capacity(queries);
    for _ in 0..queries {
        let text = format!("{} {} {}", words.next(), words.next(), words.next());
        let query = Query {
            tenant: "bench".into(),
            text,
            collections: scope(filtered),
            top_k: 5,
            ..Query::default()
        };
        let started = Instant::now();
        let hits = store.search(&query).await.unwrap();
        times.push(started.elapsed());
        std::hint::black_box(hits);
    }
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

/// The collection filter of a "filtered" query (10% of the items), or none.
fn scope(filtered: bool) -> Vec<String> {
    if filtered {
        vec!["small".into()]
    } else {
        Vec::new()
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` runs
    // nothing.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let mb_target = env_usize("TOOLFLEET_BENCH_MB", 8);
    let n_chunks = env_usize("TOOLFLEET_BENCH_CHUNKS", 100_000);
    let work = tempfile::tempdir().unwrap();
    let corpus = work.path().join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    let mut words = Words(7);
    let mut total = 0usize;
    let mut normalized = String::new();
    let mut n = 0;
    while total < mb_target * 1_000_000 {
        let md = markdown(&mut words, 40_000);
        total += md.len();
        normalized.push_str(&normalize(Format::Markdown, md.as_bytes()).unwrap().text);
        normalized.push_str("\n\n");
        std::fs::write(corpus.join(format!("doc-{n:04}.md")), md).unwrap();
        n += 1;
    }
    let mb = total as f64 / 1_000_000.0;
    println!(
        "corpus: {n} Markdown files, {mb:.1} MB ({} MB of normalised text)",
        normalized.len() / 1_000_000
    );

    // 1. Chunking beside Python tiktoken, same text, best of 3.
    let text_mb = normalized.len() as f64 / 1_000_000.0;
    let mut best_encode = f64::MAX;
    let mut best_chunk = f64::MAX;
    let mut tokens = 0;
    for _ in 0..3 {
        let started = Instant::now();
        tokens = encoding().encode_ordinary(&normalized).len();
        best_encode = best_encode.min(started.elapsed().as_secs_f64());
        let started = Instant::now();
        let chunks = chunk(&normalized, ChunkConfig::default());
        best_chunk = best_chunk.min(started.elapsed().as_secs_f64());
        std::hint::black_box(chunks);
    }
    println!("\n| step | tokens | best of 3 | MB/s | × Python tiktoken |");
    println!("|---|---|---|---|---|");
    let text_file = work.path().join("text.txt");
    std::fs::write(&text_file, &normalized).unwrap();
    let cache = work.path().join("tiktoken-cache");
    std::fs::create_dir_all(&cache).unwrap();
    write_tiktoken_cache(&cache);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench_tiktoken.py");
    let python = std::process::Command::new("python3")
        .arg(&script)
        .arg(&text_file)
        .arg("3")
        .env("TIKTOKEN_CACHE_DIR", &cache)
        .output();
    let python_secs = match python {
        Ok(out) if out.status.success() => {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(
                v["tokens"].as_u64(),
                Some(tokens as u64),
                "Python and Rust disagree on the token count"
            );
            v["seconds"].as_f64()
        }
        Ok(out) => {
            eprintln!(
                "Python tiktoken did not run: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            None
        }
        Err(e) => {
            eprintln!("python3 did not run: {e}");
            None
        }
    };
    let row = |name: &str, secs: f64| {
        let ratio = python_secs.map_or("—".to_owned(), |p| format!("{:.2}", p / secs));
        println!(
            "| {name} | {tokens} | {:.3} s | {:.2} | {ratio} |",
            secs,
            text_mb / secs
        );
    };
    if let Some(p) = python_secs {
        row("Python tiktoken `encode_ordinary` (floor)", p);
    }
    row("Rust `encode_ordinary` (tiktoken-rs)", best_encode);
    row(
        "Rust `chunk` (500/50 tokens, sentence boundaries)",
        best_chunk,
    );
    let _ = std::io::stdout().flush();

    // 2. Ingestion per backend.
    println!("\n| backend | ingest (normalise + chunk + index) | × chunking alone |");
    println!("|---|---|---|");
    let chunk_mb_s = text_mb / best_chunk;
    let dir = work.path().join("tantivy-ingest");
    let tantivy = TantivyStore::open(&dir).unwrap();
    let rate = bench_ingest(&tantivy, &corpus, mb).await;
    println!("| tantivy | {rate:.2} MB/s | {:.2} |", rate / chunk_mb_s);
    drop(tantivy);
    let postgres = fresh_postgres().await;
    if let Some((_, url, _)) = &postgres {
        PostgresStore::migrate(url, "ingest", Some(DIMENSIONS))
            .await
            .unwrap();
        let store = PostgresStore::connect(url, "ingest").await.unwrap();
        let rate = bench_ingest(&store, &corpus, mb).await;
        println!("| PostgreSQL | {rate:.2} MB/s | {:.2} |", rate / chunk_mb_s);
    } else {
        println!("| PostgreSQL | not reachable: skipped | |");
    }
    let _ = std::io::stdout().flush();

    // 3. Search at n_chunks.
    println!("\n| backend | chunks | fill | BM25 p50 | BM25 p99 | filtered p50 | filtered p99 |");
    println!("|---|---|---|---|---|---|---|");
    let mut stores: Vec<(&str, Arc<dyn Store>)> = vec![(
        "tantivy",
        Arc::new(TantivyStore::open(&work.path().join("tantivy-search")).unwrap()),
    )];
    if let Some((_, url, _)) = &postgres {
        stores.push((
            "PostgreSQL",
            Arc::new({
                PostgresStore::migrate(url, "search", Some(DIMENSIONS))
                    .await
                    .unwrap();
                PostgresStore::connect(url, "search").await.unwrap()
            }),
        ));
    }
    for (name, store) in stores {
        let fill_time = fill(store.as_ref(), n_chunks).await;
        // Warm caches (and the OS page cache) before timing.
        bench_search(store.as_ref(), 100, false).await;
        let (p50, p99) = bench_search(store.as_ref(), 1000, false).await;
        let (fp50, fp99) = bench_search(store.as_ref(), 1000, true).await;
        println!(
            "| {name} | {n_chunks} | {:.1} s | {} | {} | {} | {} |",
            fill_time.as_secs_f64(),
            ms(p50),
            ms(p99),
            ms(fp50),
            ms(fp99)
        );
        let _ = std::io::stdout().flush();
    }

    // 4. Vector search.
    bench_vectors(
        work.path(),
        postgres.as_ref().map(|(_, url, _)| url.as_str()),
    )
    .await;
    if let Some((admin, _, name)) = &postgres {
        drop_postgres(admin, name).await;
    }
}

/// Dimensions of the benchmark's vectors.
const DIMENSIONS: usize = 256;

/// A deterministic pseudo-random vector (xorshift), components in [-1, 1).
fn vector(seed: &mut u64) -> Vec<f32> {
    (0..DIMENSIONS)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

async fn bench_vectors(work: &Path, postgres: Option<&str>) {
    let n = env_usize("TOOLFLEET_BENCH_VECTORS", 20_000);
    let queries = 200;
    let mut seed = 0x2545_f491_4f6c_dd1d;
    let vectors: Vec<Vec<f32>> = (0..n).map(|_| vector(&mut seed)).collect();
    let probes: Vec<Vec<f32>> = (0..queries).map(|_| vector(&mut seed)).collect();
    // The floor: the same cosine top 5 over the same vectors in memory.
    let mut floor = Vec::with_capacity(queries);
    for probe in &probes {
        let started = Instant::now();
        let scored = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| (toolfleet_worker_retrieval::search::cosine(probe, v), i));
        std::hint::black_box(toolfleet_worker_retrieval::search::top_k_by_score(
            scored, 5,
        ));
        floor.push(started.elapsed());
    }
    floor.sort();
    let floor_p50 = percentile(&floor, 0.5);
    println!(
        "\n| backend | vectors | fill | p50 | p99 | × in-memory scan (p50) | filtered p50 | filtered p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| in-memory scan (floor) | {n} | | {} | {} | 1.00 | | |",
        ms(floor_p50),
        ms(percentile(&floor, 0.99))
    );
    let mut stores: Vec<(String, Arc<dyn Store>)> = vec![(
        "tantivy (scored by the worker)".into(),
        Arc::new(TantivyStore::open(&work.join("tantivy-vectors")).unwrap()),
    )];
    if let Some(url) = postgres {
        PostgresStore::migrate(url, "vectors", Some(DIMENSIONS))
            .await
            .unwrap();
        let store = PostgresStore::connect(url, "vectors").await.unwrap();
        let how = store
            .pgvector()
            .map_or("scored by the worker".to_owned(), |v| {
                format!("pgvector {v}")
            });
        stores.push((format!("PostgreSQL ({how})"), Arc::new(store)));
    }
    if let Ok(url) = std::env::var("TOOLFLEET_BENCH_PGVECTOR_URL") {
        PostgresStore::migrate(&url, "bench_vectors", Some(DIMENSIONS))
            .await
            .unwrap();
        let store = PostgresStore::connect(&url, "bench_vectors").await.unwrap();
        let version = store
            .pgvector()
            .expect("TOOLFLEET_BENCH_PGVECTOR_URL names a server without pgvector")
            .to_owned();
        stores.push((format!("PostgreSQL (pgvector {version})"), Arc::new(store)));
    }
    for (name, store) in stores {
        let started = Instant::now();
        for (b, batch) in vectors.chunks(2000).enumerate() {
            let items = batch
                .iter()
                .enumerate()
                .map(|(j, v)| {
                    let i = b * 2000 + j;
                    Item {
                        id: format!("v{i}"),
                        kind: ItemKind::Knowledge,
                        collection: if i % 10 == 0 { "small" } else { "big" }.into(),
                        document_id: None,
                        chunk: None,
                        title: format!("vector {i}"),
                        text: String::new(),
                        source: None,
                        owner: Owner::default(),
                        timestamp_ms: 1_790_000_000_000,
                        ingested_ms: 0,
                        entities: Vec::new(),
                        level: None,
                        child_ids: Vec::new(),
                        aliases: Vec::new(),
                        relations: Vec::new(),
                        embedding: Some(v.clone()),
                    }
                })
                .collect();
            store.upsert_items("bench", items).await.unwrap();
        }
        let fill = started.elapsed();
        let mut timings = [Vec::new(), Vec::new()];
        for (filtered, times) in timings.iter_mut().enumerate() {
            for (q, probe) in probes.iter().enumerate() {
                let query = Query {
                    tenant: "bench".into(),
                    vector: Some(probe.clone()),
                    collections: scope(filtered == 1),
                    top_k: 5,
                    ..Query::default()
                };
                let started = Instant::now();
                let hits = store.search(&query).await.unwrap();
                // The first 10 warm caches and are not counted.
                if q >= 10 {
                    times.push(started.elapsed());
                }
                assert_eq!(hits.len(), 5, "{name}");
            }
            times.sort();
        }
        let p50 = percentile(&timings[0], 0.5);
        println!(
            "| {name} | {n} | {:.1} s | {} | {} | {:.1} | {} | {} |",
            fill.as_secs_f64(),
            ms(p50),
            ms(percentile(&timings[0], 0.99)),
            p50.as_secs_f64() / floor_p50.as_secs_f64(),
            ms(percentile(&timings[1], 0.5)),
            ms(percentile(&timings[1], 0.99)),
        );
        let _ = std::io::stdout().flush();
    }
}
