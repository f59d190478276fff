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
//! the filter fields are indexed as raw terms. Every one carries its
//! `tenant` (a raw, fast term): every query has a clause on it, and a write
//! deletes by (tenant, id), never by id alone.
//!
//! The index lives in the `by-tenant` directory inside the configured one.
//! An index of an earlier release (its files right in the configured
//! directory, without the `tenant` field) is migrated when a store first
//! opens it: every item and document record, vectors included, is copied
//! into `by-tenant` as tenant [`DEFAULT_TENANT`] (the tenant of a job that
//! names none), under the old index's writer lock, then the old files are
//! deleted. Until the copy is complete nothing reads it, so a crash
//! mid-way leaves the old index, migrated again at the next open.

use std::collections::HashMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use tantivy::collector::{Count, DocSetCollector, TopDocs};
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
    DocAddress, Index, IndexReader, IndexWriter, Order, ReloadPolicy, Searcher, TantivyDocument,
    TantivyError, Term,
};
use toolfleet_worker::protocol::DEFAULT_TENANT;

use crate::analysis::{TOKENIZER, analyzer, sanitize_query, terms};
use crate::model::{Item, normalize_entity};
use crate::search::{Hit, MAX_TOP_K, Query, has_direction, similarity, top_k_by_score};
use crate::store::{DocumentRecord, DocumentSummary, Store, StoreError, check_tenant};

/// Memory for the single writer thread (tantivy's floor is 15 MB).
const WRITER_MEMORY_BYTES: usize = 50_000_000;
const TITLE_BOOST: f32 = 2.0;
const RECORD_ITEM: &str = "item";
const RECORD_DOC: &str = "doc";
/// The index's directory inside the configured one.
pub const INDEX_SUBDIR: &str = "by-tenant";
/// Where a migration builds the index before it becomes [`INDEX_SUBDIR`].
const MIGRATING_SUBDIR: &str = "by-tenant.migrating";

