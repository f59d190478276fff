//! The embedded [`Store`] backend: one tantivy index on local disk.
//!
//! One process writes (`toolfleet ingest`; tantivy's lock file refuses a
//! second writer, reported as [`StoreError::Busy`]); every retrieval worker
//! of the host opens the same directory read-only and its reader reloads
//! on each commit, so new documents become searchable without a restart.
//! A document's record and its chunks are replaced in one commit: a reader
//! sees the old set or the new one, never a mix.
//!
//! Each stored tantivy document is either an item (`record = item`) or a
//! document record (`record = doc`); both keep their JSON in `payload`, and
//! the filter fields are indexed as raw terms.

use std::collections::HashMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use tantivy::collector::TopDocs;
use tantivy::directory::MmapDirectory;
use tantivy::query::{
    AllQuery, BooleanQuery, Occur, Query as TantivyQuery, QueryParser, RangeQuery, TermQuery,
    TermSetQuery,
};
use tantivy::schema::{
    FAST, Field, INDEXED, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing,
    TextOptions, Value,
};
use tantivy::{
    Index, IndexReader, IndexWriter, Order, ReloadPolicy, TantivyDocument, TantivyError, Term,
};

use crate::analysis::{TOKENIZER, analyzer, sanitize_query, terms};
use crate::model::{Item, normalize_entity};
use crate::search::{Hit, MAX_TOP_K, Query, has_direction, similarity, top_k_by_score};
use crate::store::{DocumentRecord, DocumentSummary, Store, StoreError};

/// Memory for the single writer thread (tantivy's floor is 15 MB).
const WRITER_MEMORY_BYTES: usize = 50_000_000;
const TITLE_BOOST: f32 = 2.0;
const RECORD_ITEM: &str = "item";
const RECORD_DOC: &str = "doc";

#[derive(Debug, Clone, Copy)]
struct Fields {
    id: Field,
    record: Field,
    kind: Field,
    collection: Field,
    document_id: Field,
    owner_user: Field,
    owner_device: Field,
    owner_agent: Field,
    level: Field,
    bucket: Field,
    entity: Field,
    title: Field,
    text: Field,
    timestamp: Field,
    payload: Field,
    /// The embedding as little-endian `f32`s, in a fast column so a vector
    /// search reads it without loading documents.
    vector: Field,
}

fn schema() -> (Schema, Fields) {
    let searchable = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer(TOKENIZER)
            .set_index_option(IndexRecordOption::WithFreqsAndPositions),
    );
    let mut b = Schema::builder();
    let fields = Fields {
        id: b.add_text_field("id", STRING),
        record: b.add_text_field("record", STRING),
        kind: b.add_text_field("kind", STRING),
        collection: b.add_text_field("collection", STRING),
        document_id: b.add_text_field("document_id", STRING),
        owner_user: b.add_text_field("owner_user", STRING),
        owner_device: b.add_text_field("owner_device", STRING),
        owner_agent: b.add_text_field("owner_agent", STRING),
        level: b.add_text_field("level", STRING),
        bucket: b.add_text_field("bucket", STRING),
        entity: b.add_text_field("entity", STRING),
        title: b.add_text_field("title", searchable.clone()),
        text: b.add_text_field("text", searchable),
        timestamp: b.add_i64_field("timestamp", INDEXED | FAST),
        payload: b.add_text_field("payload", STORED),
        vector: b.add_bytes_field("vector", FAST),
    };
    (b.build(), fields)
}

fn engine(action: &'static str) -> impl FnOnce(TantivyError) -> StoreError {
    move |e| match e {
        TantivyError::LockFailure(..) => StoreError::Busy(e.to_string()),
        e => StoreError::Engine(format!("{action}: {e}")),
    }
}

/// The tantivy backend. Cheap to clone.
#[derive(Clone)]
pub struct TantivyStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    index: Index,
    reader: IndexReader,
    parser: QueryParser,
    fields: Fields,
    /// Taken on the first write: a reading worker never holds the lock.
    writer: Mutex<Option<IndexWriter>>,
}

