//! toolfleet-worker-retrieval: the `retrieval:*` tools over the document
//! index, looked up by the `implementationKey` of their definition file.
//! tantivy and the PostgreSQL client live in this crate alone.
//!
//! - [`normalize`] and [`chunk`]: files to text, text to chunks that end
//!   at paragraph or sentence boundaries; [`ingest`]: files and JSON Lines
//!   into a store.
//! - [`store`]: the index as a trait, with two backends
//!   ([`tantivy_store`] on local disk, [`postgres_store`] shared, TLS to
//!   it from the URL's `sslmode` in [`postgres_tls`]), and
//!   [`model`]/[`search`]: what it holds and how it is asked.
//! - [`tools`]: the retrieval tools, scoped by the call's headers.
//! - [`IndexArgs`]: which store (command line and environment).
//! - [`RetrievalMetrics`]: the family's own metrics.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod analysis;
pub mod chunk;
mod conformance;
pub mod embed;
pub mod ingest;
pub mod model;
pub mod normalize;
pub mod postgres_store;
pub mod postgres_tls;
pub mod search;
pub mod store;
pub mod tantivy_store;
pub mod tools;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use prometheus::{Histogram, HistogramOpts, IntCounter};
use toolfleet_worker::{Worker, WorkerError};

use crate::ingest::{IngestOptions, Outcome};
use crate::store::Store;
use crate::tools::Retrieval;

/// The index backends.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// tantivy on local disk: one index per host, shared read-only by the
    /// host's retrieval workers (the default).
    Tantivy,
    /// PostgreSQL: one store for retrieval workers on many hosts.
    Postgres,
}

/// Which index, and what to fill an empty one with.
#[derive(clap::Args, Clone)]
pub struct IndexArgs {
    /// The index backend.
    #[arg(
        long = "store",
        env = "TOOLFLEET_STORE",
        value_enum,
        default_value = "tantivy"
    )]
    pub backend: Backend,
    /// Where the tantivy index lives (created when missing).
    #[arg(
        long,
        env = "TOOLFLEET_INDEX_DIR",
        default_value = "target/toolfleet-store"
    )]
    pub index_dir: PathBuf,
    /// The PostgreSQL URL (`--store postgres`); keep the password in the
    /// environment, not on a command line.
    #[arg(long, env = "TOOLFLEET_POSTGRES_URL", hide_env_values = true)]
    pub postgres_url: Option<String>,
    /// The prefix of the PostgreSQL tables (`<prefix>_documents`,
    /// `<prefix>_items`).
    #[arg(long, env = "TOOLFLEET_POSTGRES_PREFIX", default_value = "toolfleet")]
    pub postgres_prefix: String,
    /// Files ingested into an empty index at start (as data source
    /// --corpus-collection), so a fresh demo has something to find. Empty:
    /// none.
    // Not clap's path parser, which refuses the empty value the help
    // promises.
    #[arg(long, env = "TOOLFLEET_CORPUS_DIR", default_value = "examples/corpus",
          value_parser = parse_corpus_dir)]
    pub corpus_dir: PathBuf,
    /// The data source the start-up corpus belongs to.
    #[arg(long, env = "TOOLFLEET_CORPUS_COLLECTION", default_value = "handbook")]
    pub corpus_collection: String,
    /// The tenant the start-up corpus belongs to: only that tenant's jobs
    /// find it.
    #[arg(long, env = "TOOLFLEET_CORPUS_TENANT", default_value = "default")]
    pub corpus_tenant: String,
    /// An OpenAI-shaped embeddings endpoint (its API base, e.g.
    /// https://api.openai.com/v1): chunks are embedded at ingestion and
    /// search is hybrid (BM25 and vectors, fused by reciprocal rank).
    /// Unset: BM25 alone.
    #[arg(long, env = "TOOLFLEET_EMBEDDINGS_BASE_URL")]
    pub embeddings_base_url: Option<url::Url>,
    /// The embedding model.
    #[arg(
        long,
        env = "TOOLFLEET_EMBEDDINGS_MODEL",
        default_value = "text-embedding-3-small"
    )]
    pub embeddings_model: String,
    /// The embeddings API key (sent as a bearer token; never logged).
    #[arg(long, env = "TOOLFLEET_EMBEDDINGS_API_KEY", hide_env_values = true)]
    pub embeddings_api_key: Option<String>,
    /// Vector size to ask for (models that support `dimensions`).
    #[arg(long, env = "TOOLFLEET_EMBEDDINGS_DIMENSIONS")]
    pub embeddings_dimensions: Option<u32>,
}

/// `--corpus-dir`: any path, or empty for none.
fn parse_corpus_dir(value: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(value))
}

