//! toolfleet-worker-retrieval: the `retrieval:*` tools over the document
//! index, looked up by the `implementationKey` of their definition file.
//! tantivy lives in this crate alone.
//!
//! - [`index`]: the full-text index over a Markdown corpus.
//! - `retrieval.search_documents` ([`SearchDocuments`]): full-text search
//!   over the index, citing every passage it returns.
//! - [`IndexArgs`]: where the index is (command line and environment).
//! - [`RetrievalMetrics`]: the family's own metrics.

pub mod chunk;
mod conformance;
pub mod index;
pub mod ingest;
pub mod model;
pub mod normalize;
pub mod postgres_store;
pub mod search;
pub mod store;
pub mod tantivy_store;
pub mod tools;

use std::path::{Path, PathBuf};
use std::time::Instant;

use prometheus::{Histogram, HistogramOpts, IntGauge};

use serde::Deserialize;
use serde_json::json;
use toolfleet_worker::{NewReference, Tool, ToolCtx, ToolError, ToolOutput, Worker, WorkerError};

use crate::index::DocumentIndex;

/// Where the index is, and what to build it from when it is missing.
#[derive(clap::Args, Debug, Clone)]
pub struct IndexArgs {
    /// Where the index lives (built from --corpus-dir at start when missing).
    #[arg(
        long,
        env = "TOOLFLEET_INDEX_DIR",
        default_value = "target/toolfleet-index"
    )]
    pub index_dir: PathBuf,
    /// The corpus of Markdown files to index when the index is missing.
    #[arg(long, env = "TOOLFLEET_CORPUS_DIR", default_value = "examples/corpus")]
    pub corpus_dir: PathBuf,
}

/// The retrieval family's metrics (beside the worker runtime's).
#[derive(Clone)]
pub struct RetrievalMetrics {
    /// `toolfleet_retrieval_search_duration_seconds`: time in the index.
    pub search_duration: Histogram,
    /// `toolfleet_retrieval_index_passages`: passages in the open index.
    pub index_passages: IntGauge,
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
            index_passages: IntGauge::new(
                "toolfleet_retrieval_index_passages",
                "Passages in the document index this worker searches.",
            )?,
        })
    }
}

/// `retrieval.search_documents`.
pub struct SearchDocuments {
    index: DocumentIndex,
    metrics: Option<RetrievalMetrics>,
}

/// Results per search when the model does not say.
pub const DEFAULT_LIMIT: usize = 5;

impl SearchDocuments {
    pub fn new(index: DocumentIndex) -> Self {
        Self {
            index,
            metrics: None,
        }
    }

    /// Records search times in `metrics`.
    pub fn with_metrics(mut self, metrics: RetrievalMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }
}

/// Arguments of [`SearchDocuments`].
#[derive(Debug, Deserialize)]
pub struct SearchArgs {
    pub query: String,
    /// Passages to return; [`DEFAULT_LIMIT`] when absent.
    pub limit: Option<usize>,
}

impl Tool for SearchDocuments {
    type Args = SearchArgs;

    async fn call(&self, ctx: &ToolCtx, args: SearchArgs) -> Result<ToolOutput, ToolError> {
        {
            let query = args.query;
            let limit = args.limit.unwrap_or(DEFAULT_LIMIT);
            let index = self.index.clone();
            let q = query.clone();
            // Tantivy searches are CPU work: keep them off the runtime's
            // worker threads.
            let started = Instant::now();
            let hits = tokio::task::spawn_blocking(move || index.search(&q, limit))
                .await
                .map_err(|e| ToolError::transient(format!("search task failed: {e}")))?
                .map_err(|e| ToolError::failed(format!("search failed: {e}")))?;
            if let Some(m) = &self.metrics {
                m.search_duration.observe(started.elapsed().as_secs_f64());
            }
            if hits.is_empty() {
                return Ok(ToolOutput {
                    content: format!("No documents matched {query:?}."),
                    data: Some(json!({ "hits": [] })),
                });
            }
            let refs = hits
                .iter()
                .map(|h| NewReference {
                    kind: "document".into(),
                    title: h.title.clone(),
                    source: Some(h.source.clone()),
                    url: None,
                    snippet: Some(h.snippet.clone()),
                })
                .collect();
            let cited = ctx.cite(refs).await?;
            // One line per passage, led by its marker. The tool's
            // description tells the model to cite with these markers.
            let content = hits
                .iter()
                .zip(&cited)
                .map(|(h, r)| {
                    let section = h
                        .section
                        .as_deref()
                        .map(|s| format!(" › {s}"))
                        .unwrap_or_default();
                    format!("{} {}{section}: {}", r.marker(), h.title, h.snippet)
                })
                .collect::<Vec<_>>()
                .join("\n");
            Ok(ToolOutput {
                content,
                data: Some(
                    json!({ "hits": hits, "indices": cited.iter().map(|r| r.index).collect::<Vec<_>>() }),
                ),
            })
        }
    }
}

/// The family name (the worker's name in the catalog and services API).
pub const FAMILY: &str = "retrieval";

/// The retrieval worker over `index`: every definition in `definitions`
/// whose `implementationKey` is one of this family's.
///
/// # Errors
///
/// [`WorkerError::Config`] when a definition is missing or invalid.
pub fn worker(definitions: &Path, index: &DocumentIndex) -> Result<Worker, WorkerError> {
    let metrics = RetrievalMetrics::new()
        .map_err(|e| WorkerError::Config(format!("retrieval metrics: {e}")))?;
    metrics
        .index_passages
        .set(i64::try_from(index.stats().passages).unwrap_or(i64::MAX));
    Worker::builder(FAMILY)
        .definitions_dir(definitions)
        .tool(
            "retrieval.search_documents",
            SearchDocuments::new(index.clone()).with_metrics(metrics.clone()),
        )
        .metrics(metrics.search_duration)
        .metrics(metrics.index_passages)
        .build()
}

/// Opens the index at `index_dir`, building it from `corpus_dir` first when
/// it does not exist yet.
pub fn open_or_build_index(
    index_dir: &Path,
    corpus_dir: &Path,
) -> Result<DocumentIndex, index::IndexError> {
    if !index_dir.join("meta.json").exists() {
        let stats = DocumentIndex::build(corpus_dir, index_dir)?;
        tracing::info!(documents = stats.documents, passages = stats.passages, index = %index_dir.display(), "index built");
    }
    DocumentIndex::open(index_dir)
}
