//! The index behind the retrieval tools, as a trait with two backends:
//! tantivy on local disk (the embedded default) and PostgreSQL (for fleets
//! whose retrieval workers run on many hosts against one shared store).
//! Both pass the same conformance suite.
//!
//! A backend stores [`Item`]s and the [`DocumentRecord`] of every ingested
//! document (its normalised text, and its raw text for tabular data), and
//! answers [`Query`]s. Writes are atomic per document: a re-ingested file's
//! chunks replace the old ones in one commit or transaction, so a search
//! never sees half of each.
//!
//! Everything stored belongs to one tenant, given to every write, and every
//! read names its tenant ([`Query::tenant`], the `tenant` argument): a
//! backend keys items and documents by (tenant, id), so two tenants may use
//! the same ids, and never returns, replaces or deletes another tenant's.
//! The tenant is the invocation's (the tool job's `Toolfleet-Tenant`
//! header, which only the orchestrator writes), never a field of a job's
//! body; a read or write naming no valid tenant is refused
//! ([`StoreError::Invalid`]), never widened to all.

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::model::{Item, Owner};
use crate::search::{Hit, Query};

/// An ingested document, beside its chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DocumentRecord {
    /// Unique across the index: `<collection>:<path relative to the root>`.
    pub id: String,
    pub collection: String,
    pub title: String,
    /// The path it was read from, relative to the ingested root.
    pub source: String,
    /// `markdown`, `html`, `text` or `csv`.
    pub format: String,
    pub owner: Owner,
    /// The normalised text the chunks were cut from.
    pub text: String,
    /// The file as read, kept for formats a tool reads structurally (CSV).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
    /// The file's modification time (Unix ms).
    pub timestamp_ms: i64,
    pub ingested_ms: i64,
    pub chunks: u32,
    pub tokens: u64,
}

/// A document as listed (without its text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DocumentSummary {
    pub id: String,
    pub collection: String,
    pub title: String,
    pub source: String,
    pub format: String,
    #[serde(default)]
    pub owner: Owner,
    pub timestamp_ms: i64,
    pub chunks: u32,
    pub tokens: u64,
}

impl From<DocumentRecord> for DocumentSummary {
    fn from(d: DocumentRecord) -> Self {
        Self {
            id: d.id,
            collection: d.collection,
            title: d.title,
            source: d.source,
            format: d.format,
            owner: d.owner,
            timestamp_ms: d.timestamp_ms,
            chunks: d.chunks,
            tokens: d.tokens,
        }
    }
}

/// Errors of an index backend.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend cannot be reached or opened (a missing index directory,
    /// PostgreSQL down): an operator's problem, retried.
    #[error("the document index is unavailable: {0}")]
    Unavailable(String),
    /// Another process holds the index's single writer.
    #[error("another process is writing the document index ({0}); try again when it is done")]
    Busy(String),
    /// What was asked cannot be done (an invalid item, a bad filter).
    #[error("{0}")]
    Invalid(String),
    /// The backend failed mid-operation.
    #[error("the document index failed: {0}")]
    Engine(String),
}

/// One index backend. Methods are async so a network backend never blocks
/// a runtime thread; the disk backend runs its CPU work on the blocking
/// pool.
pub trait Store: Send + Sync {
    /// `tantivy` or `postgres`, for logs and metrics.
    fn backend(&self) -> &'static str;

    /// Replaces everything `tenant` has stored for `document.id` (record
    /// and chunks) with `document` and `chunks`, atomically.
    fn replace_document<'a>(
        &'a self,
        tenant: &'a str,
        document: DocumentRecord,
        chunks: Vec<Item>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.replace_documents(tenant, vec![(document, chunks)])
    }

    /// [`Store::replace_document`] for several documents in one commit
    /// (tantivy) or transaction (PostgreSQL): all of them or none, and a
    /// search never sees half of one. Ingestion batches files this way,
    /// since a commit costs far more than the documents in it.
    fn replace_documents<'a>(
        &'a self,
        tenant: &'a str,
        batch: Vec<(DocumentRecord, Vec<Item>)>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Inserts or replaces `tenant`'s context items (knowledge, events,
    /// entities, profiles) by id, atomically as a batch.
    fn upsert_items<'a>(
        &'a self,
        tenant: &'a str,
        items: Vec<Item>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Matches `query` among its tenant's items: by relevance when it has
    /// text, newest first when it has none. An empty result is not an
    /// error.
    fn search<'a>(&'a self, query: &'a Query) -> BoxFuture<'a, Result<Vec<Hit>, StoreError>>;

    /// `tenant`'s documents of `collections` or with `ids`, newest first,
    /// at most `limit`.
    fn list_documents<'a>(
        &'a self,
        tenant: &'a str,
        collections: &'a [String],
        ids: &'a [String],
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DocumentSummary>, StoreError>>;

    /// One of `tenant`'s document records, if stored.
    fn document<'a>(
        &'a self,
        tenant: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<DocumentRecord>, StoreError>>;

    /// Whether the backend answers, by its cheapest round trip (what the
    /// worker's `/readyz` asks). A local index is always there.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// The tenants that have anything stored, sorted (what `toolfleet
    /// ingest` checks before it picks a tenant by default).
    fn tenants(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;
}

/// Refuses a tenant that is not 1-64 of `[A-Za-z0-9_-]` (an empty one
/// above all: a read naming no tenant must never match every tenant's).
///
/// # Errors
///
/// [`StoreError::Invalid`] naming the value.
pub fn check_tenant(tenant: &str) -> Result<(), StoreError> {
    if toolfleet_worker::protocol::valid_tenant(tenant) {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "{tenant:?} is not a tenant (1-64 of A-Z, a-z, 0-9, _ and -); \
             every read and write of the document index names its tenant"
        )))
    }
}