#[derive(Debug, Clone, Copy)]
struct Fields {
    id: Field,
    record: Field,
    /// The tenant the item or record belongs to: in every query.
    tenant: Field,
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
        tenant: b.add_text_field("tenant", STRING | FAST),
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

fn term_query(field: Field, value: &str) -> Box<dyn TantivyQuery> {
    Box::new(TermQuery::new(
        Term::from_field_text(field, value),
        IndexRecordOption::Basic,
    ))
}

/// Matches what `tenant` stored under `field = value` (and nothing of
/// another tenant's with the same id).
fn tenants_own(f: &Fields, tenant: &str, field: Field, value: &str) -> Box<dyn TantivyQuery> {
    Box::new(BooleanQuery::new(vec![
        (Occur::Must, term_query(f.tenant, tenant)),
        (Occur::Must, term_query(field, value)),
    ]))
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
    /// Opens the index in `dir` (its [`INDEX_SUBDIR`]), creating an empty
    /// one when there is none and migrating an earlier release's index
    /// found right in `dir` (see the module docs).
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the directory cannot be created or
    /// holds an index of another schema; [`StoreError::Busy`] when an
    /// earlier release's index must be migrated while another process
    /// writes it.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let unavailable =
            |e: std::io::Error| StoreError::Unavailable(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(unavailable)?;
        let path = dir.join(INDEX_SUBDIR);
        if !path.join("meta.json").is_file() && dir.join("meta.json").is_file() {
            migrate_pre_tenant(dir)?;
        }
        std::fs::create_dir_all(&path).map_err(unavailable)?;
        let (schema, fields) = schema();
        let directory = MmapDirectory::open(&path)
            .map_err(|e| StoreError::Unavailable(format!("{}: {e}", path.display())))?;
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
                path,
                index,
                reader,
                parser,
                fields,
                writer: Mutex::new(None),
            }),
        })
    }

    /// The directory of the index (the [`INDEX_SUBDIR`] of the one opened).
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

    fn item_doc(fields: &Fields, tenant: &str, item: &Item) -> Result<TantivyDocument, StoreError> {
        item.validate()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        let mut doc = TantivyDocument::default();
        doc.add_text(fields.id, &item.id);
        doc.add_text(fields.record, RECORD_ITEM);
        doc.add_text(fields.tenant, tenant);
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

    fn record_doc(
        fields: &Fields,
        tenant: &str,
        document: &DocumentRecord,
    ) -> Result<TantivyDocument, StoreError> {
        let mut doc = TantivyDocument::default();
        doc.add_text(fields.id, &document.id);
        doc.add_text(fields.record, RECORD_DOC);
        doc.add_text(fields.tenant, tenant);
        doc.add_text(fields.collection, &document.collection);
        doc.add_i64(fields.timestamp, document.timestamp_ms);
        let json =
            serde_json::to_string(&document).map_err(|e| StoreError::Engine(e.to_string()))?;
        doc.add_text(fields.payload, json);
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
        // The tenant first: never empty (checked), so never "any".
        one_of(f.tenant, vec![q.tenant.clone()]);
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
        check_tenant(&q.tenant)?;
        let top_k = q.top_k.min(MAX_TOP_K);
        if top_k == 0 {
            return Ok(Vec::new());
        }
        let inner = &*self.inner;
        let mut clauses = self.filters(q);
        let text = q.text.trim();
        let searcher = inner.reader.searcher();
        let addresses: Vec<(f32, DocAddress)> = if let Some(vector) = &q.vector {
            if !has_direction(vector) {
                return Ok(Vec::new());
            }
            clauses.push((Occur::Must, Box::new(AllQuery)));
            let matching = searcher
                .search(&BooleanQuery::new(clauses), &DocSetCollector)
                .map_err(engine("filtering"))?;
            let mut vectors = Vectors::new(&searcher, "vector");
            let mut scored = Vec::new();
            for address in matching {
                if let Some(score) = vectors
                    .read(address)?
                    .and_then(|candidate| similarity(vector, &candidate))
                {
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

    /// `tenant`'s document records matching `filters`, newest first.
    fn records(
        &self,
        tenant: &str,
        filters: Vec<(Occur, Box<dyn TantivyQuery>)>,
        limit: usize,
    ) -> Result<Vec<DocumentRecord>, StoreError> {
        check_tenant(tenant)?;
        let inner = &*self.inner;
        let searcher = inner.reader.searcher();
        let mut clauses = filters;
        clauses.push((Occur::Must, term_query(inner.fields.tenant, tenant)));
        clauses.push((Occur::Must, term_query(inner.fields.record, RECORD_DOC)));
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

    /// Every tenant with a live item or record: the tenant field's terms,
    /// each counted (a term of deleted documents only stays in the term
    /// dictionary until a merge).
    fn tenants_blocking(&self) -> Result<Vec<String>, StoreError> {
        let inner = &*self.inner;
        let searcher = inner.reader.searcher();
        let mut found = std::collections::BTreeSet::new();
        for segment in searcher.segment_readers() {
            let index = segment
                .inverted_index(inner.fields.tenant)
                .map_err(engine("reading tenants"))?;
            let mut stream = index
                .terms()
                .stream()
                .map_err(|e| StoreError::Engine(format!("reading tenants: {e}")))?;
            while stream.advance() {
                found.insert(String::from_utf8_lossy(stream.key()).into_owned());
            }
        }
        let mut live = Vec::with_capacity(found.len());
        for tenant in found {
            let count = searcher
                .search(&*term_query(inner.fields.tenant, &tenant), &Count)
                .map_err(engine("counting a tenant's documents"))?;
            if count > 0 {
                live.push(tenant);
            }
        }
        Ok(live)
    }
}

/// Reads stored vectors from the `vector` bytes column, one column
/// reader per segment.
struct Vectors<'s> {
    searcher: &'s Searcher,
    field: &'static str,
    columns: HashMap<u32, Option<tantivy::columnar::BytesColumn>>,
    bytes: Vec<u8>,
}

impl<'s> Vectors<'s> {
    fn new(searcher: &'s Searcher, field: &'static str) -> Self {
        Self {
            searcher,
            field,
            columns: HashMap::new(),
            bytes: Vec::new(),
        }
    }

    /// The vector stored for `address`, if it has one.
    fn read(&mut self, address: DocAddress) -> Result<Option<Vec<f32>>, StoreError> {
        let column = match self.columns.entry(address.segment_ord) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(
                self.searcher
                    .segment_reader(address.segment_ord)
                    .fast_fields()
                    .bytes(self.field)
                    .map_err(engine("reading vectors"))?,
            ),
        };
        let Some(column) = column.as_ref() else {
            return Ok(None);
        };
        let Some(ord) = column.term_ords(address.doc_id).next() else {
            return Ok(None);
        };
        self.bytes.clear();
        if !column
            .ord_to_bytes(ord, &mut self.bytes)
            .map_err(|e| StoreError::Engine(format!("reading a vector: {e}")))?
        {
            return Ok(None);
        }
        Ok(Some(
            self.bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
}

fn payload(doc: &TantivyDocument, field: Field) -> String {
    doc.get_first(field)
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Migrates the index of an earlier release in `dir` (no tenant field)
/// into `dir`'s [`INDEX_SUBDIR`] as tenant [`DEFAULT_TENANT`], then
/// deletes the old files. Holds the old index's writer lock throughout, so
/// two processes never migrate at once (the second finds the work done).
fn migrate_pre_tenant(dir: &Path) -> Result<(), StoreError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!(
            "migrating the index in {} to tenants ({what}): {e}",
            dir.display()
        ))
    };
    let old = Index::open_in_dir(dir).map_err(|e| failed("opening it", &e))?;
    if old.schema().get_field("tenant").is_ok() {
        return Err(failed(
            "reading it",
            &"it already has tenants; move it into by-tenant",
        ));
    }
    let lock: IndexWriter<TantivyDocument> = old.writer_with_num_threads(1, 15_000_000).map_err(
        |e| match e {
            TantivyError::LockFailure(..) => StoreError::Busy(format!(
                "the index in {} must be migrated to tenants, and another process is writing it; \
                 stop that process (or wait for its migration) and start again",
                dir.display()
            )),
            e => failed("locking it", &e),
        },
    )?;
    let target = dir.join(INDEX_SUBDIR);
    if target.join("meta.json").is_file() {
        // Another process migrated it while this one waited.
        return Ok(());
    }
    let building = dir.join(MIGRATING_SUBDIR);
    if building.exists() {
        std::fs::remove_dir_all(&building).map_err(|e| failed("clearing a crashed attempt", &e))?;
    }
    std::fs::create_dir_all(&building).map_err(|e| failed("creating its directory", &e))?;
    let copied = copy_as_default_tenant(&old, &building)?;
    std::fs::rename(&building, &target).map_err(|e| failed("moving it in place", &e))?;
    drop(lock);
    let managed = std::fs::read(dir.join(".managed.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<String>>(&b).ok())
        .unwrap_or_default();
    drop(old);
    // meta.json first: from then on nothing opens the old index.
    for file in std::iter::once("meta.json".to_owned()).chain(managed) {
        let _ = std::fs::remove_file(dir.join(&file));
    }
    let _ = std::fs::remove_file(dir.join(".managed.json"));
    tracing::warn!(
        index = %dir.display(),
        copied,
        tenant = DEFAULT_TENANT,
        "the document index of an earlier release was migrated to tenants: everything in it now belongs to the default tenant"
    );
    Ok(())
}

/// Copies every live item and record of `old` into a new index in `to`,
/// as tenant [`DEFAULT_TENANT`]. Returns how many.
fn copy_as_default_tenant(old: &Index, to: &Path) -> Result<usize, StoreError> {
    let (schema, fields) = schema();
    let index = Index::create_in_dir(to, schema).map_err(engine("creating the migrated index"))?;
    index.tokenizers().register(TOKENIZER, analyzer());
    let mut writer: IndexWriter<TantivyDocument> = index
        .writer_with_num_threads(1, WRITER_MEMORY_BYTES)
        .map_err(engine("opening the migrated index's writer"))?;
    let old_schema = old.schema();
    let field = |name: &str| {
        old_schema
            .get_field(name)
            .map_err(|e| StoreError::Engine(format!("the old index has no {name}: {e}")))
    };
    let (record, old_payload) = (field("record")?, field("payload")?);
    let searcher = old
        .reader()
        .map_err(engine("reading the old index"))?
        .searcher();
    let all = searcher
        .search(&AllQuery, &DocSetCollector)
        .map_err(engine("listing the old index"))?;
    // `record` is indexed, not stored: the document records are found by it.
    let records = searcher
        .search(&*term_query(record, RECORD_DOC), &DocSetCollector)
        .map_err(engine("listing the old index's document records"))?;
    let mut vectors = Vectors::new(&searcher, "vector");
    let unreadable =
        |e: serde_json::Error| StoreError::Engine(format!("an old entry is unreadable: {e}"));
    for address in &all {
        let doc: TantivyDocument = searcher.doc(*address).map_err(engine("reading"))?;
        let json = payload(&doc, old_payload);
        let copy = if records.contains(address) {
            let document: DocumentRecord = serde_json::from_str(&json).map_err(unreadable)?;
            TantivyStore::record_doc(&fields, DEFAULT_TENANT, &document)?
        } else {
            let mut item: Item = serde_json::from_str(&json).map_err(unreadable)?;
            item.embedding = vectors.read(*address)?;
            TantivyStore::item_doc(&fields, DEFAULT_TENANT, &item)?
        };
        writer
            .add_document(copy)
            .map_err(engine("copying an entry"))?;
    }
    writer
        .commit()
        .map_err(engine("committing the migrated index"))?;
    writer
        .wait_merging_threads()
        .map_err(engine("finishing the migrated index"))?;
    Ok(all.len())
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

    fn replace_documents<'a>(
        &'a self,
        tenant: &'a str,
        batch: Vec<(DocumentRecord, Vec<Item>)>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let this = self.clone();
        let tenant = tenant.to_owned();
        blocking(move || {
            check_tenant(&tenant)?;
            this.write(|writer, f| {
                for (document, chunks) in &batch {
                    // Only this tenant's: another's document of the same id
                    // stays.
                    for field in [f.document_id, f.id] {
                        writer
                            .delete_query(tenants_own(f, &tenant, field, &document.id))
                            .map_err(engine("deleting old chunks"))?;
                    }
                    for chunk in chunks {
                        if chunk.document_id.as_deref() != Some(document.id.as_str()) {
                            return Err(StoreError::Invalid(format!(
                                "chunk {} does not belong to document {}",
                                chunk.id, document.id
                            )));
                        }
                        writer
                            .add_document(Self::item_doc(f, &tenant, chunk)?)
                            .map_err(engine("adding a chunk"))?;
                    }
                    writer
                        .add_document(Self::record_doc(f, &tenant, document)?)
                        .map_err(engine("adding a document record"))?;
                }
                Ok(())
            })
        })
    }

    fn upsert_items<'a>(
        &'a self,
        tenant: &'a str,
        items: Vec<Item>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let this = self.clone();
        let tenant = tenant.to_owned();
        blocking(move || {
            check_tenant(&tenant)?;
            this.write(|writer, f| {
                for item in &items {
                    if item.document_id.is_some() {
                        return Err(StoreError::Invalid(format!(
                            "item {} is a document chunk: ingest its document instead",
                            item.id
                        )));
                    }
                    writer
                        .delete_query(tenants_own(f, &tenant, f.id, &item.id))
                        .map_err(engine("deleting an old item"))?;
                    writer
                        .add_document(Self::item_doc(f, &tenant, item)?)
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
        tenant: &'a str,
        collections: &'a [String],
        ids: &'a [String],
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<DocumentSummary>, StoreError>> {
        let this = self.clone();
        let (tenant, collections, ids) = (tenant.to_owned(), collections.to_vec(), ids.to_vec());
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
                .records(&tenant, filters, limit)?
                .into_iter()
                .map(DocumentSummary::from)
                .collect())
        })
    }

    fn document<'a>(
        &'a self,
        tenant: &'a str,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<DocumentRecord>, StoreError>> {
        let this = self.clone();
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        blocking(move || {
            let filter = term_query(this.inner.fields.id, &id);
            Ok(this
                .records(&tenant, vec![(Occur::Must, filter)], 1)?
                .into_iter()
                .next())
        })
    }

    fn tenants(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let this = self.clone();
        blocking(move || this.tenants_blocking())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{TENANT, chunk, query, record};

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
    async fn passes_the_store_suite_on_tenants() {
        let dir = tempfile::tempdir().unwrap();
        crate::conformance::tenants(&TantivyStore::open(dir.path()).unwrap()).await;
    }

    #[tokio::test]
    async fn no_tool_shows_acme_anything_of_globex() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(TantivyStore::open(dir.path()).unwrap());
        crate::tools::tenant_attack::run(store).await;
    }

    #[tokio::test]
    async fn a_second_writer_is_refused_as_busy_and_readers_see_commits() {
        let dir = tempfile::tempdir().unwrap();
        let writer = TantivyStore::open(dir.path()).unwrap();
        let reader = TantivyStore::open(dir.path()).unwrap();
        writer
            .replace_document(
                TENANT,
                record("ds:a", "ds"),
                vec![chunk("ds:a", 0, "lighthouse keepers")],
            )
            .await
            .unwrap();
        let error = reader
            .replace_document(TENANT, record("ds:b", "ds"), vec![])
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

    /// An index as the release before tenants wrote it: the same fields
    /// but `tenant`, its files right in `dir`.
    fn pre_tenant_index(dir: &Path, items: &[Item], records: &[DocumentRecord]) -> Index {
        let searchable = TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(TOKENIZER)
                .set_index_option(IndexRecordOption::WithFreqsAndPositions),
        );
        let mut b = Schema::builder();
        let id = b.add_text_field("id", STRING);
        let record = b.add_text_field("record", STRING);
        for name in [
            "kind",
            "collection",
            "document_id",
            "owner_user",
            "owner_device",
            "owner_agent",
            "level",
            "bucket",
            "entity",
        ] {
            b.add_text_field(name, STRING);
        }
        let title = b.add_text_field("title", searchable.clone());
        let text = b.add_text_field("text", searchable);
        let timestamp = b.add_i64_field("timestamp", INDEXED | FAST);
        let payload = b.add_text_field("payload", STORED);
        let vector = b.add_bytes_field("vector", FAST);
        let index = Index::create_in_dir(dir, b.build()).unwrap();
        index.tokenizers().register(TOKENIZER, analyzer());
        let mut writer: IndexWriter<TantivyDocument> = index.writer(15_000_000).unwrap();
        for item in items {
            let mut doc = TantivyDocument::default();
            doc.add_text(id, &item.id);
            doc.add_text(record, RECORD_ITEM);
            doc.add_text(title, &item.title);
            doc.add_text(text, &item.text);
            doc.add_i64(timestamp, item.timestamp_ms);
            if let Some(v) = &item.embedding {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                doc.add_bytes(vector, &bytes);
            }
            let stored = Item {
                embedding: None,
                ..item.clone()
            };
            doc.add_text(payload, serde_json::to_string(&stored).unwrap());
            writer.add_document(doc).unwrap();
        }
        for r in records {
            let mut doc = TantivyDocument::default();
            doc.add_text(id, &r.id);
            doc.add_text(record, RECORD_DOC);
            doc.add_i64(timestamp, r.timestamp_ms);
            doc.add_text(payload, serde_json::to_string(r).unwrap());
            writer.add_document(doc).unwrap();
        }
        writer.commit().unwrap();
        writer.wait_merging_threads().unwrap();
        index
    }

    #[tokio::test]
    async fn an_index_without_tenants_is_migrated_to_the_default_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let mut with_vector = chunk("ds:old.md", 0, "Old lighthouse keepers.");
        with_vector.embedding = Some(vec![0.0, 1.0]);
        drop(pre_tenant_index(
            dir.path(),
            &[with_vector, chunk("ds:old.md", 1, "Second part.")],
            &[record("ds:old.md", "ds")],
        ));
        // A crashed attempt's leftovers are cleared, not trusted.
        std::fs::create_dir_all(dir.path().join(MIGRATING_SUBDIR)).unwrap();
        std::fs::write(dir.path().join(MIGRATING_SUBDIR).join("meta.json"), "{").unwrap();

        // Another process writing the old index: the migration waits for it.
        let old = Index::open_in_dir(dir.path()).unwrap();
        let held: IndexWriter<TantivyDocument> = old.writer(15_000_000).unwrap();
        let error = TantivyStore::open(dir.path()).err().expect("busy");
        assert!(matches!(error, StoreError::Busy(_)), "{error}");
        assert!(error.to_string().contains("migrated to tenants"), "{error}");
        drop(held);
        drop(old);

        let store = TantivyStore::open(dir.path()).unwrap();
        assert_eq!(store.path(), dir.path().join(INDEX_SUBDIR));
        assert!(
            !dir.path().join("meta.json").exists(),
            "the old index is gone"
        );
        assert!(!dir.path().join(MIGRATING_SUBDIR).exists());
        let mut q = query("lighthouse keepers");
        q.tenant = DEFAULT_TENANT.into();
        let hits = store.search(&q).await.unwrap();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].item.id, "ds:old.md#0");
        q.text.clear();
        q.vector = Some(vec![0.0, 1.0]);
        let near = store.search(&q).await.unwrap();
        assert_eq!(near.len(), 1, "the vector came along");
        assert!(
            store
                .document(DEFAULT_TENANT, "ds:old.md")
                .await
                .unwrap()
                .is_some()
        );
        // Nothing of it belongs to any other tenant.
        assert!(store.search(&query("lighthouse")).await.unwrap().is_empty());
        assert!(store.document(TENANT, "ds:old.md").await.unwrap().is_none());
        assert_eq!(store.tenants().await.unwrap(), [DEFAULT_TENANT]);
        drop(store);
        // Opened again: nothing left to migrate, the same index.
        let again = TantivyStore::open(dir.path()).unwrap();
        let mut q = query("second part");
        q.tenant = DEFAULT_TENANT.into();
        assert_eq!(again.search(&q).await.unwrap().len(), 1);
    }
}