impl TantivyStore {
    /// Opens the index in `dir`, creating an empty one when the directory
    /// holds none.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the directory cannot be created or
    /// holds an index of another schema.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Unavailable(format!("{}: {e}", dir.display())))?;
        let (schema, fields) = schema();
        let directory = MmapDirectory::open(dir)
            .map_err(|e| StoreError::Unavailable(format!("{}: {e}", dir.display())))?;
        let index = Index::open_or_create(directory, schema).map_err(|e| {
            StoreError::Unavailable(format!(
                "{} does not hold a toolfleet document index of this version ({e}); ingest into a new directory",
                dir.display()
            ))
        })?;
        index.tokenizers().register(TOKENIZER, analyzer());
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::OnCommitWithDelay)
            .try_into()
            .map_err(engine("opening a reader"))?;
        let mut parser = QueryParser::for_index(&index, vec![fields.title, fields.text]);
        parser.set_field_boost(fields.title, TITLE_BOOST);
        Ok(Self {
            inner: Arc::new(Inner {
                path: dir.to_path_buf(),
                index,
                reader,
                parser,
                fields,
                writer: Mutex::new(None),
            }),
        })
    }

    /// The directory of the index.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` with the writer (opened on first use), then commits and
    /// reloads the reader, so this process reads its own writes at once.
    fn write(
        &self,
        f: impl FnOnce(&mut IndexWriter, &Fields) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let mut guard = inner
            .writer
            .lock()
            .map_err(|_| StoreError::Engine("a writer panicked".into()))?;
        if guard.is_none() {
            *guard = Some(
                inner
                    .index
                    .writer_with_num_threads(1, WRITER_MEMORY_BYTES)
                    .map_err(engine("opening the writer"))?,
            );
        }
        let Some(writer) = guard.as_mut() else {
            return Err(StoreError::Engine("no writer".into()));
        };
        if let Err(e) = f(writer, &inner.fields) {
            writer.rollback().map_err(engine("rolling back"))?;
            return Err(e);
        }
        writer.commit().map_err(engine("committing"))?;
        inner.reader.reload().map_err(engine("reloading"))?;
        Ok(())
    }

    fn item_doc(fields: &Fields, item: &Item) -> Result<TantivyDocument, StoreError> {
        item.validate()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        let mut doc = TantivyDocument::default();
        doc.add_text(fields.id, &item.id);
        doc.add_text(fields.record, RECORD_ITEM);
        doc.add_text(fields.kind, item.kind.as_str());
        doc.add_text(fields.collection, &item.collection);
        if let Some(d) = &item.document_id {
            doc.add_text(fields.document_id, d);
        }
        let owner = &item.owner;
        for (field, value) in [
            (fields.owner_user, &owner.user),
            (fields.owner_device, &owner.device),
            (fields.owner_agent, &owner.agent),
        ] {
            if let Some(v) = value {
                doc.add_text(field, v);
            }
        }
        if let Some(level) = item.level {
            doc.add_text(fields.level, format!("L{}", level.number()));
            if let Some(b) = item.buckets() {
                doc.add_text(fields.bucket, b.key(level));
            }
        }
        for e in &item.entities {
            doc.add_text(fields.entity, normalize_entity(e));
        }
        doc.add_text(fields.title, &item.title);
        doc.add_text(fields.text, &item.text);
        doc.add_i64(fields.timestamp, item.timestamp_ms);
        if let Some(v) = &item.embedding {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            doc.add_bytes(fields.vector, &bytes);
        }
        // The vector lives in its column; the payload stays small.
        let stored = Item {
            embedding: None,
            ..item.clone()
        };
        let payload =
            serde_json::to_string(&stored).map_err(|e| StoreError::Engine(e.to_string()))?;
        doc.add_text(fields.payload, payload);
        Ok(doc)
    }

    fn filters(&self, q: &Query) -> Vec<(Occur, Box<dyn TantivyQuery>)> {
        let f = &self.inner.fields;
        let mut out: Vec<(Occur, Box<dyn TantivyQuery>)> = Vec::new();
        let mut one_of = |field: Field, values: Vec<String>| {
            if !values.is_empty() {
                let terms = values.iter().map(|v| Term::from_field_text(field, v));
                out.push((Occur::Must, Box::new(TermSetQuery::new(terms))));
            }
        };
        one_of(f.record, vec![RECORD_ITEM.to_owned()]);
        one_of(
            f.kind,
            q.kinds.iter().map(|k| k.as_str().to_owned()).collect(),
        );
        one_of(f.collection, q.collections.clone());
        one_of(f.document_id, q.documents.clone());
        one_of(f.id, q.ids.clone());
        one_of(
            f.level,
            q.levels
                .iter()
                .map(|l| format!("L{}", l.number()))
                .collect(),
        );
        one_of(f.bucket, q.buckets.clone());
        for (field, value) in [
            (f.owner_user, &q.owner.user),
            (f.owner_device, &q.owner.device),
            (f.owner_agent, &q.owner.agent),
        ] {
            if let Some(v) = value {
                one_of(field, vec![v.clone()]);
            }
        }
        // Every entity must be mentioned: one clause each.
        for e in &q.entities {
            one_of(f.entity, vec![normalize_entity(e)]);
        }
        if q.time.from_ms.is_some() || q.time.to_ms.is_some() {
            let bound = |b: Option<i64>| match b {
                Some(ms) => Bound::Included(Term::from_field_i64(f.timestamp, ms)),
                None => Bound::Unbounded,
            };
            out.push((
                Occur::Must,
                Box::new(RangeQuery::new(bound(q.time.from_ms), bound(q.time.to_ms))),
            ));
        }
        out
    }

    fn search_blocking(&self, q: &Query) -> Result<Vec<Hit>, StoreError> {
        let top_k = q.top_k.min(MAX_TOP_K);
        if top_k == 0 {
            return Ok(Vec::new());
        }
        let inner = &*self.inner;
        let mut clauses = self.filters(q);
        let text = q.text.trim();
        let searcher = inner.reader.searcher();
        let addresses: Vec<(f32, tantivy::DocAddress)> = if let Some(vector) = &q.vector {
            if !has_direction(vector) {
                return Ok(Vec::new());
            }
            clauses.push((Occur::Must, Box::new(AllQuery)));
            let query = BooleanQuery::new(clauses);
            let matching = searcher
                .search(&query, &tantivy::collector::DocSetCollector)
                .map_err(engine("filtering"))?;
            let mut columns = HashMap::new();
            let mut bytes = Vec::new();
            let mut scored = Vec::new();
            for address in matching {
                let column = match columns.entry(address.segment_ord) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(
                        searcher
                            .segment_reader(address.segment_ord)
                            .fast_fields()
                            .bytes("vector")
                            .map_err(engine("reading vectors"))?,
                    ),
                };
                let Some(column) = column.as_ref() else {
                    continue;
                };
                let Some(ord) = column.term_ords(address.doc_id).next() else {
                    continue;
                };
                bytes.clear();
                if !column
                    .ord_to_bytes(ord, &mut bytes)
                    .map_err(|e| StoreError::Engine(format!("reading a vector: {e}")))?
                {
                    continue;
                }
                let candidate: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                if let Some(score) = similarity(vector, &candidate) {
                    scored.push((score, address));
                }
            }
            top_k_by_score(scored, top_k)
        } else if text.is_empty() {
            clauses.push((Occur::Must, Box::new(AllQuery)));
            let query = BooleanQuery::new(clauses);
            searcher
                .search(
                    &query,
                    &TopDocs::with_limit(top_k)
                        .order_by_fast_field::<i64>("timestamp", Order::Desc),
                )
                .map_err(engine("listing"))?
                .into_iter()
                .map(|(_, address)| (0.0, address))
                .collect()
        } else {
            let cleaned = sanitize_query(text);
            let mut analyzer = analyzer();
            if terms(&mut analyzer, &cleaned).is_empty() {
                // Only stop words or punctuation: nothing to look for.
                return Ok(Vec::new());
            }
            let (parsed, _ignored) = inner.parser.parse_query_lenient(&cleaned);
            clauses.push((Occur::Must, parsed));
            let query = BooleanQuery::new(clauses);
            searcher
                .search(&query, &TopDocs::with_limit(top_k).order_by_score())
                .map_err(engine("searching"))?
        };
        addresses
            .into_iter()
            .map(|(score, address)| {
                let doc: TantivyDocument = searcher.doc(address).map_err(engine("reading"))?;
                let item: Item = serde_json::from_str(&payload(&doc, inner.fields.payload))
                    .map_err(|e| StoreError::Engine(format!("a stored item is unreadable: {e}")))?;
                Ok(Hit { item, score })
            })
            .collect()
    }

    fn records(
        &self,
        filters: Vec<(Occur, Box<dyn TantivyQuery>)>,
        limit: usize,
    ) -> Result<Vec<DocumentRecord>, StoreError> {
        let inner = &*self.inner;
        let searcher = inner.reader.searcher();
        let mut clauses = filters;
        clauses.push((
            Occur::Must,
            Box::new(TermQuery::new(
                Term::from_field_text(inner.fields.record, RECORD_DOC),
                IndexRecordOption::Basic,
            )),
        ));
        let top = searcher
            .search(
                &BooleanQuery::new(clauses),
                &TopDocs::with_limit(limit.max(1))
                    .order_by_fast_field::<i64>("timestamp", Order::Desc),
            )
            .map_err(engine("listing documents"))?;
        top.into_iter()
            .map(|(_, address)| {
                let doc: TantivyDocument = searcher.doc(address).map_err(engine("reading"))?;
                serde_json::from_str(&payload(&doc, inner.fields.payload)).map_err(|e| {
                    StoreError::Engine(format!("a stored document record is unreadable: {e}"))
                })
            })
            .collect()
    }
}