impl std::fmt::Debug for IndexArgs {
    /// The PostgreSQL URL (it may hold a password) and the embeddings key
    /// are never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |set: bool| if set { "[redacted]" } else { "none" };
        f.debug_struct("IndexArgs")
            .field("backend", &self.backend)
            .field("index_dir", &self.index_dir)
            .field("postgres_url", &redacted(self.postgres_url.is_some()))
            .field("postgres_prefix", &self.postgres_prefix)
            .field("corpus_dir", &self.corpus_dir)
            .field("corpus_collection", &self.corpus_collection)
            .field("corpus_tenant", &self.corpus_tenant)
            .field(
                "embeddings_base_url",
                &self.embeddings_base_url.as_ref().map(|u| u.as_str()),
            )
            .field("embeddings_model", &self.embeddings_model)
            .field(
                "embeddings_api_key",
                &redacted(self.embeddings_api_key.is_some()),
            )
            .field("embeddings_dimensions", &self.embeddings_dimensions)
            .finish()
    }
}

impl IndexArgs {
    /// A tantivy index in `index_dir`, filled from `corpus_dir` when empty.
    pub fn tantivy(index_dir: PathBuf, corpus_dir: PathBuf) -> Self {
        Self {
            backend: Backend::Tantivy,
            index_dir,
            postgres_url: None,
            postgres_prefix: "toolfleet".into(),
            corpus_dir,
            corpus_collection: "handbook".into(),
            corpus_tenant: toolfleet_worker::protocol::DEFAULT_TENANT.into(),
            embeddings_base_url: None,
            embeddings_model: "text-embedding-3-small".into(),
            embeddings_api_key: None,
            embeddings_dimensions: None,
        }
    }

    /// The embeddings client, when an endpoint is configured.
    ///
    /// # Errors
    ///
    /// When the client cannot be built.
    pub fn embedder(&self) -> Result<Option<embed::Embedder>, String> {
        let Some(base_url) = &self.embeddings_base_url else {
            return Ok(None);
        };
        embed::Embedder::new(embed::EmbedderConfig {
            base_url: base_url.clone(),
            model: self.embeddings_model.clone(),
            api_key: self.embeddings_api_key.clone(),
            dimensions: self.embeddings_dimensions,
            timeout: std::time::Duration::from_secs(30),
        })
        .map(Some)
        .map_err(|e| e.to_string())
    }
}

/// Opens the store `args` names.
///
/// # Errors
///
/// A message naming the store when it cannot be opened (never the
/// PostgreSQL password).
pub async fn open_store(args: &IndexArgs) -> Result<Arc<dyn Store>, String> {
    match args.backend {
        Backend::Tantivy => {
            std::fs::create_dir_all(&args.index_dir).map_err(|e| {
                format!(
                    "creating the index directory {}: {e}",
                    args.index_dir.display()
                )
            })?;
            let store = tantivy_store::TantivyStore::open(&args.index_dir)
                .map_err(|e| format!("the index at {}: {e}", args.index_dir.display()))?;
            Ok(Arc::new(store))
        }
        Backend::Postgres => {
            let url = args
                .postgres_url
                .as_deref()
                .ok_or("--store postgres needs --postgres-url (or TOOLFLEET_POSTGRES_URL)")?;
            let store = postgres_store::PostgresStore::connect(url, &args.postgres_prefix)
                .await
                .map_err(|e| e.to_string())?;
            match store.pgvector() {
                Some(version) => {
                    tracing::info!(pgvector = version, "vectors are searched in PostgreSQL");
                }
                None => {
                    tracing::info!("PostgreSQL has no pgvector: vectors are scored by this process")
                }
            }
            Ok(Arc::new(store))
        }
    }
}

/// Opens the store and, when its corpus tenant holds no document of the
/// corpus collection yet, ingests `corpus_dir` into it as that tenant's (a
/// missing corpus directory is not an error: the index simply starts
/// empty).
///
/// # Errors
///
/// As [`open_store`].
pub async fn open_and_seed(args: &IndexArgs) -> Result<Arc<dyn Store>, String> {
    let store = open_store(args).await?;
    if args.corpus_dir.as_os_str().is_empty() || !args.corpus_dir.is_dir() {
        return Ok(store);
    }
    let existing = store
        .list_documents(
            &args.corpus_tenant,
            std::slice::from_ref(&args.corpus_collection),
            &[],
            1,
        )
        .await
        .map_err(|e| e.to_string())?;
    if !existing.is_empty() {
        return Ok(store);
    }
    let options = IngestOptions {
        tenant: args.corpus_tenant.clone(),
        collection: args.corpus_collection.clone(),
        owner: model::Owner::default(),
        chunking: chunk::ChunkConfig::default(),
        max_file_bytes: ingest::DEFAULT_MAX_FILE_BYTES,
        allowed_roots: vec![args.corpus_dir.clone()],
        embedder: args.embedder()?,
    };
    let report = ingest::ingest(
        store.as_ref(),
        std::slice::from_ref(&args.corpus_dir),
        &options,
        &mut |file| {
            if let Outcome::Skipped(why) = &file.outcome {
                tracing::warn!(path = %file.path.display(), reason = %why, "corpus file skipped");
            }
        },
    )
    .await;
    tracing::info!(
        documents = report.documents(),
        chunks = report.chunks(),
        collection = %args.corpus_collection,
        tenant = %args.corpus_tenant,
        "start-up corpus ingested"
    );
    Ok(store)
}