fn payload(doc: &TantivyDocument, field: Field) -> String {
    doc.get_first(field)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Runs blocking index work off the runtime's threads.
fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> BoxFuture<'static, Result<T, StoreError>> {
    async move {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| StoreError::Engine(format!("index task failed: {e}")))?
    }
    .boxed()
}

impl Store for TantivyStore {
    fn backend(&self) -> &'static str {
        "tantivy"
    }

    fn replace_documents(
        &self,
        batch: Vec<(DocumentRecord, Vec<Item>)>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let this = self.clone();
        blocking(move || {
            this.write(|writer, f| {
                for (document, chunks) in &batch {
                    writer.delete_term(Term::from_field_text(f.document_id, &document.id));
                    writer.delete_term(Term::from_field_text(f.id, &document.id));
                    for chunk in chunks {
                        if chunk.document_id.as_deref() != Some(document.id.as_str()) {
                            return Err(StoreError::Invalid(format!(
                                "chunk {} does not belong to document {}",
                                chunk.id, document.id
                            )));
                        }
                        writer
                            .add_document(Self::item_doc(f, chunk)?)
                            .map_err(engine("adding a chunk"))?;
                    }
                    let mut doc = TantivyDocument::default();
                    doc.add_text(f.id, &document.id);
                    doc.add_text(f.record, RECORD_DOC);
                    doc.add_text(f.collection, &document.collection);
                    doc.add_i64(f.timestamp, document.timestamp_ms);
                    let json = serde_json::to_string(&document)
                        .map_err(|e| StoreError::Engine(e.to_string()))?;
                    doc.add_text(f.payload, json);
                    writer
                        .add_document(doc)
                        .map_err(engine("adding a document record"))?;
                }
                Ok(())
            })
        })
    }

    fn upsert_items(&self, items: Vec<Item>) -> BoxFuture<'_, Result<(), StoreError>> {
        let this = self.clone();
        blocking(move || {
            this.write(|writer, f| {
                for item in &items {
                    if item.document_id.is_some() {
                        return Err(StoreError::Invalid(format!(
                            "item {} is a document chunk: ingest its document instead",
                            item.id
                        )));
                    }
                    writer.delete_term(Term::from_field_text(f.id, &item.id));
                    writer
                        .add_document(Self::item_doc(f, item)?)
                        .map_err(engine("adding an item"))?;
                }
                Ok(())
            })
        })
    }

    fn search<'a>(&'a self, query: &'a Query) -> BoxFuture<'a, Result<Vec<Hit>, StoreError>> {
        let this = self.clone();
        let query = query.clone();
        blocking(move || this.search_blocking(&query))
    }

    fn list_documents<'a>(
        &'a self,
        collections: &'a [String],
        ids: &'a [String],
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DocumentSummary>, StoreError>> {
        let this = self.clone();
        let (collections, ids) = (collections.to_vec(), ids.to_vec());
        blocking(move || {
            let f = this.inner.fields;
            let mut filters: Vec<(Occur, Box<dyn TantivyQuery>)> = Vec::new();
            for (field, values) in [(f.collection, &collections), (f.id, &ids)] {
                if !values.is_empty() {
                    let terms = values.iter().map(|v| Term::from_field_text(field, v));
                    filters.push((Occur::Must, Box::new(TermSetQuery::new(terms))));
                }
            }
            Ok(this
                .records(filters, limit)?
                .into_iter()
                .map(DocumentSummary::from)
                .collect())
        })
    }

    fn document<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<DocumentRecord>, StoreError>> {
        let this = self.clone();
        let id = id.to_owned();
        blocking(move || {
            let f = this.inner.fields;
            let filter: Box<dyn TantivyQuery> = Box::new(TermQuery::new(
                Term::from_field_text(f.id, &id),
                IndexRecordOption::Basic,
            ));
            Ok(this
                .records(vec![(Occur::Must, filter)], 1)?
                .into_iter()
                .next())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{chunk, query, record};

    #[tokio::test]
    async fn passes_the_store_suite_on_documents() {
        let dir = tempfile::tempdir().unwrap();
        crate::conformance::documents(&TantivyStore::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn passes_the_store_suite_on_context_items() {
        let dir = tempfile::tempdir().unwrap();
        crate::conformance::context_items(&TantivyStore::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn passes_the_store_suite_on_vectors() {
        let dir = tempfile::tempdir().unwrap();
        crate::conformance::vectors(&TantivyStore::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn a_second_writer_is_refused_as_busy_and_readers_see_commits() {
        let dir = tempfile::tempdir().unwrap();
        let writer = TantivyStore::open(dir.path()).unwrap();
        let reader = TantivyStore::open(dir.path()).unwrap();
        writer
            .replace_document(
                record("ds:a", "ds"),
                vec![chunk("ds:a", 0, "lighthouse keepers")],
            )
            .await
            .unwrap();
        let error = reader
            .replace_document(record("ds:b", "ds"), vec![])
            .await
            .unwrap_err();
        assert!(matches!(error, StoreError::Busy(_)), "{error}");
        // The reader reloads on commit (with a short delay).
        let mut found = false;
        for _ in 0..100 {
            if !reader
                .search(&query("lighthouse"))
                .await
                .unwrap()
                .is_empty()
            {
                found = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(found, "the second handle never saw the commit");
    }
}