/// The retrieval family's metrics (beside the worker runtime's).
#[derive(Clone)]
pub struct RetrievalMetrics {
    /// `toolfleet_retrieval_search_duration_seconds`: time in the index.
    pub search_duration: Histogram,
    /// `toolfleet_retrieval_passages_returned_total`.
    pub passages_returned: IntCounter,
}

impl RetrievalMetrics {
    /// Unregistered: the worker registers them on its process's registry.
    pub fn new() -> prometheus::Result<Self> {
        Ok(Self {
            search_duration: Histogram::with_opts(
                HistogramOpts::new(
                    "toolfleet_retrieval_search_duration_seconds",
                    "Time a search spends in the document index.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                ]),
            )?,
            passages_returned: IntCounter::new(
                "toolfleet_retrieval_passages_returned_total",
                "Passages (chunks, items) the retrieval tools returned, each cited.",
            )?,
        })
    }
}

/// The family name (the worker's name in the catalog and services API).
pub const FAMILY: &str = "retrieval";

/// The retrieval worker over `store`: every definition in `definitions`
/// whose `implementationKey` is one of this family's.
///
/// # Errors
///
/// [`WorkerError::Config`] when a definition is missing or invalid.
pub fn worker(
    definitions: &Path,
    store: Arc<dyn Store>,
    embedder: Option<embed::Embedder>,
) -> Result<Worker, WorkerError> {
    let metrics = RetrievalMetrics::new()
        .map_err(|e| WorkerError::Config(format!("retrieval metrics: {e}")))?;
    let probed = store.clone();
    let mut r = Retrieval::new(store).with_metrics(metrics.clone());
    if let Some(embedder) = embedder {
        r = r.with_embedder(embedder);
    }
    Worker::builder(FAMILY)
        .definitions_dir(definitions)
        .tool(
            "retrieval.search_documents",
            tools::SearchDocuments(r.clone()),
        )
        .tool("retrieval.list_documents", tools::ListDocuments(r.clone()))
        .tool("retrieval.read_document", tools::ReadDocument(r.clone()))
        .tool(
            "retrieval.read_tabular_data",
            tools::ReadTabularData(r.clone()),
        )
        .tool(
            "retrieval.search_data_sources",
            tools::SearchDataSources(r.clone()),
        )
        .tool(
            "retrieval.retrieve_knowledge_context",
            tools::RetrieveKnowledgeContext(r.clone()),
        )
        .tool(
            "retrieval.retrieve_event_context",
            tools::RetrieveEventContext(r.clone()),
        )
        .tool(
            "retrieval.retrieve_profile_context",
            tools::RetrieveProfileContext(r.clone()),
        )
        .tool("retrieval.entity_lookup", tools::EntityLookup(r))
        // `/readyz` asks the store (PostgreSQL: `SELECT 1` through the
        // pool), so a worker whose database is gone is taken out of rotation.
        .readiness("store", move || {
            let store = probed.clone();
            Box::pin(async move { store.ping().await.map_err(|e| e.to_string()) })
        })
        .metrics(metrics.search_duration)
        .metrics(metrics.passages_returned)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        index: IndexArgs,
    }

    async fn seeded(args: &[&str]) -> usize {
        let cli = Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let store = open_and_seed(&cli.index).await.unwrap();
        store
            .list_documents("default", &["handbook".to_owned()], &[], 100)
            .await
            .unwrap()
            .len()
    }

    /// `--corpus-dir ""` is accepted and means no corpus, as its help
    /// says (before: refused, "a value is required").
    #[tokio::test]
    async fn an_empty_corpus_dir_means_none() {
        let corpus = tempfile::tempdir().unwrap();
        std::fs::write(corpus.path().join("a.md"), "# Leave\n\nTwenty days a year.").unwrap();
        let corpus = corpus.path().to_str().unwrap();
        let index = tempfile::tempdir().unwrap();
        let index = index.path().to_str().unwrap();
        assert_eq!(seeded(&["--index-dir", index, "--corpus-dir", ""]).await, 0);
        let index2 = tempfile::tempdir().unwrap();
        let index2 = index2.path().to_str().unwrap();
        assert_eq!(
            seeded(&["--index-dir", index2, "--corpus-dir", corpus]).await,
            1
        );
    }
}
